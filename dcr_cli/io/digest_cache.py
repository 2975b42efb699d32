"""A cache of tensor digests per checkpoint file, so a trainer's stream hashes each checkpoint once.

In a refit stream, step N is the target of one diff and the base of the next. The cache remembers
the digests computed for a file, keyed by the file's identity and change times (path, size, inode,
mtime and ctime in ns: ctime cannot be set by user space, and any write moves it). A training
checkpoint's canonical digests are keyed by all of its files and by the profile that maps them to
canonical tensors (``files_key``). The key is
taken when the checkpoint is opened, before hashing, so a file written during the hash is not
cached. A stale or corrupt entry can only make a delta name wrong tensor digests or fingerprints
(receivers refuse a wrong base; dcr verify reports a wrong target); items carry their own pre/post
digests, so it can never make a receiver write wrong bits. Set DCR_CACHE_DIR to move it, or to ""
to disable it.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from ..errors import FormatError
from ..format.digest import DIGEST_HEX_LEN, digest_bytes, is_digest
from ..format.strict_json import load_json


def cache_dir() -> Path | None:
    configured = os.environ.get("DCR_CACHE_DIR")
    if configured == "":
        return None
    if configured:
        return Path(configured)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "dcr" / "digests"


def key(file: Path) -> str:
    """The cache key of the file as it is now; take it before hashing and pass it to ``save``."""
    return _key(file)


def _key(file: Path) -> str:
    st = file.stat()
    ident = f"{file.resolve()}|{st.st_size}|{st.st_ino}|{st.st_dev}|{st.st_mtime_ns}|{st.st_ctime_ns}"
    return digest_bytes(ident.encode())


def load(file: Path) -> dict[str, str]:
    return load_entry(_key(file))


def save(file: Path, digests: dict[str, str], hashed_key: str) -> None:
    """Remember ``digests``, computed from ``file`` while its key was ``hashed_key``.

    A file written while it was being hashed has a new key by now: its digests
    describe neither version, so they are not kept under either key.
    """
    try:
        if _key(file) == hashed_key:
            save_entry(hashed_key, digests)
    except OSError:
        pass  # the file is gone: nothing to remember it by


def files_key(files: list[Path], description: str) -> str:
    """The key of a checkpoint made of several files, read through ``description`` (e.g. a profile)."""
    return digest_bytes("|".join([description, *sorted(_key(f) for f in files)]).encode())


def load_entry(entry_key: str) -> dict[str, str]:
    root = cache_dir()
    if root is None:
        return {}
    try:
        data = load_json((root / entry_key).read_bytes(), entry_key)
    except (OSError, FormatError):
        return {}  # unreadable or damaged: a cache miss, never an error
    if not isinstance(data, dict) or not _all_digests(data):
        return {}
    return data


_LOWER_HEX = re.compile("[0-9a-f]*")


def _all_digests(data: dict) -> bool:
    """Whether every key is a string and every value a digest (``is_digest``), checked in bulk: an MoE
    checkpoint's file has 100k entries, and one regular expression over all of them costs less."""
    values = list(data.values())
    if not all(type(v) is str and len(v) == DIGEST_HEX_LEN for v in values):
        return all(isinstance(k, str) and is_digest(v) for k, v in data.items())  # the exact rule, slowly
    return all(type(k) is str for k in data) and _LOWER_HEX.fullmatch("".join(values)) is not None


def save_entry(entry_key: str, digests: dict[str, str]) -> None:
    root = cache_dir()
    if root is None or not digests:
        return
    try:
        root.mkdir(parents=True, exist_ok=True)
        path = root / entry_key
        tmp = path.with_suffix(f".tmp-{os.getpid()}")
        tmp.write_text(json.dumps(digests))
        os.replace(tmp, path)
    except OSError:
        pass  # a cache that cannot be written only costs time
