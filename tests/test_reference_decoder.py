"""The independent reference decoder (tests/reference_decoder.py, written from format_spec/ alone) agrees
with the committed vectors and with dcr: it decodes vectors/* to expected.json, applies them to base.json
giving target.json, and refuses every vectors/bad/* case for the rule its reason.txt names."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import reference_decoder as ref
from manifest_text import manifest_v1

VECTORS = Path(__file__).resolve().parents[1] / "format_spec" / "vectors"
GOOD = sorted(p.name for p in VECTORS.iterdir() if p.is_dir() and p.name != "bad")
BAD = sorted(p.name for p in (VECTORS / "bad").iterdir())

# The decoder's own rule for each bad vector, read off its reason.txt.
RULE_OF = {
    "bool-as-integer": "type",
    "bytes-after-frame": "frame",
    "deep-nesting": "json-depth",
    "duplicate-key": "json-duplicate",
    "float-as-integer": "type",
    "huge-integer": "json-integer",
    "lone-surrogate": "json-string",
    "nan-number": "json-number",
    "nul-in-string": "json-string",
    "overlapping-items": "overlap",
    "region-of-both-kinds": "region",
    "region-outside-tensor": "region",
    "section-past-block": "section",
    "tampered-block": "block",
    "tensor-not-a-string": "type",
    "truncated-block": "block",
    "unknown-major": "major",
    "unknown-op": "op",
    "xor-without-repair": "repair",
    "v2-bytes-after-frame": "manifest-frame",
    "v2-declared-size-mismatch": "manifest-frame",
    "v2-declared-size-over-limit": "limit",
    "v2-duplicate-tensor": "rows",
    "v2-frame-without-checksum": "manifest-frame",
    "v2-long-section-digest": "rows",
    "v2-overlapping-items": "overlap",
    "v2-plain-json": "wrapping",
    "v2-short-section-digest": "rows",
    "v2-tampered-block": "block",
    "v2-tensor-index-out-of-range": "rows",
    "v2-tensor-name-in-item": "rows",
    "v2-unknown-major-3": "major",
    "v2-zstd-wrapped-v1": "wrapping",
}


def test_the_decoder_is_independent_of_dcr() -> None:
    source = (Path(__file__).parent / "reference_decoder.py").read_text()
    assert "dcr_cli" not in source.replace("imports nothing of dcr_cli", "")


@pytest.mark.parametrize("name", GOOD)
def test_vector_decodes_to_expected(name: str) -> None:
    expected = json.loads((VECTORS / name / "expected.json").read_text())
    assert ref.expected_json(VECTORS / name / "delta") == expected


@pytest.mark.parametrize("name", GOOD)
def test_vector_applies_to_target(name: str) -> None:
    base = json.loads((VECTORS / name / "base.json").read_text())
    target = json.loads((VECTORS / name / "target.json").read_text())
    assert ref.apply(VECTORS / name / "delta", base) == target


def test_a_wrong_base_is_refused() -> None:
    base = json.loads((VECTORS / "basic" / "base.json").read_text())
    base["i64.ids"]["hex"] = "ff" + base["i64.ids"]["hex"][2:]
    with pytest.raises(ref.Refused) as info:
        ref.apply(VECTORS / "basic" / "delta", base)
    assert info.value.rule == "fingerprint"


def test_every_bad_vector_has_a_rule() -> None:
    assert sorted(RULE_OF) == BAD
    assert all(rule in ref.RULES for rule in RULE_OF.values())


@pytest.mark.parametrize("name", BAD)
def test_bad_vector_is_refused_for_its_reason(name: str) -> None:
    assert (VECTORS / "bad" / name / "reason.txt").read_text().strip()
    with pytest.raises(ref.Refused) as info:
        ref.decode(VECTORS / "bad" / name / "delta")
    assert info.value.rule == RULE_OF[name], str(info.value)


def test_decoder_agrees_with_dcr_on_fresh_deltas(tmp_path: Path) -> None:
    """dcr diff writes a delta over every dtype and region kind; the reference decoder applies it to the
    same bits as the target checkpoint holds."""
    from checkpoints import read_bits
    from helpers_checkpoints import write_checkpoint

    from dcr_cli.format.dtypes import SUPPORTED
    from dcr_cli.format.dtypes import dtype as lookup_dtype
    from dcr_cli.produce import diff

    rng = np.random.default_rng(7)
    base, new = {}, {}
    for i, name in enumerate(SUPPORTED):
        uint = lookup_dtype(name).uint
        shape = (3, 70) if i % 2 else (300,)
        a = rng.integers(0, np.iinfo(uint).max, size=int(np.prod(shape)), dtype=uint, endpoint=True)
        b = a.copy()
        if i % 3 == 0:  # dense and compressible: dcr sends a replace
            b[rng.random(a.size) < 0.9] = 0
        else:  # sparse: xor
            flip = rng.random(a.size) < 0.05
            b[flip] ^= rng.integers(1, np.iinfo(uint).max, size=int(flip.sum()), dtype=uint, endpoint=True)
        b[-1] ^= 1
        base[f"t.{name}"] = (name, shape, a)
        new[f"t.{name}"] = (name, shape, b)
    write_checkpoint(tmp_path / "a", base)
    write_checkpoint(tmp_path / "b", new)
    diff(tmp_path / "a", tmp_path / "b", tmp_path / "d", workers=1)
    before = read_bits(tmp_path / "a")
    model = {n: {"dtype": d, "shape": list(s), "hex": before[n].hex()} for n, (d, s, _) in base.items()}
    after = ref.apply(tmp_path / "d", model)
    want = read_bits(tmp_path / "b")
    assert {n: bytes.fromhex(t["hex"]) for n, t in after.items()} == want
    ops = {it["op"] for it in manifest_v1(tmp_path / "d", rewrite=False)["items"]}
    assert ops >= {"xor", "replace"}
