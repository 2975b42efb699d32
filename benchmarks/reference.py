"""The reference refit: transport only, the full checkpoint, with dcr's client and parallelism.

    python benchmarks/reference.py up CKPT URL [--workers 8] [--object-bytes 64M] [--max-bytes N] [--limit-rate R]
    python benchmarks/reference.py down URL OUT [--workers 8] [--limit-rate R]

``up`` cuts the checkpoint's files into objects of ``--object-bytes`` (dcr's block size) and uploads
them to ``URL/full/`` with ``--workers`` threads through fsspec (s3fs for s3://, as dcr push does);
``down`` downloads every object under ``URL/full/`` the same way and writes each one to a file in
OUT, fsynced (as dcr pull writes blocks). ``--max-bytes`` sends only that many bytes of the
checkpoint (a sample, to be scaled by the caller). ``--limit-rate`` caps the average rate of all
workers together, like dcr's own ``--limit-rate`` (used for stores without a proxy in front, such as
a local directory). Prints one JSON line: bytes, objects, seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import fsspec

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throttle import parse_rate

# The same limiter dcr push and pull use, so that the reference is throttled exactly as dcr is.
from dcr_cli.store.transfer import RateLimit


def run_all(tasks: list[Callable[[], None]], workers: int) -> None:
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for f in [pool.submit(t) for t in tasks]:
            f.result()


def upload(
    ckpt: Path, url: str, workers: int, object_bytes: int, max_bytes: int | None, limit: RateLimit | None
) -> dict[str, Any]:
    fs, root = fsspec.core.url_to_fs(url)
    files = sorted(p for p in ckpt.iterdir() if p.is_file())
    pieces: list[tuple[Path, int, int]] = []
    budget = max_bytes if max_bytes is not None else sum(p.stat().st_size for p in files)
    for p in files:
        size = p.stat().st_size
        for start in range(0, size, object_bytes):
            n = min(object_bytes, size - start, budget)
            if n <= 0:
                break
            pieces.append((p, start, n))
            budget -= n
    fs.makedirs(f"{root}/full", exist_ok=True)

    def task(i: int, path: Path, start: int, n: int) -> Callable[[], None]:
        def go() -> None:
            with open(path, "rb") as f:
                f.seek(start)
                data = f.read(n)
            if limit is not None:
                limit.take(len(data))
            fs.pipe_file(f"{root}/full/{i:06d}", data)

        return go

    t = time.perf_counter()
    run_all([task(i, *piece) for i, piece in enumerate(pieces)], workers)
    return {"bytes": sum(n for _, _, n in pieces), "objects": len(pieces), "seconds": time.perf_counter() - t}


def download(url: str, out: Path, workers: int, limit: RateLimit | None) -> dict[str, Any]:
    fs, root = fsspec.core.url_to_fs(url)
    out.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    names = sorted(fs.ls(f"{root}/full", detail=False))
    total = [0]
    lock = threading.Lock()

    def task(name: str) -> Callable[[], None]:
        def go() -> None:
            data = fs.cat_file(name)
            if limit is not None:
                limit.take(len(data))
            fd = os.open(out / name.rsplit("/", 1)[-1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.write(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            with lock:
                total[0] += len(data)

        return go

    run_all([task(n) for n in names], workers)
    return {"bytes": total[0], "objects": len(names), "seconds": time.perf_counter() - t}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up")
    up.add_argument("ckpt", type=Path)
    up.add_argument("url")
    up.add_argument("--object-bytes", type=int, default=64 << 20, help="bytes per object (dcr's block size)")
    up.add_argument("--max-bytes", type=int, default=None)
    down = sub.add_parser("down")
    down.add_argument("url")
    down.add_argument("out", type=Path)
    for p in (up, down):
        p.add_argument("--workers", type=int, default=8)
        p.add_argument("--limit-rate", default=None)
    args = ap.parse_args()
    limit = RateLimit(parse_rate(args.limit_rate)) if args.limit_rate else None
    if args.cmd == "up":
        result = upload(args.ckpt, args.url, args.workers, args.object_bytes, args.max_bytes, limit)
    else:
        result = download(args.url, args.out, args.workers, limit)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
