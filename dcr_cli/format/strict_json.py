"""The one JSON reader for everything dcr parses: manifests, store records, receiver state, headers.

Python's ``json`` accepts inputs that would let a hostile file mean two things or crash a reader:
the last of two equal keys wins silently, ``NaN`` and ``Infinity`` parse, a 5,000-digit integer
raises ValueError, 1,000 nested brackets raise RecursionError, and ``"\\ud800"`` yields a string
that cannot be encoded again. ``load_json`` refuses all of them with a FormatError that names the
file, so every caller fails closed with one line (delta-v1 §8, "JSON").
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import numba
import numpy as np

from ..errors import FormatError

MAX_DEPTH = 64  # nesting levels of arrays and objects; dcr's own documents use at most 6
MAX_INT_DIGITS = 20  # enough for any 64-bit value

_SUSPECT_ESCAPE = re.compile(rb"\\u(?:[dD][89a-fA-F]|0000)", re.IGNORECASE)


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _parse_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e400 overflows to Infinity, which JSON cannot express
        raise ValueError(f"the number {text[:40]} is out of range")
    return value


def _parse_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise ValueError(f"an integer of {len(text.lstrip('-'))} digits (at most {MAX_INT_DIGITS})")
    return int(text)


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise ValueError(f"duplicate key {key!r}")
        obj[key] = value
    return obj


@numba.njit(nogil=True, cache=True, boundscheck=False)
def _scan(raw: np.ndarray) -> tuple[int, int]:  # pragma: no cover - compiled
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


def _depth(raw: bytes) -> int:
    """Deepest bracket nesting, strings excluded; linear, no recursion."""
    return _scan_bytes(raw)[0]


def _scan_bytes(raw: bytes) -> tuple[int, int]:
    if not raw:
        return 0, 0
    deepest, longest = _scan(np.frombuffer(raw, dtype=np.uint8))
    return int(deepest), int(longest)


def _check_strings(value: Any) -> None:
    """Every string (keys included) must be encodable UTF-8 without NUL; iterative, no recursion."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            strings: list[str] = [v]
        elif isinstance(v, dict):
            strings = list(v)
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
            continue
        else:
            continue
        for s in strings:
            if "\x00" in s:
                raise ValueError(f"a NUL character in {_excerpt(s)}")
            try:
                s.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError(f"a lone surrogate in {_excerpt(s)}") from None


def _excerpt(s: str) -> str:
    """A short, printable rendering of a (hostile) string for an error message."""
    text = repr(s[:40] + ("…" if len(s) > 40 else ""))
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def load_json(raw: bytes | str, what: str) -> Any:
    """Parse ``raw`` strictly; ``what`` names the document in the error ("manifest.json", a path)."""
    data = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else bytes(raw)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise FormatError(f"{what}: not UTF-8 ({exc.reason} at byte {exc.start})") from None
    depth, digits = _scan_bytes(data)
    if depth > MAX_DEPTH:
        raise FormatError(f"{what}: JSON nested {depth} levels deep (at most {MAX_DEPTH})")
    try:
        if digits > MAX_INT_DIGITS:  # found by the scan, so that json's own (C) integer parser reads the rest
            _parse_int("7" * digits)
        obj = json.loads(
            text,
            object_pairs_hook=_pairs,
            parse_float=_parse_float,
            parse_constant=_refuse_constant,
        )
        if _SUSPECT_ESCAPE.search(data):
            _check_strings(obj)
    except (ValueError, RecursionError) as exc:
        raise FormatError(f"{what}: not valid JSON ({exc})") from None
    return obj
