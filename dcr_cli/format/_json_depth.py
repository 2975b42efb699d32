"""The compiled one-pass scan for large JSON documents (strict_json imports it only for those).

Kept apart so that importing strict_json, which every dcr command does, does not import numba: that
alone costs a short command (dcr ack, dcr commit, dcr status) a few tenths of a second.
"""

from __future__ import annotations

import os
import sys

import numba
import numpy as np


def _cacheable() -> bool:
    """Whether numba may keep the scan on disk (``__pycache__`` beside this file).

    numba's cache stores, with the compiled scan, the name of the module that defined it, and a
    process that loads it imports that module by that name. Loaded under a name a fresh process cannot
    import (``importlib.util.spec_from_file_location`` under another name, registered or not; numba
    then records ``<dynamic>``), the saved scan would make every later process that reads a large
    document fail with ModuleNotFoundError. So it is cached only when this module was imported as the
    submodule of a package, by the name its file has there. The same rule as format/kernels.py's
    guard, kept here rather than shared: a shared module would be one more import a standalone copy
    of either file cannot resolve (tests/test_kernel_cache.py loads kernels.py that way).
    """
    package, _, leaf = __name__.rpartition(".")
    me = sys.modules.get(__name__)
    return (
        bool(package)
        and leaf == os.path.splitext(os.path.basename(__file__))[0]
        and package in sys.modules
        and me is not None
        and vars(me) is globals()
        and __spec__ is not None
        and __spec__.name == __name__
    )


_CACHE = _cacheable()


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
