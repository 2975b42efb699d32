"""The README's first command, run as a user runs it: examples/main_job.sh end to end."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_main_job_runs_end_to_end(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "WORK": str(tmp_path / "work"),
        "DCR_SKIP_SETUP": "1",
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    r = subprocess.run(
        ["bash", str(ROOT / "examples" / "main_job.sh")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = r.stdout
    assert "path: shortcut step-3..step-5" in out  # the late receiver took the squashed shortcut
    assert "ok, 25 tensors match version step-5" in out
    assert "hold exactly the bits of" in out  # after both byte-for-byte cmp checks
    work = tmp_path / "work"
    assert (work / "rollout" / "model.safetensors").read_bytes() == (
        work / "trainer" / "step-5" / "model.safetensors"
    ).read_bytes()
