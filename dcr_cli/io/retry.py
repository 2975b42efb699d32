"""Retries with exponential backoff for transient I/O errors, and only for those.

A transient error is one that the same request may not meet again: a refused
or reset connection, a timeout, an HTTP 5xx, throttling. Everything else
(missing object, access denied, a create-only write that lost, a digest
mismatch) is permanent and is raised at once: retrying it would only delay the
one-line error the user needs.

This module knows only the standard library's notion of a network failure.
What a client library raises for one (botocore, aiohttp, azure-core, ...) is
declared by that library's store backend (``dcr_cli/store/backends.py``) and
passed in as ``transient``.
"""

from __future__ import annotations

import errno
import http.client
import os
import random
import socket
import time
from collections.abc import Callable
from typing import TypeVar

from ..errors import DcrError

T = TypeVar("T")
Classifier = Callable[[BaseException], bool]

DEFAULT_ATTEMPTS = 5
BASE_DELAY_S = 0.25
MAX_DELAY_S = 8.0

_PERMANENT = (DcrError, FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError, NotADirectoryError)
_TRANSIENT_TYPES = (
    ConnectionError,
    TimeoutError,
    socket.timeout,
    http.client.IncompleteRead,
    http.client.BadStatusLine,
)
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


def is_transient(exc: BaseException, transient: Classifier | None = None) -> bool:
    """Whether the same request might succeed if sent again a little later.

    The exception and its causes are examined in turn; ``transient`` is the backend's own test for
    the errors of its client library.
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if current is exc and isinstance(current, _PERMANENT):
            return False
        if isinstance(current, _TRANSIENT_TYPES):
            return True
        if isinstance(current, OSError) and current.errno in _TRANSIENT_ERRNOS:
            return True
        if transient is not None and transient(current):
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
    transient: Classifier | None = None,
    sleep: Callable[[float], None] = time.sleep,
    on_retry: Callable[[int, BaseException], None] | None = None,
) -> T:
    """Call ``fn``; on a transient error wait (exponential backoff, full jitter) and call it again."""
    attempts = attempts or attempts_from_env()
    for attempt in range(1, attempts + 1):
        try:
            return fn()
        except BaseException as exc:
            if not isinstance(exc, Exception) or not is_transient(exc, transient):
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


def calling(fn: Callable[[], T], what: str, transient: Classifier | None = None) -> T:
    """``retrying``, and any client-library error that is not an OSError becomes one DcrError line."""
    try:
        return retrying(fn, what, transient=transient)
    except (DcrError, OSError):
        raise
    except Exception as exc:  # client library errors (credentials, parameters...): one line, no traceback
        raise DcrError(f"{what} failed: {describe(exc)}") from exc


def describe(exc: BaseException) -> str:
    """A short description of an exception that never includes request headers or credentials."""
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text[:200]}" if text else type(exc).__name__
