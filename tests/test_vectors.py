"""The committed test vectors of format_spec/vectors decode as the spec says (format_spec/delta-v1.md §10)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from dcr_cli.delta.reader import Delta
from dcr_cli.errors import FormatError
from dcr_cli.format.digest import digest_bytes
from dcr_cli.format.dtypes import dtype as lookup_dtype
from dcr_cli.format.manifest import TensorEntry, fingerprint

VECTORS = Path(__file__).resolve().parents[1] / "format_spec" / "vectors"


def _load(path: Path) -> dict[str, tuple[str, list[int], np.ndarray]]:
    out = {}
    for name, t in json.loads(path.read_text()).items():
        out[name] = (
            t["dtype"],
            t["shape"],
            np.frombuffer(bytes.fromhex(t["hex"]), dtype=lookup_dtype(t["dtype"]).uint),
        )
    return out


@pytest.mark.parametrize(("name", "major"), [("basic", 1), ("basic-v2", 2)])
def test_basic_vector_decodes_and_applies(name: str, major: int) -> None:
    root = VECTORS / name
    delta = Delta.open(root / "delta")
    delta.verify_blocks(roles=("data", "repair"))
    assert delta.manifest.major == major
    expected = json.loads((root / "expected.json").read_text())
    base, target = _load(root / "base.json"), _load(root / "target.json")
    assert len(expected) == len(delta.manifest.items)
    state = {name: bits.copy() for name, (_, _, bits) in base.items()}
    for item, want in zip(delta.manifest.items, expected, strict=True):
        entry = delta.manifest.tensors[item.tensor]
        decoded = delta.decode(item)
        local = np.arange(item.region.size) if decoded.positions is None else decoded.positions
        flat = item.region.to_canonical(local, entry.shape)
        assert (item.tensor, item.op) == (want["tensor"], want["op"])
        assert flat.tolist() == want["indices"]
        assert decoded.values.tobytes().hex() == want["values_hex"]
        assert digest_bytes(state[item.tensor][flat]) == item.pre
        state[item.tensor][flat] = (state[item.tensor][flat] ^ decoded.values) if item.op == "xor" else decoded.values
        assert digest_bytes(state[item.tensor][flat]) == item.post
        if item.op == "xor":
            assert delta.repair_values(item).tobytes() == state[item.tensor][flat].tobytes()
    for name, (dt, shape, bits) in target.items():
        assert state[name].tobytes() == bits.tobytes(), name
        assert delta.manifest.tensors[name] == TensorEntry(dt, tuple(shape), digest_bytes(bits))
    base_table = {n: TensorEntry(d, tuple(s), digest_bytes(b)) for n, (d, s, b) in base.items()}
    assert fingerprint(base_table) == delta.manifest.base.fingerprint
    assert fingerprint(delta.manifest.tensors) == delta.manifest.target.fingerprint


def test_empty_digest_is_blake3_of_nothing():
    assert digest_bytes(b"").startswith("af1349b9")


# What dcr's refusal of each bad vector says: it must be refused for the reason in its reason.txt,
# not for some other damage (tests/test_reference_decoder.py checks the same for the independent decoder).
REFUSED_BECAUSE = {
    "bool-as-integer": "count must be an integer",
    "bytes-after-frame": "follow the zstd frame",
    "deep-nesting": "nested 1001 levels",
    "duplicate-key": "duplicate key 'items'",
    "float-as-integer": "count must be an integer",
    "huge-integer": "4301 digits",
    "lone-surrogate": "lone surrogate",
    "nan-number": "NaN",
    "nul-in-string": "NUL",
    "overlapping-items": "overlap",
    "region-of-both-kinds": "not both",
    "region-outside-tensor": "outside",
    "section-past-block": "past the end of its block",
    "tampered-block": "corrupt",
    "tensor-not-a-string": "tensor must be a string",
    "truncated-block": "truncated",
    "unknown-major": "major version 3",  # was 2 before delta-v2 made major 2 known
    "unknown-op": "unknown op 'add'",
    "xor-without-repair": "repair section",
    "v2-bytes-after-frame": "1 bytes follow the zstd frame",
    "v2-declared-size-mismatch": "corrupt zstd frame",
    "v2-declared-size-over-limit": "declares 268435457 bytes, over the 268435456 byte limit",
    "v2-duplicate-tensor": "in the table twice",
    "v2-frame-without-checksum": "carries no content checksum",
    "v2-long-section-digest": "section digest must be 32 lowercase hex",
    "v2-overlapping-items": "overlap",
    "v2-plain-json": "plain JSON declaring format major version 2",
    "v2-short-section-digest": "section digest must be 32 lowercase hex",
    "v2-tampered-block": "corrupt",
    "v2-tensor-index-out-of-range": "tensor index 7 is out of range",
    "v2-tensor-name-in-item": "tensor must be an integer",
    "v2-unknown-major-3": "major version 3",
    "v2-zstd-wrapped-v1": "zstd frame holding a format 1.x manifest",
}


def test_basic_vectors_hold_the_same_changes() -> None:
    """basic-v2 is basic written as 2.0: same tables, items and decoded values; a smaller manifest."""
    one, two = Delta.open(VECTORS / "basic" / "delta"), Delta.open(VECTORS / "basic-v2" / "delta")
    assert one.manifest.tensors == two.manifest.tensors
    assert (one.manifest.base, one.manifest.target) == (two.manifest.base, two.manifest.target)
    for a, b in zip(one.manifest.items, two.manifest.items, strict=True):
        assert (a.tensor, a.region, a.op, a.count, a.pre, a.post) == (b.tensor, b.region, b.op, b.count, b.pre, b.post)
        assert a.data.digest[:32] == b.data.digest and len(b.data.digest) == 32
    for name in ("expected.json", "base.json", "target.json"):
        assert (VECTORS / "basic" / name).read_bytes() == (VECTORS / "basic-v2" / name).read_bytes()
    assert two.manifest_bytes < one.manifest_bytes


def test_every_bad_vector_has_a_reason() -> None:
    cases = sorted(p.name for p in (VECTORS / "bad").iterdir())
    assert cases == sorted(REFUSED_BECAUSE)
    for case in cases:
        assert (VECTORS / "bad" / case / "reason.txt").read_text().strip()


@pytest.mark.parametrize("case", sorted(p.name for p in (VECTORS / "bad").iterdir()))
def test_bad_vectors_are_rejected(case: str):
    path = VECTORS / "bad" / case / "delta"
    with pytest.raises(FormatError, match=re.escape(REFUSED_BECAUSE[case])):
        delta = Delta.open(path)
        delta.verify_blocks(roles=("data", "repair"))
        for item in delta.manifest.items:
            delta.decode(item)
            if item.repair is not None:
                delta.repair_values(item)
