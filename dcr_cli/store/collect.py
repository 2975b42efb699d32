"""``dcr gc``: remove what no live version needs (format_spec/store-v1.md §4.4).

Invariant: every published version that gc has not dropped keeps its manifest and every block
its manifest lists. gc drops, once at its start, the versions that are neither among the newest
``keep`` committed ones nor pending. Everything else follows from the invariant:

* the live set is read again before each batch of deletions, so a version published while gc
  runs (however long it runs) protects its blocks from the next batch on;
* an object no published version references may belong to a push in progress: it is removed only
  once older than the grace period, asked afresh just before removing it (a push refreshes old
  blocks it reuses, and checks that all of its blocks are present before it publishes).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from ..errors import DcrError
from ..format.manifest import parse_manifest
from .repo import BLOCKS, MANIFESTS, VERSIONS, Listing, Store, VersionRecord

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
    """Blocks that versions gc did not drop need, read again on request (new records join it)."""

    def __init__(self, store: Store, dropped: Iterable[VersionRecord]) -> None:
        self.store = store
        self.dropped = {r.version for r in dropped}
        self.read: set[str] = set()  # versions whose manifests are counted
        self.blocks: dict[str, int] = {}

    def refresh(self) -> None:
        """Count every published version not dropped (an unreadable manifest of one aborts gc)."""
        names = [e.name[: -len(".json")] for e in self.store.list(VERSIONS) if e.name.endswith(".json")]
        for name in names:
            if name in self.dropped or name in self.read:
                continue
            record = self.store.version(name)
            if record is None:
                continue
            if not self.store.exists(f"{MANIFESTS}/{record.manifest}.json"):
                self.read.add(name)  # removed by an earlier gc: the version is unavailable, it needs nothing
                continue
            for block in parse_manifest(self.store.manifest_bytes(record)).blocks:
                self.blocks[block.id] = block.size
            self.read.add(name)

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
    needed = LiveSet(store, dropped)
    needed.refresh()
    live_manifests = {f"{r.manifest}.json" for r in live}
    # Keyframes and shortcuts (store-v1.md §6.4): the newest keyframe's shortcuts stay, older ones go.
    from .keyframes import retained

    shortcut_blocks, shortcut_manifests, drop_catchup = retained(store)
    needed.blocks.update(shortcut_blocks)
    live_manifests |= shortcut_manifests
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
    for entry in store.list(MANIFESTS):
        if entry.name in live_manifests:
            continue
        # A dropped version's manifest goes at once; one no version names may be a push in progress.
        if entry.name in published_manifests or old(entry, MANIFESTS):
            removed_manifests += 1
            if not dry_run:
                store.delete(f"{MANIFESTS}/{entry.name}")
        else:
            young += 1
    batch = 0  # deletions since the live set was last read
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
                needed.refresh()  # a version published meanwhile protects its blocks from this batch on
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
    )
