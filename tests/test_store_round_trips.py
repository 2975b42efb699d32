"""Publication and commit are on every refit's critical path, often across regions, and the commit
behind the producer's own repair upload on its link: each question asked in sequence costs a round
trip there.

Against a real S3 endpoint (moto), through a proxy that counts requests: once the last
acknowledgement lands, a waiting commit asks only for it, then writes the commit record and
``latest.json``; what cannot change (the version record, that its base is committed) was asked once,
while it waited. A cold commit asks each object once, and the version's base's commit record, the
base's own records and the acknowledgements' listing together. ``dcr diff --push`` asks about the
store's head once, before the diff (a Store shared with the push after it), and never walks the
chain from ``latest.json`` when the delta's base is the head.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from store_fixtures import CountingProxy, S3Endpoint, diff_args, make_deltas, run_dcr

from dcr_cli.store import acknowledge, commit, push, status


def _two_versions(tmp_path: Path, s3: S3Endpoint, url: str) -> None:
    """v1 committed (acknowledged by r0), v2 pushed on it."""
    _, (d1, d2) = make_deltas(tmp_path, 2)
    push(d2, url, storage_options=_commit_first(d1, s3, url))


def _commit_first(d1: Path, s3: S3Endpoint, url: str) -> dict[str, Any]:
    """v1 (``d1``) published, acknowledged by r0 and committed; the endpoint's storage options."""
    opts = s3.storage_options
    push(d1, url, storage_options=opts)
    acknowledge(url, "v1", "r0", storage_options=opts)
    commit(url, "v1", receivers=["r0"], storage_options=opts)
    return opts


def _asked(proxy: CountingProxy, url: str, before: dict[tuple[str, str], int]) -> dict[tuple[str, str], int]:
    """Requests since ``before``, by method and store-relative key; listings (GET of the bucket) apart."""
    bucket, prefix = url.removeprefix("s3://").split("/", 1)
    with proxy.lock:
        now = dict(proxy.requests)
    out = {}
    for (method, path), n in now.items():
        n -= before.get((method, path), 0)
        if n and path != f"/{bucket}":
            out[(method, path.removeprefix(f"/{bucket}/{prefix}/"))] = n
    return out


def _diff_push_through(
    proxy: CountingProxy, ckpts: list[Path], tmp_path: Path, s3: S3Endpoint, url: str
) -> dict[tuple[str, str], int]:
    """``dcr diff c1 c2 --push`` (v1 -> v2) through ``proxy``, which it closes: v2 is pending; what it asked."""
    try:
        args = diff_args(ckpts[1], ckpts[2], tmp_path / "out", "v1", "v2")
        pushed = run_dcr(*args, "--push", url, "-S", f"endpoint_url={proxy.url}", env=s3.env())
    finally:
        proxy.close()
    assert pushed.returncode == 0, pushed.stderr
    assert [p["version"] for p in status(url, storage_options=s3.storage_options)["pending"]] == ["v2"]
    return _asked(proxy, url, {})


def test_a_waiting_commit_asks_only_for_the_new_acknowledgement_once_it_lands(
    s3_endpoint: S3Endpoint, s3_url: str, tmp_path: Path
) -> None:
    _two_versions(tmp_path, s3_endpoint, s3_url)
    proxy = CountingProxy(s3_endpoint.url)
    through = {**s3_endpoint.storage_options, "endpoint_url": proxy.url, "skip_instance_cache": True}
    waiting = threading.Event()
    results: list[object] = []
    committer = threading.Thread(
        target=lambda: results.append(
            commit(s3_url, "v2", receivers=["r0"], storage_options=through, wait=60, on_wait=lambda _: waiting.set())
        )
    )
    try:
        committer.start()
        assert waiting.wait(30), "the commit never started waiting for the acknowledgement"
        with proxy.lock:
            before = dict(proxy.requests)
        acknowledge(s3_url, "v2", "r0", storage_options=s3_endpoint.storage_options)  # not through the proxy
        committer.join(timeout=60)
    finally:
        proxy.close()
    assert results and results[0].acked == ["r0"] and not results[0].already_committed  # type: ignore[attr-defined]
    assert status(s3_url, storage_options=s3_endpoint.storage_options)["head"]["version"] == "v2"
    # Nothing asked again: not the version record, not the base's commit records, not latest.json.
    assert _asked(proxy, s3_url, before) == {
        ("GET", "acks/v2/r0.json"): 1,
        ("PUT", "commits/v1.json"): 1,
        ("PUT", "latest.json"): 1,
    }


def test_a_commit_reads_each_record_once(s3_endpoint: S3Endpoint, s3_url: str, tmp_path: Path) -> None:
    _two_versions(tmp_path, s3_endpoint, s3_url)
    acknowledge(s3_url, "v2", "r0", storage_options=s3_endpoint.storage_options)
    proxy = CountingProxy(s3_endpoint.url)
    through = {**s3_endpoint.storage_options, "endpoint_url": proxy.url, "skip_instance_cache": True}
    try:
        result = commit(s3_url, "v2", receivers=["r0"], storage_options=through)
    finally:
        proxy.close()
    assert result.acked == ["r0"] and not result.already_committed
    asked = _asked(proxy, s3_url, {})
    assert all(n == 1 for n in asked.values()), asked
    assert ("GET", "latest.json") not in asked  # the head is not walked: the base is committed, without a successor
    assert {key for key, _ in asked.items() if key[0] == "PUT"} == {("PUT", "commits/v1.json"), ("PUT", "latest.json")}


def test_diff_push_asks_about_the_head_once_and_publishes_in_three_rounds(
    s3_endpoint: S3Endpoint, s3_url: str, tmp_path: Path
) -> None:
    ckpts, (d1, _) = make_deltas(tmp_path, 2)
    _commit_first(d1, s3_endpoint, s3_url)
    asked = _diff_push_through(CountingProxy(s3_endpoint.url), ckpts, tmp_path, s3_endpoint, s3_url)
    # The base's records once (checked before the diff, kept for the push), the chain never walked.
    assert asked[("GET", "versions/v1.json")] == 1 and asked[("GET", "commits/v0.json")] == 1, asked
    assert ("GET", "latest.json") not in asked, asked
    # Absent before the diff and at the push: asked both times (what is absent is never taken as known).
    assert asked[("GET", "versions/v2.json")] == 2 and asked[("GET", "commits/v1.json")] == 2, asked
    assert asked[("PUT", "versions/v2.json")] == 1 and asked[("PUT", "children/v1/v2")] == 1, asked


class Questions(CountingProxy):
    """Notes every request (its line and whether it waits for a go-ahead: ``Expect: 100-continue``) and holds
    back the first request for ``held`` until a request for each of ``along`` arrived (at most ``patience``
    seconds): a client that asks them one after the other cannot pass it without the wait running out."""

    def __init__(self, upstream: str, held: str, along: list[str], patience: float = 10.0) -> None:
        self.lines: list[tuple[str, str, bool]] = []  # (method, key, waits for 100 Continue)
        self.held, self.along, self.patience = held, set(along), patience
        self.all_arrived = threading.Event()
        self.released_by_the_others: bool | None = None
        self.holding = False
        super().__init__(upstream)

    def seen(self, data: bytes, upstream: bool, state: list[str]) -> None:
        super().seen(data, upstream, state)
        if upstream:
            for method, path in self._REQUEST.findall(data):
                self.lines.append((method.decode(), path.decode(), b"\r\nexpect: 100-continue" in data.lower()))
                self.along.discard(path.decode())
            if not self.along:
                self.all_arrived.set()

    def before_forwarding(self, data: bytes, upstream: bool) -> None:
        if not (upstream and f" {self.held} ".encode() in data.split(b"\r\n")[0]):
            return
        with self.lock:
            first, self.holding = not self.holding, True
        if first:  # only the first request for it (a client that gave up on it may ask again meanwhile)
            self.released_by_the_others = self.all_arrived.wait(self.patience)


def test_a_push_asks_its_first_questions_at_once_and_each_in_one_request(
    s3_endpoint: S3Endpoint, s3_url: str, tmp_path: Path
) -> None:
    """Across regions each question asked in sequence costs a round trip before the upload starts: the
    store marker, the version's record, the base's records and the blocks go out together. Each one is a
    single request: a record is one GET (no HEAD for its size first), an absent block one HEAD (no listing
    after it), and no PUT waits for the store's go-ahead (``Expect: 100-continue``) before its body."""
    from dcr_cli.delta.reader import Delta

    _, (d1, d2) = make_deltas(tmp_path, 2)
    opts = _commit_first(d1, s3_endpoint, s3_url)
    bucket, prefix = s3_url.removeprefix("s3://").split("/", 1)
    root = f"/{bucket}/{prefix}"
    data = [b.id for b in Delta.open(d2).manifest.blocks if b.role == "data"]
    along = [f"{root}/versions/v2.json", f"{root}/commits/v1.json", *(f"{root}/blocks/{b}" for b in data)]
    proxy = Questions(s3_endpoint.url, held=f"{root}/dcr-store.json", along=along)
    through = {**opts, "endpoint_url": proxy.url, "skip_instance_cache": True}
    try:
        push(d2, s3_url, storage_options=through)
        acknowledge(s3_url, "v2", "r0", storage_options=through)
        commit(s3_url, "v2", receivers=["r0"], storage_options=through)
    finally:
        proxy.close()
    assert proxy.released_by_the_others is True, proxy.lines[:8]  # the marker was held until the rest arrived
    assert status(s3_url, storage_options=opts)["head"]["version"] == "v2"
    assert not [line for line in proxy.lines if line[2]], "a PUT waited a round trip for 100 Continue"
    heads = [key for method, key, _ in proxy.lines if method == "HEAD"]
    assert heads and all(key.startswith(f"{root}/blocks/") for key in heads), heads  # records: one GET each
    published = next(i for i, (m, key, _) in enumerate(proxy.lines) if m == "PUT" and key.endswith("/versions/v2.json"))
    listings = [line for line in proxy.lines[:published] if line[1] == f"/{bucket}"]
    assert not listings, listings  # an absent block's HEAD is not followed by a listing


def test_a_receiver_opens_a_stored_version_in_three_requests(
    s3_endpoint: S3Endpoint, s3_url: str, tmp_path: Path
) -> None:
    """``dcr apply STORE --version V`` (no --wait): the marker is read once, as the store check and as the
    marker (one GET, not a HEAD then a GET), then the version's record, then its manifest."""
    from dcr_cli.store import open_delta

    _, (d1, _) = make_deltas(tmp_path, 2)
    push(d1, s3_url, storage_options=s3_endpoint.storage_options)
    proxy = CountingProxy(s3_endpoint.url)
    through = {**s3_endpoint.storage_options, "endpoint_url": proxy.url, "skip_instance_cache": True}
    try:
        delta = open_delta(s3_url, "v1", storage_options=through)
    finally:
        proxy.close()
    assert delta.manifest.target.version == "v1"
    assert _asked(proxy, s3_url, {}) == {
        ("GET", "dcr-store.json"): 1,
        ("GET", "versions/v1.json"): 1,
        ("GET", f"manifests/{delta.id}.json"): 1,
    }


def test_the_genesis_is_committed_whatever_a_record_under_its_label_holds(tmp_path: Path) -> None:
    """Asked together with the marker, a record named like the genesis (which no push writes) is not used:
    damaged, it changes nothing; any other version's damaged record is refused as before."""
    import pytest

    from dcr_cli.errors import DcrError
    from dcr_cli.store import Store

    _, (d1, _) = make_deltas(tmp_path, 2)
    url = str(tmp_path / "store")
    push(d1, url)
    (tmp_path / "store" / "versions" / "v0.json").write_text("{not json")
    assert Store(url).is_committed("v0") is True  # the marker not known yet: asked together
    warm = Store(url)
    warm.marker()
    assert warm.is_committed("v0") is True  # the marker known: the record is not asked
    (tmp_path / "store" / "versions" / "v1.json").write_text("{not json")
    with pytest.raises(DcrError):
        Store(url).is_committed("v1")


class Unreachable(CountingProxy):
    """Drops the connection of every GET of ``key`` without an answer (a store, or a route to it, that is
    down), forwarding the rest."""

    def __init__(self, upstream: str, key: str) -> None:
        self.key = key.encode()
        self.dropped = 0
        super().__init__(upstream)

    def before_forwarding(self, data: bytes, upstream: bool) -> None:
        if upstream and data.startswith(b"GET ") and self.key in data.split(b"\r\n", 1)[0]:
            with self.lock:
                self.dropped += 1
            raise ConnectionAbortedError(self.key)  # the pump ends both sides without forwarding it


def test_a_record_that_keeps_failing_is_asked_once_per_retry_not_five_times_that(
    s3_endpoint: S3Endpoint, s3_url: str, tmp_path: Path, monkeypatch: Any
) -> None:
    """A store that drops every request for a record: each of dcr's attempts asks as often as the S3 client
    retries (s3fs's retries of one call, botocore's own set to one here), not that many times over again
    (s3fs's ``cat_file`` retries its own retried call), so the error comes in seconds rather than minutes."""
    import pytest

    from dcr_cli.errors import DcrError
    from dcr_cli.store import Store

    _, (d1, _) = make_deltas(tmp_path, 2)
    push(d1, s3_url, storage_options=s3_endpoint.storage_options)
    monkeypatch.setenv("DCR_STORE_ATTEMPTS", "1")
    proxy = Unreachable(s3_endpoint.url, "/versions/v1.json")
    one_try = {"retries": {"total_max_attempts": 1, "mode": "legacy"}}  # botocore asks once per s3fs try
    through = {**s3_endpoint.storage_options, "endpoint_url": proxy.url, "skip_instance_cache": True}
    try:
        store = Store(s3_url, {**through, "config_kwargs": one_try})
        assert store.marker() is not None  # the rest of the store answers
        with pytest.raises(DcrError, match=r"versions/v1\.json"):
            store.version("v1")
    finally:
        proxy.close()
    retries = store.fs.retries  # s3fs's own retries of one call; its HTTP client tries a dropped connection twice
    assert 1 <= proxy.dropped <= 2 * retries, proxy.dropped  # (before: 5 x that, s3fs's loop around its loop)


class HoldUntil(CountingProxy):
    """Holds back the first request whose line starts with ``held`` until ``times`` requests starting with
    ``until`` arrived (at most ``patience`` seconds): a client that waits for the first before it sends the
    last of those cannot pass it without the wait running out."""

    def __init__(self, upstream: str, held: bytes, until: bytes, patience: float = 10.0, times: int = 1) -> None:
        self.held_line, self.until_line, self.patience, self.times = held, until, patience, times
        self.holding = False
        self.arrived = threading.Event()
        self.released_by_the_other: bool | None = None
        super().__init__(upstream)

    def seen(self, data: bytes, upstream: bool, state: list[str]) -> None:
        super().seen(data, upstream, state)
        if upstream and data.startswith(self.until_line):
            self.times -= 1
            if self.times <= 0:
                self.arrived.set()

    def before_forwarding(self, data: bytes, upstream: bool) -> None:
        if not (upstream and data.startswith(self.held_line)):
            return
        with self.lock:
            first, self.holding = not self.holding, True
        if first:
            self.released_by_the_other = self.arrived.wait(self.patience)


def test_diff_push_neither_asks_before_sending_a_block_nor_waits_for_its_announcement(
    s3_endpoint: S3Endpoint, s3_url: str, tmp_path: Path
) -> None:
    """The last block's questions are on the refit's critical path whole, across regions a round trip each:
    a block goes up without a HEAD first (its id is its content's digest: a new delta's blocks are not on the
    store), and the push publishes while the block's announcement is still on its way. Each data block is
    asked about once, by the check just before the record; the announcements are gone afterwards."""
    from dcr_cli.delta.reader import Delta

    ckpts, (d1, _) = make_deltas(tmp_path, 2)
    _commit_first(d1, s3_endpoint, s3_url)
    bucket, prefix = s3_url.removeprefix("s3://").split("/", 1)
    root = f"/{bucket}/{prefix}"
    proxy = HoldUntil(s3_endpoint.url, f"PUT {root}/announced/v2/".encode(), f"PUT {root}/versions/v2.json ".encode())
    asked = _diff_push_through(proxy, ckpts, tmp_path, s3_endpoint, s3_url)
    assert proxy.released_by_the_other is True  # the record went out while an announcement was held
    data = [b.id for b in Delta.open(tmp_path / "out").manifest.blocks if b.role == "data"]
    assert data and all(asked[("HEAD", f"blocks/{b}")] == 1 for b in data), asked  # the check before the record
    assert all(asked[("PUT", f"blocks/{b}")] == 1 for b in data), asked
    assert s3_endpoint.filesystem().ls(f"{bucket}/{prefix}", detail=False)  # the store is there ...
    assert not s3_endpoint.filesystem().exists(f"{bucket}/{prefix}/announced/v2")  # ... its hints are not


def test_diff_push_asks_its_first_questions_while_its_last_block_is_on_its_way(
    s3_endpoint: S3Endpoint, s3_url: str, tmp_path: Path
) -> None:
    """The push after the diff asks the store's state (the version's record, the head) while the last block
    is still uploading: only the blocks' own check waits for the uploads. The block is held until the push's
    question about the version arrives (the second: the first is the check before the diff)."""
    ckpts, (d1, _) = make_deltas(tmp_path, 2)
    _commit_first(d1, s3_endpoint, s3_url)
    bucket, prefix = s3_url.removeprefix("s3://").split("/", 1)
    root = f"/{bucket}/{prefix}"
    held, until = f"PUT {root}/blocks/".encode(), f"GET {root}/versions/v2.json ".encode()
    proxy = HoldUntil(s3_endpoint.url, held, until, times=2)
    asked = _diff_push_through(proxy, ckpts, tmp_path, s3_endpoint, s3_url)
    assert proxy.released_by_the_other is True, asked
    assert asked[("GET", "versions/v2.json")] == 2 and asked[("PUT", "versions/v2.json")] == 1, asked


def test_a_diff_push_rerun_asks_about_its_blocks_with_its_first_questions(
    s3_endpoint: S3Endpoint, s3_url: str, tmp_path: Path
) -> None:
    """The diff finds its delta already there (and asks the store nothing), so no block went through the
    uploader: the push asks about them all together with the version's record, not after it."""
    ckpts, (d1, _) = make_deltas(tmp_path, 2)
    _commit_first(d1, s3_endpoint, s3_url)
    args = diff_args(ckpts[1], ckpts[2], tmp_path / "out", "v1", "v2")
    assert run_dcr(*args, env=s3_endpoint.env()).returncode == 0  # the delta, not pushed
    bucket, prefix = s3_url.removeprefix("s3://").split("/", 1)
    root = f"/{bucket}/{prefix}"
    held, until = f"GET {root}/versions/v2.json ".encode(), f"HEAD {root}/blocks/".encode()
    proxy = HoldUntil(s3_endpoint.url, held, until)
    asked = _diff_push_through(proxy, ckpts, tmp_path, s3_endpoint, s3_url)
    assert proxy.released_by_the_other is True, asked


def test_diff_push_sends_again_only_what_an_earlier_attempt_did_not_announce(
    s3_endpoint: S3Endpoint, s3_url: str, tmp_path: Path
) -> None:
    """A diff --push re-run after a kill: the blocks the killed attempt announced (so had sent) are not sent
    again; one of them removed meanwhile (a gc) is found by the push's first questions and sent then."""
    from dcr_cli.delta.reader import Delta
    from dcr_cli.store import Store
    from dcr_cli.store.announce import announcement
    from dcr_cli.store.streaming import BlockUploader
    from dcr_cli.store.transfer import split_roles

    _, (d1, _) = make_deltas(tmp_path, 2)
    opts = s3_endpoint.storage_options
    data, _ = split_roles(Delta.open(d1).manifest)
    store = Store(s3_url, opts)
    for b in data:  # the killed attempt: every block sent and announced, then one of them collected
        store.put(f"blocks/{b.id}", (d1 / b.path).read_bytes())
        store.put(announcement("v1", b.id, b.size), b"")
    store.delete(f"blocks/{data[0].id}")
    proxy = CountingProxy(s3_endpoint.url)
    through = {**opts, "endpoint_url": proxy.url, "skip_instance_cache": True}
    try:
        uploader = BlockUploader(s3_url, through, announce="v1")
        for b in data:
            uploader(b.id, (d1 / b.path).read_bytes())
        uploader.wait_uploads()
        assert uploader.uploaded == {} and not [k for k in proxy.requests if k[0] in ("PUT", "HEAD")]
        result = push(
            d1, s3_url, storage_options=through, fresh=uploader.uploaded, on_published=lambda _: uploader.close()
        )
    finally:
        uploader.close()
        proxy.close()
    assert result.uploaded_blocks - result.repair_uploaded_blocks == 1  # the collected one, sent by the push
    assert Store(s3_url, opts).read(f"blocks/{data[0].id}") == (d1 / data[0].path).read_bytes()


class HoldEachUntilAll(CountingProxy):
    """Holds back every request whose line starts with ``prefix``, for a key of ``along``, until each key of
    ``along`` has been asked as often as it (its round: each waits at most ``patience`` seconds): a client
    that asks a round of them in waves cannot pass it without a wait running out."""

    def __init__(self, upstream: str, prefix: bytes, along: list[str], patience: float = 8.0) -> None:
        self.prefix, self.patience = prefix, patience
        self.asked = dict.fromkeys(along, 0)  # requests seen per key
        self.rounds = threading.Condition()
        self.in_time: bool | None = None
        super().__init__(upstream)

    def seen(self, data: bytes, upstream: bool, state: list[str]) -> None:
        super().seen(data, upstream, state)
        if upstream and data.startswith(self.prefix):
            key = data.split(b" ", 2)[1].split(b"?", 1)[0].decode()
            with self.rounds:
                if key in self.asked:
                    self.asked[key] += 1
                    self.rounds.notify_all()

    def before_forwarding(self, data: bytes, upstream: bool) -> None:
        if not (upstream and data.startswith(self.prefix)):
            return
        key = data.split(b" ", 2)[1].split(b"?", 1)[0].decode()
        with self.rounds:
            round_ = self.asked.get(key, 0)  # (seen() has counted this request)
            arrived = self.rounds.wait_for(lambda: min(self.asked.values()) >= round_, self.patience)
        with self.lock:
            self.in_time = arrived if self.in_time is None else self.in_time and arrived


def test_a_push_asks_about_all_its_blocks_in_one_round_however_many(
    s3_endpoint: S3Endpoint, s3_url: str, tmp_path: Path
) -> None:
    """24 data blocks: their HEADs go out together, before and after the upload, not in waves of the push's
    eight workers or the S3 client's ten connections (each wave a round trip on the producer's path)."""
    from store_fixtures import big_delta

    from dcr_cli.delta.reader import Delta

    delta = big_delta(tmp_path, tensors=24)
    bucket, prefix = s3_url.removeprefix("s3://").split("/", 1)
    root = f"/{bucket}/{prefix}"
    data = [b.id for b in Delta.open(delta).manifest.blocks if b.role == "data"]
    assert len(data) == 24
    proxy = HoldEachUntilAll(s3_endpoint.url, f"HEAD {root}/blocks/".encode(), [f"{root}/blocks/{b}" for b in data])
    through = {**s3_endpoint.storage_options, "endpoint_url": proxy.url, "skip_instance_cache": True}
    try:
        result = push(delta, s3_url, storage_options=through)
    finally:
        proxy.close()
    assert result.uploaded_blocks == 24 and proxy.in_time is True
    asked = _asked(proxy, s3_url, {})
    assert all(asked[("HEAD", f"blocks/{b}")] == 2 for b in data), asked  # before the upload, before the record


def test_a_listing_is_one_request_whether_the_folder_is_empty_or_not_and_lists_every_page(
    s3_endpoint: S3Endpoint, s3_url: str
) -> None:
    """A receiver waiting for announcements and a commit waiting for acknowledgements list a folder that stays
    empty until what they wait for lands: s3fs followed each empty listing with one of the parent (two round
    trips a poll). One request per page; more than a page (1,000 names) is listed whole, files and folders
    apart, as on a local store."""
    from dcr_cli.store import Store

    proxy = CountingProxy(s3_endpoint.url)
    through = {**s3_endpoint.storage_options, "endpoint_url": proxy.url, "skip_instance_cache": True}
    bucket, prefix = s3_url.removeprefix("s3://").split("/", 1)
    try:
        store = Store(s3_url, through)
        assert store.list("acks/v1") == [] and store.list_dirs("acks") == []
        with proxy.lock:
            assert proxy.requests == {("GET", f"/{bucket}"): 2}, proxy.requests
        names = {f"{i:04d}.json": b"x" * (i % 7) for i in range(1003)}
        s3_endpoint.filesystem().pipe({f"{bucket}/{prefix}/acks/v1/{n}": data for n, data in names.items()})
        s3_endpoint.filesystem().pipe(f"{bucket}/{prefix}/acks/v1/deeper/one.json", b"x")
        listed = store.list("acks/v1")
        assert {(e.name, e.size) for e in listed} == {(n, len(data)) for n, data in names.items()}
        assert all(e.mtime is not None for e in listed)
        assert store.list_dirs("acks/v1") == ["deeper"] and store.list_dirs("acks") == ["v1"]
    finally:
        proxy.close()
