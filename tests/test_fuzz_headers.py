"""Fuzz: mutated safetensors headers (and index.json) of the receiver against the real CLI.

The data bytes stay as they were; only the JSON header (or the shard index) changes. ``apply`` must refuse
with one line and leave every file byte-identical, or apply and leave the receiver holding the target's
tensors; ``verify``, ``diff`` and ``inspect``-free read paths must never crash.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import fuzz_support as fz
import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_fuzz_manifest import OPS, SETTINGS


def _header(path: Path) -> tuple[dict[str, Any], bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _write(path: Path, header: bytes, data: bytes) -> None:
    header += b" " * (-len(header) % 8)
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)


def _in_entries(path: tuple[Any, ...]) -> bool:
    return len(path) >= 2 and path[0] != "__metadata__"


@SETTINGS
@given(ops=OPS, entries_only=st.booleans())
def test_mutated_safetensors_header(ops: list[tuple[str, int, int]], entries_only: bool) -> None:
    w = fz.world()
    with fz.scratch() as tmp:
        recv = fz.copy_receiver(w.versions[0], tmp / "r")
        file = recv / "model.safetensors"
        header, data = _header(file)
        header["__metadata__"] = {"format": "pt"}
        _, raw, what = fz.mutate_json(header, ops, _in_entries if entries_only else None)
        _write(file, raw, data)
        oracle = fz.Oracle.of("safetensors header", recv, w.versions[1])
        oracle.check(fz.run("apply", str(w.deltas[0]), "--into", str(recv), "--workers", "1"), what)
    with fz.scratch() as tmp:  # the read paths: verify (no state: nothing recorded) and diff
        recv = fz.copy_receiver(w.versions[0], tmp / "r")
        _write(recv / "model.safetensors", raw, data)
        for args in (["verify", str(recv)], ["diff", str(recv), str(w.versions[1]), "-o", str(tmp / "out")]):
            r = fz.run(*args)
            assert r.exception is None and r.code in (0, 1, 2), f"{what}: {args[0]} {r.code} {r.exception} {r.stderr}"
            if r.code:
                assert len(r.stderr.splitlines()) == 1 and r.stderr.startswith("dcr: error: "), f"{what}: {r.stderr!r}"
        fz.COUNTS["safetensors header read paths (verify, diff): cases"] += 1


@SETTINGS
@given(ops=OPS)
def test_mutated_shard_index(ops: list[tuple[str, int, int]]) -> None:
    """A sharded receiver: its model.safetensors.index.json is mutated."""
    from helpers_checkpoints import read_raw

    w = fz.world()
    with fz.scratch() as tmp:
        # The same tensors in two shards with an index (torch tensors built from the exact bits).
        import torch
        from checkpoints import write_checkpoint

        bits = fz.tensor_bits(w.versions[0])
        assert bits is not None
        from dcr_cli.checkpoints.safetensors_dir import SafetensorsCheckpoint

        with SafetensorsCheckpoint(w.versions[0]) as ckpt:
            layout = ckpt.layout()
        from checkpoints import TORCH_DTYPES

        tensors = {
            n: torch.frombuffer(bytearray(b), dtype=torch.uint8).view(TORCH_DTYPES[layout[n][0]]).reshape(layout[n][1])
            for n, b in bits.items()
        }
        recv = write_checkpoint(tmp / "r", tensors, shards=2)
        assert read_raw(recv) == read_raw(w.versions[0])
        index = recv / "model.safetensors.index.json"
        _, raw, what = fz.mutate_json(json.loads(index.read_text()), ops)
        index.write_bytes(raw)
        oracle = fz.Oracle.of("shard index", recv, w.versions[1])
        oracle.check(fz.run("apply", str(w.deltas[0]), "--into", str(recv), "--workers", "1"), what)


@pytest.mark.parametrize(
    "shape", [[64.5, 4], ["16", 16], [True, 256], [16, 16.0], [-16, -16], [2**64, 0], None, "16,16", [[16], 16]]
)
def test_shapes_that_are_not_lists_of_integers_are_refused(shape: Any) -> None:
    w = fz.world()
    with fz.scratch() as tmp:
        recv = fz.copy_receiver(w.versions[0], tmp / "r")
        file = recv / "model.safetensors"
        header, data = _header(file)
        header["a.bf16"]["shape"] = shape
        _write(file, json.dumps(header).encode(), data)
        oracle = fz.Oracle.of("safetensors header", recv, w.versions[1])
        assert oracle.check(fz.run("apply", str(w.deltas[0]), "--into", str(recv)), f"shape {shape}") == "refused"


@pytest.fixture(autouse=True, scope="module")
def _report_counts() -> Any:
    yield
    fz.dump_counts()
