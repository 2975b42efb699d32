"""What a checkpoint receiver records in ``CKPT/.dcr/``: its state, the table of its version, its lock.

Normative: format_spec/receiver-checkpoint.md §2 (state, table) and §3 (lock).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from json.encoder import encode_basestring_ascii as _quote  # json.dumps's own (ensure_ascii)
from pathlib import Path
from typing import Any

from ...checkpoints.safetensors_dir import INDEX_NAME, SafetensorsCheckpoint
from ...errors import ConflictError, FormatError
from ...format.digest import is_digest
from ...format.manifest import TensorEntry, VersionRef, fingerprint, make_entry
from ...format.strict_json import load_json
from ...io.files import fsync_dir, write_atomic
from ...io.gc_pause import fewer_collections

STATE_DIR = ".dcr"
STATE_NAME = "state.json"
TABLE_NAME = "table.json"
LOCK_NAME = "lock"
STATE_FORMAT = "dcr.receiver-state"
STATE_VERSION = 1
HISTORY_LENGTH = 256


@dataclass
class ReceiverState:
    """What CKPT/.dcr/state.json records (format_spec/receiver-checkpoint.md §2)."""

    version: str | None  # label of the version the checkpoint holds; None while unknown
    fingerprint: str | None
    applying: dict[str, Any] | None = None  # {delta_id, base: {version, fingerprint}, target: {...}}
    files: dict[str, list[int]] = field(default_factory=dict)  # name -> [size, mtime_ns, ctime_ns, inode]
    history: list[str] = field(default_factory=list)  # fingerprints of earlier versions reached by dcr apply

    def to_json_bytes(self) -> bytes:
        obj = {"format": STATE_FORMAT, "format_version": STATE_VERSION, **asdict(self)}
        return json.dumps(obj, indent=1, sort_keys=True).encode()


def state_dir(root: Path) -> Path:
    """``CKPT/.dcr``, refused if it is a symbolic link: the lock, state and table written through one would
    land outside the checkpoint (receiver-checkpoint §1, as for its files), and two checkpoints sharing one
    would share a lock and overwrite each other's state."""
    path = root / STATE_DIR
    if path.is_symlink():
        raise FormatError(
            f"{path} is a symbolic link; dcr keeps a receiver's state inside its checkpoint directory: remove "
            "the link and re-run (the version is then established by hashing)"
        )
    return path


def ref(version: VersionRef) -> dict[str, str]:
    return {"version": version.version, "fingerprint": version.fingerprint}


def _is_ref(obj: Any) -> bool:
    """A {version, fingerprint} pair as the state records it."""
    return isinstance(obj, dict) and isinstance(obj.get("version"), str) and is_digest(obj.get("fingerprint"))


def _is_files(obj: Any) -> bool:
    return isinstance(obj, dict) and all(
        isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v) for v in obj.values()
    )


def read_state(root: str | os.PathLike[str]) -> ReceiverState | None:
    path = state_dir(Path(root)) / STATE_NAME
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    bad = FormatError(f"{path} is not a dcr receiver state file; remove it to re-establish the version")
    try:
        obj = load_json(raw, str(path))
    except FormatError:
        raise bad from None
    if not isinstance(obj, dict) or obj.get("format") != STATE_FORMAT:
        raise bad
    if obj.get("format_version") != STATE_VERSION:
        raise FormatError(f"{path}: receiver state version {obj.get('format_version')!r} is not supported; upgrade dcr")
    applying = obj.get("applying")
    if applying is not None and not (
        isinstance(applying, dict)
        and isinstance(applying.get("delta_id"), str)
        and _is_ref(applying.get("base"))
        and _is_ref(applying.get("target"))
    ):
        raise bad
    version, fp = obj.get("version"), obj.get("fingerprint")
    if not (version is None or isinstance(version, str)) or not (fp is None or is_digest(fp)):
        raise bad
    files = obj.get("files") or {}
    history = obj.get("history") or []
    if not _is_files(files) or not isinstance(history, list):
        raise bad
    return ReceiverState(version, fp, applying, dict(files), [h for h in history if is_digest(h)])


def write_state(root: Path, state: ReceiverState) -> None:
    """Replace the state file atomically and durably: temp file, fsync, rename, fsync dir."""
    path = state_dir(root) / STATE_NAME
    with explain_enospc(path):
        write_atomic(path, state.to_json_bytes())
        fsync_dir(state_dir(root))


@contextlib.contextmanager
def explain_enospc(path: Path) -> Iterator[None]:
    """A full file system (ENOSPC, EDQUOT) is reported with what to do next; the errno is kept."""
    try:
        yield
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT) or "re-run the same" in str(exc.strerror):
            raise
        raise OSError(exc.errno, f"{exc.strerror}; free space and re-run the same dcr apply", str(path)) from exc


def write_recorded_table(root: Path, table: dict[str, TensorEntry]) -> None:
    """Keep the tensor table of the version reached, so ``dcr verify`` can name tensors without the delta."""
    fp = fingerprint(table)
    raw = _table_json(table, fp)
    with explain_enospc(state_dir(root) / TABLE_NAME):
        write_atomic(state_dir(root) / TABLE_NAME, raw)
    _LAST_TABLE.clear()  # the next read of these bytes (a verify, the next step of a chain) needs no parse
    _LAST_TABLE[state_dir(root) / TABLE_NAME] = (raw, dict(table), fp)


def _table_json(table: dict[str, TensorEntry], fp: str) -> bytes:
    """``json.dumps({"fingerprint": …, "tensors": {name: entry.to_json()}}, separators=(",", ":"))``, byte for
    byte, from a template per row (100k rows: a third of the cost); each shape is spelled once."""
    shapes: dict[tuple[int, ...], str] = {}
    rows = []
    for name in sorted(table):
        t = table[name]
        shape = shapes.get(t.shape)
        if shape is None:
            shape = shapes[t.shape] = json.dumps(list(t.shape), separators=(",", ":"))
        rows.append(f'{_quote(name)}:{{"dtype":{_quote(t.dtype)},"shape":{shape},"digest":{_quote(t.digest)}}}')
    return f'{{"fingerprint":{_quote(fp)},"tensors":{{{",".join(rows)}}}}}'.encode()


# The last recorded table read, by path: (its bytes, the table, its fingerprint). An apply reads the
# table more than once (establishing the version, then before the writes); with 100k tensors a parse
# and a fingerprint cost ~20 us a tensor, and the same bytes give the same table.
_LAST_TABLE: dict[Path, tuple[bytes, dict[str, TensorEntry], str]] = {}


def read_recorded_table(root: str | os.PathLike[str], expected_fingerprint: str) -> dict[str, TensorEntry] | None:
    """The recorded table of ``expected_fingerprint``; None when absent, damaged or of another version."""
    path = state_dir(Path(root)) / TABLE_NAME
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    last = _LAST_TABLE.get(path)
    if last is not None and last[0] == raw:
        return dict(last[1]) if last[2] == expected_fingerprint else None
    try:
        with fewer_collections():  # 100k entries that all stay alive: young passes would find nothing
            table = _parse_table(load_json(raw, str(path)))
    except (FormatError, ValueError, TypeError, KeyError, AttributeError):
        return None
    if table is None:
        return None  # damaged: treated as absent (the version is established by hashing)
    fp = fingerprint(table)
    _LAST_TABLE.clear()  # one table kept: the receiver's
    _LAST_TABLE[path] = (raw, table, fp)
    return dict(table) if fp == expected_fingerprint else None


def _parse_table(obj: Any) -> dict[str, TensorEntry] | None:
    """The entries of a recorded table's JSON; None if a shape is no list of non-negative ints.
    Anything else malformed raises (TypeError, KeyError, AttributeError)."""
    shapes: dict[tuple[int, ...], tuple[int, ...]] = {}  # an MoE table repeats a few shapes 100k times: one tuple
    table = {}
    for name, t in obj["tensors"].items():
        listed = t["shape"]
        if type(listed) is not list:
            return None
        shape = tuple(listed)
        if not _is_shape(shape):  # before the lookup: 1.0 and True would find (1,)
            return None
        table[name] = make_entry(t["dtype"], shapes.setdefault(shape, shape), t["digest"])
    return table


def _is_shape(shape: tuple[object, ...]) -> bool:
    return all(type(s) is int and s >= 0 for s in shape)


def file_stats(root: Path, ckpt: SafetensorsCheckpoint) -> dict[str, list[int]]:
    """Identity of the checkpoint's files; a change means someone else wrote them, so the state is stale."""
    files = {loc.file for loc in ckpt.tensors.values()}
    if (root / INDEX_NAME).exists():
        files.add(root / INDEX_NAME)
    stats = {}
    for path in sorted(files):
        st = path.stat()
        stats[os.path.relpath(path, root.resolve())] = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
    return stats


def same_files(recorded: dict[str, list[int]], now: dict[str, list[int]]) -> bool:
    """Same names, sizes and inodes: the files an interrupted apply was writing in place (whose times moved)."""
    if not recorded or set(recorded) != set(now):
        return False
    return all(len(r) == 4 and (r[0], r[3]) == (now[n][0], now[n][3]) for n, r in recorded.items())


@contextlib.contextmanager
def receiver_lock(root: Path) -> Iterator[None]:
    """Exclusive, non-blocking: a second applier fails at once instead of interleaving writes.

    An applier that created ``.dcr/`` and recorded nothing in it (it refused the delta, or had nothing
    to do) removes it again, so a refused apply leaves the checkpoint exactly as it found it. It
    unlinks the lock file while still holding it; so every holder checks, once its lock is granted,
    that the file it locked is still the one at the path, and otherwise locks the new one
    (receiver-checkpoint.md §3).
    """
    directory = state_dir(root)
    created = not directory.exists()
    with explain_enospc(directory):
        directory.mkdir(exist_ok=True)
    fd = _locked(directory / LOCK_NAME)
    try:
        yield
    finally:
        try:
            if created and [p.name for p in directory.iterdir()] == [LOCK_NAME]:
                (directory / LOCK_NAME).unlink()
                directory.rmdir()
        except OSError:
            pass  # another process recreated something in it: leave it
        finally:
            os.close(fd)  # releases the lock


def _locked(path: Path) -> int:
    """A descriptor holding ``flock(LOCK_EX)`` on the file now at ``path`` (see ``receiver_lock``)."""
    while True:
        with explain_enospc(path.parent):
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)  # a link would create its target
            except FileNotFoundError:  # the directory was just removed by an applier that recorded nothing
                path.parent.mkdir(exist_ok=True)
                continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ConflictError(f"another dcr apply holds {path}; wait for it to finish, then re-run") from None
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)  # we locked a file its holder unlinked on the way out: lock the current one
