"""Ranks of a multi-rank engine fail together, in lockstep (EngineReceiver.agree / RankFailure).

Two receivers on two threads stand in for two vLLM workers; their exchange is a real all-gather
over a barrier, which blocks forever (here: times out) if the ranks' collective calls do not pair
up. Whichever rank fails wherever inside a phase, every rank raises the same error, none is left
waiting, and the next phase pairs up again.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

from dcr_cli.errors import DcrError, IntegrityError
from dcr_cli.receive.vllm.apply import EngineReceiver, RankFailure

TIMEOUT = 20.0


class AllGather:
    """All-gather of Python objects between ``n`` threads (one per rank)."""

    def __init__(self, n: int) -> None:
        self.slots: list[Any] = [None] * n
        self.barrier = threading.Barrier(n, timeout=TIMEOUT)
        self.calls = [0] * n

    def for_rank(self, rank: int) -> Callable[[Any], list[Any]]:
        def exchange(obj: Any) -> list[Any]:
            self.calls[rank] += 1
            self.barrier.wait()
            self.slots[rank] = obj
            self.barrier.wait()
            out = list(self.slots)
            self.barrier.wait()
            return out

        return exchange


def run_ranks(phases: list[Callable[[EngineReceiver], Any]]) -> tuple[list[Any], list[int]]:
    """Run ``phases[r]`` under ``agree`` on rank r; each rank's result or exception, and its exchange count."""
    gather = AllGather(len(phases))
    receivers = [EngineReceiver(torch.nn.Linear(2, 2), gather.for_rank(r), rank=r) for r in range(len(phases))]
    out: list[Any] = [None] * len(phases)

    def rank(r: int) -> None:
        try:
            out[r] = receivers[r].agree(lambda: phases[r](receivers[r]))
        except Exception as exc:
            out[r] = exc

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(phases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT * 3)
    assert not any(t.is_alive() for t in threads), "a rank is left waiting in an exchange"
    assert not any(isinstance(o, threading.BrokenBarrierError) for o in out), out
    return out, gather.calls


def exchanges(n: int, then: BaseException | None = None) -> Callable[[EngineReceiver], str]:
    def phase(receiver: EngineReceiver) -> str:
        for k in range(n):
            receiver.exchange(("piece", receiver.rank, k))
        if then is not None:
            raise then
        return f"rank {receiver.rank} done"

    return phase


def test_all_ranks_succeed_and_agree_returns_each_phase_result() -> None:
    out, calls = run_ranks([exchanges(3), exchanges(3)])
    assert out == ["rank 0 done", "rank 1 done"]
    assert calls == [4, 4]  # three in the phase, one to agree


def test_a_rank_failing_before_the_others_exchanges_fails_them_all_at_once() -> None:
    # Rank 0 fails before its first exchange; rank 1 is about to exchange three item pieces.
    out, calls = run_ranks([exchanges(0, IntegrityError("item x is corrupt")), exchanges(3)])
    assert isinstance(out[0], IntegrityError) and str(out[0]) == "item x is corrupt"
    assert type(out[1]) is IntegrityError and str(out[1]) == "item x is corrupt"  # the same error, same class
    assert calls == [1, 1]  # rank 1 stopped at its first exchange, which carried rank 0's failure


def test_a_non_dcr_failure_midway_on_the_last_rank_names_that_rank() -> None:
    out, calls = run_ranks([exchanges(3), exchanges(2, RuntimeError("transfer\nkilled"))])
    assert isinstance(out[1], RuntimeError)
    assert type(out[0]) is DcrError and str(out[0]) == "rank 1: RuntimeError: transfer killed"
    assert calls == [3, 3]


def test_both_ranks_failing_raise_their_own_errors_and_the_next_phase_pairs_up() -> None:
    out, _ = run_ranks([exchanges(1, IntegrityError("a")), exchanges(1, IntegrityError("b"))])
    assert [str(o) for o in out] == ["a", "b"]
    out, calls = run_ranks([exchanges(2), exchanges(2)])
    assert out == ["rank 0 done", "rank 1 done"] and calls == [3, 3]


def test_a_rank_failure_is_never_mistaken_for_data() -> None:
    failure = RankFailure(1, "gone", "NoSuchError")
    assert type(failure.error()) is DcrError and str(failure.error()) == "gone"
    with pytest.raises(DcrError, match="gone"):
        receiver = EngineReceiver(torch.nn.Linear(2, 2), lambda obj: [obj, failure], rank=0)
        receiver.exchange("piece")


@pytest.mark.parametrize("step", ["prepare", "apply"])
def test_a_rank_whose_untouched_check_refuses_fails_every_rank(step: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """prepare and apply run check_untouched inside an agreed phase: had the ranks' tables ever
    differed, the refusing rank would otherwise raise while the others wait in an all-gather."""
    from types import SimpleNamespace

    from dcr_cli.errors import IncompatibleError
    from dcr_cli.receive import plan as receiver_plan

    def check(self: EngineReceiver, delta: Any, staged: Any = None) -> str:
        self.state.fingerprint = "fp-base"  # every rank is at the delta's base
        return "apply"

    def check_untouched(manifest: Any, base_table: Any, url: str) -> None:
        if base_table == "rank 1's table":
            raise IncompatibleError("w is not at the base (rank 1)")

    monkeypatch.setattr(EngineReceiver, "check", check)
    monkeypatch.setattr(EngineReceiver, "held_table", lambda self: f"rank {self.rank}'s table")
    monkeypatch.setattr(EngineReceiver, "_first_pass", lambda self, *args, **kwargs: None)
    monkeypatch.setattr(receiver_plan, "check_untouched", check_untouched)
    manifest = SimpleNamespace(base=SimpleNamespace(fingerprint="fp-base"), items=[object()], tensors={})
    delta = SimpleNamespace(manifest=manifest, url="d", id="delta-id", source=SimpleNamespace(remote=False))

    out, _ = run_ranks([lambda r: getattr(r, step)(delta)] * 2)
    assert [type(o) for o in out] == [IncompatibleError, IncompatibleError], out
    assert [str(o) for o in out] == ["w is not at the base (rank 1)"] * 2
