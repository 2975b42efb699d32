"""Where does the engine keep each canonical tensor? Ask its own loader, and write nothing.

``trace_placement(model, name, shape, dtype)`` runs ``model.load_weights([(name, placeholder)])``
under a ``TorchDispatchMode``. Every aten op that would write into a parameter or buffer storage
is recorded and **skipped**, so the model is left untouched. A write that is a same-dtype
``copy_`` from a strided view of the placeholder becomes a :class:`Destination`: an affine map
from canonical flat indices to element indices of the parameter's storage (a few integers, no
table). A ``copy_`` that widens floats (BF16 into an FP32 engine, say) is a destination too,
marked ``cast``: its values can be read back exactly and written as the loader would write them,
but never XORed (apply.py overwrites them with absolute values). Anything else the loader does to
resident storage means that it transforms values (quantization, repacking, narrowing casts,
concatenation into temporaries) and the tensor is rejected: dcr cannot reproduce such a write
exactly from a sparse delta.

The placement is whatever vLLM decides (tensor-parallel slices, fused qkv/gate_up, tied
embeddings, experts); this module holds no model-specific knowledge.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ...errors import IncompatibleError
from ...format.dtypes import TORCH_NAMES, torch_int, torch_uint

aten = torch.ops.aten

# Writes a loader may issue into parameter storage that carry no canonical values: vLLM zeroes the
# padding rows of a vocab-parallel embedding after copying the real rows. They are skipped (the
# padding already holds what the initial load wrote) and never cover canonical elements.
_PADDING_FILLS = (aten.fill_.Scalar, aten.zero_.default)

TORCH_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, t) for name, t in TORCH_NAMES.items()}

# Casts a loader may make that dcr can undo exactly: every value of the source dtype is a value of
# the destination dtype (NaN payloads aside: a NaN that does not round-trip fails the digest checks,
# which refuses or repairs; it is never applied by XOR).
EXACT_WIDENING = {
    (torch.bfloat16, torch.float32),
    (torch.bfloat16, torch.float64),
    (torch.float16, torch.float32),
    (torch.float16, torch.float64),
    (torch.float32, torch.float64),
}

# Integer dtypes of each width that torch can gather, compare and scatter (its unsigned types
# above 8 bits lack most kernels). Bits are bits: the signed view is only a container.


def int_dtype(dtype: torch.dtype) -> torch.dtype:
    # uint8 for one byte (numpy and torch agree on it), signed otherwise
    return torch_uint(1) if dtype.itemsize == 1 else torch_int(dtype.itemsize)


def _c_contiguous(sizes: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    expected = 1
    for size, stride in zip(reversed(sizes), reversed(strides), strict=True):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def storage_ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def flat_storage(t: torch.Tensor) -> torch.Tensor:
    """The whole storage under ``t`` as a 1-D tensor of the integer dtype of t's width."""
    storage = t.untyped_storage()
    flat = torch.empty(0, dtype=t.dtype, device=t.device)
    flat.set_(storage, 0, (storage.nbytes() // t.element_size(),), (1,))
    return flat.view(int_dtype(t.dtype))


@dataclass(frozen=True)
class Destination:
    """One copy the loader makes: elements of a placeholder view -> elements of a resident storage.

    ``src_*`` describe the view of the (contiguous) placeholder, so a storage index there is a
    canonical flat index; ``dst_*`` describe the view of the parameter's storage. Both views have
    the same shape (a broadcasting copy is rejected when tracing).
    """

    param: str
    dst_dtype: torch.dtype  # the parameter's dtype; differs from the canonical one when ``cast``
    dst_offset: int
    dst_size: tuple[int, ...]
    dst_stride: tuple[int, ...]
    src_offset: int
    src_size: tuple[int, ...]
    src_stride: tuple[int, ...]

    # (cached: asked per item and per tensor, tens of thousands of times in an MoE apply; a frozen
    # dataclass's cached_property writes the instance's __dict__, not a field)
    @functools.cached_property
    def numel(self) -> int:
        n = 1
        for s in self.dst_size:
            n *= s
        return n

    def cast(self, canonical_dtype: torch.dtype) -> bool:
        return self.dst_dtype != canonical_dtype

    @functools.cached_property
    def contiguous(self) -> bool:
        """Both views are C-contiguous runs: storage index = canonical index - src_offset + dst_offset."""
        return _c_contiguous(self.src_size, self.src_stride) and _c_contiguous(self.dst_size, self.dst_stride)

    def locate(self, canonical: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For int64 canonical flat indices: (mask of those this copy holds, their storage indices).

        Inverts the source view by decomposing ``index - src_offset`` over its dimensions in
        descending stride order; exact for narrow/slice/step/transpose/permute views of a
        contiguous tensor (the only views a loader makes of its input). Contiguous copies (most
        weights, and the row blocks of fused ones) are one offset.
        """
        rest = canonical - self.src_offset
        if self.contiguous:
            hit = (rest >= 0) & (rest < self.numel)
            return hit, rest[hit] + self.dst_offset
        hit = rest >= 0
        dst = np.full_like(rest, self.dst_offset)
        for k in sorted(range(len(self.src_size)), key=lambda k: -self.src_stride[k]):
            if self.src_size[k] == 1:
                continue
            i = rest // self.src_stride[k]
            hit &= (i >= 0) & (i < self.src_size[k])
            rest = rest - i * self.src_stride[k]
            dst += i * self.dst_stride[k]
        hit &= rest == 0
        return hit, dst[hit]

    def to_json(self) -> dict:
        return {
            "param": self.param,
            "dtype": str(self.dst_dtype),
            "dst": [self.dst_offset, list(self.dst_size), list(self.dst_stride)],
            "src": [self.src_offset, list(self.src_size), list(self.src_stride)],
        }


@dataclass
class Placement:
    """Where one canonical tensor lives in this process: its destinations (often one)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    destinations: list[Destination]
    # Every name of each destination's storage (tied parameters share one) -> its pointer when traced.
    storages: dict[str, int] = field(default_factory=dict)

    @functools.cached_property
    def casts(self) -> bool:
        """Whether a destination widens (a BF16 checkpoint in an FP32 engine): no XOR mask carries over
        there. (Cached: asked per tensor and per item; the destinations never change once traced.)"""
        return any(d.cast(self.dtype) for d in self.destinations)

    @functools.cached_property
    def whole_run(self) -> Destination | None:
        """The one destination that holds the whole tensor as one contiguous run of its parameter, without a
        cast (an MoE expert's weight in its layer's fused weights); None where the tensor is held otherwise."""
        if len(self.destinations) != 1:
            return None
        dest = self.destinations[0]
        if dest.cast(self.dtype) or not dest.contiguous or dest.src_offset or dest.numel != self.numel:
            return None
        return dest

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


class _PlanMode(TorchDispatchMode):
    """Records, and skips, every write into a resident storage while the loader runs.

    ``placeholders``: storage pointer -> canonical name of each input (one, or a batch of them);
    a copy from a view of one is that tensor's destination. A rejection that no input can be
    blamed for (a copy from a temporary, another writing op) is recorded without a name.
    """

    def __init__(self, placeholders: dict[int, str], storages: dict[int, str]) -> None:
        super().__init__()
        self.placeholders = placeholders
        self.storages = storages
        self.destinations: dict[str, list[Destination]] = {name: [] for name in placeholders.values()}
        self.rejections: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        written = []
        for i, arg in enumerate(func._schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                value = args[i] if i < len(args) else kwargs.get(arg.name)
                if isinstance(value, torch.Tensor):
                    written.append(value)
        hit = [w for w in written if w.untyped_storage().nbytes() and storage_ptr(w) in self.storages]
        if not hit:
            return func(*args, **kwargs)
        dst = hit[0]
        param = self.storages[storage_ptr(dst)]
        if func is aten.copy_.default:
            src = args[1]
            name = self.placeholders.get(storage_ptr(src)) if isinstance(src, torch.Tensor) else None
            if name is None:
                self.rejections.append(f"the loader writes transformed values into {param} (not a view of the input)")
            elif src.dtype != dst.dtype and (src.dtype, dst.dtype) not in EXACT_WIDENING:
                self.rejections.append(f"the loader casts {src.dtype} to {dst.dtype} into {param}")
            elif src.size() != dst.size() or _overlaps(src):
                self.rejections.append(f"the loader broadcasts the input into {param}")
            else:
                self.destinations[name].append(
                    Destination(
                        param,
                        dst.dtype,
                        int(dst.storage_offset()),  # concrete ints: traced storage, no symbolic shapes
                        tuple(dst.size()),
                        tuple(dst.stride()),
                        int(src.storage_offset()),
                        tuple(src.size()),
                        tuple(src.stride()),
                    )
                )
        elif func in _PADDING_FILLS:
            pass  # padding rows: no canonical element lands there
        else:
            self.rejections.append(f"the loader writes into {param} with {func} (a value transform)")
        return dst  # never executed: tracing leaves the model as it was


def _overlaps(view: torch.Tensor) -> bool:
    """An expanded (stride-0) view: one canonical element would land in several places."""
    return any(stride == 0 and size > 1 for size, stride in zip(view.size(), view.stride(), strict=True))


def resident_storages(model: torch.nn.Module) -> dict[int, str]:
    """Storage pointer -> first name of every parameter and buffer (tied ones share a storage)."""
    out: dict[int, str] = {}
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        if t.untyped_storage().nbytes():
            out.setdefault(storage_ptr(t), name)
    return out


def named_resident(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Buffers and parameters by every name they have (``named_buffers`` then ``named_parameters``, both
    with ``remove_duplicate=False``; a parameter wins a name clash), from one walk of the modules."""
    buffers: dict[str, torch.Tensor] = {}
    params: dict[str, torch.Tensor] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        for members, out in ((module._buffers, buffers), (module._parameters, params)):
            for key, tensor in members.items():
                if tensor is not None:
                    out[f"{prefix}.{key}" if prefix else key] = tensor
    return {**buffers, **params}


LoadWeights = Callable[[list[tuple[str, torch.Tensor]]], object]


@torch.no_grad()
def trace_placement(model: torch.nn.Module, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> Placement:
    """Run the model's loader on a placeholder for ``name`` and return where its elements would go.

    Raises IncompatibleError when the loader does anything but same-dtype view copies, when it
    replaces parameters, or when it refuses the tensor.
    """
    resident = named_resident(model)
    _check_not_meta(resident)
    placements, failure = _trace(model, {name: (tuple(shape), dtype)}, resident)
    if failure is not None:
        raise failure
    return placements[name]


# Placeholder bytes per batched loader call (placeholders are never written: on CPU they cost
# address space only; on an accelerator they are real allocations).
TRACE_BATCH_BYTES = 256 << 20


@torch.no_grad()
def trace_placements(
    model: torch.nn.Module, tensors: dict[str, tuple[tuple[int, ...], torch.dtype]]
) -> dict[str, Placement]:
    """``trace_placement`` of many tensors, a batch of them per loader call.

    One ``load_weights`` call per batch (the loader's own per-call cost, walking the model's
    modules, is paid once per batch instead of once per tensor). A batch in which anything is
    rejected, replaced or raised is traced again tensor by tensor, so the error names the
    tensor and is the one ``trace_placement`` raises.
    """
    resident = named_resident(model)
    _check_not_meta(resident)
    out: dict[str, Placement] = {}
    batch: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    held = 0

    def flush() -> None:
        placements, failure = _trace(model, batch, resident)
        if failure is None:
            out.update(placements)
        else:
            for name, (shape, dtype) in batch.items():
                out[name] = trace_placement(model, name, shape, dtype)
        batch.clear()

    for name, (shape, dtype) in tensors.items():
        nbytes = dtype.itemsize * int(np.prod(shape, dtype=np.int64))
        if nbytes == 0:  # an empty placeholder has no storage of its own to tell it apart by
            out[name] = trace_placement(model, name, shape, dtype)
            continue
        if batch and held + nbytes > TRACE_BATCH_BYTES:
            flush()
            held = 0
        batch[name] = (tuple(shape), dtype)
        held += nbytes
    if batch:
        flush()
    return out


def _check_not_meta(resident: dict[str, torch.Tensor]) -> None:
    meta = [n for n, t in resident.items() if t.is_meta]
    if meta:
        raise IncompatibleError(
            f"parameter {meta[0]} is on the meta device (a layer-wise reload is in progress); "
            "dcr applies only to fully loaded weights"
        )


def _trace(
    model: torch.nn.Module,
    tensors: dict[str, tuple[tuple[int, ...], torch.dtype]],
    resident: dict[str, torch.Tensor],
) -> tuple[dict[str, Placement], IncompatibleError | None]:
    """One loader call on placeholders for ``tensors``: their placements, or the error (named after
    the first tensor of the batch; callers with several retrace one by one to name the culprit)."""
    first = next(iter(tensors))
    device = next(iter(resident.values())).device if resident else torch.device("cpu")
    placeholders = {name: torch.empty(shape, dtype=dtype, device=device) for name, (shape, dtype) in tensors.items()}
    storages = resident_storages(model)
    before = {n: storage_ptr(t) for n, t in resident.items()}
    mode = _PlanMode({storage_ptr(t): name for name, t in placeholders.items()}, storages)
    try:
        with mode:
            model.load_weights(iter(list(placeholders.items())))  # type: ignore[operator]
    except Exception as exc:
        return {}, IncompatibleError(
            f"{first}: vLLM's loader refused it ({type(exc).__name__}: {str(exc).splitlines()[0][:200]}); "
            + _repack_hint(model)
        )
    now = named_resident(model)
    after = {n: storage_ptr(t) for n, t in now.items()}
    if after != before:
        changed = sorted(n for n in before.keys() | after.keys() if before.get(n) != after.get(n))
        return {}, IncompatibleError(f"{first}: the loader replaced parameter {changed[0]} instead of writing into it")
    if mode.rejections:
        return {}, IncompatibleError(
            f"{first}: {mode.rejections[0]}; dcr cannot apply a sparse delta exactly through it"
        )
    # No destination on this rank is fine (pipeline stages hold some layers only); the apply checks
    # that every element is held by some rank.
    # Every name of a destination's storage (tied parameters share one): a placement holds only while
    # each of them is still there. One that the engine unties (gives its own storage) may be the name
    # the loader writes through, and checking the first name alone kept a placement into the other.
    names_of: dict[int, list[str]] = {}
    for n, ptr in before.items():
        names_of.setdefault(ptr, []).append(n)
    out = {}
    for name, (shape, dtype) in tensors.items():
        destinations = mode.destinations[name]
        held = {before[d.param] for d in destinations}
        pointers = {n: ptr for ptr in held for n in names_of[ptr]}
        out[name] = Placement(name, shape, dtype, destinations, pointers)
    return out, None


def _repack_hint(model: torch.nn.Module) -> str:
    if any(hasattr(m, "cpu_linear") for m in model.modules()):
        return (
            "the CPU backend repacked the linear weights for oneDNN; start vLLM with the dcr plugin "
            "installed, which keeps checkpoint-layout weights on CPU"
        )
    return "is the tensor name and shape those of the checkpoint the engine loaded?"


Modules = Sequence[tuple[str, torch.nn.Module]]


def check_layout_kept(model: torch.nn.Module, modules: Modules | None = None) -> None:
    """Reject engines whose resident weights are not in checkpoint layout (quantized or repacked).

    The CPU backend hands linear and embedding weights to oneDNN/SGL kernels as a repacked copy,
    so the parameters no longer hold what the GEMMs use. The dcr plugin replaces that dispatch
    with plain ``F.linear`` and marks the layers; any other ``cpu_linear`` means a repacked copy.
    ``modules``: ``list(model.named_modules())`` where the caller has it (the walk is the cost).
    """
    for module_name, module in modules if modules is not None else model.named_modules():
        method = getattr(module, "quant_method", None)
        if method is not None and not type(method).__name__.startswith("Unquantized"):
            raise IncompatibleError(
                f"{module_name} uses {type(method).__name__}: quantized weights are transformed on load, "
                "dcr applies exactly only to unquantized engines"
            )
        linear = getattr(module, "cpu_linear", None)
        # vLLM's own plain fallback (MLA's kv_b_proj) computes on the parameter as loaded, as dcr's does.
        plain = getattr(linear, "dcr_plain", False) or linear is torch.nn.functional.linear
        if linear is not None and not plain:
            raise IncompatibleError(
                f"{module_name}: the CPU backend repacked its weight for oneDNN/SGL, so the resident "
                "parameter is not what the engine computes with; install the dcr plugin (it keeps "
                "checkpoint-layout weights on CPU) and restart vLLM"
            )
