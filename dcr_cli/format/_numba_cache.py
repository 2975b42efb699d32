"""When numba may keep a module's compiled kernels on disk (``cache=True``, ``__pycache__`` beside it).

numba's cache stores, with each compiled kernel, the name of the module that defined it, and a process
that loads the kernel imports that module by that name (``numba.core.environment``'s ``_rebuild_env``).
Loaded under a name a fresh process cannot import (``importlib.util``'s ``spec_from_file_location``
under another name, registered or not; numba then records ``<dynamic>``), the saved kernels would make
every later process that loads them, under any name, fail with ModuleNotFoundError. So a module's
kernels are cached only when it was imported as the submodule of a package, by the name its file has
there; otherwise they are compiled afresh.

The modules that compile kernels (kernels.py, _json_depth.py) import this one by its absolute name, so
that a copy of either loaded on its own, as tests/test_kernel_cache.py loads them, still finds it.
"""

from __future__ import annotations

import os
import sys
from typing import Any


def cacheable(module_globals: dict[str, Any]) -> bool:
    """Whether the module whose ``globals()`` these are may cache its numba kernels on disk."""
    name = module_globals.get("__name__", "")
    spec = module_globals.get("__spec__")
    file = module_globals.get("__file__") or ""
    package, _, leaf = name.rpartition(".")
    me = sys.modules.get(name)
    return (
        bool(package)
        and leaf == os.path.splitext(os.path.basename(file))[0]
        and package in sys.modules
        and me is not None
        and vars(me) is module_globals
        and spec is not None
        and spec.name == name
    )
