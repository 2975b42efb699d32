"""The diff engine's execution: the byte-budgeted pool, hashing while scanning, the banded residual path.

The residual test runs in a child process and reads its own RssAnon, so it measures the heap a
diff really takes (numpy and torch alike), not an estimate.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from checkpoints import write_checkpoint
from manifest_text import manifest_text

from dcr_cli.delta.reader import Delta
from dcr_cli.format.kernels import scan_changes
from dcr_cli.io.pool import Inline, ordered_stream
from dcr_cli.produce import diff

ROOT = Path(__file__).resolve().parents[1]


# ----- ordered_stream


def test_stream_yields_in_task_order_and_streams_the_head() -> None:
    def task(i: int, n: int, delay: float):
        def run():
            for j in range(n):
                time.sleep(delay)
                yield (i, j)

        return run

    tasks = [(1, task(i, 3, 0.01 * ((7 * i) % 4))) for i in range(12)]
    got = list(ordered_stream(tasks, 4, budget=100))
    assert got == [(i, j) for i in range(12) for j in range(3)]


def test_stream_holds_at_most_its_budget() -> None:
    lock = threading.Lock()
    held = {"now": 0, "peak": 0}

    def task(cost: int):
        def run():
            with lock:
                held["now"] += cost
                held["peak"] = max(held["peak"], held["now"])
            time.sleep(0.02)
            with lock:
                held["now"] -= cost
            yield cost

        return run

    costs = [30, 50, 20, 90, 10, 10, 40, 250, 5]
    assert list(ordered_stream([(c, task(c)) for c in costs], 4, budget=100)) == costs
    # 250 > budget ran alone; everything else together stayed within the budget
    assert held["peak"] == 250
    held["peak"] = 0
    list(ordered_stream([(c, task(c)) for c in costs if c <= 100], 4, budget=100))
    assert held["peak"] <= 100


def test_stream_waits_before_results_exceed_the_budget() -> None:
    """A task behind a slow head stops producing once its unconsumed results fill the budget."""
    produced = []
    release = threading.Event()

    def head():
        release.wait(5)
        yield "head"

    def chatty():
        for j in range(10):
            produced.append(j)
            yield j

    stream = ordered_stream([(0, head), (0, chatty)], 2, budget=3, size=lambda r: 1)
    first = []
    reader = threading.Thread(target=lambda: first.append(next(stream)))
    reader.start()
    time.sleep(0.2)
    assert len(produced) <= 4  # 3 held, the 4th waits before it is kept
    release.set()
    reader.join(5)
    assert first == ["head"] and list(stream) == list(range(10))


def test_stream_raises_the_first_error_in_task_order_and_stops() -> None:
    started = []

    def ok(i: int):
        def run():
            started.append(i)
            time.sleep(0.01)
            yield i

        return run

    def bad():
        raise ValueError("boom")
        yield  # pragma: no cover

    tasks = [(1, ok(0)), (1, bad), *[(1, ok(i)) for i in range(2, 50)]]
    got = []
    with pytest.raises(ValueError, match="boom"):
        for r in ordered_stream(tasks, 2, budget=3):
            got.append(r)
    assert got == [0]
    assert len(started) < 10  # tasks after the failure were never started


def test_inline_tasks_run_on_the_consumer_in_order_with_the_pool_around_them() -> None:
    """An Inline task runs on the consuming thread when it is the oldest, between pool tasks, in
    task order; its error is raised in its turn; its cost counts against the budget while it runs."""
    consumer = threading.get_ident()
    where: dict[str, int] = {}

    def pooled(i: int):
        def run():
            where[f"p{i}"] = threading.get_ident()
            time.sleep(0.01 * (i % 3))
            yield f"p{i}"

        return run

    def inline(i: int):
        def run():
            where[f"i{i}"] = threading.get_ident()
            yield f"i{i}a"
            yield f"i{i}b"

        return Inline(run)

    tasks = [(1, pooled(0)), (1, inline(1)), (1, pooled(2)), (1, inline(3)), (1, inline(4)), (1, pooled(5))]
    got = list(ordered_stream(tasks, 2, budget=100))
    assert got == ["p0", "i1a", "i1b", "p2", "i3a", "i3b", "i4a", "i4b", "p5"]
    assert {k for k, t in where.items() if t == consumer} == {"i1", "i3", "i4"}  # pool tasks ran on the pool

    def bad():
        raise ValueError("inline boom")
        yield  # pragma: no cover

    got = []
    with pytest.raises(ValueError, match="inline boom"):
        for r in ordered_stream([(1, pooled(0)), (1, Inline(bad)), (1, pooled(2))], 2, budget=100):
            got.append(r)
    assert got == ["p0"]

    # An inline task as large as the budget: the pool task after it waits until it has finished.
    order: list[str] = []

    def big():
        order.append("big start")
        time.sleep(0.05)
        order.append("big end")
        yield "big"

    def after():
        order.append("after")
        yield "after"

    assert list(ordered_stream([(100, Inline(big)), (1, after)], 2, budget=100)) == ["big", "after"]
    assert order == ["big start", "big end", "after"]


# ----- the scan's tiles


@pytest.mark.parametrize("width", [1, 2, 4, 8])
def test_tiled_scan_is_the_scan_and_covers_every_element_once(width: int) -> None:
    rng = np.random.default_rng(width)
    dt = np.dtype(f"<u{width}")
    base = rng.integers(0, 2 ** (8 * width) - 1, 100_003, dtype=dt, endpoint=True)
    new = base.copy()
    hit = rng.random(len(base)) < 0.05
    new[hit] ^= rng.integers(1, 255, hit.sum()).astype(dt)
    tiles: list[tuple[int, int]] = []
    tiled = scan_changes(base, new, tile=777, after=lambda lo, hi: tiles.append((lo, hi)))
    whole = scan_changes(base, new)
    expected = np.flatnonzero(base != new)
    for a, b in zip(tiled, whole, strict=True):
        assert np.array_equal(a, b)
    assert np.array_equal(whole[0], expected) and np.array_equal(whole[1], base[expected] ^ new[expected])
    assert tiles[0][0] == 0 and tiles[-1][1] == len(base) and len(tiles) > 10
    assert all(a[1] == b[0] for a, b in itertools.pairwise(tiles))


def test_hashing_while_scanning_gives_the_same_delta_on_any_worker_count(tmp_path: Path) -> None:
    """The fused tensor tasks (one worker, or tensors within a worker's share) and the split ones
    (a tensor larger than a worker's share, hashed apart) write byte-identical deltas."""
    import torch

    g = torch.Generator().manual_seed(1)
    a = {
        "big": torch.randn(1024, 1024, generator=g).to(torch.bfloat16),
        "mid": torch.randn(300, 77, generator=g).to(torch.bfloat16),
        "f32": torch.randn(5, 999, generator=g),
        "empty": torch.zeros(0, 4, dtype=torch.bfloat16),
        "one": torch.ones(1, dtype=torch.float16),
    }
    b = {k: v.clone() for k, v in a.items()}
    b["big"].view(torch.int16).view(-1)[::37] ^= 1
    b["f32"].view(torch.int32).view(-1)[3] ^= 5
    b["one"].view(torch.int16)[0] ^= 1
    write_checkpoint(tmp_path / "a", a)
    write_checkpoint(tmp_path / "b", b)
    outs = []
    for w in (1, 2, 5):
        out = tmp_path / f"d{w}"
        diff(tmp_path / "a", tmp_path / "b", out, workers=w)
        manifest = json.loads(manifest_text(out))
        manifest.pop("created")
        outs.append((manifest, sorted(p.name for p in (out / "blocks").iterdir())))
    assert outs[0] == outs[1] == outs[2]
    digests = Delta.open(tmp_path / "d1").manifest.tensors
    from dcr_cli.format.digest import digest_bytes

    for name, t in b.items():
        raw = t.contiguous().view(torch.uint8).numpy() if t.numel() else b""
        assert digests[name].digest == digest_bytes(raw)


# ----- the residual path: banded, bounded


_RESIDUAL_CHILD = textwrap.dedent(
    r"""
    import json, sys, threading, time
    from pathlib import Path
    import numpy as np
    import torch
    from dcr_cli.checkpoints.fp8 import Fp8Quantizer, fp8_convert, fp8_block_quantize
    from dcr_cli.checkpoints.shards import CanonicalTensor, Chunk, Segment, ShardCheckpoint, ShardReader, StoredTensor
    from dcr_cli.delta.reader import Delta
    from dcr_cli.format.codec import diff_region
    from dcr_cli.format.digest import digest_bytes
    from dcr_cli.format.manifest import Region
    from dcr_cli.produce.engine import execute
    from dcr_cli.produce.plan import chunk_ranges, plan_shards

    def rss_anon():
        return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("RssAnon:"))

    tmp, rows, cols = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])

    class Memory(ShardReader):
        def __init__(self, root, w):
            self.root, self.w = str(root), w
            self.stored = {"w": StoredTensor("w", "BF16", (rows, cols), [Chunk((0, 0), (rows, cols), "f")])}

        def read_chunk(self, key, chunk):
            return self.w

    def side(tag, w):
        (tmp / tag).mkdir()
        joint = Fp8Quantizer("BF16", (128, 128))
        seg = lambda name: [Segment("w", (0, 0), (rows, cols), name, (0, 0))]
        canonical = {
            "w.weight": CanonicalTensor("w.weight", "F8_E4M3", (rows, cols), seg("w.weight"), "fp8",
                                        fp8_convert("BF16", (128, 128), "weight", joint), "BF16"),
            "w.weight_scale_inv": CanonicalTensor("w.weight_scale_inv", "F32", (-(-rows // 128), -(-cols // 128)),
                                                  seg("w.weight_scale_inv"), "fp8 scale",
                                                  fp8_convert("BF16", (128, 128), "scale", joint), "BF16",
                                                  source_shape=(rows, cols)),
        }
        return ShardCheckpoint(Memory(tmp / tag, w), canonical, "test")

    g = torch.Generator().manual_seed(0)
    w0 = (torch.randn(rows, cols, generator=g) * 0.02).to(torch.bfloat16)
    w1 = w0.clone()
    flat = w1.view(-1)
    idx = torch.randint(0, flat.numel(), (flat.numel() // 50,), generator=g)
    flat[idx] = (flat[idx].float() * 1.01 + 1e-3).to(torch.bfloat16)
    w0n, w1n = w0.view(torch.int16).numpy().view("<u2"), w1.view(torch.int16).numpy().view("<u2")
    b, n = side("base", w0n), side("new", w1n)
    plan = plan_shards(b, n)
    peak, stop = [0], threading.Event()
    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], rss_anon())
            time.sleep(0.001)
    before = rss_anon()
    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    execute(plan, b, n, tmp / "delta", workers=2, budget=int(sys.argv[4]))
    stop.set()
    thread.join()
    grown = max(peak[0], rss_anon()) - before

    # What the whole-tensor conversion gives (the path before banding): the same items, bit for bit.
    m = Delta.open(tmp / "delta").manifest
    got = [(it.tensor, it.region.to_json(), it.op, it.count, it.pre, it.post) for it in m.items]
    want = []
    (q0, s0), (q1, s1) = fp8_block_quantize(w0, (128, 128)), fp8_block_quantize(w1, (128, 128))
    for name, old, cur in (("w.weight", q0.view(torch.uint8), q1.view(torch.uint8)),
                           ("w.weight_scale_inv", s0.view(torch.int32), s1.view(torch.int32))):
        uint = f"<u{cur.element_size()}"
        old, cur = old.numpy().reshape(-1).view(uint), cur.numpy().reshape(-1).view(uint)
        assert m.tensors[name].digest == digest_bytes(cur)
        for s, e in chunk_ranges(len(cur), cur.dtype.itemsize):
            it = diff_region(name, Region.range(s, e), old[s:e], cur[s:e], residual="x")
            if it is not None:
                want.append((it.tensor, it.region.to_json(), it.op, it.count, it.pre, it.post))
    print("RESULT " + json.dumps({"grown": grown, "same": got == want, "items": len(got)}))
    """
)


def _residual_diff(tmp: Path, rows: int, cols: int, budget: int) -> dict:
    tmp.mkdir()
    proc = subprocess.run(
        [sys.executable, "-c", _RESIDUAL_CHILD, str(tmp), str(rows), str(cols), str(budget)],
        capture_output=True, text=True, check=False, timeout=600,
        env={"PYTHONPATH": f"{ROOT}", "PATH": "/usr/bin:/bin", "DCR_CACHE_DIR": ""},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.rsplit("RESULT ", 1)[1])
    assert got["same"] and got["items"] >= 2  # the weight's ranges and the scale, as the whole-tensor path
    return got


def test_residual_fp8_diff_memory_is_bounded_by_a_band_not_the_tensor(tmp_path: Path) -> None:
    """BF16 weights of 32 and 256 MiB quantized to fp8 with their scales, under a 32 MiB budget.

    The whole-tensor path assembled the source and made several float32 copies of it per
    quantization (about 4 GiB for the larger one), once for the weight and once more for the
    scale. Banded, one quantization serves both outputs: the heap grows by less than the larger
    tensor, and by about the same for both sizes.
    """
    small = _residual_diff(tmp_path / "small", 4096, 4096, 32 << 20)["grown"]
    large = _residual_diff(tmp_path / "large", 8192, 16384, 32 << 20)["grown"]
    tensor = 8192 * 16384 * 2
    assert large < tensor, f"heap grew by {large >> 20} MiB for a {tensor >> 20} MiB tensor"
    assert large - small < (tensor >> 1), f"heap grew {small >> 20} MiB, then {large >> 20} MiB for an 8x tensor"
