"""Tensor count at scale (issue 11): a Qwen3-30B-A3B-shaped expert stack, side by side with the same bytes fused.

    PYTHONPATH=. python benchmarks/bench_moe.py [--layers 48] [--experts 128] [--hidden 64] [--rate 0.01]
        [--repeats 2] [--no-profile]

Two BF16 checkpoints of the same model (48 layers x 128 experts, attention, q/k norms, router, as
Qwen3-30B-A3B, scaled down in width), written locally:

* per-expert: every expert's gate/up/down projection is its own tensor (18,432 expert tensors, 18,867
  in all), as Hugging Face checkpoints store them;
* fused: each layer's experts as three stacked [experts, out, in] tensors (579 tensors), the same
  number of bytes.

Each gets a step with ``--rate`` of the elements nudged by one or two ulps at uniformly random
positions. Measured by running the real commands (``python -m dcr_cli``), the best of --repeats:

* manifest bytes per changed and per unchanged tensor: from the delta of the step and the delta of
  the base against itself (nothing changed), whatever the manifest's encoding
  (per unchanged = M(identity) / tensors; per changed = (M(step) - M(identity)) / changed + that);
* the manifest's share of what a receiver downloads (manifest + data blocks);
* per-tensor overhead of ``diff``, ``apply --into`` (steady state: the receiver was primed),
  ``verify --against`` and ``inspect``: (t(per-expert) - t(fused)) / (tensors(per-expert) - tensors(fused)),
  in wall time and in CPU time (user + system of the process, all threads: steadier on a shared machine);
* with profiling on (the default), where the time goes: cProfile of each command on the per-expert
  checkpoint, every thread included (benchmarks/harness.py profile), top entries by own time.

Targets (issue 11): <= 0.05 ms per tensor in each command; <= 200 B of manifest per changed tensor
and <= 100 B per unchanged one.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import corpus  # noqa: E402
from harness import Proc, dcr, mib, run, top_entries  # noqa: E402

COMMANDS = ("diff", "apply", "verify", "inspect")


def changed_tensors(a: Path, b: Path) -> tuple[int, int]:
    """(tensors with at least one changed element, changed elements), counted from the files themselves."""
    ra, rb = corpus.Reader(a), corpus.Reader(b)
    tensors = elements = 0
    for name, va in ra.views.items():
        n = int(np.count_nonzero(va != rb.views[name]))
        tensors += n > 0
        elements += n
    return tensors, elements


def delta_manifest_bytes(delta: Path) -> int:
    """Bytes of a delta that are not data or repair blocks (the manifest, in whatever files it takes)."""
    return sum(p.stat().st_size for p in delta.rglob("*") if p.is_file() and "blocks" not in p.relative_to(delta).parts)


def best(procs: list[Proc]) -> float:
    return min(p.seconds for p in procs)


def children_cpu() -> float:
    """CPU seconds (user + system) of this process's finished children: a run's CPU time is the
    difference around it, which a machine shared with other work disturbs far less than wall time."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


class Layout:
    def __init__(self, name: str, root: Path, specs: list[corpus.Spec], rate: float, work: Path) -> None:
        self.name = name
        self.specs = specs
        self.tensors = len(specs)
        shards = max(16 << 20, sum(s.nbytes for s in specs) // 2 + 1)
        self.paths = corpus.build_chain(root, specs, [corpus.Step("uniform", rate)], shard_bytes=shards)
        self.work = work / name
        self.work.mkdir(parents=True, exist_ok=True)
        self.delta = self.work / "delta"
        self.identity = self.work / "identity"
        self.recv = self.work / "recv"
        self.times: dict[str, float] = {}
        self.cpu: dict[str, float] = {}  # CPU seconds of the same runs (user + system, every thread)
        self.summary: dict[str, Any] = {}
        self.identity_summary: dict[str, Any] = {}

    def diff_argv(self, out: Path, target: int = 1) -> list[str]:
        return dcr(
            "diff",
            str(self.paths[0]),
            str(self.paths[target]),
            "-o",
            str(out),
            "--base-version",
            "v0",
            "--target-version",
            f"v{target}" if target else "v0",
            "--json",
        )

    def prime_receiver(self) -> None:
        shutil.rmtree(self.recv, ignore_errors=True)
        shutil.copytree(self.paths[0], self.recv)
        run(dcr("apply", str(self.identity), "--into", str(self.recv))).check()

    def argv(self, command: str) -> list[str]:
        if command == "diff":
            return self.diff_argv(self.work / "scratch")
        if command == "apply":
            return dcr("apply", str(self.delta), "--into", str(self.recv), "--json")
        if command == "verify":
            return dcr("verify", str(self.recv), "--against", str(self.delta), "--json")
        return dcr("inspect", str(self.delta))

    def before(self, command: str) -> None:
        if command == "diff":
            shutil.rmtree(self.work / "scratch", ignore_errors=True)
        if command == "apply":
            self.prime_receiver()

    def measure(self, repeats: int) -> None:
        shutil.rmtree(self.identity, ignore_errors=True)
        shutil.rmtree(self.delta, ignore_errors=True)
        self.summary = json.loads(run(self.diff_argv(self.delta)).check().stdout)
        self.identity_summary = json.loads(run(self.diff_argv(self.identity, target=0)).check().stdout)
        for command in COMMANDS:
            procs = []
            cpu = []
            for _ in range(repeats):
                self.before(command)
                before = children_cpu()
                procs.append(run(self.argv(command)).check())
                cpu.append(children_cpu() - before)
                if command == "apply":
                    run(dcr("verify", str(self.recv), "--against", str(self.delta))).check()  # bit-exact, untimed
            self.times[command] = best(procs)
            self.cpu[command] = min(cpu)

    def profile(self, command: str, out: Path, top: int) -> list[str]:
        self.before(command)
        argv = self.argv(command)
        run([sys.executable, str(HERE / "harness.py"), "profile", str(out), "--", *argv[3:]]).check()
        return [
            "by own time (waits left out):",
            *top_entries(out, top),
            "dcr_cli functions by cumulative time:",
            *top_entries(out, top, sort="cumtime", only="dcr_cli"),
        ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=64, help="model width (Qwen3-30B-A3B: 2048)")
    ap.add_argument("--moe-intermediate", type=int, default=24, help="expert width (Qwen3-30B-A3B: 768)")
    ap.add_argument("--rate", type=float, default=0.01)
    ap.add_argument("--repeats", type=int, default=2, help="runs per command and layout (best is kept)")
    ap.add_argument("--no-profile", dest="profile", action="store_false")
    ap.add_argument("--top", type=int, default=12, help="profile entries to print per command")
    ap.add_argument("--corpus", type=Path, default=Path(tempfile.gettempdir()) / "dcr-bench-corpus")
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    work = args.work or Path(tempfile.mkdtemp(prefix="dcr-bench-moe-"))
    tag = f"{args.layers}x{args.experts}-h{args.hidden}-i{args.moe_intermediate}-r{args.rate:g}"
    try:
        shape = dict(
            layers=args.layers, experts=args.experts, hidden=args.hidden, moe_intermediate=args.moe_intermediate
        )
        many_specs, desc = corpus.moe_specs(**shape)
        fused_specs, fused_desc = corpus.moe_specs(**shape, fused=True)
        many = Layout("per-expert", args.corpus / f"moe-{tag}", many_specs, args.rate, work)
        fused = Layout("fused", args.corpus / f"moe-fused-{tag}", fused_specs, args.rate, work)
        print(f"{desc}: {corpus.describe(many_specs)}")
        print(f"side by side: {fused_desc}: {corpus.describe(fused_specs)}")
        for layout in (many, fused):
            layout.measure(args.repeats)

        # -- manifest size
        changed, changed_elems = changed_tensors(many.paths[0], many.paths[1])
        m_step = int(many.summary["manifest_bytes"])
        m_identity = int(many.identity_summary["manifest_bytes"])
        files_step, files_identity = delta_manifest_bytes(many.delta), delta_manifest_bytes(many.identity)
        payload = int(many.summary["payload_bytes"])
        per_unchanged = m_identity / many.tensors
        per_changed = (m_step - m_identity) / max(changed, 1) + per_unchanged
        print(
            f"\nstep: {changed_elems / sum(s.numel for s in many_specs):.2%} of elements changed, "
            f"{changed} of {many.tensors} tensors changed"
        )
        print(
            f"manifest {mib(m_step)} ({files_step} B in non-block files); "
            f"nothing changed: {mib(m_identity)} ({files_identity} B)"
        )
        print(
            f"payload (data blocks) {mib(payload)}; manifest / (manifest + payload) = "
            f"{m_step / (m_step + payload):.1%}; manifest / payload = {m_step / payload:.2f}x"
        )
        print(f"manifest per unchanged tensor {per_unchanged:7.1f} B (target <= 100 B)")
        print(f"manifest per changed tensor   {per_changed:7.1f} B (target <= 200 B)")
        m_fused = int(fused.summary["manifest_bytes"])
        print(
            f"fused layout: manifest {mib(m_fused)} for {fused.tensors} tensors, "
            f"payload {mib(int(fused.summary['payload_bytes']))}"
        )

        # -- per-tensor overhead
        extra = many.tensors - fused.tensors
        print(
            f"\nper-tensor overhead: (t({many.tensors} tensors) - t({fused.tensors} tensors, same bytes)) / {extra}, "
            f"best of {args.repeats}"
        )
        print(
            f"{'command':<8} {'per-expert s':>12} {'fused s':>9} {'ms/tensor':>10} {'target':>7}"
            f"     {'cpu: per-expert s':>17} {'fused s':>8} {'ms/tensor':>10}"
        )
        overhead, cpu_overhead = {}, {}
        for command in COMMANDS:
            a, b = many.times[command], fused.times[command]
            overhead[command] = (a - b) / extra * 1e3
            ca, cb = many.cpu[command], fused.cpu[command]
            cpu_overhead[command] = (ca - cb) / extra * 1e3
            ok = "ok" if overhead[command] <= 0.05 else "MISS"
            print(
                f"{command:<8} {a:12.2f} {b:9.2f} {overhead[command]:10.3f} {'0.05':>5} {ok:<4}"
                f"     {ca:17.2f} {cb:8.2f} {cpu_overhead[command]:10.3f}"
            )
        print(f"(load average at the end: {' '.join(f'{x:.1f}' for x in os.getloadavg())} on {os.cpu_count()} cores)")

        profiles: dict[str, list[str]] = {}
        if args.profile:
            for command in COMMANDS:
                out = work / f"{command}.pstats"
                profiles[command] = many.profile(command, out, args.top)
                print(
                    f"\ncProfile of dcr {command} on the per-expert checkpoint "
                    f"(all threads, {many.tensors} tensors), top {args.top}"
                )
                for line in profiles[command]:
                    print(f"  {line}")
        if args.json:
            args.json.write_text(
                json.dumps(
                    {
                        "tensors": many.tensors,
                        "changed_tensors": changed,
                        "manifest_bytes": m_step,
                        "identity_manifest_bytes": m_identity,
                        "payload_bytes": payload,
                        "per_unchanged_bytes": per_unchanged,
                        "per_changed_bytes": per_changed,
                        "times": {"per-expert": many.times, "fused": fused.times},
                        "ms_per_tensor": overhead,
                        "cpu_seconds": {"per-expert": many.cpu, "fused": fused.cpu},
                        "cpu_ms_per_tensor": cpu_overhead,
                        "profiles": profiles,
                    },
                    indent=1,
                )
            )
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
