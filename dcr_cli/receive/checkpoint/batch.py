"""A batch of small items checked and applied by one compiled call (the MoE case: 100k items of a few KiB).

The per-item path (``applier.prepare_item``) reads an item's elements, decodes its two frames and
hashes, one Python call at a time: tens of microseconds per item. Here, for a batch of consecutive
items that are all sparse (xor or overwrite) over flat ranges:

* the batch's data sections are read together, each checked against its section digest;
* every frame is checked and all are decoded at once (``codec.decode_joined``, which the vLLM
  receiver's batched first pass shares);
* the items' regions are read with one ``pread`` per stretch of the file they cover (``segments``);
* one compiled call (``kernels._apply_batch``) decodes the positions, checks them against their
  regions, gathers the current bytes, computes the new ones in place and records the spans to write;
* each item's current bytes must digest to its ``pre`` and its new bytes to its ``post``.

Anything else (a box region, a replace item, an item not at its pre-image, any check that fails)
makes ``prepare_batch`` return None, and the caller takes the per-item path, which gives the
outcome (done, torn) or the error with its usual message. So this path changes the cost only:
what it accepts, the per-item path accepts with the same new bytes. Writes are whole spans of the
batch's buffer: each lies inside the regions of the batch's items (regions that follow each other
in one file), so no other item's elements are rewritten. The bytes are not held from the first pass
to the writes: only the new bytes and where they go; the writer reads the stretches again.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import blake3
import numpy as np

from ...delta.reader import Delta
from ...format.codec import decode_joined
from ...format.dtypes import dtype as lookup_dtype
from ...format.kernels import _apply_batch, scatter
from ...format.manifest import Item
from .inplace import GAP_BYTES, InPlaceFiles, scratch

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

# Batches of fewer items take the per-item path (nothing to save).
MIN_ITEMS = 2
# Unchanged bytes between two regions that one read covers rather than split in two.
READ_GAP_BYTES = 64 << 10
# Longest read (bounds the buffer of a batch whose items are spread over a file).
SEGMENT_BYTES = 8 << 20

# A batch of at least this many items is written in spans that may cover several items whose regions
# follow each other in a file (a few pwrites for hundreds of items: 2 us per item less at 48x128); a
# smaller batch is written item by item, as the per-item path writes (each item by writes of its own).
# Either way a write cut short leaves the items before it done, one torn and the rest pending.
JOIN_FROM = 16

INT32 = np.iinfo(np.int32).max

_ITEMSIZES: dict[str, int] = {}


def _itemsize(name: str) -> int:
    size = _ITEMSIZES.get(name)
    if size is None:
        size = _ITEMSIZES[name] = lookup_dtype(name).itemsize
    return size


@dataclass(slots=True)
class Batch:
    """What a batch writes: its regions' stretches of the files (``segments``), read again when written
    and patched (the new bytes ``new`` at offsets ``patch_at`` of the stretches read one after another),
    then written in the spans ``writes`` of them. ``new`` is None once dropped to save memory: the
    batch is prepared again when written. Nothing of the files' bytes is held in between (a fresh
    buffer per batch would cost more in page faults than the read)."""

    lo: int  # the items [lo, hi) of the manifest
    hi: int
    segments: list[tuple[Path, int, int, int]]  # (file, offset in the file, buf start, buf stop)
    patch_at: np.ndarray | None
    new: np.ndarray | None
    writes: list[tuple[Path, int, int, int]]  # (file, offset in the file, buf start, buf stop)

    @property
    def nbytes(self) -> int:
        return 0 if self.new is None or self.patch_at is None else int(self.new.nbytes + self.patch_at.nbytes)

    def drop(self) -> None:
        self.new = self.patch_at = None

    def compact(self) -> None:
        """Held for the write pass (the checked-first order): 32-bit patch offsets, half the memory."""
        if self.patch_at is not None and self.patch_at.dtype != np.int32 and self.segments[-1][3] <= INT32:
            self.patch_at = self.patch_at.astype(np.int32)

    def write(self, files: InPlaceFiles, stop: Callable[[], bool]) -> None:
        """Read the stretches again, patch them, pwrite every span; ``stop()`` is asked before each write
        (a failed write elsewhere cancels the rest)."""
        assert self.new is not None and self.patch_at is not None
        buf = scratch(self.segments[-1][3])
        view = buf.data
        for file, offset, a, b in self.segments:
            files.read_at(file, offset, view[a:b], str(file))
        scatter(buf, self.patch_at, self.new)
        for file, offset, a, b in self.writes:
            if stop():
                return
            files.write_at(file, offset, view[a:b])


def prepare_batch(
    delta: Delta, items: Sequence[Item], lo: int, files: InPlaceFiles, what: Callable[[int], str]
) -> Batch | None:
    """Check and compute the batch ``items`` (= manifest items [lo, lo + len)); None where the per-item
    path must decide (see the module doc). Raises only what the per-item path raises for the same
    sections (a section's read or digest: ``Delta.read_joined``)."""
    n = len(items)
    if n < MIN_ITEMS:
        return None
    locations = files.locations
    itemsizes = _ITEMSIZES
    file_ids: dict[Path, int] = {}
    last_file: Path | None = None
    last_id = -1
    rows: list[tuple[int, int, int, int, int, bool, int, int]] = []
    sections = []
    for item in items:
        region = item.region
        start, op, count = region.start, item.op, item.count
        if start is None or op == "replace" or not count:
            return None
        loc = locations[item.tensor]
        if loc.file is not last_file:
            last_file = loc.file
            last_id = file_ids.setdefault(last_file, len(file_ids))
        w = itemsizes.get(loc.dtype) or _itemsize(loc.dtype)
        data = item.data
        # file, file offset of the region, its elements, element width, count, xor, section length, positions
        size = region.stop - start  # type: ignore[operator]
        rows.append((last_id, loc.start + start * w, size, w, count, op == "xor", data.length, item.positions_length))
        sections.append(data)
    table = np.array(rows, dtype=np.int64)
    file_of, starts, sizes, widths, counts, xor, lengths, positions_lengths = np.ascontiguousarray(table.T)
    # -- sections: read and digest-checked together, then every frame checked and decoded at once
    frames = decode_joined(delta.read_joined(sections, what), lengths, positions_lengths, counts, widths)
    if frames is None:
        return None
    # -- the regions, read with one pread per stretch of a file they cover
    order = np.lexsort((starts, file_of))
    ends = starts + sizes * widths
    paths = list(file_ids)
    seg_file: list[int] = []
    seg_start: list[int] = []  # file offset
    seg_stop: list[int] = []
    segment_of: list[int] = []  # in visiting order
    for f, s, e in zip(file_of[order].tolist(), starts[order].tolist(), ends[order].tolist(), strict=True):
        # A region that overlaps the stretch stays in it (whatever its length), so stretches never share bytes
        # and the compiled call sees every overlap of regions (refused) within one stretch.
        if (
            seg_file
            and seg_file[-1] == f
            and (s < seg_stop[-1] or (s - seg_stop[-1] <= READ_GAP_BYTES and e - seg_start[-1] <= SEGMENT_BYTES))
        ):
            if e > seg_stop[-1]:
                seg_stop[-1] = e
        else:
            seg_file.append(f)
            seg_start.append(s)
            seg_stop.append(e)
        segment_of.append(len(seg_file) - 1)
    region_seg = np.empty(n, dtype=np.int64)
    region_seg[order] = segment_of
    seg_at = [0]
    for s, e in zip(seg_start, seg_stop, strict=True):
        seg_at.append(seg_at[-1] + e - s)
    buf = scratch(seg_at[-1])  # this thread's read buffer (nothing else reads into it meanwhile)
    view = buf.data
    for j, f in enumerate(seg_file):
        files.read_at(paths[f], seg_start[j], view[seg_at[j] : seg_at[j + 1]], items[0].tensor)
    region_at = (np.array(seg_at[:-1], dtype=np.int64) - np.array(seg_start, dtype=np.int64))[region_seg] + starts
    # -- one compiled call: positions, current and new bytes, spans
    out_at = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(counts * widths, out=out_at[1:])
    cur = np.empty(out_at[-1], dtype=np.uint8)
    new = np.empty(out_at[-1], dtype=np.uint8)
    patch_at = np.empty(out_at[-1], dtype=np.int64)
    spans = np.empty((int(counts.sum()), 3), dtype=np.int64)
    bad, n_spans = _apply_batch(
        frames.raw, frames.gaps_at, frames.gaps_len, frames.values_at, counts, widths, sizes, region_at, region_seg,
        xor != 0, order.astype(np.int64), buf, cur, new, patch_at, out_at, GAP_BYTES, n >= JOIN_FROM, spans,
    )  # fmt: skip
    if bad >= 0:
        return None
    # -- every item at its pre-image, and its new values at the post digest
    cur_view, new_view = cur.data, new.data
    edges = out_at.tolist()
    for k, item in enumerate(items):
        a, b = edges[k], edges[k + 1]
        if blake3.blake3(cur_view[a:b]).hexdigest() != item.pre:
            return None
        if blake3.blake3(new_view[a:b]).hexdigest() != item.post:
            return None
    writes = [(paths[seg_file[s]], seg_start[s] + a - seg_at[s], a, b) for a, b, s in spans[:n_spans].tolist()]
    segments = [(paths[f], seg_start[j], seg_at[j], seg_at[j + 1]) for j, f in enumerate(seg_file)]
    return Batch(lo, lo + n, segments, patch_at, new, writes)
