"""Catch-up of a lagging receiver: the chain vs one squashed delta vs a keyframe, side by side.

    PYTHONPATH=. python benchmarks/bench_catchup.py [--size small] [--steps 21] [--behind 1 5 20]

Trains ``examples/train_tiny.py`` for ``steps`` real AdamW steps (BF16 checkpoints), diffs every
step, pushes and commits them to a local store. For a receiver ``k`` versions behind the head:

* chain:    ``dcr pull --since`` of the k deltas, then ``dcr apply`` of the chain in place;
* squash:   ``dcr squash`` of the k deltas (producer side, timed apart), pull of that one delta,
            apply in place;
* keyframe: a keyframe of the head (a plain checkpoint in the store), joined with one download
            (every file and the model fingerprint verified).

Bytes are what the receiver fetches (data blocks; a keyframe's files). Times are wall clock on
this machine (a local store: transfer is a file copy, so bytes are the figure that transfers).
Every receiver's result is checked bit for bit against the head checkpoint.

Last figures (small, 21 steps, lr 1e-6, ~1.5% of elements change per step; 2 shared cores):

    behind | chain MiB      s | squash MiB      s build s | keyframe MiB      s | chain/squash keyframe/squash
         1 |     0.284   0.11 |      0.284   0.06    0.06 |        40.02   0.05 |        1.00x          140.8x
         5 |     1.444   0.35 |      0.865   0.08    0.27 |        40.02   0.06 |        1.67x           46.3x
        20 |     6.946   0.95 |      2.168   0.09    1.40 |        40.02   0.05 |        3.20x           18.5x
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

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import dcr_cli  # noqa: E402
from dcr_cli.checkpoints.safetensors_dir import SafetensorsCheckpoint  # noqa: E402
from dcr_cli.delta.reader import Delta  # noqa: E402
from dcr_cli.store.keyframes import join, publish_keyframe  # noqa: E402


def bits(root: Path) -> dict[str, bytes]:
    with SafetensorsCheckpoint(root) as ckpt:
        return {n: ckpt.view(n).tobytes() for n in ckpt.tensors}


def payload(path: Path) -> int:
    return Delta.open(path).manifest.payload_bytes()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="small", help="train_tiny size (default: small, its largest)")
    parser.add_argument("--steps", type=int, default=21)
    parser.add_argument("--behind", type=int, nargs="+", default=[1, 5, 20])
    parser.add_argument("--workers", type=int, default=None)
    parser.add_argument("--keep", type=Path, help="work directory to keep (default: a temporary one)")
    args = parser.parse_args()
    if max(args.behind) >= args.steps + 1:
        parser.error("--steps must exceed the largest --behind")
    work = args.keep or Path(tempfile.mkdtemp(prefix="dcr-bench-catchup-"))
    work.mkdir(parents=True, exist_ok=True)
    ck, deltas, store = work / "ck", work / "d", work / "store"
    t0 = time.perf_counter()
    if not (ck / f"step-{args.steps}").exists():
        subprocess.run(
            [sys.executable, str(REPO / "examples" / "train_tiny.py"), str(ck), "--steps", str(args.steps),
             "--size", args.size],
            check=True, env={**os.environ, "PYTHONPATH": str(REPO)},
        )  # fmt: skip
    print(f"trained {args.steps} steps ({args.size}) in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    url = str(store)
    if not store.exists():
        for k in range(1, args.steps + 1):
            out = deltas / f"step-{k}"
            dcr_cli.diff(ck / f"step-{k - 1}", ck / f"step-{k}", out, base_version=f"step-{k - 1}",
                         target_version=f"step-{k}", workers=args.workers)  # fmt: skip
            dcr_cli.push(out, url)
            dcr_cli.acknowledge(url, f"step-{k}", "bench")
            dcr_cli.commit(url, f"step-{k}", receivers=["bench"])
        publish_keyframe(url, ck / f"step-{args.steps}", version=f"step-{args.steps}")
    head = f"step-{args.steps}"
    want = bits(ck / head)
    full = sum(f.stat().st_size for f in (ck / head).iterdir() if f.suffix == ".safetensors")

    rows = []
    for k in args.behind:
        since = f"step-{args.steps - k}"
        run = work / f"behind-{k}"
        shutil.rmtree(run, ignore_errors=True)
        run.mkdir()
        # chain
        recv = run / "recv-chain"
        shutil.copytree(ck / since, recv)
        t = time.perf_counter()
        pulled = dcr_cli.pull_since(url, since, run / "chain")
        dcr_cli.apply(run / "chain", into=recv, workers=args.workers)
        chain_s = time.perf_counter() - t
        chain_b = sum(r.downloaded_bytes for r in pulled)
        assert bits(recv) == want
        # squash (producer side), then the receiver's pull + apply of one delta
        chain_dirs = [deltas / f"step-{i}" for i in range(args.steps - k + 1, args.steps + 1)]
        t = time.perf_counter()
        dcr_cli.squash(chain_dirs, run / "squash", workers=args.workers)
        squash_build_s = time.perf_counter() - t
        recv = run / "recv-squash"
        shutil.copytree(ck / since, recv)
        t = time.perf_counter()
        local = run / "squash-pulled"
        shutil.copytree(run / "squash", local, ignore=shutil.ignore_patterns("*.partial*"))
        # only data blocks travel: count them, as pull does
        squash_b = payload(local)
        dcr_cli.apply(local, into=recv, workers=args.workers)
        squash_s = time.perf_counter() - t
        assert bits(recv) == want
        # keyframe
        t = time.perf_counter()
        joined = join(url, run / "recv-keyframe")
        key_s = time.perf_counter() - t
        assert bits(Path(joined.path)) == want
        rows.append((k, chain_b, chain_s, squash_b, squash_s, squash_build_s, joined.bytes, key_s))

    print(f"\nreceiver behind head {head}; full checkpoint {full / 2**20:.2f} MiB")
    print(
        f"{'behind':>6} | {'chain MiB':>9} {'s':>6} | {'squash MiB':>10} {'s':>6} {'build s':>7} | "
        f"{'keyframe MiB':>12} {'s':>6} | {'chain/squash':>12} {'keyframe/squash':>15}"
    )
    for k, cb, cs, sb, ss, sbs, kb, ks in rows:
        print(
            f"{k:>6} | {cb / 2**20:>9.3f} {cs:>6.2f} | {sb / 2**20:>10.3f} {ss:>6.2f} {sbs:>7.2f} | "
            f"{kb / 2**20:>12.2f} {ks:>6.2f} | {cb / sb:>11.2f}x {kb / sb:>14.1f}x"
        )
    if args.keep is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
