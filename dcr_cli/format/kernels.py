"""The change scan: one pass over two equal-width integer arrays, in compiled code.

Finding the changed elements is the hot loop of ``dcr diff``. In numpy it takes an XOR pass, a
nonzero pass (branchy, ~2x slower than the XOR itself) and gathers. This kernel compares 64-bit
words first, 64 at a time into a bit mask, which skips the ~90% of words that did not change at
vector speed, and then expands the changed words into elements from registers, writing results
branch-free. It reads each input once and runs faster than a plain numpy XOR-and-count pass
(benchmarks/bench_diff.py).
"""

from __future__ import annotations

from collections.abc import Callable

import numba
import numpy as np
from numba.cpython.unsafe.numbers import trailing_zeros

# Absolute, so that a copy of this file loaded on its own still finds it (see _numba_cache).
from dcr_cli.format._numba_cache import cacheable

_CACHE = cacheable(globals())

# Words compared per group: their changed-or-not bits make one 64-bit mask.
GROUP_WORDS = 64
# Arrays of at most this many elements are scanned with outputs for all of them (no regrowth).
SMALL_SCAN = 1 << 15


def _make_scan_words(lanes: int, release_gil: bool = True) -> Callable[..., tuple[int, int]]:
    """The scan kernel for elements of 64 / ``lanes`` bits, with the lane count fixed at compile time.

    A group of 64 word comparisons becomes one bit mask (a loop LLVM vectorizes: it reads the group
    through fixed-size slices, so the bounds of the loop are compile-time constants); only the set
    bits are visited (count trailing zeros), and each changed word is expanded from the word itself
    (lane j holds bits 64/lanes*j and up: the little-endian element order), so each input word is
    loaded once and unchanged words cost a vector compare.
    """
    bits = 64 // lanes
    lane_mask = np.uint64((1 << bits) - 1)
    holds_gil = not release_gil  # a closure value: the two variants are cached apart (numba keys on closures)
    u = np.uint64
    group = u(GROUP_WORDS)
    width = u(lanes)

    @numba.njit(nogil=release_gil, cache=_CACHE, boundscheck=False)
    def scan_words(base_words, new_words, word_at, end_at, k_at, positions, masks, news):
        # Scans words [word, end), appending at ``k``; stops early when a group might not fit.
        # Returns (k, next word); the caller grows the outputs and resumes while next word < end.
        # Every index is unsigned: numba wraps negative signed indices around, a test and a mask on
        # every access that also keeps LLVM from vectorizing the group's comparison.
        if holds_gil:
            pass
        capacity = u(positions.shape[0])
        word, end, k = u(word_at), u(end_at), u(k_at)
        while word < end:
            size = min(group, end - word)
            if k + size * width > capacity:
                return np.int64(k), np.int64(word)
            changed = u(0)
            if size == group:
                b_group = base_words[word : word + group]
                n_group = new_words[word : word + group]
                for j in range(GROUP_WORDS):
                    changed |= u(b_group[j] != n_group[j]) << u(j)
            else:
                for j in range(size):
                    at = u(j)
                    changed |= u(base_words[word + at] != new_words[word + at]) << at
            while changed != u(0):
                w = word + u(trailing_zeros(changed))
                changed &= changed - u(1)
                new_word = new_words[w]
                xor_word = base_words[w] ^ new_word
                first = w * width
                for j in range(lanes):
                    shift = u(bits * j)
                    x = (xor_word >> shift) & lane_mask
                    positions[k] = np.int64(first + u(j))
                    masks[k] = x
                    news[k] = (new_word >> shift) & lane_mask
                    k += u(x != u(0))
            word += size
        return np.int64(k), np.int64(word)

    return scan_words


_SCAN_WORDS = {lanes: _make_scan_words(lanes) for lanes in (1, 2, 4, 8)}
# For arrays of at most SMALL_SCAN elements the scan takes microseconds: releasing the GIL for it
# only hands the interpreter to another worker and waits to get it back (an MoE diff scans 100k
# such tensors on every core), so the small variant keeps it.
_SCAN_WORDS_HELD = {lanes: _make_scan_words(lanes, release_gil=False) for lanes in (1, 2, 4, 8)}


def scan_changes(
    base: np.ndarray,
    new: np.ndarray,
    *,
    tile: int = 0,
    after: Callable[[int, int], None] | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Positions (int64, increasing), XOR masks and new values of the elements that differ.

    With ``after``, the scan runs in tiles of about ``tile`` elements and calls ``after(start,
    stop)`` once each tile's elements have been compared, while they are still in cache (the
    engine feeds the same bytes to the BLAKE3 hasher). The tiles cover [0, len) in order.
    """
    n = base.shape[0]
    lanes = 8 // base.dtype.itemsize
    full = (n // lanes) * lanes
    scan_words = (_SCAN_WORDS_HELD if n <= SMALL_SCAN else _SCAN_WORDS)[lanes]
    base_words, new_words = base[:full].view(np.uint64), new[:full].view(np.uint64)
    n_words = len(base_words)
    # Sized for a sparse change; a dense one grows it a few times (amortized, like a list). A small
    # array gets room for every element: the kernel stops before a group that might not fit, and
    # growing and resuming costs more than the scan of a few thousand elements.
    capacity = n if n <= SMALL_SCAN else max(GROUP_WORDS * lanes, n // 16)
    positions = np.empty(capacity, dtype=np.int64)
    masks = np.empty(capacity, dtype=base.dtype)
    news = np.empty(capacity, dtype=base.dtype)
    # Tiles are whole groups of words, so that tiling never changes what the kernel computes.
    step = n_words if after is None else max(GROUP_WORDS, (max(1, tile) // lanes) // GROUP_WORDS * GROUP_WORDS)
    k, start, last = 0, 0, 0
    while start < n_words:
        end = min(n_words, start + step)
        word = start
        while True:
            k, word = scan_words(base_words, new_words, word, end, k, positions, masks, news)
            if word >= end:
                break
            capacity = min(n, 2 * capacity)
            positions, masks, news = (
                np.concatenate([a[:k], np.empty(capacity - k, a.dtype)]) for a in (positions, masks, news)
            )
        if after is not None and end < n_words:
            after(start * lanes, end * lanes)
        start, last = end, start
    tail = np.flatnonzero(base[full:] != new[full:]) + full  # fewer than one word's elements
    if len(tail):
        positions = np.concatenate([positions[:k], tail])
        masks = np.concatenate([masks[:k], base[tail] ^ new[tail]])
        news = np.concatenate([news[:k], new[tail]])
        k += len(tail)
    if after is not None and n:
        after(last * lanes, n)  # the last tile, with the tail
    return positions[:k], masks[:k], news[:k]


@numba.njit(nogil=True, cache=_CACHE, boundscheck=False)
def _escaped_gaps(positions, out):
    k = positions.shape[0]
    escapes = 0
    last = -1
    for t in range(k):
        gap = positions[t] - last - 1
        last = positions[t]
        if gap >= ESCAPE:
            out[t] = ESCAPE
            escapes += 1
        else:
            out[t] = gap
    e = 0
    last = -1
    for t in range(k):
        gap = positions[t] - last - 1
        last = positions[t]
        if gap >= ESCAPE:
            rest = gap - ESCAPE
            out[k + e] = rest & 0xFF
            out[k + escapes + e] = (rest >> 8) & 0xFF
            out[k + 2 * escapes + e] = (rest >> 16) & 0xFF
            out[k + 3 * escapes + e] = (rest >> 24) & 0xFF
            e += 1
    return k + 4 * escapes


ESCAPE = 255
# Above every region size (regions hold at most 2^31 elements): a decoded position that reaches it is
# refused by the caller's bound check, and saturating there keeps 2^31 gaps of 2^32 from wrapping.
POSITION_CEILING = 1 << 40


@numba.njit(nogil=True, cache=_CACHE, boundscheck=False)
def _positions_from_gaps(raw, count, out):  # pragma: no cover - compiled
    # Escaped gaps (delta-v1 §6.1) back to positions, in one pass each over the gaps and escapes.
    # Returns the number of escapes, or -(escapes + 1) when the bytes after the gaps are not 4 per escape.
    escapes = 0
    for t in range(count):
        if raw[t] == ESCAPE:
            escapes += 1
    if raw.shape[0] != count + 4 * escapes:
        return -(escapes + 1)
    e = 0
    last = np.int64(-1)
    for t in range(count):
        gap = np.int64(raw[t])
        if gap == ESCAPE:
            gap += (
                np.int64(raw[count + e])
                | (np.int64(raw[count + escapes + e]) << 8)
                | (np.int64(raw[count + 2 * escapes + e]) << 16)
                | (np.int64(raw[count + 3 * escapes + e]) << 24)
            )
            e += 1
        last += gap + 1
        if last > POSITION_CEILING:  # already outside any region: saturate rather than overflow int64
            last = np.int64(POSITION_CEILING)
        out[t] = last
    return escapes


def positions_from_gaps(raw: np.ndarray, count: int) -> tuple[np.ndarray, int]:
    """(positions, escapes) from ``count`` escaped gaps and their escapes' byte planes (the inverse of
    ``escaped_gaps``); escapes is negative, -(escapes + 1), when ``raw`` has not 4 bytes per escape."""
    out = np.empty(count, dtype=np.int64)
    if count == 0:
        return out, (0 if raw.shape[0] == 0 else -1)
    return out, int(_positions_from_gaps(raw, count, out))


def escaped_gaps(positions: np.ndarray) -> np.ndarray:
    """Strictly increasing positions coded as escaped gaps (format_spec/delta-v1.md §6.1)."""
    out = np.empty(5 * len(positions), dtype=np.uint8)
    size = _escaped_gaps(positions.astype(np.int64, copy=False), out) if len(positions) else 0
    return out[:size]


@numba.njit(nogil=True, cache=_CACHE, boundscheck=False)
def _split_planes(values, width, out):
    # Plane by plane, each a shift-and-mask over all values (a loop LLVM vectorizes).
    n = values.shape[0]
    for j in range(width):
        shift = np.uint64(8 * j)
        plane = out[j * n : (j + 1) * n]
        for i in range(n):
            plane[i] = (np.uint64(values[i]) >> shift) & np.uint64(0xFF)


def byte_planes(values: np.ndarray) -> np.ndarray:
    """Little-endian unsigned values as byte planes, least significant plane first (delta-v1 §6.2)."""
    flat = np.ascontiguousarray(values).reshape(-1)
    if flat.dtype.itemsize == 1:
        return flat.view(np.uint8)
    out = np.empty(flat.nbytes, dtype=np.uint8)
    _split_planes(flat.astype(flat.dtype.newbyteorder("="), copy=False), flat.dtype.itemsize, out)
    return out


@numba.njit(nogil=True, cache=_CACHE, boundscheck=False)
def _merge_planes(raw, width, out):
    # The inverse of _split_planes: out[i] = sum of plane j's byte i << 8j (a loop LLVM vectorizes).
    n = out.shape[0]
    for i in range(n):
        out[i] = raw[i]
    for j in range(1, width):
        shift = 8 * j
        plane = raw[j * n : (j + 1) * n]
        for i in range(n):
            out[i] |= np.uint64(plane[i]) << np.uint64(shift)


def merge_planes(raw: np.ndarray, uint: np.dtype) -> np.ndarray:
    """Byte planes (least significant first, as ``byte_planes`` writes them) back to unsigned values."""
    width = uint.itemsize
    if width == 1:
        return raw.view(uint)
    out = np.empty(len(raw) // width, dtype=uint.newbyteorder("="))
    if len(out):
        _merge_planes(raw, width, out)
    return out.view(uint)


# --------------------------------------------------------------------------- batches of small items (receivers)


@numba.njit(nogil=True, cache=_CACHE, boundscheck=False)
def _zstd_frames(blob, starts, ends, declared):  # pragma: no cover - compiled
    # Each blob[starts[f]:ends[f]] must be exactly one standard zstd frame (RFC 8878 §3.1.1) with a
    # content size, a content checksum and no dictionary id: the frames ``codec.decompress_bounded``
    # accepts, found by the same walk over block headers. Its content size goes to declared[f].
    # Returns the first frame that is not such a frame, or -1 (a caller then takes the checked
    # one-frame-at-a-time path, which says what is wrong).
    for f in range(starts.shape[0]):
        pos = np.int64(starts[f])
        end = np.int64(ends[f])
        if end - pos < 6:
            return f
        if blob[pos] != 0x28 or blob[pos + 1] != 0xB5 or blob[pos + 2] != 0x2F or blob[pos + 3] != 0xFD:
            return f
        fhd = np.int64(blob[pos + 4])
        fcs_flag = fhd >> 6
        single = (fhd >> 5) & 1
        if (fhd >> 3) & 1 or not (fhd >> 2) & 1 or fhd & 3:  # reserved bit, no checksum, a dictionary id
            return f
        p = pos + 5 + (1 - single)  # the window descriptor, where the frame is not single-segment
        if fcs_flag == 0:
            fcs = np.int64(single)  # 1 byte, or no content size at all
        elif fcs_flag == 1:
            fcs = np.int64(2)
        elif fcs_flag == 2:
            fcs = np.int64(4)
        else:
            fcs = np.int64(8)
        if fcs == 0 or p + fcs > end:
            return f
        size = np.int64(0)
        for j in range(fcs):
            size |= np.int64(blob[p + j]) << np.int64(8 * j)
        if fcs == 2:
            size += 256
        if size < 0:
            return f
        declared[f] = size
        p += fcs
        while True:
            if p + 3 > end:
                return f
            header = np.int64(blob[p]) | (np.int64(blob[p + 1]) << 8) | (np.int64(blob[p + 2]) << 16)
            kind = (header >> 1) & 3
            if kind == 3:
                return f
            p += 4 if kind == 1 else 3 + (header >> 3)
            if header & 1:
                break
        p += 4
        if p != end:
            return f
    return -1


def zstd_frames(blob: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, int]:
    """(declared content sizes, first frame refused or -1) of the frames blob[starts[f]:ends[f]] (int64 bounds)."""
    declared = np.zeros(starts.shape[0], dtype=np.int64)
    if starts.shape[0] == 0:
        return declared, -1
    return declared, int(_zstd_frames(blob, starts, ends, declared))


@numba.njit(nogil=True, cache=_CACHE, boundscheck=False)
def _apply_batch(raw, gaps_at, gaps_len, values_at, counts, widths, sizes, region_at, region_seg, xor, order,
                 buf, cur, new, patch_at, out_at, gap_bytes, join, spans):  # fmt: skip  # pragma: no cover - compiled
    # Items of one batch, each a flat region of ``sizes[k]`` elements of ``widths[k]`` bytes that
    # starts at buf[region_at[k]]: decode its escaped gaps (raw[gaps_at[k]:+gaps_len[k]], delta-v1 §6.1)
    # and its byte planes (raw[values_at[k]:], §6.2); copy each affected element's current bytes to
    # cur and its new bytes (current XOR mask, or the absolute value) to new, at out_at[k] on, in
    # position order (what the item's pre and post digests cover), and where each new byte goes in buf
    # to patch_at (buf itself is left as read: a writer reads it again and patches it).
    # Visiting the items in ``order`` (by region), it records the spans of buf to write: cut where
    # more than gap_bytes lie unchanged between two elements and wherever the next region does not
    # start where the last one ended in the same segment (a span lies inside the batch's regions);
    # without ``join``, at every item's boundary (each item written by writes of its own).
    # Returns (the first item refused, or -1; spans). Refused: regions that overlap, gaps whose
    # escapes do not match their bytes, a position outside its region.
    n_spans = 0
    lo = np.int64(-1)
    hi = np.int64(-1)
    seg = np.int64(-1)
    prev_end = np.int64(-1)
    prev_seg = np.int64(-1)
    for oi in range(order.shape[0]):
        k = order[oi]
        w = np.int64(widths[k])
        c = np.int64(counts[k])
        start = np.int64(region_at[k])
        s = np.int64(region_seg[k])
        if s == prev_seg and start < prev_end:
            return k, n_spans
        if lo >= 0 and not (join and s == prev_seg and start == prev_end):
            spans[n_spans, 0] = lo
            spans[n_spans, 1] = hi
            spans[n_spans, 2] = seg
            n_spans += 1
            lo = np.int64(-1)
        g = np.int64(gaps_at[k])
        escapes = np.int64(0)
        for t in range(c):
            if raw[g + t] == ESCAPE:
                escapes += 1
        if np.int64(gaps_len[k]) != c + 4 * escapes:
            return k, n_spans
        size = np.int64(sizes[k])
        v = np.int64(values_at[k])
        o = np.int64(out_at[k])
        is_xor = xor[k]
        e = np.int64(0)
        last = np.int64(-1)
        for t in range(c):
            gap = np.int64(raw[g + t])
            if gap == ESCAPE:
                gap += (
                    np.int64(raw[g + c + e])
                    | (np.int64(raw[g + c + escapes + e]) << 8)
                    | (np.int64(raw[g + c + 2 * escapes + e]) << 16)
                    | (np.int64(raw[g + c + 3 * escapes + e]) << 24)
                )
                e += 1
            last += gap + 1
            if last >= size:
                return k, n_spans
            b = start + last * w
            for j in range(w):
                now = buf[b + j]
                plane = raw[v + j * c + t]
                cur[o + t * w + j] = now
                new[o + t * w + j] = now ^ plane if is_xor else plane
                patch_at[o + t * w + j] = b + j
            if lo >= 0 and b - hi <= gap_bytes:
                hi = b + w
            else:
                if lo >= 0:
                    spans[n_spans, 0] = lo
                    spans[n_spans, 1] = hi
                    spans[n_spans, 2] = seg
                    n_spans += 1
                lo = b
                hi = b + w
                seg = s
        prev_end = start + size * w
        prev_seg = s
    if lo >= 0:
        spans[n_spans, 0] = lo
        spans[n_spans, 1] = hi
        spans[n_spans, 2] = seg
        n_spans += 1
    return np.int64(-1), n_spans


# --------------------------------------------------------------------------- scattered writes (receivers)


@numba.njit(nogil=True, cache=_CACHE, boundscheck=False)
def _scatter(out, index, values, offset):  # pragma: no cover - compiled
    # One pass; an index outside ``out`` stops it there (returns how many were written).
    n = out.shape[0]
    for i in range(index.shape[0]):
        at = index[i] - offset
        if at < 0 or at >= n:
            return i
        out[at] = values[i]
    return index.shape[0]


def scatter(out: np.ndarray, index: np.ndarray, values: np.ndarray, offset: int = 0) -> None:
    """``out[index - offset] = values`` for a 1-D ``out``, in one pass: about half numpy's time for
    sparse writes. ``offset``: where ``out`` starts in the storage ``index`` counts in (a piece of a
    tensor copied out of it), without a shifted copy of the index.

    An index outside ``out`` raises IndexError; the elements before it are written, as a crash in
    the middle of a write would leave them (a receiver's resume repairs such an item). ``values``
    must have ``out``'s dtype; indices may be 32- or 64-bit.
    """
    index, values = _scatter_inputs(out, index, values)
    if index.size and _scatter(out, index, values, np.int64(offset)) != index.size:
        raise IndexError(f"scatter: an index is outside the storage of {out.size} elements")


# Elements a checked scatter writes before it reads them back: their cache lines are still in L1/L2.
_CHECK_RUN = 4096


@numba.njit(nogil=True, cache=_CACHE, boundscheck=False)
def _scatter_checked(out, index, values):  # pragma: no cover - compiled
    # Returns how many were written (as _scatter) and how many of them did not read back as written.
    n = out.shape[0]
    bad = 0
    for lo in range(0, index.shape[0], _CHECK_RUN):
        hi = min(lo + _CHECK_RUN, index.shape[0])
        for i in range(lo, hi):
            at = index[i]
            if at < 0 or at >= n:
                return i, bad
            out[at] = values[i]
        for i in range(lo, hi):
            if out[index[i]] != values[i]:
                bad += 1
    return index.shape[0], bad


def _scatter_inputs(out: np.ndarray, index: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    if out.ndim != 1 or index.ndim != 1 or values.shape != index.shape or values.dtype != out.dtype:
        raise ValueError(f"scatter: 1-D {out.dtype} storage, indices and values of one length (got {values.dtype})")
    # One compiled variant per dtype and index width (compile_scatter): strided or read-only inputs are copied.
    if not (values.flags.c_contiguous and values.flags.writeable):
        values = np.array(values)
    if not (index.flags.c_contiguous and index.flags.writeable):
        index = np.array(index)
    return index, values


def scatter_checked(out: np.ndarray, index: np.ndarray, values: np.ndarray) -> int:
    """``scatter``, each run of elements read back right after it is written; how many did not read
    back as written (0 unless the storage is not memory that holds what is stored in it).

    Costs little more than ``scatter``: the lines read back are still in cache.
    """
    index, values = _scatter_inputs(out, index, values)
    if not index.size:
        return 0
    written, bad = _scatter_checked(out, index, values)
    if written != index.size:
        raise IndexError(f"scatter: an index is outside the storage of {out.size} elements")
    return int(bad)


@numba.njit(nogil=True, cache=_CACHE, boundscheck=False)
def _gather(src, index, out):  # pragma: no cover - compiled
    n = src.shape[0]
    for i in range(index.shape[0]):
        at = index[i]
        if at < 0 or at >= n:
            return i
        out[i] = src[at]
    return index.shape[0]


def gather(src: np.ndarray, index: np.ndarray) -> np.ndarray:
    """``src[index]`` for a 1-D ``src``, in one pass without the GIL (numpy's fancy indexing takes ~1.7x
    and barely runs two threads at once). An index outside ``src`` raises IndexError."""
    if src.ndim != 1 or index.ndim != 1:
        raise ValueError("gather: 1-D storage and indices")
    if not (index.flags.c_contiguous and index.flags.writeable):
        index = np.array(index)
    out = np.empty(index.shape[0], dtype=src.dtype)
    if index.size and _gather(src, index, out) != index.size:
        raise IndexError(f"gather: an index is outside the storage of {src.size} elements")
    return out


def compile_scatter(dtype: np.dtype) -> None:
    """Compile ``scatter``, ``scatter_checked`` and ``gather`` for this element dtype (32- and 64-bit
    indices), or load them from numba's cache.

    A receiver calls it before it pauses an engine, so the first write does not wait for the compiler.
    """
    empty = np.zeros(0, dtype=dtype)
    for index in (np.int32, np.int64):
        _scatter(empty, np.zeros(0, dtype=index), empty, np.int64(0))
        _scatter_checked(empty, np.zeros(0, dtype=index), empty)
        _gather(empty, np.zeros(0, dtype=index), empty)


# --------------------------------------------------------------------------- write runs (on-disk receiver)


@numba.njit(nogil=True, cache=_CACHE, boundscheck=False)
def _run_bounds(index, local, stride, gap, cap, out):  # pragma: no cover - compiled
    # ``index`` and ``local`` ascend, so "a new block of cap" and "a new stretch of stride" are each
    # one comparison with a limit recomputed only where it is crossed: no division per element.
    n = index.shape[0]
    segmented = local.shape[0] == n
    k = 1
    out[0] = 0
    prev = index[0]
    limit = (prev // cap + 1) * cap
    stretch_end = (local[0] // stride + 1) * stride if segmented else 0
    for i in range(1, n):
        at = index[i]
        if at <= prev or (segmented and local[i] <= local[i - 1]):
            return -1  # not strictly ascending: the limits above would not hold
        cut = at - prev > gap or at >= limit
        if segmented and local[i] >= stretch_end:
            cut = True
            stretch_end = (local[i] // stride + 1) * stride
        if cut:
            out[k] = i
            k += 1
            limit = (at // cap + 1) * cap
        prev = at
    out[k] = n
    return k + 1


def run_bounds(index: np.ndarray, local: np.ndarray | None, stride: int, gap: int, cap: int) -> np.ndarray:
    """Where strictly ascending ``index`` splits into runs, in one pass: [0, cuts..., len(index)]. A run ends
    where the next index is more than ``gap`` past it or in another block of ``cap``; with ``local``
    (the ascending positions the indices came from), also where ``local // stride`` changes."""
    if index.ndim != 1 or index.size == 0:
        raise ValueError("run_bounds: a non-empty 1-D index")
    if local is None:
        local = index[:0]
    elif local.shape != index.shape:
        raise ValueError("run_bounds: local positions must match the index")
    out = np.empty(index.size + 1, dtype=np.int64)
    count = _run_bounds(index, local, max(1, stride), gap, max(1, cap), out)
    if count < 0:
        raise ValueError("run_bounds: the indices (and local positions) must be strictly ascending")
    return out[:count].copy()
