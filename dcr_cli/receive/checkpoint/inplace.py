"""Reading and writing a checkpoint's tensor data in place, with pread and pwrite.

No memory map is written: a store into a mapping cannot report an error, so on a full file
system (a sparse file, a tmpfs, a copy-on-write file system) it kills the process with SIGBUS.
``pwrite`` returns ENOSPC instead, which the applier reports in one line while its state still
says "applying", so a re-run after freeing space finishes the job. Reads use ``pread`` too: on
a tmpfs even a read fault on a hole allocates a page.

Digests are the exception: a file without holes (every byte allocated: ``st_blocks`` covers its
size) is hashed straight from a read-only mapping. A read fault there never allocates, and BLAKE3
then reads the page cache itself instead of a copy of it, which halves the memory traffic of
``verify`` and of the apply's proof (about 2x faster on 2 cores). A file with holes is read with
``pread``, as before.

Writes land in the page cache that every reader of the file shares (mapped readers included);
only data sections are ever written, so headers stay intact. An item's elements are written as
*runs*: spans of the file that lie inside the item's region (so no other item's elements are
rewritten, even when items are written in parallel) and are dense enough to rewrite whole.
"""

from __future__ import annotations

import itertools
import mmap
import os
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import blake3
import numpy as np

from ...checkpoints.safetensors_dir import TensorLocation
from ...errors import IntegrityError
from ...format.codec import small_bytes
from ...format.digest import StreamingDigest, digest_bytes
from ...format.dtypes import dtype as lookup_dtype
from ...format.kernels import run_bounds
from ...format.kernels import scatter as scatter_into
from ...format.manifest import TensorEntry, make_entry
from ...io.files import start_writeback
from ...io.pool import Inline, ordered_parallel

GAP_BYTES = 4096  # unchanged bytes between two written elements that a run rewrites rather than split
RUN_BYTES = 1 << 20  # longest run: bounds a write's buffer, which stays in a core's L2 from read to write
READ_CHUNK = 1 << 20  # bytes per read when digesting a tensor (stays in a core's L2 between read and hash)
WRITEBACK_BYTES = 8 << 20  # bytes written to a file between two starts of its writeback (io.files.start_writeback)

_SCRATCH = threading.local()


def _scratch(nbytes: int) -> np.ndarray:
    """This thread's reusable read buffer (at least ``nbytes``): a fresh array per read would
    page-fault its memory in again every time, which costs more than the read itself."""
    buf: np.ndarray | None = getattr(_SCRATCH, "buf", None)
    if buf is None or buf.size < nbytes:
        buf = _SCRATCH.buf = np.empty(max(nbytes, READ_CHUNK), dtype=np.uint8)
    return buf


def scratch(nbytes: int) -> np.ndarray:
    """This thread's read buffer as ``nbytes`` bytes (valid until its next scratch read)."""
    return _scratch(nbytes)[:nbytes]


# Up to this many bytes, a digest is one single-threaded BLAKE3 call (digest_bytes' own threshold
# for its thread pool is larger): the same digest, without the wrapper's conversions.
SMALL_DIGEST_BYTES = 1 << 20


def digest_small(values: np.ndarray) -> str:
    """``digest_bytes`` of an array of at most SMALL_DIGEST_BYTES (the same digest, fewer calls)."""
    return blake3.blake3(small_bytes(values)).hexdigest()


@dataclass(frozen=True, slots=True)
class Run:
    first: int  # canonical flat index of the first element
    last: int  # ... and of the last (inclusive)
    lo: int  # the run holds index[lo:hi]
    hi: int

    @property
    def dense(self) -> bool:
        return self.hi - self.lo == self.last - self.first + 1


def runs_of(index: np.ndarray, local: np.ndarray | None, stride: int, itemsize: int) -> list[Run]:
    """Split sorted canonical ``index`` into runs. With ``local`` (the item's ascending region-local
    positions), a run also ends where ``local // stride`` changes: ``stride`` elements of the region
    are one contiguous stretch of the tensor (None: the region is one stretch, as a flat range is)."""
    if index.size == 0:
        return []
    gap, cap = max(1, GAP_BYTES // itemsize), max(1, RUN_BYTES // itemsize)
    first, last = int(index[0]), int(index[-1])
    one_stretch = local is None or int(local[0]) // stride == int(local[-1]) // stride
    if last - first <= gap and first // cap == last // cap and one_stretch:
        # No cut anywhere (every step is within the span; stretches and caps only grow): one run,
        # without a pass (the common case of a small item).
        return [Run(first, last, 0, int(index.size))]
    bounds = run_bounds(index, local, stride, gap, cap).tolist()
    return [Run(int(index[lo]), int(index[hi - 1]), lo, hi) for lo, hi in itertools.pairwise(bounds)]


def _bytes(array: np.ndarray) -> memoryview:
    """The bytes of a contiguous array, without a copy."""
    return memoryview(array.data).cast("B")


def _write_values(fd: int, offset: int, data: memoryview) -> None:
    """The only place an apply writes tensor bytes (tests inject write failures here)."""
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], offset + done)


def _read_into(fd: int, offset: int, buf: memoryview, what: str) -> None:
    got = 0
    while got < len(buf):
        n = os.preadv(fd, [buf[got:]], offset + got)
        if n == 0:
            raise IntegrityError(f"{what}: the file ended before the tensor's data (truncated behind dcr's back?)")
        got += n


class InPlaceFiles:
    """File descriptors of a checkpoint's files and element-level reads and writes of its tensors."""

    def __init__(self, locations: dict[str, TensorLocation], *, writable: bool = False) -> None:
        self.locations = locations
        self.writable = writable
        self._fds: dict[Path, int] = {}
        self._written: set[Path] = set()
        self._unsynced: dict[int, int] = {}  # fd -> bytes written since its writeback was last started
        self._lock = threading.Lock()
        self._maps: dict[Path, tuple[mmap.mmap, memoryview] | None] = {}  # read-only mappings (digests)
        self._uints: dict[str, np.dtype] = {}  # tensor name -> its unsigned integer dtype (hot-loop lookup)

    def _uint(self, name: str) -> np.dtype:
        uint = self._uints.get(name)
        if uint is None:
            uint = self._uints[name] = lookup_dtype(self.locations[name].dtype).uint
        return uint

    def _fd(self, file: Path) -> int:
        fd = self._fds.get(file)  # opened already: no lock (a dict read is atomic)
        if fd is not None:
            return fd
        with self._lock:
            return self._fd_locked(file)

    def _fd_locked(self, file: Path) -> int:
        fd = self._fds.get(file)
        if fd is None:
            fd = self._fds[file] = os.open(file, os.O_RDWR if self.writable else os.O_RDONLY)
        return fd

    def _wrote(self, fd: int, nbytes: int) -> None:
        """Count ``nbytes`` written to ``fd``; every WRITEBACK_BYTES, start writing the file back (the final
        fsync then waits for little: the disk works while the apply computes)."""
        with self._lock:
            pending = self._unsynced.get(fd, 0) + nbytes
            self._unsynced[fd] = 0 if pending >= WRITEBACK_BYTES else pending
        if pending >= WRITEBACK_BYTES:
            start_writeback(fd)

    def _mapped(self, file: Path) -> memoryview | None:
        """The bytes of ``file`` as a read-only mapping, or None where it has holes (or cannot be mapped):
        digests are then read with pread (see the module's docstring)."""
        if file in self._maps:  # a dict read is atomic
            entry = self._maps[file]
            return None if entry is None else entry[1]
        with self._lock:
            if file not in self._maps:
                entry = None
                fd = self._fd_locked(file)
                st = os.fstat(fd)
                if st.st_size > 0 and st.st_blocks * 512 >= st.st_size:
                    try:
                        m = mmap.mmap(fd, st.st_size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
                    except (OSError, ValueError):
                        m = None
                    if m is not None:
                        entry = (m, memoryview(m))
                self._maps[file] = entry
            entry = self._maps[file]
            return None if entry is None else entry[1]

    def _span(self, loc: TensorLocation) -> memoryview | None:
        """A tensor's stored bytes in its file's mapping, without a copy (None: read them with pread)."""
        view = self._mapped(loc.file)
        if view is None or loc.start + loc.nbytes > len(view):  # shorter than mapped: let pread say so
            return None
        return view[loc.start : loc.start + loc.nbytes]

    def replaced(self) -> list[Path]:
        """The files opened here whose path no longer names them (renamed over or removed by another writer:
        rsync, cp + mv); what was written to them is not in the checkpoint."""
        out = []
        for file, fd in sorted(self._fds.items()):
            try:
                st = os.stat(file)
            except FileNotFoundError:
                out.append(file)
                continue
            opened = os.fstat(fd)
            if (st.st_dev, st.st_ino) != (opened.st_dev, opened.st_ino):
                out.append(file)
        return out

    def open_all(self, names: Iterable[str]) -> None:
        """Open the files of ``names`` now (in this thread), so a missing permission fails before any write."""
        for name in names:
            self._fd(self.locations[name].file)

    def read(self, name: str, start: int, stop: int, *, scratch: bool = False) -> np.ndarray:
        """Elements [start, stop) of a tensor, as its unsigned integers: a fresh array, or with
        ``scratch`` a view of this thread's read buffer (valid until its next scratch read)."""
        loc = self.locations[name]
        uint = self._uint(name)
        count = max(0, stop - start)
        out = _scratch(count * uint.itemsize)[: count * uint.itemsize].view(uint) if scratch else np.empty(count, uint)
        if out.size:
            _read_into(self._fd(loc.file), loc.start + start * uint.itemsize, _bytes(out), name)
        return out

    def read_at(self, file: Path, offset: int, out: memoryview, what: str) -> None:
        """Bytes of ``file`` from ``offset`` into ``out`` (a batch's stretch of the file; ``what`` names it)."""
        _read_into(self._fd(file), offset, out, what)

    def write_at(self, file: Path, offset: int, data: memoryview) -> None:
        """Write ``data`` at ``offset`` of ``file`` (a span inside the regions of the items being written)."""
        fd = self._fd(file)
        if file not in self._written:
            with self._lock:
                self._written.add(file)
        _write_values(fd, offset, data)
        self._wrote(fd, data.nbytes)

    def gather(self, name: str, index: np.ndarray | slice, runs: list[Run]) -> np.ndarray:
        """Current values at ``index`` (sorted canonical indices, or a contiguous slice)."""
        if isinstance(index, slice):
            return self.read(name, index.start, index.stop)
        if len(runs) == 1:  # a small item: one read, one copy out of the scratch buffer
            (run,) = runs
            span = self.read(name, run.first, run.last + 1, scratch=True)
            return span.copy() if run.dense else span[index - run.first]
        out = np.empty(index.size, dtype=self._uint(name))
        for run in runs:
            span = self.read(name, run.first, run.last + 1, scratch=True)
            out[run.lo : run.hi] = span if run.dense else span[index[run.lo : run.hi] - run.first]
        return out

    def hold_runs(self, name: str, index: np.ndarray, runs: list[Run]) -> tuple[np.ndarray, np.ndarray]:
        """Every run read once, one after the other, into this thread's read buffer: (the buffer, as the
        tensor's unsigned integers, and where each element of ``index`` is in it). ``write_held`` writes
        the runs back from it: a read, a patch and a write, where gather then scatter read twice. Valid
        until this thread's next scratch read."""
        uint = self._uint(name)
        width = uint.itemsize
        loc = self.locations[name]
        fd = self._fd(loc.file)
        total = sum(run.last - run.first + 1 for run in runs)
        buf = _scratch(total * width)[: total * width].view(uint)
        at = np.empty(index.size, dtype=np.int64)
        o = 0
        for run in runs:
            n = run.last - run.first + 1
            _read_into(fd, loc.start + run.first * width, _bytes(buf[o : o + n]), name)
            np.subtract(index[run.lo : run.hi], run.first - o, out=at[run.lo : run.hi])
            o += n
        return buf, at

    def write_held(self, name: str, runs: list[Run], buf: np.ndarray) -> None:
        """Write the runs back from ``buf`` as ``hold_runs`` read them (each lies inside the item's region)."""
        loc = self.locations[name]
        width = buf.dtype.itemsize
        fd = self._fd(loc.file)
        if loc.file not in self._written:
            with self._lock:
                self._written.add(loc.file)
        o = 0
        for run in runs:
            n = run.last - run.first + 1
            _write_values(fd, loc.start + run.first * width, _bytes(buf[o : o + n]))
            self._wrote(fd, n * width)
            o += n

    def scatter(self, name: str, index: np.ndarray | slice, runs: list[Run], values: np.ndarray) -> None:
        """Write ``values`` at ``index``; each run is rewritten whole (it lies inside the item's region): a
        dense run straight from ``values``, any other read into this thread's buffer, patched there by the
        compiled ``kernels.scatter`` (about half numpy's time for scattered elements) and written back."""
        loc = self.locations[name]
        uint = self._uint(name)
        values = np.ascontiguousarray(values, dtype=uint)
        fd = self._fd(loc.file)
        if loc.file not in self._written:
            with self._lock:
                self._written.add(loc.file)
        if isinstance(index, slice):
            if values.size:
                _write_values(fd, loc.start + index.start * uint.itemsize, _bytes(values))
                self._wrote(fd, values.nbytes)
            return
        for run in runs:
            if run.dense:
                data = values[run.lo : run.hi]
            else:
                data = self.read(name, run.first, run.last + 1, scratch=True)
                scatter_into(data, index[run.lo : run.hi] - run.first, values[run.lo : run.hi])
            _write_values(fd, loc.start + run.first * uint.itemsize, _bytes(data))
            self._wrote(fd, data.nbytes)

    def digest(self, name: str) -> str:
        """BLAKE3 of a tensor's stored bytes: from the file's mapping, or read in bounded chunks."""
        loc = self.locations[name]
        span = self._span(loc)
        if span is not None:
            try:
                return digest_bytes(span)
            finally:
                span.release()
        if loc.nbytes <= READ_CHUNK:  # one read, one single-threaded hash: the same digest, fewer calls
            return digest_small(self.read(name, 0, loc.numel, scratch=True))
        itemsize = lookup_dtype(loc.dtype).itemsize
        step = max(1, READ_CHUNK // itemsize)
        digest = StreamingDigest()
        for start in range(0, loc.numel, step):
            digest.update(self.read(name, start, min(loc.numel, start + step), scratch=True))
        return digest.hexdigest()

    def sync_file(self, file: Path) -> None:
        """fsync one file (the applier's background fsyncs, while its write pass goes on)."""
        os.fsync(self._fd(file))

    def sync(self) -> None:
        """Make every write durable: fsync each file written."""
        for file in sorted(self._written):
            os.fsync(self._fds[file])

    def close(self) -> None:
        for entry in self._maps.values():
            if entry is not None:
                entry[1].release()
                entry[0].close()
        self._maps.clear()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._written.clear()
        self._unsynced.clear()

    def __enter__(self) -> InPlaceFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# Tensors up to SMALL_TENSOR_BYTES are hashed in batches of about BATCH_BYTES (or BATCH_TENSORS), one
# pool task each: a task per tensor of a few KiB costs more than hashing it.
SMALL_TENSOR_BYTES = 256 << 10
BATCH_BYTES = 4 << 20
BATCH_TENSORS = 512


# Unchanged bytes between two small tensors that one read covers rather than split in two.
READ_GAP_BYTES = 64 << 10


def digest_small_tensors(files: InPlaceFiles, names: list[str]) -> list[tuple[str, str]]:
    """(name, digest) of small tensors given in file order: one pread per stretch of a file that they
    cover (into this thread's scratch buffer), then one BLAKE3 call per tensor on its slice of it,
    the same digests as ``InPlaceFiles.digest``."""
    out: list[tuple[str, str]] = []
    locations = files.locations
    n, i = len(names), 0
    while i < n:
        first = locations[names[i]]
        file, start, stop = first.file, first.start, first.start + first.nbytes
        j = i + 1
        while j < n:
            loc = locations[names[j]]
            end = loc.start + loc.nbytes
            if (
                (loc.file is not file and loc.file != file)
                or loc.start < start
                or loc.start - stop > READ_GAP_BYTES
                or end - start > BATCH_BYTES
            ):
                break
            stop = max(stop, end)
            j += 1
        mapped = files._mapped(file)
        if mapped is not None and stop <= len(mapped):
            view, base = mapped, 0  # hashed in place
        else:
            buf = _scratch(stop - start)[: stop - start]
            view, base = buf.data, start
            if stop > start:
                _read_into(files._fd(file), start, view, names[i])
        for k in range(i, j):
            loc = locations[names[k]]
            a = loc.start - base
            with view[a : a + loc.nbytes] as piece:
                out.append((names[k], blake3.blake3(piece).hexdigest()))
        i = j
    return out


def digest_tensors(files: InPlaceFiles, workers: int, names: Iterable[str] | None = None) -> dict[str, TensorEntry]:
    """The tensor table of ``names`` (default: every tensor), hashed on the pool, largest tensors first;
    the small ones in file order, in batches (``digest_small_tensors``)."""
    locations = files.locations
    big: list[tuple[int, str]] = []
    small: list[tuple[int, int, str]] = []  # (file, offset, name): file order
    file_ids: dict[Path, int] = {}
    for name in locations if names is None else names:
        loc = locations[name]
        if loc.nbytes > SMALL_TENSOR_BYTES:
            big.append((-loc.nbytes, name))
        else:
            small.append((file_ids.setdefault(loc.file, len(file_ids)), loc.start, name))
    big.sort()
    small.sort()

    def batches() -> Iterable[tuple[list[str], bool]]:
        for _, name in big:
            yield [name], False
        batch: list[str] = []
        nbytes = 0
        for _, _, name in small:
            batch.append(name)
            nbytes += locations[name].nbytes
            if nbytes >= BATCH_BYTES or len(batch) >= BATCH_TENSORS:
                yield batch, True
                batch, nbytes = [], 0
        if batch:
            yield batch, True

    def task(batch: list[str], small: bool) -> Callable[[], list[tuple[str, str]]]:
        def run() -> list[tuple[str, str]]:
            if small:
                return digest_small_tensors(files, batch)
            return [(name, files.digest(name)) for name in batch]

        # A batch of small tensors holds the GIL throughout: it runs on this thread (see pool.Inline).
        return Inline(run) if small else run

    digests = dict(pair for done in ordered_parallel((task(*b) for b in batches()), workers) for pair in done)
    return {n: make_entry(locations[n].dtype, locations[n].shape, digests[n]) for n in sorted(digests)}
