"""One download of a remote delta per node, for an engine of several ranks (receiver-vllm.md §7).

Every tensor-parallel rank needs every item (each holds a slice of every tensor). Left to itself,
each rank would download the whole delta over the node's link. Instead the first rank of each node
downloads the data blocks once (:func:`download_data_blocks`: each checked whole, by size and
digest, before it is kept) into a private directory, and every rank of the node reads the delta
through a :class:`NodeCopySource`: data blocks from that directory, anything else (the manifest
was read already; repair blocks, which only a torn item reads) from the delta's own source, as
before. The backend (backend.py ``open_delta``) runs the steps as agreed phases across the ranks.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import stat
import tempfile

import fsspec

from ...delta.prefetch import BlockFetcher
from ...delta.reader import Delta
from ...delta.source import BlockSource
from ...errors import DcrError
from ...format.manifest import BLOCKS_DIR, BlockEntry


class NodeCopySource(BlockSource):
    """A remote delta's blocks, its data blocks read from this node's copy (checked whole when copied)."""

    def __init__(self, upstream: BlockSource, directory: str, data: set[str]) -> None:
        super().__init__(fsspec.filesystem("file"), directory, label=upstream.label)
        self.upstream = upstream
        self.data = data
        self.missing_repair_advice = upstream.missing_repair_advice
        self.damaged_advice = upstream.damaged_advice

    def path(self, block: BlockEntry) -> str:
        return super().path(block) if block.id in self.data else self.upstream.path(block)

    def read(self, block: BlockEntry, start: int, end: int) -> bytes:
        return super().read(block, start, end) if block.id in self.data else self.upstream.read(block, start, end)

    def exists(self, block: BlockEntry) -> bool:
        return super().exists(block) if block.id in self.data else self.upstream.exists(block)

    def missing_repair(self, what: str) -> DcrError:
        return self.upstream.missing_repair(what)  # a store's source tells "not uploaded yet" from "lost"

    @property
    def remote(self) -> bool:
        return False  # the data blocks are here: checking them reads local files, nothing is fetched


def data_blocks(delta: Delta) -> list[BlockEntry]:
    return list({b.id: b for b in delta.manifest.blocks if b.role == "data"}.values())


def download_data_blocks(delta: Delta) -> str | None:
    """A new private directory holding ``delta``'s data blocks, each checked whole; None where this node
    cannot hold them (no usable temporary directory, a full disk): its ranks then read the delta where it is.

    A block that is missing, truncated or corrupt at the source raises (IntegrityError), as reading it would.
    Copies that killed engines of this user left behind are removed first (:func:`sweep_stale_copies`).
    """
    try:
        root = _private_root()
        _release_dropped()
        sweep_stale_copies(root)
        directory = tempfile.mkdtemp(prefix=f"{delta.id[:16]}-{os.getpid()}-", dir=root)
    except OSError:
        return None
    try:
        _HELD[directory] = _hold(directory)
        os.mkdir(os.path.join(directory, BLOCKS_DIR))
        blocks = data_blocks(delta)
        with BlockFetcher(delta.source, blocks, spool=directory) as fetcher:
            for block in blocks:  # kept (renamed into blocks/) only once its size and digest are checked
                fetcher.keep(block.id, os.path.join(directory, block.path))
        return directory
    except OSError:  # not DcrError: a bad block fails the apply on every rank
        _remove_own(directory)
        return None
    except BaseException:
        _remove_own(directory)
        raise


# A copy's lock file: flock-held by the process that made the copy for as long as it lives (the kernel drops
# the lock with the process, however it ends), so an unlocked one proves its engine is gone.
_LOCK = ".lock"
_HELD: dict[str, int] = {}  # this process's copies -> the descriptor holding each one's lock
_NOFOLLOW = os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


def _hold(directory: str) -> int:
    """Lock a new copy as this process's: the lock file is locked under a temporary name, then renamed into
    place, so a sweep never sees it unlocked."""
    tmp = os.path.join(directory, _LOCK + ".tmp")
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.rename(tmp, os.path.join(directory, _LOCK))
    except BaseException:
        os.close(fd)
        raise
    return fd


def _remove_own(directory: str) -> None:
    shutil.rmtree(directory, ignore_errors=True)
    fd = _HELD.pop(directory, None)
    if fd is not None:
        os.close(fd)


def _release_dropped() -> None:
    """Close the locks of this process's copies that are gone (the backend removes a copy once every rank
    of the node is done with it): one descriptor per copy still on disk, not one per refit."""
    for directory in [d for d in _HELD if not os.path.lexists(d)]:
        os.close(_HELD.pop(directory))


def sweep_stale_copies(root: str) -> list[str]:
    """Remove the copies under ``root`` (this user's private directory) whose engine is gone; the paths removed.

    Only what is provably stale goes: a directory (never a symbolic link, never followed) of this user whose
    lock file (itself no link) nobody holds. A copy being made (no lock file yet), one of a live engine on
    this node or in another PID namespace sharing the directory (its lock is held), anything else, is left.
    """
    removed = []
    uid = os.getuid()
    with os.scandir(root) as entries:
        candidates = [e.path for e in entries if e.is_dir(follow_symlinks=False) and e.path not in _HELD]
    for path in candidates:
        try:
            info = os.lstat(path)
            if not stat.S_ISDIR(info.st_mode) or info.st_uid != uid:
                continue
            fd = os.open(os.path.join(path, _LOCK), os.O_RDWR | _NOFOLLOW)
        except OSError:  # gone, no lock file (being made, or not a copy of this dcr), a link: not provably stale
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # held: its engine is alive
            if os.path.samestat(os.fstat(fd), os.lstat(os.path.join(path, _LOCK))):  # still that copy's lock
                shutil.rmtree(path, ignore_errors=True)  # rmtree never follows links inside
                removed.append(path)
        except OSError:
            continue
        finally:
            os.close(fd)
    return removed


def read_through_copy(delta: Delta, directory: str) -> Delta:
    """``delta`` with its data blocks read from ``directory`` (this node's copy), everything else as before."""
    source = NodeCopySource(delta.source, directory, {b.id for b in data_blocks(delta)})
    return Delta(delta.url, delta.manifest, delta.id, delta.manifest_bytes, source, delta.label, delta.manifest_path)


def _private_root() -> str:
    """``$TMPDIR/dcr-engine-<uid>``, a directory of this user's only (mode 0700): refused (OSError) if it is
    anything else (a symbolic link, another user's); a looser mode of this user's own is tightened first."""
    root = os.path.join(tempfile.gettempdir(), f"dcr-engine-{os.getuid()}")
    with contextlib.suppress(FileExistsError):
        os.mkdir(root, 0o700)
    info = os.lstat(root)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise OSError(f"{root} is not a directory of this user")
    if info.st_mode & 0o077:
        os.chmod(root, 0o700)  # from now on nobody else can add or rename anything in it
    return root
