"""Repair blocks go up after the version record (store-v1 §4.1, 1.1): off the producer's critical path.

A receiver can apply a version as soon as it is published; what needs repair blocks (a torn item's
repair from a store, ``pull --repair``, squashing by ``dcr compact``) refuses a version that lacks
them with one line and writes nothing; ``dcr check`` tells a pending repair upload from damage; a
push stopped after publishing is finished by running it again; gc keeps a published version's
repair blocks whenever it runs.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from helpers_checkpoints import copy_checkpoint, read_raw
from store_fixtures import S3Endpoint, big_delta, json_out, run_dcr, spawn_dcr, tear_from_store

from dcr_cli.api import apply
from dcr_cli.delta.reader import Delta
from dcr_cli.errors import IntegrityError, NotReadyError
from dcr_cli.store import Store, acknowledge, check, commit, gc, pull, push
from dcr_cli.store.keyframes import compact, publish_keyframe
from dcr_cli.store.transfer import PushResult, missing_repair_blocks, split_roles


@pytest.fixture
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, dict[str, Any]]:
    if request.param == "local":
        return str(tmp_path / "store"), {}
    endpoint: S3Endpoint = request.getfixturevalue("s3_endpoint")
    return request.getfixturevalue("s3_url"), endpoint.storage_options


def _present(store: Store, block_id: str) -> bool:
    return store.stat(f"blocks/{block_id}") is not None


@pytest.mark.parametrize("store_url", ["local", "s3"], indirect=True)
def test_a_version_is_published_and_applied_before_its_repair_blocks_go_up(
    store_url: tuple[str, dict[str, Any]], tmp_path: Path
) -> None:
    url, opts = store_url
    delta = big_delta(tmp_path, sparse=True)
    data_blocks, repair_blocks = split_roles(Delta.open(delta).manifest)
    assert len(data_blocks) > 4 and len(repair_blocks) > 4
    receiver = copy_checkpoint(tmp_path / "big-c0", tmp_path / "receiver")
    seen: list[PushResult] = []

    def published(result: PushResult) -> None:
        seen.append(result)
        store = Store(url, opts)
        assert store.version("v1") is not None and store.exists(f"manifests/{result.manifest}.json")
        assert all(_present(store, b.id) for b in data_blocks)
        assert not any(_present(store, b.id) for b in repair_blocks)  # they follow the record
        # A receiver applies the version now, from the store, bit-exactly.
        applied = apply(url, into=receiver, version="v1", storage_options=opts)
        assert applied.version == "v1" and read_raw(receiver) == read_raw(tmp_path / "big-c1")
        # What needs the repair blocks refuses, writing nothing; check says "pending", not damage.
        with pytest.raises(NotReadyError, match=r"repair block.*not on the store yet.*re-run dcr push"):
            pull(url, tmp_path / "with-repair", storage_options=opts, repair=True)
        assert not list(tmp_path.glob("*with-repair*"))
        report = check(url, storage_options=opts)
        assert report.ok and report.repair_pending == {"v1": len(repair_blocks)}

    result = push(delta, url, storage_options=opts, on_published=published)
    assert len(seen) == 1 and seen[0].repair_pending and seen[0].repair_uploaded_blocks == 0
    assert seen[0].published_s <= result.published_s + result.repair_s
    assert not result.repair_pending and result.repair_blocks == len(repair_blocks)
    assert result.repair_uploaded_blocks == len(repair_blocks)
    assert result.uploaded_blocks == len(data_blocks) + len(repair_blocks) == result.blocks
    store = Store(url, opts)
    assert all(_present(store, b.id) for b in repair_blocks) and store.exists("complete/v1")
    report = check(url, read_data=True, storage_options=opts)
    assert report.ok and report.repair_pending == {}
    assert pull(url, tmp_path / "with-repair", storage_options=opts, repair=True).blocks == result.blocks


def test_a_push_killed_after_publishing_is_finished_by_running_it_again(
    s3_endpoint: S3Endpoint, s3_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, opts, env = s3_url, s3_endpoint.storage_options, s3_endpoint.env()
    delta = big_delta(tmp_path, sparse=True)
    data_blocks, repair_blocks = split_roles(Delta.open(delta).manifest)
    data_bytes = sum(b.size for b in data_blocks)
    # At this rate the data blocks take about two seconds, the repair blocks about as long again.
    rate = max(1, data_bytes // 2)
    proc = spawn_dcr("push", str(delta), url, "--limit-rate", str(rate), "--no-progress", env=env)
    assert proc.stderr is not None
    line = proc.stderr.readline()
    os.kill(proc.pid, signal.SIGKILL)  # right after the version became visible
    proc.communicate(timeout=30)
    assert line.strip() == f"{url}: published v1 (repair blocks follow)"

    store = Store(url, opts)
    missing = missing_repair_blocks(store, Delta.open(delta).manifest)
    assert missing and not store.exists("complete/v1")
    assert [e["version"] for e in json_out(run_dcr("log", url, "--json", env=env))] == ["v1"]

    # dcr check: not damage; its own line says what to do.
    checked = run_dcr("check", url, env=env)
    assert checked.returncode == 0, checked.stderr
    assert f"repair upload pending or interrupted: v1 lacks {len(missing)} repair block(s)" in checked.stdout
    assert f"re-run dcr push DELTA {url}" in checked.stdout
    assert json_out(run_dcr("check", url, "--json", env=env))["repair_pending"] == {"v1": len(missing)}

    # pull --repair: exit 4, one line, nothing written.
    pulled = run_dcr("pull", url, "--repair", "-o", str(tmp_path / "got"), env=env)
    assert pulled.returncode == 4 and len(pulled.stderr.strip().splitlines()) == 1
    assert pulled.stderr.startswith("dcr: error: ") and "re-run dcr push DELTA" in pulled.stderr
    assert not list(tmp_path.glob("*got*"))

    # A normal apply from the store works; a torn item needs a repair block: refused, nothing written.
    fresh = copy_checkpoint(tmp_path / "big-c0", tmp_path / "fresh")
    json_out(run_dcr("apply", url, "--version", "v1", "--into", str(fresh), "--json", env=env))
    assert read_raw(fresh) == read_raw(tmp_path / "big-c1")
    torn = copy_checkpoint(tmp_path / "big-c0", tmp_path / "torn")
    tear_from_store(torn, url, opts, monkeypatch)
    before = read_raw(torn)
    refused = run_dcr("apply", url, "--version", "v1", "--into", str(torn), env=env)
    assert refused.returncode == 4 and len(refused.stderr.strip().splitlines()) == 1  # not ready: no complete/v1
    assert "repair block is not here" in refused.stderr and "does not have it yet" in refused.stderr
    assert "re-run dcr push" in refused.stderr
    assert read_raw(torn) == before

    # Squashing (dcr compact) needs target values: refused before anything is written.
    acknowledge(url, "v1", "r0", storage_options=opts)
    commit(url, "v1", receivers=["r0"], storage_options=opts)
    publish_keyframe(url, tmp_path / "big-c0", version="v0", storage_options=opts)
    with pytest.raises(NotReadyError, match=r"repair block.*of version 'v1'.*dcr compact"):
        compact(url, every=1, storage_options=opts)
    assert not s3_endpoint.filesystem().exists(f"{url[len('s3://') :]}/shortcuts")
    compacted = run_dcr("compact", url, "--every", "1", env=env)
    assert compacted.returncode == 4 and len(compacted.stderr.strip().splitlines()) == 1

    # Running the push again uploads exactly what is missing and is otherwise a no-op.
    again = push(delta, url, storage_options=opts)
    assert again.already_published and again.uploaded_blocks == again.repair_uploaded_blocks == len(missing)
    assert again.refreshed_blocks == 0 and store.exists("complete/v1")
    assert not missing_repair_blocks(store, Delta.open(delta).manifest)
    report = check(url, read_data=True, storage_options=opts)
    assert report.ok and report.repair_pending == {}
    assert pull(url, tmp_path / "got", storage_options=opts, repair=True).blocks == len(data_blocks + repair_blocks)
    result = apply(url, into=torn, version="v1", storage_options=opts)
    assert result.steps[0].repaired >= 1 and read_raw(torn) == read_raw(tmp_path / "big-c1")
    assert compact(url, every=1, storage_options=opts).published == ["v0..v1"]
    assert push(delta, url, storage_options=opts).uploaded_blocks == 0


def test_gc_between_publication_and_the_repair_upload_keeps_the_repair_blocks(tmp_path: Path) -> None:
    """v1: A->B and v3: A->B share their blocks (v1's repair blocks too); v2: B->A drops v1 at gc --keep 1.

    gc runs while v3 is published and its repair blocks (old ones, v1's) are not yet written again.
    """
    from store_fixtures import flip_chain

    ds = flip_chain(tmp_path)
    url = str(tmp_path / "store")
    for i, d in enumerate(ds[:2], start=1):
        push(d, url)
        acknowledge(url, f"v{i}", "r")
        commit(url, f"v{i}", receivers=["r"])
    long_ago = time.time() - 7200
    for block in (tmp_path / "store" / "blocks").iterdir():
        os.utime(block, (long_ago, long_ago))
    _data, repair = split_roles(Delta.open(ds[2]).manifest)
    v2_blocks = {b.id for b in Delta.open(ds[1]).manifest.blocks}
    reused = [b for b in repair if b.id not in v2_blocks]
    assert reused  # only v1 (dropped) and v3 use them
    collected: list[Any] = []

    def published(_: PushResult) -> None:
        for b in reused:  # not written again yet: old, and a dropped version's
            assert time.time() - (tmp_path / "store" / "blocks" / b.id).stat().st_mtime > 3600
        collected.append(gc(url, keep=1, grace_s=0))  # no grace at all: only references protect them

    result = push(ds[2], url, on_published=published)
    assert collected and collected[0].removed_blocks == 0
    assert result.refreshed_blocks >= len(reused)  # written again at their upload time (§4.1 step 4)
    for b in reused:
        assert time.time() - (tmp_path / "store" / "blocks" / b.id).stat().st_mtime < 600
    report = check(url, read_data=True)
    assert report.ok and report.repair_pending == {}
    assert pull(url, tmp_path / "p3", version="v3", repair=True).blocks == len(
        {b.id for b in Delta.open(ds[2]).manifest.blocks}
    )


def test_check_tells_a_pending_repair_upload_from_lost_repair_blocks(tmp_path: Path) -> None:
    """Absent repair blocks are damage once the push marked the version complete, or if a 1.0 writer (which
    uploaded every block before the record) published it; before that they are a pending upload."""
    delta = big_delta(tmp_path, sparse=True)
    url = str(tmp_path / "store")
    push(delta, url)
    _data, repair = split_roles(Delta.open(delta).manifest)
    (tmp_path / "store" / "blocks" / repair[0].id).unlink()
    report = check(url)
    assert not report.ok and report.repair_pending == {}
    assert any(p.startswith(f"repair block {repair[0].id[:16]}") for p in report.problems)
    with pytest.raises(IntegrityError, match="is missing from the store"):  # lost, not pending
        pull(url, tmp_path / "got", repair=True)
    assert not list(tmp_path.glob("*got*"))

    (tmp_path / "store" / "complete" / "v1").unlink()  # the push had not finished
    report = check(url)
    assert report.ok and report.repair_pending == {"v1": 1}

    record = tmp_path / "store" / "versions" / "v1.json"
    obj = json.loads(record.read_text())
    obj["format_version"] = [1, 0]  # a 1.0 writer's version: complete before its record, so this is damage
    record.write_text(json.dumps(obj))
    report = check(url)
    assert not report.ok and report.repair_pending == {}
    checked = run_dcr("check", url)
    assert checked.returncode == 1 and "repair block" in checked.stderr


def test_a_failed_repair_upload_says_the_version_is_published_and_how_to_finish(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dcr_cli.errors import DcrError
    from dcr_cli.store import repo

    delta = big_delta(tmp_path, sparse=True)
    _data, repair = split_roles(Delta.open(delta).manifest)
    repair_ids = {b.id for b in repair}
    url = str(tmp_path / "store")
    real = repo.Store.put_chunks

    def failing(self: repo.Store, rel: str, chunks: Any) -> None:
        if rel.removeprefix("blocks/") in repair_ids:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(self, rel, chunks)

    monkeypatch.setattr(repo.Store, "put_chunks", failing)
    with pytest.raises(DcrError, match=r"v1 is published \(receivers can apply it\).*re-run dcr push DELTA") as info:
        push(delta, url)
    assert info.value.exit_code == 2
    monkeypatch.undo()
    store = Store(url)
    assert store.version("v1") is not None and not store.exists("complete/v1")
    assert check(url).repair_pending == {"v1": len(repair)}
    again = push(delta, url)
    assert again.already_published and again.repair_uploaded_blocks == len(repair) and store.exists("complete/v1")
