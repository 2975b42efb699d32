"""Training shards seen in canonical coordinates: stored chunks, index maps and the canonical table.

A training checkpoint stores *stored tensors* (DCP fqns, Megatron keys, DCP-HF
shard entries), each written as N-d *chunks* (boxes of the stored tensor's
global shape). A *profile* relates stored tensors to *canonical tensors* (the
Hugging Face names, dtypes and shapes a receiver holds) with *segments*: a box
of a stored tensor that is, by translation, a box of one canonical tensor
(after dropping leading axes of size one, e.g. a stacked layer axis). Every
layout change that only moves elements (row/column tensor parallelism, stacked
layers, QKV rows interleaved per group, [gate; up], vocab padding, per-expert
slices) is a list of segments, so a changed element in a chunk maps to its
canonical index without assembling anything.

Conversions that change values (dtype cast, zero-centred norm +1, fp8 block
quantization) and duplicates (tied tensors) cannot be expressed as segments:
such a canonical tensor is *residual*. It is assembled from its segments,
converted, and diffed whole (format_spec/producers.md). A residual tensor's
segments may tile a *source* of another shape (an fp8 scale is computed from
the whole weight): the source is assembled, and the conversion gives the
canonical shape.
"""

from __future__ import annotations

import itertools
import json
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import FormatError, IncompatibleError
from ..format.digest import StreamingDigest
from ..format.dtypes import dtype as lookup_dtype
from ..format.dtypes import numel
from ..format.manifest import TensorEntry
from ..io import digest_cache

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)
BAND_BYTES = 16 << 20  # canonical row bands assembled at once (digests, tied checks)
RESIDUAL_BAND_BYTES = 4 << 20  # source row bands converted at once on the residual path


@dataclass(frozen=True)
class Chunk:
    """One stored box of a stored tensor, and where its bytes live (reader-specific)."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str  # relative file name; the unit of work of one producer process
    location: Any = field(compare=False, hash=False, default=None)

    @property
    def numel(self) -> int:
        return numel(self.sizes)


@dataclass
class StoredTensor:
    key: str
    dtype: str  # safetensors spelling
    shape: tuple[int, ...]
    chunks: list[Chunk]


@dataclass(frozen=True)
class Segment:
    """stored[key][offsets : offsets+sizes] == canonical[name][canonical_offsets : ...] (leading 1-axes dropped)."""

    key: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    name: str
    canonical_offsets: tuple[int, ...]


@dataclass
class CanonicalTensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    segments: list[Segment]
    # Residual tensors: why, and the conversion from the assembled stored values
    # (an array in the stored dtype's unsigned view, canonical shape) to canonical bits.
    residual: str | None = None
    convert: Callable[[np.ndarray], np.ndarray] | None = None
    source_dtype: str | None = None  # dtype of the stored values a residual conversion reads
    source_shape: tuple[int, ...] | None = None  # shape the segments tile, when not the canonical shape

    @property
    def assembled_shape(self) -> tuple[int, ...]:
        """The shape ``assemble`` returns: the segments' source, before any residual conversion."""
        return self.shape if self.source_shape is None else self.source_shape


class ShardReader:
    """Reads the bytes of stored chunks. Subclasses implement ``read_chunk``."""

    stored: dict[str, StoredTensor]
    root: str

    def read_chunk(self, key: str, chunk: Chunk) -> np.ndarray:
        """The chunk's elements as the stored dtype's unsigned integers, shaped ``chunk.sizes``."""
        raise NotImplementedError

    def release(self, key: str, chunk: Chunk) -> None:
        """Done with this chunk for now: readers that map files drop its pages from this process."""
        return None

    def close(self) -> None:
        return None


def release_pages(m: object, start: int, length: int) -> None:
    """Unmap the pages of [start, start+length) of a read-only file mapping from this process (RSS).

    The data stays in the page cache; a later access faults it back in, so this is safe
    even while another thread still reads the same range.
    """
    import mmap as _mmap

    if length <= 0 or not hasattr(_mmap, "MADV_DONTNEED"):
        return
    page = _mmap.PAGESIZE
    lo = start - start % page
    hi = min(len(m), start + length)  # type: ignore[arg-type]
    if hi > lo:
        m.madvise(_mmap.MADV_DONTNEED, lo, hi - lo)  # type: ignore[attr-defined]


def intersect(
    a_off: tuple[int, ...], a_size: tuple[int, ...], b_off: tuple[int, ...], b_size: tuple[int, ...]
) -> Box | None:
    lo = tuple(max(x, y) for x, y in zip(a_off, b_off, strict=True))
    hi = tuple(min(x + s, y + t) for x, s, y, t in zip(a_off, a_size, b_off, b_size, strict=True))
    if any(h <= low for low, h in zip(lo, hi, strict=True)):
        return None
    return lo, tuple(h - low for low, h in zip(lo, hi, strict=True))


@dataclass(frozen=True)
class Piece:
    """The part of one chunk that lands in one canonical box."""

    name: str
    canonical_offsets: tuple[int, ...]
    canonical_sizes: tuple[int, ...]
    slices: tuple[slice, ...]  # into the chunk array


def chunk_pieces(chunk: Chunk, segments: list[Segment]) -> list[Piece]:
    """Project a chunk through the segments of its stored tensor: fixed index maps, no data."""
    pieces = []
    for seg in segments:
        hit = intersect(chunk.offsets, chunk.sizes, seg.offsets, seg.sizes)
        if hit is None:
            continue
        lo, sizes = hit
        dropped = len(sizes) - len(seg.canonical_offsets)
        if any(s != 1 for s in sizes[:dropped]):
            raise FormatError(f"segment of {seg.key} for {seg.name} drops an axis longer than 1")
        canonical_offsets = tuple(
            c + (x - o) for c, x, o in zip(seg.canonical_offsets, lo[dropped:], seg.offsets[dropped:], strict=True)
        )
        slices = tuple(slice(x - o, x - o + s) for x, o, s in zip(lo, chunk.offsets, sizes, strict=True))
        pieces.append(Piece(seg.name, canonical_offsets, sizes[dropped:], slices))
    return pieces


class ShardCheckpoint:
    """A reader plus a profile: the canonical view of one training checkpoint."""

    def __init__(
        self,
        reader: ShardReader,
        canonical: dict[str, CanonicalTensor],
        kind: str,
        duplicates: list[tuple[str, str]] | None = None,
    ) -> None:
        self.reader = reader
        # (stored key, canonical name): stored copies of a canonical tensor (tied weights), checked not emitted
        self.duplicates = list(duplicates or [])
        self.canonical = dict(sorted(canonical.items()))
        self.kind = kind
        self.segments_by_key: dict[str, list[Segment]] = {}
        for t in self.canonical.values():
            for seg in t.segments:
                if seg.key not in reader.stored:
                    raise IncompatibleError(f"{reader.root}: profile needs stored tensor {seg.key!r}, which is missing")
                self.segments_by_key.setdefault(seg.key, []).append(seg)
        self._check_cover()
        self._chunk_index: dict[tuple[str, tuple[int, ...]], Chunk] | None = None
        self._cache_key = self._digest_cache_key()  # taken before any hashing (see digest_cache)

    @property
    def root(self) -> str:
        return self.reader.root

    def _digest_cache_key(self) -> str | None:
        """Every file of the checkpoint directory, and how stored tensors map to canonical ones."""
        description = json.dumps(
            [
                self.kind,
                [
                    [t.name, t.dtype, t.shape, t.residual, t.source_dtype, t.source_shape]
                    + [[s.key, s.offsets, s.sizes, s.canonical_offsets] for s in t.segments]
                    for t in self.canonical.values()
                ],
                self.duplicates,
            ]
        )
        try:
            files = [f for f in Path(self.root).iterdir() if f.is_file()]
            return digest_cache.files_key(files, description)
        except OSError:
            return None

    def _cache_still_valid(self) -> bool:
        return self._cache_key is not None and self._digest_cache_key() == self._cache_key

    def cached_digests(self) -> dict[str, str]:
        """The canonical tensors' digests if this very checkpoint was hashed before, else {}."""
        if self._cache_key is None:
            return {}
        cached = digest_cache.load_entry(self._cache_key)
        return cached if set(cached) == set(self.canonical) and self._cache_still_valid() else {}

    def remember_digests(self, digests: dict[str, str]) -> None:
        """Store a complete digest table, unless a file changed since the checkpoint was opened."""
        if self._cache_key is not None and set(digests) == set(self.canonical) and self._cache_still_valid():
            digest_cache.save_entry(self._cache_key, digests)

    def _check_cover(self) -> None:
        """Every canonical element must come from exactly one segment, and every segment from stored chunks."""
        for t in self.canonical.values():
            covered = sum(numel(s.sizes) for s in t.segments)
            if covered != numel(t.assembled_shape):
                raise FormatError(
                    f"{self.root}: canonical {t.name} {list(t.assembled_shape)} is covered by {covered} stored"
                    f" elements, expected {numel(t.assembled_shape)}; the profile does not match this checkpoint"
                )
        for key, segs in self.segments_by_key.items():
            st = self.reader.stored[key]
            stored_total = sum(c.numel for c in st.chunks)
            if stored_total != numel(st.shape):
                raise FormatError(
                    f"{self.root}: stored tensor {key} has chunks of {stored_total} elements for a shape of"
                    f" {numel(st.shape)} (overlapping or missing chunks)"
                )
            for seg in segs:
                for o, s, d in zip(seg.offsets, seg.sizes, st.shape, strict=True):
                    if o < 0 or o + s > d:
                        raise FormatError(f"{self.root}: segment for {seg.name} lies outside {key} {list(st.shape)}")

    def duplicate_view(self, key: str, name: str) -> CanonicalTensor:
        """The duplicate stored tensor ``key`` read as if it were canonical ``name`` (for the equality check)."""
        t = self.canonical[name]
        zero = (0,) * len(t.shape)
        return CanonicalTensor(
            name, t.dtype, t.shape, [Segment(key, zero, t.shape, name, zero)], source_dtype=t.source_dtype
        )

    def residual_reasons(self) -> dict[str, str]:
        out = {n: t.residual for n, t in self.canonical.items() if t.residual}
        for key, name in self.duplicates:
            out[name] = ", ".join(filter(None, (out.get(name), f"tied: {key} is checked to equal it")))
        return out

    def layout(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        return {n: (t.dtype, t.shape) for n, t in self.canonical.items()}

    def table(self, digests: dict[str, str]) -> dict[str, TensorEntry]:
        return {n: TensorEntry(t.dtype, t.shape, digests[n]) for n, t in self.canonical.items()}

    def chunk_layout(self) -> dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]]:
        return {k: sorted((c.offsets, c.sizes) for c in st.chunks) for k, st in self.reader.stored.items()}

    def files(self) -> list[str]:
        return sorted({c.file for k in self.segments_by_key for c in self.reader.stored[k].chunks if c.numel})

    def units(self) -> list[tuple[str, Chunk]]:
        """Stored chunks that feed index-only canonical tensors, in a deterministic order."""
        out = []
        for key in sorted(self.segments_by_key):
            for chunk in sorted(self.reader.stored[key].chunks, key=lambda c: c.offsets):
                if chunk.numel:
                    out.append((key, chunk))
        return out

    def index_pieces(self, key: str, chunk: Chunk) -> list[Piece]:
        segs = [s for s in self.segments_by_key.get(key, []) if self.canonical[s.name].residual is None]
        return chunk_pieces(chunk, segs)

    # ----- what a diff reads of one side: chunks, canonical digests, residual values, tied checks
    def own_chunk(self, key: str, chunk: Chunk) -> Chunk:
        """This checkpoint's chunk at the same offsets as ``chunk`` (which may come from the other side)."""
        if self._chunk_index is None:
            self._chunk_index = {(k, c.offsets): c for k, st in self.reader.stored.items() for c in st.chunks}
        return self._chunk_index[(key, chunk.offsets)]

    def read_chunk(self, key: str, chunk: Chunk) -> np.ndarray:
        return self.reader.read_chunk(key, self.own_chunk(key, chunk))

    def release(self, key: str, chunk: Chunk) -> None:
        self.reader.release(key, self.own_chunk(key, chunk))

    def canonical_digest(self, name: str) -> str:
        """BLAKE3 of canonical tensor ``name``'s stored bytes in C order, read band by band from the chunks."""
        digest = StreamingDigest()
        runs = self.row_runs(name)
        if runs is not None:  # row-sharded: stream zero-copy chunk views, nothing assembled
            for key, chunk, slices in runs:
                digest.update(np.ascontiguousarray(self.reader.read_chunk(key, chunk)[slices]))
                self.reader.release(key, chunk)
            return digest.hexdigest()
        cache = ChunkCache(self.reader)
        for rows in self.band_rows(name, BAND_BYTES):
            digest.update(self.assemble(name, rows, cache))
        cache.clear()
        return digest.hexdigest()

    def converted(self, name: str) -> np.ndarray:
        """A residual tensor's canonical bits, flat: assembled from its source (bounded by it), then converted."""
        t = self.canonical[name]
        assert t.convert is not None
        return t.convert(self.assemble(name)).reshape(-1)

    def shares_source(self, first: str, second: str) -> bool:
        """Whether residual ``second`` is computed from the same stored values as ``first`` by one joint
        conversion (an fp8 weight and its scale), so that one assembly and conversion serve both."""
        a, b = self.canonical[first], self.canonical[second]
        joint = getattr(a.convert, "joint", None)
        if joint is None or getattr(b.convert, "joint", None) is not joint:
            return False
        if (a.assembled_shape, a.source_dtype) != (b.assembled_shape, b.source_dtype):
            return False
        return [(s.key, s.offsets, s.sizes, s.canonical_offsets) for s in a.segments] == [
            (s.key, s.offsets, s.sizes, s.canonical_offsets) for s in b.segments
        ]

    def converted_bands(self, names: Sequence[str], max_bytes: int = RESIDUAL_BAND_BYTES) -> Iterator[list[np.ndarray]]:
        """Residual tensors' canonical bits band by band of source rows: per band, one flat array per name.

        Concatenated over the bands, each name's arrays are ``converted(name)``; memory is bounded by
        a band of about ``max_bytes`` source bytes and its conversion, not by the tensor. ``names`` is
        one residual tensor, or several that ``shares_source`` (each band is converted once for all).
        """
        first = self.canonical[names[0]]
        assert first.convert is not None
        joint = getattr(first.convert, "joint", None) if len(names) > 1 else None
        if len(names) > 1 and not all(self.shares_source(names[0], n) for n in names[1:]):
            raise ValueError(f"{list(names)} do not share one residual conversion")
        converts = [self.canonical[n].convert for n in names]
        multiple = int(getattr(first.convert, "band_rows", 1))
        cache = ChunkCache(self.reader)
        try:
            for rows in self.band_rows(names[0], max_bytes, multiple):
                source = self.assemble(first, rows, cache)
                if joint is not None:
                    outs = joint(source)
                    yield [np.asarray(outs[c.index]).reshape(-1) for c in converts]  # type: ignore[union-attr]
                else:
                    yield [c(source).reshape(-1) for c in converts]  # type: ignore[misc]
                del source
        finally:
            cache.clear()

    def check_tied(self, key: str, name: str) -> None:
        """The stored duplicate ``key`` must equal canonical ``name`` (a tied copy), band by band."""
        dup = self.duplicate_view(key, name)
        cache = ChunkCache(self.reader)
        for rows in self.band_rows(name, BAND_BYTES):
            if not np.array_equal(self.assemble(dup, rows, cache), self.assemble(name, rows, cache)):
                raise IncompatibleError(
                    f"{self.root}: {key} should be a tied copy of {name} but differs (rows {rows[0]}..);"
                    " the HF checkpoint cannot represent it: untie the profile (tie_word_embeddings false)"
                )
        cache.clear()

    # ----- assembly (bounded): canonical row bands, for digests and the residual path
    def band_rows(self, name: str, max_bytes: int, multiple: int = 1) -> list[tuple[int, int]]:
        """Row bands of about ``max_bytes`` of the assembled source; each starts at a ``multiple`` of rows."""
        t = self.canonical[name]
        shape = t.assembled_shape
        if not shape:
            return [(0, 1)]
        row_bytes = max(1, numel(shape[1:]) * lookup_dtype(t.source_dtype or t.dtype).itemsize)
        step = max(1, max_bytes // row_bytes)
        step = max(multiple, step - step % multiple)
        return [(r, min(r + step, shape[0])) for r in range(0, shape[0], step)] or [(0, 0)]

    def row_runs(self, name: str) -> list[tuple[str, Chunk, tuple[slice, ...]]] | None:
        """The tensor as contiguous runs of chunk rows, in canonical C order, when it has that shape.

        True for row-sharded tensors (FSDP Shard(0), column parallel, stacked
        layers, per-group row blocks): the digest then streams over zero-copy
        chunk views with no assembly. None when a chunk splits a row (Shard(1)).
        """
        t = self.canonical[name]
        if not t.shape:
            return None
        runs: list[tuple[int, int, str, Chunk, tuple[slice, ...]]] = []
        for seg in t.segments:
            dropped = len(seg.offsets) - len(t.shape)
            if tuple(seg.sizes[dropped + 1 :]) != tuple(t.shape[1:]):
                return None
            for chunk in self.reader.stored[seg.key].chunks:
                hit = intersect(chunk.offsets, chunk.sizes, seg.offsets, seg.sizes) if chunk.numel else None
                if hit is None:
                    continue
                lo, sizes = hit
                if sizes[dropped + 1 :] != tuple(chunk.sizes[dropped + 1 :]):
                    return None  # the chunk holds part of each row
                row0 = seg.canonical_offsets[0] + lo[dropped] - seg.offsets[dropped]
                slices = tuple(slice(x - o, x - o + n) for x, o, n in zip(lo, chunk.offsets, sizes, strict=True))
                runs.append((row0, row0 + sizes[dropped], seg.key, chunk, slices))
        runs.sort(key=lambda r: r[0])
        pos = 0
        for r0, r1, *_ in runs:
            if r0 != pos:
                return None
            pos = r1
        if pos != t.shape[0]:
            return None
        return [(key, chunk, slices) for _, _, key, chunk, slices in runs]

    def assemble(
        self, name: str | CanonicalTensor, rows: tuple[int, int] | None = None, cache: ChunkCache | None = None
    ) -> np.ndarray:
        """Rows [r0, r1) (all rows if None) of ``assembled_shape``, as the stored values' unsigned ints, unconverted."""
        t = self.canonical[name] if isinstance(name, str) else name
        name = t.name
        shape = t.assembled_shape
        if rows is None:
            rows = (0, shape[0]) if shape else (0, 1)
        st_dtype = lookup_dtype(t.source_dtype or t.dtype)
        band_off = (rows[0],) + (0,) * (len(shape) - 1) if shape else ()
        band_size = (rows[1] - rows[0], *shape[1:]) if shape else ()
        out = np.empty(band_size, dtype=st_dtype.uint)
        filled = 0
        cache = cache or ChunkCache(self.reader)
        for seg in t.segments:
            dropped = len(seg.offsets) - len(shape)
            # canonical box of this segment
            seg_sizes = seg.sizes[dropped:]
            hit = intersect(seg.canonical_offsets, seg_sizes, band_off, band_size) if shape else ((), ())
            if hit is None:
                continue
            c_lo, c_sizes = hit
            # the same box in stored coordinates
            s_lo = seg.offsets[:dropped] + tuple(
                o + (c - co) for o, c, co in zip(seg.offsets[dropped:], c_lo, seg.canonical_offsets, strict=True)
            )
            s_sizes = seg.sizes[:dropped] + c_sizes
            for chunk in self.reader.stored[seg.key].chunks:
                got = intersect(chunk.offsets, chunk.sizes, s_lo, s_sizes) if chunk.numel else None
                if got is None:
                    continue
                g_lo, g_sizes = got
                data = cache.get(seg.key, chunk)
                src = data[tuple(slice(x - o, x - o + s) for x, o, s in zip(g_lo, chunk.offsets, g_sizes, strict=True))]
                dst_lo = tuple(
                    c + (x - s) - b for c, x, s, b in zip(c_lo, g_lo[dropped:], s_lo[dropped:], band_off, strict=True)
                )
                dst = tuple(slice(d, d + s) for d, s in zip(dst_lo, g_sizes[dropped:], strict=True))
                out[dst] = src.reshape(g_sizes[dropped:])
                filled += numel(g_sizes)
        if filled != numel(band_size):
            raise FormatError(f"{self.root}: stored chunks cover {filled} of {numel(band_size)} elements of {name}")
        return out


class ChunkCache:
    """A small LRU of decoded chunks, so that a chunk feeding several bands is read once."""

    def __init__(self, reader: ShardReader, max_bytes: int = 256 << 20) -> None:
        self.reader, self.max_bytes = reader, max_bytes
        self._items: OrderedDict[tuple[str, tuple[int, ...]], tuple[Chunk, np.ndarray]] = OrderedDict()

    def get(self, key: str, chunk: Chunk) -> np.ndarray:
        k = (key, chunk.offsets)
        hit = self._items.get(k)
        if hit is not None:
            self._items.move_to_end(k)
            return hit[1]
        arr = self.reader.read_chunk(key, chunk)
        self._items[k] = (chunk, arr)
        while len(self._items) > 1 and sum(a.nbytes for _, a in self._items.values()) > self.max_bytes:
            (old_key, _), (old_chunk, _) = self._items.popitem(last=False)
            self.reader.release(old_key, old_chunk)
        return arr

    def clear(self) -> None:
        for (key, _), (chunk, _) in self._items.items():
            self.reader.release(key, chunk)
        self._items.clear()


def identity_canonical(
    reader: ShardReader, include: tuple[str, ...] | list[str] = (), strip_prefix: str = ""
) -> dict[str, CanonicalTensor]:
    """Profile of formats whose stored tensors already are the canonical tensors (plain DCP, DCP-HF).

    ``include`` globs select the weights among everything a trainer saved (optimizer state,
    counters); ``strip_prefix`` removes a wrapper prefix (e.g. "model.") from the HF names.
    """
    import fnmatch

    out = {}
    for key in sorted(reader.stored):
        if include and not any(fnmatch.fnmatchcase(key, g) for g in include):
            continue
        name = key[len(strip_prefix) :] if strip_prefix and key.startswith(strip_prefix) else key
        if not name:  # a tensor named "" no checkpoint a receiver holds can match
            raise IncompatibleError(f"{reader.root}: --strip-prefix {strip_prefix!r} leaves {key!r} with no name")
        if name in out:
            raise IncompatibleError(f"{reader.root}: two stored tensors become {name!r} after --strip-prefix")
        st = reader.stored[key]
        zero = (0,) * len(st.shape)
        out[name] = CanonicalTensor(name, st.dtype, st.shape, [Segment(key, zero, st.shape, name, zero)])
    if not out:
        raise IncompatibleError(f"{reader.root}: no stored tensor matches --include {' '.join(include)}")
    return out


def check_chunks_disjoint(key: str, chunks: list[Chunk], shape: tuple[int, ...], where: str) -> None:
    """Replicas must have been deduplicated by the writer: no element may be stored twice."""
    live = [c for c in chunks if c.numel]
    for a, b in itertools.combinations(live, 2):
        if intersect(a.offsets, a.sizes, b.offsets, b.sizes) is not None:
            raise FormatError(f"{where}: {key} has overlapping chunks {list(a.offsets)} and {list(b.offsets)}")
    for c in live:
        for o, s, d in zip(c.offsets, c.sizes, shape, strict=True):
            if o < 0 or o + s > d:
                raise FormatError(
                    f"{where}: chunk {list(c.offsets)}+{list(c.sizes)} of {key} lies outside {list(shape)}"
                )
