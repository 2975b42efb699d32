"""strict_json's scan of documents without a backslash (``_scan_unescaped``, the path every dcr manifest
takes) finds exactly what cutting the strings out finds (``_scan_cut``, the exact scan it replaces there):
the nesting, and that no over-long integer literal lies outside the strings; where a long run of digits
does lie outside, or too many lie inside, it declines and the exact scan decides."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from dcr_cli.format import strict_json

# No backslash. Digit runs longer than the limit inside and outside strings, floats' long fractions and
# exponents, brackets inside strings, an unterminated last string.
PIECES = [b'"', b"[", b"]", b"{", b"}", b"1", b"7" * 22, b"0" * 21, b".", b"e", b"E", b"-", b"+", b" ", b"a", b","]
DIGESTY = [b'"' + b"1234567890" * 3 + b'"', b'"ab' + b"9" * 25 + b'cd"', b'"[[[{"', b'"]]]}"']


@settings(max_examples=1500, deadline=None)
@given(st.lists(st.sampled_from(PIECES + DIGESTY), max_size=80))
def test_the_unescaped_scan_is_the_exact_scan(parts: list[bytes]) -> None:
    raw = b"".join(parts)
    exact = strict_json._scan_cut(raw)
    quick = strict_json._scan_unescaped(raw)
    if quick is not None:
        assert quick == exact, raw
        assert exact[1] == 0, raw  # it answers only where no long literal can be
    assert strict_json._scan(raw) == exact, raw


@settings(max_examples=1500, deadline=None)
@given(st.lists(st.sampled_from(PIECES + DIGESTY), max_size=80), st.integers(min_value=1, max_value=64))
def test_pieces_of_any_size_give_the_same_answer(parts: list[bytes], piece: int) -> None:
    """The document is translated piece by piece: runs and strings across piece boundaries count alike."""
    raw = b"".join(parts)
    whole = strict_json._scan_unescaped(raw)
    saved = strict_json.SCAN_PIECE
    strict_json.SCAN_PIECE = piece
    try:
        assert strict_json._scan_unescaped(raw) == whole, (raw, piece)
    finally:
        strict_json.SCAN_PIECE = saved


def test_a_manifest_like_document_takes_the_unescaped_path() -> None:
    """Hex digests hold runs of more than 20 digits now and then: inside strings, they do not stop it."""
    rng = random.Random(5)
    rows = []
    for i in range(4000):
        digest = "".join(rng.choice("0123456789abcdef") for _ in range(64))
        rows.append(f'["layer.{i}.w","BF16",[64,{i}],"{digest}",[{i * 7},{i * 13}]]')
    digit_string = '"' + "1234567890" * 5 + '"'
    raw = ('{"tensors":[' + ",".join(rows) + "]," + '"x":' + digit_string + ',"y":[[["]]]"]]]}').encode()
    assert strict_json._scan_unescaped(raw) == strict_json._scan_cut(raw) == (4, 0)
    saved = strict_json.SCAN_PIECE
    strict_json.SCAN_PIECE = 997  # many pieces, boundaries inside digests, numbers and brackets
    try:
        assert strict_json._scan_unescaped(raw) == (4, 0)
    finally:
        strict_json.SCAN_PIECE = saved
    # The same document with one long integer outside the strings: declined, and the exact scan finds it.
    longer = raw[:-1] + b',"z":' + b"9" * 25 + b"}"
    assert strict_json._scan_unescaped(longer) is None
    assert strict_json._scan(longer) == (4, 25)
    # A float's long fraction is not an integer literal: declined too, and the exact scan says 0 digits.
    fraction = raw[:-1] + b',"z":0.' + b"1" * 25 + b"}"
    assert strict_json._scan_unescaped(fraction) is None and strict_json._scan(fraction) == (4, 0)


def test_too_many_long_runs_in_strings_go_to_the_exact_scan() -> None:
    """One long run per 4 KiB at most (64 at least) is looked at one by one; past that, the cut decides."""
    raw = b"[" + b",".join(b'"' + b"5" * 30 + b'"' for _ in range(2000)) + b"]"
    assert len(raw) >> 12 < 2000
    assert strict_json._scan_unescaped(raw) is None
    assert strict_json._scan(raw) == strict_json._scan_cut(raw) == (1, 0)
    few = b"[" + b",".join(b'"' + b"5" * 30 + b'"' for _ in range(60)) + b"]"
    assert strict_json._scan_unescaped(few) == (1, 0)


def test_unterminated_strings_and_brackets_in_strings() -> None:
    for raw, expected in (
        (b'["' + b"8" * 40, (1, 0)),  # the unterminated string holds the run
        (b'[["]"]', (2, 0)),
        (b'"[[[', (0, 0)),
        (b"", (0, 0)),
        (b'""[]', (1, 0)),
        (b"]]][", (0, 0)),
    ):
        assert strict_json._scan_unescaped(raw) == strict_json._scan_cut(raw) == expected, raw
