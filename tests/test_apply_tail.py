"""The apply's tail: the proof's read-back and the fsyncs overlap the write pass, and both are complete before the
state claims the target."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from helpers_checkpoints import copy_checkpoint, mutate, random_tensors, record_digests, write_checkpoint

import dcr_cli
from dcr_cli.produce import diff
from dcr_cli.receive.checkpoint import applier, inplace

SPECS = [(f"t{i}", "BF16", (64, 48)) for i in range(6)] + [("still", "F32", (10,))]


def test_every_written_file_is_fsynced_and_every_touched_tensor_proven_before_the_target_is_recorded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = np.random.default_rng(21)
    t0 = random_tensors(rng, SPECS)
    v0 = write_checkpoint(tmp_path / "v0", t0, shards=3)
    v1 = write_checkpoint(tmp_path / "v1", mutate(rng, t0, 0.1, names=[f"t{i}" for i in range(6)]), shards=3)
    diff(v0, v1, tmp_path / "d", base_version="v0", target_version="v1")
    recv = copy_checkpoint(v0, tmp_path / "recv")
    events: list[tuple[str, str]] = []
    real_sync_file, real_state = inplace.InPlaceFiles.sync_file, applier.write_state

    def sync_file(self: inplace.InPlaceFiles, file: Path) -> None:
        real_sync_file(self, file)
        events.append(("fsync", file.name))

    def write_state(root: Path, state: applier.ReceiverState) -> None:
        events.append(("state", "applying" if state.applying else str(state.version)))
        real_state(root, state)

    monkeypatch.setattr(inplace.InPlaceFiles, "sync_file", sync_file)
    record_digests(monkeypatch, lambda name: events.append(("digest", name)))
    monkeypatch.setattr(applier, "write_state", write_state)
    result = dcr_cli.apply(tmp_path / "d", into=recv, verify=True)
    assert result.version == "v1" and result.verified is not None and result.verified["ok"]
    target = events.index(("state", "v1"))
    applying = events.index(("state", "applying"))
    shards = {p.name for p in recv.glob("*.safetensors")}
    assert {name for kind, name in events[applying:target] if kind == "fsync"} == shards  # every file written
    proven = [name for kind, name in events[applying:target] if kind == "digest"]
    assert sorted(proven) == [f"t{i}" for i in range(6)]  # each touched tensor once, by the proof
    assert [name for kind, name in events[target:] if kind == "digest"] == ["still"]  # --verify reads the rest
    assert dcr_cli.verify(recv, against=tmp_path / "d").ok
