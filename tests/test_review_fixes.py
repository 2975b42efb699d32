"""Regression tests for defects found in review: each fails on the code before its fix."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
from manifest_text import manifest_v1

from dcr_cli.checkpoints.safetensors_dir import SafetensorsCheckpoint
from dcr_cli.errors import FormatError


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


def _part_obj(**fields: object) -> dict:
    obj: dict = {
        "format": "dcr.delta-part",
        "format_version": [1, 0],
        "rank": 0,
        "world_size": 1,
        "tensors": {},
        "base_digests": {},
        "target_digests": {},
        "blocks": [],
        "items": [],
    }
    obj.update(fields)
    return obj


@pytest.mark.parametrize(
    "part",
    [
        "[1]",
        '{"format": "dcr.delta-part", "format_version": []}',
        json.dumps({"format": "dcr.delta-part", "format_version": [1, 0]}),
        json.dumps(_part_obj(items=[{"tensor": "x"}])),
        json.dumps(_part_obj(tensors={"x": 5})),
        json.dumps(_part_obj(blocks=[{"id": "../../escaped", "size": 1, "role": "data"}])),
        '{"format": "dcr.delta-part", "truncat',
    ],
)
def test_assemble_of_a_malformed_part_is_a_one_line_error(tmp_path: Path, part: str) -> None:
    from click.testing import CliRunner

    from dcr_cli.cli import main

    rank = tmp_path / "out" / "parts" / "rank-00000"
    rank.mkdir(parents=True)
    (rank / "part.json").write_text(part)
    result = CliRunner().invoke(main, ["assemble", str(tmp_path / "out")])
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("dcr: error: ") and "part" in result.stderr


def test_assemble_never_moves_a_file_named_by_a_path_as_block_id(tmp_path: Path) -> None:
    from dcr_cli.delta.parts import assemble

    rank = tmp_path / "out" / "parts" / "rank-00000"
    (rank / "blocks").mkdir(parents=True)
    victim = tmp_path / "out" / "parts" / "victim"  # = rank/blocks/../../victim
    victim.write_bytes(b"x")
    part = _part_obj(blocks=[{"id": "../../victim", "size": 1, "role": "data"}])
    (rank / "part.json").write_text(json.dumps(part))
    with pytest.raises(FormatError):
        assemble(tmp_path / "out")
    assert victim.read_bytes() == b"x"
    assert not (tmp_path / "victim").exists()  # = out/blocks/../../victim


def test_inspect_prints_bracketed_labels_and_names_verbatim(tmp_path: Path) -> None:
    """Manifest strings are data, not rich markup: "[/]" used to raise MarkupError (a traceback)."""
    from click.testing import CliRunner
    from helpers_checkpoints import write_checkpoint

    from dcr_cli.cli import main
    from dcr_cli.produce import diff

    values = np.arange(8, dtype=np.uint32)
    write_checkpoint(tmp_path / "a", {"w[/]": ("F32", (8,), values)})
    write_checkpoint(tmp_path / "b", {"w[/]": ("F32", (8,), values + 1)})
    diff(tmp_path / "a", tmp_path / "b", tmp_path / "d", base_version="[/]", target_version="[bold]v1", workers=1)
    result = CliRunner().invoke(main, ["inspect", str(tmp_path / "d")])
    assert result.exit_code == 0, result.output
    assert "[/] -> [bold]v1" in result.stdout and "w[/]" in result.stdout


@pytest.mark.parametrize("damage", ["trailing byte", "second frame", "no checksum", "cut inside the checksum"])
def test_a_section_must_be_exactly_one_checksummed_zstd_frame(damage: str) -> None:
    """zstd's one-shot decoder ignores bytes after the first frame; the reader must not (spec §5.2)."""
    import zstandard

    from dcr_cli.errors import IntegrityError
    from dcr_cli.format.codec import decompress_exact, encode_values

    values = np.arange(1000, dtype=np.uint16)
    frame = encode_values(values)
    assert len(decompress_exact(frame, 2000, "ok")) == 2000
    bad = {
        "trailing byte": frame + b"\0",
        "second frame": frame + encode_values(values),
        "no checksum": zstandard.ZstdCompressor(write_checksum=False).compress(bytes(2000)),
        "cut inside the checksum": frame[:-2],
    }[damage]
    with pytest.raises(IntegrityError):
        decompress_exact(bad, 2000, "values")


def test_digests_of_a_file_written_while_hashed_are_not_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The cache key was taken after hashing: digests of the old bytes were filed under the new file's key."""
    import time

    from helpers_checkpoints import write_checkpoint

    from dcr_cli.format.digest import digest_bytes

    monkeypatch.setenv("DCR_CACHE_DIR", str(tmp_path / "cache"))
    write_checkpoint(tmp_path / "c", {"w": ("U8", (64,), np.zeros(64, dtype=np.uint8))})
    ckpt = SafetensorsCheckpoint(tmp_path / "c")
    hashed = {"w": digest_bytes(ckpt.view("w"))}
    ckpt.close()
    time.sleep(0.05)  # past the file system's timestamp granularity
    loc = SafetensorsCheckpoint(tmp_path / "c").tensors["w"]
    with open(loc.file, "r+b") as f:  # the trainer rewrites the file in place, same size
        f.seek(loc.start)
        f.write(b"\x01")
    ckpt.remember_digests(hashed)
    with SafetensorsCheckpoint(tmp_path / "c") as fresh:
        assert fresh.tensor_digests()["w"] == digest_bytes(fresh.view("w"))


def test_an_empty_range_overlaps_nothing_but_real_overlaps_are_refused() -> None:
    """Overlap means an element in two items (spec §4.4); an empty range holds no element."""
    from dcr_cli.format.manifest import parse_manifest

    whole = ({"start": 0, "stop": 8}, 8)
    assert len(parse_manifest(_manifest_with_items([8], [whole, ({"start": 4, "stop": 4}, 0)])).items) == 2
    with pytest.raises(FormatError, match="overlap"):
        parse_manifest(_manifest_with_items([8], [whole, ({"start": 7, "stop": 8}, 1)]))


def test_ranges_and_boxes_never_mix_even_when_one_is_empty() -> None:
    from dcr_cli.format.manifest import parse_manifest

    raw = _manifest_with_items([8], [({"start": 0, "stop": 8}, 8), ({"offsets": [3], "sizes": [0]}, 0)])
    with pytest.raises(FormatError, match="mix"):
        parse_manifest(raw)


@pytest.mark.parametrize("text", ["[1]", '"config"', "7"])
def test_megatron_profile_that_is_not_an_object_is_a_clear_error(tmp_path: Path, text: str) -> None:
    from dcr_cli.checkpoints.megatron import load_profile
    from dcr_cli.errors import IncompatibleError

    (tmp_path / "config.json").write_text(text)
    with pytest.raises(IncompatibleError, match="not a JSON object"):
        load_profile(tmp_path)


def test_a_safetensors_symlink_out_of_the_checkpoint_is_refused_like_an_index_name(tmp_path: Path) -> None:
    """Without an index, the glob followed symlinks anywhere: apply would write into the link's target."""
    from helpers_checkpoints import write_checkpoint

    outside = write_checkpoint(tmp_path / "blobs", {"w": ("U8", (4,), np.zeros(4, dtype=np.uint8))})
    ckpt = tmp_path / "snapshot"
    ckpt.mkdir()
    (ckpt / "model.safetensors").symlink_to(outside / "model.safetensors")
    with pytest.raises(FormatError, match="would escape"):
        SafetensorsCheckpoint(ckpt)


def test_changed_is_read_for_replace_items_only(tmp_path: Path) -> None:
    """Spec §4.4: `changed` is informative for replace; on xor it made inspect under-count changes."""
    from helpers_checkpoints import write_checkpoint

    from dcr_cli.format.manifest import parse_manifest
    from dcr_cli.produce import diff

    values = np.zeros(4096, dtype=np.uint16)
    changed = values.copy()
    changed[::64] = 1
    write_checkpoint(tmp_path / "a", {"w": ("BF16", (4096,), values)})
    write_checkpoint(tmp_path / "b", {"w": ("BF16", (4096,), changed)})
    diff(tmp_path / "a", tmp_path / "b", tmp_path / "d", workers=1)
    obj = manifest_v1(tmp_path / "d")
    assert obj["items"][0]["op"] == "xor"
    obj["items"][0]["changed"] = 0
    item = parse_manifest(json.dumps(obj).encode()).items[0]
    assert item.changed is None and item.changed_elements == 64


def test_assemble_refuses_parts_that_disagree_on_the_version_labels(tmp_path: Path) -> None:
    """The manifest took rank 0's labels: a rank run with another --target-version went unnoticed."""
    from dcr_cli.delta.parts import assemble

    for rank, label in ((0, "v1"), (1, "v2")):
        d = tmp_path / "out" / "parts" / f"rank-{rank:05d}"
        d.mkdir(parents=True)
        part = _part_obj(rank=rank, world_size=2, base_version="v0", target_version=label)
        (d / "part.json").write_text(json.dumps(part))
    with pytest.raises(FormatError, match="target_version"):
        assemble(tmp_path / "out")
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_hardlinked_checkpoint_file_is_refused(tmp_path):
    import os

    import pytest
    from checkpoints import read_bits
    from store_fixtures import make_deltas

    import dcr_cli
    from dcr_cli.errors import IncompatibleError

    ckpts, deltas = make_deltas(tmp_path / "src", 1)
    receiver = tmp_path / "receiver"
    receiver.mkdir()
    for f in ckpts[0].iterdir():
        os.link(f, receiver / f.name)  # a cp -al snapshot: same inodes as the source checkpoint
    with pytest.raises(IncompatibleError, match="hard links"):
        dcr_cli.apply(deltas[0], into=receiver)
    assert read_bits(ckpts[0]) == read_bits(receiver)  # neither name of the file was changed


def test_nan_rate_and_duration_are_refused():
    import pytest

    from dcr_cli.cli.store_options import parse_duration, parse_rate
    from dcr_cli.errors import DcrError

    for bad in ("nan", "inf"):
        with pytest.raises(DcrError):
            parse_rate(bad)
        with pytest.raises(DcrError):
            parse_duration(bad)
