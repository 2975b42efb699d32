"""Shard diff vs HF-directory diff on the same model, side by side in one run; peak RSS per producer.

Writes a BF16 model with FSDP2 on W CPU ranks (gloo): base and target (~3% of
elements with small mantissa changes) as PyTorch DCP and as DCP's own HF export
(consolidated safetensors). Then, alternating to share cache effects:

  hf      dcr diff of the two consolidated HF directories (the reference path)
  dcp     dcr diff of the two DCP directories (projection to canonical coordinates)
  dcp-hf  dcr diff of the two DCP-HF sharded exports (hf/sharded)

and prints throughput (GB/s of target bytes) and the ratios to hf (target >= 0.9). Every
timed diff runs as in a stream: the base's digests are cached, the target is hashed.
Finally it runs W producer processes (``dcr diff --rank R --world-size W``) one
after another and reports each one's peak RSS next to the largest shard file
and the model size, and the RSS of a process that only imports dcr and torch.

Usage: python benchmarks/bench_shards.py [--elements-m 64] [--world 4] [--repeat 3] [--dir DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def _worker(rank: int, world: int, out: str, elements_m: int, rate: float) -> None:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    hidden = 1024
    vocab = elements_m * 1024 * 1024 // 2 // hidden
    layers = max(1, elements_m * 1024 * 1024 // 2 // (hidden * 4 * hidden * 2))

    class Model(torch.nn.ModuleDict):
        def forward(self, x: torch.Tensor) -> torch.Tensor:  # fully_shard needs a forward; never called
            return x

    mods = Model({"embed": torch.nn.Embedding(vocab, hidden)})
    for i in range(layers):
        mods[f"up{i}"] = torch.nn.Linear(hidden, 4 * hidden, bias=False)
        mods[f"down{i}"] = torch.nn.Linear(4 * hidden, hidden, bias=False)
        mods[f"norm{i}"] = torch.nn.LayerNorm(hidden, bias=False)
    model = mods.to(torch.bfloat16)
    mesh = init_device_mesh("cpu", (world,))
    fully_shard(model, mesh=mesh)

    def save(tag: str) -> None:
        sd = model.state_dict()
        dcp.save(sd, checkpoint_id=f"{out}/{tag}/dcp")
        writer = HuggingFaceStorageWriter(f"{out}/{tag}/hf", save_distributed=True, enable_consolidation=True)
        dcp.save(sd, storage_writer=writer)

    save("base")
    g = torch.Generator().manual_seed(rank)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                continue  # norms do not change at small learning rates
            flat = p.to_local().view(torch.int16).view(-1)
            n = int(flat.numel() * rate)
            if n:
                idx = torch.randint(0, flat.numel(), (n,), generator=g)
                flat[idx] ^= torch.randint(1, 8, (n,), generator=g, dtype=torch.int16)
    save("target")


# ru_maxrss survives fork+exec (it would report this benchmark's own size), so the child reports
# its VmHWM (peak resident set of its own address space, file-backed mmap pages included) at exit.
_HWM = (
    "import atexit, sys, runpy\n"
    "def report():\n"
    "    hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM:')][0].split()[1]\n"
    "    sys.stderr.write(f'\\nVMHWM_KB {hwm}\\n')\n"
    "atexit.register(report)\n"
    "sys.argv = sys.argv[1:]\n"
    "if sys.argv == ['--import-only']:\n"
    "    import torch.distributed.checkpoint, dcr_cli.produce.engine, dcr_cli.checkpoints.dcp\n"
    "else:\n"
    "    runpy.run_module(sys.argv[0], run_name='__main__')\n"
)


def peak_rss_of(args: list[str]) -> tuple[int, float]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _HWM, *args], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"failed: {' '.join(args)}: {proc.stderr[-2000:]}")
    kb = int(proc.stderr.rsplit("VMHWM_KB", 1)[1].split()[0])
    return kb * 1024, time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--elements-m", type=int, default=64, help="model size in millions of BF16 elements")
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--rate", type=float, default=0.03)
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()

    from shard_writers import spawn_ranks

    from dcr_cli.produce import diff

    work = Path(args.dir or tempfile.mkdtemp(prefix="bench-shards-"))
    if not (work / "target" / "hf").exists():
        t = time.perf_counter()
        spawn_ranks(_worker, args.world, str(work), args.elements_m, args.rate)
        print(f"wrote checkpoints in {time.perf_counter() - t:.1f}s under {work}")
    model_bytes = sum(f.stat().st_size for f in (work / "target" / "hf").glob("*.safetensors"))
    shard_bytes = max(f.stat().st_size for f in (work / "target" / "dcp").glob("*.distcp"))

    kinds = (("hf", "hf", "hf"), ("dcp", "dcp", "dcp"), ("dcp-hf", "hf/sharded", "dcp-hf"))
    times: dict[str, list[float]] = {k: [] for k, _, _ in kinds}
    for i in range(args.repeat):
        for kind, sub, fmt in kinds:
            out = work / f"delta-{kind}"
            shutil.rmtree(out, ignore_errors=True)
            # A stream's steady state for every format alike: the base's digests are cached (it was the
            # previous step's target), the target is hashed in the timed run.
            os.environ["DCR_CACHE_DIR"] = str(work / f"cache-{kind}-{i}")
            diff(work / "base" / sub, work / "base" / sub, out, workers=args.workers, format=fmt)
            shutil.rmtree(out)
            t = time.perf_counter()
            s = diff(work / "base" / sub, work / "target" / sub, out, workers=args.workers, format=fmt)
            times[kind].append(time.perf_counter() - t)
            assert s is not None
    best = {k: min(v) for k, v in times.items()}
    gbps = {k: model_bytes / v / 1e9 for k, v in best.items()}
    print(f"model: {model_bytes / 2**20:.0f} MiB BF16, {args.world} ranks, change rate {args.rate:.1%}")
    for k, _, _ in kinds:
        med = sorted(times[k])[len(times[k]) // 2]
        print(f"  {k:4s} diff: best {best[k]:.2f}s, median {med:.2f}s of {args.repeat}  ({gbps[k]:.3f} GB/s best)")
    for k in ("dcp", "dcp-hf"):
        med = {x: sorted(v)[len(v) // 2] for x, v in times.items()}
        print(f"  ratio {k}/hf throughput: best {gbps[k] / gbps['hf']:.2f}x, median {med['hf'] / med[k]:.2f}x"
              "  (target >= 0.9x)")  # fmt: skip

    idle, _ = peak_rss_of(["--import-only"])  # imports torch and dcr, diffs nothing
    print(
        f"peak RSS per producer process (import-only process: {idle / 2**20:.0f} MiB;"
        f" largest shard file {shard_bytes / 2**20:.0f} MiB; model {model_bytes / 2**20:.0f} MiB):"
    )
    parts = work / "delta-parts"
    shutil.rmtree(parts, ignore_errors=True)
    for rank in range(args.world):
        cmd = [
            "dcr_cli",
            "diff",
            str(work / "base" / "dcp"),
            str(work / "target" / "dcp"),
            "-o",
            str(parts),
            "--rank",
            str(rank),
            "--world-size",
            str(args.world),
            "--no-progress",
        ]
        rss, secs = peak_rss_of(cmd)
        print(
            f"  rank {rank}: {rss / 2**20:.0f} MiB peak RSS ({(rss - idle) / 2**20:+.0f} MiB over import), {secs:.1f}s"
        )
    full_rss, secs = peak_rss_of(
        [
            "dcr_cli",
            "diff",
            str(work / "base" / "hf"),
            str(work / "target" / "hf"),
            "-o",
            str(work / "delta-hf-rss"),
            "--no-progress",
        ]
    )
    shutil.rmtree(work / "delta-hf-rss", ignore_errors=True)
    print(f"  (HF-dir diff, one process: {full_rss / 2**20:.0f} MiB peak RSS, mmap pages included, {secs:.1f}s)")


if __name__ == "__main__":
    main()
