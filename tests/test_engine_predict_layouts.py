"""The engine receiver proves a touched tensor's target digest before the writes whatever its layout
on one rank (receiver-vllm.md §3), on plain torch modules whose ``load_weights`` plays vLLM's loader:

* Llama4's stacked experts: ``experts.gate_up_proj`` (E, H, 2I) copied as two transposed, strided
  views into the halves of ``w13`` (E, 2I, H), whose spans interleave without sharing an element,
  and ``experts.down_proj`` (E, I, H) copied transposed into ``w2`` (E, H, I);
* two tensors fused along dim 1 of one parameter (``[:, :C1]`` and ``[:, C1:]``);
* a tensor whose rows are split over two parameters, with items that are one destination's
  (ready: only their changes kept) and items that cross the split;
* a re-signed manifest whose table disagrees with its items for the strided tensor: refused
  before any write.

Each delta is cut into small items (``CHUNK_BYTES``), so a tensor has items of both kinds.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from manifest_text import manifest_v1
from safetensors.numpy import save_file

import dcr_cli.produce.engine as produce_engine
import dcr_cli.produce.plan as produce_plan
from dcr_cli.delta.reader import Delta
from dcr_cli.errors import IntegrityError
from dcr_cli.format.digest import digest_bytes
from dcr_cli.format.manifest import MANIFEST_NAME, TensorEntry, fingerprint
from dcr_cli.produce import diff
from dcr_cli.receive.vllm import apply as engine_apply
from dcr_cli.receive.vllm.apply import EngineReceiver

E, H, INTER = 3, 8, 8  # experts, hidden, intermediate (gate_up: 2 * INTER columns)


class StackedExperts(torch.nn.Module):
    """Llama4's expert weights, loaded as vLLM's fused MoE loads them (``w13`` holds gate then up)."""

    def __init__(self) -> None:
        super().__init__()
        self.w13 = torch.nn.Parameter(torch.zeros(E, 2 * INTER, H, dtype=torch.float16), requires_grad=False)
        self.w2 = torch.nn.Parameter(torch.zeros(E, H, INTER, dtype=torch.float16), requires_grad=False)

    def load_weights(self, weights):  # type: ignore[no-untyped-def]
        for name, t in weights:
            if name == "experts.gate_up_proj":  # (E, H, 2I)
                self.w13.data[:, :INTER].copy_(t[..., :INTER].transpose(1, 2))
                self.w13.data[:, INTER:].copy_(t[..., INTER:].transpose(1, 2))
            else:  # experts.down_proj (E, I, H)
                self.w2.data.copy_(t.transpose(1, 2))


class FusedDim1(torch.nn.Module):
    """Two checkpoint tensors (16 x 6, 16 x 10) side by side in one 16 x 16 parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.p = torch.nn.Parameter(torch.zeros(16, 16, dtype=torch.float16), requires_grad=False)

    def load_weights(self, weights):  # type: ignore[no-untyped-def]
        for name, t in weights:
            if name == "left":
                self.p.data[:, :6].copy_(t)
            else:
                self.p.data[:, 6:].copy_(t)


class SplitRows(torch.nn.Module):
    """A 16 x 16 checkpoint tensor whose rows 0-9 and 10-15 live in two parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.top = torch.nn.Parameter(torch.zeros(10, 16, dtype=torch.float16), requires_grad=False)
        self.bottom = torch.nn.Parameter(torch.zeros(6, 16, dtype=torch.float16), requires_grad=False)

    def load_weights(self, weights):  # type: ignore[no-untyped-def]
        for _, t in weights:
            self.top.data.copy_(t[:10])
            self.bottom.data.copy_(t[10:])


def _versions(
    tmp: Path, shapes: dict[str, tuple[int, ...]], monkeypatch: pytest.MonkeyPatch, chunk: int | None
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], Delta]:
    """Random FP16 base tensors, and a target with about a third of their elements stepped in the
    low mantissa bit; the delta cut into items of ``chunk`` bytes (None: the default, one item)."""
    rng = np.random.default_rng(1)
    base = {n: rng.standard_normal(s).astype(np.float16) for n, s in shapes.items()}
    target = {}
    for name, x in base.items():
        t = x.copy()
        t.view(np.uint16)[rng.random(x.shape) < 0.35] ^= 1
        target[name] = t
    for label, table in (("c0", base), ("c1", target)):
        (tmp / label).mkdir()
        save_file(table, str(tmp / label / "model.safetensors"))
    if chunk is not None:
        monkeypatch.setattr(produce_plan, "CHUNK_BYTES", chunk)
        monkeypatch.setattr(produce_engine, "CHUNK_BYTES", chunk)
    diff(tmp / "c0", tmp / "c1", tmp / "d", base_version="v0", target_version="v1", workers=1)
    return base, target, Delta.open(str(tmp / "d"))


def _loaded(make: Callable[[], torch.nn.Module], tensors: dict[str, np.ndarray]) -> torch.nn.Module:
    module = make()
    module.load_weights([(n, torch.from_numpy(t)) for n, t in tensors.items()])  # type: ignore[operator]
    return module


def _bits(module: torch.nn.Module) -> dict[str, bytes]:
    return {n: p.detach().view(torch.int16).numpy().tobytes() for n, p in module.named_parameters()}


def _steady_apply(make: Callable[[], torch.nn.Module], shapes: dict[str, tuple[int, ...]], tmp: Path, mp, chunk):  # type: ignore[no-untyped-def]
    """prepare + apply on an engine at the base; returns (report, the (tensor, ready) kinds of its
    staged items, tensors digested whole in the update, the engine's bits, a fresh load of the target's)."""
    base, target, delta = _versions(tmp, shapes, mp, chunk)
    module = _loaded(make, base)
    receiver = EngineReceiver(module)
    assert receiver.prepare(delta) == "apply"  # reads back the base: the version is known from here on
    assert receiver._staged is not None
    items = delta.manifest.items
    # Small ready items are joined per parameter for the pause (WriteBatch), leaving their Prepared empty.
    batched = {k for batch in receiver._staged.batches for k in batch.keys}
    kinds = {(items[k].tensor, p.ready or k in batched) for k, p in receiver._staged.prepared.items()}
    digested: list[str] = []
    real = EngineReceiver.tensor_digest

    def recording(self: EngineReceiver, name: str, entry: TensorEntry) -> str:
        digested.append(name)
        return real(self, name, entry)

    mp.setattr(EngineReceiver, "tensor_digest", recording)
    report = receiver.apply(delta)
    mp.setattr(EngineReceiver, "tensor_digest", real)
    assert receiver.verify(delta.manifest.tensors)["mismatched"] == []
    return report, kinds, digested, _bits(module), _bits(_loaded(make, target))


EXPERTS = {"experts.gate_up_proj": (E, H, 2 * INTER), "experts.down_proj": (E, INTER, H)}


@pytest.mark.parametrize("chunk", [None, 12, 20])
def test_stacked_experts_loaded_as_strided_transposed_views_are_predicted_and_exact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunk: int | None
) -> None:
    """12-byte items (6 elements) are one half's or cross from gate to up; one item is both halves."""
    report, kinds, digested, held, want = _steady_apply(StackedExperts, EXPERTS, tmp_path, monkeypatch, chunk)
    assert report.status == "applied" and report.staged == report.items
    gate_up = {ready for name, ready in kinds if name == "experts.gate_up_proj"}
    assert gate_up == ({False} if chunk is None else {False, True})  # split only, or ready and split mixed
    assert ("experts.down_proj", True) in kinds  # one transposed destination: ready
    assert report.predicted == 2 and digested == []  # neither tensor digested whole after the writes
    assert held == want


def test_two_tensors_fused_along_dim1_are_both_predicted_and_exact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shapes = {"left": (16, 6), "right": (16, 10)}
    report, kinds, digested, held, want = _steady_apply(FusedDim1, shapes, tmp_path, monkeypatch, 16)
    assert report.predicted == 2 and digested == []
    assert kinds == {("left", True), ("right", True)}  # one strided destination each: ready
    assert held == want


def test_a_tensor_split_over_two_parameters_with_ready_and_split_items_is_predicted_and_exact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """24-byte items: the one at canonical 156..168 crosses the split at 160 (two destinations)."""
    report, kinds, digested, held, want = _steady_apply(SplitRows, {"w": (16, 16)}, tmp_path, monkeypatch, 24)
    assert report.predicted == 1 and digested == []
    assert kinds == {("w", True), ("w", False)}
    assert held == want


@pytest.mark.parametrize("staged", [False, True])
def test_a_resigned_manifest_for_the_strided_experts_is_refused_before_any_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, staged: bool
) -> None:
    """The table names other bits for gate_up (its fingerprint recomputed): every item still goes
    from its ``pre`` to its ``post``; only the prediction sees that the tensor would be wrong."""
    base, _, _ = _versions(tmp_path, EXPERTS, monkeypatch, 12)
    manifest = manifest_v1(tmp_path / "d")
    manifest["tensors"]["experts.gate_up_proj"]["digest"] = digest_bytes(b"not the target")
    table = {n: TensorEntry(t["dtype"], tuple(t["shape"]), t["digest"]) for n, t in manifest["tensors"].items()}
    manifest["target"]["fingerprint"] = fingerprint(table)
    (tmp_path / "d" / MANIFEST_NAME).write_text(json.dumps(manifest))
    bad = Delta.open(str(tmp_path / "d"))
    module = _loaded(StackedExperts, base)
    before = _bits(module)
    receiver = EngineReceiver(module)
    with pytest.raises(IntegrityError, match=r"would not hold the target .*gate_up_proj.*nothing was written"):
        if staged:
            receiver.prepare(bad)
        receiver.apply(bad)
    assert _bits(module) == before  # nothing written
    assert receiver.state.applying is None and receiver.state.version == "v0"


def test_a_tensor_whose_overlay_exceeds_the_first_pass_budget_is_read_back_whole_or_digested_after_the_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gate_up's one item spans both halves (split: canonical positions kept), so it is predicted
    from the whole tensor read back, as before; down_proj's item is ready (no canonical positions),
    so it is digested after the writes. Either way the engine ends with the target's bits."""
    monkeypatch.setattr(engine_apply, "_overlay_bytes", lambda placement: engine_apply.PREPARED_BYTES + 1)
    report, kinds, digested, held, want = _steady_apply(StackedExperts, EXPERTS, tmp_path, monkeypatch, None)
    assert kinds == {("experts.gate_up_proj", False), ("experts.down_proj", True)}
    assert report.predicted == 1 and digested == ["experts.down_proj"]
    assert held == want


class OverlappingHalves(StackedExperts):
    """The up half copied one row too high: its first row is the gate half's last (a loader bug, or a
    layout dcr cannot hold): the two strided views share elements, so the tensor is aliased."""

    def load_weights(self, weights):  # type: ignore[no-untyped-def]
        for name, t in weights:
            if name == "experts.gate_up_proj":
                self.w13.data[:, :INTER].copy_(t[..., :INTER].transpose(1, 2))
                self.w13.data[:, INTER - 1 : 2 * INTER - 1].copy_(t[..., INTER:].transpose(1, 2))
            else:
                self.w2.data.copy_(t.transpose(1, 2))


def test_strided_views_that_share_an_element_are_still_aliased() -> None:
    table = {n: TensorEntry("F16", shape, digest_bytes(b"")) for n, shape in EXPERTS.items()}
    for make, aliased in ((StackedExperts, set()), (OverlappingHalves, {"experts.gate_up_proj"})):
        receiver = EngineReceiver(make())
        receiver.trace_all(table)
        assert receiver._aliased(table) == aliased, make.__name__


class EmptyCopies(torch.nn.Module):
    """A 16 x 8 tensor held transposed in columns 2.. of ``p``, plus two empty copies (zero-size shards):
    one into ``p[:, :0]`` (below the tensor's span there), one into another parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.p = torch.nn.Parameter(torch.zeros(8, 18, dtype=torch.float16), requires_grad=False)
        self.q = torch.nn.Parameter(torch.zeros(4, 16, dtype=torch.float16), requires_grad=False)

    def load_weights(self, weights):  # type: ignore[no-untyped-def]
        for _, t in weights:
            self.p.data[:, :0].copy_(t.t()[:, :0])
            self.p.data[:, 2:].copy_(t.t())
            self.q.data[:0].copy_(t.t()[8:])


def test_empty_copies_beside_a_strided_destination_are_predicted_and_exact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    report, _, digested, held, want = _steady_apply(EmptyCopies, {"w": (16, 8)}, tmp_path, monkeypatch, None)
    assert report.predicted == 1 and digested == []
    assert held == want
