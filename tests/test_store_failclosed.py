"""Fail-closed corners of the store: a torn apply before the repair blocks are up (exit 4, not 2), keyframes
published atomically and found without listing the store, gc against a shortcut published while it runs.

Real parts: the local store and moto's S3 server (tests/store_fixtures.py), the real CLI for exit codes.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import pytest
from helpers_checkpoints import copy_checkpoint, read_raw
from store_fixtures import S3Endpoint, big_delta, run_dcr

from dcr_cli.api import apply
from dcr_cli.delta.reader import Delta
from dcr_cli.receive.checkpoint import inplace
from dcr_cli.store import Store, push
from dcr_cli.store.transfer import PushResult, split_roles


@pytest.fixture
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, dict[str, Any], dict[str, str] | None]:
    if request.param == "local":
        return str(tmp_path / "store"), {}, None
    endpoint: S3Endpoint = request.getfixturevalue("s3_endpoint")
    return request.getfixturevalue("s3_url"), endpoint.storage_options, endpoint.env()


def _tear(receiver: Path, url: str, opts: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """An apply from the store whose first write lands half its bytes and fails (as a crash would)."""
    real = inplace._write_values

    def write(fd: int, offset: int, data: memoryview) -> None:
        real(fd, offset, data[: len(data) // 2])
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(inplace, "_write_values", write)
    with pytest.raises(OSError):
        apply(url, into=receiver, version="v1", storage_options=opts, workers=1)
    monkeypatch.undo()


def _one_error_line(proc: Any) -> str:
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dcr: error: "), proc.stderr
    return str(lines[0])


# -- 1. a torn apply before the repair blocks are up ------------------------------------------------------------------


@pytest.mark.parametrize("store_url", ["local", "s3"], indirect=True)
def test_a_torn_apply_before_the_repair_upload_is_not_ready_and_after_a_loss_is_damage(
    store_url: tuple[str, dict[str, Any], dict[str, str] | None], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, opts, env = store_url
    delta = big_delta(tmp_path, sparse=True)
    _data, repair_blocks = split_roles(Delta.open(delta).manifest)
    torn = copy_checkpoint(tmp_path / "big-c0", tmp_path / "torn")
    refused: list[Any] = []

    def published(_: PushResult) -> None:
        # The version is visible, its repair blocks are not up yet (the push uploads them next).
        store = Store(url, opts)
        assert not any(store.exists(f"blocks/{b.id}") for b in repair_blocks)
        assert not store.exists("complete/v1")
        _tear(torn, url, opts, monkeypatch)
        before = read_raw(torn)
        refused.append(run_dcr("apply", url, "--version", "v1", "--into", str(torn), env=env))
        assert read_raw(torn) == before  # nothing written

    push(delta, url, storage_options=opts, on_published=published)
    (proc,) = refused
    line = _one_error_line(proc)
    assert proc.returncode == 4, proc.stderr  # not ready: retry once the push has finished
    assert "torn" in line and "does not have it yet" in line and "re-run dcr push DELTA" in line

    # The push finished: the same apply now repairs the torn item and reaches v1 bit-exactly.
    result = apply(url, into=torn, version="v1", storage_options=opts)
    assert result.steps[0].repaired >= 1 and read_raw(torn) == read_raw(tmp_path / "big-c1")

    # A repair block lost after the push marked v1 complete: damage (exit 2), with the advice to restore it.
    store = Store(url, opts)
    assert store.exists("complete/v1")
    torn2 = copy_checkpoint(tmp_path / "big-c0", tmp_path / "torn2")
    _tear(torn2, url, opts, monkeypatch)
    for b in repair_blocks:
        store.delete(f"blocks/{b.id}")
    before = read_raw(torn2)
    lost = run_dcr("apply", url, "--version", "v1", "--into", str(torn2), env=env)
    line = _one_error_line(lost)
    assert lost.returncode == 2 and "lost it" in line and f"restore it with dcr push DELTA {url}" in line
    assert read_raw(torn2) == before

    # The same block absent from a version without complete/v1 is pending again (exit 4).
    store.delete("complete/v1")
    again = run_dcr("apply", url, "--version", "v1", "--into", str(torn2), env=env)
    assert again.returncode == 4 and "does not have it yet" in _one_error_line(again)
    assert read_raw(torn2) == before

    push(delta, url, storage_options=opts)  # restores the repair blocks and complete/v1
    assert apply(url, into=torn2, version="v1", storage_options=opts).steps[0].repaired >= 1
    assert read_raw(torn2) == read_raw(tmp_path / "big-c1")
