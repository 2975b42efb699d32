"""Early fetch (store-v1 §4.6) against what a wrong, hostile or unlucky store does to a waiting receiver:
a hint never fails or delays a refit, and the early spool never outlives its use. Against moto's S3 server."""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import signal
import subprocess
import threading
import time
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest
from checkpoints import read_bits
from store_fixtures import HoldRequests, S3Endpoint, big_delta, json_out, make_deltas, run_dcr, spawn_dcr

from dcr_cli.delta.reader import Delta
from dcr_cli.format.manifest import BlockEntry
from dcr_cli.store import Store, push
from dcr_cli.store.announce import EarlyFetch, announcement
from dcr_cli.store.streaming import BlockUploader


def _data_blocks(delta: Path) -> list[BlockEntry]:
    return [b for b in Delta.open(delta).manifest.blocks if b.role == "data"]


def _wait_until(done, what: str, timeout: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def _early_spools(tmp: Path) -> list[Path]:
    """Early spools under a TMPDIR: the private root's directories (and the old layout's dcr-early-XXXX)."""
    root = tmp / f"dcr-early-{os.getuid()}"
    return sorted(root.iterdir()) if root.is_dir() else sorted(p for p in tmp.glob("dcr-early-*") if p != root)


@contextlib.contextmanager
def _waiting(*args: str, env: dict[str, str]) -> Iterator[subprocess.Popen[str]]:
    """A dcr command started now (a receiver waiting for its version), killed when the block ends if it is
    still running (a failed assertion must not leave it waiting)."""
    proc = spawn_dcr(*args, env=env)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def _publish_to(waiting: subprocess.Popen[str], delta: Path, url: str, endpoint: S3Endpoint) -> tuple[str, str]:
    """Push ``delta`` (the version the receiver waits for) and wait for the receiver to exit: its stdout and
    stderr."""
    push(delta, url, storage_options=endpoint.storage_options)
    return waiting.communicate(timeout=120)


def test_a_second_hint_with_another_size_never_fails_the_refit(
    s3_endpoint: S3Endpoint, s3_url: str, tmp_path: Path
) -> None:
    """Each genuine <id>-<size> has <id>-<size+1> and <id>-<size-1> beside it: each fetch has its own spool
    file, so a wrong one's failure and removal never touch the genuine block's (it used to: rc 2, naming
    the receiver's internal .<id>.part file)."""
    delta = big_delta(tmp_path, sparse=True)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    receiver = tmp_path / "receiver"
    shutil.copytree(tmp_path / "big-c0", receiver)
    env = {**s3_endpoint.env(), "TMPDIR": str(tmp)}
    args = ("apply", s3_url, "--version", "v1", "--wait", "120", "--into", str(receiver), "--json")
    with _waiting(*args, env=env) as waiting:
        store = Store(s3_url, s3_endpoint.storage_options)
        uploader = BlockUploader(s3_url, s3_endpoint.storage_options, announce="v1")
        blocks = _data_blocks(delta)
        for b in blocks:
            uploader(b.id, (delta / b.path).read_bytes())
            store.put(announcement("v1", b.id, b.size + 1), b"")
            store.put(announcement("v1", b.id, b.size - 1), b"")
        uploader.wait()
        time.sleep(2)  # the receiver lists and fetches all three hints of each block
        out, err = _publish_to(waiting, delta, s3_url, s3_endpoint)
    assert waiting.returncode == 0, err
    assert "dcr-early" not in err and ".part" not in err
    assert json_out(subprocess.CompletedProcess([], 0, out, err))["fetched_early"] == len(blocks)
    assert read_bits(receiver) == read_bits(tmp_path / "big-c1")


def test_a_stalled_hinted_download_delays_neither_the_wait_deadline_nor_an_interrupt(
    s3_endpoint: S3Endpoint, s3_url: str, tmp_path: Path
) -> None:
    """A GET of an announced block that never answers: --wait 2 still exits 4 about 2 s later, and SIGINT
    still exits 130 at once (both used to wait for the download's threads)."""
    delta = big_delta(tmp_path, sparse=True)
    block = _data_blocks(delta)[0]
    store = Store(s3_url, s3_endpoint.storage_options)
    store.put(f"blocks/{block.id}", (delta / block.path).read_bytes())
    store.put(announcement("v1", block.id, block.size), b"")
    receiver = tmp_path / "receiver"
    shutil.copytree(tmp_path / "big-c0", receiver)
    proxy = HoldRequests(s3_endpoint.url, f"/blocks/{block.id}".encode())
    timer = threading.Timer(45, proxy.released.set)  # the old code would hang until then
    timer.start()
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**s3_endpoint.env(), "FSSPEC_S3_ENDPOINT_URL": proxy.url, "TMPDIR": str(tmp)}
    args = ("apply", s3_url, "--version", "v1", "--into", str(receiver))
    try:
        started = time.monotonic()
        timed_out = spawn_dcr(*args, "--wait", "2", env=env)
        _wait_until(lambda: proxy.held >= 1, "the hinted block was never asked for")
        _out, err = timed_out.communicate(timeout=60)
        took = time.monotonic() - started
        assert timed_out.returncode == 4, err
        assert took < 15, took
        interrupted = spawn_dcr(*args, "--wait", "120", env=env)
        _wait_until(lambda: proxy.held >= 2, "the hinted block was never asked for again")
        interrupted.send_signal(signal.SIGINT)
        started = time.monotonic()
        _out, err = interrupted.communicate(timeout=60)
        assert interrupted.returncode == 130, err
        assert time.monotonic() - started < 10
        assert _early_spools(tmp) == []  # both cleaned up their spools
    finally:
        proxy.released.set()
        timer.cancel()
        proxy.close()


def test_an_abandoned_stalled_download_writes_nothing_when_it_returns(s3_endpoint: S3Endpoint, s3_url: str) -> None:
    """close() returns at once; the stalled read, released later, finds its spool gone and recreates nothing."""
    data = os.urandom(5000)
    from dcr_cli.format.digest import StreamingDigest

    digest = StreamingDigest()
    digest.update(data)
    block_id = digest.hexdigest()
    Store(s3_url, s3_endpoint.storage_options).put(f"blocks/{block_id}", data)
    proxy = HoldRequests(s3_endpoint.url, f"/blocks/{block_id}".encode())
    try:
        store = Store(s3_url, {**s3_endpoint.storage_options, "endpoint_url": proxy.url})
        store.put(announcement("v1", block_id, len(data)), b"")
        early = EarlyFetch(store, "v1")
        _wait_until(lambda: (early.poll(), proxy.held >= 1)[1], "the hinted block was never asked for")
        spool = early._spool
        assert spool is not None and os.path.isdir(spool)
        started = time.monotonic()
        early.close()
        # (the held read is released only below: a close() that waited for it would never return; the bound
        # is loose so that a loaded CI machine does not fail it)
        assert time.monotonic() - started < 10
        assert not os.path.exists(spool)
        proxy.released.set()
        time.sleep(2)  # the read returns, its worker finds no file to write
        assert not os.path.exists(spool)
    finally:
        proxy.released.set()
        proxy.close()


def _small_tmpfs(path: Path, inodes: int) -> None:
    path.mkdir()
    try:
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size=4m,nr_inodes={inodes}", "tmpfs", str(path)],
            check=True,
            capture_output=True,
        )
    except (OSError, subprocess.CalledProcessError):
        if os.environ.get("CI"):
            raise  # CI runs as root and never skips this
        pytest.skip("needs a small tmpfs (mount -t tmpfs: root in a namespace that allows it)")


def test_a_full_tmpdir_turns_early_fetch_off_and_the_wait_goes_on(
    s3_endpoint: S3Endpoint, s3_url: str, tmp_path: Path
) -> None:
    """TMPDIR with room for a handful of files and 12 hints of blocks that are not there: the wait used to
    die (OSError from the spool); now each failed hint's file goes at once, a spool that cannot be made or
    written turns early fetching off, and the refit is as without hints."""
    delta = big_delta(tmp_path, sparse=True)
    store = Store(s3_url, s3_endpoint.storage_options)
    for i in range(12):
        store.put(announcement("v1", f"{i:064x}", 1000), b"")
    tmp = tmp_path / "small"
    _small_tmpfs(tmp, 6)
    try:
        receiver = tmp_path / "receiver"
        shutil.copytree(tmp_path / "big-c0", receiver)
        env = {**s3_endpoint.env(), "TMPDIR": str(tmp)}
        with _waiting("apply", s3_url, "--version", "v1", "--wait", "60", "--into", str(receiver), env=env) as waiting:
            time.sleep(5)
            assert waiting.poll() is None, waiting.communicate()[1]
            _out, err = _publish_to(waiting, delta, s3_url, s3_endpoint)
        assert waiting.returncode == 0, err
        assert read_bits(receiver) == read_bits(tmp_path / "big-c1")
        assert _early_spools(tmp) == []
    finally:
        subprocess.run(["umount", str(tmp)], check=False)


def test_a_killed_receivers_spool_is_swept_by_the_next_early_fetch(
    s3_endpoint: S3Endpoint, s3_url: str, tmp_path: Path
) -> None:
    delta = big_delta(tmp_path, sparse=True)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    blocks = _data_blocks(delta)
    uploader = BlockUploader(s3_url, s3_endpoint.storage_options, announce="v1")
    for b in blocks:
        uploader(b.id, (delta / b.path).read_bytes())
    uploader.wait()
    receiver = tmp_path / "receiver"
    shutil.copytree(tmp_path / "big-c0", receiver)
    env = {**s3_endpoint.env(), "TMPDIR": str(tmp)}
    args = ("apply", s3_url, "--version", "v1", "--wait", "120", "--into", str(receiver))
    killed = spawn_dcr(*args, env=env)
    try:
        _wait_until(lambda: any(len(list(s.iterdir())) > 2 for s in _early_spools(tmp)), "nothing was spooled")
    finally:
        killed.send_signal(signal.SIGKILL)
        killed.communicate(timeout=60)
    (left,) = _early_spools(tmp)  # SIGKILL: nothing cleans up
    with _waiting(*args, env=env) as again:
        # (the sweep comes just before the new spool is made: wait for both, not only the first)
        _wait_until(
            lambda: not left.exists() and len(_early_spools(tmp)) == 1,
            "the next early fetch did not sweep the dead receiver's spool",
        )
        (mine,) = _early_spools(tmp)
        assert mine != left
        _out, err = _publish_to(again, delta, s3_url, s3_endpoint)
    assert again.returncode == 0, err
    assert read_bits(receiver) == read_bits(tmp_path / "big-c1")
    gc.collect()


def test_a_slow_listing_never_delays_the_wait(s3_endpoint: S3Endpoint, s3_url: str) -> None:
    """A listing of announced/ that never answers: the wait still gives up at its deadline (it used to list
    on the waiting thread)."""
    from dcr_cli.errors import NotReadyError
    from dcr_cli.store.transfer import open_version

    Store(s3_url, s3_endpoint.storage_options).put(announcement("v1", "ab" * 32, 10), b"")
    proxy = HoldRequests(s3_endpoint.url, b"announced")
    timer = threading.Timer(40, proxy.released.set)
    timer.start()
    try:
        options = {**s3_endpoint.storage_options, "endpoint_url": proxy.url}
        started = time.monotonic()
        with pytest.raises(NotReadyError):
            open_version(s3_url, "v1", storage_options=options, wait=2, early_fetch=True)
        assert proxy.held >= 1
        assert time.monotonic() - started < 10
    finally:
        proxy.released.set()
        timer.cancel()
        proxy.close()


def test_a_listing_of_more_names_than_the_cap_turns_early_fetch_off(
    s3_endpoint: S3Endpoint, s3_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dcr_cli.store import announce

    monkeypatch.setattr(announce, "MAX_BLOCKS", 5)
    store = Store(s3_url, s3_endpoint.storage_options)
    for i in range(6):
        store.put(announcement("v1", f"{i:064x}", 10), b"")
    early = EarlyFetch(store, "v1")
    deadline = time.monotonic() + 10
    while early.enabled and time.monotonic() < deadline:
        early.poll()
        time.sleep(0.05)
    assert not early.enabled and early.blocks == 0
    early.close()


def test_an_early_fetch_is_collected_once_closed(s3_endpoint: S3Endpoint, s3_url: str) -> None:
    store = Store(s3_url, s3_endpoint.storage_options)
    store.put(announcement("v1", "ab" * 32, 10), b"")
    early = EarlyFetch(store, "v1")
    deadline = time.monotonic() + 30
    while early.blocks < 1:
        assert time.monotonic() < deadline, "the hint was never tried"
        early.poll()
        time.sleep(0.05)
    spool = early._spool
    early.close()
    store.put(announcement("v1", "cd" * 32, 10), b"")
    for _ in range(5):  # closed, it stays off: a later poll starts no listing, no download, no spool
        early.poll()
        time.sleep(0.3)
    assert early.blocks == 1 and early._spool is None
    ref = weakref.ref(early)
    del early
    gc.collect()
    assert ref() is None
    assert spool is not None and not os.path.exists(spool)


def test_gc_and_push_remove_everything_under_announcements(
    s3_endpoint: S3Endpoint, s3_url: str, tmp_path: Path
) -> None:
    delta = big_delta(tmp_path, sparse=True)
    options = s3_endpoint.storage_options
    store = Store(s3_url, options)
    push(delta, s3_url, storage_options=options)
    store.put(f"announced/v1/{'ab' * 32}-5/nested", b"")  # v1 is published: all of it is spent
    store.put("announced/v1/sub/deeper/x", b"")
    store.put("announced/v9/sub/deeper/x", b"")  # v9 is not: young, kept until the grace is over
    store.put(f"announced/v9/{'cd' * 32}-7", b"")
    fs = s3_endpoint.filesystem()
    base = s3_url.removeprefix("s3://") + "/announced"

    def left() -> list[str]:
        fs.invalidate_cache()
        return sorted(p for p in fs.find(base) if p != base)

    assert json_out(run_dcr("gc", s3_url, "--keep", "1", "--json", env=s3_endpoint.env()))["removed_announcements"] == 2
    assert [p.split("/announced/")[1] for p in left()] == [f"v9/{'cd' * 32}-7", "v9/sub/deeper/x"]
    json_out(run_dcr("gc", s3_url, "--keep", "1", "--grace", "0", "--json", env=s3_endpoint.env()))
    assert left() == []
    # A push removes its version's announcements at any depth too.
    store.put("announced/v1/sub/x", b"")
    store.put(announcement("v1", "ab" * 32, 5), b"")
    push(delta, s3_url, storage_options=options)
    assert left() == []


def test_a_live_producer_on_two_ranks_leaves_no_announcement_behind_its_publication(
    s3_endpoint: S3Endpoint, s3_url: str, tmp_path: Path, monkeypatch
) -> None:
    """The live producer on two ranks: every rank's announcements are written before rank 0's push publishes
    the version and removes ``announced/<V>/``, even one that lands late (a retried request): no hint is left
    behind a complete version."""
    import dcr_cli.store.streaming as streaming
    from dcr_cli.api import _store_producer
    from dcr_cli.produce.live import Producer as Live
    from dcr_cli.store.transfer import split_roles

    _, (d1,) = make_deltas(tmp_path, 1)
    opts = s3_endpoint.storage_options
    root = tmp_path / "root"
    shutil.copytree(d1, root / "v1")
    data, _ = split_roles(Delta.open(d1).manifest)
    assert data
    cls = _store_producer()
    meet = threading.Barrier(2)
    slow_stores: set[int] = set()
    real = streaming.announce

    def announce(store, version, block_id, size):  # rank 1's hint: one slow round (a retried 503, say)
        if id(store) in slow_stores:
            time.sleep(3)
        real(store, version, block_id, size)

    monkeypatch.setattr(streaming, "announce", announce)

    class Group:
        def __init__(self, rank: int) -> None:
            self.rank, self.world = rank, 2

        def barrier(self) -> None:
            meet.wait(timeout=60)

    def fake_diff(self, state, version):  # each rank hands its blocks to on_block, as the real diff does
        if self.group.rank == 1:
            slow_stores.add(id(self.on_block.store))
        for b in data[self.group.rank :: 2] or data[:1]:
            self.on_block(b.id, (d1 / b.path).read_bytes())
        return None

    monkeypatch.setattr(Live, "diff", fake_diff)
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        p = object.__new__(cls)
        p.url, p.storage_options, p.out, p.group, p.on_block = s3_url, opts, root, Group(r), None
        try:
            p.diff({}, "v1")
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    store = Store(s3_url, opts)
    assert store.version("v1") is not None and store.exists("complete/v1")
    left = [e.name for e in store.list("announced/v1")]
    assert left == [], f"stale hints left after publication: {left}"
