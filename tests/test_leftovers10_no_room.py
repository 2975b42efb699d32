"""F6: a write that finds no room (a file-size limit here: RLIMIT_FSIZE with SIGXFSZ ignored, as a full disk
fails a write) is one line naming the file and the next step, leaves no temporary file, and re-running the
same command with room finishes the job."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO
from helpers_checkpoints import write_checkpoint

NEXT_STEP = "free space (or raise the file-size limit), then re-run the same command"


def _pair(root: Path) -> tuple[Path, Path]:
    rng = np.random.default_rng(0)
    base = {f"w{i}": ("BF16", (256, 64), rng.integers(0, 1 << 16, 256 * 64, dtype=np.uint16)) for i in range(4)}
    new = {k: (d, s, v ^ (rng.random(v.size) < 0.05).astype(np.uint16)) for k, (d, s, v) in base.items()}
    return write_checkpoint(root / "a", base, shards=2), write_checkpoint(root / "b", new, shards=2)


def _dcr_limited(limit: int, *args: str) -> subprocess.CompletedProcess[str]:
    def limited() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "dcr_cli", *args],
        env=env,
        preexec_fn=limited,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _temporaries(root: Path) -> list[str]:
    return [str(p) for p in root.rglob("*") if ".tmp-" in p.name or ".partial-" in p.name]


def _one_line(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert proc.stderr.startswith("dcr: error: File too large (writing ") and proc.stderr.count("\n") == 1
    assert NEXT_STEP in proc.stderr
    return proc.stderr


# The receiver's table.json is written first (~0.5 KiB), then state.json (~0.9 KiB), then the shards in place
# (64 KiB each): each limit stops a different writer.
@pytest.mark.parametrize("limit", [300, 600, 2048])
def test_apply_without_room(tmp_path: Path, dcr, limit: int) -> None:
    a, b = _pair(tmp_path)
    delta = tmp_path / "d"
    dcr("diff", str(a), str(b), "-o", str(delta), check=True)
    line = _one_line(_dcr_limited(limit, "apply", str(delta), "--into", str(a)))
    assert f"(writing {a}" in line  # the checkpoint, or the file of it being written
    assert _temporaries(tmp_path) == []
    dcr("apply", str(delta), "--into", str(a), check=True)  # with room, the same command finishes
    dcr("verify", str(a), "--against", str(delta), check=True)


def test_diff_without_room(tmp_path: Path, dcr) -> None:
    a, b = _pair(tmp_path)
    out = tmp_path / "deltas" / "d"
    line = _one_line(_dcr_limited(1024, "diff", str(a), str(b), "-o", str(out)))
    assert f"(writing {out})" in line
    assert not out.exists() and _temporaries(tmp_path) == []
    dcr("diff", str(a), str(b), "-o", str(out), check=True)


def test_the_one_error_path_names_the_file_and_the_next_step_once() -> None:
    import errno

    from dcr_cli.cli.common import exit_code_of

    for code in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
        exit_code, line = exit_code_of(OSError(code, os.strerror(code), "/ckpt/.dcr/table.json"))
        assert (
            exit_code == 2 and line == f"dcr: error: {os.strerror(code)} (writing /ckpt/.dcr/table.json); {NEXT_STEP}"
        )
    # A writer that said what to do already (the receiver's state files): its words, not two next steps.
    explained = OSError(errno.ENOSPC, "No space left on device; free space and re-run the same dcr apply", "/c/s")
    assert exit_code_of(explained)[1].count("re-run") == 1
    assert exit_code_of(OSError(errno.EIO, "Input/output error", "/x"))[1] == "dcr: error: Input/output error (/x)"
