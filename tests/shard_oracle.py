"""The exactness oracle for shard diffs: the real ``dcr apply`` of the delta, on a copy of the base's
HF checkpoint, must give the target's HF checkpoint bit for bit (and ``dcr verify`` must agree)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from checkpoints import read_bits

import dcr_cli
from dcr_cli.delta.reader import Delta


def assert_oracle(delta: str | Path, base_hf: str | Path, target_hf: str | Path) -> None:
    with tempfile.TemporaryDirectory(prefix="dcr-oracle-") as tmp:
        receiver = Path(tmp) / "receiver"
        shutil.copytree(base_hf, receiver)
        dcr_cli.apply(delta, into=receiver)
        got, want = read_bits(receiver), read_bits(Path(target_hf))
        assert sorted(got) == sorted(want)
        for name in want:
            assert got[name] == want[name], f"{name} differs from the target"
        assert dcr_cli.verify(receiver, against=delta).ok
        assert Delta.open(delta).manifest.target.fingerprint == dcr_cli.verify(receiver).computed_fingerprint
