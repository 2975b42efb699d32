"""Bounded reads of local files that refuse anything but a regular file.

A name that should be a file may be a FIFO (an open for reading blocks forever), a link to
/dev/zero (a read never ends) or a directory. Opening with O_NONBLOCK never blocks, and fstat on
the open descriptor says what was opened, with no window for a swap between check and read.
"""

from __future__ import annotations

import os
import stat

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
        chunks: list[bytes] = []
        offset = lo
        while offset < hi:
            chunk = os.pread(fd, hi - offset, offset)  # one allocation of the wanted size, as a rule
            if not chunk:
                break  # the file shrank while it was read
            chunks.append(chunk)
            offset += len(chunk)
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)
    finally:
        os.close(fd)
