"""``--wait nan`` is refused at once (exit 2, one line, nothing written). Before, click's range check let NaN
through (no comparison with it is true) and ``dcr apply --wait nan`` / ``dcr commit --wait nan`` waited for good
("waiting up to nan s"), a cron job that never ends."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers_checkpoints import copy_checkpoint, snapshot
from store_fixtures import make_deltas, one_error_line, run_dcr

from dcr_cli.errors import DcrError
from dcr_cli.store import push
from dcr_cli.store.ledger import commit


def test_wait_nan_is_refused_not_endless(tmp_path: Path) -> None:
    ckpts, deltas = make_deltas(tmp_path, 1)
    url = str(tmp_path / "store")
    push(deltas[0], url)
    recv = copy_checkpoint(ckpts[0], tmp_path / "recv")
    before = snapshot(recv)
    for args in (
        ["apply", url, "--version", "v9", "--wait", "nan", "--into", str(recv)],
        ["commit", url, "v1", "--receiver", "r", "--wait", "nan"],
    ):
        proc = run_dcr(*args, timeout=60)
        assert proc.returncode == 2, proc.stderr
        assert "--wait must be a number of seconds" in one_error_line(proc)
    assert snapshot(recv) == before and not (recv / ".dcr").exists()
    assert not (Path(url) / "commits").exists()
    with pytest.raises(DcrError, match="not nan"):
        commit(url, "v1", receivers=["r"], wait=float("nan"))
