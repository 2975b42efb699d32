"""A cache of tensor digests per checkpoint file, so a trainer's stream hashes each checkpoint once.

In a refit stream, step N is the target of one diff and the base of the next. The cache remembers
the digests computed for a file, keyed by the file's identity and change times (path, size, inode,
mtime and ctime in ns: ctime cannot be set by user space, and any write moves it). A stale or
corrupt entry can only make a delta name a wrong base fingerprint, which receivers then refuse;
it can never make them write wrong bits. Set DCR_CACHE_DIR to move it, or to "" to disable it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..format.digest import digest_bytes, is_digest


def cache_dir() -> Path | None:
    configured = os.environ.get("DCR_CACHE_DIR")
    if configured == "":
        return None
    if configured:
        return Path(configured)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "dcr" / "digests"


def _key(file: Path) -> str:
    st = file.stat()
    ident = f"{file.resolve()}|{st.st_size}|{st.st_ino}|{st.st_dev}|{st.st_mtime_ns}|{st.st_ctime_ns}"
    return digest_bytes(ident.encode())


def load(file: Path) -> dict[str, str]:
    root = cache_dir()
    if root is None:
        return {}
    try:
        data = json.loads((root / _key(file)).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or not all(isinstance(k, str) and is_digest(v) for k, v in data.items()):
        return {}
    return data


def save(file: Path, digests: dict[str, str]) -> None:
    root = cache_dir()
    if root is None or not digests:
        return
    try:
        root.mkdir(parents=True, exist_ok=True)
        path = root / _key(file)
        tmp = path.with_suffix(f".tmp-{os.getpid()}")
        tmp.write_text(json.dumps(digests))
        os.replace(tmp, path)
    except OSError:
        pass  # a cache that cannot be written only costs time
