"""Codec size and diff throughput on a realistic update stream (issue: dcr foundation §5).

The stream: a small Qwen3 built from a config, trained a few real AdamW steps (fp32 master weights,
lr 1e-6) with a BF16 checkpoint after each step; plus stress cases with 1%, 3% and 5% of elements
moved by one BF16 ulp. For each pair it reports, measured side by side in one run:

- change rate and delta size (payload + manifest);
- ratio of the full size to the delta, of the delta to the empirical entropy bound
  (per tensor: log2 C(n, k) for the positions + k times the order-0 entropy of the XOR values),
  and of a NeMo-RL-style codec (delta-coded u32 positions + XOR values, zstd level 1) to the delta;
- diff throughput on one core as a ratio to a plain numpy XOR-and-count pass over the same bytes
  (the memory-bandwidth reference), both reading the same memory-mapped files from page cache:
  for the whole `dcr diff` (thr/ref: the target's tensor digests, as in a stream where the base's are
  cached from the previous step, codec, blocks and manifest written and fsynced),
  for the codec alone (codec/ref: change scan and encoding), and for the target tensor digests alone.

    python benchmarks/bench_diff.py [--steps 5] [--size small] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import zstandard

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import blake3

from dcr_cli.checkpoints.safetensors_dir import SafetensorsCheckpoint
from dcr_cli.format.codec import diff_region
from dcr_cli.format.dtypes import dtype as lookup_dtype
from dcr_cli.format.manifest import Region
from dcr_cli.produce import diff
from dcr_cli.produce.plan import chunk_ranges


def entropy_bound_bytes(a: SafetensorsCheckpoint, b: SafetensorsCheckpoint) -> float:
    bits = 0.0
    for name in a.tensors:
        x, y = a.view(name), b.view(name)
        mask = x ^ y
        pos = np.flatnonzero(mask)
        n, k = len(x), len(pos)
        if k == 0:
            continue
        bits += (math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)) / math.log(2)
        _, counts = np.unique(mask[pos], return_counts=True)
        p = counts / k
        bits += float(-(counts * np.log2(p)).sum())
    return bits / 8


def nemo_style_bytes(a: SafetensorsCheckpoint, b: SafetensorsCheckpoint) -> int:
    """Sorted positions delta-coded as u32, XOR values, zstd level 1, per tensor (FIELD-NOTES §3)."""
    total = 0
    cctx = zstandard.ZstdCompressor(level=1)
    for name in a.tensors:
        mask = a.view(name) ^ b.view(name)
        pos = np.flatnonzero(mask)
        if len(pos) == 0:
            continue
        deltas = np.diff(pos, prepend=0).astype("<u4")
        total += len(cctx.compress(deltas.tobytes() + mask[pos].tobytes()))
    return total


def reference_pass(a: SafetensorsCheckpoint, b: SafetensorsCheckpoint) -> int:
    return sum(int(np.count_nonzero(a.view(n) ^ b.view(n))) for n in a.tensors)


def encode_pass(a: SafetensorsCheckpoint, b: SafetensorsCheckpoint) -> None:
    """Change detection and encoding alone (the codec), one thread, no digests of whole tensors, no I/O."""
    for name, loc in b.tensors.items():
        for start, stop in chunk_ranges(loc.numel, lookup_dtype(loc.dtype).itemsize):
            diff_region(name, Region.range(start, stop), a.view(name, start, stop), b.view(name, start, stop))


def digest_pass(b: SafetensorsCheckpoint) -> None:
    """The target tensor table: BLAKE3 of every tensor of the new checkpoint, on one thread."""
    for name in b.tensors:
        blake3.blake3(b.view(name).view(np.uint8), max_threads=1).digest()


def best_of(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def measure(base: Path, new: Path, work: Path, label: str, repeat: int) -> dict:
    with SafetensorsCheckpoint(base) as a, SafetensorsCheckpoint(new) as b:
        full = sum(t.nbytes for t in b.tensors.values())
        reference_pass(a, b)  # warm the page cache for both sides
        t_ref = best_of(lambda: reference_pass(a, b), repeat)
        t_encode = best_of(lambda: encode_pass(a, b), repeat)
        t_digest = best_of(lambda: digest_pass(b), repeat)
        bound = entropy_bound_bytes(a, b)
        nemo = nemo_style_bytes(a, b)

    counter = iter(range(1000))

    def run_diff() -> float:
        # A stream's steady state: the base was the previous step's target, so its digests are in the
        # cache; the target is hashed in this run. A fresh cache per run keeps repeats honest.
        i = next(counter)
        os.environ["DCR_CACHE_DIR"] = str(work / f"{label}-cache-{i}")
        with SafetensorsCheckpoint(base) as a:
            a.tensor_digests()
        out = work / f"{label}-{i}"
        start = time.perf_counter()
        s = diff(base, new, out, workers=1)
        seconds = time.perf_counter() - start
        run_diff.summary = s  # type: ignore[attr-defined]
        shutil.rmtree(out)
        return seconds

    t_dcr = min(run_diff() for _ in range(repeat))
    s = run_diff.summary  # type: ignore[attr-defined]
    delta_bytes = s.payload_bytes + s.manifest_bytes
    return {
        "case": label,
        "change_rate": s.change_rate,
        "payload_bytes": s.payload_bytes,
        "manifest_bytes": s.manifest_bytes,
        "delta_bytes": delta_bytes,
        "full_over_delta": full / delta_bytes,
        "delta_over_entropy_bound": delta_bytes / bound,
        "nemo_style_over_delta": nemo / delta_bytes,
        "diff_seconds_1core": t_dcr,
        "reference_seconds": t_ref,
        "throughput_vs_reference": t_ref / t_dcr,
        "codec_only_vs_reference": t_ref / t_encode,
        "target_digests_vs_reference": t_ref / t_digest,
        "full_mib": full / 2**20,
    }


def inject(base: Path, out: Path, rate: float, seed: int) -> Path:
    """Move ``rate`` of the BF16 elements of ``base`` by one ulp (the smallest stored change)."""
    import torch
    from safetensors.torch import load_file, save_file

    rng = np.random.default_rng(seed)
    tensors = load_file(str(base / "model.safetensors"))
    for name, t in tensors.items():
        raw = t.contiguous().view(torch.int16).numpy().view(np.uint16).reshape(-1).copy()
        idx = np.flatnonzero(rng.random(raw.size) < rate)
        step = np.where(rng.random(idx.size) < 0.5, 1, -1)
        raw[idx] = (raw[idx].astype(np.int32) + step).astype(np.uint16)
        tensors[name] = torch.from_numpy(raw.view(np.int16)).view(torch.bfloat16).reshape(t.shape)
    out.mkdir(parents=True)
    save_file(tensors, str(out / "model.safetensors"))
    shutil.copy(base / "config.json", out / "config.json")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--size", default="small")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    from train_tiny import train

    with tempfile.TemporaryDirectory(prefix="dcr-bench-") as tmp:
        work = Path(tmp)
        ckpts = train(work / "run", steps=args.steps, size=args.size)
        rows = [measure(ckpts[i - 1], ckpts[i], work, f"step-{i}", args.repeat) for i in range(1, len(ckpts))]
        for rate in (0.01, 0.03, 0.05):
            stressed = inject(ckpts[0], work / f"inject-{rate}", rate, seed=int(rate * 1000))
            rows.append(measure(ckpts[0], stressed, work, f"inject-{rate:.0%}", args.repeat))
    header = (
        f"{'case':<12}{'changed':>9}{'delta KiB':>11}{'full/delta':>11}{'vs bound':>10}"
        f"{'nemo/dcr':>10}{'diff s':>9}{'ref s':>8}{'thr/ref':>9}{'codec/ref':>10}{'digest/ref':>11}"
    )
    print(f"model: {rows[0]['full_mib']:.1f} MiB BF16")
    print(header)
    for r in rows:
        print(
            f"{r['case']:<12}{r['change_rate']:>9.3%}{r['delta_bytes'] / 1024:>11.1f}{r['full_over_delta']:>11.1f}"
            f"{r['delta_over_entropy_bound']:>10.3f}{r['nemo_style_over_delta']:>10.2f}"
            f"{r['diff_seconds_1core']:>9.3f}{r['reference_seconds']:>8.3f}{r['throughput_vs_reference']:>9.2f}"
            f"{r['codec_only_vs_reference']:>10.2f}{r['target_digests_vs_reference']:>11.2f}"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
