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


# A JSON string from its opening quote: any run of plain characters and backslash escapes, then the
# closing quote if there is one (an unterminated string runs to the end). The unrolled form never
# backtracks, so the scan is linear in the input; no string can contain a quote it does not escape.
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"?', re.DOTALL)
_NOT_BRACKETS = bytes(c for c in range(256) if c not in b"[]{}")
_STEP = np.zeros(256, dtype=np.int8)
_STEP[list(b"[{")] = 1
_STEP[list(b"]}")] = -1


# An integer literal of more than MAX_INT_DIGITS digits, in a document whose strings are cut out: a run of
# digits not preceded by a digit or by a fraction's point or an exponent's e (with or without its sign),
# and not followed by a fraction or exponent. In a valid document those are exactly the literals json
# hands to parse_int, and it is the compiled scan's rule. One start per run passes the look-behinds, so
# the search stays linear.
_LONG_INT = re.compile(rb"(?<![\d.eE])(?<![.eE][+\-])(\d{%d,})(?![\d.eE])" % (MAX_INT_DIGITS + 1))

_LONG_RUN = re.compile(rb"\d{%d}" % (MAX_INT_DIGITS + 1))  # what every _LONG_INT match contains

# Bytes from which the compiled scan is cheaper than the regular expressions (~12 ms per MB) plus
# importing numba and loading the compiled scan (~0.3 s): only manifests of ~100k tensors get there.
COMPILED_FROM = 16 << 20


def _depth(raw: bytes) -> int:
    """Deepest bracket nesting outside strings; linear, no recursion."""
    return _scan(raw)[0]


def _scan(raw: bytes) -> tuple[int, int]:
    """(deepest bracket nesting, digits of an over-long integer literal or 0), strings excluded.

    Documents below COMPILED_FROM (store records, state files, manifests up to tens of thousands of
    tensors): the strings are cut out with the regex above (backslash escapes count inside strings
    only, as in JSON), the running sum of the brackets left is the nesting, and a second regex finds an
    over-long integer; plain re and numpy. Larger ones take ``_scan_large``. Both agree on any input.
    """
    if len(raw) >= COMPILED_FROM:
        return _scan_large(raw)
    if b"\\" not in raw:
        # No backslash, so no escape: every quote opens or closes a string, the strings are the odd
        # pieces between quotes (an unterminated last one runs to the end), and joining the others with
        # a space is exactly the regex's cut below, at a third of its cost (bytes.split, bytes.join).
        pieces = raw.split(b'"')
        rest = b" ".join(pieces[0::2]) + (b" " if len(pieces) % 2 == 0 else b"")
    else:
        rest = _STRING.sub(b" ", raw)  # a space: a cut string must not join what stood on either side
    long_int = _LONG_INT.search(rest) if _LONG_RUN.search(rest) else None  # a long literal is a long run
    digits = len(long_int.group(1)) if long_int else 0
    brackets = rest.translate(None, _NOT_BRACKETS)
    if not brackets:
        return 0, digits
    steps = _STEP[np.frombuffer(brackets, dtype=np.uint8)].astype(np.int32)
    return max(0, int(np.cumsum(steps).max())), digits


def _scan_large(raw: bytes) -> tuple[int, int]:
    """(deepest nesting, most digits of an integer literal) by a compiled one-pass scan, whose module
    imports numba only when a large document is read."""
    from ._json_depth import scan

    deepest, longest = scan(np.frombuffer(raw, dtype=np.uint8))
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
    depth, digits = _scan(data)
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
