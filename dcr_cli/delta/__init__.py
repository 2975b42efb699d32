"""Delta directories: writing one (blocks, then the manifest last) and reading one back.

The names are loaded on first use: reading a delta's manifest (every store command does) needs no
encoder, and the encoder's kernels import numba, which costs a short command a few tenths of a second.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .reader import Delta
    from .writer import DeltaWriter

__all__ = ["Delta", "DeltaWriter"]
_WHERE = {"Delta": ".reader", "DeltaWriter": ".writer"}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name], __name__), name)
    globals()[name] = value
    return value
