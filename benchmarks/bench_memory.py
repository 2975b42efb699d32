"""Peak anonymous memory of `dcr diff` at two model sizes (issue 12 §5): O(largest tensor), not O(model).

Each diff runs in a child process that samples its own RssAnon (/proc/self/status: heap, not the
page cache that memory-mapped checkpoints use) every millisecond; the report is the high-water
mark over the diff minus the RssAnon the process had just before it (imports, numba, torch). Two
paths, each at two model sizes with the same largest tensor:

- hf: an 8B-shaped BF16 HF directory (bench_diff.py's corpus), 1 and 3 layers, 3% changes;
- fp8: a Megatron torch_dist checkpoint (2 TP ranks) diffed through the FP8 block-quantization
  residual path (weight + weight_scale_inv from the BF16 trainer weights), 2 and 6 layers.

    python benchmarks/bench_memory.py [--dir DIR] [--paths hf,fp8] [--workers N]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "benchmarks")]

_CHILD = r"""
import json, os, sys, threading, time
from pathlib import Path

def rss_anon():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0

import dcr_cli.checkpoints.dcp, dcr_cli.checkpoints.megatron, torch  # noqa: F401  (loaded before the baseline)
from dcr_cli.produce import diff
base, new, out, workers, profile = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5]
profile = json.loads(profile) if profile != "-" else None
peak = [0]
stop = threading.Event()
def sample():
    while not stop.is_set():
        peak[0] = max(peak[0], rss_anon())
        time.sleep(0.001)
before = rss_anon()
thread = threading.Thread(target=sample, daemon=True)
thread.start()
start = time.perf_counter()
diff(base, new, out, workers=int(workers) if workers != "all" else None, profile=profile)
seconds = time.perf_counter() - start
stop.set()
thread.join()
peak[0] = max(peak[0], rss_anon())
print("RESULT " + json.dumps({"before": before, "peak": peak[0], "seconds": seconds}))
"""


def measure(checkout: Path, base: Path, new: Path, out: Path, workers: str, profile: dict | None) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    env = {**os.environ, "PYTHONPATH": str(checkout), "DCR_CACHE_DIR": ""}
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(base), str(new), str(out), workers, json.dumps(profile) if profile else "-"],
        env=env, capture_output=True, text=True, check=False, cwd=tempfile.gettempdir(),
    )  # fmt: skip
    if proc.returncode != 0:
        raise SystemExit(f"diff failed: {proc.stderr[-3000:]}")
    shutil.rmtree(out, ignore_errors=True)
    return json.loads(proc.stdout.rsplit("RESULT ", 1)[1])


def fp8_config(layers: int) -> dict:
    return {
        "hidden_size": 2048,
        "num_hidden_layers": layers,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "intermediate_size": 8192,
        "vocab_size": 32000,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
        "megatron": {"padded_vocab_size": 32000},
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]},
    }


def fp8_pair(root: Path, layers: int) -> tuple[Path, Path]:
    from shard_writers import write_megatron_checkpoints

    if not (root / "target" / "torch_dist" / ".metadata").exists():
        shutil.rmtree(root, ignore_errors=True)
        write_megatron_checkpoints(root, fp8_config(layers), world=2)
    return root / "base" / "torch_dist", root / "target" / "torch_dist"


def largest(path: Path, profile: dict | None) -> int:
    """Bytes of the largest canonical tensor (for a residual one, of the stored source it is computed from)."""
    from dcr_cli.checkpoints import open_source
    from dcr_cli.checkpoints.shards import ShardCheckpoint
    from dcr_cli.format.dtypes import dtype, numel

    src = open_source(path, None, profile)
    try:
        if isinstance(src, ShardCheckpoint):
            return max(
                numel(t.assembled_shape) * dtype(t.source_dtype or t.dtype).itemsize for t in src.canonical.values()
            )
        return max(t.nbytes for t in src.tensors.values())
    finally:
        (src.reader if isinstance(src, ShardCheckpoint) else src).close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=None, help="corpus directory (kept and reused)")
    ap.add_argument("--paths", default="hf,fp8")
    ap.add_argument("--workers", default="all")
    ap.add_argument("--before", help="another dcr checkout to measure side by side")
    args = ap.parse_args()
    from bench_diff import make_8b_pair

    work = Path(args.dir or tempfile.mkdtemp(prefix="dcr-bench-memory-"))
    checkouts = {"after": ROOT} if not args.before else {"before": Path(args.before).resolve(), "after": ROOT}
    cases = []
    if "hf" in args.paths:
        for layers in (1, 3):
            t = time.perf_counter()
            base, new = make_8b_pair(work / f"hf-{layers}", layers, 0.03)
            cases.append((f"hf, {layers} layers", base, new, None, time.perf_counter() - t))
    if "fp8" in args.paths:
        for layers in (2, 6):
            t = time.perf_counter()
            base, new = fp8_pair(work / f"fp8-{layers}", layers)
            cases.append((f"megatron fp8, {layers} layers", base, new, fp8_config(layers), time.perf_counter() - t))
    print(f"peak anonymous memory of dcr diff (RssAnon high-water minus before the diff), workers={args.workers}")
    columns = "".join(f"{k + ' MiB':>14}{'s':>7}" for k in checkouts)
    print(f"  {'case':26s}{'model MiB':>10}{'largest MiB':>12}{columns}")
    for label, base, new, profile, _ in cases:
        files = [f for f in new.iterdir() if f.is_file()]
        model = sum(f.stat().st_size for f in files)
        row = f"  {label:26s}{model / 2**20:>10.0f}{largest(new, profile) / 2**20:>12.0f}"
        for checkout in checkouts.values():
            got = measure(checkout, base, new, work / "delta", args.workers, profile)
            row += f"{(got['peak'] - got['before']) / 2**20:>14.0f}{got['seconds']:>7.1f}"
        print(row, flush=True)


if __name__ == "__main__":
    main()
