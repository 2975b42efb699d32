"""Errors about a shortcut (a squashed delta dcr compact publishes, store-v1 §6.2) name the shortcut and the fix
that restores it. Before, they named "version 'v3'" and advised dcr push DELTA URL, which cannot restore a
shortcut; nor can dcr compact alone, which keeps a shortcut whose record is there: the record goes first.

Real parts: a local store, the real CLI for the one-line errors.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers_checkpoints import copy_checkpoint, read_raw
from store_fixtures import commit_each, make_deltas, one_error_line, run_dcr

from dcr_cli.errors import DcrError
from dcr_cli.format.manifest import BlockEntry, parse_manifest
from dcr_cli.store import Store, check
from dcr_cli.store.keyframes import compact, plan, publish_keyframe, shortcuts

FIX = "remove shortcuts/v1/v3.json from {url} and publish it anew with dcr compact {url} --every K"


def _store(tmp: Path) -> tuple[str, list[Path]]:
    """A local store with v1..v4 committed, a keyframe at v1 and the shortcut v1 -> v3."""
    ckpts, deltas = make_deltas(tmp, 4)
    url = str(tmp / "store")
    commit_each(url, deltas)
    publish_keyframe(url, ckpts[1], version="v1")
    assert compact(url, every=2).published == ["v1..v3"]
    steps = plan(url, "v1", allow_keyframe=False).steps
    assert [(s.kind, s.base, s.target) for s in steps] == [("shortcut", "v1", "v3"), ("chain", "v3", "v4")]
    return url, ckpts


def _blocks(url: str, role: str) -> list[BlockEntry]:
    (shortcut,) = shortcuts(Store(url))
    return [b for b in parse_manifest(Store(url).manifest_bytes(shortcut.record)).blocks if b.role == role]


def _flip(path: Path) -> None:
    raw = path.read_bytes()
    path.write_bytes(raw[:-1] + bytes([raw[-1] ^ 1]))  # same size: only the bytes tell


def _shortcut_fix(line: str, url: str) -> None:
    assert FIX.format(url=url) in line, line
    assert "dcr push" not in line, line  # was: "dcr push DELTA URL", which cannot restore a shortcut


def test_a_corrupt_shortcut_block_met_by_a_pull_names_the_shortcut_fix(tmp_path: Path) -> None:
    url, _ckpts = _store(tmp_path)
    _flip(tmp_path / "store" / "blocks" / _blocks(url, "data")[0].id)

    pulled = run_dcr("pull", url, "--since", "v1", "-o", str(tmp_path / "p"))
    line = one_error_line(pulled)
    assert pulled.returncode == 2 and "of shortcut v1..v3 is corrupt on the store" in line, line
    _shortcut_fix(line, url)
    assert line.endswith("then pull again"), line


def test_a_corrupt_shortcut_block_met_by_an_apply_names_the_shortcut_fix(tmp_path: Path) -> None:
    url, ckpts = _store(tmp_path)
    _flip(tmp_path / "store" / "blocks" / _blocks(url, "data")[0].id)
    recv = copy_checkpoint(ckpts[1], tmp_path / "recv")
    before = read_raw(recv)
    applied = run_dcr("apply", url, "--since", "v1", "--into", str(recv))
    line = one_error_line(applied)
    assert applied.returncode == 2 and "is corrupt (digest mismatch)" in line, line
    _shortcut_fix(line, url)  # was: "dcr push DELTA URL --verify-remote (dcr compact for a shortcut's)"
    assert f"dcr check {url} --read-data" in line, line
    assert read_raw(recv) == before


def test_a_pull_with_repair_blocks_names_a_shortcuts_lost_repair_block(tmp_path: Path) -> None:
    url, _ckpts = _store(tmp_path)
    repair = _blocks(url, "repair")
    assert repair
    for b in repair:
        (tmp_path / "store" / "blocks" / b.id).unlink()
    pulled = run_dcr("pull", url, "--since", "v1", "--repair", "-o", str(tmp_path / "p"))
    line = one_error_line(pulled)
    assert pulled.returncode == 2, pulled.stderr
    assert f"repair block {repair[0].id[:16]}… of shortcut v1..v3 is missing" in line, line  # was: of version 'v3'
    _shortcut_fix(line, url)
    assert not (tmp_path / "p").exists()


@pytest.mark.parametrize("how", ["corrupt", "missing"])
def test_a_shortcuts_unusable_manifest_names_the_shortcut_and_its_fix(tmp_path: Path, how: str) -> None:
    url, _ckpts = _store(tmp_path)
    (shortcut,) = shortcuts(Store(url))
    manifest = tmp_path / "store" / "manifests" / f"{shortcut.record.manifest}.json"
    if how == "corrupt":
        _flip(manifest)
    else:
        manifest.unlink()
    # A re-run of dcr compact opens the shortcut it keeps, to squash the next ones onto it.
    with pytest.raises(DcrError) as info:
        compact(url, every=2)
    message = str(info.value)
    assert "\n" not in message
    what = "is corrupt" if how == "corrupt" else "is gone (removed by dcr gc?)"
    assert f"manifest of shortcut v1..v3 {what}" in message, message  # was: of version 'v3'
    _shortcut_fix(message, url)
    if how == "corrupt":  # dcr check says the same (an absent manifest is no damage: no route takes it)
        problems = [p for p in check(url).problems if "manifest of" in p]
        assert len(problems) == 1 and "manifest of shortcut v1..v3 is corrupt" in problems[0], problems
        _shortcut_fix(problems[0], url)
