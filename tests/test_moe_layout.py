"""Resident-layout decisions for fused-MoE engines (dcr_cli/receive/vllm/layout.py), without an engine.

No GPU here: the GPU backends' decisions are tested on vLLM's own enum and expert classes, and the
per-parameter load record on vLLM's own weight transforms where they run on CPU (the Triton and
FlashInfer-CUTLASS kernel-format conversion, the CPU prepack and padding, FlashInfer's alignment
padding); XPU's transpose is the same expression vLLM uses, run here.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import require_or_skip

from dcr_cli.errors import IncompatibleError
from dcr_cli.receive.vllm.layout import (
    MOE_BACKENDS,
    RECORD_ATTR,
    SAMPLES,
    check_resident_layout,
    layout_changes,
    loaded_layouts,
    moe_layout_problem,
    record_post_load,
    sample_positions,
)

require_or_skip("vllm")

from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.oracle.unquantized import (
    UnquantizedMoeBackend,
    backend_to_kernel_cls,
    convert_to_unquantized_kernel_format,
)
from vllm.model_executor.utils import replace_parameter

E, N, H = 4, 48, 64  # experts, intermediate (not a multiple of 32: the CPU kernel pads it), hidden


class Experts(torch.nn.Module):
    """What vLLM's RoutedExperts holds: w13_weight [E, 2N, H] ([gate; up]) and w2_weight [E, H, N]."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w13_weight = torch.nn.Parameter(torch.randn(E, 2 * N, H, generator=g).bfloat16(), requires_grad=False)
        self.w2_weight = torch.nn.Parameter(torch.randn(E, H, N, generator=g).bfloat16(), requires_grad=False)


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(32, H).bfloat16()
        self.lm_head = torch.nn.Linear(H, 32, bias=False).bfloat16()
        self.experts = Experts()


def _changes(transform) -> dict[str, str]:
    model = Model()
    record_post_load(model, lambda: transform(model))
    return model.__dict__[RECORD_ATTR]


def _moe_config(**overrides):
    return SimpleNamespace(
        is_act_and_mul=True, intermediate_size_per_partition=N, activation=MoEActivation.SILU, **overrides
    )


# ------------------------------------------------------------------ the load record, on vLLM's transforms


@pytest.mark.parametrize("backend", ["TRITON", "BATCHED_TRITON", "FLASHINFER_CUTLASS"])
def test_vllms_kernel_format_conversion_agrees_with_the_table(backend):
    # The conversion vLLM runs after loading (unquantized_fused_moe_method._setup_kernel), on CPU.
    def setup_kernel(model):
        layer = model.experts
        w13, w2 = convert_to_unquantized_kernel_format(
            UnquantizedMoeBackend[backend], _moe_config(), layer.w13_weight, layer.w2_weight, layer=layer
        )
        replace_parameter(layer, "w13_weight", w13)
        replace_parameter(layer, "w2_weight", w2)

    changes = _changes(setup_kernel)
    assert (changes == {}) == MOE_BACKENDS[backend].keeps_layout
    if backend == "FLASHINFER_CUTLASS":  # [w1; w3] -> [w3; w1]: the gate/up halves trade places
        assert set(changes) == {"experts.w13_weight"}
        assert "rewritten into a new storage" in changes["experts.w13_weight"]


def test_cpu_prepack_is_recorded_as_rewritten():
    from vllm._custom_ops import cpu_prepack_moe_weight

    held = []

    def prepack(model):
        layer = model.experts
        # Keep the loaded tensors alive, as the engine's loader does until loading ends: otherwise the
        # allocator may hand their freed memory to the next prepacked tensor, and whether the two then
        # share an address would vary from run to run.
        held.extend([layer.w13_weight, layer.w2_weight])
        replace_parameter(layer, "w13_weight", cpu_prepack_moe_weight(layer.w13_weight, "vec"))
        replace_parameter(layer, "w2_weight", cpu_prepack_moe_weight(layer.w2_weight, "vec"))

    changes = _changes(prepack)
    assert set(changes) == {"experts.w13_weight", "experts.w2_weight"}
    assert all("rewritten into a new storage" in reason for reason in changes.values())


def test_cpu_intermediate_padding_is_recorded_as_padded():
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    experts = object.__new__(CPUUnquantizedExperts)  # only its moe_config is read
    experts.moe_config = _moe_config()

    changes = _changes(lambda model: experts._pad_moe_intermediate(model.experts))
    padded = "it was padded after loading (shape"
    assert changes["experts.w13_weight"] == f"{padded} [{E}, {2 * N}, {H}] -> [{E}, 128, {H}])"
    assert changes["experts.w2_weight"] == f"{padded} [{E}, {H}, {N}] -> [{E}, {H}, 64])"


def test_flashinfer_alignment_padding_is_recorded_as_padded():
    from vllm.model_executor.layers.quantization.utils.flashinfer_utils import align_moe_weights_for_fi

    def align(model):
        layer = model.experts
        w13, w2, _ = align_moe_weights_for_fi(layer.w13_weight.data, layer.w2_weight.data, True, min_alignment=128)
        replace_parameter(layer, "w13_weight", w13)
        replace_parameter(layer, "w2_weight", w2)

    changes = _changes(align)
    assert set(changes) == {"experts.w13_weight", "experts.w2_weight"}
    assert all(reason.startswith("it was padded after loading") for reason in changes.values())


def test_xpu_transpose_is_recorded_as_transposed():
    def xpu(model):  # unquantized_fused_moe_method.process_weights_after_loading, XPU branch
        w13, w2 = model.experts.w13_weight, model.experts.w2_weight
        w13.data = w13.transpose(-1, -2).contiguous()
        w2.data = w2.transpose(-1, -2).contiguous()

    changes = _changes(xpu)
    transposed = "it was transposed after loading (shape"
    assert changes["experts.w13_weight"] == f"{transposed} [{E}, {2 * N}, {H}] -> [{E}, {H}, {2 * N}])"
    assert changes["experts.w2_weight"].startswith("it was transposed after loading")


def test_in_place_reorder_is_recorded():
    from vllm.model_executor.layers.quantization.utils.flashinfer_utils import swap_w13_to_w31

    def reorder(model):  # as FlashInfer TRT-LLM's block layout does: same storage, other order
        w13 = model.experts.w13_weight.data
        w13.copy_(swap_w13_to_w31(w13).clone())

    assert _changes(reorder) == {
        "experts.w13_weight": "its elements were rewritten in place after loading (repacked or reordered for a kernel)"
    }


def test_what_is_not_a_layout_change():
    def harmless(model):
        model.lm_head.weight = model.embed.weight  # vLLM re-tying lm_head to the embedding
        model.experts.w2_weight = torch.nn.Parameter(model.experts.w2_weight.data.clone(), requires_grad=False)
        model.experts.w13_weight.data.copy_(model.experts.w13_weight.data.clone())  # same bits written back

    assert _changes(harmless) == {}


def test_emptied_cast_and_removed_parameters_are_named():
    def transforms(model):
        replace_parameter(model.lm_head, "weight", torch.empty(0, dtype=torch.bfloat16))  # stock CPU oneDNN path
        replace_parameter(model.embed, "weight", model.embed.weight.data.float())
        del model.experts.w2_weight

    changes = _changes(transforms)
    assert changes["lm_head.weight"].startswith("it was emptied after loading")
    assert changes["embed.weight"] == "it was converted from torch.bfloat16 to torch.float32 after loading"
    assert changes["experts.w2_weight"] == "it was removed after loading"


def test_a_single_changed_element_is_seen_when_sampled():
    # Small tensors are compared element by element; large ones at SAMPLES spread positions.
    model = Model()
    before = loaded_layouts(model)
    model.experts.w2_weight.data.view(-1)[int(sample_positions(E * H * N)[17])] += 1
    assert list(layout_changes(before, model)) == ["experts.w2_weight"]
    positions = sample_positions(10 * SAMPLES + 3)
    assert positions.numel() == SAMPLES and int(positions.max()) < 10 * SAMPLES + 3
    assert positions.unique().numel() == SAMPLES


def test_check_names_the_first_changed_parameter_and_counts_the_rest():
    model = Model()
    model.__dict__[RECORD_ATTR] = {"b.weight": "it was padded after loading (x)", "a.weight": "it was transposed (y)"}
    with pytest.raises(IncompatibleError, match=r"^a\.weight: it was transposed \(y\) \(and 1 more parameters\)"):
        check_resident_layout(model)
    model.__dict__[RECORD_ATTR] = {}
    check_resident_layout(model)  # nothing recorded: nothing refused


# ------------------------------------------------------------------ the MoE backend table


def _method(backend: str, experts: object | None = None, eplb: bool = False) -> SimpleNamespace:
    if experts is None:
        classes = backend_to_kernel_cls(UnquantizedMoeBackend[backend]) if backend not in ("TPU", "OOT") else []
        experts = object.__new__(classes[0]) if classes else None
    return SimpleNamespace(
        unquantized_backend=UnquantizedMoeBackend[backend],
        moe_kernel=SimpleNamespace(fused_experts=experts) if experts is not None else None,
        moe=SimpleNamespace(moe_parallel_config=SimpleNamespace(enable_eplb=eplb)),
    )


def test_the_table_covers_every_unquantized_backend_of_this_vllm():
    assert set(MOE_BACKENDS) == set(UnquantizedMoeBackend.__members__)
    assert sorted(n for n, r in MOE_BACKENDS.items() if r.keeps_layout) == ["BATCHED_TRITON", "TRITON"]


@pytest.mark.parametrize("backend", sorted(UnquantizedMoeBackend.__members__))
def test_every_backend_is_supported_or_refused_with_layer_backend_and_setting(backend):
    problem = moe_layout_problem("model.layers.3.mlp.experts", _method(backend))
    if MOE_BACKENDS[backend].keeps_layout:
        assert problem is None
        return
    assert problem is not None
    assert problem.startswith(f"model.layers.3.mlp.experts: vLLM's {backend} MoE backend (")
    assert MOE_BACKENDS[backend].remedy in problem and MOE_BACKENDS[backend].effect in problem


@pytest.mark.parametrize(
    ("backend", "setting"),
    [
        ("FLASHINFER_CUTLASS", "--moe-backend triton"),
        ("FLASHINFER_TRTLLM", "--moe-backend triton"),
        ("XPU", "--moe-backend triton"),
        ("AITER", "VLLM_ROCM_USE_AITER_MOE=0"),
        ("MOONEP", "--all2all-backend"),
        ("CPU", "DCR_VLLM_CPU_KEEP_LAYOUT"),
    ],
)
def test_refusals_name_the_setting_that_selects_a_supported_backend(backend, setting):
    problem = moe_layout_problem("L", _method(backend))
    assert problem is not None and setting in problem
    experts = type(_method(backend).moe_kernel.fused_experts).__name__
    assert f"({experts})" in problem


def test_cpu_experts_kept_plain_by_the_plugin_are_supported():
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import X86CPUUnquantizedExperts

    experts = object.__new__(X86CPUUnquantizedExperts)
    assert moe_layout_problem("L", _method("CPU", experts)) is not None
    experts.dcr_plain = True
    assert moe_layout_problem("L", _method("CPU", experts)) is None


def test_expert_load_balancing_is_refused_on_any_backend():
    problem = moe_layout_problem("model.layers.0.mlp.experts", _method("TRITON", eplb=True))
    assert problem is not None and "--enable-eplb" in problem and problem.startswith("model.layers.0.mlp.experts: ")


def test_unknown_backend_and_non_moe_methods():
    unknown = SimpleNamespace(unquantized_backend=SimpleNamespace(name="WARP_DRIVE"), moe_kernel=None, moe=None)
    problem = moe_layout_problem("L", unknown)
    assert problem is not None and "WARP_DRIVE" in problem and "not one dcr knows" in problem
    assert moe_layout_problem("L", SimpleNamespace()) is None  # a linear's method: not a fused-MoE layer


def test_check_refuses_a_model_with_a_refused_moe_layer_before_the_record():
    model = Model()
    model.experts.quant_method = _method("AITER")
    model.__dict__[RECORD_ATTR] = {"experts.w13_weight": "it was rewritten"}
    with pytest.raises(IncompatibleError, match=r"^experts: vLLM's AITER MoE backend \(AiterExperts\) shuffles"):
        check_resident_layout(model)
    model.experts.quant_method = _method("TRITON")
    with pytest.raises(IncompatibleError, match=r"^experts\.w13_weight: it was rewritten"):
        check_resident_layout(model)


# ------------------------------------------------------------------ the plugin's CPU experts


def _reference_moe(x, w13, w2, topk_weights, topk_ids):
    """Per token: sum over its top-k experts of weight * down(silu(gate x) * up x), in float64."""
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(topk_ids.shape[1]):
            e = int(topk_ids[t, k])
            gate, up = (w13[e].double() @ x[t].double()).chunk(2)
            out[t] += float(topk_weights[t, k]) * (w2[e].double() @ (torch.nn.functional.silu(gate) * up))
    return out


def _off(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest deviation relative to the largest value (bf16 intermediates round at about 1%)."""
    return float((got.double() - want).abs().max() / want.abs().max())


def test_plain_cpu_experts_compute_the_moe_with_and_without_expert_parallel():
    from dcr_cli.receive.vllm.plugin import _plain_experts

    g = torch.Generator().manual_seed(3)
    layer = Experts()
    x = torch.randn(5, H, generator=g).bfloat16()
    topk_ids = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(5)]).to(torch.int32)
    topk_weights = torch.rand(5, 2, generator=g).softmax(-1)
    experts = SimpleNamespace(quant_config=SimpleNamespace(gemm1_clamp_limit=None))
    silu = MoEActivation.SILU
    expected = _reference_moe(x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids)

    full = torch.empty(5, H, dtype=torch.bfloat16)
    _plain_experts(experts, full, x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids, silu, None, False)
    assert _off(full, expected) < 0.02

    # Expert parallel: rank r holds experts [2r, 2r+1] in its slots 0..1; the ranks' sums add up.
    parts = []
    for r in range(2):
        expert_map = torch.full((E,), -1, dtype=torch.int32)
        expert_map[2 * r : 2 * r + 2] = torch.tensor([0, 1], dtype=torch.int32)
        local13, local2 = layer.w13_weight[2 * r : 2 * r + 2], layer.w2_weight[2 * r : 2 * r + 2]
        part = torch.empty(5, H, dtype=torch.bfloat16)
        _plain_experts(experts, part, x, local13, local2, topk_weights, topk_ids, silu, expert_map, False)
        parts.append(part.double())
    assert _off(parts[0] + parts[1], expected) < 0.02
    assert _off(parts[0], expected) > 0.2  # each rank holds only a share

    # Router weights already applied to the input: not applied again.
    unweighted = torch.empty(5, H, dtype=torch.bfloat16)
    _plain_experts(experts, unweighted, x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids, silu, None, True)
    ones = _reference_moe(x, layer.w13_weight, layer.w2_weight, torch.ones_like(topk_weights), topk_ids)
    assert _off(unweighted, ones) < 0.02 and _off(unweighted, expected) > 0.2
