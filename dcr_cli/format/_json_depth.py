"""The compiled bracket-depth scan for large JSON documents (strict_json imports it only for those).

Kept apart so that importing strict_json, which every dcr command does, does not import numba: that
alone costs a short command (dcr ack, dcr commit, dcr status) a few tenths of a second.
"""

from __future__ import annotations

import numba
import numpy as np


@numba.njit(nogil=True, cache=True, boundscheck=False)
def max_depth(raw: np.ndarray) -> int:  # pragma: no cover - compiled
    """Deepest bracket nesting outside strings: one pass, constant memory, no recursion, no regex
    (a regex over strings backtracks quadratically on an unterminated string of escaped quotes)."""
    depth = 0
    deepest = 0
    in_string = False
    escaped = False
    for i in range(raw.shape[0]):
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
    return deepest
