"""Retries with exponential backoff for transient I/O errors, and only for those.

A transient error is one that the same request may not meet again: a refused
or reset connection, a timeout, an HTTP 5xx, throttling. Everything else
(missing object, access denied, a create-only write that lost, a digest
mismatch) is permanent and is raised at once: retrying it would only delay the
one-line error the user needs.

Besides the standard library's notion of a network failure, this module
declares, by fsspec protocol, what each object store's client library (botocore,
gcsfs, azure-core, aiohttp) raises for one (``transient_for``). It is here, below
both the store (``dcr_cli/store``) and the delta reader (``dcr_cli/delta``), so
that one policy serves every read: a store's, and a delta's opened by its
location (a delta directory URL, ``STORE/manifests/<digest>.json``). A client
library is imported only when one of its errors has to be recognised.
"""

from __future__ import annotations

import errno
import http.client
import os
import random
import socket
import time
from collections.abc import Callable, Iterable
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


def _http_transient(status: object) -> bool:
    return isinstance(status, int) and (status >= 500 or status == 429)


def _aiohttp_transient(exc: BaseException) -> bool:
    try:
        import aiohttp
    except ImportError:
        return False
    return isinstance(exc, (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError))


_S3_THROTTLING = frozenset({"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "RequestTimeout"})


def _s3_transient(exc: BaseException) -> bool:
    """s3fs (botocore on aiohttp)."""
    from botocore.exceptions import ClientError, HTTPClientError, IncompleteReadError
    from botocore.exceptions import ConnectionError as BotoConnectionError
    from botocore.parsers import ResponseParserError

    if isinstance(exc, (BotoConnectionError, HTTPClientError, IncompleteReadError, ResponseParserError)):
        return True  # connection closed or reset, timeouts, a truncated response
    if isinstance(exc, ClientError):
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        code = exc.response.get("Error", {}).get("Code")
        # 409 ConditionalRequestConflict: a racing conditional write is in flight; asked again, S3 decides.
        return _http_transient(status) or code in _S3_THROTTLING or code == "ConditionalRequestConflict"
    return _aiohttp_transient(exc)


def _gcs_transient(exc: BaseException) -> bool:
    """gcsfs."""
    from gcsfs.retry import HttpError

    if isinstance(exc, HttpError):
        return _http_transient(exc.code)
    return _aiohttp_transient(exc)


def _azure_transient(exc: BaseException) -> bool:
    """adlfs (azure-core)."""
    from azure.core.exceptions import HttpResponseError, ServiceRequestError, ServiceResponseError

    if isinstance(exc, (ServiceRequestError, ServiceResponseError)):
        return True
    if isinstance(exc, HttpResponseError):
        return _http_transient(exc.status_code)
    return _aiohttp_transient(exc)


_CLIENT_TRANSIENT: dict[str, Classifier] = {
    **dict.fromkeys(("s3", "s3a"), _s3_transient),
    **dict.fromkeys(("gs", "gcs"), _gcs_transient),
    **dict.fromkeys(("az", "abfs", "abfss"), _azure_transient),
}


def transient_for(protocols: str | Iterable[str]) -> Classifier | None:
    """The test for the transient errors of the client library behind an fsspec protocol (a
    filesystem's ``protocol``: one name or several), None where only the standard library's count."""
    for protocol in (protocols,) if isinstance(protocols, str) else protocols:
        if protocol in _CLIENT_TRANSIENT:
            return _CLIENT_TRANSIENT[protocol]
    return None


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
    """Call ``fn``; on a transient error wait (exponential backoff, full jitter) and call it again.

    ``attempts`` (default: DCR_STORE_ATTEMPTS) is looked up at the first transient error only: the
    success path, which every section read of a delta takes, costs one call and a ``try``."""
    attempt = 0
    while True:
        attempt += 1
        try:
            return fn()
        except BaseException as exc:
            if not isinstance(exc, Exception) or not is_transient(exc, transient):
                raise
            attempts = attempts or attempts_from_env()
            if attempt >= attempts:
                raise StoreUnavailable(
                    f"{what}: still failing after {attempts} attempts ({describe(exc)}); "
                    "check the endpoint and network, then re-run: finished work is kept"
                ) from exc
            if on_retry is not None:
                on_retry(attempt, exc)
            sleep(random.uniform(0, min(MAX_DELAY_S, BASE_DELAY_S * 2 ** (attempt - 1))))


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
