"""The change scan: one pass over two equal-width integer arrays, in compiled code.

Finding the changed elements is the hot loop of ``dcr diff``. In numpy it takes an XOR pass, a
nonzero pass (branchy, ~2x slower than the XOR itself) and gathers. This kernel compares 64-bit
words first, which skips the ~90% of words that did not change at memory speed, and only then
looks at single elements, writing results branch-free. It runs at or above the speed of a plain
numpy XOR-and-count pass (benchmarks/bench_diff.py).
"""

from __future__ import annotations

import numba
import numpy as np


@numba.njit(nogil=True, cache=True, boundscheck=False)
def _changed_words(base_words: np.ndarray, new_words: np.ndarray, out: np.ndarray) -> int:
    m = 0
    for w in range(base_words.shape[0]):
        out[m] = w
        m += base_words[w] != new_words[w]
    return m


@numba.njit(nogil=True, cache=True, boundscheck=False)
def _expand(words, m, lanes, start, stop, base, new, positions, masks, news):
    k = 0
    for t in range(m):
        first = words[t] * lanes
        for i in range(first, first + lanes):
            x = base[i] ^ new[i]
            positions[k] = i
            masks[k] = x
            news[k] = new[i]
            k += x != 0
    for i in range(start, stop):  # the tail that does not fill a whole word
        x = base[i] ^ new[i]
        positions[k] = i
        masks[k] = x
        news[k] = new[i]
        k += x != 0
    return k


def scan_changes(base: np.ndarray, new: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Positions (int64, increasing), XOR masks and new values of the elements that differ."""
    n = base.shape[0]
    width = base.dtype.itemsize
    lanes = 8 // width
    full = (n // lanes) * lanes
    if full:
        base_words = base[:full].view(np.uint64)
        new_words = new[:full].view(np.uint64)
        words = np.empty(full // lanes, dtype=np.int64)
        m = _changed_words(base_words, new_words, words)
    else:
        words = np.empty(0, dtype=np.int64)
        m = 0
    capacity = m * lanes + (n - full)
    positions = np.empty(capacity, dtype=np.int64)
    masks = np.empty(capacity, dtype=base.dtype)
    news = np.empty(capacity, dtype=base.dtype)
    k = _expand(words, m, lanes, full, n, base, new, positions, masks, news)
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
