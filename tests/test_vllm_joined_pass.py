"""The engine receiver's joined first pass (``EngineReceiver._joined_pass``): a chunk's small items
into one parameter are decoded, gathered and checked together, and keep exactly what the per-item
path keeps; anything it refuses goes one by one, with the per-item path's outcome and message.

A plain torch module stands in for an MoE layer (as in test_vllm_write_batches): per-expert
checkpoint tensors ``e0..e5`` that its loader copies into one stacked parameter ``w``, and ``a``
(first in the manifest) into a parameter ``u`` of its own.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from engine_versions import as_tensors, loaded, random_versions
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from manifest_text import manifest_v1
from safetensors.torch import save_file

from dcr_cli.delta.reader import Delta
from dcr_cli.errors import IncompatibleError
from dcr_cli.produce import diff
from dcr_cli.receive.vllm import apply as engine_apply
from dcr_cli.receive.vllm.apply import EngineReceiver, Prepared

E, R, C = 6, 32, 32


class Experts(torch.nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(E, R, C, dtype=dtype), requires_grad=False)
        self.u = torch.nn.Parameter(torch.zeros(R, C, dtype=dtype), requires_grad=False)

    def load_weights(self, weights):  # type: ignore[no-untyped-def]
        for name, t in weights:
            (self.u.data if name == "a" else self.w.data[int(name[1:])]).copy_(t)


def _versions(tmp: Path, seed: int, rate: float, uint: type = np.uint16) -> tuple[dict, dict, Delta]:
    return random_versions(tmp, {name: (R, C) for name in ["a", *(f"e{i}" for i in range(E))]}, seed, rate, uint)


def _bits(module: Experts) -> dict[str, np.ndarray]:
    return {n: p.detach().view(torch.uint8).numpy().copy() for n, p in module.named_parameters()}


def _staged(receiver: EngineReceiver, delta: Delta) -> dict[int, Prepared]:
    """Prepare ``delta`` and keep a copy of what its first pass kept, per item (before the write
    batches empty the small items)."""
    kept: dict[int, Prepared] = {}
    real = EngineReceiver._write_batches

    def keep(self, delta, prepared):  # type: ignore[no-untyped-def]
        for k, p in prepared.items():
            assert p.new is not None and len(p.located) == 1
            at = p.located[0]
            copy = engine_apply.Located(at.dest, at.hit, at.index.copy(), at.flat)
            kept[k] = Prepared(None, [copy], p.count, new=p.new.copy(), ready=p.ready)
        return real(self, delta, prepared)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(EngineReceiver, "_write_batches", keep)
        assert receiver.prepare(delta) == "apply"
    return kept


def _joined_calls(mp: pytest.MonkeyPatch) -> list[tuple[int, int | None]]:
    """Record each ``_joined_items`` call: (items asked, items kept or None where refused)."""
    calls: list[tuple[int, int | None]] = []
    real = engine_apply._joined_items

    def counting(delta, members, flat):  # type: ignore[no-untyped-def]
        got = real(delta, members, flat)
        calls.append((len(members), None if got is None else len(got)))
        return got

    mp.setattr(engine_apply, "_joined_items", counting)
    return calls


def _check_joined_like_one_by_one(tmp: Path, seed: int, rate: float, uint: type) -> None:
    base, target, delta = _versions(tmp, seed, rate, uint)
    # (a tensor changed almost everywhere is sent whole, a replace item: those go one by one)
    experts = [k for k, item in enumerate(delta.manifest.items) if item.tensor != "a" and item.op != "replace"]
    with pytest.MonkeyPatch.context() as mp:
        calls = _joined_calls(mp)
        joined_module = loaded(Experts, base)
        joined_receiver = EngineReceiver(joined_module)
        joined = _staged(joined_receiver, delta)
    # w's sparse items, together; a alone in u is not joined
    assert calls == ([(len(experts), len(experts))] if len(experts) >= 2 else [])
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(engine_apply, "_joined_items", lambda delta, members, flat: None)
        one_module = loaded(Experts, base)
        one = _staged(EngineReceiver(one_module), delta)
    assert joined.keys() == one.keys() == set(range(len(delta.manifest.items)))
    for k in joined:
        a, b = joined[k], one[k]
        assert a.ready and b.ready and a.count == b.count
        assert a.located[0].dest == b.located[0].dest
        assert np.array_equal(a.located[0].index, b.located[0].index)
        assert a.located[0].index.dtype == b.located[0].index.dtype
        assert a.new is not None and b.new is not None
        assert np.array_equal(a.new, b.new) and a.new.dtype == b.new.dtype
    report = joined_receiver.apply(Delta.open(delta.url))
    assert report.status == "applied"
    assert report.written_elements == sum(item.changed_elements for item in delta.manifest.items)
    want = _bits(loaded(Experts, target))
    got = _bits(joined_module)
    assert all(np.array_equal(got[n], want[n]) for n in want)
    assert joined_receiver.verify(delta.manifest.tensors)["mismatched"] == []


def test_the_joined_pass_keeps_what_the_items_one_by_one_keep_and_applies_exactly(tmp_path: Path) -> None:
    _check_joined_like_one_by_one(tmp_path, seed=1, rate=0.05, uint=np.uint16)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 2**32 - 1),
    rate=st.sampled_from([0.001, 0.01, 0.2, 0.7, 1.0]),
    uint=st.sampled_from([np.uint16, np.uint32]),
)
def test_joined_equals_one_by_one_for_any_change(seed: int, rate: float, uint: type) -> None:
    """Any rate (an expert left unchanged, every element changed, long gaps that escape), BF16 and F32
    with any bits (NaN payloads, -0): the joined pass keeps the same storage indices and bits."""
    with tempfile.TemporaryDirectory() as tmp:
        _check_joined_like_one_by_one(Path(tmp), seed, rate, uint)


@pytest.mark.parametrize("op", ["xor", "overwrite"])
def test_an_item_not_at_its_pre_image_refuses_the_delta_as_one_by_one_and_writes_nothing(
    tmp_path: Path, op: str
) -> None:
    """A weight changed behind dcr's back at one of e3's positions: the joined pass refuses its
    parameter, the per-item path names the item, nothing is written and no version recorded. Also
    where e3's items overwrite (its target digest would then hold whatever was at its positions)."""
    base, _, delta = _versions(tmp_path, seed=3, rate=0.05)
    if op == "overwrite":
        out = tmp_path / "overwrite"
        diff(tmp_path / "c0", tmp_path / "c1", out, base_version="v0", target_version="v1", workers=1, overwrite=["e*"])
        delta = Delta.open(str(out))
    assert {item.op for item in delta.manifest.items if item.tensor.startswith("e")} == {op}
    module = loaded(Experts, base)
    receiver = _at_v0_with_e3_changed(tmp_path, module, delta)
    before = _bits(module)
    with pytest.MonkeyPatch.context() as mp:
        calls = _joined_calls(mp)
        with pytest.raises(IncompatibleError, match=r"'e3' .* is not at the delta's pre-image"):
            receiver.prepare(delta)
    assert calls == [(E, None)]
    after = _bits(module)
    assert all(np.array_equal(after[n], before[n]) for n in before)
    assert receiver.state.version == "v0" and receiver.state.applying is None


def test_under_a_tight_budget_the_same_items_are_kept_as_one_by_one(tmp_path: Path) -> None:
    """The budget keeps items in the chunk's order, joined or not: ``a`` (first, alone in ``u``) and
    then as many experts as fit, the same ones either way."""
    base, _, delta = _versions(tmp_path, seed=5, rate=0.05)
    kept = {}
    for joined in (True, False):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(engine_apply, "PREPARED_BYTES", 700)
            if not joined:
                mp.setattr(engine_apply, "_joined_items", lambda delta, members, flat: None)
            kept[joined] = _staged(EngineReceiver(loaded(Experts, base)), delta)
    tensors = [delta.manifest.items[k].tensor for k in sorted(kept[True])]
    assert tensors[0] == "a" and 1 < len(tensors) < E + 1  # the budget binds
    assert kept[True].keys() == kept[False].keys()


def test_a_refused_group_reads_its_sections_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The sections a refused group took from the chunk's read are given back: its items decode one by
    one from them, without reading the delta again."""
    base, _, delta = _versions(tmp_path, seed=6, rate=0.05)
    monkeypatch.setattr(engine_apply, "decode_joined", lambda *args: None)  # every group refused
    reads: list[int] = []
    real = Delta._read_range

    def counting(self, block, start, end, what):  # type: ignore[no-untyped-def]
        reads.append(end - start)
        return real(self, block, start, end, what)

    monkeypatch.setattr(Delta, "_read_range", counting)
    assert EngineReceiver(loaded(Experts, base)).prepare(delta) == "apply"
    assert sum(reads) == sum(item.data.length for item in delta.manifest.items)  # each section once


def test_the_joined_pass_sets_every_field_it_makes_without_init() -> None:
    """``_joined_checked`` builds Located and Prepared without their ``__init__`` (a call per item costs
    the GIL tens of milliseconds at 20k expert items): it must set every field they have."""
    from dataclasses import fields

    assert {f.name for f in fields(engine_apply.Located)} == {"dest", "hit", "index", "flat"}
    assert {f.name for f in fields(Prepared)} == {
        "values", "located", "count", "current", "digest", "new", "canonical", "ready", "shares",
    }  # fmt: skip


@pytest.mark.parametrize("joined", [True, False])
def test_an_xor_item_with_pre_and_post_swapped_is_refused_joined_or_not(tmp_path: Path, joined: bool) -> None:
    """A re-signed manifest that swaps one XOR item's ``pre`` and ``post``: its values still lead to the
    target, so e3's target digest would hold, but the manifest contradicts itself and is refused, with
    nothing written, as the per-item path and the on-disk receiver refuse it."""
    base, _, delta = _versions(tmp_path, seed=3, rate=0.05)
    out = tmp_path / "forged"
    shutil.copytree(Path(delta.url) / "blocks", out / "blocks")
    m = manifest_v1(Path(delta.url), rewrite=False)
    (e3,) = [it for it in m["items"] if it["tensor"] == "e3"]
    assert e3["op"] == "xor"
    e3["pre"], e3["post"] = e3["post"], e3["pre"]
    (out / "manifest.json").write_text(json.dumps(m))
    module = loaded(Experts, base)
    receiver = EngineReceiver(module)
    diff(tmp_path / "c0", tmp_path / "c0", tmp_path / "noop", base_version="v0", target_version="v0", workers=1)
    receiver.apply(Delta.open(str(tmp_path / "noop")))
    before = _bits(module)
    with pytest.MonkeyPatch.context() as mp:
        if not joined:
            mp.setattr(engine_apply, "_joined_items", lambda delta, members, flat: None)
        with pytest.raises(IncompatibleError, match="pre-image"):
            receiver.apply(Delta.open(str(out)))
    after = _bits(module)
    assert all(np.array_equal(after[n], before[n]) for n in before)
    assert receiver.state.version == "v0" and receiver.state.applying is None


def _at_v0_with_e3_changed(tmp_path: Path, module: Experts, delta: Delta) -> EngineReceiver:
    """A receiver recorded at v0 (a no-op delta fingerprints it), then one of e3's elements that the
    delta changes flipped behind dcr's back."""
    receiver = EngineReceiver(module)
    diff(tmp_path / "c0", tmp_path / "c0", tmp_path / "noop", base_version="v0", target_version="v0", workers=1)
    receiver.apply(Delta.open(str(tmp_path / "noop")))
    assert receiver.state.version == "v0"
    (e3,) = [item for item in delta.manifest.items if item.tensor == "e3"]
    first = int(delta.decode(e3).positions[0])  # type: ignore[index]
    module.w.data[3].view(-1).view(torch.int16)[first] ^= 1
    return receiver


@pytest.mark.parametrize("budget", [0, 700])
@pytest.mark.parametrize("staged", [False, True])
def test_items_the_budget_leaves_out_are_checked_before_the_first_write(
    tmp_path: Path, budget: int, staged: bool
) -> None:
    """An item the first pass does not keep (the budget binds) is checked all the same, before any
    write, with or without a prepare before the update."""
    base, _, delta = _versions(tmp_path, seed=3, rate=0.05)
    module = loaded(Experts, base)
    receiver = _at_v0_with_e3_changed(tmp_path, module, delta)
    before = _bits(module)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(engine_apply, "PREPARED_BYTES", budget)
        with pytest.raises(IncompatibleError, match=r"'e3' .* is not at the delta's pre-image"):
            if staged:
                receiver.prepare(delta)
            receiver.apply(Delta.open(delta.url))
    after = _bits(module)
    assert all(np.array_equal(after[n], before[n]) for n in before)
    assert receiver.state.version == "v0" and receiver.state.applying is None


class ExpertsAndY(Experts):
    """``Experts`` and ``y``, a row loaded into a parameter ``v`` of its own."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__(dtype)
        self.v = torch.nn.Parameter(torch.zeros(1, C, dtype=dtype), requires_grad=False)

    def load_weights(self, weights):  # type: ignore[no-untyped-def]
        rest = []
        for name, t in weights:
            if name == "y":
                self.v.data.copy_(t)
            else:
                rest.append((name, t))
        super().load_weights(rest)


def test_items_the_update_reads_again_after_prepare_are_checked_again(tmp_path: Path) -> None:
    """prepare proves e3 and batches its writes; then ``v`` is rebound onto e5's first row (the same
    bits: ``y`` equals it), so e5 shares storage, the batches are dropped and their items go through
    the update's first pass again, after e3 was changed behind dcr's back. prepare's prediction says
    nothing about the bits read now: the update checks e3's item again and refuses, writing nothing."""
    rng = np.random.default_rng(8)
    base = {n: rng.integers(0, 2**16, (R, C), dtype=np.uint16) for n in ["a", *(f"e{i}" for i in range(E))]}
    base["y"] = base["e5"][:1].copy()
    target = {n: x.copy() for n, x in base.items()}
    for n in ["a", *(f"e{i}" for i in range(E))]:
        hit = rng.random((R, C)) < 0.05
        if n == "e5":
            hit[0] = False  # (y's row stays as it is)
        target[n][hit] ^= rng.integers(1, 2**16, int(hit.sum()), dtype=np.uint16)
    for label, table in (("c0", base), ("c1", target)):
        (tmp_path / label).mkdir()
        save_file(as_tensors(table), str(tmp_path / label / "model.safetensors"))
    diff(tmp_path / "c0", tmp_path / "c1", tmp_path / "d", base_version="v0", target_version="v1", workers=1)
    delta = Delta.open(str(tmp_path / "d"))
    module = loaded(ExpertsAndY, base)
    receiver = EngineReceiver(module)
    diff(tmp_path / "c0", tmp_path / "c0", tmp_path / "noop", base_version="v0", target_version="v0", workers=1)
    receiver.apply(Delta.open(str(tmp_path / "noop")))
    assert receiver.prepare(delta) == "apply"
    assert receiver._staged is not None and receiver._staged.batches and "e3" in receiver._staged.predicted
    module.v = torch.nn.Parameter(module.w.data[5][:1], requires_grad=False)
    (e3,) = [item for item in delta.manifest.items if item.tensor == "e3"]
    module.w.data[3].view(-1).view(torch.int16)[int(delta.decode(e3).positions[0])] ^= 1  # type: ignore[index]
    before = _bits(module)
    with pytest.raises(IncompatibleError, match=r"'e3' .* is not at the delta's pre-image"):
        receiver.apply(Delta.open(delta.url))
    after = _bits(module)
    assert all(np.array_equal(after[n], before[n]) for n in before)
    assert receiver.state.version == "v0"


def test_an_items_error_comes_before_another_tensors_failed_prediction(tmp_path: Path) -> None:
    """e3 changed at a position it overwrites (no trace in its target) and e4 where no item of it
    writes (only e4's prediction can see that): the items are checked first, and e3's item names the
    cause."""
    base, _, _ = _versions(tmp_path, seed=3, rate=0.05)
    out = tmp_path / "overwrite"
    diff(tmp_path / "c0", tmp_path / "c1", out, base_version="v0", target_version="v1", workers=1, overwrite=["e*"])
    delta = Delta.open(str(out))
    module = loaded(Experts, base)
    receiver = _at_v0_with_e3_changed(tmp_path, module, delta)
    (e4,) = [item for item in delta.manifest.items if item.tensor == "e4"]
    untouched = np.setdiff1d(np.arange(R * C), np.asarray(delta.decode(e4).positions))[0]
    module.w.data[4].view(-1).view(torch.int16)[int(untouched)] ^= 1
    with pytest.raises(IncompatibleError, match=r"'e3' .* is not at the delta's pre-image"):
        receiver.prepare(delta)


def _held(arrays: list[np.ndarray]) -> int:
    """The bytes the buffers behind ``arrays`` hold, each buffer once."""
    buffers: dict[int, int] = {}
    for a in arrays:
        while isinstance(a.base, np.ndarray):
            a = a.base
        buffers[id(a)] = a.nbytes
    return sum(buffers.values())


@pytest.mark.parametrize("budget", [700, 1 << 30])
def test_what_prepare_keeps_holds_no_more_memory_than_it_counts(tmp_path: Path, budget: int) -> None:
    """Joined items hold slices of their group's buffers: where the budget leaves some out, or a write
    batch copies some, the rest hold copies of their own, so the budget counts what is held."""
    base, _, delta = _versions(tmp_path, seed=5, rate=0.05)
    receiver = EngineReceiver(loaded(Experts, base))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(engine_apply, "PREPARED_BYTES", budget)
        assert receiver.prepare(delta) == "apply"
    staged = receiver._staged
    assert staged is not None
    kept = list(staged.prepared.values())
    arrays = [a for p in kept for a in (p.new, *(at.index for at in p.located)) if a is not None]
    arrays += [a for b in staged.batches for a in (b.index, b.values)]
    counted = sum(p.nbytes for p in kept) + sum(b.index.nbytes + b.values.nbytes for b in staged.batches)
    assert _held(arrays) <= counted
