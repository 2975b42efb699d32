"""Is every resident weight still in the layout vLLM's loader wrote? Checked before any write.

dcr writes a delta where vLLM's own loader would put each canonical element (placement.py). That
is right only while the parameters hold what the loader wrote. After loading, vLLM lets each
layer's method rewrite its weights for its kernels (``process_weights_after_loading``): CPU
grouped-GEMM prepacking, FlashInfer's block layout, AITER's shuffle, w1/w3 swaps, transposes,
intermediate padding. A weight rewritten that way still traces (the loader would write into it
as if nothing happened) but no longer holds the checkpoint layout, and the first thing the user
would see is a fingerprint that matches nothing. Two checks name the layer and the reason instead:

1. **The MoE backend table** (``MOE_BACKENDS``): from vLLM 0.32's
   ``fused_moe/oracle/unquantized.py`` and ``unquantized_fused_moe_method.py``, which unquantized
   fused-MoE backends keep ``w13_weight``/``w2_weight`` as loaded and which transform them, with
   the setting that selects a supported one. A layer on a transforming backend is refused.
2. **Per-parameter load-time record**: the dcr plugin wraps vLLM's
   ``process_weights_after_loading`` and compares every parameter before and after it (storage,
   shape, strides, dtype, and the bits at up to ``SAMPLES`` positions spread over it). A
   parameter that was replaced by a different layout, padded, transposed, cast, or rewritten in
   place is recorded with the reason; ``check_resident_layout`` refuses an engine that has one.
   A parameter re-pointed at another parameter's storage (vLLM re-tying ``lm_head`` to the
   embedding) or copied unchanged into a new storage is not a change of layout.

Importing this module does not import vLLM; the decisions read class and enum names only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ...errors import IncompatibleError
from .placement import Modules, int_dtype, storage_ptr

# ---------------------------------------------------------------------------------------- MoE

KEEP_LAYOUT_ENV = "DCR_VLLM_CPU_KEEP_LAYOUT"  # the plugin's switch (plugin.py)


@dataclass(frozen=True)
class MoeBackendRule:
    """What one unquantized fused-MoE backend of vLLM does to the loaded expert weights."""

    keeps_layout: bool
    effect: str  # what the backend does to w13_weight / w2_weight after loading
    remedy: str  # the setting that selects a backend dcr supports (empty when supported)


_TO_TRITON = "start vLLM with --moe-backend triton (kernel_config.moe_backend='triton')"

# Keyed by ``UnquantizedMoeBackend`` member names (vllm/model_executor/layers/fused_moe/oracle/unquantized.py).
MOE_BACKENDS: dict[str, MoeBackendRule] = {
    "TRITON": MoeBackendRule(
        True,
        "keeps the loaded layout (convert_to_unquantized_kernel_format returns the contiguous "
        "parameters; ROCm's VLLM_ROCM_MOE_PADDING pads a copy and copies it back into the same storage)",
        "",
    ),
    "BATCHED_TRITON": MoeBackendRule(True, "keeps the loaded layout (contiguous parameters)", ""),
    "CPU": MoeBackendRule(
        False,
        "prepacks w13_weight/w2_weight for its grouped GEMM (cpu_prepack_moe_weight) and zero-pads "
        "the intermediate dimension to its alignment",
        "install the dcr plugin and leave DCR_VLLM_CPU_KEEP_LAYOUT unset (the plugin keeps the "
        "loaded expert layout on CPU), then restart vLLM",
    ),
    "FLASHINFER_CUTLASS": MoeBackendRule(
        False, "swaps the gate and up halves of w13_weight ([w1; w3] -> [w3; w1], swap_w13_to_w31)", _TO_TRITON
    ),
    "FLASHINFER_TRTLLM": MoeBackendRule(
        False,
        "pads the intermediate dimension to 128 and reorders w13_weight/w2_weight in place into "
        "FlashInfer's epilogue-tiled block layout",
        _TO_TRITON,
    ),
    "AITER": MoeBackendRule(
        False,
        "shuffles w13_weight/w2_weight for ROCm AITER (rocm_aiter_ops.shuffle_weights)",
        "start vLLM with VLLM_ROCM_USE_AITER_MOE=0 or --moe-backend triton",
    ),
    "MOONEP": MoeBackendRule(
        False,
        "replaces w13_weight/w2_weight with MoonEP's [E+B] gate/down tensors and keeps the up "
        "projection outside the parameters",
        "choose another --all2all-backend than moonep",
    ),
    "XPU": MoeBackendRule(False, "transposes w13_weight/w2_weight (w.transpose(-1, -2).contiguous())", _TO_TRITON),
    "TPU": MoeBackendRule(
        False, "hands the weights to the TPU plugin, whose resident layout dcr cannot see", "none on TPU"
    ),
    "OOT": MoeBackendRule(
        False,
        "hands the weights to an out-of-tree platform, whose resident layout dcr cannot see",
        "none on out-of-tree platforms",
    ),
}

# Expert classes that compute on the loaded layout although their backend would not: the dcr
# plugin's CPU experts (``plugin._keep_expert_layout_on_cpu`` marks them ``dcr_plain``).
PLAIN_MARK = "dcr_plain"


def moe_layout_problem(layer: str, method: Any) -> str | None:
    """Why the fused-MoE layer ``layer`` (with quant method ``method``) cannot be refit in place, or None.

    ``method`` is vLLM's ``UnquantizedFusedMoEMethod`` (quantized methods are refused earlier, by
    placement.check_layout_kept): ``unquantized_backend`` is the selected backend and
    ``moe_kernel.fused_experts`` the experts object that computes.
    """
    backend = getattr(method, "unquantized_backend", None)
    if backend is None:
        return None
    name = getattr(backend, "name", str(backend))
    kernel = getattr(method, "moe_kernel", None)
    experts = getattr(kernel, "fused_experts", None)
    experts_name = type(experts).__name__ if experts is not None else "no experts kernel"
    moe = getattr(method, "moe", None)
    parallel = getattr(moe, "moe_parallel_config", None)
    if getattr(parallel, "enable_eplb", False):
        return (
            f"{layer}: expert load balancing (--enable-eplb) moves experts between physical slots while "
            "the engine serves, so the loader's placement does not last; start vLLM without --enable-eplb"
        )
    if experts is not None and getattr(experts, PLAIN_MARK, False):
        return None
    rule = MOE_BACKENDS.get(name)
    if rule is None:
        return (
            f"{layer}: vLLM's MoE backend {name} ({experts_name}) is not one dcr knows the resident layout "
            f"of; supported: {', '.join(supported_moe_backends())} (start vLLM with --moe-backend triton)"
        )
    if rule.keeps_layout:
        return None
    return (
        f"{layer}: vLLM's {name} MoE backend ({experts_name}) {rule.effect}, so the resident expert "
        f"weights are not in the layout the loader wrote; {rule.remedy}"
    )


def supported_moe_backends() -> list[str]:
    return [*sorted(name for name, rule in MOE_BACKENDS.items() if rule.keeps_layout), "CPU with the dcr plugin"]


# ------------------------------------------------------------------ per-parameter load record

SAMPLES = 1024  # positions compared per parameter around process_weights_after_loading
RECORD_ATTR = "_dcr_layout_changes"  # set on the model: {parameter: reason}


@dataclass(frozen=True)
class LoadedLayout:
    """One parameter as the loader left it: where it lives, its view, and a sample of its bits."""

    ptr: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype
    sample: torch.Tensor | None  # integer bits at ``sample_positions(numel)`` (CPU), None if empty


def sample_positions(numel: int) -> torch.Tensor:
    """Up to SAMPLES flat positions spread over [0, numel), with an odd stride so block permutations move them."""
    if numel <= SAMPLES:
        return torch.arange(numel, dtype=torch.int64)
    step = numel // SAMPLES
    return (torch.arange(SAMPLES, dtype=torch.int64) * step + (torch.arange(SAMPLES) * 7919) % max(step, 1)) % numel


def _sample_on_device(t: torch.Tensor) -> torch.Tensor | None:
    """The bits of ``t`` at ``sample_positions`` (on t's device, flat int64), None when t holds nothing."""
    if t.numel() == 0 or t.is_meta:
        return None
    bits = t.detach()
    if bits.element_size() in (1, 2, 4, 8):
        bits = bits.view(int_dtype(bits.dtype))  # compare bits, not values (NaN, -0.0)
    if not t.ndim:
        return bits.reshape(1).to(torch.int64)
    positions = sample_positions(t.numel()).to(t.device)
    return bits[torch.unravel_index(positions, tuple(t.shape))].to(torch.int64)


def loaded_layouts(model: torch.nn.Module) -> dict[str, LoadedLayout]:
    """Every parameter of ``model`` (tied names included) as it is now.

    The samples are gathered on each parameter's device and brought to the CPU in one transfer per
    device (one synchronisation, not one per parameter).
    """
    params = list(model.named_parameters(remove_duplicate=False))
    samples = {name: _sample_on_device(p) for name, p in params}
    by_device: dict[torch.device, list[str]] = {}
    for name, sample in samples.items():
        if sample is not None:
            by_device.setdefault(sample.device, []).append(name)
    on_cpu: dict[str, torch.Tensor | None] = dict.fromkeys(samples)
    for names in by_device.values():
        joined = torch.cat([samples[n] for n in names]).cpu()  # type: ignore[misc]
        for name, part in zip(names, joined.split([samples[n].numel() for n in names]), strict=True):  # type: ignore[union-attr]
            on_cpu[name] = part
    return {
        name: LoadedLayout(
            storage_ptr(p) if p.untyped_storage().nbytes() else 0,
            tuple(p.shape),
            tuple(p.stride()),
            int(p.storage_offset()),
            p.dtype,
            on_cpu[name],
        )
        for name, p in params
    }


def layout_changes(before: dict[str, LoadedLayout], model: torch.nn.Module) -> dict[str, str]:
    """Parameters whose layout is no longer what the loader wrote, with the reason."""
    after = loaded_layouts(model)
    known_storages = {layout.ptr for layout in before.values() if layout.ptr}
    changes: dict[str, str] = {}
    for name, was in before.items():
        now = after.get(name)
        if was.sample is None:
            continue  # nothing was loaded into it (an empty or meta parameter)
        if now is None:
            changes[name] = "it was removed after loading"
        elif now.dtype != was.dtype:
            changes[name] = f"it was converted from {was.dtype} to {now.dtype} after loading"
        elif now.sample is None:
            changes[name] = "it was emptied after loading (the kernel computes with a copy of its own)"
        elif now.shape != was.shape:
            changes[name] = _reshaped(was.shape, now.shape)
        elif now.ptr != was.ptr and now.ptr in known_storages:
            continue  # re-pointed at another loaded parameter (re-tied embeddings): the loader writes there
        elif now.stride != was.stride and now.ptr == was.ptr:
            changes[name] = f"its view was changed after loading (strides {was.stride} -> {now.stride})"
        elif not torch.equal(now.sample, was.sample):
            where = "in place" if now.ptr == was.ptr else "into a new storage"
            changes[name] = f"its elements were rewritten {where} after loading (repacked or reordered for a kernel)"
    return changes


def _reshaped(was: tuple[int, ...], now: tuple[int, ...]) -> str:
    if len(was) == len(now) and sorted(was) == sorted(now):
        return f"it was transposed after loading (shape {list(was)} -> {list(now)})"
    if len(was) == len(now) and all(n >= w for n, w in zip(now, was, strict=True)):
        return f"it was padded after loading (shape {list(was)} -> {list(now)})"
    return f"it was reshaped after loading (shape {list(was)} -> {list(now)})"


def record_post_load(model: torch.nn.Module, process: Callable[[], object]) -> object:
    """Run ``process`` (vLLM's process_weights_after_loading) and record what it did to each parameter."""
    before = loaded_layouts(model)
    result = process()
    model.__dict__[RECORD_ATTR] = layout_changes(before, model)
    return result


# ----------------------------------------------------------------------------------- the check


def check_resident_layout(model: torch.nn.Module, modules: Modules | None = None) -> None:
    """Refuse, naming the layer or parameter and the reason, an engine whose weights left the loader's layout.

    Called on every rank before the first write (EngineReceiver's checks). Quantized methods and
    CPU-repacked linears are refused before this, by placement.check_layout_kept. ``modules``: as there.
    """
    for module_name, module in modules if modules is not None else model.named_modules():
        method = getattr(module, "quant_method", None)
        if method is not None:
            problem = moe_layout_problem(module_name, method)
            if problem is not None:
                raise IncompatibleError(problem + "; nothing was written")
    changes: dict[str, str] = model.__dict__.get(RECORD_ATTR) or {}
    if changes:
        name = sorted(changes)[0]
        more = f" (and {len(changes) - 1} more parameters)" if len(changes) > 1 else ""
        raise IncompatibleError(
            f"{name}: {changes[name]}{more}, so it is not in the layout vLLM's loader writes and a delta "
            "cannot be applied to it in place; nothing was written. Use a kernel backend that computes on "
            "the loaded weights (format_spec/receiver-vllm.md §6, §10)"
        )


# Attributes in which vLLM's MLA attention (DeepSeek-V2/V3 style) keeps copies derived from
# kv_b_proj's weight after loading (MLAAttention.process_weights_after_loading; the CPU AMX impl
# keeps VNNI-packed ones of its own): an in-place update of the weight would leave them stale.
MLA_DERIVED = ("W_UK_T", "W_UV", "W_UK", "W_UK_T_dcp_qrep", "_v_up_proj", "_w_uk_packed", "_w_uv_packed")


def _holds(obj: object, attr: str) -> bool:
    """Whether ``obj`` holds ``attr`` itself: a plain attribute, a parameter or a buffer."""
    own = getattr(obj, "__dict__", {})
    return attr in own or attr in own.get("_parameters", {}) or attr in own.get("_buffers", {})


def mla_derived_params(model: torch.nn.Module, modules: Modules | None = None) -> dict[str, str]:
    """Parameter name -> why dcr cannot update it in place, for every MLA layer's kv_b_proj weight.

    ``modules``: as in check_layout_kept."""
    modules = modules if modules is not None else list(model.named_modules())
    names: dict[int, str] = {}  # model.named_parameters() from the same walk: a tied parameter's first name
    for prefix, module in modules:
        for pname, p in module._parameters.items():
            if p is not None and id(p) not in names:
                names[id(p)] = f"{prefix}.{pname}" if prefix else pname
    out: dict[str, str] = {}
    for module_name, module in modules:
        kv_b_proj = module.__dict__.get("_modules", {}).get("kv_b_proj") or module.__dict__.get("kv_b_proj")
        if not isinstance(kv_b_proj, torch.nn.Module):
            continue
        impl = getattr(module, "impl", None)
        derived = [a for a in MLA_DERIVED if _holds(module, a) or (impl is not None and _holds(impl, a))]
        if not derived and "MLA" not in type(module).__name__:
            continue  # the model's own attention block that only holds the linear: the MLA layer is below it
        weight = getattr(kv_b_proj, "weight", None)
        if isinstance(weight, torch.Tensor) and id(weight) in names:
            copies = "/".join(derived) if derived else "absorbed"
            out[names[id(weight)]] = (
                f"vLLM's MLA attention {module_name} ({type(module).__name__}) computes with {copies} copies "
                "derived from it after loading, which an in-place update would leave stale"
            )
    return out
