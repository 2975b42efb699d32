"""dcr: bit-exact, delta-compressed weight refit for reinforcement learning.

The Python API mirrors the command line; every name below is imported on first use, so that
``import dcr_cli`` (and ``dcr --help``) stays light.
"""

from __future__ import annotations

from importlib import import_module

from ._version import __version__ as __version__

_API = {
    # producer
    "diff": "produce",
    "diff_tensors": "produce.live",
    "Producer": "api",
    "LiveShard": "produce.live",
    "assemble": "delta.parts",
    "inspect": "delta.inspect",
    "squash": "delta.squash",
    # receivers
    "apply": "api",
    "verify": "api",
    "apply_to_llm": "receive.vllm",
    "verify_llm": "receive.vllm",
    "apply_to_server": "receive.vllm",
    "verify_server": "receive.vllm",
    # store
    "push": "store",
    "pull": "store",
    "pull_since": "store",
    "commit": "store",
    "acknowledge": "store",
    "status": "store",
    "log": "store",
    "gc": "store",
    "check": "store",
    "open_delta": "store",
    # keyframes, shortcuts and catch-up routes (dcr compact, dcr pull --join, --since on such a store)
    "publish_keyframe": "store.keyframes",
    "compact": "store.keyframes",
    "join": "store.keyframes",
    "plan": "store.keyframes",
    "pull_plan": "store.keyframes",
}

__all__ = sorted(_API)


def __getattr__(name: str) -> object:
    module = _API.get(name)
    if module is None:
        raise AttributeError(f"module 'dcr_cli' has no attribute {name!r}")
    return getattr(import_module(f".{module}", __name__), name)
