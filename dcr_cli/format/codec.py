"""Block codec (format_spec/delta-v1.md §6): positions, values and the diff kernel.

Positions are region-local element indices, strictly increasing. They are
stored as gaps (g0 = p0, gi = pi - p(i-1) - 1): one byte per gap, min(gap, 255),
then for each escaped gap (byte 255) the rest, gap - 255, as a u32 split into
four byte planes; all of it compressed as one zstd frame. Almost every gap of
a sparse change fits one byte, so the escape costs nothing where it is unused.
Values are the unsigned integers of the stored width, split into byte planes
(least significant plane first) and compressed as one zstd frame. Byte planes
put the rarely-changing high bytes of XOR masks next to each other, which is
what lets zstd get close to the entropy of the change.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass

import blake3
import numpy as np
import zstandard

from ..errors import IncompatibleError, IntegrityError
from .digest import digest_bytes
from .dtypes import DType
from .kernels import ESCAPE, byte_planes, escaped_gaps, merge_planes, positions_from_gaps, scan_changes, zstd_frames
from .manifest import Op, Region

# None selects dcr's tuned parameters; an int selects that standard zstd level.
DEFAULT_LEVEL: int | None = None


def check_level(level: object) -> None:
    """What the command line's ``--level`` type checks, for callers of the Python API: None (dcr's own
    parameters) or a zstd level from 1 to 22; else one IncompatibleError line before any work."""
    if level is not None and not (isinstance(level, int) and not isinstance(level, bool) and 1 <= level <= 22):
        raise IncompatibleError(f"level must be a zstd level from 1 to 22 (or None: dcr's own), not {level!r}")


# Above this change rate an item also tries a dense replace and keeps the smaller.
DENSE_TRIAL_RATE = 0.25


_CONTEXTS = threading.local()
_LITTLE = sys.byteorder == "little"


def _compressor(level: int | None) -> zstandard.ZstdCompressor:
    """This thread's compressor for ``level`` (a zstd context is not thread-safe, and building one
    costs more than compressing a small section; one-shot output does not depend on reuse)."""
    cache: dict[int | None, zstandard.ZstdCompressor] | None = getattr(_CONTEXTS, "compressors", None)
    if cache is None:
        cache = _CONTEXTS.compressors = {}
    cctx = cache.get(level)
    if cctx is None:
        cctx = cache[level] = new_compressor(level)
    return cctx


def _decompressor() -> zstandard.ZstdDecompressor:
    dctx: zstandard.ZstdDecompressor | None = getattr(_CONTEXTS, "decompressor", None)
    if dctx is None:
        dctx = _CONTEXTS.decompressor = zstandard.ZstdDecompressor()
    return dctx


def new_compressor(level: int | None) -> zstandard.ZstdCompressor:
    """A fresh compressor for ``level``: None selects dcr's tuned parameters."""
    if level is None:
        # Byte planes of sparse changes are low-entropy but nearly memoryless:
        # zstd's default levels spend bits on short, useless matches. A small
        # window and hash table with min_match 7 leave almost everything to
        # the Huffman literal coder, which lands within a few percent of the
        # order-0 entropy, and it is faster than level 3 (benchmarks/).
        params = zstandard.ZstdCompressionParameters(
            window_log=14,
            hash_log=6,
            chain_log=6,
            search_log=1,
            min_match=7,
            strategy=zstandard.STRATEGY_FAST,
            write_checksum=1,
            write_content_size=1,
        )
        return zstandard.ZstdCompressor(compression_params=params)
    return zstandard.ZstdCompressor(level=level, write_checksum=True, write_content_size=True)


def _to_planes(values: np.ndarray) -> np.ndarray:
    width = values.dtype.itemsize
    raw = np.ascontiguousarray(values).view(np.uint8)
    if width == 1:
        return raw
    return np.ascontiguousarray(raw.reshape(-1, width).T).reshape(-1)


def _from_planes(raw: np.ndarray, uint: np.dtype) -> np.ndarray:
    width = uint.itemsize
    if width > 1 and len(raw) <= width * SMALL_PLANES and uint.isnative and _LITTLE:
        # A transpose copy of a few KiB costs less than the compiled kernel's dispatch (the same values).
        return raw.reshape(width, -1).T.copy().view(uint).reshape(-1)
    return merge_planes(raw, uint)


def compress(data: np.ndarray, level: int | None) -> bytes:
    return _compressor(level).compress(np.ascontiguousarray(data).view(np.uint8).data)


# Up to this many values, byte planes are split by numpy's transpose copy: the compiled kernel's
# dispatch costs more than the copy of a few thousand bytes (an MoE diff encodes 100k such sections).
SMALL_PLANES = 1 << 12


def _planes(values: np.ndarray) -> bytes | memoryview:
    """``byte_planes(values)`` as a buffer, the cheapest way for the size (the same bytes either way)."""
    width = values.dtype.itemsize
    if width == 1:
        return np.ascontiguousarray(values).view(np.uint8).data
    if len(values) <= SMALL_PLANES and values.dtype.isnative:
        return np.ascontiguousarray(values).view(np.uint8).reshape(-1, width).T.tobytes()
    return byte_planes(values).data


def digest_small(values: np.ndarray) -> str:
    """``digest_bytes`` of a small array (one thread, no wrappers): the same digest."""
    return blake3.blake3(small_bytes(values)).hexdigest()


# Up to this many bytes an array's bytes are copied out (tobytes) rather than viewed: half the cost.
_COPY_BYTES = 16 << 10


def small_bytes(values: np.ndarray) -> bytes | memoryview:
    """The C-order bytes of an array, as a copy when it is small (cheaper than a contiguous view)."""
    if values.nbytes <= _COPY_BYTES:
        return values.tobytes()
    return np.ascontiguousarray(values).view(np.uint8).data


_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


def _check_single_frame(frame: bytes | memoryview, what: str) -> None:
    """The section must be exactly one zstd frame carrying its content checksum (format_spec §5.2).

    zstd's one-shot decoder stops after the first frame and ignores whatever
    follows, so the frame's extent is found by walking its block headers
    (RFC 8878 §3.1.1.2): a few bytes per 128 KiB block.
    """
    view = memoryview(frame).cast("B")
    end = len(view)
    try:
        pos = zstandard.frame_header_size(view)
    except zstandard.ZstdError:
        raise IntegrityError(f"{what}: not a zstd frame") from None
    # The magic, then the frame header descriptor: bit 2 is the Content_Checksum_flag (RFC 8878 §3.1.1.1.1).
    if end < 5 or view[:4] != _ZSTD_MAGIC:
        raise IntegrityError(f"{what}: not a zstd frame")
    if not view[4] & 0x04:
        raise IntegrityError(f"{what}: zstd frame carries no content checksum")
    while True:
        if pos + 3 > end:
            raise IntegrityError(f"{what}: zstd frame is truncated")
        header = view[pos] | view[pos + 1] << 8 | view[pos + 2] << 16
        kind = (header >> 1) & 3
        if kind == 3:
            raise IntegrityError(f"{what}: corrupt zstd frame (reserved block type)")
        pos += 4 if kind == 1 else 3 + (header >> 3)  # an RLE block stores its one byte
        if header & 1:  # last block
            break
    pos += 4  # content checksum
    if pos > end:
        raise IntegrityError(f"{what}: zstd frame is truncated")
    if pos < end:
        raise IntegrityError(f"{what}: {end - pos} bytes follow the zstd frame; a section holds exactly one")


def decompress_bounded(frame: bytes | memoryview, least: int, most: int, what: str) -> np.ndarray:
    """Decompress one zstd frame whose decoded size the manifest bounds in advance.

    The declared content size is checked before any output is allocated, so a
    frame cannot expand beyond what the manifest allows (decompression bombs).
    """
    try:
        declared = zstandard.frame_content_size(frame)
    except zstandard.ZstdError:
        raise IntegrityError(f"{what}: not a zstd frame") from None
    if not least <= declared <= most:
        raise IntegrityError(f"{what}: frame declares {declared} bytes, manifest allows {least}..{most}")
    _check_single_frame(frame, what)
    try:
        out = _decompressor().decompress(frame, max_output_size=declared)
    except zstandard.ZstdError as exc:
        raise IntegrityError(f"{what}: corrupt zstd frame ({exc})") from None
    if len(out) != declared:
        raise IntegrityError(f"{what}: decoded {len(out)} bytes, frame declared {declared}")
    return np.frombuffer(out, dtype=np.uint8)


def decompress_exact(frame: bytes | memoryview, expected: int, what: str) -> np.ndarray:
    return decompress_bounded(frame, expected, expected, what)


def encode_positions(positions: np.ndarray, level: int | None = DEFAULT_LEVEL) -> bytes:
    return compress(escaped_gaps(positions), level)


def decode_positions(frame: bytes | memoryview, count: int, region_size: int, what: str) -> np.ndarray:
    raw = decompress_bounded(frame, count, 5 * count, what + " positions")
    positions, escapes = positions_from_gaps(raw, count)
    if escapes < 0:
        escapes = -escapes - 1
        raise IntegrityError(f"{what} positions: {escapes} escapes need {count + 4 * escapes} bytes")
    if count and positions[-1] >= region_size:
        raise IntegrityError(f"{what}: a position lies outside its region of {region_size} elements")
    return positions


def encode_values(values: np.ndarray, level: int | None = DEFAULT_LEVEL) -> bytes:
    return _compressor(level).compress(_planes(values))


def decode_values(frame: bytes | memoryview, count: int, dt: DType, what: str) -> np.ndarray:
    raw = decompress_exact(frame, dt.itemsize * count, what + " values")
    return _from_planes(raw, dt.uint)


@dataclass
class EncodedItem:
    """An item before it is placed into blocks: fields plus the bytes of its sections."""

    tensor: str
    region: Region
    op: Op
    count: int
    data: bytes
    positions_length: int
    pre: str
    post: str
    repair: bytes | None = None
    residual: str | None = None
    changed: int | None = None


def diff_region(
    tensor: str,
    region: Region,
    base: np.ndarray,
    new: np.ndarray,
    *,
    op: Op = "xor",
    level: int | None = DEFAULT_LEVEL,
    residual: str | None = None,
) -> EncodedItem | None:
    """Compare two equal-width unsigned views of one region and encode the change.

    ``base`` and ``new`` are flat arrays in the region's C order. ``op`` is
    "xor" where the receiver's path preserves stored bits and "overwrite"
    where it does not; either may become a dense "replace" when that is smaller.
    Returns None when no element changed.
    """
    if base.dtype != new.dtype or base.shape != new.shape:
        raise ValueError("base and new must be same-shape views of one dtype")
    positions, masks, changed_new = scan_changes(base, new)
    return encode_changes(
        tensor, region, positions, masks, changed_new, len(base), lambda: (base, new), op=op, level=level,
        residual=residual,
    )  # fmt: skip


def encode_changes(
    tensor: str,
    region: Region,
    positions: np.ndarray,
    masks: np.ndarray,
    changed_new: np.ndarray,
    size: int,
    dense: Callable[[], tuple[np.ndarray, np.ndarray]],
    *,
    op: Op = "xor",
    level: int | None = DEFAULT_LEVEL,
    residual: str | None = None,
    defer: bool = False,
) -> EncodedItem | None:
    """Encode a scanned change of a region of ``size`` elements (what ``diff_region`` does after its scan).

    ``positions`` (increasing, region-local), ``masks`` (base XOR new) and ``changed_new`` are the
    changed elements, however they were found (the numba kernel, or torch on the tensors' device);
    ``dense()`` returns the region's whole flat (base, new), needed only for the dense trial.
    With ``defer``, a sparse item that needs no dense trial is returned as a :class:`PendingItem`:
    its frames are compressed by whoever calls ``encode()`` (the delta writer), the same bytes.
    """
    count = len(positions)
    if count == 0:
        return None
    pending = _sparse(tensor, region, op, positions, masks, changed_new, level, residual)
    if count < DENSE_TRIAL_RATE * size:
        return pending if defer else pending.encode()
    sparse = pending.encode()
    base, new = dense()
    dense_frame = encode_values(new, level)
    if len(dense_frame) >= len(sparse.data):
        return sparse
    return EncodedItem(
        tensor=tensor,
        region=region,
        op="replace",
        count=len(new),
        data=dense_frame,
        positions_length=0,
        pre=digest_bytes(base),
        post=digest_bytes(new),
        residual=residual,
        changed=count,
    )


def _sparse(
    tensor: str,
    region: Region,
    op: Op,
    positions: np.ndarray,
    masks: np.ndarray,
    changed_new: np.ndarray,
    level: int | None,
    residual: str | None,
) -> PendingItem:
    """The sparse item of a scanned change, its frames not compressed yet (``encode()`` compresses them):
    escaped gaps and byte planes, each to be one zstd frame, and the digests of the changed elements."""
    count = len(positions)
    xor = op == "xor"
    small = count <= SMALL_PLANES
    digest = digest_small if small else digest_bytes
    return PendingItem(
        tensor,
        region,
        op,
        count,
        digest(masks ^ changed_new),
        digest(changed_new),
        residual,
        (escaped_gaps(positions).data, _planes(masks if xor else changed_new), _planes(changed_new) if xor else None),
        level,
    )


class PendingItem(EncodedItem):
    """A sparse item whose sections are not compressed yet: their bytes, and ``encode()`` to compress them.

    ``dcr diff`` hands these from the scanning workers to the delta writer's thread, which compresses
    them (three zstd frames: a sixth of a large tensor's work after the scan) while the workers scan
    on. ``encode()`` returns exactly the item ``encode_changes`` returns without ``defer``. Its own
    ``data`` and ``positions_length`` are empty; ``held_bytes`` is what it holds until it is encoded.
    """

    def __init__(
        self,
        tensor: str,
        region: Region,
        op: Op,
        count: int,
        pre: str,
        post: str,
        residual: str | None,
        raw: tuple[bytes | memoryview, bytes | memoryview, bytes | memoryview | None],
        level: int | None,
    ) -> None:
        super().__init__(tensor, region, op, count, b"", 0, pre, post, None, residual)
        self.raw = raw
        self.level = level

    @property
    def held_bytes(self) -> int:
        return sum(len(r) for r in self.raw if r is not None)

    def encode(self) -> EncodedItem:
        cctx = _compressor(self.level)
        gaps, values, repair = self.raw
        positions_frame = cctx.compress(gaps)
        return EncodedItem(
            self.tensor,
            self.region,
            self.op,
            self.count,
            positions_frame + cctx.compress(values),
            len(positions_frame),
            self.pre,
            self.post,
            None if repair is None else cctx.compress(repair),
            self.residual,
        )


_new_object = object.__new__
_set_dict = object.__setattr__


def encode_span(
    names: list[str],
    ops: list[Op],
    starts: list[int],
    ends: list[int],
    cuts: list[int],
    positions: np.ndarray,
    masks: np.ndarray,
    changed_new: np.ndarray,
    dense: Callable[[int], tuple[np.ndarray, np.ndarray]],
    *,
    level: int | None = DEFAULT_LEVEL,
) -> list[EncodedItem | None]:
    """The items of neighbouring whole tensors scanned as one span: exactly ``encode_changes`` of each.

    Tensor ``i`` is elements [starts[i], ends[i]) of the span (in increasing order, disjoint) and its
    changes are entries [cuts[i], cuts[k + i]) of the span's scan (``positions`` span-local, ``masks``,
    ``changed_new``); its item is a flat range [0, ends[i] - starts[i]) of tensor ``names[i]`` with op
    ``ops[i]``. ``dense(i)`` returns tensor i's whole (base, new), for its dense trial.

    The span's gaps, byte planes and pre values are computed once, in a few numpy passes over all of
    its changes, laid out so that each tensor's section is one contiguous slice; per tensor there
    remain its zstd frames and digests (an MoE diff encodes 100k tensors of a few KiB). A tensor
    due a dense trial (a quarter of it changed) takes ``encode_changes`` itself.
    """
    k = len(names)
    total = len(positions)
    items: list[EncodedItem | None] = [None] * k
    if total == 0:
        return items
    width = masks.dtype.itemsize
    if not (masks.dtype.isnative and changed_new.dtype.isnative and _LITTLE):  # byte views are not LE planes
        for i in range(k):
            i0, i1, e0 = cuts[i], cuts[k + i], starts[i]
            items[i] = encode_changes(
                names[i], Region.range(0, ends[i] - e0), positions[i0:i1] - e0, masks[i0:i1], changed_new[i0:i1],
                ends[i] - e0, _bound(dense, i), op=ops[i], level=level,
            )  # fmt: skip
        return items
    lo = np.asarray(cuts[:k], dtype=np.int64)
    hi = np.asarray(cuts[k:], dtype=np.int64)
    counts = hi - lo
    owned = int(counts.sum())
    if owned != total:  # changes between the tensors (bytes of no tensor of the run): left out
        marks = np.zeros(total + 1, dtype=np.int64)
        np.add.at(marks, lo, 1)
        np.add.at(marks, hi, -1)
        keep = np.cumsum(marks[:-1]) > 0
        positions, masks, changed_new = positions[keep], masks[keep], changed_new[keep]
        total = owned
        hi = np.cumsum(counts)
        lo = hi - counts
        cuts = lo.tolist() + hi.tolist()
        if total == 0:
            return items
    has = counts > 0
    # Gaps as the format codes them (g0 = p0 - region start, gi = pi - p(i-1) - 1), for every tensor at once.
    gaps = np.empty(total, dtype=np.int64)
    gaps[0] = positions[0]
    np.subtract(positions[1:], positions[:-1], out=gaps[1:])
    gaps[1:] -= 1
    firsts = lo[has]
    gaps[firsts] = positions[firsts] - np.asarray(starts, dtype=np.int64)[has]
    # Each tensor's positions section, tensor after tensor: its gap bytes (min(gap, 255)), then the
    # rest (gap - 255) of each of its escaped gaps as four byte planes (delta-v1 §6.1).
    escaped = np.flatnonzero(gaps >= ESCAPE)
    if len(escaped):
        escapes_to = np.zeros(total + 1, dtype=np.int64)  # escapes among the first j gaps
        escapes_to[escaped + 1] = 1
        np.cumsum(escapes_to, out=escapes_to)
        before = escapes_to[lo]  # escapes of the tensors before each one
        escapes = escapes_to[hi] - before
        out = np.empty(total + 4 * len(escaped), dtype=np.uint8)
        out[np.arange(total, dtype=np.int64) + 4 * np.repeat(before, counts)] = np.minimum(gaps, ESCAPE)
        rest = gaps[escaped] - ESCAPE
        owner = np.repeat(np.arange(k), escapes)
        at = (lo + 3 * before + counts)[owner] + np.arange(len(escaped), dtype=np.int64)
        step = escapes[owner]
        for plane in range(4):
            out[at] = (rest >> (8 * plane)) & 0xFF
            at += step
        gap_bytes = out.tobytes()
        sections = (lo + 4 * before).tolist() + (hi + 4 * escapes_to[hi]).tolist()
    else:
        gap_bytes = gaps.astype(np.uint8).tobytes()
        sections = cuts
    xors = [op == "xor" for op in ops]
    pre_values = masks ^ changed_new
    # Byte planes of every tensor's values, tensor after tensor: tensor t's plane j of its element at
    # local index l goes to width * lo[t] + j * count[t] + l, so its planes are one slice.
    if width == 1:
        planes_masks = masks.tobytes() if any(xors) else b""
        planes_news = changed_new.tobytes()
    else:
        owner_lo = np.repeat(lo, counts)
        owner_count = np.repeat(counts, counts)
        base_at = np.arange(total, dtype=np.int64) + (width - 1) * owner_lo  # width * lo + (index - lo)

        def planes(values: np.ndarray) -> bytes:
            raw = values.view(np.uint8).reshape(total, width)
            out = np.empty(total * width, dtype=np.uint8)
            at = base_at.copy()
            for j in range(width):
                out[at] = raw[:, j]
                at += owner_count
            return out.tobytes()

        planes_masks = planes(masks) if any(xors) else b""
        planes_news = planes(changed_new)
    gap_view, mask_view, news_view = memoryview(gap_bytes), memoryview(planes_masks), memoryview(planes_news)
    pre_view, post_view = memoryview(pre_values.tobytes()), memoryview(changed_new.tobytes())
    cctx = _compressor(level)
    compress = cctx.compress
    hasher = blake3.blake3
    new_item, set_dict = _new_object, _set_dict
    regions: dict[int, Region] = {}  # a run's tensors are of a few sizes (a Region is immutable)
    for i in range(k):
        i0, i1 = cuts[i], cuts[k + i]
        count = i1 - i0
        if count == 0:
            continue
        e0 = starts[i]
        size = ends[i] - e0
        region = regions.get(size)
        if region is None:
            region = regions[size] = Region.range(0, size)
        if count >= DENSE_TRIAL_RATE * size:
            items[i] = encode_changes(
                names[i], Region.range(0, size), positions[i0:i1] - e0, masks[i0:i1], changed_new[i0:i1], size,
                _bound(dense, i), op=ops[i], level=level,
            )  # fmt: skip
            continue
        b0, b1 = width * i0, width * i1
        positions_frame = compress(gap_view[sections[i] : sections[k + i]])
        xor = xors[i]
        values_frame = compress((mask_view if xor else news_view)[b0:b1])
        item = new_item(EncodedItem)  # EncodedItem(...) without the dataclass's __init__: the same instance
        set_dict(item, "__dict__", {
            "tensor": names[i], "region": region, "op": ops[i], "count": count,
            "data": positions_frame + values_frame, "positions_length": len(positions_frame),
            "pre": hasher(pre_view[b0:b1]).hexdigest(), "post": hasher(post_view[b0:b1]).hexdigest(),
            "repair": compress(news_view[b0:b1]) if xor else None, "residual": None, "changed": None,
        })  # fmt: skip
        items[i] = item
    return items


Pair = tuple[np.ndarray, np.ndarray]


def _bound(dense: Callable[[int], Pair], i: int) -> Callable[[], Pair]:
    return lambda: dense(i)


@dataclass
class DecodedItem:
    positions: np.ndarray | None  # region-local; None for replace (all elements)
    values: np.ndarray  # xor masks or target values, as dt.uint


def decode_data(
    data: bytes | memoryview, positions_length: int, op: Op, count: int, region_size: int, dt: DType, what: str
) -> DecodedItem:
    view = memoryview(data)
    if op == "replace":
        return DecodedItem(None, decode_values(view, count, dt, what))
    positions = decode_positions(view[:positions_length], count, region_size, what)
    values = decode_values(view[positions_length:], count, dt, what)
    return DecodedItem(positions, values)


def apply_values(op: Op, current: np.ndarray, values: np.ndarray) -> np.ndarray:
    """New stored values of the affected elements, from their current values."""
    if op == "xor":
        return np.bitwise_xor(current, values)
    return values


@dataclass(slots=True)
class JoinedFrames:
    """The data sections of sparse items decoded together (``decode_joined``): item k's escaped gaps are
    ``raw[gaps_at[k]:gaps_at[k] + gaps_len[k]]`` and its byte planes start at ``raw[values_at[k]]``."""

    raw: np.ndarray  # uint8: every frame decoded, one after another
    gaps_at: np.ndarray  # int64, per item
    gaps_len: np.ndarray
    values_at: np.ndarray


def decode_joined(
    blob: bytes, lengths: np.ndarray, positions_lengths: np.ndarray, counts: np.ndarray, widths: np.ndarray
) -> JoinedFrames | None:
    """The data sections of sparse (xor, overwrite) items, one after another in ``blob`` (each already
    checked against its section digest), decoded at once: every frame's header and block headers
    checked by one compiled walk (``kernels.zstd_frames``: one standard frame with a content size and a
    checksum that fills its part of the section exactly), its declared size against the item's bounds
    (§6.1, §6.2), and all frames decoded by one zstd call, which checks each frame's content checksum
    and size. int64 arrays, one entry per item.

    None where anything is wrong: the caller then decodes item by item (``decode_data``), which names
    the item and the error. What this accepts, ``decode_data`` accepts with the same bytes.
    """
    n = lengths.shape[0]
    bounds = np.empty(2 * n + 1, dtype=np.int64)  # frame f is blob[bounds[f]:bounds[f + 1]]
    bounds[0] = 0
    np.cumsum(lengths, out=bounds[2::2])
    bounds[1:-1:2] = bounds[0:-1:2] + positions_lengths
    declared, refused = zstd_frames(np.frombuffer(blob, dtype=np.uint8), bounds[:-1], bounds[1:])
    if refused >= 0:
        return None
    gaps_len, values_len = declared[0::2], declared[1::2]
    if (gaps_len < counts).any() or (gaps_len > 5 * counts).any() or (values_len != widths * counts).any():
        return None
    frame_spans = np.stack([bounds[:-1], bounds[1:] - bounds[:-1]], axis=1).astype(np.uint64)
    try:
        frames = _decompressor().multi_decompress_to_buffer(
            zstandard.BufferWithSegments(blob, frame_spans.tobytes()),
            decompressed_sizes=declared.astype(np.uint64).tobytes(),
            threads=1,
        )
        raw = np.frombuffer(b"".join(frames[f] for f in range(2 * n)), dtype=np.uint8)  # type: ignore[misc]
    except zstandard.ZstdError:
        return None
    out = np.zeros(2 * n + 1, dtype=np.int64)
    np.cumsum(declared, out=out[1:])
    if raw.shape[0] != out[-1]:
        return None
    return JoinedFrames(raw, out[0:-1:2], gaps_len, out[1:-1:2])
