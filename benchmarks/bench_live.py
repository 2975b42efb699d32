"""Live diff vs file-based diff of the same bytes vs a plain copy of the same bytes, side by side.

Builds an 8B-shaped slice of a BF16 model (hidden 4096; embedding, attention and MLP
matrices) of about ``--mib`` MiB, and a target with ``--rate`` of its elements changed
(small mantissa steps, as an optimizer makes). Then, alternating, ``--repeat`` times:

  copy   a plain copy of the target's bytes on the tensors' device (``Tensor.copy_``): the floor
  live   ``dcr_cli.diff_tensors`` of the two states held as tensors (base digests known, as a
         Producer holds them; the target hashed)
  file   ``dcr diff`` of the same two states saved as HF checkpoints, as in a stream (base
         digests cached, target hashed; page cache warm)
  scan   the device path's torch scan alone (compare, positions, XOR values; what a GPU runs; on the
         CPU the live path uses the compiled kernel instead), no encoding or hashing

and prints the best time of each, GB/s of target bytes and the ratios. Both deltas are
checked equal (except ``created``). ``--device cuda`` runs the live side on a GPU.

Usage: python benchmarks/bench_live.py [--mib 512] [--rate 0.03] [--repeat 3] [--device cpu] [--workers N]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def model(mib: int, rate: float, seed: int = 0) -> tuple[dict[str, Any], dict[str, Any]]:
    import torch

    hidden = 4096
    g = torch.Generator().manual_seed(seed)
    shapes = [("model.embed_tokens.weight", (max(1, mib * 2**20 // 10 // (2 * hidden)), hidden))]
    budget = mib * 2**20 - shapes[0][1][0] * hidden * 2
    layer = 0
    while budget > 0:
        for name, shape in (("self_attn.q_proj", (hidden, hidden)), ("mlp.up_proj", (hidden * 3, hidden))):
            rows = min(shape[0], max(1, budget // (2 * hidden)))
            shapes.append((f"model.layers.{layer}.{name}.weight", (rows, hidden)))
            budget -= rows * hidden * 2
            if budget <= 0:
                break
        layer += 1
    base, new = {}, {}
    for name, shape in shapes:
        b = (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)
        n = b.clone()
        flat = n.view(-1).view(torch.int16)
        idx = torch.randint(0, flat.numel(), (int(flat.numel() * rate),), generator=g)
        flat[idx] ^= torch.randint(1, 8, (len(idx),), generator=g, dtype=torch.int16)
        base[name], new[name] = b, n
    return base, new


def best(fn: Callable[[], None], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--rate", type=float, default=0.03)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temporary one)")
    args = ap.parse_args()

    import os

    import torch
    from checkpoints import write_checkpoint

    from dcr_cli.checkpoints.safetensors_dir import SafetensorsCheckpoint
    from dcr_cli.format.digest import digest_bytes
    from dcr_cli.format.manifest import manifest_json
    from dcr_cli.produce import diff
    from dcr_cli.produce.live import _int_view, diff_tensors

    scratch = Path(args.dir or tempfile.mkdtemp(prefix="dcr-bench-live-"))
    os.environ.setdefault("DCR_CACHE_DIR", str(scratch / "cache"))
    base, new = model(args.mib, args.rate)
    a, b = write_checkpoint(scratch / "a", base), write_checkpoint(scratch / "b", new)
    with SafetensorsCheckpoint(a) as ck:
        ck.tensor_digests()  # the stream state: the base's digests are cached
    base_digests = {k: digest_bytes(v.contiguous().view(torch.uint8).numpy()) for k, v in base.items()}
    dev = torch.device(args.device)
    base_d = {k: v.to(dev) for k, v in base.items()}
    new_d = {k: v.to(dev) for k, v in new.items()}
    copies = {k: torch.empty_like(v) for k, v in new_d.items()}
    nbytes = sum(v.numel() * v.element_size() for v in new.values())

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def copy() -> None:
        for k, v in new_d.items():
            copies[k].copy_(v)
        sync()

    def scan() -> None:
        for k, v in new_d.items():
            bb, nn = _int_view(base_d[k]).reshape(-1), _int_view(v).reshape(-1)
            step = (16 << 20) // 2
            for s in range(0, len(nn), step):
                x, y = bb[s : s + step], nn[s : s + step]
                pos = torch.nonzero(x != y).reshape(-1)
                (x[pos] ^ y[pos]).cpu(), y[pos].cpu(), pos.cpu()
        sync()

    counter = iter(range(10**6))

    def live() -> None:
        out = scratch / f"live-{next(counter)}"
        diff_tensors(base_d, new_d, out, base_digests=base_digests, workers=args.workers,
                             base_version="a", target_version="b")  # fmt: skip

    def file() -> None:
        out = scratch / f"file-{next(counter)}"
        diff(a, b, out, workers=args.workers, base_version="a", target_version="b")
        # the target was hashed: forget it, so that each run is in the stream state
        shutil.rmtree(scratch / "cache", ignore_errors=True)
        with SafetensorsCheckpoint(a) as ck:
            ck.tensor_digests()

    results: dict[str, float] = {}
    for _ in range(args.repeat):  # alternate, to share cache and noise effects
        runs: list[tuple[str, Callable[[], None]]] = [("copy", copy), ("scan", scan), ("live", live), ("file", file)]
        for label, fn in runs:
            results[label] = min(results.get(label, 1e9), best(fn, 1))
    lives, files = sorted(scratch.glob("live-*")), sorted(scratch.glob("file-*"))
    m1, m2 = (json.loads(manifest_json((d / "manifest.json").read_bytes())) for d in (lives[0], files[0]))
    m1.pop("created"), m2.pop("created")
    assert m1 == m2, "the live delta differs from dcr diff's"
    print(f"{nbytes / 2**20:.0f} MiB BF16, {args.rate:.1%} changed, device {dev}, {len(new)} tensors")
    for label in ("copy", "scan", "live", "file"):
        t = results[label]
        print(f"  {label:5s} {t * 1e3:9.1f} ms  {nbytes / t / 1e9:7.2f} GB/s  {t / results['copy']:7.1f}x copy")
    print(f"  live / file: {results['live'] / results['file']:.2f}x (deltas identical except 'created')")
    if args.dir is None:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
