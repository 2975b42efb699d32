"""Private working directories of this user, under ``$TMPDIR``, that a later process can prove stale.

A process that spools to a temporary directory and is killed (SIGKILL, an OOM kill, a lost node) leaves
it behind. Each such directory is made under a per-user root (``$TMPDIR/dcr-<kind>-<uid>``, mode 0700)
and holds a lock file that its process keeps flock-held for as long as it lives (the kernel drops the
lock with the process, however it ends): :func:`sweep_stale` removes the directories whose lock nobody
holds. Used by the vLLM node copy (receive/vllm/node_copy.py) and the early fetch of announced blocks
(store/announce.py).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import stat
import tempfile

LOCK = ".lock"
_HELD: dict[str, int] = {}  # this process's directories -> the descriptor holding each one's lock
_NOFOLLOW = os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


def private_root(kind: str) -> str:
    """``$TMPDIR/dcr-<kind>-<uid>``, a directory of this user's only (mode 0700): refused (OSError) if it is
    anything else (a symbolic link, another user's); a looser mode of this user's own is tightened first."""
    root = os.path.join(tempfile.gettempdir(), f"dcr-{kind}-{os.getuid()}")
    with contextlib.suppress(FileExistsError):
        os.mkdir(root, 0o700)
    info = os.lstat(root)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise OSError(f"{root} is not a directory of this user")
    if info.st_mode & 0o077:
        os.chmod(root, 0o700)  # from now on nobody else can add or rename anything in it
    return root


def make_held(root: str, prefix: str) -> str:
    """A new directory under ``root``, locked as this process's (see :func:`hold`); OSError if it cannot be."""
    release_dropped()
    sweep_stale(root)
    directory = tempfile.mkdtemp(prefix=prefix, dir=root)
    try:
        hold(directory)
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)
        raise
    return directory


def hold(directory: str) -> int:
    """Lock a new directory as this process's: the lock file is locked under a temporary name, then renamed
    into place, so a sweep never sees it unlocked."""
    tmp = os.path.join(directory, LOCK + ".tmp")
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.rename(tmp, os.path.join(directory, LOCK))
    except BaseException:
        os.close(fd)
        raise
    _HELD[directory] = fd
    return fd


def remove_own(directory: str) -> None:
    """Remove one of this process's directories and release its lock."""
    shutil.rmtree(directory, ignore_errors=True)
    fd = _HELD.pop(directory, None)
    if fd is not None:
        os.close(fd)


def release_dropped() -> None:
    """Close the locks of this process's directories that are gone (removed by whoever was done with them):
    one descriptor per directory still on disk, not one per use."""
    for directory in [d for d in list(_HELD) if not os.path.lexists(d)]:  # a copy: a finalizer may remove one
        fd = _HELD.pop(directory, None)
        if fd is not None:
            os.close(fd)


def sweep_stale(root: str) -> list[str]:
    """Remove the directories under ``root`` (this user's private root) whose process is gone; the paths removed.

    Only what is provably stale goes: a directory (never a symbolic link, never followed) of this user whose
    lock file (itself no link) nobody holds. A directory being made (no lock file yet), one of a live process
    on this node or in another PID namespace sharing the root (its lock is held), anything else, is left.
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
            fd = os.open(os.path.join(path, LOCK), os.O_RDWR | _NOFOLLOW)
        except OSError:  # gone, no lock file (being made, or not one of dcr's), a link: not provably stale
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # held: its process is alive
            if os.path.samestat(os.fstat(fd), os.lstat(os.path.join(path, LOCK))):  # still that directory's lock
                shutil.rmtree(path, ignore_errors=True)  # rmtree never follows links inside
                removed.append(path)
        except OSError:
            continue
        finally:
            os.close(fd)
    return removed
