"""Readers of checkpoints: each yields canonical tensors or regions of them as integer views.

``open_source`` is the one place that recognizes a checkpoint's format.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..errors import IncompatibleError

FORMATS = ("hf", "dcp", "dcp-hf", "megatron")


def detect_format(path: str | os.PathLike[str]) -> str:
    """hf (safetensors dir), dcp (.metadata + *.distcp), dcp-hf (shards with DCP_SHARDING_INFO) or megatron."""
    from .dcp import is_dcp_dir
    from .dcp_hf import shard_files

    p = Path(path)
    if not p.is_dir():
        raise IncompatibleError(f"{p} is not a checkpoint directory")
    if is_dcp_dir(p):
        from torch.distributed.checkpoint import FileSystemReader

        from .megatron import looks_like_megatron

        try:
            keys = list(FileSystemReader(str(p)).read_metadata().state_dict_metadata)
        except Exception:
            return "dcp"  # DcpReader reports the real problem
        return "megatron" if looks_like_megatron(keys) else "dcp"
    if shard_files(p):
        return "dcp-hf"
    if any(p.glob("*.safetensors")):
        return "hf"
    raise IncompatibleError(
        f"{p}: no checkpoint recognized (need *.safetensors, a DCP .metadata, or DCP-HF shards); see --format"
    )


def open_source(path: str | os.PathLike[str], format: str | None = None, profile: dict[str, Any] | None = None) -> Any:
    """Open a checkpoint: a SafetensorsCheckpoint for "hf", a ShardCheckpoint for the training formats.

    ``profile``: for megatron, the HF config (format_spec/producers.md §4); for dcp and dcp-hf,
    optional ``{"include": [globs], "strip_prefix": str}`` selecting and naming the weights.
    """
    fmt = format or detect_format(path)
    if fmt == "hf":
        from .safetensors_dir import SafetensorsCheckpoint

        return SafetensorsCheckpoint(path)
    from .shards import ShardCheckpoint, ShardReader, identity_canonical

    selection = profile or {}
    include, strip = tuple(selection.get("include") or ()), str(selection.get("strip_prefix") or "")
    if fmt == "dcp":
        from .dcp import DcpReader

        reader: ShardReader = DcpReader(path)
        return ShardCheckpoint(reader, identity_canonical(reader, include, strip), "dcp")
    if fmt == "dcp-hf":
        from .dcp_hf import DcpHfReader

        reader = DcpHfReader(path)
        return ShardCheckpoint(reader, identity_canonical(reader, include, strip), "dcp-hf")
    if fmt == "megatron":
        from .dcp import DcpReader
        from .megatron import load_profile, megatron_canonical, tied_duplicates

        config = profile if profile is not None else load_profile(None)
        reader = DcpReader(path)
        return ShardCheckpoint(reader, megatron_canonical(reader, config), "megatron", tied_duplicates(reader, config))
    raise IncompatibleError(f"unknown checkpoint format {fmt!r}; choose one of {', '.join(FORMATS)}")
