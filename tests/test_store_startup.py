"""Short store commands start without numba (issue 12 §1): the JSON depth scan, and what the store imports."""

from __future__ import annotations

import random
import subprocess
import sys

import numpy as np
import pytest
from store_fixtures import REPO_ROOT

from dcr_cli.errors import FormatError
from dcr_cli.format import strict_json
from dcr_cli.format._json_depth import scan


def test_the_plain_scan_agrees_with_the_compiled_one() -> None:
    rng = random.Random(12)
    pieces = ["[", "]", "{", "}", '"', "\\", "a", "\n", "-", "+", ".", "e", ",", "7", "1" * 20, "1" * 21, "9" * 30]
    for _ in range(20000):
        raw = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 30))).encode()
        depth, longest = (int(v) for v in scan(np.frombuffer(raw, dtype=np.uint8))) if raw else (0, 0)
        plain_depth, over_long = strict_json._scan(raw)
        assert plain_depth == depth, raw
        # The plain scan reports only an integer over the limit (the first one); the compiled scan the longest.
        assert (over_long > strict_json.MAX_INT_DIGITS) == (longest > strict_json.MAX_INT_DIGITS), raw
    # Hostile shapes stay linear and right: escaped quotes inside an unterminated string, deep brackets.
    assert strict_json._depth(b'"' + b'\\"' * 100_000) == 0
    assert strict_json._depth(b"[" * 100_000) == 100_000
    assert strict_json._depth(b'["]]]", {"a": "\\"[["}]') == 2
    assert strict_json._scan(b"[" + b"1" * 100_000 + b".5]")[1] == 0  # a long fraction's integer part is a float's


def test_store_commands_do_not_import_numba() -> None:
    code = "import sys, dcr_cli.store, dcr_cli.cli; assert 'numba' not in sys.modules, 'numba imported'"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("pad", [0, strict_json.COMPILED_FROM], ids=["small", "large"])
def test_both_paths_hold_the_same_limits(pad: int) -> None:
    """A small document is checked by the regex scan and json's parse_int hook, a large one by the
    compiled scan: the same inputs are refused either way, and the same accepted."""
    filler = '"' + "x" * pad + '"'
    ok = f'[{filler}, 12345678901234567890, -1.5e300, "99999999999999999999999", [[[0]]]]'
    assert strict_json.load_json(ok.encode(), "doc")[1] == 12345678901234567890
    for bad, reason in (
        (f"[{filler}, 123456789012345678901]", "digits"),
        (f"[{filler}, -123456789012345678901]", "digits"),
        (f"[{filler}, " + "[" * 65 + "]" * 65 + "]", "nested"),
    ):
        with pytest.raises(FormatError, match=reason):
            strict_json.load_json(bad.encode(), "doc")
