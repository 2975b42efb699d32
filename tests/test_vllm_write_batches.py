"""The engine receiver's write batches (WriteBatch): prepare joins the small ready items of proven
tensors per parameter, the update writes each parameter's batch with one call, bit-exactly; a batch
the update cannot use has its items read again before the first write.

A plain torch module stands in for an MoE layer: per-expert checkpoint tensors ``e0..e5`` that its
loader copies into one stacked parameter ``w`` (as vLLM's fused experts do), and ``z`` into a
parameter ``u`` of its own.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from dcr_cli.delta.reader import Delta
from dcr_cli.produce import diff
from dcr_cli.receive.vllm import apply as engine_apply
from dcr_cli.receive.vllm.apply import EngineReceiver

E, R, C = 6, 32, 32


class Experts(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(E, R, C, dtype=torch.bfloat16), requires_grad=False)
        self.u = torch.nn.Parameter(torch.zeros(R, C, dtype=torch.bfloat16), requires_grad=False)

    def load_weights(self, weights):  # type: ignore[no-untyped-def]
        for name, t in weights:
            (self.u.data if name == "z" else self.w.data[int(name[1:])]).copy_(t)


def _versions(tmp: Path, z_is_e0: bool = False) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], Delta]:
    rng = np.random.default_rng(7)
    base = {f"e{i}": rng.integers(0, 1 << 16, (R, C), dtype=np.uint16) for i in range(E)}
    base["z"] = base["e0"].copy() if z_is_e0 else rng.integers(0, 1 << 16, (R, C), dtype=np.uint16)
    target = {n: x.copy() for n, x in base.items()}
    for x in target.values():
        x[rng.random(x.shape) < 0.05] ^= rng.integers(1, 1 << 16, dtype=np.uint16)
    if z_is_e0:
        target["z"] = target["e0"].copy()
    for label, table in (("c0", base), ("c1", target)):
        (tmp / label).mkdir()
        tensors = {n: torch.from_numpy(x.view(np.int16)).view(torch.bfloat16) for n, x in table.items()}
        save_file(tensors, str(tmp / label / "model.safetensors"))
    diff(tmp / "c0", tmp / "c1", tmp / "d", base_version="v0", target_version="v1", workers=1)
    return base, target, Delta.open(str(tmp / "d"))


def _loaded(table: dict[str, np.ndarray]) -> Experts:
    module = Experts()
    module.load_weights([(n, torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)) for n, x in table.items()])
    return module


def _bits(module: Experts) -> dict[str, np.ndarray]:
    return {n: p.detach().view(torch.int16).numpy().copy() for n, p in module.named_parameters()}


def _same(a: Experts, b: Experts) -> bool:
    x, y = _bits(a), _bits(b)
    return x.keys() == y.keys() and all(np.array_equal(x[n], y[n]) for n in x)


def _safetensors_dtype_is_bf16(delta: Delta) -> None:
    assert {e.dtype for e in delta.manifest.tensors.values()} == {"BF16"}


def test_the_expert_items_are_written_with_one_call_for_their_parameter(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    base, target, delta = _versions(tmp_path)
    _safetensors_dtype_is_bf16(delta)
    module = _loaded(base)
    receiver = EngineReceiver(module)
    assert receiver.prepare(delta) == "apply"
    assert receiver._staged is not None
    (batch,) = receiver._staged.batches  # w's six items; z, alone in u, is written as an item
    assert batch.tensors == batch.whole == {f"e{i}" for i in range(E)}
    calls: list[int] = []
    real = engine_apply._write_elements

    def counting(flat, index, values):  # type: ignore[no-untyped-def]
        calls.append(len(index))
        real(flat, index, values)

    monkeypatch.setattr(engine_apply, "_write_elements", counting)
    report = receiver.apply(delta)
    changed = sum(item.changed_elements for item in delta.manifest.items)
    assert sorted(calls) == sorted([batch.index.size, changed - batch.index.size])  # two calls for seven items
    assert report.items == report.applied == len(delta.manifest.items) == E + 1
    assert report.written_elements == changed
    assert report.predicted == E + 1
    assert _same(module, _loaded(target)) and receiver.state.version == "v1"
    assert receiver.verify(delta.manifest.tensors)["mismatched"] == []


def test_a_batch_the_update_cannot_use_has_its_items_read_again_before_the_first_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After prepare, ``u`` is rebound onto ``w[0]``'s storage: ``e0`` shares its elements with ``z``
    now, so it is no longer proven before the pause and its batch cannot be used. (``z``'s item is
    left out of the staged pass, as the budget would: the rest of that pass stays usable.)"""
    base, target, delta = _versions(tmp_path, z_is_e0=True)
    module = _loaded(base)
    receiver = EngineReceiver(module)
    real_first_pass = EngineReceiver._first_pass

    def without_z(self, delta, resuming, skip=None):  # type: ignore[no-untyped-def]
        real_first_pass(self, delta, resuming, skip)
        for k in [k for k in self._prepared if delta.manifest.items[k].tensor == "z"]:
            self._prepared_bytes -= self._prepared.pop(k).nbytes

    monkeypatch.setattr(EngineReceiver, "_first_pass", without_z)
    assert receiver.prepare(delta) == "apply"
    monkeypatch.setattr(EngineReceiver, "_first_pass", real_first_pass)
    assert receiver._staged is not None and receiver._staged.batches
    module.u = torch.nn.Parameter(module.w.data[0], requires_grad=False)  # u aliases w[0] now

    events: list[str] = []
    real_decode, real_write = Delta.decode, engine_apply._write_elements

    def decode(self, item):  # type: ignore[no-untyped-def]
        events.append(f"decode {item.tensor}")
        return real_decode(self, item)

    def write(flat, index, values):  # type: ignore[no-untyped-def]
        events.append("write")
        real_write(flat, index, values)

    monkeypatch.setattr(Delta, "decode", decode)
    monkeypatch.setattr(engine_apply, "_write_elements", write)
    report = receiver.apply(delta)
    first_write = events.index("write")
    decoded = {e.split()[1] for e in events[:first_write] if e.startswith("decode")}
    assert decoded == {f"e{i}" for i in range(E)} | {"z"}  # every emptied item, and z, before any write
    assert not any(e.startswith("decode") for e in events[first_write:])
    assert report.status == "applied" and report.items == E + 1
    want = _loaded(target)
    assert torch.equal(module.w.view(torch.int16), want.w.view(torch.int16)) and receiver.state.version == "v1"
