"""dcr apply into a tensor-parallel vLLM engine (TP=2 on CPU, one worker process per rank).

Runs tests/vllm_tp_probe.py in its own process (vLLM's default process layout) after the other
vLLM test modules have shut their engines down. The same engine also applies a chain from an S3
store (moto), through a proxy that counts what its workers fetch: one download per node.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import require_or_skip, run_dcr
from store_fixtures import CountingProxy, S3Endpoint

require_or_skip("vllm")  # under CI a missing vLLM fails the run

from vllm_support import ensure_plugin_entry_point, train_run

from dcr_cli.delta.reader import Delta
from dcr_cli.produce import diff

pytestmark = pytest.mark.vllm

TESTS = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    ensure_plugin_entry_point()
    paths = train_run(tmp_path_factory.mktemp("qwen3"), "qwen3", tie=False)
    diff(paths[-1], paths[0], paths[0].parent / "back", base_version="step-3", target_version="step-0")
    return paths


@pytest.fixture(scope="module")
def tp_store(qwen3: list[Path], s3_endpoint: S3Endpoint) -> Iterator[tuple[str, CountingProxy]]:
    """d1..d3 published on an S3 store, and a proxy in front of it that only the engine goes through."""
    bucket = f"dcr-tp-{uuid.uuid4().hex[:12]}"
    s3_endpoint.filesystem().mkdir(bucket)
    url = f"s3://{bucket}/store"
    options = ["-S", f"endpoint_url={s3_endpoint.url}"]
    for i in (1, 2, 3):
        run_dcr("push", str(qwen3[0].parent / f"d{i}"), url, *options, env=s3_endpoint.env(), check=True)
        # The committed version is the next push's base (a producer's receivers ack it first; here, a stand-in).
        run_dcr("ack", url, f"step-{i}", "--receiver", "r", *options, env=s3_endpoint.env(), check=True)
        run_dcr("commit", url, f"step-{i}", "--receiver", "r", *options, env=s3_endpoint.env(), check=True)
    proxy = CountingProxy(s3_endpoint.url)
    yield url, proxy
    proxy.close()


@pytest.fixture(scope="module")
def qwen3_tp_report(qwen3: list[Path], s3_endpoint: S3Endpoint, tp_store: tuple[str, CountingProxy]) -> dict:
    """The probe's report: one TP=2 engine for every test (an engine start is the slow part)."""
    url, proxy = tp_store
    root = qwen3[0].parent
    locations = [f"{url}/manifests/{Delta.open(root / f'd{i}').id}.json" for i in (1, 2, 3)]
    s3 = {k: v for k, v in s3_endpoint.env().items() if k.startswith("AWS_")}
    env = {
        **os.environ,
        **s3,
        "FSSPEC_S3_ENDPOINT_URL": proxy.url,  # the engine's workers (and the probe) reach moto through the proxy
        "DCR_TP_PROBE_STORE": json.dumps(locations),
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "0|1",  # one core per rank; the default binding wants 2 NUMA nodes
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",  # collective_rpc ships the probe's crash hook to the workers
        "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
    }
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    # A session of its own, so that a hung engine is stopped with all of its processes.
    proc = subprocess.Popen(
        [sys.executable, str(TESTS / "vllm_tp_probe.py"), str(qwen3[0].parent), "3", "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=500)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
    lines = [line for line in stdout.splitlines() if line.startswith("DCR-TP-REPORT ")]
    assert proc.returncode == 0 and lines, stdout[-2000:] + stderr[-4000:]
    return json.loads(lines[0].removeprefix("DCR-TP-REPORT "))


def test_tensor_parallel_2_round_trip_is_exact(qwen3_tp_report):
    report = qwen3_tp_report
    assert report["ranks"] == 2
    assert report["checksums_equal"], "vLLM's per-rank weight checksums differ from the fresh target engine"
    assert report["tokens_equal"] and report["base_tokens_differ"]
    assert [r["status"] for r in report["reports"]] == ["applied"] * 4
    assert report["version"] == "step-3"


def test_tensor_parallel_2_failure_on_one_rank_then_retry_is_exact(qwen3_tp_report):
    # Rank 0 fails in the middle of a write, rank 1 has no failure of its own. Every rank records
    # its error and returns normally, so no reply is left queued in vLLM's channels: the status
    # read right after, the retry and the chain after it all read fresh replies.
    report = qwen3_tp_report
    assert "re-run the same command" in report["crash"] and "transfer killed" in report["crash"]
    assert [s["ok"] for s in report["crash_statuses"]] == [True, True]
    assert all(s["last_error"] and "transfer killed" in s["last_error"] for s in report["crash_statuses"])
    assert all(s["applying"] for s in report["crash_statuses"])  # left paused, part written, on both ranks
    retry = report["retry"]
    assert retry["status"] == "resumed" and retry["repaired"] >= 1 and retry["done"] >= 1
    assert report["retry_tokens_base"]
    assert [r["status"] for r in report["again"]] == ["applied"] * 3
    assert report["again_checksums_equal"], "after the failure and retry the checksums differ from a fresh engine"
    assert report["again_tokens_equal"] and report["again_version"] == "step-3"


def test_tensor_parallel_2_from_a_store_downloads_each_block_once_per_node(
    qwen3_tp_report: dict, tp_store: tuple[str, CountingProxy], qwen3: list[Path]
) -> None:
    """Both ranks need every item (each holds a slice of every tensor); before, each rank downloaded the
    whole delta, so a TP=N engine moved the payload N times over its node's link. Now the node's first
    rank downloads each data block once, checked whole, and both ranks read that copy."""
    store = qwen3_tp_report["store"]
    assert [r["status"] for r in store["reports"]] == ["applied"] * 3
    assert store["checksums_equal"] and store["version"] == "step-3"
    assert store["copies_left"] == []  # the node's copy is removed once every rank has applied it
    _, proxy = tp_store
    with proxy.lock:
        fetched = dict(proxy.requests)
    for i in (1, 2, 3):
        for block in Delta.open(qwen3[0].parent / f"d{i}").manifest.blocks:
            gets = sum(n for (method, path), n in fetched.items() if method == "GET" and path.endswith(block.id))
            assert gets == (1 if block.role == "data" else 0), (i, block, fetched)
