"""format/kernels.scatter, the receivers' sparse write: the same bits as numpy's fancy assignment;
scatter_checked, the same write with each run read back while in cache (a vLLM apply's writes);
gather, the first pass's scattered read: the same bits as numpy's fancy indexing."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dcr_cli.format.kernels import gather, scatter, scatter_checked

WIDTHS = [np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64]


@st.composite
def storage_and_writes(draw: st.DrawFn, max_size: int = 300, distinct: bool = False) -> tuple[np.ndarray, ...]:
    """A 1-D storage of one of WIDTHS, 32- or 64-bit indices into it (sorted or not; ``distinct``: no
    index twice, else up to twice as many as elements, with repeats) and values for them."""
    dtype = draw(st.sampled_from(WIDTHS))
    size = draw(st.integers(1, max_size))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    info = np.iinfo(dtype)
    storage = rng.integers(info.min, info.max, size, dtype=dtype, endpoint=True)
    if distinct:
        index = rng.permutation(size)[: draw(st.integers(0, size))]
    else:
        index = rng.integers(0, size, draw(st.integers(0, 2 * size)))
    index = index.astype(draw(st.sampled_from([np.int32, np.int64])))
    if draw(st.booleans()):
        index = np.sort(index)
    values = rng.integers(info.min, info.max, index.size, dtype=dtype, endpoint=True)
    return storage, index, values


@settings(max_examples=200, deadline=None)
@given(storage_and_writes())
def test_scatter_writes_what_numpy_writes(case: tuple[np.ndarray, ...]) -> None:
    out, index, values = case
    # Duplicate indices: numpy's assignment keeps the last value, and so does the kernel.
    want = out.copy()
    want[index] = values
    scatter(out, index, values)
    assert out.tobytes() == want.tobytes()


@pytest.mark.parametrize("bad", [-1, 10])
def test_an_index_outside_the_storage_raises(bad: int) -> None:
    out = np.zeros(10, dtype=np.int16)
    with pytest.raises(IndexError, match="outside the storage"):
        scatter(out, np.array([1, bad, 2], dtype=np.int64), np.array([7, 8, 9], dtype=np.int16))
    assert out[1] == 7 and out[2] == 0  # stopped at the bad index: as a crash mid-write would leave it


def test_mismatched_dtypes_or_shapes_are_refused() -> None:
    out = np.zeros(4, dtype=np.int16)
    with pytest.raises(ValueError, match="scatter"):
        scatter(out, np.array([0], dtype=np.int64), np.array([1], dtype=np.int32))
    with pytest.raises(ValueError, match="scatter"):
        scatter(out, np.array([0, 1], dtype=np.int64), np.array([1], dtype=np.int16))


def test_strided_and_read_only_inputs_take_the_compiled_variant() -> None:
    """They are copied, so no new kernel is compiled for them (an engine's pause never waits for numba)."""
    from dcr_cli.format import kernels

    out = np.zeros(16, dtype=np.uint8)
    kernels.compile_scatter(np.dtype(np.uint8))
    before = len(kernels._scatter.signatures)
    values = np.arange(8, dtype=np.uint8)
    values.flags.writeable = False
    scatter(out, np.arange(0, 16, 2, dtype=np.int64)[::1], values)
    scatter(out, np.arange(16, dtype=np.int32)[::2], np.arange(16, dtype=np.uint8)[1::2])
    assert len(kernels._scatter.signatures) == before
    assert out.tolist() == [1, 0, 3, 0, 5, 0, 7, 0, 9, 0, 11, 0, 13, 0, 15, 0]


@settings(max_examples=200, deadline=None)
@given(storage_and_writes(max_size=20_000, distinct=True))  # runs of 4096 and more
def test_checked_scatter_writes_what_numpy_writes_and_reads_back_distinct_indices(case: tuple[np.ndarray, ...]) -> None:
    out, index, values = case
    want = out.copy()
    want[index] = values
    assert scatter_checked(out, index, values) == 0
    assert out.tobytes() == want.tobytes()


def test_checked_scatter_counts_what_does_not_read_back() -> None:
    """Two values for one element in one run: the first does not read back (the storage holds the
    second); a receiver's write fails on that, it never records a version over it."""
    out = np.zeros(8, dtype=np.uint16)
    assert scatter_checked(out, np.array([1, 5, 1, 2], dtype=np.int32), np.array([7, 8, 9, 3], dtype=np.uint16)) == 1
    assert out.tolist() == [0, 9, 3, 0, 0, 8, 0, 0]


@pytest.mark.parametrize("bad", [-1, 10])
def test_checked_scatter_stops_at_an_index_outside_the_storage(bad: int) -> None:
    out = np.zeros(10, dtype=np.int16)
    with pytest.raises(IndexError, match="outside the storage"):
        scatter_checked(out, np.array([1, bad, 2], dtype=np.int64), np.array([7, 8, 9], dtype=np.int16))
    assert out[1] == 7 and out[2] == 0


@settings(max_examples=200, deadline=None)
@given(storage_and_writes(), st.booleans())
def test_gather_reads_what_numpy_reads(case: tuple[np.ndarray, ...], strided: bool) -> None:
    src, index, _ = case
    if strided:
        index = index[::-1]  # a strided view: copied, not a new compiled variant
    got = gather(src, index)
    assert got.dtype == src.dtype and got.tobytes() == src[index].tobytes()


@pytest.mark.parametrize("bad", [-1, 10])
def test_gather_refuses_an_index_outside_the_storage(bad: int) -> None:
    with pytest.raises(IndexError, match="outside the storage"):
        gather(np.zeros(10, dtype=np.int16), np.array([1, bad], dtype=np.int64))


def test_a_waiting_receiver_loads_the_write_kernels_before_the_publication() -> None:
    """``apply --wait`` warms up before it waits (receive.checkpoint.warm_up): the scatter kernels for
    every element width are then loaded, so the published delta's compile_writes finds them and the
    refit's critical path does not load them (tenths of a second measured there). In a fresh
    interpreter, where nothing else loaded them."""
    import subprocess
    import sys

    probe = (
        "import numpy as np\n"
        "from dcr_cli.format import kernels\n"
        "from dcr_cli.receive.checkpoint import warm_up\n"
        "assert not kernels._scatter.signatures\n"
        "warm_up()\n"
        "for k in (kernels._scatter, kernels._scatter_checked, kernels._gather):\n"
        "    got = {(str(s[0].dtype), str(s[1].dtype)) for s in k.signatures}\n"
        "    want = {(w, i) for w in ('uint8', 'uint16', 'uint32', 'uint64') for i in ('int32', 'int64')}\n"
        "    assert want <= got, (k, sorted(got))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
