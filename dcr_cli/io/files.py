"""Durable files: atomic replacement and directory fsync."""

from __future__ import annotations

import os
import threading
from pathlib import Path


def write_atomic(path: Path, data: bytes) -> None:
    """Write a file so that readers see the old content or the new, never a mix."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make a rename or a new entry in ``path`` durable (POSIX needs the directory itself synced)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
