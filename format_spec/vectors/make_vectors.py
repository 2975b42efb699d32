"""Regenerate the test vectors: `python format_spec/vectors/make_vectors.py`.

The vectors are committed; the test suite checks the committed files, so any change to the
encoder that would change them is visible in review.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import zstandard

from dcr_cli.delta.writer import DeltaWriter
from dcr_cli.format.codec import diff_region
from dcr_cli.format.digest import digest_bytes
from dcr_cli.format.dtypes import dtype as lookup_dtype
from dcr_cli.format.manifest import (
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    Region,
    TensorEntry,
    VersionRef,
    fingerprint,
    manifest_json,
)

HERE = Path(__file__).parent
CREATED = "2026-11-30T00:00:00Z"


def _tensors() -> tuple[dict, dict]:
    """(dtype, shape, base bits, target bits) for each tensor of the 'basic' vector."""
    rng = np.random.default_rng(20261130)
    bf = rng.integers(0x3C00, 0x3D00, size=64, dtype=np.uint16)
    bf_new = bf.copy()
    bf_new[[1, 2, 30, 63]] ^= np.array([0x0001, 0x0003, 0x0007, 0x8000], dtype=np.uint16)  # incl. sign flip
    f32 = np.array([0x7FC00001], dtype="<u4")  # a NaN with payload...
    f32_new = np.array([0x7FC00002], dtype="<u4")  # ...becomes another NaN payload
    i64 = np.arange(10, dtype="<u8")
    i64_new = i64.copy()
    i64_new[[0, 9]] = np.array([2**63, 2**64 - 1], dtype="<u8")
    box = np.arange(24, dtype=np.uint8)
    box_new = box.copy().reshape(2, 3, 4)
    box_new[1, 1:3, 2:4] ^= 0xFF
    zeros = np.array([0x8000, 0x0000], dtype="<u2")  # -0.0, +0.0 in F16
    zeros_new = np.array([0x0000, 0x8000], dtype="<u2")
    dense = np.array([0, 1, 0, 1], dtype=np.uint8)
    dense_new = np.array([1, 1, 0, 0], dtype=np.uint8)
    base = {
        "bf16.weight": ("BF16", [8, 8], bf),
        "f32.nan": ("F32", [], f32),
        "i64.ids": ("I64", [10], i64),
        "u8.box": ("U8", [2, 3, 4], box),
        "f16.zeros": ("F16", [2], zeros),
        "bool.mask": ("BOOL", [4], dense),
        "empty": ("BF16", [0, 4], np.zeros(0, dtype=np.uint16)),
    }
    target = dict(base)
    target.update(
        {
            "bf16.weight": ("BF16", [8, 8], bf_new),
            "f32.nan": ("F32", [], f32_new),
            "i64.ids": ("I64", [10], i64_new),
            "u8.box": ("U8", [2, 3, 4], box_new.reshape(-1)),
            "f16.zeros": ("F16", [2], zeros_new),
            "bool.mask": ("BOOL", [4], dense_new),
        }
    )
    return base, target


def _table(tensors: dict) -> dict[str, TensorEntry]:
    return {n: TensorEntry(d, tuple(s), digest_bytes(bits)) for n, (d, s, bits) in sorted(tensors.items())}


def _dump(tensors: dict) -> dict:
    return {
        n: {"dtype": d, "shape": s, "hex": bits.astype(lookup_dtype(d).uint).tobytes().hex()}
        for n, (d, s, bits) in sorted(tensors.items())
    }


def make_basic(name: str = "basic", major: int = 1) -> Path:
    """The basic vector as a delta of format ``major`` (basic: 1.0; basic-v2: the same changes as 2.0)."""
    out = HERE / name
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    base, target = _tensors()
    items = []
    # Flat ranges: two items over one tensor, xor.
    for start, stop in ((0, 32), (32, 64)):
        items.append(
            diff_region(
                "bf16.weight",
                Region.range(start, stop),
                base["bf16.weight"][2][start:stop],
                target["bf16.weight"][2][start:stop],
            )
        )
    items.append(diff_region("f32.nan", Region.box((), ()), base["f32.nan"][2], target["f32.nan"][2]))
    items.append(diff_region("i64.ids", Region.range(0, 10), base["i64.ids"][2], target["i64.ids"][2], op="overwrite"))
    # A box region, as a training shard's producer would emit it: the half tensor [1:2, 0:3, 0:4].
    b3, t3 = base["u8.box"][2].reshape(2, 3, 4), target["u8.box"][2].reshape(2, 3, 4)
    items.append(diff_region("u8.box", Region.box((1, 0, 0), (1, 3, 4)), b3[1:2].reshape(-1), t3[1:2].reshape(-1)))
    items.append(diff_region("f16.zeros", Region.range(0, 2), base["f16.zeros"][2], target["f16.zeros"][2]))
    items.append(diff_region("bool.mask", Region.range(0, 4), base["bool.mask"][2], target["bool.mask"][2]))
    # Level 3: the level these vectors' manifest frames were written with (any level is valid, delta-v2
    # §3.1), so that regenerating them gives the same bytes whatever dcr's writer defaults to.
    writer = DeltaWriter(out / "delta", major=major, manifest_level=3)
    for item in items:
        assert item is not None
        writer.add(item)
    manifest = writer.finish(
        VersionRef("v0", fingerprint(_table(base))),
        VersionRef("v1", fingerprint(_table(target))),
        _table(target),
        created=CREATED,
    )
    expected = []
    for item in manifest.items:
        d, shape, new_bits = target[item.tensor]
        _, _, old_bits = base[item.tensor]
        flat = item.region.to_canonical(np.arange(item.region.size), tuple(shape))
        if item.op != "replace":
            flat = flat[new_bits[flat] != old_bits[flat]]
        values = (old_bits[flat] ^ new_bits[flat]) if item.op == "xor" else new_bits[flat]
        expected.append(
            {
                "tensor": item.tensor,
                "op": item.op,
                "indices": flat.tolist(),
                "values_hex": values.astype(lookup_dtype(d).uint).tobytes().hex(),
            }
        )
    (out / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")
    (out / "base.json").write_text(json.dumps(_dump(base), indent=1) + "\n")
    (out / "target.json").write_text(json.dumps(_dump(target), indent=1) + "\n")
    return out


def make_bad(basic: Path) -> None:
    bad = HERE / "bad"
    shutil.rmtree(bad, ignore_errors=True)
    manifest = json.loads((basic / "delta" / MANIFEST_NAME).read_text())

    def variant(name: str, reason: str, edit_manifest=None, edit_blocks=None, edit_text=None) -> None:
        d = bad / name
        shutil.copytree(basic / "delta", d / "delta")
        m = json.loads(json.dumps(manifest))
        if edit_manifest:
            edit_manifest(m)
        text = json.dumps(m)
        if edit_text:  # what json.dumps cannot write: duplicate keys, 1,000 levels, NaN, lone surrogates
            edited = edit_text(text)
            assert edited != text, name
            text = edited
        (d / "delta" / MANIFEST_NAME).write_bytes(text.encode("utf-8", "surrogatepass"))
        if edit_blocks:
            edit_blocks(d / "delta")
        (d / "reason.txt").write_text(reason + "\n")

    def first_block(delta: Path) -> Path:
        return delta / "blocks" / manifest["blocks"][0]["id"]

    variant(
        "unknown-major",
        "format_version major 3 is unknown (dcr reads 1.x and 2.x; 2 is no longer unknown since delta-v2)",
        lambda m: m.__setitem__("format_version", [3, 0]),
    )
    variant("overlapping-items", "two items cover the same elements", lambda m: m["items"].append(m["items"][0]))
    variant(
        "section-past-block",
        "a section runs past the end of its block",
        lambda m: m["items"][0]["data"].__setitem__("length", 10**6),
    )
    variant(
        "region-outside-tensor",
        "a region lies outside its tensor",
        lambda m: m["items"][0]["region"].__setitem__("stop", 65),
    )
    variant("unknown-op", "op 'add' is not defined in 1.x", lambda m: m["items"][0].__setitem__("op", "add"))
    variant("xor-without-repair", "an xor item lacks its repair section", lambda m: m["items"][0].pop("repair"))

    def flip(delta: Path) -> None:
        p = first_block(delta)
        raw = bytearray(p.read_bytes())
        raw[5] ^= 0x10
        p.write_bytes(bytes(raw))

    def truncate(delta: Path) -> None:
        p = first_block(delta)
        p.write_bytes(p.read_bytes()[:-3])

    variant("tampered-block", "a block byte was changed: section digests no longer match", edit_blocks=flip)
    variant("truncated-block", "a block lost its last bytes", edit_blocks=truncate)

    # Item 0's data section plus one byte after its values frame, in a block of its own whose id,
    # size and section digest are all consistent: only the one-frame rule (§5.2) rejects it.
    section = manifest["items"][0]["data"]
    source = basic / "delta" / "blocks" / manifest["blocks"][section["block"]]["id"]
    padded = source.read_bytes()[section["offset"] : section["offset"] + section["length"]] + b"\0"

    def pad_frame(m: dict) -> None:
        m["blocks"].append({"id": digest_bytes(padded), "size": len(padded), "role": "data"})
        m["items"][0]["data"] = {
            **section,
            "block": len(m["blocks"]) - 1,
            "offset": 0,
            "length": len(padded),
            "digest": digest_bytes(padded),
        }

    def write_padded(delta: Path) -> None:
        (delta / "blocks" / digest_bytes(padded)).write_bytes(padded)

    variant(
        "bytes-after-frame",
        "a values frame is followed by a byte (digests consistent): a section is exactly one zstd frame",
        pad_frame,
        write_padded,
    )

    # JSON rules (§8, "JSON"). Each breaks one rule and nothing else: a lenient JSON reader accepts it.
    first_items = json.dumps(manifest["items"])
    variant(
        "duplicate-key",
        'the top-level object has "items" twice (the second drops item 0): an object MUST NOT repeat a member name',
        edit_text=lambda t: t.replace(
            '"items": ' + first_items, '"items": ' + first_items + ', "items": ' + json.dumps(manifest["items"][1:])
        ),
    )
    variant(
        "deep-nesting",
        "an unknown optional member nests 1000 arrays: nesting is limited to 64 levels, in ignored members too",
        lambda m: m.__setitem__("x-unknown", "@deep@"),
        edit_text=lambda t: t.replace('"@deep@"', "[" * 1000 + "]" * 1000),
    )
    variant(
        "huge-integer",
        "an unknown optional member holds a 4301-digit integer: at most 20 digits, in ignored members too",
        lambda m: m.__setitem__("x-unknown", "@int@"),
        edit_text=lambda t: t.replace('"@int@"', "7" * 4301),
    )
    variant(
        "nan-number",
        "an unknown optional member is NaN: NaN and Infinity are not JSON numbers",
        lambda m: m.__setitem__("x-unknown", "@nan@"),
        edit_text=lambda t: t.replace('"@nan@"', "NaN"),
    )
    variant(
        "lone-surrogate",
        "a tensor name holds the unpaired escape \\ud800: strings MUST be valid Unicode (no lone surrogates)",
        edit_text=lambda t: t.replace('"f16.zeros"', '"f16.\\ud800zeros"'),
    )
    variant(
        "nul-in-string",
        "the target version label holds \\u0000: strings MUST NOT contain NUL",
        edit_text=lambda t: t.replace('"version": "v1"', '"version": "v\\u00001"'),
    )
    variant(
        "tensor-not-a-string",
        "items[0].tensor is an object: every field has its type (§4.4), tensor is a string",
        lambda m: m["items"][0].__setitem__("tensor", {"name": m["items"][0]["tensor"]}),
    )
    variant(
        "bool-as-integer",
        "items[3].count is true: true and false are not integers",
        lambda m: m["items"][3].__setitem__("count", True),
    )
    variant(
        "float-as-integer",
        "items[3].count is written 2.0: an integer has no fraction or exponent",
        lambda m: m["items"][3].__setitem__("count", "@float@"),
        edit_text=lambda t: t.replace('"@float@"', "2.0"),
    )
    variant(
        "region-of-both-kinds",
        "items[0].region has start/stop and offsets/sizes: a region is a range or a box, not both (§4.5)",
        lambda m: m["items"][0]["region"].update({"offsets": [0, 0], "sizes": [4, 8]}),
    )


def _frame(text: bytes, checksum: bool = True) -> bytes:
    return zstandard.ZstdCompressor(level=3, write_checksum=checksum, write_content_size=True).compress(text)


def make_bad_v2(basic: Path) -> None:
    """Bad 2.0 deltas (vectors/bad/v2-*): each breaks one rule of delta-v2.md and nothing else."""
    bad = HERE / "bad"
    for old in bad.glob("v2-*"):
        shutil.rmtree(old)
    text = manifest_json((basic / "delta" / MANIFEST_NAME).read_bytes())
    manifest = json.loads(text)

    def variant(name: str, reason: str, edit=None, raw=None, edit_blocks=None) -> None:
        d = bad / f"v2-{name}"
        shutil.copytree(basic / "delta", d / "delta")
        if raw is None:
            m = json.loads(json.dumps(manifest))
            edit(m)
            raw = _frame(json.dumps(m, separators=(",", ":")).encode())
        (d / "delta" / MANIFEST_NAME).write_bytes(raw)
        if edit_blocks:
            edit_blocks(d / "delta")
        (d / "reason.txt").write_text(reason + "\n")

    variant("frame-without-checksum", "the manifest frame carries no content checksum", raw=_frame(text, False))
    variant(
        "bytes-after-frame",
        "one byte follows the manifest frame: manifest.json is exactly one frame",
        raw=_frame(text) + b"\0",
    )
    # Valid JSON padded with whitespace to one byte over the limit: only the size rule refuses it,
    # and a reader that checks the declared size first never decompresses it.
    over = text + b" " * (MAX_MANIFEST_BYTES + 1 - len(text))
    variant(
        "declared-size-over-limit",
        "the manifest frame declares 256 MiB + 1 bytes: over the manifest limit",
        raw=_frame(over),
    )
    frame = bytearray(_frame(text))
    params = zstandard.get_frame_parameters(bytes(frame))
    fcs_flag = frame[4] >> 6
    fcs_size = (1, 2, 4, 8)[fcs_flag] if (fcs_flag or frame[4] & 0x20) else 0
    assert fcs_size and params.content_size == len(text)
    fcs_at = 5 + (0 if frame[4] & 0x20 else 1) + (0, 1, 2, 4)[frame[4] & 3]
    declared = len(text) + 1 - (256 if fcs_size == 2 else 0)
    frame[fcs_at : fcs_at + fcs_size] = declared.to_bytes(fcs_size, "little")
    variant("declared-size-mismatch", "the manifest frame declares one byte more than it holds", raw=bytes(frame))
    v1 = json.loads(json.dumps(manifest))
    v1["format_version"] = [1, 0]
    variant(
        "zstd-wrapped-v1",
        "a manifest declaring 1.0 inside a zstd frame: a 1.x manifest is plain JSON",
        raw=_frame((basic.parent / "basic" / "delta" / MANIFEST_NAME).read_bytes()),
    )
    variant("plain-json", "a 2.0 manifest written as plain JSON: a 2.x manifest is one zstd frame", raw=text)
    variant(
        "unknown-major-3",
        "format_version major 3 inside the frame is unknown to a 2.x reader",
        lambda m: m.__setitem__("format_version", [3, 0]),
    )
    variant(
        "tensor-index-out-of-range",
        "items[0] names tensor 7 of a 7-tensor table",
        lambda m: m["items"][0].__setitem__(0, len(m["tensors"])),
    )
    variant(
        "short-section-digest",
        "items[0].data's digest has 30 hex characters, not 32",
        lambda m: m["items"][0][4].__setitem__(4, m["items"][0][4][4][:30]),
    )
    variant(
        "long-section-digest",
        "items[0].data's digest is the full 64-hex digest: 2.x section digests are 32",
        lambda m: m["items"][0][4].__setitem__(4, digest_bytes(b"x")),
    )
    variant(
        "duplicate-tensor",
        "the tensor table lists one name twice",
        lambda m: m["tensors"].append(list(m["tensors"][0])),
    )
    variant("overlapping-items", "two items cover the same elements", lambda m: m["items"].append(m["items"][0]))
    variant(
        "tensor-name-in-item",
        "items[0] names its tensor by name: a 2.x item holds a table index",
        lambda m: m["items"][0].__setitem__(0, m["tensors"][m["items"][0][0]][0]),
    )

    def flip(delta: Path) -> None:
        p = delta / "blocks" / manifest["blocks"][0][0]
        raw = bytearray(p.read_bytes())
        raw[5] ^= 0x10
        p.write_bytes(bytes(raw))

    variant(
        "tampered-block",
        "a block byte was changed: 128-bit section digests no longer match",
        raw=(basic / "delta" / MANIFEST_NAME).read_bytes(),
        edit_blocks=flip,
    )


if __name__ == "__main__":
    make_bad(make_basic())
    make_bad_v2(make_basic("basic-v2", major=2))
    print("vectors written to", HERE)
