"""Peak anonymous memory of `dcr diff` at two model sizes (issue 12 §5): O(largest tensor), not O(model).

Each diff runs in a child process that samples its own RssAnon (/proc/self/status: heap, not the
page cache that memory-mapped checkpoints use) every millisecond; the report is the high-water
mark over the diff minus the RssAnon the process had just before it (imports, numba, torch). Two
paths, each at two model sizes with the same largest tensor:

- hf: an 8B-shaped BF16 HF directory (bench_diff.py's corpus), 1 and 3 layers, 3% changes;
- fp8: a Megatron torch_dist checkpoint (2 TP ranks) diffed through the FP8 block-quantization
  residual path (weight + weight_scale_inv from the BF16 trainer weights), 2 and 6 layers.

A third path, ``store``, measures the transfer commands instead (whole processes, RssAnon sampled
every 5 ms by benchmarks/harness.py, imports included): ``push`` to a local store and to a moto S3
endpoint, ``pull`` from it, and ``apply`` straight from it (blocks fetched in the background), for a
delta whose payload is many 64 MiB blocks (an Adam-like step changing about half of the elements), at
two model sizes (--store-sizes, GiB).

    python benchmarks/bench_memory.py [--dir DIR] [--paths hf,fp8,store] [--workers N] [--store-sizes 0.5,1.5]
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


def store_memory(work: Path, sizes: list[float], checkouts: dict[str, Path]) -> None:
    import corpus
    from bench_refit import CLIENT_ENV, KEY_ID, SECRET, Moto
    from harness import dcr, run

    print("\npeak RssAnon of the transfer commands (whole process), payload of many 64 MiB blocks")
    moto = Moto()
    try:
        for size in sizes:
            specs, _ = corpus.dense_specs(int(size * 2**30))
            paths = corpus.build_chain(
                work / f"store-{size:g}",
                specs,
                [corpus.Step("adam", 0.5)],
                shard_bytes=min(1 << 30, int(size * 2**29)),
            )
            delta = work / f"store-{size:g}-delta"
            if not (delta / "manifest.json").exists():
                run(dcr("diff", str(paths[0]), str(paths[1]), "-o", str(delta), "--base-version", "m0",
                        "--target-version", "m1")).check()  # fmt: skip
            manifest = json.loads((delta / "manifest.json").read_text())
            data = [b for b in manifest["blocks"] if b["role"] == "data"]
            model = sum(f.stat().st_size for f in paths[1].glob("*.safetensors"))
            print(
                f"  model {model / 2**30:.2f} GiB, largest tensor {max(x.nbytes for x in specs) / 2**20:.0f} MiB; "
                f"payload {sum(b['size'] for b in data) / 2**20:.0f} MiB in {len(data)} data blocks"
            )
            for label, checkout in checkouts.items():
                env = {**os.environ, "PYTHONPATH": str(checkout), "AWS_ACCESS_KEY_ID": KEY_ID,
                       "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_DEFAULT_REGION": "us-east-1",
                       "FSSPEC_S3_ENDPOINT_URL": moto.url, **CLIENT_ENV}  # fmt: skip
                bucket = f"mem-{label}-{size:g}".replace(".", "-")
                moto.fs().mkdir(bucket)
                local = work / f"store-{label}-{size:g}"
                shutil.rmtree(local, ignore_errors=True)
                pulled = work / f"pulled-{label}-{size:g}"
                shutil.rmtree(pulled, ignore_errors=True)
                receiver = work / f"receiver-{label}-{size:g}"
                shutil.rmtree(receiver, ignore_errors=True)
                shutil.copytree(paths[0], receiver)
                url = f"s3://{bucket}/s"
                steps = [
                    ("push local", dcr("push", str(delta), local.as_uri())),
                    ("push s3", dcr("push", str(delta), url)),
                    ("pull s3", dcr("pull", url, "--version", "m1", "-o", str(pulled))),
                    ("apply from s3", dcr("apply", url, "--version", "m1", "--into", str(receiver))),
                ]
                row = f"    {label:7s}"
                for name, argv in steps:
                    got = run(argv, env, cwd=Path(tempfile.gettempdir())).check()
                    row += f"  {name} {got.peak_anon / 2**20:6.0f} MiB {got.seconds:5.1f} s"
                print(row, flush=True)
                for path in (local, pulled, receiver):
                    shutil.rmtree(path, ignore_errors=True)
                moto.fs().rm(bucket, recursive=True)
    finally:
        moto.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=None, help="corpus directory (kept and reused)")
    ap.add_argument("--paths", default="hf,fp8")
    ap.add_argument("--workers", default="all")
    ap.add_argument("--before", help="another dcr checkout to measure side by side")
    ap.add_argument("--store-sizes", default="0.5,1.5", help="model sizes in GiB for the store path")
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
    if cases:
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
    if "store" in args.paths:
        store_memory(work, [float(x) for x in args.store_sizes.split(",")], checkouts)


if __name__ == "__main__":
    main()
