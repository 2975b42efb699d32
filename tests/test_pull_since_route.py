"""``dcr pull --since V`` and ``dcr_cli.pull_since`` fetch the route ``dcr apply URL --since V`` takes
(store-v1 §6.3: the cheapest by bytes among the chain and the store's shortcuts; no keyframe, since a pull
writes deltas), in apply order, resumable, one line per delta and a ``--json`` list of what was pulled.
Before, ``pull_since`` followed the plain chain only (three deltas where one shortcut and one delta do,
and nothing at all once gc had removed the chain's deltas), and the CLI took a second route finder that
could fetch a keyframe in place of the receiver's checkpoint."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
from helpers_checkpoints import copy_checkpoint, read_raw
from store_fixtures import commit_each, delta_files, json_out, make_deltas, one_error_line, run_dcr

import dcr_cli
from dcr_cli.delta.reader import Delta
from dcr_cli.errors import DcrError
from dcr_cli.store import Store, gc
from dcr_cli.store.keyframes import compact, plan, publish_keyframe


def _store(tmp: Path, url: str, opts: dict[str, Any]) -> list[Path]:
    """v1..v4 committed on ``url``, a keyframe at v1 and the shortcut v1 -> v3; the checkpoints c0..c4."""
    ckpts, deltas = make_deltas(tmp, 4)
    commit_each(url, deltas, storage_options=opts)
    publish_keyframe(url, ckpts[1], version="v1", storage_options=opts)
    assert compact(url, every=2, storage_options=opts).published == ["v1..v3"]
    return ckpts


@pytest.mark.parametrize("store_url", ["local", "s3"], indirect=True)
def test_pull_since_fetches_the_route_apply_takes_and_a_receiver_ends_bit_exact(
    store_url: tuple[str, dict[str, Any], dict[str, str] | None], tmp_path: Path
) -> None:
    url, opts, env = store_url
    ckpts = _store(tmp_path, url, opts)
    route = plan(url, "v1", allow_keyframe=False, storage_options=opts)
    assert [(s.kind, s.base, s.target) for s in route.steps] == [("shortcut", "v1", "v3"), ("chain", "v3", "v4")]
    assert route.chain_bytes is not None and route.bytes < route.chain_bytes

    # The Python API: the same steps, in apply order, each a verified delta directory.
    lines: list[str] = []
    pulled = dcr_cli.pull_since(url, "v1", tmp_path / "api", storage_options=opts, log=lines.append)
    assert lines == [route.describe()]
    assert [(r.kind, r.base, r.version) for r in pulled] == [("shortcut", "v1", "v3"), ("chain", "v3", "v4")]
    assert [Path(r.path).name for r in pulled] == ["shortcut-v1-v3", "v4"]
    assert [Delta.open(r.path).id for r in pulled] == [s.record.manifest for s in route.steps if s.record]
    assert sum(r.downloaded_bytes for r in pulled) == route.bytes
    recv = copy_checkpoint(ckpts[1], tmp_path / "recv-api")
    for r in pulled:  # a receiver applying the pulled directories one by one, in the order given
        dcr_cli.apply(r.path, into=recv, workers=1)
    assert read_raw(recv) == read_raw(ckpts[4])

    # The CLI: the path line, one line per delta, the same directories; a receiver applies them in order.
    out = tmp_path / "cli"
    proc = run_dcr("pull", url, "--since", "v1", "-o", str(out), "--no-progress", env=env)
    assert proc.returncode == 0, proc.stderr
    head, *per_delta = proc.stdout.splitlines()
    assert head == route.describe()
    assert [line.split(": ", 1)[1].split(" verified")[0] for line in per_delta] == ["shortcut v1..v3", "v4 (base v3)"]
    assert sorted(p.name for p in out.iterdir()) == ["shortcut-v1-v3", "v4"]
    recv = copy_checkpoint(ckpts[1], tmp_path / "recv-cli")
    for name in ("shortcut-v1-v3", "v4"):
        applied = run_dcr("apply", str(out / name), "--into", str(recv), env=env)
        assert applied.returncode == 0, applied.stderr
    assert read_raw(recv) == read_raw(ckpts[4])

    # A re-run keeps what is complete and fetches the rest (a pull stopped after its first delta); --json
    # lists what was pulled.
    shutil.rmtree(out / "v4")
    again = json_out(run_dcr("pull", url, "--since", "v1", "-o", str(out), "--json", env=env))
    listed = [
        (v["kind"], v["base"], v["version"], Path(v["path"]).name, v["already_present"]) for v in again["versions"]
    ]
    assert listed == [("shortcut", "v1", "v3", "shortcut-v1-v3", True), ("chain", "v3", "v4", "v4", False)]
    assert Delta.open(out / "v4").id == route.steps[1].record.manifest  # type: ignore[union-attr]

    # With the chain's deltas gone (gc), the shortcut route is the only one: pull --since still catches up.
    gc(url, keep=1, grace_s=0, storage_options=opts)
    late = dcr_cli.pull_since(url, "v1", tmp_path / "late", storage_options=opts)
    assert [(r.kind, r.version) for r in late] == [("shortcut", "v3"), ("chain", "v4")]
    # No keyframe route: a receiver at v0 is told to join (a pull writes deltas, never a checkpoint).
    line = one_error_line(run_dcr("pull", url, "--since", "v0", "-o", str(tmp_path / "v0"), env=env))
    assert "no path from v0" in line and "dcr pull --join" in line, line
    assert not (tmp_path / "v0").exists()


def test_a_rerun_into_a_directory_holding_an_older_shortcut_of_the_same_states_replaces_it(tmp_path: Path) -> None:
    """The shortcut v1 -> v3 published again (gc dropped its damaged record, dcr compact made it anew: another
    manifest of the same states): re-running the same ``dcr pull --since`` replaces the old copy, reusing its
    blocks whose digests match, once the new one is verified; a fetch that fails leaves the old copy as it
    was. Before, the re-run failed (exit 3, "not an intact copy of version 'v3'") until OUT was removed."""
    url = str(tmp_path / "store")
    ckpts = _store(tmp_path, url, {})
    out = tmp_path / "out"
    first = json_out(run_dcr("pull", url, "--since", "v1", "-o", str(out), "--json"))
    assert set(first) == {"versions"}  # the shape README documents: one entry per step, in apply order
    assert [(v["kind"], v["base"], v["version"], Path(v["path"]).name) for v in first["versions"]] == [
        ("shortcut", "v1", "v3", "shortcut-v1-v3"),
        ("chain", "v3", "v4", "v4"),
    ]
    for v in first["versions"]:
        assert set(v) == {
            "store", "version", "base", "target_fingerprint", "path", "manifest", "blocks", "downloaded_blocks",
            "downloaded_bytes", "reused_blocks", "reused_bytes", "already_present", "kind",
        }  # fmt: skip
        assert Delta.open(v["path"]).id == v["manifest"] and not v["already_present"]
    old_manifest = first["versions"][0]["manifest"]

    store = Store(url)
    store.put("shortcuts/v1/v3.json", b'{"format": "dcr.store.shortcut", "format_ver')  # damaged
    gc(url, keep=4, grace_s=0)
    time.sleep(1.1)  # the squashed manifest says when it was made (in seconds): this one is another manifest
    assert compact(url, every=2).published == ["v1..v3"]
    route = plan(url, "v1", allow_keyframe=False)
    new = route.steps[0].record
    assert route.steps[0].kind == "shortcut" and new is not None and new.manifest != old_manifest

    # A fetch that fails (the store's copy of a block it must fetch is corrupt) leaves the old copy whole.
    shortcut = out / "shortcut-v1-v3"
    (block,) = (shortcut / "blocks").iterdir()
    block.write_bytes(bytes(b ^ 0xFF for b in block.read_bytes()))  # the local copy no longer matches
    kept = delta_files(shortcut)
    good = store.read(f"blocks/{block.name}")
    store.put(f"blocks/{block.name}", bytes(b ^ 0x01 for b in good))
    failed = run_dcr("pull", url, "--since", "v1", "-o", str(out), "--no-progress")
    assert failed.returncode == 2 and "corrupt on the store" in one_error_line(failed)
    assert "shortcut v1..v3" in one_error_line(failed)  # not "version 'v3'"
    assert delta_files(shortcut) == kept
    assert sorted(p.name for p in out.iterdir() if not p.name.endswith(".partial")) == ["shortcut-v1-v3", "v4"]

    # The store repaired: the same command replaces the old copy; what matched is kept.
    store.put(f"blocks/{block.name}", good)
    again = json_out(run_dcr("pull", url, "--since", "v1", "-o", str(out), "--json"))
    listed = [(v["kind"], v["version"], v["already_present"], v["downloaded_blocks"]) for v in again["versions"]]
    assert listed == [("shortcut", "v3", False, 1), ("chain", "v4", True, 0)]
    assert Delta.open(shortcut).id == new.manifest
    assert sorted(p.name for p in out.iterdir()) == ["shortcut-v1-v3", "v4"]  # no partial or old copy left
    recv = copy_checkpoint(ckpts[1], tmp_path / "recv")
    for name in ("shortcut-v1-v3", "v4"):
        dcr_cli.apply(out / name, into=recv, workers=1)
    assert read_raw(recv) == read_raw(ckpts[4])

    # Intact blocks of the old copy are reused by digest, not fetched again (data blocks of a shortcut
    # made anew from the same states are the same bytes).
    store.put("shortcuts/v1/v3.json", b"{")
    gc(url, keep=4, grace_s=0)
    time.sleep(1.1)
    assert compact(url, every=2).published == ["v1..v3"]
    third = json_out(run_dcr("pull", url, "--since", "v1", "-o", str(out), "--json"))["versions"][0]
    assert (third["already_present"], third["downloaded_blocks"], third["reused_blocks"]) == (False, 0, 1)
    assert Delta.open(shortcut).id == third["manifest"] != new.manifest


def _store_with_shortcut(tmp: Path) -> tuple[str, list[Path]]:
    """v0..v4 committed locally, a keyframe at v1 and the shortcut v1..v3."""
    url = str(tmp / "store")
    ckpts, deltas = make_deltas(tmp, 4)
    commit_each(url, deltas)
    publish_keyframe(url, ckpts[1], version="v1")
    assert compact(url, every=2).published
    return url, ckpts


def test_pull_since_never_replaces_what_is_not_an_older_copy_of_its_step(tmp_path: Path) -> None:
    """A directory, a file or a link already at a step's name in OUT that is not a delta between the step's
    two states (a user's, a trainer's `step-101/`) is refused in one line and left as it is."""
    url, _ = _store_with_shortcut(tmp_path)
    out = tmp_path / "out"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("theirs")

    def held(p: Path) -> object:
        if p.is_symlink():
            return ("link", os.readlink(p))
        if p.is_dir():
            return {q.name: q.read_bytes() for q in p.iterdir()}
        return p.read_bytes()

    for name, make in [
        ("v4", lambda p: (p.mkdir(), (p / "precious.txt").write_text("user data"))),
        ("v4", lambda p: p.write_text("a file")),
        ("v4", lambda p: p.symlink_to(elsewhere, target_is_directory=True)),
        ("shortcut-v1-v3", lambda p: p.symlink_to(elsewhere, target_is_directory=True)),
        ("shortcut-v1-v3", lambda p: (p.mkdir(), (p / "manifest.json").write_text("{}"))),  # no delta of v1..v3
    ]:
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir()
        make(out / name)
        before = held(out / name)
        proc = run_dcr("pull", url, "--since", "v1", "-o", str(out), "--no-progress")
        assert proc.returncode == 3, proc.stderr
        assert one_error_line(proc) and "already exists and is not an intact copy" in proc.stderr, proc.stderr
        assert held(out / name) == before, name
    assert held(elsewhere) == {"keep.txt": b"theirs"}


def test_a_catch_up_from_a_forged_state_off_the_chain_is_refused_as_the_whole_history_would(tmp_path: Path) -> None:
    """`plan` reads forwards from --since, trusting its commit record: one forged off the chain (a version F on
    a base Q no chain reaches, commit records Q -> F -> v3) must not make F look committed."""
    import json

    url = str(tmp_path / "store")
    _, deltas = make_deltas(tmp_path, 4)
    commit_each(url, deltas)
    s = Path(url)
    v2 = json.loads((s / "versions/v2.json").read_text())
    forged = {"version": "F", "fingerprint": v2["target"]["fingerprint"]}
    (s / "versions/F.json").write_text(
        json.dumps(dict(v2, version="F", base={"version": "Q", "fingerprint": "00" * 32}, target=forged))
    )
    c1 = json.loads((s / "commits/v1.json").read_text())
    (s / "commits/Q.json").write_text(
        json.dumps(dict(c1, base={"version": "Q", "fingerprint": "00" * 32}, target=forged, version="F"))
    )
    c2 = json.loads((s / "commits/v2.json").read_text())
    (s / "commits/F.json").write_text(json.dumps(dict(c2, base=forged)))
    with pytest.raises(DcrError, match="'F' is not a committed version before 'v4'"):
        plan(url, "F", allow_keyframe=False)
    proc = run_dcr("pull", url, "--since", "F", "-o", str(tmp_path / "out"), "--no-progress")
    assert proc.returncode != 0 and "'F' is not a committed version" in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


@pytest.mark.parametrize("where", ["between the renames", "after the second rename"])
def test_a_replacement_killed_at_its_renames_is_finished_by_a_rerun_without_a_download(
    tmp_path: Path, where: str
) -> None:
    import subprocess
    import sys

    url, _ = _store_with_shortcut(tmp_path)
    out = tmp_path / "out"
    json_out(run_dcr("pull", url, "--since", "v1", "-o", str(out), "--json"))
    Store(url).put("shortcuts/v1/v3.json", b"{")  # damaged: gc drops it, compact publishes it again
    gc(url, keep=4, grace_s=0)
    time.sleep(1.1)  # the squashed manifest's digest changes once a second has passed
    assert compact(url, every=2).published
    mode = "mid" if where == "between the renames" else "after"
    code = f"""
import os
import dcr_cli.store.transfer as t
real = os.rename
def rename(a, b):
    real(a, b)
    if {mode!r} == "mid" and str(b).endswith(".replaced"):
        os._exit(9)
    if {mode!r} == "after" and str(a).endswith(".partial"):
        os._exit(9)
t.os.rename = rename
import dcr_cli
dcr_cli.pull_since({url!r}, "v1", {str(out)!r})
"""
    killed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ})
    assert killed.returncode == 9, killed.stderr
    assert (out / ".shortcut-v1-v3.replaced").exists()
    again = json_out(run_dcr("pull", url, "--since", "v1", "-o", str(out), "--json"))["versions"][0]
    assert again["kind"] == "shortcut" and again["downloaded_blocks"] == 0, again  # the verified copy is kept
    assert sorted(os.listdir(out)) == ["shortcut-v1-v3", "v4"]
