"""PyTorch Distributed Checkpoint directories: ``.metadata`` plus ``*.distcp`` files.

``.metadata`` is a pickled ``torch.distributed.checkpoint.metadata.Metadata``:
per fqn a global size and the chunks (boxes) that ranks wrote, and for each
chunk the file, byte offset and length of its record. With the default
serialization (torch 2.x, "torch_save") each record is a ``torch.save``
archive of the chunk. We read exactly that byte range and load it with
``weights_only=True``; the stored bits are then reinterpreted as unsigned
integers of the same width (``Tensor.view``), never converted.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np

from ..errors import FormatError, IncompatibleError
from .safetensors_dir import safe_child
from .shards import Chunk, ShardReader, StoredTensor, check_chunks_disjoint

METADATA_NAME = ".metadata"

_TORCH_TO_ST = {
    "torch.bfloat16": "BF16",
    "torch.float16": "F16",
    "torch.float32": "F32",
    "torch.float64": "F64",
    "torch.int8": "I8",
    "torch.uint8": "U8",
    "torch.int16": "I16",
    "torch.int32": "I32",
    "torch.int64": "I64",
    "torch.bool": "BOOL",
    "torch.float8_e4m3fn": "F8_E4M3",
    "torch.float8_e5m2": "F8_E5M2",
}


def st_dtype(torch_dtype: object) -> str:
    try:
        return _TORCH_TO_ST[str(torch_dtype)]
    except KeyError:
        raise FormatError(f"unsupported dtype {torch_dtype} in a distributed checkpoint") from None


def uint_view(tensor: object) -> np.ndarray:
    """Stored bits of a CPU tensor as a numpy unsigned-integer array (a reinterpretation, no conversion)."""
    import torch

    t = tensor.detach().contiguous()  # type: ignore[attr-defined]
    width = t.element_size()
    as_uint = {1: torch.uint8, 2: torch.uint16, 4: torch.uint32, 8: torch.uint64}[width]
    return t.view(as_uint).numpy().view(f"<u{width}")


def is_dcp_dir(path: Path) -> bool:
    return (path / METADATA_NAME).is_file()


class DcpReader(ShardReader):
    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = str(root)
        path = Path(root)
        if not is_dcp_dir(path):
            raise IncompatibleError(f"{root} is not a distributed checkpoint (no {METADATA_NAME})")
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

        try:
            meta = FileSystemReader(str(path)).read_metadata()
        except Exception as exc:  # a truncated or foreign pickle
            raise FormatError(f"{root}/{METADATA_NAME} is unreadable ({exc.__class__.__name__})") from None
        self._path = path
        self.stored: dict[str, StoredTensor] = {}
        for fqn, md in sorted(meta.state_dict_metadata.items()):
            if not isinstance(md, TensorStorageMetadata):
                continue  # bytes entries (step counters, rng state): not weights
            chunks = []
            for c in md.chunks:
                info = meta.storage_data.get(MetadataIndex(fqn, c.offsets))
                if info is None:
                    raise FormatError(f"{root}: chunk {list(c.offsets)} of {fqn} has no storage entry")
                if getattr(info, "transform_descriptors", None):
                    raise FormatError(f"{root}: {fqn} is stored with transforms {info.transform_descriptors}; unsupported")
                safe_child(path, info.relative_path)
                chunks.append(
                    Chunk(tuple(c.offsets), tuple(c.sizes), info.relative_path, (int(info.offset), int(info.length)))
                )
            shape = tuple(md.size)
            check_chunks_disjoint(fqn, chunks, shape, str(root))
            self.stored[fqn] = StoredTensor(fqn, st_dtype(md.properties.dtype), shape, chunks)

    def read_chunk(self, key: str, chunk: Chunk) -> np.ndarray:
        import torch

        offset, length = chunk.location  # type: ignore[misc]
        with open(self._path / chunk.file, "rb") as f:
            f.seek(offset)
            raw = f.read(length)
        if len(raw) != length:
            raise FormatError(f"{self.root}/{chunk.file}: record of {key} is truncated")
        try:
            tensor = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
        except Exception as exc:
            raise FormatError(f"{self.root}/{chunk.file}: record of {key} is corrupt ({exc.__class__.__name__})") from None
        if tuple(tensor.shape) != chunk.sizes or st_dtype(tensor.dtype) != self.stored[key].dtype:
            raise FormatError(f"{self.root}/{chunk.file}: record of {key} does not match its metadata")
        return uint_view(tensor)
