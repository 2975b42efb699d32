"""Transient store errors are retried with backoff; permanent ones are not.

Faults are real: a TCP proxy in front of the S3 endpoint resets the first
connections it accepts, or all of them. s3fs's and botocore's own retries are
turned off so that what is measured is dcr's.
"""

from __future__ import annotations

import errno
import socket
import struct
from pathlib import Path
from typing import Any

import pytest
from store_fixtures import LoopbackProxy, S3Endpoint, make_deltas

from dcr_cli.errors import IntegrityError
from dcr_cli.io.retry import StoreUnavailable, is_transient, retrying
from dcr_cli.store import Store, pull, push


class FlakyProxy(LoopbackProxy):
    """Resets the first ``drop`` connections it accepts (or all, drop=-1); counts requests forwarded."""

    def __init__(self, upstream: str, drop: int) -> None:
        self.drop = drop
        self.accepted = 0
        self.requests = 0
        super().__init__(upstream)

    def admit(self, conn: socket.socket) -> bool:
        with self.lock:
            self.accepted += 1
            reset = self.drop < 0 or self.accepted <= self.drop
        if reset:
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.close()
        return not reset

    def seen(self, data: bytes, upstream: bool, state: list[str]) -> None:
        if upstream:
            self.requests += data.count(b" HTTP/1.1\r\n")


def _options(proxy: FlakyProxy, endpoint: S3Endpoint) -> dict[str, Any]:
    return {
        **endpoint.storage_options,
        "endpoint_url": proxy.url,
        "skip_instance_cache": True,
        "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 2, "read_timeout": 5},
    }


def _store(url: str, proxy: FlakyProxy, endpoint: S3Endpoint) -> Store:
    store = Store(url, _options(proxy, endpoint))
    store.fs.retries = 1  # s3fs's own retry loop off: dcr's is under test
    return store


def test_reset_connections_are_retried_until_they_succeed(
    s3_endpoint: S3Endpoint, s3_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    Store(s3_url, s3_endpoint.storage_options).put("blocks/x", b"payload")
    # Without dcr's retries the resets are fatal: the client's own retries are off...
    monkeypatch.setenv("DCR_STORE_ATTEMPTS", "1")
    proxy = FlakyProxy(s3_endpoint.url, drop=8)
    try:
        with pytest.raises(StoreUnavailable):
            _store(s3_url, proxy, s3_endpoint).read("blocks/x")
    finally:
        proxy.close()
    # ...and with them, the same faults are ridden out.
    monkeypatch.setenv("DCR_STORE_ATTEMPTS", "8")
    proxy = FlakyProxy(s3_endpoint.url, drop=8)
    try:
        assert _store(s3_url, proxy, s3_endpoint).read("blocks/x") == b"payload"
        assert proxy.accepted > 8
    finally:
        proxy.close()


def test_retries_give_up_with_a_clear_error(
    s3_endpoint: S3Endpoint, s3_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    accepted = {}
    for attempts in (1, 3):
        monkeypatch.setenv("DCR_STORE_ATTEMPTS", str(attempts))
        proxy = FlakyProxy(s3_endpoint.url, drop=-1)
        try:
            with pytest.raises(StoreUnavailable, match=f"still failing after {attempts} attempts"):
                _store(s3_url, proxy, s3_endpoint).read("blocks/x")
            accepted[attempts] = proxy.accepted
        finally:
            proxy.close()
    # One dcr attempt may open a few connections (the HTTP client reconnects on its own); three open more.
    assert 1 <= accepted[1] < accepted[3]


def test_permanent_errors_are_not_retried(
    s3_endpoint: S3Endpoint, s3_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 404 or a lost create-only race costs the same requests whether 1 or 5 attempts are allowed."""
    costs: dict[str, list[int]] = {"missing": [], "exists": []}
    for attempts in (1, 5):
        monkeypatch.setenv("DCR_STORE_ATTEMPTS", str(attempts))
        proxy = FlakyProxy(s3_endpoint.url, drop=0)
        try:
            store = _store(s3_url, proxy, s3_endpoint)
            store.put("blocks/x", b"1")
            before = proxy.requests
            with pytest.raises(FileNotFoundError):
                store.read("blocks/missing")
            costs["missing"].append(proxy.requests - before)
            before = proxy.requests
            with pytest.raises(FileExistsError):
                store.create("blocks/x", b"2")
            costs["exists"].append(proxy.requests - before)
        finally:
            proxy.close()
    assert costs["missing"][0] == costs["missing"][1] >= 1
    assert costs["exists"] == [1, 1]


def test_push_and_pull_ride_out_resets(
    s3_endpoint: S3Endpoint, s3_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import s3fs

    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 1)  # s3fs's own retry loop off: dcr's is under test
    _, (d1,) = make_deltas(tmp_path, 1)
    proxy = FlakyProxy(s3_endpoint.url, drop=3)
    try:
        opts = _options(proxy, s3_endpoint)
        assert push(d1, s3_url, storage_options=opts).version == "v1"
        assert pull(s3_url, tmp_path / "out", storage_options=opts).version == "v1"
        assert proxy.accepted > 3
    finally:
        proxy.close()


def test_classification_of_real_exceptions() -> None:
    from botocore.exceptions import ClientError, EndpointConnectionError

    from dcr_cli.store.backends import backend_class

    s3 = backend_class("s3").transient  # what botocore raises is known to the s3:// backend

    def client_error(status: int, code: str) -> ClientError:
        return ClientError({"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject")

    for transient in (
        ConnectionResetError(),
        TimeoutError(),
        EndpointConnectionError(endpoint_url="http://x"),
        OSError(errno.EBUSY, "SlowDown"),  # how s3fs reports a 503
        client_error(503, "SlowDown"),
        client_error(500, "InternalError"),
    ):
        assert is_transient(transient, s3), transient
    for permanent in (
        FileNotFoundError(),
        FileExistsError(),
        PermissionError(),
        IntegrityError("digest"),
        client_error(403, "AccessDenied"),
        ValueError("bad"),
    ):
        assert not is_transient(permanent, s3), permanent

    calls: list[int] = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionResetError
        return "ok"

    delays: list[float] = []
    assert retrying(flaky, "x", attempts=5, sleep=delays.append) == "ok"
    assert len(calls) == 3 and len(delays) == 2 and all(d >= 0 for d in delays)
