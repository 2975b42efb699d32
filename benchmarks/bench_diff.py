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

``--bandwidth`` measures instead the compute target of issue 12 §3 on an 8B-shaped BF16 checkpoint
(hidden 4096, intermediate 14336, sharded safetensors, ``--layers`` layers) with ``--rate`` of the
elements moved by one ulp, uniformly: `dcr diff` in a stream's steady state (base digests cached,
target hashed) on all cores and on one worker, against the one-core numpy XOR-and-count pass over
the same bytes and BLAKE3 of the target on one thread, all from a warm page cache, side by side in
one run. ``--before DIR`` also times another checkout of dcr (e.g. ``git archive`` of the base
commit) in the same run, interleaved, and checks that both write identical deltas.

    python benchmarks/bench_diff.py --bandwidth [--layers 3] [--dir DIR] [--before DIR] [--repeat 3]
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
from dcr_cli.io.pool import default_workers
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


def scan_pass(a: SafetensorsCheckpoint, b: SafetensorsCheckpoint) -> int:
    """dcr's change scan (positions, masks, new values) of every tensor, one thread, nothing encoded."""
    from dcr_cli.format.kernels import scan_changes

    return sum(len(scan_changes(a.view(n), b.view(n))[0]) for n in a.tensors)


def digest_pass(b: SafetensorsCheckpoint) -> None:
    """The target tensor table: BLAKE3 of every tensor of the new checkpoint, on one thread."""
    for name in b.tensors:
        blake3.blake3(b.view(name).view(np.uint8).data, max_threads=1).digest()


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


# ----- the bandwidth benchmark (issue 12 §3)


def shapes_8b(layers: int, vocab: int = 16384) -> dict[str, tuple[int, ...]]:
    """Llama-3-8B's tensor shapes (hidden 4096, 14336 MLP, 8 KV heads of 128), ``layers`` layers."""
    hidden, inter, kv = 4096, 14336, 1024
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        out.update(
            {
                p + "self_attn.q_proj.weight": (hidden, hidden),
                p + "self_attn.k_proj.weight": (kv, hidden),
                p + "self_attn.v_proj.weight": (kv, hidden),
                p + "self_attn.o_proj.weight": (hidden, hidden),
                p + "mlp.gate_proj.weight": (inter, hidden),
                p + "mlp.up_proj.weight": (inter, hidden),
                p + "mlp.down_proj.weight": (hidden, inter),
                p + "input_layernorm.weight": (hidden,),
                p + "post_attention_layernorm.weight": (hidden,),
            }
        )
    out["model.norm.weight"] = (hidden,)
    out["lm_head.weight"] = (vocab, hidden)
    return out


def write_sharded(root: Path, shapes: dict[str, tuple[int, ...]], values, shard_bytes: int = 512 << 20) -> None:
    """A sharded HF safetensors directory, written tensor by tensor (``values(name, shape)`` -> uint16)."""
    import struct

    root.mkdir(parents=True, exist_ok=True)
    groups: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        nbytes = math.prod(shape) * 2
        if groups[-1] and size + nbytes > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    weight_map = {}
    for i, group in enumerate(groups):
        file = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        header, offset = {}, 0
        for name in group:
            nbytes = math.prod(shapes[name]) * 2
            header[name] = {"dtype": "BF16", "shape": list(shapes[name]), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
            weight_map[name] = file
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        with open(root / file, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            for name in group:
                f.write(values(name, shapes[name]).tobytes())
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def make_8b_pair(root: Path, layers: int, rate: float) -> tuple[Path, Path]:
    """(base, new) under ``root`` (kept between runs): BF16 N(0, 0.02) values; ``rate`` of them moved one ulp."""
    import zlib

    base, new = root / "base", root / "new"
    if (new / "model.safetensors.index.json").exists():
        return base, new
    shapes = shapes_8b(layers)

    def seed(name: str) -> int:
        return zlib.crc32(name.encode())

    def base_values(name: str, shape: tuple[int, ...]) -> np.ndarray:
        x = np.random.default_rng(seed(name)).standard_normal(math.prod(shape), dtype=np.float32) * 0.02
        return (x.view(np.uint32) >> 16).astype(np.uint16)

    def new_values(name: str, shape: tuple[int, ...]) -> np.ndarray:
        raw = base_values(name, shape)
        rng = np.random.default_rng(seed(name) + 1)
        idx = np.flatnonzero(rng.random(raw.size, dtype=np.float32) < rate)
        raw[idx] = (raw[idx].astype(np.int32) + np.where(rng.random(idx.size) < 0.5, 1, -1)).astype(np.uint16)
        return raw

    write_sharded(base, shapes, base_values)
    write_sharded(new, shapes, new_values)
    return base, new


# Runs in a child process with the checkout under test on PYTHONPATH; prints one JSON line.
_CHILD = r"""
import json, os, shutil, sys, time
from pathlib import Path
from dcr_cli.checkpoints.safetensors_dir import SafetensorsCheckpoint
from dcr_cli.produce import diff
from dcr_cli.delta.writer import DeltaWriter
base, new, work, workers = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4:]
out = {}
finish = DeltaWriter.finish
tail = [0.0]
def timed_finish(self, *args, **kwargs):  # the serial tail: last blocks written and fsynced, the manifest
    start = time.perf_counter()
    try:
        return finish(self, *args, **kwargs)
    finally:
        tail[0] = time.perf_counter() - start
DeltaWriter.finish = timed_finish
for i, w in enumerate(["warm"] + workers):
    os.environ["DCR_CACHE_DIR"] = str(work / f"cache-{i}")
    with SafetensorsCheckpoint(base) as a:
        a.tensor_digests()  # a stream's steady state: the base was the previous target
    delta = work / f"delta-{i}"
    start, cpu = time.perf_counter(), time.process_time()
    diff(base, new, delta, workers=int(w) if w not in ("all", "warm") else None)
    out[w] = time.perf_counter() - start
    out[w + " cpu"] = time.process_time() - cpu
    out[w + " finish"] = tail[0]
    raw = (delta / "manifest.json").read_bytes()
    if raw[:4] == b"\x28\xb5\x2f\xfd":  # a 2.x manifest is one zstd frame (delta-v2 §3)
        import zstandard
        raw = zstandard.ZstdDecompressor().decompress(raw)
    manifest = json.loads(raw)
    manifest.pop("created", None)
    out["delta"] = [sorted(os.listdir(delta / "blocks")), json.dumps(manifest, sort_keys=True)]
    shutil.rmtree(delta)
    shutil.rmtree(work / f"cache-{i}")
import dcr_cli
out["module"] = dcr_cli.__file__
print("RESULT " + json.dumps(out))
"""


def run_child(checkout: Path, base: Path, new: Path, work: Path) -> dict:
    import subprocess

    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(base), str(new), str(work), "all", "1"],
        env=env, capture_output=True, text=True, check=False, cwd=tempfile.gettempdir(),
    )  # fmt: skip
    if proc.returncode != 0:
        raise SystemExit(f"diff with {checkout} failed: {proc.stderr[-3000:]}")
    got = json.loads(proc.stdout.rsplit("RESULT ", 1)[1])
    if not Path(got["module"]).resolve().is_relative_to(checkout.resolve()):
        raise SystemExit(f"the child imported {got['module']}, not the checkout {checkout}")
    return got


def bandwidth(args: argparse.Namespace) -> None:
    root = Path(args.dir or tempfile.mkdtemp(prefix="dcr-bench-8b-"))
    t = time.perf_counter()
    base, new = make_8b_pair(root, args.layers, args.rate)
    print(f"corpus ready in {time.perf_counter() - t:.0f}s under {root}")
    checkouts = {"after": Path(__file__).resolve().parents[1]}
    if args.before:
        checkouts = {"before": Path(args.before).resolve(), **checkouts}
    with SafetensorsCheckpoint(base) as a, SafetensorsCheckpoint(new) as b:
        target_bytes = sum(t.nbytes for t in b.tensors.values())
        elements = sum(t.numel for t in b.tensors.values())
        reference_pass(a, b)  # warm the page cache for both sides
    times: dict[str, list[float]] = {"reference": [], "blake3": [], "scan": []}
    deltas = {}
    for _ in range(args.repeat):
        for label, checkout in checkouts.items():
            # The reference and BLAKE3 pass open the files anew each time, as a diff does.
            with SafetensorsCheckpoint(base) as a, SafetensorsCheckpoint(new) as b:
                for key, fn in (
                    ("reference", lambda: reference_pass(a, b)),
                    ("blake3", lambda: digest_pass(b)),
                    ("scan", lambda: scan_pass(a, b)),
                ):
                    start, cpu = time.perf_counter(), time.process_time()
                    fn()
                    times[key].append(time.perf_counter() - start)
                    times.setdefault(key + " cpu", []).append(time.process_time() - cpu)
            got = run_child(checkout, base, new, root / f"work-{label}")
            for w in ("all", "1", "all cpu", "1 cpu", "all finish", "1 finish"):
                times.setdefault(f"{label} {w}", []).append(got[w])
            deltas[label] = got["delta"]
    best = {k: min(v) for k, v in times.items()}
    ref = best["reference"]
    print(
        f"model: {target_bytes / 2**30:.2f} GiB BF16 per side, {elements / 1e9:.2f} G elements, {args.layers} layers,"
        f" {args.rate:.0%} uniform changes; {default_workers()} cores; best of {args.repeat}, interleaved"
    )
    print("  (wall: elapsed seconds; cpu: seconds of CPU over all threads, robust to other load on the machine)")
    print(f"  {'':42s}{'best s':>8}{'median s':>10}{'vs ref':>8}{'cpu s':>8}{'cpu/ref':>9}")
    rows = [
        ("reference: numpy XOR-and-count, one core", "reference"),
        ("BLAKE3 of the target, one thread", "blake3"),
        ("change scan alone (after), one thread", "scan"),
    ]
    for label in checkouts:
        rows += [(f"dcr diff ({label}), all cores", f"{label} all"), (f"dcr diff ({label}), one worker", f"{label} 1")]
    for text, key in rows:
        v = sorted(times[key])
        cpu = best[key + " cpu"]
        print(
            f"  {text:42s}{best[key]:>8.3f}{v[len(v) // 2]:>10.3f}{best[key] / ref:>7.2f}x"
            f"{cpu:>8.3f}{cpu / best['reference cpu']:>8.2f}x"
        )
    for label in checkouts:
        print(
            f"  of which the writer's finish ({label}; last blocks written and fsynced, manifest, serial):"
            f" {best[f'{label} all finish']:.3f} s all cores, {best[f'{label} 1 finish']:.3f} s one worker"
            f" ({best[f'{label} all finish'] / ref:.2f}x, {best[f'{label} 1 finish'] / ref:.2f}x the reference)"
        )
    if "before" in checkouts:
        for w, name in (("all", "all cores"), ("1", "one worker")):
            print(
                f"  after vs before, {name}: {best[f'before {w}'] / best[f'after {w}']:.2f}x faster,"
                f" {best[f'before {w} cpu'] / best[f'after {w} cpu']:.2f}x less CPU"
            )
        print(f"  deltas identical: {deltas['before'] == deltas['after']}")
    if args.json:
        args.json.write_text(json.dumps({"times": times, "best": best}, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--size", default="small")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--bandwidth", action="store_true", help="the 8B-shaped compute benchmark (see above)")
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--rate", type=float, default=0.03)
    parser.add_argument("--dir", help="corpus directory for --bandwidth (kept, reused)")
    parser.add_argument("--before", help="another dcr checkout to time side by side (--bandwidth)")
    args = parser.parse_args()
    if args.bandwidth:
        bandwidth(args)
        return
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
