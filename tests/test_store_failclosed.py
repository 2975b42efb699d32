"""Fail-closed corners of the store: a torn apply before the repair blocks are up (exit 4, not 2), keyframes
published atomically and found without listing the store, gc against a shortcut published while it runs.

Real parts: the local store and moto's S3 server (tests/store_fixtures.py), the real CLI for exit codes.
"""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

import pytest
from helpers_checkpoints import copy_checkpoint, read_raw
from store_fixtures import (
    S3Endpoint,
    count_store_questions,
    delta_to_tear,
    gc_stops_on_reset_reads,
    half_writes_then_eio,
    make_deltas,
    one_error_line,
    run_dcr,
    tear_from_store,
)

from dcr_cli.api import apply
from dcr_cli.delta.reader import Delta
from dcr_cli.format.manifest import parse_manifest
from dcr_cli.store import Store, acknowledge, check, commit, gc, keyframes, push, repo
from dcr_cli.store.keyframes import compact, join, open_plan, plan, publish_keyframe, shortcuts
from dcr_cli.store.transfer import PushResult, split_roles

# -- 1. a torn apply before the repair blocks are up ------------------------------------------------------------------


@pytest.mark.parametrize("store_url", ["local", "s3"], indirect=True)
def test_a_torn_apply_before_the_repair_upload_is_not_ready_and_after_a_loss_is_damage(
    store_url: tuple[str, dict[str, Any], dict[str, str] | None], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, opts, env = store_url
    delta, repair_blocks, torn = delta_to_tear(tmp_path)
    refused: list[Any] = []

    def published(_: PushResult) -> None:
        # The version is visible, its repair blocks are not up yet (the push uploads them next).
        store = Store(url, opts)
        assert not any(store.exists(f"blocks/{b.id}") for b in repair_blocks)
        assert not store.exists("complete/v1")
        tear_from_store(torn, url, opts, monkeypatch)
        before = read_raw(torn)
        refused.append(run_dcr("apply", url, "--version", "v1", "--into", str(torn), env=env))
        assert read_raw(torn) == before  # nothing written

    push(delta, url, storage_options=opts, on_published=published)
    (proc,) = refused
    line = one_error_line(proc)
    assert proc.returncode == 4, proc.stderr  # not ready: retry once the push has finished
    assert "torn" in line and "does not have it yet" in line and "re-run dcr push DELTA" in line

    # The push finished: the same apply now repairs the torn item and reaches v1 bit-exactly.
    result = apply(url, into=torn, version="v1", storage_options=opts)
    assert result.steps[0].repaired >= 1 and read_raw(torn) == read_raw(tmp_path / "big-c1")

    # A repair block lost after the push marked v1 complete: damage (exit 2), with the advice to restore it.
    store = Store(url, opts)
    assert store.exists("complete/v1")
    torn2 = copy_checkpoint(tmp_path / "big-c0", tmp_path / "torn2")
    tear_from_store(torn2, url, opts, monkeypatch)
    for b in repair_blocks:
        store.delete(f"blocks/{b.id}")
    before = read_raw(torn2)
    lost = run_dcr("apply", url, "--version", "v1", "--into", str(torn2), env=env)
    line = one_error_line(lost)
    assert lost.returncode == 2 and "lost it" in line and f"restore it with dcr push DELTA {url}" in line
    assert "compact" not in line, line  # the fix for a version only (was: "(or dcr compact for a shortcut)")
    assert read_raw(torn2) == before

    # The same block absent from a version without complete/v1 is pending again (exit 4).
    store.delete("complete/v1")
    again = run_dcr("apply", url, "--version", "v1", "--into", str(torn2), env=env)
    assert again.returncode == 4 and "does not have it yet" in one_error_line(again)
    assert read_raw(torn2) == before

    push(delta, url, storage_options=opts)  # restores the repair blocks and complete/v1
    assert apply(url, into=torn2, version="v1", storage_options=opts).steps[0].repaired >= 1
    assert read_raw(torn2) == read_raw(tmp_path / "big-c1")


# -- 2. keyframes: atomic, and shortcuts that ask only about their own blocks ------------------------------------------


def _committed_store(tmp: Path, url: str, opts: dict[str, Any], steps: int = 4) -> tuple[list[Path], list[Path]]:
    """Checkpoints c0..cN, deltas d1..dN, each pushed, acknowledged and committed on ``url``."""
    ckpts, deltas = make_deltas(tmp, steps)
    for i, d in enumerate(deltas, start=1):
        push(d, url, storage_options=opts)
        acknowledge(url, f"v{i}", "r", storage_options=opts)
        commit(url, f"v{i}", receivers=["r"], storage_options=opts)
    return ckpts, deltas


def _store_with_keyframe(tmp: Path) -> tuple[str, list[Path]]:
    """A local store committed up to v4, with a keyframe at v0 (what compact builds shortcuts from)."""
    url = str(tmp / "store")
    ckpts, _deltas = _committed_store(tmp, url, {})
    publish_keyframe(url, ckpts[0], version="v0")
    return url, ckpts


def test_compact_asks_about_its_own_blocks_and_never_lists_the_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """_upload_delta listed every block of the store (twice): a shortcut's cost grew with the store."""
    url = str(tmp_path / "store")
    ckpts, deltas = _committed_store(tmp_path, url, {})
    store = Store(url)
    for i in range(50):  # other objects under blocks/
        store.put(f"blocks/{i:064x}", b"x")
    publish_keyframe(url, ckpts[0], version="v0")
    listed, asked = count_store_questions(monkeypatch)
    result = compact(url, every=2)
    monkeypatch.undo()
    assert result.published == ["v0..v2", "v0..v4"]
    assert "blocks" not in listed
    needed = {f"blocks/{b.id}" for s in shortcuts(store) for b in parse_manifest(store.manifest_bytes(s.record)).blocks}
    squashed = {f"blocks/{b.id}" for d in deltas for b in Delta.open(d).manifest.blocks}
    asked_blocks = {a for a in asked if a.startswith("blocks/")}
    assert needed <= asked_blocks <= needed | squashed  # its own blocks, and the repair check of the squashed ones
    # Each of a shortcut's blocks is asked about before its upload and again before the record.
    for block in needed:
        assert asked.count(block) >= 2
    assert compact(url, every=2).present == result.published


def _second_copy(ckpt: Path, dst: Path) -> Path:
    """The same state (same tensors, same fingerprint) in different files: other config bytes."""
    out = copy_checkpoint(ckpt, dst)
    (out / "config.json").write_text('{"copy": "second", "padding": "' + "x" * 100 + '"}\n')
    return out


@pytest.mark.parametrize("store_url", ["local", "s3"], indirect=True)
def test_racing_keyframe_publishers_never_leave_a_keyframe_that_does_not_match_its_record(
    store_url: tuple[str, dict[str, Any], dict[str, str] | None], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Publisher B has seen no record and uploads its files; meanwhile A publishes the keyframe whole (record
    included). B's files must not replace A's: a joiner picks A's record and must get exactly A's files."""
    url, opts, _env = store_url
    ckpts, _deltas = _committed_store(tmp_path, url, opts, steps=2)
    first = copy_checkpoint(ckpts[2], tmp_path / "first")
    (first / "config.json").write_text('{"copy": "first"}\n')
    second = _second_copy(ckpts[2], tmp_path / "second")
    real = repo.Store.read_record
    raced: list[Any] = []

    def read_record(self: repo.Store, rel: str, kind: str) -> dict[str, Any] | None:
        found = real(self, rel, kind)
        if rel == "keyframes/v2.json" and found is None and not raced:
            raced.append(None)
            raced.append(publish_keyframe(url, first, version="v2", storage_options=opts))  # A wins meanwhile
        return found

    monkeypatch.setattr(repo.Store, "read_record", read_record)
    frame_b = publish_keyframe(url, second, version="v2", storage_options=opts)
    monkeypatch.undo()
    joined = join(url, tmp_path / "joined", storage_options=opts)
    assert joined.version == "v2"
    assert read_raw(tmp_path / "joined") == read_raw(ckpts[2])
    assert (tmp_path / "joined" / "config.json").read_text() == '{"copy": "first"}\n'
    assert frame_b == raced[1]  # B lost the record's race and says so with the winner's record


def test_a_keyframe_publish_stopped_half_way_is_invisible_swept_by_gc_and_finished_by_a_rerun(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = str(tmp_path / "store")
    ckpts, _deltas = _committed_store(tmp_path, url, {}, steps=2)
    frame_dir = copy_checkpoint(ckpts[2], tmp_path / "frame")
    (frame_dir / "config.json").write_text('{"a": 1}\n')
    real = keyframes._upload_file
    calls: list[str] = []

    def crash_on_second(store: repo.Store, path: Path, rel: str, f: Any) -> None:
        calls.append(rel)
        if len(calls) == 2:
            raise OSError(errno.EIO, "killed mid-upload")
        real(store, path, rel, f)

    monkeypatch.setattr(keyframes, "_upload_file", crash_on_second)
    with pytest.raises(OSError):
        publish_keyframe(url, frame_dir, version="v2")
    monkeypatch.undo()
    store = Store(url)
    assert store.list("keyframes/v2") and not store.exists("keyframes/v2.json")
    assert keyframes.newest_keyframe(store) is None  # nothing a joiner could pick
    proc = run_dcr("pull", url, "--join", "-o", str(tmp_path / "nope"))
    assert proc.returncode == 2 and "no keyframe is published" in one_error_line(proc)
    assert not (tmp_path / "nope").exists()

    # gc leaves a young leftover alone (a publish may be running) and sweeps it once past the grace period.
    assert gc(url, keep=2).removed_keyframe_files == 0 and store.list("keyframes/v2")
    assert gc(url, keep=2, grace_s=0).removed_keyframe_files == 1 and not store.list("keyframes/v2")

    frame = publish_keyframe(url, frame_dir, version="v2")
    assert {f.object for f in frame.files} == {e.name for e in store.list("keyframes/v2")}
    assert gc(url, keep=2, grace_s=0).removed_keyframe_files == 0  # the record names them all
    join(url, tmp_path / "joined")
    assert read_raw(tmp_path / "joined") == read_raw(ckpts[2])


# -- 3. gc against a shortcut published while it runs ------------------------------------------------------------------


def test_gc_keeps_the_blocks_of_a_shortcut_published_while_it_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gc read the shortcuts once, at its start: a dcr compact publishing one meanwhile lost its blocks."""
    url, ckpts = _store_with_keyframe(tmp_path)
    listing = repo.Store.list
    compacted: list[Any] = []

    def list_then_compact(self: repo.Store, rel_dir: str) -> list[repo.Listing]:
        if rel_dir == repo.MANIFESTS and not compacted:  # gc decided what it keeps; a compact publishes now
            compacted.append(None)
            compacted.append(compact(url, every=2))
        return listing(self, rel_dir)

    monkeypatch.setattr(repo.Store, "list", list_then_compact)
    result = gc(url, keep=1, grace_s=0)  # no grace at all: only references protect the shortcut's blocks
    monkeypatch.undo()
    assert compacted[1].published == ["v0..v2", "v0..v4"]
    assert result.dropped_versions == ["v1", "v2", "v3"]
    store = Store(url)
    for s in shortcuts(store):
        for b in parse_manifest(store.manifest_bytes(s.record)).blocks:
            assert store.size(f"blocks/{b.id}") == b.size, f"{s.record.version}: block {b.id[:16]} removed"
    # A receiver at v0 catches up through the shortcut (v1..v3's deltas are gone).
    the_plan = plan(url, "v0", allow_keyframe=False)
    assert [(s.kind, s.base, s.target) for s in the_plan.steps] == [("shortcut", "v0", "v4")]
    recv = copy_checkpoint(ckpts[0], tmp_path / "recv")
    apply(open_plan(url, the_plan), into=recv, workers=1)
    assert read_raw(recv) == read_raw(ckpts[4])
    assert check(url).ok


def test_a_torn_apply_through_a_shortcut_lacking_a_repair_block_is_damage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shortcut's blocks, repair blocks included, all precede its record (§6.2): one absent is lost (exit 2)."""
    url, ckpts = _store_with_keyframe(tmp_path)
    assert compact(url, every=4).published == ["v0..v4"]
    the_plan = plan(url, "v0", allow_keyframe=False)
    assert [(s.kind, s.base, s.target) for s in the_plan.steps] == [("shortcut", "v0", "v4")]
    recv = copy_checkpoint(ckpts[0], tmp_path / "recv")
    half_writes_then_eio(monkeypatch)
    with pytest.raises(OSError):
        apply(open_plan(url, the_plan), into=recv, workers=1)
    monkeypatch.undo()
    store = Store(url)
    (shortcut,) = shortcuts(store)
    _data, repair = split_roles(parse_manifest(store.manifest_bytes(shortcut.record)))
    assert repair
    for b in repair:
        store.delete(f"blocks/{b.id}")
    before = read_raw(recv)
    proc = run_dcr("apply", url, "--since", "v0", "--into", str(recv))
    assert proc.returncode == 2, proc.stderr
    line = one_error_line(proc)
    assert "lost it although shortcut v0..v4 is complete" in line, line
    # dcr push cannot restore a shortcut, and dcr compact keeps one whose record is there: the record goes first.
    assert f"remove shortcuts/v0/v4.json from {url} and publish it anew with dcr compact {url} --every K" in line
    assert "dcr push" not in line, line
    assert read_raw(recv) == before


# -- 4. gc and a shortcut whose manifest is unusable ------------------------------------------------------------------


def _damage(path: Path, how: str) -> None:
    raw = path.read_bytes()
    if how == "corrupt":
        path.write_bytes(raw[:100] + bytes([raw[100] ^ 1]) + raw[101:])
    elif how == "truncated":
        path.write_bytes(raw[: len(raw) // 2])
    else:
        path.unlink()


def _objects(store: Store) -> set[str]:
    """Every object of a store (name and size), to tell that nothing was removed."""
    return {f"{p}:{info['size']}" for p, info in store.fs.find(store.root, detail=True).items()}


@pytest.mark.parametrize("how", ["corrupt", "truncated", "missing"])
def test_gc_drops_a_shortcut_whose_manifest_is_unusable_and_keeps_everything_else(tmp_path: Path, how: str) -> None:
    """gc stopped on a shortcut whose manifest failed its digest (and kept a record naming a missing one for
    ever, which also made every later dcr compact fail): derived data that blocked collecting the store."""
    url, ckpts = _store_with_keyframe(tmp_path)
    assert compact(url, every=2).published == ["v0..v2", "v0..v4"]
    store = Store(url)
    bad, sound = sorted(shortcuts(store), key=lambda s: s.record.version)
    _damage(tmp_path / "store" / "manifests" / f"{bad.record.manifest}.json", how)
    needs = {
        b.id: b.size
        for r in [*store.versions().values(), sound.record]
        for b in parse_manifest(store.manifest_bytes(r)).blocks
    }

    proc = run_dcr("gc", url, "--keep", "4", "--grace", "0")
    assert proc.returncode == 0, proc.stderr  # was: exit 2 on a corrupt or truncated manifest
    why = "missing" if how == "missing" else "corrupt"
    assert f"dropped shortcut v0..v2, as its manifest is {why}" in proc.stdout
    assert f"dcr compact {url} --every K" in proc.stdout
    assert not store.exists("shortcuts/v0/v2.json")  # was: kept, naming a manifest nobody can read
    assert store.exists("shortcuts/v0/v4.json")
    for block_id, size in needs.items():  # every version's and the sound shortcut's blocks
        assert store.size(f"blocks/{block_id}") == size, block_id[:16]
    assert not store.exists(f"manifests/{bad.record.manifest}.json")  # unreferenced now: swept
    assert check(url).ok

    # compact publishes it again, sound (it failed on the old record), and a receiver can take it.
    result = compact(url, every=2)
    assert (result.published, result.present) == (["v0..v2"], ["v0..v4"])
    the_plan = plan(url, "v0", until="v2", allow_keyframe=False)
    assert [(s.kind, s.base, s.target) for s in the_plan.steps] == [("shortcut", "v0", "v2")]
    recv = copy_checkpoint(ckpts[0], tmp_path / "recv")
    apply(open_plan(url, the_plan), into=recv, workers=1)
    assert read_raw(recv) == read_raw(ckpts[2])


def test_gc_dry_run_says_which_shortcut_it_would_drop_and_drops_nothing(tmp_path: Path) -> None:
    url, _ckpts = _store_with_keyframe(tmp_path)
    compact(url, every=2)
    store = Store(url)
    bad = next(s for s in shortcuts(store) if s.record.version == "v2")
    _damage(tmp_path / "store" / "manifests" / f"{bad.record.manifest}.json", "corrupt")
    before = _objects(store)
    result = gc(url, keep=1, grace_s=0, dry_run=True)
    assert list(result.dropped_shortcuts) == ["v0..v2"]
    assert _objects(store) == before


def test_gc_stops_on_a_transient_error_before_dropping_anything(
    s3_endpoint: S3Endpoint, s3_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shortcut is dropped only on an answer that asking again cannot change, and only once every record
    has been read: here one shortcut's manifest is corrupt and reading the other's keeps failing."""
    opts = s3_endpoint.storage_options
    ckpts, _deltas = _committed_store(tmp_path, s3_url, opts)
    publish_keyframe(s3_url, ckpts[0], version="v0", storage_options=opts)
    compact(s3_url, every=2, storage_options=opts)
    store = Store(s3_url, opts)
    bad, flaky = sorted(shortcuts(store), key=lambda s: s.record.version)
    raw = store.read(f"manifests/{bad.record.manifest}.json")
    store.put(f"manifests/{bad.record.manifest}.json", raw[:-1])  # truncated: unusable
    before = _objects(store)

    key = f"{s3_url.removeprefix('s3://')}/manifests/{flaky.record.manifest}.json"
    proxy = gc_stops_on_reset_reads(s3_endpoint, s3_url, key, monkeypatch, keep=1, grace_s=0)
    assert proxy.reset >= 2
    assert _objects(store) == before  # nothing removed: not the corrupt shortcut either
    # Asked again once the fault is gone, gc drops the corrupt shortcut and keeps the sound one's blocks.
    result = gc(s3_url, keep=1, grace_s=0, storage_options=opts)
    assert list(result.dropped_shortcuts) == ["v0..v2"]
    for b in parse_manifest(store.manifest_bytes(flaky.record)).blocks:
        assert store.size(f"blocks/{b.id}") == b.size
