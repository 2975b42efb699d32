"""``dcr gc``: remove what no live version needs (format_spec/store-v1.md §4.4).

Invariant: every published version that gc has not dropped keeps its manifest and every block
its manifest lists. gc drops, once at its start, the versions that are neither among the newest
``keep`` committed ones nor pending. Everything else follows from the invariant:

* the live set is read again before each batch of deletions, so a version (or a shortcut, store-v1
  §6.4) published while gc runs (however long it runs) protects its blocks and manifest from the next
  batch on;
* an object no published version references may belong to a push in progress: it is removed only
  once older than the grace period, asked afresh just before removing it (a push refreshes old
  blocks it reuses, and checks that all of its blocks are present before it publishes).

A shortcut is derived data (``dcr compact`` rebuilds it): one whose manifest is missing, or whose
manifest's bytes are not the ones its record names, is unusable, and gc drops its record instead of
stopping (its blocks then go like any unreferenced object). Anything that might succeed when asked
again (a transient error, a client error) stops gc as before; a version's damaged manifest always does.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from ..errors import DcrError, IntegrityError
from ..format.manifest import parse_manifest
from .backends import TMP_PREFIX
from .repo import ANNOUNCED, BLOCKS, MANIFESTS, VERSIONS, Listing, Store, VersionRecord, is_label

DEFAULT_GRACE_S = 3600.0
BATCH = 256  # deletions between two reads of the live set


@dataclass
class GcResult:
    store: str
    live_versions: list[str]
    dropped_versions: list[str]
    removed_manifests: int
    removed_blocks: int
    removed_bytes: int
    kept_blocks: int
    kept_bytes: int
    young_unreferenced: int  # unreferenced but within the grace period (maybe a push in progress)
    dry_run: bool
    removed_keyframe_files: int = 0  # objects under keyframes/<v>/ no record names (a publish stopped half-way)
    removed_announcements: int = 0  # hints under announced/<v>/: of published versions, or older than the grace
    # Shortcut records dropped because their manifest is missing or corrupt (store-v1 §6.4): "base..target" -> why.
    dropped_shortcuts: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def live_versions(store: Store, keep: int) -> tuple[list[VersionRecord], list[VersionRecord]]:
    """(live, dropped) version records."""
    if keep < 1:
        raise DcrError("--keep must be at least 1: the committed head is always kept")
    records = store.versions()
    chain = [c.version for c in store.chain()]
    head = chain[-1] if chain else store.genesis().version
    keep_names = set(chain[-keep:])
    keep_names.update(r.version for r in records.values() if r.base.version == head and r.version not in chain)
    live = [r for r in records.values() if r.version in keep_names]
    dropped = [r for r in records.values() if r.version not in keep_names]
    return live, dropped


class LiveSet:
    """Blocks and manifests that versions gc did not drop need, and those of shortcuts gc did not drop
    (store-v1 §6.4), read again on request: records published since gc started join it.

    A shortcut whose manifest is unusable (missing, or not the bytes its record names) is not counted;
    once a whole refresh has been read, ``drop_record`` (None: a dry run) is given each such record's
    object name, and ``unusable`` says why, by "base..target"."""

    def __init__(
        self,
        store: Store,
        dropped: Iterable[VersionRecord],
        dropped_shortcuts: Iterable[str] = (),
        drop_record: Callable[[str], None] | None = None,
    ) -> None:
        self.store = store
        self.dropped = {r.version for r in dropped}
        self.dropped_shortcuts = set(dropped_shortcuts)  # object names of shortcut records gc removes
        self.drop_record = drop_record
        self.read: set[str] = set()  # versions whose manifests are counted
        self.read_shortcuts: set[str] = set()  # shortcut records whose manifests are counted
        self.blocks: dict[str, int] = {}
        self.manifests: set[str] = set()  # file names under manifests/
        self.unusable: dict[str, str] = {}  # "base..target" -> why its shortcut record is dropped
        self.unusable_manifests: set[str] = set()  # their manifests' file names

    def refresh(self) -> None:
        """Count every published version not dropped and every usable shortcut not dropped (a version's
        unreadable manifest aborts gc, as does any error that asking again might not meet)."""
        names = [e.name[: -len(".json")] for e in self.store.list(VERSIONS) if e.name.endswith(".json")]
        for name in names:
            if name in self.dropped or name in self.read:
                continue
            record = self.store.version(name)
            if record is None:
                continue
            self._count(record)
            self.read.add(name)
        self._refresh_shortcuts()

    def _refresh_shortcuts(self) -> None:
        """A ``dcr compact`` running beside gc publishes its shortcut after uploading its blocks and
        manifest: the shortcut records are read again with the versions' (store-v1 §6.4)."""
        from .keyframes import SHORTCUTS, DamagedShortcut, read_shortcut, shortcut_label

        unusable: list[str] = []
        for base in self.store.list_dirs(SHORTCUTS):
            if not is_label(base):
                continue
            for entry in self.store.list(f"{SHORTCUTS}/{base}"):
                rel = f"{SHORTCUTS}/{base}/{entry.name}"
                if not entry.name.endswith(".json") or rel in self.dropped_shortcuts or rel in self.read_shortcuts:
                    continue
                if entry.name.startswith(TMP_PREFIX):  # a local store's record being written (create-only)
                    continue
                try:
                    shortcut = read_shortcut(self.store, rel)
                except DamagedShortcut as exc:  # read whole, and no shortcut record: asking again changes nothing
                    unusable.append(rel)
                    self.unusable[shortcut_label(rel)] = f"its record is damaged ({exc})"
                    continue
                if shortcut is None:
                    continue
                record = shortcut.record
                why = self._count_shortcut(record)
                if why is None:
                    self.read_shortcuts.add(rel)
                    continue
                # Not remembered as handled: a dcr compact may publish this shortcut again, sound, while gc runs.
                unusable.append(rel)
                self.unusable[f"{record.base.version}..{record.version}"] = why
                self.unusable_manifests.add(f"{record.manifest}.json")
        # Only once every record has been read: an error above stops gc before it removes anything.
        if self.drop_record is not None:
            for rel in unusable:
                self.drop_record(rel)

    def _count(self, record: VersionRecord) -> None:
        manifest = f"{record.manifest}.json"
        self.manifests.add(manifest)  # even if absent now: one written later (a re-run) must stay
        if not self.store.exists(f"{MANIFESTS}/{manifest}"):
            return  # removed by an earlier gc: unavailable, it needs nothing
        for block in parse_manifest(self.store.manifest_bytes(record)).blocks:
            self.blocks[block.id] = block.size

    def _count_shortcut(self, record: VersionRecord) -> str | None:
        """Count a shortcut's manifest and blocks; or why it is unusable (None: counted).

        Only an answer that asking again cannot change makes it unusable: the manifest is absent (a
        shortcut's manifest is written before its record, so it is lost, not still to come), or its
        bytes do not have the digest the record names (corrupt or truncated: ``manifest_bytes`` raises
        IntegrityError for exactly that). Any other error propagates and stops gc."""
        manifest = f"{record.manifest}.json"
        if not self.store.exists(f"{MANIFESTS}/{manifest}"):
            return "its manifest is missing"
        try:
            raw = self.store.manifest_bytes(record, shortcut=True)
        except IntegrityError:
            return "its manifest is corrupt: its bytes do not have the digest its record names"
        self.manifests.add(manifest)
        for block in parse_manifest(raw).blocks:
            self.blocks[block.id] = block.size
        return None

    def needs(self, block_id: str) -> bool:
        return block_id in self.blocks


def gc(
    url: str,
    *,
    keep: int,
    grace_s: float = DEFAULT_GRACE_S,
    dry_run: bool = False,
    storage_options: dict[str, Any] | None = None,
) -> GcResult:
    store = Store(url, storage_options)
    store.require_marker()
    live, dropped = live_versions(store, keep)
    # Keyframes and shortcuts (store-v1.md §6.4): the newest keyframe's shortcuts stay, older ones go;
    # decided once, here, as the dropped versions are. Every other shortcut, published since included,
    # is counted by the live set whenever it is read.
    from .keyframes import KEYFRAME_KIND, KEYFRAMES, SHORTCUTS, KeyframeRecord, retained

    shortcut_blocks, shortcut_manifests, drop_catchup = retained(store)
    drop_shortcuts = (rel for rel in drop_catchup if rel.startswith(f"{SHORTCUTS}/"))
    needed = LiveSet(store, dropped, drop_shortcuts, drop_record=None if dry_run else store.delete)
    needed.refresh()
    # A dropped shortcut's manifest (retained() names the newest keyframe's, unread) is then unreferenced.
    shortcut_manifests -= needed.unusable_manifests
    needed.blocks.update(shortcut_blocks)
    needed.manifests |= shortcut_manifests
    live_manifests = {f"{r.manifest}.json" for r in live} | shortcut_manifests
    now = time.time()

    def old(entry: Listing, rel_dir: str) -> bool:
        if grace_s <= 0:
            return True
        if entry.mtime is None or now - entry.mtime < grace_s:
            return False
        # The listing may be stale by now: a push reusing this object writes it again (store-v1.md §4.4).
        modified = store.modified(f"{rel_dir}/{entry.name}")
        return modified is not None and time.time() - modified >= grace_s

    published_manifests = {f"{r.manifest}.json" for r in dropped}
    removed_manifests = removed_blocks = removed_bytes = kept_blocks = kept_bytes = young = 0
    batch = 0  # deletions since the live set was last read
    for entry in store.list(MANIFESTS):
        if entry.name in live_manifests or entry.name in needed.manifests:
            continue
        # A dropped version's manifest goes at once; one no version names may be a push in progress.
        if entry.name in published_manifests or old(entry, MANIFESTS):
            if not dry_run:
                if batch == 0:
                    needed.refresh()  # a version or shortcut published meanwhile keeps its manifest
                if entry.name in needed.manifests:
                    continue
                store.delete(f"{MANIFESTS}/{entry.name}")
                batch = (batch + 1) % BATCH
            removed_manifests += 1
        else:
            young += 1
    batch = 0
    for entry in store.list(BLOCKS):
        if needed.needs(entry.name):
            kept_blocks += 1
            kept_bytes += entry.size
            continue
        if not old(entry, BLOCKS):  # includes local .tmp-* leftovers of killed uploads once old
            young += 1
            continue
        if not dry_run:
            if batch == 0:
                needed.refresh()  # a version or shortcut published meanwhile protects its blocks from here on
            if needed.needs(entry.name):
                kept_blocks += 1
                kept_bytes += entry.size
                continue
            store.delete(f"{BLOCKS}/{entry.name}")
            batch = (batch + 1) % BATCH
        removed_blocks += 1
        removed_bytes += entry.size
    if not dry_run:
        for rel in drop_catchup:
            store.delete(rel)
    # Keyframe files no record names (a publish stopped before its record; store-v1 §6.4): removed once older
    # than the grace period, the version's record read again just before (a publish may have finished).
    removed_frames = 0
    for version in store.list_dirs(KEYFRAMES) if not dry_run else []:
        if not is_label(version):
            continue
        folder = f"{KEYFRAMES}/{version}"
        stale = [e for e in store.list(folder) if old(e, folder)]
        if not stale:
            continue
        obj = store.read_record(f"{KEYFRAMES}/{version}.json", KEYFRAME_KIND)
        named = {f.stored for f in KeyframeRecord.from_json(obj, folder).files} if obj is not None else set()
        for e in stale:
            if e.name not in named:
                store.delete(f"{folder}/{e.name}")
                removed_frames += 1
    # Announcements (store-v1 §4.6) are hints for receivers waiting for a push in progress: a published
    # version's are spent (its push removes them when it completes), the rest go once older than the grace.
    # Everything under announced/<v>/ counts, at any depth (a name that is no announcement is no less junk).
    removed_announcements = 0
    for version in store.list_dirs(ANNOUNCED) if not dry_run else []:
        top = f"{ANNOUNCED}/{version}"
        published = is_label(version) and store.version(version) is not None
        folders = [top]
        while folders:
            folder = folders.pop()
            for e in store.list(folder):
                if published or old(e, folder):
                    store.delete(f"{folder}/{e.name}")
                    removed_announcements += 1
            folders.extend(f"{folder}/{d}" for d in store.list_dirs(folder))
    return GcResult(
        store=url,
        live_versions=sorted(r.version for r in live),
        dropped_versions=sorted(r.version for r in dropped),
        removed_manifests=removed_manifests,
        removed_blocks=removed_blocks,
        removed_bytes=removed_bytes,
        kept_blocks=kept_blocks,
        kept_bytes=kept_bytes,
        young_unreferenced=young,
        dry_run=dry_run,
        removed_keyframe_files=removed_frames,
        removed_announcements=removed_announcements,
        dropped_shortcuts=dict(needed.unusable),
    )
