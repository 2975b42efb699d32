"""Sending a delta while it is being built: blocks go to the store as soon as they are written.

``dcr diff --push URL`` hands every finished block to a BlockUploader, so uploads of early blocks
overlap the diff of later tensors. When the diff is done, an ordinary ``push`` publishes the
version: it finds the blocks already there and uploads only the manifest and the record, so all of
its guarantees (base check, create-only publication, resume after a kill) stay as they are.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from .repo import BLOCKS, Store


class BlockUploader:
    """Uploads blocks in the background; at most ``2 x workers`` blocks wait in memory (backpressure)."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None, *, workers: int = 4) -> None:
        self.store = Store(url, storage_options)
        self.store.require_atomic_publish()  # fail before the diff, not after it
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="dcr-upload")
        self._slots = threading.BoundedSemaphore(2 * workers)
        self._futures: list[Future[None]] = []
        self.uploaded_blocks = 0
        self.uploaded_bytes = 0
        self._count_lock = threading.Lock()

    def __call__(self, block_id: str, data: bytes) -> None:
        self._slots.acquire()
        self._futures.append(self._pool.submit(self._upload, block_id, data))

    def _upload(self, block_id: str, data: bytes) -> None:
        try:
            present = self.store.stat(f"{BLOCKS}/{block_id}")  # one question per block: cost follows the delta
            if present is not None and present.size == len(data):
                return  # the push that publishes refreshes it if it is old
            self.store.put(f"{BLOCKS}/{block_id}", data)
            with self._count_lock:
                self.uploaded_blocks += 1
                self.uploaded_bytes += len(data)
        finally:
            self._slots.release()

    def wait(self) -> None:
        """Wait for every upload; raise the first failure (the push that follows would retry it anyway)."""
        try:
            for future in self._futures:
                future.result()
        finally:
            self._pool.shutdown(wait=True)
