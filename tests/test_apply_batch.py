"""The receiver's batched path for small items (receive/checkpoint/batch.py) changes the cost only.

* on random sparse changes (xor and overwrite items) of tensors of every width (1, 2, 4, 8 bytes), with
  NaN payloads, -0.0 and infinities among the values, and random batch cuts, an apply through batches writes exactly
  the bytes of an apply item by item (and of the target), and the batches were taken;
* the compiled frame walk accepts only frames that the checked one-frame path accepts, with the
  same declared size (any byte flipped, cut or appended);
* a batch with an item not at its pre-image fails as the per-item path does: the same message,
  nothing written.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from helpers_checkpoints import copy_checkpoint, read_raw, snapshot, write_checkpoint
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from manifest_text import manifest_v1
from test_apply import SPECIAL_BITS

import dcr_cli
from dcr_cli.delta.reader import Delta
from dcr_cli.errors import DcrError, IncompatibleError
from dcr_cli.format import codec, kernels
from dcr_cli.produce.engine import diff
from dcr_cli.receive.checkpoint import applier, batch

WIDTH_DTYPES = {1: ["U8", "F8_E4M3", "I8"], 2: ["BF16", "F16"], 4: ["F32", "I32"], 8: ["F64", "I64"]}


def experts(rng: np.random.Generator, count: int, shape: tuple[int, int], flips: int, mask: int) -> tuple[dict, dict]:
    """``count`` small BF16 tensors and a step that XORs ``mask`` into ``flips`` random elements of each."""
    size = shape[0] * shape[1]
    t0 = {f"e{i:03d}": ("BF16", shape, rng.integers(0, 1 << 16, size, dtype=np.uint16)) for i in range(count)}
    t1 = {}
    for name, (dt, sh, a) in t0.items():
        b = a.copy()
        b[rng.integers(0, a.size, flips)] ^= np.uint16(mask)
        t1[name] = (dt, sh, b)
    return t0, t1


@contextlib.contextmanager
def settings_of(module: object, **values: object) -> Iterator[None]:
    old = {k: getattr(module, k) for k in values}
    for k, v in values.items():
        setattr(module, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(module, k, v)


@contextlib.contextmanager
def counting_batches() -> Iterator[dict[str, int]]:
    """Counts batches prepared as one (and declined) during the block."""
    real = applier.prepare_batch
    seen = {"taken": 0, "declined": 0}

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        out = real(*args, **kwargs)
        seen["taken" if out is not None else "declined"] += 1
        return out

    applier.prepare_batch = counted  # type: ignore[assignment]
    try:
        yield seen
    finally:
        applier.prepare_batch = real  # type: ignore[assignment]


@st.composite
def sparse_pairs(draw: st.DrawFn) -> tuple[dict, dict]:
    """Two versions of 4..24 small tensors of mixed widths; a few elements of each changed to random or special bits."""
    n = draw(st.integers(4, 40))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    t0, t1 = {}, {}
    for i in range(n):
        width = draw(st.sampled_from([1, 2, 4, 8]))
        dt = draw(st.sampled_from(WIDTH_DTYPES[width]))
        size = draw(st.integers(40, 300))  # sparse: xor items (a dense change becomes a replace)
        uint = np.dtype(f"<u{width}")
        a = rng.integers(0, 1 << (8 * width), size, dtype=np.uint64).astype(uint)
        specials = np.array(SPECIAL_BITS[width], dtype=np.uint64).astype(uint)
        a[rng.random(size) < 0.2] = rng.choice(specials)
        b = a.copy()
        changed = rng.random(size) < draw(st.sampled_from([0.01, 0.05, 0.1]))
        changed[rng.integers(0, size)] = True  # every tensor changes (an item each)
        b[changed] = rng.integers(0, 1 << (8 * width), int(changed.sum()), dtype=np.uint64).astype(uint)
        b[changed & (rng.random(size) < 0.3)] = rng.choice(specials)
        b[changed & (a == b)] ^= uint.type(1)
        name = f"t{i:02d}"
        t0[name], t1[name] = (dt, (size,), a), (dt, (size,), b)
    return t0, t1


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    pair=sparse_pairs(),
    items=st.integers(2, 40),
    cover=st.sampled_from([700, 2000, 1 << 18]),
    shards=st.integers(1, 3),
    stretch=st.sampled_from([(0, 64), (100, 600), (64 << 10, 8 << 20)]),
    overwrite=st.sampled_from([(), ("t0*",), ("t*",)]),
)
def test_batches_write_the_bytes_of_the_per_item_path(
    tmp_path_factory: pytest.TempPathFactory,
    pair: tuple[dict, dict],
    items: int,
    cover: int,
    shards: int,
    stretch: tuple[int, int],
    overwrite: tuple[str, ...],
) -> None:
    tmp = tmp_path_factory.mktemp("batch")
    t0, t1 = pair
    base, new = write_checkpoint(tmp / "v0", t0, shards=shards), write_checkpoint(tmp / "v1", t1, shards=shards)
    diff(base, new, tmp / "d", base_version="v0", target_version="v1", workers=1, overwrite=overwrite)
    ops = {it.op for it in Delta.open(tmp / "d").manifest.items}
    assert ops <= {"xor", "overwrite", "replace"} and ("overwrite" in ops) == bool(overwrite)
    gap, longest = stretch  # how the batch's regions are cut into reads
    with (
        settings_of(applier, BATCH_ITEMS=items, BATCH_COVER=cover),
        settings_of(batch, READ_GAP_BYTES=gap, SEGMENT_BYTES=longest),
        counting_batches() as seen,
    ):
        batched = dcr_cli.apply(tmp / "d", into=copy_checkpoint(base, tmp / "batched"), workers=2)
    with settings_of(batch, MIN_ITEMS=1 << 30), counting_batches() as none:
        one_by_one = dcr_cli.apply(tmp / "d", into=copy_checkpoint(base, tmp / "items"), workers=2)
    assert none["taken"] == 0
    assert seen["taken"] > 0  # the batched path did run
    assert read_raw(tmp / "batched") == read_raw(tmp / "items") == read_raw(new)
    assert batched.steps[0].applied == one_by_one.steps[0].applied == len(t0)
    assert batched.steps[0].changed_elements == one_by_one.steps[0].changed_elements


def test_batches_kept_or_dropped_give_the_same_bytes(tmp_path: Path) -> None:
    """Beyond the memory budget a batch is prepared again when written: the same bytes."""
    rng = np.random.default_rng(5)
    t0, t1 = experts(rng, 200, (24, 16), flips=4, mask=3)
    base, new = write_checkpoint(tmp_path / "v0", t0, shards=2), write_checkpoint(tmp_path / "v1", t1, shards=2)
    diff(base, new, tmp_path / "d", base_version="v0", target_version="v1")
    for budget in (0, 1 << 30):
        recv = copy_checkpoint(base, tmp_path / f"recv{budget}")
        with settings_of(applier, PREPARED_BYTES=budget, BATCH_ITEMS=64), counting_batches() as seen:
            dcr_cli.apply(tmp_path / "d", into=recv, workers=2)
            batches = len(list(applier.item_batches(Delta.open(tmp_path / "d").manifest.items)))
        assert batches == 4
        assert seen == {"taken": batches if budget else 2 * batches, "declined": 0}  # dropped: prepared again
        assert read_raw(recv) == read_raw(new)


def _python_frame(frame: bytes, least: int, most: int) -> int | None:
    """The declared size the checked one-frame path accepts, or None where it refuses."""
    try:
        return len(codec.decompress_bounded(frame, least, most, "x"))
    except DcrError:
        return None


@settings(max_examples=300, deadline=None)
@given(
    data=st.binary(min_size=0, max_size=3000),
    level=st.sampled_from([None, 1, 19]),
    edit=st.sampled_from(["none", "flip", "cut", "append", "header"]),
    where=st.integers(0, 1 << 30),
    byte=st.integers(0, 255),
)
def test_the_compiled_frame_walk_accepts_only_what_the_checked_path_accepts(
    data: bytes, level: int | None, edit: str, where: int, byte: int
) -> None:
    frame = bytearray(codec.compress(np.frombuffer(data, dtype=np.uint8), level))
    if edit == "flip":
        frame[where % len(frame)] ^= byte or 1
    elif edit == "cut":
        del frame[where % len(frame) :]
    elif edit == "append":
        frame.append(byte)
    elif edit == "header":
        frame[4 + where % 6 if len(frame) > 10 else 0] = byte
    raw = bytes(frame)
    declared, refused = kernels.zstd_frames(
        np.frombuffer(raw, dtype=np.uint8), np.array([0], dtype=np.int64), np.array([len(raw)], dtype=np.int64)
    )
    if refused < 0:  # accepted by the walk: the checked path accepts it too, with that size
        size = int(declared[0])
        assert _python_frame(raw, size, size) == size or _decodes_wrong(raw)
    if edit == "none":
        assert refused < 0 and int(declared[0]) == len(data)


def _decodes_wrong(raw: bytes) -> bool:
    """A frame whose headers are sound but whose content is not (a flipped literal): zstd's own check
    refuses it, in both paths (the batched path decodes with zstd too)."""
    try:
        codec._decompressor().decompress(raw)
    except Exception:
        return True
    return False


def test_an_item_off_its_pre_image_in_a_batch_fails_as_item_by_item(tmp_path: Path) -> None:
    """A manifest whose 6th item has pre and post swapped: refused before any write, in the same words."""
    rng = np.random.default_rng(9)
    t0 = {f"e{i:02d}": ("F32", (50,), rng.integers(0, 1 << 32, 50, dtype=np.uint32)) for i in range(12)}
    t1 = {
        n: (dt, s, a ^ (np.uint32(1 << 31) * (rng.random(a.size) < 0.1)).astype(np.uint32))
        for n, (dt, s, a) in t0.items()
    }
    base, _ = write_checkpoint(tmp_path / "v0", t0), write_checkpoint(tmp_path / "v1", t1)
    diff(base, tmp_path / "v1", tmp_path / "d", base_version="v0", target_version="v1")
    m = manifest_v1(tmp_path / "d")
    it = m["items"][5]
    it["pre"], it["post"] = it["post"], it["pre"]
    (tmp_path / "d" / "manifest.json").write_text(json.dumps(m))
    errors = []
    for label, knobs in (("batched", {}), ("items", {"MIN_ITEMS": 1 << 30})):
        recv = copy_checkpoint(base, tmp_path / label)
        before = snapshot(recv)
        with settings_of(batch, **knobs), counting_batches() as seen, pytest.raises(IncompatibleError) as info:
            dcr_cli.apply(tmp_path / "d", into=recv)
        errors.append(str(info.value).replace(str(recv), "RECV"))
        assert "pre-image" in errors[-1] and "e05" in errors[-1]
        assert snapshot(recv) == before  # nothing written
        assert seen["taken"] == 0 and seen["declined"] > 0  # the batch declined; the per-item path refused
    assert errors[0] == errors[1]


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pair=sparse_pairs(), shards=st.integers(1, 3), batch_bytes=st.sampled_from([64, 1000, 4 << 20]))
def test_small_tensors_digested_in_file_order_have_their_own_digests(
    tmp_path_factory: pytest.TempPathFactory, pair: tuple[dict, dict], shards: int, batch_bytes: int
) -> None:
    from dcr_cli.checkpoints.safetensors_dir import SafetensorsCheckpoint
    from dcr_cli.format.digest import digest_bytes
    from dcr_cli.receive.checkpoint import inplace

    root = write_checkpoint(tmp_path_factory.mktemp("digests") / "c", pair[0], shards=shards)
    with SafetensorsCheckpoint(root) as ckpt, inplace.InPlaceFiles(dict(ckpt.tensors)) as files:
        with settings_of(inplace, BATCH_BYTES=batch_bytes, READ_GAP_BYTES=batch_bytes // 8):
            table = inplace.digest_tensors(files, 2)
        expected = {n: digest_bytes(files.read(n, 0, loc.numel)) for n, loc in files.locations.items()}
    assert {n: t.digest for n, t in table.items()} == expected
    assert set(table) == set(pair[0])


def test_a_write_cut_short_inside_a_joined_span_resumes_bit_exact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch of many items is written in spans over several items: one cut short leaves the items before
    it done, at most one torn (repaired from its repair section) and the rest pending."""
    from dcr_cli.receive.checkpoint import inplace

    rng = np.random.default_rng(21)
    t0, t1 = experts(rng, 120, (8, 32), flips=6, mask=0x8001)
    base, new = write_checkpoint(tmp_path / "v0", t0), write_checkpoint(tmp_path / "v1", t1)
    diff(base, new, tmp_path / "d", base_version="v0", target_version="v1")
    recv = copy_checkpoint(base, tmp_path / "recv")
    real, sizes = inplace._write_values, []

    def cut(fd: int, offset: int, data: memoryview) -> None:
        sizes.append(len(data))
        if len(sizes) == 1:  # the batch is one span (its regions follow each other)
            real(fd, offset, data[: len(data) // 3])
            raise OSError(28, "No space left on device")
        real(fd, offset, data)

    monkeypatch.setattr(inplace, "_write_values", cut)
    with pytest.raises(OSError):
        dcr_cli.apply(tmp_path / "d", into=recv, workers=1)
    monkeypatch.undo()
    assert sizes[0] > 2 * 512  # the write cut short spanned several items' regions (512 bytes each)
    step = dcr_cli.apply(tmp_path / "d", into=recv, workers=1).steps[0]
    assert step.status == "resumed" and step.done > 0 and step.repaired <= 1
    assert step.done + step.applied + step.repaired == len(t0)
    assert read_raw(recv) == read_raw(new)


def test_verify_reports_the_fingerprint_of_what_it_hashed(tmp_path: Path) -> None:
    """verify takes the expected fingerprint for the computed one only where the tables are equal."""
    from dcr_cli.checkpoints.safetensors_dir import SafetensorsCheckpoint
    from dcr_cli.format.manifest import fingerprint
    from dcr_cli.receive.checkpoint import inplace

    rng = np.random.default_rng(4)
    t0 = {f"e{i:02d}": ("F16", (30,), rng.integers(0, 1 << 16, 30, dtype=np.uint16)) for i in range(20)}
    t1 = {n: (dt, s, a ^ np.uint16(1)) for n, (dt, s, a) in t0.items()}
    base, new = write_checkpoint(tmp_path / "v0", t0), write_checkpoint(tmp_path / "v1", t1)
    diff(base, new, tmp_path / "d", base_version="v0", target_version="v1")

    def hashed(root: Path) -> str:
        with SafetensorsCheckpoint(root) as ckpt, inplace.InPlaceFiles(dict(ckpt.tensors)) as files:
            return fingerprint(inplace.digest_tensors(files, 1))

    ok = dcr_cli.verify(new, against=tmp_path / "d")
    assert ok.ok and ok.computed_fingerprint == ok.expected_fingerprint == hashed(new)
    assert ok.expected_fingerprint == Delta.open(tmp_path / "d").manifest.target.fingerprint
    bad = dcr_cli.verify(base, against=tmp_path / "d")
    assert not bad.ok and bad.computed_fingerprint == hashed(base) != bad.expected_fingerprint
    dcr_cli.apply(tmp_path / "d", into=copy_checkpoint(base, tmp_path / "recv"))
    recorded = dcr_cli.verify(tmp_path / "recv")  # against the table the apply recorded
    assert recorded.ok and recorded.computed_fingerprint == hashed(tmp_path / "recv") == ok.expected_fingerprint
