"""``dcr diff`` of training shards: project stored chunks' changes to canonical coordinates.

Work comes in two kinds, both bounded by a chunk or a row band, never a model:

- chunk units (index-only): read one stored chunk of base and new, project it
  through the profile's segments (chunk_pieces), and diff every piece as an
  N-d box item of its canonical tensor. Nothing is assembled.
- tensor units: the digest of each canonical tensor (manifest tensor table and
  fingerprints) is computed over canonical row bands assembled from the chunks;
  a residual tensor (value-changing conversion) is assembled, converted and
  diffed whole as flat ranges with ``residual`` set; tied duplicates are checked.

With ``rank``/``world_size`` each process takes the chunk units of its share of
the shard files and its share of the tensor units, and writes a part
(dcr_cli/delta/parts.py); ``dcr assemble`` (or the last producer) merges them.
"""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np

from ..checkpoints.safetensors_dir import layout_mismatch
from ..checkpoints.shards import ChunkCache, ShardCheckpoint
from ..delta.summary import DiffSummary, summarize
from ..delta.writer import DeltaWriter
from ..errors import IncompatibleError
from ..format.codec import DEFAULT_LEVEL, EncodedItem, diff_region
from ..format.digest import StreamingDigest
from ..format.dtypes import dtype as lookup_dtype
from ..format.dtypes import numel
from ..format.manifest import Op, Region, VersionRef, fingerprint
from ..io.pool import default_workers, ordered_parallel
from .engine import CHUNK_BYTES, Progress, chunk_ranges

BAND_BYTES = CHUNK_BYTES


def _box_bands(offsets: tuple[int, ...], sizes: tuple[int, ...], itemsize: int) -> list[tuple[int, int]]:
    """Split a box along its first axis so that one item covers at most CHUNK_BYTES."""
    if not sizes:
        return [(0, 1)]
    row = max(1, numel(sizes[1:]) * itemsize)
    step = max(1, CHUNK_BYTES // row)
    return [(r, min(r + step, sizes[0])) for r in range(0, sizes[0], step)]


def check_compatible(b: ShardCheckpoint, n: ShardCheckpoint) -> None:
    mismatch = layout_mismatch(b.layout(), n.layout())
    if mismatch:
        raise IncompatibleError(f"checkpoints differ in layout: {mismatch}; dcr deltas need identical tensor sets")
    bl, nl = b.chunk_layout(), n.chunk_layout()
    for key in n.segments_by_key:
        if bl.get(key) != nl.get(key):
            raise IncompatibleError(
                f"stored tensor {key!r} is chunked differently in base and new (different parallel layout);"
                " diff checkpoints written with the same world size and sharding"
            )


def assign(n: ShardCheckpoint, rank: int, world: int) -> tuple[set[str], list[str]]:
    """This producer's shard files (round robin) and canonical tensors (balanced by bytes, deterministic)."""
    files = n.files()
    mine_files = set(files[rank::world])
    load = [0] * world
    mine_tensors = []
    for name, t in sorted(n.canonical.items(), key=lambda kv: (-numel(kv[1].shape), kv[0])):
        r = min(range(world), key=lambda i: (load[i], i))
        load[r] += numel(t.shape) + 1
        if r == rank:
            mine_tensors.append(name)
    return mine_files, sorted(mine_tensors)


def diff_shard_checkpoints(
    b: ShardCheckpoint,
    n: ShardCheckpoint,
    out: str | os.PathLike[str],
    *,
    base_version: str | None = None,
    target_version: str | None = None,
    workers: int | None = None,
    level: int | None = DEFAULT_LEVEL,
    overwrite: Sequence[str] = (),
    progress: Progress | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    on_block: Callable[[str, bytes], None] | None = None,
) -> DiffSummary | None:
    """Diff two training checkpoints in canonical coordinates. Returns None when only a part was written."""
    workers = workers or default_workers()
    check_compatible(b, n)
    if rank is not None and world_size is not None and world_size > 1:
        my_files, my_tensors = assign(n, rank, world_size)
    else:
        rank, world_size = None, None
        my_files, my_tensors = set(n.files()), list(n.canonical)
    base_chunks = {(k, c.offsets): c for k, st in b.reader.stored.items() for c in st.chunks}

    def op_of(name: str) -> Op:
        return "overwrite" if any(fnmatch.fnmatchcase(name, p) for p in overwrite) else "xor"

    # In a stream the base was the previous diff's target: its digest table is usually cached.
    base_digests, new_digests = b.cached_digests(), n.cached_digests()

    def chunk_task(key: str, chunk_key: tuple[int, ...]) -> Callable[[], list[EncodedItem]]:
        def run() -> list[EncodedItem]:
            nc = next(c for c in n.reader.stored[key].chunks if c.offsets == chunk_key)
            bc = base_chunks[(key, chunk_key)]
            barr, narr = b.reader.read_chunk(key, bc), n.reader.read_chunk(key, nc)
            items = []
            itemsize = barr.dtype.itemsize
            for piece in n.index_pieces(key, nc):
                bsub = barr[piece.slices].reshape(piece.canonical_sizes)
                nsub = narr[piece.slices].reshape(piece.canonical_sizes)
                for r0, r1 in _box_bands(piece.canonical_offsets, piece.canonical_sizes, itemsize):
                    if piece.canonical_sizes:
                        offsets = (piece.canonical_offsets[0] + r0, *piece.canonical_offsets[1:])
                        sizes = (r1 - r0, *piece.canonical_sizes[1:])
                        bb, nb = bsub[r0:r1], nsub[r0:r1]
                    else:
                        offsets, sizes, bb, nb = (), (), bsub, nsub
                    item = diff_region(
                        piece.name,
                        Region.box(offsets, sizes),
                        np.ascontiguousarray(bb).reshape(-1),
                        np.ascontiguousarray(nb).reshape(-1),
                        op=op_of(piece.name),
                        level=level,
                    )
                    if item is not None:
                        items.append(item)
            del barr, narr
            b.reader.release(key, bc)
            n.reader.release(key, nc)
            if progress:
                progress(nc.numel * itemsize)
            return items

        return run

    def tensor_task(name: str) -> Callable[[], list[EncodedItem]]:
        def run() -> list[EncodedItem]:
            if n.canonical[name].residual is not None:
                return residual_items(name)
            for ckpt, digests in ((b, base_digests), (n, new_digests)):
                if name not in digests:
                    digests[name] = canonical_digest(ckpt, name)
            return []

        return run

    def residual_items(name: str) -> list[EncodedItem]:
        # Value-changing conversion: assemble (bounded by this tensor), convert, diff as flat ranges.
        t = n.canonical[name]
        assert t.convert is not None and t.residual is not None
        old = b.canonical[name].convert(b.assemble(name)).reshape(-1)  # type: ignore[misc]
        new = t.convert(n.assemble(name)).reshape(-1)
        base_digests[name] = _digest(old)
        new_digests[name] = _digest(new)
        items = []
        for start, stop in chunk_ranges(len(new), lookup_dtype(t.dtype).itemsize):
            item = diff_region(
                name,
                Region.range(start, stop),
                old[start:stop],
                new[start:stop],
                op=op_of(name),
                level=level,
                residual=t.residual,
            )
            if item is not None:
                items.append(item)
        return items

    def duplicate_task(key: str, name: str) -> Callable[[], list[EncodedItem]]:
        def run() -> list[EncodedItem]:
            for ckpt in (b, n):
                dup = ckpt.duplicate_view(key, name)
                cache = ChunkCache(ckpt.reader)
                for rows in ckpt.band_rows(name, BAND_BYTES):
                    if not np.array_equal(ckpt.assemble(dup, rows, cache), ckpt.assemble(name, rows, cache)):
                        raise IncompatibleError(
                            f"{ckpt.root}: {key} should be a tied copy of {name} but differs (rows {rows[0]}..);"
                            " the HF checkpoint cannot represent it: untie the profile (tie_word_embeddings false)"
                        )
            return []

        return run

    def tasks() -> Iterator[Callable[[], list[EncodedItem]]]:
        for key, chunk in n.units():
            if chunk.file in my_files and n.index_pieces(key, chunk):
                yield chunk_task(key, chunk.offsets)
        for name in my_tensors:
            yield tensor_task(name)
        if rank in (None, 0):
            for key, name in n.duplicates:
                yield duplicate_task(key, name)

    if rank is not None:
        from ..delta.parts import part_dir

        writer = DeltaWriter(part_dir(out, rank))
    else:
        writer = DeltaWriter(out, on_block=on_block)
    try:
        for items in ordered_parallel(tasks(), workers):
            for item in items:
                writer.add(item)
        reasons = n.residual_reasons()
        if rank is not None:
            from ..delta.parts import finish_part

            finish_part(
                writer,
                rank=rank,
                world_size=world_size or 1,
                layout=n.layout(),
                # Each tensor is digested by exactly one part (the cache may know them all).
                base_digests={name: base_digests[name] for name in my_tensors},
                target_digests={name: new_digests[name] for name in my_tensors},
                residual=reasons,
                base_version=base_version,
                target_version=target_version,
            )
            return None
        b.remember_digests(base_digests)
        n.remember_digests(new_digests)
        base_table, target_table = b.table(base_digests), n.table(new_digests)
        base_fp, target_fp = fingerprint(base_table), fingerprint(target_table)
        manifest = writer.finish(
            VersionRef(base_version or base_fp[:16], base_fp),
            VersionRef(target_version or target_fp[:16], target_fp),
            target_table,
            extra={"residual_tensors": reasons} if reasons else None,
        )
    except BaseException:
        writer.abort()
        raise
    return summarize(Path(out), manifest)


def canonical_digest(ckpt: ShardCheckpoint, name: str) -> str:
    """BLAKE3 of canonical tensor ``name``'s stored bytes in C order, read band by band from the chunks."""
    digest = StreamingDigest()
    runs = ckpt.row_runs(name)
    if runs is not None:  # row-sharded: stream zero-copy chunk views, nothing assembled
        for key, chunk, slices in runs:
            digest.update(np.ascontiguousarray(ckpt.reader.read_chunk(key, chunk)[slices]))
            ckpt.reader.release(key, chunk)
        return digest.hexdigest()
    cache = ChunkCache(ckpt.reader)
    for rows in ckpt.band_rows(name, BAND_BYTES):
        digest.update(ckpt.assemble(name, rows, cache))
    cache.clear()
    return digest.hexdigest()


def _digest(arr: np.ndarray) -> str:
    d = StreamingDigest()
    d.update(arr)
    return d.hexdigest()
