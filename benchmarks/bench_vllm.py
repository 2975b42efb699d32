"""dcr apply into a live vLLM engine vs vLLM's own dense reload of the same checkpoint, side by side.

    PYTHONPATH=. python benchmarks/bench_vllm.py [--size small] [--repeat 3]

Trains a model of the given size for two real AdamW steps (BF16 checkpoints, lr 1e-6 as in RL
fine-tuning), diffs the steps, starts one in-process vLLM engine (CPU, dcr backend) on step-0 and
measures, on that engine:

* dcr apply of step-0 -> step-1: the first apply, which also establishes the engine's base version
  by reading back and digesting every tensor through the placement (once per engine);
* dcr apply of step-1 -> step-2: the steady state (check, pause, sparse in-place update, version
  bump, prefix-cache reset, resume);
* vLLM's dense reload of step-2: ``model.load_weights`` of every tensor read from the safetensors
  file (what a full refit costs without dcr, excluding any transfer).

Prints the times and the ratio dense / apply. The dcr plugin must be discoverable by vLLM (an
installed dcr, or tests/vllm_support.ensure_plugin_entry_point, which this script calls).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small", choices=["tiny", "small"])
    parser.add_argument("--repeat", type=int, default=3, help="dense reloads to time (median)")
    parser.add_argument("--lr", type=float, default=1e-6)
    args = parser.parse_args()

    sys.path[:0] = [str(REPO / "tests"), str(REPO / "examples")]
    from train_tiny import train
    from vllm_support import engine_env, ensure_plugin_entry_point, resident_model, start_llm

    from dcr_cli.produce import diff
    from dcr_cli.receive.vllm import apply_to_llm, verify_llm

    engine_env()
    ensure_plugin_entry_point()
    work = Path(tempfile.mkdtemp(prefix="dcr-bench-vllm-"))
    paths = train(work, 2, args.size, lr=args.lr)
    summaries = [
        diff(paths[i - 1], paths[i], work / f"d{i}", base_version=f"step-{i - 1}", target_version=f"step-{i}")
        for i in (1, 2)
    ]
    checkpoint_bytes = sum(f.stat().st_size for f in paths[2].glob("*.safetensors"))

    llm = start_llm(paths[0])
    t = time.perf_counter()
    apply_to_llm(llm, work / "d1")
    first = time.perf_counter() - t
    t = time.perf_counter()
    report = apply_to_llm(llm, work / "d2")
    steady = time.perf_counter() - t
    verify_llm(llm)

    from safetensors import safe_open

    model = resident_model(llm)
    dense_times = []
    for _ in range(args.repeat):
        t = time.perf_counter()
        with safe_open(str(paths[2] / "model.safetensors"), "pt") as f:
            model.load_weights((name, f.get_tensor(name)) for name in f.keys())  # noqa: SIM118
        llm.reset_prefix_cache()
        dense_times.append(time.perf_counter() - t)
    verify_llm(llm)  # the dense reload of the same checkpoint leaves the same bits
    dense = statistics.median(dense_times)

    print(f"model: {args.size}, checkpoint {checkpoint_bytes / 2**20:.1f} MiB, cores {os.cpu_count()}")
    print(
        f"changed elements step-1 -> step-2: {report['written_elements']} ({report['items']} items); "
        f"delta payload {summaries[1].payload_bytes / 2**20:.2f} MiB vs checkpoint {checkpoint_bytes / 2**20:.1f} MiB"
    )
    print(f"dcr apply, first (establishes base by read-back): {first * 1e3:8.1f} ms")
    print(f"dcr apply, steady state (whole RL-route cycle):   {steady * 1e3:8.1f} ms")
    print(f"  of which in-engine apply:                       {report['seconds'] * 1e3:8.1f} ms")
    print(f"vLLM dense reload (load_weights, median of {args.repeat}):  {dense * 1e3:8.1f} ms")
    print(f"ratio dense / dcr apply (steady): {dense / steady:.2f}x")


if __name__ == "__main__":
    main()
