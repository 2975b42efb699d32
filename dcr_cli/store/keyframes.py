"""Keyframes, squashed shortcuts and the cheapest catch-up path (format_spec/store-v1.md §6).

* A *keyframe* is a committed version's full state as a plain Hugging Face checkpoint in the store:
  one whole-object write per file, named by its content (``keyframes/<version>/<BLAKE3>-<file>``), then
  the record ``keyframes/<version>.json`` (create-only, after every file is asked about again) with
  every file's name, object, size and BLAKE3 and the model fingerprint: as a version is published, the
  record makes it visible at once and complete. A receiver with no state joins with one download
  (:func:`join`).
* A *shortcut* is a squashed delta (``dcr_cli.delta.squash``) from a keyframe's version to a later
  committed version, published like a version's delta (blocks, ``manifests/<digest>.json``) and
  described by ``shortcuts/<base>/<target>.json``, a version record of kind ``dcr.store.shortcut``.
  ``dcr compact`` publishes one every K committed versions from the newest keyframe.
* :func:`plan` chooses, by bytes to fetch, the cheapest way from a receiver's version (or from
  nothing, via a keyframe) to a target among the chain, the shortcuts and the keyframes.

Readers that do not know these records never look under ``keyframes/`` or ``shortcuts/``.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from ..checkpoints.safetensors_dir import SafetensorsCheckpoint
from ..delta.reader import Delta
from ..delta.source import CHUNK_BYTES
from ..errors import ConflictError, DcrError, FormatError, IncompatibleError, IntegrityError
from ..format.digest import StreamingDigest, is_digest
from ..format.manifest import BlockEntry, fingerprint, parse_manifest
from ..format.store_records import SHORTCUT_KIND, SHORTCUTS, parse_record
from ..format.strict_json import load_json
from ..io.files import fsync_dir
from .backends import TMP_PREFIX
from .repo import (
    MANIFESTS,
    MAX_RECORD_BYTES,
    STORE_MAJOR,
    STORE_MINOR,
    Listing,
    Ref,
    Store,
    VersionRecord,
    check_label,
    dumps,
    is_label,
    utc_now,
)
from .transfer import (
    DEFAULT_WORKERS,
    REFRESH_S,
    Progress,
    PullResult,
    RateLimit,
    Total,
    _pull_record,
    _transfer_bytes,
    _Uploader,
    _written_before,
    check_repairs,
    open_record,
    require_repair_blocks,
    resolve,
    stat_blocks,
    version_record,
)

KEYFRAMES = "keyframes"
KEYFRAME_KIND = "dcr.store.keyframe"
_READ = 8 << 20


@dataclass(frozen=True)
class KeyframeFile:
    name: str  # the file's name in the checkpoint directory
    size: int
    digest: str
    object: str = ""  # its object under keyframes/<version>/; records without one: the name itself

    @property
    def stored(self) -> str:
        return self.object or self.name


@dataclass(frozen=True)
class KeyframeRecord:
    version: str
    fingerprint: str
    files: list[KeyframeFile]
    created: str = ""

    @property
    def bytes(self) -> int:
        return sum(f.size for f in self.files)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": KEYFRAME_KIND,
            "format_version": [STORE_MAJOR, STORE_MINOR],
            "version": self.version,
            "fingerprint": self.fingerprint,
            "files": [asdict(f) for f in self.files],
            "bytes": self.bytes,
            "created": self.created,
        }

    @staticmethod
    def from_json(obj: dict[str, Any], where: str) -> KeyframeRecord:
        try:
            files = [
                KeyframeFile(
                    _file_name(f["name"]),
                    int(f["size"]),
                    f["digest"],
                    _file_name(f["object"]) if f.get("object") is not None else "",
                )
                for f in obj["files"]
            ]
            record = KeyframeRecord(
                check_label(obj["version"], "version"), obj["fingerprint"], files, obj.get("created", "")
            )
        except (KeyError, TypeError, ValueError, DcrError) as exc:
            raise FormatError(f"{where}: malformed keyframe record ({exc})") from None
        if not is_digest(record.fingerprint) or not all(is_digest(f.digest) for f in files):
            raise FormatError(f"{where}: keyframe digests must be 64-hex")
        if any(f.size < 0 for f in files) or len({f.name for f in files}) != len(files):
            raise FormatError(f"{where}: keyframe file sizes must be non-negative and names distinct")
        return record


def _file_name(name: Any) -> str:
    """Keyframe file names become object and local names: plain names only."""
    if not isinstance(name, str) or not name or name.startswith(".") or "/" in name or "\\" in name:
        raise DcrError(f"keyframe file name {name!r} is not a plain file name")
    return name


@dataclass(frozen=True)
class Shortcut:
    record: VersionRecord  # version = target label; base and target as in the squashed manifest
    chain: list[str]  # the committed versions it replaces, in order


# -- records -----------------------------------------------------------------------------------------------------------


def keyframes(store: Store) -> dict[str, KeyframeRecord]:
    out: dict[str, KeyframeRecord] = {}
    for entry in store.list(KEYFRAMES):
        if not entry.name.endswith(".json"):
            continue
        rel = f"{KEYFRAMES}/{entry.name}"
        obj = store.read_record(rel, KEYFRAME_KIND)
        if obj is not None:
            record = KeyframeRecord.from_json(obj, f"{store.url}/{rel}")
            out[record.version] = record
    return out


class DamagedShortcut(FormatError):
    """A shortcut record whose bytes were read and are no shortcut record (store-v1 §6.4): derived data,
    which dcr gc drops, dcr check reports and a receiver's route leaves out; dcr compact makes it anew."""


def read_shortcut(store: Store, rel: str) -> Shortcut | None:
    """The shortcut record at ``rel`` (None: absent). Bytes that are no shortcut record (not JSON, a field
    missing or malformed, over the record size limit) raise DamagedShortcut; an answer asking again might
    change (a read error) raises as it is, and so does a record of a store major this dcr does not read
    (a newer dcr wrote it: upgrade, do not drop it)."""
    where = f"{store.url}/{rel}"
    try:
        raw = store.read(rel, limit=MAX_RECORD_BYTES)
    except FileNotFoundError:
        return None
    except FormatError as exc:  # read whole, and larger than any record
        raise DamagedShortcut(str(exc)) from None
    try:
        obj = parse_record(raw, SHORTCUT_KIND, where)
        record = VersionRecord.from_json(obj, where)
        chain = obj.get("chain")
        if not (isinstance(chain, list) and all(isinstance(c, str) for c in chain)):
            raise FormatError(f"{where}: shortcut chain must be a list of versions")
        if shortcut_label(rel) != f"{record.base.version}..{record.version}":  # another record copied over it
            raise FormatError(f"{where}: the record is of shortcut {record.base.version}..{record.version}")
    except FormatError as exc:
        if _newer_major(raw):
            raise
        raise DamagedShortcut(str(exc)) from None
    return Shortcut(record, chain)


def _newer_major(raw: bytes) -> bool:
    try:
        obj = load_json(raw, "record")
    except FormatError:
        return False
    version = obj.get("format_version") if isinstance(obj, dict) else None
    # Only a major above this dcr's is "newer" (upgrade dcr); any other is a damaged record (major 0, a flipped bit).
    return isinstance(version, list) and bool(version) and isinstance(version[0], int) and version[0] > STORE_MAJOR


def shortcut_label(rel: str) -> str:
    """ "base..target" of the record ``shortcuts/<base>/<target>.json`` by its name (what it should hold)."""
    _root, base, name = rel.split("/")
    return f"{base}..{name.removesuffix('.json')}"


def shortcuts(
    store: Store, damaged: dict[str, str] | None = None, bases: Collection[str] | None = None
) -> list[Shortcut]:
    """Every shortcut record of the store (with ``bases``: those under ``shortcuts/<base>/`` of these bases
    only). A damaged one raises DamagedShortcut, or with ``damaged`` is left out and noted there (its
    object name -> why)."""
    out: list[Shortcut] = []
    for base in store.list_dirs(SHORTCUTS):
        if bases is not None and base not in bases:
            continue
        for entry in store.list(f"{SHORTCUTS}/{base}"):
            if not entry.name.endswith(".json") or entry.name.startswith(TMP_PREFIX):
                continue
            rel = f"{SHORTCUTS}/{base}/{entry.name}"
            try:
                shortcut = read_shortcut(store, rel)
            except DamagedShortcut as exc:
                if damaged is None:
                    raise
                damaged[rel] = str(exc)
                continue
            if shortcut is not None:
                out.append(shortcut)
    return out


def committed_order(store: Store) -> list[Ref]:
    """Genesis, then every committed version, oldest first."""
    return [store.genesis(), *(c.target for c in store.chain())]


def _committed_ref(store: Store, version: str) -> Ref | None:
    """The committed state ``version`` (the genesis or a committed version), asked in at most two reads (its
    version record, the commit record on its base); None if it is no committed state."""
    genesis = store.genesis()
    if version == genesis.version:
        return genesis
    if not is_label(version):
        return None
    record = store.version(version)
    if record is None:
        return None
    commit = store.commit_on(record.base.version)
    return commit.target if commit is not None and commit.version == version else None


def order_from(store: Store, since: str | None, others: Collection[str] = ()) -> list[Ref] | None:
    """The committed states from the oldest of ``since`` and the committed ``others`` to the head, oldest
    first, read forwards from each (the commit record on a state names its committed successor, store-v1
    §3.4): requests in proportion to the versions after the oldest start, none for the history before it.
    None where ``since`` is no committed state, nothing is to start from, or the walks do not meet on one
    chain (a damaged store): the caller then takes :func:`committed_order`, and its checks and messages."""
    refs: dict[str, Ref] = {}
    if since is not None:
        ref = _committed_ref(store, since)
        if ref is None:
            return None
        refs[since] = ref
    for v in others:
        if v not in refs and (ref := _committed_ref(store, v)) is not None:  # else no start (no committed state)
            refs[v] = ref
    if not refs:
        return None
    successor: dict[str, Ref] = {}
    walked: set[str] = set()
    for v in refs:  # each walk stops where an earlier one went: every committed state is read once
        current = v
        while current not in walked:
            walked.add(current)
            commit = store.commit_on(current)
            if commit is None:
                break
            successor[current] = commit.target
            current = commit.version
    reached = {r.version for r in successor.values()}
    first = [v for v in refs if v not in reached]
    if len(first) != 1:
        return None
    order = [refs[first[0]]]
    seen = {first[0]}
    while (nxt := successor.get(order[-1].version)) is not None:
        if nxt.version in seen:
            return None  # the commit chain loops: committed_order says so
        seen.add(nxt.version)
        order.append(nxt)
    return order if all(v in seen for v in refs) else None


def newest_keyframe(store: Store) -> KeyframeRecord | None:
    frames = keyframes(store)
    for ref in reversed(committed_order(store)):
        frame = frames.get(ref.version)
        if frame is not None and frame.fingerprint == ref.fingerprint:
            return frame
    return None


# -- keyframes ---------------------------------------------------------------------------------------------------------


def checkpoint_fingerprint(root: str | os.PathLike[str]) -> str:
    with SafetensorsCheckpoint(root) as ckpt:
        return fingerprint(ckpt.tensor_table(ckpt.tensor_digests()))


def _file_digest(path: Path) -> str:
    h = StreamingDigest()
    with open(path, "rb") as f:
        while chunk := f.read(_READ):
            h.update(chunk)
    return h.hexdigest()


def keyframe_object(version: str, file: KeyframeFile) -> str:
    return f"{KEYFRAMES}/{version}/{file.stored}"


def publish_keyframe(
    url: str,
    checkpoint: str | os.PathLike[str],
    *,
    version: str | None = None,
    storage_options: dict[str, Any] | None = None,
) -> KeyframeRecord:
    """Store ``checkpoint`` (a HF directory) as the keyframe of committed ``version`` (default: the head).

    Published as a version is (store-v1 §6.1): every file first, each one whole-object write under a
    name its BLAKE3 fixes (so a racing publisher writes the same bytes under a name, never other bytes),
    skipped if the store has it already with its size (asked one by one, never a listing) and written
    again if that copy is older than 15 minutes (a gc may be sweeping it as unreferenced); then each is
    asked about again, and only then is the record created, create-only. Until the record exists no
    reader sees the keyframe; once it exists every file it names is there. A publish stopped half-way
    leaves only unreferenced objects (gc removes them after its grace period); running it again
    uploads what is missing.
    """
    store = Store(url, storage_options)
    store.require_marker()
    store.require_atomic_publish()
    ref = store.head() if version is None else next((r for r in committed_order(store) if r.version == version), None)
    if ref is None:
        raise DcrError(f"{url}: {version!r} is not a committed version; a keyframe is a committed state")
    held = checkpoint_fingerprint(checkpoint)
    if held != ref.fingerprint:
        # Say what the checkpoint is, so the fix is in the line: most often it is another committed version
        # and --version (default: the head) was left out or named the wrong one.
        other = next((r.version for r in committed_order(store) if r.fingerprint == held), None)
        hint = (
            f"it holds committed version {other}: pass --version {other}"
            if other is not None
            else f"it holds no committed state of {url} (see dcr log {url})"
        )
        raise IncompatibleError(
            f"{checkpoint} holds fingerprint {held[:16]}…, not version {ref.version} ({ref.fingerprint[:16]}…); {hint}"
        )
    rel = f"{KEYFRAMES}/{ref.version}.json"
    existing = store.read_record(rel, KEYFRAME_KIND)
    if existing is not None:
        return KeyframeRecord.from_json(existing, f"{url}/{rel}")
    root = Path(checkpoint)
    files: list[KeyframeFile] = []
    for path in sorted(p for p in root.iterdir() if p.is_file() and not p.name.startswith(".")):
        _file_name(path.name)
        digest = _file_digest(path)
        files.append(KeyframeFile(path.name, path.stat().st_size, digest, f"{digest}-{path.name}"))
    now = time.time()
    for f in files:
        entry = store.stat(keyframe_object(ref.version, f))
        if entry is None or entry.size != f.size or _written_before(entry, now - REFRESH_S):
            _upload_file(store, root / f.name, keyframe_object(ref.version, f), f)
    for f in files:  # a concurrent gc could have swept one: every file must be there before the record
        entry = store.stat(keyframe_object(ref.version, f))
        if entry is None or entry.size != f.size:
            raise ConflictError(
                f"{url}: keyframe file {f.name} of {ref.version} vanished during the upload (a concurrent "
                "dcr gc?); nothing was published — run it again"
            )
    record = KeyframeRecord(ref.version, ref.fingerprint, files, utc_now())
    try:
        store.create(rel, dumps(record.to_json()))
    except FileExistsError:  # a racing publisher of the same state: its record (and files) are as good
        winner = store.read_record(rel, KEYFRAME_KIND)
        if winner is not None:
            return KeyframeRecord.from_json(winner, f"{url}/{rel}")
        raise
    return record


def _upload_file(store: Store, path: Path, rel: str, f: KeyframeFile) -> None:
    """One whole-object write of a local file (temporary name and rename; one PUT or a completed multipart
    upload), refused before it completes if the bytes are no longer those whose digest names the object."""

    def chunks() -> Iterator[bytes]:
        h = StreamingDigest()
        size = 0
        with open(path, "rb") as src:
            while chunk := src.read(CHUNK_BYTES):
                h.update(chunk)
                size += len(chunk)
                yield chunk
        if size != f.size or h.hexdigest() != f.digest:
            raise IntegrityError(f"{path} changed while it was uploaded as a keyframe file; nothing was published")

    if store.capabilities.local_files or store.capabilities.streamed_writes:
        store.put_chunks(rel, chunks)
    else:  # gs://, az://: their client's upload shows the object only once complete
        if _file_digest(path) != f.digest:
            raise IntegrityError(f"{path} changed while it was uploaded as a keyframe file; nothing was published")
        store.call(functools.partial(store.fs.put_file, str(path), store.path(rel)), f"write {rel}")


@dataclass
class JoinResult:
    store: str
    version: str
    fingerprint: str
    path: str
    bytes: int

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


_JOIN_LOCK = ".lock"  # in the partial directory of a join, as in a pull's


def join(
    url: str,
    out: str | os.PathLike[str],
    *,
    storage_options: dict[str, Any] | None = None,
    frame: KeyframeRecord | None = None,
) -> JoinResult:
    """Download the newest keyframe as the checkpoint directory ``out``; every file and the model fingerprint
    are verified before ``out`` appears."""
    store = Store(url, storage_options)
    store.require_marker()
    frame = frame or newest_keyframe(store)
    if frame is None:
        raise DcrError(f"{url}: no keyframe is published; publish one with dcr compact {url} --keyframe CHECKPOINT")
    dest = Path(out)
    if dest.exists():
        raise ConflictError(f"{dest} already exists; choose a new -o or remove it")
    dest.parent.mkdir(parents=True, exist_ok=True)
    # One partial directory per output, as dcr pull's (store-v1 §4.2): a join killed part-way (SIGKILL, a
    # reboot) leaves it, and the next join into the same -o keeps the files already downloaded whose size
    # and BLAKE3 are the record's and fetches the rest. (A fresh temporary name per run left a whole
    # checkpoint's worth of orphaned bytes behind each killed attempt, and started again from nothing.)
    partial = dest.parent / f".{dest.name}.partial"
    partial.mkdir(exist_ok=True)
    with open(partial / _JOIN_LOCK, "a+b") as lock:
        try:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConflictError(f"another dcr pull is writing {dest}; wait for it to finish") from None
        try:
            if dest.exists():  # a concurrent join finished between our check and the lock
                raise ConflictError(f"{dest} already exists; choose a new -o or remove it")
            _fetch_keyframe(store, url, frame, partial)
        except BaseException:
            # Keep what a re-run can resume from (files verified before, say, a network error), but no
            # empty directory: a refused keyframe (corrupt, wrong fingerprint) leaves nothing behind.
            with contextlib.suppress(OSError):
                if {p.name for p in partial.iterdir()} <= {_JOIN_LOCK}:
                    (partial / _JOIN_LOCK).unlink()
                    partial.rmdir()
            raise
        fsync_dir(partial)
        # Rename while holding the lock, then drop the lock file (now inside dest), as dcr pull does.
        os.rename(partial, dest)
        fsync_dir(dest.parent)
        with contextlib.suppress(FileNotFoundError):
            (dest / _JOIN_LOCK).unlink()
    return JoinResult(url, frame.version, frame.fingerprint, str(dest), frame.bytes)


def _fetch_keyframe(store: Store, url: str, frame: KeyframeRecord, partial: Path) -> None:
    """Every file of ``frame`` in ``partial``, verified (size, BLAKE3, then the whole checkpoint's fingerprint);
    files already there that verify are kept (an interrupted join), anything else there is removed."""
    from .repo import ObjectBlockSource

    wanted = {f.name for f in frame.files}
    for stray in partial.iterdir():  # what another keyframe, or a killed pull of a delta, left here
        if stray.name in wanted or stray.name == _JOIN_LOCK:
            continue
        if stray.is_dir() and not stray.is_symlink():
            shutil.rmtree(stray)
        else:
            stray.unlink()
    for f in frame.files:
        local = partial / f.name
        if local.is_file() and local.stat().st_size == f.size and _file_digest(local) == f.digest:
            continue  # downloaded and verified by an earlier, interrupted join
        # In bounded ranges, hashed as they arrive (one pass): an object larger than its record says is
        # refused after reading at most its recorded size plus one byte, not downloaded whole first.
        source = ObjectBlockSource(store, keyframe_object(frame.version, f))
        try:
            with open(local, "wb") as dst:
                for chunk in source.chunks(BlockEntry(f.digest, f.size, "data")):
                    dst.write(chunk)
                dst.flush()
                os.fsync(dst.fileno())
        except FileNotFoundError:
            local.unlink(missing_ok=True)
            raise IntegrityError(
                f"{url}: keyframe {frame.version} lacks {f.name} (removed by gc?); {republish_keyframe(url, frame)}, "
                "then re-run"
            ) from None
        except IntegrityError:
            local.unlink(missing_ok=True)
            raise IntegrityError(
                f"{url}: keyframe file {f.name} of {frame.version} is corrupt on the store (its size or BLAKE3 is "
                f"not its record's); {republish_keyframe(url, frame, f)}, then re-run"
            ) from None
    if checkpoint_fingerprint(partial) != frame.fingerprint:
        for f in frame.files:  # each file is as recorded, the record is wrong: nothing here is worth resuming
            (partial / f.name).unlink()
        raise IntegrityError(
            f"{url}: keyframe {frame.version} does not hold its recorded fingerprint; "
            f"{republish_keyframe(url, frame)}, then re-run"
        )


def republish_keyframe(url: str, frame: KeyframeRecord, damaged: KeyframeFile | None = None) -> str:
    """The fix for a keyframe a join cannot use: publishing stops at a record that is there (store-v1 §6.1
    step 2), so the record goes first; a damaged file goes too, since a publish keeps an object of the
    right size written in the last 15 minutes (step 3). Only the producer holds the checkpoint."""
    objects = [f"{KEYFRAMES}/{frame.version}.json"]
    if damaged is not None:
        objects.append(keyframe_object(frame.version, damaged))
    return (
        f"remove {' and '.join(objects)} from {url} and publish it anew with dcr compact {url} --keyframe "
        f"CHECKPOINT --version {frame.version} (CHECKPOINT: the checkpoint of {frame.version})"
    )


# -- shortcuts ---------------------------------------------------------------------------------------------------------


def _open_manifest(store: Store, record: VersionRecord, label: str, *, shortcut: bool = False) -> Delta:
    return open_record(store, record, f"{store.url} ({label})", shortcut=shortcut)


def _upload_delta(store: Store, local: Path, workers: int = DEFAULT_WORKERS) -> tuple[bytes, str]:
    """Upload a squashed delta's blocks and manifest as a push uploads a version's (store-v1 §4.1 steps
    4-6, §6.2); return (manifest bytes, digest). Each of its blocks is asked about (never a listing of
    ``blocks/``: the cost follows the shortcut, not the store), the absent ones are uploaded, the present
    ones older than 15 minutes written again (a concurrent gc may be removing them), then the manifest;
    then every block is asked about again: all must be there before the caller creates the record."""
    delta = Delta.open(local)
    raw = delta.raw_manifest()
    blocks = list({b.id: b for b in delta.manifest.blocks}.values())
    uploader = _Uploader(store, delta, workers, None, None)
    missing, _kept, refreshed = uploader.plan(blocks, False, refresh=True)
    uploader.upload(missing)
    uploader.upload(refreshed, counted=True)
    store.put(f"{MANIFESTS}/{delta.id}.json", raw)
    after: dict[str, Listing | None] = stat_blocks(store, blocks, workers)
    lost = [b.id for b in blocks if (e := after[b.id]) is None or e.size != b.size]
    if lost:
        raise ConflictError(
            f"{store.url}: block {lost[0][:16]}… vanished during the upload (a concurrent dcr gc?); nothing was "
            "published — run dcr compact again"
        )
    return raw, delta.id


@dataclass
class CompactResult:
    store: str
    keyframe: str
    published: list[str] = field(default_factory=list)  # "base..target"
    present: list[str] = field(default_factory=list)  # already there, those in ``raced`` included
    raced: list[str] = field(default_factory=list)  # published by another dcr compact while this one squashed

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def compact(
    url: str,
    *,
    every: int,
    storage_options: dict[str, Any] | None = None,
    workers: int | None = None,
    log: Callable[[str], None] | None = None,
) -> CompactResult:
    """Publish a shortcut from the newest keyframe to every ``every``-th committed version after it.

    Each shortcut squashes the previous one with the next ``every`` deltas; where the chain does not
    carry some first-base values (overwrites), the keyframe's checkpoint supplies them.
    """
    if every < 1:
        raise DcrError("--every must be at least 1")
    store = Store(url, storage_options)
    store.require_marker()
    store.require_atomic_publish()
    frame = newest_keyframe(store)
    if frame is None:
        raise DcrError(f"{url}: no keyframe is published; publish one with dcr compact {url} --keyframe CHECKPOINT")
    names = [c.version for c in store.commits_after(frame.version)]
    result = CompactResult(url, frame.version)
    damaged: dict[str, str] = {}
    have = {(s.record.base.version, s.record.version): s for s in shortcuts(store, damaged)}
    for j in range(every, len(names) + 1, every):  # a damaged record where this run publishes: refused first
        rel = f"{SHORTCUTS}/{frame.version}/{names[j - 1]}.json"
        if rel in damaged:
            raise _damaged_in_the_way(store, rel, damaged[rel])
    # Squashing reads target values from the repair blocks, which a push uploads after publishing the
    # version (store-v1 §4.1): every version to squash must have them all before anything is written.
    start = 0
    for j in range(every, len(names) + 1, every):
        if (frame.version, names[j - 1]) not in have:
            for name in names[start:j]:
                record = store.require_version(name)
                manifest = parse_manifest(store.manifest_bytes(record))
                require_repair_blocks(store, record, manifest, f"run dcr compact {url} --every {every} again")
        start = j
    from ..delta.squash import UnsquashableError, squash  # imports the codec's numba kernels: compact alone pays

    previous: Delta | None = None
    done = 0
    with tempfile.TemporaryDirectory(prefix=".dcr-compact-") as tmp:
        base_ckpt: SafetensorsCheckpoint | None = None
        try:
            for j in range(every, len(names) + 1, every):
                target = names[j - 1]
                label = f"{frame.version}..{target}"
                existing = have.get((frame.version, target))
                if existing is not None:
                    result.present.append(label)
                    previous, done = _open_manifest(store, existing.record, f"shortcut {label}", shortcut=True), j
                    continue
                chain = [_open_manifest(store, store.require_version(n), n) for n in names[done:j]]
                deltas = ([previous] if previous is not None else []) + chain
                out = Path(tmp) / label
                try:
                    summary = squash(deltas, out, workers=workers)
                except UnsquashableError:
                    if base_ckpt is None:
                        joined = join(url, Path(tmp) / "keyframe", storage_options=storage_options, frame=frame)
                        base_ckpt = SafetensorsCheckpoint(joined.path)
                    ckpt = base_ckpt
                    summary = squash(deltas, out, workers=workers, base_values=_reader(ckpt))
                raw, digest = _upload_delta(store, out, workers or DEFAULT_WORKERS)
                manifest = parse_manifest(raw)
                record = version_record(manifest, digest, len(raw), Ref(frame.version, frame.fingerprint))
                obj = {**record.to_json(), "format": SHORTCUT_KIND, "chain": names[:j]}
                try:
                    store.create(f"{SHORTCUTS}/{frame.version}/{target}.json", dumps(obj))
                except FileExistsError:  # another dcr compact published this shortcut meanwhile
                    record = _raced_shortcut(store, record, names[:j], label)
                    result.present.append(label)
                    result.raced.append(label)
                    if log:
                        log(f"shortcut {label}: already published by another dcr compact meanwhile; kept that one")
                else:
                    result.published.append(label)
                    if log:
                        log(f"shortcut {label}: {summary.payload_bytes} bytes for {j} versions")
                previous, done = _open_manifest(store, record, f"shortcut {label}", shortcut=True), j
        finally:
            if base_ckpt is not None:
                base_ckpt.close()
    return result


def _raced_shortcut(store: Store, ours: VersionRecord, chain: list[str], label: str) -> VersionRecord:
    """The record a racing ``dcr compact`` created where ours was to go, if it is the same shortcut: the same
    base and target states (labels and fingerprints) over the same chain; the squash may differ in bytes
    (its manifest names its own creation time), not in the state it leads to. Anything else fails closed."""
    rel = f"{SHORTCUTS}/{ours.base.version}/{ours.version}.json"
    try:
        found = read_shortcut(store, rel)
    except DamagedShortcut as exc:
        raise _damaged_in_the_way(store, rel, str(exc)) from None
    if found is None:
        raise ConflictError(
            f"{store.url}: shortcut {label} appeared and vanished while this dcr compact published it (a "
            "concurrent dcr gc?); nothing was published — run dcr compact again"
        )
    winner = found.record
    if (winner.base, winner.target, found.chain) != (ours.base, ours.target, chain):
        raise ConflictError(
            f"{store.url}: {rel} was created meanwhile by another writer with a different shortcut (base "
            f"{winner.base.version} {winner.base.fingerprint[:16]}…, target {winner.target.version} "
            f"{winner.target.fingerprint[:16]}…); this dcr compact published nothing — check the store (dcr check "
            f"{store.url}) and remove that record if it is damaged, then run dcr compact again"
        )
    return winner


def _damaged_in_the_way(store: Store, rel: str, why: str) -> ConflictError:
    return ConflictError(
        f"{why} (a damaged shortcut record); this dcr compact published nothing — dcr gc {store.url} drops "
        f"{rel} (dcr check lists it), then run dcr compact again"
    )


def _reader(ckpt: SafetensorsCheckpoint) -> Callable[[str, np.ndarray], np.ndarray]:
    return lambda name, flat: np.asarray(ckpt.view(name)[flat])


# -- path choice -------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Step:
    kind: str  # "chain", "shortcut" or "keyframe"
    base: str | None  # None for a keyframe
    target: str
    bytes: int
    record: VersionRecord | None = None
    frame: KeyframeRecord | None = None


@dataclass
class Plan:
    steps: list[Step]
    chain_bytes: int | None  # the plain chain's bytes (None: no chain from the receiver's version)
    keyframe_bytes: int | None  # the cheapest keyframe route's bytes, if any
    chain_gone: str = ""  # what describe() says when a receiver has a version but no plain chain reaches the target
    skipped: list[str] = field(default_factory=list)  # "base..target" of shortcuts left out: a data block is missing
    damaged: list[str] = field(default_factory=list)  # "base..target" of shortcut records that do not parse

    @property
    def bytes(self) -> int:
        return sum(s.bytes for s in self.steps)

    def describe(self) -> str:
        parts = [
            f"{s.kind} {s.target}" if s.kind == "keyframe" else f"{s.kind} {s.base}..{s.target}" for s in self.steps
        ]
        alt = [f"chain {self.chain_bytes} B" if self.chain_bytes is not None else self.chain_gone, ""]
        if self.keyframe_bytes is not None:
            alt[1] = f"keyframe route {self.keyframe_bytes} B"
        if self.skipped:
            alt.append(f"skipped shortcut {', '.join(self.skipped)}: a block is missing from the store (see dcr check)")
        if self.damaged:
            alt.append(f"skipped damaged shortcut record {', '.join(self.damaged)} (see dcr check)")
        others = ", ".join(a for a in alt if a)
        return f"path: {' + '.join(parts) or 'nothing to fetch'} ({self.bytes} B; {others or 'no other path'})"


def plan(
    url: str,
    since: str | None,
    until: str | None = None,
    *,
    allow_keyframe: bool = True,
    storage_options: dict[str, Any] | None = None,
) -> Plan:
    """The cheapest steps, by payload bytes, from committed ``since`` (None: no state) to ``until`` (the tip)."""
    store = Store(url, storage_options)
    store.require_marker()
    target = resolve(store, until)
    frames = keyframes(store) if allow_keyframe or since is None else {}
    # A route starts at ``since`` or at a keyframe: only the committed states from the oldest such start on
    # matter, read forwards from it (a catch-up costs requests for the versions after ``since``, not for the
    # whole history). Whatever that walk does not settle (a start of no committed state, a target before
    # it) takes the whole order, whose checks give the messages.
    window = order_from(store, since, frames)
    if window is not None and (
        target.version in {r.version for r in window} or target.base.version == window[-1].version
    ):
        order = window
    else:
        order = committed_order(store)
    while True:
        names = [r.version for r in order]
        if target.version not in names:
            if target.base.version != names[-1]:
                raise DcrError(f"{url}: {target.version!r} is neither committed nor pending on the head")
            names.append(target.version)
        pos = {n: i for i, n in enumerate(names)}
        end = pos[target.version]
        if since is not None:
            check_label(since, "--since version")
            if since not in pos or pos[since] > end:
                raise DcrError(f"{url}: {since!r} is not a committed version before {target.version!r} (see dcr log)")
        by_fp = {r.version: r.fingerprint for r in order}  # the committed states: genesis, then the chain
        edges: list[Step] = []
        linked = True
        for i in range(1, end + 1):
            record = target if names[i] == target.version else store.require_version(names[i])
            # Each delta must start where the one before it ends. The whole order has that from the chain's
            # checks; a window read forwards from a start trusts that start's commit record, which a record
            # off the chain (a forged or stale one) could fake: then the whole order decides.
            if order is window and (record.base.version, record.base.fingerprint) != (
                names[i - 1],
                by_fp.get(names[i - 1]),
            ):
                linked = False
                break
            if store.exists(f"{MANIFESTS}/{record.manifest}.json"):  # gc removes old versions' manifests
                edges.append(Step("chain", names[i - 1], names[i], record.payload_bytes, record=record))
        if linked or order is not window:
            break
        order = committed_order(store)
    damaged: dict[str, str] = {}  # records that are no shortcut record: no route (dcr check reports them)
    for s in shortcuts(store, damaged, bases=pos):  # one based before every start is on no route
        b, t = s.record.base, s.record.target
        # A shortcut joins two committed states (§6.2): by their fingerprints, not only their labels, as a
        # keyframe is matched. One that names a committed label with another state (a hostile or damaged
        # record) is no route: taking it would leave a receiver "at" the label holding other bits.
        committed_ends = by_fp.get(b.version) == b.fingerprint and by_fp.get(t.version) == t.fingerprint
        if (
            committed_ends
            and pos[b.version] < pos[t.version] <= end
            and store.exists(f"{MANIFESTS}/{s.record.manifest}.json")
        ):
            edges.append(Step("shortcut", b.version, t.version, s.record.payload_bytes, record=s.record))

    def cheapest(starts: dict[int, tuple[int, list[Step]]]) -> tuple[int, list[Step]] | None:
        best = dict(starts)
        for i in range(end + 1):  # every edge goes forward in chain order: one pass relaxes them all
            if i not in best:
                continue
            cost, steps = best[i]
            for e in edges:
                if e.base is not None and pos[e.base] == i:
                    j = pos[e.target]
                    if j not in best or cost + e.bytes < best[j][0]:
                        best[j] = (cost + e.bytes, [*steps, e])
        return best.get(end)

    starts = {
        pos[v]: (f.bytes, [Step("keyframe", None, v, f.bytes, frame=f)])
        for v, f in frames.items()
        if v in pos and pos[v] <= end and by_fp.get(v) == f.fingerprint
    }
    skipped: list[str] = []
    while True:
        chain_route = cheapest({pos[since]: (0, [])}) if since is not None else None
        frame_route = cheapest(starts) if starts else None
        chosen = [r for r in (chain_route, frame_route if allow_keyframe or since is None else None) if r]
        if not chosen:
            break
        # A shortcut on the cheapest route whose data blocks are not all on the store (a damaged store,
        # store-v1 §4.5) is no route: every lagging receiver would take it and fail. Asked only about the
        # shortcuts a route would take, one question per block; then the next cheapest is chosen.
        broken = [s for s in min(chosen, key=lambda r: r[0])[1] if s.kind == "shortcut" and not _present(store, s)]
        if not broken:
            break
        skipped.extend(f"{s.base}..{s.target}" for s in broken)
        edges = [e for e in edges if e not in broken]
    chain_only = None
    if since is not None:
        # The plain chain's cost, only if it still reaches the target: a sum over the deltas gc left
        # would quote a route that does not exist (and look cheaper than the one chosen).
        plain = {pos[e.base or ""]: e for e in edges if e.kind == "chain" and pos[e.base or ""] >= pos[since]}
        if all(i in plain for i in range(pos[since], end)):
            chain_only = sum(e.bytes for e in plain.values())
    options = [r for r in (chain_route, frame_route if (allow_keyframe or since is None) else None) if r is not None]
    if not options:
        if since is not None:
            raise DcrError(
                f"{url}: no path from {since} reaches {target.version!r} (deltas removed by gc?); join from a "
                "keyframe instead (dcr pull --join)"
            )
        raise DcrError(f"{url}: no path reaches {target.version!r} without state; publish a keyframe first")
    _cost, steps = min(options, key=lambda r: r[0])
    gone = "no plain chain (deltas removed by gc)" if since is not None and chain_only is None else ""
    return Plan(
        steps, chain_only, frame_route[0] if frame_route else None, gone, skipped, sorted(map(shortcut_label, damaged))
    )


def _shortcut_records(steps: list[Step]) -> list[VersionRecord]:
    return [s.record for s in steps if s.kind == "shortcut" and s.record is not None]


def _present(store: Store, step: Step) -> bool:
    """Whether every data block of a shortcut's manifest is on the store with its size (its manifest intact)."""
    assert step.record is not None
    try:
        manifest = parse_manifest(store.manifest_bytes(step.record, shortcut=True))
    except DcrError:
        return False
    data = [b for b in manifest.blocks if b.role == "data"]
    found = stat_blocks(store, data, DEFAULT_WORKERS)
    return all((entry := found[b.id]) is not None and entry.size == b.size for b in data)


def step_directory(step: Step) -> str:
    """The name a fetched step gets under the output directory: ``<target>`` for a version's own delta,
    ``shortcut-<base>-<target>`` for a shortcut, ``keyframe-<version>`` for a keyframe's checkpoint."""
    if step.kind == "keyframe":
        return f"keyframe-{step.target}"
    return step.target if step.kind == "chain" else f"shortcut-{step.base}-{step.target}"


def _pull_steps(
    store: Store,
    steps: list[Step],
    out_dir: Path,
    workers: int,
    progress: Progress | None,
    limiter: RateLimit | None,
    repair: bool,
) -> list[PullResult]:
    """Fetch these delta steps (chain or shortcut) into ``out_dir``, in order, each as a pull writes a version
    (verified, resumable, under its own lock). With ``repair`` the caller has asked about every step's repair
    blocks first (:func:`check_repairs`), before anything was written."""
    out: list[PullResult] = []
    for s in steps:
        assert s.record is not None and s.kind != "keyframe"
        pulled = _pull_record(
            store,
            s.record,
            out_dir / step_directory(s),
            workers,
            progress,
            limiter,
            repair,
            repairs_checked=True,
            kind=s.kind,
            replace_other=s.kind == "shortcut",  # a re-run replaces an older shortcut of the same states
        )
        out.append(replace(pulled, kind=s.kind))
    return out


def pull_since(
    url: str,
    since: str,
    out_dir: str | os.PathLike[str],
    *,
    version: str | None = None,
    storage_options: dict[str, Any] | None = None,
    workers: int = DEFAULT_WORKERS,
    progress: Progress | None = None,
    on_total: Total | None = None,
    limit_rate: float | None = None,
    repair: bool = False,
    log: Callable[[str], None] | None = None,
) -> list[PullResult]:
    """Download the deltas a receiver at committed ``since`` applies to reach ``version`` (default: the tip),
    in apply order: the cheapest route by bytes among the chain and the store's shortcuts, as
    ``apply(url, since=...)`` takes it (:func:`plan` without keyframes: a pull writes deltas). A version's
    delta lands in ``out_dir/<version>``, a shortcut in ``out_dir/shortcut-<base>-<target>``; each is
    verified before it appears, and a re-run keeps what is complete. ``log`` is told the route chosen
    (the ``path: …`` line); ``on_total`` the bytes ``progress`` will count, before any is fetched."""
    chosen = plan(url, since, version, allow_keyframe=False, storage_options=storage_options)
    if log is not None:
        log(chosen.describe())
    store = Store(url, storage_options)
    records = [s.record for s in chosen.steps if s.record is not None]
    if repair:  # before anything is written: a pull that cannot finish starts nothing
        check_repairs(store, records, workers, shortcuts=_shortcut_records(chosen.steps))
    if on_total is not None:
        on_total(_transfer_bytes(records, repair))
    limiter = RateLimit(limit_rate) if limit_rate else None
    return _pull_steps(store, chosen.steps, Path(out_dir), workers, progress, limiter, repair)


def pull_plan(
    url: str,
    the_plan: Plan,
    out_dir: str | os.PathLike[str],
    *,
    storage_options: dict[str, Any] | None = None,
    workers: int = 8,
    repair: bool = False,
    limit_rate: float | None = None,
) -> list[str]:
    """Fetch a plan's steps into ``out_dir`` (names: :func:`step_directory`): a keyframe's checkpoint, then
    the deltas (as :func:`pull_since` fetches them)."""
    store = Store(url, storage_options)
    deltas = [s for s in the_plan.steps if s.kind != "keyframe"]
    if repair:  # before anything is written, the keyframe included
        records = [s.record for s in deltas if s.record is not None]
        check_repairs(store, records, workers, shortcuts=_shortcut_records(deltas))
    limiter = RateLimit(limit_rate) if limit_rate else None
    written: list[str] = []
    for s in the_plan.steps:
        if s.kind == "keyframe":
            assert s.frame is not None
            written.append(
                join(url, Path(out_dir) / step_directory(s), storage_options=storage_options, frame=s.frame).path
            )
    pulled = _pull_steps(store, deltas, Path(out_dir), workers, None, limiter, repair)
    return written + [r.path for r in pulled]


def open_plan(url: str, the_plan: Plan, *, storage_options: dict[str, Any] | None = None) -> list[Delta]:
    """The plan's deltas, read in place from the store (no keyframe step allowed)."""
    store = Store(url, storage_options)
    out = []
    for s in the_plan.steps:
        if s.kind == "keyframe" or s.record is None:
            raise DcrError("a keyframe replaces the checkpoint; join with dcr pull --join instead")
        out.append(_open_manifest(store, s.record, f"{s.kind} {s.base}..{s.target}", shortcut=s.kind == "shortcut"))
    return out


def retained(store: Store) -> tuple[dict[str, int], set[str], list[str]]:
    """What gc keeps and drops for keyframes and shortcuts (store-v1.md §6.4).

    Returns (block id -> size the newest keyframe's shortcuts need, their manifest file names, object paths of
    older keyframes and shortcuts to remove: files first, records last).
    """
    newest = newest_keyframe(store)
    needed: dict[str, int] = {}
    manifests: set[str] = set()
    drop: list[str] = []
    for s in shortcuts(store, {}):  # a damaged record is the live set's to drop (collect.py), as it is read
        rel = f"{SHORTCUTS}/{s.record.base.version}/{s.record.version}.json"
        if newest is not None and s.record.base.version == newest.version:
            manifests.add(f"{s.record.manifest}.json")
            with contextlib.suppress(DcrError):  # a shortcut whose manifest is gone is skipped by plan()
                for block in parse_manifest(store.manifest_bytes(s.record, shortcut=True)).blocks:
                    needed[block.id] = block.size
        else:
            drop.append(rel)
    for version, frame in keyframes(store).items():
        if newest is not None and version != newest.version:
            # The record first: the keyframe is gone at once for every reader, never seen half removed.
            drop = [f"{KEYFRAMES}/{version}.json", *(keyframe_object(version, f) for f in frame.files), *drop]
    return needed, manifests, drop
