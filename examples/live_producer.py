"""Keep training the tiny model and refit a receiver from the live weights: no checkpoint per step.

The trainer resumes from its last checkpoint (which the store has committed), and after each AdamW
step ``dcr_cli.Producer`` diffs the BF16 weights it would serve against the committed baseline. The
rollout node's part runs here through the Python API too: apply from the store, acknowledge, and the
trainer commits, and only then does the producer's baseline advance.

    python examples/live_producer.py WORK --steps 2 --store STORE --receiver CKPT
reads WORK/trainer/step-N (the newest), writes WORK/live/step-N+1 ... and, for an independent check
only, the dense BF16 export WORK/trainer/step-N+k of each live step.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import load_file
from train_tiny import save_bf16

import dcr_cli


def served_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What the rollout engines serve: the BF16 cast of the fp32 master weights, named as in HF."""
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    return {
        name: t.detach().to(torch.bfloat16)
        for name, t in model.state_dict().items()
        if not (tied and name == "lm_head.weight")
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("work", type=Path)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--store", required=True)
    parser.add_argument("--receiver", type=Path, required=True, help="the rollout node's checkpoint directory")
    parser.add_argument("--receiver-name", default="rollout-0")
    args = parser.parse_args()

    from transformers import AutoConfig, AutoModelForCausalLM

    trainer = args.work / "trainer"
    last = max(int(p.name.split("-")[1]) for p in trainer.glob("step-*"))
    start = trainer / f"step-{last}"
    config = AutoConfig.from_pretrained(start)
    model = AutoModelForCausalLM.from_config(config).float()
    model.load_state_dict({k: v.float() for k, v in load_file(start / "model.safetensors").items()}, strict=False)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.0)
    gen = torch.Generator().manual_seed(1000 + last)

    # The baseline is the committed version: the bits of step-N as the store knows them.
    producer = dcr_cli.Producer(args.work / "live", baseline=served_weights(model), base_version=start.name)
    print(f"   baseline: {producer.baseline_bytes / 2**20:.1f} MiB of integer bits (one copy of the weights)")
    for step in range(last + 1, last + 1 + args.steps):
        tokens = torch.randint(0, config.vocab_size, (4, 64), generator=gen)
        model(input_ids=tokens, labels=tokens).loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        version = f"step-{step}"

        summary = producer.diff(served_weights(model), version=version)
        assert summary is not None
        print(
            f"   {version}: {summary.changed_elements} of {summary.total_elements} elements changed, "
            f"{summary.payload_bytes} B of payload (full: {summary.full_bytes} B)"
        )
        dcr_cli.push(args.work / "live" / version, args.store)
        applied = dcr_cli.apply(
            args.store, into=args.receiver, version=version, ack=args.store, receiver=args.receiver_name
        )
        print(f"   rollout node: {applied.message}; acknowledged")
        dcr_cli.commit(args.store, version, receivers=[args.receiver_name])
        producer.committed(version)  # only now does the baseline advance
        save_bf16(model, trainer / version)  # for the independent byte-for-byte check only
    print(json.dumps({"live_steps": args.steps, "last": f"step-{last + args.steps}"}))


if __name__ == "__main__":
    main()
