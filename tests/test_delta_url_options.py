"""A delta directory at a URL (``s3://bucket/delta``, not a store) is opened with the storage options the
command was given. Before, ``open_delta`` checked whether the URL was a store with them and then opened
the delta without them, so ``dcr apply s3://bucket/delta -S endpoint_url=...`` went to the default
endpoint instead.

Real parts: moto's S3 server on 127.0.0.1 (tests/store_fixtures.py), the real CLI. The environment's
default endpoint is a closed port, so a read that ignores the options fails at once instead of passing
by luck.
"""

from __future__ import annotations

from pathlib import Path

import fsspec
import pytest
from helpers_checkpoints import copy_checkpoint, read_raw
from store_fixtures import S3Endpoint, free_port, json_out, make_deltas, run_dcr

from dcr_cli.delta.reader import Delta
from dcr_cli.store import Store, open_delta, push


def _dead_default_env(s3_endpoint: S3Endpoint) -> dict[str, str]:
    """The dcr subprocess environment with fsspec's default S3 endpoint on a port nothing listens on."""
    return {**s3_endpoint.env(), "FSSPEC_S3_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}", "AWS_MAX_ATTEMPTS": "1"}


def _delta_at_url(s3_endpoint: S3Endpoint, s3_url: str, tmp_path: Path) -> tuple[list[Path], Path, str]:
    """(checkpoints, local delta, the same delta directory uploaded to ``s3://<bucket>/delta``)."""
    ckpts, (delta,) = make_deltas(tmp_path, 1)
    bucket = s3_url.removeprefix("s3://").split("/")[0]
    s3_endpoint.filesystem().put(str(delta), f"{bucket}/delta", recursive=True)
    return ckpts, delta, f"s3://{bucket}/delta"


def test_open_delta_reads_a_delta_directory_url_through_the_given_endpoint(
    s3_endpoint: S3Endpoint, s3_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _ckpts, delta, url = _delta_at_url(s3_endpoint, s3_url, tmp_path)
    # In this process, fsspec's configured default (what FSSPEC_S3_ENDPOINT_URL sets) is the closed port.
    monkeypatch.setitem(fsspec.config.conf, "s3", {"endpoint_url": f"http://127.0.0.1:{free_port()}"})
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    opened = open_delta(url, storage_options={**s3_endpoint.storage_options, "skip_instance_cache": True})
    assert opened.id == Delta.open(delta).id  # was: EndpointConnectionError to the closed port
    opened.verify_blocks()  # the blocks come through the given endpoint too


def test_apply_and_verify_read_a_delta_directory_url_through_the_given_endpoint(
    s3_endpoint: S3Endpoint, s3_url: str, tmp_path: Path
) -> None:
    ckpts, _delta, url = _delta_at_url(s3_endpoint, s3_url, tmp_path)
    env = _dead_default_env(s3_endpoint)
    option = f"endpoint_url={s3_endpoint.url}"

    receiver = copy_checkpoint(ckpts[0], tmp_path / "receiver")
    proc = run_dcr("apply", url, "--into", str(receiver), "-S", option, env=env)
    assert proc.returncode == 0, proc.stderr  # was: a connection error to the default endpoint
    assert read_raw(receiver) == read_raw(ckpts[1])

    report = json_out(run_dcr("verify", str(receiver), "--against", url, "-S", option, "--json", env=env))
    assert report["ok"] is True, report


def test_push_reads_a_delta_directory_url_through_the_given_endpoint(
    s3_endpoint: S3Endpoint, s3_url: str, tmp_path: Path
) -> None:
    _ckpts, delta, url = _delta_at_url(s3_endpoint, s3_url, tmp_path)
    proc = run_dcr("push", url, s3_url, "-S", f"endpoint_url={s3_endpoint.url}", env=_dead_default_env(s3_endpoint))
    assert proc.returncode == 0, proc.stderr
    assert Store(s3_url, s3_endpoint.storage_options).version("v1") is not None
    # The same delta pushed from its local copy is already there: the bytes read from the URL were the delta's.
    assert push(delta, s3_url, storage_options=s3_endpoint.storage_options).already_published
