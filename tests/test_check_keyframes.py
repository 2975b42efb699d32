"""``dcr check`` examines keyframes (store-v1 §6.1, §4.5): a record that is unreadable or hostile, a file
that is missing or of the wrong size, and (``--read-data``, ``--read-data-subset``) a file whose bytes
do not have the BLAKE3 its name and record state are damage (exit 1, one ``problem:`` line each);
files no record names are leftovers, reported but not damage. Before, check never looked at keyframes:
every one of these stores passed with exit 0, and a joining receiver found the damage."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from store_fixtures import make_deltas, run_dcr

from dcr_cli.store import Store, acknowledge, check, commit, push
from dcr_cli.store.keyframes import keyframes, publish_keyframe


def _store(tmp: Path, url: str, opts: dict[str, Any]) -> list[Path]:
    """Committed v1, v2 on ``url``, a keyframe at v0 and one at v2; the checkpoints c0..c2."""
    ckpts, deltas = make_deltas(tmp, 2)
    for i, d in enumerate(deltas, start=1):
        push(d, url, storage_options=opts)
        acknowledge(url, f"v{i}", "r", storage_options=opts)
        commit(url, f"v{i}", receivers=["r"], storage_options=opts)
    publish_keyframe(url, ckpts[0], version="v0", storage_options=opts)
    publish_keyframe(url, ckpts[2], version="v2", storage_options=opts)
    return ckpts


def _problems(url: str, env: dict[str, str] | None, *args: str) -> list[str]:
    """The problems ``dcr check`` prints (exit 1 if any, 0 if none)."""
    proc = run_dcr("check", url, *args, env=env)
    found = [line.removeprefix("problem: ") for line in proc.stderr.splitlines() if line.startswith("problem: ")]
    assert proc.returncode == (1 if found else 0), proc.stdout + proc.stderr
    if found:
        assert proc.stderr.strip().splitlines()[-1].startswith("dcr: error: "), proc.stderr
    return found


@pytest.mark.parametrize("store_url", ["local", "s3"], indirect=True)
def test_check_finds_missing_resized_and_corrupt_keyframe_files(
    store_url: tuple[str, dict[str, Any], dict[str, str] | None], tmp_path: Path
) -> None:
    url, opts, env = store_url
    _store(tmp_path, url, opts)
    store = Store(url, opts)
    frames = keyframes(store)
    files = {v: {f.name: f for f in frames[v].files} for v in ("v0", "v2")}
    model0, model2 = files["v0"]["model.safetensors"], files["v2"]["model.safetensors"]
    total = sum(f.size for v in files for f in files[v].values())

    clean = check(url, read_data=True, storage_options=opts)
    assert clean.ok, clean.problems
    assert (clean.keyframes, clean.keyframe_files) == (2, sum(len(f) for f in files.values()))
    assert clean.keyframe_files_read == clean.keyframe_files and clean.keyframe_bytes_read == total
    proc = run_dcr("check", url, "--read-data", env=env)
    assert proc.returncode == 0 and f"keyframes: 2 ({clean.keyframe_files} files); read" in proc.stdout

    # Same size, other bytes: only reading finds it, and the structure check still passes.
    rel0 = f"keyframes/v0/{model0.stored}"
    good0 = store.read(rel0)
    store.put(rel0, good0[:-1] + bytes([good0[-1] ^ 1]))
    assert _problems(url, env) == []
    (corrupt,) = _problems(url, env, "--read-data")
    assert corrupt.startswith("keyframe file model.safetensors of 'v0' is corrupt") and model0.digest[:16] in corrupt
    assert "remove keyframes/v0.json, then publish it again" in corrupt and "--version v0" in corrupt
    assert _problems(url, env, "--read-data-subset", "100%") == [corrupt]
    sampled = check(url, subset=1, seed=3, storage_options=opts)  # one block and one keyframe file
    assert sampled.blocks_read == 1 and sampled.keyframe_files_read == 1

    # One byte more: the size check finds it without reading.
    store.put(rel0, good0 + b"\0")
    (longer,) = _problems(url, env)
    assert longer == (
        f"keyframe file model.safetensors of 'v0' has {model0.size + 1} bytes, expected {model0.size}; a joining "
        f"receiver refuses it; remove keyframes/v0.json, then publish it again "
        f"(dcr compact {url} --keyframe CHECKPOINT --version v0)"
    )
    store.put(rel0, good0)

    # Gone (a gc that did not know the record, a hand's rm).
    store.delete(f"keyframes/v2/{model2.stored}")
    (missing,) = _problems(url, env)
    assert missing.startswith("keyframe file model.safetensors of 'v2' is missing (keyframes/v2/")

    # JSON output carries the same findings.
    proc = run_dcr("check", url, "--json", env=env)
    assert proc.returncode == 1
    report = json.loads(proc.stdout)
    assert report["ok"] is False and report["problems"] == [missing] and report["keyframes"] == 2


def test_check_reports_hostile_keyframe_records_and_goes_on(tmp_path: Path) -> None:
    url = str(tmp_path / "store")
    _store(tmp_path, url, {})
    root = tmp_path / "store" / "keyframes"
    good = json.loads((root / "v2.json").read_text())
    assert _problems(url, None, "--read-data") == []

    def put(name: str, text: str) -> None:
        (root / name).write_text(text)

    # Two "version" keys: a reader could take either.
    text = (root / "v0.json").read_text().rstrip()
    put("v0.json", text[:-1] + ', "version": "v2"}')
    # A file name that would leave the keyframe's folder.
    put("v1.json", json.dumps({**good, "version": "v1", "files": [{**good["files"][0], "name": "../x"}]}))
    # A record under another name than its version.
    put("v9.json", json.dumps(good))
    # Of a committed version, with another fingerprint.
    (root / "v2.json").write_text(json.dumps({**good, "fingerprint": "ab" * 32}))
    found = _problems(url, None)
    assert len(found) == 4, found
    assert found[0].startswith("keyframes/v0.json: ") and "duplicate key 'version'" in found[0]
    assert found[1].startswith("keyframes/v1.json: ") and "not a plain file name" in found[1]
    assert found[2] == "keyframe 'v2' holds fingerprint abababababababab…, not its committed target " + (
        f"{good['fingerprint'][:16]}… (receivers ignore it)"
    )
    assert found[3] == "keyframes/v9.json is the record of another keyframe ('v2')"

    # A record of a version nobody committed, and a file named for another digest than its record's.
    (root / "v9.json").unlink()
    (root / "v0.json").unlink()
    (root / "v1.json").unlink()
    (root / "v2.json").write_text(json.dumps(good))
    other = {**good["files"][0], "object": "cd" * 32 + "-model.safetensors"}
    (root / "v7.json").write_text(json.dumps({**good, "version": "v7", "files": [other]}))
    found = _problems(url, None)
    assert found[0] == "keyframe 'v7' is not of a committed version (receivers ignore it)"
    assert found[1].startswith("keyframe file model.safetensors of 'v7': its object cdcdcdcd")
    assert "is named for BLAKE3 cdcdcdcdcdcdcdcd…, but the record says" in found[1]
    assert found[2].startswith("keyframe file model.safetensors of 'v7' is missing")
    assert len(found) == 3, found


def test_unnamed_keyframe_files_are_leftovers_not_damage(tmp_path: Path) -> None:
    """A keyframe publish stopped before its record leaves files no record names: gc removes them (§6.4)."""
    url = str(tmp_path / "store")
    _store(tmp_path, url, {})
    Store(url).put("keyframes/v1/" + "ef" * 32 + "-model.safetensors", b"partial")
    Store(url).put("keyframes/v2/stray", b"x")
    result = check(url)
    assert result.ok and result.unreferenced_keyframe_files == ["v1/" + "ef" * 32 + "-model.safetensors", "v2/stray"]
    proc = run_dcr("check", url)
    assert proc.returncode == 0 and ", 2 keyframe files" in proc.stdout


def test_a_keyframe_a_gc_drops_while_check_runs_is_not_damage(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """gc removes a dropped keyframe's record, then its files (store-v1 §6.4); check read the record before
    and lists the files after: the files it finds gone are asked about again with the record, not reported."""
    from dcr_cli.store import repo

    url = str(tmp_path / "store")
    _store(tmp_path, url, {})
    root = tmp_path / "store" / "keyframes"
    real = repo.Store.list

    def listing(self: repo.Store, rel_dir: str) -> list[repo.Listing]:
        if rel_dir == "keyframes/v0":  # the gc runs now: record, then files
            (root / "v0.json").unlink()
            for p in (root / "v0").iterdir():
                p.unlink()
        return real(self, rel_dir)

    monkeypatch.setattr(repo.Store, "list", listing)
    result = check(url)
    assert result.ok, result.problems
    assert result.keyframes == 1 and result.unreferenced_keyframe_files == []
