"""dcr diff of checkpoints written by megatron-core itself (GPTModel + dist_checkpointing, torch_dist, on CPU).

megatron-core is in the test extra (it needs only torch, numpy and packaging for what is used
here), so .ci/run always runs this file; outside CI it is skipped where megatron-core is missing.
The hand-written layout in test_shards_megatron.py covers the same profile without it.
The reference HF checkpoints come from torch's own DCP loader (``dcp_to_torch_save``) and the
dense conversion ``megatron_to_hf`` of the tests, independent of dcr's index maps.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
from conftest import require_or_skip
from safetensors.torch import save_file
from shard_oracle import assert_oracle
from shard_writers import full_tensors_from_dcp, megatron_to_hf

from dcr_cli.delta.inspect import inspect
from dcr_cli.delta.parts import assemble
from dcr_cli.delta.reader import Delta
from dcr_cli.produce import diff

require_or_skip("megatron.core.dist_checkpointing")

from moe_megatron_writers import megatron_core_checkpoint, register_megatron_core
from test_shards_megatron import COMMON

# The same tiny model as the hand-written layout's; megatron pads the vocab 50 -> 64 and keeps
# RMSNorm weights in F32 (a residual dtype cast).
DENSE = {**COMMON, "tie_word_embeddings": True, "megatron": {"padded_vocab_size": 64}}
MOE = {**COMMON, "tie_word_embeddings": False, "num_experts": 4, "moe_intermediate_size": 8,
       "megatron": {"padded_vocab_size": 64}}  # fmt: skip
# TP = 2 for the dense model, EP = 2 for the MoE (shard_writers.write_real_megatron_checkpoints' layouts).
register_megatron_core("core-dense", DENSE, tp=2, ep=1)
register_megatron_core("core-moe", MOE, tp=1, ep=2)


@pytest.fixture(scope="module", params=["dense", "moe"])
def real(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    cfg = DENSE if request.param == "dense" else MOE
    root = megatron_core_checkpoint(tmp_path_factory, f"core-{request.param}")
    for tag in ("base", "target"):
        full = full_tensors_from_dcp(root / tag / "torch_dist", root, moe=request.param == "moe")
        (root / tag / "hf").mkdir(exist_ok=True)  # the checkpoint is the session's: set up again, same export
        save_file(megatron_to_hf(full, cfg), str(root / tag / "hf" / "model.safetensors"))
    return root, cfg


def test_megatron_core_checkpoint_delta_is_exact(real: tuple[Path, dict], tmp_path: Path) -> None:
    root, cfg = real
    base, new = root / "base" / "torch_dist", root / "target" / "torch_dist"
    out = tmp_path / "d"
    summary = diff(base, new, out, profile=copy.deepcopy(cfg))
    assert summary is not None and summary.changed_elements > 0
    assert_oracle(out, root / "base" / "hf", root / "target" / "hf")
    rows = {r.tensor: r.residual for r in inspect(out).tensors}
    assert rows["model.norm.weight"] == "dtype cast F32->BF16"
    assert rows["model.layers.0.self_attn.q_proj.weight"] is None
    parted = tmp_path / "p"
    for rank in range(2):
        diff(base, new, parted, profile=copy.deepcopy(cfg), rank=rank, world_size=2)
    assemble(parted)
    assert Delta.open(parted).manifest.tensors == Delta.open(out).manifest.tensors
    assert_oracle(parted, root / "base" / "hf", root / "target" / "hf")
