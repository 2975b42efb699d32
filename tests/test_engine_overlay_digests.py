"""The engine receiver's prediction (``EngineReceiver._predict``, receiver-vllm §3) of tensors held as
contiguous runs of resident storage: each tensor's target digest computed from the bits the engine
holds with the kept items' new bits in their place, before any write.

Small tensors (an MoE layer's per-expert tensors in one stacked parameter) are predicted together
per chunk (``_overlaid_digests``: one copy and one scatter for many tensors); a tensor larger than a
piece goes in pieces (``_overlaid_digest``, the scatter shifting storage indices to the piece). Both
must prove exactly the tensors the target table holds, so a prepare that predicts them all and an
apply that lands the target bits are what is checked, with the pieces and chunks made small enough
that every path runs (a wrong index offset, edge or owner gives another digest, and the prepare
refuses). Also: what a steady prepare reuses from the last delta's (the write groups) holds only
while the placements are the same.
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from engine_versions import loaded, random_versions
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dcr_cli.delta.reader import Delta
from dcr_cli.errors import IncompatibleError, IntegrityError
from dcr_cli.format.manifest import TensorEntry, parse_manifest
from dcr_cli.produce import diff
from dcr_cli.receive.vllm import apply as engine_apply
from dcr_cli.receive.vllm.apply import EngineReceiver

E, R, C = 5, 16, 24  # experts e0..e4 stacked in ``w``; ``big`` (R*E x C) alone in ``v``, ``a`` alone in ``u``
NAMES = ["a", "big", *(f"e{i}" for i in range(E))]


class Layer(torch.nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(E, R, C, dtype=dtype), requires_grad=False)
        self.u = torch.nn.Parameter(torch.zeros(R, C, dtype=dtype), requires_grad=False)
        self.v = torch.nn.Parameter(torch.zeros(R * E, C, dtype=dtype), requires_grad=False)

    def load_weights(self, weights):  # type: ignore[no-untyped-def]
        for name, t in weights:
            if name == "a":
                self.u.data.copy_(t)
            elif name == "big":
                self.v.data.copy_(t)
            else:
                self.w.data[int(name[1:])].copy_(t)


def _versions(tmp: Path, seed: int, rate: float, uint: type) -> tuple[dict, dict, Delta]:
    shapes = {"a": (R, C), "big": (R * E, C), **{f"e{i}": (R, C) for i in range(E)}}
    return random_versions(tmp, shapes, seed, rate, uint)


def _held(module: Layer) -> dict[str, np.ndarray]:
    """Each checkpoint tensor's bits as the module holds them."""
    bits = {n: p.detach().view(torch.uint8).numpy() for n, p in module.named_parameters()}
    width = module.w.element_size()
    uint = np.uint16 if width == 2 else np.uint32
    w = bits["w"].view(uint).reshape(E, R, C)
    return {"a": bits["u"].view(uint).reshape(R, C), "big": bits["v"].view(uint).reshape(R * E, C)} | {
        f"e{i}": w[i] for i in range(E)
    }


def _check(tmp: Path, seed: int, rate: float, uint: type, piece_bytes: int, chunk_elements: int) -> None:
    base, target, delta = _versions(tmp, seed, rate, uint)
    touched = {item.tensor for item in delta.manifest.items}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(engine_apply, "OVERLAY_PIECE_BYTES", piece_bytes)
        mp.setattr(engine_apply, "OVERLAY_CHUNK_ELEMENTS", chunk_elements)
        module = loaded(Layer, base)
        receiver = EngineReceiver(module)
        assert receiver.prepare(delta) == "apply"
        # every touched tensor proven before any write, and nothing written by the prepare
        assert receiver._predicted == touched
        assert all(np.array_equal(_held(module)[n], base[n]) for n in NAMES)
        receiver.apply(delta)
    assert receiver.state.version == "v1"
    held = _held(module)
    assert all(np.array_equal(held[n], target[n]) for n in NAMES)


@pytest.mark.parametrize("uint", [np.uint16, np.uint32])
@pytest.mark.parametrize(
    ("piece_bytes", "chunk_elements"),
    [
        (1 << 20, 1 << 18),  # as shipped: every tensor here is one piece, all small ones in one chunk
        (64, 1 << 18),  # ``big`` (and the experts) go in pieces of 32 or 16 elements
        (1 << 20, R * C),  # small tensors one per chunk
        (96, 2 * R * C),  # pieces that do not divide a tensor, chunks of two experts
    ],
)
def test_the_prediction_proves_every_touched_tensor_and_the_apply_is_exact(
    tmp_path: Path, uint: type, piece_bytes: int, chunk_elements: int
) -> None:
    _check(tmp_path, 0, 0.05, uint, piece_bytes, chunk_elements)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 2**32 - 1),
    rate=st.sampled_from([0.002, 0.01, 0.1, 0.6]),
    uint=st.sampled_from([np.uint16, np.uint32]),
    piece_bytes=st.sampled_from([2, 40, 128, 1 << 20]),
    chunk_elements=st.sampled_from([1, R * C, 3 * R * C, 1 << 18]),
)
def test_the_prediction_in_pieces_and_chunks_proves_what_one_by_one_would(
    seed: int, rate: float, uint: type, piece_bytes: int, chunk_elements: int
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        _check(Path(tmp), seed, rate, uint, piece_bytes, chunk_elements)


@pytest.mark.parametrize("tensor", ["e3", "big"])
def test_a_weight_changed_behind_dcrs_back_where_no_item_looks_is_refused_by_the_prediction(
    tmp_path: Path, tensor: str
) -> None:
    """An element that no item changes, flipped in the engine after it recorded the base: every
    item's pre-image still holds, so only the tensor's predicted digest can tell. The prepare
    refuses, nothing is written and no version is recorded."""
    base, target, delta = _versions(tmp_path, 1, 0.05, np.uint16)
    module = loaded(Layer, base)
    receiver = EngineReceiver(module)
    diff(tmp_path / "c0", tmp_path / "c0", tmp_path / "noop", base_version="v0", target_version="v0", workers=1)
    receiver.apply(Delta.open(str(tmp_path / "noop")))  # fingerprinted: the engine is at v0 (recorded)
    assert receiver.state.version == "v0"
    flat = _held(module)[tensor].reshape(-1)
    untouched = int(np.flatnonzero(base[tensor].reshape(-1) == target[tensor].reshape(-1))[-1])
    flat[untouched] ^= 1
    before = {n: x.copy() for n, x in _held(module).items()}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(engine_apply, "OVERLAY_PIECE_BYTES", 64)
        with pytest.raises(IntegrityError, match=tensor):
            receiver.prepare(delta)
    assert all(np.array_equal(_held(module)[n], before[n]) for n in NAMES)
    assert receiver.state.version == "v0" and receiver.state.applying is None


def test_a_steady_deltas_write_groups_are_reused_only_while_the_placements_are_the_same(tmp_path: Path) -> None:
    """The write groups (tensors grouped by the parameters they write) are computed once per table and
    placements: a new manifest of the same tensors (a steady refit's next delta) reuses them, a
    placement traced again (here: replaced by an equal copy, as a re-trace makes) computes them anew."""
    base, target, delta = _versions(tmp_path, 2, 0.05, np.uint16)
    module = loaded(Layer, base)
    receiver = EngineReceiver(module)
    assert receiver.prepare(delta) == "apply"
    first = receiver._write_groups(delta.manifest.tensors)
    # Another manifest object, another table (a second open of the same bytes shares the first's parse).
    again = dataclasses.replace(delta, manifest=parse_manifest(delta.manifest.file_bytes()))
    assert again.manifest.tensors is not delta.manifest.tensors
    assert receiver.prepare(again) == "apply"
    assert receiver._write_groups(again.manifest.tensors) is first
    name = "e2"
    receiver._put_placements({name: dataclasses.replace(receiver._placements[name])})
    third = dataclasses.replace(delta, manifest=parse_manifest(delta.manifest.file_bytes()))
    receiver._begin()
    regrouped = receiver._write_groups(third.manifest.tensors)
    assert regrouped is not first and regrouped == first
    receiver.apply(third)
    assert receiver.state.version == "v1"
    assert all(np.array_equal(_held(module)[n], target[n]) for n in NAMES)


def test_the_receiver_keeps_no_manifest_after_an_apply_a_noop_or_a_refused_prepare(tmp_path: Path) -> None:
    """The version held keeps its table only: after an apply, a no-op apply or prepare, and a prepare that
    refuses, nothing of the receiver's keeps the delta's manifest (its items and sections) alive."""
    import gc

    from dcr_cli.delta import reader

    base, _target, delta = _versions(tmp_path, 2, 0.05, np.uint16)
    location, digest = delta.url, delta.id
    receiver = EngineReceiver(loaded(Layer, base))

    def pinned(which: str = digest) -> bool:
        gc.collect()
        return reader._parsed.get(which) is not None

    receiver.apply(delta)
    del delta
    assert not pinned()
    assert receiver.apply(Delta.open(location)).status == "noop"
    assert not pinned()
    assert receiver.prepare(Delta.open(location)) == "noop"
    assert not pinned()
    # At another base, a prepare refuses: nothing of it is kept either.
    diff(tmp_path / "c0", tmp_path / "c0", tmp_path / "noop", base_version="v0", target_version="v0", workers=1)
    other = Delta.open(tmp_path / "noop")
    with pytest.raises(IncompatibleError):
        receiver.prepare(other)
    refused = other.id
    del other
    assert not pinned(refused)


def test_a_new_table_of_the_same_tensors_keeps_their_placements_only_while_the_storages_stay(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``trace_all`` of a steady refit's next table (the same tensors, new entries) keeps every placement
    without checking each tensor, where every parameter's storage is where it was; a parameter given a
    new storage since has its tensors traced again, and the apply after it is exact."""
    base, target, delta = _versions(tmp_path, 3, 0.05, np.uint16)
    module = loaded(Layer, base)
    receiver = EngineReceiver(module)
    traced: list[set[str]] = []
    real = engine_apply.trace_placements

    def counting(model, missing):  # type: ignore[no-untyped-def]
        traced.append(set(missing))
        return real(model, missing)

    monkeypatch.setattr(engine_apply, "trace_placements", counting)
    receiver._begin()
    receiver.trace_all(delta.manifest.tensors)
    assert traced == [set(NAMES)]
    kept = dict(receiver._placements)

    def same_tensors_new_entries() -> dict[str, TensorEntry]:
        return {n: dataclasses.replace(e) for n, e in delta.manifest.tensors.items()}

    receiver._begin()
    receiver.trace_all(same_tensors_new_entries())
    assert len(traced) == 1 and all(receiver._placements[n] is kept[n] for n in NAMES)

    module.u = torch.nn.Parameter(module.u.data.clone(), requires_grad=False)  # same bits, new storage
    receiver._begin()
    receiver.trace_all(same_tensors_new_entries())
    assert traced[1:] == [{"a"}]
    assert all(receiver._placements[n] is kept[n] for n in NAMES if n != "a")
    assert receiver.apply(delta).status == "applied"
    assert all(np.array_equal(_held(module)[n], target[n]) for n in NAMES)
