"""FP8 block quantization (DeepSeek-V3 style) as a residual conversion of the Megatron profile.

The reference HF FP8 checkpoints are made here, block by block with torch ops, from the dense
reference conversion ``megatron_to_hf``: independent of dcr's quantizer and index maps.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from shard_oracle import assert_oracle
from shard_writers import megatron_globals, megatron_to_hf, mutate_megatron, write_megatron_checkpoints

from dcr_cli.checkpoints.fp8 import fp8_block_quantize
from dcr_cli.checkpoints.megatron import fp8_block
from dcr_cli.delta.inspect import inspect
from dcr_cli.delta.parts import assemble
from dcr_cli.delta.reader import Delta
from dcr_cli.errors import IncompatibleError
from dcr_cli.produce import diff

BLOCK = (16, 16)  # q [32,16], k/v [16,16] whole blocks; gate/up [24,16] and down [16,24] partial edge blocks
SKIPPED = "model.layers.1.self_attn.o_proj"
FP8 = {
    "hidden_size": 16,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "intermediate_size": 24,
    "vocab_size": 50,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": True,
    "megatron": {"padded_vocab_size": 64, "zero_centered_gamma": True},
    "quantization_config": {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(BLOCK),
        "modules_to_not_convert": ["layers.1.self_attn.o_proj"],
    },
}
QUANTIZED = [
    f"model.layers.{layer}.{m}.weight"
    for layer in range(2)
    for m in (
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
    )
    if f"model.layers.{layer}.{m}" != SKIPPED
]


def reference_fp8(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The spec's formula, one block at a time."""
    rows, cols = w.shape
    br, bc = block
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    scales = torch.empty(math.ceil(rows / br), math.ceil(cols / bc), dtype=torch.float32)
    for i in range(0, rows, br):
        for j in range(0, cols, bc):
            x = w[i : i + br, j : j + bc].float()
            finite = x[torch.isfinite(x)]
            amax = finite.abs().max() if finite.numel() else torch.tensor(0.0)
            scale = amax / 448.0
            if scale == 0:
                scale = torch.tensor(1.0)
            q[i : i + br, j : j + bc] = (x / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
            scales[i // br, j // bc] = scale
    return q, scales


def hf_fp8(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = megatron_to_hf(tensors, FP8)
    for name in QUANTIZED:
        out[name], out[name + "_scale_inv"] = reference_fp8(out[name], BLOCK)
    return out


@pytest.fixture(scope="module")
def fp8(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("fp8")
    write_megatron_checkpoints(root, FP8, world=2)
    base = megatron_globals(FP8, 11)
    for tag, tensors in (("base", base), ("target", mutate_megatron(base, FP8))):
        (root / tag / "hf").mkdir(parents=True)
        save_file(hf_fp8(tensors), str(root / tag / "hf" / "model.safetensors"))
    return root


def test_fp8_megatron_is_exact(fp8: Path, tmp_path: Path) -> None:
    base, new = fp8 / "base" / "torch_dist", fp8 / "target" / "torch_dist"
    out = tmp_path / "d"
    diff(base, new, out, profile=FP8)
    assert_oracle(out, fp8 / "base" / "hf", fp8 / "target" / "hf")
    m = Delta.open(out).manifest
    assert m.tensors["model.layers.0.mlp.gate_proj.weight"].dtype == "F8_E4M3"
    assert m.tensors["model.layers.0.mlp.gate_proj.weight_scale_inv"].shape == (2, 1)
    assert m.tensors["model.layers.0.mlp.down_proj.weight_scale_inv"].shape == (1, 2)
    assert m.tensors[SKIPPED + ".weight"].dtype == "BF16" and SKIPPED + ".weight_scale_inv" not in m.tensors
    rows = {r.tensor: r.residual for r in inspect(out).tensors}
    for name in QUANTIZED:
        assert rows[name] == "fp8 block quantization (16x16)"
        assert rows[name + "_scale_inv"] == "fp8 block scale (16x16)"
    assert rows[SKIPPED + ".weight"] is None
    assert rows["model.layers.0.input_layernorm.weight"] == "zero-centred norm +1"
    changed = {it.tensor for it in m.items}
    assert any(name.endswith("_scale_inv") for name in changed)  # a block's amax moved: its scale changed
    assert all(not it.region.is_box and it.residual for it in m.items if it.tensor in QUANTIZED)
    # the trainer's NaN in layer 0's qkv reached the quantized q_proj (NaN passes through)
    target_q = hf_fp8(mutate_megatron(megatron_globals(FP8, 11), FP8))["model.layers.0.self_attn.q_proj.weight"]
    assert target_q.float().isnan().any()

    parted = tmp_path / "p"
    for rank in range(2):
        assert diff(base, new, parted, profile=FP8, rank=rank, world_size=2) is None
    assemble(parted)
    assert Delta.open(parted).manifest.tensors == m.tensors
    assert_oracle(parted, fp8 / "base" / "hf", fp8 / "target" / "hf")


def test_fp8_quantizer_edge_cases() -> None:
    nan, inf = float("nan"), float("inf")
    w = torch.zeros(5, 7)
    # block (0, 0): amax 448 -> scale exactly 1, so rounding is visible: ties go to the even mantissa
    w[0, :4] = torch.tensor([448.0, 1.0625, 1.1875, -0.0])
    w[1, 1] = inf  # saturates to 448
    w[1, 2] = -inf
    # block (0, 1) [0:4, 4:7] stays all zero: scale 1
    # block (1, 0) [4:5, 0:4] (partial rows): amax 3.5
    w[4, :4] = torch.tensor([3.5, -1.75, 0.0, 1e-3])
    # block (1, 1) [4:5, 4:7] (partial rows and columns): only non-finite values: scale 1
    w[4, 4:7] = torch.tensor([nan, inf, -inf])
    w = w.to(torch.bfloat16)
    w.view(torch.int16)[1, 0] = 0x7FC1  # NaN with a payload: ignored by the amax, stays a NaN
    w.view(torch.int16)[1, 3] = -0x3F  # 0xFFC1: the same NaN with the sign bit set
    q, scale = fp8_block_quantize(w, (4, 4))
    assert scale.dtype == torch.float32 and scale.shape == (2, 2)
    assert scale.tolist() == [[1.0, 1.0], [3.5 / 448.0, 1.0]]
    assert scale[1, 0] == torch.tensor(3.5) / 448.0
    back = q.float()
    assert back[0, :3].tolist() == [448.0, 1.0, 1.25]
    assert q[0, 3].view(torch.uint8) == 0x80  # -0.0 keeps its sign
    assert back[1, 0].isnan() and back[1, 1] == 448.0 and back[1, 2] == -448.0
    assert q[1, 0].view(torch.uint8) == 0x7F and q[1, 3].view(torch.uint8) == 0xFF  # the NaN of its sign
    assert (back[0:4, 4:7] == 0).all()
    assert back[4, 0] == 448.0 and back[4, 1] == -224.0
    assert back[4, 4].isnan() and back[4, 5] == 448.0 and back[4, 6] == -448.0
    ref_q, ref_scale = reference_fp8(w, (4, 4))
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))
    assert torch.equal(scale.view(torch.int32), ref_scale.view(torch.int32))


def test_fp8_quantizer_default_block_matches_reference() -> None:
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(300, 200, generator=g) * 0.02).to(torch.bfloat16)
    w[0, 0] = 5.0  # one large outlier in one block
    q, scale = fp8_block_quantize(w, (128, 128))
    ref_q, ref_scale = reference_fp8(w, (128, 128))
    assert scale.shape == (3, 2)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))
    assert torch.equal(scale.view(torch.int32), ref_scale.view(torch.int32))


def test_fp8_profile_is_validated() -> None:
    assert fp8_block({"quantization_config": {"quant_method": "fp8"}}) == (128, 128)
    assert fp8_block({}) is None
    for bad in (
        {"quant_method": "bitsandbytes"},
        {"quant_method": "fp8", "fmt": "e5m2"},
        {"quant_method": "fp8", "weight_block_size": [128]},
        {"quant_method": "fp8", "weight_block_size": [0, 128]},
    ):
        with pytest.raises(IncompatibleError):
            fp8_block({"quantization_config": bad})


def test_fp8_skip_list_changes_the_layout(fp8: Path, tmp_path: Path) -> None:
    cfg = copy.deepcopy(FP8)
    cfg["quantization_config"]["modules_to_not_convert"] = ["mlp"]
    diff(fp8 / "base" / "torch_dist", fp8 / "target" / "torch_dist", tmp_path / "d", profile=cfg)
    tensors = Delta.open(tmp_path / "d").manifest.tensors
    assert tensors["model.layers.0.mlp.up_proj.weight"].dtype == "BF16"
    assert tensors["model.layers.1.self_attn.o_proj.weight"].dtype == "F8_E4M3"
