"""``dcr gc``: remove what no live version needs.

Live versions are the newest ``keep`` committed versions and every pending
version (published on the committed head). A block survives if any live
manifest lists it. Objects not referenced by a published version may belong
to a push still in progress, so they are removed only once older than a grace
period.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

from ..errors import DcrError
from ..format.manifest import parse_manifest
from .repo import BLOCKS, MANIFESTS, Listing, Store, VersionRecord

DEFAULT_GRACE_S = 3600.0


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


def referenced_blocks(store: Store, records: list[VersionRecord]) -> dict[str, int]:
    """Block id -> size for every block the given versions' manifests list. Unreadable manifests abort."""
    out: dict[str, int] = {}
    for record in records:
        manifest = parse_manifest(store.manifest_bytes(record))
        for block in manifest.blocks:
            out[block.id] = block.size
    return out


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
    needed = referenced_blocks(store, live)
    live_manifests = {f"{r.manifest}.json" for r in live}
    # Keyframes and shortcuts (store-v1.md §6.4): the newest keyframe's shortcuts stay, older ones go.
    from .keyframes import retained

    shortcut_blocks, shortcut_manifests, drop_catchup = retained(store)
    needed.update(shortcut_blocks)
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
    for entry in store.list(BLOCKS):
        if entry.name in needed:
            kept_blocks += 1
            kept_bytes += entry.size
        elif old(entry, BLOCKS):  # includes local .tmp-* leftovers of killed uploads
            removed_blocks += 1
            removed_bytes += entry.size
            if not dry_run:
                store.delete(f"{BLOCKS}/{entry.name}")
        else:
            young += 1
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
