"""`dcr diff` and `dcr inspect` on real safetensors checkpoints, through the real command line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from checkpoints import apply_in_memory, read_bits, tensor_from_bits, write_checkpoint
from manifest_text import manifest_v1

from dcr_cli.delta.reader import Delta
from dcr_cli.errors import IntegrityError
from dcr_cli.format.dtypes import SUPPORTED
from dcr_cli.format.dtypes import dtype as lookup_dtype
from dcr_cli.format.manifest import MANIFEST_NAME


def model_pair(seed: int = 0) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Every dtype, plus empty and scalar tensors, NaN payloads and ±0, with a sparse change."""
    rng = np.random.default_rng(seed)
    base: dict[str, torch.Tensor] = {}
    new: dict[str, torch.Tensor] = {}
    for name in SUPPORTED:
        dt = lookup_dtype(name)
        shape = (37, 23)
        bits = rng.integers(0, np.iinfo(dt.uint).max, size=37 * 23, dtype=dt.uint, endpoint=True)
        changed = bits.copy()
        idx = rng.choice(len(bits), size=25, replace=False)
        changed[idx] ^= rng.integers(1, 4, size=25, dtype=dt.uint)
        base[f"layers.{name}.weight"] = tensor_from_bits(bits, name, shape)
        new[f"layers.{name}.weight"] = tensor_from_bits(changed, name, shape)
    # -0.0 -> +0.0 and one NaN payload -> another: equal or unordered as floats, different as bits.
    base["signs"] = tensor_from_bits(np.array([0x8000, 0x7FC1, 0x3F80], dtype="<u2"), "BF16", (3,))
    new["signs"] = tensor_from_bits(np.array([0x0000, 0x7FC2, 0x3F80], dtype="<u2"), "BF16", (3,))
    base["scalar"] = torch.tensor(1.5, dtype=torch.float32)
    new["scalar"] = torch.tensor(-0.0, dtype=torch.float32)
    base["empty"] = torch.zeros(0, 8, dtype=torch.bfloat16)
    new["empty"] = torch.zeros(0, 8, dtype=torch.bfloat16)
    base["unchanged"] = torch.ones(64, dtype=torch.bfloat16)
    new["unchanged"] = torch.ones(64, dtype=torch.bfloat16)
    return base, new


@pytest.mark.parametrize("shards", [1, 3])
def test_diff_round_trips_every_dtype(tmp_path: Path, dcr, shards: int):
    base, new = model_pair()
    a = write_checkpoint(tmp_path / "a", base, shards=shards)
    b = write_checkpoint(tmp_path / "b", new, shards=shards)
    proc = dcr("diff", str(a), str(b), "-o", str(tmp_path / "d"), "--json", check=True)
    summary = json.loads(proc.stdout)
    assert summary["changed_elements"] == 25 * len(SUPPORTED) + 2 + 1

    result = apply_in_memory(tmp_path / "d", read_bits(a))
    assert result == read_bits(b)

    report = json.loads(dcr("inspect", str(tmp_path / "d"), "--json", check=True).stdout)
    for key in ("total_elements", "changed_elements", "payload_bytes", "full_bytes", "tensors"):
        assert key in report
    rows = {r["tensor"]: r for r in report["tensors"]}
    assert rows["signs"]["changed_elements"] == 2
    assert rows["scalar"]["changed_elements"] == 1
    assert "unchanged" not in rows and "empty" not in rows  # only changed tensors unless --all
    assert report["changed_elements"] == summary["changed_elements"]

    manifest = Delta.open(tmp_path / "d").manifest
    assert set(manifest.tensors) == set(new)  # the full target table, unchanged tensors included
    human = dcr("inspect", str(tmp_path / "d"), check=True).stdout
    assert "signs" in human and "total:" in human


def test_identical_checkpoints_give_an_empty_delta(tmp_path: Path, dcr):
    base, _ = model_pair()
    a = write_checkpoint(tmp_path / "a", base)
    b = write_checkpoint(tmp_path / "b", base)
    summary = json.loads(dcr("diff", str(a), str(b), "-o", str(tmp_path / "d"), "--json", check=True).stdout)
    assert summary["changed_elements"] == 0 and summary["payload_bytes"] == 0
    assert summary["base_version"] == summary["target_version"]


def test_version_labels_and_overwrite_op(tmp_path: Path, dcr):
    base, new = model_pair()
    a = write_checkpoint(tmp_path / "a", base)
    b = write_checkpoint(tmp_path / "b", new)
    dcr(
        "diff",
        str(a),
        str(b),
        "-o",
        str(tmp_path / "d"),
        "--base-version",
        "step-1",
        "--target-version",
        "step-2",
        "--overwrite",
        "layers.BF16.*",
        "--workers",
        "1",
        check=True,
    )
    manifest = Delta.open(tmp_path / "d").manifest
    assert (manifest.base.version, manifest.target.version) == ("step-1", "step-2")
    ops = {it.tensor: it.op for it in manifest.items}
    assert ops["layers.BF16.weight"] == "overwrite" and ops["layers.F16.weight"] == "xor"
    assert apply_in_memory(tmp_path / "d", read_bits(a)) == read_bits(b)


def test_layout_mismatch_is_refused_and_writes_nothing(tmp_path: Path, dcr):
    base, new = model_pair()
    new["layers.BF16.weight"] = new["layers.BF16.weight"].reshape(23, 37)
    a = write_checkpoint(tmp_path / "a", base)
    b = write_checkpoint(tmp_path / "b", new)
    proc = dcr("diff", str(a), str(b), "-o", str(tmp_path / "d"))
    assert proc.returncode == 2
    assert "layers.BF16.weight" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "d").exists()
    assert not any(p.name.startswith(".d.partial") for p in tmp_path.iterdir())


def test_missing_tensor_is_refused(tmp_path: Path, dcr):
    base, new = model_pair()
    del new["scalar"]
    proc = dcr(
        "diff",
        str(write_checkpoint(tmp_path / "a", base)),
        str(write_checkpoint(tmp_path / "b", new)),
        "-o",
        str(tmp_path / "d"),
    )
    assert proc.returncode == 2 and "scalar" in proc.stderr


@pytest.fixture
def delta(tmp_path: Path, dcr) -> Path:
    base, new = model_pair()
    a = write_checkpoint(tmp_path / "a", base)
    b = write_checkpoint(tmp_path / "b", new)
    dcr("diff", str(a), str(b), "-o", str(tmp_path / "d"), check=True)
    return tmp_path / "d"


def _assert_one_line_error(proc, code: int = 2) -> None:
    assert proc.returncode == code, proc.stderr
    assert proc.stderr.startswith("dcr: error: ")
    assert len(proc.stderr.strip().splitlines()) == 1
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("cut", [0, 1, 100, -10])
def test_truncated_manifest(delta: Path, dcr, cut: int):
    path = delta / MANIFEST_NAME
    raw = path.read_bytes()
    path.write_bytes(raw[:cut])
    _assert_one_line_error(dcr("inspect", str(delta)))


def test_missing_delta(tmp_path: Path, dcr):
    _assert_one_line_error(dcr("inspect", str(tmp_path / "nowhere")))


def test_unknown_major_version_is_refused(delta: Path, dcr):
    obj = manifest_v1(delta)
    obj["format_version"] = [2, 0]
    (delta / MANIFEST_NAME).write_text(json.dumps(obj))
    proc = dcr("inspect", str(delta))
    _assert_one_line_error(proc)
    assert "major version 2" in proc.stderr


def test_unknown_optional_fields_are_ignored(delta: Path, dcr):
    obj = manifest_v1(delta)
    obj["format_version"] = [1, 7]
    obj["future_field"] = {"x": 1}
    obj["items"][0]["future_item_field"] = [1, 2]
    obj["tensors"][next(iter(obj["tensors"]))]["future"] = True
    (delta / MANIFEST_NAME).write_text(json.dumps(obj))
    assert dcr("inspect", str(delta)).returncode == 0


def test_unknown_op_is_refused(delta: Path, dcr):
    obj = manifest_v1(delta)
    obj["items"][0]["op"] = "add"
    (delta / MANIFEST_NAME).write_text(json.dumps(obj))
    _assert_one_line_error(dcr("inspect", str(delta)))


def test_overlapping_items_are_refused(delta: Path, dcr):
    obj = manifest_v1(delta)
    obj["items"].append(obj["items"][0])
    (delta / MANIFEST_NAME).write_text(json.dumps(obj))
    proc = dcr("inspect", str(delta))
    _assert_one_line_error(proc)
    assert "overlap" in proc.stderr


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_damaged_block_is_detected(delta: Path, damage: str):
    d = Delta.open(delta)
    block = delta / d.manifest.blocks[0].path
    raw = bytearray(block.read_bytes())
    if damage == "flip":
        raw[len(raw) // 2] ^= 0x01
        block.write_bytes(bytes(raw))
    elif damage == "truncate":
        block.write_bytes(bytes(raw[: len(raw) // 2]))
    else:
        block.unlink()
    with pytest.raises(IntegrityError):
        d.verify_blocks()
    with pytest.raises(IntegrityError):
        for item in d.manifest.items:
            d.decode(item)


def test_tampered_section_digest_is_detected(delta: Path):
    obj = manifest_v1(delta)
    obj["items"][0]["data"]["digest"] = "0" * 64
    (delta / MANIFEST_NAME).write_text(json.dumps(obj))
    d = Delta.open(delta)
    with pytest.raises(IntegrityError, match="digest mismatch"):
        d.decode(d.manifest.items[0])


def test_large_tensor_is_split_into_items_and_round_trips(tmp_path: Path, dcr, monkeypatch):
    rng = np.random.default_rng(1)
    bits = rng.integers(0, 2**16 - 1, size=3 * (1 << 20), dtype=np.uint16)
    changed = bits.copy()
    idx = rng.choice(len(bits), size=50_000, replace=False)
    changed[idx] ^= 1
    a = write_checkpoint(tmp_path / "a", {"big": tensor_from_bits(bits, "BF16", (3 << 10, 1 << 10))})
    b = write_checkpoint(tmp_path / "b", {"big": tensor_from_bits(changed, "BF16", (3 << 10, 1 << 10))})
    import dcr_cli.produce.plan as plan_module
    from dcr_cli.produce import diff

    monkeypatch.setattr(plan_module, "CHUNK_BYTES", 1 << 20)
    summary = diff(a, b, tmp_path / "d", workers=2)
    manifest = Delta.open(tmp_path / "d").manifest
    assert len(manifest.items) == 6 and summary.changed_elements == 50_000
    assert apply_in_memory(tmp_path / "d", read_bits(a)) == read_bits(b)


def test_same_inputs_give_the_same_blocks(tmp_path: Path):
    from dcr_cli.produce import diff

    base, new = model_pair()
    a = write_checkpoint(tmp_path / "a", base)
    b = write_checkpoint(tmp_path / "b", new)
    diff(a, b, tmp_path / "d1", workers=1)
    diff(a, b, tmp_path / "d2", workers=2)
    assert [x.id for x in Delta.open(tmp_path / "d1").manifest.blocks] == [
        x.id for x in Delta.open(tmp_path / "d2").manifest.blocks
    ]
