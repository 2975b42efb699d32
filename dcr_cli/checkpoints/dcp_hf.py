"""DCP's Hugging Face sharded safetensors (``HuggingFaceStorageWriter(save_distributed=True)``).

Each ``shard-*.safetensors`` file holds, per fqn, one box of the HF tensor;
``__metadata__["DCP_SHARDING_INFO"][fqn]["saved_offsets"]`` places it. The
global shape is not written anywhere: it is the extent of the union of the
boxes (which ``_check_cover`` then proves complete). No pickle is involved.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from pathlib import Path

import numpy as np

from ..errors import FormatError, IncompatibleError
from ..format.dtypes import dtype as lookup_dtype
from ..format.strict_json import load_json
from .safetensors_dir import header_entry, parse_header, read_header, read_raw_header
from .shards import Chunk, ShardReader, StoredTensor, check_chunks_disjoint, release_pages

SHARDING_KEY = "DCP_SHARDING_INFO"


def shard_files(path: Path) -> list[Path]:
    """The sharded files of a DCP-HF export: in ``path`` itself, or in ``path/sharded`` when ``path``
    holds no safetensors of its own (a directory with consolidated HF files is an HF checkpoint)."""
    files = sorted(p for p in path.glob("*.safetensors") if p.is_file())
    if not files:
        files = sorted(p for p in (path / "sharded").glob("*.safetensors") if p.is_file())
    if files and all(_has_sharding_info(p) for p in files):
        return files
    return []


def _has_sharding_info(file: Path) -> bool:
    try:
        raw, _ = read_raw_header(file)
        # The key must appear in the bytes, literally or written with JSON escapes: without either, no
        # need to parse (an HF checkpoint's header of 100k tensors is parsed once, when it is opened).
        if SHARDING_KEY.encode() not in raw and b"\\" not in raw:
            return False
        header = parse_header(file, raw)
    except FormatError:
        return False
    return SHARDING_KEY in (header.get("__metadata__") or {})


def sharding_info(file: Path, header: dict) -> dict[str, dict]:
    """``__metadata__["DCP_SHARDING_INFO"]`` of a shard, read strictly: fqn -> {"saved_offsets": [uint...]}."""
    raw = (header.get("__metadata__") or {}).get(SHARDING_KEY)
    if not isinstance(raw, str):
        raise FormatError(f"{file}: {SHARDING_KEY} is missing from the safetensors metadata")
    info = load_json(raw, f"{file}: {SHARDING_KEY}")
    if not isinstance(info, dict):
        raise FormatError(f"{file}: {SHARDING_KEY} is not a JSON object")
    for name, entry in info.items():
        offsets = entry.get("saved_offsets") if isinstance(entry, dict) else None
        if not (
            isinstance(offsets, list)
            and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in offsets)
        ):
            raise FormatError(f"{file}: {SHARDING_KEY} entry for {name!r} needs saved_offsets, non-negative integers")
    return info


class DcpHfReader(ShardReader):
    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = str(root)
        files = shard_files(Path(root))
        if not files:
            raise IncompatibleError(f"{root} holds no safetensors shards with {SHARDING_KEY}")
        self._files = {p.name: p for p in files}
        self._maps: dict[str, mmap.mmap] = {}
        boxes: dict[str, list[Chunk]] = {}
        dtypes: dict[str, str] = {}
        for file in files:
            header, data_start = read_header(file)
            info = sharding_info(file, header)
            size = file.stat().st_size
            for name, meta in header.items():
                if name == "__metadata__":
                    continue
                dt, shape, begin, _end = header_entry(file, name, meta, data_start, size)
                try:
                    offsets = tuple(int(x) for x in info[name]["saved_offsets"])
                except (KeyError, TypeError, ValueError):
                    raise FormatError(f"{file}: bad sharding entry for {name!r}") from None
                if len(offsets) != len(shape):
                    raise FormatError(f"{file}: the sharding entry of {name!r} does not match its rank")
                if dtypes.setdefault(name, dt.name) != dt.name:
                    raise FormatError(f"{root}: {name} has two dtypes across shards")
                boxes.setdefault(name, []).append(Chunk(offsets, shape, file.name, data_start + begin))
        self.stored: dict[str, StoredTensor] = {}
        for name, chunks in sorted(boxes.items()):
            shape = tuple(max(c.offsets[d] + c.sizes[d] for c in chunks) for d in range(len(chunks[0].sizes)))
            check_chunks_disjoint(name, chunks, shape, self.root)
            self.stored[name] = StoredTensor(name, dtypes[name], shape, chunks)

    def read_chunk(self, key: str, chunk: Chunk) -> np.ndarray:
        m = self._maps.get(chunk.file)
        if m is None:
            with open(self._files[chunk.file], "rb") as f:
                m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            self._maps[chunk.file] = m
        dt = lookup_dtype(self.stored[key].dtype)
        if not chunk.numel:
            return np.empty(chunk.sizes, dtype=dt.uint)
        return np.frombuffer(m, dtype=dt.uint, count=chunk.numel, offset=int(chunk.location)).reshape(chunk.sizes)  # type: ignore[arg-type]

    def release(self, key: str, chunk: Chunk) -> None:
        m = self._maps.get(chunk.file)
        if m is not None:
            release_pages(m, int(chunk.location), chunk.numel * lookup_dtype(self.stored[key].dtype).itemsize)  # type: ignore[arg-type]

    def close(self) -> None:
        for m in self._maps.values():
            with contextlib.suppress(BufferError):  # a view is still alive; it closes when collected
                m.close()
        self._maps.clear()
