"""The on-disk receiver's staging (receiver-checkpoint.md §4.1 step 6): the checked-first order keeps each
item's outcome, ready to write, within PREPARED_BYTES: only the changed elements, their new bits in the
storage width and 32-bit indices. Items beyond the budget are read, decoded and verified again when
written; either way the files end bit-exact, and the budget (not the model) bounds what the first pass holds.
"""

from __future__ import annotations

import tracemalloc
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from helpers_checkpoints import copy_checkpoint, read_raw, write_checkpoint

import dcr_cli
from dcr_cli.checkpoints.safetensors_dir import SafetensorsCheckpoint
from dcr_cli.delta.reader import Delta
from dcr_cli.produce import diff
from dcr_cli.receive.checkpoint import ReceiverState, applier, file_stats, read_state, write_state
from dcr_cli.receive.checkpoint.inplace import InPlaceFiles

ROWS, COLS = 256, 1024  # 256 K elements a tensor: each item is a task of its own (>= BATCH_ELEMENTS)


def bf16_pair(rng: np.random.Generator, tensors: int, rate: float) -> tuple[dict, dict]:
    """BF16 tensors and a step that moves about ``rate`` of their elements by one or two ulps."""
    t0, t1 = {}, {}
    for i in range(tensors):
        bits = (rng.standard_normal(ROWS * COLS, dtype=np.float32) * 0.02).view(np.uint32) >> 16
        old = bits.astype(np.uint16)
        new = old.copy()
        hit = rng.random(old.size) < rate
        new[hit] ^= rng.integers(1, 4, size=int(hit.sum()), dtype=np.uint16)
        t0[f"layers.{i}.w"] = ("BF16", (ROWS, COLS), old)
        t1[f"layers.{i}.w"] = ("BF16", (ROWS, COLS), new)
    return t0, t1


@pytest.fixture
def step(tmp_path: Path) -> tuple[Path, Path, Path]:
    """(v0, v1, delta): 12 BF16 tensors of 512 KiB, 3% of the elements changed."""
    t0, t1 = bf16_pair(np.random.default_rng(7), 12, 0.03)
    v0, v1 = write_checkpoint(tmp_path / "v0", t0, shards=2), write_checkpoint(tmp_path / "v1", t1, shards=2)
    diff(v0, v1, tmp_path / "delta", base_version="v0", target_version="v1")
    return v0, v1, tmp_path / "delta"


@contextmanager
def budget(nbytes: int) -> Iterator[None]:
    old = applier.PREPARED_BYTES
    applier.PREPARED_BYTES = nbytes
    try:
        yield
    finally:
        applier.PREPARED_BYTES = old


def first_pass(recv: Path, delta: Path, resuming: bool = False, workers: int = 2) -> list[applier.Prepared]:
    with SafetensorsCheckpoint(recv) as ckpt, InPlaceFiles(dict(ckpt.tensors)) as files:
        return applier.first_pass(Delta.open(delta), files, resuming, workers)


@contextmanager
def counting_prepares() -> Iterator[dict[str, int]]:
    """How often items are prepared (the first pass once each; the write pass again for those not kept)."""
    real = applier.prepare_item
    seen = {"n": 0}

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        seen["n"] += 1
        return real(*args, **kwargs)

    applier.prepare_item = counted  # type: ignore[assignment]
    try:
        yield seen
    finally:
        applier.prepare_item = real  # type: ignore[assignment]


def test_a_staged_bf16_element_costs_six_bytes_and_a_3pct_step_of_3gib_stages_whole(
    step: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    """Each kept item holds its changed elements only: 16-bit new bits and 32-bit indices (plus its runs),
    so the default budget holds a 3% step of a 3 GiB BF16 model (48 M elements) whole."""
    v0, _, delta = step
    prepared = first_pass(copy_checkpoint(v0, tmp_path / "recv"), delta)
    assert prepared and all(p.kind == "pending" and p.new is not None for p in prepared)
    for p in prepared:
        assert isinstance(p.index, np.ndarray) and p.new is not None
        assert p.index.dtype == np.int32 and p.new.dtype == np.uint16
        assert p.index.size == p.new.size == p.count
        assert p.nbytes == 6 * p.count + applier.RUN_COST * len(p.runs or ())
    per_element = sum(p.nbytes for p in prepared) / sum(p.count for p in prepared)
    assert per_element < 6.5  # the runs of a 3% step are few (one per 4 MiB stretch at most, here)
    assert per_element * 0.03 * (3 * 2**30 // 2) <= applier.PREPARED_BYTES


@pytest.mark.parametrize("kept", ["none", "some", "all"])
def test_items_beyond_the_budget_are_read_again_and_the_files_end_bit_exact(
    step: tuple[Path, Path, Path], tmp_path: Path, kept: str
) -> None:
    """A receiver whose version is hashed takes the checked-first order: with the budget forced small
    the write pass prepares again exactly the items not kept, and the bytes are the target's either way."""
    v0, v1, delta = step
    items = len(Delta.open(delta).manifest.items)
    one = max(p.nbytes for p in first_pass(copy_checkpoint(v0, tmp_path / "probe"), delta))
    nbytes = {"none": 0, "some": 5 * one, "all": applier.PREPARED_BYTES}[kept]
    recv = copy_checkpoint(v0, tmp_path / "recv")
    with budget(nbytes), counting_prepares() as seen:
        result = dcr_cli.apply(delta, into=recv, workers=2)
    assert result.steps[0].applied == items
    again = seen["n"] - items
    if kept == "none":
        assert again == items
    elif kept == "some":
        assert 0 < again < items - 3
    else:
        assert again == 0
    assert read_raw(recv) == read_raw(v1)
    assert dcr_cli.verify(recv, against=delta).ok


def test_the_budget_bounds_what_the_first_pass_holds(tmp_path: Path) -> None:
    """Peak traced memory of the first pass: with a 1 MiB budget it stays within the budget plus the items
    in flight (2 x workers tasks, a few times an item's bytes each), far below what keeping every item
    (about 19 MiB here) takes."""
    t0, t1 = bf16_pair(np.random.default_rng(11), 80, 0.15)
    v0, v1 = write_checkpoint(tmp_path / "v0", t0, shards=2), write_checkpoint(tmp_path / "v1", t1, shards=2)
    diff(v0, v1, tmp_path / "delta", base_version="v0", target_version="v1")
    recv = copy_checkpoint(v0, tmp_path / "recv")
    tensor = ROWS * COLS * 2
    delta = Delta.open(tmp_path / "delta")

    def peak(nbytes: int) -> tuple[int, int]:
        with budget(nbytes), SafetensorsCheckpoint(recv) as ckpt, InPlaceFiles(dict(ckpt.tensors)) as files:
            applier.first_pass(delta, files, False, 2)  # warm: decoder contexts, compiled kernels
            tracemalloc.start()
            try:
                prepared = applier.first_pass(delta, files, False, 2)
                return tracemalloc.get_traced_memory()[1], sum(p.nbytes for p in prepared)
            finally:
                tracemalloc.stop()

    small, kept_small = peak(1 << 20)
    whole, kept_whole = peak(applier.PREPARED_BYTES)
    assert kept_small <= 1 << 20 < 16 << 20 < kept_whole
    assert whole >= kept_whole
    assert small <= (1 << 20) + 16 * tensor < kept_whole


def test_a_torn_item_stages_only_the_elements_still_to_write(step: tuple[Path, Path, Path], tmp_path: Path) -> None:
    """Resuming with a tensor half written (its item torn): the staged form keeps only the elements that
    still differ, its runs renumbered, and the resume ends bit-exact."""
    v0, v1, delta = step
    opened = Delta.open(delta)
    m = opened.manifest
    recv = copy_checkpoint(v0, tmp_path / "recv")
    name = m.items[0].tensor
    with SafetensorsCheckpoint(recv) as ckpt:
        loc = ckpt.tensors[name]
    target = read_raw(v1)[name]
    half = loc.nbytes // 2
    with open(loc.file, "r+b") as f:  # a write cut short: the first half of the tensor at the target
        f.seek(loc.start)
        f.write(target[:half])
    (recv / ".dcr").mkdir()
    with SafetensorsCheckpoint(recv) as ckpt:
        stats = file_stats(recv, ckpt)
    applying = {
        "delta_id": opened.id,
        "base": {"version": m.base.version, "fingerprint": m.base.fingerprint},
        "target": {"version": m.target.version, "fingerprint": m.target.fingerprint},
        "url": str(delta),
    }
    write_state(recv, ReceiverState(None, None, applying, stats))
    prepared = first_pass(recv, delta, resuming=True)
    torn = [(item, p) for item, p in zip(m.items, prepared, strict=True) if p.kind == "torn"]
    assert torn
    for _item, p in torn:
        assert isinstance(p.index, np.ndarray) and p.new is not None and p.runs
        assert 0 < p.new.size < p.count and p.index.size == p.new.size
        assert p.runs[0].lo == 0 and p.runs[-1].hi == p.index.size
        assert all(a.hi == b.lo for a, b in zip(p.runs, p.runs[1:], strict=False))
        assert all(r.first <= int(p.index[r.lo]) and int(p.index[r.hi - 1]) <= r.last for r in p.runs)
    result = dcr_cli.apply(delta, into=recv, workers=2)
    assert result.steps[0].status == "resumed" and result.steps[0].repaired == len(torn)
    assert read_raw(recv) == read_raw(v1)
    state = read_state(recv)
    assert state is not None and state.version == "v1"


def test_a_batch_of_small_items_is_held_with_32_bit_patch_offsets(tmp_path: Path) -> None:
    """Small items checked as one batch (batch.py) are held for the write pass as their new bytes and 32-bit
    offsets into the batch's stretch of the files (2 + 4 bytes a changed byte, was 2 + 8): the same bytes."""
    rng = np.random.default_rng(3)
    t0 = {f"e{i:03d}": ("BF16", (24, 16), rng.integers(0, 1 << 16, 384, dtype=np.uint16)) for i in range(200)}
    t1 = {}
    for name, (dt, shape, values) in t0.items():
        new = values.copy()
        new[rng.choice(values.size, 4, replace=False)] ^= 3
        t1[name] = (dt, shape, new)
    v0, v1 = write_checkpoint(tmp_path / "v0", t0, shards=2), write_checkpoint(tmp_path / "v1", t1, shards=2)
    diff(v0, v1, tmp_path / "delta", base_version="v0", target_version="v1")
    prepared = first_pass(copy_checkpoint(v0, tmp_path / "probe"), tmp_path / "delta")
    batches = {id(p.batch): p.batch for p in prepared if p.batch is not None}
    assert batches
    for batch in batches.values():
        assert batch.patch_at is not None and batch.new is not None
        assert batch.patch_at.dtype == np.int32 and batch.nbytes == 5 * batch.new.size
    recv = copy_checkpoint(v0, tmp_path / "recv")
    dcr_cli.apply(tmp_path / "delta", into=recv, workers=2)
    assert read_raw(recv) == read_raw(v1)
