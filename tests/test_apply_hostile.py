"""dcr apply --into against hostile deltas and failures: fail closed, and prove every claim (issue 10).

* §1 manifests that pass every check but are wrong (re-signed: the tensor table still matches the
  target fingerprint, every block digest is right): exit non-zero and no version recorded.
* §2 hostile sections and frames in an item after the first: refused before the first write,
  the receiver byte-identical and not left "applying"; any delta with the same base -> target
  resumes an interrupted one.
* §5 a real full file system (a small tmpfs), with sparse files: one line, exit 2, re-run finishes.
* §6 a cancelled worker never masks the real error; a resume re-checks the files' identity.
* §9 verify quotes tensor names; verify --against takes a store URL.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zstandard
from click.testing import CliRunner
from helpers_checkpoints import copy_checkpoint, mutate, random_tensors, read_raw, snapshot, write_checkpoint
from manifest_text import manifest_v1

import dcr_cli
from dcr_cli.cli import main
from dcr_cli.delta.reader import Delta
from dcr_cli.format.codec import encode_positions, encode_values
from dcr_cli.format.digest import digest_bytes
from dcr_cli.produce import diff
from dcr_cli.receive.checkpoint import applier as apply_module
from dcr_cli.receive.checkpoint import inplace, read_state


def run_cli(*args: object) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.stdout, result.stderr


def state_bytes(recv: Path) -> bytes | None:
    path = recv / ".dcr" / "state.json"
    return path.read_bytes() if path.exists() else None


@pytest.fixture
def versions(tmp_path: Path) -> tuple[Path, Path, Path]:
    """(receiver at v0 with a recorded state, delta v0 -> v1 with several items, dense v1)."""
    rng = np.random.default_rng(17)
    t0 = random_tensors(
        rng,
        [("a", "BF16", (64, 32)), ("b", "F32", (40, 30)), ("c", "F16", (300,)), ("d", "U8", (50,)), ("e", "I32", (7,))],
    )
    t1 = mutate(rng, t0, 0.1, names=["a", "b", "c", "d"])
    write_checkpoint(tmp_path / "v0", t0, shards=2)
    write_checkpoint(tmp_path / "v1", t1, shards=2)
    diff(tmp_path / "v0", tmp_path / "v1", tmp_path / "delta", base_version="v0", target_version="v1", workers=1)
    recv = copy_checkpoint(tmp_path / "v0", tmp_path / "recv")
    # A receiver that dcr knows to be at v0 (recorded state and table), as the RL loop leaves it:
    # the reverse delta finds it already at its target, and records that.
    diff(tmp_path / "v1", tmp_path / "v0", tmp_path / "back", base_version="v1", target_version="v0", workers=1)
    assert dcr_cli.apply(tmp_path / "back", into=recv).noop
    state = read_state(recv)
    assert state is not None and state.version == "v0" and (recv / ".dcr" / "table.json").exists()
    return recv, tmp_path / "delta", tmp_path / "v1"


def forged(delta: Path, out: Path, edit: Callable[[dict, Path], None]) -> Path:
    """A copy of ``delta`` whose manifest ``edit`` changed (blocks shared; new blocks go into out/blocks)."""
    (out / "blocks").mkdir(parents=True)
    for block in (delta / "blocks").iterdir():
        (out / "blocks" / block.name).write_bytes(block.read_bytes())
    manifest = manifest_v1(delta, rewrite=False)
    edit(manifest, out)
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out


def add_block(manifest: dict, out: Path, data: bytes, role: str = "data") -> int:
    block_id = digest_bytes(data)
    (out / "blocks" / block_id).write_bytes(data)
    manifest["blocks"].append({"id": block_id, "size": len(data), "role": role})
    return len(manifest["blocks"]) - 1


def set_data(manifest: dict, out: Path, k: int, data: bytes, positions_length: int) -> None:
    """Point item k's data at ``data`` in a new block, with a correct section digest (a re-signed delta)."""
    block = add_block(manifest, out, data)
    manifest["items"][k]["data"] = {
        "block": block,
        "offset": 0,
        "length": len(data),
        "positions_length": positions_length,
        "digest": digest_bytes(data),
    }


def expect_refused_untouched(recv: Path, delta: Path, words: str = "") -> str:
    before, state_before = snapshot(recv), state_bytes(recv)
    code, out, err = run_cli("apply", delta, "--into", recv)
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dcr: error: "), err
    assert words in lines[0], lines[0]
    assert snapshot(recv) == before  # byte-identical
    assert state_bytes(recv) == state_before  # and not left "applying"
    return lines[0]


def expect_not_recorded(recv: Path, delta: Path, honest: Path, v1: Path, words: str = "") -> None:
    """Refused, with no version recorded or acknowledged; the honest delta then finishes the job."""
    code, out, err = run_cli("apply", delta, "--into", recv)
    assert code == 2, (out, err)
    assert len(err.strip().splitlines()) == 1 and words in err, err
    state = read_state(recv)
    assert state is None or state.version != "v1"
    code, _, err = run_cli("apply", honest, "--into", recv)
    assert code == 0, err
    assert read_raw(recv) == read_raw(v1)


def last_item_of(manifest: dict, tensor: str | None = None) -> int:
    ks = [k for k, it in enumerate(manifest["items"]) if tensor is None or it["tensor"] == tensor]
    return ks[-1]


# --------------------------------------------------------------------------- §1 wrong but valid manifests


def test_dropped_item_of_an_otherwise_untouched_tensor_is_refused_before_any_write(
    versions: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    recv, delta, v1 = versions

    def drop(m: dict, _: Path) -> None:
        k = last_item_of(m, "d")
        assert sum(it["tensor"] == "d" for it in m["items"]) == 1
        del m["items"][k]

    bad = forged(delta, tmp_path / "dropped", drop)
    expect_refused_untouched(recv, bad, words="no item changes it")
    assert run_cli("apply", delta, "--into", recv)[0] == 0 and read_raw(recv) == read_raw(v1)


def test_dropped_item_of_a_touched_tensor_is_never_recorded(versions: tuple[Path, Path, Path], tmp_path: Path) -> None:
    recv, delta, v1 = versions

    def drop(m: dict, _: Path) -> None:
        ks = [k for k, it in enumerate(m["items"]) if it["tensor"] == "a"]
        assert len(ks) == 2  # "a" keeps one of its two items
        del m["items"][ks[-1]]

    bad = forged(delta, tmp_path / "dropped", _split_first_item_then(drop))
    expect_not_recorded(recv, bad, delta, v1, words="do not hold the target")


def _split_first_item_then(edit: Callable[[dict, Path], None]) -> Callable[[dict, Path], None]:
    """Re-encode tensor "a"'s one item as two range items (a valid, re-signed delta), then ``edit``."""

    def run(m: dict, out: Path) -> None:
        k = next(k for k, it in enumerate(m["items"]) if it["tensor"] == "a")
        item = m["items"][k]
        d = Delta.open(out.parent / "delta") if (out.parent / "delta").exists() else None
        assert d is not None
        parsed = d.manifest.items[k]
        decoded = d.decode(parsed)
        assert decoded.positions is not None and parsed.op == "xor" and len(decoded.positions) >= 2
        half = len(decoded.positions) // 2
        region_size = item["region"]["stop"] - item["region"]["start"]
        cut = int(decoded.positions[half])  # region-local position where the second item starts
        repair = d.repair_values(parsed)
        base = Path(out.parent / "v0")
        from dcr_cli.checkpoints.safetensors_dir import SafetensorsCheckpoint

        with SafetensorsCheckpoint(base) as ckpt:
            before = np.array(ckpt.view("a"))
        start = item["region"]["start"]
        items = []
        for lo, hi, offset in ((0, half, 0), (half, len(decoded.positions), cut)):
            pos = decoded.positions[lo:hi] - offset
            values, target = decoded.values[lo:hi], repair[lo:hi]
            pf, vf, rf = encode_positions(pos), encode_values(values), encode_values(target)
            data_block = add_block(m, out, pf + vf)
            repair_block = add_block(m, out, rf, role="repair")
            stop = start + (cut if lo == 0 else region_size)
            items.append(
                {
                    **item,
                    "region": {"start": start + offset, "stop": stop},
                    "count": int(hi - lo),
                    "data": {
                        "block": data_block,
                        "offset": 0,
                        "length": len(pf + vf),
                        "positions_length": len(pf),
                        "digest": digest_bytes(pf + vf),
                    },
                    "repair": {"block": repair_block, "offset": 0, "length": len(rf), "digest": digest_bytes(rf)},
                    "pre": digest_bytes(before[start + offset + pos]),
                    "post": digest_bytes(target),
                }
            )
        m["items"][k : k + 1] = items
        edit(m, out)

    return run


def test_duplicated_items_key_is_refused_and_never_recorded(versions: tuple[Path, Path, Path], tmp_path: Path) -> None:
    recv, delta, v1 = versions
    m = manifest_v1(delta, rewrite=False)
    fewer = [it for it in m["items"] if it["tensor"] != "d"]
    raw = json.dumps(m)
    assert raw.endswith("]}")
    # "items" twice: a lenient reader takes the last (one item short); strict JSON refuses it.
    raw = raw[:-1] + ', "items": ' + json.dumps(fewer) + "}"
    bad = forged(delta, tmp_path / "dup", lambda _m, _o: None)
    (bad / "manifest.json").write_text(raw)
    expect_refused_untouched(recv, bad)
    assert run_cli("apply", delta, "--into", recv)[0] == 0 and read_raw(recv) == read_raw(v1)


def test_swapped_pre_and_post_is_refused_before_any_write(versions: tuple[Path, Path, Path], tmp_path: Path) -> None:
    recv, delta, v1 = versions

    def swap(m: dict, _: Path) -> None:
        it = m["items"][last_item_of(m)]
        it["pre"], it["post"] = it["post"], it["pre"]

    bad = forged(delta, tmp_path / "swapped", swap)
    expect_refused_untouched(recv, bad, words="pre-image")
    assert run_cli("apply", delta, "--into", recv)[0] == 0 and read_raw(recv) == read_raw(v1)


def _shift(m: dict, _: Path) -> None:
    """Shift tensor "c"'s item by one element (its region made one shorter first, so it stays inside)."""
    k = last_item_of(m, "c")
    region = m["items"][k]["region"]
    assert region == {"start": 0, "stop": 300}
    region["start"], region["stop"] = 1, 300  # positions must stay < region size: drop the last element's room
    m["items"][k]["region"] = region


def test_region_shifted_by_one_is_refused_before_any_write(versions: tuple[Path, Path, Path], tmp_path: Path) -> None:
    recv, delta, v1 = versions
    d = Delta.open(delta)
    k = last_item_of(manifest_v1(delta, rewrite=False), "c")
    positions = d.decode(d.manifest.items[k]).positions
    assert positions is not None
    if positions[-1] >= 299:
        pytest.skip("the last element changed: a one-element shift would leave the region")
    bad = forged(delta, tmp_path / "shifted", _shift)
    expect_refused_untouched(recv, bad, words="pre-image")
    assert run_cli("apply", delta, "--into", recv)[0] == 0 and read_raw(recv) == read_raw(v1)


def test_region_shifted_by_one_while_resuming_is_never_recorded(
    versions: tuple[Path, Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Resuming, a shifted item is "torn" and its repair lands at the wrong place: the proof refuses it.

    Its repair wrote target values over elements no item covers, so no delta can prove the target
    afterwards: the honest one is refused too (never recorded), and verify names the tensor.
    """
    recv, delta, _ = versions
    d = Delta.open(delta)
    k = last_item_of(manifest_v1(delta, rewrite=False), "c")
    positions = d.decode(d.manifest.items[k]).positions
    assert positions is not None
    if positions[-1] >= 299:
        pytest.skip("the last element changed: a one-element shift would leave the region")
    fail_writes_after(monkeypatch, 0)
    with pytest.raises(OSError):
        dcr_cli.apply(delta, into=recv, workers=1)
    monkeypatch.undo()
    bad = forged(delta, tmp_path / "shifted", _shift)
    for attempt in (bad, delta):
        code, _, err = run_cli("apply", attempt, "--into", recv)
        assert code == 2 and len(err.strip().splitlines()) == 1 and "do not hold the target" in err, err
        state = read_state(recv)
        assert state is not None and state.version is None and state.applying is not None  # nothing claimed
    report = dcr_cli.verify(recv, against=delta)
    assert not report.ok and report.mismatched == ["c"]


def test_acknowledgement_only_after_the_proof(versions: tuple[Path, Path, Path], tmp_path: Path) -> None:
    recv, delta, v1 = versions
    store = tmp_path / "store"
    dcr_cli.push(delta, str(store))

    def drop(m: dict, _: Path) -> None:
        del m["items"][last_item_of(m, "d")]

    bad = forged(delta, tmp_path / "dropped", drop)
    code, _, err = run_cli("apply", bad, "--into", recv, "--ack", store, "--receiver", "east")
    assert code == 2, err
    assert acked(store, "v1") == []
    code, _, err = run_cli("apply", delta, "--into", recv, "--ack", store, "--receiver", "east")
    assert code == 0, err
    assert read_raw(recv) == read_raw(v1)
    assert acked(store, "v1") == ["east"]


def acked(store: Path, version: str) -> list[str]:
    return [name for info in dcr_cli.log(str(store)) if info.version == version for name in info.acked]


# --------------------------------------------------------------------------- §2 every check before the first write


def _frames(d: Delta, k: int) -> tuple[np.ndarray, np.ndarray, int]:
    item = d.manifest.items[k]
    decoded = d.decode(item)
    assert decoded.positions is not None
    return decoded.positions, decoded.values, item.region.size


def _raw_frame(data: bytes, **params: bool) -> bytes:
    return zstandard.ZstdCompressor(
        write_checksum=params.get("checksum", True), write_content_size=params.get("content_size", True)
    ).compress(data)


def _planes(values: np.ndarray) -> bytes:
    w = values.dtype.itemsize
    return np.ascontiguousarray(values.view(np.uint8).reshape(-1, w).T).tobytes()


def _hostile(kind: str) -> Callable[[dict, Path], None]:
    def edit(m: dict, out: Path) -> None:
        d = Delta.open(out.parent / "delta")
        k = max(k for k, it in enumerate(d.manifest.items) if it.op == "xor")
        assert k > 0
        item = m["items"][k]
        section = item["data"]
        positions, values, region_size = _frames(d, k)
        gaps = np.diff(np.concatenate(([-1], positions))) - 1
        pf, vf = encode_positions(positions), encode_values(values)
        if kind == "section digest":
            section["digest"] = digest_bytes(b"something else")
        elif kind in ("offset", "length"):
            block = (out / "blocks" / m["blocks"][section["block"]]["id"]).read_bytes()
            if kind == "offset":
                section["offset"] += 1
            else:
                section["length"] -= 1
            span = block[section["offset"] : section["offset"] + section["length"]]
            section["digest"] = digest_bytes(span)
        elif kind == "count":
            item["count"] += 1
            assert item["count"] <= region_size
        elif kind == "positions_length":
            section["positions_length"] += 1
        elif kind == "op":
            item["op"] = "overwrite"
        elif kind == "no checksum":
            raw = _raw_frame(bytes(np.minimum(gaps, 255).astype(np.uint8)), checksum=False)
            set_data(m, out, k, raw + vf, len(raw))
        elif kind == "no content size":
            raw = _raw_frame(bytes(np.minimum(gaps, 255).astype(np.uint8)), content_size=False)
            set_data(m, out, k, raw + vf, len(raw))
        elif kind == "trailing bytes":
            set_data(m, out, k, pf + b"\0\0\0" + vf, len(pf) + 3)
        elif kind == "skippable frame":
            skippable = (0x184D2A50).to_bytes(4, "little") + (4).to_bytes(4, "little") + b"dcr!"
            set_data(m, out, k, pf + skippable + vf, len(pf) + len(skippable))
        elif kind == "wrong decoded length":
            short = _raw_frame(_planes(values[:-1]))
            set_data(m, out, k, pf + short, len(pf))
        elif kind == "too many escapes":
            raw = _raw_frame(bytes([255] * len(positions)))
            set_data(m, out, k, raw + vf, len(raw))
        elif kind == "positions out of range":
            wide = gaps.copy()
            wide[-1] += region_size
            set_data(m, out, k, encode_positions_from_gaps(wide) + vf, len(encode_positions_from_gaps(wide)))
        else:
            raise AssertionError(kind)

    return edit


def encode_positions_from_gaps(gaps: np.ndarray) -> bytes:
    positions = np.cumsum(gaps.astype(np.int64) + 1) - 1
    return encode_positions(positions)


HOSTILE = [
    "section digest",
    "offset",
    "length",
    "count",
    "positions_length",
    "op",
    "no checksum",
    "no content size",
    "trailing bytes",
    "skippable frame",
    "wrong decoded length",
    "too many escapes",
    "positions out of range",
]


@pytest.mark.parametrize("kind", HOSTILE)
def test_hostile_section_in_a_later_item_is_refused_before_any_write(
    versions: tuple[Path, Path, Path], tmp_path: Path, kind: str
) -> None:
    recv, delta, v1 = versions
    bad = forged(delta, tmp_path / "hostile", _hostile(kind))
    expect_refused_untouched(recv, bad)
    # Not stuck: the honest delta for the same base and target goes through.
    assert run_cli("apply", delta, "--into", recv)[0] == 0
    assert read_raw(recv) == read_raw(v1)


def fail_writes_after(monkeypatch: pytest.MonkeyPatch, good: int, code: int = errno.EIO) -> None:
    real = inplace._write_values
    calls = {"n": 0}

    def write(fd: int, offset: int, data: memoryview) -> None:
        calls["n"] += 1
        if calls["n"] > good:
            real(fd, offset, data[: len(data) // 2])
            raise OSError(code, os.strerror(code))
        real(fd, offset, data)

    monkeypatch.setattr(inplace, "_write_values", write)


def test_any_delta_with_the_same_base_and_target_resumes(
    versions: tuple[Path, Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    recv, delta, v1 = versions
    other = tmp_path / "other"  # the same step, encoded otherwise: another manifest, another id
    diff(tmp_path / "v0", v1, other, base_version="v0", target_version="v1", overwrite=["*"], workers=1)
    assert Delta.open(other).id != Delta.open(delta).id
    fail_writes_after(monkeypatch, 2)
    with pytest.raises(OSError):
        dcr_cli.apply(delta, into=recv, workers=1)
    monkeypatch.undo()
    state = read_state(recv)
    assert state is not None and state.applying is not None
    result = dcr_cli.apply(other, into=recv)
    assert result.steps[0].status == "resumed" and result.steps[0].done >= 1  # which ones: the writes' order
    assert read_raw(recv) == read_raw(v1)
    assert snapshot(recv) == snapshot(v1)


# --------------------------------------------------------------------------- §5 a real full file system


@contextlib.contextmanager
def small_tmpfs(where: Path, size: str) -> Any:
    where.mkdir()
    if os.geteuid() != 0 and not os.environ.get("CI"):
        pytest.skip("needs root to mount a small tmpfs (CI runs as root and never skips this)")
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], check=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True)


def fill(path: Path) -> None:
    with open(path, "wb", buffering=0) as f, contextlib.suppress(OSError):
        while True:
            f.write(b"\0" * 4096)


def test_full_tmpfs_with_sparse_files_is_one_line_then_rerun_finishes(tmp_path: Path) -> None:
    """The receiver's files are sparse (holes where weights are zero): writing into a hole needs space."""
    rng = np.random.default_rng(23)
    t0 = random_tensors(rng, [("w", "U16", (64 * 1024,)), ("b", "F32", (100,))])
    dt, shape, values = t0["w"]
    t0["w"] = (dt, shape, np.zeros_like(values))  # 128 KiB of zeros: holes in a sparse copy
    t1 = mutate(rng, t0, 0.2)
    write_checkpoint(tmp_path / "v0", t0)
    write_checkpoint(tmp_path / "v1", t1)
    diff(tmp_path / "v0", tmp_path / "v1", tmp_path / "delta", base_version="v0", target_version="v1")
    with small_tmpfs(tmp_path / "tiny", "1m") as mnt:
        recv = mnt / "recv"
        recv.mkdir()
        for f in (tmp_path / "v0").iterdir():
            subprocess.run(["cp", "--sparse=always", str(f), str(recv / f.name)], check=True)
        assert any(os.stat(f).st_blocks * 512 < os.stat(f).st_size for f in recv.iterdir()), "no holes"
        (recv / ".dcr").mkdir()  # so that the state can be written: the data is what needs space
        fill(mnt / "filler")
        code, out, err = run_cli("apply", tmp_path / "delta", "--into", recv)
        assert code == 2, (out, err)
        assert len(err.strip().splitlines()) == 1 and "re-run the same dcr apply" in err, err
        state = read_state(recv)
        assert state is None or state.version != "v1"  # v1 is not claimed
        (mnt / "filler").unlink()
        code, _, err = run_cli("apply", tmp_path / "delta", "--into", recv)
        assert code == 0, err
        assert read_raw(recv) == read_raw(tmp_path / "v1")


# --------------------------------------------------------------------------- §6 races


def test_a_cancelled_item_never_masks_the_real_error(
    versions: tuple[Path, Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Item 0 is still preparing when item 1's write fails with ENOSPC: item 0 is cancelled, ENOSPC is reported."""
    recv, delta, v1 = versions
    monkeypatch.setattr(apply_module, "streams", lambda *_a, **_k: False)  # the checked-first path (test_apply_stream)
    monkeypatch.setattr(apply_module, "PREPARED_BYTES", 0)  # every item is prepared again in the write pass
    monkeypatch.setattr(apply_module, "BATCH_ITEMS", 1)  # items 0 and 1 in tasks of their own, on two workers
    failed = threading.Event()
    real_prepare, real_write = apply_module.prepare_item, inplace._write_values
    first = Delta.open(delta).manifest.items[0]

    seen = {"first": 0}

    def prepare(d: Delta, item, files, resuming):  # type: ignore[no-untyped-def]
        out = real_prepare(d, item, files, resuming)
        if item == first:
            seen["first"] += 1
            if seen["first"] == 2:  # the write pass (the first pass prepared it once already)
                assert failed.wait(30)  # until the other worker's write has failed
        return out

    def write(fd: int, offset: int, data: memoryview) -> None:
        failed.set()
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    calls = {"n": 0}

    def write_once_then_fail(fd: int, offset: int, data: memoryview) -> None:
        calls["n"] += 1
        write(fd, offset, data)

    monkeypatch.setattr(apply_module, "prepare_item", prepare)
    monkeypatch.setattr(inplace, "_write_values", write_once_then_fail)
    with pytest.raises(OSError) as info:
        dcr_cli.apply(delta, into=recv, workers=2)
    assert info.value.errno == errno.ENOSPC
    assert seen["first"] == 2
    monkeypatch.undo()
    assert real_write is inplace._write_values
    assert run_cli("apply", delta, "--into", recv)[0] == 0
    assert read_raw(recv) == read_raw(v1)


def test_resume_rechecks_file_identity(
    versions: tuple[Path, Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Files replaced after an interrupted apply are re-hashed, not trusted to be between base and target."""
    recv, delta, _ = versions
    fail_writes_after(monkeypatch, 1)
    with pytest.raises(OSError):
        dcr_cli.apply(delta, into=recv, workers=1)
    monkeypatch.undo()
    # Someone replaces the files with another model of the same layout (tensor "e" differs: no item touches it).
    rng = np.random.default_rng(5)
    other = {n: v for n, v in _tensors(tmp_path / "v0").items()}
    dt, shape, values = other["e"]
    other["e"] = (dt, shape, values ^ rng.integers(1, 100, size=values.size).astype(values.dtype))
    for f in recv.glob("*.safetensors"):
        f.unlink()
    (recv / "model.safetensors.index.json").unlink()
    write_checkpoint(recv, other, shards=2)
    before = snapshot(recv)
    code, _, err = run_cli("apply", delta, "--into", recv)
    assert code == 2 and "not at the base" in err, err
    assert snapshot(recv) == before


def _tensors(root: Path) -> dict:
    from dcr_cli.checkpoints.safetensors_dir import SafetensorsCheckpoint

    with SafetensorsCheckpoint(root) as ckpt:
        return {n: (loc.dtype, loc.shape, np.array(ckpt.view(n))) for n, loc in ckpt.tensors.items()}


# --------------------------------------------------------------------------- §9 verify


def test_verify_quotes_tensor_names(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    evil = "layer\n\x1b[31mred\x1b[0m"
    t0 = random_tensors(rng, [(evil, "U8", (16,)), ("ok", "U8", (4,))])
    write_checkpoint(tmp_path / "v0", t0)
    t1 = mutate(rng, t0, 0.5)
    write_checkpoint(tmp_path / "v1", t1)
    diff(tmp_path / "v0", tmp_path / "v1", tmp_path / "delta")
    code, _, err = run_cli("verify", tmp_path / "v0", "--against", tmp_path / "delta")
    assert code == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dcr: error: "), err
    assert "\x1b" not in err and repr(evil) in lines[0]


def test_verify_against_a_store_url(versions: tuple[Path, Path, Path], tmp_path: Path) -> None:
    recv, delta, v1 = versions
    store = tmp_path / "store"
    dcr_cli.push(delta, str(store))
    code, out, err = run_cli("verify", v1, "--against", store)
    assert code == 0 and "ok" in out, err
    code, out, err = run_cli("verify", v1, "--against", store, "--version", "v1", "--json")
    assert code == 0 and json.loads(out)["expected_version"] == "v1", err
    code, out, err = run_cli("verify", recv, "--against", store)  # recv holds v0
    assert code == 1 and "MISMATCH" in err
    assert dcr_cli.verify(v1, against=str(store)).ok
