"""Bounded reads of local files that refuse anything but a regular file.

A name that should be a file may be a FIFO (an open for reading blocks forever), a link to
/dev/zero (a read never ends) or a directory. Opening with O_NONBLOCK never blocks, and fstat on
the open descriptor says what was opened, with no window for a swap between check and read.
"""

from __future__ import annotations

import contextlib
import os
import stat
import threading
import weakref
from collections import OrderedDict

from ..errors import FormatError


def open_regular(path: str | os.PathLike[str]) -> int:
    """A read-only descriptor of ``path``, which must be a regular file (FormatError otherwise)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = "a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "not a plain file"
            raise FormatError(f"{os.fspath(path)} is {kind}; dcr reads only plain files")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_regular_file(path: str | os.PathLike[str], start: int | None = None, end: int | None = None) -> bytes:
    """Bytes ``start:end`` of a regular file (the whole file by default), read with pread."""
    fd = open_regular(path)
    try:
        size = os.fstat(fd).st_size
        lo = 0 if start is None else max(0, start if start >= 0 else size + start)
        hi = size if end is None else min(size, end if end >= 0 else size + end)
        return pread_range(fd, lo, hi)
    finally:
        os.close(fd)


def pread_range(fd: int, start: int, end: int) -> bytes:
    """Bytes ``start:end`` (non-negative offsets) of an open file; fewer where the file ends first."""
    chunks: list[bytes] = []
    offset = start
    while offset < end:
        chunk = os.pread(fd, end - offset, offset)  # one allocation of the wanted size, as a rule
        if not chunk:
            break  # the file ends (or shrank while it was read)
        chunks.append(chunk)
        offset += len(chunk)
    if len(chunks) == 1:
        return chunks[0]
    return b"".join(chunks)


class RegularFiles:
    """Open descriptors of regular files (``open_regular``), kept for repeated reads of the same files.

    A receiver reads thousands of small sections from a few block files: opening, checking and
    closing the file for each costs more than the read. At most ``keep`` idle descriptors stay open
    (least recently used closed first); one in use by a read is never closed under it.
    """

    def __init__(self, keep: int = 64) -> None:
        self.keep = keep
        self._open: OrderedDict[str, list[int]] = OrderedDict()  # path -> [fd, readers]
        self._lock = threading.Lock()
        self._finalizer = weakref.finalize(self, RegularFiles._close_all, self._open)

    def read(self, path: str, start: int, end: int) -> bytes:
        """Bytes ``start:end`` of ``path`` (fewer if it is shorter), like ``read_regular_file``."""
        with self._lock:
            entry = self._open.get(path)
            if entry is not None:
                self._open.move_to_end(path)
                entry[1] += 1
        if entry is None:
            fd = open_regular(path)  # outside the lock: an open may be slow (network file systems)
            with self._lock:
                entry = self._open.get(path)
                if entry is None:
                    entry = self._open[path] = [fd, 1]
                else:  # another reader opened it meanwhile
                    entry[1] += 1
                    os.close(fd)
        try:
            return pread_range(entry[0], max(0, start), max(0, end))
        finally:
            with self._lock:
                entry[1] -= 1
                self._trim()

    def _trim(self) -> None:
        excess = len(self._open) - self.keep
        for path in [p for p, e in self._open.items() if e[1] == 0][: max(0, excess)]:
            os.close(self._open.pop(path)[0])

    def close(self) -> None:
        with self._lock:
            RegularFiles._close_all(self._open)

    @staticmethod
    def _close_all(files: OrderedDict[str, list[int]]) -> None:
        for fd, _ in files.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        files.clear()
