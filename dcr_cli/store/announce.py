"""Announcements: a push in progress names its data blocks so that waiting receivers fetch them early.

A receiver started before its producer publishes (``dcr apply URL --version V --wait S``) would
otherwise start downloading only once the version record appears, and the refit's critical path
would be the upload *then* the download. ``dcr diff --push`` writes ``announced/<V>/<id>-<size>``
(an empty object) right after each data block of ``V`` is on the store; the waiting receiver lists
that directory while it waits and starts fetching each announced block at once, so the download
runs alongside the upload (store-v1 §4.6).

An announcement is a hint, never a publication. Its block is checked against its id (the block's
BLAKE3) and size when it arrives, and used only if the manifest the record names lists it; what
the hint got wrong (a block that is not there, a wrong size, a block of another attempt) is
dropped and fetched as if nothing had been announced. The push that publishes ``V`` removes its
announcements once every block is uploaded; ``dcr gc`` removes the ones a stopped push left.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..delta.prefetch import BlockFetcher
from ..format.manifest import BlockEntry
from .repo import ANNOUNCED, Store, StoreBlockSource

if TYPE_CHECKING:
    from ..delta.reader import Delta

_NAME = re.compile(r"([0-9a-f]{64})-([1-9][0-9]{0,15})")
# A receiver fetches early at most this many announced blocks, and bytes: a store that announces more
# (a damaged or hostile one) gets the normal fetch for the rest, after the record.
MAX_BLOCKS = 100_000
MAX_BYTES = 64 << 30
LIST_EVERY_S = 0.25  # between two listings of a version's announcements while waiting
FETCH_WORKERS = 4


def announcement(version: str, block_id: str, size: int) -> str:
    """The announcement's name, relative to the store root."""
    return f"{ANNOUNCED}/{version}/{block_id}-{size}"


def parse(name: str) -> tuple[str, int] | None:
    """(block id, size) of an announcement's file name; None for anything that is not one."""
    match = _NAME.fullmatch(name)
    return (match.group(1), int(match.group(2))) if match else None


def remove_announcements(store: Store, version: str) -> int:
    """Remove ``version``'s announcements (its push is complete, or was stopped); how many were removed."""
    removed = 0
    for entry in store.list(f"{ANNOUNCED}/{version}"):
        store.delete(f"{ANNOUNCED}/{version}/{entry.name}")
        removed += 1
    return removed


class EarlyFetch:
    """While a receiver waits for ``version``: fetch the blocks its push announces, as they are announced."""

    def __init__(self, store: Store, version: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self.version = version
        self._clock = clock
        self._source = StoreBlockSource(store)
        self._fetchers: list[BlockFetcher] = []
        self._seen: set[str] = set()
        self._bytes = 0
        self._listed_at: float | None = None
        self.enabled = self._source.remote  # a local store's blocks are read where they are: nothing to fetch

    def poll(self) -> None:
        """List the announcements (at most every LIST_EVERY_S) and start fetching the new ones."""
        now = self._clock()
        if not self.enabled or (self._listed_at is not None and now - self._listed_at < LIST_EVERY_S):
            return
        self._listed_at = now
        new: list[BlockEntry] = []
        for entry in self.store.list(f"{ANNOUNCED}/{self.version}"):
            parsed = parse(entry.name)
            if parsed is None or parsed[0] in self._seen:
                continue
            block_id, size = parsed
            if len(self._seen) >= MAX_BLOCKS or self._bytes + size > MAX_BYTES:
                break
            self._seen.add(block_id)
            self._bytes += size
            new.append(BlockEntry(block_id, size, "data"))
        # One fetcher per block: a hint that turns out wrong (absent, another size) costs only its own block.
        self._fetchers += [BlockFetcher(self._source, [b], workers=2) for b in new]

    @property
    def blocks(self) -> int:
        return len(self._fetchers)

    def hand_over(self, delta: Delta) -> int:
        """Give ``delta`` the early blocks its manifest lists and that arrived intact; drop the rest.

        Waits for the downloads still running (the record appears once every data block is on the
        store, so they are the last of them, on the same link the normal fetch would use). Returns
        how many blocks were handed over.
        """
        listed = {b.id: b for b in delta.manifest.blocks}
        handed = 0
        for fetcher in self._fetchers:
            (block_id,) = list(fetcher.ids)
            entry = listed.get(block_id)
            if entry is None or entry.size != fetcher.entry(block_id).size:
                fetcher.close()
                continue
            try:
                fetcher.wait_block(block_id)
            except Exception:  # a wrong hint: the normal fetch gets the block (and reports its own errors)
                fetcher.close()
                continue
            delta.adopt_fetcher(fetcher)
            handed += 1
        self._fetchers = []
        return handed

    def close(self) -> None:
        for fetcher in self._fetchers:
            with contextlib.suppress(Exception):
                fetcher.close()
        self._fetchers = []
