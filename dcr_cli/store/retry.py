"""Retries with exponential backoff for transient store errors, and only for those.

A transient error is one that the same request may not meet again: a refused
or reset connection, a timeout, an HTTP 5xx, throttling. Everything else
(missing object, access denied, a create-only write that lost, a digest
mismatch) is permanent and is raised at once: retrying it would only delay the
one-line error the user needs.
"""

from __future__ import annotations

import errno
import os
import random
import socket
import time
from collections.abc import Callable
from typing import TypeVar

from ..errors import DcrError

T = TypeVar("T")

DEFAULT_ATTEMPTS = 5
BASE_DELAY_S = 0.25
MAX_DELAY_S = 8.0

# Transport-level failures of the HTTP clients fsspec backends use, matched by
# class name so that no optional client library has to be importable here.
_TRANSIENT_CLASS_NAMES = frozenset(
    {
        "EndpointConnectionError",
        "ConnectionClosedError",
        "ConnectTimeoutError",
        "ReadTimeoutError",
        "HTTPClientError",
        "ResponseStreamingError",
        "IncompleteReadError",
        "IncompleteRead",
        "ResponseParserError",
        "FSTimeoutError",
        "ClientConnectionError",
        "ClientConnectorError",
        "ServerDisconnectedError",
        "ClientPayloadError",
        "ClientOSError",
    }
)
_PERMANENT = (DcrError, FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError, NotADirectoryError)
_TRANSIENT_ERRNOS = frozenset(
    {
        errno.EBUSY,  # s3fs: 503 SlowDown / ServiceUnavailable, 409 OperationAborted
        errno.EAGAIN,
        errno.ETIMEDOUT,
        errno.ECONNRESET,
        errno.ECONNREFUSED,
        errno.ECONNABORTED,
        errno.EPIPE,
        errno.ENETUNREACH,
        errno.EHOSTUNREACH,
        errno.EREMOTEIO,  # s3fs: 500 InternalError
    }
)
_THROTTLE_CODES = frozenset({"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "RequestTimeout"})


def _http_status(exc: BaseException) -> tuple[int | None, str | None]:
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return None, None
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    code = response.get("Error", {}).get("Code")
    return (status if isinstance(status, int) else None), (code if isinstance(code, str) else None)


def is_transient(exc: BaseException) -> bool:
    """Whether the same request might succeed if sent again a little later."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if current is exc and isinstance(current, _PERMANENT):
            return False
        if isinstance(current, (ConnectionError, TimeoutError, socket.timeout)):
            return True
        if any(cls.__name__ in _TRANSIENT_CLASS_NAMES for cls in type(current).__mro__):
            return True
        status, code = _http_status(current)
        if status is not None and (status >= 500 or status == 429):
            return True
        if code in _THROTTLE_CODES:
            return True
        if isinstance(current, OSError) and current.errno in _TRANSIENT_ERRNOS:
            return True
        current = current.__cause__ or current.__context__
    return False


def attempts_from_env() -> int:
    """DCR_STORE_ATTEMPTS overrides how often one store call is tried (default 5)."""
    raw = os.environ.get("DCR_STORE_ATTEMPTS")
    if raw is None:
        return DEFAULT_ATTEMPTS
    try:
        return max(1, int(raw))
    except ValueError:
        raise DcrError(f"DCR_STORE_ATTEMPTS={raw!r} is not an integer") from None


class StoreUnavailable(DcrError):
    """A store call kept failing with transient errors until the retries ran out."""


def retrying(
    fn: Callable[[], T],
    what: str,
    *,
    attempts: int | None = None,
    sleep: Callable[[float], None] = time.sleep,
    on_retry: Callable[[int, BaseException], None] | None = None,
) -> T:
    """Call ``fn``; on a transient error wait (exponential backoff, full jitter) and call it again."""
    attempts = attempts or attempts_from_env()
    for attempt in range(1, attempts + 1):
        try:
            return fn()
        except BaseException as exc:
            if not isinstance(exc, Exception) or not is_transient(exc):
                raise
            if attempt == attempts:
                raise StoreUnavailable(
                    f"{what}: still failing after {attempts} attempts ({describe(exc)}); "
                    "check the endpoint and network, then re-run: finished work is kept"
                ) from exc
            if on_retry is not None:
                on_retry(attempt, exc)
            sleep(random.uniform(0, min(MAX_DELAY_S, BASE_DELAY_S * 2 ** (attempt - 1))))
    raise AssertionError("unreachable")


def describe(exc: BaseException) -> str:
    """A short description of an exception that never includes request headers or credentials."""
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text[:200]}" if text else type(exc).__name__
