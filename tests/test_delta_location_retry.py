"""A delta opened by its location (a delta directory URL, or ``STORE/manifests/<digest>.json``: what a vLLM
worker is handed) reads its manifest and blocks with the store's retries. Before, only a delta opened
through its store retried: the first reset connection on the direct path failed the whole apply (with an
internal error, exit 70), while the store path rode it out. A missing or corrupt block is still refused at
once, never retried.

Faults are real: a TCP proxy in front of moto's S3 server (tests/store_fixtures.py) resets connections.
s3fs's and botocore's own retries are turned off so that what is measured is dcr's.
"""

from __future__ import annotations

import re
import socket
from pathlib import Path
from typing import Any

import pytest
from helpers_checkpoints import copy_checkpoint, read_raw
from store_fixtures import CountingProxy, LoopbackProxy, S3Endpoint, make_deltas

from dcr_cli.api import apply
from dcr_cli.delta.reader import Delta
from dcr_cli.errors import IntegrityError
from dcr_cli.store import Store, push


class ResetFirstReads(LoopbackProxy):
    """Resets the connection carrying each of the first ``FAILS`` GETs of every object: every read fails,
    then works. Twice, as aiohttp sends a request again once on its own when its connection drops."""

    FAILS = 2
    _GET = re.compile(rb"GET (/[^ ?]*)")

    def __init__(self, upstream: str) -> None:
        self.failed: dict[bytes, int] = {}  # object path -> GETs reset
        super().__init__(upstream)

    def seen(self, data: bytes, upstream: bool, state: list[str]) -> None:
        for path in self._GET.findall(data) if upstream else []:
            if self.failed.get(path, 0) < self.FAILS:
                self.failed[path] = self.failed.get(path, 0) + 1
                raise ConnectionResetError  # the pump drops both sides: the client gets no answer


def _through(proxy: LoopbackProxy, endpoint: S3Endpoint) -> dict[str, Any]:
    return {
        **endpoint.storage_options,
        "endpoint_url": proxy.url,
        "skip_instance_cache": True,
        "config_kwargs": {"retries": {"total_max_attempts": 1}, "connect_timeout": 2, "read_timeout": 5},
    }


@pytest.fixture
def published(s3_endpoint: S3Endpoint, s3_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """v1 pushed to an S3 store, the same delta directory uploaded beside it, s3fs's own retries off."""
    import s3fs

    ckpts, (delta,) = make_deltas(tmp_path, 1)
    result = push(delta, s3_url, storage_options=s3_endpoint.storage_options)
    bucket = s3_url.removeprefix("s3://").split("/")[0]
    s3_endpoint.filesystem().put(str(delta), f"{bucket}/delta", recursive=True)
    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 1)
    return {
        "ckpts": ckpts,
        "locations": {
            "store manifest": f"{s3_url}/manifests/{result.manifest}.json",
            "delta directory": f"s3://{bucket}/delta",
        },
        "delta": Delta.open(delta),
    }


@pytest.mark.parametrize("where", ["store manifest", "delta directory"])
def test_a_delta_opened_by_its_location_rides_out_reset_connections(
    published: dict[str, Any], s3_endpoint: S3Endpoint, tmp_path: Path, where: str
) -> None:
    ckpts = published["ckpts"]
    proxy = ResetFirstReads(s3_endpoint.url)
    try:
        delta = Delta.open(published["locations"][where], storage_options=_through(proxy, s3_endpoint))
        receiver = copy_checkpoint(ckpts[0], tmp_path / "receiver")
        apply(delta, into=receiver, workers=1)  # was: EndpointConnectionError on the first reset
    finally:
        proxy.close()
    assert read_raw(receiver) == read_raw(ckpts[1])
    blocks = {f"/blocks/{b.id}".encode() for b in delta.manifest.blocks if b.role == "data"}
    failed = {p for p, n in proxy.failed.items() if n == proxy.FAILS}
    assert all(any(p.endswith(b) for p in failed) for b in blocks)  # every block's first reads failed
    assert any(p.endswith(b".json") for p in failed)  # and the manifest's


@pytest.mark.parametrize("damage", ["missing", "corrupt"])
def test_a_missing_or_corrupt_block_is_not_retried(
    published: dict[str, Any], s3_endpoint: S3Endpoint, s3_url: str, monkeypatch: pytest.MonkeyPatch, damage: str
) -> None:
    block = next(b for b in published["delta"].manifest.blocks if b.role == "data")
    store = Store(s3_url, s3_endpoint.storage_options)
    if damage == "missing":
        store.delete(f"blocks/{block.id}")
    else:
        store.put(f"blocks/{block.id}", bytes([store.read(f"blocks/{block.id}")[0] ^ 1]) + b"\0" * (block.size - 1))
    asked = []
    for attempts in (1, 5):
        monkeypatch.setenv("DCR_STORE_ATTEMPTS", str(attempts))
        proxy = CountingProxy(s3_endpoint.url)
        try:
            delta = Delta.open(published["locations"]["store manifest"], storage_options=_through(proxy, s3_endpoint))
            with pytest.raises((FileNotFoundError, IntegrityError)) as caught:
                for _ in delta.source.chunks(block):
                    pass
        finally:
            proxy.close()
        assert isinstance(caught.value, FileNotFoundError if damage == "missing" else IntegrityError)
        asked.append(proxy.requests_for(f"/blocks/{block.id}"))
    assert asked[0] == asked[1] >= 1, asked  # as many requests with 5 attempts allowed as with 1


def test_reset_connections_that_outlast_the_retries_are_one_error_line(
    published: dict[str, Any], s3_endpoint: S3Endpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every connection reset: the direct path gives up as the store does (StoreUnavailable: one line), not
    with a client library's exception."""
    from dcr_cli.io.retry import StoreUnavailable

    monkeypatch.setenv("DCR_STORE_ATTEMPTS", "2")

    class Refuse(LoopbackProxy):
        def admit(self, conn: socket.socket) -> bool:
            conn.close()
            return False

    proxy = Refuse(s3_endpoint.url)
    try:
        with pytest.raises(StoreUnavailable, match="still failing after 2 attempts"):
            Delta.open(published["locations"]["store manifest"], storage_options=_through(proxy, s3_endpoint))
    finally:
        proxy.close()
