"""Items whose sections the delta writer builds (codec.PendingItem): the diff's large tensors hand their
scanned changes to the writer's thread, which encodes them while the workers scan on. The bytes must
be exactly those of the item encoded on the worker."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from helpers_checkpoints import random_tensors, write_checkpoint
from manifest_text import manifest_text

from dcr_cli.delta.writer import DeltaWriter
from dcr_cli.format import codec
from dcr_cli.format.codec import PendingItem, encode_changes
from dcr_cli.format.kernels import scan_changes
from dcr_cli.format.manifest import Region
from dcr_cli.produce import diff, engine


def _fields(item: codec.EncodedItem) -> tuple:
    return (item.tensor, item.region, item.op, item.count, item.data, item.positions_length, item.pre, item.post,
            item.repair, item.residual, item.changed)  # fmt: skip


@pytest.mark.parametrize("uint", [np.uint8, np.uint16, np.uint32, np.uint64])
@pytest.mark.parametrize("op", ["xor", "overwrite"])
@pytest.mark.parametrize("level", [None, 3])
def test_a_pending_item_encodes_to_the_item_encoded_at_once(uint: type, op: str, level: int | None) -> None:
    rng = np.random.default_rng(7)
    n = 200_000
    base = rng.integers(0, np.iinfo(uint).max, n, dtype=uint, endpoint=True)
    for rate in (0.0001, 0.03, 0.2):  # long gaps (escaped), the usual, a dense-ish one below the trial rate
        new = base.copy()
        at = rng.random(n) < rate
        new[at] ^= rng.integers(1, np.iinfo(uint).max, int(at.sum()), dtype=uint, endpoint=True)
        positions, masks, news = scan_changes(base, new)
        args = ("t", Region.range(0, n), positions, masks, news, n, lambda new=new: (base, new))
        now = encode_changes(*args, op=op, level=level, residual="r")  # type: ignore[arg-type]
        later = encode_changes(*args, op=op, level=level, residual="r", defer=True)  # type: ignore[arg-type]
        assert type(now) is codec.EncodedItem and type(later) is PendingItem
        assert later.held_bytes >= news.nbytes + len(positions)  # its planes and gaps, at least
        assert _fields(later.encode()) == _fields(now)


def test_a_change_that_needs_the_dense_trial_is_encoded_at_once() -> None:
    base = np.zeros(1000, dtype=np.uint16)
    new = base + np.uint16(1)
    positions, masks, news = scan_changes(base, new)
    item = encode_changes("t", Region.range(0, 1000), positions, masks, news, 1000, lambda: (base, new), defer=True)
    assert item is not None and type(item) is codec.EncodedItem and item.op == "replace"
    assert encode_changes("t", Region.range(0, 5), positions[:0], masks[:0], news[:0], 5, lambda: (base, new),
                          defer=True) is None  # fmt: skip


@pytest.mark.parametrize("workers", [1, 2])
def test_the_diff_hands_its_large_tensors_to_the_writer_and_writes_the_same_delta(
    tmp_path: Path, workers: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = np.random.default_rng(3)
    specs = [("big", "BF16", (1024, 600)), ("f32", "F32", (300, 1100)), ("small", "BF16", (64, 64))]
    a = random_tensors(rng, specs)
    b = {}
    for name, (dt, shape, values) in a.items():
        values = values.copy()
        values[rng.random(values.size) < 0.03] ^= 1
        b[name] = (dt, shape, values)
    write_checkpoint(tmp_path / "a", a)
    write_checkpoint(tmp_path / "b", b)

    added: list[str] = []
    add = DeltaWriter.add

    def spy(self: DeltaWriter, item: codec.EncodedItem) -> None:
        added.append(type(item).__name__)
        add(self, item)

    monkeypatch.setattr(DeltaWriter, "add", spy)
    monkeypatch.setattr(engine, "default_workers", lambda: 4)  # a machine of 4 cores
    diff(tmp_path / "a", tmp_path / "b", tmp_path / "pending", workers=workers)
    assert "PendingItem" in added  # fewer workers than cores: the large tensors' items reached the writer unencoded
    added.clear()
    diff(tmp_path / "a", tmp_path / "b", tmp_path / "all-cores", workers=4)
    assert "PendingItem" not in added and "EncodedItem" in added  # a worker on every core: encoded by the workers

    encode = engine.encode_changes
    monkeypatch.setattr(engine, "encode_changes", lambda *a, **k: encode(*a, **{**k, "defer": False}))
    added.clear()
    diff(tmp_path / "a", tmp_path / "b", tmp_path / "at-once", workers=workers)
    assert "PendingItem" not in added

    def delta(out: Path) -> tuple:
        manifest = json.loads(manifest_text(out))
        manifest.pop("created")
        return manifest, {p.name: p.read_bytes() for p in (out / "blocks").iterdir()}

    assert delta(tmp_path / "pending") == delta(tmp_path / "at-once") == delta(tmp_path / "all-cores")
