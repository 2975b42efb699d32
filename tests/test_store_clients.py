"""The S3 client dcr opens: dcr's defaults (more connections than botocore's 10) are added to what the user
configured, never in its place, whether the options come from ``-S`` or from fsspec's own configuration
(``FSSPEC_S3_*``, which the README names); and a store and a delta opened by its location share one client."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import fsspec
import pytest
from store_fixtures import LoopbackProxy, S3Endpoint, make_deltas

from dcr_cli.delta.reader import Delta
from dcr_cli.io.clients import S3_CONNECTIONS, client_options
from dcr_cli.store import Store, push


class Sniff(LoopbackProxy):
    """Counts the requests, and those whose headers carry ``tag``."""

    def __init__(self, upstream: str, tag: bytes) -> None:
        self.tag, self.requests, self.tagged = tag, 0, 0
        super().__init__(upstream)

    def seen(self, data: bytes, upstream: bool, state: list[str]) -> None:
        if upstream and b" HTTP/1.1\r\n" in data:
            self.requests += 1
            self.tagged += self.tag in data


def test_what_fsspecs_configuration_sets_for_s3_still_reaches_the_client(
    s3_endpoint: S3Endpoint, s3_url: str, tmp_path: Path
) -> None:
    _, (d1,) = make_deltas(tmp_path, 1)
    push(d1, s3_url, storage_options=s3_endpoint.storage_options)
    proxy = Sniff(s3_endpoint.url, b"dcr-test-from-fsspec-conf")
    env = {**s3_endpoint.env(), "FSSPEC_S3_CONFIG_KWARGS": '{"user_agent_extra": "dcr-test-from-fsspec-conf"}'}
    try:
        out = subprocess.run(
            [sys.executable, "-m", "dcr_cli", "status", s3_url, "-S", f"endpoint_url={proxy.url}"],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        proxy.close()
    assert out.returncode == 0, out.stderr
    assert proxy.requests and proxy.tagged == proxy.requests, (proxy.requests, proxy.tagged)


@pytest.mark.parametrize(
    ("given", "configured", "expected"),
    [
        ({}, {}, {"max_pool_connections": S3_CONNECTIONS}),
        ({}, {"connect_timeout": 7}, {"connect_timeout": 7, "max_pool_connections": S3_CONNECTIONS}),
        ({"config_kwargs": {"retries": {"max_attempts": 2}}}, {"connect_timeout": 7}, None),
        ({"config_kwargs": {"max_pool_connections": 5}}, {}, {"max_pool_connections": 5}),
        ({}, {"max_pool_connections": 5}, None),
    ],
    ids=["defaults", "fsspec-config-kept", "options-win-whole", "options-limit-kept", "config-limit-kept"],
)
def test_client_options_add_dcrs_connections_to_what_was_configured(
    monkeypatch: pytest.MonkeyPatch, given: dict[str, Any], configured: dict[str, Any], expected: dict[str, Any] | None
) -> None:
    monkeypatch.setitem(fsspec.config.conf, "s3", {"config_kwargs": configured} if configured else {})
    # What the client gets: fsspec fills in its configuration's keys that the options leave out.
    got = client_options("s3://bucket/run", given).get("config_kwargs", configured or None)
    if expected is None:  # what the user gave (or configured) stays as it is, dcr's count added where unset
        expected = {**(given.get("config_kwargs") or configured)}
        expected.setdefault("max_pool_connections", S3_CONNECTIONS)
    assert got == expected
    assert client_options("/local/store", given) == given  # only S3 clients get dcr's defaults


def test_a_store_and_a_delta_opened_by_its_location_share_one_client(
    s3_endpoint: S3Endpoint, s3_url: str, tmp_path: Path
) -> None:
    _, (d1,) = make_deltas(tmp_path, 1)
    opts = s3_endpoint.storage_options
    push(d1, s3_url, storage_options=opts)
    store = Store(s3_url, opts)
    record = store.require_version("v1")
    delta = Delta.open(f"{s3_url}/manifests/{record.manifest}.json", storage_options=opts)
    assert delta.source.fs is store.fs
