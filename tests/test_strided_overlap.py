"""receive/vllm/overlap: whether two strided views of one storage share an element, against brute
force (every element offset of both boxes enumerated): exact for equal strides (the Llama4 stacked
experts' two transposed halves, a weight fused along dim 1), different strides and size-1 dims;
a box's own folding (self-overlap) is never missed. Missing a real overlap would be a wrong-bits
bug (a tensor predicted while another's writes change it); a budget-limited answer is "overlap"."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from dcr_cli.receive.vllm.overlap import Box, box_span, strided_box_self_overlaps, strided_boxes_overlap


def _elements(box: Box) -> list[int]:
    offset, sizes, strides = box
    return [
        offset + sum(i * s for i, s in zip(index, strides, strict=True))
        for index in itertools.product(*(range(n) for n in sizes))
    ]


def _box(draw: st.DrawFn, dims: int, strides: tuple[int, ...] | None = None) -> Box:
    sizes = tuple(draw(st.integers(0 if draw(st.booleans()) and draw(st.booleans()) else 1, 4)) for _ in range(dims))
    if strides is None:
        strides = tuple(draw(st.integers(0, 12)) for _ in range(dims))
    return draw(st.integers(0, 40)), sizes, strides


@st.composite
def _pairs(draw: st.DrawFn) -> tuple[Box, Box]:
    dims = draw(st.integers(1, 3))
    a = _box(draw, dims)
    if draw(st.booleans()):  # equal strides: different offsets and sizes
        return a, _box(draw, dims, a[2])
    return a, _box(draw, draw(st.integers(1, 3)))


@settings(max_examples=600, deadline=None)
@given(pair=_pairs())
def test_two_boxes_overlap_exactly_when_they_share_an_element(pair: tuple[Box, Box]) -> None:
    a, b = pair
    shared = bool(set(_elements(a)) & set(_elements(b)))
    assert strided_boxes_overlap(a, b) == shared
    assert strided_boxes_overlap(b, a) == shared


@settings(max_examples=400, deadline=None)
@given(data=st.data())
def test_a_box_folds_onto_itself_exactly_when_two_of_its_indices_name_one_element(data: st.DataObject) -> None:
    box = _box(data.draw, data.draw(st.integers(1, 3)))
    elements = _elements(box)
    assert strided_box_self_overlaps(box) == (len(set(elements)) < len(elements))


@settings(max_examples=200, deadline=None)
@given(pair=_pairs())
def test_a_box_spans_its_elements(pair: tuple[Box, Box]) -> None:
    for box in pair:
        elements = _elements(box)
        assert box_span(box) == ((min(elements), max(elements) + 1) if elements else None)


def test_the_stacked_experts_halves_and_dim1_fused_views_do_not_overlap_and_a_shared_row_does() -> None:
    experts, inter, hidden = 4, 6, 5  # w13 (E, 2I, H) filled by two transposed views of (E, H, 2I)
    gate = (0, (experts, hidden, inter), (2 * inter * hidden, 1, hidden))
    up = (inter * hidden, (experts, hidden, inter), (2 * inter * hidden, 1, hidden))
    assert not strided_boxes_overlap(gate, up)
    rows, c1, c2 = 7, 3, 5  # param (R, C1 + C2), views [:, :C1] and [:, C1:]
    left, right = (0, (rows, c1), (c1 + c2, 1)), (c1, (rows, c2), (c1 + c2, 1))
    assert not strided_boxes_overlap(left, right)
    assert strided_boxes_overlap(left, (c1 - 1, (rows, c2), (c1 + c2, 1)))  # one column too far left
    assert not strided_box_self_overlaps(gate) and strided_box_self_overlaps((0, (2, 3), (1, 1)))


def test_a_search_past_its_budget_answers_overlap() -> None:
    a = (0, (50, 50, 50), (101, 103, 107))
    b = (1, (50, 50, 50), (101, 103, 107))
    assert strided_boxes_overlap(a, b, budget=1)
