"""Tiny mixture-of-experts models for the vLLM receiver tests, built locally from a config.

Qwen3-MoE (routed experts + router gate, qk-norm) and Qwen2-MoE (routed experts, router gate, a
``shared_expert`` MLP and its sigmoid ``shared_expert_gate``), trained for a few real AdamW steps
in fp32 and exported as BF16 Hugging Face checkpoints in the per-expert spelling vLLM loads
(``mlp.experts.<e>.{gate,up,down}_proj.weight``): transformers' own ``save_pretrained`` converts
its fused expert parameters back to that spelling. Nothing is downloaded.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch

# Dimensions: head_dim 64 (vLLM's CPU attention needs it); hidden and expert widths multiples of
# 32 (vLLM's CPU grouped-GEMM selection requires it even when dcr's plugin keeps the layout).
MOE_SIZES: dict[str, dict[str, Any]] = {
    "qwen3_moe": dict(
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        vocab_size=1024,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
    ),
    "qwen2_moe": dict(
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=1024,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=False,
    ),
}


def build_moe_model(arch: str, seed: int = 0) -> torch.nn.Module:
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    common = dict(MOE_SIZES[arch], max_position_embeddings=512, tie_word_embeddings=False, initializer_range=0.02)
    if arch == "qwen3_moe":
        return Qwen3MoeForCausalLM(Qwen3MoeConfig(**common)).float()
    if arch == "qwen2_moe":
        return Qwen2MoeForCausalLM(Qwen2MoeConfig(**common)).float()
    raise ValueError(f"unknown MoE arch {arch!r}")


def save_moe_bf16(model: torch.nn.Module, out: Path) -> None:
    """The fp32 master weights as a BF16 checkpoint, per-expert tensor names (what vLLM loads)."""
    exported = copy.deepcopy(model).to(torch.bfloat16)
    exported.save_pretrained(str(out), safe_serialization=True)
    config = json.loads((out / "config.json").read_text())
    config["torch_dtype"] = config["dtype"] = "bfloat16"
    config["architectures"] = [type(model).__name__]
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").unlink(missing_ok=True)


def train_moe(out_dir: Path, arch: str, steps: int = 3, lr: float = 1e-3, seed: int = 0) -> list[Path]:
    """step-0 (initial weights) .. step-N after N AdamW steps on random tokens (router loss included)."""
    model = build_moe_model(arch, seed)
    model.config.output_router_logits = True  # the router's auxiliary loss: gradients reach every expert
    optim = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed + 1)
    paths = [out_dir / "step-0"]
    save_moe_bf16(model, paths[0])
    for step in range(1, steps + 1):
        tokens = torch.randint(0, model.config.vocab_size, (4, 64), generator=gen)
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        paths.append(out_dir / f"step-{step}")
        save_moe_bf16(model, paths[-1])
    return paths


def moe_train_run(root: Path, arch: str, steps: int = 3) -> list[Path]:
    """Checkpoints step-0..N and deltas d1..dN between consecutive ones (as vllm_support.train_run)."""
    from dcr_cli.produce import diff

    paths = train_moe(root, arch, steps)
    for i in range(steps):
        diff(paths[i], paths[i + 1], root / f"d{i + 1}", base_version=f"step-{i}", target_version=f"step-{i + 1}")
    return paths
