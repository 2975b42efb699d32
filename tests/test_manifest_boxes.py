"""Box-overlap validation of manifest items: the sweep agrees with comparing every pair, and scales."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dcr_cli.format import manifest
from dcr_cli.format.manifest import Region, _any_boxes_overlap


def _pairwise(boxes: list[Region]) -> bool:
    def overlap(a: Region, b: Region) -> bool:
        assert a.offsets is not None and a.sizes is not None and b.offsets is not None and b.sizes is not None
        axes = zip(a.offsets, a.sizes, b.offsets, b.sizes, strict=True)
        return all(ao < bo + bs and bo < ao + as_ for ao, as_, bo, bs in axes)

    return any(overlap(a, b) for a, b in itertools.combinations(boxes, 2))


@st.composite
def box_sets(draw: st.DrawFn) -> list[Region]:
    ndim = draw(st.integers(1, 3))
    dims = st.tuples(*[st.tuples(st.integers(0, 12), st.integers(1, 5))] * ndim)
    spans = draw(st.lists(dims, max_size=12))
    return [Region.box([o for o, _ in span], [s for _, s in span]) for span in spans]


@settings(max_examples=400, deadline=None)
@given(box_sets())
def test_sweep_finds_exactly_the_overlaps_pairwise_comparison_finds(boxes: list[Region]) -> None:
    assert _any_boxes_overlap(boxes) == _pairwise(boxes)


def test_a_tiling_of_many_boxes_needs_few_comparisons(monkeypatch: pytest.MonkeyPatch) -> None:
    # 64 layers x 2048 tensor-parallel column blocks: 131072 disjoint boxes of one stacked tensor.
    tiles = [Region.box([layer, 0, col * 4], [1, 8, 4]) for layer in range(64) for col in range(2048)]
    comparisons = 0
    compare = manifest._boxes_overlap

    def counted(a: object, b: object) -> bool:
        nonlocal comparisons
        comparisons += 1
        return compare(a, b)  # type: ignore[arg-type]

    monkeypatch.setattr(manifest, "_boxes_overlap", counted)
    assert not _any_boxes_overlap(tiles)
    # A box meets at most the boxes that share its span on the swept axis (64 layers); all pairs would be ~8.6e9.
    assert comparisons <= 64 * len(tiles)
    tiles.append(Region.box([63, 7, 8191], [1, 1, 1]))  # one element of the last tile, again
    assert _any_boxes_overlap(tiles)
