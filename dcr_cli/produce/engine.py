"""``dcr diff``: execute a plan (plan.py) over two sides and write a delta (or one producer's part).

Execution is written once for every source: read, scan and encode
(``format.codec``), write (``DeltaWriter``) in plan order, digests (with the
digest cache), then finish the manifest or the part. A side is anything that
serves the reads a plan's units make (``Side``): a Hugging Face directory, a
training checkpoint in canonical coordinates, or live tensors (live.py).
"""

from __future__ import annotations

import functools
import os
import queue
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Protocol, cast

import blake3
import numpy as np

from ..checkpoints import detect_format, open_source
from ..checkpoints.safetensors_dir import SafetensorsCheckpoint, TensorLocation
from ..checkpoints.shards import BAND_BYTES, RESIDUAL_BAND_BYTES, Chunk, ShardCheckpoint, release_pages
from ..delta.summary import DiffSummary, summarize
from ..delta.writer import DeltaWriter
from ..errors import IncompatibleError
from ..format.codec import (
    DEFAULT_LEVEL,
    EncodedItem,
    PendingItem,
    check_level,
    diff_region,
    digest_small,
    encode_changes,
    encode_span,
)
from ..format.digest import StreamingDigest, digest_bytes
from ..format.dtypes import numel, uint_of
from ..format.kernels import scan_changes
from ..format.manifest import Op, Region, TensorEntry, VersionRef, fingerprint
from ..io.files import NO_ROOM, named
from ..io.gc_pause import fewer_collections
from ..io.pool import Inline, check_workers, default_workers, in_background, ordered_stream
from .plan import (
    CHUNK_BYTES,
    Band,
    ChunkUnit,
    DigestUnit,
    Plan,
    RangeUnit,
    ResidualUnit,
    TiedUnit,
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
    def converted_bands(self, names: Sequence[str]) -> Iterator[list[np.ndarray]]: ...
    def shares_source(self, first: str, second: str) -> bool: ...
    def check_tied(self, key: str, name: str) -> None: ...
    def cached_digests(self) -> dict[str, str]: ...
    def remember_digests(self, digests: dict[str, str]) -> None: ...
    def table(self, digests: dict[str, str]) -> dict[str, TensorEntry]: ...


class HfSide:
    """A Hugging Face safetensors directory as a side of an identity plan (flat ranges and digests only)."""

    flat_is_memory = True  # flat() returns numpy views of memory (the engine may hash while it scans)

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

    def location(self, name: str) -> TensorLocation:
        return self.ckpt.tensors[name]

    def span(self, name: str, start: int, count: int) -> np.ndarray:
        """``count`` elements of ``name``'s unsigned dtype from byte ``start`` of its file (several
        neighbouring tensors at once; see the engine's span_run)."""
        loc = self.ckpt.tensors[name]
        return np.frombuffer(self.ckpt._map(loc.file), dtype=uint_of(loc.dtype), count=count, offset=start)

    def release_tensor(self, name: str) -> None:
        """Done with this tensor: unmap its pages from this process (they stay in the page cache).

        Unmapping is work for the kernel in proportion to the pages mapped; done here, by the
        worker that read them, it runs in parallel with the other workers instead of all at
        once when the checkpoint is closed.
        """
        loc = self.ckpt.tensors[name]
        if loc.nbytes:
            release_pages(self.ckpt._map(loc.file), loc.start, loc.nbytes)

    def release_span(self, name: str, start: int, nbytes: int) -> None:
        """``release_tensor`` of the bytes [start, start + nbytes) of ``name``'s file (a span of neighbours)."""
        release_pages(self.ckpt._map(self.ckpt.tensors[name].file), start, nbytes)

    def release_tensors(self, names: Sequence[str]) -> None:
        """``release_tensor`` of a batch of small tensors: one unmap per file over the span they cover
        where that span is about their own size (tensors of a batch are usually neighbours in the file)."""
        spans: dict[Path, list[int]] = {}  # file -> [lo, hi, bytes of the batch's tensors in it]
        tensors = self.ckpt.tensors
        file: Path | None = None
        span: list[int] = []
        for name in names:
            loc = tensors[name]
            if not loc.nbytes:
                continue
            if loc.file is not file:  # neighbours share their file's Path object: no hashing per tensor
                file = loc.file
                span = spans.setdefault(file, [loc.start, loc.start + loc.nbytes, 0])
            end = loc.start + loc.nbytes
            if loc.start < span[0]:
                span[0] = loc.start
            if end > span[1]:
                span[1] = end
            span[2] += loc.nbytes
        total = {f: s[2] for f, s in spans.items()}
        for file, (lo, hi, _) in spans.items():
            if hi - lo <= 2 * total[file] + (64 << 10):
                release_pages(self.ckpt._map(file), lo, hi - lo)
            else:
                for name in names:
                    if self.ckpt.tensors[name].file == file:
                        self.release_tensor(name)


def numpy_scan(level: int | None) -> Scan:
    """The CPU scan: numba's change kernel over numpy views (``format.codec.diff_region``)."""

    def scan(name: str, region: Region, base: Any, new: Any, op: Op, residual: str | None) -> EncodedItem | None:
        return diff_region(
            name, region, _flat(base), _flat(new), op=op, level=level, residual=residual
        )  # fmt: skip

    return scan


def _flat(arr: np.ndarray) -> np.ndarray:
    """A flat C-order view, copying only when the array is not contiguous already."""
    return arr.reshape(-1) if arr.flags.c_contiguous else np.ascontiguousarray(arr).reshape(-1)


def band_of(arr: Any, band: Band) -> Any:
    """The band's elements of a chunk array (numpy or torch), shaped as the canonical box."""
    piece = arr[band.slices].reshape(band.piece_sizes)
    return piece[band.rows[0] : band.rows[1]] if band.piece_sizes else piece


# The scan hashes the target (and a base without a cached digest) tile by tile, while the tile
# is still in cache: about L2-sized, of the target's bytes.
TILE_BYTES = 256 << 10
# Tensors up to SMALL_TENSOR_BYTES are diffed in batches of consecutive ones, one pool task per
# batch of about BATCH_BYTES (or BATCH_TENSORS): an MoE checkpoint has 100k tensors of a few KiB,
# and a task per tensor costs more in scheduling and thread hand-offs than its scan. A batch emits
# exactly the items its tensors would alone, in the same order (the delta is byte-identical). A batch
# holds the GIL almost throughout (tiny scans, frames and digests): it runs on the consuming thread
# (pool.Inline), so its items reach the writer without a thread hand-off each.
SMALL_TENSOR_BYTES = 256 << 10
BATCH_BYTES = 4 << 20
BATCH_TENSORS = 512
# Neighbouring small tensors of a batch are scanned as one span of at most SPAN_BYTES (their changes
# are then cut at the tensors' bounds: the same items), where at most SPAN_GAP_BYTES lie between two.
SPAN_BYTES = 1 << 20
SPAN_GAP_BYTES = 4 << 10
# A tensor's hashing is pipelined on a helper thread only when it is at least this large.
PIPELINE_MIN_BYTES = 4 << 20
# Bytes of anonymous memory the tasks in flight may hold, per worker (ordered_stream's budget);
# a task larger than the whole budget runs alone, so peak memory is O(largest task), not O(model).
BUDGET_PER_WORKER = 128 << 20
MIN_BUDGET = 256 << 20


def diff_budget(workers: int) -> int:
    return max(MIN_BUDGET, workers * BUDGET_PER_WORKER)


def _item_bytes(item: EncodedItem) -> int:
    if type(item) is PendingItem:
        return item.held_bytes + 512
    return len(item.data) + len(item.repair or b"") + 512


def _batch_cost(nbytes: int) -> int:
    """A batch of small tensors scans a span of neighbours (or one tensor) at a time: the largest's working memory."""
    return _scan_cost(min(nbytes, max(SMALL_TENSOR_BYTES, SPAN_BYTES)))


def _scan_cost(nbytes: int) -> int:
    """Working memory of one region's scan and encoding: the change arrays at worst grow to a few
    times the region (int64 positions), and the dense trial compresses it once more."""
    return 4 * nbytes


class _TileFeeder:
    """Feeds tiles to BLAKE3 hashers in order: on the calling thread, or, where ``helper`` allows it,
    pipelined on a helper thread (started at its first pipelined tile). A tile fed inline after
    pipelined ones waits until the helper has hashed those, so each hasher sees its bytes in order."""

    def __init__(self, helper: bool) -> None:
        self.helper = helper
        self.error: BaseException | None = None
        self.jobs: queue.Queue[tuple[Any, np.ndarray] | None] | None = None
        self.thread: threading.Thread | None = None

    def feed(self, hasher: Any, tile: np.ndarray, pipelined: bool) -> None:
        if pipelined and self.helper:
            if self.jobs is None:
                self.jobs = queue.Queue(maxsize=8)
                self.thread = threading.Thread(target=self._run, args=(self.jobs,), name="dcr-hash", daemon=True)
                self.thread.start()
            self.jobs.put((hasher, tile))
            return
        if self.jobs is not None:
            self.jobs.join()  # the helper's tiles first
            if self.error is not None:
                return
        hasher.update(tile)

    def _run(self, jobs: queue.Queue[tuple[Any, np.ndarray] | None]) -> None:
        while True:
            job = jobs.get()
            try:
                if job is None:
                    return
                if self.error is None:
                    job[0].update(job[1])
            except BaseException as exc:  # reported by close()
                self.error = exc
            finally:
                jobs.task_done()

    def close(self) -> None:
        if self.jobs is not None and self.thread is not None:
            self.jobs.put(None)
            self.thread.join()
            self.jobs = self.thread = None
        if self.error is not None:
            raise self.error


class _Scanning:
    """How many large-tensor tasks of this process are running (``tensor_task``): while fewer than the
    workers are, a core is free for the hashing of a large tensor, and the task hands it to a helper
    thread; while every worker scans one, each hashes its own tiles, from its own core's cache."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.count = 0

    def __enter__(self) -> _Scanning:
        with self.lock:
            self.count += 1
        return self

    def __exit__(self, *exc: object) -> None:
        with self.lock:
            self.count -= 1


_SCANNING = _Scanning()


class _ResidualStream:
    """One residual tensor's converted bits, fed band by band, cut into the items' flat ranges.

    The ranges are exactly those of the whole converted tensor (``chunk_ranges``), so banding
    never changes the delta; a range that a band covers whole is scanned in place, one that
    straddles bands is gathered into one buffer of a range per side.
    """

    def __init__(self, name: str, op: Op, residual: str, itemsize: int, size: int, scan: Scan) -> None:
        self.name, self.op, self.residual, self.scan = name, op, residual, scan
        self.ranges = chunk_ranges(size, itemsize)
        self.next = 0  # index of the range being filled
        self.filled = 0  # elements of that range gathered in ``buffers``
        self.buffers: tuple[np.ndarray, np.ndarray] | None = None
        self.digests = (StreamingDigest(), StreamingDigest())

    def feed(self, old: np.ndarray, cur: np.ndarray) -> Iterator[EncodedItem]:
        self.digests[0].update(old)
        self.digests[1].update(cur)
        at, end = 0, len(cur)
        while at < end:
            if self.next >= len(self.ranges):
                raise IncompatibleError(f"{self.name}: the residual conversion gave more elements than its shape")
            start, stop = self.ranges[self.next]
            take = min(end - at, stop - start - self.filled)
            if self.filled == 0 and take == stop - start:
                b, n = old[at : at + take], cur[at : at + take]  # the band holds the whole range
            else:
                if self.buffers is None or len(self.buffers[0]) != stop - start or self.buffers[0].dtype != cur.dtype:
                    self.buffers = (np.empty(stop - start, cur.dtype), np.empty(stop - start, cur.dtype))
                self.buffers[0][self.filled : self.filled + take] = old[at : at + take]
                self.buffers[1][self.filled : self.filled + take] = cur[at : at + take]
                self.filled += take
                if self.filled < stop - start:
                    break
                b, n = self.buffers
            at += take
            self.next += 1
            self.filled = 0
            item = self.scan(self.name, Region.range(start, stop), b, n, self.op, self.residual)
            if item is not None:
                yield item
        if self.next == len(self.ranges):
            self.buffers = None

    def hexdigests(self) -> tuple[str, str]:
        if self.next != len(self.ranges) or self.filled:
            raise IncompatibleError(f"{self.name}: the residual conversion gave fewer elements than its shape")
        return self.digests[0].hexdigest(), self.digests[1].hexdigest()


@fewer_collections()
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
    budget: int | None = None,
    before_writing: Callable[[], None] | None = None,
) -> DiffSummary | None:
    """Run the plan's units on a thread pool and write their items in plan order.

    Returns the summary of the delta, or None when the plan is a part (``plan.rank``).
    ``base_digests``/``target_digests`` are digests already known (e.g. by a live producer), and
    are completed in place with those the units compute; without them the sides' caches are asked.
    ``budget`` bounds the bytes the tasks in flight hold (default ``diff_budget(workers)``).
    ``before_writing()`` is called before the first byte is written (the output directory included),
    once the first item is ready: it may raise, and then nothing is written.

    With the CPU scan over memory views (HF directories), a tensor's digest unit and its ranges
    run as one task that hashes each tile of the scan while it is in cache, so the target is
    read once; other units are tasks of their own.
    """
    workers = workers or default_workers()
    budget = budget or diff_budget(workers)
    # With fewer workers than cores, a large tensor's items leave their worker with their frames not yet
    # compressed (codec.PendingItem): this thread, the writer's, compresses them on a core of its own
    # while the worker scans on. With a worker on every core it would only take turns with them, and
    # compress the last items alone after the scan.
    defer = workers < default_workers()
    fused = scan is None and getattr(base, "flat_is_memory", False) and getattr(new, "flat_is_memory", False)
    scan = scan or numpy_scan(level)
    # In a stream, the base was the previous diff's target: its digests are usually cached.
    b_digests = base.cached_digests() if base_digests is None else base_digests
    n_digests = new.cached_digests() if target_digests is None else target_digests
    layout = plan.layout

    def range_task(u: RangeUnit) -> Iterator[EncodedItem]:
        item = scan(u.name, Region.range(u.start, u.stop), base.flat(u.name, u.start, u.stop),
                    new.flat(u.name, u.start, u.stop), u.op, None)  # fmt: skip
        if progress:
            progress((u.stop - u.start) * u.itemsize)
        if item is not None:
            yield item

    def small_tensor(name: str, ranges: list[RangeUnit]) -> Iterator[EncodedItem]:
        """A small tensor (one range, at most SMALL_TENSOR_BYTES): scanned whole, hashed after its scan."""
        (u,) = ranges
        b, n = base.flat(name, u.start, u.stop), new.flat(name, u.start, u.stop)
        item = scan(name, Region.range(u.start, u.stop), b, n, u.op, None)
        if name not in b_digests:
            b_digests[name] = digest_small(b)  # a small tensor: digest_bytes without its wrappers
        if name not in n_digests:
            n_digests[name] = digest_small(n)
        if progress:
            progress((u.stop - u.start) * u.itemsize)
        if item is not None:
            yield item

    def span_run(
        run: list[tuple[str, RangeUnit]], b_lo: int, n_lo: int, count: int, b_starts: list[int]
    ) -> Iterator[tuple[str, EncodedItem | None]]:
        """Neighbouring small tensors laid out alike in both files: one scan over their span, its changes
        cut at the tensors' bounds; each tensor's item is exactly the one its own scan gives."""
        first = run[0][0]
        b_span, n_span = base.span(first, b_lo, count), new.span(first, n_lo, count)  # type: ignore[attr-defined]
        positions, masks, news = scan_changes(b_span, n_span)
        itemsize = b_span.dtype.itemsize
        names = [name for name, _ in run]
        starts = [(start - b_lo) // itemsize for start in b_starts]  # the tensors' byte starts in the base file
        ends = [start + u.stop for start, (_, u) in zip(starts, run, strict=True)]
        cuts = np.searchsorted(positions, starts + ends).tolist()

        def dense(i: int) -> tuple[np.ndarray, np.ndarray]:
            return b_span[starts[i] : ends[i]], n_span[starts[i] : ends[i]]

        ops = [u.op for _, u in run]
        items = encode_span(names, ops, starts, ends, cuts, positions, masks, news, dense, level=level)
        hasher = blake3.blake3
        for digests, span in ((b_digests, b_span), (n_digests, n_span)):
            raw: memoryview | None = None
            for name, e0, e1 in zip(names, starts, ends, strict=True):
                if name not in digests:  # digest_bytes of the tensor's bytes, one BLAKE3 call each
                    if raw is None:
                        raw = memoryview(span.view(np.uint8))
                    digests[name] = hasher(raw[e0 * itemsize : e1 * itemsize]).hexdigest()
        if progress:
            progress(sum(u.stop for _, u in run) * itemsize)
        return zip(names, items, strict=True)

    Run = list[tuple[str, RangeUnit]]

    def spans_of(batch: list[tuple[str, list[RangeUnit]]]) -> Iterator[tuple[Run, int, int, int, list[int]]]:
        """The batch, in base file order, cut into runs for ``span_run``: whole-tensor ranges of one width
        that follow each other in one file of each side, at the same distances on both sides, with
        little else between them. (run, base start, new start, elements, the run's tensors' base starts);
        a run of one is scanned alone."""
        run: list[tuple[str, RangeUnit]] = []
        b_starts: list[int] = []  # byte starts in the base file of the run's tensors
        b_lo = n_lo = b_end = 0
        file_b = file_n = None
        width = 0
        b_loc, n_loc = base.location, new.location  # type: ignore[attr-defined]
        located = [(b_loc(name), name, ranges[0]) for name, ranges in batch]
        located.sort(key=lambda x: (str(x[0].file), x[0].start))
        for lb, name, u in located:
            ln = n_loc(name)
            start = lb.start
            nbytes = u.stop * u.itemsize
            whole = u.start == 0 and lb.nbytes == nbytes == ln.nbytes and nbytes > 0
            fits = (
                run
                and whole
                and u.itemsize == width
                and lb.file is file_b
                and ln.file is file_n
                and start >= b_end
                and start - b_lo == ln.start - n_lo
                and (start - b_lo) % width == 0
                and start - b_end <= SPAN_GAP_BYTES
                and start + nbytes - b_lo <= SPAN_BYTES
            )
            if not fits:
                if run:
                    yield run, b_lo, n_lo, (b_end - b_lo) // width, b_starts
                run, b_starts = [], []
                if not whole:
                    yield [(name, u)], -1, -1, 0, []  # not a whole tensor as one range: alone
                    continue
                b_lo, n_lo, width, file_b, file_n = start, ln.start, u.itemsize, lb.file, ln.file
            run.append((name, u))
            b_starts.append(start)
            b_end = start + nbytes  # (the new side's run ends at the same distance from its start)
        if run:
            yield run, b_lo, n_lo, (b_end - b_lo) // width, b_starts

    def batch_task(batch: list[tuple[str, list[RangeUnit]]]) -> Iterator[EncodedItem]:
        """Consecutive small tensors, one after the other in one task (see SMALL_TENSOR_BYTES)."""
        if hasattr(base, "span") and hasattr(new, "span"):
            # Scanned in file order, emitted in plan order (the items of a batch are a few KiB each).
            found: dict[str, EncodedItem | None] = {}
            alone: list[str] = []  # tensors scanned alone; the runs' spans are released whole
            spans: list[tuple[str, int, int, int]] = []  # (first tensor, base start, new start, bytes)
            for run, b_lo, n_lo, count, b_starts in spans_of(batch):
                if len(run) > 1:
                    found.update(span_run(run, b_lo, n_lo, count, b_starts))
                    spans.append((run[0][0], b_lo, n_lo, count * run[0][1].itemsize))
                else:
                    name, u = run[0]
                    found[name] = next(iter(small_tensor(name, [u])), None)
                    alone.append(name)
            for name, _ in batch:
                item = found[name]
                if item is not None:
                    yield item
            for first, b_lo, n_lo, nbytes in spans:
                base.release_span(first, b_lo, nbytes)  # type: ignore[attr-defined]
                new.release_span(first, n_lo, nbytes)  # type: ignore[attr-defined]
            if alone:
                base.release_tensors(alone)  # type: ignore[attr-defined]
                new.release_tensors(alone)  # type: ignore[attr-defined]
            return
        for name, ranges in batch:
            yield from small_tensor(name, ranges)
        release = getattr(base, "release_tensors", None)
        if release is not None:
            names = [name for name, _ in batch]
            release(names)
            new.release_tensors(names)  # type: ignore[attr-defined]

    def tensor_task(name: str, ranges: list[RangeUnit]) -> Iterator[EncodedItem]:
        """A tensor's digests and ranges in one pass: each tile is hashed right after it is scanned."""
        hashers = [
            (blake3.blake3(max_threads=1), side, digests)  # one thread per hasher: the workers use the cores
            for side, digests in ((base, b_digests), (new, n_digests))
            if name not in digests
        ]
        # One worker is one thread. With several, a range is hashed on a helper thread (each tile
        # from the last-level cache, while the scan reads the next one) only while some worker has
        # no large tensor to scan, e.g. at the end of the plan; otherwise right after each tile's
        # scan, on the scanning thread, while the tile is in its core's cache.
        nbytes = sum((u.stop - u.start) * u.itemsize for u in ranges)
        feeder = _TileFeeder(helper=workers > 1 and bool(hashers) and nbytes >= PIPELINE_MIN_BYTES)
        try:
            with _SCANNING:
                for u in ranges:
                    b, n = base.flat(u.name, u.start, u.stop), new.flat(u.name, u.start, u.stop)
                    views = [(h, (b if side is base else n).view(np.uint8)) for h, side, _ in hashers]
                    width = u.itemsize
                    pipelined = feeder.helper and _SCANNING.count < workers
                    tile = TILE_BYTES * (4 if pipelined else 1)

                    def hash_tile(
                        lo: int, hi: int, views: list[tuple[Any, Any]] = views, w: int = width, pipe: bool = pipelined
                    ) -> None:
                        for h, raw in views:
                            feeder.feed(h, raw[lo * w : hi * w], pipe)

                    positions, masks, news = scan_changes(
                        b, n, tile=tile // width, after=hash_tile if hashers else None
                    )  # fmt: skip
                    item = encode_changes(
                        u.name, Region.range(u.start, u.stop), positions, masks, news, len(n), _const(b, n), op=u.op,
                        level=level, defer=defer,
                    )  # fmt: skip
                    del positions, masks, news, views
                    if progress:
                        progress((u.stop - u.start) * u.itemsize)
                    if item is not None:
                        yield item
        finally:
            feeder.close()
        for h, _, digests in hashers:
            digests[name] = h.hexdigest()
        for side in (base, new):
            release = getattr(side, "release_tensor", None)
            if release is not None:
                release(name)

    def chunk_task(u: ChunkUnit) -> Iterator[EncodedItem]:
        barr, narr = base.read_chunk(u.key, u.chunk), new.read_chunk(u.key, u.chunk)
        for band in u.bands:
            item = scan(band.name, Region.box(band.offsets, band.sizes), band_of(barr, band), band_of(narr, band),
                        band.op, None)  # fmt: skip
            if item is not None:
                yield item
        del barr, narr
        base.release(u.key, u.chunk)
        new.release(u.key, u.chunk)
        if progress:
            progress(u.chunk.numel * u.itemsize)

    def digest_task(u: DigestUnit) -> Iterator[EncodedItem]:
        for side, digests in ((base, b_digests), (new, n_digests)):
            if u.name not in digests:
                digests[u.name] = side.canonical_digest(u.name)
        return iter(())

    def residual_task(units: list[ResidualUnit]) -> Iterator[EncodedItem]:
        # Value-changing conversion, band by band of source rows (one conversion for every tensor of
        # ``units``: an fp8 weight and its scale), cut into each tensor's flat ranges as if whole.
        names = [u.name for u in units]
        streams = [_ResidualStream(u.name, u.op, u.residual, u.itemsize, numel(layout[u.name][1]), scan) for u in units]
        later: list[list[EncodedItem]] = [[] for _ in units[1:]]
        for olds, curs in zip(base.converted_bands(names), new.converted_bands(names), strict=True):
            for i, (stream, old, cur) in enumerate(zip(streams, olds, curs, strict=True)):
                for item in stream.feed(old, cur):
                    if i == 0:
                        yield item
                    else:  # items stay in plan order: the first tensor's, then the next one's
                        later[i - 1].append(item)
            del olds, curs
        for u, stream in zip(units, streams, strict=True):
            b_digests[u.name], n_digests[u.name] = stream.hexdigests()
        for items in later:
            yield from items

    def tied_task(u: TiedUnit) -> Iterator[EncodedItem]:
        base.check_tied(u.key, u.name)
        new.check_tied(u.key, u.name)
        return iter(())

    def residual_cost(units: list[ResidualUnit]) -> int:
        # Per side: a source band, its float32 temporaries (fp8: ~13 bytes per element), one range
        # buffer per tensor; and the scan of one range.
        return 2 * (RESIDUAL_BAND_BYTES * 8 + CHUNK_BYTES * len(units)) + _scan_cost(CHUNK_BYTES)

    def tasks() -> Iterator[tuple[int, Callable[[], Iterable[EncodedItem]]]]:
        units = plan.units
        n_units = len(units)
        # A tensor larger than a worker's share is hashed apart, by BLAKE3's own threads.
        share = plan.total_bytes // max(1, workers)
        batch: list[tuple[str, list[RangeUnit]]] = []
        batch_bytes = 0
        i = 0
        while i < n_units:
            u = units[i]
            if isinstance(u, DigestUnit) and fused:
                j = i + 1
                while j < n_units and isinstance(units[j], RangeUnit) and units[j].name == u.name:  # type: ignore[union-attr]
                    j += 1
                if j == i + 2:  # one range: a small tensor, usually
                    r = cast(RangeUnit, units[i + 1])
                    ranges = [r]
                    nbytes = (r.stop - r.start) * r.itemsize
                else:
                    ranges = cast(list[RangeUnit], units[i + 1 : j])
                    nbytes = sum((r.stop - r.start) * r.itemsize for r in ranges)
                if len(ranges) == 1 and nbytes <= SMALL_TENSOR_BYTES:
                    batch.append((u.name, ranges))
                    batch_bytes += nbytes
                    if batch_bytes >= BATCH_BYTES or len(batch) >= BATCH_TENSORS:
                        yield _batch_cost(batch_bytes), Inline(_bind(batch_task, batch))
                        batch, batch_bytes = [], 0
                    i = j
                    continue
                if batch:
                    yield _batch_cost(batch_bytes), Inline(_bind(batch_task, batch))
                    batch, batch_bytes = [], 0
                if workers == 1 or nbytes <= share:
                    yield _scan_cost(CHUNK_BYTES), _bind2(tensor_task, u.name, ranges)
                    i = j
                    continue
            if batch:
                yield _batch_cost(batch_bytes), Inline(_bind(batch_task, batch))
                batch, batch_bytes = [], 0
            if isinstance(u, RangeUnit):
                yield _scan_cost((u.stop - u.start) * u.itemsize), _bind(range_task, u)
            elif isinstance(u, ChunkUnit):
                nbytes = u.chunk.numel * u.itemsize
                yield 2 * nbytes + _scan_cost(min(nbytes, CHUNK_BYTES)), _bind(chunk_task, u)
            elif isinstance(u, DigestUnit):
                yield 4 * BAND_BYTES, _bind(digest_task, u)
            elif isinstance(u, ResidualUnit):
                group = [u]
                while (
                    i + 1 < len(units)
                    and isinstance(units[i + 1], ResidualUnit)
                    and base.shares_source(u.name, units[i + 1].name)  # type: ignore[union-attr]
                    and new.shares_source(u.name, units[i + 1].name)  # type: ignore[union-attr]
                ):
                    i += 1
                    group.append(units[i])  # type: ignore[arg-type]
                yield residual_cost(group), _bind(residual_task, group)
            elif isinstance(u, TiedUnit):
                yield 4 * BAND_BYTES, _bind(tied_task, u)
            else:
                raise TypeError(f"unknown plan unit {u!r}")
            i += 1
        if batch:
            yield _batch_cost(batch_bytes), Inline(_bind(batch_task, batch))

    def open_writer() -> DeltaWriter:
        if before_writing is not None:
            before_writing()
        if plan.rank is not None:
            from ..delta.parts import part_dir

            return DeltaWriter(part_dir(out, plan.rank), on_block=on_block)
        return DeltaWriter(out, on_block=on_block)

    stream = ordered_stream(tasks(), workers, budget=budget, size=_item_bytes)
    first = next(stream, None)  # the scan runs while ``before_writing`` waits (a check of the base on the store)
    try:
        writer = open_writer()
    except BaseException:
        stream.close()
        raise
    try:
        if first is not None:
            writer.add(first)
            del first
        for item in stream:
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
    except BaseException as exc:
        writer.abort()
        if isinstance(exc, OSError) and exc.errno in NO_ROOM and exc.filename is None:
            raise named(exc, out) from exc  # a block's write: name the delta it was for (its partial is gone)
        raise
    return summarize(Path(out), manifest)


def existing_result(
    out: str | os.PathLike[str],
    plan: Plan,
    base: Side,
    new: Side,
    *,
    base_version: str | None,
    target_version: str | None,
) -> DiffSummary | None:
    """The summary of ``out`` when it already holds this very diff's result, None when ``out`` is absent or
    empty; a :class:`ConflictError` (nothing written) for anything else there.

    A diff that completed just before its process was killed is re-run by its cron script: the same
    command must find its own delta (exit 0), not a conflict. "Its own" is decided by what identifies a
    delta to a receiver: the base and target labels and fingerprints. Labels given on the command line
    are compared first, then each side's digests (from the digest cache a completed diff filled: no
    read at all then; otherwise one hashing pass over that side, which writes nothing).
    """
    from ..delta.reader import Delta
    from ..errors import ConflictError, DcrError
    from ..format.manifest import BLOCKS_DIR

    path = Path(out)
    if not path.exists() or (path.is_dir() and not any(path.iterdir())):
        return None

    def conflict(why: str) -> ConflictError:
        return ConflictError(f"{path} already exists ({why}); choose a new output path or remove it")

    if not path.is_dir():
        raise conflict("not a directory")
    try:
        delta = Delta.open(path)
    except DcrError:
        raise conflict("not a complete delta") from None
    manifest = delta.manifest
    for block in manifest.blocks:
        try:
            complete = (path / BLOCKS_DIR / block.id).stat().st_size == block.size
        except OSError:
            complete = False
        if not complete:
            raise conflict(f"a delta whose block {block.id[:16]} is missing or cut short")
    try:  # every byte, as a receiver would check it (the delta is small next to the checkpoints)
        delta.verify_blocks(("data", "repair"))
    except DcrError:
        raise conflict("a delta with a damaged block") from None
    there = (manifest.base, manifest.target)
    for label, ref, what in ((base_version, there[0], "base"), (target_version, there[1], "target")):
        if label is not None and ref.version != label:
            raise conflict(f"a delta of another {what}, {ref.version!r}")
    for side, ref, label, what in ((base, there[0], base_version, "base"), (new, there[1], target_version, "target")):
        digests = _all_digests(side, plan)
        fp = fingerprint(side.table(digests))
        if ref.fingerprint != fp or ref.version != (label or fp[:16]):
            raise conflict(f"a delta of another {what} ({ref.version!r}, fingerprint {ref.fingerprint[:16]})")
    summary = summarize(path, manifest)
    summary.already_there = True
    return summary


def cached_base_ref(plan: Plan, base: Side, base_version: str | None) -> VersionRef | None:
    """The reference a diff of ``plan`` would give its base (label, fingerprint), where the digest
    cache holds every one of the base's tensors; None where it does not (finding out would cost a read)."""
    cached = base.cached_digests()
    if any(name not in cached for name in plan.layout):
        return None
    fp = fingerprint(base.table({name: cached[name] for name in plan.layout}))
    return VersionRef(base_version or fp[:16], fp)


def _all_digests(side: Side, plan: Plan) -> dict[str, str]:
    """Every canonical tensor's digest of one side, as a diff of ``plan`` records it (cached ones not read
    again; residual tensors digested over their converted bits), remembered for the next run."""
    digests = dict(side.cached_digests())
    missing = [name for name in plan.layout if name not in digests]
    converted = {u.name for u in plan.units if isinstance(u, ResidualUnit)} if missing else set()
    for name in missing:
        if name in converted:
            stream = StreamingDigest()
            for (band,) in side.converted_bands([name]):
                stream.update(band)
            digests[name] = stream.hexdigest()
        else:
            digests[name] = side.canonical_digest(name)
    if missing:
        side.remember_digests(digests)
    return digests


def _bind(run: Callable[[Any], Iterable[EncodedItem]], unit: Any) -> Callable[[], Iterable[EncodedItem]]:
    return lambda: run(unit)


def _const(b: np.ndarray, n: np.ndarray) -> Callable[[], tuple[np.ndarray, np.ndarray]]:
    return lambda: (b, n)


def _bind2(
    run: Callable[[str, list[RangeUnit]], Iterable[EncodedItem]], name: str, ranges: list[RangeUnit]
) -> Callable[[], Iterable[EncodedItem]]:
    return lambda: run(name, ranges)


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


def check_options(workers: int | None, level: int | None, rank: int | None, world_size: int | None) -> None:
    """What ``dcr diff``'s option types check, for callers of the Python API: one line, before any work."""
    check_workers(workers)
    check_level(level)
    whole = (rank is None) == (world_size is None)
    if not whole or not (rank is None or _in_world(rank, world_size)):
        raise IncompatibleError(
            f"give rank and world_size together, with 0 <= rank < world_size (got rank={rank!r}, "
            f"world_size={world_size!r})"
        )


def _in_world(rank: object, world_size: object) -> bool:
    ints = all(isinstance(v, int) and not isinstance(v, bool) for v in (rank, world_size))
    return ints and 0 <= rank < world_size  # type: ignore[operator]


@fewer_collections()
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
    check_base: Callable[[VersionRef], None] | None = None,
    before_writing: Callable[[], None] | None = None,
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
    Where ``out`` already holds this very diff's complete delta (a re-run after a kill), nothing is written
    and its summary is returned with ``already_there`` set; anything else there is a ConflictError.
    ``check_base(ref)`` is called with the delta's base reference before anything is written, where the
    base's digests are all in the digest cache (the steady state of a stream: no read at all); it may
    raise to refuse the base (``dcr diff --push`` refuses one that is not the store's head there, before
    the diff and before any block is uploaded). Without cached digests it is not called.
    ``before_writing()`` is called before the first byte is written, after the scan has started (the
    caller's own setup, such as the store's client, overlaps it); it may raise, and then nothing is written.
    """
    check_options(workers, level, rank, world_size)
    fmt, b_src, n_src = open_pair(base, new, format, profile)
    try:
        if fmt == "hf":
            if rank is not None and (world_size or 1) > 1:
                raise IncompatibleError(
                    "--rank/--world-size split training shards; an HF directory is diffed by one process"
                )
            n_layout = n_src.layout()
            check_layouts(b_src.layout(), n_layout)
            plan = plan_tensors(n_layout, overwrite)
            b_side: Any = HfSide(b_src)
            n_side: Any = HfSide(n_src)
        else:
            plan = plan_shards(b_src, n_src, overwrite=overwrite, rank=rank, world_size=world_size)
            b_side, n_side = b_src, n_src
        if rank is None:
            done = existing_result(out, plan, b_side, n_side, base_version=base_version, target_version=target_version)
            if done is not None:
                return done
        checked: Future[None] | None = None
        if check_base is not None and rank is None:
            known = cached_base_ref(plan, b_side, base_version)
            if known is not None:
                # The check asks the store (round trips, across regions): the scan starts meanwhile, and
                # the first write waits for the answer (``before_writing``), so a refused base still
                # leaves nothing written and nothing uploaded.
                checked = in_background(functools.partial(check_base, known), "dcr-base-check")
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
            before_writing=_both(before_writing, None if checked is None else checked.result),
        )
    finally:
        _close(b_src)
        _close(n_src)


def _both(first: Callable[[], None] | None, second: Callable[[], None] | None) -> Callable[[], None] | None:
    if first is None or second is None:
        return first or second

    def both() -> None:
        first()
        second()

    return both
