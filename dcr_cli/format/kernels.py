"""The change scan: one pass over two equal-width integer arrays, in compiled code.

Finding the changed elements is the hot loop of ``dcr diff``. In numpy it takes an XOR pass, a
nonzero pass (branchy, ~2x slower than the XOR itself) and gathers. This kernel compares 64-bit
words first, which skips the ~90% of words that did not change at memory speed, and then expands
the changed words into elements while they are still in registers, writing results branch-free.
It reads each input once and runs at about the speed of a plain numpy XOR-and-count pass
(benchmarks/bench_diff.py).
"""

from __future__ import annotations

from collections.abc import Callable

import numba
import numpy as np

# Words compared before their changed ones are expanded: 2 x 16 KiB of input stays in L1/L2.
TILE_WORDS = 2048


def _make_scan_words(lanes: int) -> Callable[..., tuple[int, int]]:
    """The scan kernel for elements of 64 / ``lanes`` bits, with the lane count fixed at compile time.

    Changed words are expanded from the words themselves (lane j holds bits 64/lanes*j and up: the
    little-endian element order), so each input word is loaded once.
    """
    bits = 64 // lanes
    lane_mask = np.uint64((1 << bits) - 1)

    @numba.njit(nogil=True, cache=True, boundscheck=False)
    def scan_words(base_words, new_words, word, k, positions, masks, news):
        # Scans from word ``word`` on, appending at ``k``; stops early when a tile might not fit.
        # Returns (k, next word); the caller grows the outputs and resumes while next word < len(words).
        n_words = base_words.shape[0]
        capacity = positions.shape[0]
        changed = np.empty(TILE_WORDS, dtype=np.int64)
        while word < n_words:
            stop = min(word + TILE_WORDS, n_words)
            if k + (stop - word) * lanes > capacity:
                return k, word
            m = 0
            for w in range(word, stop):
                changed[m] = w
                m += base_words[w] != new_words[w]
            for t in range(m):
                w = changed[t]
                xor_word = base_words[w] ^ new_words[w]
                new_word = new_words[w]
                for j in range(lanes):
                    shift = np.uint64(bits * j)
                    x = (xor_word >> shift) & lane_mask
                    positions[k] = w * lanes + j
                    masks[k] = x
                    news[k] = (new_word >> shift) & lane_mask
                    k += x != 0
            word = stop
        return k, word

    return scan_words


_SCAN_WORDS = {lanes: _make_scan_words(lanes) for lanes in (1, 2, 4, 8)}


def scan_changes(base: np.ndarray, new: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Positions (int64, increasing), XOR masks and new values of the elements that differ."""
    n = base.shape[0]
    lanes = 8 // base.dtype.itemsize
    full = (n // lanes) * lanes
    scan_words = _SCAN_WORDS[lanes]
    base_words, new_words = base[:full].view(np.uint64), new[:full].view(np.uint64)
    # Sized for a sparse change; a dense one grows it a few times (amortized, like a list).
    capacity = min(n, max(TILE_WORDS * lanes, n // 16))
    positions = np.empty(capacity, dtype=np.int64)
    masks = np.empty(capacity, dtype=base.dtype)
    news = np.empty(capacity, dtype=base.dtype)
    k, word = 0, 0
    while True:
        k, word = scan_words(base_words, new_words, word, k, positions, masks, news)
        if word >= len(base_words):
            break
        capacity = min(n, 2 * capacity)
        positions, masks, news = (
            np.concatenate([a[:k], np.empty(capacity - k, a.dtype)]) for a in (positions, masks, news)
        )
    tail = np.flatnonzero(base[full:] != new[full:]) + full  # fewer than one word's elements
    if len(tail):
        positions = np.concatenate([positions[:k], tail])
        masks = np.concatenate([masks[:k], base[tail] ^ new[tail]])
        news = np.concatenate([news[:k], new[tail]])
        k += len(tail)
    return positions[:k], masks[:k], news[:k]


@numba.njit(nogil=True, cache=True, boundscheck=False)
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


def escaped_gaps(positions: np.ndarray) -> np.ndarray:
    """Strictly increasing positions coded as escaped gaps (format_spec/delta-v1.md §6.1)."""
    out = np.empty(5 * len(positions), dtype=np.uint8)
    size = _escaped_gaps(positions.astype(np.int64, copy=False), out) if len(positions) else 0
    return out[:size]
