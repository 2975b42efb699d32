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


def _widening(dst: torch.dtype, n: int) -> Destination:
    return Destination("w", dst, 0, (n,), (1,), 0, (n,), (1,))


# BF16 bit patterns a float cast would not carry back: NaN payloads (quiet, signalling, negative), ±0, ±inf.
BF16_SPECIALS = [0x7FC1, 0xFFFF, 0x7F81, 0xFF80 | 0x1, 0x7FC0, 0x0000, 0x8000, 0x7F80, 0xFF80, 0x3F80, 0x0001]


def test_nan_payloads_survive_reading_bf16_back_from_an_fp32_engine() -> None:
    from dcr_cli.receive.vllm.apply import _to_canonical

    bits = np.array(BF16_SPECIALS, dtype=np.uint16)
    held = torch.from_numpy((bits.astype(np.uint32) << 16).view(np.int32))  # what the loader's widening holds
    back = _to_canonical(held, _widening(torch.float32, len(bits)), torch.bfloat16)
    assert back.dtype == torch.int16
    assert back.numpy().view(np.uint16).tolist() == bits.tolist()
    # The loader's own cast (torch's BF16 -> F32 copy_) is read back exactly too.
    loaded = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).to(torch.float32).view(torch.int32)
    assert (
        _to_canonical(loaded, _widening(torch.float32, len(bits)), torch.bfloat16).numpy().view(np.uint16).tolist()
        == bits.tolist()
    )


def test_values_no_bf16_widens_to_are_refused() -> None:
    from dcr_cli.errors import IntegrityError
    from dcr_cli.receive.vllm.apply import _to_canonical

    for pattern in (0x7FC00001, 0x3F800001):  # a NaN and a number with low bits a widening never sets
        held = torch.tensor([pattern], dtype=torch.int64).to(torch.int32)
        with pytest.raises(IntegrityError, match="widens to"):
            _to_canonical(held, _widening(torch.float32, 1), torch.bfloat16)


def test_fp16_in_an_fp32_engine_round_trips_every_number() -> None:
    from dcr_cli.receive.vllm.apply import _to_canonical

    bits = np.arange(0, 1 << 16, dtype=np.uint32).astype(np.uint16)
    exponent, mantissa = (bits >> 10) & 0x1F, bits & 0x3FF
    numbers = bits[~((exponent == 0x1F) & (mantissa != 0))]  # every F16 value but NaN
    held = torch.from_numpy(numbers.view(np.int16)).view(torch.float16).to(torch.float32).view(torch.int32)
    back = _to_canonical(held, _widening(torch.float32, len(numbers)), torch.float16)
    assert np.array_equal(back.numpy().view(np.uint16), numbers)


def test_named_resident_is_torchs_named_buffers_then_named_parameters_from_one_walk() -> None:
    """Every name of every buffer and parameter, in torch's order, shared modules and tied weights
    included: what ``{**named_buffers(remove_duplicate=False), **named_parameters(...)}`` gives, from
    one walk of the modules instead of two (an apply's pause collects it)."""
    from dcr_cli.receive.vllm.placement import named_resident

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.register_buffer("scale", torch.ones(4))
            self.register_buffer("unset", None)

    model = torch.nn.Module()
    model.embed = torch.nn.Embedding(10, 4)
    model.blocks = torch.nn.ModuleList([Block(), Block()])
    model.head = torch.nn.Linear(4, 10, bias=False)
    model.head.weight = model.embed.weight  # tied
    model.again = model.blocks[0]  # one module reachable under two names
    model.register_buffer("top", torch.zeros(2))
    want = {**dict(model.named_buffers(remove_duplicate=False)), **dict(model.named_parameters(remove_duplicate=False))}
    got = named_resident(model)
    assert list(got) == list(want) and all(got[n] is want[n] for n in want)
    assert "head.weight" in got and "again.lin.weight" in got and "blocks.0.unset" not in got
