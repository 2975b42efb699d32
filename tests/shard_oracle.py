"""Reference applier for the exactness oracle (stand-in for ``dcr apply`` until it lands on this branch).

Applies a delta to numpy copies of an HF checkpoint's tensors, checking the
base fingerprint and every item's pre/post digests, then returns the result.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dcr_cli.delta.reader import Delta
from dcr_cli.format.codec import apply_values
from dcr_cli.format.digest import digest_bytes
from dcr_cli.format.manifest import TensorEntry, fingerprint
from dcr_cli.sources.safetensors_dir import SafetensorsCheckpoint


def hf_tensors(path: str | Path) -> dict[str, tuple[str, tuple[int, ...], np.ndarray]]:
    with SafetensorsCheckpoint(path) as ck:
        return {n: (t.dtype, t.shape, np.array(ck.view(n))) for n, t in ck.tensors.items()}


def hf_fingerprint(tensors: dict[str, tuple[str, tuple[int, ...], np.ndarray]]) -> str:
    return fingerprint({n: TensorEntry(d, s, digest_bytes(a)) for n, (d, s, a) in tensors.items()})


def apply_reference(delta: str | Path, base_hf: str | Path) -> dict[str, np.ndarray]:
    d = Delta.open(delta)
    m = d.manifest
    base = hf_tensors(base_hf)
    assert hf_fingerprint(base) == m.base.fingerprint, "base HF checkpoint does not match the delta's base"
    arrays = {n: a.copy() for n, (_, _, a) in base.items()}
    for item in m.items:
        shape = m.tensors[item.tensor].shape
        decoded = d.decode(item)
        positions = decoded.positions if decoded.positions is not None else np.arange(item.region.size)
        idx = item.region.to_canonical(positions, shape)
        arr = arrays[item.tensor]
        current = arr[idx]
        assert digest_bytes(current) == item.pre, f"pre digest mismatch in {item.tensor}"
        arr[idx] = apply_values(item.op, current, decoded.values)
        assert digest_bytes(arr[idx]) == item.post, f"post digest mismatch in {item.tensor}"
        if item.op == "xor":
            assert np.array_equal(d.repair_values(item), arr[idx])
    for name, entry in m.tensors.items():
        assert digest_bytes(arrays[name]) == entry.digest, f"{name}: result differs from the manifest's digest"
    return arrays


def assert_oracle(delta: str | Path, base_hf: str | Path, target_hf: str | Path) -> None:
    """Delta applied to the base HF checkpoint gives the target HF checkpoint bit for bit."""
    got = apply_reference(delta, base_hf)
    want = hf_tensors(target_hf)
    assert sorted(got) == sorted(want)
    for name, (_, _, arr) in want.items():
        assert got[name].dtype == arr.dtype and np.array_equal(got[name], arr), f"{name} differs from the target"
    assert hf_fingerprint(want) == Delta.open(delta).manifest.target.fingerprint
