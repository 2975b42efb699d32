"""Shortcuts on a store are routes between committed states (store-v1 §6.2, §6.3), matched by fingerprint:
a record that names committed labels but other states is no route for a lagging receiver (before, the path
choice matched labels only: a receiver took such a shortcut and ended "at" the target label holding other
bits, exit 0). The ``path:`` line quotes the plain chain's cost only while that chain reaches the target."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from helpers_checkpoints import copy_checkpoint, read_raw
from safetensors.numpy import load_file
from store_fixtures import commit_each, make_deltas, one_error_line, run_dcr, write_checkpoint

import dcr_cli
from dcr_cli.delta.reader import Delta
from dcr_cli.errors import IntegrityError
from dcr_cli.format.digest import digest_bytes
from dcr_cli.format.manifest import BlockEntry, parse_manifest
from dcr_cli.produce import diff
from dcr_cli.store import Store, check, gc
from dcr_cli.store.keyframes import compact, plan, publish_keyframe, shortcuts
from dcr_cli.store.repo import dumps


def _committed_store(tmp: Path, steps: int = 4) -> tuple[str, list[Path]]:
    """A local store with v1..v<steps> committed, a keyframe at v1 and the shortcut v1 -> v3."""
    ckpts, deltas = make_deltas(tmp, steps)
    url = str(tmp / "store")
    commit_each(url, deltas)
    publish_keyframe(url, ckpts[1], version="v1")
    assert compact(url, every=2).published == ["v1..v3"]
    return url, ckpts


def _plant_shortcut(tmp: Path, url: str, base: Path, label_base: str, label_target: str) -> dict[str, str]:
    """Store a delta from checkpoint ``base`` to bits no version holds (labelled base -> target) as a shortcut
    record cheaper than any route, as a damaged or hostile store could hold it; returns the record's target."""
    tensors = {name: t.copy() for name, t in load_file(str(base / "model.safetensors")).items()}
    tensors["norm.weight"] = (tensors["norm.weight"] * 2).astype(np.float16)
    out = tmp / f"planted-{label_base}-{label_target}"
    diff(base, write_checkpoint(tmp / f"{out.name}-ckpt", tensors), out, base_version=label_base,
         target_version=label_target, workers=1)  # fmt: skip
    store = Path(url)
    raw = (out / "manifest.json").read_bytes()
    (store / "manifests" / f"{digest_bytes(raw)}.json").write_bytes(raw)
    for block in (out / "blocks").iterdir():
        shutil.copyfile(block, store / "blocks" / block.name)
    manifest = Delta.open(out).manifest
    target = {"version": label_target, "fingerprint": manifest.target.fingerprint}
    base_ref = {"version": label_base, "fingerprint": manifest.base.fingerprint}
    record = json.loads((store / "shortcuts" / "v1" / "v3.json").read_text())
    record.update(version=label_target, base=base_ref, target=target, manifest=digest_bytes(raw),
                  manifest_bytes=len(raw), payload_bytes=1, chain=[])  # fmt: skip
    (store / "shortcuts" / label_base).mkdir(exist_ok=True)
    (store / "shortcuts" / label_base / f"{label_target}.json").write_bytes(dumps(record))
    return target


def test_a_shortcut_to_another_state_under_a_committed_label_is_no_route(tmp_path: Path) -> None:
    url, ckpts = _committed_store(tmp_path)
    target = _plant_shortcut(tmp_path, url, ckpts[1], "v1", "v4")
    assert target["fingerprint"] != Delta.open(tmp_path / "d4").manifest.target.fingerprint

    chosen = plan(url, "v1", allow_keyframe=False)
    assert [(s.kind, s.base, s.target) for s in chosen.steps] == [("shortcut", "v1", "v3"), ("chain", "v3", "v4")]

    # The command a lagging receiver runs: it reaches committed v4's bits, not the planted state.
    recv = copy_checkpoint(ckpts[1], tmp_path / "recv")
    proc = run_dcr("apply", url, "--since", "v1", "--into", str(recv))
    assert proc.returncode == 0, proc.stderr
    assert "shortcut v1..v4" not in proc.stdout
    assert read_raw(recv) == read_raw(ckpts[4])
    # pull --since fetches the same route.
    proc = run_dcr("pull", url, "--since", "v1", "-o", str(tmp_path / "pulled"))
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in (tmp_path / "pulled").iterdir()) == ["shortcut-v1-v3", "v4"]


def test_a_shortcut_from_another_state_under_a_committed_label_is_no_route(tmp_path: Path) -> None:
    url, ckpts = _committed_store(tmp_path)
    # Labelled v2 -> v4 but built on c1's bits: its base is no committed state.
    _plant_shortcut(tmp_path, url, ckpts[1], "v2", "v4")
    record = json.loads((Path(url) / "shortcuts" / "v2" / "v4.json").read_text())
    record["target"] = {"version": "v4", "fingerprint": Delta.open(tmp_path / "d4").manifest.target.fingerprint}
    (Path(url) / "shortcuts" / "v2" / "v4.json").write_bytes(dumps(record))
    chosen = plan(url, "v2", allow_keyframe=False)
    assert [(s.kind, s.base, s.target) for s in chosen.steps] == [("chain", "v2", "v3"), ("chain", "v3", "v4")]
    recv = copy_checkpoint(ckpts[2], tmp_path / "recv")  # a receiver at v2 is not stuck behind the record
    proc = run_dcr("apply", url, "--since", "v2", "--into", str(recv))
    assert proc.returncode == 0, proc.stderr
    assert read_raw(recv) == read_raw(ckpts[4])


def test_the_path_line_quotes_no_chain_that_gc_broke(tmp_path: Path) -> None:
    url, ckpts = _committed_store(tmp_path)
    intact = plan(url, "v1", allow_keyframe=False)
    assert intact.chain_bytes is not None and "; chain " in intact.describe()
    gc(url, keep=1, grace_s=0)  # v1..v3's deltas go; v4's stays; the keyframe v1 and its shortcut stay
    broken = plan(url, "v1", allow_keyframe=False)
    assert [(s.kind, s.base, s.target) for s in broken.steps] == [("shortcut", "v1", "v3"), ("chain", "v3", "v4")]
    assert broken.chain_bytes is None
    assert "no plain chain (deltas removed by gc)" in broken.describe()
    # From v0 only the keyframe route is left; the line must not quote v4's delta as "the chain".
    line = plan(url, "v0").describe()
    assert line.startswith("path: keyframe v1 + shortcut v1..v3 + chain v3..v4") and "; chain " not in line, line
    # dcr pull --since writes deltas only (a keyframe replaces the checkpoint: dcr pull --join), as apply does.
    line = one_error_line(run_dcr("pull", url, "--since", "v0", "-o", str(tmp_path / "p")))
    assert "no path from v0" in line and "dcr pull --join" in line, line
    assert not (tmp_path / "p").exists()
    assert one_error_line(
        run_dcr("apply", url, "--since", "v0", "--into", str(copy_checkpoint(ckpts[0], tmp_path / "r")))
    )


def _shortcut_blocks(url: str) -> list[BlockEntry]:
    (shortcut,) = [s for s in shortcuts(Store(url)) if s.record.version == "v3"]
    return list(parse_manifest(Store(url).manifest_bytes(shortcut.record)).blocks)


def test_check_examines_shortcuts(tmp_path: Path) -> None:
    """Before, dcr check never looked at shortcuts: their objects were listed as unreferenced ("dcr gc
    removes them", which it does not), --read-data skipped their blocks, and a missing or corrupt one passed
    with exit 0 while every lagging receiver's apply --since took it and failed."""
    url, ckpts = _committed_store(tmp_path)
    store = Path(url)
    (store / "blocks" / ".tmp-0123-upload").write_bytes(b"half")  # a killed upload: no block (store-v1 §1)
    sc_blocks = _shortcut_blocks(url)
    clean = check(url, read_data=True)
    assert clean.ok, clean.problems
    assert clean.shortcuts == 1 and clean.unreferenced_manifests == []
    assert clean.unreferenced_blocks == [] and clean.blocks == len(list((store / "blocks").iterdir())) - 1
    assert clean.blocks_read == clean.blocks  # the shortcut's blocks are read too
    assert "shortcuts: 1" in run_dcr("check", url).stdout

    data = next(b for b in sc_blocks if b.role == "data")
    victim = store / "blocks" / data.id
    good = victim.read_bytes()
    victim.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
    assert check(url).ok  # same size: only the bytes tell
    proc = run_dcr("check", url, "--read-data")
    assert proc.returncode == 1 and f"block {data.id[:16]}… is corrupt" in proc.stderr, proc.stderr

    victim.unlink()
    proc = run_dcr("check", url)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"block {data.id[:16]}… of shortcuts/v1/v3.json is missing" in proc.stderr
    assert "remove shortcuts/v1/v3.json" in proc.stderr
    # The fix the line gives works: without the record, a lagging receiver takes the chain.
    (store / "shortcuts" / "v1" / "v3.json").unlink()
    recv = copy_checkpoint(ckpts[1], tmp_path / "recv")
    assert run_dcr("apply", url, "--since", "v1", "--into", str(recv)).returncode == 0
    assert read_raw(recv) == read_raw(ckpts[4])


def test_check_reports_a_shortcut_of_no_committed_state(tmp_path: Path) -> None:
    url, ckpts = _committed_store(tmp_path)
    _plant_shortcut(tmp_path, url, ckpts[1], "v1", "v4")
    result = check(url, read_data=True)
    assert result.shortcuts == 2
    assert result.problems == [
        f"shortcuts/v1/v4.json names 'v4' with fingerprint {result_fp(url)[:16]}…, which is not a committed "
        "state (receivers ignore it)"
    ]


def result_fp(url: str) -> str:
    (planted,) = [s for s in shortcuts(Store(url)) if s.record.version == "v4"]
    return planted.record.target.fingerprint


def test_a_join_interrupted_part_way_resumes_in_one_partial_directory(tmp_path: Path) -> None:
    """``dcr pull --join -o DIR`` killed part-way leaves ``.DIR.partial``; the next join into DIR keeps the files
    already there with the record's size and BLAKE3 and leaves no partial directory behind. Before, every
    attempt downloaded into a fresh ``.DIR.partial-<random>``: a killed one stayed on disk for good (a whole
    checkpoint each) and the next started from nothing."""
    url, ckpts = _committed_store(tmp_path)
    out = tmp_path / "new"
    partial = tmp_path / ".new.partial"
    partial.mkdir()
    done = partial / "model.safetensors"  # what a join killed after its first file left
    shutil.copyfile(ckpts[1] / "model.safetensors", done)
    os.utime(done, ns=(10**18, 10**18))
    (partial / "blocks").mkdir()  # and strays: a killed dcr pull -o new of a delta
    (partial / "blocks" / "x").write_bytes(b"x")
    proc = run_dcr("pull", url, "--join", "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    assert read_raw(out) == read_raw(ckpts[1])
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
    assert (out / "model.safetensors").stat().st_mtime_ns == 10**18  # kept, not downloaded again
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".new")) == []
    # A damaged file left there is fetched again, not trusted.
    out2, partial2 = tmp_path / "new2", tmp_path / ".new2.partial"
    partial2.mkdir()
    (partial2 / "model.safetensors").write_bytes(b"\0" * (ckpts[1] / "model.safetensors").stat().st_size)
    assert run_dcr("pull", url, "--join", "-o", str(out2)).returncode == 0
    assert read_raw(out2) == read_raw(ckpts[1]) and not partial2.exists()


def test_the_python_api_publishes_keyframes_joins_and_catches_up_as_the_cli_does(tmp_path: Path) -> None:
    """``dcr compact``, ``dcr pull --join`` and the route of ``dcr pull --since`` are in the Python API too
    (before: only by importing dcr_cli.store.keyframes, which the README does not name)."""
    ckpts, deltas = make_deltas(tmp_path, 4)
    url = str(tmp_path / "store")
    commit_each(url, deltas)
    dcr_cli.publish_keyframe(url, ckpts[1], version="v1")
    assert dcr_cli.compact(url, every=2).published == ["v1..v3"]
    dcr_cli.gc(url, keep=1, grace_s=0)  # the chain from v1 is gone: only the shortcut route is left
    pulled = dcr_cli.pull_since(url, "v1", tmp_path / "since")  # the route, as dcr pull --since takes it
    assert [(r.kind, r.base, r.version) for r in pulled] == [("shortcut", "v1", "v3"), ("chain", "v3", "v4")]
    route = dcr_cli.plan(url, "v1")
    written = dcr_cli.pull_plan(url, route, tmp_path / "route")
    assert [Path(p).name for p in written] == ["shortcut-v1-v3", "v4"]
    joined = dcr_cli.join(url, tmp_path / "new")
    assert joined.version == "v1" and read_raw(tmp_path / "new") == read_raw(ckpts[1])
    dcr_cli.apply([Path(p) for p in written], into=tmp_path / "new")
    assert read_raw(tmp_path / "new") == read_raw(ckpts[4])


def test_a_keyframe_of_another_version_names_the_version_it_holds(tmp_path: Path) -> None:
    """``dcr compact URL --keyframe CKPT`` without --version means the head; a checkpoint of an older committed
    version is refused with the --version that fits (before: only the two fingerprints, no next step)."""
    url, ckpts = _committed_store(tmp_path)
    line = one_error_line(run_dcr("compact", url, "--keyframe", str(ckpts[2])))
    assert line.endswith("it holds committed version v2: pass --version v2"), line
    tensors = load_file(str(ckpts[2] / "model.safetensors"))
    tensors["norm.weight"] = (tensors["norm.weight"] * 2).astype(np.float16)
    stranger = write_checkpoint(tmp_path / "stranger", tensors)
    line = one_error_line(run_dcr("compact", url, "--keyframe", str(stranger)))
    assert "it holds no committed state" in line, line
    assert run_dcr("compact", url, "--keyframe", str(ckpts[2]), "--version", "v2").returncode == 0


def test_a_shortcut_missing_a_data_block_is_skipped_for_the_next_route(tmp_path: Path) -> None:
    """A receiver catching up asks about the data blocks of the shortcuts its cheapest route takes; one that
    lacks a block is left out and the next cheapest route is taken, and the path line says so. Before, the
    shortcut stayed the choice on every run: each lagging receiver failed (exit 2) until someone removed it."""
    url, ckpts = _committed_store(tmp_path)
    data = next(b for b in _shortcut_blocks(url) if b.role == "data")
    (Path(url) / "blocks" / data.id).unlink()
    recv = copy_checkpoint(ckpts[1], tmp_path / "recv")
    proc = run_dcr("apply", url, "--since", "v1", "--into", str(recv))
    assert proc.returncode == 0, proc.stderr
    path_line = proc.stdout.splitlines()[0]
    assert path_line.startswith("path: chain v1..v2 + chain v2..v3 + chain v3..v4"), path_line
    assert "skipped shortcut v1..v3: a block is missing from the store (see dcr check)" in path_line
    assert read_raw(recv) == read_raw(ckpts[4])
    # pull --since and a joining receiver's route skip it the same way.
    assert [s.kind for s in plan(url, "v1").steps] == ["chain", "chain", "chain"]
    assert [s.kind for s in plan(url, None).steps] == ["keyframe", "chain", "chain", "chain"]


def test_a_refused_keyframe_leaves_no_partial_directory(tmp_path: Path) -> None:
    url, _ckpts = _committed_store(tmp_path)
    (obj,) = (Path(url) / "keyframes" / "v1").iterdir()
    data = bytearray(obj.read_bytes())
    data[-1] ^= 1
    obj.write_bytes(bytes(data))
    proc = run_dcr("pull", url, "--join", "-o", str(tmp_path / "bad"))
    assert proc.returncode == 2 and "corrupt" in one_error_line(proc)
    assert sorted(p.name for p in tmp_path.iterdir() if "bad" in p.name) == []


def _bytes_read() -> int:
    """Bytes this process has read through read(2) and the like (Linux /proc/self/io ``rchar``)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


def test_a_keyframe_object_larger_than_its_record_is_refused_after_its_size(tmp_path: Path) -> None:
    """A join reads each keyframe file in ranges bounded by its recorded size plus one byte, hashing as the bytes
    arrive (store-v1 §4.2's rule for blocks). Before, it downloaded the whole object (and read it again to hash
    it): an object far larger than its record said was fetched in full before the size check refused it."""
    url, _ckpts = _committed_store(tmp_path)
    (obj,) = (Path(url) / "keyframes" / "v1").iterdir()
    size = obj.stat().st_size
    with open(obj, "r+b") as f:
        f.truncate(size + (64 << 20))  # 64 MiB more than the record says (a sparse tail: no disk used)
    before = _bytes_read()
    with pytest.raises(IntegrityError, match="corrupt on the store"):
        dcr_cli.join(url, tmp_path / "new")
    assert _bytes_read() - before < size + (4 << 20)
    assert not (tmp_path / "new").exists() and not (tmp_path / ".new.partial").exists()


def test_check_does_not_call_the_blocks_of_a_damaged_manifest_garbage(tmp_path: Path) -> None:
    """A version whose manifest is on the store but damaged lists blocks check cannot know: its line about
    unreferenced objects must not say "dcr gc removes them" (before, it did, for the head's own blocks)."""
    url, _ckpts = _committed_store(tmp_path)
    record = Store(url).version("v4")
    assert record is not None
    (Path(url) / "manifests" / f"{record.manifest}.json").write_bytes(b"\0" * 100)
    proc = run_dcr("check", url)
    assert proc.returncode == 1
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("unreferenced")]
    assert "dcr gc removes them" not in line and "damaged manifests of v4, which are not garbage" in line, line
    result = check(url)
    assert result.unreadable_manifests == ["v4"] and not result.ok
