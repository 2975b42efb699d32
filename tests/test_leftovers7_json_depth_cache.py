"""numba's on-disk cache of strict_json's compiled scan (format/_json_depth.py) survives the module
being loaded under another name: such a process compiles afresh and saves nothing, so it cannot leave
a compiled scan that names a module later processes cannot import (before the guard, the next process
that read a large document failed with ModuleNotFoundError: No module named '<dynamic>')."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from store_fixtures import REPO_ROOT

JSON_DEPTH = REPO_ROOT / "dcr_cli" / "format" / "_json_depth.py"

# Scans a fixed document (nesting, a long integer, a string holding brackets and digits) and prints it.
SCAN = """
import numpy as np
doc = b'{"a": [[1, 2.5e10, 123456789012345678901234], "[[[ 99999999999999999999999999"], "b": {"c": -7}}'
print("RESULT", *json_depth.scan(np.frombuffer(doc, dtype=np.uint8)))
print("CACHED", getattr(json_depth, "_CACHE", None))
"""

ALIAS = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location({name!r}, {path!r})
json_depth = importlib.util.module_from_spec(spec)
if {register}:
    sys.modules[{name!r}] = json_depth
spec.loader.exec_module(json_depth)
"""

PACKAGE = """
import sys
sys.path.insert(0, {root!r})
from jpkg import _json_depth as json_depth
"""


def _run(code: str, cwd: Path) -> tuple[str, str]:
    env = {**os.environ, "NUMBA_DEBUG_CACHE": "1"}
    env.pop("NUMBA_CACHE_DIR", None)
    env.pop("NUMBA_DISABLE_JIT", None)
    proc = subprocess.run([sys.executable, "-c", code + SCAN], cwd=cwd, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    result = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT"))
    return result, proc.stdout + proc.stderr


def test_a_process_that_loads_the_json_scan_under_another_name_does_not_poison_the_cache(tmp_path: Path) -> None:
    pkg = tmp_path / "jpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    shutil.copy(JSON_DEPTH, pkg / "_json_depth.py")
    cache = pkg / "__pycache__"

    # Under other names (not registered; registered under a name no fresh process can import):
    # compiled afresh, nothing saved.
    results = set()
    for name, register in (("json_depth_elsewhere", False), ("json_depth_elsewhere", True), ("jpkg.other", True)):
        result, log = _run(ALIAS.format(name=name, path=str(pkg / "_json_depth.py"), register=register), tmp_path)
        assert "saved" not in log, log
        assert "CACHED False" in log, log
        assert not (cache.exists() and list(cache.glob("*.nb*")))
        results.add(result)

    # Imported as the package's submodule: compiled and saved once, then loaded from the cache.
    first, log = _run(PACKAGE.format(root=str(tmp_path)), tmp_path)
    assert "CACHED True" in log and "index saved" in log, log
    assert list(cache.glob("_json_depth.*.nbi"))
    again, log = _run(PACKAGE.format(root=str(tmp_path)), tmp_path)
    assert "data loaded" in log and "saved" not in log, log
    # A process under another name still works next to that cache (it neither loads nor replaces it).
    other, log = _run(
        ALIAS.format(name="json_depth_elsewhere", path=str(pkg / "_json_depth.py"), register=False), tmp_path
    )
    assert "saved" not in log and "loaded" not in log, log
    results |= {first, again, other}
    # Depth 3 ({, [, [); the 24-digit literal (the one in the string does not count).
    assert results == {"RESULT 3 24"}, results


def test_the_installed_scan_is_cached() -> None:
    """dcr's own import path (dcr_cli.format._json_depth) passes the guard, so large manifests keep
    loading the compiled scan from disk instead of compiling it in every process."""
    from dcr_cli.format import _json_depth

    assert _json_depth._CACHE is True
