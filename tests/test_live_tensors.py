"""Live tensors in one process: ``dcr_cli.diff_tensors`` and ``dcr_cli.Producer`` (issue 14).

The delta of live tensors must be the delta ``dcr diff`` writes for the equivalent checkpoints,
bit for bit except ``created``; and applying it must give the target's bits.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from checkpoints import apply_in_memory, read_bits, write_checkpoint
from manifest_text import manifest_text
from test_diff import model_pair

import dcr_cli
from dcr_cli.delta.reader import Delta
from dcr_cli.errors import IncompatibleError
from dcr_cli.format.manifest import MANIFEST_NAME

REPO = Path(__file__).resolve().parents[1]


def manifest_without_created(delta: Path) -> dict:
    m = json.loads(manifest_text(delta))
    m.pop("created")
    return m


def blocks_of(delta: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in (delta / "blocks").iterdir()}


def test_plain_tensors_give_the_delta_of_their_hf_checkpoints(tmp_path: Path) -> None:
    base, new = model_pair()
    a, b = write_checkpoint(tmp_path / "a", base), write_checkpoint(tmp_path / "b", new)
    dcr_cli.diff(a, b, tmp_path / "files", base_version="v0", target_version="v1", workers=2)
    summary = dcr_cli.diff_tensors(base, new, tmp_path / "live", base_version="v0", target_version="v1", workers=2)
    assert summary is not None and summary.changed_elements > 0
    assert manifest_without_created(tmp_path / "live") == manifest_without_created(tmp_path / "files")
    assert blocks_of(tmp_path / "live") == blocks_of(tmp_path / "files")
    assert apply_in_memory(tmp_path / "live", read_bits(a)) == read_bits(b)


def test_a_name_map_and_overwrite_globs_apply_to_live_tensors(tmp_path: Path) -> None:
    base, new = model_pair()
    prefixed = {f"module.{k}": v for k, v in base.items()}
    prefixed_new = {f"module.{k}": v for k, v in new.items()} | {"optim.step": torch.tensor(3)}

    def names(key: str) -> str | None:
        return key.removeprefix("module.") if key.startswith("module.") else None

    a, b = write_checkpoint(tmp_path / "a", base), write_checkpoint(tmp_path / "b", new)
    dcr_cli.diff(a, b, tmp_path / "files", overwrite=["layers.F32.*"])
    dcr_cli.diff_tensors(
        {**prefixed, "optim.step": torch.tensor(2)}, prefixed_new, tmp_path / "live", names=names,
        overwrite=["layers.F32.*"],
    )  # fmt: skip
    assert manifest_without_created(tmp_path / "live") == manifest_without_created(tmp_path / "files")


def test_a_layout_change_is_refused_and_writes_nothing(tmp_path: Path) -> None:
    base, new = model_pair()
    new["signs"] = torch.zeros(4, dtype=torch.bfloat16)
    with pytest.raises(IncompatibleError, match="signs"):
        dcr_cli.diff_tensors(base, new, tmp_path / "d")
    assert not (tmp_path / "d").exists()


def adam_steps(steps: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """A small BF16 model trained ``steps`` real AdamW steps: the state after each step."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Embedding(64, 32), torch.nn.Linear(32, 48), torch.nn.Linear(48, 8))
    model = model.to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    states = [{k: v.detach().clone() for k, v in model.state_dict().items()}]
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        tokens = torch.randint(0, 32, (4, 5), generator=g)
        model(tokens).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        states.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return states


@pytest.mark.parametrize("baseline_from", ["tensors", "checkpoint"])
def test_producer_chains_committed_steps_onto_a_checkpoint(tmp_path: Path, baseline_from: str) -> None:
    states = adam_steps(3)
    receiver = write_checkpoint(tmp_path / "receiver", states[0])
    baseline = states[0] if baseline_from == "tensors" else str(write_checkpoint(tmp_path / "step0", states[0]))
    producer = dcr_cli.Producer(tmp_path / "deltas", baseline=baseline, base_version="step-0")
    assert producer.baseline_bytes == (0 if baseline_from == "checkpoint" else sum(
        t.numel() * t.element_size() for t in states[0].values()))  # fmt: skip
    for step in (1, 2, 3):
        summary = producer.diff(states[step], version=f"step-{step}")
        assert summary is not None and summary.changed_elements > 0
        delta = tmp_path / "deltas" / f"step-{step}"
        # The same bits as dcr diff of the two steps' HF checkpoints.
        prev = write_checkpoint(tmp_path / f"hf-{step - 1}", states[step - 1])
        cur = write_checkpoint(tmp_path / f"hf-{step}", states[step])
        dcr_cli.diff(prev, cur, tmp_path / f"files-{step}", base_version=f"step-{step - 1}",
                     target_version=f"step-{step}")  # fmt: skip
        assert manifest_without_created(delta) == manifest_without_created(tmp_path / f"files-{step}")
        dcr_cli.apply(delta, into=receiver)
        assert read_bits(receiver) == read_bits(cur)
        producer.committed(f"step-{step}")


def test_an_uncommitted_version_is_diffed_again_from_the_old_baseline(tmp_path: Path) -> None:
    states = adam_steps(2)
    producer = dcr_cli.Producer(tmp_path / "deltas", baseline=states[0], base_version="step-0")
    producer.diff(states[1], version="step-1")
    # step-1 is never committed (receivers did not acknowledge): step-2 is diffed from step-0
    producer.diff(states[2], version="step-2")
    d = Delta.open(tmp_path / "deltas" / "step-2").manifest
    assert d.base.version == "step-0"
    base = write_checkpoint(tmp_path / "hf-0", states[0])
    assert apply_in_memory(tmp_path / "deltas" / "step-2", read_bits(base)) == read_bits(
        write_checkpoint(tmp_path / "hf-2", states[2])
    )
    with pytest.raises(IncompatibleError, match="step-1"):
        producer.committed("step-1")
    # a retry of the same version replaces its delta, still from step-0
    producer.diff(states[2], version="step-2")
    producer.committed("step-2")
    producer.diff(states[2], version="step-3")
    assert Delta.open(tmp_path / "deltas" / "step-3").manifest.items == []


CRASHING_PRODUCER = """
import os, sys, torch
import dcr_cli
sys.path.insert(0, {tests!r})
from test_live_tensors import adam_steps
states = adam_steps(2)
producer = dcr_cli.Producer({out!r}, baseline={baseline!r}, base_version="step-1")
producer.diff(states[2], version="step-2")
os._exit(17)  # crash between diff and commit
"""


def test_a_producer_that_crashes_between_diff_and_commit_resumes(tmp_path: Path) -> None:
    states = adam_steps(2)
    # step-1 is committed; the receivers (and the producer's mirror) hold it.
    receiver = write_checkpoint(tmp_path / "receiver", states[1])
    mirror = write_checkpoint(tmp_path / "mirror", states[1])
    script = CRASHING_PRODUCER.format(tests=str(REPO / "tests"), out=str(tmp_path / "deltas"), baseline=str(mirror))
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests'}"}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 17, proc.stderr
    assert (tmp_path / "deltas" / "step-2" / MANIFEST_NAME).exists()  # written, never committed
    # The restarted producer reads its baseline once from the mirror and diffs step-2 again.
    producer = dcr_cli.Producer(tmp_path / "deltas", baseline=str(mirror), base_version="step-1")
    producer.diff(states[2], version="step-2")
    dcr_cli.apply(tmp_path / "deltas" / "step-2", into=receiver)
    assert read_bits(receiver) == read_bits(write_checkpoint(tmp_path / "hf-2", states[2]))
    producer.committed("step-2")
    assert not np.array_equal(states[1]["1.weight"].float().numpy(), states[2]["1.weight"].float().numpy())


@pytest.fixture(params=["kernel", "torch"])
def scan_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both scans: the compiled kernel (CPU tensors) and the torch path that CUDA tensors take."""
    import dcr_cli.produce.live as live

    monkeypatch.setattr(live, "CPU_KERNEL", request.param == "kernel")
    return str(request.param)


def test_both_scan_paths_give_the_delta_of_the_hf_checkpoints(tmp_path: Path, scan_path: str) -> None:
    base, new = model_pair()
    a, b = write_checkpoint(tmp_path / "a", base), write_checkpoint(tmp_path / "b", new)
    dcr_cli.diff(a, b, tmp_path / "files")
    dcr_cli.diff_tensors(base, new, tmp_path / "live")
    assert manifest_without_created(tmp_path / "live") == manifest_without_created(tmp_path / "files")


def boxes(t: torch.Tensor, cols: int) -> list[dcr_cli.LiveShard]:
    """A 2-D tensor as column boxes (as a row-parallel layer's shards): strided, never a flat range."""
    return [
        dcr_cli.LiveShard(t[:, c : c + cols], (0, c), tuple(t.shape)) for c in range(0, t.shape[1], cols)
    ] if t.dim() == 2 else [dcr_cli.LiveShard(t, (0,) * t.dim(), tuple(t.shape))]  # fmt: skip


def test_live_shard_boxes_apply_exactly_and_commit_advances_strided_baselines(tmp_path: Path, scan_path: str) -> None:
    states = adam_steps(3)
    receiver = write_checkpoint(tmp_path / "receiver", states[0])
    as_boxes = [{k: boxes(v, 5) for k, v in s.items()} for s in states]
    producer = dcr_cli.Producer(tmp_path / "deltas", baseline=as_boxes[0], base_version="step-0")
    for step in (1, 2, 3):
        producer.diff(as_boxes[step], version=f"step-{step}")
        manifest = Delta.open(tmp_path / "deltas" / f"step-{step}").manifest
        assert any(item.region.is_box for item in manifest.items)
        dcr_cli.apply(tmp_path / "deltas" / f"step-{step}", into=receiver)
        assert read_bits(receiver) == read_bits(write_checkpoint(tmp_path / f"hf-{step}", states[step]))
        producer.committed(f"step-{step}")


def test_a_scan_records_what_advances_a_strided_baseline_band(scan_path: str) -> None:
    from dcr_cli.format.manifest import Region
    from dcr_cli.produce.live import advance, torch_scan

    g = torch.Generator().manual_seed(3)
    baseline = torch.randint(-(2**15), 2**15, (6, 10), generator=g, dtype=torch.int16)
    target = baseline.clone()
    target[1, 2], target[4, 7], target[5, 9] = 1, 2, 3
    band = baseline[1:6, 2:10]  # strided: a piece of a chunk (e.g. a QKV row block of one group)
    assert not band.is_contiguous()
    changes: list = []
    item = torch_scan(None, changes.append)("t", Region.box((0, 0), (5, 8)), band, target[1:6, 2:10], "xor", None)
    assert item is not None and item.count == 3
    advance(changes)
    assert torch.equal(baseline[1:6, 2:10], target[1:6, 2:10]) and torch.equal(baseline, target)
