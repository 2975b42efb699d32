"""One download of a remote delta per node, for an engine of several ranks (receiver-vllm.md §7).

Every tensor-parallel rank needs every item (each holds a slice of every tensor). Left to itself,
each rank would download the whole delta over the node's link. Instead the first rank of each node
downloads the data blocks once (:func:`download_data_blocks`: each checked whole, by size and
digest, before it is kept) into a private directory, and every rank of the node reads the delta
through a :class:`NodeCopySource`: data blocks from that directory, anything else (the manifest
was read already; repair blocks, which only a torn item reads) from the delta's own source, as
before. The backend (backend.py ``open_delta``) runs the steps as agreed phases across the ranks.
"""

from __future__ import annotations

import contextlib
import os
import stat

import blake3
import fsspec

from ...delta.prefetch import BlockFetcher
from ...delta.reader import Delta
from ...delta.source import BlockSource
from ...errors import DcrError
from ...format.manifest import BLOCKS_DIR, BlockEntry
from ...io import private


class NodeCopySource(BlockSource):
    """A remote delta's blocks, its data blocks read from this node's copy (checked whole when copied)."""

    def __init__(self, upstream: BlockSource, directory: str, data: set[str]) -> None:
        super().__init__(fsspec.filesystem("file"), directory, label=upstream.label)
        self.upstream = upstream
        self.data = data
        self.missing_repair_advice = upstream.missing_repair_advice
        self.damaged_advice = upstream.damaged_advice

    def path(self, block: BlockEntry) -> str:
        return super().path(block) if block.id in self.data else self.upstream.path(block)

    def read(self, block: BlockEntry, start: int, end: int) -> bytes:
        return super().read(block, start, end) if block.id in self.data else self.upstream.read(block, start, end)

    def exists(self, block: BlockEntry) -> bool:
        return super().exists(block) if block.id in self.data else self.upstream.exists(block)

    def missing_repair(self, what: str) -> DcrError:
        return self.upstream.missing_repair(what)  # a store's source tells "not uploaded yet" from "lost"

    @property
    def remote(self) -> bool:
        return False  # the data blocks are here: checking them reads local files, nothing is fetched


def data_blocks(delta: Delta) -> list[BlockEntry]:
    return list({b.id: b for b in delta.manifest.blocks if b.role == "data"}.values())


def early_blocks(delta: Delta, early: str | None) -> list[BlockEntry]:
    """``delta``'s data blocks that the directory ``early`` offers as ``blocks/<id>``: regular files (not
    symbolic links) of the size the manifest lists. ``early`` is what the client passed to ``prepare``:
    the blocks it fetched while it waited for the version (receiver-vllm.md §7), on this node's
    filesystem if the engine runs here; a directory this rank cannot see offers none."""
    if not early or not os.path.isabs(early):
        return []
    offered = []
    for block in data_blocks(delta):
        try:
            info = os.lstat(os.path.join(early, block.path))
        except OSError:
            continue
        if stat.S_ISREG(info.st_mode) and info.st_size == block.size:
            offered.append(block)
    return offered


def _link_checked(source: str, block: BlockEntry, directory: str) -> bool:
    """Hard-link the offered file ``source`` into ``directory`` as ``block.path`` once the linked file
    is of the block's size and digest (no copy: the offer costs no space); False, leaving nothing, if
    it cannot be linked (another filesystem, not this user's) or is not the block."""
    part = os.path.join(directory, f".{block.id}.early")
    try:
        os.link(source, part, follow_symlinks=False)
        try:
            info = os.lstat(part)
            digest = blake3.blake3(max_threads=blake3.blake3.AUTO)
            if stat.S_ISREG(info.st_mode) and info.st_size == block.size:
                digest.update_mmap(part)
            if not stat.S_ISREG(info.st_mode) or info.st_size != block.size or digest.hexdigest() != block.id:
                os.unlink(part)
                return False
            os.replace(part, os.path.join(directory, block.path))
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(part)
            raise
    except OSError:
        return False
    return True


def _link_offered(delta: Delta, early: str | None, directory: str) -> list[tuple[BlockEntry, str]]:
    """The blocks ``early`` offers, hard-linked into ``directory``'s ``blocks/`` and checked there
    (:func:`_link_checked`), with their paths; those that could not be are left out."""
    linked = []
    for block in early_blocks(delta, early):
        assert early is not None
        if _link_checked(os.path.join(early, block.path), block, directory):
            linked.append((block, os.path.join(directory, block.path)))
    return linked


def adopt_early_blocks(delta: Delta, early: str | None) -> tuple[str | None, int]:
    """One rank: let ``delta`` read the blocks ``early`` offers in place, each hard-linked into a new
    private directory and checked whole there, while the rest download in the background as the
    first pass reads them (``Delta.prefetch_blocks`` skips the adopted ones). Returns (the directory,
    to remove when the update ends; how many were taken); (None, 0) where nothing could be taken."""
    if not early_blocks(delta, early):
        return None, 0
    try:
        directory = private.make_held(_private_root(), f"{delta.id[:16]}-{os.getpid()}-")
        os.mkdir(os.path.join(directory, BLOCKS_DIR))
    except OSError:
        return None, 0
    try:
        linked = _link_offered(delta, early, directory)
    except BaseException:
        private.remove_own(directory)
        raise
    if not linked:
        private.remove_own(directory)
        return None, 0
    delta.adopt_fetcher(BlockFetcher.of_checked_files(delta.source, linked))
    return directory, len(linked)


def download_data_blocks(delta: Delta, early: str | None = None) -> str | None:
    """A new private directory holding ``delta``'s data blocks, each checked whole; None where this node
    cannot hold them (no usable temporary directory, a full disk): its ranks then read the delta where it is.
    The blocks that ``early`` offers (:func:`early_blocks`) are hard-linked from there and checked, the
    rest downloaded (an offered block that cannot be linked, or is not the block, is downloaded too).

    A block that is missing, truncated or corrupt at the source raises (IntegrityError), as reading it would.
    Copies that killed engines of this user left behind are removed first (:func:`sweep_stale_copies`).
    """
    try:
        root = _private_root()
        directory = private.make_held(root, f"{delta.id[:16]}-{os.getpid()}-")
    except OSError:
        return None
    try:
        os.mkdir(os.path.join(directory, BLOCKS_DIR))
        linked = {block.id for block, _ in _link_offered(delta, early, directory)}
        blocks = [b for b in data_blocks(delta) if b.id not in linked]
        with BlockFetcher(delta.source, blocks, spool=directory) as fetcher:
            for block in blocks:  # kept (renamed into blocks/) only once its size and digest are checked
                fetcher.keep(block.id, os.path.join(directory, block.path), durable=False)  # dies with the engine
        return directory
    except OSError:  # not DcrError: a bad block fails the apply on every rank
        private.remove_own(directory)
        return None
    except BaseException:
        private.remove_own(directory)
        raise


def taken_early(directory: str, early: str | None) -> int:
    """How many of the node copy's blocks in ``directory`` are the files ``early`` offered (linked, not fetched)."""
    if not early:
        return 0
    taken = 0
    blocks = os.path.join(directory, BLOCKS_DIR)
    with contextlib.suppress(OSError):
        for name in os.listdir(blocks):
            with contextlib.suppress(OSError):
                taken += os.path.samefile(os.path.join(blocks, name), os.path.join(early, BLOCKS_DIR, name))
    return taken


def sweep_stale_copies(root: str) -> list[str]:
    """Remove the copies under ``root`` (this user's private directory) whose engine is gone (io/private.py
    :func:`~dcr_cli.io.private.sweep_stale`); the paths removed."""
    return private.sweep_stale(root)


def read_through_copy(delta: Delta, directory: str) -> Delta:
    """``delta`` with its data blocks read from ``directory`` (this node's copy), everything else as before."""
    source = NodeCopySource(delta.source, directory, {b.id for b in data_blocks(delta)})
    copy = Delta(delta.url, delta.manifest, delta.id, delta.manifest_bytes, source, delta.label, delta.manifest_path)
    copy.manifest_offered = delta.manifest_offered  # where this rank's manifest came from, as prepare reports it
    return copy


def _private_root() -> str:
    """``$TMPDIR/dcr-engine-<uid>``, a directory of this user's only (mode 0700, io/private.py)."""
    return private.private_root("engine")
