"""SIGKILL `dcr apply` at random instants, re-run it, and check the checkpoint is bit-exact every time."""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from helpers_checkpoints import copy_checkpoint, mutate, random_tensors, read_raw, snapshot, write_checkpoint

from dcr_cli.produce import diff
from dcr_cli.receive.checkpoint import read_state

ITERATIONS = 16


def apply_cmd(delta: Path, recv: Path) -> list[str]:
    # One worker: items are written one after another, which widens the window a kill can land in.
    return [sys.executable, "-m", "dcr_cli", "apply", str(delta), "--into", str(recv), "--workers", "1"]


def env() -> dict[str, str]:
    root = str(Path(__file__).resolve().parents[1])
    return {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}


def state_kind(recv: Path) -> str:
    state = read_state(recv)  # must always parse: it is replaced atomically
    if state is None:
        return "no state"
    return "applying" if state.applying else "done"


def calibrate(delta: Path, v0: Path, recv: Path) -> tuple[float, float]:
    """(seconds until the state says "applying", seconds until the run ends) for one undisturbed run."""
    copy_checkpoint(v0, recv)
    started = time.perf_counter()
    proc = subprocess.Popen(apply_cmd(delta, recv), env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    applying_at = None
    while proc.poll() is None:
        if applying_at is None and (recv / ".dcr" / "state.json").exists() and state_kind(recv) == "applying":
            applying_at = time.perf_counter() - started
        time.sleep(0.002)
    ended = time.perf_counter() - started
    assert proc.returncode == 0, proc.stderr.read() if proc.stderr else ""
    shutil.rmtree(recv)
    return applying_at or ended * 0.7, ended


def run_and_kill(cmd: list[str], delay: float, recv: Path | None = None) -> int | None:
    """SIGKILL the command ``delay`` seconds after it starts, or, given ``recv``, after it starts writing."""
    proc = subprocess.Popen(cmd, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if recv is not None:
        deadline = time.perf_counter() + 30
        while proc.poll() is None and time.perf_counter() < deadline:
            if (recv / ".dcr" / "state.json").exists() and state_kind(recv) == "applying":
                break
            time.sleep(0.001)
    time.sleep(delay)
    proc.send_signal(signal.SIGKILL)
    return proc.wait()


@pytest.mark.slow
def test_sigkill_at_random_points_then_rerun_is_bit_exact(tmp_path: Path) -> None:
    rng = np.random.default_rng(2024)
    specs = [(f"layers.{i}.w", "BF16", (256, 512)) for i in range(64)] + [("embed", "F32", (2048, 512))]
    t0 = random_tensors(rng, specs)
    t1 = mutate(rng, t0, 0.05)
    write_checkpoint(tmp_path / "v0", t0, shards=3)
    write_checkpoint(tmp_path / "v1", t1, shards=3)
    delta = tmp_path / "delta"
    diff(tmp_path / "v0", tmp_path / "v1", delta, base_version="v0", target_version="v1")
    target_raw, target_files = read_raw(tmp_path / "v1"), snapshot(tmp_path / "v1")
    recv = tmp_path / "recv"
    applying_at, ended = calibrate(delta, tmp_path / "v0", recv)

    chooser = random.Random(7)
    outcomes: Counter[str] = Counter()
    for i in range(ITERATIONS):
        copy_checkpoint(tmp_path / "v0", recv)
        # Half the kills anywhere in the run, half inside the window where items are written.
        if i % 2:
            delay = chooser.uniform(0, ended)
            run_and_kill(apply_cmd(delta, recv), delay)
        else:
            # The first half of the writing window: the calibrated run's window ends with the proof
            # and the final state, and on a loaded machine a late pick lands after the end.
            delay = chooser.uniform(0, (ended - applying_at) / 2)
            run_and_kill(apply_cmd(delta, recv), delay, recv=recv)
        outcomes[state_kind(recv)] += 1
        if i % 3 == 0:  # kill the re-run too: recovery itself must be interruptible
            run_and_kill(apply_cmd(delta, recv), chooser.uniform(0, ended))
            state_kind(recv)
        done = subprocess.run(apply_cmd(delta, recv), env=env(), capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        if "resumed" in done.stdout and " 0 repaired" not in done.stdout:
            outcomes["rerun repaired torn items"] += 1
        assert read_raw(recv) == target_raw, f"iteration {i}: not bit-exact after kill at {delay:.3f}s"
        assert snapshot(recv) == target_files
        assert state_kind(recv) == "done"
        shutil.rmtree(recv)
    print(f"kill outcomes: {dict(outcomes)}; calibrated applying at {applying_at:.3f}s, end {ended:.3f}s")
    assert outcomes["applying"] >= 3, f"too few kills landed mid-apply to mean anything: {dict(outcomes)}"
