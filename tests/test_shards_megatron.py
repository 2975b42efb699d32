"""dcr diff from Megatron torch_dist checkpoints (hand-written megatron-core layout, see shard_writers.py).

The reference target is a dense Megatron -> HF conversion written in the tests
(``megatron_to_hf``), independent of dcr's index maps.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
from moe_megatron_writers import write_megatron_checkpoints_together
from safetensors.torch import save_file
from shard_oracle import assert_oracle
from shard_writers import megatron_globals, megatron_to_hf, mutate_megatron

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


def export_hf(root: Path, cfg: dict) -> Path:
    """The dense HF conversions (``megatron_to_hf``) of the checkpoints under ``root`` (base, target), beside them."""
    base = megatron_globals(cfg, 11)
    for tag, tensors in (("base", base), ("target", mutate_megatron(base, cfg))):
        (root / tag / "hf").mkdir(parents=True)
        save_file(megatron_to_hf(tensors, cfg), str(root / tag / "hf" / "model.safetensors"))
    return root


# built's checkpoints, by name, once per session.
_BUILT: dict[str, Path] = {}


def built(tmp_path_factory: pytest.TempPathFactory, name: str) -> Path:
    """shard_writers' ``write_megatron_checkpoints(root, cfg, world=2)`` and ``export_hf`` of DENSE ("dense")
    or MOE ("moe"): both are written the first time either is asked for, in one run of the gloo ranks, and
    shared (read-only) by the tests of the session (test_review9_megatron reads "dense" too)."""
    if not _BUILT:
        roots = {"dense": tmp_path_factory.mktemp("dense"), "moe": tmp_path_factory.mktemp("moe")}
        cfgs = {"dense": DENSE, "moe": MOE}
        write_megatron_checkpoints_together([(roots[n], cfgs[n]) for n in roots], world=2)
        _BUILT.update({n: export_hf(roots[n], cfgs[n]) for n in roots})
    return _BUILT[name]


@pytest.fixture(scope="module")
def dense(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return built(tmp_path_factory, "dense")


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return built(tmp_path_factory, "moe")


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
    assert (rows["model.embed_tokens.weight"] or "").startswith("tied: output_layer.weight")
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


@pytest.mark.parametrize("layers", [1, 3])
def test_a_profile_with_another_layer_count_fails_closed(dense: Path, tmp_path: Path, layers: int) -> None:
    """One layer fewer would otherwise diff only the first layer, silently; one more names a missing key."""
    cfg = copy.deepcopy(DENSE)
    cfg["num_hidden_layers"] = layers
    with pytest.raises(IncompatibleError, match=r"does --profile match the model"):
        diff(dense / "base" / "torch_dist", dense / "target" / "torch_dist", tmp_path / "d", profile=cfg)
    assert not (tmp_path / "d").exists()


def _singleton_stored(expert_key: str) -> dict:
    """The stored keys and shapes of megatron-core's singleton_local_shards layout of MOE (structure only)."""
    from types import SimpleNamespace

    def t(*shape: int) -> SimpleNamespace:
        return SimpleNamespace(dtype="BF16", shape=shape)

    stored = {
        "embedding.word_embeddings.weight": t(64, 16),
        "output_layer.weight": t(64, 16),
        "decoder.final_layernorm.weight": t(16),
    }
    for i in range(2):
        p = f"decoder.layers.{i}."
        stored |= {
            p + "input_layernorm.weight": t(16),
            p + "pre_mlp_layernorm.weight": t(16),
            p + "self_attention.linear_qkv.weight": t(64, 16),
            p + "self_attention.linear_proj.weight": t(16, 32),
            p + "mlp.router.weight": t(4, 16),
        }
        for e in range(4):
            fc1 = p + expert_key.format(e=e, fc="linear_fc1")
            fc2 = p + expert_key.format(e=e, fc="linear_fc2")
            stored |= {fc1 + "_w": t(8, 16), fc1 + "_v": t(8, 16), fc2: t(16, 8)}
    return stored


@pytest.mark.parametrize("expert_key", ["mlp.experts.experts.{e}.{fc}.weight", "mlp.experts.{fc}.weight{e}"])
def test_singleton_local_shards_keys_map_per_layer_and_per_expert(expert_key: str) -> None:
    """The singleton_local_shards layout (megatron-core's per-expert keys, and TE GroupedLinear's weight<E>
    spelling): each per-layer, per-expert key is one canonical tensor, _w the gate and _v the up projection.
    Exactness against megatron-core itself is in test_moe_megatron_core.py."""
    from types import SimpleNamespace

    from dcr_cli.checkpoints.megatron import megatron_canonical

    stored = _singleton_stored(expert_key)
    out = megatron_canonical(SimpleNamespace(stored=stored, root="ckpt"), MOE)  # type: ignore[arg-type]
    fc1 = "decoder.layers.1." + expert_key.format(e=3, fc="linear_fc1")
    gate, up = out["model.layers.1.mlp.experts.3.gate_proj.weight"], out["model.layers.1.mlp.experts.3.up_proj.weight"]
    assert [(s.key, s.offsets, s.sizes) for s in gate.segments] == [(fc1 + "_w", (0, 0), (8, 16))]
    assert [(s.key, s.offsets, s.sizes) for s in up.segments] == [(fc1 + "_v", (0, 0), (8, 16))]
    down = out["model.layers.0.mlp.experts.2.down_proj.weight"].segments
    assert [s.key for s in down] == ["decoder.layers.0." + expert_key.format(e=2, fc="linear_fc2")]
    k = out["model.layers.1.self_attn.k_proj.weight"].segments  # per-layer qkv: no layer axis
    qkv = "decoder.layers.1.self_attention.linear_qkv.weight"
    assert [(s.key, s.offsets) for s in k] == [(qkv, (16, 0)), (qkv, (48, 0))]


def test_singleton_local_shards_layout_that_is_not_whole_is_refused() -> None:
    """What dcr does not map is still refused, before anything is read: half a SwiGLU pair, a per-expert key
    of the wrong shape, a key really missing (the profile named)."""
    from types import SimpleNamespace

    from dcr_cli.checkpoints.megatron import megatron_canonical

    stored = _singleton_stored("mlp.experts.experts.{e}.{fc}.weight")
    reader = SimpleNamespace(stored=stored, root="ckpt")
    v = stored.pop("decoder.layers.1.mlp.experts.experts.2.linear_fc1.weight_v")
    with pytest.raises(IncompatibleError, match=r"linear_fc1\.weight_w is stored without its SwiGLU other half"):
        megatron_canonical(reader, MOE)  # type: ignore[arg-type]
    stored["decoder.layers.1.mlp.experts.experts.2.linear_fc1.weight_v"] = SimpleNamespace(dtype="BF16", shape=(16, 16))
    with pytest.raises(IncompatibleError, match=r"weight_v is \[16, 16\].*8 rows.*does --profile match"):
        megatron_canonical(reader, MOE)  # type: ignore[arg-type]
    stored["decoder.layers.1.mlp.experts.experts.2.linear_fc1.weight_v"] = v
    del stored["decoder.layers.0.mlp.experts.experts.1.linear_fc2.weight"]
    with pytest.raises(IncompatibleError, match=r"experts\.1\.linear_fc2\.weight' is missing \(does --profile match"):
        megatron_canonical(reader, MOE)  # type: ignore[arg-type]


def test_singleton_local_shards_dense_mlp_reads_the_w_v_halves() -> None:
    """A dense model in the singleton_local_shards layout: per-layer keys, the MLP's linear_fc1 as _w and _v."""
    from types import SimpleNamespace

    from dcr_cli.checkpoints.megatron import megatron_canonical

    def t(*shape: int) -> SimpleNamespace:
        return SimpleNamespace(dtype="BF16", shape=shape)

    stored = {"embedding.word_embeddings.weight": t(64, 16), "decoder.final_layernorm.weight": t(16)}
    for i in range(2):
        p = f"decoder.layers.{i}."
        stored |= {
            p + "self_attention.linear_qkv.layer_norm_weight": t(16),
            p + "self_attention.linear_qkv.weight": t(64, 16),
            p + "self_attention.linear_proj.weight": t(16, 32),
            p + "mlp.linear_fc1.layer_norm_weight": t(16),
            p + "mlp.linear_fc1.weight_w": t(24, 16),
            p + "mlp.linear_fc1.weight_v": t(24, 16),
            p + "mlp.linear_fc2.weight": t(16, 24),
        }
    out = megatron_canonical(SimpleNamespace(stored=stored, root="ckpt"), DENSE)  # type: ignore[arg-type]
    up = out["model.layers.1.mlp.up_proj.weight"].segments
    assert [(s.key, s.offsets, s.sizes) for s in up] == [("decoder.layers.1.mlp.linear_fc1.weight_v", (0, 0), (24, 16))]
    assert out["model.layers.0.input_layernorm.weight"].residual == "zero-centred norm +1"
    stored["decoder.layers.0.mlp.linear_fc1.weight_w"] = t(48, 16)  # a joint [gate; up] shape under the _w key
    with pytest.raises(IncompatibleError, match=r"weight_w is \[48, 16\].*24 rows"):
        megatron_canonical(SimpleNamespace(stored=stored, root="ckpt"), DENSE)  # type: ignore[arg-type]
