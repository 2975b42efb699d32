"""receive/vllm/node_copy.py: a remote delta's data blocks downloaded once per node, read by every rank.

Without an engine (tests/test_vllm_tp.py runs the whole path in a TP=2 vLLM): a real S3 endpoint
(moto) behind a proxy that counts requests, and the delta of two small checkpoints.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO
from store_fixtures import CountingProxy, S3Endpoint, decodes_as, make_deltas, published_remotely, removed_after

from dcr_cli.delta.reader import Delta
from dcr_cli.errors import IntegrityError
from dcr_cli.receive.vllm import node_copy


@pytest.fixture
def remote(
    tmp_path: Path, s3_endpoint: S3Endpoint, s3_url: str
) -> Iterator[tuple[Path, Callable[[], Delta], CountingProxy]]:
    """d1 published on an S3 store; a function opening it by its store location through a counting proxy."""
    _, (d1,) = make_deltas(tmp_path, 1)
    with published_remotely(d1, s3_endpoint, s3_url) as (open_remote, proxy):
        yield d1, open_remote, proxy


def test_every_rank_reads_the_nodes_copy_and_repair_blocks_from_the_store(
    remote: tuple[Path, Callable[[], Delta], CountingProxy],
) -> None:
    local, open_remote, proxy = remote
    leader = open_remote()
    with removed_after(node_copy.download_data_blocks(leader)) as copy:
        assert (os.stat(copy.parent).st_mode & 0o777) == 0o700
        ranks = [node_copy.read_through_copy(open_remote(), str(copy)) for _ in range(2)]
        for delta in ranks:
            delta.prefetch_blocks()  # the data blocks are local: checked here, nothing fetched
            delta.verify_blocks()
            decodes_as(delta, local)
        blocks = leader.manifest.blocks
        assert all(proxy.gets_for(b.id) == (1 if b.role == "data" else 0) for b in blocks)  # once, by the leader
        # A torn item's repair values come from the store, as before (the copy holds data blocks only).
        item = next(it for it in ranks[0].manifest.items if it.repair is not None)
        repair = ranks[0].manifest.blocks[item.repair.block]
        assert np.array_equal(ranks[0].repair_values(item), Delta.open(local).repair_values(item))
        assert proxy.gets_for(repair.id) >= 1


def test_a_corrupt_block_on_the_store_fails_and_leaves_no_copy(
    remote: tuple[Path, Callable[[], Delta], CountingProxy], s3_endpoint: S3Endpoint
) -> None:
    _, open_remote, _ = remote
    delta = open_remote()
    block = next(b for b in delta.manifest.blocks if b.role == "data")
    fs = s3_endpoint.filesystem()
    path = delta.block_path(block).removeprefix("s3://")
    raw = bytearray(fs.cat_file(path))
    raw[len(raw) // 2] ^= 0x01
    fs.pipe_file(path, bytes(raw))
    root = Path(tempfile.gettempdir()) / f"dcr-engine-{os.getuid()}"
    before = set(root.iterdir()) if root.exists() else set()
    with pytest.raises(IntegrityError, match="corrupt"):
        node_copy.download_data_blocks(open_remote())
    assert set(root.iterdir()) == before  # the partial copy is removed


def test_a_link_in_place_of_the_private_directory_is_not_followed(
    remote: tuple[Path, Callable[[], Delta], CountingProxy], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ranks then read the delta where it is (None), instead of writing where someone else points them."""
    _, open_remote, _ = remote
    shared, elsewhere = tmp_path / "tmp", tmp_path / "elsewhere"
    shared.mkdir()
    elsewhere.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(shared))
    (shared / f"dcr-engine-{os.getuid()}").symlink_to(elsewhere)
    assert node_copy.download_data_blocks(open_remote()) is None
    assert list(elsewhere.iterdir()) == []
    # A looser mode of the user's own directory is tightened, then used.
    (shared / f"dcr-engine-{os.getuid()}").unlink()
    (shared / f"dcr-engine-{os.getuid()}").mkdir()
    os.chmod(shared / f"dcr-engine-{os.getuid()}", 0o777)
    directory = node_copy.download_data_blocks(open_remote())
    assert directory is not None and Path(directory).parent == shared / f"dcr-engine-{os.getuid()}"
    assert (os.stat(Path(directory).parent).st_mode & 0o777) == 0o700


_ENGINE = """
import os, signal, sys
from dcr_cli.delta.reader import Delta
from dcr_cli.receive.vllm import node_copy
print(node_copy.download_data_blocks(Delta.open(sys.argv[1])), flush=True)
if sys.argv[2] == "kill":
    os.kill(os.getpid(), signal.SIGKILL)  # an engine killed with its copy on disk
sys.stdin.read()  # a live engine: holds its copy until told to go
"""


def _engine(delta: Path, tmp: Path, how: str) -> tuple[subprocess.Popen[str], str]:
    """A process that makes a node copy as an engine's leader does, then is killed or stays alive."""
    env = {**os.environ, "TMPDIR": str(tmp), "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-c", _ENGINE, str(delta), how], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    directory = proc.stdout.readline().strip()
    assert directory.startswith(str(tmp)) and f"-{proc.pid}-" in os.path.basename(directory)
    return proc, directory


def test_the_leader_removes_the_copies_of_killed_engines_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _, (d1,) = make_deltas(tmp_path, 1)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    killed, stale = _engine(d1, tmp, "kill")
    assert killed.wait(timeout=60) == -signal.SIGKILL and os.path.isdir(stale)
    alive, live = _engine(d1, tmp, "wait")
    root = tmp / f"dcr-engine-{os.getuid()}"
    # Not provably stale: a directory without a lock file (being made, or an older dcr's), and a link to
    # a directory elsewhere that looks like a stale copy (never followed).
    (root / "being-made").mkdir()
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "blocks").mkdir(parents=True)
    (elsewhere / ".lock").touch()
    (root / "link").symlink_to(elsewhere)
    try:
        directory = node_copy.download_data_blocks(Delta.open(d1))
        assert directory is not None
        assert not os.path.exists(stale)  # the killed engine's copy is gone
        assert os.path.isdir(live) and (root / "being-made").is_dir()  # the live engine's copy is kept
        assert (root / "link").is_symlink() and (elsewhere / ".lock").exists() and (elsewhere / "blocks").is_dir()
        # This process's own copy is kept by its next download while it exists, and its lock let go once
        # the backend removed it (one descriptor per copy on disk, not one per refit).
        again = node_copy.download_data_blocks(Delta.open(d1))
        assert again is not None and os.path.isdir(directory)
        for made in (directory, again):
            shutil.rmtree(made)
        fds = len(os.listdir("/proc/self/fd"))
        for _ in range(3):
            made = node_copy.download_data_blocks(Delta.open(d1))
            assert made is not None
            shutil.rmtree(made)  # as backend.drop_spool does
        assert len(os.listdir("/proc/self/fd")) <= fds + 1
    finally:
        alive.communicate("", timeout=60)
    node_copy.download_data_blocks(Delta.open(d1))
    assert not os.path.exists(live)  # that engine is gone now: so is its copy
