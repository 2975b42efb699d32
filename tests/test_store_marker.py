"""The store marker (dcr-store.json) is read first by every command: damaged, it fails each of them the same
way, with one line that names it, whether or not the command goes on to use the genesis it records, and on
a local store as on S3 (which answers any range of an empty object with 416, not with its empty bytes)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from checkpoints import read_bits
from store_fixtures import S3Endpoint, make_deltas, one_error_line, run_dcr

from dcr_cli.store import Store, push


def _apply_from(url: str, ckpt: Path, env: dict[str, str] | None = None) -> str:
    proc = run_dcr("apply", url, "--version", "v1", "--into", str(ckpt), env=env)
    assert proc.returncode != 0, proc.stdout
    return one_error_line(proc)


@pytest.mark.parametrize(
    "genesis",
    [{"version": "../../evil", "fingerprint": "0" * 64}, {"version": "v0"}, "v0", None],
    ids=["a-path", "no-fingerprint", "a-string", "absent"],
)
def test_a_marker_with_a_damaged_genesis_fails_an_apply_that_never_asks_for_the_genesis(
    tmp_path: Path, genesis: object
) -> None:
    ckpts, (d1,) = make_deltas(tmp_path, 1)
    url = str(tmp_path / "store")
    push(d1, url)
    marker = json.loads((tmp_path / "store" / "dcr-store.json").read_text())
    marker["genesis"] = genesis
    (tmp_path / "store" / "dcr-store.json").write_text(json.dumps(marker))
    receiver = tmp_path / "receiver"
    shutil.copytree(ckpts[0], receiver)
    line = _apply_from(url, receiver)
    assert "dcr-store.json genesis" in line, line
    assert read_bits(receiver) == read_bits(ckpts[0])  # nothing written


def test_an_empty_marker_on_s3_is_named_as_on_a_local_store(
    s3_endpoint: S3Endpoint, s3_url: str, tmp_path: Path
) -> None:
    ckpts, (d1,) = make_deltas(tmp_path, 1)
    lines = []
    for url, options, env in (
        (str(tmp_path / "store"), None, None),
        (s3_url, s3_endpoint.storage_options, s3_endpoint.env()),
    ):
        push(d1, url, storage_options=options)
        store = Store(url, options)
        store.delete("dcr-store.json")
        store.put("dcr-store.json", b"")
        assert Store(url, options).read("dcr-store.json") == b""  # S3: a 416 for the range, read as empty
        receiver = tmp_path / f"receiver-{len(lines)}"
        shutil.copytree(ckpts[0], receiver)
        lines.append(_apply_from(url, receiver, env))
        assert read_bits(receiver) == read_bits(ckpts[0])
    local, s3 = (line.split("dcr-store.json", 1) for line in lines)
    assert len(local) == len(s3) == 2 and local[1] == s3[1], lines  # the same message after the object's name
