"""Property tests of the pure codec: every dtype, shape and change pattern round-trips bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from dcr_cli.errors import IntegrityError
from dcr_cli.format.codec import decode_data, decode_positions, diff_region, encode_positions
from dcr_cli.format.digest import digest_bytes
from dcr_cli.format.dtypes import SUPPORTED
from dcr_cli.format.dtypes import dtype as lookup_dtype
from dcr_cli.format.manifest import Region

# Bit patterns that float arithmetic would not preserve: NaNs with payloads, ±0, ±inf, subnormals.
SPECIAL = {
    2: [0x0000, 0x8000, 0x7FC1, 0xFFFF, 0x7F80, 0x0001, 0x7E01],
    4: [0x00000000, 0x80000000, 0x7FC00001, 0xFFFFFFFF, 0x7F800000, 0x00000001],
    8: [0, 1 << 63, 0x7FF8000000000001, (1 << 64) - 1, 0x7FF0000000000000],
    1: [0x00, 0x80, 0x7F, 0xFF, 0x01],
}


@st.composite
def region_pairs(draw):
    name = draw(st.sampled_from(SUPPORTED))
    dt = lookup_dtype(name)
    n = draw(st.integers(min_value=0, max_value=3000))
    seed = draw(st.integers(min_value=0, max_value=2**32 - 1))
    rate = draw(st.sampled_from([0.0, 0.001, 0.03, 0.3, 0.9, 1.0]))
    rng = np.random.default_rng(seed)
    info = np.iinfo(dt.uint)
    base = rng.integers(0, info.max, size=n, dtype=dt.uint, endpoint=True)
    if n and draw(st.booleans()):
        specials = np.array(SPECIAL[dt.itemsize], dtype=dt.uint)
        base[rng.integers(0, n, size=min(n, 20))] = rng.choice(specials, size=min(n, 20))
    new = base.copy()
    mask = rng.random(n) < rate
    small = draw(st.booleans())  # low-bit flips like real optimizer steps, or arbitrary new patterns
    flips = rng.integers(1, 8, size=n, dtype=dt.uint) if small else rng.integers(1, info.max, size=n, dtype=dt.uint)
    new[mask] ^= flips[mask]
    if n and draw(st.booleans()):
        specials = np.array(SPECIAL[dt.itemsize], dtype=dt.uint)
        idx = rng.integers(0, n, size=min(n, 10))
        new[idx] = rng.choice(specials, size=len(idx))
    op = draw(st.sampled_from(["xor", "overwrite"]))
    return name, base, new, op


@settings(max_examples=300, deadline=None)
@given(region_pairs())
def test_region_round_trip_is_bit_exact(case):
    name, base, new, op = case
    dt = lookup_dtype(name)
    item = diff_region("t", Region.range(0, len(base)), base, new, op=op)
    changed = np.flatnonzero(base != new)
    if len(changed) == 0:
        assert item is None
        return
    assert item is not None
    decoded = decode_data(item.data, item.positions_length, item.op, item.count, len(base), dt, "t")
    out = base.copy()
    if item.op == "replace":
        assert decoded.positions is None
        out[:] = decoded.values
        assert item.pre == digest_bytes(base) and item.post == digest_bytes(new)
    else:
        assert np.array_equal(decoded.positions, changed)
        out[decoded.positions] = (out[decoded.positions] ^ decoded.values) if item.op == "xor" else decoded.values
        assert item.pre == digest_bytes(base[changed]) and item.post == digest_bytes(new[changed])
    assert out.tobytes() == new.tobytes()
    if item.op == "xor":
        repair = decode_data(item.repair, 0, "replace", item.count, item.count, dt, "t").values
        assert repair.tobytes() == new[changed].tobytes()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=2**31 - 1), unique=True, max_size=500))
def test_positions_round_trip(values):
    positions = np.array(sorted(values), dtype=np.int64)
    frame = encode_positions(positions)
    out = decode_positions(frame, len(positions), 2**31, "p")
    assert np.array_equal(out, positions)


def test_position_outside_region_is_rejected():
    frame = encode_positions(np.array([3, 10], dtype=np.int64))
    with pytest.raises(IntegrityError, match="outside its region"):
        decode_positions(frame, 2, 10, "p")


def test_frame_larger_than_manifest_allows_is_rejected_before_decoding():
    bomb = zstandard.ZstdCompressor().compress(b"\0" * (64 << 20))
    with pytest.raises(IntegrityError, match="declares"):
        decode_positions(bomb, 4, 100, "p")


def test_corrupt_frame_is_rejected():
    frame = bytearray(encode_positions(np.arange(0, 1000, 7, dtype=np.int64)))
    frame[len(frame) // 2] ^= 0xFF
    with pytest.raises(IntegrityError):
        decode_positions(bytes(frame), len(range(0, 1000, 7)), 1000, "p")


def test_box_region_maps_to_canonical_indices():
    shape = (4, 6, 5)
    region = Region.box((1, 2, 0), (2, 3, 5))
    full = np.arange(np.prod(shape)).reshape(shape)
    box = full[1:3, 2:5, 0:5].reshape(-1)
    local = np.array([0, 7, 29], dtype=np.int64)
    assert np.array_equal(region.to_canonical(local, shape), box[local])


def test_scalar_and_empty_regions():
    base = np.array([0x8000], dtype="<u2")  # -0.0 in BF16
    new = np.array([0x0000], dtype="<u2")  # +0.0: equal as floats, different bits
    item = diff_region("s", Region.box((), ()), base, new)
    assert item is not None and item.count == 1
    assert diff_region("e", Region.range(0, 0), base[:0], new[:0]) is None


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from([1, 2, 4, 8]),
    st.integers(min_value=0, max_value=70_000),
    st.sampled_from([0.0, 0.0005, 0.02, 0.5, 1.0]),
    st.integers(min_value=0, max_value=2**32 - 1),
)
def test_change_scan_matches_numpy_across_tiles_tails_and_growth(width: int, n: int, rate: float, seed: int) -> None:
    # Sizes span many 2048-word tiles, a tail shorter than one word, and dense changes that outgrow the
    # scan's first allocation (sized for sparse changes).
    from dcr_cli.format.kernels import scan_changes

    uint = np.dtype(f"<u{width}")
    rng = np.random.default_rng(seed)
    base = rng.integers(0, np.iinfo(uint).max, size=n, dtype=uint, endpoint=True)
    new = base.copy()
    hit = rng.random(n) < rate
    new[hit] ^= rng.integers(1, np.iinfo(uint).max, size=int(hit.sum()), dtype=uint, endpoint=True)
    positions, masks, news = scan_changes(base, new)
    expected = np.flatnonzero(base != new)
    assert positions.dtype == np.int64 and masks.dtype == uint and news.dtype == uint
    assert np.array_equal(positions, expected)
    assert np.array_equal(masks, base[expected] ^ new[expected]) and np.array_equal(news, new[expected])


def test_positions_that_would_overflow_int64_are_refused_not_wrapped() -> None:
    """Every gap escaped at the u32 maximum: the sum passes 2^63 for ~2^31 gaps; decoding saturates,
    so the last position stays beyond the region and the bound check refuses it (review finding)."""
    from dcr_cli.format.kernels import POSITION_CEILING, positions_from_gaps

    count = 4
    gaps = np.full(count, 255, dtype=np.uint8)
    escaped = np.full(count, 0xFFFFFFFF, dtype="<u4")
    planes = np.ascontiguousarray(escaped.view(np.uint8).reshape(count, 4).T).reshape(-1)
    raw = np.concatenate([gaps, planes])
    positions, escapes = positions_from_gaps(raw, count)
    assert escapes == count
    assert positions[0] == 255 + 0xFFFFFFFF
    assert (np.diff(positions) >= 0).all() and positions[-1] <= POSITION_CEILING
    # 2^31 such gaps would reach ~2^63; at 300 the unsaturated sum is already past the ceiling.
    count = 300
    raw = np.concatenate(
        [
            np.full(count, 255, dtype=np.uint8),
            np.full(4 * count, 0xFF, dtype=np.uint8),
        ]
    )
    positions, _ = positions_from_gaps(raw, count)
    assert positions[-1] == POSITION_CEILING
