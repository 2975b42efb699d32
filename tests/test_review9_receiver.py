"""review9: a shard renamed over by another writer (rsync, cp + mv) while ``dcr apply --into`` runs.

The applier writes and proves through the descriptors it opened. Before, a file renamed over during
the apply kept the other writer's bytes while the writes and the proof went to the old, unlinked
file: the target was recorded (exit 0, an ``--ack`` would follow), and a re-run said "already at
version". Now the apply refuses to record the target (state still ``applying``) and the re-run
finishes it bit-exactly: the untouched tensors hash to the base table, each item is classified by
its own digests, and the proof covers every touched tensor (receiver-checkpoint.md §2, §4.3).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from checkpoints import read_bits, tensor_from_bits, write_checkpoint
from conftest import run_dcr

import dcr_cli
from dcr_cli.errors import IntegrityError
from dcr_cli.receive.checkpoint import applier

SHARDS = 3


@pytest.fixture
def chain(tmp_path: Path) -> tuple[Path, Path, Path]:
    """(base, target, delta base -> target): sharded, every shard with changed and unchanged tensors."""
    rng = np.random.default_rng(9)
    base, new = {}, {}
    for i in range(9):
        bits = rng.integers(0, 1 << 16, 4000).astype(np.uint16)
        changed = bits.copy()
        if i % 3 != 2:  # tensors 2, 5, 8 stay as they are: untouched by the delta
            idx = rng.choice(len(bits), 200, replace=False)
            changed[idx] ^= rng.integers(1, 1 << 16, len(idx)).astype(np.uint16)
        base[f"t{i}"] = tensor_from_bits(bits, "BF16", (40, 100))
        new[f"t{i}"] = tensor_from_bits(changed, "BF16", (40, 100))
    a = write_checkpoint(tmp_path / "a", base, shards=SHARDS)
    b = write_checkpoint(tmp_path / "b", new, shards=SHARDS)
    run_dcr(
        "diff", str(a), str(b), "-o", str(tmp_path / "d"), "--base-version", "A", "--target-version", "B", check=True
    )
    return a, b, tmp_path / "d"


def _shard(root: Path) -> Path:
    return sorted(root.glob("model-*.safetensors"))[1]


def _rename_over(src: Path, dst: Path) -> None:
    """What rsync or cp + mv do: a new file, renamed over the old name (a new inode)."""
    tmp = dst.with_name(f".{dst.name}.other-writer")
    shutil.copyfile(src, tmp)
    os.replace(tmp, dst)


def _state(root: Path) -> dict:
    return json.loads((root / ".dcr" / "state.json").read_text())


def _replaced_during_the_writes(a: Path, delta: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy of ``a`` that ``delta`` is applied to while another writer renames a shard over (with the
    same base bytes) after every item was written through the old file; the apply must fail."""
    recv = tmp_path / "recv"
    shutil.copytree(a, recv)
    finish = applier._Proof.finish

    def other_writer_then_finish(self: applier._Proof, workers: int) -> dict[str, str]:
        _rename_over(a / _shard(recv).name, _shard(recv))
        return finish(self, workers)

    monkeypatch.setattr(applier._Proof, "finish", other_writer_then_finish)
    with pytest.raises(IntegrityError, match="was replaced by another writer while dcr apply wrote it"):
        dcr_cli.apply(delta, into=recv)
    monkeypatch.undo()
    return recv


def test_a_shard_renamed_over_during_the_writes_is_not_recorded_and_a_rerun_finishes(
    chain: tuple[Path, Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b, delta = chain
    recv = _replaced_during_the_writes(a, delta, tmp_path, monkeypatch)
    assert _state(recv)["applying"] is not None and _state(recv)["version"] is None  # nothing claimed
    proc = run_dcr("verify", str(recv))
    assert proc.returncode == 2 and "in the middle of a dcr apply" in proc.stderr

    proc = run_dcr("apply", str(delta), "--into", str(recv))  # the same command again
    assert proc.returncode == 0, proc.stderr
    assert "resumed A -> B" in proc.stdout
    assert read_bits(recv) == read_bits(b)
    assert run_dcr("verify", str(recv), "--against", str(delta)).returncode == 0


def test_a_shard_renamed_over_before_the_first_write_is_refused_and_nothing_is_written(
    chain: tuple[Path, Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b, delta = chain
    recv = tmp_path / "recv"
    shutil.copytree(a, recv)
    first_pass = applier.first_pass

    def other_writer_then_first_pass(*args: object, **kwargs: object) -> list[applier.Prepared]:
        out = first_pass(*args, **kwargs)  # type: ignore[arg-type]
        _rename_over(a / _shard(recv).name, _shard(recv))  # the same base bytes, a new file
        return out

    monkeypatch.setattr(applier, "first_pass", other_writer_then_first_pass)
    with pytest.raises(IntegrityError, match="was replaced by another writer before dcr apply wrote it"):
        dcr_cli.apply(delta, into=recv, workers=1)
    monkeypatch.undo()
    assert read_bits(recv) == read_bits(a)  # not a byte written
    assert dcr_cli.apply(delta, into=recv).version == "B"
    assert read_bits(recv) == read_bits(b)


def test_replaced_files_whose_untouched_tensors_moved_are_still_refused(
    chain: tuple[Path, Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The resume after a replacement needs every untouched tensor at its base digest; otherwise the
    version is established by hashing, and a checkpoint at neither end is refused, writing nothing."""
    a, _, delta = chain
    recv = _replaced_during_the_writes(a, delta, tmp_path, monkeypatch)
    # Now the other writer also changes t2, which no item touches (it is in the third shard).
    odd = {
        name: tensor_from_bits(np.frombuffer(raw, np.uint16).copy(), "BF16", (40, 100))
        for name, raw in read_bits(a).items()
    }
    odd["t2"] = tensor_from_bits(np.frombuffer(read_bits(a)["t2"], np.uint16) ^ np.uint16(1), "BF16", (40, 100))
    write_checkpoint(tmp_path / "odd", odd, shards=SHARDS)
    third = sorted(recv.glob("model-*.safetensors"))[2]
    _rename_over(tmp_path / "odd" / third.name, third)
    before = read_bits(recv)
    proc = run_dcr("apply", str(delta), "--into", str(recv))
    assert proc.returncode == 2 and "is not at the base of" in proc.stderr, proc.stderr
    assert read_bits(recv) == before


def test_a_file_of_another_version_renamed_over_an_interrupted_apply_is_not_written_over(
    chain: tuple[Path, Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The untouched tensors matching the base is not enough: a replaced file's touched tensors must hold the
    base's or the target's bits. Here another writer renames a shard of a third version (its untouched
    tensors, frozen layers, the same) over an apply that was interrupted before its first write. Before,
    the re-run resumed and wrote the delta's items over that file, then failed on every later run."""
    a, _, delta = chain
    recv = tmp_path / "recv"
    shutil.copytree(a, recv)

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt  # the apply is killed after it recorded "applying", before any write

    monkeypatch.setattr(applier, "write_items", interrupted)
    with pytest.raises(KeyboardInterrupt):
        dcr_cli.apply(delta, into=recv)
    monkeypatch.undo()
    assert _state(recv)["applying"] is not None

    third = {}
    for name, raw in read_bits(a).items():
        bits = np.frombuffer(raw, np.uint16).copy()
        if name not in ("t2", "t5", "t8"):  # the tensors the delta touches move elsewhere
            bits[::7] ^= np.uint16(3)
        third[name] = tensor_from_bits(bits, "BF16", (40, 100))
    write_checkpoint(tmp_path / "third", third, shards=SHARDS)
    _rename_over(tmp_path / "third" / _shard(recv).name, _shard(recv))
    before = read_bits(recv)
    proc = run_dcr("apply", str(delta), "--into", str(recv))
    assert proc.returncode == 2 and "is not at the base of" in proc.stderr, proc.stderr
    assert read_bits(recv) == before  # the other writer's file is as it left it
