"""A steady in-engine apply of MoE expert layouts that a loader copies as strided views, on a plain
torch module whose ``load_weights`` plays vLLM's fused-MoE loader (no vLLM needed; seconds).

    PYTHONPATH=. python benchmarks/bench_engine_layouts.py [--experts 16] [--hidden 2048] [--inter 1024]
        [--rate 0.03] [--repeat 3]

The module is Llama4's expert stack: ``experts.gate_up_proj`` (E, H, 2I) copied as two transposed,
strided views into the gate and up halves of ``w13`` (E, 2I, H), and ``experts.down_proj`` (E, I, H)
copied transposed into ``w2`` (E, H, I). Two BF16 versions, the second with ``--rate`` of the
elements stepped in the low mantissa bit at uniformly random positions; each repeat starts from a
fresh engine at the base, runs ``prepare`` (the first pass, before the pause; it reads back the
base once to establish the version) and then ``apply``. Timed:

* ``update``: ``apply`` after ``prepare``, what a vLLM engine's pause holds (the writes, and the
  digests of any touched tensor the prediction did not prove before them);
* ``prepare``: the ``prepare`` before it (the base read back once to establish the version, then
  the first pass and the prediction: what runs while an engine still serves);
* ``dense``: ``load_weights`` of both tensors (a dense reload from memory, the reference).

Printed: best of ``--repeat`` for each, the tensors predicted, and the ratios to the dense reload.
Run it against two trees side by side (``PYTHONPATH=TREE``) to compare them.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from dcr_cli.delta.reader import Delta
from dcr_cli.produce import diff
from dcr_cli.receive.vllm.apply import EngineReceiver


class StackedExperts(torch.nn.Module):
    def __init__(self, experts: int, hidden: int, inter: int) -> None:
        super().__init__()
        self.inter = inter
        self.w13 = torch.nn.Parameter(torch.zeros(experts, 2 * inter, hidden, dtype=torch.bfloat16), False)
        self.w2 = torch.nn.Parameter(torch.zeros(experts, hidden, inter, dtype=torch.bfloat16), False)

    def load_weights(self, weights: Any) -> None:
        i = self.inter
        for name, t in weights:
            if name == "experts.gate_up_proj":
                self.w13.data[:, :i].copy_(t[..., :i].transpose(1, 2))
                self.w13.data[:, i:].copy_(t[..., i:].transpose(1, 2))
            else:
                self.w2.data.copy_(t.transpose(1, 2))


def versions(work: Path, e: int, h: int, i: int, rate: float) -> tuple[dict[str, torch.Tensor], Delta]:
    g = torch.Generator().manual_seed(0)
    shapes = {"experts.gate_up_proj": (e, h, 2 * i), "experts.down_proj": (e, i, h)}
    base = {n: (torch.randn(s, generator=g) * 0.02).to(torch.bfloat16) for n, s in shapes.items()}
    target = {}
    for n, t in base.items():
        bits = t.clone().view(torch.int16)
        bits[torch.rand(t.shape, generator=g) < rate] ^= 1
        target[n] = bits.view(torch.bfloat16)
    for label, table in (("c0", base), ("c1", target)):
        (work / label).mkdir()
        save_file(table, str(work / label / "model.safetensors"))
    diff(work / "c0", work / "c1", work / "d", base_version="v0", target_version="v1")
    return base, Delta.open(str(work / "d"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=1024)
    ap.add_argument("--rate", type=float, default=0.03)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    e, h, i = args.experts, args.hidden, args.inter
    with tempfile.TemporaryDirectory() as tmp:
        base, delta = versions(Path(tmp), e, h, i, args.rate)
        mib = sum(t.numel() * 2 for t in base.values()) / 2**20
        weights = list(base.items())
        times: dict[str, list[float]] = {"update": [], "prepare": [], "dense": []}
        predicted = None
        for _ in range(args.repeat):
            module = StackedExperts(e, h, i)
            t0 = time.perf_counter()
            module.load_weights(weights)
            times["dense"].append(time.perf_counter() - t0)
            receiver = EngineReceiver(module)
            t0 = time.perf_counter()
            receiver.prepare(delta)  # the first one also reads back the base (the version)
            first_prepare = time.perf_counter() - t0
            t0 = time.perf_counter()
            report = receiver.apply(delta)
            times["update"].append(time.perf_counter() - t0)
            predicted = report.predicted
            assert receiver.verify(delta.manifest.tensors)["mismatched"] == []
            times["prepare"].append(first_prepare)
        dense = min(times["dense"])
        print(f"stacked experts E={e} H={h} I={i}: {mib:.0f} MiB BF16, {args.rate:.1%} of the elements changed")
        print(f"  tensors predicted before the writes: {predicted} of 2")
        for k in ("dense", "prepare", "update"):
            best = min(times[k])
            every = [round(t * 1e3) for t in times[k]]
            print(f"  {k:8} best {best * 1e3:8.1f} ms  ({best / dense:.2f}x dense)  all {every}")


if __name__ == "__main__":
    main()
