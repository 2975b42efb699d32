"""A receiver's digests (the apply's proof, verify) read a file without holes through a read-only
mapping and a file with holes with pread (receiver-checkpoint.md §4.3 step 2; inplace.py's docstring):
the same digests either way, and a sparse receiver still applies and verifies."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from helpers_checkpoints import random_tensors, write_checkpoint

import dcr_cli
from dcr_cli.checkpoints.safetensors_dir import SafetensorsCheckpoint
from dcr_cli.format.digest import digest_bytes
from dcr_cli.produce import diff
from dcr_cli.receive.checkpoint.inplace import InPlaceFiles, digest_small_tensors, digest_tensors

SPECS = [
    ("big.weight", "BF16", (1024, 1024)),  # 2 MiB: hashed on its own
    ("mid.weight", "F32", (300, 257)),  # odd size, above the small-tensor batch size
    ("small.a", "F16", (7, 3)),  # batched small tensors
    ("small.b", "I8", (5,)),
    ("small.c", "U64", (4, 2)),
]


def _tensors(seed: int = 0, zero: str | None = None) -> dict:
    tensors = random_tensors(np.random.default_rng(seed), SPECS)
    if zero is not None:
        dt, shape, values = tensors[zero]
        tensors[zero] = (dt, shape, np.zeros_like(values))
    return tensors


def _make_sparse(path: Path, hole_min: int = 1 << 16) -> None:
    """Rewrite ``path`` in place of itself with every aligned stretch of zeros of at least ``hole_min``
    bytes left as a hole (seek, not write): the same bytes, fewer allocated blocks."""
    data = np.fromfile(path, dtype=np.uint8)
    blocks = data[: data.size - data.size % hole_min].reshape(-1, hole_min)
    zero = ~blocks.any(axis=1)
    tmp = path.with_suffix(".sparse")
    with open(tmp, "wb") as f:
        for i, is_zero in enumerate(zero.tolist()):
            if is_zero:
                f.seek(hole_min, os.SEEK_CUR)
            else:
                f.write(blocks[i].tobytes())
        f.write(data[blocks.size :].tobytes())
        f.truncate()
    os.replace(tmp, path)
    assert np.array_equal(np.fromfile(path, dtype=np.uint8), data)


def _has_holes(path: Path) -> bool:
    st = os.stat(path)
    return st.st_blocks * 512 < st.st_size


def _digests(root: Path) -> tuple[dict[str, str], dict[str, str], bool]:
    """(digest of each tensor one by one, the same in small-tensor batches, whether the file was mapped)."""
    with SafetensorsCheckpoint(root) as ckpt, InPlaceFiles(dict(ckpt.tensors)) as files:
        one = {name: files.digest(name) for name in files.locations}
        names = sorted(files.locations, key=lambda n: files.locations[n].start)
        batched = dict(digest_small_tensors(files, names))
        mapped = files._mapped(files.locations["big.weight"].file) is not None
        table = digest_tensors(files, 2)
        assert {n: e.digest for n, e in table.items()} == one
    return one, batched, mapped


def test_a_file_without_holes_is_digested_through_its_mapping(tmp_path: Path) -> None:
    tensors = _tensors()
    root = write_checkpoint(tmp_path / "ckpt", tensors)
    expected = {name: digest_bytes(values) for name, (_, _, values) in tensors.items()}
    one, batched, mapped = _digests(root)
    assert mapped
    assert one == expected and batched == expected


def test_a_file_with_holes_is_read_with_pread_and_digests_the_same(tmp_path: Path) -> None:
    tensors = _tensors(zero="big.weight")
    root = write_checkpoint(tmp_path / "ckpt", tensors)
    _make_sparse(root / "model.safetensors")
    if not _has_holes(root / "model.safetensors"):
        pytest.skip("this file system allocates every block of a file (no holes to test)")
    expected = {name: digest_bytes(values) for name, (_, _, values) in tensors.items()}
    one, batched, mapped = _digests(root)
    assert not mapped
    assert one == expected and batched == expected


def test_a_sparse_receiver_applies_and_verifies(tmp_path: Path) -> None:
    v0 = _tensors(zero="big.weight")
    v1 = {name: (dt, shape, values.copy()) for name, (dt, shape, values) in v0.items()}
    v1["big.weight"][2][::97] ^= 1  # changes inside the hole
    v1["small.a"][2][0] ^= 0x8000  # -0/+0-style sign flip on an F16
    a = write_checkpoint(tmp_path / "v0", v0)
    b = write_checkpoint(tmp_path / "v1", v1)
    diff(a, b, tmp_path / "delta", base_version="v0", target_version="v1")
    recv = write_checkpoint(tmp_path / "recv", v0)
    _make_sparse(recv / "model.safetensors")
    if not _has_holes(recv / "model.safetensors"):
        pytest.skip("this file system allocates every block of a file (no holes to test)")
    dcr_cli.apply(tmp_path / "delta", into=recv)
    assert (recv / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert dcr_cli.verify(recv, against=tmp_path / "delta").ok
