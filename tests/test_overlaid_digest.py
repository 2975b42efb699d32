"""receive/vllm/apply._overlaid_digest: the digest a tensor will have once its ready items are written,
taken before any write (receiver-vllm.md §3), equals the digest of the tensor written.

The tensor's resident runs (one per destination: a fused ``qkv_proj`` holds q, k and v as runs of
one storage), items in any order (box items of trainer shards interleave in canonical order), and
pieces smaller than the runs, so the overlay crosses piece edges.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dcr_cli.format.digest import digest_bytes
from dcr_cli.receive.vllm import apply as engine_apply
from dcr_cli.receive.vllm.apply import Located, Prepared, _overlaid_digest
from dcr_cli.receive.vllm.placement import Destination


def _destination(param: str, dst_offset: int, src_offset: int, numel: int) -> Destination:
    return Destination(param, torch.bfloat16, dst_offset, (numel,), (1,), src_offset, (numel,), (1,))


@settings(max_examples=150, deadline=None)
@given(
    numel=st.integers(1, 3000),
    cuts=st.lists(st.floats(0.0, 1.0), max_size=2),
    piece_bytes=st.sampled_from([2, 64, 1000, 1 << 20]),
    index_dtype=st.sampled_from([np.int32, np.int64]),
    data=st.data(),
)
def test_the_overlaid_digest_is_the_digest_after_the_writes(
    numel: int, cuts: list[float], piece_bytes: int, index_dtype: type, data: st.DataObject, monkeypatch_module: None
) -> None:
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    edges = sorted({0, numel, *(int(c * numel) for c in cuts)})
    storage = rng.integers(0, 2**16, numel + 7, dtype=np.uint16)  # the runs lie in one storage, 7 elements in
    before = storage.copy()
    canonical = storage[7 : 7 + numel]
    runs, kept = [], []
    want = canonical.copy()
    for lo, hi in itertools.pairwise(edges):
        dest = _destination("qkv", 7 + lo, lo, hi - lo)
        runs.append((dest, canonical[lo:hi]))
        changed = np.flatnonzero(rng.random(hi - lo) < data.draw(st.sampled_from([0.0, 0.03, 0.5, 1.0])))
        for part in np.array_split(changed, data.draw(st.integers(1, 4))):  # several items per run
            if not part.size:
                continue
            new = rng.integers(0, 2**16, part.size, dtype=np.uint16)
            want[lo + part] = new
            index = (part + 7 + lo).astype(index_dtype)  # storage indices, as _compute_new keeps them
            located = Located(dest, np.zeros(0, bool), index, torch.empty(0, dtype=torch.int16))
            kept.append(Prepared(None, [located], part.size, new=new, ready=True))
    order = data.draw(st.permutations(range(len(kept))))
    monkeypatch_module.setattr(engine_apply, "OVERLAY_PIECE_BYTES", piece_bytes)
    got = _overlaid_digest(runs, [kept[k] for k in order])
    assert got == digest_bytes(want)
    assert storage.tobytes() == before.tobytes()  # the engine's weights are only read


@pytest.fixture(scope="module")
def monkeypatch_module():  # type: ignore[no-untyped-def]
    with pytest.MonkeyPatch.context() as patch:
        yield patch
