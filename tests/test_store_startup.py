"""Short store commands start without numba (issue 12 §1): the JSON depth scan, and what the store imports."""

from __future__ import annotations

import random
import subprocess
import sys

import numpy as np
from store_fixtures import REPO_ROOT

from dcr_cli.format import strict_json
from dcr_cli.format._json_depth import max_depth


def test_the_plain_depth_scan_agrees_with_the_compiled_one() -> None:
    rng = random.Random(12)
    alphabet = b'[]{}"\\a\n'
    for _ in range(20000):
        raw = bytes(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
        expected = int(max_depth(np.frombuffer(raw, dtype=np.uint8))) if raw else 0
        assert strict_json._depth(raw) == expected, raw
    # Hostile shapes stay linear and right: escaped quotes inside an unterminated string, deep brackets.
    assert strict_json._depth(b'"' + b'\\"' * 100_000) == 0
    assert strict_json._depth(b"[" * 100_000) == 100_000
    assert strict_json._depth(b'["]]]", {"a": "\\"[["}]') == 2


def test_store_commands_do_not_import_numba() -> None:
    code = "import sys, dcr_cli.store, dcr_cli.cli; assert 'numba' not in sys.modules, 'numba imported'"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
