"""A shortcut *record* that does not parse (store-v1 §6.4) is derived data, as a shortcut whose manifest is
unusable: dcr gc drops it once every record has been read and says so (advice: dcr compact), a receiver's
route leaves it out, dcr check reports it as damage, dcr compact refuses to publish where it lies until gc
dropped it; a read error that asking again might not meet still stops gc before it removes anything.
Before, one such record stopped dcr gc (exit 2, nothing collected, for good), every dcr apply --since and
every dcr compact."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from helpers_checkpoints import copy_checkpoint, read_raw
from store_fixtures import S3Endpoint, commit_each, gc_stops_on_reset_reads, make_deltas, one_error_line, run_dcr

from dcr_cli.format.manifest import parse_manifest
from dcr_cli.store import Store, check, gc
from dcr_cli.store.keyframes import compact, plan, publish_keyframe, shortcuts

DAMAGED = b'{"format": "dcr.store.shortcut", "format_version": [1, 1], "vers'  # a record cut short


def _store(tmp: Path, url: str, opts: dict[str, Any], every: int = 2) -> list[Path]:
    """v1..v4 committed, a keyframe at v1 and its shortcuts every ``every`` versions; the checkpoints."""
    ckpts, deltas = make_deltas(tmp, 4)
    commit_each(url, deltas, storage_options=opts)
    publish_keyframe(url, ckpts[1], version="v1", storage_options=opts)
    compact(url, every=every, storage_options=opts)
    return ckpts


def _objects(store: Store) -> dict[str, int]:
    return {p: int(info["size"]) for p, info in store.fs.find(store.root, detail=True).items()}


@pytest.mark.parametrize("store_url", ["local", "s3"], indirect=True)
def test_gc_drops_a_damaged_shortcut_record_and_check_reports_it(
    store_url: tuple[str, dict[str, Any], dict[str, str] | None], tmp_path: Path
) -> None:
    url, opts, env = store_url
    ckpts = _store(tmp_path, url, opts)
    store = Store(url, opts)
    needs = {b.id: b.size for r in store.versions().values() for b in parse_manifest(store.manifest_bytes(r)).blocks}
    rel = "shortcuts/v1/v3.json"
    store.put(rel, DAMAGED)

    # dcr check: damage, with what to do.
    proc = run_dcr("check", url, env=env)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    (problem,) = [line for line in proc.stderr.splitlines() if line.startswith("problem: ")]
    assert rel in problem and "damaged shortcut record" in problem, problem
    assert f"dcr gc {url} drops it" in problem and f"dcr compact {url} --every K" in problem, problem
    # A receiver catching up leaves it out (the path line says so) and takes the chain.
    route = plan(url, "v1", allow_keyframe=False, storage_options=opts)
    assert [s.kind for s in route.steps] == ["chain", "chain", "chain"]
    assert "skipped damaged shortcut record v1..v3 (see dcr check)" in route.describe()
    recv = copy_checkpoint(ckpts[1], tmp_path / "recv")
    assert run_dcr("apply", url, "--since", "v1", "--into", str(recv), env=env).returncode == 0
    assert read_raw(recv) == read_raw(ckpts[4])
    # dcr compact would publish there: refused before it writes anything, pointing at dcr gc.
    before = _objects(store)
    line = one_error_line(run_dcr("compact", url, "--every", "2", env=env))
    assert "damaged shortcut record" in line and f"dcr gc {url} drops {rel}" in line, line
    assert _objects(store) == before

    # dcr gc --dry-run says it would drop it and removes nothing; dcr gc drops it and collects the rest.
    dry = run_dcr("gc", url, "--keep", "4", "--grace", "0", "--dry-run", env=env)
    assert dry.returncode == 0 and "would drop shortcut v1..v3, as its record is damaged" in dry.stdout, dry.stderr
    assert _objects(store) == before
    proc = run_dcr("gc", url, "--keep", "4", "--grace", "0", env=env)
    assert proc.returncode == 0, proc.stderr  # was: exit 2, nothing collected
    assert "dropped shortcut v1..v3, as its record is damaged" in proc.stdout, proc.stdout
    assert f"dcr compact {url} --every K publishes it again" in proc.stdout
    assert not store.exists(rel)
    for block_id, size in needs.items():
        assert store.size(f"blocks/{block_id}") == size, block_id[:16]
    assert check(url, storage_options=opts).ok

    # compact publishes it anew and a lagging receiver takes it to v4's bits.
    assert compact(url, every=2, storage_options=opts).published == ["v1..v3"]
    recv = copy_checkpoint(ckpts[1], tmp_path / "recv2")
    proc = run_dcr("apply", url, "--since", "v1", "--into", str(recv), env=env)
    assert proc.returncode == 0 and "shortcut v1..v3" in proc.stdout, proc.stderr
    assert read_raw(recv) == read_raw(ckpts[4])


def test_gc_stops_on_a_transient_read_of_a_shortcut_record_before_dropping_a_damaged_one(
    s3_endpoint: S3Endpoint, s3_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    opts = s3_endpoint.storage_options
    _store(tmp_path, s3_url, opts, every=1)  # shortcuts v1..v2, v1..v3, v1..v4
    store = Store(s3_url, opts)
    store.put("shortcuts/v1/v2.json", DAMAGED)
    before = _objects(store)

    key = f"{s3_url.removeprefix('s3://')}/shortcuts/v1/v3.json"
    proxy = gc_stops_on_reset_reads(s3_endpoint, s3_url, key, monkeypatch, keep=1, grace_s=0)
    assert proxy.reset >= 2
    assert _objects(store) == before  # nothing removed: not the damaged record either
    result = gc(s3_url, keep=4, grace_s=0, storage_options=opts)
    assert list(result.dropped_shortcuts) == ["v1..v2"]
    assert sorted(s.record.version for s in shortcuts(store)) == ["v3", "v4"]


def test_a_record_of_major_0_is_damage_and_only_a_newer_major_asks_for_an_upgrade(tmp_path: Path) -> None:
    """Before, any major other than this dcr's (a flipped bit: 0) was taken for a newer dcr's record: gc
    stopped for good, and every receiver was told to upgrade."""
    url = str(tmp_path / "store")
    _store(tmp_path, url, {})
    store = Store(url)
    rel = "shortcuts/v1/v3.json"

    def with_major(major: int) -> bytes:
        record = json.loads(store.read(rel))
        record["format_version"][0] = major
        return json.dumps(record).encode()

    store.put(rel, with_major(0))
    proc = run_dcr("gc", url, "--keep", "4", "--grace", "0")
    assert proc.returncode == 0 and "dropped shortcut v1..v3, as its record is damaged" in proc.stdout, proc.stderr
    compact(url, every=2)  # published again
    store.put(rel, with_major(2))
    line = one_error_line(run_dcr("gc", url, "--keep", "4", "--grace", "0"))
    assert "newer" in line or "upgrade" in line, line
    assert store.exists(rel)


def test_a_record_that_is_another_shortcuts_is_damage_before_compact_squashes(tmp_path: Path) -> None:
    """A record copied over another's path (shortcuts/v1/v3.json holding v3..v5's): before, every dcr compact
    squashed and uploaded, then failed blaming "another writer", and gc never dropped it."""
    url = str(tmp_path / "store")
    _store(tmp_path, url, {})
    store = Store(url)
    rel = "shortcuts/v1/v3.json"
    record = json.loads(store.read(rel))
    record["base"]["version"], record["version"] = "v0", "v2"
    store.put(rel, json.dumps(record).encode())
    before = _objects(store)
    line = one_error_line(run_dcr("compact", url, "--every", "2"))
    assert "damaged shortcut record" in line and "of shortcut v0..v2" in line, line
    assert _objects(store) == before  # refused before the squash: nothing uploaded
    proc = run_dcr("gc", url, "--keep", "4", "--grace", "0")
    assert proc.returncode == 0 and "dropped shortcut v1..v3, as its record is damaged" in proc.stdout, proc.stderr
