"""Receivers and producers that start before the version exists: ``apply --wait`` and ``commit --wait``."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from store_fixtures import make_deltas

import dcr_cli
from dcr_cli.cli import main
from dcr_cli.errors import DcrError, NotReadyError
from dcr_cli.receive.checkpoint.state import read_state
from dcr_cli.store import acknowledge, commit, push, status


@pytest.fixture(scope="module")
def deltas(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Path], list[Path]]:
    return make_deltas(tmp_path_factory.mktemp("ckpts"), 1)


def later(seconds: float, fn: object, *args: object) -> threading.Thread:
    def run() -> None:
        time.sleep(seconds)
        fn(*args)  # type: ignore[operator]

    th = threading.Thread(target=run)
    th.start()
    return th


def test_apply_waits_for_the_store_and_the_version_then_commit_waits_for_the_ack(
    deltas: tuple[list[Path], list[Path]], tmp_path: Path
) -> None:
    (c0, c1), (d1,) = deltas
    url = str(tmp_path / "store")  # not even created yet: the first push creates it
    recv = tmp_path / "recv"
    shutil.copytree(c0, recv)
    committed: list[object] = []
    committer = threading.Thread(
        target=lambda: committed.append(commit(url, "v1", receivers=["r0"], wait=30)),
    )
    committer.start()
    pusher = later(0.4, push, d1, url)
    started = time.monotonic()
    result = dcr_cli.apply(url, into=recv, version="v1", wait=30, verify=True, ack=url, receiver="r0")
    waited = time.monotonic() - started
    pusher.join()
    committer.join(timeout=30)
    assert waited >= 0.4 and result.version == "v1" and result.verified and result.verified["ok"]
    assert committed and committed[0].acked == ["r0"]  # type: ignore[attr-defined]
    assert status(url)["head"]["version"] == "v1"
    assert dcr_cli.verify(recv, against=d1).ok and dcr_cli.verify(c1, against=d1).ok


def test_apply_wait_times_out_with_exit_4_and_writes_nothing(
    deltas: tuple[list[Path], list[Path]], tmp_path: Path
) -> None:
    (c0, _), (d1,) = deltas
    url = str(tmp_path / "store")
    push(d1, url)
    recv = tmp_path / "recv"
    shutil.copytree(c0, recv)
    before = {p.name: p.read_bytes() for p in recv.iterdir()}
    started = time.monotonic()
    code = CliRunner().invoke(main, ["apply", url, "--version", "v2", "--into", str(recv), "--wait", "0.3"])
    assert time.monotonic() - started >= 0.3
    assert code.exit_code == 4 and "version 'v2' did not appear in time" in code.stderr, code.output
    assert {p.name: p.read_bytes() for p in recv.iterdir()} == before and read_state(recv) is None


def test_wait_needs_a_version_and_one_store(deltas: tuple[list[Path], list[Path]], tmp_path: Path) -> None:
    (c0, _), (d1,) = deltas
    with pytest.raises(DcrError, match="--wait needs"):
        dcr_cli.apply(str(tmp_path / "store"), into=c0, wait=1)
    with pytest.raises(DcrError, match="--wait needs"):
        dcr_cli.apply([d1, d1], into=c0, version="v1", wait=1)


def test_commit_wait_times_out_with_exit_4_and_commits_nothing(
    deltas: tuple[list[Path], list[Path]], tmp_path: Path
) -> None:
    _, (d1,) = deltas
    url = str(tmp_path / "store")
    push(d1, url)
    acknowledge(url, "v1", "r0")
    started = time.monotonic()
    with pytest.raises(NotReadyError, match="new acknowledgement"):
        commit(url, "v1", receivers=["r0", "r1"], wait=0.3)
    assert time.monotonic() - started >= 0.3
    assert status(url)["head"]["version"] == "v0"
    code = CliRunner().invoke(main, ["commit", url, "v1", "--receiver", "r0", "--receiver", "r1", "--wait", "0.2"])
    assert code.exit_code == 4, code.output
    later(0.2, acknowledge, url, "v1", "r1").join(0)
    assert commit(url, "v1", receivers=["r0", "r1"], wait=30).acked == ["r0", "r1"]
