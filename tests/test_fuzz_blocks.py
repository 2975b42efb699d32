"""Fuzz: damaged and hostile blocks against the real ``dcr apply``, on fresh and on torn receivers.

Unsigned damage (a flipped, cut or appended byte, a missing block) must be refused before any write.
Re-signed damage (the section moved to a block of its own whose id, size and digest all match) leaves only
the frame and value checks: a hostile frame, a re-encoded but equal frame (must apply), changed values
or changed positions.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import fuzz_support as fz
import pytest
import zstandard
from hypothesis import given
from hypothesis import strategies as st
from manifest_text import manifest_v1
from test_fuzz_manifest import FRAME_ATTACKS, SETTINGS, _frame, _hostile_values

from dcr_cli.format.manifest import manifest_json

UNSIGNED = ("flip", "truncate", "extend", "delete", "delete-repair")
SIGNED = (*FRAME_ATTACKS, "re-encoded", "value-flip", "positions-moved")


def _tear(recv: Path, w: fz.World, delta: Path) -> None:
    """Leave the receiver as a crash in the middle of applying ``delta`` would: one changed element of
    item 0 (a.bf16) already written, and the state file saying "applying" that delta
    (format_spec/receiver-checkpoint.md §2, written by hand from the spec)."""
    from dcr_cli.checkpoints.safetensors_dir import SafetensorsCheckpoint
    from dcr_cli.format.digest import digest_bytes

    with SafetensorsCheckpoint(w.versions[1]) as target, SafetensorsCheckpoint(recv) as ckpt:
        loc = ckpt.tensors["a.bf16"]
        new = target.view("a.bf16").tobytes()
    raw = bytearray(loc.file.read_bytes())
    raw[loc.start + 2 : loc.start + 4] = new[2:4]  # element 1 changes from v0 to v1
    loc.file.write_bytes(bytes(raw))
    manifest = (delta / "manifest.json").read_bytes()
    m = json.loads(manifest_json(manifest))
    # The identity of the files being written (§2: size, mtime_ns, ctime_ns, inode), as dcr records it
    # before its first write: without it a resume cannot trust the state and must re-hash.
    files = {}
    for f in sorted(recv.glob("*.safetensors")):
        st = f.stat()
        files[f.name] = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
    state = {
        "format": "dcr.receiver-state",
        "format_version": 1,
        "version": None,
        "fingerprint": None,
        "applying": {"delta_id": digest_bytes(manifest), "base": m["base"], "target": m["target"], "url": str(delta)},
        "files": files,
        "history": [],
    }
    (recv / ".dcr").mkdir(exist_ok=True)
    (recv / ".dcr" / "state.json").write_text(json.dumps(state))


def _signed(kind: str, delta: Path, m: dict[str, Any], item: int, key: str, seed: int) -> None:
    it = m["items"][item]
    if key == "repair" and it.get("repair") is None:
        key = "data"
    section = fz.section_bytes(delta, m, it[key])
    pl = it["data"]["positions_length"] if key == "data" else 0
    head, frame = section[:pl], section[pl:]
    if key == "data" and pl and kind == "positions-moved":
        gaps = bytearray(zstandard.ZstdDecompressor().decompress(head))
        if gaps and gaps[0] < 254:
            gaps[0] += 1  # every position moves one element on (same count, same values)
        head = _frame(bytes(gaps))
    values = zstandard.ZstdDecompressor().decompress(frame)
    if kind == "re-encoded":
        frame = zstandard.ZstdCompressor(level=19, write_checksum=True, write_content_size=True).compress(values)
    elif kind == "value-flip":
        flipped = bytearray(values)
        if flipped:
            flipped[seed % len(flipped)] ^= 1 << (seed % 8)
        frame = _frame(bytes(flipped))
    elif kind in FRAME_ATTACKS:
        frame = _hostile_values(kind, values)
    fz.put_section(delta, m, item, key, head + frame)
    if key == "data":
        it["data"]["positions_length"] = len(head)


def _unsigned(kind: str, delta: Path, m: dict[str, Any], seed: int) -> str:
    """Damage one block file; returns its role."""
    blocks = [b for b in m["blocks"] if kind != "delete-repair" or b["role"] == "repair"]
    block = blocks[seed % len(blocks)]
    path = delta / "blocks" / block["id"]
    raw = bytearray(path.read_bytes())
    if kind == "flip":
        raw[seed % len(raw)] ^= 1 << (seed % 8)
        path.write_bytes(bytes(raw))
    elif kind == "truncate":
        path.write_bytes(bytes(raw[: seed % len(raw)]))
    elif kind == "extend":
        path.write_bytes(bytes(raw) + b"\0" * (1 + seed % 3))
    else:
        path.unlink()
    return str(block["role"])


@SETTINGS
@given(
    kind=st.sampled_from(UNSIGNED + SIGNED),
    item=st.integers(0, 3),
    key=st.sampled_from(["data", "repair"]),
    seed=st.integers(0, 1 << 20),
    torn=st.booleans(),
    workers=st.sampled_from(["1", "2"]),
)
def test_damaged_blocks(kind: str, item: int, key: str, seed: int, torn: bool, workers: str) -> None:
    w = fz.world()
    with fz.scratch() as tmp:
        delta = fz.copy_delta(w.deltas[0], tmp / "d")
        m = manifest_v1(delta)
        role = "data"
        if kind in UNSIGNED:
            role = _unsigned(kind, delta, m, seed)
        else:
            _signed(kind, delta, m, item, key, seed)
            fz.write_manifest(delta, m)
        recv = fz.copy_receiver(w.versions[0], tmp / "r")
        if torn:
            _tear(recv, w, delta)
        oracle = fz.Oracle.of("blocks", recv, w.versions[1])
        what = f"{kind} item {item} {key} torn={torn}"
        outcome = oracle.check(fz.run("apply", str(delta), "--into", str(recv), "--workers", workers), what)
        if (kind in ("flip", "truncate", "extend", "delete") and role == "data") or (
            kind in FRAME_ATTACKS and key == "data"
        ):
            assert outcome != "applied", what  # the data the target needs was damaged
        if kind == "re-encoded":
            assert outcome == "applied", what  # compression parameters are the writer's choice (§5.2)


@pytest.mark.parametrize("torn", [False, True])
def test_missing_repair_blocks(torn: bool) -> None:
    """Repair blocks are optional (§7.3): a clean apply needs none; a torn item without one is refused."""
    w = fz.world()
    with fz.scratch() as tmp:
        delta = fz.copy_delta(w.deltas[0], tmp / "d")
        m = manifest_v1(delta)
        for b in m["blocks"]:
            if b["role"] == "repair":
                (delta / "blocks" / b["id"]).unlink()
        recv = fz.copy_receiver(w.versions[0], tmp / "r")
        if torn:
            _tear(recv, w, delta)
        oracle = fz.Oracle.of("blocks", recv, w.versions[1])
        outcome = oracle.check(fz.run("apply", str(delta), "--into", str(recv)), f"no repair blocks, torn={torn}")
        assert outcome != "applied" if torn else outcome == "applied"  # torn: refused (§2 hole aside)


def test_positions_moved_by_one_are_not_applied_at_the_wrong_place() -> None:
    """Re-signed positions frame of item 0, every position one element on: today the item counts as torn
    and the repair values land at the wrong elements, exit 0 (positions are not bound into a digest)."""
    from test_fuzz_manifest import _strict

    def case() -> str:
        w = fz.world()
        with fz.scratch() as tmp:
            delta = fz.copy_delta(w.deltas[0], tmp / "d")
            m = manifest_v1(delta)
            _signed("positions-moved", delta, m, 0, "data", 0)
            fz.write_manifest(delta, m)
            recv = fz.copy_receiver(w.versions[0], tmp / "r")
            oracle = fz.Oracle.of("blocks", recv, w.versions[1])
            return oracle.check(fz.run("apply", str(delta), "--into", str(recv), "--workers", "1"), "positions moved")

    _strict(case, "positions moved")


@pytest.fixture(autouse=True, scope="module")
def _report_counts() -> Any:
    yield
    fz.dump_counts()
