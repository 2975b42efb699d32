"""``dcr apply STORE --vllm URL``: a live vLLM server as a store's receiver, as a checkpoint is one.

The client resolves the version (``--version``, ``--wait``, ``--since``) and acknowledges; the engine's
workers read the chosen manifest by its store location with the server's own environment (here: an
S3 endpoint on 127.0.0.1, moto, through a proxy that counts what the engine fetches), and fetch and
check every block before the engine is paused (receiver-vllm.md §7).
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from conftest import REPO, require_or_skip
from store_fixtures import CountingProxy, one_error_line

require_or_skip("vllm")  # under CI a missing vLLM fails the run

from vllm_support import get_json, qwen3_run, served

from dcr_cli.delta.reader import Delta
from dcr_cli.store.streaming import BlockUploader

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    return qwen3_run(tmp_path_factory, "qwen3")


@pytest.fixture(scope="module")
def engine_proxy(s3_endpoint):
    proxy = CountingProxy(s3_endpoint.url)  # only the engine's workers go through it
    yield proxy
    proxy.close()


@pytest.fixture(scope="module")
def server(chain, s3_endpoint, engine_proxy, tmp_path_factory):
    env = {**s3_endpoint.env(), "FSSPEC_S3_ENDPOINT_URL": engine_proxy.url}
    with served(chain[0], tmp_path_factory, env) as url:
        yield url


def _engine_fetches(proxy: CountingProxy, since: dict) -> dict:
    """(method, path) -> requests the engine made since the snapshot ``since``."""
    with proxy.lock:
        now = dict(proxy.requests)
    return {k: n - since.get(k, 0) for k, n in now.items() if n - since.get(k, 0)}


def test_a_vllm_server_receives_from_an_s3_store(server, chain, s3_endpoint, s3_url, engine_proxy, dcr):
    root = chain[0].parent
    env = s3_endpoint.env()  # the client reaches moto directly: the proxy counts the engine alone
    store = ["-S", f"endpoint_url={s3_endpoint.url}"]
    dcr("push", str(root / "d1"), s3_url, *store, env=env, check=True)

    # 1. A published version, acknowledged after the engine proved it; each data block fetched once
    #    by the engine, no repair block, and its manifest read once (prepare's; the update reuses it).
    before = dict(engine_proxy.requests)
    first = dcr("apply", s3_url, "--version", "step-1", "--vllm", server, "--ack", s3_url, "--receiver", "east",
                *store, env=env, check=True)  # fmt: skip
    assert "vLLM engine at version step-1" in first.stdout and "acknowledged step-1 as 'east'" in first.stdout
    assert get_json(server + "/weight_info")["weight_version"] == "step-1"
    fetched = _engine_fetches(engine_proxy, before)
    blocks = Delta.open(root / "d1").manifest.blocks
    assert {b.role for b in blocks} == {"data", "repair"}
    for block in blocks:
        gets = sum(n for (method, path), n in fetched.items() if method == "GET" and path.endswith(block.id))
        assert gets == (1 if block.role == "data" else 0), (block, fetched)
    manifest_gets = [n for (method, path), n in fetched.items() if method == "GET" and "/manifests/" in path]
    assert manifest_gets == [1], fetched
    dcr("commit", s3_url, "step-1", "--receiver", "east", *store, env=env, check=True)  # exit 4 without east's ack

    # 2. Started before the producer publishes: it waits, then applies, verifies every tensor and acks.
    #    Meanwhile it fetches the data blocks the push announces (as `dcr diff --push` does, store-v1
    #    §4.6), and the engine, on this node, reads them and the manifest from the client's spool: none
    #    from the store.
    client_proxy = CountingProxy(s3_endpoint.url)
    waiting = subprocess.Popen(
        [sys.executable, "-m", "dcr_cli", "apply", s3_url, "--version", "step-2", "--wait", "300",
         "--vllm", server, "--verify", "--ack", s3_url, "--receiver", "east", "-S", f"endpoint_url={client_proxy.url}"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**env, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    data = [b for b in Delta.open(root / "d2").manifest.blocks if b.role == "data"]
    try:
        assert waiting.stderr is not None
        line = waiting.stderr.readline()
        assert line.startswith("waiting up to 300 s for"), line
        assert get_json(server + "/weight_info")["weight_version"] == "step-1"  # nothing happens before the push
        uploader = BlockUploader(s3_url, s3_endpoint.storage_options, announce="step-2")
        for block in data:
            uploader(block.id, (root / "d2" / block.path).read_bytes())
        uploader.wait()
        deadline = time.monotonic() + 120
        while not all(client_proxy.gets_for(b.id) for b in data):
            assert time.monotonic() < deadline, "the waiting client did not fetch the announced blocks"
            time.sleep(0.05)
        before = dict(engine_proxy.requests)
        dcr("push", str(root / "d2"), s3_url, *store, env=env, check=True)
        out, err = waiting.communicate(timeout=300)
    finally:
        waiting.kill()
        client_proxy.close()
    assert waiting.returncode == 0, err
    assert "vLLM engine at version step-2" in out and "tensors of the vLLM engine match" in out, out
    said = f"the engine read {len(data)} of the {len(data)} blocks fetched early from this node, and the manifest"
    assert f"step-2: {said}" in out, out
    assert get_json(server + "/weight_info")["weight_version"] == "step-2"
    fetched = _engine_fetches(engine_proxy, before)
    asked = [p for (method, p), _ in fetched.items() if method == "GET" and ("/blocks/" in p or "/manifests/" in p)]
    assert not asked, fetched
    assert all(client_proxy.gets_for(b.id) == 1 for b in data)  # and the client fetched each once

    # 3. Fail closed, the engine untouched and serving: a version that is not published in time (exit 4),
    #    a version whose base the engine does not hold (exit 2), an option the engine has no use for.
    late = dcr("apply", s3_url, "--version", "step-9", "--wait", "0.5", "--vllm", server, *store, env=env)
    assert late.returncode == 4, late.stderr
    said = late.stderr.strip().splitlines()  # the --wait line, then one error line
    assert len(said) == 2 and said[0].startswith("waiting up to") and "did not appear in time" in said[1], said
    behind = dcr("apply", s3_url, "--version", "step-1", "--vllm", server, *store, env=env)
    assert behind.returncode == 2 and "dcr apply STORE --since step-2 --vllm URL" in one_error_line(behind)
    workers = dcr("apply", s3_url, "--vllm", server, "--workers", "2", *store, env=env)
    assert workers.returncode == 2 and "--workers" in one_error_line(workers)
    assert not get_json(server + "/is_paused")["is_paused"]
    assert get_json(server + "/weight_info")["weight_version"] == "step-2"

    # 4. A data block damaged in the store: the engine's prepare finds it (its first pass reads the blocks as
    #    they arrive, and every block is checked whole before the pause), so the engine is never paused.
    dcr("commit", s3_url, "step-2", "--receiver", "east", *store, env=env, check=True)
    dcr("push", str(root / "d3"), s3_url, *store, env=env, check=True)
    fs = s3_endpoint.filesystem()
    data = next(b for b in Delta.open(root / "d3").manifest.blocks if b.role == "data")
    key = f"{s3_url.removeprefix('s3://')}/blocks/{data.id}"
    good = fs.cat(key)
    fs.pipe(key, good[:-1] + bytes([good[-1] ^ 1]))
    damaged = dcr("apply", s3_url, "--version", "step-3", "--vllm", server, *store, env=env)
    assert damaged.returncode == 2 and "corrupt" in one_error_line(damaged), damaged.stderr
    assert not get_json(server + "/is_paused")["is_paused"]
    assert get_json(server + "/weight_info")["weight_version"] == "step-2"
    fs.pipe(key, good)

    # 5. A lagging engine catches up from its committed version by the store's cheapest path.
    caught_up = dcr("apply", s3_url, "--since", "step-2", "--vllm", server, *store, env=env, check=True)
    assert "vLLM engine at version step-3" in caught_up.stdout
    dcr("verify", "--vllm", server, "--against", str(root / "d3"), check=True)
    again = dcr("apply", s3_url, "--vllm", server, *store, env=env, check=True)  # the newest: already held
    assert "already holds version step-3" in again.stdout
