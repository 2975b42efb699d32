"""Two versions of a small checkpoint of random bits and the delta between them, for the engine
receiver's tests on plain torch modules (test_vllm_joined_pass, test_engine_overlay_digests)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch
from safetensors.torch import save_file

from dcr_cli.delta.reader import Delta
from dcr_cli.produce import diff

TORCH = {np.uint16: torch.bfloat16, np.uint32: torch.float32}
M = TypeVar("M", bound=torch.nn.Module)
SIGNED = {np.uint16: np.int16, np.uint32: np.int32}


def as_tensors(table: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """Unsigned bits as BF16 (16-bit) or F32 (32-bit) tensors, bit for bit."""
    uint = next(iter(table.values())).dtype.type
    return {n: torch.from_numpy(x.view(SIGNED[uint])).view(TORCH[uint]) for n, x in table.items()}


def loaded(make: Callable[[torch.dtype], M], table: dict[str, np.ndarray]) -> M:
    """A module made for ``table``'s dtype (``make(dtype)``), loaded through its own ``load_weights``."""
    uint = next(iter(table.values())).dtype.type
    module = make(TORCH[uint])
    module.load_weights(list(as_tensors(table).items()))  # type: ignore[operator]
    return module


def random_versions(
    tmp: Path, shapes: Mapping[str, tuple[int, ...]], seed: int, rate: float, uint: type
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], Delta]:
    """A base of random bits (NaN payloads and -0 among them) and a target that changes each element
    with probability ``rate`` (and at least one element: a delta with nothing in it is a no-op, which
    tests nothing here), saved as ``tmp/c0`` and ``tmp/c1``; the delta ``tmp/d`` between them."""
    rng = np.random.default_rng(seed)
    top = np.iinfo(uint).max
    base = {name: rng.integers(0, top, shape, dtype=uint, endpoint=True) for name, shape in shapes.items()}
    target = {n: x.copy() for n, x in base.items()}
    for x in target.values():
        hit = rng.random(x.shape) < rate
        x[hit] ^= rng.integers(1, top, size=int(hit.sum()), dtype=uint, endpoint=True)
    if all(np.array_equal(base[n], target[n]) for n in base):
        first = next(iter(target.values())).reshape(-1)
        first[rng.integers(0, first.size)] ^= 1
    for label, table in (("c0", base), ("c1", target)):
        (tmp / label).mkdir()
        save_file(as_tensors(table), str(tmp / label / "model.safetensors"))
    diff(tmp / "c0", tmp / "c1", tmp / "d", base_version="v0", target_version="v1", workers=1)
    return base, target, Delta.open(str(tmp / "d"))
