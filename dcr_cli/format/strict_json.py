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
    obj = dict(pairs)  # built in C; fewer keys than pairs means a duplicate, named by the slow loop below
    if len(obj) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise ValueError(f"duplicate key {key!r}")
            seen.add(key)
    return obj


# A JSON string from its opening quote: any run of plain characters and backslash escapes, then the
# closing quote if there is one (an unterminated string runs to the end). The unrolled form never
# backtracks, so the scan is linear in the input; no string can contain a quote it does not escape.
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"?', re.DOTALL)
_NOT_BRACKETS = bytes(c for c in range(256) if c not in b"[]{}")
_STEP = np.zeros(256, dtype=np.int8)
_STEP[list(b"[{")] = 1
_STEP[list(b"]}")] = -1
_STEP32 = _STEP.astype(np.int32)  # what the unescaped scan sums (a document of fewer than 2**31 brackets)
_NOT_MARKS = bytes(c for c in range(256) if c not in b'"[]{}')  # deleted: what is left is quotes and brackets
# Every digit becomes "0", every other byte a space: a run of digits is then a run of "0", found by bytes.find.
_DIGIT_RUNS = bytes(0x30 if 0x30 <= c <= 0x39 else 0x20 for c in range(256))
_OVER_LONG = b"0" * (MAX_INT_DIGITS + 1)
SCAN_PIECE = 1 << 20  # bytes translated at a time by the unescaped scan


# An integer literal of more than MAX_INT_DIGITS digits, in a document whose strings are cut out: a run of
# digits not preceded by a digit or by a fraction's point or an exponent's e (with or without its sign),
# and not followed by a fraction or exponent. In a valid document those are exactly the literals json
# hands to parse_int, and it is the compiled scan's rule. One start per run passes the look-behinds, so
# the search stays linear.
_LONG_INT = re.compile(rb"(?<![\d.eE])(?<![.eE][+\-])(\d{%d,})(?![\d.eE])" % (MAX_INT_DIGITS + 1))

_LONG_RUN = re.compile(rb"\d{%d}" % (MAX_INT_DIGITS + 1))  # what every _LONG_INT match contains

# Bytes from which the compiled scan is used: chosen as where it beats the regular expressions (~12 ms per
# MB) plus importing numba and loading the compiled scan (~0.3 s); only manifests of ~100k tensors get
# there. (Documents without a backslash, every manifest, now scan at ~4-6 ms per MB: _scan_unescaped.)
COMPILED_FROM = 16 << 20


def _depth(raw: bytes) -> int:
    """Deepest bracket nesting outside strings; linear, no recursion."""
    return _scan(raw)[0]


def _scan(raw: bytes) -> tuple[int, int]:
    """(deepest bracket nesting, digits of an over-long integer literal or 0), strings excluded.

    Documents below COMPILED_FROM (store records, state files, manifests up to tens of thousands of
    tensors): without a backslash, ``_scan_unescaped`` (bytes.translate, bytes.find and numpy over the
    quotes and brackets alone) unless a long run of digits lies outside the strings; otherwise the
    strings are cut out (backslash escapes count inside strings only, as in JSON), the running sum of
    the brackets left is the nesting, and a regex finds an over-long integer (``_scan_cut``). Larger
    ones take ``_scan_large``. All agree on any input.
    """
    if len(raw) >= COMPILED_FROM:
        return _scan_large(raw)
    if b"\\" not in raw:
        quick = _scan_unescaped(raw)
        if quick is not None:
            return quick
    return _scan_cut(raw)


def _scan_unescaped(raw: bytes) -> tuple[int, int] | None:
    """``_scan`` of a document without a backslash, in which every quote opens or closes a string, if no run
    of more than MAX_INT_DIGITS digits lies outside the strings (else None: ``_scan_cut`` finds the literal).

    About 2x faster than cutting the strings out (a manifest's hundreds of thousands of strings made that
    many pieces): a run of digits never contains a quote, so it lies inside a string exactly when an odd
    number of quotes precedes it; the few runs that long (inside hex digests) are looked at one by one,
    and a budget of one per 4 KiB bounds that loop (past it, the cut decides). The nesting is the running
    sum over the quotes and brackets alone, a bracket counting where the quotes before it are even. The
    document is translated in pieces of SCAN_PIECE bytes: no full-size copy (memory stays bounded, and
    the pieces stay in cache).
    """
    n = len(raw)
    at, budget = 0, max(64, n >> 12)  # at: a position outside any string (the start; after a string's end)
    pieces: list[bytes] = []
    for lo in range(0, n, SCAN_PIECE):
        hi = min(n, lo + SCAN_PIECE)
        pieces.append(raw[lo:hi].translate(None, _NOT_MARKS))
        if at >= hi:
            continue
        # MAX_INT_DIGITS bytes more: a run that starts in this piece is seen here whole enough.
        runs = raw[lo : hi + MAX_INT_DIGITS].translate(_DIGIT_RUNS)
        while (p := runs.find(_OVER_LONG, max(at - lo, 0))) >= 0 and lo + p < hi:
            hit = lo + p
            budget -= 1
            if budget < 0 or raw.count(b'"', at, hit) % 2 == 0:
                return None  # outside a string (an integer, or a float's fraction or exponent), or too many
            close = raw.find(b'"', hit)  # the end of that string; after it, outside again
            at = n if close < 0 else close + 1  # an unterminated string runs to the end
            if at >= hi:
                break
    marks = b"".join(pieces)
    if not marks:
        return 0, 0
    codes = np.frombuffer(marks, dtype=np.uint8)
    steps = _STEP32.take(codes)
    steps[np.bitwise_xor.accumulate(codes == 0x22)] = 0  # brackets after an odd number of quotes: in a string
    return max(0, int(steps.cumsum().max())), 0


def _scan_cut(raw: bytes) -> tuple[int, int]:
    """``_scan`` by cutting the strings out of the document, then looking at what is left (see ``_scan``)."""
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
        if b"\\" in data and _SUSPECT_ESCAPE.search(data):  # only an escape makes a NUL or lone surrogate
            _check_strings(obj)
    except (ValueError, RecursionError) as exc:
        raise FormatError(f"{what}: not valid JSON ({exc})") from None
    return obj
