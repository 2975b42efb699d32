"""Writes a delta directory: content-addressed blocks first, the manifest last.

The directory is built under a temporary name beside the destination and
renamed into place at the end, so a crashed ``dcr diff`` never leaves
something that looks like a delta.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import os
import shutil
import tempfile
import threading
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import blake3

from .._version import __version__
from ..errors import ConflictError
from ..format.codec import EncodedItem, PendingItem
from ..format.digest import digest_bytes
from ..format.manifest import (
    BLOCKS_DIR,
    FORMAT_MAJOR,
    MANIFEST_NAME,
    MANIFEST_ZSTD_LEVEL,
    SECTION_DIGEST_BYTES,
    TARGET_BLOCK_BYTES,
    BlockEntry,
    BlockRole,
    Item,
    Manifest,
    Section,
    TensorEntry,
    VersionRef,
    make_item,
    make_section,
    section_digest,
)
from ..io.files import fsync_dir, start_writeback, write_atomic

_blake3 = blake3.blake3

# A block being filled has its writeback started every this many bytes (io.files.start_writeback: the
# disk works while the diff goes on, nobody waits), so that its final fsync (on the diff's critical path,
# after the last item) has little left to write.
SYNC_BYTES = 8 << 20


# Sections are gathered in memory up to this many bytes before they are written and hashed at once:
# an MoE diff adds 100k sections of a few hundred bytes, and a write and a hash call each cost more than
# the bytes (the block file and its digest are the same).
WRITE_BYTES = 1 << 20
# A section at least this large is written (with what was gathered before it) as soon as it is added,
# as a large tensor's sections always were: its write and hash calls cost nothing next to its bytes.
_WRITE_AT_ONCE = 64 << 10


class _StagedBlock:
    """A block's file, written and hashed while the block fills (under a temporary name in the blocks
    directory), WRITE_BYTES at a time: when it is full, or at finish, only its last sections remain to
    be written and synced, instead of the whole block at once."""

    def __init__(self, directory: Path, role: BlockRole, number: int) -> None:
        self.path = directory / f".partial-{role}-{number}"
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
        self.hasher = blake3.blake3(max_threads=1)
        self.unsynced = 0
        self.chunks: list[bytes] = []  # added, not yet written
        self.buffered = 0

    def write(self, data: bytes) -> None:
        self.chunks.append(data)
        self.buffered += len(data)
        if self.buffered >= WRITE_BYTES or len(data) >= _WRITE_AT_ONCE:
            self.drain()

    def drain(self) -> None:
        """Write and hash the sections gathered so far."""
        if not self.chunks:
            return
        data = self.chunks[0] if len(self.chunks) == 1 else b"".join(self.chunks)
        self.chunks, self.buffered = [], 0
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view) :]
        self.hasher.update(data)
        self.unsynced += len(data)
        if self.unsynced >= SYNC_BYTES:
            start_writeback(self.fd)
            self.unsynced = 0

    def digest(self) -> str:
        self.drain()
        return self.hasher.hexdigest()  # digest_bytes of the block's bytes

    def place(self, path: Path) -> None:
        """Sync the file and give it its content address (dropping it when that block exists already)."""
        self.drain()
        os.fsync(self.fd)
        self.close()
        if path.exists():
            os.unlink(self.path)
        else:
            os.replace(self.path, path)

    def close(self) -> None:
        self.chunks = []
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


# Blocks handed to ``on_block`` (uploaded while the delta is still being built) are cut at this size.
STREAMED_BLOCK_BYTES = 8 << 20
# ... the first of them at this size, and each next one twice the last up to STREAMED_BLOCK_BYTES: the
# upload (the link) starts after 1 MiB of the delta has been built, not after 8 MiB.
FIRST_STREAMED_BLOCK_BYTES = 1 << 20


class _Written:
    """A staged block's bytes where only their length is needed (no on_block to hand them to)."""

    __slots__ = ("size",)

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size


class _BlockPacker:
    """Packs sections of one role into block files of about TARGET_BLOCK_BYTES."""

    def __init__(self, writer: DeltaWriter, role: BlockRole) -> None:
        self.writer, self.role = writer, role
        # Whether this role's blocks are handed to on_block as they are cut (dcr diff --push takes the data
        # blocks only: the repair blocks go up after publication, read from their files).
        self.streamed = writer.on_block is not None and role in getattr(writer.on_block, "roles", (role,))
        # The block's bytes in memory, only for on_block: they are in the staged file anyway, and
        # growing a buffer of tens of MB copies it under the GIL, which stalls the diff's workers.
        self.buffer: bytearray | None = bytearray() if self.streamed else None
        self.size = 0  # bytes in the block so far
        self.pending: list[tuple[int, str, int, int, str]] = []  # (item index, field, offset, length, digest)
        self.staged: _StagedBlock | None = None
        self.started = 0  # blocks begun (names the staged files apart)
        self.digest_bytes = SECTION_DIGEST_BYTES[writer.major]
        ramp = self.streamed and writer.block_bytes == STREAMED_BLOCK_BYTES
        self.limit = min(FIRST_STREAMED_BLOCK_BYTES, writer.block_bytes) if ramp else writer.block_bytes

    def add(self, item_index: int, field: str, data: bytes) -> None:
        n = len(data)
        if type(data) is bytes and n <= WRITE_BYTES:  # section_digest of a small section, without its wrapper
            digest = _blake3(data).hexdigest(length=self.digest_bytes)
        else:
            digest = section_digest(data, self.writer.major)
        self.pending.append((item_index, field, self.size, n, digest))
        self.size += n
        if self.buffer is not None:
            self.buffer += data
        staged = self.staged
        if staged is None:
            self.started += 1
            staged = self.staged = _StagedBlock(self.writer._tmp / BLOCKS_DIR, self.role, self.started)
        staged.chunks.append(data)  # staged.write(data), inline
        staged.buffered += n
        if staged.buffered >= WRITE_BYTES or n >= _WRITE_AT_ONCE:
            staged.drain()
        if self.size >= self.limit:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        staged, self.staged = self.staged, None
        data = bytes(self.buffer) if self.buffer is not None else _Written(self.size)
        index = self.writer._store_block(data, self.role, staged)  # type: ignore[arg-type]  # _Written: len() only
        sections = self.writer._sections[self.role]
        for item_index, _, offset, length, digest in self.pending:
            sections[item_index] = make_section(index, offset, length, digest)
        if self.buffer is not None:
            self.buffer = bytearray()
        self.size = 0
        self.pending = []
        self.limit = min(2 * self.limit, self.writer.block_bytes)

    def close(self) -> None:
        if self.staged is not None:
            self.staged.close()
            self.staged = None


class DeltaWriter:
    """Collects encoded items and writes them as a delta directory at ``out``.

    Items are placed into blocks in the order they are added, so adding them
    in a deterministic order gives byte-identical deltas for identical inputs.
    """

    def __init__(
        self,
        out: str | os.PathLike[str],
        *,
        block_bytes: int | None = None,
        on_block: Callable[[str, bytes], None] | None = None,
        major: int = FORMAT_MAJOR,
        manifest_level: int = MANIFEST_ZSTD_LEVEL,
    ) -> None:
        """``block_bytes``: the size at which blocks are cut (default: 64 MiB, 8 MiB with ``on_block``).
        ``on_block(id, data)`` is called with every block as soon as it is on disk (e.g. to start its
        upload while the rest of the delta is still being computed); only with the blocks of the roles
        in ``on_block.roles`` if it has that attribute. ``major`` is the delta format major
        written (it decides the section digests, so it is fixed before the first section);
        ``manifest_level`` the zstd level of a 2.x manifest's frame (a writer's choice)."""
        self.out = Path(out)
        self.major = major
        self.manifest_level = manifest_level
        self.on_block = on_block
        if self.out.exists() and (not self.out.is_dir() or any(self.out.iterdir())):
            raise ConflictError(f"{self.out} already exists; choose a new output path or remove it")
        self.out.parent.mkdir(parents=True, exist_ok=True)
        # Blocks that are uploaded as they are written (dcr diff --push) are smaller: a 3% delta of a
        # few GiB is one or two 64 MiB blocks, which would go up only when the diff ends.
        self.block_bytes = block_bytes or (STREAMED_BLOCK_BYTES if on_block is not None else TARGET_BLOCK_BYTES)
        self._tmp = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.partial-", dir=self.out.parent))
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(self._tmp, 0o777 & ~umask)  # mkdtemp makes it private; a delta is ordinary data
        self._held = _hold(self._tmp)
        _sweep_partials(self.out, self._tmp)
        (self._tmp / BLOCKS_DIR).mkdir()
        self._lock = threading.Lock()
        # An added item's fields (tensor, region, op, count, positions_length, pre, post, residual,
        # changed): its section bytes live in the packers' blocks once added.
        self._items: list[tuple[Any, ...]] = []
        self._sections: dict[str, list[Section | None]] = {"data": [], "repair": []}  # by field, by item index
        self._blocks: list[BlockEntry] = []
        self._packers = {"data": _BlockPacker(self, "data"), "repair": _BlockPacker(self, "repair")}
        self._data_packer, self._repair_packer = self._packers["data"], self._packers["repair"]

    def _store_block(self, data: bytes, role: BlockRole, staged: _StagedBlock | None = None) -> int:
        """Store a block (``staged``: its bytes are already in that file) and report it to ``on_block``."""
        block_id = digest_bytes(data) if staged is None else staged.digest()
        path = self._tmp / BLOCKS_DIR / block_id
        if staged is not None:
            staged.place(path)
        elif not path.exists():
            with open(path, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        self._blocks.append(BlockEntry(block_id, len(data), role))
        # A callback may name the roles it wants (``on_block.roles``, e.g. ("data",)): dcr diff --push
        # uploads repair blocks only after publication (store-v1 §4.1).
        if self._packers[role].streamed:
            assert self.on_block is not None and isinstance(data, bytes)
            self.on_block(block_id, data)
        return len(self._blocks) - 1

    def add(self, item: EncodedItem) -> None:
        """Place ``item``'s sections into blocks (a :class:`PendingItem` is encoded here first)."""
        if type(item) is PendingItem:
            item = item.encode()
        with self._lock:
            index = len(self._items)
            sections = self._sections
            sections["data"].append(None)
            sections["repair"].append(None)
            self._data_packer.add(index, "data", item.data)
            if item.repair is not None:
                self._repair_packer.add(index, "repair", item.repair)
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
        (self._tmp / _PARTIAL_LOCK).unlink()  # still held: no sweep takes a directory without one
        os.replace(self._tmp, self.out)
        fsync_dir(self.out.parent)
        os.close(self._held)

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
            manifest = dataclasses.replace(manifest, raw=manifest.to_json_bytes(self.manifest_level))
            self.commit(MANIFEST_NAME, manifest.file_bytes())
            return manifest

    def abort(self) -> None:
        for packer in self._packers.values():
            packer.close()
        shutil.rmtree(self._tmp, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.close(self._held)


_PARTIAL_LOCK = ".lock"  # in a writer's partial directory, flock-held while the writer lives


def _hold(partial: Path) -> int:
    """Lock a new partial directory as its writer's for as long as the process lives: the lock file is
    locked under a temporary name and only then renamed into place, so a sweep never sees it unlocked."""
    tmp = partial / f"{_PARTIAL_LOCK}.tmp"
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.rename(tmp, partial / _PARTIAL_LOCK)
    return fd


def _sweep_partials(out: Path, own: Path) -> None:
    """Remove what killed writers of ``out`` left: ``.<out>.partial-*`` directories whose lock no process
    holds (the kernel dropped it with the writer). A killed dcr diff otherwise leaves a delta's worth of
    blocks for good under a random name, and every retry another. Directories without a lock file (an
    older dcr's, or one being committed) are left alone."""
    for other in out.parent.glob(f".{out.name}.partial-*"):
        if other == own or not (other / _PARTIAL_LOCK).is_file():
            continue
        try:
            fd = os.open(other / _PARTIAL_LOCK, os.O_RDWR | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            shutil.rmtree(other, ignore_errors=True)  # its writer is gone
        except BlockingIOError:
            pass  # a live writer
        finally:
            os.close(fd)
