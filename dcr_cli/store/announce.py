"""Announcements: a push in progress names its data blocks so that waiting receivers fetch them early.

A receiver started before its producer publishes (``dcr apply URL --version V --wait S``) would
otherwise start downloading only once the version record appears, and the refit's critical path
would be the upload *then* the download. ``dcr diff --push`` writes ``announced/<V>/<id>-<size>``
(an empty object) right after each data block of ``V`` is on the store; the waiting receiver lists
that directory while it waits and fetches the announced blocks meanwhile, so the download runs
alongside the upload (store-v1 §4.6).

An announcement is a hint, never a publication, and never a reason to fail: a block is checked
against its id (the block's BLAKE3) and size when it arrives, and used only if the manifest the
record names lists it; what a hint got wrong (a block that is not there, a wrong size, a block of
another attempt) is dropped and fetched as if nothing had been announced, and a store that refuses
the announcements (a bucket policy, errors after the retries) gets a refit as before.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import tempfile
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..delta.prefetch import BlockFetcher
from ..errors import DcrError
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
FETCHERS = 4  # blocks being fetched early at once (each on two threads): a thousand hints start four downloads


def announcement(version: str, block_id: str, size: int) -> str:
    """The announcement's name, relative to the store root."""
    return f"{ANNOUNCED}/{version}/{block_id}-{size}"


def parse(name: str) -> tuple[str, int] | None:
    """(block id, size) of an announcement's file name; None for anything that is not one."""
    match = _NAME.fullmatch(name)
    return (match.group(1), int(match.group(2))) if match else None


def announce(store: Store, version: str, block_id: str, size: int) -> None:
    """Announce a data block that is on the store; a store that refuses it only loses the hint."""
    with contextlib.suppress(DcrError, OSError):
        store.put(announcement(version, block_id, size), b"")


def remove_announcements(store: Store, version: str) -> int:
    """Remove ``version``'s announcements (its push is complete, or was stopped), in one bulk request where
    the store has one; how many there were."""
    names = [f"{ANNOUNCED}/{version}/{e.name}" for e in store.list(f"{ANNOUNCED}/{version}")]
    if names:
        store.delete_many(names)
    return len(names)


class EarlyFetch:
    """While a receiver waits for ``version``: fetch the blocks its push announces, as they are announced.

    Blocks are spooled to one private temporary directory (not the process's memory allowance, which the
    normal fetch needs), at most FETCHERS at a time; the directory goes with the delta they are handed to.
    """

    def __init__(self, store: Store, version: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self.version = version
        self._clock = clock
        self._source = StoreBlockSource(store)
        self._fetchers: list[BlockFetcher] = []
        self._queue: list[BlockEntry] = []  # announced, not started yet
        self._seen: set[tuple[str, int]] = set()
        self._bytes = 0
        self._listed_at: float | None = None
        self._spool: str | None = None
        self._handed = False
        self.enabled = self._source.remote  # a local store's blocks are read where they are: nothing to fetch

    def poll(self) -> None:
        """Start fetching announced blocks as fetchers free up; list the announcements at most every
        LIST_EVERY_S. A store that cannot list them (a policy, errors after the retries) turns this off."""
        if not self.enabled:
            return
        now = self._clock()
        if self._listed_at is None or now - self._listed_at >= LIST_EVERY_S:
            self._listed_at = now
            try:
                listed = self.store.list(f"{ANNOUNCED}/{self.version}")
            except (DcrError, OSError):
                self.enabled = False
                return
            for entry in listed:
                parsed = parse(entry.name)
                if parsed is None or parsed in self._seen:
                    continue
                if len(self._seen) >= MAX_BLOCKS:
                    break
                if self._bytes + parsed[1] > MAX_BYTES:
                    continue  # a smaller one may still fit
                self._seen.add(parsed)
                self._bytes += parsed[1]
                self._queue.append(BlockEntry(parsed[0], parsed[1], "data"))
        running = sum(not f.settled for f in self._fetchers)
        while self._queue and running < FETCHERS:
            if self._spool is None:
                self._spool = tempfile.mkdtemp(prefix="dcr-early-")
                weakref.finalize(self, _remove_unless_handed, self._spool, lambda: self._handed)
            block = self._queue.pop(0)
            # One fetcher per block: a hint that turns out wrong (absent, another size) costs only its own block.
            self._fetchers.append(BlockFetcher(self._source, [block], workers=2, spool=self._spool))
            running += 1

    @property
    def blocks(self) -> int:
        return len(self._fetchers)

    def hand_over(self, delta: Delta) -> int:
        """Give ``delta`` the early blocks its manifest lists and that arrived intact; drop the rest.

        Waits for the downloads still running (the record appears once every data block is on the
        store, so they are the last of them, on the same link the normal fetch would use). Returns
        how many blocks were handed over.
        """
        listed = {(b.id, b.size) for b in delta.manifest.blocks}
        handed = 0
        for fetcher in self._fetchers:
            (block_id,) = fetcher.ids
            if (block_id, fetcher.entry(block_id).size) not in listed:
                fetcher.close()
                continue
            try:
                fetcher.wait_block(block_id)
            except Exception:  # a wrong hint: the normal fetch gets the block (and reports its own errors)
                fetcher.close()
                continue
            delta.adopt_fetcher(fetcher)
            handed += 1
        self._fetchers, self._queue = [], []
        if handed and self._spool is not None:
            self._handed = True  # the spool now holds the delta's blocks: it goes when the delta does
            weakref.finalize(delta, shutil.rmtree, self._spool, True)
        return handed

    def close(self) -> None:
        """Stop what was not handed over; remove the spool unless a delta reads from it."""
        for fetcher in self._fetchers:
            with contextlib.suppress(Exception):
                fetcher.close()
        self._fetchers, self._queue = [], []
        if self._spool is not None and not self._handed:
            shutil.rmtree(self._spool, ignore_errors=True)


def _remove_unless_handed(path: str, handed: Callable[[], bool]) -> None:
    if not handed():
        shutil.rmtree(path, ignore_errors=True)
