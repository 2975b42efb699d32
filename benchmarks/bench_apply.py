"""dcr apply --into vs a dense refit, and dcr verify vs a plain read, measured side by side.

    PYTHONPATH=. python benchmarks/bench_apply.py [--size-mb 512] [--rate 0.02] [--repeats 3]

A synthetic BF16 model (layer matrices like a small LLM) is written as v0;
v1 changes about ``rate`` of the elements at uniformly random positions (the
pattern RL fine-tuning produces in BF16: sparse and scattered). Then:

* apply:  the receiver holds v0 with its recorded state (as a previous apply
  leaves it); time ``dcr_cli.apply(delta, into=receiver)``, which includes
  all checks (block digests, the first pass that decodes and classifies every
  item), the in-place writes (pwrite), fsync of the files, the proof (the
  touched tensors read back and compared with the target table) and the
  atomic state update. The proof's share is printed as a ratio.
* dense refit: write the full v1 checkpoint (``safetensors.torch.save_file`` of
  the tensors already in memory, as a trainer would) and fsync it.
* the same two without durability (page cache only), for the CPU side.
* verify: ``dcr_cli.verify(receiver, against=delta)`` vs reading the same
  files once through the page cache (``readinto`` in 8 MiB chunks).
* the floors an exact apply and verify cannot go below on this machine, measured in the same run:
  writing back just the 4 KiB pages the step touches, then fsync (what any in-place apply must make
  durable); and BLAKE3 of the files' bytes on all cores, straight from the page cache (what a
  digest proof must compute).

Ratios are printed; the issue's target is apply/dense <= 0.1 at 2%.

With ``--corpus DIR`` the model is instead the multi-GiB 8B-shaped corpus of benchmarks/corpus.py
(``--size-gb``, default 3; a uniform ``--rate`` step; built once under DIR and reused), nothing of it
held in memory, and both of the on-disk receiver's orders are measured:

* streaming: the receiver's state records the base (a refit's steady case, §4.4: one pass);
* two-pass: the receiver is resuming this delta (its state says "applying", its files still at the
  base), so every check runs first and the items are written in a second pass (§4.1 step 6, §4.3):
  what a receiver whose version was hashed, a delta with overwrite items or a resume take. The first
  pass keeps what fits the applier's staging budget; the rest is read, decoded and verified again in
  the write pass ("re-read items", the thread-seconds spent on them).

The dense reference is then writing the target's files (read from the page cache, 8 MiB at a time)
into a fresh directory, and fsync; the phases (first pass, re-read items, write pass, fsync + proof)
are timed by wrapping the applier's functions, the same way for any version of its code.
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import blake3
import numpy as np
import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers_checkpoints import write_checkpoint

import dcr_cli
from dcr_cli.checkpoints.safetensors_dir import SafetensorsCheckpoint
from dcr_cli.produce import diff
from dcr_cli.receive import checkpoint as receiver
from dcr_cli.receive.checkpoint import inplace
from dcr_cli.receive.checkpoint.state import write_recorded_table


def model_tensors(size_mb: int, rng: np.random.Generator) -> dict[str, tuple[str, tuple[int, ...], np.ndarray]]:
    hidden = 1024
    per_layer = 4 * hidden * hidden * 2 + 2 * hidden * 4 * hidden * 2  # q,k,v,o + up,down in BF16
    layers = max(1, (size_mb << 20) // per_layer)
    tensors = {}
    for i in range(layers):
        for name, shape in (
            ("q", (hidden, hidden)),
            ("k", (hidden, hidden)),
            ("v", (hidden, hidden)),
            ("o", (hidden, hidden)),
            ("up", (4 * hidden, hidden)),
            ("down", (hidden, 4 * hidden)),
        ):
            # Plausible BF16 weights: the upper 16 bits of small normal floats.
            values = (rng.standard_normal(shape[0] * shape[1], dtype=np.float32) * 0.02).view(np.uint32)
            tensors[f"layers.{i}.{name}.weight"] = ("BF16", shape, (values >> 16).astype(np.uint16))
    return tensors


def change(tensors: dict, rate: float, rng: np.random.Generator, pattern: str = "scattered") -> dict:
    """Change about ``rate`` of all elements: at uniformly random positions, or as whole random rows."""
    out = {}
    for name, (dt, shape, values) in tensors.items():
        values = values.copy()
        if pattern == "rows":
            mask = np.repeat(rng.random(shape[0]) < rate, int(np.prod(shape[1:])))
        else:
            mask = rng.random(values.size) < rate
        values[mask] ^= rng.integers(1, 4, size=int(mask.sum()), dtype=np.uint16)  # a step in the low mantissa bits
        out[name] = (dt, shape, values)
    return out


def fsync_tree(root: Path) -> None:
    for p in root.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
    os.sync()


CPU_SECONDS: dict[int, float] = {}  # id(fn) -> median CPU seconds (all threads) of the last measurement
STAT: Callable[[list[float]], float] = statistics.median  # of the repeats (--stat min: the best of them)


def median_time(fn: Callable[[], object], setup: Callable[[], object], repeats: int) -> float:
    """Median wall seconds; the median CPU seconds go to CPU_SECONDS (robust on a shared, loaded machine)."""
    times, cpu = [], []
    for _ in range(repeats):
        setup()
        t, c = time.perf_counter(), time.process_time()
        fn()
        times.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    CPU_SECONDS[id(fn)] = STAT(cpu)
    return STAT(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mb", type=int, default=512)
    ap.add_argument("--rate", type=float, default=0.02)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--pattern",
        choices=["scattered", "rows"],
        default="scattered",
        help="Where changes fall: uniformly random elements (RL in BF16) or whole rows (clustered).",
    )
    ap.add_argument("--dir", default=None, help="Work directory on the disk to measure (default: a temp dir).")
    ap.add_argument("--corpus", type=Path, default=None, help="Use the corpus.py checkpoints under this directory.")
    ap.add_argument("--size-gb", type=float, default=3.0, help="With --corpus: the model's size.")
    ap.add_argument("--modes", default="streaming,two-pass", help="With --corpus: the apply orders to measure.")
    ap.add_argument("--stat", choices=["median", "min"], default="median", help="Of the repeats: median or best.")
    args = ap.parse_args()
    global STAT
    STAT = min if args.stat == "min" else statistics.median
    if args.corpus is not None:
        corpus_main(args)
        return

    work = Path(tempfile.mkdtemp(prefix="dcr-bench-apply-", dir=args.dir))
    try:
        rng = np.random.default_rng(0)
        t0 = model_tensors(args.size_mb, rng)
        t1 = change(t0, args.rate, rng, args.pattern)
        write_checkpoint(work / "v0", t0, shards=2)
        write_checkpoint(work / "v1", t1, shards=2)
        nbytes = sum(v.nbytes for _, _, v in t1.values())
        pages = sum(((t1[n][2] != t0[n][2]).reshape(-1, 2048).any(axis=1)).sum() for n in t1)  # 4 KiB of BF16
        changed = sum(int((t1[n][2] != t0[n][2]).sum()) for n in t1)
        diff(work / "v0", work / "v1", work / "delta", base_version="v0", target_version="v1")
        delta = work / "delta"
        payload = sum(p.stat().st_size for p in (work / "delta" / "blocks").iterdir())
        torch_tensors = {
            n: torch.from_numpy(v.view(np.int16)).view(torch.bfloat16).reshape(s) for n, (_, s, v) in t1.items()
        }
        print(
            f"model {nbytes / 2**20:.0f} MiB BF16, {len(t1)} tensors; {changed / (nbytes // 2):.2%} elements changed "
            f"({args.pattern}), touching {pages / (nbytes // 4096):.1%} of 4 KiB pages; "
            f"delta {payload / 2**20:.1f} MiB (data + repair blocks)"
        )

        recv = work / "recv"
        shutil.copytree(work / "v0", recv)
        from dcr_cli.delta.reader import Delta

        manifest = Delta.open(delta).manifest

        def reset_receiver() -> None:
            """Receiver at v0 with the state a previous apply leaves; its files clean on disk."""
            for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
                with open(work / "v0" / name, "rb") as src, open(recv / name, "r+b") as dst:
                    shutil.copyfileobj(src, dst, 8 << 20)
            fsync_tree(recv)
            (recv / ".dcr").mkdir(exist_ok=True)
            with SafetensorsCheckpoint(recv) as ckpt:
                stats = receiver.file_stats(recv, ckpt)
            receiver.write_state(recv, receiver.ReceiverState("v0", manifest.base.fingerprint, None, stats))
            write_recorded_table(recv, base_table)

        from dcr_cli.format.digest import digest_bytes
        from dcr_cli.format.manifest import TensorEntry

        base_table = {n: TensorEntry(dt, s, digest_bytes(v)) for n, (dt, s, v) in t0.items()}
        proofs: list[tuple[float, float]] = []  # (proof seconds, apply seconds) of each measured apply

        def apply() -> None:
            result = dcr_cli.apply(delta, into=recv)
            assert result.steps and result.steps[0].applied == len(manifest.items)
            proofs.append((result.steps[0].proof_seconds, result.steps[0].seconds))

        dense_dir = work / "dense"

        def clear_dense() -> None:
            shutil.rmtree(dense_dir, ignore_errors=True)
            dense_dir.mkdir()
            os.sync()

        def dense(durable: bool) -> Callable[[], None]:
            def run() -> None:
                save_file(torch_tensors, str(dense_dir / "model.safetensors"))
                if durable:
                    fd = os.open(dense_dir / "model.safetensors", os.O_RDONLY)
                    os.fsync(fd)
                    os.close(fd)

            return run

        apply_s = median_time(apply, reset_receiver, args.repeats)
        apply_cpu = CPU_SECONDS[id(apply)]
        dense_durable = dense(True)
        dense_s = median_time(dense_durable, clear_dense, args.repeats)
        dense_cpu = CPU_SECONDS[id(dense_durable)]

        # Without durability: the same work, minus waiting for the disk.
        real_sync, real_sync_file = inplace.InPlaceFiles.sync, inplace.InPlaceFiles.sync_file
        inplace.InPlaceFiles.sync = lambda self: None  # type: ignore[method-assign]
        inplace.InPlaceFiles.sync_file = lambda self, file: None  # type: ignore[method-assign]
        try:
            apply_cache_s = median_time(apply, reset_receiver, args.repeats)
        finally:
            inplace.InPlaceFiles.sync, inplace.InPlaceFiles.sync_file = real_sync, real_sync_file  # type: ignore[method-assign]
        apply_cache_cpu = CPU_SECONDS[id(apply)]
        dense_cached = dense(False)
        dense_cache_s = median_time(dense_cached, clear_dense, args.repeats)
        dense_cache_cpu = CPU_SECONDS[id(dense_cached)]

        # The durable floor: the pages this step touches, written back from v1 and fsynced.
        shard_names = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
        touched_pages: dict[str, np.ndarray] = {}
        for name in shard_names:
            old = np.fromfile(work / "v0" / name, dtype=np.uint8)
            new = np.fromfile(work / "v1" / name, dtype=np.uint8)
            pad = -old.size % 4096
            differs = np.concatenate([old != new, np.zeros(pad, bool)]).reshape(-1, 4096).any(axis=1)
            touched_pages[name] = np.flatnonzero(differs)
            del old, new

        def page_runs(pages: np.ndarray) -> list[tuple[int, int]]:
            """Consecutive touched pages as (first, end) runs, at most 2,048 pages (8 MiB) each."""
            if pages.size == 0:
                return []
            cuts = np.flatnonzero(np.diff(pages) != 1) + 1
            runs = []
            for run in np.split(pages, cuts):
                first, end = int(run[0]), int(run[-1]) + 1
                runs += [(a, min(end, a + 2048)) for a in range(first, end, 2048)]
            return runs

        runs_of_pages = {name: page_runs(touched_pages[name]) for name in shard_names}

        def write_touched_pages() -> None:
            for name in shard_names:
                with open(work / "v1" / name, "rb") as src:
                    fd = os.open(recv / name, os.O_WRONLY)
                    try:
                        for first, end in runs_of_pages[name]:
                            src.seek(first * 4096)
                            os.pwrite(fd, src.read((end - first) * 4096), first * 4096)
                        os.fsync(fd)
                    finally:
                        os.close(fd)

        floor_s = median_time(write_touched_pages, reset_receiver, args.repeats)
        floor_cpu = CPU_SECONDS[id(write_touched_pages)]
        assert dcr_cli.verify(recv, against=delta).ok

        def plain_read() -> None:
            buf = bytearray(8 << 20)
            for p in sorted(recv.glob("*.safetensors")):
                with open(p, "rb", buffering=0) as f:
                    while f.readinto(buf):
                        pass

        plain_read()  # warm the page cache
        read_s = median_time(plain_read, lambda: None, args.repeats)
        read_cpu = CPU_SECONDS[id(plain_read)]

        def run_verify() -> None:
            dcr_cli.verify(recv, against=delta)

        verify_s = median_time(run_verify, lambda: None, args.repeats)
        verify_cpu = CPU_SECONDS[id(run_verify)]

        def blake3_in_place() -> None:
            for p in sorted(recv.glob("*.safetensors")):
                with open(p, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                    blake3.blake3(m, max_threads=blake3.blake3.AUTO).digest()

        hash_s = median_time(blake3_in_place, lambda: None, args.repeats)
        hash_cpu = CPU_SECONDS[id(blake3_in_place)]

        def line(label: str, seconds: float, cpu: float) -> str:
            return (
                f"  {label:<40} {seconds * 1e3:8.1f} ms wall {nbytes / seconds / 2**30:6.2f} GiB/s"
                f"   {cpu * 1e3:8.1f} ms CPU"
            )

        def ratio(label: str, a: float, b: float, a_cpu: float, b_cpu: float) -> str:
            return f"  ratio {label:<34} {a / b:8.3f}x wall {'':13} {a_cpu / b_cpu:8.3f}x CPU"

        print(line("apply (durable: fsync, proof, state)", apply_s, apply_cpu))
        print(line("dense refit (save_file + fsync)", dense_s, dense_cpu))
        print(ratio("apply / dense (durable)", apply_s, dense_s, apply_cpu, dense_cpu))
        print(line("floor: touched pages written + fsync", floor_s, floor_cpu))
        print(ratio("floor / dense (durable)", floor_s, dense_s, floor_cpu, dense_cpu))
        print(ratio("apply / floor (durable)", apply_s, floor_s, apply_cpu, floor_cpu))
        print(line("apply (page cache, no fsync)", apply_cache_s, apply_cache_cpu))
        print(line("dense refit (save_file, no fsync)", dense_cache_s, dense_cache_cpu))
        print(ratio("apply / dense (page cache)", apply_cache_s, dense_cache_s, apply_cache_cpu, dense_cache_cpu))
        proof_s = statistics.median(p for p, _ in proofs)
        step_s = statistics.median(a for _, a in proofs)
        print(f"  proof (read back touched tensors)        {proof_s * 1e3:8.1f} ms wall")
        print(f"  ratio proof / apply step                 {proof_s / step_s:8.3f}x wall")
        print(line("verify (digest every tensor)", verify_s, verify_cpu))
        print(line("plain read of the same files", read_s, read_cpu))
        print(ratio("verify / plain read", verify_s, read_s, verify_cpu, read_cpu))
        print(line("floor: BLAKE3 of the files, all cores", hash_s, hash_cpu))
        print(ratio("verify / floor", verify_s, hash_s, verify_cpu, hash_cpu))
        print(f"  cores: {len(os.sched_getaffinity(0))}, load average {os.getloadavg()[0]:.1f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


class Phases:
    """Wall and thread seconds of the applier's phases, by wrapping its module functions (any version)."""

    def __init__(self) -> None:
        from dcr_cli.receive.checkpoint import applier

        self.applier: Any = applier
        self.runs: list[dict[str, float]] = []
        self.now: dict[str, float] = {}
        self._writing = False
        self._lock = __import__("threading").Lock()
        self._saved: dict[str, object] = {}

    def _add(self, key: str, seconds: float) -> None:
        with self._lock:
            self.now[key] = self.now.get(key, 0.0) + seconds

    def __enter__(self) -> Phases:
        a = self.applier
        for name in ("first_pass", "write_items", "stream_items", "prepare_item", "prepare_batch"):
            self._saved[name] = getattr(a, name)
        first_pass, write_items, stream_items = a.first_pass, a.write_items, a.stream_items
        prepare_item, prepare_batch = a.prepare_item, a.prepare_batch

        def timed_first_pass(*args, **kwargs):  # type: ignore[no-untyped-def]
            t = time.perf_counter()
            try:
                return first_pass(*args, **kwargs)
            finally:
                self._add("first_pass", time.perf_counter() - t)

        def timed_generator(key: str, gen_fn, second: bool):  # type: ignore[no-untyped-def]
            def run(*args, **kwargs):  # type: ignore[no-untyped-def]
                t = time.perf_counter()
                self._writing = second  # the streaming pass prepares each item once: nothing is read again
                try:
                    yield from gen_fn(*args, **kwargs)
                finally:
                    self._writing = False
                    self._add(key, time.perf_counter() - t)

            return run

        def again(fn, key: str):  # type: ignore[no-untyped-def]
            def run(*args, **kwargs):  # type: ignore[no-untyped-def]
                if not self._writing:
                    return fn(*args, **kwargs)
                t = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    self._add(key, time.perf_counter() - t)
                    self._add(key + "_n", 1)

            return run

        a.first_pass = timed_first_pass
        a.write_items = timed_generator("write_pass", write_items, True)
        a.stream_items = timed_generator("stream_pass", stream_items, False)
        a.prepare_item = again(prepare_item, "reread")  # only the write pass's calls (dropped items)
        a.prepare_batch = again(prepare_batch, "reread_batch")
        return self

    def __exit__(self, *exc: object) -> None:
        for name, fn in self._saved.items():
            setattr(self.applier, name, fn)

    def start(self) -> None:
        self.now = {}

    def stop(self, proof: float, step: float) -> None:
        self.now["fsync_and_proof"] = proof
        self.now["step"] = step
        self.runs.append(self.now)

    def summary(self) -> dict[str, float]:
        keys = sorted({k for r in self.runs for k in r})
        return {k: STAT([r.get(k, 0.0) for r in self.runs]) for k in keys}


def corpus_main(args: argparse.Namespace) -> None:
    import corpus

    from dcr_cli.delta.reader import Delta
    from dcr_cli.receive.checkpoint import applier

    size = int(args.size_gb * 2**30)
    specs, desc = corpus.dense_specs(size)
    root = args.corpus / f"dense-{args.size_gb:g}-r{args.rate:g}"
    c0, c1 = corpus.build_chain(
        root, specs, [corpus.Step("uniform", args.rate)], shard_bytes=max(16 << 20, min(1 << 30, size // 3))
    )
    delta = root / "delta"
    if not (delta / "manifest.json").exists():
        shutil.rmtree(delta, ignore_errors=True)
        diff(c0, c1, delta, base_version="v0", target_version="v1")
    opened = Delta.open(delta)
    manifest, delta_id = opened.manifest, opened.id
    shards = sorted(p.name for p in c0.glob("*.safetensors"))
    nbytes = sum(s.nbytes for s in specs)
    changed = sum(item.count for item in manifest.items)
    payload = sum(p.stat().st_size for p in (delta / "blocks").iterdir())
    print(
        f"{desc}; {corpus.describe(specs)}; {changed:,} elements changed ({changed / (nbytes // 2):.2%}); "
        f"delta {payload / 2**20:.1f} MiB; staging budget PREPARED_BYTES = {applier.PREPARED_BYTES >> 20} MiB"
    )
    recv = root / "recv"
    if not recv.exists():
        shutil.copytree(c0, recv)
    with SafetensorsCheckpoint(c0) as ckpt:
        from dcr_cli.receive.checkpoint.inplace import InPlaceFiles, digest_tensors

        with InPlaceFiles(dict(ckpt.tensors)) as files:
            base_table = digest_tensors(files, 2)

    def reset_receiver(mode: str) -> Callable[[], None]:
        def run() -> None:
            for name in shards:
                with open(c0 / name, "rb") as src, open(recv / name, "r+b") as dst:
                    shutil.copyfileobj(src, dst, 8 << 20)
            fsync_tree(recv)
            shutil.rmtree(recv / ".dcr", ignore_errors=True)
            (recv / ".dcr").mkdir()
            with SafetensorsCheckpoint(recv) as ckpt:
                stats = receiver.file_stats(recv, ckpt)
            write_recorded_table(recv, base_table)
            if mode == "streaming":
                receiver.write_state(recv, receiver.ReceiverState("v0", manifest.base.fingerprint, None, stats))
            else:  # "applying" this delta, nothing written yet: the checked-first order (a resume)
                applying = {
                    "delta_id": delta_id,
                    "base": {"version": manifest.base.version, "fingerprint": manifest.base.fingerprint},
                    "target": {"version": manifest.target.version, "fingerprint": manifest.target.fingerprint},
                    "url": str(delta),
                }
                receiver.write_state(recv, receiver.ReceiverState(None, None, applying, stats))

        return run

    def line(label: str, seconds: float) -> str:
        return f"  {label:<44} {seconds * 1e3:9.1f} ms {nbytes / seconds / 2**30:6.2f} GiB/s of the model"

    results: dict[str, float] = {}
    with Phases() as phases:
        for mode in args.modes.split(","):
            phases.runs = []

            def apply() -> None:
                phases.start()
                result = dcr_cli.apply(delta, into=recv)
                step = result.steps[0]
                assert step.applied == len(manifest.items), step
                phases.stop(step.proof_seconds, step.seconds)

            results[mode] = median_time(apply, reset_receiver(mode), args.repeats)
            assert dcr_cli.verify(recv, against=delta).ok
            print(line(f"apply, {mode}", results[mode]))
            for key, value in phases.summary().items():
                shown = f"{value:9.0f} items" if key.endswith("_n") else f"{value * 1e3:9.1f} ms"
                print(f"    {key:<42} {shown}")

    dense_dir = root / "dense"

    def clear_dense() -> None:
        shutil.rmtree(dense_dir, ignore_errors=True)
        dense_dir.mkdir()
        os.sync()

    def dense_write() -> None:
        for name in shards:
            with open(c1 / name, "rb") as src, open(dense_dir / name, "wb") as dst:
                shutil.copyfileobj(src, dst, 8 << 20)
                dst.flush()
                os.fsync(dst.fileno())

    for name in shards:  # the target's bytes in the page cache, as a trainer's are in memory
        with open(c1 / name, "rb") as f:
            while f.read(8 << 20):
                pass
    dense_s = median_time(dense_write, clear_dense, args.repeats)
    shutil.rmtree(dense_dir, ignore_errors=True)

    def plain_read() -> None:
        buf = bytearray(8 << 20)
        for p in sorted(recv.glob("*.safetensors")):
            with open(p, "rb", buffering=0) as f:
                while f.readinto(buf):
                    pass

    plain_read()
    read_s = median_time(plain_read, lambda: None, args.repeats)
    verify_s = median_time(lambda: dcr_cli.verify(recv, against=delta), lambda: None, args.repeats)

    def blake3_in_place() -> None:
        for p in sorted(recv.glob("*.safetensors")):
            with open(p, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                blake3.blake3(m, max_threads=blake3.blake3.AUTO).digest()

    hash_s = median_time(blake3_in_place, lambda: None, args.repeats)
    print(line("dense write of the target + fsync", dense_s))
    for mode, seconds in results.items():
        print(f"  ratio apply ({mode}) / (dense write + fsync)      {seconds / dense_s:8.3f}x")
    print(line("verify (digest every tensor)", verify_s))
    print(line("plain read of the same files", read_s))
    print(f"  ratio verify / plain read                        {verify_s / read_s:8.3f}x")
    print(line("floor: BLAKE3 of the files, all cores", hash_s))
    print(f"  ratio verify / floor                             {verify_s / hash_s:8.3f}x")
    print(f"  cores: {len(os.sched_getaffinity(0))}, load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
