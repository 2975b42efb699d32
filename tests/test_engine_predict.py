"""The engine receiver's proof before the writes (receiver-vllm.md §3, §4), on plain torch modules
whose ``load_weights`` plays vLLM's loader (placement is traced through it as for a real engine).

* two tensors the loader copies into one storage are never proven before the writes: another
  tensor's writes change their bits, so they are digested after all the writes;
* a parameter replaced between ``prepare`` and the update drops the staged pass (its indices
  point into the old storage);
* a tensor held through a widening cast is digested after the writes (the cast can change a NaN
  payload, so the bits written are not known before);
* two ranks (threads exchanging through a barrier) predict the same tensors, in step, and drop a
  staged pass together when one rank's is stale.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file

from dcr_cli.delta.reader import Delta
from dcr_cli.errors import IntegrityError
from dcr_cli.produce import diff
from dcr_cli.receive.vllm.apply import EngineReceiver


class OneStorage(torch.nn.Module):
    """Every checkpoint tensor (64 x 64) is copied into the same parameter: tied weights loaded both ways."""

    def __init__(self, dtype: torch.dtype = torch.float16) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(4096, dtype=dtype), requires_grad=False)

    def load_weights(self, weights):  # type: ignore[no-untyped-def]
        for _, t in weights:
            self.w.data.view(64, 64).copy_(t)


def _versions(tmp: Path, tensors: dict[str, list[int]]) -> tuple[np.ndarray, Delta]:
    """A base where every tensor is the same 64 x 64 FP16 matrix, and a target where tensor ``n``
    has the rows ``tensors[n]`` stepped in their low mantissa bit."""
    x = np.random.default_rng(0).standard_normal((64, 64)).astype(np.float16)
    target = {}
    for name, rows in tensors.items():
        t = x.copy()
        for r in rows:
            t.view(np.uint16)[r, :50] ^= 1
        target[name] = t
    for label, table in (("c0", {n: x.copy() for n in tensors}), ("c1", target)):
        (tmp / label).mkdir()
        save_file(table, str(tmp / label / "model.safetensors"))
    diff(tmp / "c0", tmp / "c1", tmp / "d", base_version="v0", target_version="v1", workers=1)
    return x, Delta.open(str(tmp / "d"))


def _engine(x: np.ndarray, dtype: torch.dtype = torch.float16) -> tuple[OneStorage, EngineReceiver]:
    module = OneStorage(dtype)
    module.w.data.copy_(torch.from_numpy(x).reshape(-1).to(dtype))
    return module, EngineReceiver(module)


@pytest.mark.parametrize("staged", [False, True])
def test_tensors_sharing_one_storage_are_digested_after_the_writes_never_predicted(
    tmp_path: Path, staged: bool
) -> None:
    """Base a == b; the target changes row 0 of a and row 1 of b, which one storage cannot hold.
    Each tensor's own items lead to its target, so a prediction per tensor would pass both."""
    x, delta = _versions(tmp_path, {"a": [0], "b": [1]})
    _, receiver = _engine(x)
    if staged:
        assert receiver.prepare(delta) == "apply"
    with pytest.raises(IntegrityError, match="do not hold the target"):
        receiver.apply(delta)
    assert receiver.state.version != "v1" and receiver.state.applying is not None


def test_tensors_sharing_one_storage_still_apply_when_the_target_is_one_tensor(tmp_path: Path) -> None:
    x, delta = _versions(tmp_path, {"a": [0, 3], "b": [0, 3]})
    _, receiver = _engine(x)
    receiver.prepare(delta)
    report = receiver.apply(delta)
    assert report.status == "applied" and report.predicted == 0  # both digested after the writes
    assert receiver.verify(delta.manifest.tensors)["mismatched"] == []


def test_a_parameter_replaced_after_prepare_drops_the_staged_pass_and_the_apply_is_exact(tmp_path: Path) -> None:
    x, delta = _versions(tmp_path, {"a": [0, 7]})
    module, receiver = _engine(x)
    assert receiver.prepare(delta) == "apply"
    old = module.w
    module.w = torch.nn.Parameter(old.data.clone(), requires_grad=False)  # same bits, new storage
    report = receiver.apply(delta)
    assert report.status == "applied" and report.staged == 0 and report.predicted == 1
    assert receiver.verify(delta.manifest.tensors)["mismatched"] == []
    assert torch.equal(old.data, torch.from_numpy(x).reshape(-1))  # nothing went to the old storage


def test_an_untouched_tensor_sharing_storage_with_a_touched_one_is_digested_even_on_a_resume(tmp_path: Path) -> None:
    """Base a == b in one storage; the target changes a only, so b's bits change with it."""
    x, delta = _versions(tmp_path, {"a": [0], "b": []})
    assert {item.tensor for item in delta.manifest.items} == {"a"}
    _, receiver = _engine(x)
    for attempt in ("fresh", "resume"):
        with pytest.raises(IntegrityError, match=r"do not hold the target v1 \('b'\)"):
            receiver.apply(delta)
        assert receiver.state.version != "v1", attempt


class Folded(torch.nn.Module):
    """A 64 x 64 checkpoint tensor whose two halves the loader copies into one 32 x 64 parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.p = torch.nn.Parameter(torch.zeros(32, 64, dtype=torch.float16), requires_grad=False)

    def load_weights(self, weights):  # type: ignore[no-untyped-def]
        for _, t in weights:
            self.p.data.copy_(t[:32])
            self.p.data.copy_(t[32:])


def test_a_tensor_whose_two_destinations_overlap_is_digested_after_the_writes(tmp_path: Path) -> None:
    half = np.random.default_rng(0).standard_normal((32, 64)).astype(np.float16)
    x = np.concatenate([half, half])
    y = x.copy()
    y.view(np.uint16)[0, :10] ^= 1  # one half only: the engine cannot hold it
    for label, table in (("c0", {"w": x}), ("c1", {"w": y})):
        (tmp_path / label).mkdir()
        save_file(table, str(tmp_path / label / "model.safetensors"))
    diff(tmp_path / "c0", tmp_path / "c1", tmp_path / "d", base_version="v0", target_version="v1", workers=1)
    module = Folded()
    module.load_weights([("w", torch.from_numpy(x))])
    receiver = EngineReceiver(module)
    with pytest.raises(IntegrityError, match="do not hold the target"):
        receiver.apply(Delta.open(str(tmp_path / "d")))
    assert receiver.state.version != "v1"


def test_a_widened_tensor_is_digested_after_the_writes_and_a_nan_payload_the_cast_changes_is_never_recorded(
    tmp_path: Path,
) -> None:
    """An FP16 checkpoint in an FP32 engine: torch's cast quiets a signalling NaN (0x7C01), so the
    engine cannot hold that target; a target of ordinary values applies, proven after the writes."""
    x = np.random.default_rng(0).standard_normal((64, 64)).astype(np.float16)
    y = x.copy()
    y.view(np.uint16)[3, 5] = 0x7C01
    z = x.copy()
    z.view(np.uint16)[3, :40] ^= 1
    for label, table in (("c0", {"w": x}), ("nan", {"w": y}), ("ok", {"w": z})):
        (tmp_path / label).mkdir()
        save_file(table, str(tmp_path / label / "model.safetensors"))
    for target in ("nan", "ok"):
        diff(tmp_path / "c0", tmp_path / target, tmp_path / f"d-{target}", base_version="v0", target_version=target)
    _, receiver = _engine(x, torch.float32)
    with pytest.raises(IntegrityError):
        receiver.apply(Delta.open(str(tmp_path / "d-nan")))
    assert receiver.state.version != "nan"
    _, fresh = _engine(x, torch.float32)
    report = fresh.apply(Delta.open(str(tmp_path / "d-ok")))
    assert report.status == "applied" and report.predicted == 0
    assert fresh.verify(Delta.open(str(tmp_path / "d-ok")).manifest.tensors)["mismatched"] == []


class TwoParams(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.zeros(64, 64, dtype=torch.float16), requires_grad=False)
        self.b = torch.nn.Parameter(torch.zeros(64, 64, dtype=torch.float16), requires_grad=False)

    def load_weights(self, weights):  # type: ignore[no-untyped-def]
        for name, t in weights:
            getattr(self, name).data.copy_(t)


def _two_ranks(run: Callable[[int, Callable[[Any], list[Any]]], Any]) -> tuple[list[Any], list[int]]:
    """``run(rank, exchange)`` on two threads whose exchange is an all-gather; results and exchange counts."""
    barrier = threading.Barrier(2, timeout=30)
    slots: list[Any] = [None, None]
    calls, out = [0, 0], [None, None]

    def exchange_of(rank: int) -> Callable[[Any], list[Any]]:
        def exchange(obj: Any) -> list[Any]:
            calls[rank] += 1
            slots[rank] = obj
            barrier.wait()
            got = list(slots)
            barrier.wait()
            return got

        return exchange

    def body(rank: int) -> None:
        try:
            out[rank] = run(rank, exchange_of(rank))
        except BaseException as exc:  # reported to the test
            out[rank] = exc

    threads = [threading.Thread(target=body, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out, calls


@pytest.mark.parametrize("moved", [False, True])
def test_two_ranks_predict_in_step_and_drop_a_stale_staged_pass_together(tmp_path: Path, moved: bool) -> None:
    """Each rank holds a replica. ``moved``: after prepare, rank 0's parameter gets a new storage
    (same bits), so its staged pass is stale; both ranks drop theirs and take the same steps."""
    x, _ = _versions(tmp_path, {"a": [0, 5], "b": []})

    def run(rank: int, exchange: Callable[[Any], list[Any]]) -> tuple[str, int, list[str]]:
        module = TwoParams()
        module.load_weights([("a", torch.from_numpy(x)), ("b", torch.from_numpy(x))])
        receiver = EngineReceiver(module, exchange, rank)
        step = Delta.open(str(tmp_path / "d"))
        assert receiver.prepare(step) == "apply"
        if moved and rank == 0:
            module.a.data = module.a.data.clone()
        report = receiver.apply(step)
        return report.status, report.predicted, receiver.verify(step.manifest.tensors)["mismatched"]

    out, calls = _two_ranks(run)
    assert out == [("applied", 1, []), ("applied", 1, [])], out
    assert calls[0] == calls[1]


@pytest.mark.parametrize("rebind", ["b to a", "a to b"])
def test_a_parameter_rebound_onto_anothers_storage_after_prepare_is_never_recorded_from_a_stale_prediction(
    tmp_path: Path, rebind: str
) -> None:
    """``prepare`` predicts a and b apart (two storages), each from its own items. Then one parameter
    is rebound to the other: both tensors now load into one storage, which cannot hold a's row 0
    change and b's row 1 change at once. The update re-traces the tensor whose storage moved, finds
    the two aliased (by storage, though the two placements name it differently; never from the answer
    ``prepare`` computed: a new placement is a new question), drops their predictions and digests
    both after the writes, so the apply fails and records nothing."""
    x, delta = _versions(tmp_path, {"a": [0], "b": [1]})
    module = TwoParams()
    for p in (module.a, module.b):
        p.data.copy_(torch.from_numpy(x))
    receiver = EngineReceiver(module)
    assert receiver.prepare(delta) == "apply"
    assert receiver._staged is not None and receiver._staged.predicted == {"a", "b"}
    if rebind == "b to a":  # a parameter rebound between prepare and the update
        module.b = module.a
    else:
        module.a = module.b
    with pytest.raises(IntegrityError, match="do not hold the target"):
        receiver.apply(delta)
    assert receiver.state.version != "v1" and receiver.state.applying is not None


class TiedPair(torch.nn.Module):
    """``b.weight`` tied to ``a.weight`` (one storage, ``a.weight`` its first name); the loader writes ``x``
    through ``b``."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Module()
        self.a.weight = torch.nn.Parameter(torch.zeros(8, 12, dtype=torch.float16), requires_grad=False)
        self.b = torch.nn.Module()
        self.b.weight = self.a.weight

    def load_weights(self, weights):  # type: ignore[no-untyped-def]
        for _, t in weights:
            self.b.weight.data.copy_(t)


def test_a_tied_parameter_given_its_own_storage_is_traced_again(tmp_path: Path) -> None:
    """The engine unties ``b`` from ``a`` (same bits, its own storage) after the placement was traced: the
    placement into the shared storage no longer holds, since the loader now writes ``x`` into ``b.weight``.
    Checking the storage's first name alone (``a.weight``, unmoved) kept it: the apply wrote ``a.weight``,
    proved it through the same stale placement and recorded a version ``b.weight`` did not hold."""
    rng = np.random.default_rng(3)
    base = rng.integers(0, 1 << 16, size=(8, 12), dtype=np.uint16)
    target = base ^ (rng.random(base.shape) < 0.2).astype(np.uint16)
    for tag, bits in (("c0", base), ("c1", target)):
        (tmp_path / tag).mkdir()
        save_file({"x": bits.view(np.float16)}, str(tmp_path / tag / "model.safetensors"))
    diff(tmp_path / "c0", tmp_path / "c1", tmp_path / "d", base_version="v0", target_version="v1", workers=1)
    delta = Delta.open(tmp_path / "d")
    module = TiedPair()
    module.load_weights([("x", torch.from_numpy(base.view(np.float16)))])
    receiver = EngineReceiver(module)
    receiver._begin()
    receiver.trace_all(delta.manifest.tensors)

    module.b.weight = torch.nn.Parameter(module.b.weight.data.clone(), requires_grad=False)
    assert receiver.apply(delta).status == "applied"
    assert np.array_equal(module.b.weight.detach().numpy().view(np.uint16), target)  # where the loader puts x
    assert np.array_equal(module.a.weight.detach().numpy().view(np.uint16), base)  # untouched
