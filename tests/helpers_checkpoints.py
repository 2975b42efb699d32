"""Tiny safetensors checkpoints for tests: any dtype, any shape, exact bit patterns.

Tensors are given as (dtype name, shape, flat unsigned-integer array of the
stored width), so every bit pattern (NaN payloads, -0.0, subnormals) can be
written exactly, including dtypes numpy cannot represent (BF16, F8).
"""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from dcr_cli.checkpoints.safetensors_dir import SafetensorsCheckpoint
from dcr_cli.format.dtypes import dtype as lookup_dtype
from dcr_cli.format.dtypes import numel

Tensors = dict[str, tuple[str, tuple[int, ...], np.ndarray]]


def write_safetensors(path: Path, tensors: Tensors, metadata: dict[str, str] | None = None) -> None:
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = metadata
    offset = 0
    for name, (dt, shape, _values) in tensors.items():
        nbytes = numel(shape) * lookup_dtype(dt).itemsize
        header[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors pads the header to 8 bytes
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for dt, shape, values in tensors.values():
            data = np.ascontiguousarray(values, dtype=lookup_dtype(dt).uint).reshape(-1)
            assert data.size == numel(shape)
            f.write(data.tobytes())


def write_checkpoint(root: Path, tensors: Tensors, shards: int = 1) -> Path:
    """A HF checkpoint dir: model.safetensors, or ``shards`` files plus model.safetensors.index.json."""
    root.mkdir(parents=True, exist_ok=True)
    if shards == 1:
        write_safetensors(root / "model.safetensors", tensors)
        return root
    names = list(tensors)
    weight_map = {}
    for k in range(shards):
        part = {n: tensors[n] for n in names[k::shards]}
        file = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        write_safetensors(root / file, part)
        weight_map.update({n: file for n in part})
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return root


def random_tensors(rng: np.random.Generator, specs: list[tuple[str, str, tuple[int, ...]]]) -> Tensors:
    """specs: (name, dtype, shape). Values are uniformly random bit patterns."""
    out: Tensors = {}
    for name, dt, shape in specs:
        uint = lookup_dtype(dt).uint
        values = rng.integers(0, np.iinfo(uint).max, size=numel(shape), dtype=uint, endpoint=True)
        out[name] = (dt, tuple(shape), values)
    return out


def mutate(rng: np.random.Generator, tensors: Tensors, rate: float, names: list[str] | None = None) -> Tensors:
    """A copy with about ``rate`` of the elements of ``names`` (default: all) given new random bits."""
    out: Tensors = {}
    for name, (dt, shape, values) in tensors.items():
        values = values.copy()
        if (names is None or name in names) and values.size:
            uint = values.dtype
            mask = rng.random(values.size) < rate
            flips = rng.integers(1, np.iinfo(uint).max, size=int(mask.sum()), dtype=uint, endpoint=True)
            values[mask] ^= flips
        out[name] = (dt, shape, values)
    return out


def read_raw(root: Path) -> dict[str, bytes]:
    """Every tensor's stored bytes, by name."""
    with SafetensorsCheckpoint(root) as ckpt:
        return {name: ckpt.view(name).tobytes() for name in ckpt.tensors}


def snapshot(root: Path) -> dict[str, bytes]:
    """Every checkpoint file's bytes (dcr's own .dcr directory excluded)."""
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and ".dcr" not in p.relative_to(root).parts
    }


def copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".dcr"))
    return dst


def record_digests(monkeypatch: Any, seen: Callable[[str], None]) -> None:
    """Call ``seen(name)`` for every tensor a receiver hashes from its files: one by one
    (``InPlaceFiles.digest``) or in batches of small ones (``digest_small_tensors``), wherever called."""
    from dcr_cli.receive.checkpoint import applier, inplace

    one, small = inplace.InPlaceFiles.digest, inplace.digest_small_tensors

    def digest(self: inplace.InPlaceFiles, name: str) -> str:
        seen(name)
        return one(self, name)

    def digest_small_tensors(files: inplace.InPlaceFiles, names: list[str]) -> list[tuple[str, str]]:
        for name in names:
            seen(name)
        return small(files, names)

    monkeypatch.setattr(inplace.InPlaceFiles, "digest", digest)
    monkeypatch.setattr(inplace, "digest_small_tensors", digest_small_tensors)
    monkeypatch.setattr(applier, "digest_small_tensors", digest_small_tensors)
