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
   outputs are those of the same weights). Set ``DCR_VLLM_CPU_KEEP_LAYOUT=0`` to keep vLLM's
   repacking (dcr then refuses to apply). On GPU nothing is changed: unquantized weights stay
   resident as loaded.
4. makes numba's llvmlite survive vLLM's kernel-override scan (see ``_shield_llvmlite``): dcr's
   diff kernels use numba, and without this an ``LLM`` created in a process that imported numba
   fails on CPU with ``'_lib_fn_wrapper' object has no attribute 'get'``;
5. on CPU, requests AMX tile permission for the process (``torch.cpu._init_amx()``): vLLM's CPU
   attention picks AMX kernels on AMX machines but never asks Linux for the permission, and a
   spawned worker then dies with SIGILL on its first forward pass.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Any

KEEP_LAYOUT_ENV = "DCR_VLLM_CPU_KEEP_LAYOUT"

_original_dispatch: list[Callable[..., Any]] = []


def register() -> None:
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        _keep_checkpoint_layout_on_cpu()
        _request_amx()
        _shield_llvmlite()
    _register_backend()
    _attach_worker_rpc()


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
    if os.environ.get(KEEP_LAYOUT_ENV, "1") == "0" or weight.is_meta or weight.ndim != 2:
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
