"""dcr's store side over real backends: local disk, memory://, and S3 (moto's server on 127.0.0.1 via s3fs)."""

from __future__ import annotations

import shutil
import threading
import uuid
from pathlib import Path

import pytest
from store_fixtures import S3Endpoint, commit_each, count_store_questions, delta_files, make_deltas

from dcr_cli.delta.reader import Delta
from dcr_cli.errors import ConflictError, DcrError, IncompatibleError, IntegrityError, NotReadyError
from dcr_cli.store import (
    Store,
    acknowledge,
    check,
    commit,
    gc,
    log,
    open_delta,
    pull,
    pull_since,
    push,
    status,
)


@pytest.fixture(params=["local", "file", "memory", "s3"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, dict]:
    if request.param == "local":
        return str(tmp_path / "store"), {}
    if request.param == "file":
        return f"file://{tmp_path / 'store'}", {}
    if request.param == "memory":
        return f"memory://dcr-{uuid.uuid4().hex}/store", {}
    endpoint: S3Endpoint = request.getfixturevalue("s3_endpoint")
    return request.getfixturevalue("s3_url"), endpoint.storage_options


@pytest.fixture(scope="module")
def deltas(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Path], list[Path]]:
    return make_deltas(tmp_path_factory.mktemp("ckpts"), 3)


def test_round_trip(store_url: tuple[str, dict], deltas: tuple[list[Path], list[Path]], tmp_path: Path) -> None:
    url, opts = store_url
    _, (d1, *_) = deltas
    result = push(d1, url, storage_options=opts)
    assert (result.version, result.base, result.already_published) == ("v1", "v0", False)
    assert result.uploaded_blocks == result.blocks > 0

    again = push(d1, url, storage_options=opts)
    assert again.already_published and again.uploaded_blocks == 0

    pulled = pull(url, tmp_path / "p1", storage_options=opts)
    assert pulled.version == "v1" and pulled.downloaded_blocks == pulled.blocks
    source, copy = Delta.open(d1), Delta.open(tmp_path / "p1")
    assert copy.id == source.id  # byte-identical manifest
    data_blocks = {f"blocks/{b.id}" for b in source.manifest.blocks if b.role == "data"}
    assert set(delta_files(tmp_path / "p1")) == {"manifest.json", *data_blocks}
    for name in data_blocks:
        assert (tmp_path / "p1" / name).read_bytes() == (d1 / name).read_bytes()

    # The store can also be read in place, every section checked against its digest; a plain delta
    # directory opens through the same call (what dcr apply uses for "DELTA or store URL").
    assert open_delta(str(d1)).id == source.id
    remote = open_delta(url, "v1", storage_options=opts)
    assert remote.id == source.id
    for item in remote.manifest.items:
        assert remote.decode(item).values.tobytes() == source.decode(item).values.tobytes()

    with_repair = pull(url, tmp_path / "p1r", storage_options=opts, repair=True)
    assert set(delta_files(tmp_path / "p1r")) == set(delta_files(d1))
    assert with_repair.blocks == len({b.id for b in source.manifest.blocks})


@pytest.mark.parametrize("backend", ["local", "memory", "s3", "gcs"])
def test_create_only_has_exactly_one_winner(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    if backend == "local":
        store = Store(str(tmp_path / "store"))
    elif backend == "memory":
        store = Store(f"memory://dcr-{uuid.uuid4().hex}")
    else:  # s3 or gcs: a real endpoint on 127.0.0.1, whose conditional create decides the race
        url, endpoint = request.getfixturevalue(f"{backend}_url"), request.getfixturevalue(f"{backend}_endpoint")
        store = Store(url, endpoint.storage_options)
    racers = 8
    barrier = threading.Barrier(racers)
    winners: list[int] = []
    losers: list[int] = []

    def race(i: int) -> None:
        barrier.wait()
        try:
            store.create("versions/race.json", f"writer {i}".encode())
            winners.append(i)
        except FileExistsError:
            losers.append(i)

    threads = [threading.Thread(target=race, args=(i,)) for i in range(racers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(winners) == 1 and len(losers) == racers - 1
    assert store.read("versions/race.json") == f"writer {winners[0]}".encode()


def test_store_without_atomic_create_is_refused_unless_allowed(deltas: tuple[list[Path], list[Path]]) -> None:
    _, (d1, *_) = deltas
    url = f"dir::memory://dcr-{uuid.uuid4().hex}"  # DirFileSystem: create-only is check-then-write there
    with pytest.raises(DcrError, match="cannot create an object atomically"):
        push(d1, url)
    assert push(d1, url, allow_unsafe_publish=True).version == "v1"
    acknowledge(url, "v1", "r")
    with pytest.raises(DcrError, match="cannot create an object atomically"):
        commit(url, "v1", receivers=["r"])
    # Allowed, the commit asks for the base's commit record just before its write (no create-only
    # write stands for it there), and a re-run finds the commit done.
    assert not commit(url, "v1", receivers=["r"], allow_unsafe_publish=True).already_committed
    assert commit(url, "v1", receivers=["r"], allow_unsafe_publish=True, wait=1).already_committed
    assert status(url)["head"]["version"] == "v1"


def test_joint_commit_needs_every_named_ack(deltas: tuple[list[Path], list[Path]], tmp_path: Path) -> None:
    _, (d1, d2, _) = deltas
    url = str(tmp_path / "store")
    push(d1, url)
    acknowledge(url, "v1", "rollout-a")
    with pytest.raises(NotReadyError, match="missing: rollout-b"):
        commit(url, "v1", receivers=["rollout-a", "rollout-b"])
    assert not (tmp_path / "store" / "commits").exists() or not any((tmp_path / "store" / "commits").iterdir())
    state = status(url)
    assert state["head"]["version"] == "v0" and [p["version"] for p in state["pending"]] == ["v1"]
    assert state["pending"][0]["acked"] == ["rollout-a"]

    # The producer must not build on the uncommitted v1.
    with pytest.raises(IncompatibleError, match="not the committed baseline"):
        push(d2, url)

    with pytest.raises(IncompatibleError):
        acknowledge(url, "v1", "rollout-b", fingerprint=Delta.open(d1).manifest.base.fingerprint)
    acknowledge(url, "v1", "rollout-b", fingerprint=Delta.open(d1).manifest.target.fingerprint)
    done = commit(url, "v1", receivers=["rollout-a", "rollout-b"])
    assert done.acked == ["rollout-a", "rollout-b"] and not done.already_committed
    assert commit(url, "v1", receivers=["rollout-a", "rollout-b"]).already_committed

    state = status(url)
    assert state["diff_base"] == {"version": "v1", "fingerprint": Delta.open(d1).manifest.target.fingerprint}
    assert state["pending"] == [] and state["committed"]
    push(d2, url)
    acknowledge(url, "v2", "rollout-a")
    with pytest.raises(NotReadyError):
        commit(url, "v2", quorum=2)
    assert commit(url, "v2", quorum=1).acked == ["rollout-a"]

    entries = log(url)
    assert [(e.version, e.state) for e in entries] == [("v1", "committed"), ("v2", "committed")]
    assert all(0 < e.change_rate < 0.2 and e.payload_bytes > 0 and e.full_bytes > e.payload_bytes for e in entries)


def test_stale_version_cannot_be_committed(tmp_path: Path) -> None:
    """Two candidate versions on one base: committing one makes the other stale for good."""
    ckpts, (d1,) = make_deltas(tmp_path / "a", 1)
    from safetensors.numpy import load_file
    from store_fixtures import step, write_checkpoint

    from dcr_cli.produce import diff

    other = write_checkpoint(tmp_path / "other", step(load_file(str(ckpts[0] / "model.safetensors")), 999))
    diff(ckpts[0], other, tmp_path / "d1b", base_version="v0", target_version="v1b", workers=1)
    url = str(tmp_path / "store")
    push(d1, url)
    push(tmp_path / "d1b", url)
    with pytest.raises(ConflictError, match="several versions"):
        pull(url, tmp_path / "out")
    acknowledge(url, "v1", "r")
    acknowledge(url, "v1b", "r")
    commit(url, "v1b", receivers=["r"])
    with pytest.raises(ConflictError, match="stale"):
        commit(url, "v1", receivers=["r"])
    assert {e.version: e.state for e in log(url)} == {"v1b": "committed", "v1": "stale"}
    assert pull(url, tmp_path / "out").version == "v1b"


def test_a_version_whose_base_was_never_committed_can_never_be_committed(tmp_path: Path) -> None:
    """A record built on a base that is published but not committed (a push refuses that; here the
    record is carried over from another store): the commit refuses it at once, even with --wait,
    naming the head, and writes nothing."""
    _, (d1, d2) = make_deltas(tmp_path, 2)
    done, url = str(tmp_path / "done"), str(tmp_path / "store")
    push(d1, done)
    acknowledge(done, "v1", "r")
    commit(done, "v1", receivers=["r"])
    push(d2, done)
    push(d1, url)  # v1 published here, never committed: the head is the genesis
    acknowledge(url, "v1", "r")
    shutil.copy(Path(done) / "versions" / "v2.json", Path(url) / "versions" / "v2.json")
    for wait in (None, 5.0):
        with pytest.raises(ConflictError, match="built on 'v1', but the committed head is 'v0'; it can never be"):
            commit(url, "v2", receivers=["r"], wait=wait)
    assert not (Path(url) / "commits").exists() and status(url)["head"]["version"] == "v0"


def test_a_damaged_record_of_the_head_costs_a_walk_not_the_next_push_or_commit(tmp_path: Path) -> None:
    """The head's own version record unreadable (bit rot): the head is still found by walking the commit
    records from the genesis, as before the shortcut that asks the base's records directly."""
    _, (d1, d2, d3) = make_deltas(tmp_path, 3)
    url = str(tmp_path / "store")
    commit_each(url, [d1, d2])
    (tmp_path / "store" / "versions" / "v2.json").write_bytes(b"{not json")
    assert push(d3, url).version == "v3"
    acknowledge(url, "v3", "r")
    assert commit(url, "v3", receivers=["r"]).acked == ["r"]
    assert status(url)["head"]["version"] == "v3"


def test_a_push_re_run_asks_nothing_about_the_head(tmp_path: Path) -> None:
    """Re-running the push of a published version (§4.1 step 2, the fix for a lost manifest) takes the
    base its record names: a damaged commit record further along the chain does not stop it."""
    _, deltas = make_deltas(tmp_path, 3)
    url = str(tmp_path / "store")
    commit_each(url, deltas)
    shutil.rmtree(tmp_path / "store" / "manifests")
    (tmp_path / "store" / "commits" / "v2.json").write_bytes(b"{not json")
    result = push(deltas[0], url)
    assert result.already_published and result.manifest_restored
    assert (tmp_path / "store" / "manifests" / f"{result.manifest}.json").exists()


def _publish_chain(url: str, deltas: list[Path], opts: dict | None = None) -> None:
    for d in deltas:
        result = push(d, url, storage_options=opts)
        acknowledge(url, result.version, "r", storage_options=opts)
        commit(url, result.version, receivers=["r"], storage_options=opts)


def test_pull_since_fetches_the_chain_a_lagging_receiver_needs(
    deltas: tuple[list[Path], list[Path]], tmp_path: Path
) -> None:
    _, ds = deltas
    url = str(tmp_path / "store")
    _publish_chain(url, ds)
    results = pull_since(url, "v0", tmp_path / "chain")
    assert [r.version for r in results] == ["v1", "v2", "v3"]
    for r, d in zip(results, ds, strict=True):
        assert Delta.open(r.path).id == Delta.open(d).id
    assert [r.version for r in pull_since(url, "v2", tmp_path / "chain2")] == ["v3"]
    assert pull_since(url, "v3", tmp_path / "chain3") == []
    with pytest.raises(DcrError, match="not a committed version"):
        pull_since(url, "v9", tmp_path / "chain4")


def test_gc_keeps_what_live_versions_need(tmp_path: Path) -> None:
    """v1: A->B, v2: B->A, v3: A->B. XOR data is symmetric, so v3 shares blocks with v1 (and v2's data)."""
    from store_fixtures import base_tensors, step, write_checkpoint

    from dcr_cli.produce import diff

    a = base_tensors(3)
    b = step(a, 4)
    ca, cb = write_checkpoint(tmp_path / "A", a), write_checkpoint(tmp_path / "B", b)
    pairs = [(ca, cb), (cb, ca), (ca, cb)]
    ds = []
    for i, (x, y) in enumerate(pairs, start=1):
        diff(x, y, tmp_path / f"d{i}", base_version=f"v{i - 1}", target_version=f"v{i}", workers=1)
        ds.append(tmp_path / f"d{i}")
    url = str(tmp_path / "store")
    _publish_chain(url, ds)
    blocks = [{b.id for b in Delta.open(d).manifest.blocks} for d in ds]
    assert blocks[0] == blocks[2] and blocks[0] & blocks[1]  # shared across live and dead versions
    orphan = Store(url)
    orphan.put("blocks/" + "0" * 64, b"left by a killed push")

    # Default grace: fresh unreferenced blocks (the orphan, v2's own block) may belong to a push in progress.
    young = gc(url, keep=1)
    assert young.removed_blocks == 0 and young.young_unreferenced == 1 + len(blocks[1] - blocks[2])
    assert (tmp_path / "store" / "blocks" / ("0" * 64)).exists()
    result = gc(url, keep=1, grace_s=0)
    assert result.live_versions == ["v3"] and result.dropped_versions == ["v1", "v2"]
    stored = {p.name for p in (tmp_path / "store" / "blocks").iterdir()}
    assert stored == blocks[2]
    assert result.removed_blocks == len(blocks[1] - blocks[2]) + 1
    assert pull(url, tmp_path / "p3", version="v3", repair=True).blocks == len(blocks[2])
    with pytest.raises(DcrError, match="removed by dcr gc"):
        pull(url, tmp_path / "p1", version="v1")
    report = check(url, read_data=True)
    assert report.ok and report.unavailable_versions == ["v1", "v2"] and report.blocks_read == len(blocks[2])
    assert {e.version: e.available for e in log(url)} == {"v1": False, "v2": False, "v3": True}


def test_gc_racing_a_push_that_reuses_old_blocks_loses_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """gc lists blocks, a push reusing a dropped version's old blocks publishes, then gc removes what it listed.

    v1: A->B and v3: A->B share their blocks (v1's repair blocks too); v2: B->A drops v1 at gc --keep 1.
    """
    import os
    import time

    from store_fixtures import flip_chain

    from dcr_cli.store import repo

    ds = flip_chain(tmp_path)
    url = str(tmp_path / "store")
    _publish_chain(url, ds[:2])
    two_hours_ago = time.time() - 7200
    for block in (tmp_path / "store" / "blocks").iterdir():
        os.utime(block, (two_hours_ago, two_hours_ago))
    reused_only_by_v1 = {b.id for b in Delta.open(ds[0]).manifest.blocks} - {
        b.id for b in Delta.open(ds[1]).manifest.blocks
    }
    # v1's repair blocks: unreferenced once v1 is dropped, and needed by v3.
    assert reused_only_by_v1 and reused_only_by_v1 <= {b.id for b in Delta.open(ds[2]).manifest.blocks}

    listing = repo.Store.list
    pushed: list[str] = []
    racing = threading.Event()

    def list_then_push(self: repo.Store, rel_dir: str) -> list[repo.Listing]:
        entries = listing(self, rel_dir)
        if rel_dir == repo.BLOCKS and not racing.is_set():  # gc has its (soon stale) listing: v3 is pushed now
            racing.set()
            pushed.append(push(ds[2], url).version)
        return entries

    monkeypatch.setattr(repo.Store, "list", list_then_push)
    result = gc(url, keep=1)
    monkeypatch.undo()
    assert pushed == ["v3"] and result.removed_blocks == 0
    assert pull(url, tmp_path / "p3", version="v3", repair=True).blocks == len(
        {b.id for b in Delta.open(ds[2]).manifest.blocks}
    )
    assert check(url, read_data=True).ok


def test_push_writes_again_only_old_blocks_it_reuses(tmp_path: Path, deltas: tuple[list[Path], list[Path]]) -> None:
    import os
    import time

    _, (d1, *_) = deltas
    url = str(tmp_path / "store")
    blocks = sorted({b.id for b in Delta.open(d1).manifest.blocks})
    (tmp_path / "store" / "blocks").mkdir(parents=True)
    old, young = time.time() - 7200, time.time() - 60
    for i, block_id in enumerate(blocks):
        (tmp_path / "store" / "blocks" / block_id).write_bytes((d1 / "blocks" / block_id).read_bytes())
        stamp = old if i % 2 == 0 else young
        os.utime(tmp_path / "store" / "blocks" / block_id, (stamp, stamp))
    result = push(d1, url)
    assert result.uploaded_blocks == 0 and result.refreshed_blocks == len(blocks[::2])
    for i, block_id in enumerate(blocks):
        age = time.time() - (tmp_path / "store" / "blocks" / block_id).stat().st_mtime
        assert (age < 600) if i % 2 == 0 else (age > 30)


def test_corrupted_block_is_detected_at_pull(
    s3_endpoint: S3Endpoint, s3_url: str, deltas: tuple[list[Path], list[Path]], tmp_path: Path
) -> None:
    _, (d1, *_) = deltas
    opts = s3_endpoint.storage_options
    push(d1, s3_url, storage_options=opts)
    block = next(b for b in Delta.open(d1).manifest.blocks if b.role == "data")
    fs = s3_endpoint.filesystem()
    path = f"{s3_url.removeprefix('s3://')}/blocks/{block.id}"
    data = bytearray(fs.cat_file(path))
    data[len(data) // 2] ^= 0x01  # one flipped bit, same size
    fs.pipe_file(path, bytes(data))

    with pytest.raises(IntegrityError, match="corrupt on the store"):
        pull(s3_url, tmp_path / "out", storage_options=opts)
    assert not (tmp_path / "out").exists()
    # The corrupt block's bytes were spooled to a temporary file: removed, and never given the block's name.
    kept = {p.name for p in (tmp_path / ".out.partial" / "blocks").iterdir()}
    assert block.id not in kept and not [n for n in kept if n.startswith(".")], kept
    assert check(s3_url, storage_options=opts).ok  # sizes are right: only reading the data shows it
    report = check(s3_url, read_data=True, storage_options=opts)
    assert not report.ok and block.id[:16] in report.problems[0]
    remote = open_delta(s3_url, storage_options=opts)
    with pytest.raises(IntegrityError):
        for item in remote.manifest.items:
            remote.decode(item)

    # A plain re-push trusts blocks that are there; --verify-remote reads them and replaces the corrupt one.
    assert push(d1, s3_url, storage_options=opts).uploaded_blocks == 0
    repaired = push(d1, s3_url, storage_options=opts, verify_remote=True)
    assert repaired.already_published and repaired.uploaded_blocks == 1
    assert check(s3_url, read_data=True, storage_options=opts).ok
    # A lost block is restored by a plain re-push.
    fs.rm_file(path)
    assert check(s3_url, storage_options=opts).problems
    with pytest.raises(IntegrityError, match="missing from the store"):
        pull(s3_url, tmp_path / "out", storage_options=opts)
    assert push(d1, s3_url, storage_options=opts).uploaded_blocks == 1
    assert pull(s3_url, tmp_path / "out", storage_options=opts).version == "v1"
    assert Delta.open(tmp_path / "out").id == Delta.open(d1).id


def test_labels_are_validated(tmp_path: Path, deltas: tuple[list[Path], list[Path]]) -> None:
    url = str(tmp_path / "store")
    _, (d1, *_) = deltas
    push(d1, url)
    for bad in ("../v1", "a/b", "", ".hidden", "x" * 200):
        with pytest.raises(DcrError, match="not a valid label"):
            acknowledge(url, "v1", bad)
    with pytest.raises(DcrError, match="not a valid label"):
        pull(url, tmp_path / "o", version="../../etc")


def test_racing_pushes_meet_at_the_create_only_record(s3_endpoint: S3Endpoint, s3_url: str, tmp_path: Path) -> None:
    """Both pushers pass every earlier check; they meet at the record's create-only write, and one loses."""
    from safetensors.numpy import load_file
    from store_fixtures import step, write_checkpoint

    from dcr_cli.produce import diff
    from dcr_cli.store.transfer import split_roles

    ckpts, (d1,) = make_deltas(tmp_path, 1)
    rival = write_checkpoint(tmp_path / "rival", step(load_file(str(ckpts[0] / "model.safetensors")), 5))
    diff(ckpts[0], rival, tmp_path / "rival-d1", base_version="v0", target_version="v1", workers=1)
    candidates = [d1, tmp_path / "rival-d1"]
    barrier = threading.Barrier(2, timeout=60)
    outcomes: dict[int, object] = {}

    def pusher(i: int) -> None:
        delta = Delta.open(candidates[i])
        data_blocks, _repair_blocks = split_roles(delta.manifest)  # repair blocks go up after publication
        total = sum(b.size for b in data_blocks)
        done = [0]
        waited = [False]
        lock = threading.Lock()

        def progress(n: int) -> None:  # the last data upload waits for the rival's: both then publish at once
            with lock:
                done[0] += n
                last = done[0] == total and not waited[0]
                waited[0] = waited[0] or last
            if last:
                barrier.wait()

        try:
            outcomes[i] = push(candidates[i], s3_url, storage_options=s3_endpoint.storage_options, progress=progress)
        except ConflictError as exc:
            outcomes[i] = exc

    threads = [threading.Thread(target=pusher, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    errors = [o for o in outcomes.values() if isinstance(o, ConflictError)]
    assert len(errors) == 1 and "lost the race" in str(errors[0])
    winner = next(i for i, o in outcomes.items() if not isinstance(o, ConflictError))
    assert (
        Store(s3_url, s3_endpoint.storage_options).require_version("v1").manifest == Delta.open(candidates[winner]).id
    )


def test_hint_and_records_are_not_trusted_blindly(deltas: tuple[list[Path], list[Path]], tmp_path: Path) -> None:
    from dcr_cli.errors import FormatError

    _, ds = deltas
    url = str(tmp_path / "store")
    _publish_chain(url, ds[:2])
    store = Store(url)
    store.put("latest.json", b'{"version": "v1", "fingerprint": "0"}')  # stale hint
    state = status(url)
    assert state["head"]["version"] == "v2" and state["latest_hint_stale"]
    store.put("latest.json", b"garbage")
    assert status(url)["head"]["version"] == "v2"

    record = store.require_version("v2")
    store.put(f"manifests/{record.manifest}.json", b"{}")  # tampered manifest
    with pytest.raises(IntegrityError, match="corrupt"):
        pull(url, tmp_path / "out", version="v2")
    assert not (tmp_path / "out").exists()

    marker = store.read("dcr-store.json").replace(b'"format_version": [\n  1,', b'"format_version": [\n  2,')
    assert marker != store.read("dcr-store.json")
    store.put("dcr-store.json", marker)
    with pytest.raises(FormatError, match="upgrade dcr"):
        status(url)


def test_genesis_label_cannot_be_reused_and_a_looping_chain_fails_instead_of_hanging(tmp_path: Path) -> None:
    """commits/<genesis>.json naming a version labelled like the genesis made every head walk loop forever."""
    import json

    from dcr_cli.produce import diff

    ckpts, (d1, _) = make_deltas(tmp_path / "a", 2)
    url = str(tmp_path / "store")
    _publish_chain(url, [d1])
    diff(ckpts[1], ckpts[2], tmp_path / "again-v0", base_version="v1", target_version="v0", workers=1)
    with pytest.raises(ConflictError, match="genesis"):
        push(tmp_path / "again-v0", url)

    # A store damaged into a loop (commits/v1.json naming "v0" back): a walk must fail, not spin.
    first = json.loads((tmp_path / "store" / "commits" / "v0.json").read_text())
    looping = {**first, "version": "v0", "base": first["target"], "target": first["base"]}
    (tmp_path / "store" / "commits" / "v1.json").write_text(json.dumps(looping))
    outcome: list[BaseException | dict] = []

    def walk() -> None:
        try:
            outcome.append(status(url))
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=walk, daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), "dcr status loops on a looping commit chain"
    assert isinstance(outcome[0], DcrError) and "loops" in str(outcome[0])


def test_base_label_that_is_a_path_cannot_escape_the_store(tmp_path: Path) -> None:
    """The genesis label names commits/<label>.json and children/<label>/: it was never checked."""
    import json

    from store_fixtures import base_tensors, step, write_checkpoint

    from dcr_cli.produce import diff

    c0 = write_checkpoint(tmp_path / "c0", base_tensors(0, 256))
    c1 = write_checkpoint(tmp_path / "c1", step(base_tensors(0, 256), 1))
    diff(c0, c1, tmp_path / "d", base_version="../../evil", target_version="v1", workers=1)
    url = str(tmp_path / "sub" / "store")
    with pytest.raises(DcrError, match="not a valid label"):
        push(tmp_path / "d", url)
    assert not (tmp_path / "evil").exists() and not (tmp_path / "sub" / "evil").exists()
    assert not (tmp_path / "sub" / "store" / "dcr-store.json").exists()

    # A marker damaged (or written by another tool) with such a label is refused when read.
    (tmp_path / "sub" / "store").mkdir(parents=True, exist_ok=True)
    marker = {
        "format": "dcr.store",
        "format_version": [1, 0],
        "genesis": {"version": "../../evil", "fingerprint": "0" * 64},
    }
    (tmp_path / "sub" / "store" / "dcr-store.json").write_text(json.dumps(marker))
    with pytest.raises(DcrError, match="not a valid label"):
        status(url)


def test_gc_running_longer_than_its_grace_period_keeps_what_a_push_published_meanwhile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gc computed its live set once: a push publishing during a gc longer than the grace period lost blocks.

    v1: A->B and v3: A->B share their blocks; v2: B->A drops v1 at gc --keep 1. v3 is pushed (refreshing
    v1's old blocks) after gc listed the blocks, and gc then runs on past the grace period.
    """
    import os
    import time

    from store_fixtures import flip_chain

    from dcr_cli.store import repo

    ds = flip_chain(tmp_path)
    url = str(tmp_path / "store")
    _publish_chain(url, ds[:2])
    grace = 2.0
    long_ago = time.time() - 7200
    for block in (tmp_path / "store" / "blocks").iterdir():
        os.utime(block, (long_ago, long_ago))

    listing = repo.Store.list
    pushed: list[str] = []

    def list_then_push_then_wait(self: repo.Store, rel_dir: str) -> list[repo.Listing]:
        entries = listing(self, rel_dir)
        if rel_dir == repo.BLOCKS and not pushed:
            pushed.append(push(ds[2], url).version)  # refreshes the old blocks it reuses...
            time.sleep(grace + 1)  # ...and gc goes on for longer than its grace period
        return entries

    monkeypatch.setattr(repo.Store, "list", list_then_push_then_wait)
    result = gc(url, keep=1, grace_s=grace)
    monkeypatch.undo()
    assert pushed == ["v3"]
    v3_blocks = {b.id for b in Delta.open(ds[2]).manifest.blocks}
    assert v3_blocks <= {p.name for p in (tmp_path / "store" / "blocks").iterdir()}
    live_blocks = {b.id for b in Delta.open(ds[1]).manifest.blocks} | v3_blocks
    assert result.removed_blocks == 0 and result.kept_blocks == len(live_blocks)  # v1's own blocks are v3's
    assert check(url, read_data=True).ok


def test_a_push_asks_only_about_its_own_blocks(
    tmp_path: Path, deltas: tuple[list[Path], list[Path]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every push listed all of blocks/ two or three times: its cost grew with the store."""
    from dcr_cli.store.streaming import BlockUploader

    _, (d1, *_) = deltas
    url = str(tmp_path / "store")
    store = Store(url)
    for i in range(50):  # other versions' blocks
        store.put(f"blocks/{i:064x}", b"x")
    listed, asked = count_store_questions(monkeypatch)
    result = push(d1, url)
    blocks = {b.id for b in Delta.open(d1).manifest.blocks}
    assert "blocks" not in listed and result.uploaded_blocks == len(blocks)
    assert sorted(asked) == sorted(f"blocks/{b}" for b in blocks for _ in range(2))  # before and after upload
    asked.clear()
    uploader = BlockUploader(url)  # dcr diff --push: every block already there is asked about, once
    written = Delta.open(d1).manifest.blocks
    for block in written:
        uploader(block.id, (d1 / "blocks" / block.id).read_bytes())
    uploader.wait()
    assert "blocks" not in listed and uploader.uploaded_blocks == 0 and len(asked) == len(written)


def test_store_modules_are_not_shadowed_by_api_names() -> None:
    """`import dcr_cli.store.gc` yielded a function: no name the package exports is one of its modules."""
    import importlib
    import pkgutil
    import types

    import dcr_cli
    import dcr_cli.store as package

    modules = {m.name for m in pkgutil.iter_modules(package.__path__)}
    assert {"backends", "repo", "transfer", "ledger", "collect", "audit"} <= modules
    assert not modules & set(package.__all__)
    for name in modules:
        assert isinstance(importlib.import_module(f"dcr_cli.store.{name}"), types.ModuleType)
    for name in ("push", "pull", "pull_since", "commit", "acknowledge", "status", "log", "gc", "check", "open_delta"):
        assert callable(getattr(dcr_cli, name)) and getattr(dcr_cli, name) is getattr(package, name)


def test_push_takes_the_uploaders_blocks_as_present_but_checks_them_before_the_record(
    tmp_path: Path, deltas: tuple[list[Path], list[Path]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """dcr diff --push: push(fresh=...) does not ask again about the blocks its uploader just wrote, except in
    the check just before the record (so a block that vanished meanwhile still stops the publication)."""
    from dcr_cli.store import repo
    from dcr_cli.store.streaming import BlockUploader
    from dcr_cli.store.transfer import split_roles

    _, (d1, *_) = deltas
    manifest = Delta.open(d1).manifest
    data, repair = split_roles(manifest)
    for url in (str(tmp_path / "store"), str(tmp_path / "gone")):
        uploader = BlockUploader(url)
        for block in data:
            uploader(block.id, (d1 / "blocks" / block.id).read_bytes())
        uploader.wait()
        assert uploader.uploaded == {b.id: b.size for b in data}
    asked: list[str] = []
    stat = repo.Store.stat

    def counting_stat(self: repo.Store, rel: str) -> repo.Listing | None:
        asked.append(rel)
        return stat(self, rel)

    monkeypatch.setattr(repo.Store, "stat", counting_stat)
    result = push(d1, str(tmp_path / "store"), fresh=uploader.uploaded)
    assert result.uploaded_blocks == len(repair) and not result.already_published
    data_asked = [a for a in asked if a.removeprefix("blocks/") in {b.id for b in data}]
    assert sorted(data_asked) == sorted(f"blocks/{b.id}" for b in data)  # once each: before the record
    Store(str(tmp_path / "gone")).delete(f"blocks/{data[0].id}")  # a gc between the upload and the push
    with pytest.raises(ConflictError, match="vanished during the push"):
        push(d1, str(tmp_path / "gone"), fresh=uploader.uploaded)
    assert Store(str(tmp_path / "gone")).version("v1") is None


def test_push_verify_remote_writes_a_damaged_manifest_again(
    tmp_path: Path, deltas: tuple[list[Path], list[Path]], dcr
) -> None:
    """A published version whose manifest the store damaged: a plain re-push leaves it (it is there), the
    re-push with --verify-remote writes it again (review8: it said 'already published' and left it)."""
    _, (d1, *_) = deltas
    url = str(tmp_path / "store")
    push(d1, url)
    manifest = tmp_path / "store" / "manifests" / f"{Delta.open(d1).id}.json"
    good = manifest.read_bytes()
    manifest.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
    with pytest.raises(IntegrityError, match="corrupt"):
        open_delta(url, "v1")

    assert not push(d1, url).manifest_restored  # present: a plain re-push does not read it
    proc = dcr("push", str(d1), url, "--verify-remote", check=True)
    assert "wrote its damaged manifest again" in proc.stderr + proc.stdout
    assert manifest.read_bytes() == good
    assert open_delta(url, "v1").id == Delta.open(d1).id
    assert check(url, read_data=True).ok
