"""``dcr diff``: compare two checkpoints' stored bits and write a delta."""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from ..checkpoints.safetensors_dir import SafetensorsCheckpoint, layout_mismatch
from ..delta.summary import DiffSummary, summarize
from ..delta.writer import DeltaWriter
from ..errors import IncompatibleError
from ..format.codec import DEFAULT_LEVEL, EncodedItem, diff_region
from ..format.digest import digest_bytes
from ..format.dtypes import dtype as lookup_dtype
from ..format.manifest import Op, Region, VersionRef, fingerprint
from ..io.pool import default_workers, ordered_parallel

# One item covers at most this many bytes of a tensor: bounds memory per
# worker and lets one huge tensor (an embedding) use every core.
CHUNK_BYTES = 16 << 20

Progress = Callable[[int], None]  # called with bytes of the new checkpoint processed


def chunk_ranges(numel: int, itemsize: int) -> list[tuple[int, int]]:
    step = max(1, CHUNK_BYTES // max(1, itemsize))
    return [(s, min(s + step, numel)) for s in range(0, numel, step)]


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
) -> DiffSummary | None:
    """Write a delta that turns checkpoint ``base`` into checkpoint ``new``.

    Both are Hugging Face safetensors directories, or both training checkpoints
    (``format``: dcp, dcp-hf, megatron; autodetected when None), which are
    diffed in canonical (HF) coordinates (dcr_cli/produce/shards.py).
    ``overwrite`` lists glob patterns of tensors whose receivers do not keep
    stored bits (e.g. they cast or quantize): those travel as absolute values.
    With ``rank``/``world_size`` this process writes only its part of the delta
    and returns None (``dcr_cli.delta.parts.assemble`` merges the parts).
    ``on_block(id, data)`` sees every block as soon as it is written, so that
    sending can overlap building (``dcr_cli.store.BlockUploader``).
    """
    from ..checkpoints import detect_format, open_source

    formats = {format or detect_format(base), format or detect_format(new)}
    if len(formats) != 1:
        raise IncompatibleError(f"BASE and NEW are of different formats ({' and '.join(sorted(formats))})")
    if formats != {"hf"}:
        from .shards import diff_shard_checkpoints

        fmt = formats.pop()
        b_src, n_src = open_source(base, fmt, profile), open_source(new, fmt, profile)
        try:
            return diff_shard_checkpoints(
                b_src,
                n_src,
                out,
                base_version=base_version,
                target_version=target_version,
                workers=workers,
                level=level,
                overwrite=overwrite,
                progress=progress,
                rank=rank,
                world_size=world_size,
                on_block=on_block,
            )
        finally:
            b_src.reader.close()
            n_src.reader.close()
    if rank is not None and (world_size or 1) > 1:
        raise IncompatibleError("--rank/--world-size split training shards; an HF directory is diffed by one process")
    workers = workers or default_workers()
    with SafetensorsCheckpoint(base) as b, SafetensorsCheckpoint(new) as n:
        mismatch = layout_mismatch(b.layout(), n.layout())
        if mismatch:
            raise IncompatibleError(f"checkpoints differ in layout: {mismatch}; dcr deltas need identical tensor sets")
        names = sorted(n.tensors)
        # In a stream, the base was the previous diff's target: its digests are usually cached.
        base_digests = b.cached_digests()
        new_digests = n.cached_digests()

        def digest_task(name: str) -> Callable[[], None]:
            def run() -> None:
                if name not in base_digests:
                    base_digests[name] = digest_bytes(b.view(name))
                if name not in new_digests:
                    new_digests[name] = digest_bytes(n.view(name))

            return run

        def region_task(name: str, start: int, stop: int, op: Op) -> Callable[[], EncodedItem | None]:
            def run() -> EncodedItem | None:
                item = diff_region(
                    name,
                    Region.range(start, stop),
                    b.view(name, start, stop),
                    n.view(name, start, stop),
                    op=op,
                    level=level,
                )
                if progress:
                    progress((stop - start) * lookup_dtype(n.tensors[name].dtype).itemsize)
                return item

            return run

        def tasks() -> Iterator[Callable[[], EncodedItem | None]]:
            for name in names:
                loc = n.tensors[name]
                op: Op = "overwrite" if any(fnmatch.fnmatchcase(name, p) for p in overwrite) else "xor"
                yield digest_task(name)  # type: ignore[misc]
                for start, stop in chunk_ranges(loc.numel, lookup_dtype(loc.dtype).itemsize):
                    yield region_task(name, start, stop, op)

        writer = DeltaWriter(out, on_block=on_block)
        try:
            for result in ordered_parallel(tasks(), workers):
                if result is not None:
                    writer.add(result)
            b.remember_digests(base_digests)
            n.remember_digests(new_digests)
            base_table = b.tensor_table(base_digests)
            target_table = n.tensor_table(new_digests)
            base_fp, target_fp = fingerprint(base_table), fingerprint(target_table)
            manifest = writer.finish(
                VersionRef(base_version or base_fp[:16], base_fp),
                VersionRef(target_version or target_fp[:16], target_fp),
                target_table,
            )
        except BaseException:
            writer.abort()
            raise
    return summarize(Path(out), manifest)
