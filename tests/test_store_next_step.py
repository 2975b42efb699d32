"""A version's manifest that is gone or corrupt on the store, and a keyframe a join cannot use, each fail with
one line that names the fix; following that fix makes the same command succeed. Before, these lines ended at
"is gone (removed by dcr gc?)", "is corrupt", "lacks model.safetensors (removed by gc?)", "is corrupt on the
store (...)" and "does not hold its recorded fingerprint", with no next step.

Real parts: a local store, the real CLI (one line on stderr, the exit code), the output directories.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from store_fixtures import commit_each, make_deltas, one_error_line, run_dcr

from dcr_cli.format.digest import digest_bytes
from dcr_cli.store import Store, check, push
from dcr_cli.store.keyframes import KEYFRAMES, publish_keyframe


def _flip(path: Path) -> None:
    raw = path.read_bytes()
    path.write_bytes(raw[:-1] + bytes([raw[-1] ^ 1]))  # same size: only the bytes tell


def _manifest(url: str, version: str) -> Path:
    record = Store(url).require_version(version)
    return Path(url) / "manifests" / f"{record.manifest}.json"


def _store(tmp: Path, steps: int = 3, *, pending: bool = False) -> tuple[str, list[Path], list[Path]]:
    """A local store with v1..vN committed (with ``pending``, vN only published); (url, checkpoints, deltas)."""
    ckpts, deltas = make_deltas(tmp, steps)
    url = str(tmp / "store")
    commit_each(url, deltas[:-1] if pending else deltas)
    if pending:
        push(deltas[-1], url)  # published, not committed: no keyframe can hold it
    return url, ckpts, deltas


def _refused(*args: str) -> str:
    """The one line of a dcr command that fails with exit 2."""
    failed = run_dcr(*args)
    line = one_error_line(failed)
    assert failed.returncode == 2, failed.stderr
    return line


def _nothing_written(tmp: Path, name: str) -> None:
    assert not (tmp / name).exists()
    assert not (tmp / f".{name}.partial").exists() or not any((tmp / f".{name}.partial").iterdir())


# -- a version's manifest ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["gone", "corrupt"])
def test_a_committed_versions_lost_manifest_names_the_push_that_restores_it(tmp_path: Path, how: str) -> None:
    url, ckpts, deltas = _store(tmp_path)
    manifest = _manifest(url, "v2")
    if how == "gone":
        manifest.unlink()
    else:
        _flip(manifest)

    pull = ("pull", url, "--version", "v2", "-o", str(tmp_path / "p"))
    line = _refused(*pull)
    verify = " --verify-remote" if how == "corrupt" else ""
    what = "is gone (removed by dcr gc?)" if how == "gone" else "is corrupt"
    assert f"manifest of version 'v2' {what}; restore it with dcr push DELTA {url}{verify} (DELTA: the delta" in line
    assert (
        f"; without that delta, publish a keyframe of the head (dcr compact {url} --keyframe CHECKPOINT) and "
        f"join from it (dcr pull {url} --join -o DIR)"
    ) in line, line
    _nothing_written(tmp_path, "p")

    # Without that delta: the advised keyframe of the head, which a receiver with no state joins.
    published = run_dcr("compact", url, "--keyframe", str(ckpts[3]))
    assert published.returncode == 0, published.stderr
    joined = run_dcr("pull", url, "--join", "-o", str(tmp_path / "j"))
    assert joined.returncode == 0, joined.stderr
    assert (tmp_path / "j" / "model.safetensors").read_bytes() == (ckpts[3] / "model.safetensors").read_bytes()

    # With it: the advised push, after which the same pull succeeds.
    if how == "corrupt":  # the push without --verify-remote trusts the copy there: the advice needs the flag
        assert run_dcr("push", str(deltas[1]), url).returncode == 0
        assert run_dcr(*pull).returncode == 2
    restored = run_dcr("push", str(deltas[1]), url, *verify.split())
    assert restored.returncode == 0, restored.stderr
    again = run_dcr(*pull)
    assert again.returncode == 0, again.stderr
    assert (tmp_path / "p" / "manifest.json").is_file()


def test_a_pending_versions_lost_manifest_names_its_push_and_no_keyframe(tmp_path: Path) -> None:
    url, _ckpts, deltas = _store(tmp_path, pending=True)
    _manifest(url, "v3").unlink()

    pull = ("pull", url, "-o", str(tmp_path / "p"))
    line = _refused(*pull)
    assert line.endswith(
        f"the manifest of version 'v3' is gone (removed by dcr gc?); restore it with dcr push DELTA {url} "
        "(DELTA: the delta of 'v3')"
    ), line
    _nothing_written(tmp_path, "p")

    assert run_dcr("push", str(deltas[2]), url).returncode == 0
    again = run_dcr(*pull)
    assert again.returncode == 0, again.stderr


def test_a_corrupt_manifest_that_stops_gc_names_the_push_that_restores_it(tmp_path: Path) -> None:
    url, _ckpts, deltas = _store(tmp_path)
    manifest = _manifest(url, "v3")
    _flip(manifest)
    before = sorted(p.relative_to(url) for p in Path(url).rglob("*"))

    gc = ("gc", url, "--keep", "3", "--grace", "0")
    line = _refused(*gc)
    assert f"manifest of version 'v3' is corrupt; restore it with dcr push DELTA {url} --verify-remote" in line, line
    assert sorted(p.relative_to(url) for p in Path(url).rglob("*")) == before  # gc removed nothing

    assert run_dcr("push", str(deltas[2]), url, "--verify-remote").returncode == 0
    again = run_dcr(*gc)
    assert again.returncode == 0, again.stderr


# -- a keyframe a join cannot use --------------------------------------------------------------------------------------


def _keyframed(tmp: Path) -> tuple[str, list[Path], Path]:
    """v1..v3 committed, a keyframe of v3; (url, checkpoints, the keyframe's one file object)."""
    url, ckpts, _deltas = _store(tmp)
    frame = publish_keyframe(url, ckpts[3], version="v3")
    (f,) = frame.files
    return url, ckpts, Path(url) / KEYFRAMES / "v3" / f.stored


def _refused_join(tmp: Path, url: str) -> str:
    line = _refused("pull", url, "--join", "-o", str(tmp / "j"))
    _nothing_written(tmp, "j")
    return line


def _republish_and_join(tmp: Path, url: str, ckpt: Path) -> None:
    published = run_dcr("compact", url, "--keyframe", str(ckpt), "--version", "v3")
    assert published.returncode == 0, published.stderr
    joined = run_dcr("pull", url, "--join", "-o", str(tmp / "j"))
    assert joined.returncode == 0, joined.stderr
    assert (tmp / "j" / "model.safetensors").read_bytes() == (ckpt / "model.safetensors").read_bytes()


def _fix(url: str, *removed: str) -> str:
    return (
        f"remove {' and '.join(removed)} from {url} and publish it anew with dcr compact {url} --keyframe "
        "CHECKPOINT --version v3 (CHECKPOINT: the checkpoint of v3), then re-run"
    )


def test_a_join_of_a_keyframe_that_lacks_a_file_names_the_republish(tmp_path: Path) -> None:
    url, ckpts, obj = _keyframed(tmp_path)
    obj.unlink()
    line = _refused_join(tmp_path, url)
    assert line.endswith(f"keyframe v3 lacks model.safetensors (removed by gc?); {_fix(url, 'keyframes/v3.json')}")

    assert run_dcr("compact", url, "--keyframe", str(ckpts[3]), "--version", "v3").returncode == 0
    assert not obj.exists()  # the record alone stops a publish (store-v1 §6.1 step 2): it goes first
    (Path(url) / KEYFRAMES / "v3.json").unlink()
    _republish_and_join(tmp_path, url, ckpts[3])


def test_a_join_of_a_corrupt_keyframe_file_names_the_republish_with_that_file(tmp_path: Path) -> None:
    url, ckpts, obj = _keyframed(tmp_path)
    _flip(obj)
    line = _refused_join(tmp_path, url)
    rel = obj.relative_to(url).as_posix()
    assert line.endswith(
        f"is corrupt on the store (its size or BLAKE3 is not its record's); {_fix(url, 'keyframes/v3.json', rel)}"
    )

    (Path(url) / KEYFRAMES / "v3.json").unlink()  # the record alone: the young copy of the right size is kept
    assert run_dcr("compact", url, "--keyframe", str(ckpts[3]), "--version", "v3").returncode == 0
    assert _refused_join(tmp_path, url).endswith(_fix(url, "keyframes/v3.json", rel))
    (Path(url) / KEYFRAMES / "v3.json").unlink()
    obj.unlink()
    _republish_and_join(tmp_path, url, ckpts[3])


def test_a_join_of_a_keyframe_of_other_bits_names_the_republish(tmp_path: Path) -> None:
    url, ckpts, _obj = _keyframed(tmp_path)
    # The record names v3's fingerprint, its file is v2's state (each file as recorded, the whole not).
    other = (ckpts[2] / "model.safetensors").read_bytes()
    digest = digest_bytes(other)
    (Path(url) / KEYFRAMES / "v3" / f"{digest}-model.safetensors").write_bytes(other)
    rel = Path(url) / KEYFRAMES / "v3.json"
    record = json.loads(rel.read_bytes())
    record["files"] = [
        {"name": "model.safetensors", "size": len(other), "digest": digest, "object": f"{digest}-model.safetensors"}
    ]
    rel.write_text(json.dumps(record))
    line = _refused_join(tmp_path, url)
    assert line.endswith(f"keyframe v3 does not hold its recorded fingerprint; {_fix(url, 'keyframes/v3.json')}"), line

    rel.unlink()
    _republish_and_join(tmp_path, url, ckpts[3])


# -- a record that names a manifest of other states --------------------------------------------------------------------


def _point_at(record_path: Path, url: str, other: str) -> None:
    """Make the record at ``record_path`` name version ``other``'s manifest (its digest is right, its states not)."""
    theirs = Store(url).require_version(other)
    record = json.loads(record_path.read_bytes())
    record.update(manifest=theirs.manifest, manifest_bytes=theirs.manifest_bytes)
    record_path.write_text(json.dumps(record))


def test_a_pending_versions_record_of_another_manifest_names_its_republish(tmp_path: Path) -> None:
    url, _ckpts, deltas = _store(tmp_path, pending=True)
    _point_at(Path(url) / "versions" / "v3.json", url, "v2")

    pull = ("pull", url, "-o", str(tmp_path / "p"))
    line = _refused(*pull)
    assert line.endswith(
        f"manifest of version 'v3' does not match its record; remove versions/v3.json from {url} and publish it "
        f"anew with dcr push DELTA {url} (DELTA: the delta of 'v3')"
    ), line
    _nothing_written(tmp_path, "p")
    found = [p for p in check(url).problems if "does not match its version record" in p]  # dcr check says it too
    assert len(found) == 1 and found[0].endswith(line.split("does not match its record", 1)[1]), found

    (Path(url) / "versions" / "v3.json").unlink()
    assert run_dcr("push", str(deltas[2]), url).returncode == 0
    again = run_dcr(*pull)
    assert again.returncode == 0, again.stderr


def test_a_shortcut_record_of_another_manifest_names_the_shortcut_fix(tmp_path: Path) -> None:
    from dcr_cli.store.keyframes import compact

    url, ckpts, _deltas = _store(tmp_path, 4)
    publish_keyframe(url, ckpts[1], version="v1")
    assert compact(url, every=2).published == ["v1..v3"]
    _point_at(Path(url) / "shortcuts" / "v1" / "v3.json", url, "v2")

    pull = ("pull", url, "--since", "v1", "-o", str(tmp_path / "p"))
    line = _refused(*pull)
    assert line.endswith(
        f"manifest of shortcut v1..v3 does not match its record; remove shortcuts/v1/v3.json from {url} and "
        f"publish it anew with dcr compact {url} --every K"
    ), line
    assert not (tmp_path / "p" / "shortcut-v1-v3").exists()

    (Path(url) / "shortcuts" / "v1" / "v3.json").unlink()
    assert run_dcr("compact", url, "--every", "2").returncode == 0
    again = run_dcr(*pull)
    assert again.returncode == 0, again.stderr
    assert (tmp_path / "p" / "shortcut-v1-v3" / "manifest.json").is_file()


def test_a_committed_versions_record_of_another_manifest_names_the_keyframe_way_round(tmp_path: Path) -> None:
    url, ckpts, _deltas = _store(tmp_path)
    _point_at(Path(url) / "versions" / "v2.json", url, "v1")

    line = _refused("pull", url, "--version", "v2", "-o", str(tmp_path / "p"))
    assert line.endswith(
        "manifest of version 'v2' does not match its record; a committed version's record cannot be published "
        f"again: publish a keyframe of the head (dcr compact {url} --keyframe CHECKPOINT) and join from it "
        f"(dcr pull {url} --join -o DIR)"
    ), line
    _nothing_written(tmp_path, "p")

    assert run_dcr("compact", url, "--keyframe", str(ckpts[3])).returncode == 0
    joined = run_dcr("pull", url, "--join", "-o", str(tmp_path / "j"))
    assert joined.returncode == 0, joined.stderr
    assert (tmp_path / "j" / "model.safetensors").read_bytes() == (ckpts[3] / "model.safetensors").read_bytes()
