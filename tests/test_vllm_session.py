"""The vLLM client's update session and pause, whatever fails after the pause.

Unit tests drive ``apply_to_engine`` against a fake engine that keeps vLLM 0.32's session rules
(``start`` refuses while a session is open, ``finish`` refuses without one, an update that raises
closes the session) and dcr's rank state, with failures injected where a real engine cannot be
made to fail on cue. The real in-process vLLM engine then shows an interrupted client's retry
ending bit-identical to a fresh engine, and a failed finish that a re-run completes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import require_or_skip

from dcr_cli.cli.common import exit_code_of
from dcr_cli.errors import EXIT_BAD_INPUT, EXIT_INTERNAL, DcrError, IntegrityError
from dcr_cli.receive.vllm import client
from dcr_cli.receive.vllm.client import EngineInternalError, apply_to_engine

VECTOR = Path(__file__).resolve().parents[1] / "format_spec" / "vectors" / "basic-v2" / "delta"
TARGET = client.Delta.open(str(VECTOR)).manifest.target.version
TARGET_FP = client.Delta.open(str(VECTOR)).manifest.target.fingerprint


class FakeEngine(client.Engine):
    """Two ranks; ``fail`` names the step that raises (once, unless ``always``)."""

    def __init__(self, fail: str | None = None, *, always: bool = False, ranks: int = 2) -> None:
        self.fail, self.always = fail, always
        self.ranks = ranks
        self.session = False
        self.paused = False
        self.version: str | None = None
        self.applying = [False] * ranks
        self.at_target = False
        self.last_error: list[str | None] = [None] * ranks
        self.last_error_kind: list[str | None] = [None] * ranks
        self.last_report: dict[str, Any] | None = None
        self.calls: list[str] = []
        self.mode = "apply"

    def _maybe_fail(self, step: str) -> None:
        if self.fail == step:
            if not self.always:
                self.fail = None
            raise DcrError(f"http://x/{step} answered HTTP 500: Internal Server Error")

    def _status(self, rank: int) -> dict[str, Any]:
        return {
            "ok": True,
            "state": {
                "applying": {"delta_id": "d"} if self.applying[rank] else None,
                "version": self.version,
                "fingerprint": TARGET_FP if self.at_target else None,
            },
            "last_report": self.last_report,
            "last_error": self.last_error[rank],
            "last_error_kind": self.last_error_kind[rank],
            "session_open": self.session,
        }

    def rpc(self, op: str, **args: Any) -> list[dict[str, Any]]:
        if op in ("claim", "release"):  # the engine's claim (backend.py); test_vllm_claim.py covers it
            assert self.token
            return [{"ok": True, "claimed": True}] * self.ranks
        self.calls.append(op)
        self._maybe_fail(op)
        if op == "prepare":
            return [{"ok": True, "mode": self.mode, "session_open": self.session}] * self.ranks
        assert op == "status"
        return [self._status(r) for r in range(self.ranks)]

    def pause(self) -> None:
        self.calls.append("pause")
        self._maybe_fail("pause")
        self.paused = True
        self._maybe_fail("pause-reply")  # the engine paused; its reply was lost

    def resume(self) -> None:
        self.calls.append("resume")
        self._maybe_fail("resume")
        self.paused = False

    def start(self) -> None:
        self.calls.append("start")
        if self.session:  # vLLM's worker: a RuntimeError, an HTTP 500 without detail on the server
            raise DcrError("http://x/start_weight_update answered HTTP 500: Internal Server Error")
        self._maybe_fail("start")
        self.session = True
        self.last_error = [None] * self.ranks
        self.last_report = None

    def update(self, location: str) -> None:
        self.calls.append("update")
        assert self.session
        if self.fail == "refuse":  # recorded on every rank, before any write (dcr's backend never raises)
            self.last_error = ["tensor x is missing"] * self.ranks
            self.last_error_kind = ["IntegrityError"] * self.ranks
            return
        if self.fail == "bug":  # rank 1 raised something that is not a DcrError; rank 0 got its failure
            self.last_error = ["rank 1: ValueError: bad shape", "rank 1: ValueError: bad shape"]
            self.last_error_kind = ["DcrError", "internal"]
            return
        if self.fail == "torn":  # rank 0 wrote part of the delta, then the connection dropped
            self.applying[0] = True
            raise DcrError("cannot reach the vLLM server at http://x (timed out); is it running?")
        self.applying = [False] * self.ranks
        self.version, self.at_target = TARGET, True
        self.last_report = {"status": "applied", "applied": 3}
        if self.fail == "update-reply":  # the update ran to completion; its reply was lost
            self.fail = None
            raise DcrError("cannot reach the vLLM server at http://x (timed out); is it running?")

    def finish(self, version: str | None) -> None:
        self.calls.append(f"finish({version})")
        if not self.session:
            raise DcrError("http://x/finish_weight_update answered HTTP 500: Internal Server Error")
        self._maybe_fail("finish" if version is not None else "finish-none")
        self.session = False
        if version is not None:
            self.stamped = version

    def reset_prefix_cache(self) -> None:
        self.calls.append("reset")

    def set_version(self, version: str) -> None:
        self.calls.append("set_version")
        self.stamped = version


def test_a_clean_apply_opens_and_closes_one_session_and_resumes() -> None:
    engine = FakeEngine()
    report = apply_to_engine(engine, VECTOR)
    assert report["status"] == "applied"
    assert engine.calls == ["prepare", "pause", "start", "update", "status", f"finish({TARGET})", "reset", "resume"]
    assert not engine.session and not engine.paused and engine.stamped == TARGET


def test_a_session_left_open_by_an_interrupted_client_is_closed_without_a_version_and_the_retry_succeeds() -> None:
    engine = FakeEngine()
    engine.session = True  # a client was interrupted after start (Ctrl-C, a dropped connection)
    report = apply_to_engine(engine, VECTOR)
    assert report["status"] == "applied"
    # start is refused (HTTP 500 without a reason); status says the session is open; it is closed
    # without stamping a version, and a new one is started.
    assert engine.calls[:6] == ["prepare", "pause", "start", "status", "finish(None)", "start"], engine.calls
    assert not engine.session and not engine.paused and engine.stamped == TARGET
    assert apply_to_engine(engine, VECTOR)["status"] == "applied"  # and the next one too


def test_start_failing_for_another_reason_resumes_and_says_so() -> None:
    engine = FakeEngine("start")
    with pytest.raises(DcrError, match=r"starting the weight update failed: .*HTTP 500.*nothing was written"):
        apply_to_engine(engine, VECTOR)
    assert not engine.paused and not engine.session


@pytest.mark.parametrize("fail", ["pause", "pause-reply"])
def test_a_failing_pause_resumes_the_engine_and_says_nothing_was_written(fail: str) -> None:
    engine = FakeEngine(fail)
    with pytest.raises(DcrError, match=r"pausing the engine failed: .*HTTP 500.*nothing was written"):
        apply_to_engine(engine, VECTOR)
    assert not engine.paused and not engine.session and "update" not in engine.calls
    apply_to_engine(engine, VECTOR)  # the retry applies
    assert not engine.paused and engine.stamped == TARGET


def test_a_refusal_recorded_by_the_ranks_closes_the_session_resumes_and_keeps_its_class() -> None:
    engine = FakeEngine("refuse")
    with pytest.raises(IntegrityError, match=r"vLLM engine: tensor x is missing; nothing was written"):
        apply_to_engine(engine, VECTOR)
    assert "finish(None)" in engine.calls and not engine.session and not engine.paused


def test_a_failing_session_close_after_a_refusal_keeps_the_ranks_reason_and_says_the_engine_is_paused() -> None:
    engine = FakeEngine("refuse")

    def finish(version: str | None) -> None:
        engine.calls.append(f"finish({version})")
        raise DcrError("http://x/finish_weight_update answered HTTP 500: boom")

    engine.finish = finish  # type: ignore[method-assign]
    with pytest.raises(DcrError) as info:
        apply_to_engine(engine, VECTOR)
    message = str(info.value)
    assert "tensor x is missing" in message and "closing the update session failed" in message
    assert "left paused" in message and "re-run the same command" in message
    assert engine.paused


def test_a_rank_bug_is_an_internal_error_with_the_ranks_message() -> None:
    engine = FakeEngine("bug")
    with pytest.raises(EngineInternalError, match=r"rank 1: ValueError: bad shape") as info:
        apply_to_engine(engine, VECTOR)
    code, line = exit_code_of(info.value)
    assert code == EXIT_INTERNAL and "internal error" in line and "rank 1: ValueError: bad shape" in line
    assert not engine.paused  # nothing was written


def test_a_rank_bug_in_an_rpc_answer_wins_over_the_other_ranks_echo() -> None:
    with pytest.raises(EngineInternalError, match="rank 1: KeyError"):
        client._answers(
            [
                {"ok": False, "error": "rank 1: KeyError: 'x'", "kind": "DcrError"},
                {"ok": False, "error": "rank 1: KeyError: 'x'", "kind": "internal"},
            ]
        )
    with pytest.raises(IntegrityError):
        client._answers([{"ok": True}, {"ok": False, "error": "bad block", "kind": "IntegrityError"}])


def test_status_failing_after_the_update_says_the_engine_may_be_paused() -> None:
    engine = FakeEngine("status", always=True)
    with pytest.raises(DcrError) as info:
        apply_to_engine(engine, VECTOR)
    assert type(info.value) is DcrError and exit_code_of(info.value)[0] == EXIT_BAD_INPUT
    message = str(info.value)
    assert "status after the update failed" in message and "may be left paused" in message
    assert "re-run the same command" in message
    assert f"finish({TARGET})" not in engine.calls  # never stamped without every rank's status


def test_an_update_that_drops_its_connection_after_writing_leaves_the_engine_paused_and_says_so() -> None:
    engine = FakeEngine("torn")
    with pytest.raises(DcrError) as info:
        apply_to_engine(engine, VECTOR)
    message = str(info.value)
    assert "cannot reach the vLLM server" in message and "1 of 2 ranks applying" in message
    assert "left paused" in message and "re-run the same command" in message
    assert engine.paused and "resume" not in engine.calls
    assert "finish(None)" in engine.calls and not engine.session  # the session is closed for the retry
    engine.fail = None
    assert apply_to_engine(engine, VECTOR)["status"] == "applied"
    assert not engine.paused and engine.stamped == TARGET


def test_an_update_whose_reply_was_lost_but_that_completed_on_every_rank_finishes() -> None:
    engine = FakeEngine("update-reply")
    assert apply_to_engine(engine, VECTOR)["status"] == "applied"
    assert f"finish({TARGET})" in engine.calls and not engine.paused and engine.stamped == TARGET


def test_a_failing_finish_leaves_the_engine_paused_and_a_rerun_completes_it() -> None:
    engine = FakeEngine("finish")
    with pytest.raises(DcrError) as info:
        apply_to_engine(engine, VECTOR)
    message = str(info.value)
    assert "applied and proven on every rank" in message and "HTTP 500" in message
    assert "left paused" in message and "re-run the same command" in message
    assert engine.paused and engine.session and not hasattr(engine, "stamped")
    # The re-run: every rank holds the target (noop) and the session is still open: it is closed
    # with the version, the prefix cache reset and the engine resumed.
    engine.mode = "noop"
    engine.calls.clear()
    assert apply_to_engine(engine, VECTOR)["status"] == "noop"
    assert engine.calls == ["prepare", f"finish({TARGET})", "reset", "resume"]
    assert not engine.paused and not engine.session and engine.stamped == TARGET


def test_a_failing_resume_after_a_refusal_keeps_the_reason_and_says_paused() -> None:
    engine = FakeEngine("refuse")

    def resume() -> None:
        engine.calls.append("resume")
        raise DcrError("http://x/resume answered HTTP 500: boom")

    engine.resume = resume  # type: ignore[method-assign]
    with pytest.raises(DcrError) as info:
        apply_to_engine(engine, VECTOR)
    message = str(info.value)
    assert "tensor x is missing" in message and "resuming the engine failed" in message and "left paused" in message
    assert engine.paused


# ---------------------------------------------------------------------------- real vLLM


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    require_or_skip("vllm")
    from vllm_support import qwen3_run

    return qwen3_run(tmp_path_factory, "qwen3-session")  # the chain shared_qwen3_server serves


@pytest.fixture
def server(qwen3: list[Path], shared_qwen3_server: str) -> str:
    """A real ``vllm serve`` (vLLM's own launcher, default process layout) with the dcr backend, as it starts."""
    return shared_qwen3_server


@pytest.mark.vllm
def test_real_server_a_client_interrupted_after_start_then_dcr_apply_succeeds_and_serves(
    server: str, qwen3: list[Path], dcr: Any
) -> None:
    root = qwen3[0].parent
    engine = client.ServerEngine(server)
    # An interrupted client: paused, session started, then gone. vLLM answers a later start with a bare 500.
    engine.pause()
    engine.start()
    assert all(s["session_open"] is True for s in engine.rpc("status"))
    with pytest.raises(DcrError, match="HTTP 500"):
        engine.start()
    applied = dcr("apply", str(root / "d1"), "--vllm", server)
    assert applied.returncode == 0, applied.stderr
    assert engine.call("/is_paused", method="GET")["is_paused"] is False
    assert engine.call("/weight_info", method="GET")["weight_version"] == "step-1"
    assert all(s["session_open"] is False for s in engine.rpc("status"))
    assert dcr("verify", "--vllm", server, check=True).stdout.startswith("ok:")


@pytest.mark.vllm
def test_real_engine_interrupted_client_retry_and_failed_finish(qwen3: list[Path]) -> None:
    from vllm_support import differing, resident_bits, start_llm

    from dcr_cli.receive.vllm import verify_llm
    from dcr_cli.receive.vllm.client import InProcessEngine

    root = qwen3[0].parent
    llm = start_llm(qwen3[0])
    # A client interrupted after start_weight_update: vLLM's session stays open.
    InProcessEngine(llm).start()
    (status,) = InProcessEngine(llm).rpc("status")
    assert status["session_open"] is True
    report = apply_to_engine(InProcessEngine(llm), root / "d1")  # the retry closes it and succeeds
    assert report["status"] == "applied"
    assert InProcessEngine(llm).rpc("status")[0]["session_open"] is False
    assert llm.get_weight_version() == "step-1"
    verify_llm(llm)

    # A finish that fails after every rank proved the target: left paused, and said so.
    class FailingFinish(InProcessEngine):
        def finish(self, version: str | None) -> None:
            if version is not None:
                raise RuntimeError("finish_weight_update: connection reset (injected)")
            super().finish(version)

    with pytest.raises(DcrError, match=r"applied and proven on every rank.*injected.*left paused.*re-run"):
        apply_to_engine(FailingFinish(llm), root / "d2")
    assert InProcessEngine(llm).rpc("status")[0]["session_open"] is True
    assert llm.get_weight_version() != "step-2"
    # The re-run finds the target held (noop) and the session open: it closes it with the version.
    assert apply_to_engine(InProcessEngine(llm), root / "d2")["status"] == "noop"
    assert InProcessEngine(llm).rpc("status")[0]["session_open"] is False
    assert llm.get_weight_version() == "step-2"
    got = resident_bits(llm)
    del llm
    fresh = start_llm(qwen3[2])
    assert differing(got, resident_bits(fresh)) == []


def test_the_caller_of_a_remote_engine_keeps_its_collector_an_in_process_one_defers_it() -> None:
    """An engine in this process shares the client's heap: the client's parse of the manifest must not be
    walked by collections during the apply. A remote engine's caller (a trainer, say) keeps its own."""
    import gc

    from dcr_cli.io.gc_pause import YOUNG

    seen: list[int] = []

    class Watching(FakeEngine):
        def rpc(self, op: str, **args: Any) -> list[dict[str, Any]]:
            seen.append(gc.get_threshold()[0])
            return super().rpc(op, **args)

    before = gc.get_threshold()
    assert apply_to_engine(Watching(), VECTOR)["status"] == "applied"
    assert seen and YOUNG not in seen and gc.get_threshold() == before
    seen.clear()
    local = Watching()
    local.in_process = True
    assert apply_to_engine(local, VECTOR)["status"] == "applied"
    assert seen and set(seen) == {YOUNG} and gc.get_threshold() == before
