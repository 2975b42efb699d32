"""Live diff of a real 2-rank FSDP2 model (gloo, CPU): a few AdamW steps, each diffed with no checkpoint.

Each rank hands ``dcr_cli.Producer`` its DTensor state dict after every optimizer step. The test
also saves (only as references) the dense HF export and a ``dcp.save`` checkpoint of every step:
each live delta, applied to the HF export of step 0 and its successors, gives the dense export
of its step bit for bit, and it is the delta ``dcr diff --rank R`` of the DCP checkpoints writes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from checkpoints import read_bits
from manifest_text import manifest_text
from shard_writers import TinyModel, spawn_ranks

import dcr_cli
from dcr_cli.delta.parts import assemble

STEPS = 3


def _worker(rank: int, world: int, out: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    torch.manual_seed(0)
    model = TinyModel(37, 16).to(torch.bfloat16)
    mesh = init_device_mesh("cpu", (world,))
    for m in (model.embed, model.proj, model.out, model.head):
        fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    g = torch.Generator().manual_seed(1)
    extra = {  # a column-sharded (uneven) and a replicated DTensor, as other parallel layouts hold them
        "extra.col_sharded": distribute_tensor(torch.randn(5, 9, generator=g).to(torch.bfloat16), mesh, [Shard(1)]),
        "extra.replicated": distribute_tensor(torch.randn(7, generator=g).to(torch.bfloat16), mesh, [Replicate()]),
    }
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def state() -> dict[str, torch.Tensor]:
        return {**model.state_dict(), **extra}

    def references(step: int) -> None:  # what the test compares with; the producer never reads them
        sd = state()
        full = {k: (v.full_tensor() if isinstance(v, DTensor) else v).contiguous() for k, v in sd.items()}
        if rank == 0:
            save_file(full, f"{out}/hf-{step}/model.safetensors")
        dcp.save(sd, checkpoint_id=f"{out}/dcp-{step}")

    if rank == 0:
        for step in range(STEPS + 1):
            Path(f"{out}/hf-{step}").mkdir(parents=True)
    dist.barrier()
    references(0)
    producer = dcr_cli.Producer(f"{out}/deltas", baseline=state(), base_version="step-0")
    data = torch.Generator().manual_seed(100 + rank)
    for step in range(1, STEPS + 1):
        tokens = torch.randint(0, 18, (4, 6), generator=data)
        model(tokens).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            extra["extra.replicated"].to_local()[step] += 1.0  # the same change on every replica
            extra["extra.col_sharded"].to_local().view(torch.int16).view(-1)[-1] ^= step
        summary = producer.diff(state(), version=f"step-{step}")
        assert summary is not None and summary.changed_elements > 0
        references(step)
        producer.committed(f"step-{step}")  # in a real loop: once every receiver acknowledged it
    shapes = {k: tuple(v.to_local().shape) for k, v in model.state_dict().items()}
    expected = sum(torch.Size(s).numel() * 2 for s in shapes.values()) + sum(
        v.to_local().numel() * 2 for v in extra.values()
    )
    assert producer.baseline_bytes == expected  # one copy of this rank's shard


def _manifest(delta: Path) -> dict:
    m = json.loads(manifest_text(delta))
    m.pop("created")
    return m


def test_fsdp2_steps_diffed_live_apply_bit_exactly_and_equal_the_dcp_diff(tmp_path: Path) -> None:
    spawn_ranks(_worker, 2, str(tmp_path))
    receiver = tmp_path / "receiver"
    shutil.copytree(tmp_path / "hf-0", receiver)
    for step in range(1, STEPS + 1):
        live = tmp_path / "deltas" / f"step-{step}"
        dcr_cli.apply(live, into=receiver)
        assert read_bits(receiver) == read_bits(tmp_path / f"hf-{step}"), f"step {step}"
        assert dcr_cli.verify(receiver, against=live).ok
        # the same delta as dcr diff --rank R --world-size 2 of the equivalent DCP checkpoints
        files = tmp_path / f"files-{step}"
        for rank in range(2):
            dcr_cli.diff(tmp_path / f"dcp-{step - 1}", tmp_path / f"dcp-{step}", files, rank=rank, world_size=2,
                         base_version=f"step-{step - 1}", target_version=f"step-{step}")  # fmt: skip
        assemble(files)
        assert _manifest(live) == _manifest(files)
