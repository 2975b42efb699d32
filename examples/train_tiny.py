"""Train a tiny Qwen3 for a few real AdamW steps and write one BF16 checkpoint per step.

This is the realistic update stream used by the main job, the tests and the benchmarks: fp32
master weights, AdamW at lr 1e-6, BF16 Hugging Face checkpoints (config.json + safetensors) that
vLLM can load. The model is built from a config with random weights; nothing is downloaded.

    python examples/train_tiny.py OUT_DIR --steps 3
writes OUT_DIR/step-0 (the initial weights) ... OUT_DIR/step-3.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

SIZES = {
    # head_dim 64: vLLM's CPU attention backend does not accept smaller heads.
    "tiny": dict(
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=1024,
    ),
    "small": dict(
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=8192,
    ),
}


def build_model(size: str = "tiny", tie_word_embeddings: bool = False, seed: int = 0, arch: str = "qwen3"):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    common = dict(
        SIZES[size],
        head_dim=64,
        max_position_embeddings=512,
        tie_word_embeddings=tie_word_embeddings,
        initializer_range=0.02,
    )
    if arch == "llama":
        config = LlamaConfig(**common)
        model = LlamaForCausalLM(config)
    else:
        config = Qwen3Config(**common)
        model = Qwen3ForCausalLM(config)
    return model.float()


def save_bf16(model, out: Path) -> None:
    """Save the fp32 master weights as a BF16 Hugging Face checkpoint (what a trainer exports)."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    state = {}
    for name, tensor in model.state_dict().items():
        if model.config.tie_word_embeddings and name == "lm_head.weight":
            continue  # tied: the checkpoint holds the embedding once, as HF does
        state[name] = tensor.detach().to(torch.bfloat16).contiguous()
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config["torch_dtype"] = "bfloat16"
    config["dtype"] = "bfloat16"
    config["architectures"] = [type(model).__name__]  # vLLM picks its model class (and runner) from this
    (out / "config.json").write_text(json.dumps(config, indent=2, default=str))


def train(
    out_dir: Path,
    steps: int = 3,
    size: str = "tiny",
    lr: float = 1e-6,
    seed: int = 0,
    tie_word_embeddings: bool = False,
    arch: str = "qwen3",
    batch: int = 4,
    seq: int = 64,
) -> list[Path]:
    """Run ``steps`` optimizer steps; return the checkpoint directories step-0 .. step-N."""
    model = build_model(size, tie_word_embeddings, seed, arch)
    optim = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed + 1)
    paths = [out_dir / "step-0"]
    save_bf16(model, paths[0])
    for step in range(1, steps + 1):
        tokens = torch.randint(0, model.config.vocab_size, (batch, seq), generator=gen)
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        paths.append(out_dir / f"step-{step}")
        save_bf16(model, paths[-1])
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--tie", action="store_true", help="tie the embedding and the output layer")
    parser.add_argument("--arch", choices=["qwen3", "llama"], default="qwen3")
    args = parser.parse_args()
    for path in train(args.out, args.steps, args.size, args.lr, tie_word_embeddings=args.tie, arch=args.arch):
        print(path)


if __name__ == "__main__":
    main()
