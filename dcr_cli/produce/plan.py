"""The diff plan: plain work items computed from the checkpoints' metadata, before any data is read.

In the spirit of torch.distributed.checkpoint's planner/storage split, a diff is
planned first and executed after (engine.py). A plan is a list of units:

- ``RangeUnit``: elements [start, stop) of a canonical tensor, one flat-range item
  (a Hugging Face directory is the identity plan: one chunk per tensor, split in
  CHUNK_BYTES ranges);
- ``ChunkUnit``: one stored chunk projected through the profile's index maps into
  box bands of canonical tensors (format_spec/producers.md): nothing is assembled;
- ``DigestUnit``: the digest of a canonical tensor on both sides (tensor table, fingerprints);
- ``ResidualUnit``: a value-changing conversion, assembled, converted and diffed as flat ranges;
- ``TiedUnit``: a stored duplicate checked equal to its canonical tensor, never emitted.

With ``rank``/``world_size`` a plan covers one producer's share (its shard files and a
byte-balanced share of the canonical tensors) and execution writes a part.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..checkpoints.safetensors_dir import layout_mismatch
from ..checkpoints.shards import Chunk, ShardCheckpoint
from ..errors import IncompatibleError
from ..format.dtypes import dtype as lookup_dtype
from ..format.dtypes import numel
from ..format.manifest import Op

# One item covers at most this many bytes of a tensor: bounds memory per
# worker and lets one huge tensor (an embedding) use every core.
CHUNK_BYTES = 16 << 20

Layout = dict[str, tuple[str, tuple[int, ...]]]


@dataclass(frozen=True)
class RangeUnit:
    name: str
    start: int
    stop: int
    op: Op
    itemsize: int


@dataclass(frozen=True)
class Band:
    """Rows [r0, r1) of one piece of a chunk: the box item ``offsets``+``sizes`` of canonical ``name``."""

    name: str
    slices: tuple[slice, ...]  # the piece, into the chunk array
    piece_sizes: tuple[int, ...]  # the piece's canonical sizes (leading 1-axes dropped)
    rows: tuple[int, int]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    op: Op


@dataclass(frozen=True)
class ChunkUnit:
    key: str
    chunk: Chunk
    bands: tuple[Band, ...]
    itemsize: int


@dataclass(frozen=True)
class DigestUnit:
    name: str


@dataclass(frozen=True)
class ResidualUnit:
    name: str
    op: Op
    residual: str
    itemsize: int


@dataclass(frozen=True)
class TiedUnit:
    key: str
    name: str


Unit = RangeUnit | ChunkUnit | DigestUnit | ResidualUnit | TiedUnit


@dataclass
class Plan:
    units: list[Unit]
    layout: Layout
    digested: list[str]  # canonical tensors whose digests this producer reports
    rank: int | None = None  # a part of a delta, or (None) the whole delta
    world_size: int | None = None
    residual: dict[str, str] = field(default_factory=dict)  # tensor -> why it took the residual path

    @property
    def total_bytes(self) -> int:
        """Bytes of the new side that the units scan (for progress)."""
        total = 0
        for u in self.units:
            if isinstance(u, RangeUnit):
                total += (u.stop - u.start) * u.itemsize
            elif isinstance(u, ChunkUnit):
                total += u.chunk.numel * u.itemsize
        return total


def op_selector(overwrite: Sequence[str]) -> Callable[[str], Op]:
    def op_of(name: str) -> Op:
        return "overwrite" if any(fnmatch.fnmatchcase(name, p) for p in overwrite) else "xor"

    return op_of


def chunk_ranges(numel: int, itemsize: int) -> list[tuple[int, int]]:
    step = max(1, CHUNK_BYTES // max(1, itemsize))
    return [(s, min(s + step, numel)) for s in range(0, numel, step)]


def box_bands(sizes: tuple[int, ...], itemsize: int) -> list[tuple[int, int]]:
    """Split a box along its first axis so that one item covers at most CHUNK_BYTES."""
    if not sizes:
        return [(0, 1)]
    row = max(1, numel(sizes[1:]) * itemsize)
    step = max(1, CHUNK_BYTES // row)
    return [(r, min(r + step, sizes[0])) for r in range(0, sizes[0], step)]


def check_layouts(base: Layout, new: Layout) -> None:
    mismatch = layout_mismatch(base, new)
    if mismatch:
        raise IncompatibleError(f"checkpoints differ in layout: {mismatch}; dcr deltas need identical tensor sets")


_new_object = object.__new__
_set_dict = object.__setattr__


def digest_unit(name: str) -> DigestUnit:
    """``DigestUnit(name)`` without the frozen dataclass's ``__init__`` (the same instance; a plan of an
    MoE checkpoint makes 100k of them)."""
    unit = _new_object(DigestUnit)
    _set_dict(unit, "__dict__", {"name": name})
    return unit


def range_unit(name: str, start: int, stop: int, op: Op, itemsize: int) -> RangeUnit:
    """``RangeUnit(...)`` without the frozen dataclass's ``__init__`` (the same instance)."""
    unit = _new_object(RangeUnit)
    _set_dict(unit, "__dict__", {"name": name, "start": start, "stop": stop, "op": op, "itemsize": itemsize})
    return unit


def plan_tensors(layout: Layout, overwrite: Sequence[str] = ()) -> Plan:
    """The identity plan (HF directories, plain tensors): per tensor, its digest and CHUNK_BYTES ranges."""
    op_of = op_selector(overwrite)
    units: list[Unit] = []
    append = units.append
    itemsizes: dict[str, int] = {}  # an MoE layout has 100k tensors of a few dtypes
    names = sorted(layout)
    for name in names:
        dt, shape = layout[name]
        itemsize = itemsizes.get(dt)
        if itemsize is None:
            itemsize = itemsizes[dt] = lookup_dtype(dt).itemsize
        append(digest_unit(name))
        op: Op = op_of(name) if overwrite else "xor"
        size = numel(shape)
        if size * itemsize <= CHUNK_BYTES:  # one range, as chunk_ranges gives it (none when empty)
            if size:
                append(range_unit(name, 0, size, op, itemsize))
        else:
            units.extend(RangeUnit(name, s, e, op, itemsize) for s, e in chunk_ranges(size, itemsize))
    return Plan(units, layout, names)


def check_compatible(b: ShardCheckpoint, n: ShardCheckpoint) -> None:
    check_layouts(b.layout(), n.layout())
    bl, nl = b.chunk_layout(), n.chunk_layout()
    for key in n.segments_by_key:
        if bl.get(key) != nl.get(key):
            raise IncompatibleError(
                f"stored tensor {key!r} is chunked differently in base and new (different parallel layout);"
                " diff checkpoints written with the same world size and sharding"
            )


def assign_tensors(n: ShardCheckpoint, rank: int, world: int) -> list[str]:
    """This producer's canonical tensors to digest: balanced by elements, deterministic."""
    load = [0] * world
    mine = []
    for name, t in sorted(n.canonical.items(), key=lambda kv: (-numel(kv[1].shape), kv[0])):
        r = min(range(world), key=lambda i: (load[i], i))
        load[r] += numel(t.shape) + 1
        if r == rank:
            mine.append(name)
    return sorted(mine)


def chunk_unit(n: ShardCheckpoint, key: str, chunk: Chunk, op_of: Callable[[str], Op]) -> ChunkUnit | None:
    """One stored chunk's index-only pieces, banded; None when no index-only tensor reads it."""
    itemsize = lookup_dtype(n.reader.stored[key].dtype).itemsize
    bands = []
    for piece in n.index_pieces(key, chunk):
        for r0, r1 in box_bands(piece.canonical_sizes, itemsize):
            if piece.canonical_sizes:
                offsets = (piece.canonical_offsets[0] + r0, *piece.canonical_offsets[1:])
                sizes = (r1 - r0, *piece.canonical_sizes[1:])
            else:
                offsets, sizes = (), ()
            bands.append(
                Band(piece.name, piece.slices, piece.canonical_sizes, (r0, r1), offsets, sizes, op_of(piece.name))
            )
    return ChunkUnit(key, chunk, tuple(bands), itemsize) if bands else None


def plan_shards(
    b: ShardCheckpoint,
    n: ShardCheckpoint,
    *,
    overwrite: Sequence[str] = (),
    rank: int | None = None,
    world_size: int | None = None,
    my_chunk: Callable[[str, Chunk], bool] | None = None,
) -> Plan:
    """Training shards in canonical coordinates: chunk units, then tensor units, then tied checks.

    A producer of a part takes the chunks of its share of the shard files (round robin; or
    those ``my_chunk`` selects, e.g. the chunks a trainer rank holds) and its tensors.
    """
    check_compatible(b, n)
    op_of = op_selector(overwrite)
    if rank is not None and world_size is not None and world_size > 1:
        files = set(n.files()[rank::world_size])
        my_tensors = assign_tensors(n, rank, world_size)
    else:
        rank, world_size = None, None
        files, my_tensors = set(n.files()), list(n.canonical)
    selected = my_chunk or (lambda key, chunk: chunk.file in files)
    units: list[Unit] = []
    for key, chunk in n.units():
        if selected(key, chunk):
            unit = chunk_unit(n, key, chunk, op_of)
            if unit is not None:
                units.append(unit)
    for name in my_tensors:
        t = n.canonical[name]
        if t.residual is not None:
            units.append(ResidualUnit(name, op_of(name), t.residual, lookup_dtype(t.dtype).itemsize))
        else:
            units.append(DigestUnit(name))
    if rank in (None, 0):
        units.extend(TiedUnit(key, name) for key, name in n.duplicates)
    return Plan(units, n.layout(), my_tensors, rank, world_size, n.residual_reasons())
