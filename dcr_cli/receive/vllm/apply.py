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

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from ...delta.reader import Delta
from ...errors import DcrError, FormatError, IncompatibleError, IntegrityError
from ...format.codec import DecodedItem
from ...format.digest import StreamingDigest, digest_bytes
from ...format.manifest import Item, TensorEntry, fingerprint
from .. import plan as receiver_plan
from .layout import check_resident_layout
from .placement import (
    TORCH_DTYPES,
    Destination,
    Placement,
    check_layout_kept,
    flat_storage,
    int_dtype,
    named_resident,
    trace_placement,
)

# All-gather of a picklable object across the engine's ranks (identity on one rank).
Exchange = Callable[[Any], list[Any]]


def single_rank(obj: Any) -> list[Any]:
    return [obj]


@dataclass
class EngineState:
    """What this engine holds, as far as dcr knows. Unknown (None) until the first check."""

    version: str | None = None
    fingerprint: str | None = None
    # While an apply is unfinished: {"delta_id", "base": {version, fingerprint}, "target": {...}}.
    applying: dict[str, Any] | None = None
    table: dict[str, dict] = field(default_factory=dict)  # tensor table of ``fingerprint`` (when known)

    def held_table(self) -> dict[str, TensorEntry] | None:
        """The table of the version held, where dcr knows it (proven by a read-back or an apply)."""
        table = {n: TensorEntry(t["dtype"], tuple(t["shape"]), t["digest"]) for n, t in self.table.items()}
        return table if table and fingerprint(table) == self.fingerprint else None

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

    def to_json(self) -> dict:
        return asdict(self)


# Memory the check pass may spend on keeping decoded and located items for the write pass.
PREPARED_BYTES = 256 << 20


@dataclass
class Prepared:
    decoded: DecodedItem
    located: list[Located]
    count: int

    @property
    def nbytes(self) -> int:
        held = [self.decoded.values] + ([self.decoded.positions] if self.decoded.positions is not None else [])
        held += [a for at in self.located for a in (at.hit, at.index)]
        return sum(a.nbytes for a in held)


@dataclass
class Located:
    """One destination's share of an item: which positions it holds and at which storage elements."""

    dest: Destination
    hit: np.ndarray  # bool per item position
    index: np.ndarray  # storage element indices (int64) of the hit positions
    flat: torch.Tensor  # the parameter's whole storage as integers

    def read(self) -> torch.Tensor:
        """Current bits at ``index`` (on the CPU; numpy indexing there, which is cheaper for scattered reads)."""
        if self.flat.device.type == "cpu":
            return torch.from_numpy(self.flat.numpy()[self.index])
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
    """The only place dcr writes resident weights (tests inject failures here)."""
    flat[index] = values


class EngineReceiver:
    """dcr's view of one worker's model: placements, the recorded version, apply and read-back."""

    def __init__(self, model: torch.nn.Module, exchange: Exchange = single_rank) -> None:
        self.model = model
        self.exchange = exchange
        self.state = EngineState()
        self._placements: dict[str, Placement] = {}
        self._resident: dict[str, torch.Tensor] | None = None
        # Items decoded and located by the check pass, for the write pass (bounded by PREPARED_BYTES).
        self._prepared: dict[int, Prepared] = {}
        self._prepared_bytes = 0

    def resident(self) -> dict[str, torch.Tensor]:
        """Parameters and buffers by name; collected once per operation (walking modules is slow)."""
        if self._resident is None:
            self._resident = named_resident(self.model)
        return self._resident

    def _begin(self) -> None:
        self._resident = None  # parameters may have been replaced since the last operation

    # ------------------------------------------------------------------ placement

    def placement(self, name: str, entry: TensorEntry) -> Placement:
        dtype = TORCH_DTYPES[entry.dtype]
        cached = self._placements.get(name)
        if cached is not None and cached.shape == entry.shape and cached.dtype == dtype:
            resident = self.resident()
            if all(
                p in resident and resident[p].untyped_storage().data_ptr() == ptr for p, ptr in cached.storages.items()
            ):
                return cached
        placement = trace_placement(self.model, name, entry.shape, dtype)
        self._placements[name] = placement
        return placement

    def locate(self, placement: Placement, canonical: np.ndarray) -> list[Located]:
        """Where this rank holds ``canonical`` positions: per destination, the positions hit and storage indices."""
        resident = self.resident()
        located = []
        for dest in placement.destinations:
            hit, index = dest.locate(canonical)
            if index.size:
                located.append(Located(dest, hit, index, flat_storage(resident[dest.param])))
        return located

    def assemble(self, placement: Placement, count: int, located: list[Located]) -> tuple[np.ndarray, bool]:
        """The item's elements as held by the engine (all ranks), and whether replicas disagree."""
        local = [
            (
                None if at.index.size == count else np.flatnonzero(at.hit),  # None: every position
                _as_uint(_to_canonical(at.read(), at.dest, placement.dtype)),
            )
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

    def write(self, placement: Placement, located: list[Located], new: np.ndarray) -> int:
        """Write ``new`` at every local destination, only where the bits differ."""
        written = 0
        for at in located:
            want = torch.from_numpy(np.ascontiguousarray(new[at.hit]).view(_np_int(placement.dtype)))
            if at.dest.cast(placement.dtype):  # write what the loader writes: the same cast of the value
                want = want.view(placement.dtype).to(at.dest.dst_dtype).view(at.flat.dtype)
            written += at.write_where_different(want)
        return written

    def read_tensor(self, name: str, entry: TensorEntry) -> np.ndarray:
        """The whole canonical tensor as the engine holds it (all ranks), C order, unsigned view.

        Copies each destination view into the matching view of a canonical buffer (integer dtype,
        so bit for bit); memory is one tensor, not an index table.
        """
        placement = self.placement(name, entry)
        resident = self.resident()
        local = []
        for dest in placement.destinations:
            flat = flat_storage(resident[dest.param])
            held = torch.as_strided(flat, dest.dst_size, dest.dst_stride, dest.dst_offset)
            local.append((dest, _to_canonical(held, dest, placement.dtype).cpu().contiguous()))
        out = torch.zeros(placement.numel, dtype=int_dtype(placement.dtype))
        seen = torch.zeros(placement.numel, dtype=torch.bool)
        for rank_pieces in self.exchange(local):
            for dest, held in rank_pieces:
                out_view = torch.as_strided(out, dest.src_size, dest.src_stride, dest.src_offset)
                seen_view = torch.as_strided(seen, dest.src_size, dest.src_stride, dest.src_offset)
                if bool(seen_view.any()) and not torch.equal(out_view[seen_view], held[seen_view]):
                    raise IntegrityError(f"{name}: the engine's replicas of this tensor hold different bits")
                out_view.copy_(held)
                seen_view.fill_(True)
        if not bool(seen.all()):
            raise IncompatibleError(f"{name}: {int((~seen).sum())} elements are held by no rank of this engine")
        return _as_uint(out)

    # ------------------------------------------------------------------ version

    def fingerprint_resident(self, table: dict[str, TensorEntry]) -> dict[str, TensorEntry]:
        """Digest every tensor of ``table``'s layout as the engine holds it (the base, established)."""
        return {
            name: TensorEntry(entry.dtype, entry.shape, digest_bytes(self.read_tensor(name, entry)))
            for name, entry in sorted(table.items())
        }

    def check(self, delta: Delta) -> str:
        """Every check before the first write. Returns "apply", "resume" or "noop"."""
        m = delta.manifest
        self._begin()
        self.agree(lambda: self._check_local(delta))
        applying = self.state.applying
        if applying is not None:
            if applying["delta_id"] == delta.id or receiver_plan.same_transition(applying, m):
                return "resume"
            raise IncompatibleError(
                f"an apply of the delta to version {applying['target']['version']} was interrupted on this engine; "
                "re-run that delta (or one with the same base and target) to finish it first"
            )
        if self.state.fingerprint is None:
            resident = self.fingerprint_resident(m.tensors)
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
                f"the delta needs base {m.base.version} ({m.base.fingerprint[:16]}…); apply the deltas in "
                "between first"
            )
        return "apply"

    def _check_local(self, delta: Delta) -> None:
        m = delta.manifest
        check_layout_kept(self.model)
        check_resident_layout(self.model)  # repacked, reordered, transposed or padded after loading
        receiver_plan.check_table(m, delta.url)
        for name, entry in m.tensors.items():
            if entry.dtype not in TORCH_DTYPES:
                raise FormatError(f"{name}: unsupported dtype {entry.dtype}")
            self.placement(name, entry)  # rejects what cannot be applied exactly, before any write
        delta.verify_blocks()

    def agree(self, local_check: Callable[[], None]) -> None:
        """Run a check on every rank and fail on all of them if it fails on one (no rank is left waiting)."""
        error: DcrError | None = None
        try:
            local_check()
        except DcrError as exc:
            error = exc
        failures = [e for e in self.exchange(error) if e is not None]
        if failures:
            raise failures[0]

    def _reached(self, version: str, fp: str, table: dict[str, TensorEntry]) -> None:
        self.state.version, self.state.fingerprint, self.state.applying = version, fp, None
        self.state.table = {n: t.to_json() for n, t in table.items()}

    # ------------------------------------------------------------------ apply

    @torch.no_grad()
    def apply(self, delta: Delta) -> ApplyReport:
        started = time.perf_counter()
        m = delta.manifest
        mode = self.check(delta)
        if mode == "noop":
            assert self.state.fingerprint is not None
            return ApplyReport("noop", m.target.version, self.state.fingerprint)
        resuming = mode == "resume"
        base_table = self.state.held_table() if self.state.fingerprint == m.base.fingerprint else None
        try:
            if base_table is not None:
                receiver_plan.check_untouched(m, base_table, delta.url)
            self.agree(lambda: self._first_pass(delta, resuming))
            self.state.applying = {
                "delta_id": delta.id,
                "base": {"version": m.base.version, "fingerprint": m.base.fingerprint},
                "target": {"version": m.target.version, "fingerprint": m.target.fingerprint},
            }
            report = ApplyReport("resumed" if resuming else "applied", m.target.version, m.target.fingerprint)
            for name, items in delta.items_by_tensor():
                placement = self.placement(name, m.tensors[name])
                for item in items:
                    kind, written = self.apply_item(delta, item, placement, resuming)
                    setattr(report, kind, getattr(report, kind) + 1)
                    report.items += 1
                    report.written_elements += written
        finally:
            self._prepared.clear()
            self._prepared_bytes = 0
        # The proof: what was touched (everything, where the base table is unknown) reads back as
        # the target table. Until it does, the engine stays "applying" and no version is recorded.
        names = sorted(receiver_plan.touched(m)) if base_table is not None else sorted(m.tensors)
        digests = {name: digest_bytes(self.read_tensor(name, m.tensors[name])) for name in names}
        bad = receiver_plan.unproven(m, digests)
        if bad:
            raise receiver_plan.proof_failure(m, bad, "vLLM engine")
        self._reached(m.target.version, m.target.fingerprint, m.tensors)
        report.seconds = time.perf_counter() - started
        return report

    def _first_pass(self, delta: Delta, resuming: bool) -> None:
        """Before any write: every item decodes (section digests, frames) and classifies.

        On a fresh apply every item must be at its pre-image: the recorded version says the engine
        is at the base, so an item that is not means the delta does not describe this base or the
        weights were changed by something other than dcr. Resuming may find items done or torn.
        """
        for name, items in delta.items_by_tensor():
            placement = self.placement(name, delta.manifest.tensors[name])
            for item in items:
                digest = self._current(delta, item, placement, keep=True)[0]
                receiver_plan.classify(digest, item, resuming, f"vLLM engine (recorded version {self.state.version})")

    def _prepare(self, delta: Delta, item: Item, placement: Placement) -> Prepared:
        """The item decoded and located on this rank; taken from the check pass when it kept it."""
        kept = self._prepared.pop(id(item), None)
        if kept is not None:
            return kept
        decoded = delta.decode(item)
        positions = decoded.positions if decoded.positions is not None else np.arange(item.region.size)
        located = self.locate(placement, item.region.to_canonical(positions, placement.shape))
        return Prepared(decoded, located, len(positions))

    def _current(self, delta: Delta, item: Item, placement: Placement, keep: bool = False):  # type: ignore[no-untyped-def]
        """(digest of the item's elements as held, or None if replicas disagree; values; decoded; located).

        The values are always read afresh; ``keep`` saves the decoding and locating for the write pass.
        """
        prepared = self._prepare(delta, item, placement)
        if keep and self._prepared_bytes + prepared.nbytes <= PREPARED_BYTES:
            self._prepared[id(item)] = prepared
            self._prepared_bytes += prepared.nbytes
        current, divergent = self.assemble(placement, prepared.count, prepared.located)
        return (None if divergent else digest_bytes(current)), current, prepared.decoded, prepared.located

    def apply_item(self, delta: Delta, item: Item, placement: Placement, resuming: bool) -> tuple[str, int]:
        state, current, decoded, located = self._current(delta, item, placement)
        kind = receiver_plan.classify(state, item, resuming, "vLLM engine")
        if kind == "done":
            return "done", 0
        # Through a widening loader no mask on stored bits carries over: take the absolute values.
        casts = any(d.cast(placement.dtype) for d in placement.destinations)
        if item.op == "xor" and item.repair is None:
            raise IntegrityError(f"{item.tensor}: an xor item needs its repair section, which is missing")
        new = receiver_plan.new_values(
            item, kind, current, decoded.values, lambda: delta.repair_values(item), absolute=casts
        )
        return ("applied" if kind == "pending" else "repaired"), self.write(placement, located, new)

    # ------------------------------------------------------------------ verify

    def verify(self, table: dict[str, TensorEntry] | None = None) -> dict[str, Any]:
        """Read every canonical tensor back through its placement and compare digests."""
        if table is None:
            table = self.state.held_table()
            if table is None:
                raise DcrError("this engine has no recorded version yet; pass the delta to verify against")
        self._begin()
        check_layout_kept(self.model)
        mismatched = []
        for name, entry in sorted(table.items()):
            digest = StreamingDigest()
            digest.update(self.read_tensor(name, entry))
            if digest.hexdigest() != entry.digest:
                mismatched.append(name)
        return {"tensors": len(table), "mismatched": mismatched, "fingerprint": fingerprint(table)}


_NP_INT: dict[int, np.dtype] = {1: np.dtype(np.uint8), 2: np.dtype("<i2"), 4: np.dtype("<i4"), 8: np.dtype("<i8")}


def _np_int(dtype: torch.dtype) -> np.dtype:
    return _NP_INT[dtype.itemsize]


# (exponent bits, mantissa bits) of the float dtypes a loader may widen between.
_FLOAT_BITS = {torch.bfloat16: (8, 7), torch.float16: (5, 10), torch.float32: (8, 23), torch.float64: (11, 52)}


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
    exp_d, man_d = _FLOAT_BITS[dest.dst_dtype]
    exp_s, man_s = _FLOAT_BITS[canonical]
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
