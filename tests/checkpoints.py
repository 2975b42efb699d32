"""Writing small Hugging Face-style checkpoints for tests (single file or sharded with an index)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from dcr_cli.format.dtypes import TORCH_NAMES
from dcr_cli.format.dtypes import dtype as lookup_dtype

TORCH_DTYPES = {name: getattr(torch, t) for name, t in TORCH_NAMES.items()}


def tensor_from_bits(bits: np.ndarray, dtype_name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A torch tensor whose stored bytes are exactly ``bits`` (an unsigned array of the dtype's width)."""
    uint = lookup_dtype(dtype_name).uint
    raw = torch.from_numpy(np.ascontiguousarray(bits.astype(uint, copy=False)).view(np.uint8).copy())
    return raw.view(TORCH_DTYPES[dtype_name]).reshape(shape)


def bits_of(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.uint8).numpy().copy()


def write_checkpoint(root: Path, tensors: dict[str, torch.Tensor], shards: int = 1) -> Path:
    """Write ``tensors`` as model.safetensors, or as ``shards`` files with model.safetensors.index.json."""
    root.mkdir(parents=True, exist_ok=True)
    names = sorted(tensors)
    if shards == 1:
        save_file({n: tensors[n].contiguous() for n in names}, str(root / "model.safetensors"))
        return root
    weight_map = {}
    for i in range(shards):
        part = names[i::shards]
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n].contiguous() for n in part}, str(root / fname))
        weight_map.update({n: fname for n in part})
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return root


def read_bits(root: Path) -> dict[str, bytes]:
    """Raw stored bytes of every tensor of a checkpoint directory."""
    from dcr_cli.checkpoints.safetensors_dir import SafetensorsCheckpoint

    with SafetensorsCheckpoint(root) as ckpt:
        return {name: ckpt.view(name).tobytes() for name in ckpt.tensors}


def apply_in_memory(delta_path: Path | str, base: dict[str, bytes]) -> dict[str, bytes]:
    """A deliberately simple reference applier: decode every item and patch copies of the base bytes.

    It shares no code with the receivers, so tests of the format do not trust the code they test.
    """
    from dcr_cli.delta.reader import Delta

    delta = Delta.open(delta_path)
    out = {name: bytearray(data) for name, data in base.items()}
    for item in delta.manifest.items:
        entry = delta.manifest.tensors[item.tensor]
        dt = lookup_dtype(entry.dtype)
        arr = np.frombuffer(out[item.tensor], dtype=dt.uint)
        decoded = delta.decode(item)
        local = np.arange(item.region.size) if decoded.positions is None else decoded.positions
        flat = item.region.to_canonical(local, entry.shape)
        if item.op == "xor":
            arr[flat] = arr[flat] ^ decoded.values
        else:
            arr[flat] = decoded.values
    return {name: bytes(data) for name, data in out.items()}
