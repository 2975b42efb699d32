"""A delta opened by its store location, ``STORE/manifests/<digest>.json`` (the location a Delta opened
through the store hands on, e.g. to a vLLM worker), tells a missing repair block apart as the store
path does (store-v1 §4.1): exit 4 while the version's push may still be uploading its repair blocks,
exit 2 once the version is complete. Before, the direct path always said exit 2 ("fetch the delta with
its repair blocks"), so a receiver that would have been told to retry was told its input was bad."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from helpers_checkpoints import read_raw
from store_fixtures import big_delta, delta_to_tear, one_error_line, run_dcr, tear_from_store

from dcr_cli.api import apply
from dcr_cli.delta.reader import Delta
from dcr_cli.errors import DcrError
from dcr_cli.store import Store, push


def _apply_direct(direct: str, into: Path, env: dict[str, str] | None) -> tuple[int, str]:
    """(exit code, error line) of ``dcr apply STORE/manifests/<digest>.json --into into``. On a local store
    the API is asked too, with the Delta that location opens (a vLLM worker's path): the same answer."""
    proc = run_dcr("apply", direct, "--into", str(into), env=env)
    line = one_error_line(proc) if proc.returncode else ""
    if env is None:
        try:
            apply(Delta.open(direct), into=into, workers=1)
            code = 0
        except DcrError as exc:
            code = exc.exit_code
        assert code == proc.returncode, (code, line)
    return proc.returncode, line


@pytest.mark.parametrize("store_url", ["local", "s3"], indirect=True)
def test_a_direct_store_manifest_says_not_ready_while_repair_blocks_are_still_to_come(
    store_url: tuple[str, dict[str, Any], dict[str, str] | None], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, opts, env = store_url
    delta, repair, torn = delta_to_tear(tmp_path)
    result = push(delta, url, storage_options=opts)
    store = Store(url, opts)
    direct = f"{url}/manifests/{result.manifest}.json"
    tear_from_store(torn, url, opts, monkeypatch)
    before = read_raw(torn)

    # The push published v1 and is still uploading its repair blocks (no complete/v1 yet).
    for b in repair:
        store.delete(f"blocks/{b.id}")
    store.delete("complete/v1")
    via_store = run_dcr("apply", url, "--version", "v1", "--into", str(torn), env=env)
    code, line = _apply_direct(direct, torn, env)
    assert via_store.returncode == 4, via_store.stderr
    assert code == 4, line  # was 2
    assert "repair block is not here" in line and f"{url} does not have it yet" in line
    assert "still uploading repair blocks" in line and f"dcr push DELTA {url}" in line
    assert read_raw(torn) == before

    # Once the version is complete, a missing repair block is damage: exit 2 on both paths.
    store.put("complete/v1", b"")
    via_store = run_dcr("apply", url, "--version", "v1", "--into", str(torn), env=env)
    code, line = _apply_direct(direct, torn, env)
    assert via_store.returncode == code == 2, line
    assert "lost it although version 'v1' is complete" in line
    assert read_raw(torn) == before

    # With the repair blocks back, the direct path repairs the torn receiver bit-exactly.
    assert push(delta, url, storage_options=opts).already_published
    code, line = _apply_direct(direct, torn, env)
    assert code == 0, line
    assert read_raw(torn) == read_raw(tmp_path / "big-c1")


def test_a_direct_store_manifest_no_record_names_is_refused_as_bad_input(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A manifest that no published version (or shortcut) names: the store cannot promise a repair
    upload for it, so a missing repair block is bad input (exit 2), and the line says what to do."""
    delta, repair, torn = delta_to_tear(tmp_path)
    url = str(tmp_path / "store")
    result = push(delta, url)
    tear_from_store(torn, url, {}, monkeypatch)
    before = read_raw(torn)
    for b in repair:
        (tmp_path / "store" / "blocks" / b.id).unlink()
    (tmp_path / "store" / "complete" / "v1").unlink()
    record = tmp_path / "store" / "versions" / "v1.json"
    obj = json.loads(record.read_text())
    obj["manifest"] = "0" * 64  # v1 now names another manifest
    record.write_text(json.dumps(obj))
    code, line = _apply_direct(f"{url}/manifests/{result.manifest}.json", torn, None)
    assert code == 2, line
    assert "publishes no version or shortcut with this manifest" in line and "--version" in line
    assert read_raw(torn) == before


def test_a_delta_directory_laid_out_like_a_store_keeps_the_plain_answer(tmp_path: Path) -> None:
    """No dcr-store.json above manifests/: not a store, so a missing repair block is the plain exit-2 line."""
    from dcr_cli.delta.source import StoreManifestSource
    from dcr_cli.errors import IntegrityError

    delta = big_delta(tmp_path, sparse=True)
    fake = tmp_path / "fake"
    (fake / "manifests").mkdir(parents=True)
    raw = (delta / "manifest.json").read_bytes()
    opened = Delta.open(delta)
    (fake / "manifests" / f"{opened.id}.json").write_bytes(raw)
    direct = Delta.open(fake / "manifests" / f"{opened.id}.json")
    assert isinstance(direct.source, StoreManifestSource)
    error = direct.source.missing_repair("item: torn")
    assert type(error) is IntegrityError and "fetch the delta with its repair blocks" in str(error)


def test_a_direct_shortcut_manifest_is_always_complete(tmp_path: Path) -> None:
    """A shortcut's blocks all precede its record (store-v1 §6.2): a missing one is lost (exit 2), and the
    line names the shortcut, found by its labels (shortcuts/<base>/<target>.json) and its digest."""
    from store_fixtures import make_deltas

    from dcr_cli.store import acknowledge, commit
    from dcr_cli.store.keyframes import compact, publish_keyframe, shortcuts

    url = str(tmp_path / "store")
    ckpts, deltas = make_deltas(tmp_path, 2)
    for i, d in enumerate(deltas, start=1):
        push(d, url)
        acknowledge(url, f"v{i}", "r")
        commit(url, f"v{i}", receivers=["r"])
    publish_keyframe(url, ckpts[0], version="v0")
    assert compact(url, every=2).published == ["v0..v2"]
    (shortcut,) = shortcuts(Store(url))
    direct = Delta.open(f"{url}/manifests/{shortcut.record.manifest}.json")
    error = direct.source.missing_repair("'w': torn")
    assert error.exit_code == 2 and "lost it although shortcut v0..v2 is complete" in str(error), error
    # The fix that restores a shortcut (dcr push cannot; dcr compact keeps one whose record is there).
    assert f"remove shortcuts/v0/v2.json from {url} and publish it anew with dcr compact {url} --every K" in str(error)
    assert "dcr push" not in str(error), error
    # The version v2 itself (its own manifest) is complete too: pushed to the end, complete/v2 written.
    record = Store(url).version("v2")
    assert record is not None
    error = Delta.open(f"{url}/manifests/{record.manifest}.json").source.missing_repair("'w': torn")
    assert error.exit_code == 2 and "lost it although version 'v2' is complete" in str(error), error
    assert f"restore it with dcr push DELTA {url}, then re-run" in str(error) and "compact" not in str(error), error
    (tmp_path / "store" / "complete" / "v2").unlink()
    error = Delta.open(f"{url}/manifests/{record.manifest}.json").source.missing_repair("'w': torn")
    assert error.exit_code == 4 and "does not have it yet" in str(error), error


def test_a_hostile_version_record_fails_closed_with_one_line(tmp_path: Path) -> None:
    """The record is read strictly (store-v1 §3): duplicate keys, a FIFO in its place: exit 2, no hang."""
    from store_fixtures import make_deltas

    url = str(tmp_path / "store")
    _ckpts, deltas = make_deltas(tmp_path, 1)
    manifest = push(deltas[0], url).manifest
    record = tmp_path / "store" / "versions" / "v1.json"
    text = record.read_text().rstrip()
    assert text.endswith("}")
    record.write_text(text[:-1] + f', "manifest": "{manifest}"}}')  # a second "manifest" key
    error = Delta.open(f"{url}/manifests/{manifest}.json").source.missing_repair("'w': torn")
    assert error.exit_code == 2 and "asking" in str(error) and "duplicate key" in str(error), error
    record.unlink()
    os.mkfifo(record)
    error = Delta.open(f"{url}/manifests/{manifest}.json").source.missing_repair("'w': torn")
    assert error.exit_code == 2 and "FIFO" in str(error), error
