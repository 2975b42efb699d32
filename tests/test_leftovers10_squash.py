"""F5: a squash whose chain brings a tensor back to its first base leaves it out, also where the chain
replaced or overwrote it (whose first-base values only the item's pre digest states): squash then apply is
the chain applied, bit for bit, and no output item is an identity (pre == post)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from helpers_checkpoints import copy_checkpoint, read_raw, write_checkpoint
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from test_squash import LAYOUTS, base_reader, build_delta, chain_versions, check_digests, shapes

import dcr_cli
from dcr_cli.checkpoints.safetensors_dir import SafetensorsCheckpoint
from dcr_cli.delta.reader import Delta
from dcr_cli.delta.squash import UnsquashableError
from dcr_cli.format.dtypes import SUPPORTED
from dcr_cli.format.manifest import Op


def test_a_chain_there_and_back_squashes_to_nothing(tmp_path: Path, dcr) -> None:
    """a -> b -> a: a dense tensor travels as replace items; net, nothing changed (was 'N changed elements')."""
    rng = np.random.default_rng(7)
    a = {"dense": ("BF16", (200, 200), rng.integers(0, 1 << 16, 40000, dtype=np.uint16))}
    a["sparse"] = ("BF16", (200, 200), rng.integers(0, 1 << 16, 40000, dtype=np.uint16))
    b = {"dense": ("BF16", (200, 200), rng.integers(0, 1 << 16, 40000, dtype=np.uint16))}
    b["sparse"] = ("BF16", (200, 200), a["sparse"][2] ^ (rng.random(40000) < 0.01).astype(np.uint16))
    write_checkpoint(tmp_path / "a", a)
    write_checkpoint(tmp_path / "b", b)
    dcr("diff", tmp_path / "a", tmp_path / "b", "-o", tmp_path / "ab", "--base-version", "a", "--target-version", "b",
        check=True)  # fmt: skip
    dcr("diff", tmp_path / "b", tmp_path / "a", "-o", tmp_path / "ba", "--base-version", "b", "--target-version", "a2",
        check=True)  # fmt: skip
    assert any(it.op == "replace" for it in Delta.open(tmp_path / "ab").manifest.items)
    proc = dcr("squash", tmp_path / "ab", tmp_path / "ba", "-o", tmp_path / "s", check=True)
    assert ", 0 changed elements" in proc.stdout, proc.stdout
    assert Delta.open(tmp_path / "s").manifest.items == []


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 2**32 - 1),
    specs=st.lists(st.tuples(st.sampled_from(SUPPORTED), shapes), min_size=1, max_size=3),
    steps=st.integers(2, 4),
    rates=st.lists(st.sampled_from([0.03, 0.4, 0.9, 1.0]), min_size=4, max_size=4),
    layout=st.sampled_from(LAYOUTS),
    overwrite=st.lists(st.integers(0, 7), min_size=4, max_size=4),
    back=st.lists(st.booleans(), min_size=3, max_size=3),
)
def test_squash_then_apply_is_the_chain_applied(
    tmp_path_factory: pytest.TempPathFactory,
    seed: int,
    specs: list[tuple[str, tuple[int, ...]]],
    steps: int,
    rates: list[float],
    layout: str,
    overwrite: list[int],
    back: list[bool],
) -> None:
    tmp = tmp_path_factory.mktemp("chain")
    versions = chain_versions(seed, specs, steps, rates)
    names = sorted(versions[0])
    returned = [n for j, n in enumerate(names) if back[j]]
    for n in returned:  # the last step brings these tensors back to their first base, bit for bit
        versions[-1][n] = versions[0][n]
    for i, v in enumerate(versions):
        write_checkpoint(tmp / f"v{i}", v)
    deltas: list[Path] = []
    for k in range(steps):
        ops: dict[str, Op] = {n: "overwrite" if overwrite[k] >> (j % 3) & 1 else "xor" for j, n in enumerate(names)}
        out = tmp / f"d{k + 1}"
        if layout == "hf":  # dcr diff: dense changes travel as replace items
            globs = [n for n in names if ops[n] == "overwrite"]
            dcr_cli.diff(tmp / f"v{k}", tmp / f"v{k + 1}", out, base_version=f"v{k}", target_version=f"v{k + 1}",
                         overwrite=globs, workers=1)  # fmt: skip
        else:
            build_delta(out, versions[k], versions[k + 1], (f"v{k}", f"v{k + 1}"), dict.fromkeys(names, layout), ops)
        deltas.append(out)
    sq = tmp / "squash"
    try:
        dcr_cli.squash(deltas, sq, workers=1)
    except UnsquashableError:
        event("squashed with the base checkpoint")
        with SafetensorsCheckpoint(tmp / "v0") as ckpt:
            dcr_cli.squash(deltas, sq, workers=1, base_values=base_reader(ckpt))
    m = Delta.open(sq).manifest
    chain_ops = {it.op for d in deltas for it in Delta.open(d).manifest.items if it.tensor in returned}
    for op in sorted(chain_ops):
        event(f"a returned tensor travelled as {op}")
    assert all(it.pre != it.post for it in m.items)  # no identity item
    unchanged = [n for n in names if (versions[0][n][2] == versions[-1][n][2]).all()]
    assert not [it for it in m.items if it.tensor in unchanged]  # a tensor back at its base is left out
    check_digests(sq, versions[0], versions[-1])
    by_squash = copy_checkpoint(tmp / "v0", tmp / "by-squash")
    by_chain = copy_checkpoint(tmp / "v0", tmp / "by-chain")
    dcr_cli.apply(sq, into=by_squash, workers=1)
    for d in deltas:
        dcr_cli.apply(d, into=by_chain, workers=1)
    assert read_raw(by_squash) == read_raw(by_chain) == read_raw(tmp / f"v{steps}")
    assert dcr_cli.verify(by_squash, against=sq).ok
