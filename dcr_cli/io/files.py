"""Durable files: atomic replacement and directory fsync."""

from __future__ import annotations

import contextlib
import errno
import os
import threading
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
