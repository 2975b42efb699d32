"""Two ``dcr compact`` runs of the same range at once: the one whose create-only record write loses says the
shortcut was published by another writer and exits 0 when that record is the same shortcut (the same base
and target states over the same chain), and fails closed (one line, exit 3) when it is a different one.
Before, the loser swallowed the FileExistsError and reported the shortcut as published by itself."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from helpers_checkpoints import copy_checkpoint, read_raw
from store_fixtures import commit_each, make_deltas, run_dcr

import dcr_cli.store.keyframes as keyframes
from dcr_cli.cli import main
from dcr_cli.store.keyframes import plan, publish_keyframe
from dcr_cli.store.repo import dumps


def _store(tmp: Path) -> tuple[str, list[Path]]:
    ckpts, deltas = make_deltas(tmp, 3)
    url = str(tmp / "store")
    commit_each(url, deltas)
    publish_keyframe(url, ckpts[1], version="v1")
    return url, ckpts


def _race(monkeypatch: pytest.MonkeyPatch, url: str, then: Any = None) -> None:
    """While this process squashes v1..v3, another dcr compact process publishes the same shortcut (and
    ``then`` may change what it wrote), before this one uploads and creates its record."""
    real = keyframes._upload_delta

    def upload(store: Any, local: Path, workers: int = 8) -> tuple[bytes, str]:
        other = run_dcr("compact", url, "--every", "2")
        assert other.returncode == 0 and "1 shortcut(s) published" in other.stdout, other.stderr
        if then is not None:
            then()
        return real(store, local, workers)

    monkeypatch.setattr(keyframes, "_upload_delta", upload)


def test_the_compact_that_loses_the_race_says_another_published_the_same_shortcut(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, ckpts = _store(tmp_path)
    _race(monkeypatch, url)
    rel = Path(url) / "shortcuts" / "v1" / "v3.json"
    proc = CliRunner().invoke(main, ["compact", url, "--every", "2"])
    assert proc.exit_code == 0, proc.output
    lines = proc.stdout.splitlines()
    assert lines == [
        "shortcut v1..v3: already published by another dcr compact meanwhile; kept that one",
        f"{url}: 0 shortcut(s) published from keyframe v1, 1 already there (1 published by another dcr compact "
        "meanwhile)",
    ], lines
    winner = rel.read_bytes()
    # --json says the same: not in "published".
    monkeypatch.undo()
    again = json.loads(CliRunner().invoke(main, ["compact", url, "--every", "2", "--json"]).stdout)
    assert again["shortcuts"]["published"] == [] and again["shortcuts"]["present"] == ["v1..v3"]
    assert rel.read_bytes() == winner
    # The winner's shortcut is the route, and it leads to v3's bits.
    assert [s.kind for s in plan(url, "v1", allow_keyframe=False).steps] == ["shortcut"]
    recv = copy_checkpoint(ckpts[1], tmp_path / "recv")
    assert run_dcr("apply", url, "--since", "v1", "--into", str(recv)).returncode == 0
    assert read_raw(recv) == read_raw(ckpts[3])


def test_the_compact_that_loses_the_race_to_a_different_shortcut_fails_closed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, _ckpts = _store(tmp_path)
    rel = Path(url) / "shortcuts" / "v1" / "v3.json"

    planted: list[bytes] = []

    def other_state() -> None:  # the record there names another target state under the label v3
        record = json.loads(rel.read_text())
        record["target"]["fingerprint"] = "ab" * 32
        planted.append(dumps(record))
        rel.write_bytes(planted[0])

    _race(monkeypatch, url, other_state)
    proc = CliRunner().invoke(main, ["compact", url, "--every", "2"])
    assert proc.exit_code == 3, proc.output
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("dcr: error: ") and "with a different shortcut" in line, line
    assert "published nothing" in line and "dcr check" in line, line
    assert "published" not in proc.stdout
    assert [rel.read_bytes()] == planted  # left as it was: nothing overwritten
