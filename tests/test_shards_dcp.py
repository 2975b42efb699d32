"""dcr diff from PyTorch DCP and DCP-HF shards, checked against torch's own HF export (exactness oracle)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from shard_oracle import assert_oracle
from shard_writers import write_fsdp_checkpoints

from dcr_cli.checkpoints import detect_format
from dcr_cli.delta.reader import Delta
from dcr_cli.errors import FormatError, IncompatibleError
from dcr_cli.produce import diff

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """3 CPU ranks, FSDP2 + DTensor (Shard(0) uneven and empty, Shard(1), Replicate) and a plain tensor."""
    return write_fsdp_checkpoints(tmp_path_factory.mktemp("fsdp"), world=3)


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dcr_cli", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
        timeout=300,
    )


def item_keys(delta: Path) -> list[tuple]:
    m = Delta.open(delta).manifest
    return sorted(
        (it.tensor, json.dumps(it.region.to_json()), it.op, it.count, it.pre, it.post, it.residual) for it in m.items
    )


def test_formats_are_autodetected(fsdp: Path) -> None:
    assert detect_format(fsdp / "base" / "dcp") == "dcp"
    # torch's export dir holds the consolidated HF files (hf) and, in sharded/, the DCP-HF shards
    assert detect_format(fsdp / "base" / "hf") == "hf"
    assert detect_format(fsdp / "base" / "hf" / "sharded") == "dcp-hf"


@pytest.mark.parametrize("sub", ["dcp", "hf/sharded"])
def test_delta_from_shards_applied_to_hf_base_gives_hf_target(fsdp: Path, tmp_path: Path, sub: str) -> None:
    out = tmp_path / "delta"
    summary = diff(fsdp / "base" / sub, fsdp / "target" / sub, out, workers=2)
    assert summary is not None and summary.changed_elements > 0
    # torch's own consolidated HF export is the reference for both base and target
    assert_oracle(out, fsdp / "base" / "hf", fsdp / "target" / "hf")
    m = Delta.open(out).manifest
    # index-only: every item is a box of its canonical tensor, nothing took the residual path
    assert m.items and all(it.region.is_box and it.residual is None for it in m.items)
    changed = {it.tensor for it in m.items}
    assert {"proj.weight", "extra.col_sharded", "extra.replicated", "extra.plain_f32", "head.weight"} <= changed


def test_dcp_and_dcp_hf_give_the_same_items(fsdp: Path, tmp_path: Path) -> None:
    diff(fsdp / "base" / "dcp", fsdp / "target" / "dcp", tmp_path / "a")
    diff(fsdp / "base" / "hf" / "sharded", fsdp / "target" / "hf" / "sharded", tmp_path / "b")
    assert item_keys(tmp_path / "a") == item_keys(tmp_path / "b")
    assert Delta.open(tmp_path / "a").manifest.tensors == Delta.open(tmp_path / "b").manifest.tensors


def test_producers_write_parts_and_the_last_one_assembles(fsdp: Path, tmp_path: Path) -> None:
    single, parted = tmp_path / "single", tmp_path / "parted"
    diff(fsdp / "base" / "dcp", fsdp / "target" / "dcp", single)
    base, new = str(fsdp / "base" / "dcp"), str(fsdp / "target" / "dcp")
    for rank in (2, 0):
        r = run_cli("diff", base, new, "-o", str(parted), env={"RANK": str(rank), "WORLD_SIZE": "3"})
        assert r.returncode == 0, r.stderr
        assert not (parted / "manifest.json").exists()
    r = run_cli("diff", base, new, "-o", str(parted), "--rank", "1", "--world-size", "3", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["changed_elements"] > 0
    assert (parted / "manifest.json").exists() and not (parted / "parts").exists()
    assert item_keys(parted) == item_keys(single)  # every canonical element once: replicas emitted once
    Delta.open(parted).verify_blocks(("data", "repair"))
    assert_oracle(parted, fsdp / "base" / "hf", fsdp / "target" / "hf")


def test_torchrun_launches_one_producer_per_rank(fsdp: Path, tmp_path: Path) -> None:
    out = tmp_path / "d"
    r = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3", "-m", "dcr_cli",
         "diff", str(fsdp / "base" / "dcp"), str(fsdp / "target" / "dcp"), "-o", str(out), "--workers", "1"],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stderr.count("written") == 3  # three producers, each wrote its part; the last one assembled
    assert_oracle(out, fsdp / "base" / "hf", fsdp / "target" / "hf")


def test_assemble_refuses_missing_parts(fsdp: Path, tmp_path: Path) -> None:
    out = tmp_path / "d"
    for rank in (0, 2):
        diff(fsdp / "base" / "dcp", fsdp / "target" / "dcp", out, rank=rank, world_size=3)
    r = run_cli("assemble", str(out))
    assert r.returncode == 2 and "missing ranks [1]" in r.stderr
    assert not (out / "manifest.json").exists()
    diff(fsdp / "base" / "dcp", fsdp / "target" / "dcp", out, rank=1, world_size=3)
    r = run_cli("assemble", str(out))
    assert r.returncode == 0, r.stderr
    assert_oracle(out, fsdp / "base" / "hf", fsdp / "target" / "hf")


def test_mixed_or_forced_wrong_formats_fail_closed(fsdp: Path, tmp_path: Path) -> None:
    with pytest.raises(IncompatibleError, match="different formats"):
        diff(fsdp / "base" / "dcp", fsdp / "target" / "hf", tmp_path / "x")
    r = run_cli(
        "diff",
        str(fsdp / "base" / "dcp"),
        str(fsdp / "target" / "dcp"),
        "-o",
        str(tmp_path / "y"),
        "--format",
        "dcp-hf",
    )
    assert r.returncode == 2 and r.stderr.startswith("dcr: error:")
    assert not (tmp_path / "y").exists()


def test_truncated_shard_fails_closed(fsdp: Path, tmp_path: Path) -> None:
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(fsdp / "target" / "dcp", broken)
    victim = broken / "__1_0.distcp"
    victim.write_bytes(victim.read_bytes()[:-200])
    with pytest.raises(FormatError):
        diff(fsdp / "base" / "dcp", broken, tmp_path / "z")
    assert not (tmp_path / "z").exists()


def test_include_and_strip_prefix_select_and_name_the_weights(fsdp: Path, tmp_path: Path) -> None:
    full, some = tmp_path / "full", tmp_path / "some"
    diff(fsdp / "base" / "dcp", fsdp / "target" / "dcp", full)
    base, new = str(fsdp / "base" / "dcp"), str(fsdp / "target" / "dcp")
    r = run_cli("diff", base, new, "-o", str(some), "--include", "extra.*", "--include", "proj.weight",
                "--strip-prefix", "extra.")  # fmt: skip
    assert r.returncode == 0, r.stderr
    tensors = Delta.open(some).manifest.tensors
    assert sorted(tensors) == ["col_sharded", "plain_f32", "proj.weight", "replicated"]
    whole = Delta.open(full).manifest.tensors
    assert tensors["col_sharded"] == whole["extra.col_sharded"] and tensors["proj.weight"] == whole["proj.weight"]
    r = run_cli("diff", base, new, "-o", str(tmp_path / "none"), "--include", "optim.*")
    assert r.returncode == 2 and "no stored tensor matches" in r.stderr


@pytest.mark.parametrize("sub", ["dcp", "hf/sharded"])
def test_a_stream_hashes_each_training_checkpoint_once_and_a_rewrite_invalidates(
    fsdp: Path, tmp_path: Path, sub: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shutil

    from dcr_cli.checkpoints import open_source
    from dcr_cli.checkpoints.shards import ShardCheckpoint

    monkeypatch.setenv("DCR_CACHE_DIR", str(tmp_path / "cache"))
    base, target = tmp_path / "base", tmp_path / "target"
    shutil.copytree(fsdp / "base" / sub, base)
    shutil.copytree(fsdp / "target" / sub, target)
    hashed: list[str] = []
    digest = ShardCheckpoint.canonical_digest

    def counting(ckpt: ShardCheckpoint, name: str) -> str:
        hashed.append(f"{Path(ckpt.root).name}:{name}")
        return digest(ckpt, name)

    monkeypatch.setattr(ShardCheckpoint, "canonical_digest", counting)
    diff(base, target, tmp_path / "d1", workers=1)
    tensors = len(open_source(target).canonical)
    assert len(hashed) == 2 * tensors  # nothing cached yet: both sides hashed
    hashed.clear()
    diff(base, target, tmp_path / "d2", workers=1)
    assert hashed == []  # both tables come from the cache
    assert Delta.open(tmp_path / "d2").manifest.tensors == Delta.open(tmp_path / "d1").manifest.tensors

    # Rewrite one target shard with the same bytes: its identity changes, so the target is hashed again.
    shard = sorted(p for p in target.iterdir() if p.suffix in (".distcp", ".safetensors"))[0]
    data = shard.read_bytes()
    shard.unlink()
    shard.write_bytes(data)
    diff(base, target, tmp_path / "d3", workers=1)
    assert sorted(hashed) == sorted(f"target:{name}" for name in open_source(target).canonical)
