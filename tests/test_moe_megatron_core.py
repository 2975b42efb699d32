"""dcr diff of MoE checkpoints written by megatron-core itself in four parallel layouts (moe_megatron_writers.py).

Expert parallel 2 with SequentialMLP and with the legacy GroupedMLP; attention TP=2 with expert
tensor parallel 2; attention TP=2 with the experts expert-parallel over the same ranks. Each is
diffed with ``--profile config.json`` (vocab padding 50 -> 64, router, qk-norm, RMSNorm weights
kept in F32 by megatron: the cast path), whole and by ``--rank/--world-size`` producers, and the
delta applied to an independent HF export (torch's own DCP loader + the tests' dense conversion,
no dcr code) must give the target's export bit for bit.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
from conftest import require_or_skip
from safetensors.torch import save_file
from shard_oracle import assert_oracle
from shard_writers import REAL_MEGATRON_KEYS, full_tensors_from_dcp, megatron_to_hf

from dcr_cli.delta.inspect import inspect
from dcr_cli.delta.parts import assemble
from dcr_cli.delta.reader import Delta
from dcr_cli.produce import diff

require_or_skip("megatron.core.dist_checkpointing")

from moe_megatron_writers import (
    LAYOUTS,
    chunk_boxes,
    megatron_core_checkpoint,
    moe_layout,
    register_megatron_core,
    restack_singleton,
    write_te_grouped_spelling,
)
from test_shards_megatron import COMMON

MOE = {**COMMON, "tie_word_embeddings": False, "num_experts": 4, "moe_intermediate_size": 8,
       "megatron": {"padded_vocab_size": 64}}  # fmt: skip
for _layout in LAYOUTS:
    register_megatron_core(f"moe-{_layout}", MOE, **moe_layout(_layout))
PRE_MLP = "decoder.layers.pre_mlp_layernorm.weight"  # the local MoE spec's pre-MLP norm, as megatron_to_hf reads it
FC1 = "decoder.layers.mlp.experts.experts.linear_fc1.weight"  # [L, E, 2F, H], SequentialMLP's and GroupedMLP's key


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def written(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    root = megatron_core_checkpoint(tmp_path_factory, f"moe-{request.param}")
    for tag in ("base", "target"):
        full = full_tensors_from_dcp(root / tag / "torch_dist", root, moe=True)
        if LAYOUTS[request.param].get("singleton"):
            keys = {**REAL_MEGATRON_KEYS, "decoder.layers.mlp.linear_fc1.layer_norm_weight": PRE_MLP}
            full = {keys.get(k, k): v for k, v in restack_singleton(full, MOE).items()}
        (root / tag / "hf").mkdir(exist_ok=True)  # the checkpoint is the session's: set up again, same export
        save_file(megatron_to_hf(full, MOE), str(root / tag / "hf" / "model.safetensors"))
    return request.param, root


def test_the_layout_is_the_one_named(written: tuple[str, Path]) -> None:
    # The chunks megatron-core wrote for the expert fc1 tensor show the parallel layout.
    layout, root = written
    L, E, F, H = (int(MOE[k]) for k in ("num_hidden_layers", "num_experts", "moe_intermediate_size", "hidden_size"))  # type: ignore[call-overload]
    if LAYOUTS[layout].get("singleton"):
        # a key per layer and expert, SwiGLU fc1 as _w (gate) and _v (up) [F, H], each split by expert TP
        from torch.distributed.checkpoint import FileSystemReader

        stored = FileSystemReader(str(root / "base" / "torch_dist")).read_metadata().state_dict_metadata
        assert FC1 not in stored and "decoder.layers.self_attention.linear_qkv.weight" not in stored
        rows = F // 2 if LAYOUTS[layout]["etp"] == 2 else F
        for layer in range(L):
            assert f"decoder.layers.{layer}.self_attention.linear_qkv.weight" in stored
            for e in range(E):
                fc1 = f"decoder.layers.{layer}.mlp.experts.experts.{e}.linear_fc1.weight"
                for half in (fc1 + "_w", fc1 + "_v"):
                    assert chunk_boxes(root / "base" / "torch_dist", half) == [
                        ((r, 0), (rows, H)) for r in range(0, F, rows)
                    ]
                assert fc1 not in stored
                assert f"decoder.layers.{layer}.mlp.experts.experts.{e}.linear_fc2.weight" in stored
        return
    boxes = chunk_boxes(root / "base" / "torch_dist", FC1)
    assert {off[0] for off, _ in boxes} == set(range(L))
    # SequentialMLP saves each expert as its own chunk, GroupedMLP a rank's experts as one.
    per_chunk = 2 if LAYOUTS[layout]["grouped"] else 1
    assert {off[1] for off, _ in boxes} == set(range(0, E, per_chunk))
    assert all(size[1] == per_chunk and size[3] == H for _, size in boxes)
    # SwiGLU fc1 is saved as gate and up fragments; expert TP halves each again (one half per rank).
    rows = F // 2 if LAYOUTS[layout]["etp"] == 2 else F
    assert {size[2] for _, size in boxes} == {rows}
    assert {off[2] for off, _ in boxes} == set(range(0, 2 * F, rows))


def test_megatron_core_moe_delta_is_exact(written: tuple[str, Path], tmp_path: Path) -> None:
    _, root = written
    base, new = root / "base" / "torch_dist", root / "target" / "torch_dist"
    out = tmp_path / "d"
    summary = diff(base, new, out, profile=copy.deepcopy(MOE))
    assert summary is not None and summary.changed_elements > 0
    assert_oracle(out, root / "base" / "hf", root / "target" / "hf")

    rows = {r.tensor: r for r in inspect(out).tensors}
    names = set(Delta.open(out).manifest.tensors)
    experts = {f"model.layers.{layer}.mlp.experts.{e}.{p}_proj.weight"
               for layer in range(2) for e in range(4) for p in ("gate", "up", "down")}  # fmt: skip
    assert experts <= names and {"model.layers.0.mlp.gate.weight", "model.layers.1.self_attn.k_norm.weight"} <= names
    assert Delta.open(out).manifest.tensors["model.embed_tokens.weight"].shape == (MOE["vocab_size"], 16)  # unpadded
    for norm in ("model.norm.weight", "model.layers.0.input_layernorm.weight", "model.layers.1.self_attn.q_norm.weight",
                 "model.layers.0.post_attention_layernorm.weight"):  # fmt: skip
        assert rows[norm].residual == "dtype cast F32->BF16", norm
    assert rows["model.layers.0.mlp.experts.3.up_proj.weight"].residual is None
    assert rows["model.layers.1.mlp.gate.weight"].residual is None


@pytest.mark.parametrize("world_size", [2, 3])
def test_rank_producers_on_an_moe_checkpoint_assemble_the_same_delta(
    written: tuple[str, Path], tmp_path: Path, world_size: int
) -> None:
    _, root = written
    base, new = root / "base" / "torch_dist", root / "target" / "torch_dist"
    whole, parted = tmp_path / "whole", tmp_path / "parted"
    diff(base, new, whole, profile=copy.deepcopy(MOE))
    for rank in range(world_size):
        diff(base, new, parted, profile=copy.deepcopy(MOE), rank=rank, world_size=world_size)
    assemble(parted)
    assert Delta.open(parted).manifest.tensors == Delta.open(whole).manifest.tensors
    assert_oracle(parted, root / "base" / "hf", root / "target" / "hf")


@pytest.mark.parametrize("written", ["ep2-sequential-singleton"], indirect=True)  # one is enough to respell
def test_transformer_engine_grouped_expert_spelling_is_exact(written: tuple[str, Path], tmp_path: Path) -> None:
    """TEGroupedMLP writes the same storage keys as SequentialMLP (megatron-core 0.16: "interchangeable"), so
    the singleton layouts above cover it; TE GroupedLinear's own ``experts.linear_fc1.weight<E>`` spelling is
    a hand-made copy of the same tensors (TE does not run on CPU), fc1 joint [gate; up]."""
    _, root = written
    te = {
        tag: write_te_grouped_spelling(root / tag / "torch_dist", tmp_path / tag, tmp_path)
        for tag in ("base", "target")
    }
    from torch.distributed.checkpoint import FileSystemReader

    stored = FileSystemReader(str(te["base"])).read_metadata().state_dict_metadata
    fc1 = stored["decoder.layers.1.mlp.experts.linear_fc1.weight3"]
    assert tuple(fc1.size) == (2 * int(MOE["moe_intermediate_size"]), MOE["hidden_size"])  # type: ignore[call-overload,union-attr]
    assert not any(".experts.experts." in k for k in stored)
    out = tmp_path / "d"
    summary = diff(te["base"], te["target"], out, profile=copy.deepcopy(MOE))
    assert summary is not None and summary.changed_elements > 0
    assert_oracle(out, root / "base" / "hf", root / "target" / "hf")
    parted = tmp_path / "p"
    for rank in range(2):
        diff(te["base"], te["target"], parted, profile=copy.deepcopy(MOE), rank=rank, world_size=2)
    assemble(parted)
    assert Delta.open(parted).manifest.tensors == Delta.open(out).manifest.tensors
    assert_oracle(parted, root / "base" / "hf", root / "target" / "hf")


# The default layouts are diffed through the CLI elsewhere.
@pytest.mark.parametrize("written", sorted(k for k in LAYOUTS if LAYOUTS[k].get("singleton")), indirect=True)
def test_cli_diff_of_a_singleton_checkpoint_with_profile_config_json(written: tuple[str, Path], tmp_path: Path) -> None:
    """``dcr diff --profile config.json`` (and ``--rank/--world-size``) on megatron-core's singleton layout."""
    import json

    from click.testing import CliRunner

    from dcr_cli.cli import main

    _, root = written
    config = tmp_path / "config.json"
    config.write_text(json.dumps(MOE))
    base, new = str(root / "base" / "torch_dist"), str(root / "target" / "torch_dist")
    result = CliRunner().invoke(main, ["diff", base, new, "-o", str(tmp_path / "d"), "--profile", str(config)])
    assert result.exit_code == 0, result.output
    assert_oracle(tmp_path / "d", root / "base" / "hf", root / "target" / "hf")
    for rank in range(2):
        args = ["diff", base, new, "-o", str(tmp_path / "p"), "--profile", str(config), "--rank", str(rank)]
        result = CliRunner().invoke(main, [*args, "--world-size", "2"])
        assert result.exit_code == 0, result.output
    # the producer that wrote the last part assembled the delta (the CLI's default)
    assert Delta.open(tmp_path / "p").manifest.tensors == Delta.open(tmp_path / "d").manifest.tensors
    assert_oracle(tmp_path / "p", root / "base" / "hf", root / "target" / "hf")
    # a profile that does not match is refused before anything is written, naming the key and the profile
    config.write_text(json.dumps({**MOE, "moe_intermediate_size": 16}))
    result = CliRunner().invoke(main, ["diff", base, new, "-o", str(tmp_path / "x"), "--profile", str(config)])
    assert result.exit_code != 0 and "does --profile match the model?" in result.stderr, result.output
    assert "linear_fc1.weight_w" in result.stderr and not (tmp_path / "x").exists()
