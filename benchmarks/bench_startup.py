"""The producer's start-up (issue 12 §3/§4): from ``python -m dcr_cli diff BASE NEW --push s3://...``
starting to the diff's first read of a checkpoint and to the first block upload the store receives.

    PYTHONPATH=. python benchmarks/bench_startup.py BASE NEW [--repeat 5] [--repo DIR ...] [--workers N]

BASE and NEW are checkpoint directories (e.g. /tmp/dcr-bench-corpus/dense-3/c0 and c1). The store is
a moto S3 server in this process, unthrottled, whose WSGI app is wrapped to stamp every request as it
arrives (wall clock, the same clock the child's start is taken on). The child process gets an audit
hook that stamps its first open of a file under BASE or NEW (the first byte the diff reads) and
its first socket connect. Each --repo (a checkout of dcr; default: this one) is measured in turn,
alternated --repeat times, and the best and the median of each figure are printed side by side.

Also measured per repo, once per repeat: ``python -m dcr_cli --help`` and ``diff --help`` to exit.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
KEY_ID = "AKIADCRBENCHKEY00000"
SECRET = "dcr-bench-secret-0123456789"

# Run in the child before dcr_cli: an audit hook that writes the first time of each event to $DCR_STAMPS.
PRELUDE = r"""
import os, sys, time
_roots = tuple(os.environ["DCR_STAMP_ROOTS"].split(os.pathsep))
_seen = {}
def _stamp(name):
    if name not in _seen:
        _seen[name] = time.time()
        with open(os.environ["DCR_STAMPS"], "a") as f:
            f.write(f"{name} {_seen[name]!r}\n")
def _hook(event, args):
    if event == "open" and isinstance(args[0], str):
        path = args[0]
        if path.startswith(_roots) and path.endswith(".safetensors"):
            _stamp("first_read")
        elif path.endswith(".nbi"):
            _stamp("first_kernel_cache")
        elif "/.partial-" in path:
            _stamp("first_block_file")
    elif event == "socket.connect":
        _stamp("first_connect")
    elif event == "import" and args[0] in _watch:
        _stamp("import " + args[0])
_watch = set(os.environ.get("DCR_STAMP_IMPORTS", "").split(","))
sys.addaudithook(_hook)
import atexit, runpy
atexit.register(lambda: _stamp("module " + sys.modules["dcr_cli"].__file__))
sys.argv[0] = "dcr"
runpy.run_module("dcr_cli", run_name="__main__", alter_sys=True)
"""


class Stamps:
    """WSGI middleware: (time, method, path) of every request, as it arrives."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.requests: list[tuple[float, str, str]] = []
        self.lock = threading.Lock()

    def __call__(self, environ: dict[str, Any], start_response: Any) -> Any:
        with self.lock:
            self.requests.append((time.time(), environ["REQUEST_METHOD"], environ.get("PATH_INFO", "")))
        return self.app(environ, start_response)


def _quiet_handler() -> Any:
    from werkzeug.serving import WSGIRequestHandler

    class Quiet(WSGIRequestHandler):
        def log(self, *args: Any, **kwargs: Any) -> None:  # no line per request
            pass

    return Quiet


def start_moto() -> tuple[Stamps, str, Any]:
    from moto.server import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import make_server

    stamps = Stamps(DomainDispatcherApplication(create_backend_app))
    server = make_server("127.0.0.1", 0, stamps, threaded=True, request_handler=_quiet_handler())
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return stamps, f"http://127.0.0.1:{server.server_port}", server


def child_env(repo: Path, endpoint: str) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": str(repo),
        "AWS_ACCESS_KEY_ID": KEY_ID,
        "AWS_SECRET_ACCESS_KEY": SECRET,
        "AWS_DEFAULT_REGION": "us-east-1",
        "FSSPEC_S3_ENDPOINT_URL": endpoint,
        "AWS_REQUEST_CHECKSUM_CALCULATION": "when_required",
        "AWS_RESPONSE_CHECKSUM_VALIDATION": "when_required",
    }


def one_diff(repo: Path, base: str, new: str, endpoint: str, stamps: Stamps, work: Path, workers: int | None) -> dict:
    import s3fs

    bucket = f"startup-{uuid.uuid4().hex[:10]}"
    s3fs.S3FileSystem(endpoint_url=endpoint, key=KEY_ID, secret=SECRET, skip_instance_cache=True).mkdir(bucket)
    out = work / f"delta-{uuid.uuid4().hex[:8]}"
    stamp_file = work / f"stamps-{uuid.uuid4().hex[:8]}"
    env = child_env(repo, endpoint)
    env["DCR_STAMPS"] = str(stamp_file)
    env["DCR_STAMP_ROOTS"] = os.pathsep.join(str(Path(p).resolve()) for p in (base, new))
    cmd = [sys.executable, "-X", "importtime", "-c", PRELUDE, "diff", base, new, "-o", str(out)]
    cmd += ["--push", f"s3://{bucket}/run", "--no-progress"]
    if workers:
        cmd += ["--workers", str(workers)]
    with stamps.lock:
        stamps.requests.clear()
    t0 = time.time()
    proc = subprocess.run(cmd, env=env, cwd=work, capture_output=True, text=True, check=False)
    t_end = time.time()
    if proc.returncode != 0:
        raise SystemExit(f"diff failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    seen = {}
    for line in stamp_file.read_text().splitlines():
        name, _, value = line.rpartition(" ")
        seen[name] = value
    module = next(name[len("module ") :] for name in seen if name.startswith("module "))
    if not Path(module).resolve().is_relative_to(repo.resolve()):
        raise SystemExit(f"the child imported {module}, not the checkout {repo}")
    with stamps.lock:
        reqs = list(stamps.requests)
    first_req = min((t for t, _, _ in reqs), default=float("nan"))
    block_puts = [t for t, m, p in reqs if m in ("PUT", "POST") and "/blocks/" in p]
    imports = top_imports(proc.stderr)
    return {
        "first_read": float(seen.get("first_read", "nan")) - t0,
        "first_connect": float(seen.get("first_connect", "nan")) - t0,
        "first_request": first_req - t0,
        "first_upload": (min(block_puts) if block_puts else float("nan")) - t0,
        "total": t_end - t0,
        "imports": imports,
    }


def top_imports(stderr: str, n: int = 12) -> list[tuple[str, float]]:
    """The heaviest imports (cumulative ms), of those at the top of their import tree."""
    rows = []
    for line in stderr.splitlines():
        if not line.startswith("import time:") or "|" not in line:
            continue
        try:
            fields = line[len("import time:") :].split("|")
            cum = int(fields[1])
            raw = fields[2]
        except (IndexError, ValueError):
            continue
        depth = (len(raw) - len(raw.lstrip(" "))) // 2
        if depth == 0:
            rows.append((raw.strip(), cum / 1000))
    rows.sort(key=lambda r: -r[1])
    return rows[:n]


def one_help(repo: Path, args: list[str]) -> float:
    t0 = time.time()
    subprocess.run(
        [sys.executable, "-m", "dcr_cli", *args],
        env={**os.environ, "PYTHONPATH": str(repo)},
        capture_output=True,
        check=True,
    )
    return time.time() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("base")
    ap.add_argument("new")
    ap.add_argument("--repo", action="append", type=Path, help="dcr checkout to measure (repeatable)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--workers", type=int)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    repos = args.repo or [HERE.parent]
    os.environ.update({"AWS_ACCESS_KEY_ID": KEY_ID, "AWS_SECRET_ACCESS_KEY": SECRET})
    stamps, endpoint, server = start_moto()
    results: dict[str, list[dict]] = {str(r): [] for r in repos}
    with tempfile.TemporaryDirectory(prefix="dcr-startup-") as tmp:
        work = Path(tmp)
        for _ in range(args.repeat):
            for repo in repos:
                run = one_diff(repo, args.base, args.new, endpoint, stamps, work, args.workers)
                run["help"] = one_help(repo, ["--help"])
                run["diff_help"] = one_help(repo, ["diff", "--help"])
                results[str(repo)].append(run)
    server.shutdown()
    keys = ("first_read", "first_connect", "first_request", "first_upload", "total", "help", "diff_help")
    print(f"{'seconds from start':<22}" + "".join(f"{Path(r).name:>24}" for r in results))
    for key in keys:
        cells = []
        for runs in results.values():
            values = [r[key] for r in runs]
            cells.append(f"{min(values):9.3f} (med {statistics.median(values):.3f})")
        print(f"{key:<22}" + "".join(f"{c:>24}" for c in cells))
    for repo, runs in results.items():
        print(f"\n{repo}: heaviest top-level imports of the last run (cumulative ms)")
        for name, ms in runs[-1]["imports"]:
            print(f"  {ms:8.1f}  {name}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
