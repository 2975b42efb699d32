"""strict_json._scan's split path (documents without a backslash) cuts strings exactly as the regex does."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from dcr_cli.format import strict_json

PIECES = [b'"', b"[", b"]", b"{", b"}", b"1", b"7" * 22, b".", b"e", b"-", b" ", b"a", b"\\", b","]


def _regex_scan(raw: bytes) -> tuple[int, int]:
    rest = strict_json._STRING.sub(b" ", raw)
    long_int = strict_json._LONG_INT.search(rest)
    digits = len(long_int.group(1)) if long_int else 0
    depth, level = 0, 0
    for c in rest:
        if c in b"[{":
            level += 1
            depth = max(depth, level)
        elif c in b"]}":
            level -= 1
    return depth, digits


@settings(max_examples=600, deadline=None)
@given(st.lists(st.sampled_from(PIECES), max_size=60))
def test_split_scan_is_the_regex_scan(parts: list[bytes]) -> None:
    raw = b"".join(parts)
    assert strict_json._scan(raw) == _regex_scan(raw), raw


def test_split_scan_cases() -> None:
    for raw in (
        b'["a""b"]',
        b'{"k": [1, "x]]]"]}',
        b'["unterminated [[[',
        b'"',
        b"",
        b"[1e" + b"9" * 30 + b"]",
        b"[" + b"9" * 21 + b"]",
    ):
        assert strict_json._scan(raw) == _regex_scan(raw), raw
