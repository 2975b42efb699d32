"""dcr apply into a tensor-parallel vLLM engine (TP=2 on CPU, one worker process per rank).

Runs tests/vllm_tp_probe.py in its own process (vLLM's default process layout) after the other
vLLM test modules have shut their engines down.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import require_or_skip

require_or_skip("vllm")  # under CI a missing vLLM fails the run

from vllm_support import ensure_plugin_entry_point, train_run

from dcr_cli.produce import diff

pytestmark = pytest.mark.vllm

TESTS = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    ensure_plugin_entry_point()
    paths = train_run(tmp_path_factory.mktemp("qwen3"), "qwen3", tie=False)
    diff(paths[-1], paths[0], paths[0].parent / "back", base_version="step-3", target_version="step-0")
    return paths


def test_tensor_parallel_2_round_trip_is_exact(qwen3):
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "0|1",  # one core per rank; the default binding wants 2 NUMA nodes
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
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
        stdout, stderr = proc.communicate(timeout=400)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
    proc = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("DCR-TP-REPORT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-4000:]
    report = json.loads(lines[0].removeprefix("DCR-TP-REPORT "))
    assert report["ranks"] == 2
    assert report["checksums_equal"], "vLLM's per-rank weight checksums differ from the fresh target engine"
    assert report["tokens_equal"] and report["base_tokens_differ"]
    assert [r["status"] for r in report["reports"]] == ["applied"] * 4
    assert report["version"] == "step-3"
