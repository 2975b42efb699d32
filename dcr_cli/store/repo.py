"""A dcr store on any fsspec filesystem: layout, records and atomic writes (format_spec/store-v1.md).

Layout under the store root::

    dcr-store.json                 store marker: format version and genesis baseline (create-only)
    blocks/<id>                    block bytes, id = BLAKE3 of the bytes (immutable, shared)
    manifests/<digest>.json        manifest bytes, digest = BLAKE3 of the bytes (immutable)
    versions/<version>.json        publication record of one version (create-only)
    acks/<version>/<receiver>.json a receiver's acknowledgement that it holds the version
    commits/<base version>.json    the joint commit of the version built on <base version> (create-only)
    children/<base>/<version>      index: versions published on <base> (written just before their record)
    latest.json                    hint: the newest committed version (may lag; never trusted alone)

Every object is written so that a reader sees all of it or nothing: content
addressed objects and records go to a temporary name and are renamed (local
disks) or sent as one PUT (object stores). Records that decide something
(publication, commit) are written create-only, so exactly one of two racing
writers wins.
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import json
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Any, TypeVar

from ..delta.reader import STORE_MANIFESTS
from ..delta.source import BlockSource
from ..errors import ConflictError, DcrError, FormatError, IntegrityError, NotReadyError
from ..format.digest import digest_bytes, is_digest
from ..format.manifest import BlockEntry
from ..format.store_records import (
    COMPLETE,
    MARKER,
    MAX_RECORD_BYTES,
    STORE_FORMAT,
    STORE_MAJOR,
    STORE_MINOR,
    VERSION_KIND,
    VERSIONS,
    is_label,
    parse_record,
    redo_shortcut,
)
from ..format.store_records import LABEL as _LABEL
from ..format.strict_json import load_json
from ..io.pool import parallel
from ..io.retry import calling
from .backends import Capabilities, open_filesystem

T = TypeVar("T")

BLOCKS = "blocks"
MANIFESTS = STORE_MANIFESTS
ACKS = "acks"
COMMITS = "commits"
CHILDREN = "children"
LATEST = "latest.json"
ANNOUNCED = "announced"  # announced/<version>/<block id>-<size>: a push in progress names its data blocks (1.2)

STORE_QUESTIONS = 16  # small requests (records, stats) one command has in flight at once
POLL_S = 0.05  # between two questions of a command that waits (--wait) for something to appear on a store


def check_label(label: str, what: str) -> str:
    """Version and receiver labels become object names: allow only a safe, portable alphabet."""
    if not isinstance(label, str) or not is_label(label):
        raise DcrError(
            f"{what} {label!r} is not a valid label: use 1-128 characters from A-Z a-z 0-9 . _ -, "
            "starting with a letter or digit"
        )
    return label


def check_distinct_labels(target: str, base: str | None, where: str) -> None:
    """A store cannot publish a version under its base's label (the chain would loop): refused, one line, the
    same for every command that would reach the store with it (``dcr push``, and ``dcr diff --push`` before
    the diff runs). ``where`` starts the line (the store, or the option given)."""
    if base is not None and target == base:
        raise ConflictError(
            f"{where}: the target label {target!r} is also the base's label; a store cannot publish a version "
            "under its base's label: label the target differently (dcr diff --target-version)"
        )


def utc_now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def dumps(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, indent=1, sort_keys=True, ensure_ascii=False).encode("utf-8") + b"\n"


@dataclass(frozen=True)
class Ref:
    """A model state: its label in this store and its fingerprint (format_spec/delta-v1.md)."""

    version: str
    fingerprint: str

    def to_json(self) -> dict[str, str]:
        return {"version": self.version, "fingerprint": self.fingerprint}

    @staticmethod
    def from_json(obj: Any, where: str) -> Ref:
        if (
            not isinstance(obj, dict)
            or not isinstance(obj.get("version"), str)
            or not is_digest(obj.get("fingerprint"))
        ):
            raise FormatError(f"{where}: needs a string version and a 64-hex fingerprint")
        if not _LABEL.fullmatch(obj["version"]) or obj["version"].endswith(".json"):
            # Labels become object names (commits/<base>.json, children/<base>/): never a path.
            raise FormatError(f"{where}: version {obj['version']!r} is not a valid label; the store is damaged")
        return Ref(obj["version"], obj["fingerprint"])


@dataclass(frozen=True)
class VersionRecord:
    """versions/<version>.json: a published version (its delta is complete on the store)."""

    version: str
    base: Ref
    target: Ref
    manifest: str  # digest of the manifest bytes: manifests/<manifest>.json
    manifest_bytes: int
    payload_bytes: int
    repair_bytes: int
    full_bytes: int
    changed_elements: int
    total_elements: int
    blocks: int
    created: str
    producer: str = ""
    minor: int = STORE_MINOR  # format_version minor it was written with: from 1.1 on, repair blocks follow the record

    KIND = VERSION_KIND

    @property
    def change_rate(self) -> float:
        return self.changed_elements / self.total_elements if self.total_elements else 0.0

    def to_json(self) -> dict[str, Any]:
        obj = asdict(self)
        del obj["minor"]
        obj.update(
            format=self.KIND,
            format_version=[STORE_MAJOR, STORE_MINOR],
            base=self.base.to_json(),
            target=self.target.to_json(),
            change_rate=self.change_rate,
        )
        return obj

    @staticmethod
    def from_json(obj: dict[str, Any], where: str) -> VersionRecord:
        try:
            record = VersionRecord(
                version=check_label(obj["version"], "version"),
                base=Ref.from_json(obj["base"], where + " base"),
                target=Ref.from_json(obj["target"], where + " target"),
                manifest=obj["manifest"],
                **{
                    k: int(obj[k])
                    for k in (
                        "manifest_bytes",
                        "payload_bytes",
                        "repair_bytes",
                        "full_bytes",
                        "changed_elements",
                        "total_elements",
                        "blocks",
                    )
                },
                created=str(obj.get("created", "")),
                producer=str(obj.get("producer", "")),
                minor=int(obj["format_version"][1]),
            )
        except (KeyError, TypeError, ValueError, DcrError) as exc:
            raise FormatError(f"{where}: malformed version record ({exc})") from None
        if not is_digest(record.manifest):
            raise FormatError(f"{where}: manifest must be a 64-hex digest")
        return record


@dataclass(frozen=True)
class CommitRecord:
    """commits/<base version>.json: the one version committed on top of ``base``."""

    version: str
    base: Ref
    target: Ref
    acked: tuple[str, ...]
    required: dict[str, Any] = field(default_factory=dict)
    created: str = ""

    KIND = "dcr.store.commit"

    def to_json(self) -> dict[str, Any]:
        return {
            "format": self.KIND,
            "format_version": [STORE_MAJOR, STORE_MINOR],
            "version": self.version,
            "base": self.base.to_json(),
            "target": self.target.to_json(),
            "acked": list(self.acked),
            "required": self.required,
            "created": self.created,
        }

    @staticmethod
    def from_json(obj: dict[str, Any], where: str) -> CommitRecord:
        try:
            return CommitRecord(
                version=check_label(obj["version"], "version"),
                base=Ref.from_json(obj["base"], where + " base"),
                target=Ref.from_json(obj["target"], where + " target"),
                acked=tuple(str(a) for a in obj.get("acked", [])),
                required=dict(obj.get("required") or {}),
                created=str(obj.get("created", "")),
            )
        except (KeyError, TypeError, ValueError, DcrError) as exc:
            raise FormatError(f"{where}: malformed commit record ({exc})") from None


@dataclass(frozen=True)
class Listing:
    """One object found by listing a store directory."""

    name: str
    size: int
    mtime: float | None  # seconds since the epoch, when the backend says


def poll(probe: Callable[[], T | None], deadline: float, what: str, on_wait: Callable[[str], None] | None = None) -> T:
    """``probe()`` until it returns something, asked every POLL_S until ``deadline`` (time.monotonic);
    then NotReadyError (exit 4) saying ``what`` did not appear. ``on_wait(what)`` is called once, when
    the first answer is no (the caller is then ready and waiting)."""
    if deadline != deadline:  # NaN (--wait nan): no comparison with it is ever true, so it waited for good
        raise DcrError("--wait must be a number of seconds (0 or more; inf waits until it appears), not nan")
    while True:
        found = probe()
        if found is not None:
            return found
        if on_wait is not None:
            on_wait(what)
            on_wait = None
        left = deadline - time.monotonic()
        if left <= 0:
            raise NotReadyError(f"{what} did not appear in time; nothing was done — run it again (or wait longer)")
        time.sleep(min(POLL_S, left))


class Store:
    """A dcr store at an fsspec URL. Every call that touches the store is retried on transient errors."""

    def __init__(
        self,
        url: str,
        storage_options: dict[str, Any] | None = None,
        *,
        allow_unsafe_publish: bool = False,
    ) -> None:
        self.url = url
        self.backend, root = open_filesystem(url, storage_options)
        self.fs = self.backend.fs
        self.root = root.rstrip("/") or root
        self.allow_unsafe_publish = allow_unsafe_publish
        self._marker: dict[str, Any] | None = None  # the marker is create-only and never changes: read once
        self._marker_lock = threading.Lock()  # questions asked at once that each need the marker read it once
        # Version and commit records too are written create-only and never removed or rewritten
        # (§3): once found, each is kept, and a command asks for it once (an absent one is asked afresh).
        self._versions: dict[str, VersionRecord] = {}
        self._commits: dict[str, CommitRecord] = {}

    # -- backend capabilities ------------------------------------------------------------------------------------

    @property
    def capabilities(self) -> Capabilities:
        return self.backend.capabilities

    @property
    def publish_method(self) -> str | None:
        """How this backend makes a create-only write atomic, or None when it cannot (store-v1 §2)."""
        return self.capabilities.atomic_create

    def require_atomic_publish(self) -> None:
        if self.publish_method is None and not self.allow_unsafe_publish:
            raise DcrError(
                f"{self.url}: this store ({self.backend.name}) cannot create an object atomically, so two "
                "producers could both believe they published the same version; use a local, file://, s3://, "
                "gs:// or az:// store, or pass --allow-unsafe-publish if only one producer ever writes here"
            )

    # -- paths and raw operations ----------------------------------------------------------------------------------

    def path(self, *parts: str) -> str:
        return "/".join((self.root, *parts))

    def call(self, fn: Callable[[], T], what: str) -> T:
        """Run one store operation with retries; client-library errors become one DcrError line."""
        return calling(fn, f"{self.url}: {what}", self.backend.transient)

    def read(self, rel: str, *, limit: int | None = None) -> bytes:
        """A whole object; with ``limit``, at most that many bytes are read and a larger object is refused."""
        path = self.path(rel)
        if limit is None:
            return self.call(lambda: self.backend.read(path), f"read {rel}")
        data = self.call(lambda: self.backend.read(path, 0, limit + 1), f"read {rel}")
        if len(data) > limit:
            raise FormatError(f"{self.url}/{rel}: over the {limit} byte limit; the store is damaged")
        return data

    def read_range(self, rel: str, start: int, end: int) -> bytes:
        return self.call(lambda: self.backend.read(self.path(rel), start, end), f"read {rel}")

    def size(self, rel: str) -> int | None:
        """The object's size asked afresh, None if it is absent."""
        entry = self.stat(rel)
        return None if entry is None else entry.size

    def stat(self, rel: str) -> Listing | None:
        """Size and modification time of one object, asked afresh; None if it is absent."""

        def run() -> Listing | None:
            info = self.backend.info(self.path(rel))
            if info is None:
                return None
            return Listing(rel.rsplit("/", 1)[-1], int(info.get("size") or 0), self.backend.mtime(info))

        return self.call(run, f"check {rel}")

    def exists(self, rel: str) -> bool:
        return self.stat(rel) is not None

    def list(self, rel_dir: str) -> builtins.list[Listing]:
        """Objects directly under a store directory (names only, no subdirectories); [] if it is absent."""
        path = self.path(rel_dir)

        def run() -> builtins.list[Listing]:
            entries = self.backend.ls(path)
            return [
                Listing(e["name"].rstrip("/").rsplit("/", 1)[-1], int(e.get("size") or 0), self.backend.mtime(e))
                for e in entries
                if e.get("type") != "directory"
            ]

        return self.call(run, f"list {rel_dir}/")

    def list_dirs(self, rel_dir: str) -> builtins.list[str]:
        path = self.path(rel_dir)

        def run() -> builtins.list[str]:
            return [
                e["name"].rstrip("/").rsplit("/", 1)[-1] for e in self.backend.ls(path) if e.get("type") == "directory"
            ]

        return self.call(run, f"list {rel_dir}/")

    def modified(self, rel: str) -> float | None:
        """When the object was last written (seconds since the epoch), asked afresh; None if absent or unknown."""
        entry = self.stat(rel)
        return None if entry is None else entry.mtime

    def delete(self, rel: str) -> None:
        def run() -> None:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm_file(self.path(rel))

        self.call(run, f"delete {rel}")

    def delete_many(self, rels: builtins.list[str]) -> None:
        """Delete several objects, in as few requests as the backend allows (S3: up to 1000 a request)."""
        paths = [self.path(rel) for rel in rels]

        def run() -> None:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm(paths)

        self.call(run, f"delete {len(rels)} objects")

    def put(self, rel: str, data: bytes) -> None:
        """Write an object whole: readers see the previous state or all of ``data``, never a part."""
        self.call(lambda: self.backend.put(self.path(rel), data), f"write {rel}")

    def put_chunks(self, rel: str, chunks: Callable[[], Iterable[bytes]]) -> None:
        """As ``put``, from the chunks ``chunks()`` yields (called again if a transient error retries the write)."""
        self.call(lambda: self.backend.put_chunks(self.path(rel), chunks()), f"write {rel}")

    def create(self, rel: str, data: bytes) -> None:
        """Create an object only if the name is free; raise FileExistsError if someone got there first."""
        self.require_atomic_publish()
        self.call(lambda: self.backend.create(self.path(rel), data), f"create {rel}")

    # -- typed records -----------------------------------------------------------------------------------------------

    def read_record(self, rel: str, kind: str) -> dict[str, Any] | None:
        """A record, or None if it does not exist."""
        try:
            raw = self.read(rel, limit=MAX_RECORD_BYTES)
        except FileNotFoundError:
            return None
        return parse_record(raw, kind, f"{self.url}/{rel}")

    def marker(self) -> dict[str, Any] | None:
        """The store marker; once found it is kept (store-v1: written create-only, never rewritten), which
        saves a commit or a push a round trip per question about the genesis."""
        with self._marker_lock:
            if self._marker is None:
                marker = self.read_record(MARKER, STORE_FORMAT)
                if marker is not None:  # damaged, it fails every command, not only those that ask for the genesis
                    Ref.from_json(marker.get("genesis"), f"{self.url}/{MARKER} genesis")
                self._marker = marker
            return self._marker

    def require_marker(self) -> dict[str, Any]:
        marker = self.marker()
        if marker is None:
            raise DcrError(f"{self.url} is not a dcr store (no {MARKER}); push a delta to create it")
        return marker

    def genesis(self) -> Ref:
        return Ref.from_json(self.require_marker().get("genesis"), f"{self.url}/{MARKER} genesis")

    def init(self, genesis: Ref) -> Ref:
        """Create the store marker if absent (create-only); return the store's genesis either way."""
        check_label(genesis.version, "the delta's base version (the store's genesis label)")
        marker = {
            "format": STORE_FORMAT,
            "format_version": [STORE_MAJOR, STORE_MINOR],
            "genesis": genesis.to_json(),
            "created": utc_now(),
        }
        if self.marker() is not None:
            return self.genesis()  # the common case; never rely on a create being refused when a read will do
        with contextlib.suppress(FileExistsError):
            self.create(MARKER, dumps(marker))
        return self.genesis()

    def version(self, version: str) -> VersionRecord | None:
        check_label(version, "version")
        if version in self._versions:
            return self._versions[version]
        rel = f"{VERSIONS}/{version}.json"
        obj = self.read_record(rel, VersionRecord.KIND)
        if obj is None:
            return None
        record = self._versions[version] = VersionRecord.from_json(obj, f"{self.url}/{rel}")
        return record

    def require_version(self, version: str) -> VersionRecord:
        record = self.version(version)
        if record is None:
            raise DcrError(f"{self.url}: version {version!r} is not published here (see dcr log {self.url})")
        return record

    def versions(self) -> dict[str, VersionRecord]:
        names = [e.name[: -len(".json")] for e in self.list(VERSIONS) if e.name.endswith(".json")]
        out: dict[str, VersionRecord] = {}
        for name in names:
            if _LABEL.fullmatch(name):
                record = self.version(name)
                if record is not None:
                    out[name] = record
        return out

    def children(self, base_version: str) -> builtins.list[VersionRecord]:
        """Published versions built on ``base_version``, oldest first (found through the children index)."""
        out = []
        for entry in self.list(f"{CHILDREN}/{base_version}"):
            if _LABEL.fullmatch(entry.name):
                record = self.version(entry.name)
                if record is not None and record.base.version == base_version:
                    out.append(record)
        return sorted(out, key=lambda r: (r.created, r.version))

    def commits_after(self, version: str) -> builtins.list[CommitRecord]:
        """The committed versions that follow ``version``, in order, up to the head."""
        out: builtins.list[CommitRecord] = []
        seen = {version}
        current = version
        while (record := self.commit_on(current)) is not None:
            if record.version in seen:
                raise FormatError(f"{self.url}: the commit chain loops at {record.version!r}; the store is damaged")
            seen.add(record.version)
            out.append(record)
            current = record.version
        return out

    def is_committed(self, version: str, fingerprint: str | None = None) -> bool:
        """Whether ``version`` is the genesis or a committed version (with ``fingerprint``: of that target)."""
        if self._marker is not None:
            genesis = self.genesis()
            if version == genesis.version:
                return fingerprint in (None, genesis.fingerprint)
            record = self.version(version)
        else:  # the marker and the record asked together: one round trip, not two

            def record_or_error() -> VersionRecord | DcrError | None:
                try:
                    return self.version(version)
                except DcrError as exc:  # raised only if the record is needed: the genesis has none
                    return exc

            questions: builtins.list[Callable[[], Any]] = [self.genesis, record_or_error]
            genesis, answer = parallel(questions, len(questions))
            if version == genesis.version:
                return fingerprint in (None, genesis.fingerprint)
            if isinstance(answer, DcrError):
                raise answer
            record = answer
        if record is None or fingerprint not in (None, record.target.fingerprint):
            return False
        commit = self.commit_on(record.base.version)
        return commit is not None and commit.version == version

    def is_head(self, ref: Ref) -> bool:
        """Whether ``ref`` (the store's label, and fingerprint) is the committed head, as ``head() == ref``
        says, without walking the chain: committed, and no commit record on it. Records are never
        rewritten or removed, so a committed state stays committed (§4.3); the two questions go out
        together."""
        if not _LABEL.fullmatch(ref.version):  # a delta's label for its base: never part of a name unchecked
            return False
        questions: builtins.list[Callable[[], Any]] = [
            functools.partial(self.commit_on, ref.version),
            functools.partial(self.is_committed, ref.version, ref.fingerprint),
        ]
        try:
            successor, committed = parallel(questions, len(questions))
        except DcrError:  # a damaged record on the way: not known here; head() walks around what it can
            return False
        return successor is None and bool(committed)

    def commit_on(self, base_version: str) -> CommitRecord | None:
        if base_version in self._commits:
            return self._commits[base_version]
        rel = f"{COMMITS}/{base_version}.json"
        obj = self.read_record(rel, CommitRecord.KIND)
        if obj is None:
            return None
        record = self._commits[base_version] = CommitRecord.from_json(obj, f"{self.url}/{rel}")
        return record

    def chain(self) -> builtins.list[CommitRecord]:
        """Committed versions in order, from the genesis baseline to the head."""
        return self.commits_after(self.genesis().version)

    def head(self) -> Ref:
        """The newest committed state: the only base a producer may diff against."""
        current = self._hinted_head()
        seen = {current.version}
        while (record := self.commit_on(current.version)) is not None:
            if record.version in seen:
                raise FormatError(f"{self.url}: the commit chain loops at {record.version!r}; the store is damaged")
            seen.add(record.version)
            current = record.target
        return current

    def _hinted_head(self) -> Ref:
        """Start point of the head walk: latest.json if it names a committed version, else the genesis."""
        genesis = self.genesis()
        try:
            version = self.latest_hint()
            record = None if version is None else self.version(version)
        except DcrError:
            return genesis
        if record is None:
            return genesis
        commit = self.commit_on(record.base.version)
        if commit is None or commit.version != version:
            return genesis
        return commit.target

    def latest_hint(self) -> str | None:
        """The version latest.json names, if it is a readable record with a valid label (never trusted alone)."""
        try:
            hint = load_json(self.read(LATEST, limit=MAX_RECORD_BYTES), f"{self.url}/{LATEST}")
        except (FileNotFoundError, FormatError):
            return None
        version = hint.get("version") if isinstance(hint, dict) else None
        return version if isinstance(version, str) and _LABEL.fullmatch(version) else None

    def manifest_bytes(self, record: VersionRecord, *, shortcut: bool = False) -> bytes:
        """The version's (with ``shortcut``, the shortcut's) manifest, checked against the digest its record
        names (and its size before reading)."""
        from ..format.manifest import MAX_MANIFEST_BYTES

        rel = f"{MANIFESTS}/{record.manifest}.json"
        try:
            raw = self.read(rel, limit=MAX_MANIFEST_BYTES)
        except FileNotFoundError:
            raise DcrError(
                f"{self.url}: the manifest of {record_name(record, shortcut)} is gone (removed by dcr gc?); "
                f"{self._manifest_fix(record, shortcut, damaged=False)}"
            ) from None
        if digest_bytes(raw) != record.manifest:
            raise IntegrityError(
                f"{self.url}/{rel}: manifest of {record_name(record, shortcut)} is corrupt; "
                f"{self._manifest_fix(record, shortcut, damaged=True)}"
            )
        return raw

    def _manifest_fix(self, record: VersionRecord, shortcut: bool, *, damaged: bool) -> str:
        """What restores a version's (or shortcut's) manifest that is gone or damaged on this store.

        A shortcut is derived data: compact makes it anew once its record is gone (store-v1 §6.2, §6.4). A
        version's is restored by a re-run of its push (§4.1 step 2: the manifest if absent, with
        --verify-remote one that fails its digest); without that delta, see :meth:`_way_round`."""
        if shortcut:
            return redo_shortcut(self.url, record.base.version, record.version)
        verify = " --verify-remote" if damaged else ""
        fix = f"restore it with dcr push DELTA {self.url}{verify} (DELTA: the delta of {record.version!r})"
        way_round = self._way_round(record)
        return f"{fix}; without that delta, {way_round}" if way_round else fix

    def record_fix(self, record: VersionRecord, shortcut: bool = False) -> str:
        """What fixes a record that names a manifest of other states (the manifest has the record's digest, so
        the record is wrong). A shortcut's, as :meth:`_manifest_fix`; a pending version's record goes and its
        push publishes it anew (§4.1); a committed one's cannot (the commit record names it, and a push
        builds on the head): see :meth:`_way_round`."""
        if shortcut:
            return redo_shortcut(self.url, record.base.version, record.version)
        way_round = self._way_round(record)
        if way_round:
            return f"a committed version's record cannot be published again: {way_round}"
        return (
            f"remove {VERSIONS}/{record.version}.json from {self.url} and publish it anew with dcr push DELTA "
            f"{self.url} (DELTA: the delta of {record.version!r})"
        )

    def _way_round(self, record: VersionRecord) -> str:
        """For a committed version whose delta cannot be had: a keyframe of the head, which a receiver with no
        state joins (store-v1 §6.1, §6.3); "" for a pending one (a keyframe holds a committed state)."""
        committed = False
        with contextlib.suppress(DcrError, OSError):  # the question only shapes the advice
            committed = self.is_committed(record.version)
        if not committed:
            return ""
        return (
            f"publish a keyframe of the head (dcr compact {self.url} --keyframe CHECKPOINT) and join from it "
            f"(dcr pull {self.url} --join -o DIR)"
        )


def record_name(record: VersionRecord, shortcut: bool = False) -> str:
    """How a message names a record: "version 'v4'", or "shortcut v0..v4" (a squashed delta, store-v1 §6.2)."""
    return f"shortcut {record.base.version}..{record.version}" if shortcut else f"version {record.version!r}"


class StoreBlockSource(BlockSource):
    """A store's blocks, read with the store's retries and error wrapping.

    ``record``: the version (or shortcut) whose blocks these are, so that a missing repair block can be
    told apart: still to come (the push publishes before it uploads them, store-v1 §4.1) or lost.
    ``repairs_promised``: every block was uploaded before the record (a shortcut, §6.2).
    """

    checks_repairs_up_front = False  # read only by a torn item (and pull --repair, squashing), as on any store
    # A push publishes a version before its repair blocks (store-v1 §4.1).
    missing_repair_advice = (
        "the store lacks it: the producer's dcr push is still uploading repair blocks or was stopped after "
        "publishing; wait for it to finish, or re-run dcr push DELTA URL, then re-run"
    )
    damaged_advice = (
        "the store's copy is damaged (dcr check URL --read-data lists every damaged object): restore it with "
        "dcr push DELTA URL --verify-remote, then re-run"
    )

    def __init__(self, store: Store, record: VersionRecord | None = None, *, repairs_promised: bool = False) -> None:
        super().__init__(store.fs, store.root, label=store.url)
        self.store = store
        self.local = store.capabilities.local_files
        self.record = record
        self.repairs_promised = repairs_promised
        if record is not None and repairs_promised:  # a shortcut's: dcr push cannot restore it
            self.damaged_advice = (
                f"the store's copy is damaged (dcr check {store.url} --read-data lists every damaged object): "
                f"{redo_shortcut(store.url, record.base.version, record.version)}, then re-run"
            )

    def call(self, fn: Callable[[], T], what: str) -> T:
        return self.store.call(fn, what)

    def read(self, block: BlockEntry, start: int, end: int) -> bytes:
        return self.store.read_range(f"{BLOCKS}/{block.id}", start, end)

    def exists(self, block: BlockEntry) -> bool:
        return self.store.exists(f"{BLOCKS}/{block.id}")

    def missing_repair(self, what: str) -> DcrError:
        """Not ready (exit 4) while the version's push may still upload the block; lost (exit 2) once the
        version is complete (``complete/<v>``, a record of minor 0, a shortcut): store-v1 §4.1."""
        record = self.record
        if record is None:
            return IntegrityError(f"{what}; {self.missing_repair_advice}")
        promised = self.repairs_promised or record.minor < 1 or self.store.exists(f"{COMPLETE}/{record.version}")
        if promised:
            url = self.store.url
            fix = (
                redo_shortcut(url, record.base.version, record.version)
                if self.repairs_promised
                else f"restore it with dcr push DELTA {url}"
            )
            return IntegrityError(
                f"{what}; {url} lost it although {record_name(record, self.repairs_promised)} is complete there: "
                f"{fix}, then re-run"
            )
        return NotReadyError(
            f"{what}; {self.store.url} does not have it yet: the producer's dcr push of {record.version!r} is "
            "still uploading repair blocks or was stopped after publishing; wait for it to finish, or re-run "
            f"dcr push DELTA {self.store.url}, then re-run"
        )


class ObjectBlockSource(StoreBlockSource):
    """One object of the store (``rel``) read as a block is: in bounded ranges, at most its recorded size plus one
    byte, its BLAKE3 computed as the ranges arrive (``chunks``). Keyframe files are read so, by a join and by
    ``dcr check --read-data`` (store-v1 §6.1)."""

    def __init__(self, store: Store, rel: str) -> None:
        super().__init__(store)
        self.rel = rel

    def read(self, block: BlockEntry, start: int, end: int) -> bytes:
        return self.store.read_range(self.rel, start, end)
