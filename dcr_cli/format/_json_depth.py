"""The compiled one-pass scan for large JSON documents (strict_json imports it only for those).

Kept apart so that importing strict_json, which every dcr command does, does not import numba: that
alone costs a short command (dcr ack, dcr commit, dcr status) a few tenths of a second.
"""

from __future__ import annotations

import numba
import numpy as np

# Absolute, so that a copy of this file loaded on its own still finds it (see _numba_cache).
from dcr_cli.format._numba_cache import cacheable

_CACHE = cacheable(globals())


@numba.njit(nogil=True, cache=_CACHE, boundscheck=False)
def scan(raw: np.ndarray) -> tuple[int, int]:  # pragma: no cover - compiled
    """(deepest bracket nesting, most digits of an integer literal), strings excluded: one pass,
    constant memory, no recursion, no regex (a regex over strings backtracks quadratically on an
    unterminated string of escaped quotes). An integer literal is a run of digits that is neither
    the fraction or exponent of a number nor followed by one (what json calls parse_int on)."""
    depth = 0
    deepest = 0
    longest = 0
    in_string = False
    escaped = False
    n = raw.shape[0]
    i = 0
    while i < n:
        c = raw[i]
        if in_string:
            if escaped:
                escaped = False
            elif c == 0x5C:  # backslash
                escaped = True
            elif c == 0x22:  # quote
                in_string = False
        elif c == 0x22:
            in_string = True
        elif c == 0x5B or c == 0x7B:  # [ {
            depth += 1
            if depth > deepest:
                deepest = depth
        elif c == 0x5D or c == 0x7D:  # ] }
            depth -= 1
        elif 0x30 <= c <= 0x39:  # a run of digits
            j = i
            while j < n and 0x30 <= raw[j] <= 0x39:
                j += 1
            before = raw[i - 1] if i > 0 else 0x20
            if before == 0x2B or before == 0x2D:  # a sign: an exponent's if an e precedes it
                before = raw[i - 2] if i > 1 else 0x20
            after = raw[j] if j < n else 0x20
            fraction_or_exponent = before == 0x2E or before == 0x65 or before == 0x45  # . e E
            float_part = after == 0x2E or after == 0x65 or after == 0x45
            if not fraction_or_exponent and not float_part and j - i > longest:
                longest = j - i
            i = j
            continue
        i += 1
    return deepest, longest
