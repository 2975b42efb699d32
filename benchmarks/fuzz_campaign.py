"""A long fuzz campaign: the CI fuzz suite (tests/test_fuzz_*.py) with many more, random examples.

    python benchmarks/fuzz_campaign.py --examples 2000            # per fuzz test; prints cases per family
    python benchmarks/fuzz_campaign.py --examples 500 -k blocks   # one family

CI runs the same suite with a bounded, derandomized number of examples (DCR_FUZZ_EXAMPLES, default 120
per test, about 30 s on two cores). Here hypothesis draws fresh cases each run (DCR_FUZZ_RANDOM=1); a
failure prints the minimal failing case, which can be pasted into a test as an explicit example.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", type=int, default=2000, help="hypothesis examples per fuzz test")
    parser.add_argument("-k", default="", help="pytest -k expression (e.g. manifest, blocks, header, store, state)")
    parser.add_argument("--report", type=Path, help="write the case counts (JSON) here as well")
    args = parser.parse_args()
    report = Path(tempfile.mkstemp(prefix="dcr-fuzz-", suffix=".json")[1])
    report.unlink()
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "DCR_FUZZ_EXAMPLES": str(args.examples),
        "DCR_FUZZ_RANDOM": "1",
        "DCR_FUZZ_REPORT": str(report),
    }
    files = sorted(str(p) for p in (REPO / "tests").glob("test_fuzz_*.py"))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files]
    if args.k:
        cmd += ["-k", args.k]
    started = time.perf_counter()
    rc = subprocess.call(cmd, cwd=REPO, env=env)
    seconds = time.perf_counter() - started
    counts = json.loads(report.read_text()) if report.exists() else {}
    width = max((len(k) for k in counts), default=10)
    print(f"\nfuzz campaign: {args.examples} examples per test, {seconds:.0f} s, pytest exit {rc}")
    for key, n in counts.items():
        print(f"  {key:<{width}}  {n:>7}")
    if args.report:
        args.report.write_text(json.dumps(counts, indent=1) + "\n")
    return rc


if __name__ == "__main__":
    sys.exit(main())
