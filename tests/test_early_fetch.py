"""A receiver waiting for a version fetches the data blocks its push announces, while the push runs
(store-v1 §4.6): the download overlaps the upload instead of following it. Against moto's S3 server,
through a counting proxy."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest
from checkpoints import read_bits
from store_fixtures import CountingProxy, S3Endpoint, big_delta, json_out, run_dcr, spawn_dcr

from dcr_cli.delta.reader import Delta
from dcr_cli.format.manifest import BlockEntry
from dcr_cli.store import Store, push
from dcr_cli.store.announce import announcement, parse
from dcr_cli.store.streaming import BlockUploader


def _data_blocks(delta: Path) -> list[BlockEntry]:
    return [b for b in Delta.open(delta).manifest.blocks if b.role == "data"]


def _upload_announced(url: str, options: dict, delta: Path, version: str) -> list[BlockEntry]:
    """What `dcr diff --push` does while it diffs: each data block uploaded, then announced."""
    blocks = _data_blocks(delta)
    uploader = BlockUploader(url, options, announce=version)
    for b in blocks:
        uploader(b.id, (delta / b.path).read_bytes())
    uploader.wait()
    return blocks


def _wait_until(done, what: str, timeout: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_a_waiting_receiver_fetches_announced_blocks_before_the_version_is_published(
    s3_endpoint: S3Endpoint, s3_url: str, tmp_path: Path
) -> None:
    delta = big_delta(tmp_path, sparse=True)  # many data blocks; a new store (the push creates it as it publishes)
    receiver = tmp_path / "receiver"
    shutil.copytree(tmp_path / "big-c0", receiver)
    proxy = CountingProxy(s3_endpoint.url)
    env = {**s3_endpoint.env(), "FSSPEC_S3_ENDPOINT_URL": proxy.url}
    args = ("apply", s3_url, "--version", "v1", "--wait", "120", "--into", str(receiver), "--json")
    waiting = spawn_dcr(*args, env=env)
    try:
        blocks = _upload_announced(s3_url, s3_endpoint.storage_options, delta, "v1")
        # Nothing is published yet (no marker, no record): the receiver has every data block all the same.
        _wait_until(
            lambda: all(proxy.requests_for(f"/blocks/{b.id}") == 1 for b in blocks),
            "the waiting receiver did not fetch the announced blocks before the version was published",
        )
        assert Store(s3_url, s3_endpoint.storage_options).version("v1") is None
        push(delta, s3_url, storage_options=s3_endpoint.storage_options)
        out, err = waiting.communicate(timeout=120)
    finally:
        if waiting.poll() is None:
            waiting.kill()
        proxy.close()
    assert waiting.returncode == 0, err
    assert json.loads(out)["fetched_early"] == len(blocks)
    assert read_bits(receiver) == read_bits(tmp_path / "big-c1")
    for b in blocks:  # each once: none again after the record
        assert proxy.requests_for(f"/blocks/{b.id}") == 1, b.id
        assert b.size <= proxy.bytes_for(f"/blocks/{b.id}") < b.size + 2048
    # The push that published them removed the hints.
    assert Store(s3_url, s3_endpoint.storage_options).list("announced/v1") == []


def test_wrong_announcements_are_dropped_and_the_blocks_fetched_as_usual(
    s3_endpoint: S3Endpoint, s3_url: str, tmp_path: Path
) -> None:
    delta = big_delta(tmp_path, sparse=True)
    blocks = _data_blocks(delta)
    store = Store(s3_url, s3_endpoint.storage_options)
    wrong_size, absent = blocks[0], "ab" * 32
    store.put(f"blocks/{wrong_size.id}", (delta / wrong_size.path).read_bytes())
    store.put(announcement("v1", wrong_size.id, wrong_size.size + 1), b"")  # a size that is not the block's
    store.put(announcement("v1", absent, 100), b"")  # a block that is not there
    store.put("announced/v1/not-an-announcement", b"")
    store.put(f"announced/v1/{'cd' * 32}-0", b"")  # sizes start at 1: not parsed, not fetched
    receiver = tmp_path / "receiver"
    shutil.copytree(tmp_path / "big-c0", receiver)
    proxy = CountingProxy(s3_endpoint.url)
    env = {**s3_endpoint.env(), "FSSPEC_S3_ENDPOINT_URL": proxy.url}
    waiting = spawn_dcr("apply", s3_url, "--version", "v1", "--wait", "120", "--into", str(receiver), env=env)
    try:
        _wait_until(lambda: proxy.requests_for(f"/blocks/{absent}") >= 1, "the absent block was never asked for")
        push(delta, s3_url, storage_options=s3_endpoint.storage_options)
        _out, err = waiting.communicate(timeout=120)
    finally:
        if waiting.poll() is None:
            waiting.kill()
        proxy.close()
    assert waiting.returncode == 0, err
    assert read_bits(receiver) == read_bits(tmp_path / "big-c1")
    assert proxy.requests_for(f"/blocks/{'cd' * 32}") == 0
    assert proxy.requests_for(f"/blocks/{wrong_size.id}") == 2  # the wrong hint's try, then the normal fetch


def test_diff_push_announces_each_data_block_and_its_push_removes_them(
    s3_endpoint: S3Endpoint, s3_url: str, tmp_path: Path
) -> None:
    big_delta(tmp_path, sparse=True)  # the checkpoints; the CLI's diff makes its own delta
    proxy = CountingProxy(s3_endpoint.url)
    env = {**s3_endpoint.env(), "FSSPEC_S3_ENDPOINT_URL": proxy.url}
    try:
        out = tmp_path / "pushed"
        proc = run_dcr(
            "diff", str(tmp_path / "big-c0"), str(tmp_path / "big-c1"), "-o", str(out),
            "--base-version", "v0", "--target-version", "v1", "--push", s3_url, env=env,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
    finally:
        proxy.close()
    blocks = _data_blocks(out)
    for b in blocks:
        name = f"/announced/v1/{b.id}-{b.size}"
        assert sum(n for (m, p), n in proxy.requests.items() if m == "PUT" and p.endswith(name)) == 1, name
    assert Store(s3_url, s3_endpoint.storage_options).list("announced/v1") == []


def test_gc_removes_spent_and_stale_announcements(s3_endpoint: S3Endpoint, s3_url: str, tmp_path: Path) -> None:
    delta = big_delta(tmp_path, sparse=True)
    options = s3_endpoint.storage_options
    store = Store(s3_url, options)
    push(delta, s3_url, storage_options=options)
    block = _data_blocks(delta)[0]
    store.put(announcement("v1", block.id, block.size), b"")  # left by a push of v1 that stopped (v1 is published)
    store.put(announcement("v2", block.id, block.size), b"")  # a push of v2 in progress
    json_out(run_dcr("gc", s3_url, "--keep", "1", "--json", env=s3_endpoint.env()))
    assert store.list("announced/v1") == []
    assert [e.name for e in store.list("announced/v2")] == [f"{block.id}-{block.size}"]  # young: kept
    json_out(run_dcr("gc", s3_url, "--keep", "1", "--grace", "0", "--json", env=s3_endpoint.env()))
    assert store.list("announced/v2") == []


@pytest.mark.parametrize(
    ("name", "parsed"),
    [
        (f"{'0a' * 32}-1", ("0a" * 32, 1)),
        (f"{'0a' * 32}-4194304", ("0a" * 32, 4194304)),
        (f"{'0A' * 32}-1", None),  # ids are lowercase hex
        (f"{'0a' * 32}-0", None),
        (f"{'0a' * 32}-01", None),
        (f"{'0a' * 31}-1", None),
        (f"{'0a' * 32}-1-2", None),
        (f"../{'0a' * 32}-1", None),
        (f"{'0a' * 32}-{'9' * 17}", None),  # beyond any block size
        (".tmp-x", None),
    ],
)
def test_announcement_names(name: str, parsed: tuple[str, int] | None) -> None:
    assert parse(name) == parsed
    if parsed is not None:
        assert announcement("v9", *parsed) == f"announced/v9/{name}"


def test_a_store_that_refuses_announcements_publishes_and_applies_as_before(
    s3_endpoint: S3Endpoint, s3_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hint never fails a refit: a bucket policy without announced/ (PUT and LIST refused) changes nothing."""
    import threading

    from dcr_cli.store import repo
    from dcr_cli.store.transfer import open_version

    refused: list[str] = []
    put, listing = repo.Store.put, repo.Store.list

    def refusing_put(self: repo.Store, rel: str, data: bytes) -> None:
        if rel.startswith("announced/"):
            refused.append(rel)
            raise PermissionError(13, "AccessDenied", rel)
        put(self, rel, data)

    def refusing_list(self: repo.Store, rel_dir: str) -> list[repo.Listing]:
        if rel_dir.startswith("announced/"):
            refused.append(rel_dir)
            raise PermissionError(13, "AccessDenied", rel_dir)
        return listing(self, rel_dir)

    monkeypatch.setattr(repo.Store, "put", refusing_put)
    monkeypatch.setattr(repo.Store, "list", refusing_list)
    delta = big_delta(tmp_path, sparse=True)
    opened: list[Delta] = []
    waiter = threading.Thread(
        target=lambda: opened.append(
            open_version(s3_url, "v1", storage_options=s3_endpoint.storage_options, wait=60, early_fetch=True)
        )
    )
    waiter.start()
    blocks = _upload_announced(s3_url, s3_endpoint.storage_options, delta, "v1")  # does not raise
    _wait_until(lambda: any(r == "announced/v1" for r in refused), "the waiting receiver never listed")
    push(delta, s3_url, storage_options=s3_endpoint.storage_options)
    waiter.join(60)
    assert len([r for r in refused if r.startswith("announced/v1/")]) == len(blocks)
    (remote,) = opened
    assert remote.fetched_early == 0
    remote.verify_blocks()  # the normal fetch: every data block whole


def test_many_hints_start_a_bounded_number_of_downloads(s3_endpoint: S3Endpoint, s3_url: str) -> None:
    """Stale or hostile hints (here 60 blocks that are not there) cost at most FETCHERS downloads at a time,
    one spool directory, and nothing of the process's memory allowance; closing removes it all."""
    import tempfile
    import threading

    from dcr_cli.delta import prefetch
    from dcr_cli.store.announce import FETCHERS, EarlyFetch

    store = Store(s3_url, s3_endpoint.storage_options)
    for i in range(60):
        store.put(announcement("v1", f"{i:064x}", 600 << 20), b"")
    root = Path(tempfile.gettempdir()) / f"dcr-early-{os.getuid()}"
    spools_before = set(root.glob("*"))
    allowance = prefetch._MEMORY._left
    baseline = sum(t.name.startswith("dcr-fetch") for t in threading.enumerate())
    early = EarlyFetch(store, "v1")
    most = 0
    deadline = time.monotonic() + 30
    while early.blocks < 60 and time.monotonic() < deadline:
        early.poll()
        running = sum(not f.settled for f in early._fetchers)
        threads = sum(t.name.startswith("dcr-fetch") for t in threading.enumerate()) - baseline
        most = max(most, running)
        # Two threads per download; a settled download's threads may still be returning. Unbounded: 120.
        assert running <= FETCHERS and threads <= 3 * FETCHERS
        time.sleep(0.01)
    assert early.blocks == 60 and most >= 1  # every hint was tried, a few at a time
    spools = set(root.glob("*")) - spools_before
    assert len(spools) == 1
    assert prefetch._MEMORY._left == allowance
    early.close()
    assert not any(p.exists() for p in spools)
