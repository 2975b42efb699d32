"""Destination.locate: the one-offset path for contiguous copies agrees with the general inversion."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dcr_cli.receive.vllm.placement import Destination


def _strides(sizes: tuple[int, ...]) -> tuple[int, ...]:
    out, step = [], 1
    for size in reversed(sizes):
        out.append(step)
        step *= size
    return tuple(reversed(out))


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(1, 5), min_size=1, max_size=3),
    st.integers(0, 40),
    st.integers(0, 40),
    st.integers(0, 2**32 - 1),
)
def test_contiguous_copies_locate_like_the_general_inversion(
    sizes: list[int], src_offset: int, dst_offset: int, seed: int
) -> None:
    shape = tuple(sizes)
    dest = Destination("p", torch.bfloat16, dst_offset, shape, _strides(shape), src_offset, shape, _strides(shape))
    assert dest.contiguous
    numel = int(np.prod(shape))
    canonical = np.sort(np.random.default_rng(seed).choice(src_offset + numel + 20, size=15, replace=True))
    fast = dest.locate(canonical)
    general = _general(dest, canonical)
    assert np.array_equal(fast[0], general[0]) and np.array_equal(fast[1], general[1])


def test_a_transposed_copy_is_not_taken_for_contiguous() -> None:
    dest = Destination("p", torch.bfloat16, 0, (3, 4), (1, 3), 0, (3, 4), (4, 1))
    assert not dest.contiguous
    hit, index = dest.locate(np.array([0, 1, 4], dtype=np.int64))
    assert hit.all() and index.tolist() == [0, 3, 1]  # canonical (0,0),(0,1),(1,0) in a column-major copy


def _general(dest: Destination, canonical: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Destination, "contiguous", property(lambda self: False))
        return dest.locate(canonical)
