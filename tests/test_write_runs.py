"""receive/checkpoint/inplace.runs_of, how an on-disk apply cuts an item's elements into the spans it
rewrites whole: the same runs as the plain numpy definition (three passes over the index), computed
by format/kernels.run_bounds in one compiled pass."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dcr_cli.receive.checkpoint.inplace import GAP_BYTES, RUN_BYTES, Run, runs_of


def reference_runs(index: np.ndarray, local: np.ndarray | None, stride: int, itemsize: int) -> list[Run]:
    """The definition: cut between two indices more than a gap apart, in two blocks of the cap, or
    (with ``local``) in two stretches of ``stride`` region positions."""
    if index.size == 0:
        return []
    gap, cap = max(1, GAP_BYTES // itemsize), max(1, RUN_BYTES // itemsize)
    cut = (np.diff(index) > gap) | (np.diff(index // cap) != 0)
    if local is not None:
        cut |= np.diff(local // stride) != 0
    bounds = [0, *(np.flatnonzero(cut) + 1).tolist(), int(index.size)]
    return [Run(int(index[lo]), int(index[hi - 1]), lo, hi) for lo, hi in itertools.pairwise(bounds)]


@st.composite
def items(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray | None, int, int]:
    """Ascending canonical indices of one item (sparse or dense, near gap and cap boundaries), its
    ascending region positions when the region is a box, a stretch length and an element size."""
    itemsize = draw(st.sampled_from([1, 2, 4, 8]))
    gap, cap = GAP_BYTES // itemsize, RUN_BYTES // itemsize
    count = draw(st.integers(0, 400))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    step_kind = draw(st.sampled_from(["dense", "around-gap", "wide"]))
    if step_kind == "dense":
        steps = rng.integers(1, 4, count)
    elif step_kind == "around-gap":
        steps = rng.integers(gap - 2, gap + 3, count)
    else:
        steps = rng.integers(1, 3 * cap, count)
    start = draw(st.sampled_from([0, cap - 5, 7 * cap - 1, draw(st.integers(0, 10 * cap))]))
    index = start + np.cumsum(steps, dtype=np.int64)
    if draw(st.booleans()) and (index.size == 0 or index[-1] < 2**31):
        index = index.astype(np.int32)
    if not draw(st.booleans()):
        return index, None, 1, itemsize
    local = np.cumsum(rng.integers(1, 5, count)).astype(np.int64)
    stride = draw(st.integers(1, 64))
    return index, local, stride, itemsize


@settings(max_examples=300, deadline=None)
@given(items())
def test_runs_are_those_of_the_definition(case: tuple[np.ndarray, np.ndarray | None, int, int]) -> None:
    index, local, stride, itemsize = case
    got = runs_of(index, local, stride, itemsize)
    assert got == reference_runs(index, local, stride, itemsize)
    # Every element is in exactly one run, in order, and each run stays within one stretch and cap block.
    assert [i for r in got for i in range(r.lo, r.hi)] == list(range(index.size))


def test_a_dense_item_across_cap_blocks_is_cut_at_each_block() -> None:
    cap = RUN_BYTES // 2
    index = np.arange(cap - 3, 3 * cap + 3, dtype=np.int64)
    runs = runs_of(index, None, 1, 2)
    assert [(r.first, r.last) for r in runs] == [
        (cap - 3, cap - 1),
        (cap, 2 * cap - 1),
        (2 * cap, 3 * cap - 1),
        (3 * cap, 3 * cap + 2),
    ]
    assert all(r.dense for r in runs)


def test_indices_that_do_not_ascend_are_refused() -> None:
    # An item's positions ascend by construction (delta-v1 §6.1: each gap adds at least 1); a run cut
    # from indices that do not would rewrite elements outside the item, so the kernel refuses them.
    with pytest.raises(ValueError, match="strictly ascending"):
        runs_of(np.array([10, 5000, 4999], dtype=np.int64), None, 1, 2)
    with pytest.raises(ValueError, match="strictly ascending"):
        runs_of(np.array([10, 11, 9000], dtype=np.int64), np.array([0, 1, 1], dtype=np.int64), 4, 2)
