"""A checkpoint's ``.dcr`` (and its lock) must not lead outside the checkpoint (receiver-checkpoint §1, §3).
Before, ``CKPT/.dcr`` as a symbolic link was followed: apply wrote its lock, state and table into the
directory it named (exit 0), and two checkpoints linking one ``.dcr`` shared a lock and each other's state;
a ``.dcr/lock`` link created the file it named. Now both are refused with one line, exit 2, nothing written."""

from __future__ import annotations

import os
from pathlib import Path

from helpers_checkpoints import copy_checkpoint, snapshot
from store_fixtures import make_deltas, one_error_line, run_dcr


def _listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_a_symlinked_state_directory_is_refused(tmp_path: Path) -> None:
    ckpts, deltas = make_deltas(tmp_path, 1)
    recv = copy_checkpoint(ckpts[0], tmp_path / "recv")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (recv / ".dcr").symlink_to(elsewhere)
    before = snapshot(recv)

    line = one_error_line(run_dcr("apply", str(deltas[0]), "--into", str(recv)))
    assert "symbolic link" in line and "remove the link" in line, line
    assert _listing(elsewhere) == [] and snapshot(recv) == before
    proc = run_dcr("verify", str(recv))  # reads the recorded version: not through the link either
    assert proc.returncode == 2 and "symbolic link" in one_error_line(proc)
    assert _listing(elsewhere) == []

    (recv / ".dcr").unlink()  # the fix the line gives
    proc = run_dcr("apply", str(deltas[0]), "--into", str(recv))
    assert proc.returncode == 0, proc.stderr


def test_a_symlinked_lock_creates_nothing_outside(tmp_path: Path) -> None:
    ckpts, deltas = make_deltas(tmp_path, 1)
    recv = copy_checkpoint(ckpts[0], tmp_path / "recv")
    (recv / ".dcr").mkdir()
    target = tmp_path / "created-by-the-lock"
    os.symlink(target, recv / ".dcr" / "lock")
    before = snapshot(recv)
    proc = run_dcr("apply", str(deltas[0]), "--into", str(recv))
    assert proc.returncode == 2, proc.stderr
    one_error_line(proc)
    assert not target.exists() and snapshot(recv) == before
