"""The large-tensor diff path at memory bandwidth: the change scan's exactness, and hashing while scanning.

The scan kernel compares 64-bit words with unsigned indices; these tests pin what it must find on every
width, odd sizes, unaligned views, resumed scans, NaN payloads and signed zeros (bits, not float
equality), and that the tile-by-tile hashing of the engine (inline, on a helper thread, or switching
between the two from one range to the next) digests exactly the tensor's bytes and writes the same delta.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import blake3
import numpy as np
import pytest
import torch
from checkpoints import write_checkpoint
from hypothesis import given, settings
from hypothesis import strategies as st
from manifest_text import manifest_text

import dcr_cli.produce.engine as engine
import dcr_cli.produce.plan as plan_module
from dcr_cli.delta.reader import Delta
from dcr_cli.format.digest import digest_bytes
from dcr_cli.format.kernels import GROUP_WORDS, scan_changes
from dcr_cli.produce import diff

# Bit patterns that float comparison gets wrong: NaNs with different payloads and signs, +0 and -0,
# infinities, subnormals (per width: 1 = FP8 E4M3, 2 = BF16/F16, 4 = F32, 8 = F64).
SPECIAL = {
    1: [0x7F, 0xFF, 0x00, 0x80, 0x01, 0x81],
    2: [0x7FC0, 0x7FC1, 0xFFC0, 0x7F80, 0xFF80, 0x0000, 0x8000, 0x0001, 0x7E00, 0x7E01, 0xFE00],
    4: [0x7FC00000, 0x7FC00001, 0xFFC00000, 0x7F800000, 0x00000000, 0x80000000, 0x00000001, 0x7F800001],
    8: [0x7FF8000000000000, 0x7FF8000000000001, 0xFFF8000000000000, 0, 1 << 63, 1, 0x7FF0000000000000],
}


def _reference(base: np.ndarray, new: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    positions = np.flatnonzero(base != new)
    return positions, base[positions] ^ new[positions], new[positions]


def _assert_scan(base: np.ndarray, new: np.ndarray, **kw: object) -> None:
    got = scan_changes(base, new, **kw)  # type: ignore[arg-type]
    want = _reference(base, new)
    assert got[0].dtype == np.int64 and got[1].dtype == base.dtype and got[2].dtype == base.dtype
    for g, w in zip(got, want, strict=True):
        assert np.array_equal(g, w)


@settings(max_examples=80, deadline=None)
@given(
    width=st.sampled_from([1, 2, 4, 8]),
    n=st.integers(min_value=0, max_value=40_000),
    offset=st.integers(min_value=0, max_value=7),
    rate=st.sampled_from([0.0, 0.001, 0.03, 0.3, 1.0]),
    special=st.booleans(),
    seed=st.integers(min_value=0, max_value=2**32 - 1),
)
def test_scan_finds_exactly_the_changed_bits(
    width: int, n: int, offset: int, rate: float, special: bool, seed: int
) -> None:
    """Odd sizes (a tail shorter than a word, groups shorter than GROUP_WORDS), views that start at
    any element of a word (unaligned 64-bit loads), NaN payloads and signed zeros."""
    uint = np.dtype(f"<u{width}")
    rng = np.random.default_rng(seed)
    pool = np.array(SPECIAL[width], dtype=uint)
    buf_b = rng.integers(0, np.iinfo(uint).max, size=n + offset, dtype=uint, endpoint=True)
    if special:
        buf_b = pool[rng.integers(0, len(pool), size=n + offset)]
    buf_n = buf_b.copy()
    hit = rng.random(n + offset) < rate
    if special:  # another special pattern (a NaN with another payload, the other zero), or the same one
        buf_n[hit] = pool[rng.integers(0, len(pool), size=int(hit.sum()))]
    else:
        buf_n[hit] ^= rng.integers(1, np.iinfo(uint).max, size=int(hit.sum()), dtype=uint, endpoint=True)
    base, new = buf_b[offset:], buf_n[offset:]
    _assert_scan(base, new)
    tiles: list[tuple[int, int]] = []
    _assert_scan(base, new, tile=int(rng.integers(1, 5000)), after=lambda lo, hi: tiles.append((lo, hi)))
    if n:
        assert tiles[0][0] == 0 and tiles[-1][1] == n
        assert all(a[1] == b[0] for a, b in itertools.pairwise(tiles))


@pytest.mark.parametrize("width", [1, 2, 4, 8])
def test_scan_of_every_lane_position_and_group_boundary(width: int) -> None:
    """One changed element at each lane of the first and last word of a group, and at the first and
    last element, on either side of every group boundary: each found once, at its own position."""
    uint = np.dtype(f"<u{width}")
    lanes = 8 // width
    n = 3 * GROUP_WORDS * lanes + lanes - 1  # three whole groups and a tail
    for at in sorted({0, n - 1} | {g * GROUP_WORDS * lanes + d for g in range(4) for d in range(-lanes, lanes)}):
        if not 0 <= at < n:
            continue
        base = np.zeros(n, dtype=uint)
        new = base.copy()
        new[at] = np.iinfo(uint).max  # every bit of the lane, including the top one
        positions, masks, news = scan_changes(base, new)
        assert positions.tolist() == [at] and masks.tolist() == [np.iinfo(uint).max] and news.tolist() == masks.tolist()


def test_dense_change_regrows_and_resumes_exactly() -> None:
    """Every element changed: the outputs outgrow their first size (n / 16) several times and the kernel
    resumes where it stopped; a change only in the top bit of each lane is still a change."""
    n = (1 << 16) + 5
    base = np.zeros(n, dtype="<u2")
    new = np.full(n, 0x8000, dtype="<u2")
    _assert_scan(base, new)
    _assert_scan(base, new, tile=3000, after=lambda lo, hi: None)


# ----- hashing while scanning


def test_tile_feeder_keeps_order_across_inline_and_helper_tiles() -> None:
    """Tiles fed to one hasher alternately on the helper thread and inline digest the whole bytes."""
    data = np.random.default_rng(3).integers(0, 255, size=3_000_007, dtype=np.uint8)
    feeder = engine._TileFeeder(helper=True)
    h = blake3.blake3(max_threads=1)
    edges = [*range(0, len(data), 65_537), len(data)]
    for i, (lo, hi) in enumerate(itertools.pairwise(edges)):
        feeder.feed(h, data[lo:hi], pipelined=(i // 3) % 2 == 0)
    feeder.close()
    assert h.hexdigest() == digest_bytes(data)
    assert feeder.thread is None  # the helper has ended


def test_tile_feeder_reports_the_helpers_error() -> None:
    class Broken:
        def update(self, data: object) -> None:
            raise RuntimeError("hash failed")

    feeder = engine._TileFeeder(helper=True)
    feeder.feed(Broken(), np.zeros(10, np.uint8), pipelined=True)
    feeder.feed(Broken(), np.zeros(10, np.uint8), pipelined=False)  # waits for the helper, then skips
    with pytest.raises(RuntimeError, match="hash failed"):
        feeder.close()


def _pair(tmp_path: Path) -> tuple[Path, Path, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    a = {
        "big": torch.randn(1536, 1024, generator=g).to(torch.bfloat16),  # 3 MiB: several ranges below
        "wide": torch.randn(700, 1001, generator=g),  # F32, an odd row length
        "small": torch.randn(33, 5, generator=g).to(torch.float16),
        "nan": torch.tensor([float("nan"), 0.0, -0.0, float("inf")] * 300_000, dtype=torch.bfloat16),
    }
    b = {k: v.clone() for k, v in a.items()}
    b["big"].view(torch.int16).view(-1)[::29] ^= 1
    b["wide"].view(torch.int32).view(-1)[5::1013] ^= 1 << 31  # sign flips: -x, and +0 <-> -0
    b["small"].view(torch.int16).view(-1)[4] ^= 3
    nan = b["nan"].view(torch.int16).view(-1)
    nan[0::4] |= 1  # another NaN payload
    nan[1::8] ^= -0x8000  # +0 -> -0
    write_checkpoint(tmp_path / "a", a, shards=2)
    write_checkpoint(tmp_path / "b", b, shards=2)
    return tmp_path / "a", tmp_path / "b", b


class _Busy:
    """A stand-in for engine._SCANNING that reports every worker busy (so nothing goes to a helper)."""

    count = 1 << 20

    def __enter__(self) -> _Busy:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


class _Idle(_Busy):
    """... and one that reports every worker idle (so every range is hashed on a helper)."""

    count = 0


@pytest.mark.parametrize("mode", ["inline", "helper", "mixed"])
def test_hashing_on_a_helper_or_inline_writes_the_same_delta(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """Every tensor large enough for the helper thread, tiles small, ranges several per tensor: with
    the hashing inline, on the helper, or switching from range to range, the delta is the one-worker
    delta, byte for byte, and the target table holds the digests of the new tensors' bytes."""
    a, b, tensors = _pair(tmp_path)
    monkeypatch.setenv("DCR_CACHE_DIR", "")  # no digest cache: each diff hashes both sides
    monkeypatch.setattr(plan_module, "CHUNK_BYTES", 1 << 20)
    monkeypatch.setattr(engine, "PIPELINE_MIN_BYTES", 1 << 10)
    monkeypatch.setattr(engine, "TILE_BYTES", 24 << 10)
    reference = tmp_path / "one"
    diff(a, b, reference, workers=1)
    if mode == "inline":
        monkeypatch.setattr(engine, "_SCANNING", _Busy())
    elif mode == "helper":
        monkeypatch.setattr(engine, "_SCANNING", _Idle())
    elif mode == "mixed":
        flips = itertools.cycle([0, 1 << 20])

        class Flipping(_Busy):
            @property
            def count(self) -> int:  # type: ignore[override]
                return next(flips)

        monkeypatch.setattr(engine, "_SCANNING", Flipping())
    fed: list[bool] = []
    feed = engine._TileFeeder.feed

    def spy(self: engine._TileFeeder, hasher: object, tile: np.ndarray, pipelined: bool) -> None:
        fed.append(pipelined and self.helper)
        feed(self, hasher, tile, pipelined)

    monkeypatch.setattr(engine._TileFeeder, "feed", spy)
    out = tmp_path / mode
    diff(a, b, out, workers=2)
    assert {"inline": {False}, "helper": {True}, "mixed": {True, False}}[mode] == set(fed)

    def content(d: Path) -> tuple[dict, list[str]]:
        manifest = json.loads(manifest_text(d))
        manifest.pop("created")
        return manifest, sorted(p.name for p in (d / "blocks").iterdir())

    assert content(out) == content(reference)
    table = Delta.open(out).manifest.tensors
    for name, t in tensors.items():
        assert table[name].digest == digest_bytes(t.contiguous().view(torch.uint8).numpy())


# ----- the writer's staged blocks


def _write_delta(out: Path, block_bytes: int, items: int, abort: bool = False) -> tuple[dict[str, bytes], list]:
    """A delta of ``items`` one-region tensors, sections packed into blocks of ``block_bytes``; returns
    (the blocks each ``on_block`` call saw, the added items)."""
    from dcr_cli.delta.writer import DeltaWriter
    from dcr_cli.format.codec import diff_region
    from dcr_cli.format.manifest import Region, TensorEntry, VersionRef

    rng = np.random.default_rng(11)
    seen: dict[str, bytes] = {}
    writer = DeltaWriter(out, block_bytes=block_bytes, on_block=lambda bid, data: seen.__setitem__(bid, data))
    added, table = [], {}
    for i in range(items):
        a = rng.integers(0, 2**16, size=20_000, dtype=np.uint16)
        b = a.copy()
        b[rng.random(len(a)) < 0.2] ^= 1
        item = diff_region(f"t{i}", Region.range(0, len(a)), a, b)
        assert item is not None
        writer.add(item)
        added.append(item)
        table[f"t{i}"] = TensorEntry("U16", (len(a),), digest_bytes(b))
    if abort:
        writer.abort()
        return seen, added
    writer.finish(VersionRef("a", "0" * 64), VersionRef("b", "1" * 64), table)
    return seen, added


def _open_fds() -> int:
    return len(list(Path("/proc/self/fd").iterdir()))


@pytest.mark.skipif(not Path("/proc/self/fd").exists(), reason="counts open files through /proc")
@pytest.mark.parametrize("block_bytes", [1, 30_000, 1 << 20, 64 << 20])
def test_staged_blocks_are_the_blocks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, block_bytes: int) -> None:
    """Blocks written section by section (and synced every SYNC_BYTES) are named by the digest of their
    bytes, hold exactly the sections the manifest places in them, are what on_block saw, and leave no
    staged file or open descriptor behind; an aborted writer leaves nothing."""
    import dcr_cli.delta.writer as writer_module

    monkeypatch.setattr(writer_module, "SYNC_BYTES", 50_000)
    fds = _open_fds()
    out = tmp_path / "d"
    seen, added = _write_delta(out, block_bytes, items=12)
    assert _open_fds() == fds
    files = {p.name: p.read_bytes() for p in (out / "blocks").iterdir()}
    assert files == seen and all(digest_bytes(data) == name for name, data in files.items())
    delta = Delta.open(out)
    blocks = delta.manifest.blocks
    assert {b.id for b in blocks} == set(files)
    for item, original in zip(delta.manifest.items, added, strict=True):
        section = item.data
        data = files[blocks[section.block].id][section.offset : section.offset + section.length]
        assert data == original.data
        assert item.repair is not None and original.repair is not None
        repair = files[blocks[item.repair.block].id][item.repair.offset : item.repair.offset + item.repair.length]
        assert repair == original.repair
    delta.verify_blocks(roles=("data", "repair"))
    if block_bytes == 64 << 20:
        assert len(blocks) == 2  # one data block, one repair block: staged whole, placed at finish
    del delta
    fds = _open_fds()  # the reader may keep its block files open
    gone = tmp_path / "aborted"
    _write_delta(gone, block_bytes, items=5, abort=True)
    assert _open_fds() == fds and not gone.exists() and [p.name for p in tmp_path.iterdir()] == ["d"]
