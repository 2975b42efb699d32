"""Hugging Face checkpoint directories: one model.safetensors, or shards with an index.

Tensors are exposed as flat unsigned-integer views over a read-only memory
map, so reading costs page cache, not heap, and nothing is ever converted.
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
import os
import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass
from operator import attrgetter
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import FormatError, IncompatibleError
from ..format.digest import digest_bytes
from ..format.dtypes import DType, numel, uint_of
from ..format.dtypes import dtype as lookup_dtype
from ..format.manifest import TensorEntry
from ..format.strict_json import load_json
from ..io import digest_cache

INDEX_NAME = "model.safetensors.index.json"
_NAME = attrgetter("name")
MAX_HEADER_BYTES = 100 << 20
MAX_INDEX_BYTES = 64 << 20


@dataclass(frozen=True, slots=True)
class TensorLocation:
    name: str
    dtype: str
    shape: tuple[int, ...]
    file: Path
    start: int  # absolute byte offset of the data in the file
    nbytes: int

    @property
    def numel(self) -> int:
        return numel(self.shape)


def safe_child(root: Path, name: str) -> Path:
    """Resolve a file name from checkpoint metadata, refusing anything outside root."""
    if not name or os.path.isabs(name) or ".." in Path(name).parts:
        raise FormatError(f"file name {name!r} would escape {root}")
    path = (root / name).resolve()
    if root.resolve() not in path.parents:
        raise FormatError(f"file name {name!r} would escape {root}")
    return path


def read_header(path: Path) -> tuple[dict, int]:
    """Parse a safetensors header. Returns (header, offset of the data section).

    The JSON is read strictly (duplicate keys, deep nesting, huge integers refused) and every tensor
    entry is type-checked (:func:`check_header_entry`), so callers may use ``dtype``, ``shape`` and
    ``data_offsets`` as they are. ``__metadata__``, if present, is an object of strings.
    """
    raw, data_start = read_raw_header(path)
    return parse_header(path, raw), data_start


def read_raw_header(path: Path) -> tuple[bytes, int]:
    """The header's bytes (not parsed) and the offset of the data section."""
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) != 8:
            raise FormatError(f"{path}: not a safetensors file (too short)")
        (length,) = struct.unpack("<Q", prefix)
        if length > MAX_HEADER_BYTES:
            raise FormatError(f"{path}: safetensors header of {length} bytes is implausible")
        raw = f.read(length)
    if len(raw) != length:
        raise FormatError(f"{path}: safetensors header is truncated")
    return raw, 8 + length


def parse_header(path: Path, raw: bytes) -> dict:
    """:func:`read_header` of header bytes already read."""
    header = load_json(raw, f"{path}: safetensors header")
    if not isinstance(header, dict):
        raise FormatError(f"{path}: safetensors header is not a JSON object")
    for name, meta in header.items():
        if name == "__metadata__":
            if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
                raise FormatError(f"{path}: safetensors __metadata__ must map names to strings")
        else:
            check_header_entry(path, name, meta)
    return header


def _is_uint(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0  # bool is an int in Python


def check_header_entry(path: Path, name: str, meta: object) -> None:
    """One tensor entry of a safetensors header: {"dtype": str, "shape": [uint...], "data_offsets": [begin, end]}
    with ``end - begin`` the byte size of the shape (offsets relative to the data section)."""
    if not isinstance(meta, dict):
        raise FormatError(f"{path}: header entry for {name!r} is not an object")
    dt, shape, offsets = meta.get("dtype"), meta.get("shape"), meta.get("data_offsets")
    if not isinstance(dt, str):
        raise FormatError(f"{path}: bad header entry for {name!r} (dtype must be a string)")
    itemsize = lookup_dtype(dt).itemsize
    if not isinstance(shape, list) or not all(_is_uint(s) for s in shape):
        raise FormatError(f"{path}: header entry for {name!r} is inconsistent (shape must be non-negative integers)")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_uint(x) for x in offsets)):
        raise FormatError(f"{path}: bad header entry for {name!r} (data_offsets must be two non-negative integers)")
    begin, end = offsets
    if end < begin or end - begin != numel(shape) * itemsize:
        raise FormatError(f"{path}: data of {name!r} is truncated or inconsistent with its shape")


def read_index(index: Path) -> dict[str, str]:
    """The ``weight_map`` (tensor name -> file name) of a ``model.safetensors.index.json``, read strictly."""
    return parse_index(index, read_index_bytes(index))


def read_index_bytes(index: Path) -> bytes:
    with open(index, "rb") as f:
        raw = f.read(MAX_INDEX_BYTES + 1)
    if len(raw) > MAX_INDEX_BYTES:
        raise FormatError(f"{index}: over the {MAX_INDEX_BYTES} byte limit of a safetensors index")
    return raw


def parse_index(index: Path, raw: bytes) -> dict[str, str]:
    """:func:`read_index` of index bytes already read."""
    obj = load_json(raw, str(index))
    weight_map = obj.get("weight_map") if isinstance(obj, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) and f for f in weight_map.values()):
        raise FormatError(f"{index}: not a valid safetensors index (needs weight_map: tensor -> file name)")
    return weight_map


class SafetensorsCheckpoint:
    """A Hugging Face checkpoint directory, opened for reading (and, by receivers, in-place writes)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        if not self.root.is_dir():
            raise IncompatibleError(f"{self.root} is not a checkpoint directory")
        self.tensors: dict[str, TensorLocation] = {}
        self._maps: dict[Path, mmap.mmap] = {}
        # The index's weight_map (tensor -> file name), and each file name's path; None without an index.
        self._weight_map: dict[str, str] | None = None
        self._index_files: dict[str, Path] = {}
        files = self._files()
        # Digest-cache keys as the files were before anything was hashed (see remember_digests).
        self._cache_keys: dict[Path, str] = {}
        self._cached: dict[Path, dict[str, str]] = {}  # entries cached_digests found, under those keys
        parsed = []
        for file in files:
            parsed.append(self._add_file(file))
            self._cache_keys[file] = digest_cache.key(file)
        if self._weight_map is not None:
            self._check_index(self._weight_map, parsed)

    def _files(self) -> list[Path]:
        index = self.root / INDEX_NAME
        if index.exists():
            raw = read_index_bytes(index)
            known = _INDEXES.get(index)
            if known is not None and known[0] == raw:  # the same bytes parse to the same names
                weight_map, names = known[1], known[2]
            else:
                weight_map = parse_index(index, raw)
                names = sorted(set(weight_map.values()))
                _INDEXES.clear()  # one kept: an apply opens its checkpoint four times
                _INDEXES[index] = (raw, weight_map, names)
            self._weight_map = weight_map
            # One check per file, not per tensor: an MoE index names the same few shards 100k times.
            self._index_files = {f: safe_child(self.root, f) for f in names}
            return sorted(set(self._index_files.values()))
        files = sorted(p for p in self.root.glob("*.safetensors") if p.is_file())
        if not files:
            raise IncompatibleError(f"{self.root} holds no *.safetensors files")
        # The same rule as for index names: a symlink out of the directory (e.g. into a shared blob
        # store) would let an in-place apply change files that are not this checkpoint's.
        return [safe_child(self.root, p.name) for p in files]

    def _check_index(self, weight_map: dict[str, str], parsed: list[list[TensorLocation]]) -> None:
        """The index must say where every stored tensor is: each tensor it names and a file holds, in the file
        it names, and every tensor of those files named. A tensor it names that no file holds is allowed: the
        Hub's safetensors converter (``convert_multi``) drops tied duplicates from the shards and keeps them in
        the index, and transformers ties them on load; such a name has no stored bits for dcr to compare.
        Anything else is refused rather than guessed around: what the files hold and what the index promises
        readers would differ.

        ``parsed``: each file's locations, in file order. An index and headers checked before in this
        process (the very objects _INDEXES and _PARSED hand out again) are not checked again: an apply
        opens its checkpoint four times, and the check costs ~0.05 s at 100k tensors."""
        last = _INDEX_CHECKED.get("last")
        if (
            last is not None
            and last[0] is weight_map
            and len(last[1]) == len(parsed)
            and all(a is b for a, b in zip(last[1], parsed, strict=True))
        ):
            return
        paths = self._index_files
        file_names = {p: f for f, p in paths.items()}  # a file's path -> its name in the index
        agree = len(file_names) == len(paths)  # (two names of one file: told apart below)
        for locations in parsed:
            if agree and locations:
                # Every tensor of this file is in the index under this file's name (C-level maps).
                agree = set(map(weight_map.get, map(_NAME, locations))) == {file_names[locations[0].file]}
        if not (agree and self.tensors.keys() <= weight_map.keys()):
            self._name_disagreement(weight_map)
        _INDEX_CHECKED["last"] = (weight_map, parsed)  # held: the ids compared above cannot be reused

    def _name_disagreement(self, weight_map: dict[str, str]) -> None:
        """Raise for the first entry where the index and the files disagree (none: two names of one file)."""
        index = self.root / INDEX_NAME
        tensors, paths = self.tensors, self._index_files
        advice = "regenerate the index from the shards"
        for name, f in weight_map.items():
            loc = tensors.get(name)
            if loc is not None and loc.file != paths[f]:
                raise FormatError(f"{index} puts tensor {name!r} in {f}, but it is stored in {loc.file.name}; {advice}")
        unnamed = next((n for n in tensors if n not in weight_map), None)
        if unnamed is not None:
            raise FormatError(
                f"{index} does not name tensor {unnamed!r}, stored in {tensors[unnamed].file.name} (a stale index); "
                f"{advice}"
            )

    def _add_file(self, file: Path) -> list[TensorLocation]:
        if not file.exists():
            raise IncompatibleError(f"{file} is listed in the index but missing")
        raw, data_start = read_raw_header(file)
        size = file.stat().st_size
        locations = _PARSED.get(file, raw, size)
        if locations is None:
            locations = header_locations(file, raw, data_start, size)
            _PARSED.put(file, raw, size, locations)
        tensors = self.tensors
        for loc in locations:
            if loc.name in tensors:
                raise FormatError(f"tensor {loc.name!r} appears in two files of {self.root}")
            tensors[loc.name] = loc
        return locations

    def _map(self, file: Path) -> mmap.mmap:
        m = self._maps.get(file)
        if m is None:
            with open(file, "rb") as f:
                if os.fstat(f.fileno()).st_size == 0:
                    raise FormatError(f"{file} is empty")
                m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            self._maps[file] = m
        return m

    def view(self, name: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Flat unsigned-integer view of elements [start, stop) of a tensor (no copy)."""
        loc = self.tensors[name]
        uint = uint_of(loc.dtype)
        stop = loc.numel if stop is None else stop
        if stop <= start:
            return np.empty(0, dtype=uint)
        offset = loc.start + start * uint.itemsize
        return np.frombuffer(self._map(loc.file), dtype=uint, count=stop - start, offset=offset)

    def cached_digests(self) -> dict[str, str]:
        """Tensor digests remembered for these exact files (see digest_cache); may be partial."""
        out: dict[str, str] = {}
        by_file: dict[Path, list[str]] = {}
        for n, t in self.tensors.items():  # one pass (Path equality per tensor and file costs ~20 us)
            by_file.setdefault(t.file, []).append(n)
        for file, names in by_file.items():
            cached = digest_cache.load(file) if digest_cache.key(file) == self._cache_keys[file] else {}
            out.update({n: cached[n] for n in names if n in cached})
            if cached:
                self._cached[file] = cached
        return out

    def remember_digests(self, digests: dict[str, str]) -> None:
        """Store the digests of every file whose tensors are all in ``digests``, unless it changed since opened."""
        by_file: dict[Path, dict[str, str]] = {}
        for name, loc in self.tensors.items():
            by_file.setdefault(loc.file, {})[name] = digests.get(name, "")
        for file, table in by_file.items():
            if all(table.values()) and table != self._cached.get(file):  # the cache holds these already
                digest_cache.save(file, table, self._cache_keys[file])

    def tensor_digests(self) -> dict[str, str]:
        """Digests of every tensor's stored bytes, computed where the cache has none."""
        out = self.cached_digests()
        for name in self.tensors:
            if name not in out:
                out[name] = digest_bytes(self.view(name))
        self.remember_digests(out)
        return out

    def layout(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        return {n: (t.dtype, t.shape) for n, t in self.tensors.items()}

    def tensor_table(self, digests: dict[str, str]) -> dict[str, TensorEntry]:
        tensors = self.tensors
        return {n: TensorEntry(tensors[n].dtype, tensors[n].shape, digests[n]) for n in sorted(tensors)}

    def close(self) -> None:
        for m in self._maps.values():
            with contextlib.suppress(BufferError):  # a view is still alive; it closes when collected
                m.close()
        self._maps.clear()

    def __enter__(self) -> SafetensorsCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def header_entry(
    file: Path, name: str, meta: Any, data_start: int, size: int
) -> tuple[DType, tuple[int, ...], int, int]:
    """(dtype, shape, begin, end) of one safetensors header entry, checked against its shape and the file's size."""
    try:
        dt = lookup_dtype(meta["dtype"])
        shape = tuple(int(s) for s in meta["shape"])
        begin, end = (int(x) for x in meta["data_offsets"])
    except (KeyError, TypeError, ValueError):
        raise FormatError(f"{file}: bad header entry for {name!r}") from None
    if any(s < 0 for s in shape) or end - begin != numel(shape) * dt.itemsize or data_start + end > size or begin < 0:
        raise FormatError(f"{file}: data of {name!r} is truncated or inconsistent with its shape")
    return dt, shape, begin, end


def _locations(file: Path, header: dict, data_start: int, size: int) -> list[TensorLocation]:
    """The tensors of one parsed header, in header order, checked against the file's size and each other."""
    out: list[TensorLocation] = []
    spans: list[tuple[int, int, str]] = []
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        dt, shape, begin, end = header_entry(file, name, meta, data_start, size)
        nbytes = end - begin
        out.append(TensorLocation(name, dt.name, shape, file, data_start + begin, nbytes))
        if nbytes:
            spans.append((begin, end, name))
    # Two tensors sharing bytes would let an in-place write to one silently change the other.
    spans.sort()
    for (_, end_a, name_a), (begin_b, _, name_b) in itertools.pairwise(spans):
        if begin_b < end_a:
            raise FormatError(f"{file}: the data of {name_a!r} and {name_b!r} overlap (not valid safetensors)")
    return out


def header_locations(file: Path, raw: bytes, data_start: int, size: int) -> list[TensorLocation]:
    """``_locations(file, parse_header(file, raw), ...)``: the same locations, every check of both, in one pass.

    A 100k-tensor header is checked entry by entry twice over there (types, then offsets against the
    file); here each entry is checked once with exact type tests. Anything the fast pass does not
    accept is handed to the two-step path, so a bad header is refused with exactly its message.
    """
    header = load_json(raw, f"{file}: safetensors header")
    out = _fast_locations(file, header, data_start, size) if isinstance(header, dict) else None
    if out is None:
        return _locations(file, parse_header(file, raw), data_start, size)
    return out


_NEW_LOCATION = object.__new__
_SET_LOCATION = tuple(getattr(TensorLocation, f).__set__ for f in ("name", "dtype", "shape", "file", "start", "nbytes"))


def _location(name: str, dtype: str, shape: tuple[int, ...], file: Path, start: int, nbytes: int) -> TensorLocation:
    """``TensorLocation(...)`` of checked fields, each slot set directly (the frozen dataclass's ``__init__``
    goes through ``object.__setattr__`` per field: a third of a location's cost at 100k tensors)."""
    loc = _NEW_LOCATION(TensorLocation)
    set_name, set_dtype, set_shape, set_file, set_start, set_nbytes = _SET_LOCATION
    set_name(loc, name)
    set_dtype(loc, dtype)
    set_shape(loc, shape)
    set_file(loc, file)
    set_start(loc, start)
    set_nbytes(loc, nbytes)
    return loc


def _fast_locations(file: Path, header: dict, data_start: int, size: int) -> list[TensorLocation] | None:
    """The locations of a header every entry of which passes all checks, in header order; None otherwise."""
    out: list[TensorLocation] = []
    append = out.append
    dtypes: dict[str, DType] = {}
    previous_end = 0  # entries in offset order need no sort for the overlap check (the usual layout)
    ordered = True
    for name, meta in header.items():
        if name == "__metadata__":
            if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
                return None
            continue
        if type(meta) is not dict:
            return None
        dt_name, shape, offsets = meta.get("dtype"), meta.get("shape"), meta.get("data_offsets")
        if type(dt_name) is not str or type(shape) is not list or type(offsets) is not list or len(offsets) != 2:
            return None
        dt = dtypes.get(dt_name)
        if dt is None:
            try:
                dt = dtypes[dt_name] = lookup_dtype(dt_name)
            except FormatError:
                return None
        count = 1
        for s in shape:
            if type(s) is not int or s < 0:
                return None
            count *= s
        begin, end = offsets
        if type(begin) is not int or type(end) is not int or begin < 0 or end < begin:
            return None
        nbytes = end - begin
        if nbytes != count * dt.itemsize or data_start + end > size:
            return None
        if nbytes:
            if begin < previous_end:
                ordered = False
            previous_end = end
        append(_location(name, dt.name, tuple(shape), file, data_start + begin, nbytes))
    if not ordered:
        spans = sorted((loc.start, loc.start + loc.nbytes) for loc in out if loc.nbytes)
        if any(b < a_end for (_, a_end), (b, _) in itertools.pairwise(spans)):
            return None  # overlapping data: the two-step path names the two tensors
    return out


class _ParsedHeaders:
    """The tensors of headers parsed before in this process, for files opened again (an apply opens its
    checkpoint four times; a 100k-tensor header takes ~0.1 s to parse and check). A hit needs the same
    path, the same header bytes (compared in full) and the same file size, which are all the parse reads,
    so it returns exactly what parsing again would. Bounded by the bytes of the headers kept."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[Path, tuple[bytes, int, list[TensorLocation]]] = OrderedDict()
        self._held = 0
        self._lock = threading.Lock()

    def get(self, file: Path, raw: bytes, size: int) -> list[TensorLocation] | None:
        with self._lock:
            entry = self._entries.get(file)
            if entry is None or entry[1] != size or entry[0] != raw:
                return None
            self._entries.move_to_end(file)
            return entry[2]

    def put(self, file: Path, raw: bytes, size: int, locations: list[TensorLocation]) -> None:
        if len(raw) > self.max_bytes:
            return
        with self._lock:
            old = self._entries.pop(file, None)
            if old is not None:
                self._held -= len(old[0])
            self._entries[file] = (raw, size, locations)
            self._held += len(raw)
            while self._held > self.max_bytes:
                _, (dropped, _, _) = self._entries.popitem(last=False)
                self._held -= len(dropped)


_PARSED = _ParsedHeaders(max_bytes=256 << 20)
# The index read last, by its path: (its bytes, its weight_map, its file names); a hit needs the same bytes.
_INDEXES: dict[Path, tuple[bytes, dict[str, str], list[str]]] = {}
# The index checked last against its files' headers: (its weight_map, each file's locations), as handed out.
_INDEX_CHECKED: dict[str, tuple[dict[str, str], list[list[TensorLocation]]]] = {}


def layout_mismatch(a: dict[str, tuple[str, tuple[int, ...]]], b: dict[str, tuple[str, tuple[int, ...]]]) -> str | None:
    """A one-line description of how two tensor layouts differ, or None."""
    only_a, only_b = sorted(set(a) - set(b)), sorted(set(b) - set(a))
    if only_a:
        return f"tensor {only_a[0]!r} is only in the first checkpoint ({len(only_a)} such)"
    if only_b:
        return f"tensor {only_b[0]!r} is only in the second checkpoint ({len(only_b)} such)"
    for name in sorted(a):
        if a[name] != b[name]:
            (da, sa), (db, sb) = a[name], b[name]
            return f"tensor {name!r} is {da}{list(sa)} in one and {db}{list(sb)} in the other"
    return None
