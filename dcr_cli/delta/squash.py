"""``dcr squash``: compose a chain of deltas into one delta, from the first base to the last target.

No checkpoint is needed. Everything a squash writes is derived from what the deltas carry, and every
value it derives is checked against the input deltas' own digests before it is used.

What is knowable without a checkpoint (format_spec/delta-v1.md §6.3, §7.3):

* an ``xor`` item carries the mask and, in its repair section, the target values; so it gives both
  the base value (target XOR mask) and the target value of each affected element;
* an ``overwrite`` or ``replace`` item carries target values only. Its elements' base values are
  known individually only where an earlier delta of the chain touched them (then the base of this
  delta is that delta's target). For the others, only the digest of all of them together is known:
  the item's ``pre``.

Composition, element by element over the union of positions (in the order of the chain):

* XOR masks compose by XOR: the output mask is ``first base XOR last target``; an element that
  returns to its first base value drops out (so does a whole overwrite group, below, whose last
  values have its ``pre`` digest: all its elements are back at the first base);
* an overwrite or replace wins over anything before it: an element that any delta overwrote is
  written by an ``overwrite`` item with its last target value (a receiver that casts or quantizes a
  tensor is sent absolute values for it, as the producer chose);
* the target table, and the target version, come from the last delta; the base from the first.

``pre`` must be the digest of the first base's values at the output item's affected elements. Where
the first delta to touch an element overwrote it, its first base value is unknown; the digest of the
whole set is known only as that item's ``pre``, which a hash cannot split or merge. So each such
overwrite item ``I`` becomes one *group*: an output item whose affected elements are exactly ``I``'s,
whose ``pre`` is ``I.pre`` and whose values are the last targets there. That is exact when the first
base equals ``I``'s base on all of ``I``'s elements, i.e. when each element of ``I`` that an earlier
delta touched has a known first-base value equal to its value before ``I`` (nothing before ``I``
touched it in net effect). Later deltas may touch a group's elements freely (they only change its
values). The common cases are covered: all-xor chains (the default producer output), a tensor that
is replaced on the same region in every step (small, fully-changing tensors), an ``--overwrite``
tensor whose changed sets nest, or that changes once in the chain. Where a group is not exact — an
overwrite reaches elements whose first-base value neither the chain nor a group can state — squash
refuses with one line (exit 2) naming the tensor and the delta, rather than write a ``pre`` that is
not the base's digest; squashing from that delta on works. A caller that holds the first base (a
keyframe, ``dcr_cli.store``) passes ``base_values`` and then every value is known.

Regions. Items of different deltas need not align. A tensor whose items are all boxes, pairwise
identical or disjoint across the chain (one trainer layout), is squashed box by box and keeps those
boxes. Every other tensor is squashed in canonical flat positions: items whose flat extents overlap
form one cluster (for ``dcr diff`` deltas: one 16 MiB chunk), and the output uses flat ranges, one
per group and one per run of other changes within a chunk. Memory is bounded by one cluster's
changes over the chain (never the whole model); clusters run on a thread pool.
"""

from __future__ import annotations

import functools
import itertools
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import FormatError, IncompatibleError, IntegrityError
from ..format.codec import (
    DEFAULT_LEVEL,
    DENSE_TRIAL_RATE,
    EncodedItem,
    check_level,
    encode_positions,
    encode_values,
)
from ..format.digest import digest_bytes
from ..format.dtypes import dtype as lookup_dtype
from ..format.manifest import MAX_REGION_ELEMENTS, Item, Op, Region, TensorEntry, _any_boxes_overlap
from ..format.manifest import fingerprint as table_fingerprint
from ..io.pool import check_workers, default_workers, ordered_parallel
from .reader import Delta, DeltaLike, open_deltas
from .summary import DiffSummary, summarize
from .writer import DeltaWriter

# Output flat ranges cover at most this many bytes of a tensor (as dcr diff's chunks).
CHUNK_BYTES = 16 << 20

# base_values(tensor, canonical flat indices) -> the first base's stored values there (dt.uint)
BaseValues = Callable[[str, np.ndarray], np.ndarray]
Dense = tuple[np.ndarray, np.ndarray] | None


class UnsquashableError(IncompatibleError):
    """The chain overwrites elements whose first-base values it does not carry (see the module docstring)."""


@dataclass
class _Piece:
    """One input item of one cluster, decoded: positions in the cluster's coordinates."""

    step: int  # index of its delta in the chain
    item: Item
    positions: np.ndarray  # int64, strictly increasing: region-local (box mode) or canonical flat
    values: np.ndarray  # xor masks or target values
    target: np.ndarray  # target values (repair section for xor, data values otherwise)


@dataclass
class _Group:
    members: np.ndarray  # indices into the cluster's union of positions
    pre: str
    op: Op
    region: Region


def open_chain(deltas: DeltaLike | Sequence[DeltaLike]) -> list[Delta]:
    """Open the deltas in the order given; a local directory of deltas stands for its children in chain order."""
    return open_deltas(deltas, order_directory=_link)


def _link(deltas: list[Delta], where: str) -> list[Delta]:
    """Order the deltas of one directory by base -> target (their names need not sort that way)."""
    by_base = {d.manifest.base.fingerprint: d for d in deltas}
    targets = {d.manifest.target.fingerprint for d in deltas}
    starts = [d for d in deltas if d.manifest.base.fingerprint not in targets]
    if len(by_base) != len(deltas) or len(starts) != 1:
        raise IncompatibleError(f"the deltas in {where} do not form one chain; pass them one by one, in order")
    chain = [starts[0]]
    while len(chain) < len(deltas):
        nxt = by_base.get(chain[-1].manifest.target.fingerprint)
        if nxt is None:
            raise IncompatibleError(f"the deltas in {where} do not form one chain (a gap after {chain[-1].url})")
        chain.append(nxt)
    return chain


def check_chain(chain: list[Delta]) -> None:
    """Refuse a chain with a gap or out of order, a tampered tensor table, or a change of layout."""
    seen: set[str] = set()
    for d in chain:
        if d.id in seen:
            raise IncompatibleError(f"{d.url} appears twice in the chain; pass each delta once, in chain order")
        seen.add(d.id)
    for d in chain:
        if table_fingerprint(d.manifest.tensors) != d.manifest.target.fingerprint:
            raise IntegrityError(f"{d.url}: manifest tensor table does not match its target fingerprint (tampered?)")
    for k, (a, b) in enumerate(itertools.pairwise(chain)):
        if b.manifest.base.fingerprint == a.manifest.target.fingerprint:
            continue
        ma, mb = a.manifest, b.manifest
        later = [d for d in chain[k + 2 :] if d.manifest.base.fingerprint == ma.target.fingerprint]
        earlier = [d for d in chain[: k + 1] if d.manifest.base.fingerprint == mb.target.fingerprint]
        if later or earlier:
            raise IncompatibleError(
                f"deltas out of order: {b.url} starts at {mb.base.version}, not at {ma.target.version} where "
                f"{a.url} ends; pass the deltas in chain order (base -> target)"
            )
        raise IncompatibleError(
            f"gap in the chain: {b.url} starts at {mb.base.version} ({mb.base.fingerprint[:16]}…), but {a.url} "
            f"ends at {ma.target.version} ({ma.target.fingerprint[:16]}…); pass the deltas in between"
        )
    last = chain[-1].manifest.tensors
    for d in chain[:-1]:
        layout = {n: (t.dtype, t.shape) for n, t in d.manifest.tensors.items()}
        if layout != {n: (t.dtype, t.shape) for n, t in last.items()}:
            raise IncompatibleError(f"{d.url} and {chain[-1].url} differ in tensor layout; a v1 chain keeps it")


def squash(
    deltas: DeltaLike | Sequence[DeltaLike],
    out: str | os.PathLike[str],
    *,
    workers: int | None = None,
    level: int | None = DEFAULT_LEVEL,
    base_values: BaseValues | None = None,
    on_block: Callable[[str, bytes], None] | None = None,
) -> DiffSummary:
    """Write at ``out`` one delta equivalent to applying ``deltas`` in order.

    ``deltas`` are paths/URLs of deltas (or :class:`Delta` objects) in chain order, or a local
    directory of deltas. ``base_values(tensor, flat_indices)``, if given, returns the first base's
    stored values (unsigned integers of the dtype's width); it is consulted only where the chain does
    not carry them (overwrite items), and checked against the deltas' digests.
    """
    check_workers(workers)
    check_level(level)
    chain = open_chain(deltas)
    check_chain(chain)
    for d in chain:  # xor items' target values live in repair blocks, which dcr pull skips by default
        for block in d.manifest.blocks:
            if block.role == "repair" and not d.has_block(block):
                raise FormatError(
                    f"{d.url}: repair block {block.id[:16]}… is missing; squash needs the target values it "
                    "holds: pull with --repair, or squash the producer's deltas"
                )
    first, last = chain[0].manifest, chain[-1].manifest
    tensors = last.tensors
    per_delta = [_items_by_tensor(d) for d in chain]
    workers = workers or default_workers()

    def tasks() -> Iterator[Callable[[], list[EncodedItem]]]:
        for name in sorted(tensors):
            pieces = [(k, it) for k, items in enumerate(per_delta) for it in items.get(name, ())]
            if not pieces:
                continue
            for cluster, box_region in _clusters(name, tensors[name], pieces):
                yield _task(chain, name, tensors[name], cluster, box_region, level, base_values, first.base.version)

    writer = DeltaWriter(out, on_block=on_block)
    try:
        for items in ordered_parallel(tasks(), workers):
            for encoded in items:
                writer.add(encoded)
        manifest = writer.finish(first.base, last.target, dict(tensors))
    except BaseException:
        writer.abort()
        raise
    return summarize(Path(out), manifest)


def _items_by_tensor(delta: Delta) -> dict[str, list[Item]]:
    groups: dict[str, list[Item]] = {}
    for item in delta.manifest.items:
        if item.count:
            groups.setdefault(item.tensor, []).append(item)
    return groups


def _flat_extent(region: Region, shape: tuple[int, ...]) -> tuple[int, int]:
    if not region.is_box:
        assert region.start is not None and region.stop is not None
        return region.start, region.stop
    assert region.offsets is not None and region.sizes is not None
    if region.size == 0:
        return 0, 0
    if not shape:
        return 0, 1
    lo = int(np.ravel_multi_index(region.offsets, shape))
    hi = int(np.ravel_multi_index(tuple(o + s - 1 for o, s in zip(region.offsets, region.sizes, strict=True)), shape))
    return lo, hi + 1


def _clusters(
    name: str, entry: TensorEntry, pieces: list[tuple[int, Item]]
) -> Iterator[tuple[list[tuple[int, Item]], Region | None]]:
    """Split one tensor's items of the whole chain into independent clusters.

    Yields (pieces, box) where box is the common region of a box cluster (positions stay region-local),
    or None for a flat cluster (positions become canonical flat indices).
    """
    regions = {it.region for _, it in pieces}
    if all(r.is_box for r in regions) and not _any_boxes_overlap(list(regions)):
        by_region: dict[Region, list[tuple[int, Item]]] = {}
        for k, it in pieces:
            by_region.setdefault(it.region, []).append((k, it))
        for region in sorted(by_region, key=lambda r: (r.offsets, r.sizes)):
            yield by_region[region], region
        return
    spans = sorted(((*_flat_extent(it.region, entry.shape), k, it) for k, it in pieces), key=lambda s: s[:3])
    cluster: list[tuple[int, Item]] = []
    end = -1
    for lo, hi, k, it in spans:
        if cluster and lo >= end:
            yield cluster, None
            cluster = []
        cluster.append((k, it))
        end = max(end, hi)
    if cluster:
        yield cluster, None


def _task(
    chain: list[Delta],
    name: str,
    entry: TensorEntry,
    cluster: list[tuple[int, Item]],
    box: Region | None,
    level: int | None,
    base_values: BaseValues | None,
    base_version: str,
) -> Callable[[], list[EncodedItem]]:
    def run() -> list[EncodedItem]:
        pieces = [_decode(chain[k], k, it, entry.shape, box is not None) for k, it in cluster]
        pieces.sort(key=lambda p: p.step)
        return _compose(chain, name, entry, pieces, box, level, base_values, base_version)

    return run


def _decode(delta: Delta, step: int, item: Item, shape: tuple[int, ...], local: bool) -> _Piece:
    decoded = delta.decode(item)
    positions = np.arange(item.region.size, dtype=np.int64) if decoded.positions is None else decoded.positions
    if not local:
        positions = item.region.to_canonical(positions, shape)
    target = delta.repair_values(item) if item.op == "xor" else decoded.values
    return _Piece(step, item, positions.astype(np.int64, copy=False), decoded.values, target)


def _compose(
    chain: list[Delta],
    name: str,
    entry: TensorEntry,
    pieces: list[_Piece],
    box: Region | None,
    level: int | None,
    base_values: BaseValues | None,
    base_version: str,
) -> list[EncodedItem]:
    dt = lookup_dtype(entry.dtype)
    union = np.unique(np.concatenate([p.positions for p in pieces]))
    n = len(union)
    base0 = np.zeros(n, dtype=dt.uint)  # the first base's value, where known
    known = np.zeros(n, dtype=bool)
    last = np.zeros(n, dtype=dt.uint)  # the value after the last delta that touched it
    touched = np.zeros(n, dtype=bool)
    overwritten = np.zeros(n, dtype=bool)
    group_of = np.full(n, -1, dtype=np.int64)
    groups: list[_Group] = []

    for p in pieces:
        it, where = p.item, f"{chain[p.step].url}: {name} {p.item.region.to_json()}"
        idx = np.searchsorted(union, p.positions)
        before = touched[idx]
        if digest_bytes(p.target) != it.post:
            raise IntegrityError(f"{where}: target values do not match the item's post digest (corrupt delta?)")
        if it.op == "xor":
            base_k = p.target ^ p.values
            if digest_bytes(base_k) != it.pre:
                raise IntegrityError(f"{where}: base values do not match the item's pre digest (corrupt delta?)")
            if not np.array_equal(last[idx[before]], base_k[before]):
                raise IntegrityError(f"{where}: its base values differ from the previous delta's targets")
            fresh = idx[~before]
            base0[fresh], known[fresh] = base_k[~before], True
        elif before.all():
            if digest_bytes(last[idx]) != it.pre:
                raise IntegrityError(f"{where}: its base differs from the previous delta's targets")
        elif base_values is not None:
            fresh = idx[~before]
            flat = p.positions[~before] if box is None else box.to_canonical(p.positions[~before], entry.shape)
            base0[fresh], known[fresh] = np.asarray(base_values(name, flat), dtype=dt.uint), True
            base_k = last[idx].copy()
            base_k[~before] = base0[fresh]
            if digest_bytes(base_k) != it.pre:
                raise IncompatibleError(f"{where}: the base checkpoint does not hold version {base_version} here")
        else:
            prior = idx[before]
            if not (known[prior].all() and np.array_equal(base0[prior], last[prior])):
                raise UnsquashableError(
                    f"cannot squash {name}: {chain[p.step].url} overwrites elements whose values at "
                    f"{base_version} the chain does not carry; squash from that delta on, or pass the base checkpoint"
                )
            group_of[idx] = len(groups)
            groups.append(_Group(idx, it.pre, it.op, it.region))
        last[idx] = p.target
        touched[idx] = True
        if it.op != "xor":
            overwritten[idx] = True

    # A group whose last values have its pre digest is back at the first base on all its elements (the
    # digest proves it, as it proves every value squash derives): a net identity, dropped whole. Which of a
    # group's elements alone returned is not known (its pre states their base values only together).
    back = [digest_bytes(last[g.members]) == g.pre for g in groups]
    dropped = np.zeros(n, dtype=bool)
    for g, identity in zip(groups, back, strict=True):
        if identity:
            dropped[g.members] = True
            group_of[g.members] = -1
    groups = [g for g, identity in zip(groups, back, strict=True) if not identity]
    base0[dropped] = last[dropped]  # their first-base values are known now (a dense trial below reads them)
    free = (group_of < 0) & (base0 != last)
    out: list[EncodedItem] = []

    def dense(lo: int, size: int, to_flat: Callable[[np.ndarray], np.ndarray]) -> Dense:
        """(base, target) of every element of the region [lo, lo + size) of these coordinates, if known."""
        a, b = np.searchsorted(union, [lo, lo + size])
        local = union[a:b] - lo
        if b - a < size and base_values is None:
            return None
        base_full = np.empty(size, dtype=dt.uint)
        if b - a < size:
            untouched = np.ones(size, dtype=bool)
            untouched[local] = False
            rest = np.flatnonzero(untouched)
            base_full[rest] = np.asarray(base_values(name, to_flat(rest + lo)), dtype=dt.uint)  # type: ignore[misc]
        target_full = base_full.copy()
        base_full[local], target_full[local] = base0[a:b], last[a:b]
        return base_full, target_full

    if box is not None:
        if groups and (len(groups) > 1 or free.any()):
            raise UnsquashableError(
                f"cannot squash {name} {box.to_json()}: overwrites and other changes of the chain share a box "
                f"whose values at {base_version} the chain does not carry; squash a shorter chain"
            )
        if groups:
            g = groups[0]
            out.append(_group_item(name, box, union[g.members], g, last[g.members], level))
        elif free.any():
            sel = np.flatnonzero(free)
            full = functools.partial(dense, 0, box.size, functools.partial(box.to_canonical, shape=entry.shape))
            out.append(
                _free_item(name, box, union[sel], base0[sel], last[sel], bool(overwritten[sel].any()), level, full)
            )
        return out

    # Flat: one range per group, then runs of free changes between groups, within output chunks.
    intervals = sorted(
        ((int(union[g.members[0]]), int(union[g.members[-1]]) + 1, g) for g in groups), key=lambda t: t[:2]
    )
    for (_, hi_a, _), (lo_b, _, _) in itertools.pairwise(intervals):
        if lo_b < hi_a:
            raise UnsquashableError(
                f"cannot squash {name}: two overwrites of the chain interleave, and their elements' values at "
                f"{base_version} are not carried; squash a shorter chain"
            )
    for lo, hi, g in intervals:
        a, b = np.searchsorted(union, [lo, hi])
        if free[a:b].any():
            raise UnsquashableError(
                f"cannot squash {name}: other changes fall between the elements of an overwrite whose values at "
                f"{base_version} the chain does not carry; squash a shorter chain"
            )
        if hi - lo > MAX_REGION_ELEMENTS:
            raise UnsquashableError(f"cannot squash {name}: an overwrite spans more than 2^31 elements")
        out.append(_group_item(name, Region.range(lo, hi), union[g.members] - lo, g, last[g.members], level))
    sel = np.flatnonzero(free)
    if len(sel):
        pos = union[sel]
        chunk = max(1, CHUNK_BYTES // dt.itemsize)
        key = (pos // chunk) * (len(intervals) + 1) + np.searchsorted([lo for lo, _, _ in intervals], pos)
        cuts = np.flatnonzero(np.diff(key)) + 1
        for run in np.split(np.arange(len(sel)), cuts):
            s = sel[run]
            lo, hi = int(union[s[0]]), int(union[s[-1]]) + 1
            region = Region.range(lo, hi)
            full = functools.partial(dense, lo, hi - lo, _same)
            ow = bool(overwritten[s].any())
            out.append(_free_item(name, region, union[s] - lo, base0[s], last[s], ow, level, full))
    out.sort(key=lambda e: e.region.start or 0)
    return out


def _same(positions: np.ndarray) -> np.ndarray:
    return positions


def _group_item(
    name: str, region: Region, positions: np.ndarray, g: _Group, target: np.ndarray, level: int | None
) -> EncodedItem:
    post = digest_bytes(target)
    if g.op == "replace" and len(positions) == region.size:
        data = encode_values(target, level)
        return EncodedItem(name, region, "replace", len(positions), data, 0, g.pre, post)
    frame = encode_positions(positions, level)
    data = frame + encode_values(target, level)
    return EncodedItem(name, region, "overwrite", len(positions), data, len(frame), g.pre, post)


def _free_item(
    name: str,
    region: Region,
    positions: np.ndarray,
    base: np.ndarray,
    target: np.ndarray,
    overwrite: bool,
    level: int | None,
    full: Callable[[], Dense],
) -> EncodedItem:
    """The sparse item, or a dense replace where that is smaller and the whole region's values are known."""
    frame = encode_positions(positions, level)
    pre, post = digest_bytes(base), digest_bytes(target)
    count = len(positions)
    if overwrite:
        data = frame + encode_values(target, level)
        sparse = EncodedItem(name, region, "overwrite", count, data, len(frame), pre, post)
    else:
        data = frame + encode_values(base ^ target, level)
        repair = encode_values(target, level)
        sparse = EncodedItem(name, region, "xor", count, data, len(frame), pre, post, repair=repair)
    if count < DENSE_TRIAL_RATE * region.size:
        return sparse
    known = full()
    if known is None:
        return sparse
    base_full, target_full = known
    frame = encode_values(target_full, level)
    if len(frame) >= len(sparse.data):
        return sparse
    pre, post = digest_bytes(base_full), digest_bytes(target_full)
    return EncodedItem(name, region, "replace", region.size, frame, 0, pre, post, changed=count)


__all__ = ["UnsquashableError", "check_chain", "open_chain", "squash"]
