"""``_blocked_copy`` (the vLLM receiver's copy between a canonical view and a transposed resident view)
copies exactly what ``Tensor.copy_`` copies, bit for bit, for permuted, sliced and stepped views."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dcr_cli.receive.vllm.apply import _blocked_copy


@st.composite
def views(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A (dst view of a larger buffer, its twin in a second buffer, src) triple of one shape."""
    ndim = draw(st.integers(1, 4))
    shape = [draw(st.integers(1, 150 if ndim <= 2 else 20)) for _ in range(ndim)]
    perm = draw(st.permutations(range(ndim)))
    step = draw(st.integers(1, 3))
    bits = torch.Generator().manual_seed(draw(st.integers(0, 2**63 - 1)))  # (drawn: a failure replays)
    base = torch.randint(
        -(2**15), 2**15, [s * (step if d == perm[-1] else 1) for d, s in enumerate(shape)], generator=bits
    )
    base = base.to(torch.int16)
    dst_buffer = base.clone()
    index = tuple(slice(None, None, step) if d == perm[-1] else slice(None) for d in range(ndim))
    dst = dst_buffer[index].permute(*perm)
    twin_buffer = base.clone()
    twin = twin_buffer[index].permute(*perm)
    src = torch.randint(-(2**15), 2**15, list(dst.shape), generator=bits).to(torch.int16)
    if draw(st.booleans()):  # a transposed source too
        src = src.transpose(0, -1).contiguous().transpose(0, -1)
    return dst, twin, src


@settings(max_examples=200, deadline=None)
@given(views())
def test_blocked_copy_equals_copy(case: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
    dst, twin, src = case
    twin.copy_(src)
    assert _blocked_copy(dst, src) is dst
    assert torch.equal(dst, twin)
    assert torch.equal(dst._base if dst._base is not None else dst, twin._base if twin._base is not None else twin)
