"""Joint commit: receivers acknowledge a version, the producer commits it once enough have.

The commit record of a version lives at ``commits/<its base version>.json``
and is written create-only, so each committed state has exactly one committed
successor and the committed versions form one chain from the genesis. The
head of that chain is the only base a producer may diff against.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from ..errors import ConflictError, DcrError, IncompatibleError, NotReadyError
from .repo import (
    ACKS,
    COMMITS,
    LATEST,
    MANIFESTS,
    MAX_RECORD_BYTES,
    STORE_MAJOR,
    STORE_MINOR,
    CommitRecord,
    Ref,
    Store,
    VersionRecord,
    check_label,
    dumps,
    is_label,
    parse_record,
    poll,
    utc_now,
)

ACK_KIND = "dcr.store.ack"


def acknowledge(
    url: str,
    version: str,
    receiver: str,
    *,
    fingerprint: str | None = None,
    storage_options: dict[str, Any] | None = None,
    store: Store | None = None,
) -> dict[str, Any]:
    """Record that ``receiver`` holds ``version``. Idempotent.

    ``fingerprint``, when given, is what the receiver verified it holds; it
    must be the version's target fingerprint. ``store``: the Store of ``url`` the caller has open
    already (its marker read once: one round trip less).
    """
    check_label(receiver, "receiver")
    store = store if store is not None and store.url == url else Store(url, storage_options)
    store.require_marker()
    record = store.require_version(version)
    if fingerprint is not None and fingerprint != record.target.fingerprint:
        raise IncompatibleError(
            f"receiver {receiver!r} holds {fingerprint[:16]}…, not version {version!r} "
            f"({record.target.fingerprint[:16]}…); apply the version before acknowledging it"
        )
    ack = {
        "format": ACK_KIND,
        "format_version": [STORE_MAJOR, STORE_MINOR],
        "version": version,
        "receiver": receiver,
        "fingerprint": record.target.fingerprint,
        "created": utc_now(),
    }
    store.put(f"{ACKS}/{version}/{receiver}.json", dumps(ack))
    return ack


def acks(store: Store, record: VersionRecord) -> list[str]:
    """Receivers that acknowledged ``record``, sorted. An acknowledgement counts by its object name,
    ``acks/<version>/<receiver>.json``, and only if what it says agrees with that name and with the
    version record (store-v1 §3.3)."""
    names: list[str] = []
    for entry in store.list(f"{ACKS}/{record.version}"):
        receiver = entry.name[: -len(".json")] if entry.name.endswith(".json") else ""
        if not is_label(receiver):
            continue  # temporary files of an interrupted write, strays
        try:
            obj = parse_record(
                store.read(f"{ACKS}/{record.version}/{entry.name}", limit=MAX_RECORD_BYTES), ACK_KIND, entry.name
            )
        except (FileNotFoundError, DcrError):
            continue  # unreadable acks do not count; the receiver re-acknowledges
        if (obj.get("receiver"), obj.get("version"), obj.get("fingerprint")) == (
            receiver,
            record.version,
            record.target.fingerprint,
        ):
            names.append(receiver)
    return sorted(set(names))


@dataclass
class CommitResult:
    store: str
    version: str
    base: str
    fingerprint: str
    acked: list[str]
    already_committed: bool

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def commit(
    url: str,
    version: str,
    *,
    receivers: Sequence[str] = (),
    quorum: int | None = None,
    storage_options: dict[str, Any] | None = None,
    allow_unsafe_publish: bool = False,
    wait: float | None = None,
    on_wait: Callable[[str], None] | None = None,
) -> CommitResult:
    """Make ``version`` the committed head once the named receivers (or a quorum) acknowledged it.

    With receivers and a quorum, ``quorum`` of the named receivers suffice;
    with a quorum alone, any receivers count. Missing acknowledgements raise
    NotReadyError (exit 4) and write nothing: run it again later. ``wait``: seconds to wait
    for the store, the version and the acknowledgements instead (a producer that starts its commit
    with the refit: its start-up is off the refit's path); the acknowledgements are listed every
    POLL_S and the commit is tried whenever a new one appears, with every check as without it.
    ``on_wait`` is told what it waits for, once, when it starts waiting.
    """
    _check_commit_args(receivers, quorum)
    if wait is None:
        return _commit(url, version, receivers, quorum, storage_options, allow_unsafe_publish)
    deadline = time.monotonic() + wait
    store = Store(url, storage_options, allow_unsafe_publish=allow_unsafe_publish)
    check_label(version, "version")
    poll(store.marker, deadline, f"{url}: a dcr store", on_wait)
    poll(lambda: store.version(version), deadline, f"{url}: version {version!r}", on_wait)
    while True:
        seen = _ack_names(store, version)
        try:
            return _commit(url, version, receivers, quorum, storage_options, allow_unsafe_publish, store)
        except NotReadyError:
            if time.monotonic() >= deadline:
                raise
        # Until an acknowledgement appears, one listing per poll (a commit attempt asks several questions).
        what = f"a new acknowledgement of {version!r}"
        poll(functools.partial(_new_acks, store, version, seen), deadline, what, on_wait)
        on_wait = None


def _ack_names(store: Store, version: str) -> set[tuple[str, int, float | None]]:
    return {(e.name, e.size, e.mtime) for e in store.list(f"{ACKS}/{version}")}


def _new_acks(
    store: Store, version: str, seen: set[tuple[str, int, float | None]]
) -> set[tuple[str, int, float | None]] | None:
    return (_ack_names(store, version) - seen) or None


def _check_commit_args(receivers: Sequence[str], quorum: int | None) -> None:
    for name in receivers:
        check_label(name, "receiver")
    if not receivers and quorum is None:
        raise DcrError("name the receivers that must acknowledge (--receiver, repeatable) or set --quorum N")
    if quorum is not None and (quorum < 1 or (receivers and quorum > len(set(receivers)))):
        raise DcrError(f"--quorum {quorum} must be between 1 and the number of named receivers")


def _commit(
    url: str,
    version: str,
    receivers: Sequence[str],
    quorum: int | None,
    storage_options: dict[str, Any] | None,
    allow_unsafe_publish: bool,
    store: Store | None = None,
) -> CommitResult:
    store = store or Store(url, storage_options, allow_unsafe_publish=allow_unsafe_publish)
    store.require_marker()
    store.require_atomic_publish()
    record = store.require_version(version)

    done = store.commit_on(record.base.version)
    if done is not None:
        return _existing(store, record, done)
    head = store.head()
    if record.base.version != head.version:
        raise ConflictError(
            f"version {version!r} is built on {record.base.version!r}, but the committed head is "
            f"{head.version!r}; it can never be committed — diff against {head.version!r} and push again"
        )

    acked = acks(store, record)
    required = sorted(set(receivers))
    if required:
        have = [r for r in required if r in acked]
        need = quorum if quorum is not None else len(required)
        if len(have) < need:
            missing = [r for r in required if r not in acked]
            raise NotReadyError(
                f"version {version!r} is acknowledged by {len(have)} of the {need} required receivers; "
                f"missing: {', '.join(missing)}; nothing was committed — retry once they ran dcr ack"
            )
        counted = have
    else:
        assert quorum is not None
        if len(acked) < quorum:
            raise NotReadyError(
                f"version {version!r} has {len(acked)} acknowledgements, the quorum is {quorum}; "
                "nothing was committed — retry later"
            )
        counted = acked

    commit_record = CommitRecord(
        version=version,
        base=record.base,
        target=record.target,
        acked=tuple(counted),
        required={"receivers": required, "quorum": quorum},
        created=utc_now(),
    )
    try:
        store.create(f"{COMMITS}/{record.base.version}.json", dumps(commit_record.to_json()))
    except FileExistsError:
        done = store.commit_on(record.base.version)
        assert done is not None
        return _existing(store, record, done)
    _write_hint(store, record)
    return CommitResult(url, version, record.base.version, record.target.fingerprint, list(counted), False)


def _existing(store: Store, record: VersionRecord, done: CommitRecord) -> CommitResult:
    if done.version != record.version:
        raise ConflictError(
            f"{record.base.version!r} already has a committed successor, {done.version!r}; version "
            f"{record.version!r} is stale and cannot be committed"
        )
    _write_hint(store, record)
    return CommitResult(
        store.url, record.version, record.base.version, record.target.fingerprint, list(done.acked), True
    )


def _write_hint(store: Store, record: VersionRecord) -> None:
    """latest.json only speeds up finding the head; readers verify it, so a lost write is harmless."""
    store.put(LATEST, dumps({"version": record.version, "fingerprint": record.target.fingerprint}))


# -- status and log ----------------------------------------------------------------------------------------------------


@dataclass
class VersionInfo:
    version: str
    state: str  # committed | pending | stale
    base: str
    fingerprint: str
    created: str
    payload_bytes: int
    manifest_bytes: int
    repair_bytes: int
    full_bytes: int
    changed_elements: int
    total_elements: int
    change_rate: float
    acked: list[str] = field(default_factory=list)
    available: bool = True  # False once dcr gc removed its manifest

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _info(record: VersionRecord, state: str, acked: list[str], available: bool) -> VersionInfo:
    return VersionInfo(
        version=record.version,
        state=state,
        base=record.base.version,
        fingerprint=record.target.fingerprint,
        created=record.created,
        payload_bytes=record.payload_bytes,
        manifest_bytes=record.manifest_bytes,
        repair_bytes=record.repair_bytes,
        full_bytes=record.full_bytes,
        changed_elements=record.changed_elements,
        total_elements=record.total_elements,
        change_rate=record.change_rate,
        acked=acked,
        available=available,
    )


def log(url: str, *, storage_options: dict[str, Any] | None = None) -> list[VersionInfo]:
    """Every published version: the committed chain in order, then pending, then stale ones."""
    store = Store(url, storage_options)
    store.require_marker()
    records = store.versions()
    chain = store.chain()
    head = chain[-1].version if chain else store.genesis().version
    manifests = {e.name for e in store.list(MANIFESTS)}
    committed = [c.version for c in chain]
    out: list[VersionInfo] = []
    for commit_record in chain:
        record = records.get(commit_record.version)
        if record is not None:
            available = f"{record.manifest}.json" in manifests
            out.append(_info(record, "committed", list(commit_record.acked), available))
    rest = sorted((r for r in records.values() if r.version not in committed), key=lambda r: (r.created, r.version))
    for record in rest:
        state = "pending" if record.base.version == head else "stale"
        out.append(_info(record, state, acks(store, record), f"{record.manifest}.json" in manifests))
    return out


def status(url: str, *, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Where the store stands; ``diff_base`` is the state the producer's next dcr diff must start from."""
    store = Store(url, storage_options)
    store.require_marker()
    genesis = store.genesis()
    head = store.head()
    pending = [
        {"version": r.version, "fingerprint": r.target.fingerprint, "created": r.created, "acked": acks(store, r)}
        for r in store.children(head.version)
    ]
    hint = store.latest_hint()
    return {
        "store": url,
        "genesis": genesis.to_json(),
        "head": head.to_json(),
        "diff_base": head.to_json(),
        "committed": head.version != genesis.version,
        "pending": pending,
        "latest_hint": hint,
        "latest_hint_stale": hint is not None and hint != head.version,
    }


def committed_base(url: str, *, storage_options: dict[str, Any] | None = None) -> Ref:
    """The committed head: what the next delta must be diffed against."""
    store = Store(url, storage_options)
    store.require_marker()
    return store.head()
