"""dcr apply into multi-rank vLLM engines serving a mixture-of-experts model (CPU, one process per rank).

Tensor parallel 2 (every rank holds a slice of every expert) and expert parallel 2 (each rank holds
4 of the 8 experts whole), each through tests/moe_tp_probe.py in its own process: a fresh engine
on step-3, back to step-0, forward again with d1 killed on every rank in the middle of a write and
retried; every parameter and buffer on every rank and the greedy tokens end equal to the fresh
engine's.
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

from moe_support import moe_train_run
from vllm_support import ensure_plugin_entry_point

from dcr_cli.delta.reader import Delta
from dcr_cli.produce import diff

pytestmark = pytest.mark.vllm

TESTS = Path(__file__).resolve().parent
CRASH_AT_ITEM = 41  # inside layer 1's expert tensors (the items run in tensor-name order)


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    ensure_plugin_entry_point()
    paths = moe_train_run(tmp_path_factory.mktemp("qwen3_moe"), "qwen3_moe")
    diff(paths[-1], paths[0], paths[0].parent / "back", base_version="step-3", target_version="step-0")
    return paths


def _probe(root: Path, engine_args: dict) -> dict:
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "0|1",  # one core per rank; the default binding wants 2 NUMA nodes
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",  # collective_rpc ships the probe's functions to the workers
        "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
    }
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    args = [str(root), "3", "2", json.dumps(engine_args), str(CRASH_AT_ITEM)]
    proc = subprocess.Popen(
        [sys.executable, str(TESTS / "moe_tp_probe.py"), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,  # a hung engine is stopped with all of its processes
    )
    try:
        stdout, stderr = proc.communicate(timeout=400)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
    lines = [line for line in stdout.splitlines() if line.startswith("DCR-MOE-TP-REPORT ")]
    assert proc.returncode == 0 and lines, stdout[-2000:] + stderr[-4000:]
    return json.loads(lines[0].removeprefix("DCR-MOE-TP-REPORT "))


@pytest.mark.parametrize(
    ("engine_args", "experts_per_rank"),
    [({}, [[8, 8], [8, 8]]), ({"enable_expert_parallel": True}, [[4, 4], [4, 4]])],
    ids=["tp2", "tp2-ep2"],
)
def test_moe_multi_rank_chain_with_crash_and_retry_is_exact(qwen3_moe, engine_args, experts_per_rank):
    report = _probe(qwen3_moe[0].parent, engine_args)
    assert report["ranks"] == 2
    assert report["experts_per_rank"] == experts_per_rank  # TP slices every expert; EP splits them 4/4
    assert report["back_changed_bits"] and report["torn_differs"]
    assert "re-run the same command" in report["crash"]
    back, resumed, *forward = report["reports"]
    assert back["status"] == "applied" and [r["status"] for r in forward] == ["applied", "applied"]
    d1_items = len(Delta.open(qwen3_moe[0].parent / "d1").manifest.items)
    assert resumed["status"] == "resumed" and resumed["items"] == d1_items
    assert resumed["done"] == CRASH_AT_ITEM - 1 and resumed["repaired"] == 1  # the half-written item
    assert resumed["applied"] == d1_items - CRASH_AT_ITEM
    assert report["differing"] == [], "parameters or buffers differ from the fresh target engine"
    assert report["tokens_equal"] and report["base_tokens_differ"]
    assert report["version"] == "step-3"
