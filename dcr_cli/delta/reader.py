"""Reads a delta from a block source, checking every byte it uses.

A delta is its manifest plus a :class:`BlockSource`. It has a *location*, ``Delta.url``, from which
``Delta.open`` opens the same delta again (in another process too, e.g. a vLLM worker), and a
*label* for messages. Two kinds of location open:

* a delta directory, local or any fsspec URL: ``DIR`` with ``DIR/manifest.json`` and ``DIR/blocks/``;
* a manifest in a dcr store, ``STORE/manifests/<digest>.json`` with the blocks in ``STORE/blocks/``
  (format_spec/store-v1.md §1). The name is the BLAKE3 of the manifest bytes, so the location
  proves what it names: bytes with another digest are refused.

Every section is checked against its digest when read. ``verify_blocks`` checks whole blocks. From
a remote source, ``prefetch_blocks`` downloads them in the background in the order the items use
them (delta/prefetch.py) and keeps them (memory, then a temporary directory): a section read waits
only for its own bytes, so a receiver's first pass runs while later blocks are still on the wire, and
a whole apply fetches every data block once, repair blocks only when a torn item needs them
(delta-v1 §7.3). ``verify_blocks`` waits for the whole blocks: receivers call it before their first write.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import blake3
import fsspec
import numpy as np

from ..errors import DcrError, FormatError, IntegrityError
from ..format.digest import digest_bytes
from ..format.dtypes import dtype as lookup_dtype
from ..format.manifest import (
    BLOCKS_DIR,
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    SECTION_DIGEST_BYTES,
    BlockEntry,
    Item,
    Manifest,
    Section,
    parse_manifest,
)
from ..io.clients import client_options
from ..io.gc_pause import no_collections
from .prefetch import BlockFetcher
from .source import BlockSource, StoreManifestSource

if TYPE_CHECKING:
    from ..format.codec import DecodedItem

STORE_MANIFESTS = "manifests"  # store-v1 §1: manifests/<digest>.json beside blocks/
_STORE_MANIFEST = re.compile(rf"(?P<root>.*)/{STORE_MANIFESTS}/(?P<digest>[0-9a-f]{{64}})\.json")
FETCH_WORKERS = 8  # parallel block fetches from a remote source
GROUP_READ_BYTES = 4 << 20  # read_sections reads a run of adjacent sections at once up to this many bytes
# Manifests parsed in this process and still alive somewhere, by the BLAKE3 of their bytes: a second
# open of the same bytes takes the same (never mutated) parse. An engine in the caller's process (vLLM's
# ``LLM``) has the client and the worker open every delta: the second parse of an MoE manifest
# (20k items) cost 160-180 ms of the GIL. Weak: the cache never keeps a manifest alive by itself.
_parsed: weakref.WeakValueDictionary[str, Manifest] = weakref.WeakValueDictionary()
_parsed_lock = threading.Lock()


@dataclass(eq=False)  # identity: receivers keep deltas in lists and ask "is this one in the plan"
class Delta:
    """An opened delta: its parsed manifest and access to its blocks."""

    url: str  # location: Delta.open(url) opens this delta again
    manifest: Manifest
    id: str  # digest of the manifest bytes
    manifest_bytes: int
    source: BlockSource
    label: str = ""  # for messages (default: the location)
    manifest_path: str = ""  # where the manifest's bytes are, on the source's filesystem
    fetched_early: int = 0  # blocks fetched while the receiver waited for the version (store/announce.py)
    _fetchers: list[BlockFetcher] = field(default_factory=list, repr=False)  # remote blocks fetched or on the way
    # Sections read and checked ahead by preread, by id of their (live) Section: taken by read_section.
    _preread: dict[int, bytes] = field(default_factory=dict, repr=False)
    # The manifest's bytes, where opened from a store location: offered with the early blocks (early_blocks).
    _raw: bytes | None = field(default=None, repr=False)
    manifest_offered: bool = False  # its bytes were taken from a directory offered to Delta.open, not read here

    def __post_init__(self) -> None:
        self.label = self.label or self.url

    @staticmethod
    def open(
        url: str | os.PathLike[str], *, storage_options: dict[str, Any] | None = None, offered: str | None = None
    ) -> Delta:
        """Open a delta directory, or a store manifest ``STORE/manifests/<digest>.json`` (see the module doc).

        ``offered``: a local directory (absolute) where another process of this node may have left the
        store manifest's bytes, as ``manifests/<digest>.json`` (a vLLM client's early spool,
        ``early_blocks``): taken from there if they are a regular file with the digest the location
        names, else read from the store as without it (a hint, never a failure)."""
        location = os.fspath(url)
        try:
            fs, path = fsspec.core.url_to_fs(location, **client_options(location, storage_options))
        except (ImportError, ValueError) as exc:
            raise DcrError(f"cannot open {location}: {exc}") from None
        path = path.rstrip("/") or path
        store = _STORE_MANIFEST.fullmatch(path)
        if store is not None:
            root, manifest_path, expected = store["root"], path, store["digest"]
        else:
            root, manifest_path, expected = path, f"{path}/{MANIFEST_NAME}", None
        source = BlockSource(fs, root, label=location)
        raw = _offered_manifest(offered, expected) if expected is not None else None
        from_offer = raw is not None
        try:
            if raw is None:
                raw = source.call(lambda: _read_manifest(source, manifest_path), f"read {manifest_path}")
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            raise FormatError(
                f"{location} is not a dcr delta (no {MANIFEST_NAME}); was it fully written or pulled?"
            ) from None
        digest = digest_bytes(raw)
        if expected is not None and digest != expected:
            raise IntegrityError(f"{location}: the manifest's bytes do not have the digest its name says (corrupt)")
        manifest = parse_manifest_once(raw, digest)
        in_store = _STORE_MANIFEST.fullmatch(location.rstrip("/")) if store is not None else None
        if in_store is not None:
            # A missing repair block is then told apart as the store would (not ready / lost, store-v1 §4.1).
            source = StoreManifestSource(
                fs,
                root,
                label=location,
                store_url=in_store["root"],
                manifest_id=digest,
                base_version=manifest.base.version,
                target_version=manifest.target.version,
            )
        delta = Delta(location, manifest, digest, len(raw), source, manifest_path=manifest_path)
        if in_store is not None:
            delta.keep_manifest_bytes(raw)
            delta.manifest_offered = from_offer
        return delta

    def keep_manifest_bytes(self, raw: bytes) -> None:
        """Keep the manifest's bytes (as read, with this delta's id) to offer with the early blocks."""
        assert len(raw) == self.manifest_bytes
        self._raw = raw

    # -- where the blocks are (kept for callers that use the filesystem directly) --------------------------------

    @property
    def fs(self) -> fsspec.AbstractFileSystem:
        return self.source.fs

    @property
    def root(self) -> str:
        return self.source.root

    def block_path(self, block: BlockEntry) -> str:
        return self.source.path(block)

    def has_block(self, block: BlockEntry) -> bool:
        """Whether the block can be read here (fetched already, or present at the source)."""
        return self._fetcher_of(block.id) is not None or self.source.exists(block)

    def _fetcher_of(self, block_id: str) -> BlockFetcher | None:
        return next((f for f in self._fetchers if block_id in f), None)

    def raw_manifest(self) -> bytes:
        """The manifest's bytes, read again; IntegrityError if they are no longer the ones opened."""
        raw = self.source.call(lambda: _read_manifest(self.source, self.manifest_path), f"read {self.manifest_path}")
        if digest_bytes(raw) != self.id:
            raise IntegrityError(f"{self.label}: the manifest changed since it was opened")
        return raw

    # -- reading -------------------------------------------------------------------------------------------------

    def read_section(self, section: Section, what: str) -> bytes:
        data = self._preread.pop(id(section), None)
        if data is not None:  # read and checked by preread
            return data
        block = self.manifest.blocks[section.block]
        end = section.offset + section.length
        data = self._read_range(block, section.offset, end, what)
        if len(data) != section.length:
            raise IntegrityError(f"{what}: block {block.id[:16]}… is truncated")
        if self.manifest.section_digest(data) != section.digest:
            raise IntegrityError(
                f"{what}: block {block.id[:16]}… is corrupt (digest mismatch); {self.source.damaged_advice}"
            )
        return data

    def preread(self, sections: Sequence[Section], what: Callable[[int], str]) -> None:
        """Read and check these sections now, together (``read_sections``); the next ``read_section`` of
        each returns its bytes without reading them again (a receiver's batch of small items: one
        read for the batch, then its items decode one by one as usual)."""
        for section, data in zip(sections, self.read_sections(sections, what), strict=True):
            self._preread[id(section)] = data

    def give_back(self, sections: Sequence[Section], datas: Sequence[bytes]) -> None:
        """Return sections' checked bytes taken by ``read_section`` from a ``preread`` (a batch that
        could not use them: its items read them one by one next, without reading them again)."""
        for section, data in zip(sections, datas, strict=True):
            self._preread[id(section)] = data

    def _read_range(self, block: BlockEntry, start: int, end: int, what: str) -> bytes:
        fetcher = self._fetcher_of(block.id)
        if fetcher is not None:  # waits until these bytes have arrived
            return fetcher.read(block.id, start, end)
        try:
            return self.source.read(block, start, end)
        except FileNotFoundError:
            raise IntegrityError(f"{what}: block {block.id[:16]}… is missing from {self.label}") from None

    def read_sections(self, sections: Sequence[Section], what: Callable[[int], str]) -> list[bytes]:
        """``read_section`` of each section (``what(i)`` names the i-th in messages), with one read per
        run of sections that follow each other in one block (a writer packs consecutive items so):
        the same bytes, each checked against its own digest, for a fraction of the reads."""
        out: list[bytes] = []
        digest_of = self.manifest.section_digest
        i, n = 0, len(sections)
        while i < n:
            first = sections[i]
            j, end = i + 1, first.offset + first.length
            while (
                j < n
                and sections[j].block == first.block
                and sections[j].offset == end
                and end - first.offset < GROUP_READ_BYTES
            ):
                end += sections[j].length
                j += 1
            if j - i == 1:
                out.append(self.read_section(first, what(i)))
                i = j
                continue
            data = self._read_range(self.manifest.blocks[first.block], first.offset, end, what(i))
            if len(data) != end - first.offset:  # short: each section again, for its own message
                out.extend(self.read_section(sections[k], what(k)) for k in range(i, j))
                i = j
                continue
            for k in range(i, j):
                section = sections[k]
                lo = section.offset - first.offset
                piece = data[lo : lo + section.length]
                if digest_of(piece) != section.digest:
                    block = self.manifest.blocks[section.block]
                    raise IntegrityError(
                        f"{what(k)}: block {block.id[:16]}… is corrupt (digest mismatch); {self.source.damaged_advice}"
                    )
                out.append(piece)
            i = j
        return out

    def read_joined(self, sections: Sequence[Section], what: Callable[[int], str]) -> bytes:
        """The bytes of these sections one after another (each checked against its digest), as one
        object: one read where they follow each other in one block, else ``read_sections`` joined.
        Errors are ``read_sections``' (it is asked again where anything is wrong)."""
        first = sections[0]
        end = first.offset
        for section in sections:
            if section.block != first.block or section.offset != end:
                return b"".join(self.read_sections(sections, what))
            end += section.length
        if end - first.offset > GROUP_READ_BYTES:
            return b"".join(self.read_sections(sections, what))
        data = self._read_range(self.manifest.blocks[first.block], first.offset, end, what(0))
        if len(data) != end - first.offset:
            return b"".join(self.read_sections(sections, what))
        view = memoryview(data)
        length = SECTION_DIGEST_BYTES[self.manifest.major]
        at = 0
        for section in sections:
            stop = at + section.length
            if blake3.blake3(view[at:stop]).hexdigest(length=length) != section.digest:
                return b"".join(self.read_sections(sections, what))  # raises, naming the section
            at = stop
        return data

    def prefetch_blocks(self, roles: tuple[str, ...] = ("data",), *, workers: int = FETCH_WORKERS) -> None:
        """Start fetching a remote delta's blocks of these roles in the background, in the order the
        items use them; section reads wait only for their own bytes. Call :meth:`verify_blocks` before
        relying on a block as a whole (receivers: before their first write). A local source has
        nothing to fetch: its blocks are checked here, at once, as ``verify_blocks`` does."""
        if not self.source.remote:
            self.verify_blocks(roles)
            return
        wanted = {b.id: b for b in self.manifest.blocks if b.role in roles and self._fetcher_of(b.id) is None}
        if not wanted:
            return
        first_use: dict[str, BlockEntry] = {}
        for item in self.manifest.items:
            for section in (item.data, item.repair):
                if section is not None:
                    block = self.manifest.blocks[section.block]
                    if block.id in wanted:
                        first_use.setdefault(block.id, block)
        order = [*first_use.values(), *(b for i, b in wanted.items() if i not in first_use)]
        self._fetchers.append(BlockFetcher(self.source, order, workers=workers))

    def verify_blocks(self, roles: tuple[str, ...] = ("data",)) -> None:
        """Check that every block of the given roles is present, of its size and digest.

        Reads each block in bounded ranges, never more than its declared size plus one byte. From
        a remote source each block is fetched once (by :meth:`prefetch_blocks`, started here if it
        was not) and kept, so later section reads fetch nothing again.
        """
        wanted = list({b.id: b for b in self.manifest.blocks if b.role in roles}.values())
        if not self.source.remote:
            for block in wanted:
                try:
                    for _ in self.source.chunks(block):
                        pass
                except FileNotFoundError:
                    raise IntegrityError(f"block {block.id[:16]}… is missing from {self.label}") from None
            return
        self.prefetch_blocks(roles)
        for block in wanted:
            fetcher = self._fetcher_of(block.id)
            assert fetcher is not None
            fetcher.wait_block(block.id)

    def adopt_fetcher(self, fetcher: BlockFetcher) -> None:
        """Read the blocks ``fetcher`` holds (or is fetching) from it: fetched before this delta was opened,
        e.g. while a receiver waited for the version (store/announce.py). Its blocks are checked whole by
        the fetcher, against their ids, as :meth:`prefetch_blocks`' are."""
        self._fetchers.append(fetcher)

    def early_blocks(self) -> str | None:
        """A directory where another process of this node (a vLLM engine's workers) finds the blocks that
        arrived whole and checked in an adopted fetcher's spool (fetched while a receiver waited for the
        version, store/announce.py), as ``blocks/<id>`` (hard links: the spool keeps its own files); None
        if there are none, or if they cannot be linked (the reader then fetches them itself: a hint only).
        The directory goes with the spool, when this delta does."""
        spool: str | None = None
        try:
            for fetcher in self._fetchers:
                for block_id in fetcher.ids:
                    path = fetcher.arrived_file(block_id)
                    if path is None or (spool is not None and os.path.dirname(path) != spool):
                        continue
                    spool = os.path.dirname(path)
                    directory = os.path.join(spool, BLOCKS_DIR)
                    os.makedirs(directory, exist_ok=True)
                    with contextlib.suppress(FileExistsError):
                        os.link(path, os.path.join(directory, block_id))
        except OSError:
            return None
        if spool is not None and self._raw is not None:
            # The manifest too: the engine's ranks on this node read it here instead of the store
            # (Delta.open(offered=...)), checked against the digest their location names. Without it
            # (a full TMPDIR) the blocks are offered still.
            # (No fsync: the spool dies with this process; a reader that finds it partial reads the store.)
            with contextlib.suppress(OSError):
                os.makedirs(os.path.join(spool, STORE_MANIFESTS), exist_ok=True)
                with open(os.path.join(spool, STORE_MANIFESTS, f"{self.id}.json"), "wb") as f:
                    f.write(self._raw)
        return spool

    def cancel_fetches(self) -> None:
        """Stop background downloads (a receiver that failed no longer needs them); blocks that had not
        arrived whole are fetched afresh if this delta is read again."""
        for fetcher in self._fetchers:
            fetcher.cancel()
        self._fetchers = [f for f in self._fetchers if f.complete]

    def check_repair_blocks(self) -> None:
        """Repair blocks are optional. Those of a local delta directory that are here must be intact
        (checked whole); a remote source's or a store's are never read for this: each is checked by its
        section digests if a torn item reads it."""
        if self.source.remote or not self.source.checks_repairs_up_front:
            return
        for block in {b.id: b for b in self.manifest.blocks if b.role == "repair"}.values():
            if self.source.exists(block):
                try:
                    for _ in self.source.chunks(block):
                        pass
                except (IntegrityError, FileNotFoundError):
                    raise IntegrityError(
                        f"repair block {block.id[:16]}… in {self.label} is truncated or corrupt"
                    ) from None

    def decode(self, item: Item) -> DecodedItem:
        from ..format.codec import decode_data  # its kernels import numba: only what decodes pays for it

        data = self._preread.pop(id(item.data), None)  # read and checked by preread
        if data is None:
            data = self.read_section(item.data, f"{item.tensor} {item.region.to_json()}")
        dt = lookup_dtype(self.manifest.tensors[item.tensor].dtype)
        try:
            return decode_data(data, item.positions_length, item.op, item.count, item.region.size, dt, "")
        except DcrError:  # decoded again to raise the same error with the item's name (made only now)
            what = f"{item.tensor} {item.region.to_json()}"
            return decode_data(data, item.positions_length, item.op, item.count, item.region.size, dt, what)

    def repair_values(self, item: Item) -> np.ndarray:
        """Target values at the item's positions: what an absolute overwrite writes."""
        if item.repair is None:
            raise FormatError(f"{item.tensor}: item has no repair section")
        from ..format.codec import decode_values

        what = f"{item.tensor} {item.region.to_json()} repair"
        data = self.read_section(item.repair, what)
        dt = lookup_dtype(self.manifest.tensors[item.tensor].dtype)
        return decode_values(data, item.count, dt, what)

    def items_by_tensor(self) -> Iterator[tuple[str, list[Item]]]:
        groups: dict[str, list[Item]] = {}
        for item in self.manifest.items:
            groups.setdefault(item.tensor, []).append(item)
        yield from groups.items()


def _offered_manifest(offered: str | None, digest: str) -> bytes | None:
    """The bytes of manifest ``digest`` that the directory ``offered`` holds as ``manifests/<digest>.json``,
    if it is a regular file within the format's limit with that digest; else None (read the store)."""
    if not offered or not os.path.isabs(offered):
        return None
    from ..io.reading import read_regular_file

    try:
        path = os.path.join(offered, STORE_MANIFESTS, f"{digest}.json")
        if not stat.S_ISREG(os.lstat(path).st_mode):  # not a link, as offered blocks (node_copy.early_blocks)
            return None
        raw = read_regular_file(path, 0, MAX_MANIFEST_BYTES + 1)
    except (OSError, ValueError, DcrError):  # gone, swapped for a FIFO or a directory, a NUL in the path: the store
        return None
    return raw if len(raw) <= MAX_MANIFEST_BYTES and digest_bytes(raw) == digest else None


def _read_manifest(source: BlockSource, path: str) -> bytes:
    """The manifest's bytes, reading at most the format's limit plus one byte (delta-v1 §8)."""
    if source.local:
        from ..io.reading import read_regular_file

        raw = read_regular_file(path, 0, MAX_MANIFEST_BYTES + 1)
    else:
        raw = bytes(source.fs.cat_file(path, start=0, end=MAX_MANIFEST_BYTES + 1))
    if len(raw) > MAX_MANIFEST_BYTES:
        raise FormatError(f"{path}: manifest over the {MAX_MANIFEST_BYTES} byte limit")
    return raw


DeltaLike = str | os.PathLike[str] | Delta


def parse_manifest_once(raw: bytes, digest: str) -> Manifest:
    """``parse_manifest(raw)``, or the manifest parsed from the same bytes that this process still holds:
    the same bytes parse to the same manifest, and nothing mutates a parsed one. ``digest`` MUST be the
    BLAKE3 of ``raw``, computed or checked by the caller (``Delta.open``; a store's ``manifest_bytes``)."""
    with _parsed_lock:
        manifest = _parsed.get(digest)
    if manifest is None:
        with no_collections():  # 100k items: the parse builds millions of objects and no cycles
            manifest = parse_manifest(raw)
        with _parsed_lock:
            _parsed[digest] = manifest
    return manifest


def open_deltas(
    deltas: DeltaLike | Sequence[DeltaLike],
    *,
    order_directory: Callable[[list[Delta], str], list[Delta]] | None = None,
) -> list[Delta]:
    """Open deltas given as paths/URLs or Delta objects, in the order given; a local directory of
    deltas stands for its children (name order, or ``order_directory(children, path)``)."""
    if isinstance(deltas, (str, os.PathLike, Delta)):
        deltas = [deltas]
    opened: list[Delta] = []
    for d in deltas:
        if isinstance(d, Delta):
            opened.append(d)
            continue
        path = Path(os.fspath(d))
        if "://" not in os.fspath(d) and path.is_dir() and not (path / MANIFEST_NAME).exists():
            children = [Delta.open(p) for p in sorted(path.iterdir()) if (p / MANIFEST_NAME).is_file()]
            if not children:
                raise FormatError(f"{path} is neither a dcr delta nor a directory of deltas")
            opened.extend(order_directory(children, str(path)) if order_directory else children)
        else:
            opened.append(Delta.open(d))
    if not opened:
        raise FormatError("no delta given")
    return opened
