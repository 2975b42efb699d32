"""Index maps of the shard projection, property-tested on in-memory chunkings (no files, no processes).

The real multi-rank checkpoints are in test_shards_dcp.py and test_shards_megatron.py; here
hypothesis explores chunkings and segment maps that those fixtures cannot enumerate.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from manifest_text import manifest_v1

from dcr_cli.checkpoints.shards import (
    CanonicalTensor,
    Chunk,
    Segment,
    ShardCheckpoint,
    ShardReader,
    StoredTensor,
    chunk_pieces,
    identity_canonical,
)
from dcr_cli.delta.parts import PARTS_DIR, assemble
from dcr_cli.delta.reader import Delta
from dcr_cli.errors import FormatError, IncompatibleError
from dcr_cli.format.digest import digest_bytes
from dcr_cli.format.manifest import Region
from dcr_cli.produce.engine import execute
from dcr_cli.produce.plan import check_compatible, plan_shards


class ArrayReader(ShardReader):
    """Stored tensors held as numpy arrays, chunked by explicit boxes."""

    def __init__(self, arrays: dict[str, np.ndarray], boxes: dict[str, list[tuple[tuple, tuple]]]) -> None:
        self.root = "<memory>"
        self.arrays = arrays
        self.stored = {
            k: StoredTensor(k, "BF16", a.shape, [Chunk(o, s, f"file{i % 3}") for i, (o, s) in enumerate(boxes[k])])
            for k, a in arrays.items()
        }

    def read_chunk(self, key: str, chunk: Chunk) -> np.ndarray:
        sl = tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes, strict=True))
        return self.arrays[key][sl]


def split_points(n: int, cuts: list[int]) -> list[tuple[int, int]]:
    points = sorted({0, n, *(c % (n + 1) for c in cuts)})
    return list(itertools.pairwise(points)) or [(0, 0)]


@st.composite
def chunked(draw: st.DrawFn) -> tuple[np.ndarray, list[tuple[tuple, tuple]]]:
    shape = tuple(draw(st.lists(st.integers(1, 7), min_size=1, max_size=3)))
    per_dim = [split_points(n, draw(st.lists(st.integers(0, 8), max_size=3))) for n in shape]
    boxes = []
    for combo in np.ndindex(*[len(p) for p in per_dim]):
        spans = [per_dim[d][i] for d, i in enumerate(combo)]
        boxes.append((tuple(a for a, _ in spans), tuple(b - a for a, b in spans)))
    seed = draw(st.integers(0, 2**32 - 1))
    arr = np.random.default_rng(seed).integers(0, 2**16, size=shape, dtype=np.uint16)
    return arr, boxes


@settings(max_examples=60, deadline=None)
@given(chunked())
def test_pieces_tile_the_canonical_tensor_and_digests_stream(data: tuple[np.ndarray, list]) -> None:
    arr, boxes = data
    reader = ArrayReader({"w": arr}, {"w": boxes})
    ck = ShardCheckpoint(reader, identity_canonical(reader), "test")
    seen = np.zeros(arr.size, dtype=np.int64)
    rebuilt = np.zeros(arr.size, dtype=arr.dtype)
    for key, chunk in ck.units():
        values = reader.read_chunk(key, chunk)
        for piece in ck.index_pieces(key, chunk):
            region = Region.box(piece.canonical_offsets, piece.canonical_sizes)
            idx = region.to_canonical(np.arange(region.size), arr.shape)
            rebuilt[idx] = values[piece.slices].reshape(-1)
            seen[idx] += 1
    assert (seen == 1).all()  # every canonical element exactly once
    assert np.array_equal(rebuilt, arr.reshape(-1))
    for rows in ck.band_rows("w", 7 * 2):
        assert np.array_equal(ck.assemble("w", rows), arr[rows[0] : rows[1]])
    runs = ck.row_runs("w")
    if runs is not None:
        joined = b"".join(np.ascontiguousarray(reader.read_chunk(k, c)[s]).tobytes() for k, c, s in runs)
        assert digest_bytes(joined) == digest_bytes(arr)
    elif len(arr.shape) > 1:
        assert any(tuple(s[1:]) != arr.shape[1:] for _, s in boxes)  # only a split row disables runs


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 3), st.integers(1, 4), st.integers(1, 3), st.integers(1, 3), st.integers(0, 2**32 - 1))
def test_per_group_row_blocks_are_a_permutation(layers: int, groups: int, hpg: int, tp_split: int, seed: int) -> None:
    """QKV-style interleave [q_g; k_g; v_g] over a stacked layer axis, chunked by layer and row blocks."""
    d, hidden = 2, 3
    rows = groups * (hpg + 2) * d
    stored = np.random.default_rng(seed).integers(0, 2**16, size=(layers, rows, hidden), dtype=np.uint16)
    step = max(1, rows // tp_split)
    boxes = [((layer, r, 0), (1, min(step, rows - r), hidden)) for layer in range(layers) for r in range(0, rows, step)]
    reader = ArrayReader({"qkv": stored}, {"qkv": boxes})
    canonical = {}
    for layer in range(layers):
        for part, n_rows, skip in (("q", hpg * d, 0), ("k", d, hpg * d), ("v", d, (hpg + 1) * d)):
            name = f"{layer}.{part}"
            segs = [
                Segment("qkv", (layer, g * (hpg + 2) * d + skip, 0), (1, n_rows, hidden), name, (g * n_rows, 0))
                for g in range(groups)
            ]
            canonical[name] = CanonicalTensor(name, "BF16", (groups * n_rows, hidden), segs)
    ck = ShardCheckpoint(reader, canonical, "test")
    for layer in range(layers):
        want = stored[layer].reshape(groups, hpg + 2, d, hidden)
        expected = {
            "q": want[:, :hpg].reshape(-1, hidden),
            "k": want[:, hpg].reshape(-1, hidden),
            "v": want[:, hpg + 1].reshape(-1, hidden),
        }
        for part, value in expected.items():
            name = f"{layer}.{part}"
            got = np.zeros(value.size, dtype=np.uint16)
            for key, chunk in ck.units():
                for piece in chunk_pieces(chunk, [s for s in ck.segments_by_key[key] if s.name == name]):
                    region = Region.box(piece.canonical_offsets, piece.canonical_sizes)
                    got[region.to_canonical(np.arange(region.size), value.shape)] = reader.read_chunk(key, chunk)[
                        piece.slices
                    ].reshape(-1)
            assert np.array_equal(got, value.reshape(-1))
            assert np.array_equal(ck.assemble(name), value)
            runs = ck.row_runs(name)
            assert runs is not None
            joined = b"".join(np.ascontiguousarray(reader.read_chunk(k, c)[s]).tobytes() for k, c, s in runs)
            assert joined == value.tobytes()


def test_profile_gaps_and_overlapping_chunks_are_refused() -> None:
    arr = np.zeros((4, 2), dtype=np.uint16)
    reader = ArrayReader({"w": arr}, {"w": [((0, 0), (2, 2)), ((1, 0), (3, 2))]})
    with pytest.raises(FormatError, match="chunks"):
        ShardCheckpoint(reader, identity_canonical(reader), "test")
    reader = ArrayReader({"w": arr}, {"w": [((0, 0), (4, 2))]})
    half = {"w": CanonicalTensor("w", "BF16", (4, 2), [Segment("w", (0, 0), (2, 2), "w", (0, 0))])}
    with pytest.raises(FormatError, match="covered"):
        ShardCheckpoint(reader, half, "test")


def test_different_chunk_layouts_are_refused() -> None:
    arr = np.zeros((4, 2), dtype=np.uint16)
    a = ArrayReader({"w": arr}, {"w": [((0, 0), (2, 2)), ((2, 0), (2, 2))]})
    b = ArrayReader({"w": arr}, {"w": [((0, 0), (4, 2))]})
    with pytest.raises(IncompatibleError, match="chunked differently"):
        check_compatible(ShardCheckpoint(a, identity_canonical(a), "t"), ShardCheckpoint(b, identity_canonical(b), "t"))


def test_assemble_resumes_after_a_crash_midway(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    base = rng.integers(0, 2**16, size=(9, 5), dtype=np.uint16)
    new = base.copy()
    new[rng.integers(0, 9, 6), rng.integers(0, 5, 6)] ^= 3
    boxes = {"w": [((r, 0), (3, 5)) for r in range(0, 9, 3)]}
    b, n = ArrayReader({"w": base}, boxes), ArrayReader({"w": new}, boxes)
    cb, cn = ShardCheckpoint(b, identity_canonical(b), "t"), ShardCheckpoint(n, identity_canonical(n), "t")
    out = tmp_path / "d"
    for rank in range(3):
        execute(plan_shards(cb, cn, rank=rank, world_size=3), cb, cn, out)
    # crash after some blocks moved: the first part's blocks are already in OUT/blocks
    first = sorted((out / PARTS_DIR).iterdir())[0]
    (out / "blocks").mkdir()
    for block in (first / "blocks").iterdir():
        block.rename(out / "blocks" / block.name)
    manifest = assemble(out)
    assert not (out / PARTS_DIR).exists()
    d = Delta.open(out)
    d.verify_blocks(("data", "repair"))
    result = base.reshape(-1).copy()
    for item in manifest.items:
        dec = d.decode(item)
        idx = item.region.to_canonical(dec.positions, (9, 5))
        result[idx] ^= dec.values
    assert np.array_equal(result, new.reshape(-1))
    assert manifest_v1(out, rewrite=False)["tensors"]["w"]["digest"] == digest_bytes(new)
