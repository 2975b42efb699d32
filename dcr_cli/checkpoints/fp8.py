"""FP8 block quantization (DeepSeek-V3 style ``weight`` + ``weight_scale_inv``), a residual conversion.

Normative text: format_spec/producers.md §4.1. Per block of ``block`` = (rows, cols)
elements of a 2-D weight (edge blocks are partial, never padded into the output):

- ``amax`` = max |w| over the block's finite elements, in float32 (0 if none);
- ``scale`` = float32(amax / 448); where that is 0 (all-zero block, or underflow), ``scale`` = 1;
- ``q`` = clamp(float32(w) / scale, -448, 448) cast to ``float8_e4m3fn`` by torch
  (round to nearest, ties to even). ±Inf saturates to ±448 and NaN stays NaN (neither
  counts in the block's amax), so a diverged weight still shows on the receiver.

The stored ``weight_scale_inv`` is ``scale`` (what a receiver multiplies ``q`` by).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

E4M3_MAX = 448.0
DEFAULT_BLOCK = (128, 128)


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    rows, cols = shape
    return (-(-rows // block[0]), -(-cols // block[1]))


# Source elements quantized at once: the float32 temporaries of one band stay a few tens of MB.
BAND_ELEMENTS = 1 << 21


def fp8_block_quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(q as float8_e4m3fn, scale as float32 [ceil(rows/br), ceil(cols/bc)]) of a 2-D float tensor.

    Quantized in bands of whole block rows: a block never spans two bands, so the result is the
    same as quantizing the whole tensor at once, with float32 temporaries of one band only.
    """
    import torch

    rows, cols = w.shape
    br = block[0]
    nr, nc = scale_shape((rows, cols), block)
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    scale = torch.empty(nr, nc, dtype=torch.float32)
    step = br * max(1, BAND_ELEMENTS // max(1, br * cols))
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        q[r0:r1], scale[r0 // br : -(-r1 // br)] = _quantize_band(w[r0:r1], block)
    return q, scale


def _quantize_band(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``fp8_block_quantize`` of rows that start at a block row (the last band may be partial)."""
    import torch

    rows, cols = w.shape
    br, bc = block
    nr, nc = scale_shape((rows, cols), block)
    x = w.to(torch.float32)
    if (nr * br, nc * bc) != (rows, cols):  # partial edge blocks: zero padding cannot raise an amax
        padded = torch.zeros(nr * br, nc * bc, dtype=torch.float32)
        padded[:rows, :cols] = x
        x = padded
    blocks = x.view(nr, br, nc, bc)
    magnitude = x.abs()
    magnitude.masked_fill_(~torch.isfinite(x), 0.0)  # NaN and Inf do not count in the amax
    amax = magnitude.view(nr, br, nc, bc).amax(dim=(1, 3))
    del magnitude
    scale = amax / E4M3_MAX
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    # Each element divided by its block's scale: the same float32 division as with a per-element copy.
    ratio = blocks / scale.view(nr, 1, nc, 1)
    q = ratio.clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(nr * br, nc * bc)[:rows, :cols]
    return q, scale


class Fp8Quantizer:
    """The joint residual conversion of one fp8 weight: stored bits -> (weight bits, scale bits).

    An fp8 weight and its ``weight_scale_inv`` come from one quantization of the same source; the
    diff engine calls this once per band of ``band_rows``-multiple source rows for both outputs.
    """

    def __init__(self, src: str, block: tuple[int, int]) -> None:
        self.src, self.block = src, block
        self.band_rows = block[0]

    def __call__(self, stored: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        import torch

        from ..format.dtypes import to_torch

        w = torch.from_numpy(np.ascontiguousarray(stored)).view(to_torch(self.src))
        q, scale = fp8_block_quantize(w, self.block)
        return q.view(torch.uint8).numpy(), scale.view(torch.uint32).numpy().view("<u4")


class Fp8Part:
    """One output ("weight" or "scale") of an ``Fp8Quantizer``, as a residual conversion of its own."""

    def __init__(self, joint: Fp8Quantizer, part: str) -> None:
        if part not in ("weight", "scale"):
            raise ValueError(f"fp8 part must be weight or scale, not {part!r}")
        self.joint, self.index = joint, (0 if part == "weight" else 1)
        self.band_rows = joint.band_rows

    def __call__(self, stored: np.ndarray) -> np.ndarray:
        return self.joint(stored)[self.index]


def fp8_convert(
    src: str, block: tuple[int, int], part: str, joint: Fp8Quantizer | None = None
) -> Callable[[np.ndarray], np.ndarray]:
    """Residual conversion: stored ``src`` bits of a 2-D weight -> canonical bits of ``part`` ("weight" | "scale").

    Pass the same ``joint`` for a weight and its scale, so that a diff quantizes once for both.
    """
    return Fp8Part(joint or Fp8Quantizer(src, block), part)
