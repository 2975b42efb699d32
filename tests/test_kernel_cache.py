"""numba's on-disk cache of the change kernels (format/kernels.py) survives the module being loaded
under another name: such a process compiles afresh and saves nothing, so it cannot leave compiled
kernels that name a module later processes cannot import (they failed with ModuleNotFoundError)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from store_fixtures import REPO_ROOT

KERNELS = REPO_ROOT / "dcr_cli" / "format" / "kernels.py"

# Scans a fixed pair of arrays (large enough for the GIL-releasing variant) and prints a summary.
SCAN = """
import numpy as np
base = np.arange(1 << 16, dtype=np.uint16)
new = base.copy()
new[::7] ^= np.uint16(0x0101)
positions, masks, news = kernels.scan_changes(base, new)
sums = [int(a.astype(np.int64).sum()) for a in (positions, masks, news)]
print("RESULT", len(positions), *sums)
print("CACHED", kernels._CACHE)
"""

ALIAS = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location({name!r}, {path!r})
kernels = importlib.util.module_from_spec(spec)
if {register}:
    sys.modules[{name!r}] = kernels
spec.loader.exec_module(kernels)
"""

PACKAGE = """
import sys
sys.path.insert(0, {root!r})
from kpkg import kernels
"""


def _run(code: str, cwd: Path) -> tuple[str, str]:
    env = {**os.environ, "NUMBA_DEBUG_CACHE": "1"}
    env.pop("NUMBA_CACHE_DIR", None)
    proc = subprocess.run([sys.executable, "-c", code + SCAN], cwd=cwd, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    result = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT"))
    return result, proc.stdout + proc.stderr


def test_a_process_that_loads_the_kernels_under_another_name_does_not_poison_the_cache(tmp_path: Path) -> None:
    pkg = tmp_path / "kpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    shutil.copy(KERNELS, pkg / "kernels.py")
    cache = pkg / "__pycache__"

    # Under other names (not registered; registered under a name no fresh process can import):
    # compiled afresh, nothing saved.
    results = set()
    for name, register in (("kernels_elsewhere", False), ("kernels_elsewhere", True), ("kpkg.other", True)):
        result, log = _run(ALIAS.format(name=name, path=str(pkg / "kernels.py"), register=register), tmp_path)
        assert "CACHED False" in log
        assert "saved" not in log, log
        assert not list(cache.glob("*.nb*")) if cache.exists() else True
        results.add(result)

    # Imported as the package's submodule: compiled and saved once, then loaded from the cache.
    first, log = _run(PACKAGE.format(root=str(tmp_path)), tmp_path)
    assert "CACHED True" in log and "index saved" in log, log
    assert list(cache.glob("kernels.*.nbi"))
    again, log = _run(PACKAGE.format(root=str(tmp_path)), tmp_path)
    assert "data loaded" in log and "saved" not in log, log
    # And a process under another name still works next to that cache (it neither loads nor replaces it).
    other, log = _run(ALIAS.format(name="kernels_elsewhere", path=str(pkg / "kernels.py"), register=False), tmp_path)
    assert "saved" not in log
    results |= {first, again, other}
    assert len(results) == 1, results
