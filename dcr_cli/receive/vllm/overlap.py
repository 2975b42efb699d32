"""Do two strided views of one storage share an element? (receiver-vllm.md §3, ``_aliased``)

A box is ``(offset, sizes, strides)`` in elements, as a loader's copy destination is
(``Destination.dst_*``). Two boxes share an element where ``offA + sum a_i sA_i == offB + sum b_j
sB_j`` for some in-range index tuples: grouping the dimensions by stride, ``offA - offB = sum_s k_s
s`` with ``k_s`` the difference of the two boxes' index sums along stride ``s``, which takes every
integer in ``[-(nA_s - 1), nB_s - 1]`` (``n_s - 1`` summed over a box's dims of that stride). The
equation is solved by a depth-first search over the strides in descending order, each level
trying only the ``k`` that leave a remainder the smaller strides can still reach: for the views a
loader makes (slices, steps, transposes of a parameter: each stride exceeds what the smaller ones
span) that is one or two candidates per level. Exact when it finishes; past a node budget it
answers "overlap", which only costs a prediction (conservative), never a wrong bit.
"""

from __future__ import annotations

from math import gcd

Box = tuple[int, tuple[int, ...], tuple[int, ...]]  # (offset, sizes, strides), in elements

# Search nodes per test before answering "overlap" (a few milliseconds of Python).
NODE_BUDGET = 20_000


class _Exhausted(Exception):
    pass


def box_span(box: Box) -> tuple[int, int] | None:
    """``[lo, hi)`` of the storage elements the box spans; None when it has no element."""
    offset, sizes, strides = box
    if any(n == 0 for n in sizes):
        return None
    lo = hi = offset
    for n, s in zip(sizes, strides, strict=True):
        reach = (n - 1) * s
        lo, hi = (lo + reach, hi) if reach < 0 else (lo, hi + reach)
    return lo, hi + 1


def _normal(box: Box) -> tuple[int, dict[int, int]]:
    """(lowest offset, stride -> summed n - 1) with positive strides; size-1 and stride-0 dims dropped."""
    offset, sizes, strides = box
    reach: dict[int, int] = {}
    for n, s in zip(sizes, strides, strict=True):
        if n <= 1 or s == 0:
            continue
        if s < 0:
            offset, s = offset + (n - 1) * s, -s
        reach[s] = reach.get(s, 0) + n - 1
    return offset, reach


def _solve(target: int, dims: list[tuple[int, int, int]], nonzero: bool, budget: int) -> bool:
    """Is ``target == sum k_i s_i`` for ``(s_i, lo_i, hi_i)`` in ``dims``, ``lo_i <= k_i <= hi_i``
    (and some ``k_i != 0`` where ``nonzero``)? Raises _Exhausted past ``budget`` nodes."""
    dims = sorted(dims, key=lambda d: -d[0])
    low = [0] * (len(dims) + 1)  # the least and most the dims from i on can sum to
    high = [0] * (len(dims) + 1)
    for i in range(len(dims) - 1, -1, -1):
        s, lo, hi = dims[i]
        low[i], high[i] = low[i + 1] + lo * s, high[i + 1] + hi * s
    nodes = 0

    def search(i: int, rest: int, moved: bool) -> bool:
        nonlocal nodes
        if i == len(dims):
            return rest == 0 and (moved or not nonzero)
        nodes += 1
        if nodes > budget:
            raise _Exhausted
        s, lo, hi = dims[i]
        first = max(lo, -((high[i + 1] - rest) // s))  # ceil((rest - high) / s)
        last = min(hi, (rest - low[i + 1]) // s)
        return any(search(i + 1, rest - k * s, moved or k != 0) for k in range(first, last + 1))

    if not low[0] <= target <= high[0]:
        return False
    return search(0, target, False)


def strided_boxes_overlap(a: Box, b: Box, budget: int = NODE_BUDGET) -> bool:
    """Whether boxes ``a`` and ``b`` (of one storage) share an element; True too where the search
    runs out of ``budget`` (conservative)."""
    span_a, span_b = box_span(a), box_span(b)
    if span_a is None or span_b is None or span_a[1] <= span_b[0] or span_b[1] <= span_a[0]:
        return False
    off_a, reach_a = _normal(a)
    off_b, reach_b = _normal(b)
    strides = sorted(reach_a.keys() | reach_b.keys())
    target = off_a - off_b
    step = 0
    for s in strides:
        step = gcd(step, s)
    if (step == 0 and target != 0) or (step and target % step):
        return False
    dims = [(s, -reach_a.get(s, 0), reach_b.get(s, 0)) for s in strides]
    try:
        return _solve(target, dims, nonzero=False, budget=budget)
    except _Exhausted:
        return True


def strided_box_self_overlaps(box: Box, budget: int = NODE_BUDGET) -> bool:
    """Whether two index tuples of ``box`` name one storage element (a stride of 0, two dims of one
    stride, or strides that fold); True too where the search runs out of ``budget``."""
    _, sizes, strides = box
    if any(n == 0 for n in sizes):
        return False
    if any(n > 1 and s == 0 for n, s in zip(sizes, strides, strict=True)):
        return True
    _, reach = _normal(box)
    if sum(1 for n in sizes if n > 1) != len(reach):  # two dims share a stride
        return True
    spanned = 0  # each stride beyond what the smaller ones span: the common case, no search
    for s in sorted(reach):
        if s <= spanned:
            break
        spanned += reach[s] * s
    else:
        return False
    try:
        return _solve(0, [(s, -n, n) for s, n in reach.items()], nonzero=True, budget=budget)
    except _Exhausted:
        return True
