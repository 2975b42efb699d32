"""Fuzz: mutated manifests against the real ``dcr apply`` / ``dcr inspect`` / ``dcr verify --against``.

Property (fuzz_support.Oracle): one-line refusal with exit 2 and a byte-identical receiver, or exit 0 with
the receiver bit-identical to the target. Plus a differential check: dcr's manifest parser and the
independent reference decoder (tests/reference_decoder.py) accept exactly the same manifests.
"""

from __future__ import annotations

import json
from typing import Any

import fuzz_support as fz
import pytest
import reference_decoder as ref
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from manifest_text import manifest_v1

from dcr_cli.errors import FormatError
from dcr_cli.format.manifest import parse_manifest

SETTINGS = settings(
    max_examples=fz.EXAMPLES,
    deadline=None,
    derandomize=not fz.RANDOM,  # CI runs the same cases every time; benchmarks/fuzz_campaign.py explores
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    database=None,
)

OPS = st.lists(
    st.tuples(st.sampled_from(fz.MUTATIONS), st.integers(0, 1 << 20), st.integers(0, 1 << 20)), min_size=1, max_size=3
)


def _manifest(i: int = 0) -> dict[str, Any]:
    return manifest_v1(fz.world().deltas[i], rewrite=False)


def _apply_case(m: Any, raw: bytes | None, what: str, family: str = "manifest") -> str:
    w = fz.world()
    with fz.scratch() as tmp:
        delta = fz.copy_delta(w.deltas[0], tmp / "d")
        fz.write_manifest(delta, m, raw)
        recv = fz.copy_receiver(w.versions[0], tmp / "r")
        oracle = fz.Oracle.of(family, recv, w.versions[1])
        return oracle.check(fz.run("apply", str(delta), "--into", str(recv), "--workers", "1"), what)


@SETTINGS
@given(ops=OPS, resign=st.booleans())
def test_mutated_manifest_apply(ops: list[tuple[str, int, int]], resign: bool) -> None:
    obj, raw, what = fz.mutate_json(_manifest(), ops)
    if obj is not None and resign:
        fz.resign_fingerprint(obj)
        raw = json.dumps(obj).encode()
    _apply_case(None, raw, what)


@SETTINGS
@given(ops=OPS)
def test_mutated_manifest_inspect_and_verify(ops: list[tuple[str, int, int]]) -> None:
    """Read-only commands: exit 0, or one line and exit 2 (1 for verify's mismatch); never a crash."""
    w = fz.world()
    _, raw, what = fz.mutate_json(_manifest(), ops)
    with fz.scratch() as tmp:
        delta = fz.copy_delta(w.deltas[0], tmp / "d")
        fz.write_manifest(delta, None, raw)
        recv = fz.copy_receiver(w.versions[1], tmp / "r")
        before = fz.snapshot(recv)
        for args in (
            ["inspect", str(delta)],
            ["inspect", "--json", "--all", str(delta)],
            ["verify", str(recv), "--against", str(delta)],
        ):
            r = fz.run(*args)
            assert r.exception is None and r.code in (0, 1, 2), f"{what}: {args[0]}: {r.code} {r.exception} {r.stderr}"
            if r.code:
                assert len(r.stderr.splitlines()) == 1 and r.stderr.startswith("dcr: error: "), f"{what}: {r.stderr!r}"
        assert fz.snapshot(recv) == before
        fz.COUNTS["manifest read-only (inspect x2, verify --against): cases"] += 1


@SETTINGS
@given(ops=OPS)
def test_dcr_and_the_reference_decoder_accept_the_same_manifests(ops: list[tuple[str, int, int]]) -> None:
    _, raw, what = fz.mutate_json(_manifest(), ops)
    try:
        parse_manifest(raw)
        dcr_ok, dcr_why = True, ""
    except FormatError as exc:
        dcr_ok, dcr_why = False, str(exc)
    try:
        ref.read_manifest(raw)
        ref_ok, ref_why = True, ""
    except ref.Refused as exc:
        ref_ok, ref_why = False, str(exc)
    dcr_says = "accepts" if dcr_ok else f"refuses: {dcr_why}"
    ref_says = "accepts" if ref_ok else f"refuses: {ref_why}"
    assert dcr_ok == ref_ok, f"{what}: dcr {dcr_says}; reference {ref_says}"
    fz.COUNTS[f"manifest differential: {'both accept' if dcr_ok else 'both refuse'}"] += 1
    fz.COUNTS["manifest differential: cases"] += 1


# --------------------------------------------------------------------------- specific attacks


def test_order_of_items_carries_no_meaning() -> None:
    m = _manifest()
    m["items"].reverse()
    assert _apply_case(m, None, "items reversed") == "applied"


def test_unknown_members_everywhere_are_ignored() -> None:
    m = _manifest()
    m["x-top"] = {"nested": [1, 2.5, None]}
    for it in m["items"]:
        it["x-item"] = "note"
        it["data"]["x-section"] = 1
        it["region"]["x-region"] = []
    for t in m["tensors"].values():
        t["x-tensor"] = True
    m["blocks"][0]["x-block"] = "b"
    assert _apply_case(m, None, "unknown members") == "applied"


@pytest.mark.parametrize("attack", sorted(fz.RAW_ATTACKS))
def test_raw_json_attacks_in_an_unknown_member_are_refused(attack: str) -> None:
    raw = json.dumps({**_manifest(), "x-unknown": "@@a@@"}).replace('"@@a@@"', fz.RAW_ATTACKS[attack]).encode()
    expected = "applied" if attack == "float-int" else "refused"  # 2.0 in an ignored member is fine
    assert _apply_case(None, raw, attack) == expected


def test_duplicated_items_key_is_refused() -> None:
    m = _manifest()
    text = json.dumps(m).replace('"items": ', '"items": [], "items": ', 1)
    assert _apply_case(None, text.encode(), "items twice") == "refused"


@pytest.mark.parametrize(
    "attack", ["tensor is an object", "deep nesting", "huge integer", "lone surrogate", "items reversed"]
)
def test_real_subprocess_cases(attack: str) -> None:
    """A few cases through ``python -m dcr_cli`` itself (what users and cron run), same property."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    m = _manifest()
    raw = None
    if attack == "tensor is an object":
        m["items"][0]["tensor"] = {"a": 1}
    elif attack == "items reversed":
        m["items"].reverse()
    else:
        m["x-unknown"] = "@@a@@"
        splice = {"deep nesting": fz.RAW_ATTACKS["deep-nesting"], "huge integer": fz.RAW_ATTACKS["huge-integer"]}
        raw = json.dumps(m).replace('"@@a@@"', splice.get(attack, fz.RAW_ATTACKS["lone-surrogate"])).encode()
    w = fz.world()
    repo = Path(__file__).resolve().parents[1]
    with fz.scratch() as tmp:
        delta = fz.copy_delta(w.deltas[0], tmp / "d")
        fz.write_manifest(delta, m, raw)
        recv = fz.copy_receiver(w.versions[0], tmp / "r")
        oracle = fz.Oracle.of("manifest (subprocess)", recv, w.versions[1])
        proc = subprocess.run(
            [sys.executable, "-m", "dcr_cli", "apply", str(delta), "--into", str(recv)],
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "PYTHONPATH": str(repo)},
        )
        outcome = oracle.check(fz.Result(proc.returncode, proc.stdout, proc.stderr), attack)
        assert outcome == ("applied" if attack == "items reversed" else "refused")


# Issue 10 §1 and §2, each the exact case the issue names.


def _strict(case: Any, what: str) -> None:
    outcome = case()
    assert outcome in ("applied", "refused"), what


def _dropped(m: dict[str, Any]) -> None:
    m["items"].pop(1)


def _swapped(m: dict[str, Any]) -> None:
    m["items"][0]["pre"], m["items"][0]["post"] = m["items"][0]["post"], m["items"][0]["pre"]


def _shifted(m: dict[str, Any]) -> None:
    """Region [0, 256) becomes [1, 256): every position now names the next element (the last change is at 250)."""
    m["items"][0]["region"]["start"] += 1


@pytest.mark.parametrize("attack", [_dropped, _swapped, _shifted], ids=lambda f: f.__name__[1:])
def test_manifest_that_passes_every_check_but_is_wrong(attack: Any) -> None:
    m = _manifest()
    attack(m)
    _strict(lambda: _apply_case(m, None, attack.__name__), attack.__name__)


def _frame(content: bytes, *, checksum: bool = True, size: bool = True) -> bytes:
    return zstandard.ZstdCompressor(write_checksum=checksum, write_content_size=size).compress(content)


SKIPPABLE = (0x184D2A50).to_bytes(4, "little") + (4).to_bytes(4, "little") + b"skip"


def _hostile_values(kind: str, values: bytes) -> bytes:
    return {
        "no-checksum": lambda: _frame(values, checksum=False),
        "no-content-size": lambda: _frame(values, size=False),
        "trailing-bytes": lambda: _frame(values) + b"\0",
        "skippable-frame-after": lambda: _frame(values) + SKIPPABLE,
        "skippable-frame-before": lambda: SKIPPABLE + _frame(values),
        "two-frames": lambda: _frame(values) + _frame(values),
        "decoded-length-short": lambda: _frame(values[:-1]),
        "decoded-length-long": lambda: _frame(values + b"\0"),
        "garbage": lambda: b"\x28\xb5\x2f\xfd" + bytes(range(40)),
    }[kind]()


K = 3  # items[3] (d.u8, xor, with positions): items 0..2 are written before it in a sequential apply


def _item_k_attack(edit: Any) -> Any:
    def case() -> str:
        w = fz.world()
        with fz.scratch() as tmp:
            delta = fz.copy_delta(w.deltas[0], tmp / "d")
            m = _manifest()
            assert m["items"][K]["op"] == "xor" and all(not it.get("x") for it in m["items"])
            edit(delta, m)
            fz.write_manifest(delta, m)
            recv = fz.copy_receiver(w.versions[0], tmp / "r")
            oracle = fz.Oracle.of("manifest", recv, w.versions[1])
            return oracle.check(fz.run("apply", str(delta), "--into", str(recv), "--workers", "1"), "item k attack")

    return case


def _values_of(delta: Any, m: dict[str, Any]) -> tuple[bytes, bytes]:
    data = fz.section_bytes(delta, m, m["items"][K]["data"])
    pl = m["items"][K]["data"]["positions_length"]
    return data[:pl], zstandard.ZstdDecompressor().decompress(data[pl:])


def _hostile(kind: str) -> Any:
    def edit(delta: Any, m: dict[str, Any]) -> None:
        positions, values = _values_of(delta, m)
        fz.put_section(delta, m, K, "data", positions + _hostile_values(kind, values))
        m["items"][K]["data"]["positions_length"] = len(positions)

    return edit


def _hostile_positions(kind: str) -> Any:
    def edit(delta: Any, m: dict[str, Any]) -> None:
        positions, _ = _values_of(delta, m)
        data = fz.section_bytes(delta, m, m["items"][K]["data"])[len(positions) :]
        gaps = zstandard.ZstdDecompressor().decompress(positions)
        count = m["items"][K]["count"]
        if kind == "too-many-escapes":  # every gap escaped, but no escape values
            new = _frame(b"\xff" * count + gaps[count:])
        else:  # out of range: the last gap jumps past the region
            new = _frame(gaps[: count - 1] + b"\xff" + gaps[count:] + (1 << 20).to_bytes(4, "little"))
        fz.put_section(delta, m, K, "data", new + data)
        m["items"][K]["data"]["positions_length"] = len(new)

    return edit


def _field(key: str, value: Any) -> Any:
    def edit(delta: Any, m: dict[str, Any]) -> None:
        if key in ("offset", "length", "digest"):
            if key == "digest":
                m["items"][K]["data"]["digest"] = "0" * 64
            else:
                m["items"][K]["data"][key] += value
        elif key == "positions_length":
            m["items"][K]["data"]["positions_length"] += value
        else:
            m["items"][K][key] = value if not callable(value) else value(m["items"][K][key])

    return edit


FRAME_ATTACKS = (
    "no-checksum",
    "no-content-size",
    "trailing-bytes",
    "skippable-frame-after",
    "skippable-frame-before",
    "two-frames",
    "decoded-length-short",
    "decoded-length-long",
    "garbage",
)
ITEM_K_ATTACKS = {
    **{f"frame {kind}": _hostile(kind) for kind in FRAME_ATTACKS},
    "positions too-many-escapes": _hostile_positions("too-many-escapes"),
    "positions out-of-range": _hostile_positions("out-of-range"),
    "section digest": _field("digest", None),
    "section offset": _field("offset", -1),
    "section length": _field("length", -1),
    "positions_length": _field("positions_length", -1),
    "count": _field("count", lambda c: c + 1),
    "op": _field("op", "overwrite"),
}


@pytest.mark.parametrize("attack", sorted(ITEM_K_ATTACKS))
def test_bad_section_in_item_k_is_refused_before_any_write(attack: str) -> None:
    _strict(_item_k_attack(ITEM_K_ATTACKS[attack]), attack)


@pytest.mark.parametrize("attack", sorted(ITEM_K_ATTACKS))
def test_bad_section_in_item_k_never_gives_exit_0(attack: str) -> None:
    """Today's guarantee, which must hold before and after the fix: never exit 0, one line, exit 2."""
    outcome = _item_k_attack(ITEM_K_ATTACKS[attack])()
    assert outcome != "applied" and "§1" not in outcome


@pytest.fixture(autouse=True, scope="module")
def _report_counts() -> Any:
    yield
    fz.dump_counts()
