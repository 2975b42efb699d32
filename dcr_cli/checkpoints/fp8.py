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


def fp8_block_quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(q as float8_e4m3fn, scale as float32 [ceil(rows/br), ceil(cols/bc)]) of a 2-D float tensor."""
    import torch

    rows, cols = w.shape
    br, bc = block
    nr, nc = scale_shape((rows, cols), block)
    x = w.to(torch.float32)
    padded = torch.zeros(nr * br, nc * bc, dtype=torch.float32)  # zero padding cannot raise an amax
    padded[:rows, :cols] = torch.where(torch.isfinite(x), x.abs(), 0.0)
    amax = padded.reshape(nr, br, nc, bc).amax(dim=(1, 3))
    scale = amax / E4M3_MAX
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    per_element = scale.repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]
    q = (x / per_element).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale


def fp8_convert(src: str, block: tuple[int, int], part: str) -> Callable[[np.ndarray], np.ndarray]:
    """Residual conversion: stored ``src`` bits of a 2-D weight -> canonical bits of ``part`` ("weight" | "scale")."""
    import torch

    from ..format.dtypes import to_torch

    source = to_torch(src)

    def convert(stored: np.ndarray) -> np.ndarray:
        w = torch.from_numpy(np.ascontiguousarray(stored)).view(source)
        q, scale = fp8_block_quantize(w, block)
        if part == "weight":
            return q.view(torch.uint8).numpy()
        return scale.view(torch.uint32).numpy().view("<u4")

    return convert
