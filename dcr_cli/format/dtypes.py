"""Stored dtypes and the unsigned integer views that dcr compares and applies through.

dcr never does float arithmetic on weights: every element is handled as the
unsigned integer of its stored width, so NaN payloads, -0.0/+0.0 and every
other bit pattern survive unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

from ..errors import FormatError


@dataclass(frozen=True)
class DType:
    name: str  # safetensors spelling, e.g. "BF16"
    itemsize: int  # bytes per element
    float_bits: tuple[int, int] | None = None  # IEEE-style (exponent, mantissa) bits; None if not such a float

    @property
    def uint(self) -> np.dtype:
        """The unsigned integer dtype of the same width, little-endian."""
        return np.dtype(f"<u{self.itemsize}")


_DTYPES = {
    d.name: d
    for d in (
        DType("BOOL", 1),
        DType("U8", 1),
        DType("I8", 1),
        DType("F8_E4M3", 1),
        DType("F8_E5M2", 1),
        DType("U16", 2),
        DType("I16", 2),
        DType("F16", 2, (5, 10)),
        DType("BF16", 2, (8, 7)),
        DType("U32", 4),
        DType("I32", 4),
        DType("F32", 4, (8, 23)),
        DType("U64", 8),
        DType("I64", 8),
        DType("F64", 8, (11, 52)),
    )
}

SUPPORTED = tuple(_DTYPES)

# torch's spelling of each dtype (torch is imported only by the callers that need it).
TORCH_NAMES = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "U16": "uint16",
    "I16": "int16",
    "F16": "float16",
    "BF16": "bfloat16",
    "U32": "uint32",
    "I32": "int32",
    "F32": "float32",
    "U64": "uint64",
    "I64": "int64",
    "F64": "float64",
}


def dtype(name: str) -> DType:
    try:
        return _DTYPES[name]
    except KeyError:
        raise FormatError(f"unsupported dtype {name!r}; dcr supports {', '.join(SUPPORTED)}") from None


def numel(shape: tuple[int, ...] | list[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


# ----- torch spellings (lookups for the checkpoint readers and live tensors; torch is imported lazily)
def from_torch(torch_dtype: object) -> DType:
    """The dtype of a torch dtype (``torch.bfloat16``) or of its name ("bfloat16", "torch.bfloat16")."""
    name = str(torch_dtype).removeprefix("torch.")
    for st_name, torch_name in TORCH_NAMES.items():
        if torch_name == name:
            return _DTYPES[st_name]
    raise FormatError(f"unsupported dtype {torch_dtype}; dcr supports {', '.join(SUPPORTED)}")


def to_torch(name: str) -> torch.dtype:
    """The torch dtype of a stored dtype ("BF16" -> torch.bfloat16)."""
    import torch

    out: torch.dtype = getattr(torch, TORCH_NAMES[dtype(name).name])
    return out


def torch_uint(itemsize: int) -> torch.dtype:
    """torch's unsigned integer dtype of ``itemsize`` bytes: the view dcr compares and writes through."""
    import torch

    return {1: torch.uint8, 2: torch.uint16, 4: torch.uint32, 8: torch.uint64}[itemsize]


def from_storage_class(storage_class: str) -> str | None:
    """The stored dtype of a torch.save storage class name ("BFloat16Storage" -> "BF16"), or None."""
    return {
        "BFloat16Storage": "BF16",
        "HalfStorage": "F16",
        "FloatStorage": "F32",
        "DoubleStorage": "F64",
        "CharStorage": "I8",
        "ByteStorage": "U8",
        "ShortStorage": "I16",
        "IntStorage": "I32",
        "LongStorage": "I64",
        "BoolStorage": "BOOL",
        "Float8_e4m3fnStorage": "F8_E4M3",
        "Float8_e5m2Storage": "F8_E5M2",
    }.get(storage_class)


def torch_int(itemsize: int) -> torch.dtype:
    """torch's signed integer dtype of ``itemsize`` bytes: the same bits, with every torch op defined."""
    import torch

    return {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[itemsize]


def numpy_int(itemsize: int) -> np.dtype:
    """numpy's signed little-endian integer dtype of ``itemsize`` bytes (what torch's signed views map to)."""
    return np.dtype(np.uint8) if itemsize == 1 else np.dtype(f"<i{itemsize}")


# ----- the unsigned view dtype by name (hot loops: DType.uint builds a numpy dtype on every call)
_UINTS = {name: np.dtype(f"<u{d.itemsize}") for name, d in _DTYPES.items()}


def uint_of(name: str) -> np.dtype:
    """``dtype(name).uint``, from a table: the unsigned little-endian dtype of a stored dtype's width."""
    uint = _UINTS.get(name)
    return uint if uint is not None else dtype(name).uint  # unknown: dtype() raises its FormatError
