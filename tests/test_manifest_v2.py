"""Format 2.0 manifests (format_spec/delta-v2.md): round trips, the frame and wrapping rules, the one
section-digest function, 2.0 from every writer, and dcr and the reference decoder agreeing on mutated 2.0
manifests."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import fuzz_support as fz
import numpy as np
import pytest
import reference_decoder as ref
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from manifest_text import as_major, manifest_text

from dcr_cli.errors import FormatError
from dcr_cli.format.digest import digest_bytes
from dcr_cli.format.manifest import (
    MANIFEST_NAME,
    ZSTD_MAGIC,
    BlockEntry,
    Item,
    Manifest,
    Region,
    Section,
    TensorEntry,
    VersionRef,
    manifest_json,
    parse_manifest,
    section_digest,
)

SETTINGS = settings(
    max_examples=fz.EXAMPLES,
    deadline=None,
    derandomize=not fz.RANDOM,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    database=None,
)
HEX64 = st.binary(min_size=32, max_size=32).map(bytes.hex)
HEX32 = st.binary(min_size=16, max_size=16).map(bytes.hex)
TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=12)


@st.composite
def manifests(draw: Any, major: int = 2) -> Manifest:
    """A random valid manifest: tensors of random dtypes and shapes, disjoint items of every op and region kind."""
    names = draw(st.lists(TEXT, min_size=1, max_size=6, unique=True))
    tensors = {}
    for name in names:
        shape = tuple(draw(st.lists(st.integers(0, 5), max_size=3)))
        tensors[name] = TensorEntry(draw(st.sampled_from(["BF16", "F32", "U8", "I64", "BOOL"])), shape, draw(HEX64))
    blocks = [BlockEntry(draw(HEX64), 1 << 20, "data"), BlockEntry(draw(HEX64), 1 << 20, "repair")]
    digest = HEX64 if major == 1 else HEX32
    items = []
    offset = 0
    for name, t in tensors.items():
        size = int(np.prod(t.shape)) if t.shape else 1
        if not draw(st.booleans()):
            continue
        if draw(st.booleans()) or not t.shape:
            region = Region.box(tuple(0 for _ in t.shape), t.shape)
        else:
            cut = draw(st.integers(0, size))
            region = Region.range(draw(st.integers(0, cut)), cut)
        op = draw(st.sampled_from(["xor", "overwrite", "replace"]))
        count = region.size if op == "replace" else draw(st.integers(0, region.size))
        length = draw(st.integers(0, 100))
        positions = 0 if op == "replace" else draw(st.integers(0, length))
        data = Section(0, offset, length, draw(digest))
        repair = Section(1, offset, 7, draw(digest)) if op == "xor" or draw(st.booleans()) else None
        offset += length
        residual = draw(st.none() | TEXT)
        changed = draw(st.none() | st.integers(0, count)) if op == "replace" else None
        items.append(
            Item(name, region, op, count, data, positions, draw(HEX64), draw(HEX64), repair, residual, changed)
        )
    extra = draw(st.dictionaries(st.sampled_from(["residual_tensors", "x-future"]), st.just({"a": "b"}), max_size=1))
    return Manifest(
        VersionRef(draw(TEXT), draw(HEX64)),
        VersionRef(draw(TEXT), draw(HEX64)),
        tensors,
        items,
        blocks,
        created=draw(TEXT),
        producer=draw(TEXT),
        minor=draw(st.integers(0, 3)),
        extra=extra,
        major=major,
    )


@SETTINGS
@given(m=manifests(major=2))
def test_v2_round_trip(m: Manifest) -> None:
    raw = m.to_json_bytes()
    assert raw[:4] == ZSTD_MAGIC
    parsed = parse_manifest(raw)
    assert parsed == m
    assert parsed.to_json_bytes() == raw  # encode(parse(x)) == x
    ref.read_manifest(raw)  # the independent decoder accepts what dcr writes


@SETTINGS
@given(m=manifests(major=1))
def test_v1_round_trip(m: Manifest) -> None:
    raw = m.to_json_bytes()
    assert raw[:1] == b"{"
    assert parse_manifest(raw) == m and parse_manifest(raw).to_json_bytes() == raw


def _basic(major: int) -> Manifest:
    root = Path(__file__).resolve().parents[1] / "format_spec" / "vectors" / ("basic" if major == 1 else "basic-v2")
    return parse_manifest((root / "delta" / MANIFEST_NAME).read_bytes())


def test_section_digest_is_one_function_of_the_major() -> None:
    data = b"section bytes"
    assert section_digest(data, 1) == digest_bytes(data)
    assert section_digest(data, 2) == digest_bytes(data)[:32] == digest_bytes(data, 16)
    assert _basic(1).section_digest(data) == section_digest(data, 1)
    assert _basic(2).section_digest(data) == section_digest(data, 2)


def test_the_two_majors_refuse_each_others_wrapping() -> None:
    v1, v2 = _basic(1), _basic(2)
    with pytest.raises(FormatError, match=r"zstd frame holding a format 1\.x manifest"):
        parse_manifest(zstandard.ZstdCompressor(write_checksum=True).compress(v1.to_json_bytes()))
    with pytest.raises(FormatError, match="plain JSON declaring format major version 2"):
        parse_manifest(v2.json_text())
    obj = json.loads(v2.json_text())
    obj["format_version"] = [3, 0]
    frame = zstandard.ZstdCompressor(write_checksum=True).compress(json.dumps(obj).encode())
    with pytest.raises(FormatError, match="major version 3 is not supported"):
        parse_manifest(frame)


def test_frame_without_content_size_is_refused() -> None:
    text = _basic(2).json_text()
    frame = zstandard.ZstdCompressor(write_checksum=True, write_content_size=False).compress(text)
    with pytest.raises(FormatError, match="does not declare its content size"):
        parse_manifest(frame)


def test_a_truncated_frame_is_refused() -> None:
    raw = _basic(2).to_json_bytes()
    for cut in (5, len(raw) // 2, len(raw) - 1):
        with pytest.raises(FormatError):
            parse_manifest(raw[:cut])


def test_unknown_row_elements_and_optional_members_are_ignored() -> None:
    m = _basic(2)
    obj = json.loads(m.json_text())
    obj["format_version"] = [2, 9]
    obj["x-future"] = [1]
    obj["blocks"][0].append("future")
    obj["tensors"][0].append({"future": 1})
    obj["items"][0] = [*obj["items"][0][:8], {"future": True}, "later"]
    parsed = parse_manifest(zstandard.ZstdCompressor(write_checksum=True).compress(json.dumps(obj).encode()))
    assert parsed.items == m.items and parsed.tensors == m.tensors and parsed.minor == 9


def test_v2_is_smaller_than_v1_and_names_no_tensor_twice() -> None:
    v1, v2 = _basic(1), _basic(2)
    assert len(v2.to_json_bytes()) < len(v1.to_json_bytes())
    text = v2.json_text().decode()
    for name in v2.tensors:
        assert text.count(json.dumps(name)) == 1  # items name tensors by index


def test_diff_writes_2_0_and_inspect_says_so(tmp_path: Path) -> None:
    from helpers_checkpoints import write_checkpoint

    import dcr_cli
    from dcr_cli.delta.inspect import inspect

    a = np.arange(64, dtype=np.uint16)
    b = a.copy()
    b[3] ^= 1
    write_checkpoint(tmp_path / "a", {"w": ("BF16", (8, 8), a)})
    write_checkpoint(tmp_path / "b", {"w": ("BF16", (8, 8), b)})
    dcr_cli.diff(tmp_path / "a", tmp_path / "b", tmp_path / "d", workers=1)
    raw = (tmp_path / "d" / MANIFEST_NAME).read_bytes()
    assert raw[:4] == ZSTD_MAGIC
    m = parse_manifest(raw)
    assert m.major == 2 and all(len(it.data.digest) == 32 for it in m.items)
    assert inspect(tmp_path / "d").format_version == "2.0"
    # The same delta at 1.0 (a 1.x writer's bytes) still reads, applies the same and inspects as 1.0.
    (tmp_path / "d" / MANIFEST_NAME).write_bytes(as_major(m, tmp_path / "d", 1).to_json_bytes())
    assert inspect(tmp_path / "d").format_version == "1.0"
    json.loads(manifest_text(tmp_path / "d"))


def test_a_v1_part_assembles_into_a_v1_delta(tmp_path: Path) -> None:
    """part.json without delta_major (a 1.x writer's) carries 64-hex section digests: assembled as 1.0."""
    from dcr_cli.delta.parts import PART_NAME, assemble, finish_part, part_dir
    from dcr_cli.delta.writer import DeltaWriter
    from dcr_cli.format.codec import diff_region

    a = np.arange(16, dtype=np.uint8)
    b = a.copy()
    b[[1, 9]] ^= 3
    for major in (1, 2):
        out = tmp_path / f"out{major}"
        writer = DeltaWriter(part_dir(out, 0), major=major)
        item = diff_region("t", Region.range(0, 16), a, b)
        assert item is not None
        writer.add(item)
        finish_part(
            writer,
            rank=0,
            world_size=1,
            layout={"t": ("U8", (16,))},
            base_digests={"t": digest_bytes(a)},
            target_digests={"t": digest_bytes(b)},
            residual={},
            base_version=None,
            target_version=None,
        )
        part = part_dir(out, 0) / PART_NAME
        obj = json.loads(part.read_text())
        if major == 1:
            del obj["delta_major"]  # as a 1.x writer wrote it
            part.write_text(json.dumps(obj))
        m = assemble(out)
        assert m.major == major and len(m.items[0].data.digest) == (64 if major == 1 else 32)
        assert parse_manifest((out / MANIFEST_NAME).read_bytes()) == m


def test_parts_must_agree_on_the_delta_major(tmp_path: Path) -> None:
    from dcr_cli.delta.parts import PART_NAME, _load_part, part_dir

    part = part_dir(tmp_path, 0)
    part.mkdir(parents=True)
    obj = {"format": "dcr.delta-part", "format_version": [1, 1], "delta_major": 3}
    obj.update(rank=0, world_size=1, tensors={}, base_digests={}, target_digests={}, blocks=[], items=[])
    (part / PART_NAME).write_text(json.dumps(obj))
    with pytest.raises(FormatError, match="delta_major 3 unsupported"):
        _load_part(part)


@SETTINGS
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(fz.MUTATIONS), st.integers(0, 1 << 20), st.integers(0, 1 << 20)),
        min_size=1,
        max_size=3,
    )
)
def test_dcr_and_the_reference_decoder_accept_the_same_v2_manifests(ops: list[tuple[str, int, int]]) -> None:
    """Mutations of a real 2.0 manifest's JSON, framed: both readers accept it, or both refuse it."""
    doc = json.loads(manifest_json((fz.world().deltas[0] / MANIFEST_NAME).read_bytes()))
    assert doc["format_version"][0] == 2
    _, text, what = fz.mutate_json(doc, ops)
    raw = zstandard.ZstdCompressor(write_checksum=True).compress(text)
    try:
        parse_manifest(raw)
        dcr_says = "accepts"
    except FormatError as exc:
        dcr_says = f"refuses: {exc}"
    try:
        ref.read_manifest(raw)
        ref_says = "accepts"
    except ref.Refused as exc:
        ref_says = f"refuses: {exc}"
    assert (dcr_says == "accepts") == (ref_says == "accepts"), f"{what}: dcr {dcr_says}; reference {ref_says}"


def test_writer_sections_use_the_writers_major(tmp_path: Path) -> None:
    from dcr_cli.delta.reader import Delta
    from dcr_cli.delta.writer import DeltaWriter
    from dcr_cli.format.codec import diff_region

    a = np.arange(32, dtype=np.uint16)
    b = a ^ 1
    for major in (1, 2):
        writer = DeltaWriter(tmp_path / f"d{major}", major=major)
        item = diff_region("t", Region.range(0, 32), a, b)
        assert item is not None
        writer.add(item)
        table = {"t": TensorEntry("U16", (32,), digest_bytes(b))}
        m = writer.finish(VersionRef("a", "0" * 64), VersionRef("b", "1" * 64), table)
        d = Delta.open(tmp_path / f"d{major}")
        assert d.manifest == m and d.manifest.major == major
        d.verify_blocks(roles=("data", "repair"))
        assert d.decode(d.manifest.items[0]).values.tolist() == [1] * 32
        damaged = dataclasses.replace(m.items[0].data, digest="0" * len(m.items[0].data.digest))
        with pytest.raises(Exception, match="digest mismatch"):
            d.read_section(damaged, "t")


def _generic_text(m: Manifest) -> bytes:
    """The 2.x document as ``json.dumps`` of its object gives it (the reference for the row templates)."""
    return m._json_text_v2_generic(
        {
            "format": "dcr.delta",
            "format_version": [m.major, m.minor],
            "producer": m.producer,
            "created": m.created,
            "base": {"version": m.base.version, "fingerprint": m.base.fingerprint},
            "target": {"version": m.target.version, "fingerprint": m.target.fingerprint},
        },
        {name: i for i, name in enumerate(m.tensors)},
    )


@SETTINGS
@given(m=manifests(major=2))
def test_v2_rows_written_from_templates_are_json_dumps_of_the_rows(m: Manifest) -> None:
    assert m.json_text() == _generic_text(m)


def test_v2_row_templates_keep_every_odd_field_as_json_dumps_writes_it() -> None:
    """Names that need escaping, extras that collide with a member or hold nested values, fields of
    unusual types (a bool count, a list shape): the document is still byte for byte json.dumps'."""
    data, repair = Section(0, 0, 10, "a" * 32), Section(1, 3, 4, "b" * 32)
    names = ['q"uote\\back', "ctl\x01\x1f", "uni é \u2028 \U0001f600", "plain", "box"]
    tensors = {n: TensorEntry("BF16", (4, 2), "c" * 64) for n in names}
    tensors["plain"] = TensorEntry("U8", [3, 1], "d" * 64)  # type: ignore[arg-type]  # a list shape
    items = [
        Item(names[0], Region.range(0, 8), "xor", 2, data, 3, "e" * 64, "f" * 64, repair),
        Item(names[1], Region.range(1, 5), "overwrite", True, data, 3, "e" * 64, "f" * 64, None),  # type: ignore[arg-type]
        Item(names[2], Region.range(0, 8), "replace", 8, data, 0, "e" * 64, "f" * 64, None, "cast", 5),
        Item("plain", Region.range(0, 3), "xor", 1, data, 2, "e" * 64, "f" * 64, repair, 'why "not"'),
        Item("box", Region.box((1, 0), (3, 2)), "xor", 1, data, 2, "e" * 64, "f" * 64, repair),
    ]
    ref_ = VersionRef('v"1', "0" * 64)
    for extra in ({}, {"items": [1], "x-future": {"a": [1, None, "é"]}}, {"residual_tensors": {names[0]: "cast"}}):
        m = Manifest(ref_, ref_, tensors, items, [], created="now", producer="p\n", extra=extra)
        assert m.json_text() == _generic_text(m)
        json.loads(m.json_text())
