"""Durable files: atomic replacement and directory fsync."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path


def write_atomic(path: Path, data: bytes) -> None:
    """Write a file so that readers see the old content or the new, never a mix.

    On failure (a full disk, a file-size limit) the temporary file is removed and the error names ``path``."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, OSError) and exc.filename in (None, str(tmp), tmp):
            raise named(exc, path) from exc
        raise


# A write failed for want of room: the disk (or quota) is full, or the process's file-size limit was reached.
NO_ROOM = frozenset({errno.ENOSPC, errno.EFBIG, errno.EDQUOT})


def named(exc: OSError, path: str | os.PathLike[str]) -> OSError:
    """``exc`` (an error of a write that did not say where) as the same error of ``path``."""
    return type(exc)(exc.errno, exc.strerror or str(exc), os.fspath(path))


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make a rename or a new entry in ``path`` durable (POSIX needs the directory itself synced)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_WRITEBACK: list[Callable[[int], object] | None] = []  # the libc call, looked up on first use ([None]: none here)


def _writeback_call() -> Callable[[int], object] | None:
    if not _WRITEBACK:
        _WRITEBACK.append(_find_writeback() if sys.platform.startswith("linux") else None)
    return _WRITEBACK[0]


def _find_writeback() -> Callable[[int], object] | None:
    try:
        libc_call = ctypes.CDLL(None, use_errno=True).sync_file_range  # the C library the process runs on
    except (OSError, AttributeError):
        return None
    libc_call.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    libc_call.restype = ctypes.c_int
    write = 2  # SYNC_FILE_RANGE_WRITE: start writing dirty pages back; wait for nothing else

    def call(fd: int) -> object:
        return libc_call(fd, 0, 0, write)  # the whole file; a hint: its result is not needed

    return call


def start_writeback(fd: int) -> None:
    """Start writing ``fd``'s dirty pages to the disk now, without waiting for it (Linux; elsewhere nothing).

    Not durability: the fsync that follows still makes the writes durable and reports their errors. What it
    buys is overlap: the kernel otherwise starts writeback only once dirty pages pile up (or age), so the
    final fsync of a large in-place apply writes gigabytes while every core waits; started every few MiB,
    the disk works while the apply goes on computing, and the fsync finds little left to write."""
    call = _writeback_call()
    if call is not None:
        call(fd)
