"""F11: a `dcr diff` re-run on the complete delta it wrote before (killed just after it finished, re-run by
cron) recognises its own result and exits 0; any other OUT stays a conflict (exit 3) and nothing is written."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from helpers_checkpoints import write_checkpoint

from dcr_cli.delta.reader import Delta
from dcr_cli.errors import ConflictError
from dcr_cli.format.manifest import MANIFEST_NAME
from dcr_cli.produce import diff


def _pair(tmp_path: Path, seed: int = 0) -> tuple[Path, Path]:
    rng = np.random.default_rng(seed)
    base = {f"w{i}": ("BF16", (64, 32), rng.integers(0, 1 << 16, 64 * 32, dtype=np.uint16)) for i in range(4)}
    new = {}
    for name, (dt, shape, bits) in base.items():
        changed = bits.copy()
        changed[rng.choice(bits.size, 40, replace=False)] ^= 1
        new[name] = (dt, shape, changed)
    return write_checkpoint(tmp_path / "a", base, shards=2), write_checkpoint(tmp_path / "b", new, shards=2)


def _tree(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out.parent)): p.read_bytes() for p in sorted(out.parent.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("cache", ["on", "off"])
def test_rerun_on_its_own_complete_delta_exits_0(tmp_path: Path, dcr, cache: str) -> None:
    a, b = _pair(tmp_path)
    out = tmp_path / "deltas" / "d"
    env = {} if cache == "on" else {"DCR_CACHE_DIR": ""}  # off: the re-run hashes both sides again
    args = ("diff", str(a), str(b), "-o", str(out), "--target-version", "step-2")
    dcr(*args, check=True, env=env)
    before = _tree(out)
    again = dcr(*args, env=env)
    assert again.returncode == 0, again.stderr
    assert "already there" in again.stdout and "step-2" in again.stdout
    assert _tree(out) == before  # nothing written, nothing left beside it
    as_json = dcr(*args, "--json", env=env)
    assert as_json.returncode == 0, as_json.stderr
    assert json.loads(as_json.stdout)["already_there"] is True


def test_another_diff_on_a_complete_delta_stays_a_conflict(tmp_path: Path, dcr) -> None:
    a, b = _pair(tmp_path)
    _, c = _pair(tmp_path / "other", seed=1)
    out = tmp_path / "deltas" / "d"
    dcr("diff", str(a), str(b), "-o", str(out), check=True)
    before = _tree(out)
    for args in (
        ("diff", str(a), str(c), "-o", str(out)),  # another target
        ("diff", str(b), str(b), "-o", str(out)),  # another base
        ("diff", str(a), str(b), "-o", str(out), "--target-version", "step-9"),  # another label
        ("diff", str(a), str(b), "-o", str(out), "--base-version", "step-0"),
    ):
        proc = dcr(*args)
        assert proc.returncode == 3, (args, proc.stdout, proc.stderr)
        assert proc.stderr.startswith("dcr: error: ") and "already exists" in proc.stderr
        assert proc.stderr.count("\n") == 1
        assert _tree(out) == before


def test_an_incomplete_out_stays_a_conflict(tmp_path: Path, dcr) -> None:
    a, b = _pair(tmp_path)
    out = tmp_path / "d"
    dcr("diff", str(a), str(b), "-o", str(out), check=True)
    block = next((out / "blocks").iterdir())
    block.write_bytes(block.read_bytes()[:-1])
    proc = dcr("diff", str(a), str(b), "-o", str(out))
    assert proc.returncode == 3 and "already exists" in proc.stderr, proc.stderr
    (out / MANIFEST_NAME).unlink()
    proc = dcr("diff", str(a), str(b), "-o", str(out))
    assert proc.returncode == 3 and "not a complete delta" in proc.stderr, proc.stderr


def test_a_damaged_out_of_its_full_size_stays_a_conflict(tmp_path: Path, dcr) -> None:
    """A flipped byte keeps the block's size: "already there" would leave cron re-running a diff that never
    repairs it, while every apply refuses the delta."""
    a, b = _pair(tmp_path)
    out = tmp_path / "d"
    dcr("diff", str(a), str(b), "-o", str(out), check=True)
    block = next((out / "blocks").iterdir())
    data = bytearray(block.read_bytes())
    data[len(data) // 2] ^= 1
    block.write_bytes(bytes(data))
    proc = dcr("diff", str(a), str(b), "-o", str(out))
    assert proc.returncode == 3 and "a damaged block" in proc.stderr, proc.stderr
    assert proc.stderr.count("\n") == 1


def test_api_rerun_of_a_training_checkpoint_diff(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Megatron with FP8 residual tensors, digest cache off: the re-run digests the converted bits as the diff."""
    from shard_writers import write_megatron_checkpoints
    from test_shards_fp8 import FP8

    monkeypatch.setenv("DCR_CACHE_DIR", "")
    root = tmp_path / "m"
    write_megatron_checkpoints(root, FP8, world=2)
    base, new = root / "base" / "torch_dist", root / "target" / "torch_dist"
    out = tmp_path / "d"
    first = diff(base, new, out, profile=FP8)
    assert first is not None and not first.already_there
    raw = (out / MANIFEST_NAME).read_bytes()
    again = diff(base, new, out, profile=FP8)
    assert again is not None and again.already_there and again.delta_id == first.delta_id
    assert (out / MANIFEST_NAME).read_bytes() == raw
    with pytest.raises(ConflictError, match="already exists"):
        diff(new, new, out, profile=FP8)
    assert Delta.open(out).id == first.delta_id
