"""Where a delta's blocks come from: a block source reads byte ranges of content-addressed blocks.

A delta directory (format_spec/delta-v1.md §3) and a dcr store (format_spec/store-v1.md §1) keep
blocks the same way, as ``<root>/blocks/<id>``. The plain source below reads them through any
fsspec filesystem (local files with pread, refusing anything that is not a plain file); the store
gives its own source, which adds its retries and error wrapping (``dcr_cli/store/repo.py``).

Reads are bounded by what the manifest declares: a block is fetched in ranges up to its declared
size plus one byte, so an object larger than declared is refused after reading at most that much,
and its digest is computed as the ranges arrive.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TypeVar

import fsspec
from fsspec.implementations.local import LocalFileSystem

from ..errors import DcrError, IntegrityError
from ..format.digest import StreamingDigest
from ..format.manifest import BLOCKS_DIR, BlockEntry
from ..io.reading import RegularFiles

T = TypeVar("T")
CHUNK_BYTES = 16 << 20  # one ranged read while a whole block is verified


class BlockSource:
    """Blocks under ``<root>/blocks/`` of an fsspec filesystem."""

    # What a receiver is told to do when a torn item needs a repair block this source does not have.
    missing_repair_advice = "fetch the delta with its repair blocks and re-run"

    def __init__(self, fs: fsspec.AbstractFileSystem, root: str, *, label: str | None = None) -> None:
        self.fs = fs
        self.root = root.rstrip("/") or root
        self.label = label or root
        self.local = isinstance(fs, LocalFileSystem)
        self._files = RegularFiles()  # local block files stay open across the many small section reads

    def path(self, block: BlockEntry) -> str:
        return f"{self.root}/{BLOCKS_DIR}/{block.id}"

    def missing_repair(self, what: str) -> DcrError:
        """The error for a torn item whose repair block this source lacks (``what``: the item and that fact).

        A delta directory either has its repair blocks or was fetched without them: bad input (exit 2).
        A store's source tells a repair upload still to come (exit 4) from a lost block (store-v1 §4.1)."""
        return IntegrityError(f"{what}; {self.missing_repair_advice}")

    def call(self, fn: Callable[[], T], what: str) -> T:
        """Run one read; a store's source retries transient errors here."""
        return fn()

    def read(self, block: BlockEntry, start: int, end: int) -> bytes:
        """Bytes ``start:end`` of a block (fewer if the object is shorter); FileNotFoundError if absent."""
        path = self.path(block)
        if self.local:
            return self.call(lambda: self._files.read(path, start, end), f"read {path}")
        return self.call(lambda: bytes(self.fs.cat_file(path, start=start, end=end)), f"read {path}")

    def exists(self, block: BlockEntry) -> bool:
        path = self.path(block)
        return bool(self.call(lambda: self.fs.exists(path), f"check {path}"))

    @property
    def remote(self) -> bool:
        """Whether reading a block costs a transfer (then a verified block is worth keeping)."""
        return not self.local

    def chunks(self, block: BlockEntry, chunk_bytes: int = CHUNK_BYTES) -> Iterator[bytes]:
        """The whole block in ranges, checked against its declared size and its id as they arrive.

        Reads at most the declared size plus one byte. The block is valid only once the iterator is
        exhausted: it raises IntegrityError (or FileNotFoundError) instead of finishing otherwise.
        """
        digest = StreamingDigest()
        for lo in range(0, max(block.size, 1), chunk_bytes):
            hi = min(lo + chunk_bytes, block.size)
            last = hi == block.size
            data = self.read(block, lo, hi + 1 if last else hi)  # one byte more: is the object longer?
            if len(data) > hi - lo:
                raise IntegrityError(
                    f"block {block.id[:16]}… in {self.label} is larger than the {block.size} bytes the manifest says"
                )
            if len(data) < hi - lo:
                raise IntegrityError(f"block {block.id[:16]}… in {self.label} is truncated")
            digest.update(data)
            yield data
        if digest.hexdigest() != block.id:
            raise IntegrityError(f"block {block.id[:16]}… in {self.label} is corrupt (digest mismatch)")
