"""dcr squash: a chain composed into one delta equals the chain, bit for bit, with digests that prove it."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers_checkpoints import Tensors, copy_checkpoint, read_raw, write_checkpoint
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from manifest_text import manifest_v1

import dcr_cli
from dcr_cli.checkpoints.safetensors_dir import SafetensorsCheckpoint
from dcr_cli.delta.reader import Delta
from dcr_cli.delta.squash import UnsquashableError
from dcr_cli.delta.writer import DeltaWriter
from dcr_cli.errors import IncompatibleError, IntegrityError
from dcr_cli.format.codec import diff_region
from dcr_cli.format.digest import digest_bytes
from dcr_cli.format.dtypes import SUPPORTED, numel
from dcr_cli.format.dtypes import dtype as lookup_dtype
from dcr_cli.format.manifest import Op, Region, TensorEntry, VersionRef, fingerprint

REPO = Path(__file__).resolve().parents[1]
FRAME_COST = 2 * 24  # two zstd frames' headers, block header, checksum and a few bytes of content
# zstd stores a block's literals raw where fewer than about 64 bytes of them are left (no Huffman table pays
# for itself there), so a frame of a few dozen bytes may come out up to that much larger than a nearly equal
# one: compressed sizes are neither monotone nor additive at this scale (hypothesis seed 5 found a squashed
# positions frame of 72 bytes stored raw, 85 B, where the chain's 74 bytes took 45 B).
SMALL_LITERALS = 64

# Bit patterns that float arithmetic would lose: NaN payloads, -0.0, +0.0, infinities (per width).
SPECIAL = {
    1: [0x00, 0x80, 0x7F, 0xFF, 0x79],
    2: [0x0000, 0x8000, 0x7FC1, 0xFF81, 0x7C01, 0xFC00],
    4: [0x00000000, 0x80000000, 0x7FC00001, 0xFFC00000, 0x7F800001],
    8: [0, 1 << 63, 0x7FF8000000000001, 0xFFF8000000000000],
}


# --------------------------------------------------------------------------- building chains


def table_of(tensors: Tensors) -> dict[str, TensorEntry]:
    return {
        n: TensorEntry(dt, shape, digest_bytes(np.ascontiguousarray(v, dtype=lookup_dtype(dt).uint)))
        for n, (dt, shape, v) in tensors.items()
    }


def layout_regions(kind: str, shape: tuple[int, ...]) -> list[Region]:
    """A producer's regions for one tensor: flat chunks, or boxes split along one axis (trainer shards)."""
    total = numel(shape)
    if kind == "whole":
        return [Region.range(0, total)]
    if kind == "ranges" or not shape:
        step = max(1, total // 3)
        return [Region.range(s, min(s + step, total)) for s in range(0, total, step)] or [Region.range(0, 0)]
    axis = 0 if kind == "rows" else len(shape) - 1
    parts = 2 if shape[axis] >= 2 else 1
    cuts = np.linspace(0, shape[axis], parts + 1).astype(int)
    regions = []
    for a, b in itertools.pairwise(cuts):
        offsets = [0] * len(shape)
        sizes = list(shape)
        offsets[axis], sizes[axis] = int(a), int(b - a)
        regions.append(Region.box(offsets, sizes))
    return regions


def region_values(values: np.ndarray, region: Region, shape: tuple[int, ...]) -> np.ndarray:
    local = np.arange(region.size, dtype=np.int64)
    return values[region.to_canonical(local, shape)] if region.size else values[:0]


def build_delta(
    out: Path, base: Tensors, new: Tensors, versions: tuple[str, str], layouts: dict[str, str], ops: dict[str, Op]
) -> Path:
    """A delta through the real codec and writer, with the given region layout per tensor."""
    writer = DeltaWriter(out)
    for name in sorted(new):
        _dt, shape, new_values = new[name]
        for region in layout_regions(layouts[name], shape):
            item = diff_region(
                name,
                region,
                region_values(base[name][2], region, shape),
                region_values(new_values, region, shape),
                op=ops[name],
            )
            if item is not None:
                writer.add(item)
    bt, nt = table_of(base), table_of(new)
    writer.finish(VersionRef(versions[0], fingerprint(bt)), VersionRef(versions[1], fingerprint(nt)), nt)
    return out


def step_values(rng: np.random.Generator, v0: np.ndarray, prev: np.ndarray, rate: float) -> np.ndarray:
    """The next version: some elements get random or special bits, some return to v0 or stay."""
    out = prev.copy()
    if not out.size:
        return out
    uint = out.dtype
    change = rng.random(out.size) < rate
    special = np.array(SPECIAL[uint.itemsize], dtype=uint)
    fresh = rng.integers(0, np.iinfo(uint).max, size=out.size, dtype=uint, endpoint=True)
    pick = rng.random(out.size) < 0.3
    fresh[pick] = special[rng.integers(0, len(special), size=int(pick.sum()))]
    out[change] = fresh[change]
    revert = rng.random(out.size) < rate / 2
    out[revert] = v0[revert]
    return out


def chain_versions(
    seed: int, specs: list[tuple[str, tuple[int, ...]]], steps: int, rates: list[float]
) -> list[Tensors]:
    rng = np.random.default_rng(seed)
    v0: Tensors = {}
    for i, (dt, shape) in enumerate(specs):
        uint = lookup_dtype(dt).uint
        v0[f"t{i}"] = (dt, shape, rng.integers(0, np.iinfo(uint).max, size=numel(shape), dtype=uint, endpoint=True))
    versions = [v0]
    for k in range(steps):
        prev = versions[-1]
        versions.append(
            {n: (dt, shape, step_values(rng, v0[n][2], vals, rates[k])) for n, (dt, shape, vals) in prev.items()}
        )
    return versions


def base_reader(ckpt: SafetensorsCheckpoint):
    return lambda name, flat: np.asarray(ckpt.view(name)[flat])


def check_digests(out: Path, first: Tensors, last: Tensors) -> None:
    """Independent of squash's code: every output item's pre/post are the first base's / last target's digests."""
    delta = Delta.open(out)
    for item in delta.manifest.items:
        _dt, shape, _ = last[item.tensor]
        decoded = delta.decode(item)
        local = np.arange(item.region.size) if decoded.positions is None else decoded.positions
        flat = item.region.to_canonical(local, shape)
        assert digest_bytes(first[item.tensor][2][flat]) == item.pre
        assert digest_bytes(last[item.tensor][2][flat]) == item.post
        if item.op == "xor":
            assert np.array_equal(decoded.values, first[item.tensor][2][flat] ^ last[item.tensor][2][flat])
            assert (decoded.values != 0).all()  # elements that returned to their base value dropped out
        else:
            assert np.array_equal(decoded.values, last[item.tensor][2][flat])


# --------------------------------------------------------------------------- property test

shapes = st.one_of(
    st.just(()),
    st.tuples(st.integers(1, 400)),
    st.tuples(st.integers(1, 16), st.integers(1, 24)),
    st.tuples(st.integers(1, 3), st.integers(1, 4), st.integers(1, 5)),
)
LAYOUTS = ("hf", "ranges", "whole", "rows", "cols")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 2**32 - 1),
    specs=st.lists(st.tuples(st.sampled_from(SUPPORTED), shapes), min_size=1, max_size=3),
    steps=st.integers(1, 4),
    rates=st.lists(st.sampled_from([0.01, 0.03, 0.1, 0.4, 0.9]), min_size=4, max_size=4),
    layouts=st.lists(st.sampled_from(LAYOUTS), min_size=4, max_size=4),
    overwrite=st.lists(st.one_of(st.just(0), st.just(0), st.integers(0, 7)), min_size=4, max_size=4),
    same_layout=st.booleans(),
)
def test_squash_equals_chain(
    tmp_path_factory: pytest.TempPathFactory,
    seed: int,
    specs: list[tuple[str, tuple[int, ...]]],
    steps: int,
    rates: list[float],
    layouts: list[str],
    overwrite: list[int],
    same_layout: bool,
) -> None:
    tmp = tmp_path_factory.mktemp("chain")
    versions = chain_versions(seed, specs, steps, rates)
    names = sorted(versions[0])
    for i, v in enumerate(versions):
        write_checkpoint(tmp / f"v{i}", v)
    deltas: list[Path] = []
    for k in range(steps):
        # Overwrite: a bit mask over the tensors, per delta (xor+overwrite mixes, also within one tensor's chain).
        ops: dict[str, Op] = {n: "overwrite" if overwrite[k] >> (j % 3) & 1 else "xor" for j, n in enumerate(names)}
        kind = layouts[0] if same_layout else layouts[k]
        out = tmp / f"d{k + 1}"
        if kind == "hf":
            globs = [n for n in names if ops[n] == "overwrite"]
            dcr_cli.diff(tmp / f"v{k}", tmp / f"v{k + 1}", out, base_version=f"v{k}", target_version=f"v{k + 1}",
                         overwrite=globs, workers=1)  # fmt: skip
        else:
            build_delta(out, versions[k], versions[k + 1], (f"v{k}", f"v{k + 1}"), dict.fromkeys(names, kind), ops)
        deltas.append(out)

    sq = tmp / "squash"
    try:
        summary = dcr_cli.squash(deltas, sq, workers=1)
        event("squashed from the chain alone")
    except UnsquashableError:
        event("refused; squashed with the base checkpoint")
        # Only an overwrite whose base values the chain lacks may be refused; the base checkpoint fills them in.
        assert any(it.op != "xor" for d in deltas for it in Delta.open(d).manifest.items)
        assert not sq.exists()
        with SafetensorsCheckpoint(tmp / "v0") as ckpt:
            summary = dcr_cli.squash(deltas, sq, workers=1, base_values=base_reader(ckpt))
    m = Delta.open(sq).manifest
    for op in sorted({it.op for it in m.items}):
        event(f"output has {op} items")
    first, last = Delta.open(deltas[0]).manifest, Delta.open(deltas[-1]).manifest
    assert (m.base, m.target, m.tensors) == (first.base, last.target, last.tensors)
    check_digests(sq, versions[0], versions[-1])
    # Never more than the chain, but for zstd's fixed cost (~2 x 13 bytes of frame headers and checksums) of
    # items beyond the chain's count: an overwrite whose base values only its own pre digest states keeps its
    # own item, which can cut a run of other changes in two (tiny tensors only; see test_train_tiny_stream);
    # and for zstd's raw literals in small frames (SMALL_LITERALS, each of an item's two frames).
    chain_items = sum(len(Delta.open(d).manifest.items) for d in deltas)
    extra = max(0, len(m.items) - chain_items)
    slack = FRAME_COST * extra + 2 * SMALL_LITERALS * len(m.items)
    assert summary.payload_bytes <= sum(Delta.open(d).manifest.payload_bytes() for d in deltas) + slack

    by_squash = copy_checkpoint(tmp / "v0", tmp / "by-squash")
    by_chain = copy_checkpoint(tmp / "v0", tmp / "by-chain")
    dcr_cli.apply(sq, into=by_squash, workers=1)
    for d in deltas:  # one by one: a step that changed nothing starts where the next one does
        dcr_cli.apply(d, into=by_chain, workers=1)
    assert read_raw(by_squash) == read_raw(by_chain) == read_raw(tmp / f"v{steps}")
    assert dcr_cli.verify(by_squash, against=sq).ok


# --------------------------------------------------------------------------- regions and fallbacks


def test_identical_boxes_are_kept(tmp_path: Path) -> None:
    versions = chain_versions(3, [("BF16", (8, 12)), ("F32", (6, 4))], 3, [0.1, 0.2, 0.1])
    deltas = []
    for k in range(3):
        out = tmp_path / f"d{k}"
        ops: dict[str, Op] = {"t0": "xor", "t1": "xor"}
        build_delta(out, versions[k], versions[k + 1], (f"v{k}", f"v{k + 1}"), {"t0": "cols", "t1": "rows"}, ops)
        deltas.append(out)
    dcr_cli.squash(deltas, tmp_path / "sq", workers=2)
    m = Delta.open(tmp_path / "sq").manifest
    assert m.items and all(it.region.is_box for it in m.items)
    assert {it.region for it in m.items} <= {it.region for d in deltas for it in Delta.open(d).manifest.items}
    check_digests(tmp_path / "sq", versions[0], versions[-1])


def test_replaced_every_step_stays_replace(tmp_path: Path) -> None:
    """A small tensor replaced in every delta keeps one dense item with the first delta's pre."""
    rng = np.random.default_rng(5)
    versions: list[Tensors] = [
        {
            n: ("BF16", (size,), rng.integers(0, 1 << 16, size=size, dtype=np.uint16))
            for n, size in (("a", 64), ("b", 300))
        }
        for _ in range(4)
    ]
    for i, v in enumerate(versions):
        write_checkpoint(tmp_path / f"v{i}", v)
    deltas = []
    for k in range(3):
        deltas.append(tmp_path / f"d{k}")
        dcr_cli.diff(tmp_path / f"v{k}", tmp_path / f"v{k + 1}", deltas[-1], workers=1)
    assert all(it.op == "replace" for d in deltas for it in Delta.open(d).manifest.items)
    dcr_cli.squash(deltas, tmp_path / "sq", workers=1)
    m = Delta.open(tmp_path / "sq").manifest
    assert [it.op for it in m.items] == ["replace", "replace"]
    assert {it.pre for it in m.items} == {it.pre for it in Delta.open(deltas[0]).manifest.items}
    check_digests(tmp_path / "sq", versions[0], versions[-1])


def test_overwrite_without_base_values_is_refused_then_base_fills_in(tmp_path: Path, dcr) -> None:
    """Overwrites with interleaving sets: the first base's values are in no delta; --base supplies them."""
    rng = np.random.default_rng(1)
    v0: Tensors = {"w": ("BF16", (1000,), rng.integers(0, 1 << 16, size=1000, dtype=np.uint16))}
    versions = [v0]
    for k in range(2):
        vals = versions[-1]["w"][2].copy()
        vals[k::7] ^= 0x0101
        versions.append({"w": ("BF16", (1000,), vals)})
    for i, v in enumerate(versions):
        write_checkpoint(tmp_path / f"v{i}", v)
    deltas = []
    for k in range(2):
        deltas.append(tmp_path / f"d{k}")
        dcr_cli.diff(tmp_path / f"v{k}", tmp_path / f"v{k + 1}", deltas[-1], overwrite=["w"], workers=1)
    proc = dcr("squash", *map(str, deltas), "-o", str(tmp_path / "sq"))
    assert proc.returncode == 2
    assert proc.stderr.startswith("dcr: error: cannot squash w:") and proc.stderr.count("\n") == 1
    assert not (tmp_path / "sq").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".sq")]  # no partial directory left
    dcr("squash", *map(str, deltas), "-o", str(tmp_path / "sq"), "--base", str(tmp_path / "v0"), check=True)
    assert all(it.op == "overwrite" for it in Delta.open(tmp_path / "sq").manifest.items)
    check_digests(tmp_path / "sq", versions[0], versions[-1])
    recv = copy_checkpoint(tmp_path / "v0", tmp_path / "recv")
    dcr_cli.apply(tmp_path / "sq", into=recv, workers=1)
    assert read_raw(recv) == read_raw(tmp_path / "v2")
    # A base checkpoint at another version is caught by the deltas' own pre digests.
    with (
        pytest.raises(IncompatibleError, match="does not hold version"),
        SafetensorsCheckpoint(tmp_path / "v1") as ckpt,
    ):
        dcr_cli.squash(deltas, tmp_path / "sq-wrong", workers=1, base_values=base_reader(ckpt))


def test_gap_and_order_are_refused(tmp_path: Path, dcr) -> None:
    versions = chain_versions(9, [("BF16", (50,))], 3, [0.1, 0.1, 0.1])
    for i, v in enumerate(versions):
        write_checkpoint(tmp_path / f"v{i}", v)
    d = [tmp_path / f"d{k}" for k in range(3)]
    for k in range(3):
        dcr_cli.diff(tmp_path / f"v{k}", tmp_path / f"v{k + 1}", d[k], base_version=f"v{k}",
                     target_version=f"v{k + 1}", workers=1)  # fmt: skip
    for args, words in (
        ((d[0], d[2]), "gap in the chain"),
        ((d[1], d[0], d[2]), "out of order"),
        ((d[0], d[2], d[1]), "out of order"),
        ((d[0], d[1], d[1]), "twice"),
    ):
        proc = dcr("squash", *map(str, args), "-o", str(tmp_path / "sq"))
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.startswith("dcr: error: ") and words in proc.stderr and proc.stderr.count("\n") == 1
        assert not (tmp_path / "sq").exists()
    # A directory of deltas is ordered by its chain, whatever the names.
    (tmp_path / "dir").mkdir()
    for k, name in enumerate(("zz", "aa", "mm")):
        os.rename(d[k], tmp_path / "dir" / name)
    proc = dcr("squash", str(tmp_path / "dir"), "-o", str(tmp_path / "sq"), "--json", check=True)
    assert '"target_version": "v3"' in proc.stdout
    recv = copy_checkpoint(tmp_path / "v0", tmp_path / "recv")
    dcr_cli.apply(tmp_path / "sq", into=recv, workers=1)
    assert read_raw(recv) == read_raw(tmp_path / "v3")


def test_corrupt_repair_values_are_caught(tmp_path: Path) -> None:
    """A repair section that decodes but holds other values fails the item's digests, not the output."""
    versions = chain_versions(2, [("F32", (200,))], 2, [0.2, 0.2])
    deltas = []
    for k in range(2):
        deltas.append(tmp_path / f"d{k}")
        build_delta(deltas[-1], versions[k], versions[k + 1], ("a", "b"), {"t0": "whole"}, {"t0": "xor"})
    # Re-write the second delta's repair values as base values: a well-formed frame, wrong content.
    manifest_v1(deltas[1])  # its manifest as 1.0 JSON, so that digests can be swapped in the text
    delta = Delta.open(deltas[1])
    (item,) = delta.manifest.items
    wrong = delta.repair_values(item) ^ delta.decode(item).values
    from dcr_cli.format.codec import encode_values

    frame = encode_values(wrong)
    assert item.repair is not None
    block = delta.manifest.blocks[item.repair.block]
    data = bytearray((deltas[1] / block.path).read_bytes())
    assert len(frame) == item.repair.length  # same size: a swap of values, not of lengths
    data[item.repair.offset : item.repair.offset + item.repair.length] = frame
    raw = (deltas[1] / "manifest.json").read_text()
    new_id = digest_bytes(bytes(data))
    raw = raw.replace(item.repair.digest, digest_bytes(frame)).replace(block.id, new_id)
    (deltas[1] / block.path).unlink()
    (deltas[1] / "blocks" / new_id).write_bytes(bytes(data))
    (deltas[1] / "manifest.json").write_text(raw)
    with pytest.raises(IntegrityError, match="post digest"):
        dcr_cli.squash(deltas, tmp_path / "sq", workers=1)
    assert not (tmp_path / "sq").exists()


# --------------------------------------------------------------------------- a real training stream


def test_train_tiny_stream(tmp_path: Path, dcr) -> None:
    subprocess.run(
        [sys.executable, str(REPO / "examples" / "train_tiny.py"), str(tmp_path / "ck"), "--steps", "5"],
        check=True,
        capture_output=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=600,
    )
    ck = tmp_path / "ck"
    deltas = []
    for k in range(1, 6):
        deltas.append(tmp_path / "d" / f"step-{k}")
        dcr("diff", str(ck / f"step-{k - 1}"), str(ck / f"step-{k}"), "-o", str(deltas[-1]),
            "--base-version", f"step-{k - 1}", "--target-version", f"step-{k}", check=True)  # fmt: skip
    dcr("squash", *map(str, deltas), "-o", str(tmp_path / "sq"), check=True)
    dcr("squash", *map(str, deltas[2:]), "-o", str(tmp_path / "sq25"), check=True)
    chain_bytes = sum(Delta.open(d).manifest.payload_bytes() for d in deltas)
    m = Delta.open(tmp_path / "sq").manifest
    assert (m.base.version, m.target.version) == ("step-0", "step-5")
    assert m.payload_bytes() < chain_bytes
    recv = copy_checkpoint(ck / "step-0", tmp_path / "recv")
    dcr("apply", str(tmp_path / "sq"), "--into", str(recv), check=True)
    assert read_raw(recv) == read_raw(ck / "step-5")
    dcr("verify", str(recv), "--against", str(deltas[-1]), check=True)
    recv2 = copy_checkpoint(ck / "step-2", tmp_path / "recv2")
    dcr("apply", str(tmp_path / "sq25"), "--into", str(recv2), check=True)
    assert read_raw(recv2) == read_raw(ck / "step-5")


def test_missing_repair_blocks_are_named(tmp_path: Path, dcr) -> None:
    """A delta pulled without --repair lacks the xor items' target values: one line says what to do."""
    versions = chain_versions(4, [("BF16", (300,))], 2, [0.1, 0.1])
    deltas = []
    for k in range(2):
        deltas.append(tmp_path / f"d{k}")
        build_delta(deltas[-1], versions[k], versions[k + 1], ("a", "b"), {"t0": "whole"}, {"t0": "xor"})
    (repair,) = [b for b in Delta.open(deltas[1]).manifest.blocks if b.role == "repair"]
    (deltas[1] / repair.path).unlink()
    proc = dcr("squash", *map(str, deltas), "-o", str(tmp_path / "sq"))
    assert proc.returncode == 2 and "pull with --repair" in proc.stderr and proc.stderr.count("\n") == 1
    assert not (tmp_path / "sq").exists()
