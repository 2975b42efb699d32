"""Per-tensor overhead at MoE tensor counts (issue 11): batching and caching must not change a single bit.

* the diff engine batches small tensors into one pool task: the delta is byte-identical to the
  unbatched one (and to one written with one worker);
* the receiver batches small items (first pass, writes, digests): the result is the target, bit-exact,
  and a write failure inside a batch still leaves a resumable state;
* thread-local zstd contexts give the same frames as fresh ones, across threads and levels;
* local block files stay open across section reads: a block corrupted in place is still refused;
* a checkpoint opened again reuses its parsed header only while the header bytes and the size are the same;
* ``dcr inspect`` prints plain aligned columns for long tables, with every row and the totals.
"""

from __future__ import annotations

import errno
import json
import os
import threading
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from helpers_checkpoints import copy_checkpoint, mutate, random_tensors, read_raw, write_checkpoint
from hypothesis import given, settings
from hypothesis import strategies as st
from manifest_text import manifest_text

import dcr_cli
from dcr_cli.checkpoints import safetensors_dir
from dcr_cli.checkpoints.safetensors_dir import SafetensorsCheckpoint
from dcr_cli.cli import main
from dcr_cli.delta.inspect import inspect
from dcr_cli.delta.reader import Delta
from dcr_cli.errors import FormatError, IntegrityError
from dcr_cli.format import codec
from dcr_cli.produce import engine
from dcr_cli.receive.checkpoint import applier, inplace


def _moe_pair(tmp: Path, experts: int = 64, shards: int = 2) -> tuple[Path, Path]:
    """Many small expert tensors, a few larger ones (one over the small-tensor limit), mixed dtypes."""
    rng = np.random.default_rng(11)
    specs: list[tuple[str, str, tuple[int, ...]]] = [("embed", "BF16", (512, 300))]  # 300 KiB: not small
    for e in range(experts):
        for proj, shape in (("gate", (24, 64)), ("up", (24, 64)), ("down", (64, 24))):
            specs.append((f"layers.0.experts.{e}.{proj}", "BF16", shape))
    specs += [("norm", "F32", (64,)), ("router", "F16", (experts, 64)), ("bias", "U8", (7,)), ("scalar", "F32", ())]
    t0 = random_tensors(rng, specs)
    t1 = mutate(rng, t0, 0.03)
    t0["dense"] = ("BF16", (8, 8), rng.integers(1, 1 << 16, 64, dtype=np.uint16))
    t1["dense"] = ("BF16", (8, 8), np.zeros(64, dtype=np.uint16))  # every element changed: a replace item
    return write_checkpoint(tmp / "v0", t0, shards=shards), write_checkpoint(tmp / "v1", t1, shards=shards)


def _files(delta: Path) -> dict[str, bytes]:
    return {str(p.relative_to(delta)): p.read_bytes() for p in sorted(delta.rglob("*")) if p.is_file()}


def _diff(base: Path, new: Path, out: Path, workers: int) -> dict[str, bytes]:
    engine.diff(base, new, out, base_version="v0", target_version="v1", workers=workers)
    manifest = json.loads(manifest_text(out))
    manifest.pop("created")
    files = _files(out)
    files["manifest.json"] = json.dumps(manifest).encode()
    return files


@pytest.mark.parametrize("cached", [False, True], ids=["hashing", "digests cached"])
def test_batched_diff_is_byte_identical_to_unbatched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cached: bool
) -> None:
    base, new = _moe_pair(tmp_path)
    monkeypatch.setenv("DCR_CACHE_DIR", str(tmp_path / "cache") if cached else "")
    if cached:
        engine.diff(base, new, tmp_path / "warm", workers=2)  # fills the cache for both sides
    calls = {"batches": 0}
    real = engine.ordered_stream

    def counting(tasks, workers, **kw):  # type: ignore[no-untyped-def]
        listed = list(tasks)
        calls["batches"] = len(listed)
        return real(iter(listed), workers, **kw)

    monkeypatch.setattr(engine, "ordered_stream", counting)
    batched = _diff(base, new, tmp_path / "batched", workers=2)
    batched_tasks = calls["batches"]
    one_worker = _diff(base, new, tmp_path / "one", workers=1)
    monkeypatch.setattr(engine, "SMALL_TENSOR_BYTES", 0)  # every tensor a task of its own, as before batching
    unbatched = _diff(base, new, tmp_path / "unbatched", workers=2)
    unbatched_tasks = calls["batches"]
    assert batched == unbatched == one_worker
    assert batched_tasks < unbatched_tasks / 20, (batched_tasks, unbatched_tasks)  # it did batch
    manifest = Delta.open(tmp_path / "batched").manifest
    assert {i.op for i in manifest.items} == {"xor", "replace"}
    assert dcr_cli.apply(tmp_path / "batched", into=copy_checkpoint(base, tmp_path / "recv")).steps
    assert read_raw(tmp_path / "recv") == read_raw(new)


def test_batched_apply_and_verify_are_bit_exact(tmp_path: Path) -> None:
    base, new = _moe_pair(tmp_path)
    engine.diff(base, new, tmp_path / "d", base_version="v0", target_version="v1")
    items = Delta.open(tmp_path / "d").manifest.items
    batches = list(applier.item_batches(items))
    assert [i for lo, hi, _ in batches for i in range(lo, hi)] == list(range(len(items)))  # every item, in order
    assert len(batches) < len(items) / 20
    big = [i for i, it in enumerate(items) if it.region.size >= applier.BATCH_ELEMENTS]
    assert big and all((i, i + 1, False) in batches for i in big)  # a large item is a pool task of its own
    recv = copy_checkpoint(base, tmp_path / "recv")
    result = dcr_cli.apply(tmp_path / "d", into=recv, workers=2)
    assert result.steps[0].applied == len(items)
    assert read_raw(recv) == read_raw(new)
    report = dcr_cli.verify(recv, against=tmp_path / "d", workers=2)
    assert report.ok and report.tensors == len(read_raw(new))
    # One element changed behind dcr's back in a small tensor: verify names exactly that tensor.
    with SafetensorsCheckpoint(recv) as ckpt:
        loc = ckpt.tensors["layers.0.experts.7.up"]
    with open(loc.file, "r+b") as f:
        f.seek(loc.start + 10)
        byte = f.read(1)
        f.seek(loc.start + 10)
        f.write(bytes([byte[0] ^ 1]))
    report = dcr_cli.verify(recv, against=tmp_path / "d", workers=2)
    assert not report.ok and report.mismatched == ["layers.0.experts.7.up"]


def test_a_write_failure_inside_a_batch_resumes_bit_exact(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    base, new = _moe_pair(tmp_path)
    engine.diff(base, new, tmp_path / "d", base_version="v0", target_version="v1")
    recv = copy_checkpoint(base, tmp_path / "recv")
    real, writes = inplace._write_values, {"n": 0}

    def fail_in_the_middle(fd: int, offset: int, data: memoryview) -> None:
        writes["n"] += 1
        if writes["n"] == 4:  # inside a batch of small items (a few spans each): half of its bytes land
            real(fd, offset, data[: len(data) // 2])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd, offset, data)

    monkeypatch.setattr(inplace, "_write_values", fail_in_the_middle)
    with pytest.raises(OSError) as info:
        dcr_cli.apply(tmp_path / "d", into=recv, workers=2)
    assert info.value.errno == errno.ENOSPC
    monkeypatch.undo()
    result = dcr_cli.apply(tmp_path / "d", into=recv, workers=2)
    assert result.steps[0].status == "resumed" and result.steps[0].done > 0
    assert read_raw(recv) == read_raw(new)


def test_reused_zstd_contexts_give_the_frames_of_fresh_ones() -> None:
    rng = np.random.default_rng(3)
    inputs = [rng.integers(0, 4, size=n, dtype=np.uint8) for n in (0, 1, 100, 5000, 300_000)]
    for level in (None, 1, 3, 19):
        fresh = [codec.new_compressor(level).compress(x.data) for x in inputs]
        out: dict[int, list[bytes]] = {}

        def work(k: int, level: int | None = level, out: dict[int, list[bytes]] = out) -> None:
            out[k] = [codec.compress(x, level) for x in inputs * 3]

        threads = [threading.Thread(target=work, args=(k,)) for k in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert all(frames == fresh * 3 for frames in out.values())
        # the reused decompressor recovers from a corrupt frame and keeps decoding good ones
        for x, frame in zip(inputs, fresh, strict=True):
            if len(x) > 100:
                bad = frame[:-5] + bytes(b ^ 0xFF for b in frame[-5:-4]) + frame[-4:]
                with pytest.raises(IntegrityError):
                    codec.decompress_exact(bad, len(x), "values")
            assert codec.decompress_exact(frame, len(x), "values").tobytes() == x.tobytes()


def test_open_block_files_still_see_a_block_corrupted_in_place(tmp_path: Path) -> None:
    base, new = _moe_pair(tmp_path)
    engine.diff(base, new, tmp_path / "d", base_version="v0", target_version="v1")
    delta = Delta.open(tmp_path / "d")
    first, last = delta.manifest.items[0], delta.manifest.items[-1]
    delta.decode(first)  # opens the data block and keeps it open
    block = Path(delta.block_path(delta.manifest.blocks[last.data.block]))
    with open(block, "r+b") as f:  # same inode: the open descriptor reads the damage
        f.seek(last.data.offset)
        byte = f.read(1)
        f.seek(last.data.offset)
        f.write(bytes([byte[0] ^ 0x40]))
    with pytest.raises(IntegrityError, match="corrupt"):
        delta.decode(last)
    block.unlink()
    fresh = Delta.open(tmp_path / "d")
    with pytest.raises(IntegrityError, match="missing"):
        fresh.decode(first)


def test_regular_files_keep_a_bounded_number_open(tmp_path: Path) -> None:
    from dcr_cli.io.reading import RegularFiles

    files = RegularFiles(keep=3)
    paths = []
    for k in range(10):
        p = tmp_path / f"f{k}"
        p.write_bytes(bytes(range(k, k + 20)))
        paths.append(str(p))
    for _ in range(2):
        for k, p in enumerate(paths):
            assert files.read(p, 2, 5) == bytes(range(k + 2, k + 5))
            assert files.read(p, 15, 100) == bytes(range(k + 15, k + 20))  # short at the end
    assert len(files._open) == 3
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(FormatError, match="FIFO"):
        files.read(str(tmp_path / "fifo"), 0, 10)
    files.close()
    assert not files._open


def test_a_reopened_checkpoint_reparses_a_changed_header(tmp_path: Path) -> None:
    values = np.arange(16, dtype=np.uint16)
    root = write_checkpoint(tmp_path / "c", {"a": ("BF16", (16,), values), "b": ("BF16", (4, 4), values)})
    with SafetensorsCheckpoint(root) as first:
        tensors = dict(first.tensors)
    with SafetensorsCheckpoint(root) as again:
        assert again.tensors == tensors
        assert all(again.tensors[n] is tensors[n] for n in tensors)  # reused, not parsed again
    # Same size, other header bytes: parsed again.
    file = root / "model.safetensors"
    raw = file.read_bytes()
    file.write_bytes(raw.replace(b'"a"', b'"c"', 1))
    with SafetensorsCheckpoint(root) as changed:
        assert set(changed.tensors) == {"b", "c"}
    # Same header, truncated data: refused, as a fresh parse refuses it.
    file.write_bytes(raw[:-2])
    with pytest.raises(FormatError, match="truncated"):
        SafetensorsCheckpoint(root)
    file.write_bytes(raw)
    safetensors_dir._PARSED = safetensors_dir._ParsedHeaders(max_bytes=16)  # too small to keep any header
    try:
        with SafetensorsCheckpoint(root) as uncached:
            assert uncached.tensors == tensors
    finally:
        safetensors_dir._PARSED = safetensors_dir._ParsedHeaders(max_bytes=256 << 20)


def test_inspect_prints_long_tables_as_plain_columns(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dcr_cli.cli import inspect_cmd

    base, new = _moe_pair(tmp_path, experts=200, shards=1)
    engine.diff(base, new, tmp_path / "d", base_version="v[0]", target_version="v\n1")
    report = inspect(tmp_path / "d", changed_only=True)  # as the command lists them by default
    assert len(report.tensors) > inspect_cmd.RICH_ROWS
    result = CliRunner().invoke(main, ["inspect", str(tmp_path / "d")])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0] == "v[0] -> v\\n1  (format 2.0)"  # escaped, verbatim, one line
    assert lines[1].split() == ["tensor", "dtype", "changed", "%", "op", "bytes", "ratio", "residual"]
    body = lines[3:-1]
    assert len(body) == len(report.tensors)
    assert lines[-1].startswith("total: ") and f"{report.items} items" in lines[-1]
    # aligned: every column starts where its header does
    columns = [lines[1].index(h) for h in ("dtype", "op")]
    for line, row in zip(body, report.tensors, strict=True):
        assert line.startswith(row.tensor + " ")
        assert line[columns[0] :].startswith(row.dtype) and line[columns[1] :].startswith(",".join(row.ops))
        assert f"{row.changed_elements:,}" in line
    # short tables stay rich tables
    monkeypatch.setattr(inspect_cmd, "RICH_ROWS", 10**6)
    rich = CliRunner().invoke(main, ["inspect", str(tmp_path / "d")])
    assert rich.exit_code == 0 and "┃ tensor" in rich.stdout


def test_inspect_json_is_what_asdict_gave(tmp_path: Path) -> None:
    base, new = _moe_pair(tmp_path, experts=4)
    engine.diff(base, new, tmp_path / "d")
    report = inspect(tmp_path / "d", changed_only=False)
    expected = asdict(report)
    expected["change_rate"] = report.changed_elements / report.total_elements
    expected["ratio"] = report.full_bytes / (report.payload_bytes + report.manifest_bytes)
    for row, raw in zip(report.tensors, expected["tensors"], strict=True):
        raw["change_rate"] = row.change_rate
        raw["ratio"] = row.ratio
    got = report.to_json()
    assert got == expected and list(got) == list(expected)
    assert [list(r) for r in got["tensors"]] == [list(r) for r in expected["tensors"]]


def _reference_positions(raw: np.ndarray, count: int) -> np.ndarray | None:
    """The numpy decoder the compiled one replaced (None where it refused the bytes)."""
    gaps = raw[:count].astype(np.int64)
    escaped = np.flatnonzero(gaps == 255)
    if len(raw) != count + 4 * len(escaped):
        return None
    rest = np.ascontiguousarray(raw[count:].reshape(4, -1).T).reshape(-1).view("<u4").astype(np.int64)
    gaps[escaped] += rest
    return np.cumsum(gaps + 1) - 1


def test_compiled_gap_decoder_matches_the_numpy_one() -> None:
    from dcr_cli.format.kernels import escaped_gaps, positions_from_gaps

    rng = np.random.default_rng(8)
    for trial in range(300):
        count = int(rng.integers(0, 40))
        spread = [3, 300, 70_000, 2**31][trial % 4]
        positions = np.unique(rng.integers(0, spread, size=count)).astype(np.int64)
        raw = escaped_gaps(positions)
        out, escapes = positions_from_gaps(raw, len(positions))
        assert escapes == int(np.count_nonzero(raw[: len(positions)] == 255))
        assert np.array_equal(out, positions) and np.array_equal(out, _reference_positions(raw, len(positions)))
        # damaged lengths are refused exactly where the numpy decoder refused them
        for bad in (raw[:-1], np.concatenate([raw, np.zeros(int(rng.integers(1, 5)), np.uint8)])):
            if len(bad) < len(positions):
                continue
            got, esc = positions_from_gaps(bad, len(positions))
            ref = _reference_positions(bad, len(positions))
            assert (esc < 0) == (ref is None)
            if ref is not None:
                assert np.array_equal(got, ref)


def test_fewer_collections_nests_and_restores_the_thresholds() -> None:
    import gc

    from dcr_cli.io.gc_pause import YOUNG, fewer_collections

    before = gc.get_threshold()
    with fewer_collections():
        assert gc.get_threshold()[0] == max(before[0], YOUNG)
        with fewer_collections():
            assert gc.get_threshold()[0] == max(before[0], YOUNG)
        assert gc.get_threshold()[0] == max(before[0], YOUNG)  # the inner exit does not restore early
    assert gc.get_threshold() == before
    with pytest.raises(RuntimeError), fewer_collections():
        raise RuntimeError("restored on errors too")
    assert gc.get_threshold() == before
    gc.set_threshold(0)  # a caller that turned automatic collection off keeps it off
    try:
        with fewer_collections():
            assert gc.get_threshold()[0] == 0
    finally:
        gc.set_threshold(*before)


def assert_still_frozen(sentinel: object, frozen: int) -> None:
    """The heap a host froze is still frozen after a pause: an object frozen with it is in no collected
    generation, and the pause froze nothing of its own. (Not an exact count: a frozen object another
    thread frees meanwhile leaves the permanent generation.)"""
    import gc

    assert all(id(sentinel) not in {id(x) for x in gc.get_objects(generation=g)} for g in (0, 1, 2))
    assert 0 < gc.get_freeze_count() <= frozen


@pytest.fixture
def unfrozen_heap() -> Iterator[None]:
    """A heap nobody froze, as in a fresh dcr process: an in-process vLLM engine that ran earlier in this
    pytest process froze it (vLLM calls gc.freeze at start-up), and a frozen heap is a host's choice the
    pause must leave alone, which is not what these tests are about. Frozen again afterwards. The pause
    remembers a frozen heap it has seen (io/gc_pause.py): told to forget it both times."""
    import gc

    from dcr_cli.io.gc_pause import forget_frozen_heap

    frozen = gc.get_freeze_count()
    if frozen:
        gc.unfreeze()
    forget_frozen_heap()
    yield
    if frozen:
        gc.freeze()
    forget_frozen_heap()


def test_no_collections_pauses_the_collector_and_promotes_survivors_without_a_pass(unfrozen_heap: None) -> None:
    import gc

    from dcr_cli.io.gc_pause import no_collections

    assert gc.isenabled()
    with no_collections():
        assert not gc.isenabled()
        with no_collections():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the inner exit leaves the outer pause on
        kept = [[i] for i in range(1000)]  # survivors, tracked in the youngest generation
    assert gc.isenabled()
    assert id(kept[0]) in {id(x) for x in gc.get_objects(generation=2)}  # the oldest, without a pass
    with pytest.raises(RuntimeError), no_collections():
        raise RuntimeError("enabled again on errors too")
    assert gc.isenabled()
    sentinel = [1]
    gc.freeze()  # a host that froze its heap (a vLLM server) keeps it frozen
    try:
        frozen = gc.get_freeze_count()
        with no_collections():
            kept.append([0])
        assert_still_frozen(sentinel, frozen)
    finally:
        gc.unfreeze()
    gc.disable()  # a caller that disabled the collector keeps it disabled
    try:
        with no_collections():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_a_command_freezes_the_heap_at_exit_and_still_runs_later_handlers(tmp_path: Path) -> None:
    """The exit-time collections skip what a command left alive (gc.freeze in atexit); the atexit
    handlers registered before it still run afterwards, and the command's output is complete."""
    import subprocess
    import sys

    base, new = _moe_pair(tmp_path, experts=4)
    engine.diff(base, new, tmp_path / "d", base_version="v0", target_version="v1")
    probe = (
        "import atexit, gc, sys\n"
        "atexit.register(lambda: print('frozen at exit:', gc.get_freeze_count() > 0, file=sys.stderr))\n"
        "from dcr_cli.cli import main\n"
        f"main(['inspect', {str(tmp_path / 'd')!r}, '--json'])\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in [str(Path(dcr_cli.__file__).parents[1])] if p)}
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "frozen at exit: True" in done.stderr  # the freeze ran first, the earlier handler after it
    assert json.loads(done.stdout)["items"]  # stdout was flushed whole


def test_a_pause_defers_older_collections_and_promotes_its_survivors_without_a_pass(unfrozen_heap: None) -> None:
    """Inside a pause the middle and oldest generations wait; at its end the survivors go to the
    oldest generation with no collection over them, cyclic garbage made meanwhile is still found by
    the next full collection, and a heap frozen by someone else stays frozen."""
    import gc
    import weakref

    from dcr_cli.io.gc_pause import OLDER, fewer_collections

    class Node:
        pass

    before = gc.get_threshold()
    passes: list[int] = []

    def count(phase: str, info: dict) -> None:
        if phase == "start":
            passes.append(info["generation"])

    gc.collect()
    gc.callbacks.append(count)
    try:
        with fewer_collections():
            assert all(t >= max(b, OLDER) for t, b in zip(gc.get_threshold()[1:], before[1:], strict=True))
            kept = [Node() for _ in range(1000)]
            cycle = Node()
            cycle.me = cycle  # type: ignore[attr-defined]
            dead = weakref.ref(cycle)
            del cycle
            passes.clear()
        assert passes == []  # leaving the pause ran no collection
        assert gc.get_threshold() == before
        survivors = {id(o) for o in gc.get_objects(generation=2)}
        assert all(id(k) in survivors for k in kept)  # promoted to the oldest generation
        assert dead() is not None  # garbage in a cycle waits for a full collection ...
        gc.collect()
        assert dead() is None  # ... which finds it: nothing was leaked into a frozen generation
        assert gc.get_freeze_count() == 0
        sentinel = [1]
        gc.freeze()  # a host that froze its heap (e.g. a server before forking)
        try:
            frozen = gc.get_freeze_count()
            with fewer_collections():
                more = [Node() for _ in range(10)]
            assert_still_frozen(sentinel, frozen)  # left frozen, not unfrozen by the pause
            assert more
        finally:
            gc.unfreeze()
    finally:
        gc.callbacks.remove(count)


def test_fingerprint_orders_names_by_their_utf8_bytes() -> None:
    """The fingerprint's plain sort of names is the order of their UTF-8 bytes (format_spec §4.3),
    for names across the planes too; the shape cache does not mix tensors up."""
    from dcr_cli.format.digest import digest_bytes
    from dcr_cli.format.manifest import TensorEntry, fingerprint

    def reference(tensors: dict[str, TensorEntry]) -> str:
        lines = [
            f"{name}\t{t.dtype}\t{','.join(str(s) for s in t.shape)}\t{t.digest}\n"
            for name, t in sorted(tensors.items(), key=lambda kv: kv[0].encode("utf-8"))
        ]
        return digest_bytes("".join(lines).encode("utf-8"))

    names = ["b", "a", "B", "é", "\uffff", "\U0001f600", "\ue000", "z\u00e9", "ze", "", "\x7f", "\u0800"]
    rng = np.random.default_rng(3)
    shapes = [(), (3,), (2, 5), (3,), (1, 1, 1)]
    digests = [f"{int(rng.integers(1 << 62)):064x}" for _ in names]
    tensors = {n: TensorEntry("BF16", shapes[i % len(shapes)], digests[i]) for i, n in enumerate(names)}
    assert fingerprint(tensors) == reference(tensors)
    assert sorted(names) == sorted(names, key=lambda n: n.encode("utf-8"))
    with pytest.raises(UnicodeEncodeError):
        fingerprint({"\ud800": tensors["a"]})


def test_one_pass_header_check_is_the_two_step_one(tmp_path: Path) -> None:
    """header_locations gives exactly the locations of parse_header + _locations, and refuses every
    bad header with the two-step path's message."""

    def two_step(f: Path, raw: bytes, start: int, size: int) -> list[safetensors_dir.TensorLocation] | str:
        try:
            return safetensors_dir._locations(f, safetensors_dir.parse_header(f, raw), start, size)
        except FormatError as exc:
            return str(exc)

    def one_pass(f: Path, raw: bytes, start: int, size: int) -> list[safetensors_dir.TensorLocation] | str:
        try:
            return safetensors_dir.header_locations(f, raw, start, size)
        except FormatError as exc:
            return str(exc)

    f = tmp_path / "x.safetensors"
    e = {"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 12]}
    headers = [
        {"a": e, "b": {**e, "data_offsets": [12, 24]}},
        {"b": {**e, "data_offsets": [12, 24]}, "a": e, "__metadata__": {"k": "v"}},  # offsets out of order
        {"z": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}, "a": {**e, "dtype": "U8", "shape": [12]}},
        {"s": {"dtype": "F64", "shape": [], "data_offsets": [0, 8]}},
        {"a": e, "b": e},  # overlapping data
        {"a": {**e, "shape": [2, True]}},
        {"a": {**e, "shape": [2, -3]}},
        {"a": {**e, "data_offsets": [0, 10]}},
        {"a": {**e, "data_offsets": [12, 0]}},
        {"a": {**e, "data_offsets": [0, 1 << 40]}},  # past the end of the file
        {"a": {**e, "dtype": "Q4"}},
        {"a": {**e, "dtype": 7}},
        {"a": [1, 2]},
        {"a": {**e, "data_offsets": [0.0, 12]}},
        {"a": {**e, "data_offsets": [0]}},
        {"__metadata__": {"k": 1}, "a": e},
        {"a": {k: v for k, v in e.items() if k != "shape"}},
        [1, 2],
    ]
    for header in headers:
        raw = json.dumps(header).encode()
        assert one_pass(f, raw, 100, 124) == two_step(f, raw, 100, 124), header
    assert isinstance(one_pass(f, json.dumps(headers[1]).encode(), 100, 124), list)
    assert "overlap" in str(one_pass(f, json.dumps(headers[4]).encode(), 100, 124))


def test_sections_read_together_are_the_sections_read_one_by_one(tmp_path: Path) -> None:
    """Delta.read_sections: the bytes of read_section for each, with one read per adjacent run; a bad
    digest or a short block is refused naming the item, as read_section refuses it."""
    from dataclasses import replace

    base, new = _moe_pair(tmp_path, experts=8)
    engine.diff(base, new, tmp_path / "d", base_version="v0", target_version="v1")
    delta = Delta.open(tmp_path / "d")
    sections = [it.data for it in delta.manifest.items]
    reads = {"n": 0}
    real = delta.source.read

    def counting(block, start, end):  # type: ignore[no-untyped-def]
        reads["n"] += 1
        return real(block, start, end)

    delta.source.read = counting  # type: ignore[method-assign]
    together = delta.read_sections(sections, lambda i: f"item {i}")
    assert reads["n"] < len(sections) / 5  # adjacent sections were read at once
    assert together == [delta.read_section(s, "x") for s in sections]
    bad = list(sections)
    bad[5] = replace(bad[5], digest="0" * len(bad[5].digest))
    with pytest.raises(IntegrityError, match=r"^item 5: .*corrupt \(digest mismatch\)"):
        delta.read_sections(bad, lambda i: f"item {i}")
    block = delta.manifest.blocks[sections[-1].block]
    long = [*sections[:-1], replace(sections[-1], length=block.size - sections[-1].offset + 7)]
    with pytest.raises(IntegrityError, match=rf"^item {len(sections) - 1}: .*truncated"):
        delta.read_sections(long, lambda i: f"item {i}")
    # preread hands each checked section to the next read_section of it, once
    delta.preread(sections[:3], lambda i: f"item {i}")
    before = reads["n"]
    assert [delta.read_section(s, "x") for s in sections[:3]] == together[:3]
    assert reads["n"] == before
    delta.read_section(sections[0], "x")
    assert reads["n"] == before + 1


def test_digest_cache_entries_are_checked_whole_and_not_rewritten_unchanged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dcr_cli.io import digest_cache

    monkeypatch.setenv("DCR_CACHE_DIR", str(tmp_path / "cache"))
    good = {f"t{i}": f"{i:064x}" for i in range(50)}
    digest_cache.save_entry("k", good)
    assert digest_cache.load_entry("k") == good
    for bad_value in ("A" * 64, "0" * 63, 7, None, "g" * 64):
        digest_cache.save_entry("k", {**good, "t3": bad_value})  # type: ignore[dict-item]
        assert digest_cache.load_entry("k") == {}, bad_value  # damaged: a miss, as before
    (tmp_path / "cache" / "k").write_text(json.dumps([1, 2]))
    assert digest_cache.load_entry("k") == {}

    base, _ = _moe_pair(tmp_path, experts=2, shards=1)
    with SafetensorsCheckpoint(base) as ckpt:
        digests = ckpt.tensor_digests()  # hashed and saved
    saves = {"n": 0}
    real = digest_cache.save

    def counting(*args, **kwargs):  # type: ignore[no-untyped-def]
        saves["n"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(digest_cache, "save", counting)
    with SafetensorsCheckpoint(base) as ckpt:
        assert ckpt.cached_digests() == digests
        ckpt.remember_digests(digests)
        assert saves["n"] == 0  # the cache held exactly these
        ckpt.remember_digests({**digests, "embed": "0" * 64})
        assert saves["n"] == 1


def test_neighbouring_small_tensors_scanned_as_one_span_give_the_same_delta(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch's neighbours laid out alike on both sides are scanned as one span; the delta is byte for
    byte the one of per-tensor scans, also where the sides are laid out differently (no span fits)."""
    base, new = _moe_pair(tmp_path)
    with SafetensorsCheckpoint(new) as ckpt:
        tensors = {n: (t.dtype, t.shape, ckpt.view(n).copy()) for n, t in ckpt.tensors.items()}
    shuffled = write_checkpoint(tmp_path / "v1-shuffled", dict(reversed(list(tensors.items()))), shards=2)
    calls = {"n": 0}
    real = engine.scan_changes

    def counting(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(engine, "scan_changes", counting)  # the spans' scans
    monkeypatch.setattr(codec, "scan_changes", counting)  # a tensor's own scan (diff_region)
    spans = _diff(base, new, tmp_path / "spans", workers=2)
    span_scans = calls["n"]
    other_layout = _diff(base, shuffled, tmp_path / "other-layout", workers=2)
    monkeypatch.setattr(engine, "SPAN_BYTES", 0)  # every tensor scanned alone
    calls["n"] = 0
    alone = _diff(base, new, tmp_path / "alone", workers=2)
    assert spans == alone
    assert span_scans < len(tensors) / 5 < calls["n"], (span_scans, calls["n"])  # it did scan spans
    assert other_layout == alone
    assert dcr_cli.apply(tmp_path / "spans", into=copy_checkpoint(base, tmp_path / "recv")).steps
    assert read_raw(tmp_path / "recv") == read_raw(new)


def test_make_item_is_the_dataclass_item() -> None:
    import dataclasses

    from dcr_cli.format.manifest import Item, Region, Section, make_item

    data, repair = Section(0, 4, 20, "a" * 32), Section(1, 0, 9, "b" * 32)
    for fields in (
        ("t", Region.range(0, 8), "xor", 3, data, 5, "c" * 64, "d" * 64, repair, None, None),
        ("u", Region.box((1, 0), (2, 3)), "replace", 6, data, 0, "e" * 64, "f" * 64, None, "cast", 2),
    ):
        made, built = make_item(*fields), Item(*fields)  # type: ignore[arg-type]
        assert made == built and hash(made) == hash(built) and repr(made) == repr(built)
        assert dataclasses.astuple(made) == dataclasses.astuple(built)
        with pytest.raises(dataclasses.FrozenInstanceError):
            made.count = 1  # type: ignore[misc]


def test_a_reopened_checkpoint_rereads_a_changed_index(tmp_path: Path) -> None:
    base, _ = _moe_pair(tmp_path, experts=2, shards=2)
    index = base / safetensors_dir.INDEX_NAME
    good = index.read_bytes()
    with SafetensorsCheckpoint(base) as first:
        names = set(first.tensors)
    with SafetensorsCheckpoint(base) as again:  # the same bytes: the names kept from the first parse
        assert set(again.tensors) == names
    index.write_bytes(good.replace(b'"weight_map"', b'"weight_map": {}, "weight_map"'))
    with pytest.raises(FormatError, match="duplicate key"):
        SafetensorsCheckpoint(base)
    index.write_bytes(good.replace(b"model-00002-of-00002", b"model-00003-of-00002"))
    with pytest.raises(dcr_cli.errors.IncompatibleError, match="missing"):
        SafetensorsCheckpoint(base)
    index.write_bytes(good)
    with SafetensorsCheckpoint(base) as restored:
        assert set(restored.tensors) == names


def test_a_damaged_recorded_shape_neither_crashes_the_fingerprint_nor_is_trusted(tmp_path: Path) -> None:
    # Found by test_fuzz_store_state: a nested list where a dimension belongs (an unhashable shape).

    from dcr_cli.format.manifest import TensorEntry, fingerprint
    from dcr_cli.receive.checkpoint.state import read_recorded_table, state_dir

    odd = {"a": TensorEntry("BF16", ([1], 2), "0" * 64)}  # type: ignore[arg-type]
    assert len(fingerprint(odd)) == 64
    (tmp_path / ".dcr").mkdir()
    table = {"tensors": {"a": {"dtype": "BF16", "shape": [[1], 2], "digest": "0" * 64}}}
    (state_dir(tmp_path) / "table.json").write_text(json.dumps(table))
    assert read_recorded_table(tmp_path, fingerprint(odd)) is None


@pytest.mark.parametrize("level", [None, 3], ids=["tuned", "level-3"])
@pytest.mark.parametrize("uint", [np.uint8, np.uint16, np.uint32, np.uint64])
def test_a_span_encodes_each_tensor_as_its_own_encoding(uint: type, level: int | None) -> None:
    """``encode_span`` (one set of numpy passes over a span's changes) gives every tensor exactly the
    item ``encode_changes`` gives it alone: gaps with and without escapes, byte planes of every width,
    xor and overwrite, dense trials, unchanged tensors, and changes between the tensors left out."""
    from dcr_cli.format.kernels import scan_changes
    from dcr_cli.format.manifest import Region

    rng = np.random.default_rng(int(np.dtype(uint).itemsize))
    bits = 8 * np.dtype(uint).itemsize
    escapes_seen = dense_seen = 0
    for trial in range(40):
        k = int(rng.integers(1, 24))
        sizes = rng.integers(0, 3000, k)
        gaps = rng.integers(0, 40, k) * (trial % 3 != 0)  # a third of the spans: tensors back to back
        starts, ends, at = [], [], 0
        for size, gap in zip(sizes, gaps, strict=True):
            at += int(gap)
            starts.append(at)
            at += int(size)
            ends.append(at)
        span = at + int(rng.integers(0, 9))
        base = rng.integers(0, 1 << min(bits, 63), span, dtype=np.uint64).astype(uint)
        new = base.copy()
        for e0, e1 in zip(starts, ends, strict=True):
            rate = float(rng.choice([0.0, 0.002, 0.01, 0.05, 0.3, 1.0]))
            hit = rng.random(e1 - e0) < rate
            new[e0:e1][hit] ^= rng.integers(1, 1 << min(bits, 63), int(hit.sum()), dtype=np.uint64).astype(uint)
        between = rng.random(span) < 0.05  # changes in the bytes between tensors: no tensor's
        for e0, e1 in zip(starts, ends, strict=True):
            between[e0:e1] = False
        new[between] ^= uint(1)
        ops = [str(rng.choice(["xor", "overwrite"])) for _ in range(k)]
        positions, masks, news = scan_changes(base, new)
        cuts = np.searchsorted(positions, starts + ends).tolist()
        names = [f"t{i}" for i in range(k)]

        def dense(
            i: int, base: np.ndarray = base, new: np.ndarray = new, starts: list[int] = starts, ends: list[int] = ends
        ) -> tuple[np.ndarray, np.ndarray]:
            return base[starts[i] : ends[i]], new[starts[i] : ends[i]]

        got = codec.encode_span(names, ops, starts, ends, cuts, positions, masks, news, dense, level=level)  # type: ignore[arg-type]
        for i in range(k):
            b, n = base[starts[i] : ends[i]], new[starts[i] : ends[i]]
            want = codec.diff_region(names[i], Region.range(0, len(b)), b, n, op=ops[i], level=level)  # type: ignore[arg-type]
            assert got[i] == want, (trial, i)
            if want is not None and want.op == "replace":
                dense_seen += 1
            if want is not None and want.op != "replace" and np.any(np.diff(np.flatnonzero(b != n)) > 256):
                escapes_seen += 1
    assert escapes_seen > 10 and dense_seen > 3, (escapes_seen, dense_seen)  # the cases were exercised


def test_make_section_is_the_dataclass_section() -> None:
    import dataclasses

    from dcr_cli.format.manifest import Section, make_section

    made, built = make_section(3, 17, 250, "a" * 32), Section(3, 17, 250, "a" * 32)
    assert made == built and hash(made) == hash(built) and repr(made) == repr(built)
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.offset = 1  # type: ignore[misc]


def test_staged_blocks_hold_their_sections_whatever_the_write_batching(tmp_path: Path) -> None:
    """Sections are gathered and written WRITE_BYTES at a time: every block file is still exactly its
    sections' bytes, named by their digest, and on_block sees the same bytes."""
    from dcr_cli.delta import writer as writer_mod
    from dcr_cli.format.codec import EncodedItem
    from dcr_cli.format.digest import digest_bytes
    from dcr_cli.format.manifest import Region, TensorEntry, VersionRef

    rng = np.random.default_rng(5)
    seen: dict[str, bytes] = {}

    def on_block(block_id: str, data: bytes) -> None:
        seen[block_id] = bytes(data)

    w = writer_mod.DeltaWriter(tmp_path / "d", block_bytes=3 << 20, on_block=on_block)
    added: list[tuple[bytes, bytes | None]] = []
    sizes = [10, 300, writer_mod.WRITE_BYTES + 7, 5, 2 << 20, 1, 900_000, 64, 4 << 20, 3, 70_000, 9]
    sizes += [30_000] * 40 + [7]  # small sections that fill the write buffer by themselves
    for i, size in enumerate(sizes):
        data = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
        repair = data[: size // 2] if i % 3 else None
        added.append((data, repair))
        w.add(EncodedItem(f"t{i}", Region.range(0, size), "xor", 1, data, 0, "c" * 64, "d" * 64, repair))
    ref = VersionRef("v", "0" * 64)
    manifest = w.finish(ref, ref, {f"t{i}": TensorEntry("U8", (len(d),), "0" * 64) for i, (d, _) in enumerate(added)})
    blocks = {b.id: (tmp_path / "d" / b.path).read_bytes() for b in manifest.blocks}
    assert len(manifest.blocks) > 3
    for block_id, raw in blocks.items():
        assert digest_bytes(raw) == block_id and seen[block_id] == raw
    for item, (data, repair) in zip(manifest.items, added, strict=True):
        d = item.data
        assert blocks[manifest.blocks[d.block].id][d.offset : d.offset + d.length] == data
        if repair is None:
            assert item.repair is None
        else:
            r = item.repair
            assert r is not None and blocks[manifest.blocks[r.block].id][r.offset : r.offset + r.length] == repair


def test_plan_units_made_fast_are_the_dataclass_units() -> None:
    import dataclasses

    from dcr_cli.produce.plan import DigestUnit, RangeUnit, digest_unit, range_unit

    pairs = [(digest_unit("t"), DigestUnit("t")), (range_unit("t", 3, 9, "xor", 2), RangeUnit("t", 3, 9, "xor", 2))]
    for made, built in pairs:
        assert made == built and hash(made) == hash(built) and repr(made) == repr(built)
        assert dataclasses.astuple(made) == dataclasses.astuple(built)
        with pytest.raises(dataclasses.FrozenInstanceError):
            made.name = "u"  # type: ignore[misc]


@pytest.mark.parametrize("shape", [[1.0, 2], [True, 2], [-1, 2], "ab", [[1], 2], 5, {"0": 1}])
def test_a_recorded_shape_that_is_no_list_of_ints_is_not_trusted(tmp_path: Path, shape: object) -> None:
    """The table's parse caches shapes; what the cache would equate (1.0 and True with 1) is refused first."""
    from dcr_cli.format.manifest import TensorEntry, fingerprint
    from dcr_cli.receive.checkpoint.state import read_recorded_table, state_dir, write_recorded_table

    (tmp_path / ".dcr").mkdir()
    good = {"a": TensorEntry("BF16", (1, 2), "0" * 64), "b": TensorEntry("BF16", (1, 2), "1" * 64)}
    write_recorded_table(tmp_path, good)
    assert read_recorded_table(tmp_path, fingerprint(good)) == good
    doc = json.loads((state_dir(tmp_path) / "table.json").read_bytes())
    doc["tensors"]["b"]["shape"] = shape
    (state_dir(tmp_path) / "table.json").write_text(json.dumps(doc))
    assert read_recorded_table(tmp_path, fingerprint(good)) is None


@settings(max_examples=60, deadline=None)
@given(
    st.dictionaries(
        # names as strict_json reads them back: no NUL, no lone surrogate (refused, as in any dcr JSON)
        st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), min_size=1, max_size=12),
        st.tuples(
            st.sampled_from(["BF16", "F32", "I8"]),
            st.lists(st.integers(0, 2**40), max_size=4),
            st.text(alphabet="0123456789abcdef", min_size=64, max_size=64),
        ),
        max_size=8,
    )
)
def test_the_recorded_table_is_written_as_json_dumps_writes_it(rows: dict) -> None:
    """The templated writer gives json.dumps's bytes (any name: quotes, backslashes, controls, non-ASCII)
    and reads back as the same table."""
    import tempfile

    from dcr_cli.format.manifest import TensorEntry, fingerprint
    from dcr_cli.receive.checkpoint import state

    table = {n: TensorEntry(d, tuple(s), g) for n, (d, s, g) in rows.items()}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / ".dcr").mkdir()
        state.write_recorded_table(root, table)
        raw = (state.state_dir(root) / state.TABLE_NAME).read_bytes()
        obj = {"fingerprint": fingerprint(table), "tensors": {n: t.to_json() for n, t in sorted(table.items())}}
        assert raw == json.dumps(obj, separators=(",", ":")).encode()
        state._LAST_TABLE.clear()  # parsed from the file, not the writer's cache
        assert state.read_recorded_table(root, fingerprint(table)) == table
