"""A command whose stdout reader went away (``dcr apply … | head -1``, a log shipper that restarts) finishes
its work: the lines it cannot print are dropped, the exit code still tells how the work went. Before, the
first line printed to the closed pipe (the ``path:`` line, or the first delta's report) stopped the command
with ``dcr: error: Broken pipe (I/O)``, exit 2: a lagging receiver was left part-way along its chain and
its --ack never went out."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from helpers_checkpoints import copy_checkpoint, read_raw
from store_fixtures import REPO_ROOT, commit_each, make_deltas

from dcr_cli.store import Store, push


def _run_with_closed_stdout(*args: str) -> subprocess.CompletedProcess[str]:
    """Run dcr with a stdout pipe whose reading end is closed before dcr writes anything."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run(
            [sys.executable, "-m", "dcr_cli", *args],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
            cwd=REPO_ROOT,
            timeout=120,
        )
    finally:
        os.close(write_end)


def test_apply_since_with_a_closed_stdout_finishes_the_chain_and_acks(tmp_path: Path) -> None:
    ckpts, deltas = make_deltas(tmp_path, 3)
    url = str(tmp_path / "store")
    commit_each(url, deltas[:2])
    push(deltas[2], url)  # v3 pending: the receiver's ack is what its commit waits for
    recv = copy_checkpoint(ckpts[0], tmp_path / "recv")
    proc = _run_with_closed_stdout(
        "apply", url, "--since", "v0", "--into", str(recv), "--ack", url, "--receiver", "east"
    )
    assert proc.returncode == 0, proc.stderr
    assert "Broken pipe" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert read_raw(recv) == read_raw(ckpts[3])
    assert Store(url).exists("acks/v3/east.json")


def test_json_to_a_closed_stdout_is_no_failure_of_the_work(tmp_path: Path) -> None:
    _ckpts, deltas = make_deltas(tmp_path, 1)
    url = str(tmp_path / "store")
    proc = _run_with_closed_stdout("push", str(deltas[0]), url, "--json")
    assert proc.returncode == 0, proc.stderr
    assert Store(url).exists("complete/v1")
