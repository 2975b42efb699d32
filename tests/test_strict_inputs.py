"""Hostile JSON and header values are refused with one FormatError (issue 10 §3, §9; delta-v1 §8 "JSON").

Every case here crashed or was silently accepted before: RecursionError, ValueError on 4,300+ digits,
TypeError on an object as a tensor name, NUL in an index value, a lone surrogate in a tensor name,
``[true, 4096]`` as a shape.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from dcr_cli.checkpoints.safetensors_dir import SafetensorsCheckpoint, read_header
from dcr_cli.errors import FormatError
from dcr_cli.format.manifest import MANIFEST_NAME, parse_manifest
from dcr_cli.format.strict_json import MAX_DEPTH, load_json

REPO = Path(__file__).resolve().parents[1]
BASIC = REPO / "format_spec" / "vectors" / "basic" / "delta"


# --------------------------------------------------------------------------- load_json


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b'{"a": 1, "a": 2}', "duplicate key"),
        (b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1), "nested"),
        (b'{"x": ' + b"[" * 1000 + b"]" * 1000 + b"}", "nested"),
        (b"1" * 4301, "digits"),
        (b"-" + b"9" * 21, "digits"),
        (b"NaN", "NaN"),
        (b"[Infinity]", "Infinity"),
        (b"[-Infinity]", "Infinity"),
        (b"1e400", "out of range"),
        (b'"\\u0000"', "NUL"),
        (b'{"a\\u0000b": 1}', "NUL"),
        (b'"\\ud800"', "surrogate"),
        (b'{"\\udfff": 1}', "surrogate"),
        (b"\xff\xfe", "UTF-8"),
        (b'"\xed\xa0\x80"', "UTF-8"),  # a surrogate encoded in UTF-8 is not UTF-8
        (b'{"a": 1', "not valid JSON"),
    ],
)
def test_load_json_refuses(raw: bytes, reason: str) -> None:
    with pytest.raises(FormatError, match=reason):
        load_json(raw, "doc")


@pytest.mark.parametrize(
    ("raw", "value"),
    [
        (b"[" * MAX_DEPTH + b"]" * MAX_DEPTH, None),
        (b'"\\ud83d\\ude00"', "\U0001f600"),
        (b'{"a": "[[[[[[", "b": "\\\\u0000"}', {"a": "[[[[[[", "b": "\\u0000"}),
        (b"18446744073709551615", 2**64 - 1),
        (b"[1.5, -0.0]", [1.5, -0.0]),
    ],
)
def test_load_json_accepts(raw: bytes, value: Any) -> None:
    got = load_json(raw, "doc")
    if value is not None:
        assert got == value


def test_load_json_stays_linear_on_hostile_strings() -> None:
    """An unterminated string of escaped quotes made the old string regex backtrack quadratically."""
    load_json(b"[]", "warm up the compiled scan")
    started = time.perf_counter()
    with pytest.raises(FormatError):
        load_json(b'"' + b'\\"' * (4 << 20), "doc")  # 8 MiB; hours with the quadratic scan
    assert time.perf_counter() - started < 5


# --------------------------------------------------------------------------- manifests


def _manifest() -> dict[str, Any]:
    return json.loads((BASIC / MANIFEST_NAME).read_text())


DEEP = "@@deep@@"  # json.dumps itself recurses: 1,000 levels are spliced in as text


def _encode(m: dict[str, Any]) -> bytes:
    return json.dumps(m).encode().replace(f'"{DEEP}"'.encode(), b"[" * 1000 + b"]" * 1000)


def _nest(depth: int) -> Any:
    v: Any = 0
    for _ in range(depth):
        v = [v]
    return v


MANIFEST_ATTACKS = {
    "tensor is an object": lambda m: m["items"][0].__setitem__("tensor", {"a": 1}),
    "tensor is a list": lambda m: m["items"][0].__setitem__("tensor", ["bf16.weight"]),
    "tensor is null": lambda m: m["items"][0].__setitem__("tensor", None),
    "op is a list": lambda m: m["items"][0].__setitem__("op", ["xor"]),
    "count is a bool": lambda m: m["items"][0].__setitem__("count", True),
    "count is a float": lambda m: m["items"][0].__setitem__("count", 4.0),
    "data is a list": lambda m: m["items"][0].__setitem__("data", []),
    "region is both kinds": lambda m: m["items"][0]["region"].update({"offsets": [0], "sizes": [32]}),
    "box ranks differ": lambda m: m["items"][4]["region"].__setitem__("sizes", [1, 3]),
    "residual is a number": lambda m: m["items"][0].__setitem__("residual", 7),
    "changed is a string": lambda m: m["items"][0].__setitem__("changed", "3"),
    "producer is a list": lambda m: m.__setitem__("producer", ["dcr"]),
    "minor is negative": lambda m: m.__setitem__("format_version", [1, -1]),
    "shape holds a bool": lambda m: m["tensors"]["bf16.weight"].__setitem__("shape", [True, 64]),
    "shape holds a float": lambda m: m["tensors"]["bf16.weight"].__setitem__("shape", [8.0, 8]),
    "shape over 2^63 bytes": lambda m: m["tensors"]["bf16.weight"].__setitem__("shape", [2**62, 4]),
    "deep nesting in an unknown field": lambda m: m.__setitem__("x-future", DEEP),
    "nesting one over the limit": lambda m: m.__setitem__("x-future", _nest(MAX_DEPTH)),
    "role is an object": lambda m: m["blocks"][0].__setitem__("role", {}),
}


@pytest.mark.parametrize("attack", sorted(MANIFEST_ATTACKS))
def test_parse_manifest_refuses(attack: str) -> None:
    m = _manifest()
    MANIFEST_ATTACKS[attack](m)
    with pytest.raises(FormatError):
        parse_manifest(_encode(m))


@pytest.mark.parametrize(
    ("edit", "reason"),
    [
        (lambda raw: raw.replace(b'"count": 4', b'"count": ' + b"4" * 4301, 1), "digits"),
        (lambda raw: raw.replace(b'"bf16.weight"', b'"bf16.\\ud800weight"'), "surrogate"),
        (lambda raw: raw.replace(b'"bf16.weight"', b'"bf16.\\u0000weight"'), "NUL"),
        (lambda raw: raw.replace(b'"items": [', b'"items": [], "items": [', 1), "duplicate key"),
        (lambda raw: raw.replace(b'"format_version": [1, 0]', b'"format_version": [1, NaN]'), "NaN"),
    ],
)
def test_parse_manifest_refuses_raw(edit: Any, reason: str) -> None:
    raw = edit(_encode(_manifest()))
    assert raw != _encode(_manifest())
    with pytest.raises(FormatError, match=reason):
        parse_manifest(raw)


def test_unknown_optional_fields_within_limits_are_ignored() -> None:
    m = _manifest()
    m["x-future"] = _nest(MAX_DEPTH - 1)
    m["items"][0]["x-note"] = {"a": [1, 2.5, None, "s"]}
    parsed = parse_manifest(_encode(m))
    assert len(parsed.items) == len(m["items"])


def _run_dcr(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "dcr_cli", *args], capture_output=True, text=True, env=env, timeout=120
    )


@pytest.mark.parametrize(
    "attack", ["tensor is an object", "deep nesting in an unknown field", "lone surrogate", "4301 digits"]
)
def test_inspect_refuses_with_one_line(tmp_path: Path, attack: str) -> None:
    import shutil

    delta = tmp_path / "d"
    shutil.copytree(BASIC, delta)
    m = _manifest()
    if attack in MANIFEST_ATTACKS:
        MANIFEST_ATTACKS[attack](m)
        raw = _encode(m)
    elif attack == "lone surrogate":
        raw = _encode(m).replace(b'"bf16.weight"', b'"bf16.\\udc80weight"')
    else:
        raw = _encode(m).replace(b'"count": 4', b'"count": ' + b"4" * 4301, 1)
    (delta / MANIFEST_NAME).write_bytes(raw)
    proc = _run_dcr("inspect", str(delta))
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("dcr: error: "), proc.stderr


# --------------------------------------------------------------------------- safetensors headers


def _raw_safetensors(path: Path, header: dict[str, Any] | bytes, data: bytes = b"") -> None:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


@pytest.mark.parametrize(
    "entry",
    [
        {"dtype": "U8", "shape": [2.5, 2], "data_offsets": [0, 4]},
        {"dtype": "U8", "shape": ["4"], "data_offsets": [0, 4]},
        {"dtype": "U8", "shape": [True, 4], "data_offsets": [0, 4]},
        {"dtype": "U8", "shape": [4], "data_offsets": [False, 4]},
        {"dtype": "U8", "shape": [4], "data_offsets": [0.0, 4]},
        {"dtype": "U8", "shape": [4], "data_offsets": [0, 4, 8]},
        {"dtype": "U8", "shape": [4], "data_offsets": [4, 0]},
        {"dtype": "U8", "shape": [4], "data_offsets": [0, 5]},
        {"dtype": ["U8"], "shape": [4], "data_offsets": [0, 4]},
        {"dtype": "U8", "shape": 4, "data_offsets": [0, 4]},
        "U8",
    ],
)
def test_safetensors_entry_types_are_checked(tmp_path: Path, entry: Any) -> None:
    _raw_safetensors(tmp_path / "model.safetensors", {"a": entry}, bytes(8))
    with pytest.raises(FormatError):
        SafetensorsCheckpoint(tmp_path)


@pytest.mark.parametrize(
    "header",
    [
        b'{"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}, '
        b'"a": {"dtype": "U8", "shape": [4], "data_offsets": [4, 8]}}',
        b'{"__metadata__": {"x": ' + b"[" * 1000 + b"]" * 1000 + b"}}",
        b'{"__metadata__": {"x": 1}}',
        b'{"a": {"dtype": "U8", "shape": [' + b"9" * 4301 + b'], "data_offsets": [0, 4]}}',
    ],
)
def test_safetensors_header_json_is_strict(tmp_path: Path, header: bytes) -> None:
    _raw_safetensors(tmp_path / "model.safetensors", header, bytes(8))
    with pytest.raises(FormatError):
        read_header(tmp_path / "model.safetensors")


def test_index_with_nul_in_a_file_name_is_refused(tmp_path: Path) -> None:
    _raw_safetensors(tmp_path / "a.safetensors", {"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}}, bytes(4))
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": {"a": "a.safe\\u0000tensors"}}')
    with pytest.raises(FormatError, match="NUL"):
        SafetensorsCheckpoint(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": {"a": "a.safetensors", "a": "b"}}')
    with pytest.raises(FormatError, match="duplicate"):
        SafetensorsCheckpoint(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": {"a": "a.safetensors"}}')
    assert set(SafetensorsCheckpoint(tmp_path).tensors) == {"a"}


def test_dcp_sharding_info_is_strict(tmp_path: Path) -> None:
    from dcr_cli.checkpoints.dcp_hf import SHARDING_KEY, DcpHfReader

    entry = {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}
    for info in ('{"a": {"saved_offsets": [true]}}', '{"a": {"saved_offsets": [0]}, "a": 1}', "[" * 100 + "]" * 100):
        _raw_safetensors(
            tmp_path / "shard-00001.safetensors", {"__metadata__": {SHARDING_KEY: info}, "a": entry}, bytes(4)
        )
        with pytest.raises(FormatError):
            DcpHfReader(tmp_path)
    _raw_safetensors(
        tmp_path / "shard-00001.safetensors",
        {"__metadata__": {SHARDING_KEY: '{"a": {"saved_offsets": [0]}}'}, "a": entry},
        bytes(4),
    )
    assert DcpHfReader(tmp_path).stored["a"].shape == (4,)
