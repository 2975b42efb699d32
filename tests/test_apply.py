"""dcr apply --into: round trips, chains, bad inputs, failed writes, torn items, locking."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import tempfile
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from helpers_checkpoints import (
    Tensors,
    copy_checkpoint,
    mutate,
    random_tensors,
    read_raw,
    snapshot,
    write_checkpoint,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from manifest_text import manifest_v1

import dcr_cli
from dcr_cli.checkpoints.safetensors_dir import SafetensorsCheckpoint
from dcr_cli.cli import main
from dcr_cli.delta.reader import Delta
from dcr_cli.delta.writer import DeltaWriter
from dcr_cli.errors import ConflictError, FormatError, IncompatibleError, IntegrityError
from dcr_cli.format.codec import diff_region
from dcr_cli.format.digest import digest_bytes
from dcr_cli.format.dtypes import SUPPORTED
from dcr_cli.format.dtypes import dtype as lookup_dtype
from dcr_cli.format.manifest import Region, TensorEntry, VersionRef, fingerprint
from dcr_cli.produce import diff
from dcr_cli.receive import checkpoint as receiver
from dcr_cli.receive import plan as receiver_plan
from dcr_cli.receive.checkpoint import inplace, read_state
from dcr_cli.receive.checkpoint.state import ref


def run_cli(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.stdout, result.stderr


def make_versions(tmp: Path, versions: list[Tensors], shards: int = 1) -> list[Path]:
    """Write checkpoints v0..vn and deltas d01, d12, ... between consecutive ones."""
    for i, t in enumerate(versions):
        write_checkpoint(tmp / f"v{i}", t, shards=shards)
    deltas = []
    for i in range(len(versions) - 1):
        out = tmp / f"d{i}{i + 1}"
        diff(tmp / f"v{i}", tmp / f"v{i + 1}", out, base_version=f"v{i}", target_version=f"v{i + 1}", workers=2)
        deltas.append(out)
    return deltas


@pytest.fixture
def two_versions(tmp_path: Path) -> tuple[Path, Path, Path]:
    """(receiver at v0, delta v0 -> v1, dense v1)."""
    rng = np.random.default_rng(7)
    t0 = random_tensors(
        rng,
        [("embed", "BF16", (64, 32)), ("layer.0.w", "F32", (40, 30)), ("layer.0.b", "F16", (30,)), ("s", "I64", ())],
    )
    t1 = mutate(rng, t0, 0.05)
    (delta,) = make_versions(tmp_path, [t0, t1], shards=2)
    return copy_checkpoint(tmp_path / "v0", tmp_path / "recv"), delta, tmp_path / "v1"


# --------------------------------------------------------------------------- round trips

# Bit patterns that float math would not preserve: NaN payloads, signed zeros, infinities.
SPECIAL_BITS = {
    1: [0x00, 0x80, 0x7F, 0xFF],
    2: [0x0000, 0x8000, 0x7FC1, 0xFFFF, 0x7C00, 0x7F81],
    4: [0x00000000, 0x80000000, 0x7FC00001, 0xFFBFFFFF, 0x7F800000],
    8: [0, 1 << 63, 0x7FF8000000000001, 0xFFF0000000000001],
}


@st.composite
def change_cases(draw: st.DrawFn) -> tuple[Tensors, Tensors, list[str]]:
    count = draw(st.integers(1, 4))
    base: Tensors = {}
    new: Tensors = {}
    for i in range(count):
        dt = draw(st.sampled_from(SUPPORTED))
        shape = tuple(draw(st.lists(st.integers(0, 7), min_size=0, max_size=3)))
        n = int(np.prod(shape, dtype=np.int64)) if shape else 1
        d = lookup_dtype(dt)
        seed = draw(st.integers(0, 2**32 - 1))
        rng = np.random.default_rng(seed)
        top = np.iinfo(d.uint).max
        values = rng.integers(0, top, size=n, dtype=d.uint, endpoint=True)
        pattern = draw(st.sampled_from(["none", "sparse", "dense", "all", "special"]))
        changed = values.copy()
        if n:
            if pattern == "sparse":
                changed[rng.integers(0, n, size=max(1, n // 20))] ^= d.uint.type(1)
            elif pattern == "dense":
                mask = rng.random(n) < 0.6
                changed[mask] = rng.integers(0, top, size=int(mask.sum()), dtype=d.uint, endpoint=True)
            elif pattern == "all":
                changed = ~values
            elif pattern == "special":
                specials = np.array(SPECIAL_BITS[d.itemsize], dtype=d.uint)
                where = rng.random(n) < 0.5
                changed[where] = rng.choice(specials, size=int(where.sum()))
                values[~where] = rng.choice(specials, size=int((~where).sum()))
        base[f"t{i}"] = (dt, shape, values)
        new[f"t{i}"] = (dt, shape, changed)
    overwrite = draw(st.sampled_from([[], ["t0"], ["*"]]))
    return base, new, overwrite


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(change_cases())
def test_round_trip_is_bit_exact(case: tuple[Tensors, Tensors, list[str]]) -> None:
    base, new, overwrite = case
    with tempfile.TemporaryDirectory() as tmp_str:
        tmp = Path(tmp_str)
        write_checkpoint(tmp / "base", base)
        write_checkpoint(tmp / "new", new)
        diff(tmp / "base", tmp / "new", tmp / "delta", overwrite=overwrite, workers=1)
        copy_checkpoint(tmp / "base", tmp / "recv")
        dcr_cli.apply(tmp / "delta", into=tmp / "recv", workers=2)
        assert read_raw(tmp / "recv") == read_raw(tmp / "new")
        assert snapshot(tmp / "recv") == snapshot(tmp / "new")  # headers untouched, file bytes equal
        assert dcr_cli.verify(tmp / "recv", against=tmp / "delta").ok


def test_box_regions_apply_in_canonical_order(tmp_path: Path) -> None:
    """Items whose regions are N-d boxes (as training shards produce) land at the right elements."""
    rng = np.random.default_rng(3)
    t0 = random_tensors(rng, [("w", "BF16", (6, 10)), ("v", "F32", (4, 3, 5))])
    t1 = mutate(rng, t0, 0.3)
    write_checkpoint(tmp_path / "v0", t0)
    write_checkpoint(tmp_path / "v1", t1)
    writer = DeltaWriter(tmp_path / "delta")
    table = {}
    for name, (dt, shape, base_values) in t0.items():
        new_values = t1[name][2]
        table[name] = TensorEntry(dt, shape, digest_bytes(new_values))
        b, n = base_values.reshape(shape), new_values.reshape(shape)
        boxes = [((0,) * len(shape), (3, *shape[1:])), ((3,) + (0,) * (len(shape) - 1), (shape[0] - 3, *shape[1:]))]
        for k, (offsets, sizes) in enumerate(boxes):
            index = tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))
            item = diff_region(
                name,
                Region.box(offsets, sizes),
                b[index].reshape(-1),
                n[index].reshape(-1),
                op="overwrite" if k else "xor",
            )
            if item is not None:
                writer.add(item)
    base_table = {n: TensorEntry(dt, s, digest_bytes(v)) for n, (dt, s, v) in t0.items()}
    writer.finish(VersionRef("v0", fingerprint(base_table)), VersionRef("v1", fingerprint(table)), table)
    copy_checkpoint(tmp_path / "v0", tmp_path / "recv")
    dcr_cli.apply(tmp_path / "delta", into=tmp_path / "recv")
    assert read_raw(tmp_path / "recv") == read_raw(tmp_path / "v1")


# --------------------------------------------------------------------------- versions


def test_chain_in_one_command_in_any_order(tmp_path: Path) -> None:
    rng = np.random.default_rng(11)
    versions = [random_tensors(rng, [("a", "BF16", (50, 20)), ("b", "F32", (33,))])]
    for _ in range(3):
        versions.append(mutate(rng, versions[-1], 0.1))
    d01, d12, d23 = make_versions(tmp_path, versions)
    recv = copy_checkpoint(tmp_path / "v0", tmp_path / "recv")
    code, out, err = run_cli("apply", d23, d01, d12, "--into", recv)
    assert code == 0, err
    assert "v0 -> v1" in out and "v2 -> v3" in out
    assert read_raw(recv) == read_raw(tmp_path / "v3")
    state = read_state(recv)
    assert state is not None and state.version == "v3" and state.applying is None


def test_directory_of_deltas_skips_applied_ones(tmp_path: Path) -> None:
    rng = np.random.default_rng(12)
    versions = [random_tensors(rng, [("a", "U16", (200,))])]
    for _ in range(3):
        versions.append(mutate(rng, versions[-1], 0.1))
    deltas = make_versions(tmp_path, versions)
    chain = tmp_path / "chain"
    chain.mkdir()
    for d in deltas:
        d.rename(chain / d.name)
    recv = copy_checkpoint(tmp_path / "v1", tmp_path / "recv")  # already past d01
    result = dcr_cli.apply(chain, into=recv)
    assert [s.target_version for s in result.steps] == ["v2", "v3"]
    assert result.skipped == [str(chain / "d01")]
    assert read_raw(recv) == read_raw(tmp_path / "v3")


def test_already_applied_is_a_noop_and_says_so(two_versions: tuple[Path, Path, Path]) -> None:
    recv, delta, v1 = two_versions
    assert run_cli("apply", delta, "--into", recv)[0] == 0
    before = snapshot(recv)
    code, out, _ = run_cli("apply", delta, "--into", recv)
    assert code == 0
    assert "already at version v1" in out
    assert snapshot(recv) == before
    # A dense copy of the target, never touched by dcr, is recognised too.
    fresh = copy_checkpoint(v1, recv.parent / "fresh")
    code, out, _ = run_cli("apply", delta, "--into", fresh, "--json")
    assert code == 0 and json.loads(out)["noop"] is True


def test_state_is_rehashed_when_files_change_behind_its_back(two_versions: tuple[Path, Path, Path]) -> None:
    recv, delta, v1 = two_versions
    dcr_cli.apply(delta, into=recv)
    # Someone refits densely back to v0 (new files): the recorded v1 must not be trusted.
    v0_files = snapshot(recv.parent / "v0")
    for name, data in v0_files.items():
        (recv / name).unlink()
        (recv / name).write_bytes(data)
    result = dcr_cli.apply(delta, into=recv)
    assert result.steps and result.steps[0].applied > 0
    assert read_raw(recv) == read_raw(v1)


# --------------------------------------------------------------------------- bad inputs


def expect_refusal(recv: Path, *args: object, code: int = 2, words: str = "") -> str:
    before = snapshot(recv)
    had_state_dir = (recv / ".dcr").exists()
    state_before = (recv / ".dcr" / "state.json").read_bytes() if (recv / ".dcr" / "state.json").exists() else None
    exit_code, out, err = run_cli(*(str(a) for a in args))
    assert exit_code == code, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dcr: error: "), err
    assert words in lines[0], lines[0]
    assert snapshot(recv) == before
    state_after = (recv / ".dcr" / "state.json").read_bytes() if (recv / ".dcr" / "state.json").exists() else None
    assert state_after == state_before
    assert (recv / ".dcr").exists() == had_state_dir  # not even the lock file is left behind
    return lines[0]


def test_wrong_base_is_refused(two_versions: tuple[Path, Path, Path], tmp_path: Path) -> None:
    _, delta, v1 = two_versions
    other = copy_checkpoint(v1, tmp_path / "other")
    data = bytearray((other / "model-00001-of-00002.safetensors").read_bytes())
    data[-1] ^= 1  # one bit differs from v0: not the base
    (other / "model-00001-of-00002.safetensors").write_bytes(bytes(data))
    expect_refusal(other, "apply", delta, "--into", other, words="not at the base")


def test_tampered_block_is_refused(two_versions: tuple[Path, Path, Path]) -> None:
    recv, delta, _ = two_versions
    block = next(p for p in (delta / "blocks").iterdir())
    data = bytearray(block.read_bytes())
    data[len(data) // 2] ^= 0x40
    block.write_bytes(bytes(data))
    line = expect_refusal(recv, "apply", delta, "--into", recv, words="corrupt")
    assert "fetch the delta again" in line  # and what to do about it


def test_truncated_block_is_refused(two_versions: tuple[Path, Path, Path]) -> None:
    recv, delta, _ = two_versions
    manifest = manifest_v1(delta)
    data_block = next(b["id"] for b in manifest["blocks"] if b["role"] == "data")
    path = delta / "blocks" / data_block
    path.write_bytes(path.read_bytes()[:-5])
    expect_refusal(recv, "apply", delta, "--into", recv, words="truncated")


def test_tampered_manifest_table_is_refused(two_versions: tuple[Path, Path, Path]) -> None:
    recv, delta, _ = two_versions
    manifest = manifest_v1(delta)
    manifest["tensors"]["embed"]["digest"] = "0" * 64
    (delta / "manifest.json").write_text(json.dumps(manifest))
    expect_refusal(recv, "apply", delta, "--into", recv, words="target fingerprint")


def test_unknown_major_version_is_refused(two_versions: tuple[Path, Path, Path]) -> None:
    recv, delta, _ = two_versions
    manifest = manifest_v1(delta)
    manifest["format_version"] = [2, 0]
    (delta / "manifest.json").write_text(json.dumps(manifest))
    expect_refusal(recv, "apply", delta, "--into", recv, words="major version 2")


def test_missing_tensor_is_refused(two_versions: tuple[Path, Path, Path], tmp_path: Path) -> None:
    _, delta, _ = two_versions
    rng = np.random.default_rng(7)
    t0 = random_tensors(rng, [("embed", "BF16", (64, 32)), ("layer.0.w", "F32", (40, 30))])
    recv = write_checkpoint(tmp_path / "partial", t0)
    with pytest.raises(IncompatibleError, match=r"'layer\.0\.b'"):  # in-process: the API raises the same error
        dcr_cli.apply(delta, into=recv)
    expect_refusal(recv, "apply", delta, "--into", recv, words="'layer.0.b' of")


def test_missing_tensor_with_trusted_state_is_refused(two_versions: tuple[Path, Path, Path]) -> None:
    recv, delta, _ = two_versions
    # The receiver's state says v0, but a tensor has been removed since in a way the stats do not reveal:
    # rewrite the state with the new file stats to simulate a stale-but-trusted record.
    t0 = {n: v for n, v in read_raw_tensors(recv).items() if n != "layer.0.b"}
    for p in recv.glob("*.safetensors"):
        p.unlink()
    (recv / "model.safetensors.index.json").unlink()
    write_checkpoint(recv, t0)
    with SafetensorsCheckpoint(recv) as ckpt:
        stats = receiver.file_stats(recv, ckpt)
    v0_fp = Delta.open(delta).manifest.base.fingerprint
    (recv / ".dcr").mkdir(exist_ok=True)
    receiver.write_state(recv, receiver.ReceiverState("v0", v0_fp, None, stats))
    expect_refusal(recv, "apply", delta, "--into", recv, words="'layer.0.b'")


def read_raw_tensors(root: Path) -> Tensors:
    with SafetensorsCheckpoint(root) as ckpt:
        return {n: (loc.dtype, loc.shape, np.array(ckpt.view(n))) for n, loc in ckpt.tensors.items()}


def test_different_shape_is_refused(two_versions: tuple[Path, Path, Path], tmp_path: Path) -> None:
    recv, delta, _ = two_versions
    tensors = read_raw_tensors(recv)
    dt, _, values = tensors["layer.0.w"]
    tensors["layer.0.w"] = (dt, (30, 40), values)  # same bytes, other shape
    other = write_checkpoint(tmp_path / "reshaped", tensors)
    # The fingerprint differs, so it is a wrong base first; with a trusted state the layout check names it.
    with SafetensorsCheckpoint(other) as ckpt:
        stats = receiver.file_stats(other, ckpt)
    (other / ".dcr").mkdir()
    receiver.write_state(other, receiver.ReceiverState("v0", Delta.open(delta).manifest.base.fingerprint, None, stats))
    expect_refusal(other, "apply", delta, "--into", other, words="F32[30, 40]")


def test_path_escaping_the_directory_is_refused(two_versions: tuple[Path, Path, Path]) -> None:
    recv, delta, _ = two_versions
    index = json.loads((recv / "model.safetensors.index.json").read_text())
    outside = recv.parent / "outside.safetensors"
    outside.write_bytes((recv / "model-00001-of-00002.safetensors").read_bytes())
    index["weight_map"] = {
        k: "../outside.safetensors" if v.startswith("model-00001") else v for k, v in index["weight_map"].items()
    }
    (recv / "model.safetensors.index.json").write_text(json.dumps(index))
    outside_before = outside.read_bytes()
    expect_refusal(recv, "apply", delta, "--into", recv, words="escape")
    # A symlink pointing out of the directory is refused the same way.
    index["weight_map"] = {
        k: "link.safetensors" if v == "../outside.safetensors" else v for k, v in index["weight_map"].items()
    }
    (recv / "model.safetensors.index.json").write_text(json.dumps(index))
    (recv / "link.safetensors").symlink_to(outside)
    expect_refusal(recv, "apply", delta, "--into", recv, words="escape")
    assert outside.read_bytes() == outside_before


def test_second_applier_fails_fast(two_versions: tuple[Path, Path, Path]) -> None:
    recv, delta, _ = two_versions
    (recv / ".dcr").mkdir()
    fd = os.open(recv / ".dcr" / "lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # what a running dcr apply holds
        expect_refusal(recv, "apply", delta, "--into", recv, code=3, words="another dcr apply holds")
        with pytest.raises(ConflictError):
            dcr_cli.apply(delta, into=recv)
    finally:
        os.close(fd)
    dcr_cli.apply(delta, into=recv)  # released: it goes through


def test_mid_apply_with_another_delta_is_refused(
    two_versions: tuple[Path, Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    recv, delta, v1 = two_versions
    fail_after_writes(monkeypatch, 1, errno.EIO)
    with pytest.raises(OSError):
        dcr_cli.apply(delta, into=recv, workers=1)
    monkeypatch.undo()
    backwards = recv.parent / "d10"
    diff(v1, recv.parent / "v0", backwards)
    expect_refusal(recv, "apply", backwards, "--into", recv, words="in the middle of applying")
    dcr_cli.apply(delta, into=recv)
    assert read_raw(recv) == read_raw(v1)


# --------------------------------------------------------------------------- failed writes and torn items


def fail_after_writes(monkeypatch: pytest.MonkeyPatch, good: int, code: int, torn: bool = False) -> None:
    """Make the receiver's element writes fail with ``code`` after ``good`` successful ones.

    With ``torn`` the failing write lands half of its bytes first, as a write cut short by a
    crash would. (Each item of these small deltas is written with one pwrite.)
    """
    real = inplace._write_values
    calls = {"n": 0}

    def write(fd: int, offset: int, data: memoryview) -> None:
        calls["n"] += 1
        if calls["n"] > good:
            if torn:
                real(fd, offset, data[: len(data) // 2])
            raise OSError(code, os.strerror(code))
        real(fd, offset, data)

    monkeypatch.setattr(inplace, "_write_values", write)


@pytest.mark.parametrize("good", [0, 1, 2])
@pytest.mark.parametrize("torn", [False, True])
def test_failed_write_then_rerun_is_bit_exact(
    two_versions: tuple[Path, Path, Path], monkeypatch: pytest.MonkeyPatch, good: int, torn: bool
) -> None:
    recv, delta, v1 = two_versions
    fail_after_writes(monkeypatch, good, errno.ENOSPC, torn=torn)
    with pytest.raises(OSError) as info:
        dcr_cli.apply(delta, into=recv, workers=1)
    assert info.value.errno == errno.ENOSPC
    state = read_state(recv)
    assert state is not None and state.applying is not None  # the state says an apply is in flight
    monkeypatch.undo()
    result = dcr_cli.apply(delta, into=recv)
    step = result.steps[0]
    assert step.status == "resumed"
    assert step.done == good  # items finished before the failure are not applied again
    assert step.repaired == (1 if torn else 0)
    assert read_raw(recv) == read_raw(v1)
    assert snapshot(recv) == snapshot(v1)


def test_failed_write_via_cli_is_one_line(
    two_versions: tuple[Path, Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    recv, delta, v1 = two_versions
    fail_after_writes(monkeypatch, 2, errno.ENOSPC)
    code, _, err = run_cli("apply", delta, "--into", recv, "--workers", "1")
    assert code == 2 and err.startswith("dcr: error: ") and "re-run the same dcr apply" in err
    assert len(err.strip().splitlines()) == 1
    monkeypatch.undo()
    assert run_cli("apply", delta, "--into", recv)[0] == 0
    assert read_raw(recv) == read_raw(v1)


def corrupt_items(recv: Path, delta_path: Path, rng: np.random.Generator, every: int = 2) -> int:
    """Overwrite some affected elements of some items with garbage: neither pre- nor post-image."""
    delta = Delta.open(delta_path)
    with SafetensorsCheckpoint(recv) as ckpt:
        locations = dict(ckpt.tensors)
    torn = 0
    for k, item in enumerate(delta.manifest.items):
        if k % every:
            continue
        loc = locations[item.tensor]
        decoded = delta.decode(item)
        index = receiver_plan.canonical_index(item.region, decoded.positions, loc.shape)
        first = int(index[0]) if isinstance(index, np.ndarray) else index.start
        uint = lookup_dtype(loc.dtype).uint
        view = np.memmap(loc.file, dtype=uint, mode="r+", offset=loc.start, shape=(loc.numel,))
        view[first] = view[first] ^ rng.integers(1, 200, dtype=uint)
        view.flush()
        del view
        torn += 1
    return torn


@pytest.mark.parametrize("state", ["pending", "applied"])
def test_torn_items_are_repaired_with_absolute_values(
    two_versions: tuple[Path, Path, Path], state: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    recv, delta, v1 = two_versions
    if state == "applied":
        dcr_cli.apply(delta, into=recv)
    # Leave an interrupted apply in the state file, then tear items by hand.
    fail_after_writes(monkeypatch, 0, errno.EIO)
    if state == "pending":
        with pytest.raises(OSError):
            dcr_cli.apply(delta, into=recv, workers=1)
    else:
        m = Delta.open(delta)
        with SafetensorsCheckpoint(recv) as ckpt:
            files = receiver.file_stats(recv, ckpt)  # the files an interrupted apply was writing
        receiver.write_state(
            recv,
            receiver.ReceiverState(
                None,
                None,
                {"delta_id": m.id, "base": ref(m.manifest.base), "target": ref(m.manifest.target)},
                files,
            ),
        )
    monkeypatch.undo()
    torn = corrupt_items(recv, delta, np.random.default_rng(1))
    assert torn > 0
    result = dcr_cli.apply(delta, into=recv)
    assert result.steps[0].repaired == torn
    assert read_raw(recv) == read_raw(v1)


def test_torn_xor_item_without_repair_block_is_refused_clearly(
    two_versions: tuple[Path, Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    recv, delta, v1 = two_versions
    fail_after_writes(monkeypatch, 0, errno.EIO)
    with pytest.raises(OSError):
        dcr_cli.apply(delta, into=recv, workers=1)
    monkeypatch.undo()
    corrupt_items(recv, delta, np.random.default_rng(2), every=1)
    manifest = manifest_v1(delta)
    repair_blocks = [b["id"] for b in manifest["blocks"] if b["role"] == "repair"]
    stash = recv.parent / "stash"
    stash.mkdir()
    for block in repair_blocks:
        (delta / "blocks" / block).rename(stash / block)
    with pytest.raises(IntegrityError, match="repair block"):
        dcr_cli.apply(delta, into=recv)
    for block in repair_blocks:
        (stash / block).rename(delta / "blocks" / block)
    dcr_cli.apply(delta, into=recv)
    assert read_raw(recv) == read_raw(v1)


@pytest.mark.parametrize(
    "state",
    [
        "{not json",
        '{"format": "dcr.receiver-state", "format_version": 1, "applying": {"delta_id": "x", "base": 5}}',
        '{"format": "dcr.receiver-state", "format_version": 1,'
        ' "applying": {"delta_id": "x", "base": {"version": "a", "fingerprint": "' + "0" * 64 + '"}, "target": 3}}',
        '{"format": "dcr.receiver-state", "format_version": 1, "version": 5, "fingerprint": 7}',
    ],
)
def test_corrupt_state_file_is_a_clear_error(two_versions: tuple[Path, Path, Path], state: str) -> None:
    recv, delta, _ = two_versions
    (recv / ".dcr").mkdir()
    (recv / ".dcr" / "state.json").write_text(state)
    with pytest.raises(FormatError, match="receiver state"):
        dcr_cli.apply(delta, into=recv)
    code, _, err = run_cli("verify", str(recv))
    assert code == 2 and "receiver state" in err


def test_mapped_reader_sees_intact_headers_and_the_new_bits(two_versions: tuple[Path, Path, Path]) -> None:
    """An engine that has the files memory-mapped keeps valid headers; apply rewrites no header byte."""
    import mmap

    recv, delta, v1 = two_versions
    files = sorted(recv.glob("*.safetensors"))
    handles = [open(p, "rb") for p in files]  # noqa: SIM115
    try:
        maps = [mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) for f in handles]
        headers = [bytes(m[: 8 + int.from_bytes(m[:8], "little")]) for m in maps]
        dcr_cli.apply(delta, into=recv)
        for p, m, header in zip(files, maps, headers, strict=True):
            assert bytes(m[: len(header)]) == header
            assert bytes(m[:]) == (v1 / p.name).read_bytes()  # same page cache: the reader sees the target
            m.close()
    finally:
        for f in handles:
            f.close()
    assert [p.stat().st_size for p in files] == [(v1 / p.name).stat().st_size for p in files]


def test_older_delta_is_recognised_as_applied(tmp_path: Path) -> None:
    """The receiver remembers the versions it passed through, so an old delta alone is a no-op, not an error."""
    rng = np.random.default_rng(13)
    versions = [random_tensors(rng, [("a", "F32", (64,))])]
    for _ in range(2):
        versions.append(mutate(rng, versions[-1], 0.2))
    d01, d12 = make_versions(tmp_path, versions)
    recv = copy_checkpoint(tmp_path / "v0", tmp_path / "recv")
    dcr_cli.apply([d01, d12], into=recv)
    before = snapshot(recv)
    code, out, err = run_cli("apply", d01, "--into", recv)
    assert code == 0, err
    assert "already at version v2" in out and "applied before" in out
    assert snapshot(recv) == before


def test_real_enospc_on_a_full_filesystem_then_rerun(two_versions: tuple[Path, Path, Path], tmp_path: Path) -> None:
    """A genuinely full file system (a small tmpfs): one-line error, nothing claimed, re-run finishes."""
    import subprocess

    _, delta, v1 = two_versions
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    if os.geteuid() != 0 and not os.environ.get("CI"):
        pytest.skip("needs root to mount a small tmpfs (CI runs as root and never skips this)")
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)], check=True)
    try:
        recv = copy_checkpoint(tmp_path / "v0", mnt / "recv")
        with open(mnt / "filler", "wb", buffering=0) as f, contextlib.suppress(OSError):  # fill every free block
            while True:
                f.write(b"\0" * 4096)
        code, _, err = run_cli("apply", delta, "--into", recv)
        assert code == 2 and "No space left on device" in err and "re-run the same dcr apply" in err
        assert len(err.strip().splitlines()) == 1
        assert read_state(recv) is None or read_state(recv).version is None  # v1 is not claimed
        (mnt / "filler").unlink()
        code, _, err = run_cli("apply", delta, "--into", recv)
        assert code == 0, err
        assert read_raw(recv) == read_raw(v1)
        assert not list((recv / ".dcr").glob(".*.tmp-*"))
    finally:
        subprocess.run(["umount", str(mnt)], check=True)
