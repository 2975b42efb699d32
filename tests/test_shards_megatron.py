"""dcr diff from Megatron torch_dist checkpoints (hand-written megatron-core layout, see shard_writers.py).

The reference target is a dense Megatron -> HF conversion written in the tests
(``megatron_to_hf``), independent of dcr's index maps.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
from safetensors.torch import save_file
from shard_oracle import assert_oracle
from shard_writers import megatron_globals, megatron_to_hf, mutate_megatron, write_megatron_checkpoints

from dcr_cli.checkpoints import detect_format
from dcr_cli.delta.inspect import inspect
from dcr_cli.delta.parts import assemble
from dcr_cli.delta.reader import Delta
from dcr_cli.errors import IncompatibleError
from dcr_cli.produce import diff

COMMON = dict(
    hidden_size=16,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    intermediate_size=24,
    vocab_size=50,
    torch_dtype="bfloat16",
)
# Llama/Qwen3 dense: tied output layer, zero-centred norms, vocab padded 50 -> 64.
DENSE = {**COMMON, "tie_word_embeddings": True, "megatron": {"padded_vocab_size": 64, "zero_centered_gamma": True}}
# Qwen3-MoE: 4 experts over 2 expert-parallel ranks, untied lm_head, norms kept in F32 (a dtype cast to BF16).
MOE = {
    **COMMON,
    "tie_word_embeddings": False,
    "num_experts": 4,
    "moe_intermediate_size": 8,
    "megatron": {"padded_vocab_size": 64, "norms_f32": True},
}


def build(root: Path, cfg: dict) -> Path:
    write_megatron_checkpoints(root, cfg, world=2)
    base = megatron_globals(cfg, 11)
    for tag, tensors in (("base", base), ("target", mutate_megatron(base, cfg))):
        (root / tag / "hf").mkdir(parents=True)
        save_file(megatron_to_hf(tensors, cfg), str(root / tag / "hf" / "model.safetensors"))
    return root


@pytest.fixture(scope="module")
def dense(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(tmp_path_factory.mktemp("dense"), DENSE)


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(tmp_path_factory.mktemp("moe"), MOE)


def test_megatron_dense_is_exact(dense: Path, tmp_path: Path) -> None:
    assert detect_format(dense / "base" / "torch_dist") == "megatron"
    out = tmp_path / "d"
    diff(dense / "base" / "torch_dist", dense / "target" / "torch_dist", out, profile=DENSE)
    assert_oracle(out, dense / "base" / "hf", dense / "target" / "hf")
    m = Delta.open(out).manifest
    assert "lm_head.weight" not in m.tensors  # tied: the output layer is a checked duplicate, emitted once
    by_tensor = {it.tensor: it for it in m.items}
    # QKV per-group interleave and [gate; up] are index-only: box items, no residual
    for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
        item = by_tensor[f"model.layers.0.{name}.weight"]
        assert item.region.is_box and item.residual is None
    rows = {r.tensor: r.residual for r in inspect(out).tensors}
    assert rows["model.layers.1.input_layernorm.weight"] == "zero-centred norm +1"
    assert rows["model.embed_tokens.weight"].startswith("tied: output_layer.weight")
    assert rows["model.layers.0.self_attn.q_proj.weight"] is None


def test_megatron_moe_is_exact_and_parts_match(moe: Path, tmp_path: Path) -> None:
    base, new = moe / "base" / "torch_dist", moe / "target" / "torch_dist"
    out = tmp_path / "d"
    diff(base, new, out, profile=MOE)
    assert_oracle(out, moe / "base" / "hf", moe / "target" / "hf")
    rows = {r.tensor: r.residual for r in inspect(out).tensors}
    assert rows["model.norm.weight"] == "dtype cast F32->BF16"
    assert rows["model.layers.1.mlp.experts.3.up_proj.weight"] is None
    parted = tmp_path / "p"
    for rank in range(2):
        assert diff(base, new, parted, profile=MOE, rank=rank, world_size=2) is None
    assemble(parted)
    a, b = Delta.open(out).manifest, Delta.open(parted).manifest
    assert a.tensors == b.tensors and a.base == b.base and len(a.items) == len(b.items)
    assert_oracle(parted, moe / "base" / "hf", moe / "target" / "hf")


def test_tied_profile_on_untied_weights_fails_closed(moe: Path, tmp_path: Path) -> None:
    cfg = copy.deepcopy(MOE)
    cfg["tie_word_embeddings"] = True
    with pytest.raises(IncompatibleError, match="tied copy"):
        diff(moe / "base" / "torch_dist", moe / "target" / "torch_dist", tmp_path / "d", profile=cfg)
    assert not (tmp_path / "d").exists()


def test_profile_that_does_not_match_fails_closed(dense: Path, tmp_path: Path) -> None:
    cfg = copy.deepcopy(DENSE)
    cfg["num_key_value_heads"] = 4
    with pytest.raises(IncompatibleError, match="rows"):
        diff(dense / "base" / "torch_dist", dense / "target" / "torch_dist", tmp_path / "d", profile=cfg)
    with pytest.raises(IncompatibleError, match="--profile"):
        diff(dense / "base" / "torch_dist", dense / "target" / "torch_dist", tmp_path / "d")


def test_singleton_local_shards_layout_is_named_not_blamed_on_the_profile() -> None:
    """megatron-core's singleton_local_shards layout (per-layer keys, fc1 split in _w/_v, a key per expert)
    used to be refused as a key "missing (does --profile match the model?)"; the message names the layout."""
    from types import SimpleNamespace

    from dcr_cli.checkpoints.megatron import megatron_canonical

    def t(*shape: int) -> SimpleNamespace:
        return SimpleNamespace(dtype="BF16", shape=shape)

    stored = {
        "embedding.word_embeddings.weight": t(50, 16),
        "output_layer.weight": t(50, 16),
        "decoder.final_layernorm.weight": t(16),
        **{f"decoder.layers.{i}.self_attention.linear_qkv.weight": t(64, 16) for i in range(2)},
        **{f"decoder.layers.{i}.mlp.experts.{e}.linear_fc1.weight_w": t(24, 16) for i in range(2) for e in range(4)},
    }
    reader = SimpleNamespace(stored=stored, root="ckpt")
    with pytest.raises(IncompatibleError, match="singleton_local_shards") as info:
        megatron_canonical(reader, MOE)  # type: ignore[arg-type]
    assert "does --profile match" not in str(info.value) and "decoder.layers.0." in str(info.value)
    # the default layout with a key really missing still says so
    for k in [k for k in stored if k.startswith("decoder.layers.") and k[15].isdigit()]:
        del stored[k]
    with pytest.raises(IncompatibleError, match="does --profile match"):
        megatron_canonical(reader, MOE)  # type: ignore[arg-type]
