"""Reads a delta directory from a local path or any fsspec URL, checking every byte it uses."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass

import fsspec
import numpy as np

from ..errors import FormatError, IntegrityError
from ..format.codec import DecodedItem, decode_data, decode_values
from ..format.digest import digest_bytes
from ..format.dtypes import dtype as lookup_dtype
from ..format.manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES, BlockEntry, Item, Manifest, Section, parse_manifest


@dataclass
class Delta:
    """An opened delta: its parsed manifest and access to its blocks."""

    url: str
    manifest: Manifest
    id: str  # digest of the manifest bytes
    manifest_bytes: int
    fs: fsspec.AbstractFileSystem
    root: str

    @staticmethod
    def open(url: str | os.PathLike[str]) -> Delta:
        url = os.fspath(url)
        fs, root = fsspec.core.url_to_fs(url)
        root = root.rstrip("/")
        path = f"{root}/{MANIFEST_NAME}"
        try:
            size = fs.size(path)
        except (FileNotFoundError, OSError):
            raise FormatError(
                f"{url} is not a dcr delta (no {MANIFEST_NAME}); was it fully written or pulled?"
            ) from None
        if size is not None and size > MAX_MANIFEST_BYTES:
            raise FormatError(f"{url}: manifest of {size} bytes is over the {MAX_MANIFEST_BYTES} byte limit")
        raw = fs.cat_file(path)
        return Delta(url, parse_manifest(raw), digest_bytes(raw), len(raw), fs, root)

    def block_path(self, block: BlockEntry) -> str:
        return f"{self.root}/{block.path}"

    def read_section(self, section: Section, what: str) -> bytes:
        block = self.manifest.blocks[section.block]
        try:
            data = self.fs.cat_file(self.block_path(block), start=section.offset, end=section.offset + section.length)
        except FileNotFoundError:
            raise IntegrityError(f"{what}: block {block.id[:16]}… is missing from {self.url}") from None
        if len(data) != section.length:
            raise IntegrityError(f"{what}: block {block.id[:16]}… is truncated")
        if digest_bytes(data) != section.digest:
            raise IntegrityError(f"{what}: block {block.id[:16]}… is corrupt (digest mismatch)")
        return data

    def verify_blocks(self, roles: tuple[str, ...] = ("data",)) -> None:
        """Check that every block of the given roles is present, of its size and digest."""
        for block in self.manifest.blocks:
            if block.role not in roles:
                continue
            path = self.block_path(block)
            try:
                data = self.fs.cat_file(path)
            except FileNotFoundError:
                raise IntegrityError(f"block {block.id[:16]}… is missing from {self.url}") from None
            if len(data) != block.size or digest_bytes(data) != block.id:
                raise IntegrityError(f"block {block.id[:16]}… in {self.url} is truncated or corrupt")

    def decode(self, item: Item) -> DecodedItem:
        what = f"{item.tensor} {item.region.to_json()}"
        data = self.read_section(item.data, what)
        dt = lookup_dtype(self.manifest.tensors[item.tensor].dtype)
        return decode_data(data, item.positions_length, item.op, item.count, item.region.size, dt, what)

    def repair_values(self, item: Item) -> np.ndarray:
        """Target values at the item's positions: what an absolute overwrite writes."""
        if item.repair is None:
            raise FormatError(f"{item.tensor}: item has no repair section")
        what = f"{item.tensor} {item.region.to_json()} repair"
        data = self.read_section(item.repair, what)
        dt = lookup_dtype(self.manifest.tensors[item.tensor].dtype)
        return decode_values(data, item.count, dt, what)

    def items_by_tensor(self) -> Iterator[tuple[str, list[Item]]]:
        groups: dict[str, list[Item]] = {}
        for item in self.manifest.items:
            groups.setdefault(item.tensor, []).append(item)
        yield from groups.items()
