"""A writer killed part-way (SIGKILL, OOM, preemption) leaves ``.<out>.partial-<random>``; the next writer of
the same output removes it once no live process holds its lock. Before, every killed ``dcr diff`` (or squash)
left a delta's worth of blocks there for good, and each retry added another directory."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from store_fixtures import REPO_ROOT, diff_args, write_checkpoint


def _partials(parent: Path, name: str) -> list[Path]:
    return sorted(parent.glob(f".{name}.partial-*"))


def test_a_killed_diff_leaves_nothing_after_the_next_one(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    # 32 MiB: a diff that runs long enough to be killed part-way
    base = {f"w{i}": rng.standard_normal(1 << 20).astype(np.float32) for i in range(8)}
    new = {k: v.copy() for k, v in base.items()}
    for v in new.values():
        v[::37] += 1
    c0, c1 = write_checkpoint(tmp_path / "c0", base), write_checkpoint(tmp_path / "c1", new)
    out = tmp_path / "d"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    args = [sys.executable, "-m", "dcr_cli", *diff_args(c0, c1, out, "v0", "v1"), "--workers", "1"]
    proc = subprocess.Popen(args, env=env, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not any((p / "blocks").is_dir() for p in _partials(tmp_path, "d")):
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not out.exists()
    (killed,) = _partials(tmp_path, "d")  # what the kill left

    # A directory whose writer still lives is left alone (its lock is held), and so is one without a lock.
    live = tmp_path / ".d.partial-live"
    live.mkdir()
    fd = os.open(live / ".lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    legacy = tmp_path / ".d.partial-legacy"
    legacy.mkdir()
    try:
        done = subprocess.run(args, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        assert not killed.exists()
        assert _partials(tmp_path, "d") == sorted([legacy, live])
        assert not (out / ".lock").exists() and sorted(p.name for p in out.iterdir()) == ["blocks", "manifest.json"]
    finally:
        os.close(fd)
