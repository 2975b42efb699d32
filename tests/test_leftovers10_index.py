"""F10: a model.safetensors.index.json that disagrees with its shards about a stored tensor is refused, naming
the first tensor and file and what to do (regenerate the index); a consistent one, or none, is read as before,
and so is one that also names a tied weight no shard stores (what the Hub's safetensors converter writes)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from helpers_checkpoints import write_checkpoint

from dcr_cli.checkpoints.safetensors_dir import INDEX_NAME, SafetensorsCheckpoint
from dcr_cli.errors import FormatError


def _tensors(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {f"layer{i}.weight": ("BF16", (8, 4), rng.integers(0, 1 << 16, 32, dtype=np.uint16)) for i in range(4)}


def _edit_index(root: Path, edit) -> None:
    index = json.loads((root / INDEX_NAME).read_text())
    edit(index["weight_map"])
    (root / INDEX_NAME).write_text(json.dumps(index))


def _first_file(wm: dict) -> str:
    return sorted(set(wm.values()))[0]


CASES = {
    "misses a stored tensor": (lambda wm: wm.pop("layer3.weight"), "'layer3.weight'"),
    "puts a tensor in another file": (
        lambda wm: wm.__setitem__("layer0.weight", sorted(set(wm.values()))[1]),
        "'layer0.weight'",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_an_index_that_disagrees_with_its_shards_is_refused(tmp_path: Path, dcr, case: str) -> None:
    edit, named = CASES[case]
    a = write_checkpoint(tmp_path / "a", _tensors(0), shards=2)
    b = write_checkpoint(tmp_path / "b", _tensors(1), shards=2)
    _edit_index(b, edit)
    with pytest.raises(FormatError, match=re.escape(named)):
        SafetensorsCheckpoint(b)
    proc = dcr("diff", str(a), str(b), "-o", str(tmp_path / "d"))
    assert proc.returncode == 2, proc.stderr
    line = proc.stderr
    assert line.startswith("dcr: error: ") and line.count("\n") == 1
    assert named in line and ".safetensors" in line and "regenerate the index from the shards" in line
    assert not (tmp_path / "d").exists()
    (b / INDEX_NAME).unlink()  # the shards are read without it
    dcr("diff", str(a), str(b), "-o", str(tmp_path / "d"), check=True)


def test_an_index_that_also_names_a_tied_weight_no_shard_stores_is_read(tmp_path: Path, dcr) -> None:
    """safetensors' convert_multi drops tied duplicates from the shards but keeps them in the index."""
    a = write_checkpoint(tmp_path / "a", _tensors(0), shards=2)
    b = write_checkpoint(tmp_path / "b", _tensors(1), shards=2)
    for root in (a, b):
        _edit_index(root, lambda wm: wm.__setitem__("lm_head.weight", _first_file(wm)))
    with SafetensorsCheckpoint(b) as ckpt:
        assert sorted(ckpt.tensors) == sorted(_tensors(1))
    dcr("diff", str(a), str(b), "-o", str(tmp_path / "d"), check=True)
    dcr("apply", str(tmp_path / "d"), "--into", str(a), check=True)
    dcr("verify", str(a), "--against", str(tmp_path / "d"), check=True)


def test_a_consistent_index_is_read(tmp_path: Path) -> None:
    b = write_checkpoint(tmp_path / "b", _tensors(1), shards=3)
    with SafetensorsCheckpoint(b) as ckpt:
        wm = json.loads((b / INDEX_NAME).read_text())["weight_map"]
        assert {n: loc.file.name for n, loc in ckpt.tensors.items()} == wm
    with SafetensorsCheckpoint(b) as again:  # the index's parse kept for the next open gives the same
        assert set(again.tensors) == set(wm)


def test_an_index_checked_before_is_checked_again_once_it_changes(tmp_path: Path) -> None:
    """The check is skipped only for the very index and headers checked before in this process."""
    b = write_checkpoint(tmp_path / "b", _tensors(1), shards=2)
    SafetensorsCheckpoint(b).close()
    SafetensorsCheckpoint(b).close()
    _edit_index(b, lambda wm: wm.pop("layer1.weight"))
    with pytest.raises(FormatError, match=re.escape("'layer1.weight'")):
        SafetensorsCheckpoint(b)
