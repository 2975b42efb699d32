"""numba's on-disk cache of dcr's compiled kernels (format/kernels.py, the change kernels; and
format/_json_depth.py, strict_json's scan of large documents) survives a module being loaded under
another name: such a process compiles afresh and saves nothing, so it cannot leave compiled kernels
that name a module later processes cannot import (before the guard, format/_numba_cache.py, they
failed with ModuleNotFoundError: No module named '<dynamic>')."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from store_fixtures import REPO_ROOT


@dataclass(frozen=True)
class Kernels:
    file: str  # in dcr_cli/format
    call: str  # runs the module's kernels (bound as ``kernels``) and prints "RESULT ..."
    expected: str | None  # the RESULT line, where it is known in advance


KERNELS = Kernels(
    "kernels.py",
    """
base = np.arange(1 << 16, dtype=np.uint16)  # large enough for the GIL-releasing variant
new = base.copy()
new[::7] ^= np.uint16(0x0101)
positions, masks, news = kernels.scan_changes(base, new)
print("RESULT", len(positions), *(int(a.astype(np.int64).sum()) for a in (positions, masks, news)))
""",
    None,
)
JSON_DEPTH = Kernels(
    "_json_depth.py",
    """
doc = b'{"a": [[1, 2.5e10, 123456789012345678901234], "[[[ 99999999999999999999999999"], "b": {"c": -7}}'
print("RESULT", *kernels.scan(np.frombuffer(doc, dtype=np.uint8)))
""",
    "RESULT 3 24",  # depth 3 ({, [, [); the 24-digit literal (the one in the string does not count)
)

ALIAS = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location({name!r}, {path!r})
kernels = importlib.util.module_from_spec(spec)
if {register}:
    sys.modules[{name!r}] = kernels
spec.loader.exec_module(kernels)
"""

PACKAGE = """
import sys, importlib
sys.path.insert(0, {root!r})
kernels = importlib.import_module("kpkg." + {module!r})
"""


def _run(code: str, k: Kernels, cwd: Path) -> tuple[str, str]:
    # This checkout's dcr_cli (the guard, format/_numba_cache.py) for the copies' absolute import.
    env = {**os.environ, "NUMBA_DEBUG_CACHE": "1", "PYTHONPATH": str(REPO_ROOT)}
    env.pop("NUMBA_CACHE_DIR", None)
    env.pop("NUMBA_DISABLE_JIT", None)
    script = code + "import numpy as np\n" + k.call + 'print("CACHED", kernels._CACHE)\n'
    proc = subprocess.run([sys.executable, "-c", script], cwd=cwd, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    result = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT"))
    return result, proc.stdout + proc.stderr


@pytest.mark.parametrize("k", [KERNELS, JSON_DEPTH], ids=lambda k: k.file)
def test_a_process_that_loads_kernels_under_another_name_does_not_poison_the_cache(k: Kernels, tmp_path: Path) -> None:
    pkg = tmp_path / "kpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    shutil.copy(REPO_ROOT / "dcr_cli" / "format" / k.file, pkg / k.file)
    path, module = str(pkg / k.file), k.file.removesuffix(".py")
    cache = pkg / "__pycache__"

    # Under other names (not registered; registered under a name no fresh process can import):
    # compiled afresh, nothing saved.
    results = set()
    for name, register in (("kernels_elsewhere", False), ("kernels_elsewhere", True), ("kpkg.other", True)):
        result, log = _run(ALIAS.format(name=name, path=path, register=register), k, tmp_path)
        assert "CACHED False" in log
        assert "saved" not in log, log
        assert not (cache.exists() and list(cache.glob("*.nb*")))
        results.add(result)

    # Imported as the package's submodule: compiled and saved once, then loaded from the cache.
    first, log = _run(PACKAGE.format(root=str(tmp_path), module=module), k, tmp_path)
    assert "CACHED True" in log and "index saved" in log, log
    assert list(cache.glob(f"{module}.*.nbi"))
    again, log = _run(PACKAGE.format(root=str(tmp_path), module=module), k, tmp_path)
    assert "data loaded" in log and "saved" not in log, log
    # And a process under another name still works next to that cache (it neither loads nor replaces it).
    other, log = _run(ALIAS.format(name="kernels_elsewhere", path=path, register=False), k, tmp_path)
    assert "saved" not in log and "loaded" not in log, log
    results |= {first, again, other}
    assert len(results) == 1, results
    if k.expected is not None:
        assert results == {k.expected}


def test_dcr_s_own_imports_cache_their_kernels() -> None:
    """dcr's own import path passes the guard, so every process loads the compiled kernels from disk
    instead of compiling them afresh."""
    from dcr_cli.format import _json_depth, kernels

    assert kernels._CACHE is True and _json_depth._CACHE is True
