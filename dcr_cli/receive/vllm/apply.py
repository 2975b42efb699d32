"""Engine side: apply a delta to the weights resident in one vLLM worker, in place, exactly.

Runs inside each vLLM worker process (one per tensor-parallel rank); normative description in
format_spec/receiver-vllm.md. For every item of the delta:

1. map its canonical positions to resident storage elements through the placement traced from
   vLLM's own loader (``placement.py``), on every destination this rank holds;
2. gather the current bits there (integer views) and, when there are several ranks, exchange
   the pieces so every rank sees the item's whole pre-state and the same classification;
3. classify by digest: ``post`` -> done; ``pre`` -> pending, new = base XOR mask (or the values);
   anything else, or replicas that disagree -> torn, new = the absolute repair values;
   where the loader widens the dtype (a BF16 checkpoint in an FP32 engine), XOR is never used:
   new = the absolute repair values, written as the loader writes them (the same cast);
4. check digest(new) == ``post``, then write new bits only where a destination differs from them.

An interrupted apply therefore resumes from any instant: finished items are skipped, torn ones
are overwritten with absolute values, nothing is XORed twice, and replicated destinations (tied
weights, TP replicas) all end with the same bits.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

import blake3
import numpy as np
import torch

from ... import errors
from ...delta.reader import Delta
from ...errors import DcrError, FormatError, IncompatibleError, IntegrityError
from ...format.codec import decode_joined
from ...format.digest import StreamingDigest, digest_bytes
from ...format.dtypes import from_torch, numpy_int
from ...format.kernels import _apply_batch, compile_scatter, gather, scatter, scatter_checked
from ...format.manifest import Item, Manifest, TensorEntry, fingerprint
from ...io.gc_pause import fewer_collections
from ...io.pool import default_workers, ordered_parallel
from .. import plan as receiver_plan
from .layout import check_resident_layout, mla_derived_params
from .overlap import Box, box_span, strided_box_self_overlaps, strided_boxes_overlap
from .placement import (
    TORCH_DTYPES,
    Destination,
    Placement,
    check_layout_kept,
    flat_storage,
    int_dtype,
    named_resident,
    trace_placement,
    trace_placements,
)

# All-gather of a picklable object across the engine's ranks (identity on one rank).
Exchange = Callable[[Any], list[Any]]
# One write-and-prove task's result: (kind, written) per item, digests, seconds writing and digesting.
_WriteResult = tuple[list[tuple[str, int]], dict[str, str], float, float]

T = TypeVar("T")


def single_rank(obj: Any) -> list[Any]:
    return [obj]


@dataclass(frozen=True)
class RankFailure:
    """What a failing rank sends in place of its next exchange, so that every rank fails with it.

    Ranks exchange in lockstep (the same items, in the same order). A rank that fails sends this
    once, from ``EngineReceiver.agree``, and stops; every other rank receives it in whatever
    exchange it is in (an item's pieces, a tensor's read-back, the agreement at the end of a
    phase) and stops too. So each rank makes the same number of collective calls and none is left
    waiting in one, whichever rank fails where.
    """

    rank: int
    message: str
    kind: str  # a DcrError subclass name

    def error(self) -> DcrError:
        cls = getattr(errors, self.kind, None)
        if not (isinstance(cls, type) and issubclass(cls, DcrError)):
            cls = DcrError
        return cls(self.message)


class PeerFailed(DcrError):
    """Another rank failed (it sent a :class:`RankFailure`); this rank stops without exchanging again."""

    def __init__(self, failure: RankFailure) -> None:
        super().__init__(failure.message)
        self.failure = failure


def _failure_of(exc: BaseException, rank: int) -> RankFailure:
    if isinstance(exc, DcrError):
        text = str(exc).strip().splitlines()
        return RankFailure(rank, text[0] if text else type(exc).__name__, type(exc).__name__)
    return RankFailure(rank, f"rank {rank}: {type(exc).__name__}: {' '.join(str(exc).split())[:500]}", "DcrError")


@dataclass
class EngineState:
    """What this engine holds, as far as dcr knows. Unknown (None) until the first check."""

    version: str | None = None
    fingerprint: str | None = None
    # While an apply is unfinished: {"delta_id", "base": {version, fingerprint}, "target": {...}}.
    applying: dict[str, Any] | None = None
    table: dict[str, TensorEntry] = field(default_factory=dict)  # tensor table of ``fingerprint`` (when known)

    def held_table(self) -> dict[str, TensorEntry] | None:
        """The table of the version held, where dcr knows it (proven by a read-back or an apply)."""
        return self.table if self.table and fingerprint(self.table) == self.fingerprint else None

    def to_json(self) -> dict:
        # Not asdict(): that would deep-copy the whole tensor table only to drop it.
        applying = {k: (dict(v) if isinstance(v, dict) else v) for k, v in (self.applying or {}).items()} or None
        return {"version": self.version, "fingerprint": self.fingerprint, "applying": applying}


@dataclass
class ApplyReport:
    status: str  # "applied" | "resumed" | "noop"
    version: str
    fingerprint: str
    items: int = 0
    done: int = 0
    applied: int = 0
    repaired: int = 0
    written_elements: int = 0
    seconds: float = 0.0
    staged: int = 0  # items whose first pass ran before the pause (``prepare``)
    # Touched tensors whose target digest the first pass proved from the bits held and the new bits
    # (before any write); after the writes only their written elements are read back.
    predicted: int = 0
    proof_seconds: float = 0.0  # digesting, after the writes, the touched tensors not predicted
    # Seconds per phase inside the engine: check, first_pass (before any write; done before the
    # pause where the client staged the delta), writes, proof.
    phases: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict:
        return asdict(self)


# Memory the first pass may spend on keeping items, ready to write, for the write pass (per worker).
# An item that does not fit is decoded, read and classified again inside the update, in the pause:
# so the budget holds a whole step of a few-GiB model (a staged element costs 6 bytes: a 32-bit
# storage index and its new bits; 48 M changed elements, 3% of a 3 GiB BF16 model, take 288 MiB).
PREPARED_BYTES = 1 << 30


@dataclass
class Prepared:
    """An item decoded and located on this rank, with its elements as the first pass read them.

    On a fresh apply the first pass also computes the item's new bits (checked against ``post``)
    and, where this rank holds the item's only copy, keeps just the elements that change, with
    their storage indices: the write pass then only writes.
    """

    values: np.ndarray | None  # the decoded data values (XOR masks or absolute values); None once ``new`` is known
    located: list[Located]
    count: int
    current: np.ndarray | None = None  # the item's elements (all ranks) when first read
    digest: str | None = None  # their digest (None: replicas disagree)
    new: np.ndarray | None = None  # the bits to write, checked against ``post`` (a fresh apply's pending item)
    # The canonical flat index of each of the item's positions, while it may be needed to put ``new`` in
    # place in the whole tensor (``_predict`` of a tensor not held as plain runs); None once ``ready``.
    canonical: np.ndarray | None = None
    # ``new`` and the one destination's indices are all the write needs, and only the elements that change
    # are left in them (one copy, no cast, on the CPU).
    ready: bool = False
    # Its arrays are slices of buffers its joined group's items share (``_joined_checked``): each item
    # counts its own slices, so the group's items count the buffers once between them.
    shares: bool = False

    @property
    def nbytes(self) -> int:
        """The memory its arrays hold, each buffer once: a destination's index is often a view of
        ``canonical`` (a tensor alone in its parameter), and counting both twice filled the first
        pass's budget with bytes that do not exist."""
        if self.shares:  # (asked of every item, twice: 20k in an MoE prepare; no generator, no tuple)
            n = 0 if self.new is None else self.new.nbytes
            for at in self.located:
                n += at.index.nbytes
            return n
        held = [a for a in (self.values, self.current, self.new, self.canonical) if a is not None]
        held += [a for at in self.located for a in (at.hit, at.index) if isinstance(a, np.ndarray)]
        buffers: dict[int, int] = {}
        for a in held:
            while isinstance(a.base, np.ndarray):  # a view holds its base alive: count the base, once
                a = a.base
            buffers[id(a)] = a.nbytes
        return sum(buffers.values())


@dataclass
class Staged:
    """A delta's first pass, run by the client's ``prepare`` before it pauses the engine.

    Valid only for the same delta, from the same recorded state, in the same mode; the update
    that follows then writes at once. Anything else (another delta, a write in between) drops it.
    """

    delta_id: str
    key: tuple[str | None, str | None]  # (fingerprint, applying delta) when staged
    resuming: bool
    prepared: dict[int, Prepared]  # item index -> first pass result (within PREPARED_BYTES)
    seconds: float
    phases: dict[str, float] = field(default_factory=dict)  # of the prepare: check, fingerprint, predict
    predicted: frozenset[str] = frozenset()  # tensors whose target digest the first pass proved
    placements: dict[str, Placement] = field(default_factory=dict)  # those the kept items were located by
    batches: list[WriteBatch] = field(default_factory=list)  # the small ready items' writes, per parameter


@dataclass
class WriteBatch:
    """Small ready items of predicted tensors that write one parameter, joined for one compiled scatter.

    Built by ``prepare`` (``_write_batches``): the pause then writes an MoE layer's hundreds of expert
    items with one call, not one each. The items keep no arrays of their own (no second copy): where
    the update cannot use the batch (a tensor of it aliased since prepare: no longer proven before
    the pause), they go through its first pass again, before its first write.
    """

    flat: torch.Tensor  # the parameter's whole storage as integers
    index: np.ndarray
    values: np.ndarray
    keys: frozenset[int]  # the items (manifest indices)
    tensors: frozenset[str]  # the tensors they belong to
    whole: frozenset[str]  # ... those of them whose items are all in this batch


@dataclass
class Located:
    """One destination's share of an item: which positions it holds and at which storage elements."""

    dest: Destination
    hit: np.ndarray | slice  # the item positions it holds: a bool per position, or a slice of them
    index: np.ndarray  # storage element indices of the hit positions (int64; int32 once ready, where they fit)
    flat: torch.Tensor  # the parameter's whole storage as integers

    def positions(self, count: int) -> np.ndarray | None:
        """Indices of the item positions held (None: every position)."""
        if self.index.size == count:
            return None
        if isinstance(self.hit, slice):
            return np.arange(self.hit.start, self.hit.stop)
        return np.flatnonzero(self.hit)

    def read(self) -> torch.Tensor:
        """Current bits at ``index`` (on the CPU; a compiled gather there, which is cheaper for scattered reads)."""
        if self.flat.device.type == "cpu":
            return torch.from_numpy(gather(self.flat.numpy(), self.index))
        return self.flat[torch.from_numpy(self.index).to(self.flat.device)].cpu()

    def write_where_different(self, want: torch.Tensor) -> int:
        """Write ``want`` (CPU, the storage's integer dtype) at ``index`` where the bits differ; count them."""
        if self.flat.device.type == "cpu":
            flat, values = self.flat.numpy(), want.numpy()
            differs = flat[self.index] != values
            count = int(differs.sum())
            if count:
                _write_elements(flat, self.index[differs], values[differs])
            return count
        index = torch.from_numpy(self.index).to(self.flat.device)
        on_device = want.to(self.flat.device)
        changed = self.flat[index] != on_device
        count = int(changed.sum())
        if count:
            _write_elements(self.flat, index[changed], on_device[changed])
        return count


def _write_elements(flat: np.ndarray | torch.Tensor, index: np.ndarray | torch.Tensor, values) -> None:  # type: ignore[no-untyped-def]
    """The only place dcr writes resident weights (tests inject failures here).

    Every element is read back as it is written (on the CPU, each run while its lines are in
    cache), a cheap check that the writes landed: two values for one element in one write, or a
    storage that does not hold what is stored in it, fail the apply here. It is not what proves a
    tensor: its digest before the writes does (``_predict``), or after them.
    """
    if isinstance(flat, np.ndarray) and isinstance(index, np.ndarray) and isinstance(values, np.ndarray):
        bad = scatter_checked(flat, index, values)  # one compiled pass (numpy's fancy assignment takes ~1.4x)
    else:
        flat[index] = values
        bad = int((flat[index] != values).sum())
    if bad:
        raise IntegrityError(
            f"{bad} of the {len(index)} elements written do not read back as written: the engine's weight "
            "storage does not hold what is stored in it; the version was not recorded; reload the engine"
        )


class EngineReceiver:
    """dcr's view of one worker's model: placements, the recorded version, apply and read-back."""

    def __init__(self, model: torch.nn.Module, exchange: Exchange = single_rank, rank: int = 0) -> None:
        self.model = model
        self._exchange = exchange
        self.rank = rank
        self.single = exchange is single_rank  # one rank: canonical tensors can be read where they live
        self.state = EngineState()
        self._placements: dict[str, Placement] = {}
        self._resident: dict[str, torch.Tensor] | None = None
        self._storage_ptrs: dict[str, int | None] = {}
        # Placements found still valid in this operation (_cached), each with the shape and dtype it was
        # checked for: the pause asks for each tensor's several times, and an MoE model has tens of thousands.
        self._valid: dict[str, tuple[Placement, tuple[int, ...], str]] = {}
        # The table every placement of which is valid in this operation (trace_all found the storage of
        # every resident parameter where it was when they were last checked), and that table with the
        # storages then: the pause checks the parameters (hundreds), not the tensors (MoE: tens of thousands).
        self._all_valid: dict[str, TensorEntry] | None = None
        # Each parameter's whole storage as integers (flat_storage), once per operation: a view costs
        # tens of microseconds to make, and an MoE apply asks for one per item and per tensor.
        self._flats: dict[str, torch.Tensor] = {}
        self._flat_uints: dict[str, np.ndarray | None] = {}
        self._traced: tuple[dict[str, TensorEntry], dict[str, int | None]] | None = None
        # _aliased's last answer, with the table and the placement epoch it was computed for (a function of
        # the table's tensors' placements alone: the same tensors at the same epoch, the same answer).
        self._aliased_memo: tuple[dict[str, TensorEntry], int, set[str]] | None = None
        # Items decoded and located by the check pass, for the write pass (bounded by PREPARED_BYTES).
        self._prepared: dict[int, Prepared] = {}
        self._prepared_bytes = 0
        self._batch_bytes = 0  # what the staged write batches hold, in the update (part of PREPARED_BYTES)
        self._staged: Staged | None = None
        self._skip_blocks = False
        # In prepare, a remote delta's blocks download while the first pass reads them (each section is
        # checked by its own digest; the whole blocks before prepare returns, so before the pause).
        self._overlap_fetch = False
        self._fingerprint_seconds = 0.0
        self._predicted: set[str] = set()  # this first pass's tensors whose target digest is proven (_predict)
        self._aliased_names: set[str] = set()  # tensors sharing storage with another, found by _predict
        self._predict_seconds = 0.0
        self._held: tuple[str, dict[str, TensorEntry]] | None = None  # (fingerprint, table) last reached
        # The manifest and base table check_untouched last passed (identical objects: the same answer).
        self._untouched_checked: tuple[Manifest, dict[str, TensorEntry]] | None = None
        # The items of the last manifest by tensor (_grouped), and that manifest: prepare, the pause's
        # passes and the proof each walk them, and an MoE manifest has tens of thousands.
        self._grouped_memo: tuple[Manifest, list[tuple[str, list[tuple[int, Item]]]]] | None = None
        # The last manifest whose tensor table matched its fingerprint (check_table), kept so that the
        # pause does not hash the table again for the delta that prepare checked.
        self._table_checked: Manifest | None = None
        # Bumped whenever ``_placements`` changes (a placement traced or replaced): what is computed from
        # placements keys on it.
        self._placement_epoch = 0
        # The tensors of a table grouped by the parameters they write (_storage_groups), largest group
        # first, and each tensor's group, with the table and the placement epoch they were computed for.
        self._groups_memo: tuple[dict[str, TensorEntry], int, list[list[str]], dict[str, int]] | None = None

    def _grouped(self, delta: Delta) -> list[tuple[str, list[tuple[int, Item]]]]:
        memo = self._grouped_memo
        if memo is None or memo[0] is not delta.manifest:
            memo = self._grouped_memo = (delta.manifest, _grouped(delta))
        return memo[1]

    def exchange(self, obj: Any) -> list[Any]:
        """All-gather ``obj``; raises PeerFailed where another rank sent its failure instead."""
        got = self._exchange(obj)
        failed = [g for g in got if isinstance(g, RankFailure)]
        if failed and not isinstance(obj, RankFailure):
            raise PeerFailed(failed[0])
        return got

    def resident(self) -> dict[str, torch.Tensor]:
        """Parameters and buffers by name; collected once per operation (walking modules is slow)."""
        if self._resident is None:
            self._resident = named_resident(self.model)
        return self._resident

    def _storage_ptr(self, param: str) -> int | None:
        """The address of resident ``param``'s storage (None: no such parameter), once per operation."""
        ptr = self._storage_ptrs.get(param, -1)
        if ptr == -1:
            tensor = self.resident().get(param)
            ptr = self._storage_ptrs[param] = None if tensor is None else tensor.untyped_storage().data_ptr()
        return ptr

    def _flat(self, param: str) -> torch.Tensor:
        flat = self._flats.get(param)
        if flat is None:  # (two threads may both make it: the same view)
            flat = self._flats[param] = flat_storage(self.resident()[param])
        return flat

    def _flat_uint(self, param: str) -> np.ndarray | None:
        """``_flat`` as unsigned integers in CPU memory, once per operation (None: on a device)."""
        got = self._flat_uints.get(param, False)
        if got is False:
            flat = self._flat(param)
            got = self._flat_uints[param] = _as_uint(flat) if flat.device.type == "cpu" else None
        return got  # type: ignore[return-value]

    def _begin(self) -> None:
        self._resident = None  # parameters may have been replaced since the last operation
        self._storage_ptrs = {}
        self._valid = {}
        self._all_valid = None
        self._flats = {}
        self._flat_uints = {}

    # ------------------------------------------------------------------ placement

    def _cached(self, name: str, entry: TensorEntry) -> Placement | None:
        cached = self._placements.get(name)
        if self._all_valid is not None and self._all_valid.get(name) is entry:
            return cached
        valid = self._valid.get(name)
        if valid is not None and valid[0] is cached and valid[1] == entry.shape and valid[2] == entry.dtype:
            return cached
        if (
            cached is not None
            and cached.shape == entry.shape
            and cached.dtype == TORCH_DTYPES[entry.dtype]
            and all(self._storage_ptr(p) == ptr for p, ptr in cached.storages.items())
        ):
            self._valid[name] = (cached, entry.shape, entry.dtype)
            return cached
        return None

    def placement(self, name: str, entry: TensorEntry) -> Placement:
        cached = self._cached(name, entry)
        if cached is not None:
            return cached
        placement = trace_placement(self.model, name, entry.shape, TORCH_DTYPES[entry.dtype])
        self._put_placements({name: placement})
        self._traced = None  # (a placement replaced: trace_all checks each one again)
        return placement

    def _put_placements(self, placements: dict[str, Placement]) -> None:
        """The one way ``_placements`` changes: with the epoch that what is computed from them keys on
        (``_write_groups``, ``_aliased``: the same epoch and tensors, the same placements)."""
        self._placements.update(placements)
        self._placement_epoch += 1

    def trace_all(self, table: dict[str, TensorEntry]) -> None:
        """Placements of every tensor of ``table`` not known yet: batches of them per loader call.

        Where every resident parameter's storage is where it was when this very table's placements
        were last checked (a steady refit's pause, after its prepare), they all still hold, as each
        one's own check (``_cached``: its parameters' storages) would find, without asking per tensor.
        """
        storages = {param: self._storage_ptr(param) for param in self.resident()}
        traced = self._traced
        if traced is not None and traced[1] == storages:
            if traced[0] is table:
                self._all_valid = table
                return
            # Every storage is where it was when the last table's placements were all checked, and none
            # was traced since (that clears ``_traced``): a tensor of that table with the same shape and
            # dtype keeps its placement, as its own check would find (a steady refit's next delta: the
            # same tensors, another table). The others are checked one by one.
            last, placements = traced[0], self._placements
            missing = {}
            for n, e in table.items():
                was = last.get(n)
                kept = was is not None and was.shape == e.shape and was.dtype == e.dtype and n in placements
                if not kept and self._cached(n, e) is None:
                    missing[n] = (e.shape, TORCH_DTYPES[e.dtype])
        else:
            missing = {n: (e.shape, TORCH_DTYPES[e.dtype]) for n, e in table.items() if self._cached(n, e) is None}
        if missing:
            self._put_placements(trace_placements(self.model, missing))
        self._traced = (table, storages)  # (tracing runs the loader on placeholders: no storage moves)
        self._all_valid = table

    def locate(self, placement: Placement, canonical: np.ndarray) -> list[Located]:
        """Where this rank holds ``canonical`` positions: per destination, the positions hit and storage indices."""
        located = []
        for dest in placement.destinations:
            hit: np.ndarray | slice
            if dest.contiguous:
                # Canonical indices of an item increase (positions do, and a box keeps C order), so a
                # contiguous copy holds one slice of them: two binary searches, one add.
                lo, hi = (int(i) for i in np.searchsorted(canonical, [dest.src_offset, dest.src_offset + dest.numel]))
                shift = dest.dst_offset - dest.src_offset
                # (a shift of 0, a tensor alone in its parameter, needs no copy: the indices are a view)
                hit, index = slice(lo, hi), (canonical[lo:hi] + shift if shift else canonical[lo:hi])
            else:
                hit, index = dest.locate(canonical)
            if index.size:
                located.append(Located(dest, hit, index, self._flat(dest.param)))
        return located

    def assemble(self, placement: Placement, count: int, located: list[Located]) -> tuple[np.ndarray, bool]:
        """The item's elements as held by the engine (all ranks), and whether replicas disagree."""
        local = [
            (at.positions(count), _as_uint(_to_canonical(at.read(), at.dest, placement.dtype)))  # None: every position
            for at in located
        ]
        pieces = [piece for rank_pieces in self.exchange(local) for piece in rank_pieces]
        if len(pieces) == 1 and pieces[0][0] is None:
            return pieces[0][1], False  # one destination holds the whole item (the common TP=1 case)
        uint = np.dtype(f"<u{placement.dtype.itemsize}")
        values = np.zeros(count, dtype=uint)
        seen = np.zeros(count, dtype=bool)
        divergent = False
        for where, got in pieces:
            if where is None:
                where = np.arange(count)
            again = seen[where]
            if again.any() and not np.array_equal(values[where[again]], got[again]):
                divergent = True
            values[where[~again]] = got[~again]
            seen[where] = True
        if not seen.all():
            raise IncompatibleError(
                f"{placement.name}: {int((~seen).sum())} elements are held by no rank of this engine; "
                "is it a parallel layout dcr does not know (pipeline parallel)?"
            )
        return values, divergent

    def write(
        self, placement: Placement, located: list[Located], new: np.ndarray, current: np.ndarray | None = None
    ) -> int:
        """Write ``new`` at every local destination, only where the bits differ.

        ``current``: the elements as this pass read them, when they are the only copy (one rank,
        one destination that holds the whole item, no cast): the differing ones are known without
        reading the storage again.
        """
        if current is not None and len(located) == 1 and self.single and located[0].flat.device.type == "cpu":
            at = located[0]
            assert not at.dest.cast(placement.dtype) and at.index.size == new.size
            differs = current != new
            if bool(differs.all()):
                return self._write_ready(placement, at, at.index, new)
            return self._write_ready(placement, at, at.index[differs], new[differs])
        written = 0
        for at in located:
            want = torch.from_numpy(np.ascontiguousarray(new[at.hit]).view(_np_int(placement.dtype)))
            if at.dest.cast(placement.dtype):  # write what the loader writes: the same cast of the value
                want = want.view(placement.dtype).to(at.dest.dst_dtype).view(at.flat.dtype)
            written += at.write_where_different(want)
        return written

    def spans(self, placement: Placement) -> list[np.ndarray] | None:
        """The canonical tensor as views of resident storage, in canonical order; None if not held so.

        On one rank, where the loader copies the tensor without a cast into contiguous runs that
        tile it exactly (every weight at TP=1, fused qkv/gate_up blocks included), the canonical
        bytes *are* those runs: they are digested where they live, without a copy.
        """
        runs = self._runs(placement)
        return None if runs is None else [run for _, run in runs]

    def _runs(self, placement: Placement) -> list[tuple[Destination, np.ndarray]] | None:
        """``spans``, each with the destination whose storage it is."""
        if not self.single:
            return None
        out: list[tuple[Destination, np.ndarray]] = []
        at = 0
        dests = placement.destinations
        for dest in dests if len(dests) == 1 else sorted(dests, key=lambda d: d.src_offset):
            if dest.cast(placement.dtype) or not dest.contiguous or dest.src_offset != at:
                return None
            flat = self._flat_uint(dest.param)
            if flat is None:
                return None
            out.append((dest, flat[dest.dst_offset : dest.dst_offset + dest.numel]))
            at += dest.numel
        return out if at == placement.numel else None

    def tensor_digest(self, name: str, entry: TensorEntry) -> str:
        """Digest of the canonical tensor as the engine holds it (all ranks)."""
        spans = self.spans(self.placement(name, entry))
        if spans is None:
            return digest_bytes(self.read_tensor(name, entry))
        if len(spans) == 1:
            return digest_bytes(spans[0])
        digest = StreamingDigest()
        for span in spans:
            digest.update(span)
        return digest.hexdigest()

    def digests(self, table: dict[str, TensorEntry], names: list[str] | None = None) -> dict[str, str]:
        """Digests of tensors of ``table`` as held (default: all), largest first on all cores when on one rank.

        Placements are resolved first (tracing runs the loader: one thread); BLAKE3 releases the GIL.
        """
        chosen = sorted(table) if names is None else names
        self.trace_all({n: table[n] for n in chosen})
        sizes = {n: self.placement(n, table[n]).numel * TORCH_DTYPES[table[n].dtype].itemsize for n in chosen}
        if not self.single:  # the read-back exchanges pieces: every rank in the same order, one at a time
            return {n: self.tensor_digest(n, table[n]) for n in chosen}

        def task(name: str) -> Callable[[], tuple[str, str]]:
            return lambda: (name, self.tensor_digest(name, table[name]))

        largest_first = sorted(chosen, key=lambda n: -sizes[n])
        return dict(ordered_parallel((task(n) for n in largest_first), default_workers()))

    def read_tensor(self, name: str, entry: TensorEntry) -> np.ndarray:
        """The whole canonical tensor as the engine holds it (all ranks), C order, unsigned view.

        Copies each destination view into the matching view of a canonical buffer (integer dtype,
        so bit for bit); memory is one tensor, not an index table.
        """
        placement = self.placement(name, entry)
        local = _held_pieces(placement, {d.param: (self._flat(d.param), 0) for d in placement.destinations})
        return _canonical_of(placement, self.exchange(local))

    # ------------------------------------------------------------------ version

    def fingerprint_resident(self, table: dict[str, TensorEntry]) -> dict[str, TensorEntry]:
        """Digest every tensor of ``table``'s layout as the engine holds it (the base, established)."""
        digests = self.digests(table)
        return {name: TensorEntry(entry.dtype, entry.shape, digests[name]) for name, entry in sorted(table.items())}

    def check(self, delta: Delta, staged: Staged | None = None) -> str:
        """Every check before the first write. Returns "apply", "resume" or "noop".

        ``staged``: this delta's first pass, run by ``prepare`` and still valid; where it kept every
        item, nothing is read from the delta again, so its blocks need no second check.
        """
        m = delta.manifest
        self._begin()
        self._skip_blocks = staged is not None and len(staged.prepared) == len(m.items)
        try:
            self.agree(lambda: self._check_local(delta))
        finally:
            self._skip_blocks = False
        applying = self.state.applying
        if applying is not None:
            if applying["delta_id"] == delta.id or receiver_plan.same_transition(applying, m):
                return "resume"
            raise IncompatibleError(
                f"an apply of the delta to version {applying['target']['version']} was interrupted on this engine; "
                "re-run that delta (or one with the same base and target) to finish it first"
            )
        if self.state.fingerprint is None:
            started = time.perf_counter()
            resident = self.agree(lambda: self.fingerprint_resident(m.tensors))  # ranks exchange per tensor
            self._fingerprint_seconds = time.perf_counter() - started
            held = fingerprint(resident)
            if held == m.target.fingerprint:
                self._reached(m.target.version, held, m.tensors)
            elif held == m.base.fingerprint:
                self._reached(m.base.version, held, resident)
            else:
                raise IncompatibleError(
                    f"the engine holds fingerprint {held[:16]}…, which is neither the delta's base "
                    f"{m.base.version} ({m.base.fingerprint[:16]}…) nor its target; reload the engine "
                    "from the base checkpoint or apply the missing deltas first"
                )
        if self.state.fingerprint == m.target.fingerprint:
            return "noop"
        if self.state.fingerprint != m.base.fingerprint:
            raise IncompatibleError(
                f"the engine is at version {self.state.version} ({(self.state.fingerprint or '')[:16]}…), "
                f"the delta needs base {m.base.version} ({m.base.fingerprint[:16]}…); apply the deltas that "
                f"start from the engine's version (from a store: dcr apply STORE --since {self.state.version} "
                "--vllm URL)"
            )
        return "apply"

    def _check_local(self, delta: Delta) -> None:
        m = delta.manifest
        modules = list(self.model.named_modules())  # one walk for the three layout checks (an apply's pause runs them)
        check_layout_kept(self.model, modules)
        check_resident_layout(self.model, modules)  # repacked, reordered, transposed or padded after loading
        if self._table_checked is not m:  # (the pause, after prepare checked this very manifest: done)
            receiver_plan.check_table(m, delta.url)
            for name, entry in m.tensors.items():
                if entry.dtype not in TORCH_DTYPES:
                    raise FormatError(f"{name}: unsupported dtype {entry.dtype}")
            self._table_checked = m
        self.trace_all(m.tensors)  # rejects what cannot be applied exactly, before any write
        derived = mla_derived_params(self.model, modules)
        if derived:
            for name in sorted(receiver_plan.touched(m)):
                hit = [d.param for d in self._placements[name].destinations if d.param in derived]
                if hit:
                    raise IncompatibleError(
                        f"{name} (resident as {hit[0]}): {derived[hit[0]]}; dcr cannot refit MLA's kv_b_proj in "
                        "place, refit this engine densely (a full reload); nothing was written"
                    )
        if self._skip_blocks:
            return
        if self._overlap_fetch and delta.source.remote:
            delta.prefetch_blocks()  # checked whole at the end of prepare (_untouched_and_first_pass)
        else:
            delta.verify_blocks()

    def agree(self, phase: Callable[[], T]) -> T:
        """Run a phase on every rank and fail on all of them if it fails on one (no rank is left waiting).

        A rank that fails sends its failure once (:class:`RankFailure`) and raises its own error;
        a rank that receives one, here or in an exchange inside the phase, raises that error.
        """
        if self.single:
            return phase()
        try:
            result = phase()
        except PeerFailed as exc:
            raise exc.failure.error() from None  # the failure was exchanged already
        except Exception as exc:
            self._exchange(_failure_of(exc, self.rank))
            raise
        failed = [g for g in self._exchange(None) if isinstance(g, RankFailure)]
        if failed:
            raise failed[0].error()
        return result

    def _reached(self, version: str, fp: str, table: dict[str, TensorEntry]) -> None:
        """Record ``version``: ``table`` is its tensor table, whose fingerprint the caller has checked is
        ``fp`` (a manifest's target table by ``check_table``, a read-back's by computing it). Kept as it
        is, not converted: an MoE table of tens of thousands of tensors would cost the pause milliseconds."""
        self.state.version, self.state.fingerprint, self.state.applying = version, fp, None
        self.state.table = table
        self._held = (fp, table)

    def held_table(self) -> dict[str, TensorEntry] | None:
        """The table of the version held (``EngineState.held_table``, without rebuilding it each time)."""
        if self._held is None or self._held[0] != self.state.fingerprint:
            return self.state.held_table()
        return self._held[1]

    def _state_key(self) -> tuple[str | None, str | None]:
        return self.state.fingerprint, (self.state.applying or {}).get("delta_id")

    # ------------------------------------------------------------------ apply

    # An MoE table keeps a few objects per tensor alive (items, entries, placements, kept items): the
    # collector's passes over them find nothing, and in the pause they cost tens of milliseconds.
    @fewer_collections()
    @torch.no_grad()
    def prepare(self, delta: Delta) -> str:
        """What the client runs before it pauses the engine: every check and the first pass.

        The first pass only reads (the engine serves on meanwhile); what it keeps (within
        PREPARED_BYTES) is staged for the update of the same delta, which then only writes and
        proves. Returns the mode, as ``check``.
        """
        try:
            mode = self._prepare(delta)
        except BaseException:
            self.forget_manifest()
            raise
        if mode == "noop":  # (no update follows to read the memos)
            self.forget_manifest()
        return mode

    def _prepare(self, delta: Delta) -> str:
        self._staged = None
        self._fingerprint_seconds = self._predict_seconds = 0.0
        self._predicted = set()
        started = time.perf_counter()
        self._overlap_fetch = True
        try:
            mode = self.check(delta)
        finally:
            self._overlap_fetch = False
        if mode == "noop":
            return mode
        phases = {"prepare_check": time.perf_counter() - started, "fingerprint": self._fingerprint_seconds}
        started = time.perf_counter()
        resuming = mode == "resume"
        base_table = self.held_table() if self.state.fingerprint == delta.manifest.base.fingerprint else None
        try:
            # One agreed phase: a rank whose check refuses fails every rank (none waits in an exchange).
            self.agree(lambda: self._untouched_and_first_pass(delta, base_table, resuming, blocks=True))
            prepared = dict(self._prepared)
        finally:
            self._prepared.clear()
            self._prepared_bytes = 0
        phases["predict"] = self._predict_seconds
        items = delta.manifest.items
        placements = {items[k].tensor: self._placements[items[k].tensor] for k in prepared}
        batches = [] if resuming or not self.single else self._write_batches(delta, prepared)
        if self.single and self._all_valid is delta.manifest.tensors:
            self._write_groups(delta.manifest.tensors)  # for the pause
        self._staged = Staged(
            delta.id,
            self._state_key(),
            resuming,
            prepared,
            time.perf_counter() - started,
            phases,
            frozenset(self._predicted),
            placements,
            batches,
        )
        return mode

    def _write_groups(self, table: dict[str, TensorEntry]) -> list[list[str]]:
        """The tensors of ``table`` grouped by the parameters they write (``_storage_groups``), largest
        group first; computed once per table and placements (prepare), not in the pause. Placements
        must be current (``trace_all``)."""
        memo = self._groups_memo
        if memo is not None and memo[1] == self._placement_epoch and _same_tensors(memo[0], table):
            # The same tensors, no placement traced since (every change to ``_placements`` bumps the epoch):
            # the same placements, so the same groups (a steady refit's next delta, a new table of the same
            # tensors; grouping 20k MoE tensors again costs ~0.1 s of each prepare).
            if memo[0] is not table:
                self._groups_memo = (table, *memo[1:])
            return memo[2]
        placements = {n: self._placements[n] for n in table}
        nbytes = {n: p.numel * p.dtype.itemsize for n, p in placements.items()}
        groups = _storage_groups({n: [d.param for d in p.destinations] for n, p in placements.items()})
        groups.sort(key=lambda g: -sum(nbytes[n] for n in g))
        at = {name: i for i, group in enumerate(groups) for name in group}
        self._groups_memo = (table, self._placement_epoch, groups, at)
        return groups

    def _write_group_of(self, table: dict[str, TensorEntry]) -> dict[str, int]:
        """Tensor -> its group's index in ``_write_groups(table)``."""
        self._write_groups(table)
        assert self._groups_memo is not None
        return self._groups_memo[3]

    def _write_batches(self, delta: Delta, prepared: dict[int, Prepared]) -> list[WriteBatch]:
        """The small ready items of the predicted tensors that share no storage element with another
        destination, joined per parameter (``WriteBatch``), where that saves calls: two items or more.

        Those tensors' items have distinct indices, so one scatter writes what the items would one by
        one, and the read-back of each element (``_write_elements``) checks them as it does an item's;
        they are not digested after the writes, so no digest depends on when the batch runs.
        """
        tensors = self._predicted - self._aliased_names
        by_param: dict[str, list[tuple[int, str, Prepared]]] = {}
        items_of: dict[str, int] = {}  # the number of items of each tensor met
        got = prepared.get
        for name, items in self._grouped(delta):
            if name not in tensors:
                continue
            items_of[name] = len(items)
            for k, _ in items:
                p = got(k)
                if p is not None and p.ready and p.new is not None and p.new.size <= SMALL_ITEM_ELEMENTS:
                    by_param.setdefault(p.located[0].dest.param, []).append((k, name, p))
        batches = []
        for members in by_param.values():
            if len(members) < 2:
                continue
            flat = members[0][2].located[0].flat
            bits = flat.numpy().dtype
            index = np.concatenate([p.located[0].index for _, _, p in members])
            values = np.concatenate([p.new.view(bits) for _, _, p in members if p.new is not None])
            for _, _, p in members:  # the batch holds their bits now: one copy, not two
                p.new, p.values, p.current, p.canonical, p.located, p.ready = None, None, None, None, [], False
                p.shares = False
            keys = frozenset(k for k, _, _ in members)
            in_batch = collections.Counter(name for _, name, _ in members)
            # (each item is in one batch at most: a tensor is whole where all its items are in this one)
            whole = frozenset(n for n, count in in_batch.items() if count == items_of[n])
            batches.append(WriteBatch(flat, index, values, keys, frozenset(in_batch), whole))
        if batches:  # a batched item's group buffers must not stay alive through an item left out of the batches
            _own_arrays(prepared.values())
        return batches

    def _untouched_and_first_pass(
        self,
        delta: Delta,
        base_table: dict[str, TensorEntry] | None,
        resuming: bool,
        skip: dict[int, Prepared] | None = None,
        first_pass: bool = True,
        blocks: bool = False,
    ) -> None:
        memo = self._untouched_checked  # by identity (comparing two manifests field by field costs more than the check)
        if base_table is not None and (memo is None or memo[0] is not delta.manifest or memo[1] is not base_table):
            receiver_plan.check_untouched(delta.manifest, base_table, delta.url)
            self._untouched_checked = (delta.manifest, base_table)  # (the pause after prepare: done)
        if first_pass:
            self._first_pass(delta, resuming, skip=skip)
        self._aliased_names = self._agreed_aliased(delta.manifest.tensors)
        # In the update after a prepare that kept every item, the prediction was made there and nothing
        # new can be predicted (the same items, the same budget): only a first pass here may add to it.
        if not resuming and first_pass:
            started = time.perf_counter()
            self._predicted |= self._predict(delta, {**(skip or {}), **self._prepared})
            self._predict_seconds += time.perf_counter() - started
        if blocks and delta.source.remote:  # prepare: the download overlapped the first pass; now every block whole
            delta.verify_blocks()

    def _take_staged(self, delta: Delta) -> Staged | None:
        staged, self._staged = self._staged, None
        if staged is None or staged.delta_id != delta.id or staged.key != self._state_key():
            return None
        return staged

    def _staged_still_placed(self, staged: Staged) -> bool:
        """Whether every tensor with kept items is still placed as when they were located (after ``check``,
        which re-traces a placement whose parameter storage changed): else the kept indices are stale."""
        return all(self._placements.get(name) is placement for name, placement in staged.placements.items())

    @fewer_collections()  # (as prepare)
    @torch.no_grad()
    def apply(self, delta: Delta) -> ApplyReport:
        try:
            return self._apply(delta)
        finally:
            self.forget_manifest()

    def forget_manifest(self) -> None:
        """Drop the memos that hold the last delta's manifest (its items and sections), once nothing reads them
        again: after an apply, or a prepare that ends without one to follow. The version held keeps its
        table only."""
        self._grouped_memo = self._untouched_checked = self._table_checked = None

    def _apply(self, delta: Delta) -> ApplyReport:
        started = time.perf_counter()
        m = delta.manifest
        staged = self._take_staged(delta)
        mode = self.check(delta, staged)
        if mode == "noop":
            assert self.state.fingerprint is not None
            return ApplyReport("noop", m.target.version, self.state.fingerprint)
        resuming = mode == "resume"
        usable = staged is not None and staged.resuming == resuming and self._staged_still_placed(staged)
        if not self.single:  # a rank that drops its staged pass takes other steps: all ranks drop it then
            usable = all(self.exchange(usable))
        if not usable:
            staged = None
        self._predicted = set(staged.predicted) if staged is not None else set()
        self._aliased_names = set()
        self._predict_seconds = 0.0
        phases = {**(staged.phases if staged is not None else {}), "check": time.perf_counter() - started}
        base_table = self.held_table() if self.state.fingerprint == m.base.fingerprint else None
        try:
            t = time.perf_counter()
            kept = staged.prepared if staged is not None else {}
            staged_batches = staged.batches if staged is not None else []
            if staged_batches:  # (one rank, a fresh apply)
                # A batch holds while its tensors are still proven and share no storage element (a
                # tensor rebound onto one since prepare would): else its items, which the batch emptied,
                # go through the first pass again below, before the first write, and the data blocks
                # are checked whole, as for any item not kept.
                proven = self._predicted - self._aliased(m.tensors)
                if not all(b.tensors <= proven for b in staged_batches):
                    dropped = set().union(*(b.keys for b in staged_batches))
                    kept = {k: p for k, p in kept.items() if k not in dropped}
                    staged_batches = []
                    delta.verify_blocks()
            self._batch_bytes = sum(b.index.nbytes + b.values.nbytes for b in staged_batches)
            # Items the staged pass could not keep are checked again here, in the same agreed phase as
            # the untouched tensors' check (a rank that refuses fails every rank; none is left waiting).
            again = len(kept) < len(m.items)
            # ... and kept within what the staged ones left of the budget: one PREPARED_BYTES in all.
            if again:
                self._prepared_bytes = sum(p.nbytes for p in kept.values()) + self._batch_bytes
            self.agree(lambda: self._untouched_and_first_pass(delta, base_table, resuming, kept, first_pass=again))
            prepared = {**kept, **self._prepared}
            staged_items = len(kept)
            self._prepared.clear()
            self._prepared_bytes = 0
            phases["first_pass"] = time.perf_counter() - t + (staged.seconds if staged is not None else 0.0)
            if self._predict_seconds:
                phases["predict"] = phases.get("predict", 0.0) + self._predict_seconds
            # A staged prediction of a tensor that shares storage now (a parameter rebound since) no longer holds.
            predicted = set(self._predicted) - self._aliased_names
            self.state.applying = {
                "delta_id": delta.id,
                "base": {"version": m.base.version, "fingerprint": m.base.fingerprint},
                "target": {"version": m.target.version, "fingerprint": m.target.fingerprint},
            }
            report = ApplyReport("resumed" if resuming else "applied", m.target.version, m.target.fingerprint)
            report.staged = staged_items
            report.predicted = len(predicted)
            # The proof: what was touched (everything, where the base table is unknown) reads back
            # as the target table. Until it does, the engine stays "applying" and no version is
            # recorded. On one rank each tensor is digested right after its writes, on all cores;
            # a tensor whose target digest the first pass proved (_predict) has its written
            # elements read back instead.
            touched = [name for name, _ in self._grouped(delta)] if base_table is not None else list(m.tensors)
            # Tensors sharing storage (with another tensor, or two destinations of one) are digested
            # whole after the writes, touched or not (_aliased). Sorted on several ranks: every rank
            # digests in one order (one rank needs no order: not sorting 100k names in the pause).
            names = {*touched, *self._aliased_names} if self.single else sorted({*touched, *self._aliased_names})
            t = time.perf_counter()
            if self.single:
                # The staged batches hold where their tensors are still predicted and not aliased (a
                # parameter rebound since prepare makes one aliased): else their items go one by one.
                batches = staged_batches if not resuming else []
                assert all(b.tensors <= predicted for b in batches)  # (checked before the first pass)
                digests = self._write_and_prove(delta, resuming, prepared, names, predicted, report, phases, batches)
                report.proof_seconds = phases["proof_cpu"]
            else:
                self.agree(lambda: self._write_in_order(delta, resuming, prepared, report))
                phases["writes"] = time.perf_counter() - t
                t = time.perf_counter()
                rest = [n for n in names if n not in predicted]  # the same on every rank (agreed in _predict)
                digests = self.agree(lambda: self.digests(m.tensors, rest))
                report.proof_seconds = phases["proof"] = time.perf_counter() - t
        finally:
            self._prepared.clear()
            self._prepared_bytes = self._batch_bytes = 0
        unaccounted = set(names) - set(digests) - predicted
        if unaccounted:  # a bug, never a delta's fault: nothing may be recorded unproven
            raise DcrError(f"internal error: {len(unaccounted)} touched tensors were neither digested nor predicted")
        bad = receiver_plan.unproven(m, digests)
        if bad:
            raise receiver_plan.proof_failure(m, bad, "vLLM engine")
        self._reached(m.target.version, m.target.fingerprint, m.tensors)
        report.phases = phases
        report.seconds = time.perf_counter() - started
        return report

    def _count(self, report: ApplyReport, kind: str, written: int, items: int = 1) -> None:
        setattr(report, kind, getattr(report, kind) + items)
        report.items += items
        report.written_elements += written

    def _write_in_order(self, delta: Delta, resuming: bool, prepared: dict[int, Prepared], report: ApplyReport) -> None:
        """Every item, tensor by tensor, in manifest order (several ranks: they exchange per item in step)."""
        m = delta.manifest
        for name, items in self._grouped(delta):
            placement = self.placement(name, m.tensors[name])
            for k, item in items:
                self._count(report, *self.apply_item(delta, item, placement, resuming, prepared.pop(k, None)))

    def _write_and_prove(
        self,
        delta: Delta,
        resuming: bool,
        prepared: dict[int, Prepared],
        names: Collection[str],
        predicted: set[str],
        report: ApplyReport,
        phases: dict[str, float],
        batches: Sequence[WriteBatch] = (),
    ) -> dict[str, str]:
        """One rank: write the items and digest the tensors ``names``, on all cores, each tensor
        digested right after its own writes (while its lines are still in cache), except those whose
        target digest is ``predicted`` (proven by the first pass from the bits held and the new
        bits): their proof is that every element written reads back (``_write_elements``).

        Tensors whose destinations share a parameter (q/k/v in ``qkv_proj``, gate/up, tied
        weights) form one task, so no tensor is digested while another task writes into its
        storage. Largest tasks first. ``batches``: the staged small items' writes (``WriteBatch``), a task
        each; their items are not written again. Returns the digests.
        """
        m = delta.manifest
        by_tensor = dict(self._grouped(delta))
        # Every placement checked in this operation (trace_all): taken as they are, not copied per tensor;
        # else traced here, not in threads.
        checked = self._all_valid is m.tensors
        placements = self._placements if checked else {n: self.placement(n, m.tensors[n]) for n in {*names, *by_tensor}}
        self.resident()
        digested = set(names) - predicted
        phases["writes_cpu"] = phases["proof_cpu"] = 0.0
        started = time.perf_counter()
        # The small ready items of predicted tensors are written in batches, a compiled scatter per
        # parameter for all of them (an MoE layer's experts: hundreds of items, one call), as tasks of
        # their own: those tensors share no storage element with another and are not digested after
        # the writes, so no digest depends on when these writes run.
        if batches:
            whole = set().union(*(b.whole for b in batches))  # tensors whose items are all in one batch
            partial = set().union(*(b.tensors for b in batches)) - whole
            keys = set().union(*(b.keys for b in batches if b.tensors & partial))
            for b in batches:
                self._count(report, "applied", int(b.index.size), len(b.keys))
            by_tensor = {n: items for n, items in by_tensor.items() if n not in whole}
            for n in partial:
                rest = [(k, it) for k, it in by_tensor[n] if k not in keys]
                if rest:
                    by_tensor[n] = rest
                else:
                    del by_tensor[n]
        # Only the groups with something left to write or digest take a task (a steady MoE refit: few).
        if checked:
            groups = self._write_groups(m.tensors)
            at = self._write_group_of(m.tensors)
            groups = [groups[i] for i in sorted({at[n] for n in (*by_tensor, *digested)})]
        else:  # (of the tensors in play only)
            nbytes = {n: p.numel * p.dtype.itemsize for n, p in placements.items()}
            groups = _storage_groups({n: [d.param for d in p.destinations] for n, p in placements.items()})
            groups.sort(key=lambda g: -sum(nbytes[n] for n in g))

        # A tensor sharing storage elements with another (tied weights the loader copies into one
        # parameter) is digested once every write of its group is done: its bits are what the last
        # write of them left, which a digest right after its own writes would not see.
        aliased = self._aliased_names & digested

        def write_batch(batch: WriteBatch) -> Callable[[], _WriteResult]:
            def run() -> _WriteResult:
                t = time.perf_counter()
                _write_elements(batch.flat.numpy(), batch.index, batch.values)
                return [], {}, time.perf_counter() - t, 0.0

            return run

        def task(group: list[str]) -> Callable[[], _WriteResult]:
            def run() -> _WriteResult:
                counts: list[tuple[str, int]] = []
                digests: dict[str, str] = {}
                writing = hashing = 0.0
                last: list[str] = []
                for name in group:
                    if name not in by_tensor and name not in digested:
                        continue
                    t = time.perf_counter()
                    for k, item in by_tensor.get(name, ()):
                        counts.append(self.apply_item(delta, item, placements[name], resuming, prepared.pop(k, None)))
                    t2 = time.perf_counter()
                    if name in aliased:  # another tensor of the group may write its elements still: after them
                        last.append(name)
                    elif name in digested:
                        digests[name] = self.tensor_digest(name, m.tensors[name])
                    writing, hashing = writing + t2 - t, hashing + time.perf_counter() - t2
                t = time.perf_counter()
                for name in last:
                    digests[name] = self.tensor_digest(name, m.tensors[name])
                return counts, digests, writing, hashing + time.perf_counter() - t

            return run

        digests: dict[str, str] = {}
        tasks = [*(write_batch(b) for b in batches), *(task(g) for g in groups)]
        for counts, got, writing, hashing in ordered_parallel(tasks, default_workers()):
            for kind, count in counts:
                self._count(report, kind, count)
            digests.update(got)
            phases["writes_cpu"] += writing
            phases["proof_cpu"] += hashing
        phases["writes_and_proof"] = time.perf_counter() - started
        return digests

    def _first_pass(self, delta: Delta, resuming: bool, skip: dict[int, Prepared] | None = None) -> None:
        """Before any write: every item decodes (section digests, frames) and classifies.

        On a fresh apply every item must be at its pre-image: the recorded version says the engine
        is at the base, so an item that is not means the delta does not describe this base or the
        weights were changed by something other than dcr. Resuming may find items done or torn.
        On a fresh apply each item's new bits are computed and checked against its ``post`` digest
        here too, so a corrupt item fails before the first write. Items that fit PREPARED_BYTES are
        kept for the write pass.
        """
        where = f"vLLM engine (recorded version {self.state.version})"
        todo = []
        for name, items in self._grouped(delta):
            placement = self.placement(name, delta.manifest.tensors[name])
            todo += [(k, item, placement) for k, item in items if not (skip and k in skip)]
        resident = self.resident()  # collected once, before any thread reads it
        # Every integer width the model's parameters have (a few hundred parameters; not asked per item: 20k
        # in an MoE delta). Once per process each: numba's cache then answers at once.
        widths = {t.element_size() for t in resident.values()} & {1, 2, 4, 8}
        for width in sorted(widths):  # here, before the pause (and agreed): its writes never wait for the compiler
            compile_scatter(numpy_int(width))

        def one(k: int, item: Item, placement: Placement) -> tuple[int, Prepared]:
            return k, self._first_pass_item(delta, item, placement, resuming, where)

        # One rank, a fresh apply: a chunk's small items into one parameter are checked and computed
        # together where they can be (``_joined_pass``); the rest, and anything it refuses, one by one.
        joining = self.single and not resuming

        def task(chunk: list[tuple[int, Item, Placement]]) -> Callable[[], list[tuple[int, Prepared]]]:
            def run() -> list[tuple[int, Prepared]]:
                if len(chunk) > 1:  # their data sections, next to each other in a block: one read for all
                    delta.preread([item.data for _, item, _ in chunk], lambda i: f"{chunk[i][1].tensor} data")
                joined = self._joined_pass(delta, chunk) if joining and len(chunk) > 1 else {}
                # In the chunk's order, as one by one: the budget then keeps the same items either way.
                return [(t[0], joined[t[0]]) if t[0] in joined else one(*t) for t in chunk]

            return run

        if self.single:
            # Largest first: results are consumed in submission order from a window of 2 x workers,
            # so a large item (an embedding's, 10x a layer's) behind small ones holds the window while
            # the other cores run out of work. Several ranks keep the manifest's order (the same on all).
            # The small ones (stable sort) keep the manifest's order, and go in chunks, a task each (an
            # MoE layer's expert items: one hand-off to a worker and one read per chunk, not per item);
            # one item per task on several ranks (they exchange per item).
            todo.sort(key=lambda t: -t[1].count if t[1].count >= CHUNK_ELEMENTS else 0)
            chunks = _chunks(todo, lambda t: t[1].count, most=JOINED_CHUNK_MOST if joining else CHUNK_MOST)
        else:
            chunks = [[t] for t in todo]
        tasks = (task(chunk) for chunk in chunks)
        # One rank: items on all cores (zstd, BLAKE3 and numpy's copies release the GIL); several
        # ranks exchange pieces per item, in the same order on every rank.
        results = ordered_parallel(tasks, default_workers()) if self.single else (run() for run in tasks)
        left_out_shared = False
        for done in results:
            for k, prepared in done:
                nbytes = prepared.nbytes
                if self._prepared_bytes + nbytes <= PREPARED_BYTES:
                    self._prepared[k] = prepared
                    self._prepared_bytes += nbytes
                elif prepared.shares:
                    left_out_shared = True
        if left_out_shared:  # (the budget binds) a kept slice must not hold a left-out item's bytes alive
            _own_arrays(self._prepared.values())
        if not self.single:
            # Ranks hold different shares of an item, so each fills its budget differently: keep only the
            # items every rank kept, so all take the same steps (and exchanges) from here on.
            common = set.intersection(*(set(keys) for keys in self.exchange(sorted(self._prepared))))
            for k in [k for k in self._prepared if k not in common]:
                self._prepared_bytes -= self._prepared.pop(k).nbytes

    def _first_pass_item(self, delta: Delta, item: Item, placement: Placement, resuming: bool, where: str) -> Prepared:
        """One item's first pass by itself: located, read, classified (a fresh apply refuses an item not at
        its pre-image, with its message) and, pending, its new bits computed and checked."""
        prepared = self._read(placement, self._locate_item(delta, item, placement))
        kind = receiver_plan.classify(prepared.digest, item, resuming, where)
        if not resuming and kind == "pending":
            self._compute_new(delta, item, placement, prepared)
        return prepared

    def _joined_pass(self, delta: Delta, chunk: list[tuple[int, Item, Placement]]) -> dict[int, Prepared]:
        """A fresh apply on one rank: the first pass of a chunk's items, joined per parameter where it
        can be, as the on-disk receiver's batches (``checkpoint.batch``): the small (JOINED_ITEM_ELEMENTS)
        sparse items over flat regions of tensors held whole, without a cast, as one contiguous run of
        a parameter in CPU memory (an MoE layer's expert tensors in its fused expert weights). Per parameter: the data
        sections read together, every frame checked and decoded at once (``codec.decode_joined``),
        and one compiled call (``kernels._apply_batch``) decodes the positions, checks them against
        their regions (refusing regions that overlap), gathers the bits held and computes the new
        ones; each item's elements must digest to its ``pre`` and its new bits to its ``post``.

        The items of a parameter where anything is refused are left out of the result, and go one by
        one (``_first_pass``), which gives the error with its usual message. So this changes the cost
        only: what it keeps, the per-item path keeps with the same bits (``ready``: the storage
        indices of the elements that change and their new bits). Reads only.
        """
        by_param: dict[str, list[tuple[int, Item, Destination]]] = {}
        for k, item, placement in chunk:
            dest = placement.whole_run
            if dest is None or item.region.start is None or not 0 < item.count <= JOINED_ITEM_ELEMENTS:
                continue
            if item.op == "replace" or (item.op == "xor" and item.repair is None):  # (the latter refused one by one)
                continue
            by_param.setdefault(dest.param, []).append((k, item, dest))
        out: dict[int, Prepared] = {}
        for param, members in by_param.items():
            flat = self._flat(param)
            if len(members) < 2 or flat.device.type != "cpu":
                continue
            got = _joined_items(delta, members, flat)
            if got is not None:
                out.update(got)
        return out

    def _predict(self, delta: Delta, prepared: dict[int, Prepared]) -> set[str]:
        """A fresh apply, before any write: prove each touched tensor's target digest from the bits
        the engine holds now with the items' new bits in their place.

        For the tensors not proven yet whose items were all kept with their new bits, that no
        destination widens, and whose destinations share no storage element with another
        destination (``_aliased``: other writes would change them). On one rank, where the items are
        ready and the resident runs tile the canonical tensor (``spans``), each tensor is digested in
        pieces through a scratch copy that stays in cache, on all cores. On one rank in CPU memory,
        for any other layout (strided or transposed destinations, items split over parameters, ready
        and split items mixed), the storage each parameter's destinations span is copied once, the
        items' new bits are scattered there at their storage indices and the tensor is read out of
        the copies through its destinations and digested (``_overlaid_in_storage``), for tensors
        whose copies fit the first pass's budget (PREPARED_BYTES, less what the kept items hold).
        Otherwise (several ranks, device memory, a tensor over that budget) where no item is ready,
        the whole tensor is read back from every rank (``read_tensor``) and the new bits put in
        place at the items' canonical positions; any other tensor is digested after the writes.
        The engine's weights are only read, and it serves meanwhile
        where this runs in ``prepare``; after the writes these tensors are not digested again, so
        the pause costs a pass over the changes, not over the model. A tensor whose digest is not
        the target table's refuses the delta here, with nothing written: its items do not lead from
        the engine's bits to the table (a manifest that drops or edits an item and is signed again,
        say). Returns the tensors proven.
        """
        m = delta.manifest
        resident = self.resident()
        todo: list[tuple[str, list[tuple[Destination, np.ndarray]], list[Prepared]]] = []
        overlaid: list[tuple[str, Placement, list[Prepared]]] = []
        assembled: list[tuple[str, list[Prepared]]] = []
        aliased = self._aliased_names
        got_prepared = prepared.get
        for name, items in self._grouped(delta):
            if name in self._predicted or name in aliased:  # (the pause after a staged prepare: every tensor)
                continue
            if len(items) == 1:  # (most tensors of an MoE delta: no lists to build, 20k times over)
                one = got_prepared(items[0][0])
                if one is None or one.new is None:
                    continue
                kept, ready = [one], one.ready
            else:
                got_all = [got_prepared(k) for k, _ in items]
                kept = [p for p in got_all if p is not None and p.new is not None]
                if len(kept) != len(items):
                    continue
                ready = all(p.ready for p in kept)
            placement = self.placement(name, m.tensors[name])
            if placement.casts:
                # The write leaves cast(new), which for a NaN payload need not read back as ``new``
                # (torch's casts quiet signalling NaNs): such a tensor is digested after the writes.
                continue
            runs = self._runs(placement) if ready else None
            if runs is not None:
                todo.append((name, runs, kept))
            elif self.single and all(resident[d.param].device.type == "cpu" for d in placement.destinations):
                overlaid.append((name, placement, kept))
            elif all(p.canonical is not None for p in kept):  # not a mix with ready items (they drop it)
                assembled.append((name, kept))
        # Overlaid in storage within the first pass's budget, less what the kept items hold (in
        # batches whose copies fit it together); a larger tensor is predicted as before where its items
        # kept their canonical positions (read back whole), else digested after the writes.
        room = PREPARED_BYTES - sum(p.nbytes for p in prepared.values()) - self._batch_bytes if overlaid else 0
        batches: list[list[tuple[str, Placement, list[Prepared]]]] = []
        held = 0
        for name, placement, kept in sorted(overlaid, key=lambda t: -_overlay_bytes(t[1])):
            cost = _overlay_bytes(placement)
            if cost > room:
                if all(p.canonical is not None for p in kept):
                    assembled.append((name, kept))
                continue
            if not batches or held + cost > room:
                batches.append([])
                held = 0
            batches[-1].append((name, placement, kept))
            held += cost
        if not self.single:  # every rank takes the same tensors, in the same order (each one exchanges)
            agreed = set.intersection(*(set(names) for names in self.exchange([n for n, _ in assembled])))
            assembled = [(n, kept) for n, kept in assembled if n in agreed]

        Todo = tuple[str, list[tuple[Destination, np.ndarray]], list[Prepared]]

        def task(chunk: list[Todo]) -> Callable[[], list[tuple[str, str]]]:
            return lambda: _overlaid_digests(chunk)

        sizes = {  # (the sort and the chunks ask)
            name: runs[0][1].size if len(runs) == 1 else sum(run.size for _, run in runs) for name, runs, _ in todo
        }

        def elements(t: Todo) -> int:
            return sizes[t[0]]

        todo.sort(key=lambda t: -elements(t))  # largest first (see _first_pass); small tensors in chunks
        chunks = _chunks(todo, elements, most=OVERLAY_CHUNK_MOST, budget=OVERLAY_CHUNK_ELEMENTS)
        got = {name: d for done in ordered_parallel(map(task, chunks), default_workers()) for name, d in done}
        flats = {d.param: self._flat(d.param) for _, p, _ in overlaid for d in p.destinations}

        def overlay(name: str, placement: Placement, kept: list[Prepared]) -> Callable[[], tuple[str, str]]:
            return lambda: (name, _overlaid_in_storage(placement, flats, kept))

        for batch in batches:
            got.update(ordered_parallel((overlay(*t) for t in batch), default_workers()))
        for name, kept in assembled:  # the whole tensor, from every rank, with the new bits in place
            whole = self.read_tensor(name, m.tensors[name])
            for p in kept:
                assert p.new is not None and p.canonical is not None
                whole[p.canonical] = p.new.view(whole.dtype)
            got[name] = digest_bytes(whole)
        wrong = sorted(name for name, digest in got.items() if digest != m.tensors[name].digest)
        if wrong:
            raise receiver_plan.prediction_failure(m, wrong, f"vLLM engine (recorded version {self.state.version})")
        return set(got)

    def _aliased(self, table: dict[str, TensorEntry]) -> set[str]:
        """Tensors of ``table`` whose destinations on this rank share a storage element with another
        destination's, of another tensor (tied weights that the loader copies both ways into one
        parameter, say) or of the same one, or whose own destination folds onto itself.

        Such a tensor is never proven by ``_predict`` (other writes change its bits) and is digested
        whole after the writes, touched or not. Candidate pairs are the destinations into one
        storage whose spans overlap (a sweep over the spans by start); each pair is then tested
        exactly as two strided boxes (``strided_boxes_overlap``), so views that interleave without
        sharing an element (the two transposed halves of stacked experts, a weight fused along dim 1)
        are not aliased. Conservative where that test runs out of its budget.
        """
        memo = self._aliased_memo
        if memo is not None and memo[1] == self._placement_epoch and _same_tensors(memo[0], table):
            # The same tensors and no placement traced since (the epoch): the same placements, the same
            # answer (the pause after prepare; a steady refit's next delta, a new table of the same tensors).
            if memo[0] is not table:
                self._aliased_memo = (table, memo[1], memo[2])
            return set(memo[2])
        of = [(name, self._placements.get(name)) for name in table]
        # One storage can be reached under several parameter names (a parameter rebound onto another's
        # storage after one of them was traced names it differently in the two placements): destinations
        # are grouped by the storage each trace recorded (which _cached has just checked), not by name.
        spans: dict[int | str, list[tuple[int, int, str, Box, int]]] = {}
        aliased: set[str] = set()
        for name, placement in of:
            if placement is None:
                continue
            for d in placement.destinations:
                box = (d.dst_offset, d.dst_size, d.dst_stride)
                span = box_span(box)
                if span is None:
                    continue
                if strided_box_self_overlaps(box):
                    aliased.add(name)
                size = d.dst_dtype.itemsize  # spans in bytes: views of one storage may differ in dtype
                storage = placement.storages.get(d.param, d.param)
                spans.setdefault(storage, []).append((span[0] * size, span[1] * size, name, box, size))
        for ranges in spans.values():
            ranges.sort(key=lambda r: (r[0], r[1]))
            active: list[tuple[int, int, str, Box, int]] = []  # spans still open at ``lo``
            for lo, hi, name, box, size in ranges:
                active = [r for r in active if r[1] > lo]
                for _, _, other, other_box, other_size in active:
                    if {name, other} <= aliased:
                        continue
                    # Exact for two views of one dtype; views of two dtypes whose spans overlap: aliased.
                    if other_size != size or strided_boxes_overlap(other_box, box):
                        aliased.update((name, other))
                active.append((lo, hi, name, box, size))
        self._aliased_memo = (table, self._placement_epoch, set(aliased))
        return aliased

    def _agreed_aliased(self, table: dict[str, TensorEntry]) -> set[str]:
        """``_aliased``, the union over the ranks (every rank then digests the same tensors: each exchanges)."""
        aliased = self._aliased(table)
        if self.single:
            return aliased
        return set().union(*(set(names) for names in self.exchange(sorted(aliased))))

    def _locate_item(self, delta: Delta, item: Item, placement: Placement) -> Prepared:
        """The item decoded (section digest, frames) and located on this rank."""
        decoded = delta.decode(item)
        positions = decoded.positions if decoded.positions is not None else np.arange(item.region.size)
        canonical = _to_canonical_index(item, positions, placement.shape)
        return Prepared(decoded.values, self.locate(placement, canonical), len(positions), canonical=canonical)

    def _compute_new(self, delta: Delta, item: Item, placement: Placement, prepared: Prepared) -> None:
        """A fresh apply's pending item: its new bits, checked against ``post`` (raises before any write).

        Through a widening loader those are the item's absolute repair values (read here, before the
        pause). Where this rank holds the item's only copy (one rank, one destination, no cast, CPU
        memory) only the elements that change are kept, with 32-bit storage indices where the
        parameter allows them: what the write needs, and no more.
        """
        _require_repair(item)
        casts = _casts(placement)
        assert prepared.current is not None and prepared.values is not None
        new = receiver_plan.new_values(
            item, "pending", prepared.current, prepared.values, lambda: delta.repair_values(item), absolute=casts
        )
        current, prepared.current, prepared.values, prepared.new = prepared.current, None, None, new
        if casts or len(prepared.located) != 1 or not self.single or prepared.located[0].flat.device.type != "cpu":
            return
        at = prepared.located[0]
        assert at.index.size == new.size
        differs = current != new
        if not bool(differs.all()):  # overwrite/replace items may leave elements as they are
            at.index, prepared.new = at.index[differs], new[differs]
        if at.flat.numel() <= np.iinfo(np.int32).max and at.index.dtype != np.int32:
            at.index = at.index.astype(np.int32)  # half the memory kept; the write kernel is as fast with it
        prepared.ready, prepared.canonical = True, None

    def _read(self, placement: Placement, prepared: Prepared) -> Prepared:
        """Read the item's elements as held now (all ranks) and their digest (None: replicas disagree)."""
        current, divergent = self.assemble(placement, prepared.count, prepared.located)
        prepared.current, prepared.digest = current, (None if divergent else digest_bytes(current))
        return prepared

    def apply_item(
        self, delta: Delta, item: Item, placement: Placement, resuming: bool, prepared: Prepared | None = None
    ) -> tuple[str, int]:
        """Classify and write one item. A fresh apply uses the first pass's reading of its elements
        (nothing has written them since: items do not overlap); a resume reads them again."""
        if prepared is not None and not resuming and prepared.new is not None:
            # The first pass classified it pending from the elements it read (nothing but dcr writes
            # them, and items do not overlap) and computed and checked its new bits (_compute_new).
            if prepared.ready:
                at = prepared.located[0]
                return "applied", self._write_ready(placement, at, at.index, prepared.new)
            return "applied", self.write(placement, prepared.located, prepared.new)
        if prepared is None or prepared.values is None:  # nothing kept, or only new bits: decode again
            prepared = self._locate_item(delta, item, placement)
        if resuming or prepared.current is None:
            prepared = self._read(placement, prepared)
        assert prepared.current is not None and prepared.values is not None
        kind = receiver_plan.classify(prepared.digest, item, resuming, "vLLM engine")
        if kind == "done":
            return "done", 0
        # Through a widening loader no mask on stored bits carries over: take the absolute values.
        casts = _casts(placement)
        _require_repair(item)
        new = receiver_plan.new_values(
            item, kind, prepared.current, prepared.values, lambda: delta.repair_values(item), absolute=casts
        )
        written = self.write(placement, prepared.located, new, None if casts else prepared.current)
        return ("applied" if kind == "pending" else "repaired"), written

    def _write_ready(self, placement: Placement, at: Located, index: np.ndarray, new: np.ndarray) -> int:
        """The one-copy write: ``new`` at storage ``index`` of ``at``, every one of them a change; their count."""
        if new.size:
            _write_elements(at.flat.numpy(), index, new.view(_np_int(placement.dtype)))
        return int(new.size)

    # ------------------------------------------------------------------ verify

    def verify(self, table: dict[str, TensorEntry] | None = None) -> dict[str, Any]:
        """Read every canonical tensor back through its placement and compare digests."""
        if table is None:
            table = self.state.held_table()
            if table is None:
                raise DcrError("this engine has no recorded version yet; pass the delta to verify against")
        self._begin()
        self._staged = None
        check_layout_kept(self.model)
        held = table
        digests = self.agree(lambda: self.digests(held))  # several ranks exchange per tensor: fail together
        mismatched = [name for name, entry in sorted(table.items()) if digests[name] != entry.digest]
        return {"tensors": len(table), "mismatched": mismatched, "fingerprint": fingerprint(table)}


def _held_pieces(
    placement: Placement, storages: dict[str, tuple[torch.Tensor, int]]
) -> list[tuple[Destination, torch.Tensor]]:
    """Each destination's elements (canonical dtype, CPU, in the view's C order), read from
    ``storages``: param -> (its storage as integers, or a copy of part of it, and the storage index
    of that part's first element)."""
    local = []
    for dest in placement.destinations:
        if not dest.numel:  # an empty copy (a zero-size shard): nothing held, and maybe no storage spanned
            continue
        flat, start = storages[dest.param]
        view = torch.as_strided(flat, dest.dst_size, dest.dst_stride, dest.dst_offset - start)
        held = _to_canonical(view, dest, placement.dtype).cpu()
        if not held.is_contiguous():
            held = _blocked_copy(torch.empty(held.shape, dtype=held.dtype), held)
        local.append((dest, held))
    return local


# Elements per run of a blocked copy's innermost strided dimension: two cache lines of BF16.
COPY_RUN_BYTES = 128


def _blocked_copy(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """``dst.copy_(src)``, in slabs where one side is transposed against the other: torch copies such
    views element by element across rows (a cache miss per element for a transposed expert stack,
    6x slower than slabs of a few rows, each of whose pieces stays in cache). Bits are copied as
    they are (the same dtype on both sides); returns ``dst``."""
    for side in (dst, src):
        strides = side.stride()
        dims = [d for d in range(side.dim()) if side.shape[d] > 1]
        if not dims:
            break
        k = min(dims, key=lambda d: abs(strides[d]))
        if k != side.dim() - 1 and (dst.stride()[k], src.stride()[k]) != (1, 1):
            run, n = max(1, COPY_RUN_BYTES // side.element_size()), side.shape[k]
            for a in range(0, n, run):
                dst.narrow(k, a, min(run, n - a)).copy_(src.narrow(k, a, min(run, n - a)))
            return dst
    return dst.copy_(src)


def _canonical_of(placement: Placement, ranks: list[list[tuple[Destination, torch.Tensor]]]) -> np.ndarray:
    """The canonical tensor (C order, unsigned view) from every rank's ``_held_pieces``: each copied
    into the matching view of a canonical buffer (integer dtype, so bit for bit); replicas must agree."""
    name = placement.name
    out = torch.zeros(placement.numel, dtype=int_dtype(placement.dtype))
    seen = torch.zeros(placement.numel, dtype=torch.bool)
    for rank_pieces in ranks:
        for dest, held in rank_pieces:
            out_view = torch.as_strided(out, dest.src_size, dest.src_stride, dest.src_offset)
            seen_view = torch.as_strided(seen, dest.src_size, dest.src_stride, dest.src_offset)
            if bool(seen_view.any()) and not torch.equal(out_view[seen_view], held[seen_view]):
                raise IntegrityError(f"{name}: the engine's replicas of this tensor hold different bits")
            _blocked_copy(out_view, held)
            seen_view.fill_(True)
    if not bool(seen.all()):
        raise IncompatibleError(f"{name}: {int((~seen).sum())} elements are held by no rank of this engine")
    return _as_uint(out)


def _spanned(placement: Placement) -> dict[str, tuple[int, int]]:
    """Per parameter, ``[lo, hi)`` of the storage elements the tensor's destinations there span."""
    regions: dict[str, tuple[int, int]] = {}
    for dest in placement.destinations:
        span = box_span((dest.dst_offset, dest.dst_size, dest.dst_stride))
        if span is not None:
            lo, hi = regions.get(dest.param, span)
            regions[dest.param] = (min(lo, span[0]), max(hi, span[1]))
    return regions


def _overlay_bytes(placement: Placement) -> int:
    """Memory ``_overlaid_in_storage`` takes for ``placement``: the spanned storage copied, the pieces
    read out of it, the canonical buffer and its bool mask."""
    spanned = sum(hi - lo for lo, hi in _spanned(placement).values())
    return (spanned + 2 * placement.numel) * placement.dtype.itemsize + placement.numel


def _overlaid_in_storage(placement: Placement, flats: dict[str, torch.Tensor], kept: list[Prepared]) -> str:
    """Digest of the canonical tensor as it will be once its kept items are written, for any layout
    on one rank without a cast (strided or transposed destinations, items split over parameters,
    ready and split items mixed): each parameter's spanned storage copied once, every item's new
    bits scattered at its storage indices there (per destination), the tensor read out of the copies
    through its destinations (as ``read_tensor`` reads it) and digested. Reads the weights only.

    Exact because no destination of the tensor shares an element with another destination
    (``_aliased``): what other tensors' writes change in the copies is never read back.
    """
    regions = _spanned(placement)
    copies = {param: flats[param][lo:hi].clone() for param, (lo, hi) in regions.items()}
    for p in kept:
        assert p.new is not None
        for at in p.located:
            if not at.index.size:
                continue
            lo = regions[at.dest.param][0]
            copy = copies[at.dest.param].numpy()
            new = p.new if p.ready else np.ascontiguousarray(p.new[at.hit])
            scatter(copy, at.index, new.view(copy.dtype), lo)
    pieces = _held_pieces(placement, {param: (copies[param], lo) for param, (lo, _) in regions.items()})
    return digest_bytes(_canonical_of(placement, [pieces]))


# Items (or tensors) under this many elements go to the worker pool in chunks of about this many
# elements (_chunks): below it, a hand-off to a worker costs more than the item's own work.
CHUNK_ELEMENTS = 1 << 16
CHUNK_MOST = 64  # ... and of at most this many (the window of tasks in flight stays fine-grained)
JOINED_CHUNK_MOST = 1024  # ... where a chunk's items are joined per parameter (a call per parameter, not per item)


def _chunks(
    todo: list[T], size: Callable[[T], int], most: int | None = None, budget: int | None = None
) -> list[list[T]]:
    """``todo`` in order, cut into runs of small entries of about ``budget`` (CHUNK_ELEMENTS) elements
    in all and at most ``most`` (CHUNK_MOST) entries; a large one alone."""
    most = CHUNK_MOST if most is None else most
    budget = CHUNK_ELEMENTS if budget is None else budget
    chunks: list[list[T]] = []
    held = 0
    for t in todo:
        n = size(t)
        if n >= budget or not chunks or held >= budget or len(chunks[-1]) >= most:
            chunks.append([t])
            held = n
        else:
            chunks[-1].append(t)
            held += n
    return chunks


def _joined_items(
    delta: Delta, members: list[tuple[int, Item, Destination]], flat: torch.Tensor
) -> dict[int, Prepared] | None:
    """``EngineReceiver._joined_pass`` for the items ``members`` of one parameter (storage ``flat``):
    each a flat region of a tensor held as one contiguous run there. None where anything is refused."""
    width = flat.element_size()
    size = flat.numel()
    if any(d.dst_offset + d.numel > size for _, _, d in members):
        return None
    rows = [
        (
            (d.dst_offset + item.region.start) * width,  # type: ignore[operator]  # (flat regions only)
            item.region.size,
            item.count,
            item.op == "xor",
            item.data.length,
            item.positions_length,
        )
        for _, item, d in members
    ]
    region_at, sizes, counts, xor, lengths, positions_lengths = np.ascontiguousarray(np.array(rows, dtype=np.int64).T)
    # (the chunk's sections were read together: ``read_section`` takes each from there; where this
    # refuses, they are given back for the items' decode one by one, not read again)
    sections = [item.data for _, item, _ in members]
    datas = [delta.read_section(item.data, f"{item.tensor} data") for _, item, _ in members]
    got = _joined_checked(members, flat, datas, region_at, sizes, counts, xor, lengths, positions_lengths)
    if got is None:
        delta.give_back(sections, datas)
    return got


def _joined_checked(
    members: list[tuple[int, Item, Destination]],
    flat: torch.Tensor,
    datas: list[bytes],
    region_at: np.ndarray,
    sizes: np.ndarray,
    counts: np.ndarray,
    xor: np.ndarray,
    lengths: np.ndarray,
    positions_lengths: np.ndarray,
) -> dict[int, Prepared] | None:
    """``_joined_items`` once the sections' bytes ``datas`` are read: decoded, gathered, computed, checked.

    The items' arrays are slices of the group's (``Prepared.shares``), made without a dataclass
    ``__init__`` each: at 20k expert items a call per item costs tens of milliseconds of the GIL."""
    n, width, size = len(members), flat.element_size(), flat.numel()
    widths = np.full(n, width, dtype=np.int64)
    frames = decode_joined(b"".join(datas), lengths, positions_lengths, counts, widths)
    if frames is None:
        return None
    out_at = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(counts * width, out=out_at[1:])
    total = int(out_at[-1])
    cur = np.empty(total, dtype=np.uint8)
    new = np.empty(total, dtype=np.uint8)
    patch_at = np.empty(total, dtype=np.int64)
    # (unused here: with ``join`` and no gap limit, a span per run of adjacent regions, so at most n; the
    # kernel does not check bounds, this size does)
    spans = np.empty((n + 1, 3), dtype=np.int64)
    bad, _ = _apply_batch(
        frames.raw, frames.gaps_at, frames.gaps_len, frames.values_at, counts, widths, sizes, region_at,
        np.zeros(n, dtype=np.int64), xor != 0, np.argsort(region_at, kind="stable"), flat.numpy().view(np.uint8),
        cur, new, patch_at, out_at, size * width, True, spans,
    )  # fmt: skip
    if bad >= 0:
        return None
    edges = out_at.tolist()
    cur_view, new_view = cur.data, new.data
    for k, (_, item, _) in enumerate(members):
        a, b = edges[k], edges[k + 1]
        if blake3.blake3(cur_view[a:b]).hexdigest() != item.pre:
            return None
        if blake3.blake3(new_view[a:b]).hexdigest() != item.post:
            return None
    uint = np.dtype(f"<u{width}")
    held, bits = cur.view(uint), new.view(uint)
    index = patch_at[::width] // width
    if size <= np.iinfo(np.int32).max:
        index = index.astype(np.int32)  # (as _compute_new keeps it)
    element_edges = out_at // width
    changes = held != bits  # an overwrite may leave an element as it is: only those that change are kept
    if bool(changes.all()):
        kept_edges = element_edges.tolist()
    else:
        kept_edges = np.concatenate(([0], np.cumsum(changes)))[element_edges].tolist()
        index, bits = index[changes], bits[changes]
    counts_of = np.diff(element_edges).tolist()
    got: dict[int, Prepared] = {}
    for k, (key, item, dest) in enumerate(members):
        a, b = kept_edges[k], kept_edges[k + 1]
        located = _new_object(Located)
        located.__dict__.update(dest=dest, hit=slice(0, counts_of[k]), index=index[a:b], flat=flat)
        prepared = _new_object(Prepared)
        prepared.__dict__.update(
            values=None, located=[located], count=counts_of[k], current=None, digest=item.pre,
            new=bits[a:b], canonical=None, ready=True, shares=True,
        )  # fmt: skip
        got[key] = prepared
    return got


def _own_arrays(prepared: Iterable[Prepared]) -> None:
    """Give each item whose arrays are slices of its joined group's buffers (``Prepared.shares``) copies of its
    own, where the rest of its group is dropped (left out by the budget, or written by a batch): the budget
    counts each item's own slices, which holds only while the group's items keep its buffers together."""
    for p in prepared:
        if p.shares:
            if p.new is not None:
                p.new = p.new.copy()
            for at in p.located:
                at.index = at.index.copy()
            p.shares = False


# ``_joined_checked`` sets every field of Located and Prepared without their ``__init__``: a field
# added must be set there too (test_vllm_joined_pass checks the names).
_new_object = object.__new__


# Items of at most this many elements go through the joined first pass (``_joined_pass``): below it
# the per-item path's fixed cost (tens of microseconds) dominates; above it, the per-item path's
# kernels are the cheaper per element (a dense tensor's items at 0.5%: 1.4x slower joined).
JOINED_ITEM_ELEMENTS = 1 << 12

# Ready items of at most this many elements are written in batches (WriteBatch): the
# items of an MoE layer's experts, each a few thousand elements, cost a call each otherwise.
SMALL_ITEM_ELEMENTS = 1 << 15


def _storage_groups(params: dict[str, list[str]]) -> list[list[str]]:
    """Tensors (name -> the parameters its destinations write) grouped by shared parameters (union-find)."""
    parent: dict[str, str] = {}

    def root(x: str) -> str:
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for name, ps in params.items():
        for p in ps:
            parent[root("p:" + p)] = root("t:" + name)
    groups: dict[str, list[str]] = {}
    for name in sorted(params):
        groups.setdefault(root("t:" + name), []).append(name)
    return list(groups.values())


# The piece of a tensor ``_overlaid_digest`` copies at a time: small enough to stay in a core's cache
# between the copy, the overlay and the digest; large enough that Python's cost per piece is noise.
OVERLAY_PIECE_BYTES = 1 << 20


# Tensors held as one run of at most one piece (OVERLAY_PIECE_BYTES) are predicted together, in
# chunks of about this many elements in all (``_overlaid_digests``): an MoE layer's expert tensors,
# a few thousand elements each, cost one copy and one scatter per chunk, not per tensor (the copies
# stay in cache).
OVERLAY_CHUNK_ELEMENTS = 1 << 18
OVERLAY_CHUNK_MOST = 256


def _overlaid_digests(
    todo: list[tuple[str, list[tuple[Destination, np.ndarray]], list[Prepared]]],
) -> list[tuple[str, str]]:
    """``_overlaid_digest`` of each tensor of ``todo`` (name, runs, kept), in order. Those held as one
    run of at most one piece (OVERLAY_PIECE_BYTES), together per element width: their runs copied next to
    each other into one scratch buffer, their items' new bits put in place there by one scatter,
    each tensor's bytes digested where they lie in it. The same bits as one by one (the same
    copies, indices and values, in the same order); only Python's cost per tensor goes."""
    digests: dict[str, str] = {}
    joint: dict[int, list[tuple[str, Destination, np.ndarray, list[Prepared]]]] = {}
    for name, runs, kept in todo:
        if len(runs) == 1 and runs[0][1].nbytes <= OVERLAY_PIECE_BYTES:  # (one piece, as _overlaid_digest's)
            dest, run = runs[0]
            joint.setdefault(run.itemsize, []).append((name, dest, run, kept))
        else:
            digests[name] = _overlaid_digest(runs, kept)
    for width, group in joint.items():
        bits = numpy_int(width)
        held = np.concatenate([run.view(bits) for _, _, run, _ in group])
        index: list[np.ndarray] = []
        values: list[np.ndarray] = []
        owner: list[int] = []  # the tensor (its place in ``group``) of each entry of ``index``
        shift: list[int] = []  # ... and what moves its storage indices to the tensor's place in ``held``
        edges = [0]
        for k, (_, dest, run, kept) in enumerate(group):
            lo = edges[-1]
            for p in kept:
                at = p.located[0]
                if p.new is not None and (at.dest is dest or at.dest == dest):  # (as _overlaid_digest)
                    index.append(at.index)
                    values.append(p.new.view(bits))
                    owner.append(k)
                    shift.append(lo - dest.dst_offset)
            edges.append(lo + run.size)
        if index:
            # (joined, then widened and moved at once: two numpy calls per item cost the GIL 30 ms at 20k items)
            sizes = [a.size for a in index]
            at_all = np.concatenate(index).astype(np.int64) + np.repeat(np.array(shift, dtype=np.int64), sizes)
            # Each index inside its own tensor's place in the buffer (``locate`` makes them so; a
            # neighbour's bits must never be what proves a tensor).
            of = np.repeat(np.array(owner), sizes)
            bounds = np.array(edges)
            if at_all.size and not bool(((at_all >= bounds[of]) & (at_all < bounds[of + 1])).all()):
                raise IndexError("prediction: an item's storage index lies outside its tensor's run")
            scatter(held, at_all, np.concatenate(values))
        view = held.view(np.uint8).data
        for (name, _, _, _), lo, hi in zip(group, edges[:-1], edges[1:], strict=True):
            digests[name] = blake3.blake3(view[lo * width : hi * width]).hexdigest()
    return [(name, digests[name]) for name, _, _ in todo]


def _overlaid_digest(runs: list[tuple[Destination, np.ndarray]], kept: list[Prepared]) -> str:
    """Digest of the canonical tensor held in ``runs`` (``spans``, in canonical order) as it will be
    once the ready items ``kept`` are written: each run read in pieces into a scratch buffer, the
    new bits of the elements that change put in place there, the buffer digested. Reads only."""
    digest = StreamingDigest(threads=False)  # one tensor per core (the caller's pool)
    for dest, run in runs:
        mine = [p for p in kept if p.located[0].dest is dest or p.located[0].dest == dest]
        bits = numpy_int(run.itemsize)
        # Storage indices (the run starts at ``base`` there): scatter shifts them, no shifted copy is made.
        base = dest.dst_offset
        index = _joined([p.located[0].index for p in mine], np.int64)
        values = _joined([p.new.view(bits) for p in mine if p.new is not None], bits)
        step = max(1, OVERLAY_PIECE_BYTES // run.itemsize)
        if index.size and run.size <= step:  # one piece (an expert's tensor): in any order, no edges to find
            held = np.array(run.view(bits))
            scatter(held, index, values, base)
            digest.update(held)
            continue
        if index.size > 1 and not bool((index[1:] > index[:-1]).all()):  # items in another order than the tensor's
            order = np.argsort(index, kind="stable")
            index, values = index[order], values[order]
        if not index.size:
            digest.update(run)
            continue
        # The piece edges in the index's own dtype where they fit it (searching casts the index otherwise).
        fits = base + run.size + step <= np.iinfo(index.dtype).max
        pieces = np.arange(base, base + run.size + step, step, dtype=index.dtype if fits else np.int64)
        edges = np.searchsorted(index, pieces)
        scratch = np.empty(min(step, run.size), dtype=bits)
        for piece, lo in enumerate(range(0, run.size, step)):
            hi, a, b = min(lo + step, run.size), int(edges[piece]), int(edges[piece + 1])
            if a == b:
                digest.update(run[lo:hi])
                continue
            held = scratch[: hi - lo]
            np.copyto(held, run[lo:hi].view(bits))
            scatter(held, index[a:b], values[a:b], base + lo)
            digest.update(held)
    return digest.hexdigest()


def _same_tensors(a: dict[str, TensorEntry], b: dict[str, TensorEntry]) -> bool:
    """Whether two tables name the same tensors (compared in C: a steady refit's next table has 20k)."""
    return a is b or a.keys() == b.keys()


def _joined(arrays: list[np.ndarray], dtype: type | np.dtype) -> np.ndarray:
    """``arrays`` end to end; the one array itself where there is one (no copy), empty where none."""
    if len(arrays) == 1:
        return arrays[0]
    return np.concatenate(arrays) if arrays else np.zeros(0, dtype)


def _grouped(delta: Delta) -> list[tuple[str, list[tuple[int, Item]]]]:
    """The delta's items by tensor, each with its index in the manifest (the key of a staged item)."""
    groups: dict[str, list[tuple[int, Item]]] = {}
    for k, item in enumerate(delta.manifest.items):
        groups.setdefault(item.tensor, []).append((k, item))
    return list(groups.items())


def _to_canonical_index(item: Item, positions: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """``item.region.to_canonical``, without a copy where the region is the whole tensor from its start."""
    region = item.region
    whole_box = region.is_box and list(region.offsets or ()) == [0] * len(shape) and tuple(region.sizes or ()) == shape
    if (whole_box or (not region.is_box and region.start == 0)) and positions.dtype == np.int64:
        return positions
    return region.to_canonical(positions, shape)


def _casts(placement: Placement) -> bool:
    """Whether a destination widens (a BF16 checkpoint in an FP32 engine): no XOR mask carries over there."""
    return placement.casts


def _require_repair(item: Item) -> None:
    if item.op == "xor" and item.repair is None:
        raise IntegrityError(f"{item.tensor}: an xor item needs its repair section, which is missing")


def _np_int(dtype: torch.dtype) -> np.dtype:
    return numpy_int(dtype.itemsize)


def _float_bits(dtype: torch.dtype) -> tuple[int, int]:
    """(exponent bits, mantissa bits) from the dtype registry."""
    bits = from_torch(dtype).float_bits
    assert bits is not None, f"{dtype} is not a float a loader widens between"  # EXACT_WIDENING pairs only
    return bits


def _to_canonical(held: torch.Tensor, dest: Destination, canonical: torch.dtype) -> torch.Tensor:
    """Integer bits of the canonical dtype for elements held in ``dest`` (undoing a widening cast).

    Every value but NaN is cast back (exact: a widened value is a value of the narrower dtype, and
    casting back must reproduce the held bits). NaN is undone with integer operations: its sign
    and the top mantissa bits, after checking that the low bits the widening appended are zero
    (a float cast would turn every NaN payload into the default NaN).
    """
    if not dest.cast(canonical):
        return held
    wide = held.view(dest.dst_dtype)
    out = wide.to(canonical).view(int_dtype(canonical))
    exp_d, man_d = _float_bits(dest.dst_dtype)
    exp_s, man_s = _float_bits(canonical)
    bits = held.to(torch.int64)
    if held.element_size() < 8:
        bits &= (1 << (8 * held.element_size())) - 1  # the unsigned bits of a signed container
    exponent = (bits >> man_d) & ((1 << exp_d) - 1)
    mantissa = bits & ((1 << man_d) - 1)
    nan = (exponent == (1 << exp_d) - 1) & (mantissa != 0)
    shift = man_d - man_s
    exact = torch.where(
        nan, (mantissa & ((1 << shift) - 1)) == 0, out.view(canonical).to(dest.dst_dtype).view(held.dtype) == held
    )
    if not bool(exact.all()):
        raise IntegrityError(
            f"{dest.param}: the engine holds {dest.dst_dtype} values that no {canonical} checkpoint widens to; "
            "it was not loaded from such a checkpoint (or was changed since): reload it"
        )
    if bool(nan.any()):
        width = 1 + exp_s + man_s
        sign = (bits >> (8 * held.element_size() - 1)) & 1
        narrow = (sign << (width - 1)) | (((1 << exp_s) - 1) << man_s) | (mantissa >> shift)
        narrow = torch.where(narrow >= 1 << (width - 1), narrow - (1 << width), narrow)  # signed container
        out = torch.where(nan, narrow.to(out.dtype), out)
    return out


def _as_uint(values: torch.Tensor) -> np.ndarray:
    array = values.cpu().numpy()
    return array.view(np.dtype(f"<u{array.dtype.itemsize}"))
