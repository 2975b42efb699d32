"""Store backends, keyed by fsspec protocol: what each one can do, and how (format_spec/store-v1.md §2).

As in fsspec's ``registry.py``, a protocol names a small class; as in zarr's ``abc/store.py``, the
class declares its capabilities instead of callers guessing them. A backend's client library (boto,
aiohttp, azure-core) is imported only when one of its errors has to be recognised, and a missing
filesystem package gives an install hint. Nothing here looks at module or class names: errors are
recognised by the exception classes the backend's own library defines.

Capabilities:

* ``atomic_create``: how a create-only write is made atomic (None: it cannot be, and publishing
  needs ``--allow-unsafe-publish``);
* ``listing_times``: listings carry modification times (``dcr gc`` ages unreferenced objects by them);
* ``local_files``: objects are files of this machine (writes go through a temporary name and rename);
* ``streamed_writes``: ``put_chunks`` sends an object in parts as its chunks come, several at once (memory
  holds a few parts, not the object), and publishes nothing if the chunks fail.
"""

from __future__ import annotations

import collections
import contextlib
import os
import threading
import uuid
import weakref
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from typing import Any, ClassVar

import fsspec

from ..errors import DcrError
from ..io.clients import client_options
from ..io.files import fsync_dir
from ..io.reading import read_regular_file
from ..io.retry import describe, transient_for

S3_PART_BYTES = 8 << 20  # one part of a multipart upload (S3's minimum is 5 MiB)
S3_PARTS_IN_FLIGHT = 4  # parts of one object uploaded at once
# What one streamed upload holds in memory at most: the parts in flight, the part being cut, a chunk.
S3_STREAM_HOLD_BYTES = (S3_PARTS_IN_FLIGHT + 2) * S3_PART_BYTES
TMP_PREFIX = ".tmp-"  # local stores: objects being written; never a valid name of anything else


@dataclass(frozen=True)
class Capabilities:
    atomic_create: str | None
    listing_times: bool = True
    local_files: bool = False
    streamed_writes: bool = False


class Backend:
    """A filesystem without atomic create: whole-object writes only (one PUT or one write)."""

    protocols: ClassVar[tuple[str, ...]] = ()
    package: ClassVar[str | None] = None  # what to pip install for this protocol
    capabilities: ClassVar[Capabilities] = Capabilities(atomic_create=None)
    time_keys: ClassVar[tuple[str, ...]] = ("mtime", "LastModified", "last_modified", "created")

    def __init__(self, fs: fsspec.AbstractFileSystem) -> None:
        self.fs = fs

    @property
    def name(self) -> str:
        return type(self.fs).__name__

    def read(self, path: str, start: int | None = None, end: int | None = None) -> bytes:
        """Bytes ``start:end`` of an object (all of it by default); FileNotFoundError if it is absent."""
        return bytes(self.fs.cat_file(path, start=start, end=end))

    def ls(self, path: str) -> list[dict[str, Any]]:
        """The listing entries (``name``, ``type``, ``size``, times) directly under ``path``, asked afresh; []
        if there are none."""
        self.fs.invalidate_cache(path)
        try:
            return list(self.fs.ls(path, detail=True))
        except FileNotFoundError:
            return []

    def info(self, path: str) -> dict[str, Any] | None:
        """The object's listing entry (size, times), asked afresh; None if there is no object of that name."""
        self.fs.invalidate_cache(path)
        try:
            entry = self.fs.info(path)
        except (FileNotFoundError, NotADirectoryError):  # NotADirectory: a local path under a file (x.json/...)
            return None
        return None if entry.get("type") == "directory" else dict(entry)

    def put(self, path: str, data: bytes) -> None:
        """Readers see the previous state or all of ``data``, never a part."""
        self.fs.pipe_file(path, data)  # one PUT: object stores make it visible only when complete

    def put_chunks(self, path: str, chunks: Iterable[bytes]) -> None:
        """As ``put``, from chunks (an error while they are produced writes nothing). Here: joined, one PUT."""
        self.put(path, b"".join(chunks))

    def create(self, path: str, data: bytes) -> None:
        """Create only if the name is free, else FileExistsError. Here: check, then write (not atomic)."""
        if self.fs.exists(path):
            raise FileExistsError(path)
        self.fs.pipe_file(path, data)

    @classmethod
    def transient(cls, exc: BaseException) -> bool:
        """Whether ``exc``, raised by this backend's client library, is worth retrying (the one table of
        those errors is io/retry.py's, which a delta opened by its location is read with too)."""
        classifier = transient_for(cls.protocols)
        return classifier is not None and classifier(exc)

    def mtime(self, entry: dict[str, Any]) -> float | None:
        for key in self.time_keys:
            value = entry.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return float(value)
            if isinstance(value, datetime):
                return value.timestamp()
        return None


class LocalBackend(Backend):
    protocols = ("file", "local")
    capabilities = Capabilities(atomic_create="link", local_files=True)
    time_keys = ("mtime",)

    def read(self, path: str, start: int | None = None, end: int | None = None) -> bytes:
        return read_regular_file(path, start, end)

    def put(self, path: str, data: bytes) -> None:
        self._publish(path, data)

    def _publish(self, path: str, data: bytes | Iterable[bytes]) -> None:
        """Written to a temporary name, renamed over ``path``, the directory synced."""
        tmp = self._tmp(path, data)
        try:
            os.replace(tmp, path)
        except BaseException:
            _unlink_quietly(tmp)
            raise
        fsync_dir(os.path.dirname(path) or ".")

    def put_chunks(self, path: str, chunks: Iterable[bytes]) -> None:
        """Streamed to a temporary name and renamed once complete: memory holds one chunk, not the object."""
        self._publish(path, chunks)

    def create(self, path: str, data: bytes) -> None:
        tmp = self._tmp(path, data)
        try:
            os.link(tmp, path)  # atomic, fails with FileExistsError if the name is taken
        finally:
            _unlink_quietly(tmp)
        fsync_dir(os.path.dirname(path) or ".")

    @staticmethod
    def _tmp(path: str, data: bytes | Iterable[bytes]) -> str:
        directory, name = os.path.split(path)
        os.makedirs(directory, exist_ok=True)
        tmp = os.path.join(directory, f"{TMP_PREFIX}{uuid.uuid4().hex}-{name}")
        try:
            with open(tmp, "xb") as f:
                for chunk in (data,) if isinstance(data, bytes) else data:
                    f.write(chunk)
                f.flush()
                os.fsync(f.fileno())
        except BaseException:
            _unlink_quietly(tmp)
            raise
        return tmp


_MEMORY_LOCK = threading.Lock()  # a memory store lives in one process: a process-wide lock makes create atomic


class MemoryBackend(Backend):
    protocols = ("memory",)
    capabilities = Capabilities(atomic_create="process-lock")
    time_keys = ("created",)

    def put(self, path: str, data: bytes) -> None:
        with _MEMORY_LOCK:
            self.fs.makedirs(os.path.dirname(path) or "/", exist_ok=True)
            self.fs.pipe_file(path, data)

    def create(self, path: str, data: bytes) -> None:
        with _MEMORY_LOCK:
            if self.fs.exists(path):
                raise FileExistsError(path)
            self.fs.makedirs(os.path.dirname(path) or "/", exist_ok=True)
            self.fs.pipe_file(path, data)


class S3Backend(Backend):
    """s3fs: conditional PUT with ``If-None-Match: *`` (``pipe_file(mode="create")``); HTTP 412 means taken.

    Each question costs one round trip, which across regions is what a refit's publication, receivers and
    commit wait on: a question about an object is one HEAD, and a write sends its body with its headers
    (botocore asks the store's go-ahead first, ``Expect: 100-continue``, a round trip for every PUT and
    part). Reads are one ranged GET each (``Store.read`` bounds every read, so s3fs asks no size first), and a
    listing one request per page.
    """

    protocols = ("s3", "s3a")
    package = "s3fs"
    capabilities = Capabilities(atomic_create="if-none-match", streamed_writes=True)
    time_keys = ("LastModified", "mtime")

    def read(self, path: str, start: int | None = None, end: int | None = None) -> bytes:
        # One GET under one retry loop: s3fs's cat_file wraps its call_s3 (retried already) in a retry
        # loop of its own, which with dcr's retries (Store.call) made a dead endpoint cost 5x the requests
        # and the time before the error. A body cut short is aiohttp's error, which dcr retries.
        from fsspec.asyn import sync

        bucket, key, _ = self.fs.split_path(path)
        ranged = {}
        if start is not None or end is not None:  # (end is exclusive here, inclusive in HTTP)
            ranged["Range"] = f"bytes={start or 0}-{'' if end is None else end - 1}"

        async def get() -> bytes:
            try:
                out = await self.fs._call_s3("get_object", Bucket=bucket, Key=key, **ranged)
            except OSError as exc:
                if not start and _invalid_range(exc):
                    return b""  # S3 refuses any range of an empty object (416): it is there, and empty
                raise
            try:
                return bytes(await out["Body"].read())
            finally:
                out["Body"].close()

        return sync(self.fs.loop, get)

    def ls(self, path: str) -> list[dict[str, Any]]:
        # One listing per page: s3fs follows an empty one with a listing of the parent (is ``path`` a file?),
        # and a receiver or a commit that waits lists a folder that is empty until the thing it waits for lands.
        from fsspec.asyn import sync

        bucket, key, _ = self.fs.split_path(path)
        prefix = f"{key.rstrip('/')}/" if key else ""

        async def pages() -> list[dict[str, Any]]:
            entries: list[dict[str, Any]] = []
            more: dict[str, str] = {}
            while True:
                out = await self.fs._call_s3("list_objects_v2", Bucket=bucket, Prefix=prefix, Delimiter="/", **more)
                for obj in out.get("Contents", []):
                    if obj["Key"] != prefix:  # (a "folder" object some tools write)
                        entries.append({**obj, "name": f"{bucket}/{obj['Key']}", "type": "file", "size": obj["Size"]})
                for common in out.get("CommonPrefixes", []):
                    entries.append({"name": f"{bucket}/{common['Prefix'].rstrip('/')}", "type": "directory", "size": 0})
                if not out.get("IsTruncated"):
                    return entries
                more = {"ContinuationToken": out["NextContinuationToken"]}

        return sync(self.fs.loop, pages)

    def info(self, path: str) -> dict[str, Any] | None:
        # One HEAD: s3fs follows a 404 with a listing, to tell a missing object from a "directory" (no
        # object of dcr's is ever one), so every absent block a push asks about cost two round trips.
        bucket, key, _ = self.fs.split_path(path)
        try:
            out = self.fs.call_s3("head_object", self.fs.kwargs, Bucket=bucket, Key=key)
        except FileNotFoundError:
            return None
        return {"name": f"{bucket}/{key}", "type": "file", "size": out["ContentLength"], **out}

    def put(self, path: str, data: bytes) -> None:
        _send_bodies_at_once(self.fs)
        super().put(path, data)

    def create(self, path: str, data: bytes) -> None:
        from botocore.exceptions import ClientError

        _send_bodies_at_once(self.fs)
        try:
            self.fs.pipe_file(path, data, mode="create")
        except FileExistsError:
            raise
        except OSError as exc:
            cause = exc.__cause__
            if isinstance(cause, ClientError) and (
                cause.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 412
                or cause.response.get("Error", {}).get("Code") == "PreconditionFailed"
            ):
                raise FileExistsError(path) from exc
            raise

    def put_chunks(self, path: str, chunks: Iterable[bytes]) -> None:
        """A multipart upload of S3_PART_BYTES parts, S3_PARTS_IN_FLIGHT of them on the wire at once (one PUT
        if the object is smaller than a part). S3 shows the object only once the upload is completed, after
        the last chunk and every part; an error before that aborts the upload.

        s3fs's own file object sends its parts one after the other over one connection, which holds one
        block to what a single stream gets (a fraction of the link across regions); the download side
        already reads its ranges in parallel (``delta/prefetch.py``).
        """
        _send_bodies_at_once(self.fs)
        parts = _parts_of(chunks, S3_PART_BYTES)
        first = next(parts, b"")
        second = next(parts, None)
        if second is None:
            self.put(path, first)
            return
        bucket, key, _ = self.fs.split_path(path)
        upload_id = self.fs.call_s3("create_multipart_upload", Bucket=bucket, Key=key)["UploadId"]

        def send(number: int, body: bytes) -> dict[str, Any]:
            out = self.fs.call_s3(
                "upload_part", Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=body
            )
            header = {"PartNumber": number, "ETag": out["ETag"]}
            if "ChecksumSHA256" in out:  # as s3fs's own uploads: the completion lists what the parts were given
                header["ChecksumSHA256"] = out["ChecksumSHA256"]
            return header

        # The first two parts are handed on from a queue, not a tuple that would keep them for the whole upload.
        ahead = collections.deque((first, second))
        del first, second

        def bodies() -> Iterator[bytes]:
            while ahead:
                yield ahead.popleft()
            yield from parts

        done: list[dict[str, Any]] = []
        try:
            with ThreadPoolExecutor(S3_PARTS_IN_FLIGHT, thread_name_prefix="dcr-s3-part") as pool:
                flying: collections.deque[Future[dict[str, Any]]] = collections.deque()
                try:
                    for number, body in enumerate(bodies(), start=1):
                        if len(flying) == S3_PARTS_IN_FLIGHT:
                            done.append(flying.popleft().result())
                        flying.append(pool.submit(send, number, body))
                    done.extend(f.result() for f in flying)
                finally:
                    for f in flying:
                        f.cancel()
            self.fs.call_s3(
                "complete_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": done}
            )
        except BaseException:
            with contextlib.suppress(Exception):
                self.fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id)
            raise
        self.fs.invalidate_cache(path)


_PROMPT_CLIENTS: weakref.WeakSet[Any] = weakref.WeakSet()  # s3fs clients whose PUTs no longer wait for a go-ahead
_PROMPT_LOCK = threading.Lock()


def _send_bodies_at_once(fs: Any) -> None:
    """Drop botocore's ``Expect: 100-continue`` from this filesystem's client: a PUT then carries its body at
    once instead of waiting a round trip for the store's ``100 Continue``. The wait only saves sending a
    body the store refuses (a bad signature, a name taken); dcr's bodies are small records and 8 MiB
    parts, for which the round trip costs more. A client s3fs makes anew (after its session closed) is
    changed at its first write."""
    from botocore.handlers import add_expect_header

    client = fs.s3
    with _PROMPT_LOCK:
        if client not in _PROMPT_CLIENTS:
            client.meta.events.unregister("before-call.s3", add_expect_header)
            _PROMPT_CLIENTS.add(client)


def _parts_of(chunks: Iterable[bytes], size: int) -> Iterator[bytes]:
    """The bytes of ``chunks`` cut into parts of exactly ``size`` bytes, the last one shorter (S3 asks every
    part but the last to be at least 5 MiB); a chunk of exactly one part is passed on without a copy."""
    pending = bytearray()
    for chunk in chunks:
        if not pending and len(chunk) == size:
            yield bytes(chunk)
            continue
        pending += chunk
        while len(pending) >= size:
            yield bytes(pending[:size])
            del pending[:size]
    if pending:
        yield bytes(pending)


class GCSBackend(Backend):
    """gcsfs: upload with ``ifGenerationMatch=0`` (``pipe_file(mode="create")``); 412 arrives as FileExistsError."""

    protocols = ("gs", "gcs")
    package = "gcsfs"
    capabilities = Capabilities(atomic_create="if-generation-match")
    time_keys = ("mtime",)

    def create(self, path: str, data: bytes) -> None:
        self.fs.pipe_file(path, data, mode="create")


class AzureBackend(Backend):
    """adlfs: ``upload_blob(overwrite=False)``, i.e. ``If-None-Match: *``; 409 means taken."""

    protocols = ("az", "abfs", "abfss")
    package = "adlfs"
    capabilities = Capabilities(atomic_create="azure-if-none-match")
    time_keys = ("last_modified", "mtime")

    def create(self, path: str, data: bytes) -> None:
        from azure.core.exceptions import ResourceExistsError

        try:
            self.fs.pipe_file(path, data, overwrite=False)
        except ResourceExistsError as exc:
            raise FileExistsError(path) from exc


_REGISTRY: dict[str, type[Backend]] = {}


def register(cls: type[Backend]) -> type[Backend]:
    """Make ``cls`` the backend of each of its protocols (usable as a class decorator)."""
    for protocol in cls.protocols:
        _REGISTRY[protocol] = cls
    return cls


for _cls in (LocalBackend, MemoryBackend, S3Backend, GCSBackend, AzureBackend):
    register(_cls)


def backend_class(protocol: str) -> type[Backend]:
    return _REGISTRY.get(protocol, Backend)


def backend_for(fs: fsspec.AbstractFileSystem) -> Backend:
    """The backend of a filesystem, by the protocols its class declares (a generic one if none is known)."""
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
    for protocol in protocols:
        if protocol in _REGISTRY:
            return _REGISTRY[protocol](fs)
    return Backend(fs)


def open_filesystem(url: str, storage_options: dict[str, Any] | None = None) -> tuple[Backend, str]:
    """(backend, root path) of a store URL; a missing client package says what to install."""
    try:
        fs, root = fsspec.core.url_to_fs(url, **client_options(url, storage_options))
    except ImportError as exc:
        protocol = fsspec.core.split_protocol(url)[0] or "file"
        package = backend_class(protocol).package
        hint = f"pip install {package}" if package else describe(exc)
        raise DcrError(f"cannot open {url}: {protocol}:// needs a package that is not installed ({hint})") from None
    except ValueError as exc:
        raise DcrError(f"cannot open {url}: {describe(exc)}") from None
    return backend_for(fs), root


def _unlink_quietly(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _invalid_range(exc: BaseException) -> bool:
    """Whether ``exc`` is S3's answer to a range past the object's end (s3fs raises it as EINVAL)."""
    response = getattr(exc.__cause__, "response", None)
    if not isinstance(response, dict):
        return False
    code = response.get("Error", {}).get("Code")
    return code == "InvalidRange" or response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 416
