"""The streaming apply (receiver-checkpoint.md §4.4): items are written as soon as they are checked, and a
check that fails later undoes them, so the receiver is proven back at its base with nothing lost.

Each item is a task of its own here (BATCH_ELEMENTS = 1), so a failure at the last item comes after the
earlier items were written; every test checks that they were (``writes``), so none of them can pass by
refusing before the first write.
"""

from __future__ import annotations

import errno
import functools
import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner
from helpers_checkpoints import copy_checkpoint, mutate, random_tensors, read_raw, write_checkpoint
from store_fixtures import S3Endpoint

import dcr_cli
from dcr_cli.cli import main
from dcr_cli.delta import prefetch, reader, writer
from dcr_cli.delta.reader import Delta
from dcr_cli.errors import IncompatibleError
from dcr_cli.format.digest import digest_bytes
from dcr_cli.produce import diff
from dcr_cli.receive.checkpoint import applier as apply_module
from dcr_cli.receive.checkpoint import inplace, read_state


def run_cli(*args: object) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.stdout, result.stderr


@pytest.fixture
def versions(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path, Path, Path]:
    """(receiver recorded at v0, delta v0 -> v1 of xor items, dense v0, dense v1); one task per item."""
    rng = np.random.default_rng(29)
    specs = [(f"t{i}", dt, (64, 48)) for i, dt in enumerate(["BF16", "F32", "F16", "BF16", "F32", "U8"])]
    t0 = random_tensors(rng, specs)
    t1 = mutate(rng, t0, 0.05)
    write_checkpoint(tmp_path / "v0", t0, shards=2)
    write_checkpoint(tmp_path / "v1", t1, shards=2)
    with monkeypatch.context() as m:  # blocks of a few sections, so that the last one arrives after the first writes
        m.setattr(writer, "TARGET_BLOCK_BYTES", 1024)
        diff(tmp_path / "v0", tmp_path / "v1", tmp_path / "delta", base_version="v0", target_version="v1", workers=1)
    diff(tmp_path / "v1", tmp_path / "v0", tmp_path / "back", base_version="v1", target_version="v0", workers=1)
    recv = copy_checkpoint(tmp_path / "v0", tmp_path / "recv")
    assert dcr_cli.apply(tmp_path / "back", into=recv).noop  # records v0, as the RL loop leaves a receiver
    monkeypatch.setattr(apply_module, "BATCH_ELEMENTS", 1)  # every item a pool task of its own
    m = Delta.open(tmp_path / "delta").manifest
    assert len(m.items) >= 6 and all(item.op == "xor" for item in m.items) and len(m.blocks) > 4
    return recv, tmp_path / "delta", tmp_path / "v0", tmp_path / "v1"


def count_writes(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    real = inplace._write_values
    writes = {"n": 0}

    def write(fd: int, offset: int, data: memoryview) -> None:
        writes["n"] += 1
        real(fd, offset, data)

    monkeypatch.setattr(inplace, "_write_values", write)
    return writes


def assert_back_at_base(recv: Path, v0: Path, before: object) -> None:
    assert read_raw(recv) == read_raw(v0)
    state = read_state(recv)
    assert state is not None and state.applying is None
    assert (state.version, state.fingerprint, state.history) == before
    assert dcr_cli.verify(recv).ok  # the recorded version is the one the files hold


def test_items_are_written_while_later_items_are_still_unchecked(
    versions: tuple[Path, Path, Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    recv, delta, _, v1 = versions
    events: list[str] = []
    real_write, real_decode = inplace._write_values, Delta.decode
    last = Delta.open(delta).manifest.items[-1]

    def write(fd: int, offset: int, data: memoryview) -> None:
        events.append("write")
        real_write(fd, offset, data)

    def decode(self: Delta, item):  # type: ignore[no-untyped-def]
        if item == last:
            events.append("last checked")
        return real_decode(self, item)

    monkeypatch.setattr(inplace, "_write_values", write)
    monkeypatch.setattr(Delta, "decode", decode)
    dcr_cli.apply(delta, into=recv, workers=1)
    assert "write" in events[: events.index("last checked")]
    assert read_raw(recv) == read_raw(v1)


@pytest.mark.parametrize(("workers", "range_bytes"), [(1, 4 << 20), (2, 4 << 20), (1, 256), (2, 256)])
def test_a_block_damaged_after_the_first_writes_is_undone(
    versions: tuple[Path, Path, Path, Path], s3_endpoint: S3Endpoint, s3_url: str, monkeypatch: pytest.MonkeyPatch,
    workers: int, range_bytes: int,
) -> None:  # fmt: skip
    """From a (real, moto) S3 store, a block that arrives damaged is found after the first writes (a local
    delta's or store's blocks are checked whole before anything is written). With ranges of 256 bytes a
    block arrives in several: the items of its good ranges may be written before the block fails its check,
    and their undo reads them again from the ranges that arrived."""
    recv, delta, v0, v1 = versions
    monkeypatch.setattr(reader, "BlockFetcher", functools.partial(prefetch.BlockFetcher, range_bytes=range_bytes))
    options = [arg for k, v in s3_endpoint.storage_options.items() for arg in ("-S", f"{k}={v}")]
    assert run_cli("push", delta, s3_url, *options)[0] == 0
    fs = s3_endpoint.filesystem()
    d = Delta.open(delta)
    section = d.manifest.items[-1].data
    key = f"{s3_url}/blocks/{d.manifest.blocks[section.block].id}"
    good = fs.cat_file(key)
    bad = bytearray(good)
    bad[section.offset + section.length - 1] ^= 0x40
    fs.pipe_file(key, bytes(bad))
    real_fetch = prefetch.BlockFetcher._fetch

    def fetch(self: prefetch.BlockFetcher, block: Any, index: int) -> None:  # the damaged block's last range: late
        if block.entry.id == d.manifest.blocks[section.block].id and index == len(block.ranges) - 1:
            time.sleep(0.3)
        real_fetch(self, block, index)

    monkeypatch.setattr(prefetch.BlockFetcher, "_fetch", fetch)
    state = read_state(recv)
    assert state is not None
    before = (state.version, state.fingerprint, state.history)
    real_write = inplace._write_values
    writes = count_writes(monkeypatch)
    code, _, err = run_cli("apply", s3_url, "--version", "v1", "--into", recv, "--workers", workers, *options)
    assert code == 2 and len(err.strip().splitlines()) == 1 and err.startswith("dcr: error: "), err
    assert "digest" in err and "items written were undone" in err and "back at version v0" in err, err
    assert writes["n"] > 0  # the earlier items had been written
    assert_back_at_base(recv, v0, before)
    monkeypatch.setattr(inplace, "_write_values", real_write)
    fs.pipe_file(key, good)  # the store, repaired, gives the version as if nothing had happened
    assert run_cli("apply", s3_url, "--version", "v1", "--into", recv, *options)[0] == 0
    assert read_raw(recv) == read_raw(v1)


def test_an_item_not_at_its_pre_image_after_the_first_writes_is_undone(
    versions: tuple[Path, Path, Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A re-signed manifest whose last item does not describe this base: refused, and the rest undone."""
    recv, delta, v0, _ = versions
    state = read_state(recv)
    assert state is not None
    before = (state.version, state.fingerprint, state.history)
    last = Delta.open(delta).manifest.items[-1]
    real_digest = apply_module._digest

    def digest(values: np.ndarray) -> str:  # the last item's current elements are not at its pre-image
        d = real_digest(values)
        return digest_bytes(b"elsewhere") if d == last.pre else d

    writes = count_writes(monkeypatch)
    monkeypatch.setattr(apply_module, "_digest", digest)
    with pytest.raises(IncompatibleError, match=r"not at the delta's pre-image.*items written were undone") as info:
        dcr_cli.apply(delta, into=recv, workers=1)
    assert "Nothing was written" not in str(info.value) and "back at version v0" in str(info.value)
    assert writes["n"] > 0
    monkeypatch.setattr(apply_module, "_digest", real_digest)
    assert_back_at_base(recv, v0, before)


def test_a_write_cut_short_is_undone_from_the_repair_values(
    versions: tuple[Path, Path, Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The third write stops halfway with EIO and the disk then recovers: that item is torn, and the undo
    puts it back at its base through its repair values (target xor mask); the error is the EIO."""
    recv, delta, v0, v1 = versions
    state = read_state(recv)
    assert state is not None
    before = (state.version, state.fingerprint, state.history)
    real = inplace._write_values
    calls = {"n": 0}

    def write(fd: int, offset: int, data: memoryview) -> None:
        calls["n"] += 1
        if calls["n"] == 3:
            real(fd, offset, data[: len(data) // 2])
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        real(fd, offset, data)

    monkeypatch.setattr(inplace, "_write_values", write)
    with pytest.raises(OSError) as info:
        dcr_cli.apply(delta, into=recv, workers=1)
    assert info.value.errno == errno.EIO and "items written were undone" in str(info.value)
    assert calls["n"] > 3  # the undo wrote
    monkeypatch.undo()
    assert_back_at_base(recv, v0, before)
    assert run_cli("apply", delta, "--into", recv)[0] == 0
    assert read_raw(recv) == read_raw(v1)


def test_a_cancelled_item_never_masks_the_real_error(
    versions: tuple[Path, Path, Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Item 0 is still being checked when item 1's write fails with ENOSPC: item 0 stops, ENOSPC is reported."""
    recv, delta, v0, v1 = versions
    failed = threading.Event()
    real_prepare = apply_module.prepare_items
    first = Delta.open(delta).manifest.items[0]

    def prepare(d, items, files, resuming, lo=-1):  # type: ignore[no-untyped-def]
        out = real_prepare(d, items, files, resuming, lo)
        if items[0] == first:
            assert failed.wait(30)  # until the other worker's write has failed
        return out

    def write(fd: int, offset: int, data: memoryview) -> None:
        failed.set()
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(apply_module, "prepare_items", prepare)
    monkeypatch.setattr(inplace, "_write_values", write)
    with pytest.raises(OSError) as info:
        dcr_cli.apply(delta, into=recv, workers=2)
    assert info.value.errno == errno.ENOSPC
    monkeypatch.undo()
    assert read_raw(recv) == read_raw(v0)  # the failed write wrote nothing
    assert run_cli("apply", delta, "--into", recv)[0] == 0
    assert read_raw(recv) == read_raw(v1)


def test_only_a_recorded_base_streams(versions: tuple[Path, Path, Path, Path], tmp_path: Path) -> None:
    """A receiver dcr has not recorded (hashed first) or an overwrite delta takes the checked-first path."""
    recv, delta, v0, _ = versions
    state = read_state(recv)
    m = Delta.open(delta)
    assert apply_module.streams(m, state, resumed=False)
    assert not apply_module.streams(m, state, resumed=True)
    assert not apply_module.streams(m, None, resumed=False)
    other = tmp_path / "over"
    diff(v0, tmp_path / "v1", other, base_version="v0", target_version="v1", overwrite=["*"], workers=1)
    assert not apply_module.streams(Delta.open(other), state, resumed=False)


def test_a_batch_is_never_stopped_half_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch of small items writing while another task fails finishes its writes: stopped between two,
    it would leave an item torn, whose undo needs a repair block that a pulled delta may not have."""
    rng = np.random.default_rng(3)
    t0 = {f"a{i}": ("F32", (60000,), rng.integers(0, 2**32 - 1, 60000, dtype=np.uint32)) for i in range(4)}
    t0["z"] = ("F32", (300000,), rng.integers(0, 2**32 - 1, 300000, dtype=np.uint32))
    t1 = {k: (dt, sh, v.copy()) for k, (dt, sh, v) in t0.items()}
    for i in range(4):
        t1[f"a{i}"][2][[0, 59999]] ^= 0x5A5A5A5A  # two changes 240 KB apart: two writes per item
    t1["z"][2][::1000] ^= 0x11111111
    write_checkpoint(tmp_path / "v0", t0)
    write_checkpoint(tmp_path / "v1", t1)
    delta = tmp_path / "delta"
    diff(tmp_path / "v0", tmp_path / "v1", delta, base_version="v0", target_version="v1", workers=1)
    diff(tmp_path / "v1", tmp_path / "v0", tmp_path / "back", base_version="v1", target_version="v0", workers=1)
    recv = copy_checkpoint(tmp_path / "v0", tmp_path / "recv")
    assert dcr_cli.apply(tmp_path / "back", into=recv).noop
    m = Delta.open(delta).manifest
    for block in m.blocks:  # as `dcr pull` without --repair leaves a delta
        if block.role == "repair":
            (delta / "blocks" / block.id).unlink()
    big = next(item for item in m.items if item.tensor == "z")
    failed, wrote = threading.Event(), threading.Event()
    real_digest, real_write_at = apply_module._digest, inplace.InPlaceFiles.write_at
    calls = {"n": 0}

    def digest(values: np.ndarray) -> str:  # z is found not at its pre-image once the batch has begun writing
        d = real_digest(values)
        if d == big.pre:
            assert wrote.wait(10)
            failed.set()
            return digest_bytes(b"elsewhere")
        return d

    def write_at(self: inplace.InPlaceFiles, file: Path, offset: int, data: memoryview) -> None:
        real_write_at(self, file, offset, data)
        calls["n"] += 1
        if calls["n"] == 1:
            wrote.set()
            assert failed.wait(10)

    monkeypatch.setattr(apply_module, "_digest", digest)
    monkeypatch.setattr(inplace.InPlaceFiles, "write_at", write_at)
    with pytest.raises(IncompatibleError, match="items written were undone"):
        dcr_cli.apply(delta, into=recv, workers=2)
    assert calls["n"] > 1  # the batch went on writing after the failure
    monkeypatch.undo()
    state = read_state(recv)
    assert state is not None and state.applying is None and state.version == "v0"
    assert read_raw(recv) == read_raw(tmp_path / "v0")


def test_a_receiver_just_hashed_takes_the_checked_first_path(
    versions: tuple[Path, Path, Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Files touched since the state was recorded are hashed again: that version is not one dcr recorded,
    so nothing is written before every check has passed (and no stale history can be restored)."""
    recv, delta, _, v1 = versions
    for f in recv.glob("*.safetensors"):
        os.utime(f)
    calls = {"stream": 0}
    real = apply_module.stream_items

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls["stream"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(apply_module, "stream_items", spy)
    dcr_cli.apply(delta, into=recv)
    assert calls["stream"] == 0
    assert read_raw(recv) == read_raw(v1)
