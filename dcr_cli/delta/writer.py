"""Writes a delta directory: content-addressed blocks first, the manifest last.

The directory is built under a temporary name beside the destination and
renamed into place at the end, so a crashed ``dcr diff`` never leaves
something that looks like a delta.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from .._version import __version__
from ..errors import ConflictError
from ..format.codec import EncodedItem
from ..format.digest import digest_bytes
from ..format.manifest import (
    BLOCKS_DIR,
    FORMAT_MAJOR,
    MANIFEST_NAME,
    MANIFEST_ZSTD_LEVEL,
    TARGET_BLOCK_BYTES,
    BlockEntry,
    BlockRole,
    Item,
    Manifest,
    Section,
    TensorEntry,
    VersionRef,
    make_item,
    section_digest,
)
from ..io.files import fsync_dir, write_atomic


class _BlockPacker:
    """Packs sections of one role into block files of about TARGET_BLOCK_BYTES."""

    def __init__(self, writer: DeltaWriter, role: BlockRole) -> None:
        self.writer, self.role = writer, role
        self.buffer = bytearray()
        self.pending: list[tuple[int, str, int, int, str]] = []  # (item index, field, offset, length, digest)

    def add(self, item_index: int, field: str, data: bytes) -> None:
        digest = section_digest(data, self.writer.major)
        self.pending.append((item_index, field, len(self.buffer), len(data), digest))
        self.buffer += data
        if len(self.buffer) >= self.writer.block_bytes:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        index = self.writer._store_block(bytes(self.buffer), self.role)
        for item_index, field, offset, length, digest in self.pending:
            self.writer._sections[field][item_index] = Section(index, offset, length, digest)
        self.buffer = bytearray()
        self.pending = []


class DeltaWriter:
    """Collects encoded items and writes them as a delta directory at ``out``.

    Items are placed into blocks in the order they are added, so adding them
    in a deterministic order gives byte-identical deltas for identical inputs.
    """

    def __init__(
        self,
        out: str | os.PathLike[str],
        *,
        block_bytes: int = TARGET_BLOCK_BYTES,
        on_block: Callable[[str, bytes], None] | None = None,
        major: int = FORMAT_MAJOR,
        manifest_level: int = MANIFEST_ZSTD_LEVEL,
    ) -> None:
        """``on_block(id, data)`` is called with every block as soon as it is on disk (e.g. to start its
        upload while the rest of the delta is still being computed). ``major`` is the delta format major
        written (it decides the section digests, so it is fixed before the first section);
        ``manifest_level`` the zstd level of a 2.x manifest's frame (a writer's choice)."""
        self.out = Path(out)
        self.major = major
        self.manifest_level = manifest_level
        self.on_block = on_block
        if self.out.exists() and (not self.out.is_dir() or any(self.out.iterdir())):
            raise ConflictError(f"{self.out} already exists; choose a new output path or remove it")
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.block_bytes = block_bytes
        self._tmp = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.partial-", dir=self.out.parent))
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(self._tmp, 0o777 & ~umask)  # mkdtemp makes it private; a delta is ordinary data
        (self._tmp / BLOCKS_DIR).mkdir()
        self._lock = threading.Lock()
        # An added item's fields (tensor, region, op, count, positions_length, pre, post, residual,
        # changed): its section bytes live in the packers' blocks once added.
        self._items: list[tuple[Any, ...]] = []
        self._sections: dict[str, list[Section | None]] = {"data": [], "repair": []}  # by field, by item index
        self._blocks: list[BlockEntry] = []
        self._packers = {"data": _BlockPacker(self, "data"), "repair": _BlockPacker(self, "repair")}

    def _store_block(self, data: bytes, role: BlockRole) -> int:
        block_id = digest_bytes(data)
        path = self._tmp / BLOCKS_DIR / block_id
        if not path.exists():
            with open(path, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        self._blocks.append(BlockEntry(block_id, len(data), role))
        if self.on_block is not None:
            self.on_block(block_id, data)
        return len(self._blocks) - 1

    def add(self, item: EncodedItem) -> None:
        with self._lock:
            index = len(self._items)
            self._sections["data"].append(None)
            self._sections["repair"].append(None)
            self._packers["data"].add(index, "data", item.data)
            if item.repair is not None:
                self._packers["repair"].add(index, "repair", item.repair)
            # Keep the fields only: the section bytes now live in the packers' blocks, and holding
            # them until finish() would make the writer's memory grow with the delta.
            self._items.append(
                (item.tensor, item.region, item.op, item.count, item.positions_length, item.pre, item.post,
                 item.residual, item.changed)
            )  # fmt: skip

    def placed_items(self) -> list[Item]:
        """Flush pending blocks and return the items with their sections placed (call under the lock)."""
        for packer in self._packers.values():
            packer.flush()
        return [
            make_item(tensor, region, op, count, data, positions_length, pre, post, repair, residual, changed)  # type: ignore[arg-type]  # every item has its data section
            for (tensor, region, op, count, positions_length, pre, post, residual, changed), data, repair in zip(
                self._items, self._sections["data"], self._sections["repair"], strict=True
            )
        ]

    @property
    def blocks(self) -> list[BlockEntry]:
        return self._blocks

    def commit(self, file_name: str, data: bytes) -> None:
        """Write the directory's index file (manifest, or a producer's part) last, then rename into place."""
        write_atomic(self._tmp / file_name, data)
        fsync_dir(self._tmp / BLOCKS_DIR)
        fsync_dir(self._tmp)  # the index file's rename into the directory, before the directory's own rename
        if self.out.exists():
            self.out.rmdir()  # empty, checked in __init__
        os.replace(self._tmp, self.out)
        fsync_dir(self.out.parent)

    def finish(
        self,
        base: VersionRef,
        target: VersionRef,
        tensors: dict[str, TensorEntry],
        extra: dict[str, Any] | None = None,
        created: str | None = None,
    ) -> Manifest:
        with self._lock:
            items = self.placed_items()
            manifest = Manifest(
                base=base,
                target=target,
                tensors=tensors,
                items=items,
                blocks=self._blocks,
                created=created or datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                producer=f"dcr {__version__}",
                extra=dict(extra or {}),
                major=self.major,
            )
            manifest.raw = manifest.to_json_bytes(self.manifest_level)
            self.commit(MANIFEST_NAME, manifest.raw)
            return manifest

    def abort(self) -> None:
        shutil.rmtree(self._tmp, ignore_errors=True)
