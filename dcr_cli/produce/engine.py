"""``dcr diff``: execute a plan (plan.py) over two sides and write a delta (or one producer's part).

Execution is written once for every source: read, scan and encode
(``format.codec``), write (``DeltaWriter``) in plan order, digests (with the
digest cache), then finish the manifest or the part. A side is anything that
serves the reads a plan's units make (``Side``): a Hugging Face directory, a
training checkpoint in canonical coordinates, or live tensors (live.py).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ..checkpoints import detect_format, open_source
from ..checkpoints.safetensors_dir import SafetensorsCheckpoint
from ..checkpoints.shards import Chunk, ShardCheckpoint
from ..delta.summary import DiffSummary, summarize
from ..delta.writer import DeltaWriter
from ..errors import IncompatibleError
from ..format.codec import DEFAULT_LEVEL, EncodedItem, diff_region
from ..format.digest import digest_bytes
from ..format.manifest import Op, Region, TensorEntry, VersionRef, fingerprint
from ..io.pool import default_workers, ordered_parallel
from .plan import (
    Band,
    ChunkUnit,
    DigestUnit,
    Plan,
    RangeUnit,
    ResidualUnit,
    TiedUnit,
    Unit,
    check_layouts,
    chunk_ranges,
    plan_shards,
    plan_tensors,
)

Progress = Callable[[int], None]  # called with bytes of the new checkpoint processed
# Scans one region of both sides and encodes it: (tensor, region, base, new, op, residual) -> item.
Scan = Callable[[str, Region, Any, Any, Op, "str | None"], "EncodedItem | None"]


class Side(Protocol):
    """The reads a plan makes of one side of a diff (arrays are unsigned-integer views)."""

    def flat(self, name: str, start: int, stop: int) -> Any: ...
    def read_chunk(self, key: str, chunk: Chunk) -> Any: ...
    def release(self, key: str, chunk: Chunk) -> None: ...
    def canonical_digest(self, name: str) -> str: ...
    def converted(self, name: str) -> np.ndarray: ...
    def check_tied(self, key: str, name: str) -> None: ...
    def cached_digests(self) -> dict[str, str]: ...
    def remember_digests(self, digests: dict[str, str]) -> None: ...
    def table(self, digests: dict[str, str]) -> dict[str, TensorEntry]: ...


class HfSide:
    """A Hugging Face safetensors directory as a side of an identity plan (flat ranges and digests only)."""

    def __init__(self, ckpt: SafetensorsCheckpoint) -> None:
        self.ckpt = ckpt

    def flat(self, name: str, start: int, stop: int) -> np.ndarray:
        return self.ckpt.view(name, start, stop)

    def canonical_digest(self, name: str) -> str:
        return digest_bytes(self.ckpt.view(name))

    def cached_digests(self) -> dict[str, str]:
        return self.ckpt.cached_digests()

    def remember_digests(self, digests: dict[str, str]) -> None:
        self.ckpt.remember_digests(digests)

    def table(self, digests: dict[str, str]) -> dict[str, TensorEntry]:
        return self.ckpt.tensor_table(digests)


def numpy_scan(level: int | None) -> Scan:
    """The CPU scan: numba's change kernel over numpy views (``format.codec.diff_region``)."""

    def scan(name: str, region: Region, base: Any, new: Any, op: Op, residual: str | None) -> EncodedItem | None:
        return diff_region(
            name,
            region,
            np.ascontiguousarray(base).reshape(-1),
            np.ascontiguousarray(new).reshape(-1),
            op=op,
            level=level,
            residual=residual,
        )

    return scan


def band_of(arr: Any, band: Band) -> Any:
    """The band's elements of a chunk array (numpy or torch), shaped as the canonical box."""
    piece = arr[band.slices].reshape(band.piece_sizes)
    return piece[band.rows[0] : band.rows[1]] if band.piece_sizes else piece


def execute(
    plan: Plan,
    base: Side,
    new: Side,
    out: str | os.PathLike[str],
    *,
    base_version: str | None = None,
    target_version: str | None = None,
    workers: int | None = None,
    level: int | None = DEFAULT_LEVEL,
    progress: Progress | None = None,
    on_block: Callable[[str, bytes], None] | None = None,
    scan: Scan | None = None,
    base_digests: dict[str, str] | None = None,
    target_digests: dict[str, str] | None = None,
    created: str | None = None,
) -> DiffSummary | None:
    """Run the plan's units on a thread pool and write their items in plan order.

    Returns the summary of the delta, or None when the plan is a part (``plan.rank``).
    ``base_digests``/``target_digests`` are digests already known (e.g. by a live producer), and
    are completed in place with those the units compute; without them the sides' caches are asked.
    """
    workers = workers or default_workers()
    scan = scan or numpy_scan(level)
    # In a stream, the base was the previous diff's target: its digests are usually cached.
    b_digests = base.cached_digests() if base_digests is None else base_digests
    n_digests = new.cached_digests() if target_digests is None else target_digests

    def range_task(u: RangeUnit) -> list[EncodedItem]:
        item = scan(u.name, Region.range(u.start, u.stop), base.flat(u.name, u.start, u.stop),
                    new.flat(u.name, u.start, u.stop), u.op, None)  # fmt: skip
        if progress:
            progress((u.stop - u.start) * u.itemsize)
        return [item] if item is not None else []

    def chunk_task(u: ChunkUnit) -> list[EncodedItem]:
        barr, narr = base.read_chunk(u.key, u.chunk), new.read_chunk(u.key, u.chunk)
        items = []
        for band in u.bands:
            item = scan(band.name, Region.box(band.offsets, band.sizes), band_of(barr, band), band_of(narr, band),
                        band.op, None)  # fmt: skip
            if item is not None:
                items.append(item)
        del barr, narr
        base.release(u.key, u.chunk)
        new.release(u.key, u.chunk)
        if progress:
            progress(u.chunk.numel * u.itemsize)
        return items

    def digest_task(u: DigestUnit) -> list[EncodedItem]:
        for side, digests in ((base, b_digests), (new, n_digests)):
            if u.name not in digests:
                digests[u.name] = side.canonical_digest(u.name)
        return []

    def residual_task(u: ResidualUnit) -> list[EncodedItem]:
        # Value-changing conversion: assemble (bounded by this tensor), convert, diff as flat ranges.
        old, cur = base.converted(u.name), new.converted(u.name)
        b_digests[u.name], n_digests[u.name] = digest_bytes(old), digest_bytes(cur)
        items = []
        for start, stop in chunk_ranges(len(cur), u.itemsize):
            item = scan(u.name, Region.range(start, stop), old[start:stop], cur[start:stop], u.op, u.residual)
            if item is not None:
                items.append(item)
        return items

    def tied_task(u: TiedUnit) -> list[EncodedItem]:
        base.check_tied(u.key, u.name)
        new.check_tied(u.key, u.name)
        return []

    runners: dict[type, Callable[[Any], list[EncodedItem]]] = {
        RangeUnit: range_task,
        ChunkUnit: chunk_task,
        DigestUnit: digest_task,
        ResidualUnit: residual_task,
        TiedUnit: tied_task,
    }

    def tasks() -> Iterator[Callable[[], list[EncodedItem]]]:
        for unit in plan.units:
            yield _bind(runners[type(unit)], unit)

    if plan.rank is not None:
        from ..delta.parts import part_dir

        writer = DeltaWriter(part_dir(out, plan.rank), on_block=on_block)
    else:
        writer = DeltaWriter(out, on_block=on_block)
    try:
        for items in ordered_parallel(tasks(), workers):
            for item in items:
                writer.add(item)
        if plan.rank is not None:
            from ..delta.parts import finish_part

            finish_part(
                writer,
                rank=plan.rank,
                world_size=plan.world_size or 1,
                layout=plan.layout,
                # Each tensor is digested by exactly one part (the cache may know them all).
                base_digests={name: b_digests[name] for name in plan.digested},
                target_digests={name: n_digests[name] for name in plan.digested},
                residual=plan.residual,
                base_version=base_version,
                target_version=target_version,
            )
            return None
        base.remember_digests(b_digests)
        new.remember_digests(n_digests)
        base_table, target_table = base.table(b_digests), new.table(n_digests)
        base_fp, target_fp = fingerprint(base_table), fingerprint(target_table)
        manifest = writer.finish(
            VersionRef(base_version or base_fp[:16], base_fp),
            VersionRef(target_version or target_fp[:16], target_fp),
            target_table,
            extra={"residual_tensors": plan.residual} if plan.residual else None,
            created=created,
        )
    except BaseException:
        writer.abort()
        raise
    return summarize(Path(out), manifest)


def _bind(run: Callable[[Unit], list[EncodedItem]], unit: Unit) -> Callable[[], list[EncodedItem]]:
    return lambda: run(unit)


def open_pair(
    base: str | os.PathLike[str], new: str | os.PathLike[str], format: str | None, profile: dict | None
) -> tuple[str, Any, Any]:
    """(format, base source, new source): both checkpoints must be of one format (autodetected when None)."""
    formats = {format or detect_format(base), format or detect_format(new)}
    if len(formats) != 1:
        raise IncompatibleError(f"BASE and NEW are of different formats ({' and '.join(sorted(formats))})")
    fmt = formats.pop()
    b_src = open_source(base, fmt, profile)
    try:
        n_src = open_source(new, fmt, profile)
    except BaseException:
        _close(b_src)
        raise
    return fmt, b_src, n_src


def _close(src: Any) -> None:
    if isinstance(src, ShardCheckpoint):
        src.reader.close()
    else:
        src.close()


def diff(
    base: str | os.PathLike[str],
    new: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    base_version: str | None = None,
    target_version: str | None = None,
    workers: int | None = None,
    level: int | None = DEFAULT_LEVEL,
    overwrite: Sequence[str] = (),
    progress: Progress | None = None,
    format: str | None = None,
    profile: dict | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    on_block: Callable[[str, bytes], None] | None = None,
    progress_total: Callable[[int], None] | None = None,
) -> DiffSummary | None:
    """Write a delta that turns checkpoint ``base`` into checkpoint ``new``.

    Both are Hugging Face safetensors directories, or both training checkpoints
    (``format``: dcp, dcp-hf, megatron; autodetected when None), which are
    diffed in canonical (HF) coordinates (format_spec/producers.md).
    ``overwrite`` lists glob patterns of tensors whose receivers do not keep
    stored bits (e.g. they cast or quantize): those travel as absolute values.
    With ``rank``/``world_size`` this process writes only its part of the delta
    and returns None (``dcr_cli.delta.parts.assemble`` merges the parts).
    ``on_block(id, data)`` sees every block as soon as it is written, so that
    sending can overlap building (``dcr_cli.store.BlockUploader``).
    ``progress_total(bytes)`` is called once, before any work, with the total ``progress`` will reach.
    """
    fmt, b_src, n_src = open_pair(base, new, format, profile)
    try:
        if fmt == "hf":
            if rank is not None and (world_size or 1) > 1:
                raise IncompatibleError(
                    "--rank/--world-size split training shards; an HF directory is diffed by one process"
                )
            check_layouts(b_src.layout(), n_src.layout())
            plan = plan_tensors(n_src.layout(), overwrite)
            b_side: Any = HfSide(b_src)
            n_side: Any = HfSide(n_src)
        else:
            plan = plan_shards(b_src, n_src, overwrite=overwrite, rank=rank, world_size=world_size)
            b_side, n_side = b_src, n_src
        if progress_total is not None:
            progress_total(plan.total_bytes)
        return execute(
            plan,
            b_side,
            n_side,
            out,
            base_version=base_version,
            target_version=target_version,
            workers=workers,
            level=level,
            progress=progress,
            on_block=on_block,
        )
    finally:
        _close(b_src)
        _close(n_src)
