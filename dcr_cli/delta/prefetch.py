"""Fetching a remote delta's blocks in the background while the receiver's first pass reads them.

A :class:`BlockFetcher` downloads the blocks it is given, in that order (the order in which the
receiver's first pass uses them), as ranged reads on a few threads, at most ``budget`` bytes in
flight. Each block is assembled at its offsets (in memory up to a limit, then in a temporary file)
and its digest computed as its bytes become contiguous; a reader asks for a byte range of a block and
waits only until that range has arrived. So the first item of a delta can be checked while the
last block is still on the wire.

What a reader gets is unchecked bytes: the caller checks every section against its own digest
(``Delta.read_section``), and a whole block is valid only once :meth:`wait_all` (or
:meth:`wait_block`) has returned, which is when its size and digest have been checked. Receivers
call it before their first write, so overlapping the download with the first pass moves no write
before a check. Every block is read once, never more than its declared size plus one byte.

``dcr pull`` uses the same fetcher with ``spool``: every block is written straight to a temporary
file in that directory (memory holds only the ranges in flight), and :meth:`keep` renames a block's
file to its final name once its size and digest have been checked.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..errors import IntegrityError
from ..format.digest import StreamingDigest
from ..format.manifest import BlockEntry
from .source import BlockSource

RANGE_BYTES = 4 << 20  # one ranged read
WINDOW_BYTES = 32 << 20  # ranges being fetched at once (their bytes are in memory until written)
# Blocks kept in anonymous memory up to this, the rest in a temporary directory (page cache, which the
# kernel can write out): a receiver's memory does not grow with the delta. The allowance is the
# process's, shared by all its fetchers: a late joiner that checks a chain of N deltas before its
# first write holds at most this much, not N times it.
MEMORY_BYTES = 64 << 20
WORKERS = 8


class _Allowance:
    """Bytes of block data the fetchers of this process may still hold in memory, together."""

    def __init__(self, total: int) -> None:
        self._left = total
        self._lock = threading.Lock()

    def take(self, n: int) -> bool:
        with self._lock:
            if n > self._left:
                return False
            self._left -= n
            return True

    def give(self, n: int) -> None:
        with self._lock:
            self._left += n


_MEMORY = _Allowance(MEMORY_BYTES)


class MissingBlock(IntegrityError):
    """A block the manifest names is absent from the source."""


@dataclass
class _Block:
    entry: BlockEntry
    ranges: list[tuple[int, int]]  # [lo, hi) of the block, hi of the last one is size + 1
    data: bytearray | None = None  # in memory, or
    path: str | None = None  # in a temporary file, opened per range (a delta of thousands of blocks
    # would otherwise hold a descriptor for each until the end)
    arrived: set[int] = field(default_factory=set)  # indexes of ranges written
    contiguous: int = 0  # bytes from the start that have arrived
    next_range: int = 0  # first range not yet folded into ``contiguous``
    digest: StreamingDigest = field(default_factory=StreamingDigest)
    done: bool = False  # size and digest checked
    error: BaseException | None = None


class BlockFetcher:
    """Background, ordered, budgeted download of whole blocks from a (remote) block source."""

    def __init__(
        self,
        source: BlockSource,
        blocks: Sequence[BlockEntry],
        *,
        workers: int = WORKERS,
        window: int = WINDOW_BYTES,
        range_bytes: int = RANGE_BYTES,
        memory: int | None = None,
        spool: str | os.PathLike[str] | None = None,
        throttle: Callable[[int], None] | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> None:
        """``spool``: write every block to ``<spool>/.<id>-<size>.part`` (two fetchers told different sizes for
        one id, e.g. by a wrong hint, never share a file; kept by :meth:`keep`, else removed by
        :meth:`close`); ``throttle`` is called with a range's size before it is read (a rate limit),
        ``progress`` with the bytes of each range once it has arrived; ``memory`` bounds the bytes of
        blocks this fetcher keeps in memory (default: what is left of the process's ``MEMORY_BYTES``,
        given back when the fetcher is closed or collected)."""
        self.source = source
        self._throttle = throttle
        self._progress = progress
        self._spool = os.fspath(spool) if spool is not None else None
        self._cond = threading.Condition()
        self._blocks: dict[str, _Block] = {}
        self._order: list[tuple[_Block, int]] = []  # (block, range index), in fetch order
        self._next = 0  # next entry of _order to start
        self._in_flight = 0  # bytes of ranges started and not yet written
        self._window = max(window, range_bytes)
        self._cancelled = False
        self._dir: str | None = None
        held = 0
        allowance = _MEMORY if memory is None else _Allowance(memory)
        for entry in blocks:
            if entry.id in self._blocks:
                continue
            ranges = [(lo, min(lo + range_bytes, entry.size)) for lo in range(0, max(entry.size, 1), range_bytes)]
            lo, hi = ranges[-1]
            ranges[-1] = (lo, hi + 1)  # one byte more: is the object longer than declared?
            block = _Block(entry, ranges)
            if self._spool is not None:
                block.path = os.path.join(self._spool, f".{entry.id}-{entry.size}.part")
                _create(block.path, os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0))
            elif allowance.take(entry.size):
                block.data = bytearray(entry.size)
                held += entry.size
            else:
                if self._dir is None:
                    self._dir = tempfile.mkdtemp(prefix="dcr-fetch-")
                    weakref.finalize(self, shutil.rmtree, self._dir, True)
                block.path = os.path.join(self._dir, entry.id)
                _create(block.path, os.O_EXCL)
            self._blocks[entry.id] = block
            self._order.extend((block, i) for i in range(len(ranges)))
        if held:  # the blocks' memory is the fetcher's until it is collected (readers use it after close)
            weakref.finalize(self, allowance.give, held)
        # Daemon threads: a receiver that fails early exits without waiting for downloads it no longer needs.
        self._threads = [
            threading.Thread(target=self._work, name=f"dcr-fetch-{i}", daemon=True)
            for i in range(max(1, min(workers, len(self._order))))
        ]
        for t in self._threads:
            t.start()

    @classmethod
    def of_checked_files(cls, source: BlockSource, files: Sequence[tuple[BlockEntry, str]]) -> BlockFetcher:
        """A fetcher that fetches nothing: each block is already whole in its file, checked (size and
        digest) by the caller, and is read there in place. The files are the caller's: never removed here."""
        fetcher = cls(source, [])
        for entry, path in files:
            block = _Block(entry, [(0, entry.size + 1)], path=path, contiguous=entry.size, next_range=1)
            block.done = True
            fetcher._blocks[entry.id] = block
        return fetcher

    def __contains__(self, block_id: str) -> bool:
        return block_id in self._blocks

    @property
    def ids(self) -> list[str]:
        """The blocks this fetcher was given, in fetch order."""
        return list(self._blocks)

    def entry(self, block_id: str) -> BlockEntry:
        return self._blocks[block_id].entry

    @property
    def settled(self) -> bool:
        """Whether every block has either arrived whole and been checked, or failed."""
        with self._cond:
            return all(b.done or b.error is not None for b in self._blocks.values())

    # -- the workers ------------------------------------------------------------------------------------------------

    def _work(self) -> None:
        while True:
            with self._cond:
                while (
                    not self._cancelled
                    and self._next < len(self._order)
                    and self._in_flight > 0
                    and self._in_flight + self._cost(self._order[self._next]) > self._window
                ):
                    self._cond.wait()
                if self._cancelled or self._next >= len(self._order):
                    return
                block, index = self._order[self._next]
                self._next += 1
                if block.error is not None:
                    continue
                cost = self._cost((block, index))
                self._in_flight += cost
            try:
                self._fetch(block, index)
            except BaseException as exc:  # handed to whoever reads or waits for this block
                with self._cond:
                    if block.error is None:
                        block.error = _as_integrity(exc, block.entry, self.source.label)
                    self._cond.notify_all()
            finally:
                with self._cond:
                    self._in_flight -= cost
                    self._cond.notify_all()

    @staticmethod
    def _cost(job: tuple[_Block, int]) -> int:
        lo, hi = job[0].ranges[job[1]]
        return hi - lo

    def _fetch(self, block: _Block, index: int) -> None:
        entry = block.entry
        lo, hi = block.ranges[index]
        last = index == len(block.ranges) - 1
        want = (hi - 1 if last else hi) - lo
        if self._throttle is not None:
            self._throttle(want)
        data = self.source.read(entry, lo, hi)
        if len(data) > want:
            raise IntegrityError(
                f"block {entry.id[:16]}… in {self.source.label} is larger than the {entry.size} bytes the manifest says"
            )
        if len(data) < want:
            raise IntegrityError(f"block {entry.id[:16]}… in {self.source.label} is truncated")
        if block.data is not None:
            block.data[lo : lo + want] = data
        else:
            assert block.path is not None
            self._spooled(_write_at, block.path, data, lo)
        if self._progress is not None:
            self._progress(want)
        with self._cond:
            block.arrived.add(index)
            start = block.contiguous
            while block.next_range in block.arrived:
                _r_lo, r_hi = block.ranges[block.next_range]
                block.contiguous = min(r_hi, entry.size)
                block.next_range += 1
            end = block.contiguous
            if end > start:  # fold the newly contiguous bytes into the digest, in order
                block.digest.update(self._bytes(block, start, end))
            if block.next_range == len(block.ranges):
                if block.digest.hexdigest() != entry.id:
                    block.error = IntegrityError(
                        f"block {entry.id[:16]}… in {self.source.label} is corrupt (digest mismatch); "
                        f"{self.source.damaged_advice}"
                    )
                else:
                    block.done = True
            self._cond.notify_all()

    def _spooled(self, write: Callable[[str, bytes, int], None], path: str, data: bytes, offset: int) -> None:
        """A write to the spool; a full disk there names the spool, not the receiver's checkpoint."""
        try:
            write(path, data, offset)
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            where = os.path.dirname(path)
            hint = "" if self._spool is not None else " (TMPDIR chooses it)"
            raise OSError(
                exc.errno,
                f"no space left for downloaded blocks in {where}{hint}; free space there or point TMPDIR "
                "at a larger disk, then re-run the same command",
            ) from None

    @staticmethod
    def _bytes(block: _Block, start: int, end: int) -> bytes | memoryview:
        if block.data is not None:
            return memoryview(block.data)[start:end]
        assert block.path is not None
        return _read_at(block.path, end - start, start)

    # -- readers ----------------------------------------------------------------------------------------------------

    def read(self, block_id: str, start: int, end: int) -> bytes:
        """Bytes ``start:end`` of a block once they have arrived (unchecked: the caller checks its section).

        Bytes that arrived stay readable when a later part of the block fails (a range lost, the block
        longer than declared or not at its digest): a section checked against its own digest is sound
        whatever the rest of its block holds, and a streaming apply reads the sections it wrote again to
        undo them after such a failure (receiver-checkpoint.md §4.4)."""
        block = self._blocks[block_id]
        end = min(end, block.entry.size)
        with self._cond:
            while block.error is None and block.contiguous < end and not self._cancelled:
                self._cond.wait()
            if block.contiguous < end:
                if block.error is not None:
                    raise block.error
                raise IntegrityError(f"block {block_id[:16]}… of {self.source.label}: the download was cancelled")
        return bytes(self._bytes(block, start, max(start, end)))

    def wait_block(self, block_id: str) -> None:
        """Return once the block has arrived whole with its size and digest; raise why it did not."""
        block = self._blocks[block_id]
        with self._cond:
            while block.error is None and not block.done and not self._cancelled:
                self._cond.wait()
            if block.error is not None:
                raise block.error
            if not block.done:
                raise IntegrityError(f"block {block_id[:16]}… of {self.source.label}: the download was cancelled")

    def wait_all(self) -> None:
        """Every block checked whole, or the first failure in fetch order."""
        for block_id in self._blocks:
            self.wait_block(block_id)

    def arrived_file(self, block_id: str) -> str | None:
        """The spool file of a block that has arrived whole and been checked; None if it has not, or if this
        fetcher keeps its blocks in memory (no ``spool``)."""
        with self._cond:
            block = self._blocks[block_id]
            return block.path if self._spool is not None and block.done else None

    @property
    def complete(self) -> bool:
        """Whether every block has arrived whole and been checked."""
        with self._cond:
            return all(b.done for b in self._blocks.values())

    def cancel(self) -> None:
        """Stop starting ranges (the ones in flight finish); readers waiting get an error."""
        with self._cond:
            self._cancelled = True
            self._cond.notify_all()

    def keep(self, block_id: str, dest: str | os.PathLike[str], *, durable: bool = True) -> None:
        """Spooled fetchers: once the block is checked whole, make its file durable (unless ``durable`` is
        False: a copy that does not outlive its process's node) and rename it to ``dest``."""
        assert self._spool is not None, "keep() needs a spool directory"
        self.wait_block(block_id)
        block = self._blocks[block_id]
        assert block.path is not None
        if durable:
            fd = os.open(block.path, os.O_RDONLY)  # every range has been written: fsync covers the file's data
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        os.replace(block.path, dest)
        block.path = None

    def abandon(self) -> None:
        """Cancel without waiting for the ranges in flight (a stalled read may never return) and remove a
        spool's unkept block files. A worker still reading finds its file gone when it returns (files are
        opened without O_CREAT): nothing is written again, its block fails, and the threads are daemons."""
        self.cancel()
        for block in self._blocks.values():
            if self._spool is not None and block.path is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(block.path)

    def close(self) -> None:
        """Cancel, wait for the ranges in flight, close the files; a spool's unkept block files are removed."""
        self.cancel()
        for t in self._threads:
            t.join()
        for block in self._blocks.values():
            if self._spool is not None and block.path is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(block.path)
                block.path = None

    def __enter__(self) -> BlockFetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _as_integrity(exc: BaseException, entry: BlockEntry, label: str) -> BaseException:
    if isinstance(exc, FileNotFoundError):
        return MissingBlock(f"block {entry.id[:16]}… is missing from {label}")
    return exc


def _create(path: str, flags: int) -> None:
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | flags, 0o600))


def _write_at(path: str, data: bytes, offset: int) -> None:
    fd = os.open(path, os.O_WRONLY | getattr(os, "O_NOFOLLOW", 0))
    try:
        view = memoryview(data)
        while view:
            n = os.pwrite(fd, view, offset)
            view, offset = view[n:], offset + n
    finally:
        os.close(fd)


def _read_at(path: str, size: int, offset: int) -> bytes:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    try:
        return os.pread(fd, size, offset)
    finally:
        os.close(fd)
