"""Damage and hostile objects: `dcr check` reports what is wrong (exit 1), readers refuse before reading."""

from __future__ import annotations

import json
import os
import shutil
import tracemalloc
from pathlib import Path

import pytest
from store_fixtures import make_deltas, run_dcr

from dcr_cli.delta.reader import Delta
from dcr_cli.errors import FormatError, IntegrityError
from dcr_cli.store import Store, acknowledge, check, commit, log, pull, push, status


@pytest.fixture(scope="module")
def deltas(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Path], list[Path]]:
    return make_deltas(tmp_path_factory.mktemp("ckpts"), 3)


def _chain(tmp_path: Path, deltas: list[Path], committed: int) -> str:
    url = str(tmp_path / "store")
    for i, d in enumerate(deltas):
        result = push(d, url)
        if i < committed:
            acknowledge(url, result.version, "r")
            commit(url, result.version, receivers=["r"])
    return url


def _problems(url: str) -> list[str]:
    report = check(url)
    assert not report.ok
    cli = run_dcr("check", url)
    assert cli.returncode == 1 and cli.stderr.strip().splitlines()[-1].startswith("dcr: error:"), cli.stderr
    return report.problems


def test_a_deleted_head_or_tip_manifest_is_damage(tmp_path: Path, deltas: tuple[list[Path], list[Path]]) -> None:
    _, ds = deltas
    url = _chain(tmp_path, ds, committed=2)  # v1, v2 committed; v3 pending (the tip)
    store = Store(url)
    assert check(url).ok
    for version in ("v3", "v2"):
        record = store.require_version(version)
        path = tmp_path / "store" / "manifests" / f"{record.manifest}.json"
        saved = path.read_bytes()
        path.unlink()
        problems = _problems(url)
        assert any(version in p and "manifest" in p and "missing" in p for p in problems), problems
        path.write_bytes(saved)
    assert check(url).ok


def test_a_deleted_commit_record_is_damage(tmp_path: Path, deltas: tuple[list[Path], list[Path]]) -> None:
    _, ds = deltas
    url = _chain(tmp_path, ds, committed=3)
    commits = tmp_path / "store" / "commits"
    # The last commit record: the head rolls back silently to v2 while latest.json names v3.
    (commits / "v2.json").unlink()
    assert status(url)["head"]["version"] == "v2"
    assert any("latest.json names 'v3'" in p for p in _problems(url))
    # A commit record in the middle: the ones after it are off the chain.
    shutil.move(commits / "v1.json", tmp_path / "v1.json")
    assert any("commits/v1.json" not in p and "not on the commit chain" in p for p in _problems(url))


def test_a_commit_record_of_another_base_or_fingerprint_is_damage(
    tmp_path: Path, deltas: tuple[list[Path], list[Path]]
) -> None:
    _, ds = deltas
    url = _chain(tmp_path, ds, committed=2)
    path = tmp_path / "store" / "commits" / "v1.json"  # commits v2, built on v1
    good = json.loads(path.read_text())
    for field, value in (("target", {**good["target"], "fingerprint": "e" * 64}), ("base", good["target"])):
        path.write_text(json.dumps({**good, field: value}))
        problems = _problems(url)
        assert any("v2" in p for p in problems), problems
    path.write_text(json.dumps(good))
    assert check(url).ok


def test_a_corrupt_version_record_is_reported_as_damage(tmp_path: Path, deltas: tuple[list[Path], list[Path]]) -> None:
    _, ds = deltas
    url = _chain(tmp_path, ds[:1], committed=1)
    record = tmp_path / "store" / "versions" / "v1.json"
    for damage in (b'{"format": "dcr.store.version", "format_version": [1, 0], ' + b"[" * 1000, b"{" * 2000, b"\x00"):
        record.write_bytes(damage)
        problems = _problems(url)  # exit 1 with a list, not exit 2 at the first bad record
        assert any("versions/v1.json" in p for p in problems), problems
    dup = tmp_path / "store" / "versions" / "v9.json"
    dup.write_bytes(b'{"format": "dcr.store.version", "format": "dcr.store.version", "format_version": [1, 0]}')
    assert any("versions/v9.json" in p and "duplicate" in p for p in _problems(url))


def test_acks_count_by_their_object_name(tmp_path: Path, deltas: tuple[list[Path], list[Path]]) -> None:
    _, ds = deltas
    url = _chain(tmp_path, ds[:1], committed=0)
    acknowledge(url, "v1", "east")
    acks = tmp_path / "store" / "acks" / "v1"
    shutil.copy(acks / "east.json", acks / "west.json")  # says "east" inside: not west's acknowledgement
    from dcr_cli.errors import NotReadyError

    with pytest.raises(NotReadyError, match="missing: west"):
        commit(url, "v1", receivers=["east", "west"])
    assert [e.acked for e in log(url)] == [["east"]]


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "directory"])
def test_a_manifest_that_is_not_a_plain_file_is_refused_at_once(
    tmp_path: Path, deltas: tuple[list[Path], list[Path]], kind: str
) -> None:
    _, (d1, *_) = deltas
    delta = tmp_path / "d"
    shutil.copytree(d1, delta)
    manifest = delta / "manifest.json"
    manifest.unlink()
    if kind == "fifo":
        os.mkfifo(manifest)
    elif kind == "dev-zero":
        manifest.symlink_to("/dev/zero")
    else:
        manifest.mkdir()
    with pytest.raises(FormatError):
        Delta.open(delta)
    for args in (("inspect", str(delta)), ("push", str(delta), str(tmp_path / "store"))):
        proc = run_dcr(*args, timeout=30)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and proc.stderr.startswith("dcr: error:"), (
            proc.stderr
        )
    assert not (tmp_path / "store").exists()


def _giant(path: Path, size: int = 1 << 30) -> None:
    """Make the file at ``path`` 1 GiB (sparse: nothing is written, every byte beyond is zero)."""
    with open(path, "r+b") as f:
        f.truncate(size)


def test_a_block_far_larger_than_declared_is_refused_without_reading_it(
    tmp_path: Path, deltas: tuple[list[Path], list[Path]]
) -> None:
    """A 1 GiB block declared as a few KB was read whole before the size check (1.17 GB peak)."""
    _, (d1, *_) = deltas
    delta = tmp_path / "d"
    shutil.copytree(d1, delta)
    opened = Delta.open(delta)
    block = next(b for b in opened.manifest.blocks if b.role == "data")
    url = str(tmp_path / "store")
    push(d1, url)
    _giant(delta / "blocks" / block.id)
    _giant(tmp_path / "store" / "blocks" / block.id)

    tracemalloc.start()
    try:
        with pytest.raises(IntegrityError, match="larger"):
            opened.verify_blocks()
        with pytest.raises(IntegrityError, match="corrupt on the store"):
            pull(url, tmp_path / "out")
        report = check(url, read_data=True)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert not (tmp_path / "out").exists()
    assert not report.ok and any(block.id[:16] in p for p in report.problems)
    assert peak < 64 << 20, f"peak {peak} bytes while refusing a 1 GiB block"
