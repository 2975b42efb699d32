"""Moving deltas to and from a store: ``push``, ``pull`` and opening a stored version in place.

Push order is data blocks -> manifest -> version record -> repair blocks, so a
version is visible only once everything a receiver's normal apply reads is on
the store, and the repair blocks (needed only by a receiver torn by a crash, by
``pull --repair`` and by squashing) stay off the producer's critical path; the
record is written create-only, which is what makes publication atomic. Pull verifies every byte
against the manifest digests and only then renames the local directory into
place, so a pulled delta is never half-valid. Pull downloads through the same
fetcher as apply-from-store (delta/prefetch.py: parallel ranged reads, a bounded
window in flight), spooling each block to a temporary file in the partial
directory that gets the block's name once its size and digest are checked. Both resume: what is already
complete (on the store, or in the pull's partial directory) is checked and
kept, the rest is transferred.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
import shutil
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

from .._version import __version__
from ..delta.prefetch import BlockFetcher, MissingBlock
from ..delta.reader import STORE_MANIFESTS, Delta, parse_manifest_once
from ..delta.source import CHUNK_BYTES, BlockSource
from ..errors import ConflictError, DcrError, IncompatibleError, IntegrityError, NotReadyError
from ..format.digest import StreamingDigest, digest_bytes
from ..format.manifest import BLOCKS_DIR, MANIFEST_NAME, BlockEntry, Manifest, parse_manifest
from ..format.store_records import redo_shortcut
from ..io.files import fsync_dir, write_atomic
from ..io.gc_pause import no_collections
from ..io.pool import parallel
from ..io.reading import open_regular
from .announce import EarlyFetch, remove_announcements
from .backends import S3_PART_BYTES, S3_STREAM_HOLD_BYTES
from .repo import (
    BLOCKS,
    CHILDREN,
    COMPLETE,
    MANIFESTS,
    VERSIONS,
    Listing,
    Ref,
    Store,
    StoreBlockSource,
    VersionRecord,
    check_distinct_labels,
    check_label,
    dumps,
    poll,
    record_name,
    utc_now,
)

Progress = Callable[[int], None]  # called with bytes transferred
Total = Callable[[int], None]  # called once, before the transfer, with the bytes it will count
DEFAULT_WORKERS = 8
QUESTIONS_IN_FLIGHT = 48  # questions about blocks (HEADs) a push asks at once, within S3_CONNECTIONS
PUSH_BUDGET_BYTES = 128 << 20  # block bytes a push to an object store holds in memory at once, over all workers
# A present block older than this is written again by push (format_spec/store-v1.md §4.1 step 4). It
# must stay well below dcr gc's grace period (1 h by default) minus the longest push.
REFRESH_S = 15 * 60.0
PULL_STATE = ".dcr-pull.json"
T = TypeVar("T")


class RateLimit:
    """Caps the average transfer rate of all workers together (bytes per second)."""

    def __init__(self, bytes_per_s: float) -> None:
        if bytes_per_s <= 0:
            raise DcrError("--limit-rate must be positive")
        self.rate = float(bytes_per_s)
        self.start = time.monotonic()
        self.sent = 0
        self.lock = threading.Lock()

    def take(self, n: int) -> None:
        with self.lock:
            self.sent += n
            due = self.start + self.sent / self.rate
        delay = due - time.monotonic()
        if delay > 0:
            time.sleep(delay)


class ByteBudget:
    """Bytes held at once by transfers in flight: a transfer waits until its bytes fit, or runs alone.

    Pushing whole blocks on ``workers`` threads would otherwise hold workers x block size (8 x 64 MiB)
    in memory whatever the delta; with a budget, peak memory is the budget plus one block at most.
    """

    def __init__(self, limit: int) -> None:
        self.limit = max(1, limit)
        self.held = 0
        self.cond = threading.Condition()

    @contextlib.contextmanager
    def hold(self, n: int) -> Iterator[None]:
        with self.cond:
            while self.held and self.held + n > self.limit:
                self.cond.wait()
            self.held += n
        try:
            yield
        finally:
            with self.cond:
                self.held -= n
                self.cond.notify_all()


def stat_blocks(store: Store, blocks: list[BlockEntry], workers: int) -> dict[str, Listing | None]:
    """Size and time of each of these blocks on the store (None: absent), asked one by one.

    A push asks only about its own blocks, so its cost follows the delta, not the store.
    """
    # All at once, however many: each is a small request, and a second wave is a round trip more.
    in_flight = max(workers, min(len(blocks), QUESTIONS_IN_FLIGHT))
    found = parallel((functools.partial(store.stat, f"{BLOCKS}/{b.id}") for b in blocks), in_flight)
    return {b.id: entry for b, entry in zip(blocks, found, strict=True)}


# -- push --------------------------------------------------------------------------------------------------------------


@dataclass
class PushResult:
    store: str
    version: str
    base: str
    manifest: str
    blocks: int
    uploaded_blocks: int  # data and repair blocks together
    uploaded_bytes: int
    present_blocks: int
    present_bytes: int
    refreshed_blocks: int  # present but old: written again so that a concurrent gc keeps them
    already_published: bool
    repair_blocks: int = 0  # blocks only repairs use: uploaded after the version is published (store-v1 §4.1)
    repair_uploaded_blocks: int = 0
    repair_uploaded_bytes: int = 0
    published_s: float = 0.0  # from the start of the push until the version was visible (receivers may start)
    repair_s: float = 0.0  # the repair blocks' upload, after publication
    repair_pending: bool = False  # True only in what on_published is given: repair blocks still follow
    manifest_restored: bool = False  # verify_remote: the store's copy of the manifest was damaged, written again

    @property
    def status(self) -> str:
        """What this push did: ``published`` (it created the version record), ``completed`` (the version was
        already published with this delta; it uploaded blocks the store lacked or wrote its damaged manifest
        again) or ``already_published`` (nothing was missing: a no-op)."""
        if not self.already_published:
            return "published"
        return "completed" if self.uploaded_blocks or self.manifest_restored else "already_published"

    def to_json(self) -> dict[str, Any]:
        return {"status": self.status, **asdict(self)}


def version_record(manifest: Manifest, manifest_id: str, manifest_size: int, base: Ref) -> VersionRecord:
    changed = sum(it.changed_elements for it in manifest.items)
    return VersionRecord(
        version=manifest.target.version,
        base=base,
        target=Ref(manifest.target.version, manifest.target.fingerprint),
        manifest=manifest_id,
        manifest_bytes=manifest_size,
        payload_bytes=manifest.payload_bytes(),
        repair_bytes=sum(b.size for b in manifest.blocks if b.role == "repair"),
        full_bytes=sum(t.nbytes for t in manifest.tensors.values()),
        changed_elements=changed,
        total_elements=sum(t.numel for t in manifest.tensors.values()),
        blocks=len({b.id for b in manifest.blocks}),
        created=utc_now(),
        producer=f"dcr {__version__}",
    )


def split_roles(manifest: Manifest) -> tuple[list[BlockEntry], list[BlockEntry]]:
    """The delta's distinct blocks as (what a normal apply reads, what only repairs read).

    A block whose bytes serve as data anywhere in the delta is a data block (content addressing may
    give a data and a repair section the same block)."""
    data_ids = {b.id for b in manifest.blocks if b.role == "data"}
    unique = list({b.id: b for b in manifest.blocks}.values())
    return [b for b in unique if b.id in data_ids], [b for b in unique if b.id not in data_ids]


# A block that vanished after its upload (a gc that decided before the version was published) is
# uploaded again this many times before the push gives up.
REPAIR_ROUNDS = 3


def push(
    delta: str | os.PathLike[str],
    url: str,
    *,
    storage_options: dict[str, Any] | None = None,
    workers: int = DEFAULT_WORKERS,
    progress: Progress | None = None,
    on_total: Total | None = None,
    limit_rate: float | None = None,
    allow_unsafe_publish: bool = False,
    verify_remote: bool = False,
    on_published: Callable[[PushResult], None] | None = None,
    fresh: Mapping[str, int] | None = None,
    store: Store | None = None,
    uploads_done: Callable[[], None] | None = None,
) -> PushResult:
    """Publish the delta at ``delta`` as version ``<its target version>`` on the store at ``url``.

    Only blocks the store lacks are uploaded (``verify_remote`` also downloads
    the blocks already there and replaces any whose digest is wrong). The
    delta's base must be the store's committed head (the genesis for a new
    store): a delta computed against anything else is refused. Pushing a
    version that is already published with this very delta restores any of
    its blocks the store lost, and is otherwise a no-op. ``on_total`` is told
    the bytes ``progress`` will count, before any is sent.

    Order (format_spec/store-v1.md §4.1): data blocks, manifest, version record, then the repair
    blocks (target values that only a receiver torn by a crash, ``pull --repair`` and squashing
    read), so that they stay off the critical path of a refit. ``on_published`` is called the
    moment the version is visible (receivers can fetch and apply it), with the result so far
    (``repair_pending`` True); the call returns only once the repair blocks are uploaded too. A
    push killed after publication is completed by running it again. ``fresh``: id -> size of blocks
    the caller wrote to this store moments ago (``dcr diff --push``'s uploads): they are taken as
    present and young without asking; the check that every data block is there, just before the
    record is written, asks about them as about every other. ``store``: the Store of ``url`` the
    caller has open already (``check_push_base``'s): the records it found are not asked again.
    ``uploads_done``: waits for the caller's uploads still in flight (``dcr diff --push``'s last blocks),
    which fill ``fresh``; called once the first questions are answered (they go out meanwhile) and before
    any block is asked about.
    """
    started = time.monotonic()
    # A delta given as a URL (s3://bucket/delta) is read with the options given for the store: one endpoint.
    source = Delta.open(delta, storage_options=storage_options)
    manifest = source.manifest
    version = check_label(manifest.target.version, "the delta's target version")
    check_distinct_labels(version, manifest.base.version, url)  # before store.init creates a new store's marker
    if store is None or store.url != url:
        store = Store(url, storage_options, allow_unsafe_publish=allow_unsafe_publish)
    store.allow_unsafe_publish = allow_unsafe_publish
    store.require_atomic_publish()
    data_blocks, repair_blocks = split_roles(manifest)
    if on_total is not None:
        on_total(sum(b.size for b in data_blocks + repair_blocks))
    limiter = RateLimit(limit_rate) if limit_rate else None
    uploader = _Uploader(store, source, workers, limiter, progress)

    # The questions that do not depend on each other go out at once, before anything is written: one
    # round trip, not four in sequence, on the producer's critical path (each one across regions).
    base_ref = Ref(manifest.base.version, manifest.base.fingerprint)

    def blocks() -> dict[str, Listing | None]:
        if uploads_done is not None:  # the caller's last blocks: on their way while the other questions go out
            uploads_done()
        return uploader.ask(data_blocks, fresh=None if verify_remote else fresh)

    first: list[Callable[[], Any]] = [
        store.marker,
        functools.partial(_version_and_is_head, store, version, base_ref),
        blocks,
    ]
    _, (existing, is_head), found = parallel(first, len(first))
    genesis = store.init(base_ref)  # asks nothing more where the marker was found
    if version == genesis.version:
        # commits/<genesis>.json would name a version whose own commit record is itself: the chain would loop.
        raise ConflictError(
            f"{url}: {version!r} is the label of the store's genesis state; label this delta differently "
            "(dcr diff --target-version)"
        )
    if existing is not None:  # a re-run: nothing more is asked about the head
        if existing.manifest != source.id:
            raise ConflictError(
                f"{url}: version {version!r} is already published with a different delta (manifest "
                f"{existing.manifest[:16]}…); label this delta differently (dcr diff --target-version)"
            )
        base = existing.base
    else:
        base = base_ref if is_head else store.head()  # a store just created: its genesis
        if manifest.base.fingerprint != base.fingerprint:
            raise _not_the_head(url, manifest.base.version, base)

    # -- data blocks, manifest, record: after these the version is visible
    missing, kept, refreshed = uploader.plan(data_blocks, verify_remote, refresh=existing is None, found=found)
    uploader.upload(missing)
    uploader.upload(refreshed, counted=True)  # progress was counted with the present blocks

    raw = source.raw_manifest()  # IntegrityError if it changed while the blocks went up
    manifest_restored = existing is not None and (
        not store.exists(f"{MANIFESTS}/{source.id}.json") or (verify_remote and _damaged_manifest(store, existing))
    )
    if manifest_restored:
        # Content-addressed: the name says which bytes are right, so a damaged copy is simply written again.
        store.put(f"{MANIFESTS}/{source.id}.json", raw)

    if existing is None:
        # Steps 5 to 7 of §4.1, the record last: the manifest, the check that every data block a receiver
        # reads is there (a concurrent dcr gc could have removed one) and the children index entry
        # depend on nothing but the uploads, so they go out together (one round trip, not three, on
        # the producer's critical path).
        questions: list[Callable[[], Any]] = [
            functools.partial(store.put, f"{MANIFESTS}/{source.id}.json", raw),
            functools.partial(stat_blocks, store, data_blocks, workers),
            functools.partial(store.put, f"{CHILDREN}/{base.version}/{version}", b""),  # the record below decides
        ]
        after = parallel(questions, len(questions))[1]
        lost = [b.id for b in data_blocks if (e := after[b.id]) is None or e.size != b.size]
        if lost:
            raise ConflictError(
                f"{url}: block {lost[0][:16]}… vanished during the push (a concurrent dcr gc?); re-run dcr push"
            )
        record = version_record(manifest, source.id, len(raw), base)
        try:
            store.create(f"{VERSIONS}/{version}.json", dumps(record.to_json()))
        except FileExistsError:
            winner = store.require_version(version)
            if winner.manifest != source.id:
                raise ConflictError(
                    f"{url}: version {version!r} was just published by another producer (manifest "
                    f"{winner.manifest[:16]}…); this push lost the race and published nothing"
                ) from None
            # The same delta, published by a concurrent push of it: that push says "published", not this one.
            existing = winner
    published_s = time.monotonic() - started
    result = PushResult(
        store=url,
        version=version,
        base=base.version,
        manifest=source.id,
        blocks=len(data_blocks) + len(repair_blocks),
        uploaded_blocks=len(missing),
        uploaded_bytes=sum(b.size for b in missing),
        present_blocks=len(kept),
        present_bytes=sum(b.size for b in kept),
        refreshed_blocks=len(refreshed),
        already_published=existing is not None,
        repair_blocks=len(repair_blocks),
        published_s=published_s,
        repair_pending=bool(repair_blocks),
        manifest_restored=manifest_restored,
    )
    if on_published is not None:
        on_published(replace(result))

    # -- repair blocks, after publication. The version's manifest lists them, so a gc that reads the
    # records after this point keeps them (§4.4); an old one that is present is written again, as the
    # data blocks were, for a gc that decided before the record existed; and each is asked about once
    # more after the upload and sent again if such a gc removed it meanwhile.
    try:
        r_kept, r_refreshed, sent = _upload_repairs(store, uploader, repair_blocks, verify_remote, existing is None)
        # Every block is up: from now on a missing repair block of this version is damage, not a pending upload.
        store.put(f"{COMPLETE}/{version}", b"")
    except ConflictError:
        raise
    except (DcrError, OSError) as exc:
        error = DcrError(
            f"{url}: version {version} is published (receivers can apply it), but uploading its repair blocks "
            f"failed ({exc}); re-run dcr push DELTA {url} to finish"
        )
        error.exit_code = getattr(exc, "exit_code", error.exit_code)
        raise error from exc
    with contextlib.suppress(DcrError, OSError):  # hints for receivers that waited: no longer needed (gc: §4.4)
        remove_announcements(store, version)
    result.repair_uploaded_blocks = len(sent)
    result.repair_uploaded_bytes = sum(b.size for b in sent.values())
    result.uploaded_blocks += len(sent)
    result.uploaded_bytes += result.repair_uploaded_bytes
    result.present_blocks += len(r_kept)
    result.present_bytes += sum(b.size for b in r_kept)
    result.refreshed_blocks += len(r_refreshed)
    result.repair_s = time.monotonic() - started - published_s
    result.repair_pending = False
    return result


def _not_the_head(url: str, base: str, head: Ref) -> IncompatibleError:
    return IncompatibleError(
        f"the delta's base ({base}) is not the committed baseline of {url} "
        f"({head.version}); re-run dcr diff against {head.version} (dcr status {url} --json shows it)"
    )


def check_push_base(store: Store, base: Ref, target_version: str) -> None:
    """What ``push`` of a delta from ``base`` to ``target_version`` would refuse for its base, refused
    now (``dcr diff --push``, before the diff and before any block is uploaded): a base that is not
    the store's committed head, unless the version is published already (a re-run: ``push`` then
    compares the deltas themselves). Reads only; a store that does not exist yet takes any base."""
    questions: list[Callable[[], Any]] = [
        store.marker,
        functools.partial(_version_and_is_head, store, target_version, base),
    ]
    marker, (existing, is_head) = parallel(questions, len(questions))
    if marker is None or existing is not None or is_head:
        return
    head = store.head()
    if base.fingerprint != head.fingerprint:
        raise _not_the_head(store.url, base.version, head)


def _version_and_is_head(store: Store, version: str, base: Ref) -> tuple[VersionRecord | None, bool]:
    """The record of ``version`` (None: not published) and whether ``base`` is the committed head under that
    label, asked together (False also where the store has no marker yet)."""
    questions: list[Callable[[], Any]] = [
        functools.partial(store.version, version),
        functools.partial(store.is_head, base),
    ]
    existing, is_head = parallel(questions, len(questions))
    return existing, bool(is_head)


def _upload_repairs(
    store: Store, uploader: _Uploader, repair_blocks: list[BlockEntry], verify_remote: bool, refresh: bool
) -> tuple[list[BlockEntry], list[BlockEntry], dict[str, BlockEntry]]:
    """Upload the repair blocks after publication (§4.1 step 8); (kept, refreshed, sent)."""
    r_missing, r_kept, r_refreshed = uploader.plan(repair_blocks, verify_remote, refresh=refresh)
    uploader.upload(r_missing)
    uploader.upload(r_refreshed, counted=True)
    sent = {b.id: b for b in r_missing}
    for round_ in range(REPAIR_ROUNDS + 1):
        after = stat_blocks(store, repair_blocks, uploader.workers) if repair_blocks else {}
        lost_blocks = [b for b in repair_blocks if (e := after[b.id]) is None or e.size != b.size]
        if not lost_blocks:
            break
        if round_ == REPAIR_ROUNDS:
            raise ConflictError(
                f"{store.url}: repair block {lost_blocks[0].id[:16]}… keeps vanishing after its upload (a "
                "concurrent dcr gc?); the version is published; re-run dcr push to finish uploading its repair blocks"
            )
        uploader.upload(lost_blocks, counted=True)
        sent.update((b.id, b) for b in lost_blocks)
    return r_kept, r_refreshed, sent


class _Uploader:
    """Uploads a push's blocks from the local delta: parallel, rate-limited, within the memory budget."""

    def __init__(
        self, store: Store, source: Delta, workers: int, limiter: RateLimit | None, progress: Progress | None
    ) -> None:
        self.store, self.source, self.workers, self.limiter, self.progress = store, source, workers, limiter, progress
        self.budget = ByteBudget(PUSH_BUDGET_BYTES)
        # Streamed uploads read the delta in parts: memory holds a part being read, one buffered and one sent.
        self.chunk_bytes = S3_PART_BYTES if store.capabilities.streamed_writes else CHUNK_BYTES

    def ask(self, blocks: list[BlockEntry], fresh: Mapping[str, int] | None = None) -> dict[str, Listing | None]:
        """What the store holds of these blocks; those in ``fresh`` (id -> size, just written by the caller)
        count as present and young unasked."""
        known = {b.id for b in blocks if fresh is not None and fresh.get(b.id) == b.size}
        asked = [b for b in blocks if b.id not in known]
        found: dict[str, Listing | None] = stat_blocks(self.store, asked, self.workers)
        now = time.time()
        found.update((b.id, Listing(b.id, b.size, now)) for b in blocks if b.id in known)
        return found

    def plan(
        self,
        blocks: list[BlockEntry],
        verify_remote: bool,
        *,
        refresh: bool,
        found: dict[str, Listing | None] | None = None,
    ) -> tuple[list[BlockEntry], list[BlockEntry], list[BlockEntry]]:
        """(absent or wrong: upload, present: keep, present but old: write again) for these blocks (§4.1 step 4);
        ``found``: what ``ask`` said of them (asked here if not given)."""
        if found is None:
            found = self.ask(blocks)
        now = time.time()  # no earlier than the answers: a block is taken as old no later than it is
        missing = [b for b in blocks if (e := found[b.id]) is None or e.size != b.size]
        if verify_remote:
            missing += _corrupt_on_store(self.store, [b for b in blocks if b not in missing], self.workers)
        missing_ids = {b.id for b in missing}
        kept = [b for b in blocks if b.id not in missing_ids]
        # A block the store holds already may belong to a version a concurrent dcr gc is dropping. Writing
        # it again makes it young, and gc removes a block only while it is older than its grace period
        # (checked afresh just before removing it): so no block this version needs can vanish.
        refreshed = [b for b in kept if _written_before(found[b.id], now - REFRESH_S)] if refresh else []
        if self.progress is not None:
            self.progress(sum(b.size for b in kept))
        return missing, kept, refreshed

    def upload(self, blocks: list[BlockEntry], *, counted: bool = False) -> None:
        """Upload these blocks; ``counted``: their bytes were already counted as present."""
        parallel((functools.partial(self._one, b, counted) for b in blocks), self.workers)

    def _one(self, block: BlockEntry, counted: bool) -> None:
        store, limiter = self.store, self.limiter

        def chunks() -> Iterator[bytes]:
            for chunk in _local_block_chunks(self.source, block, self.chunk_bytes):
                if limiter is not None:
                    limiter.take(len(chunk))
                yield chunk

        if store.capabilities.local_files:  # streamed to a temporary file: one chunk in memory
            store.put_chunks(f"{BLOCKS}/{block.id}", chunks)
        elif store.capabilities.streamed_writes:  # a multipart upload: a chunk and the parts in flight in memory
            with self.budget.hold(min(block.size, S3_STREAM_HOLD_BYTES)):
                store.put_chunks(f"{BLOCKS}/{block.id}", chunks)
        else:
            with self.budget.hold(block.size):  # one PUT of the whole block
                store.put(f"{BLOCKS}/{block.id}", b"".join(chunks()))
        if self.progress is not None and not counted:
            self.progress(block.size)


def _written_before(entry: Listing | None, moment: float) -> bool:
    return entry is not None and entry.mtime is not None and entry.mtime < moment  # gc never removes what has no time


def block_intact(source: BlockSource, block: BlockEntry) -> bool:
    """Whether the block is at the source with its size and digest (read in bounded ranges)."""
    try:
        for _ in source.chunks(block):
            pass
    except (IntegrityError, FileNotFoundError):
        return False
    return True


def _corrupt_on_store(store: Store, blocks: list[BlockEntry], workers: int) -> list[BlockEntry]:
    source = StoreBlockSource(store)
    intact = parallel((functools.partial(block_intact, source, b) for b in blocks), workers)
    return [b for b, ok in zip(blocks, intact, strict=True) if not ok]


def _local_block_chunks(source: Delta, block: BlockEntry, chunk_bytes: int = CHUNK_BYTES) -> Iterator[bytes]:
    """The block's bytes in bounded ranges. A wrong size or digest raises, at the latest when the chunk after
    the last is asked for: a consumer that writes them as they come publishes only once the iterator is
    exhausted (the local store renames its temporary file only then)."""
    try:
        yield from source.source.chunks(block, chunk_bytes)  # bounded by the declared size, digest checked
    except FileNotFoundError:
        raise IntegrityError(f"{source.label}: block {block.id[:16]}… is missing; the delta is incomplete") from None
    except IntegrityError:
        raise IntegrityError(
            f"{source.label}: block {block.id[:16]}… is corrupt; nothing corrupt was published"
        ) from None


# -- repair blocks on the store ----------------------------------------------------------------------------------------


def missing_repair_blocks(store: Store, manifest: Manifest, workers: int = DEFAULT_WORKERS) -> list[BlockEntry]:
    """The blocks only repairs read that the store lacks (or holds with the wrong size), asked one by one."""
    _data, repair = split_roles(manifest)
    found = stat_blocks(store, repair, workers) if repair else {}
    return [b for b in repair if (e := found[b.id]) is None or e.size != b.size]


def require_repair_blocks(
    store: Store,
    record: VersionRecord,
    manifest: Manifest,
    then: str,
    workers: int = DEFAULT_WORKERS,
    *,
    shortcut: bool = False,
) -> None:
    """Refuse (NotReadyError, exit 4) a version whose repair blocks are not all on the store yet.

    A push publishes a version before its repair blocks (store-v1 §4.1), so a version may be visible
    while they are still going up, or lack them for good if that push was stopped after publishing.
    A shortcut's blocks all precede its record (§6.2): one absent is lost (IntegrityError, exit 2).
    """
    missing = missing_repair_blocks(store, manifest, workers)
    if missing and (shortcut or record.minor < 1 or store.exists(f"{COMPLETE}/{record.version}")):
        fix = (
            redo_shortcut(store.url, record.base.version, record.version)
            if shortcut
            else f"restore it with dcr push DELTA {store.url}"
        )
        raise IntegrityError(  # its push (or compact) had uploaded every block: this one was lost since
            f"{store.url}: repair block {missing[0].id[:16]}… of {record_name(record, shortcut)} is missing from "
            f"the store ({len(missing)} such); {fix}, then {then}"
        )
    if missing:
        raise NotReadyError(
            f"{store.url}: {len(missing)} repair block(s) of version {record.version!r} are not on the store yet "
            f"(e.g. {missing[0].id[:16]}…): the producer's dcr push is still uploading them or was stopped after "
            f"publishing; wait for it to finish, or re-run dcr push DELTA {store.url}, then {then}"
        )


# -- choosing a version ------------------------------------------------------------------------------------------------


def tip(store: Store) -> VersionRecord:
    """What a receiver should hold next: the one pending version on the committed head, else the head itself."""
    head = store.head()
    pending = store.children(head.version)
    if len(pending) > 1:
        raise ConflictError(
            f"{store.url}: several versions wait on {head.version}: {', '.join(r.version for r in pending)}; "
            "pass --version"
        )
    if pending:
        return pending[0]
    if head.version == store.genesis().version:
        raise DcrError(f"{store.url}: nothing is published yet")
    return store.require_version(head.version)


def resolve(store: Store, version: str | None) -> VersionRecord:
    return store.require_version(version) if version else tip(store)


# -- pull --------------------------------------------------------------------------------------------------------------


@dataclass
class PullResult:
    store: str
    version: str
    base: str
    target_fingerprint: str
    path: str
    manifest: str
    blocks: int
    downloaded_blocks: int
    downloaded_bytes: int
    reused_blocks: int
    reused_bytes: int
    already_present: bool
    kind: str = "chain"  # "chain": the version's own delta; "shortcut": a squashed delta from base (store-v1 §6.2)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def pull(
    url: str,
    out: str | os.PathLike[str],
    *,
    version: str | None = None,
    storage_options: dict[str, Any] | None = None,
    workers: int = DEFAULT_WORKERS,
    progress: Progress | None = None,
    on_total: Total | None = None,
    limit_rate: float | None = None,
    repair: bool = False,
) -> PullResult:
    """Download a version into the local delta directory ``out``, verifying every byte first.

    ``repair`` also fetches the repair blocks (only needed to repair a receiver torn by a crash).
    ``on_total`` is told the bytes ``progress`` will count, before any is fetched.
    """
    store = Store(url, storage_options)
    store.require_marker()
    record = resolve(store, version)
    if on_total is not None:
        on_total(_transfer_bytes([record], repair))
    limiter = RateLimit(limit_rate) if limit_rate else None
    return _pull_record(store, record, Path(out), workers, progress, limiter, repair)


def _transfer_bytes(records: list[VersionRecord], repair: bool) -> int:
    return sum(r.payload_bytes + (r.repair_bytes if repair else 0) for r in records)


def check_repairs(
    store: Store,
    records: list[VersionRecord],
    workers: int = DEFAULT_WORKERS,
    *,
    shortcuts: Collection[VersionRecord] = (),
) -> None:
    """Every one of these versions (and of ``shortcuts``, those records that are shortcuts') has all its repair
    blocks on the store (checked before a pull writes anything)."""
    for record in records:
        shortcut = record in shortcuts
        manifest = parse_manifest(store.manifest_bytes(record, shortcut=shortcut))
        require_repair_blocks(store, record, manifest, "pull again", workers, shortcut=shortcut)


def _pull_record(
    store: Store,
    record: VersionRecord,
    out: Path,
    workers: int,
    progress: Progress | None,
    limiter: RateLimit | None,
    repair: bool,
    repairs_checked: bool = False,
    *,
    kind: str = "chain",
    replace_other: bool = False,
) -> PullResult:
    """Fetch ``record``'s delta into ``out`` (``kind``: "chain", a version's own; "shortcut", a squashed
    one). An intact copy there is kept; anything else is refused, but for one case with ``replace_other``
    (the shortcut directories a pull --since names itself): a delta directory between the same two states
    (an older shortcut of them, published again) is fetched anew beside it, its blocks reused where their
    digests match, and put in its place only once verified: a failed fetch leaves it as it was. A directory
    that is no such delta, a file, a link, is never replaced (it may be the user's)."""
    shortcut = kind == "shortcut"
    what = record_name(record, shortcut)
    raw = store.manifest_bytes(record, shortcut=shortcut)  # checked against the digest in the version record
    with no_collections():  # see Delta.open
        manifest = parse_manifest(raw)
    if (manifest.target.fingerprint, manifest.base.fingerprint) != (record.target.fingerprint, record.base.fingerprint):
        raise IntegrityError(
            f"{store.url}: manifest of {what} does not match its record; {store.record_fix(record, shortcut)}"
        )
    roles = ("data", "repair") if repair else ("data",)
    wanted = list({b.id: b for b in manifest.blocks if b.role in roles}.values())

    def result(downloaded: list[BlockEntry], reused: list[BlockEntry], already: bool) -> PullResult:
        return PullResult(
            store=store.url,
            version=record.version,
            base=record.base.version,
            target_fingerprint=record.target.fingerprint,
            path=str(out),
            manifest=record.manifest,
            blocks=len(wanted),
            downloaded_blocks=len(downloaded),
            downloaded_bytes=sum(b.size for b in downloaded),
            reused_blocks=len(reused),
            reused_bytes=sum(b.size for b in reused),
            already_present=already,
        )

    def already_pulled() -> PullResult | None:
        if not out.exists():
            return None
        held = out / MANIFEST_NAME
        if held.is_file() and digest_bytes(held.read_bytes()) == record.manifest:
            present = [b for b in wanted if _local_block_ok(out / BLOCKS_DIR / b.id, b)]
            if len(present) == len(wanted):
                if replace_other:  # what a replacement killed after its second rename left
                    _remove(out.parent / f".{out.name}.replaced")
                return result([], present, True)
        if replace_other and _same_states(out, record):
            return None
        raise ConflictError(f"{out} already exists and is not an intact copy of {what}; choose another -o or remove it")

    done = already_pulled()
    if done is not None:
        return done
    if repair and not repairs_checked:  # before anything is written: a pull that cannot finish starts nothing
        require_repair_blocks(store, record, manifest, "pull again", workers, shortcut=shortcut)

    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.parent / f".{out.name}.partial"
    partial.mkdir(exist_ok=True)
    with open(partial / ".lock", "a+b") as lock:
        try:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConflictError(f"another dcr pull is writing {out}; wait for it to finish") from None
        done = already_pulled()  # a concurrent pull may have finished between our check and the lock
        if done is not None:
            return done
        state = partial / PULL_STATE
        if not state.exists() or state.read_bytes() != record.manifest.encode():
            # A partial download of some other version (or a complete one a kill stopped before its rename):
            # its blocks are kept only where this delta lists them and their digests match (checked below),
            # the rest removed once the blocks are in.
            write_atomic(state, record.manifest.encode())
        blocks_dir = partial / BLOCKS_DIR
        blocks_dir.mkdir(exist_ok=True)
        if replace_other and out.is_dir():  # the copy to replace: its blocks that match are not fetched again
            _link_blocks(out / BLOCKS_DIR, blocks_dir, wanted)
        reused = [b for b in wanted if _local_block_ok(blocks_dir / b.id, b)]
        reused_ids = {b.id for b in reused}
        missing = [b for b in wanted if b.id not in reused_ids]
        if progress is not None:
            progress(sum(b.size for b in reused))

        for stray in blocks_dir.iterdir():
            if stray.name.startswith("."):  # .part files of a killed pull
                stray.unlink()
        # One mechanism with apply-from-store (delta/prefetch.py): ranged reads on ``workers`` threads, a
        # bounded window in flight, each block written straight to its temporary file and its digest
        # computed as the bytes arrive; a block gets its name only once its size and digest are checked.
        throttle = limiter.take if limiter is not None else None
        block: BlockEntry | None = None
        try:
            with BlockFetcher(
                StoreBlockSource(store),
                missing,
                workers=workers,
                spool=blocks_dir,
                throttle=throttle,
                progress=progress,
            ) as fetcher:
                for block in missing:
                    fetcher.keep(block.id, blocks_dir / block.id)
        except MissingBlock as exc:
            fix = (
                redo_shortcut(store.url, record.base.version, record.version)
                if shortcut
                else "restore it with dcr push DELTA URL"
            )
            raise IntegrityError(
                f"{store.url}: a block of {what} is missing from the store ({exc}); {fix}, then pull again"
            ) from None
        except IntegrityError:
            which = f"block {block.id[:16]}…" if block is not None else "a block"
            fix = (
                redo_shortcut(store.url, record.base.version, record.version)
                if shortcut
                else "repair it with dcr push DELTA URL --verify-remote"
            )
            raise IntegrityError(
                f"{store.url}: {which} of {what} is corrupt on the store (wrong size or "
                f"digest); nothing was written to the output — {fix}, then pull again"
            ) from None
        for stray in blocks_dir.iterdir():
            if stray.name not in {b.id for b in wanted}:  # includes .part files of a killed pull
                stray.unlink()
        write_atomic(partial / MANIFEST_NAME, raw)
        fsync_dir(blocks_dir)
        state.unlink()
        fsync_dir(partial)
        # Rename while still holding the lock; only then drop the lock file (now inside out, where
        # readers ignore it). Unlinking it first would let a second pull lock a fresh file and
        # clear the blocks under us before the rename.
        if replace_other:
            # Verified and complete: the old copy steps aside, this one takes its name, then the old one goes
            # (as does one a replacement killed between its two renames left).
            old = out.parent / f".{out.name}.replaced"
            _remove(old)
            if out.exists() or out.is_symlink():
                os.rename(out, old)
            os.rename(partial, out)
            fsync_dir(out.parent)
            _remove(old)
        else:
            os.rename(partial, out)
            fsync_dir(out.parent)
        with contextlib.suppress(FileNotFoundError):
            (out / ".lock").unlink()
    return result(missing, reused, False)


def _same_states(out: Path, record: VersionRecord) -> bool:
    """Whether ``out`` is a delta directory (no link) from ``record``'s base state to its target state."""
    held = out / MANIFEST_NAME
    if out.is_symlink() or not out.is_dir() or held.is_symlink() or not held.is_file():
        return False
    try:
        with no_collections():
            other = parse_manifest(held.read_bytes())
    except (DcrError, OSError, ValueError):
        return False
    return (other.base.fingerprint, other.target.fingerprint) == (record.base.fingerprint, record.target.fingerprint)


def _link_blocks(src: Path, dst: Path, wanted: list[BlockEntry]) -> None:
    """Hard-link (or copy) into ``dst`` the blocks of ``wanted`` that ``src`` has (checked after, by digest);
    ``src`` itself is left as it is."""
    for b in wanted:
        held, there = src / b.id, dst / b.id
        if there.exists() or not held.is_file() or held.is_symlink():
            continue
        try:
            os.link(held, there)
        except OSError:
            with contextlib.suppress(OSError):
                shutil.copyfile(held, there)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _local_block_ok(path: Path, block: BlockEntry) -> bool:
    """Whether a block pulled earlier is intact; a damaged one is removed (it is fetched again)."""
    try:
        fd = open_regular(path)
    except FileNotFoundError:
        return False
    except DcrError:
        return False
    try:
        ok = os.fstat(fd).st_size == block.size
        digest = StreamingDigest()
        offset = 0
        while ok and offset < block.size:
            chunk = os.pread(fd, min(16 << 20, block.size - offset), offset)
            if not chunk:
                ok = False
                break
            digest.update(chunk)
            offset += len(chunk)
        ok = ok and digest.hexdigest() == block.id
    finally:
        os.close(fd)
    if not ok:
        path.unlink()
    return ok


# -- reading a version in place ----------------------------------------------------------------------------------------


def open_version(
    url: str,
    version: str | None = None,
    *,
    storage_options: dict[str, Any] | None = None,
    wait: float | None = None,
    on_wait: Callable[[str], None] | None = None,
    early_fetch: bool = False,
    store: Store | None = None,
) -> Delta:
    """Open a stored version as a Delta that reads its blocks straight from the store.

    The manifest is checked against the digest in the version record, every section against the
    manifest. The Delta's location, ``STORE/manifests/<digest>.json``, opens the same delta again
    with ``Delta.open`` (e.g. in a vLLM worker; credentials then come from the environment).
    ``wait``: seconds to wait for the store and ``version`` to be published (a receiver started
    before its producer publishes); NotReadyError (exit 4) if they are not there by then. ``on_wait`` is
    told what it waits for, once, when it starts waiting. ``early_fetch`` (with ``wait``): meanwhile fetch
    the data blocks the version's push announces (store/announce.py), for a receiver that reads every
    block itself; the Delta then reads them from there. ``store``: the Store of ``url`` the caller opened.
    """
    if store is None or store.url != url:
        store = Store(url, storage_options)
    if wait is not None:
        if version is None:
            raise DcrError("--wait needs --version: the version to wait for")
        check_label(version, "version")
        deadline = time.monotonic() + wait
        # Announcements are read from the first question on: a first push creates the store only as it publishes.
        early = EarlyFetch(store, version) if early_fetch else None

        def fetching_meanwhile(probe: Callable[[], T | None]) -> Callable[[], T | None]:
            def run() -> T | None:
                found = probe()
                if found is None and early is not None:
                    early.poll()
                return found

            return run

        try:
            poll(fetching_meanwhile(store.marker), deadline, f"{url}: a dcr store", on_wait)
            published = fetching_meanwhile(lambda: store.version(version))
            record = poll(published, deadline, f"{url}: version {version!r}", on_wait)
            delta = open_record(store, record, f"{url} (version {record.version})")
            if early is not None:
                delta.fetched_early = early.hand_over(delta)
        finally:
            if early is not None:
                early.close()
        return delta
    store.require_marker()
    record = resolve(store, version)
    return open_record(store, record, f"{url} (version {record.version})")


def open_record(store: Store, record: VersionRecord, label: str, *, shortcut: bool = False) -> Delta:
    """The Delta a version record (or, with ``shortcut``, a shortcut's record) describes, reading its blocks
    from ``store``. A torn item whose repair block is absent is refused as not ready (exit 4) while the
    version's push may still upload it, as lost (exit 2) once it is complete (a shortcut always is)."""
    raw = store.manifest_bytes(record, shortcut=shortcut)  # (checked: its digest is the record's)
    manifest = parse_manifest_once(raw, record.manifest)  # (one parse per process, as Delta.open's)
    if (manifest.target.fingerprint, manifest.base.fingerprint) != (record.target.fingerprint, record.base.fingerprint):
        raise IntegrityError(
            f"{store.url}: manifest of {record_name(record, shortcut)} does not match its record; "
            f"{store.record_fix(record, shortcut)}"
        )
    rel = f"{STORE_MANIFESTS}/{record.manifest}.json"
    delta = Delta(
        store.path(rel) if "://" not in store.url else f"{store.url.rstrip('/')}/{rel}",
        manifest,
        record.manifest,
        len(raw),
        StoreBlockSource(store, record, repairs_promised=shortcut),
        label=label,
        manifest_path=store.path(rel),
    )
    delta.keep_manifest_bytes(raw)
    return delta


def _damaged_manifest(store: Store, record: VersionRecord) -> bool:
    """Whether the store's copy of a published version's manifest fails the digest its record names."""
    try:
        store.manifest_bytes(record)
    except IntegrityError:
        return True
    return False


def open_delta(
    location: str,
    version: str | None = None,
    *,
    storage_options: dict[str, Any] | None = None,
    wait: float | None = None,
    on_wait: Callable[[str], None] | None = None,
    early_fetch: bool = False,
) -> Delta:
    """Open a delta given either a delta directory (path or URL) or a store URL (plus an optional version).

    ``wait`` (with a version): the location is a store, maybe not created yet; wait for the version
    (``early_fetch``: as in :func:`open_version`)."""
    store = None if wait is not None else store_at(location, storage_options)
    if wait is not None or store is not None:
        return open_version(
            location,
            version,
            storage_options=storage_options,
            wait=wait,
            on_wait=on_wait,
            early_fetch=early_fetch,
            store=store,
        )
    if version is not None:
        raise DcrError(f"{location} is a delta, not a store: --version does not apply")
    # The same options as the store check above: a delta directory at a URL lives behind the same endpoint.
    return Delta.open(location, storage_options=storage_options)


def is_store(location: str, storage_options: dict[str, Any] | None = None) -> bool:
    return store_at(location, storage_options) is not None


def store_at(location: str, storage_options: dict[str, Any] | None = None) -> Store | None:
    """The store at ``location``, its marker read and kept (so opening a version there asks for it no more:
    one round trip, not a HEAD then a GET), or None where there is no store marker (a delta directory).
    A marker that cannot be read or parsed raises, as opening the store would."""
    store = Store(location, storage_options)
    if store.capabilities.local_files and not os.path.isdir(store.path()):
        return None  # a file (a delta's manifest, say) or nothing: no marker can be under it
    return store if store.marker() is not None else None
