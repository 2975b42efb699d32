"""dcr's vLLM plugin: entry point ``vllm.general_plugins`` -> ``register``.

vLLM calls ``register()`` once in every process it starts (API server, engine core, each worker)
before any model is built. It:

1. registers the ``dcr`` weight-transfer backend (``backend.DcrWeightTransferEngine``);
2. attaches ``dcr_rpc`` to vLLM's worker wrapper, so ``collective_rpc("dcr_rpc", ...)`` and
   ``POST /collective_rpc`` can ask dcr's questions (check, status, verify) and get answers;
3. **on the CPU platform only**, keeps checkpoint-layout weights: vLLM's CPU backend normally
   hands every linear and embedding weight to oneDNN/SGL/zentorch as a repacked copy after loading
   (``dispatch_cpu_unquantized_gemm``), which leaves parameters that are empty or no longer what
   the GEMMs use, so no in-place update could reach them. The plugin replaces that dispatch with
   plain ``torch.nn.functional.linear`` on the parameter as loaded (slower GEMMs on CPU; the
   outputs are those of the same weights). Likewise the CPU fused-MoE experts
   (``CPUUnquantizedExperts`` and its x86/Arm/Power subclasses) normally zero-pad and prepack
   ``w13_weight``/``w2_weight`` for their grouped GEMM; the plugin keeps them as loaded and
   computes the experts with plain per-expert ``F.linear`` (``_plain_experts``). Set
   ``DCR_VLLM_CPU_KEEP_LAYOUT=0`` to keep vLLM's repacking (dcr then refuses to apply). On GPU
   nothing is changed; which GPU MoE backends keep the loaded layout is layout.py's table;
4. makes numba's llvmlite survive vLLM's kernel-override scan (see ``_shield_llvmlite``): dcr's
   diff kernels use numba, and without this an ``LLM`` created in a process that imported numba
   fails on CPU with ``'_lib_fn_wrapper' object has no attribute 'get'``;
5. on every platform, records what vLLM's ``process_weights_after_loading`` does to each parameter
   (``layout.record_post_load``: storage, view, dtype and a sample of the bits before and after),
   so that dcr refuses, naming the parameter and the reason, weights that a kernel repacked,
   reordered, transposed or padded after loading (``layout.check_resident_layout``);
6. on CPU, requests AMX tile permission for the process (``torch.cpu._init_amx()``): vLLM's CPU
   attention picks AMX kernels on AMX machines but never asks Linux for the permission, and a
   spawned worker then dies with SIGILL on its first forward pass.
"""

from __future__ import annotations

import contextlib
import inspect
import os
from collections.abc import Callable
from typing import Any

KEEP_LAYOUT_ENV = "DCR_VLLM_CPU_KEEP_LAYOUT"

_original_dispatch: list[Callable[..., Any]] = []
_original_post_load: list[Callable[..., Any]] = []


def register() -> None:
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        _keep_checkpoint_layout_on_cpu()
        _keep_expert_layout_on_cpu()
        _request_amx()
        _shield_llvmlite()
    _record_layout_after_loading()
    _register_backend()
    _attach_worker_rpc()


def _keep_layout() -> bool:
    return os.environ.get(KEEP_LAYOUT_ENV, "1") != "0"


def _register_backend() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from .backend import BACKEND_NAME

    if BACKEND_NAME not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            BACKEND_NAME, "dcr_cli.receive.vllm.backend", "DcrWeightTransferEngine"
        )


def _attach_worker_rpc() -> None:
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    from .backend import RPC_METHOD, dcr_rpc

    if not hasattr(WorkerWrapperBase, RPC_METHOD):
        setattr(WorkerWrapperBase, RPC_METHOD, dcr_rpc)


def _plain_linear(x: Any, weight: Any, bias: Any) -> Any:
    import torch

    return torch.nn.functional.linear(x, weight, bias)


_plain_linear.dcr_plain = True  # type: ignore[attr-defined]  # placement.check_layout_kept looks for it


def _plain_cpu_gemm_dispatch(layer: Any, remove_weight: bool) -> None:
    weight = layer.weight
    if not _keep_layout() or weight.is_meta or weight.ndim != 2:
        return _original_dispatch[0](layer, remove_weight)  # vLLM's own path (dcr rejects repacked layers)
    layer.cpu_linear = _plain_linear
    return None


def _keep_checkpoint_layout_on_cpu() -> None:
    # linear.py and vocab_parallel_embedding.py import the function inside their methods, so
    # replacing the module attribute before the model loads reaches every layer.
    import vllm.model_executor.layers.utils as layer_utils

    if not _original_dispatch:
        _original_dispatch.append(layer_utils.dispatch_cpu_unquantized_gemm)
        layer_utils.dispatch_cpu_unquantized_gemm = _plain_cpu_gemm_dispatch


def _keep_expert_layout_on_cpu() -> None:
    """CPU fused-MoE experts compute on ``w13_weight``/``w2_weight`` as loaded (no padding, no prepack).

    Patches the methods of ``CPUUnquantizedExperts``, which its x86 (AMX), Arm and Power
    subclasses inherit: ``process_weights_after_loading`` marks the experts ``dcr_plain`` instead of
    padding and prepacking, ``apply`` then runs ``_plain_experts``, and the grouped GEMM's
    alignment requirement is waived (the plain path has none). With
    ``DCR_VLLM_CPU_KEEP_LAYOUT=0`` (read when the model loads) vLLM's own path runs.
    """
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe

    from .layout import PLAIN_MARK

    cls = cpu_moe.CPUUnquantizedExperts
    if getattr(cls, "_dcr_patched", False):
        return
    original_process = cls.process_weights_after_loading
    original_apply = cls.apply
    original_supports = cls.__dict__["_supports_grouped_gemm"].__func__
    signature = inspect.signature(original_apply)

    def process_weights_after_loading(self: Any, layer: Any) -> None:
        if not _keep_layout():
            return original_process(self, layer)
        self._use_zentorch = False
        setattr(self, PLAIN_MARK, True)
        return None

    def apply(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not getattr(self, PLAIN_MARK, False):
            return original_apply(self, *args, **kwargs)
        bound = signature.bind(self, *args, **kwargs).arguments
        _plain_experts(
            self,
            bound["output"],
            bound["hidden_states"],
            bound["w1"],
            bound["w2"],
            bound["topk_weights"],
            bound["topk_ids"],
            bound["activation"],
            bound["expert_map"],
            bool(bound["apply_router_weight_on_input"]),
        )
        return None

    def supports_grouped_gemm(klass: Any, moe_config: Any) -> tuple[bool, str | None]:
        if _keep_layout():
            return True, None
        return original_supports(klass, moe_config)

    cls.process_weights_after_loading = process_weights_after_loading  # type: ignore[method-assign]
    cls.apply = apply  # type: ignore[method-assign]
    cls._supports_grouped_gemm = classmethod(supports_grouped_gemm)  # type: ignore[method-assign,assignment]
    cls._dcr_patched = True  # type: ignore[attr-defined]
    cls._dcr_vllm_process_weights_after_loading = original_process  # type: ignore[attr-defined]  # tests use it


def _plain_experts(
    experts: Any,
    output: Any,
    hidden_states: Any,
    w13: Any,
    w2: Any,
    topk_weights: Any,
    topk_ids: Any,
    activation: Any,
    expert_map: Any,
    weights_on_input: bool,
) -> None:
    """Routed experts on the loaded layout: per local expert, act(x @ w13[e].T) @ w2[e].T, weighted, summed.

    ``w13[e]`` is [gate; up] (2I x H) and ``w2[e]`` is H x I, as vLLM's loader fills them.
    ``topk_ids`` are global expert ids; with expert parallelism ``expert_map`` maps them to this
    rank's slots (-1: another rank's expert, whose share the all-reduce brings). When the router
    weights were applied to the input already (``apply_router_weight_on_input``) they are not
    applied again. Accumulates in float32 and rounds once into ``output``.
    """
    import torch
    import torch.nn.functional as F

    ids = topk_ids.long()
    if expert_map is not None:
        ids = expert_map.long()[ids]
    weights = torch.ones_like(topk_weights, dtype=torch.float32) if weights_on_input else topk_weights.float()
    w1_bias, w2_bias = getattr(experts, "w1_bias", None), getattr(experts, "w2_bias", None)
    total = torch.zeros(hidden_states.shape[0], w2.shape[1], dtype=torch.float32, device=hidden_states.device)
    for e in torch.unique(ids).tolist():
        if e < 0:
            continue
        rows, slots = torch.nonzero(ids == e, as_tuple=True)
        h = F.linear(hidden_states[rows], w13[e], None if w1_bias is None else w1_bias[e])
        a = _moe_activation(experts, activation, h)
        y = F.linear(a, w2[e], None if w2_bias is None else w2_bias[e])
        total.index_add_(0, rows, y.float() * weights[rows, slots].unsqueeze(1))
    output.copy_(total.reshape(output.shape))


def _moe_activation(experts: Any, activation: Any, h: Any) -> Any:
    import torch.nn.functional as F

    name = getattr(activation, "name", "")
    limit = getattr(getattr(experts, "quant_config", None), "gemm1_clamp_limit", None)
    if name in ("SILU", "GELU", "GELU_TANH") and limit is None:
        gate, up = h.float().chunk(2, dim=-1)
        act = F.silu(gate) if name == "SILU" else F.gelu(gate, approximate="tanh" if name == "GELU_TANH" else "none")
        return (act * up).to(h.dtype)
    # Anything else (clamped SiLU, SWIGLUOAI, ...): vLLM's own activation kernel.
    from vllm.model_executor.layers.fused_moe.activation import ApplyMoEActivationConfig, apply_moe_activation

    width = h.shape[-1] // 2 if activation.is_gated else h.shape[-1]
    out = h.new_empty(h.shape[0], width)
    config = ApplyMoEActivationConfig.from_configs(experts.moe_config, experts.quant_config)
    return apply_moe_activation(activation, out, h.contiguous(), activation_config=config)


def _record_layout_after_loading() -> None:
    """Wrap vLLM's ``process_weights_after_loading`` so that what it does to each parameter is recorded.

    ``base_loader`` calls it by the name it imported, so that name is replaced too (and in any
    other loader module already imported with it).
    """
    import sys

    import vllm.model_executor.model_loader.base_loader as base_loader
    import vllm.model_executor.model_loader.utils as loader_utils

    from .layout import record_post_load

    if _original_post_load:
        return
    original = loader_utils.process_weights_after_loading
    _original_post_load.append(original)

    def process_weights_after_loading(model: Any, model_config: Any, target_device: Any) -> None:
        record_post_load(model, lambda: original(model, model_config, target_device))

    for module in [loader_utils, base_loader, *list(sys.modules.values())]:
        if (
            getattr(module, "__name__", "").startswith("vllm.")
            and getattr(module, "process_weights_after_loading", None) is original
        ):
            module.process_weights_after_loading = process_weights_after_loading  # type: ignore[attr-defined]


def _request_amx() -> None:
    import torch

    with contextlib.suppress(AttributeError, RuntimeError):  # no AMX here, or an older torch
        torch.cpu._init_amx()


def _shield_llvmlite() -> None:
    """Give llvmlite's library wrapper an empty ``__dict__`` so that vLLM's scan skips it.

    ``vllm.triton_utils.dispatcher._rebind_kernels`` walks every module in ``sys.modules`` and calls
    ``vars(value).get("kernel")`` on each object with a ``__dict__``. llvmlite's ``ffi.lib`` is a
    slotted object whose ``__getattr__`` wraps any name, ``__dict__`` included, as a C function, so
    the scan crashes. Its lookup table answers ``__dict__`` with a real (empty) dict from now on.
    """
    try:
        from llvmlite.binding import ffi
    except ImportError:
        return
    table = getattr(ffi.lib, "_fntab", None)
    if isinstance(table, dict):
        table["__dict__"] = {}
