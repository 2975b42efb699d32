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

import contextlib
import io
import mmap
import os
import pickle
import struct
import threading
import zipfile
from collections import OrderedDict
from pathlib import Path

import numpy as np

from ..errors import FormatError, IncompatibleError
from ..format.dtypes import dtype as lookup_dtype
from ..format.dtypes import from_storage_class, from_torch, torch_uint
from .safetensors_dir import safe_child
from .shards import Chunk, ShardReader, StoredTensor, check_chunks_disjoint, release_pages

METADATA_NAME = ".metadata"


def st_dtype(torch_dtype: object) -> str:
    try:
        return from_torch(torch_dtype).name
    except FormatError:
        raise FormatError(f"unsupported dtype {torch_dtype} in a distributed checkpoint") from None


def uint_view(tensor: object) -> np.ndarray:
    """Stored bits of a CPU tensor as a numpy unsigned-integer array (a reinterpretation, no conversion)."""
    t = tensor.detach().contiguous()  # type: ignore[attr-defined]
    width = t.element_size()
    return t.view(torch_uint(width)).numpy().view(f"<u{width}")


def is_dcp_dir(path: Path) -> bool:
    return (path / METADATA_NAME).is_file()


class _Window(io.RawIOBase):
    """A read-only file window [start, start+length): lets zipfile read one embedded torch.save archive."""

    def __init__(self, buf: mmap.mmap, start: int, length: int) -> None:
        self.buf, self.start, self.length, self.pos = buf, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = {0: offset, 1: self.pos + offset, 2: self.length + offset}[whence]
        return self.pos

    def read(self, n: int = -1) -> bytes:
        end = self.length if n is None or n < 0 else min(self.length, self.pos + n)
        data = self.buf[self.start + self.pos : self.start + end] if end > self.pos else b""
        self.pos = max(self.pos, end)
        return data


class _RecordUnpickler(pickle.Unpickler):
    """Reads a torch.save record's data.pkl as plain metadata: no torch objects are built."""

    def find_class(self, module: str, name: str) -> object:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return lambda storage, offset, size, stride, *_: ("tensor", storage, offset, tuple(size), tuple(stride))
        if module == "torch" and from_storage_class(name):
            return from_storage_class(name)
        if (module, name) == ("collections", "OrderedDict"):
            return OrderedDict
        raise pickle.UnpicklingError(f"unexpected {module}.{name}")

    def persistent_load(self, pid: object) -> object:
        return pid


def _raw_record_offset(buf: mmap.mmap, start: int, length: int, sizes: tuple[int, ...], dt: str) -> int | None:
    """Absolute byte offset of a torch.save record's tensor data, if it is stored plainly (C order, uncompressed).

    None when the record is anything else; the caller then falls back to torch.load.
    """
    try:
        with zipfile.ZipFile(_Window(buf, start, length)) as z:
            pkl = next(n for n in z.namelist() if n.endswith("/data.pkl"))
            obj = _RecordUnpickler(io.BytesIO(z.read(pkl))).load()
            if not (isinstance(obj, tuple) and obj[0] == "tensor"):
                return None
            _, storage, offset, size, stride = obj
            _, storage_dtype, key, _, storage_numel = storage
            if storage_dtype != dt or size != sizes:
                return None
            expected, acc = [], 1
            for s in reversed(size):
                expected.append(acc)
                acc *= s
            if any(s > 1 and st != e for s, st, e in zip(size, stride, reversed(expected), strict=True)):
                return None
            info = z.getinfo(pkl[: -len("data.pkl")] + f"data/{key}")
            if info.compress_type != zipfile.ZIP_STORED:
                return None
            header = buf[start + info.header_offset : start + info.header_offset + 30]
            name_len, extra_len = struct.unpack("<HH", header[26:30])
            data = start + info.header_offset + 30 + name_len + extra_len
            itemsize = lookup_dtype(dt).itemsize
            if offset + acc > storage_numel or info.file_size != storage_numel * itemsize:
                return None
            if data + info.file_size > start + length:
                return None
            return data + offset * itemsize
    except (zipfile.BadZipFile, pickle.UnpicklingError, StopIteration, KeyError, ValueError, TypeError, struct.error):
        return None


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
        self._maps: dict[str, mmap.mmap] = {}
        self._record_offsets: dict[tuple[str, int], int | None] = {}
        self._lock = threading.Lock()
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
                    raise FormatError(
                        f"{root}: {fqn} is stored with transforms {info.transform_descriptors}; unsupported"
                    )
                safe_child(path, info.relative_path)
                chunks.append(
                    Chunk(tuple(c.offsets), tuple(c.sizes), info.relative_path, (int(info.offset), int(info.length)))
                )
            shape = tuple(md.size)
            check_chunks_disjoint(fqn, chunks, shape, str(root))
            self.stored[fqn] = StoredTensor(fqn, st_dtype(md.properties.dtype), shape, chunks)

    def _map(self, file: str) -> mmap.mmap:
        with self._lock:
            m = self._maps.get(file)
            if m is None:
                with open(self._path / file, "rb") as f:
                    m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
                self._maps[file] = m
            return m

    def read_chunk(self, key: str, chunk: Chunk) -> np.ndarray:
        """Zero-copy view of the record's stored bytes when it is plain; torch.load otherwise."""
        offset, length = chunk.location  # type: ignore[misc]
        dt = lookup_dtype(self.stored[key].dtype)
        m = self._map(chunk.file)
        if offset + length > len(m):
            raise FormatError(f"{self.root}/{chunk.file}: record of {key} is truncated")
        where = (chunk.file, offset)
        data = self._record_offsets.get(where, -1)
        if data == -1:
            data = self._record_offsets[where] = _raw_record_offset(m, offset, length, chunk.sizes, dt.name)
        if data is not None:
            return np.frombuffer(m, dtype=dt.uint, count=chunk.numel, offset=data).reshape(chunk.sizes)
        return self._load_chunk(key, chunk)

    def release(self, key: str, chunk: Chunk) -> None:
        m = self._maps.get(chunk.file)
        if m is not None:
            offset, length = chunk.location  # type: ignore[misc]
            release_pages(m, offset, length)

    def close(self) -> None:
        for m in self._maps.values():
            with contextlib.suppress(BufferError):  # a view is still alive; it closes when collected
                m.close()
        self._maps.clear()

    def _load_chunk(self, key: str, chunk: Chunk) -> np.ndarray:
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
            raise FormatError(
                f"{self.root}/{chunk.file}: record of {key} is corrupt ({exc.__class__.__name__})"
            ) from None
        if tuple(tensor.shape) != chunk.sizes or st_dtype(tensor.dtype) != self.stored[key].dtype:
            raise FormatError(f"{self.root}/{chunk.file}: record of {key} does not match its metadata")
        return uint_view(tensor)
