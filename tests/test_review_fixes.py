"""Regression tests for defects found in review: each fails on the code before its fix."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from dcr_cli.errors import FormatError
from dcr_cli.sources.safetensors_dir import SafetensorsCheckpoint


def _raw_safetensors(path: Path, header: object, data: bytes = b"") -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


@pytest.mark.parametrize("weight_map", [5, ["a.safetensors"], {"w": 5}, {"w": None}])
def test_index_with_ill_typed_weight_map_is_a_format_error(tmp_path: Path, weight_map: object) -> None:
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(FormatError, match="weight_map"):
        SafetensorsCheckpoint(tmp_path)


@pytest.mark.parametrize("header", [[1, 2], "text", 7])
def test_safetensors_header_that_is_not_an_object_is_a_format_error(tmp_path: Path, header: object) -> None:
    _raw_safetensors(tmp_path / "model.safetensors", header)
    with pytest.raises(FormatError, match="not a JSON object"):
        SafetensorsCheckpoint(tmp_path)


def test_safetensors_tensors_sharing_bytes_are_refused(tmp_path: Path) -> None:
    # An in-place apply to one tensor would silently change the other.
    header = {
        "a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
        "b": {"dtype": "U8", "shape": [4], "data_offsets": [2, 6]},
    }
    _raw_safetensors(tmp_path / "model.safetensors", header, bytes(range(8)))
    with pytest.raises(FormatError, match="overlap"):
        SafetensorsCheckpoint(tmp_path)


def test_safetensors_negative_shape_is_refused(tmp_path: Path) -> None:
    header = {"a": {"dtype": "U8", "shape": [-2, -2], "data_offsets": [0, 4]}}
    _raw_safetensors(tmp_path / "model.safetensors", header, bytes(4))
    with pytest.raises(FormatError, match="inconsistent"):
        SafetensorsCheckpoint(tmp_path)


def test_safetensors_empty_tensors_next_to_others_are_fine(tmp_path: Path) -> None:
    header = {
        "a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
        "e": {"dtype": "U8", "shape": [0], "data_offsets": [2, 2]},
    }
    _raw_safetensors(tmp_path / "model.safetensors", header, bytes(4))
    with SafetensorsCheckpoint(tmp_path) as ckpt:
        assert np.array_equal(ckpt.view("a"), np.arange(4, dtype=np.uint8) * 0)


def _manifest_with_items(shape: list[int], regions: list[tuple[dict, int]]) -> bytes:
    """A replace-only manifest of one F32 tensor ``t``; ``regions`` are (region JSON, element count)."""
    zero = "0" * 64
    items = [
        {
            "tensor": "t",
            "region": region,
            "op": "replace",
            "count": count,
            "data": {"block": 0, "offset": 0, "length": 0, "positions_length": 0, "digest": zero},
            "pre": zero,
            "post": zero,
        }
        for region, count in regions
    ]
    return json.dumps(
        {
            "format": "dcr.delta",
            "format_version": [1, 0],
            "base": {"version": "a", "fingerprint": zero},
            "target": {"version": "b", "fingerprint": zero},
            "blocks": [{"id": zero, "size": 0, "role": "data"}],
            "tensors": {"t": {"dtype": "F32", "shape": shape, "digest": zero}},
            "items": items,
        }
    ).encode()


def test_two_scalar_boxes_are_an_overlap_not_an_assertion() -> None:
    from dcr_cli.format.manifest import parse_manifest

    scalar_box = ({"offsets": [], "sizes": []}, 1)
    raw = _manifest_with_items([], [scalar_box, scalar_box])
    with pytest.raises(FormatError, match="overlap"):
        parse_manifest(raw)
