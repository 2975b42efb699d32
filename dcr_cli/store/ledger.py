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
from ..io.pool import parallel
from .repo import (
    ACKS,
    COMMITS,
    LATEST,
    MANIFESTS,
    MAX_RECORD_BYTES,
    STORE_MAJOR,
    STORE_MINOR,
    STORE_QUESTIONS,
    CommitRecord,
    Listing,
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


def acks(store: Store, record: VersionRecord, listing: Sequence[Listing] | None = None) -> list[str]:
    """Receivers that acknowledged ``record``, sorted. An acknowledgement counts by its object name,
    ``acks/<version>/<receiver>.json``, and only if what it says agrees with that name and with the
    version record (store-v1 §3.3). ``listing``: that directory as just listed (else listed here);
    the acknowledgements are read in parallel, one round trip for all of them."""
    if listing is None:
        listing = store.list(f"{ACKS}/{record.version}")
    # temporary files of an interrupted write and strays are not acknowledgements
    names = sorted({e.name[: -len(".json")] for e in listing if e.name.endswith(".json")} - {""})
    names = [n for n in names if is_label(n)]

    def agrees(receiver: str) -> bool:
        try:
            rel = f"{ACKS}/{record.version}/{receiver}.json"
            obj = parse_record(store.read(rel, limit=MAX_RECORD_BYTES), ACK_KIND, f"{receiver}.json")
        except (FileNotFoundError, DcrError):
            return False  # unreadable acks do not count; the receiver re-acknowledges
        return (obj.get("receiver"), obj.get("version"), obj.get("fingerprint")) == (
            receiver,
            record.version,
            record.target.fingerprint,
        )

    found = parallel((functools.partial(agrees, n) for n in names), min(len(names), STORE_QUESTIONS))
    return [n for n, ok in zip(names, found, strict=True) if ok]


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

    The commit sits on every refit's critical path, often across regions and behind the producer's
    own repair upload on its link, so it asks few questions in sequence: those that do not
    depend on each other go out together, what cannot change is asked once (a version record, and
    that the base is committed: store-v1 keeps both for good), and the create-only write of the
    commit record is itself the check that the base has no successor yet. After the last
    acknowledgement lands: its listing, its read, the commit record, ``latest.json``.
    """
    _check_commit_args(receivers, quorum)
    check_label(version, "version")
    store = Store(url, storage_options, allow_unsafe_publish=allow_unsafe_publish)
    deadline = None if wait is None else time.monotonic() + wait
    if deadline is None:
        store.require_marker()
        store.require_atomic_publish()
        record = store.require_version(version)
    else:
        poll(store.marker, deadline, f"{url}: a dcr store", on_wait)
        store.require_atomic_publish()
        record = poll(lambda: store.version(version), deadline, f"{url}: version {version!r}", on_wait)
    base = record.base.version
    questions: list[Callable[[], Any]] = [
        functools.partial(store.commit_on, base),  # conditions 2 and 3 (store-v1 §4.3) ...
        functools.partial(_is_committed, store, base),
        functools.partial(store.list, f"{ACKS}/{version}"),  # ... and the first look at condition 4
    ]
    answers = parallel(questions, len(questions))
    successor: CommitRecord | None = answers[0]
    base_committed: bool | None = answers[1]
    listing: list[Listing] = answers[2]
    if successor is not None:
        return _existing(store, record, successor)
    if base_committed is None:  # a damaged record on the way: the head, as head() finds it around it
        base_committed = store.head().version == base
    if not base_committed:
        head = store.head().version
        raise ConflictError(
            f"version {version!r} is built on {base!r}, but the committed head is {head!r}; it can never be "
            f"committed — diff against {head!r} and push again"
        )
    # The base is committed and has no successor: it is the head, until a commit record on it appears.
    while True:
        try:
            counted = _counted(record, receivers, quorum, acks(store, record, listing))
            break
        except NotReadyError:
            if deadline is None:
                raise
            successor = store.commit_on(base)  # committed meanwhile (by another producer), or now stale
            if successor is not None:
                return _existing(store, record, successor)
            if time.monotonic() >= deadline:
                raise
        # Until an acknowledgement appears, one listing per poll.
        seen = _ack_names(listing)
        what = f"a new acknowledgement of {version!r}"
        listing = poll(functools.partial(_changed_acks, store, version, seen), deadline, what, on_wait)
        on_wait = None
    commit_record = CommitRecord(
        version=version,
        base=record.base,
        target=record.target,
        acked=tuple(counted),
        required={"receivers": sorted(set(receivers)), "quorum": quorum},
        created=utc_now(),
    )
    try:
        store.create(f"{COMMITS}/{base}.json", dumps(commit_record.to_json()))
    except FileExistsError:
        done = store.commit_on(base)
        assert done is not None
        return _existing(store, record, done)
    _write_hint(store, record)
    return CommitResult(url, version, base, record.target.fingerprint, list(counted), False)


def _is_committed(store: Store, version: str) -> bool | None:
    """Whether ``version`` is the genesis or committed; None where a record on the way is damaged."""
    try:
        return store.is_committed(version)
    except DcrError:
        return None


def _ack_names(listing: Sequence[Listing]) -> set[tuple[str, int, float | None]]:
    return {(e.name, e.size, e.mtime) for e in listing}


def _changed_acks(store: Store, version: str, seen: set[tuple[str, int, float | None]]) -> list[Listing] | None:
    """The acknowledgements' listing, if it shows an object that was not in ``seen``."""
    listing = store.list(f"{ACKS}/{version}")
    return listing if _ack_names(listing) - seen else None


def _check_commit_args(receivers: Sequence[str], quorum: int | None) -> None:
    for name in receivers:
        check_label(name, "receiver")
    if not receivers and quorum is None:
        raise DcrError("name the receivers that must acknowledge (--receiver, repeatable) or set --quorum N")
    if quorum is not None and (quorum < 1 or (receivers and quorum > len(set(receivers)))):
        raise DcrError(f"--quorum {quorum} must be between 1 and the number of named receivers")


def _counted(record: VersionRecord, receivers: Sequence[str], quorum: int | None, acked: list[str]) -> list[str]:
    """The acknowledgements the commit record lists (condition 4), or NotReadyError: too few."""
    version = record.version
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
        return have
    assert quorum is not None
    if len(acked) < quorum:
        raise NotReadyError(
            f"version {version!r} has {len(acked)} acknowledgements, the quorum is {quorum}; "
            "nothing was committed — retry later"
        )
    return acked


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
