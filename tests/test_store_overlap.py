"""Store transfers in bounded memory, and applying from a store while its blocks download (issue 12 §2, §5)."""

from __future__ import annotations

import itertools
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from checkpoints import read_bits
from store_fixtures import REPO_ROOT, CountingProxy, HoldRequests, S3Endpoint, big_delta, run_dcr

from dcr_cli.delta.prefetch import BlockFetcher
from dcr_cli.delta.reader import Delta
from dcr_cli.errors import IntegrityError


def files_of(root: Path) -> dict[str, bytes]:
    """Every file of a checkpoint directory, the receiver's own state included (its lock file aside)."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# -- the fetcher on its own, over a local delta's blocks ------------------------------------------------------------


def test_the_fetcher_assembles_blocks_from_many_ranges_in_memory_and_on_disk(tmp_path: Path) -> None:
    delta = Delta.open(big_delta(tmp_path, sparse=True))
    blocks = list({b.id: b for b in delta.manifest.blocks}.values())
    assert len(blocks) > 8 and all(b.size > 300 for b in blocks)
    # 100-byte ranges, a window of 3 ranges, the first blocks in memory and the rest in a temporary file.
    half = sum(b.size for b in blocks[: len(blocks) // 2])
    fetcher = BlockFetcher(delta.source, blocks, workers=3, window=300, range_bytes=100, memory=half)
    fetcher.wait_all()
    for b in blocks:
        whole = Path(delta.block_path(b)).read_bytes()
        assert fetcher.read(b.id, 0, b.size) == whole
        assert fetcher.read(b.id, 17, 250) == whole[17:250]


def test_the_fetcher_refuses_a_corrupt_a_truncated_and_a_longer_block(tmp_path: Path) -> None:
    delta = Delta.open(big_delta(tmp_path, sparse=True))
    blocks = list({b.id: b for b in delta.manifest.blocks}.values())
    corrupt, short, long = blocks[-1], blocks[-2], blocks[-3]
    for block, change in ((corrupt, "flip"), (short, "cut"), (long, "grow")):
        path = Path(delta.block_path(block))
        raw = bytearray(path.read_bytes())
        if change == "flip":
            raw[len(raw) // 2] ^= 1
        elif change == "cut":
            del raw[-1]
        else:
            raw += b"\0"
        path.write_bytes(bytes(raw))
    fetcher = BlockFetcher(delta.source, blocks, workers=2, range_bytes=128)
    for block in blocks[:-3]:
        fetcher.wait_block(block.id)  # the intact ones are fine
    with pytest.raises(IntegrityError, match="corrupt"):
        fetcher.wait_block(corrupt.id)
    with pytest.raises(IntegrityError, match="truncated"):
        fetcher.wait_block(short.id)
    with pytest.raises(IntegrityError, match="larger than"):
        fetcher.wait_block(long.id)
    with pytest.raises(IntegrityError):
        fetcher.wait_all()


# -- from a real S3 endpoint ---------------------------------------------------------------------------------------


class Throttle:
    """benchmarks/throttle.py in front of the endpoint: a slow link, as in bench_refit."""

    def __init__(self, upstream: str, rate: float) -> None:
        port = upstream.rsplit(":", 1)[1]
        script = str(REPO_ROOT / "benchmarks" / "throttle.py")
        self.proc = subprocess.Popen(
            [sys.executable, script, "--target", f"127.0.0.1:{port}", "--rate", str(rate)],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        self.url = f"http://127.0.0.1:{int(self.proc.stdout.readline())}"

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)


def test_the_first_pass_reads_early_blocks_while_later_ones_download(
    s3_endpoint: S3Endpoint, s3_url: str, tmp_path: Path
) -> None:
    from dcr_cli.store import open_delta, push

    local = big_delta(tmp_path)  # one 16 KiB data block per tensor, no repair blocks
    push(local, s3_url, storage_options=s3_endpoint.storage_options)
    manifest = Delta.open(local).manifest
    last = manifest.blocks[manifest.items[-1].data.block]  # the last one the first pass reaches
    assert manifest.blocks[manifest.items[0].data.block].id != last.id
    # The last block cannot arrive until it is released: counted, not timed, so a loaded machine cannot
    # make the first item look as if it waited (or not) for it.
    proxy = HoldRequests(s3_endpoint.url, f"GET /{s3_url.removeprefix('s3://')}/blocks/{last.id}".encode())
    try:
        options = {**s3_endpoint.storage_options, "endpoint_url": proxy.url, "skip_instance_cache": True}
        remote = open_delta(s3_url, "v1", storage_options=options)
        remote.prefetch_blocks(("data",))
        first = threading.Thread(target=remote.decode, args=(remote.manifest.items[0],), daemon=True)
        first.start()
        first.join(timeout=60)
        assert not first.is_alive(), "the first item waited for a block it does not use"
        with proxy.lock:
            assert not proxy.released.is_set()  # it was decoded while the last block was still held back
        proxy.released.set()
        remote.verify_blocks(("data",))
        with proxy.lock:
            gets = proxy.gets
        for item in remote.manifest.items:
            remote.decode(item)  # all there: nothing is fetched again
        with proxy.lock:
            assert proxy.gets == gets, (proxy.gets, gets)
            assert proxy.held >= 1  # the last block really was asked for through the hold
    finally:
        proxy.released.set()
        proxy.close()


def test_a_corrupt_late_block_leaves_the_receiver_untouched(
    s3_endpoint: S3Endpoint, s3_url: str, tmp_path: Path
) -> None:
    from dcr_cli.store import push

    local = big_delta(tmp_path)
    push(local, s3_url, storage_options=s3_endpoint.storage_options)
    manifest = Delta.open(local).manifest
    last = manifest.blocks[manifest.items[-1].data.block]  # the last one the first pass reaches
    fs = s3_endpoint.filesystem()
    key = f"{s3_url.removeprefix('s3://')}/blocks/{last.id}"
    raw = bytearray(fs.cat_file(key))
    raw[-5] ^= 0x40
    fs.pipe_file(key, bytes(raw))
    receiver = tmp_path / "receiver"
    shutil.copytree(tmp_path / "big-c0", receiver)
    before = files_of(receiver)

    proc = run_dcr("apply", s3_url, "--version", "v1", "--into", str(receiver), env=s3_endpoint.env())
    assert proc.returncode != 0 and "corrupt" in proc.stderr, proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("dcr: error: ")
    assert "the store's copy is damaged" in proc.stderr and "dcr push DELTA URL --verify-remote" in proc.stderr
    assert "compact" not in proc.stderr, proc.stderr  # a version's fix only (was: "(dcr compact for a shortcut's)")
    after = files_of(receiver)
    assert {k: v for k, v in after.items() if k in before} == before  # not one byte of the checkpoint changed
    assert not [k for k in after if k not in before and not k.endswith("lock")], sorted(after)  # no state either
    assert read_bits(receiver) == read_bits(tmp_path / "big-c0")

    fs.pipe_file(key, bytes(raw[:-5]) + bytes([raw[-5] ^ 0x40]) + bytes(raw[-4:]))  # repaired: now it applies
    ok = run_dcr("apply", s3_url, "--version", "v1", "--into", str(receiver), env=s3_endpoint.env())
    assert ok.returncode == 0, ok.stderr
    assert read_bits(receiver) == read_bits(tmp_path / "big-c1")


def test_a_live_producer_publishes_each_step_on_a_store(tmp_path: Path) -> None:
    """dcr_cli.Producer with a store URL (the store producer is defined lazily, on first use)."""
    import dcr_cli
    from dcr_cli.store import Store, commit

    test_live_tensors = pytest.importorskip("test_live_tensors")
    states = test_live_tensors.adam_steps(2)
    from checkpoints import write_checkpoint

    receiver = write_checkpoint(tmp_path / "receiver", states[0])
    url = (tmp_path / "store").as_uri()
    producer = dcr_cli.Producer(url, baseline=states[0], base_version="step-0", staging=tmp_path / "staging")
    for step in (1, 2):
        summary = producer.diff(states[step], version=f"step-{step}")
        assert summary is not None and summary.changed_elements > 0
        assert Store(url).require_version(f"step-{step}").base.version == f"step-{step - 1}"
        result = dcr_cli.apply(url, into=receiver, version=f"step-{step}", ack=url, receiver="r0")
        assert result.version == f"step-{step}"
        assert read_bits(receiver) == read_bits(write_checkpoint(tmp_path / f"hf-{step}", states[step]))
        commit(url, f"step-{step}", receivers=["r0"])
        producer.committed(f"step-{step}")


def test_a_push_holds_blocks_within_its_byte_budget() -> None:
    import threading

    from dcr_cli.store.transfer import ByteBudget, parallel

    budget = ByteBudget(250)
    held: list[int] = []
    lock = threading.Lock()
    now = [0]

    def task(n: int) -> None:
        with budget.hold(n):
            with lock:
                now[0] += n
                held.append(now[0])
            time.sleep(0.02)
            with lock:
                now[0] -= n

    parallel([lambda: task(100)] * 12 + [lambda: task(1000)] + [lambda: task(100)] * 4, workers=8)
    assert max(h for h in held if h != 1000) <= 250  # two 100-byte blocks at once, never three
    assert 200 in held and 1000 in held  # it did run in parallel; the oversized block ran alone


@pytest.mark.parametrize("store", ["local", "s3"])
def test_a_corrupt_block_streamed_to_a_store_is_never_published(
    store: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """A local store gets blocks streamed to a temporary file: the digest fails only after the last chunk,
    and then nothing may be left under the block's name (nor a temporary file)."""
    from dcr_cli.store import Store, push

    local = big_delta(tmp_path)
    manifest = Delta.open(local).manifest
    victim = manifest.blocks[-1]
    path = Path(Delta.open(local).block_path(victim))
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 1  # the last byte: every chunk but the digest looks fine
    path.write_bytes(bytes(raw))
    if store == "local":
        url, options = (tmp_path / "store").as_uri(), None
    else:
        endpoint: S3Endpoint = request.getfixturevalue("s3_endpoint")
        url, options = request.getfixturevalue("s3_url"), endpoint.storage_options
    with pytest.raises(IntegrityError, match="corrupt; nothing corrupt was published"):
        push(local, url, storage_options=options)
    s = Store(url, options)
    assert s.stat(f"blocks/{victim.id}") is None
    assert s.version("v1") is None
    if store == "local":
        assert not [p for p in (tmp_path / "store" / "blocks").iterdir() if p.name.startswith(".tmp-")]


def one_big_block_delta(tmp: Path, mib: int) -> Path:
    """A delta v0 -> v1 whose payload is one data block of about ``mib`` MiB (every element changes)."""
    import numpy as np
    from store_fixtures import write_checkpoint

    from dcr_cli.produce import diff

    rng = np.random.default_rng(3)
    n = (mib << 20) // 4 // 2
    base = {f"w{i}": rng.standard_normal(n).astype(np.float32) for i in range(2)}
    new = {k: rng.standard_normal(n).astype(np.float32) for k in base}
    c0 = write_checkpoint(tmp / "one-c0", base)
    c1 = write_checkpoint(tmp / "one-c1", new)
    diff(c0, c1, tmp / "one", base_version="v0", target_version="v1", workers=1)
    return tmp / "one"


class TimedProxy(CountingProxy):
    """A CountingProxy that also notes, per connection, when block bytes first and last came back."""

    def __init__(self, upstream: str) -> None:
        self.spans: dict[int, list[float]] = {}  # id of a connection's state -> [first, last] (monotonic)
        super().__init__(upstream)

    def seen(self, data: bytes, upstream: bool, state: list[str]) -> None:
        super().seen(data, upstream, state)
        if not upstream and "/blocks/" in state[0]:
            now = time.monotonic()
            self.spans.setdefault(id(state), [now, now])[1] = now


def test_pull_runs_at_the_link_rate_and_fetches_the_payload_once(
    s3_endpoint: S3Endpoint, s3_url: str, tmp_path: Path
) -> None:
    """Issue 12: pull goes through the fetcher (ranged reads in parallel), not one block over one connection.

    Side by side over the same throttled link: the old mechanism (each block read in 16 MiB chunks, one
    after the other, over one connection) and ``pull``. Pull must fetch every block's bytes exactly once
    (plus the response headers of its ranged GETs), its ranges at once over several connections (what lets
    it reach the link rate; the times are printed, not asserted: bench_refit measures the rate)."""
    from dcr_cli.delta.prefetch import RANGE_BYTES
    from dcr_cli.delta.source import CHUNK_BYTES
    from dcr_cli.store import Store, pull, push
    from dcr_cli.store.repo import StoreBlockSource

    local = one_big_block_delta(tmp_path, 24)
    push(local, s3_url, storage_options=s3_endpoint.storage_options)
    manifest = Delta.open(local).manifest
    data = {b.id: b for b in manifest.blocks if b.role == "data"}
    payload = sum(b.size for b in data.values())
    assert len(data) == 1 and payload > 20 << 20
    rate = payload / 3.0  # the floor: 3 s
    throttle = Throttle(s3_endpoint.url, rate)
    proxy = TimedProxy(throttle.url)
    options = {**s3_endpoint.storage_options, "endpoint_url": proxy.url}
    try:
        # Before: one block over one connection, chunk after chunk (what pull did).
        source = StoreBlockSource(Store(s3_url, options))
        started = time.perf_counter()
        with open(tmp_path / "old-block", "wb") as f:
            for b in data.values():
                for chunk in source.chunks(b):
                    f.write(chunk)
        before = time.perf_counter() - started
        fetched_before = proxy.total_bytes()
        with proxy.lock:
            proxy.spans.clear()  # from here on, pull's connections only

        started = time.perf_counter()
        result = pull(s3_url, tmp_path / "pulled", version="v1", storage_options=options)
        after = time.perf_counter() - started
        fetched = proxy.total_bytes() - fetched_before
    finally:
        proxy.close()
        throttle.close()
    floor = payload / rate
    print(
        f"pull of {payload / 2**20:.1f} MiB at {rate / 2**20:.1f} MiB/s (floor {floor:.2f} s): "
        f"before {before:.2f} s ({before / floor:.2f}x floor), after {after:.2f} s ({after / floor:.2f}x floor); "
        f"{fetched} bytes fetched for the payload and records"
    )
    assert result.downloaded_bytes == payload and result.downloaded_blocks == 1
    assert delta_files_equal(tmp_path / "pulled", local)
    for block_id, b in data.items():
        ranges, chunks = -(-b.size // RANGE_BYTES), -(-b.size // CHUNK_BYTES)
        assert proxy.requests_for(f"/blocks/{block_id}") == chunks + ranges  # the old read's GETs, then pull's
        got = proxy.bytes_for(f"/blocks/{block_id}") - b.size  # less the old read's bytes (and its headers)
        assert b.size <= got < b.size + 2048 * (ranges + chunks)
    # Pull's block bytes came over several connections at once: some two of them were receiving at the same
    # time (a fetcher that took one range after another would show no two spans overlapping).
    with proxy.lock:
        spans = sorted(proxy.spans.values())
    assert len(spans) >= 2, spans
    assert any(later[0] < earlier[1] for earlier, later in itertools.pairwise(spans)), spans


def delta_files_equal(a: Path, b: Path) -> bool:
    from store_fixtures import delta_files

    return delta_files(a) == delta_files(b)


def test_a_push_to_s3_streams_large_blocks_as_multipart_uploads(
    s3_endpoint: S3Endpoint, s3_url: str, tmp_path: Path
) -> None:
    """Blocks above one part go up as multipart uploads (a part or two in memory, not the block); a block
    whose digest fails after its last chunk is aborted: no object, no upload left open, no version."""
    from dcr_cli.store import Store, push
    from dcr_cli.store.backends import S3_PART_BYTES

    local = one_big_block_delta(tmp_path, 24)
    (block,) = [b for b in Delta.open(local).manifest.blocks]
    assert block.size > 2 * S3_PART_BYTES
    path = Path(Delta.open(local).block_path(block))
    good = path.read_bytes()
    path.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))  # every part but the digest looks fine
    fs = s3_endpoint.filesystem()
    bucket = s3_url.removeprefix("s3://").split("/")[0]
    with pytest.raises(IntegrityError, match="corrupt; nothing corrupt was published"):
        push(local, s3_url, storage_options=s3_endpoint.storage_options)
    store = Store(s3_url, s3_endpoint.storage_options)
    assert store.stat(f"blocks/{block.id}") is None and store.version("v1") is None
    assert not fs.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads")  # aborted, not left open

    path.write_bytes(good)
    result = push(local, s3_url, storage_options=s3_endpoint.storage_options)
    assert result.uploaded_blocks == 1 and result.uploaded_bytes == block.size
    assert fs.cat_file(f"{s3_url.removeprefix('s3://')}/blocks/{block.id}") == good
    assert not fs.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads")


class HoldFirstPart(CountingProxy):
    """Holds back the first part of a multipart upload until a request for another part of it has arrived
    (at most ``patience`` seconds): an uploader that sends its parts one after the other cannot pass it
    without the wait running out."""

    _PART = re.compile(rb"^PUT [^ ]*[?&]partNumber=(\d+)[& ]")

    def __init__(self, upstream: str, patience: float = 20.0) -> None:
        self.another_part = threading.Event()
        self.patience = patience
        self.released_by_another_part: bool | None = None
        super().__init__(upstream)

    def seen(self, data: bytes, upstream: bool, state: list[str]) -> None:
        super().seen(data, upstream, state)
        part = self._PART.match(data) if upstream else None
        if part is not None and int(part.group(1)) > 1:
            self.another_part.set()

    def before_forwarding(self, data: bytes, upstream: bool) -> None:
        part = self._PART.match(data) if upstream else None
        if part is not None and int(part.group(1)) == 1:
            self.released_by_another_part = self.another_part.wait(self.patience)


def test_a_push_to_s3_sends_the_parts_of_one_block_at_once(
    s3_endpoint: S3Endpoint, s3_url: str, tmp_path: Path
) -> None:
    """Issue 12: one block's multipart upload has several parts on the wire at once, as pull reads several
    ranges at once; each part is sent once, the object is the block's bytes, no upload is left open."""
    from dcr_cli.store import push
    from dcr_cli.store.backends import S3_PART_BYTES

    local = one_big_block_delta(tmp_path, 40)
    data = [b for b in Delta.open(local).manifest.blocks if b.role == "data"]
    assert len(data) == 1 and data[0].size > 4 * S3_PART_BYTES
    block = data[0]
    proxy = HoldFirstPart(s3_endpoint.url)
    try:
        push(local, s3_url, storage_options={**s3_endpoint.storage_options, "endpoint_url": proxy.url})
    finally:
        proxy.close()
    assert proxy.released_by_another_part is True  # part 1 was still held when another part's request came
    key = f"{s3_url.removeprefix('s3://')}/blocks/{block.id}"
    assert proxy.requests[("PUT", f"/{key}")] == -(-block.size // S3_PART_BYTES)  # each part once
    fs = s3_endpoint.filesystem()
    assert fs.cat_file(key) == Path(Delta.open(local).block_path(block)).read_bytes()
    assert not fs.call_s3("list_multipart_uploads", Bucket=key.split("/")[0]).get("Uploads")


def test_a_streamed_upload_holds_no_more_than_it_counts_against_the_push_budget() -> None:
    """The parts in flight, the one being cut and a chunk: S3_STREAM_HOLD_BYTES, which the push's byte budget
    counts per streamed upload; nothing keeps a part once it is sent. The parts are completed in order,
    each with its own ETag. (A client whose parts each take 20 ms, in this process, traced by tracemalloc.)"""
    import os
    import tracemalloc
    import types

    from dcr_cli.store import backends

    part = backends.S3_PART_BYTES

    class Client:
        meta = types.SimpleNamespace(events=types.SimpleNamespace(unregister=lambda *a: None))

    class SlowParts:
        def __init__(self) -> None:
            self.s3 = Client()
            self.completed: list[dict[str, Any]] = []

        def split_path(self, path: str) -> tuple[str, str, None]:
            bucket, key = path.split("/", 1)
            return bucket, key, None

        def invalidate_cache(self, path: str) -> None:
            pass

        def call_s3(self, method: str, *args: Any, **kw: Any) -> dict[str, Any]:
            if method == "create_multipart_upload":
                return {"UploadId": "u"}
            if method == "upload_part":
                time.sleep(0.02)
                return {"ETag": f"etag-{kw['PartNumber']}-{len(kw['Body'])}"}
            if method == "complete_multipart_upload":
                self.completed = kw["MultipartUpload"]["Parts"]
                return {}
            raise AssertionError(method)

    def chunks() -> Any:
        for _ in range(16):
            yield os.urandom(16) * (part // 16)  # a fresh part-sized chunk each time, as a block's reader yields

    fs = SlowParts()
    tracemalloc.start()
    try:
        backends.S3Backend(fs).put_chunks("bucket/key", chunks())  # type: ignore[arg-type]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert fs.completed == [{"PartNumber": n, "ETag": f"etag-{n}-{part}"} for n in range(1, 17)]
    assert peak <= backends.S3_STREAM_HOLD_BYTES + (1 << 20), f"{peak / 2**20:.1f} MiB held"


def test_a_part_that_fails_aborts_the_whole_upload(
    s3_endpoint: S3Endpoint, s3_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A part refused by the store (not a transient error) while others are in flight: the multipart upload
    is aborted once they end, the error reaches the caller, and nothing is published."""
    import s3fs

    from dcr_cli.store import Store, push

    local = one_big_block_delta(tmp_path, 40)
    (block,) = [b for b in Delta.open(local).manifest.blocks if b.role == "data"]
    real = s3fs.S3FileSystem.call_s3
    asked: list[int] = []

    def refusing(self: Any, method: str, *args: Any, **kwargs: Any) -> Any:
        if method == "upload_part":
            asked.append(kwargs["PartNumber"])
            if kwargs["PartNumber"] == 3:
                raise PermissionError("part 3: access denied")
        return real(self, method, *args, **kwargs)

    monkeypatch.setattr(s3fs.S3FileSystem, "call_s3", refusing)
    with pytest.raises(Exception, match="access denied"):
        push(local, s3_url, storage_options=s3_endpoint.storage_options)
    monkeypatch.setattr(s3fs.S3FileSystem, "call_s3", real)
    assert 3 in asked and max(asked) < -(-block.size // (8 << 20)) + 1
    store = Store(s3_url, s3_endpoint.storage_options)
    assert store.stat(f"blocks/{block.id}") is None and store.version("v1") is None
    fs = s3_endpoint.filesystem()
    assert not fs.call_s3("list_multipart_uploads", Bucket=s3_url.removeprefix("s3://").split("/")[0]).get("Uploads")


def test_streamed_blocks_start_small_so_the_upload_starts_early(tmp_path: Path) -> None:
    """With on_block (dcr diff --push) the first data block is cut at 1 MiB, then 2, 4, 8, 8, ... MiB."""
    import numpy as np

    from dcr_cli.delta.writer import FIRST_STREAMED_BLOCK_BYTES, STREAMED_BLOCK_BYTES, DeltaWriter
    from dcr_cli.format.codec import EncodedItem
    from dcr_cli.format.manifest import Region

    sizes: list[int] = []
    writer = DeltaWriter(tmp_path / "d", on_block=lambda _id, data: sizes.append(len(data)))
    chunk = np.random.default_rng(3).integers(0, 256, 1 << 18, dtype=np.uint8).tobytes()  # 256 KiB a section
    for i in range(110):  # 27.5 MiB of data sections
        item = EncodedItem(f"t{i:03d}", Region.range(0, 1 << 17), "overwrite", 1 << 17, chunk, 0, "0" * 64, "0" * 64)
        writer.add(item)
    writer.abort()
    mib = 1 << 20
    assert mib == FIRST_STREAMED_BLOCK_BYTES and 8 * mib == STREAMED_BLOCK_BYTES
    assert sizes[:5] == [mib, 2 * mib, 4 * mib, 8 * mib, 8 * mib], sizes


def test_repair_blocks_that_are_not_streamed_are_neither_buffered_nor_ramped(tmp_path: Path) -> None:
    """dcr diff --push hands the writer only its data blocks (``on_block.roles``): the repair blocks
    go up after publication, read from their files. So the writer keeps no in-memory copy of them (a
    buffer of tens of MB grown and copied under the GIL, for nothing) and cuts them at the streamed
    block size from the first one, as their upload does not start early anyway."""
    import numpy as np

    from dcr_cli.delta.writer import FIRST_STREAMED_BLOCK_BYTES, STREAMED_BLOCK_BYTES, DeltaWriter
    from dcr_cli.format.codec import EncodedItem
    from dcr_cli.format.manifest import Region

    class DataOnly:
        roles = ("data",)

        def __init__(self) -> None:
            self.seen: list[int] = []

        def __call__(self, _id: str, data: bytes) -> None:
            self.seen.append(len(data))

    rng = np.random.default_rng(4)
    chunk, repair = (rng.integers(0, 256, 1 << 18, dtype=np.uint8).tobytes() for _ in range(2))  # 256 KiB a section

    def write(on_block: Any) -> DeltaWriter:
        writer = DeltaWriter(tmp_path / f"d{id(on_block)}", on_block=on_block)
        for i in range(40):  # 10 MiB of data and 10 MiB of repair sections
            writer.add(
                EncodedItem(f"t{i:03d}", Region.range(0, 1 << 17), "xor", 1 << 17, chunk, 0, "0" * 64, "1" * 64, repair)
            )
            if i == 20 and isinstance(on_block, DataOnly):  # half-way through a repair block: none of it in memory
                assert writer._repair_packer.buffer is None and writer._repair_packer.size > 0
        return writer

    data_only = DataOnly()
    writer = write(data_only)
    items = writer.placed_items()
    repair_sizes = sorted(b.size for b in writer._blocks if b.role == "repair")
    writer.abort()
    assert len(items) == 40
    mib = 1 << 20
    assert data_only.seen == [FIRST_STREAMED_BLOCK_BYTES, 2 * mib, 4 * mib, 3 * mib]  # the data blocks, ramped up
    assert repair_sizes == [2 * mib, STREAMED_BLOCK_BYTES], repair_sizes  # 8 + 2 MiB: no 1, 2, 4 MiB ramp

    every: list[tuple[str, int]] = []  # a callback that names no roles takes every block, repair blocks too
    writer = write(lambda block_id, data: every.append((block_id, len(data))))
    writer.placed_items()
    roles = {b.id: b.role for b in writer._blocks}
    writer.abort()
    assert sum(n for _, n in every) == 20 * mib and {roles[i] for i, _ in every} == {"data", "repair"}
