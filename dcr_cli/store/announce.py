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
import os
import re
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..delta.prefetch import BlockFetcher
from ..errors import DcrError
from ..format.manifest import BlockEntry
from ..io import private
from .repo import ANNOUNCED, Store, StoreBlockSource

if TYPE_CHECKING:
    from ..delta.reader import Delta

_NAME = re.compile(r"([0-9a-f]{64})-([1-9][0-9]{0,15})")
# A receiver fetches early at most this many announced blocks, and bytes: a store that announces more
# (a damaged or hostile one) gets the normal fetch for the rest, after the record. The caps are filled in
# listing order; a listing of more names than MAX_BLOCKS turns early fetching off for this wait.
MAX_BLOCKS = 100_000
MAX_BYTES = 64 << 30
LIST_EVERY_S = 0.25  # at least this between two listings of a version's announcements while waiting, and
LIST_SPACING = 4  # at least this many times the last listing's duration (listing is at most ~1/5 of the time)
FETCHERS = 4  # blocks being fetched early at once (each on two threads): a thousand hints start four downloads
SPOOL_KIND = "early"  # the spool's private root: $TMPDIR/dcr-early-<uid> (io/private.py)


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
    names, folders = [], [f"{ANNOUNCED}/{version}"]
    while folders:  # at any depth: whatever else a writer put there goes with the hints (store-v1 §4.4)
        folder = folders.pop()
        names += [f"{folder}/{e.name}" for e in store.list(folder)]
        folders += [f"{folder}/{d}" for d in store.list_dirs(folder)]
    if names:
        store.delete_many(names)
    return len(names)


class EarlyFetch:
    """While a receiver waits for ``version``: fetch the blocks its push announces, as they are announced.

    Blocks are spooled to one private directory (not the process's memory allowance, which the normal fetch
    needs) under this user's ``$TMPDIR/dcr-early-<uid>`` (mode 0700; its lock lets a later early fetch remove
    it if this process is killed), at most FETCHERS at a time; the directory goes with the delta they are
    handed to. The listings run on a thread of their own: the wait for the record, and its deadline, never
    wait for one. Anything that goes wrong here (the store refuses the listing, the spool cannot be made or
    written) turns early fetching off and removes what it spooled; the wait goes on as without it.
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
        self._tried = 0  # downloads started
        self._next_listing = 0.0  # clock time before which no listing starts
        self._listing: _Listing | None = None  # the listing in flight
        self._spool: str | None = None
        self._handed = [False]  # shared with the finalizer, which must not hold self
        self.enabled = self._source.remote  # a local store's blocks are read where they are: nothing to fetch

    def poll(self) -> None:
        """Take the last listing's new announcements, start the next listing when it is due, and start
        fetching announced blocks as fetchers free up. Never raises, never waits for the store."""
        if not self.enabled:
            return
        try:
            self._take_listing()
            if self.enabled:
                self._start()
        except (OSError, RuntimeError):  # no spool (TMPDIR full, not ours), no thread: no early fetch
            self.disable()

    def _take_listing(self) -> None:
        listing = self._listing
        if listing is not None:
            if not listing.done.is_set():
                return
            self._listing = None
            self._next_listing = listing.ended + max(LIST_EVERY_S, LIST_SPACING * (listing.ended - listing.started))
            if listing.failed or len(listing.names) > MAX_BLOCKS:  # refused, or more than early fetching may take
                self.disable()
                return
            for name in listing.names:
                parsed = parse(name)
                if parsed is None or parsed in self._seen:
                    continue
                if len(self._seen) >= MAX_BLOCKS:
                    break
                if self._bytes + parsed[1] > MAX_BYTES:
                    continue  # a smaller one may still fit
                self._seen.add(parsed)
                self._bytes += parsed[1]
                self._queue.append(BlockEntry(parsed[0], parsed[1], "data"))
        if self._clock() >= self._next_listing:
            self._listing = _Listing(self.store, f"{ANNOUNCED}/{self.version}", self._clock)

    def _start(self) -> None:
        running = 0
        for fetcher in list(self._fetchers):
            if not fetcher.settled:
                running += 1
            elif not fetcher.complete:  # a wrong hint: its part file goes now, not at the record
                fetcher.abandon()
                self._fetchers.remove(fetcher)
                if _spool_failed(fetcher):
                    raise OSError("the early spool cannot be written")
        while self._queue and running < FETCHERS:
            if self._spool is None:
                self._spool = private.make_held(private.private_root(SPOOL_KIND), f"{os.getpid()}-")
                weakref.finalize(self, _remove_unless_handed, self._spool, self._handed)
            block = self._queue.pop(0)
            # One fetcher per block: a hint that turns out wrong (absent, another size) costs only its own block.
            self._fetchers.append(BlockFetcher(self._source, [block], workers=2, spool=self._spool))
            self._tried += 1
            running += 1

    @property
    def blocks(self) -> int:
        """Downloads started."""
        return self._tried

    def disable(self) -> None:
        """No more early fetching for this wait: stop the downloads (without waiting for them) and remove the spool."""
        self.enabled = False
        self._drop()

    def hand_over(self, delta: Delta) -> int:
        """Give ``delta`` the early blocks its manifest lists and that arrived intact; drop the rest.

        Waits for the downloads still running (the record appears once every data block is on the
        store, so they are the last of them, on the same link the normal fetch would use). Returns
        how many blocks were handed over; 0 (and the spool removed) if anything of it fails.
        """
        if not self.enabled:
            return 0
        listed = {(b.id, b.size) for b in delta.manifest.blocks}
        kept: list[BlockFetcher] = []
        try:
            for fetcher in self._fetchers:
                (block_id,) = fetcher.ids
                if (block_id, fetcher.entry(block_id).size) not in listed:
                    fetcher.abandon()
                    continue
                try:
                    fetcher.wait_block(block_id)
                except Exception:  # a wrong hint: the normal fetch gets the block (and reports its own errors)
                    fetcher.abandon()
                    continue
                kept.append(fetcher)
        except BaseException:  # an interrupt while waiting: nothing handed over
            self._fetchers.extend(kept)
            self.disable()
            raise
        self._fetchers, self._queue = [], []
        for fetcher in kept:
            delta.adopt_fetcher(fetcher)
        if kept and self._spool is not None:
            self._handed[0] = True  # the spool now holds the delta's blocks: it goes when the delta does
            weakref.finalize(delta, private.remove_own, self._spool)
        return len(kept)

    def close(self) -> None:
        """Stop what was not handed over, without waiting for it; remove the spool unless a delta reads from it.
        A closed early fetch stays off (a later poll starts nothing)."""
        self.enabled = False
        self._drop()

    def _drop(self) -> None:
        for fetcher in self._fetchers:
            with contextlib.suppress(Exception):
                fetcher.abandon()
        self._fetchers, self._queue = [], []
        if self._spool is not None and not self._handed[0]:
            private.remove_own(self._spool)
            self._spool = None


class _Listing:
    """One listing of a version's announcements, on a daemon thread (it holds no EarlyFetch)."""

    def __init__(self, store: Store, rel: str, clock: Callable[[], float]) -> None:
        self.started = self.ended = clock()
        self.names: list[str] = []
        self.failed = False
        self.done = threading.Event()

        def run() -> None:
            try:
                self.names = [e.name for e in store.list(rel)]
            except BaseException:  # a policy, errors after the retries: no early fetch
                self.failed = True
            finally:
                self.ended = clock()
                self.done.set()

        threading.Thread(target=run, name="dcr-announced", daemon=True).start()


def _spool_failed(fetcher: BlockFetcher) -> bool:
    """Whether a failed download failed here (the spool: a full disk, a file removed) rather than at the store."""
    (block_id,) = fetcher.ids
    try:
        fetcher.wait_block(block_id)
    except DcrError:
        return False  # absent, another size, corrupt (IntegrityError, MissingBlock), the store's errors
    except OSError:
        return True
    except Exception:
        return False
    return False


def _remove_unless_handed(path: str, handed: list[bool]) -> None:
    if not handed[0]:
        private.remove_own(path)
