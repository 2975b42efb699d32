"""Sending a delta while it is being built: blocks go to the store as soon as they are written.

``dcr diff --push URL`` hands every finished block to a BlockUploader, so uploads of early blocks
overlap the diff of later tensors. Only data blocks: repair blocks (``roles``; the delta writer
honours it) stay on local disk until the version is published. When the diff is done, an ordinary
``push`` publishes the version: it finds the data blocks already there, uploads the manifest and the
record, then the repair blocks (store-v1 §4.1), so all of its guarantees (base check, create-only
publication, resume after a kill) stay as they are. It is told which blocks this uploader has just
written (``uploaded``), so it does not ask the store about them again before the manifest; it still
checks every data block is there just before it writes the record.

With ``announce`` (the version's label), each data block is announced once it is on the store
(``announced/<version>/<id>-<size>``, store-v1 §4.6): a receiver waiting for the version starts
downloading it then, while the diff and the upload go on.

Across regions every question asked in sequence is a round trip on the refit's critical path, and the
last block's are on it whole. So a block is sent without asking first whether the store has it: a block
is its content's BLAKE3, new with every delta, and the answer was almost always "no". A remote store is
asked once, before the first block, which blocks an earlier attempt of the same version announced
(announcements are written only once a block is up, and removed when its push completes): those are not
sent again, and the push asks about them with its first questions, which go out together. A local
store is asked per block: a stat there costs microseconds and saves rewriting the file. The
announcements go out on their own threads: the push waits for the blocks (``wait_uploads``), not for
their hints, which it waits for (``close``) once the version is published, before it removes them.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from .announce import announce, parse
from .repo import ANNOUNCED, BLOCKS, Store, check_label
from .transfer import PUSH_BUDGET_BYTES


class BlockUploader:
    """Uploads blocks in the background; the diff waits (backpressure) while the blocks handed over and
    not yet uploaded hold ``budget`` bytes, so memory does not grow with workers x block size."""

    roles = ("data",)  # what the delta writer hands over: repair blocks follow the publication instead

    def __init__(
        self,
        url: str,
        storage_options: dict[str, Any] | None = None,
        *,
        workers: int = 4,
        budget: int = PUSH_BUDGET_BYTES,
        announce: str | None = None,
    ) -> None:
        self.store = Store(url, storage_options)
        if announce is not None:
            check_label(announce, "the delta's target version")
        # A local store's receivers read its blocks where they are: nothing to fetch early, nothing to announce.
        self.announce = None if self.store.capabilities.local_files else announce
        self.store.require_atomic_publish()  # fail before the diff, not after it
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="dcr-upload")
        # As many as the uploads: a hint waiting behind others holds back a waiting receiver's early fetch.
        self._hints = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="dcr-announce")
        self._slots = 2 * workers  # blocks waiting, at most
        self._budget = budget
        self._held = 0  # bytes of the blocks waiting
        self._waiting = 0
        self._cond = threading.Condition()
        self._futures: list[Future[None]] = []
        self.uploaded_blocks = 0
        self.uploaded_bytes = 0
        self.uploaded: dict[str, int] = {}  # id -> size of each block this uploader wrote (push(fresh=...))
        self._count_lock = threading.Lock()
        # The store client's first request sets up its session and connection (tenths of a second): ask it
        # now, while the diff builds the first block, not when that block is ready to go.
        self._earlier = self._pool.submit(self._connect)

    def _connect(self) -> set[tuple[str, int]]:
        """Warm the client up; the (id, size) of the blocks an earlier attempt of this version announced."""
        with contextlib.suppress(Exception):  # only a warm-up: the uploads ask again and report their own errors
            self.store.marker()
        if self.announce is None:
            return set()
        try:  # a hint: anything wrong with it costs a block sent again, or asked about by the push
            names = [e.name for e in self.store.list(f"{ANNOUNCED}/{self.announce}")]
        except Exception:
            return set()
        return {hint for name in names if (hint := parse(name)) is not None}

    def __call__(self, block_id: str, data: bytes) -> None:
        with self._cond:
            while self._waiting and (self._waiting >= self._slots or self._held + len(data) > self._budget):
                self._cond.wait()
            self._waiting += 1
            self._held += len(data)
        self._futures.append(self._pool.submit(self._upload, block_id, data))

    def _upload(self, block_id: str, data: bytes) -> None:
        try:
            if (block_id, len(data)) in self._earlier.result():
                return  # up since an earlier attempt: the push asks about it (and sends it if it is gone)
            if self.store.capabilities.local_files:
                present = self.store.stat(f"{BLOCKS}/{block_id}")
                if present is not None and present.size == len(data):
                    return  # the push that publishes refreshes it if old
            self.store.put(f"{BLOCKS}/{block_id}", data)
            with self._count_lock:
                self.uploaded_blocks += 1
                self.uploaded_bytes += len(data)
                self.uploaded[block_id] = len(data)
            if self.announce is not None:  # only once the block is there: a receiver may fetch it at once
                self._hints.submit(announce, self.store, self.announce, block_id, len(data))
        finally:
            with self._cond:
                self._waiting -= 1
                self._held -= len(data)
                self._cond.notify_all()

    def wait_uploads(self) -> None:
        """Wait for every block's upload (not its announcement); raise the first failure (``dcr diff --push``
        gives this to its push as ``uploads_done``: the failure stops the push before it writes anything)."""
        try:
            for future in self._futures:
                future.result()
        finally:
            self._pool.shutdown(wait=True)

    def wait(self) -> None:
        """Wait for every upload and announcement; raise the first upload failure."""
        try:
            self.wait_uploads()
        finally:
            self.close()

    def close(self) -> None:
        """Wait for whatever is still running, announcements included; raise nothing (announce() never
        raises: a refused hint only loses the hint, and an upload's failure is ``wait_uploads``' to raise)."""
        self._pool.shutdown(wait=True)
        self._hints.shutdown(wait=True)


class DeferredUploader:
    """The ``on_block`` of a diff whose uploader is still being set up (``dcr diff --push`` makes the
    store's client on a thread while the scan starts): each block waits for ``get()``, the uploader."""

    roles = BlockUploader.roles

    def __init__(self, get: Callable[[], BlockUploader]) -> None:
        self._get = get

    def __call__(self, block_id: str, data: bytes) -> None:
        self._get()(block_id, data)
