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
from ...format.codec import DecodedItem, apply_values
from ...format.digest import StreamingDigest, digest_bytes
from ...format.manifest import Item, TensorEntry, fingerprint
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
    applying: dict[str, str] | None = None  # {"delta_id", "target"} while an apply is unfinished
    table: dict[str, dict] = field(default_factory=dict)  # target tensor table of the last apply

    def to_json(self) -> dict:
        # Not asdict(): that would deep-copy the whole tensor table only to drop it.
        applying = dict(self.applying) if self.applying is not None else None
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
            flat, index, values = self.flat.numpy(), self.index, want.numpy()
            differs = flat[index] != values
        else:
            flat, index = self.flat, torch.from_numpy(self.index).to(self.flat.device)
            values = want.to(self.flat.device)
            differs = flat[index] != values
        count = int(differs.sum())
        if count:
            _write_elements(flat, index[differs], values[differs])
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
            if applying["delta_id"] == delta.id:
                return "resume"
            raise IncompatibleError(
                f"an apply of the delta to version {applying['target']} was interrupted on this engine; "
                "re-run that delta to finish it first"
            )
        if self.state.fingerprint is None:
            held = fingerprint(self.fingerprint_resident(m.tensors))
            if held == m.target.fingerprint:
                self._reached(m.target.version, held, m.tensors)
            elif held == m.base.fingerprint:
                self.state.version, self.state.fingerprint = m.base.version, held
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
        if fingerprint(m.tensors) != m.target.fingerprint:
            raise FormatError(f"{delta.url}: the tensor table does not match the target fingerprint")
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
        try:
            if mode == "apply":
                self.agree(lambda: self._check_all_pending(delta))
            self.state.applying = {"delta_id": delta.id, "target": m.target.version}
            report = ApplyReport("resumed" if mode == "resume" else "applied", m.target.version, m.target.fingerprint)
            for name, items in delta.items_by_tensor():
                placement = self.placement(name, m.tensors[name])
                for item in items:
                    kind, written = self.apply_item(delta, item, placement)
                    setattr(report, kind, getattr(report, kind) + 1)
                    report.items += 1
                    report.written_elements += written
        finally:
            self._prepared.clear()
            self._prepared_bytes = 0
        self._reached(m.target.version, m.target.fingerprint, m.tensors)
        report.seconds = time.perf_counter() - started
        return report

    def _check_all_pending(self, delta: Delta) -> None:
        """A fresh apply writes nothing unless every item is at its pre-image.

        The recorded version says the engine is at the base; an item that is not means its weights
        were changed by something other than dcr, and the delta would not lead to the target.
        """
        for name, items in delta.items_by_tensor():
            placement = self.placement(name, delta.manifest.tensors[name])
            for item in items:
                if self._current(delta, item, placement, keep=True)[0] != item.pre:
                    raise IncompatibleError(
                        f"{name}: the engine's weights are not the delta's base there although dcr recorded "
                        f"version {self.state.version}; they were changed outside dcr. Nothing was written: "
                        "reload the engine from a checkpoint of a known version"
                    )

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

    def apply_item(self, delta: Delta, item: Item, placement: Placement) -> tuple[str, int]:
        state, current, decoded, located = self._current(delta, item, placement)
        if state == item.post:
            return "done", 0
        casts = any(d.cast(placement.dtype) for d in placement.destinations)
        if item.op == "xor" and casts:
            # Fail closed for XOR through a transforming loader: take the absolute values instead.
            if item.repair is None:
                raise IncompatibleError(
                    f"{item.tensor}: the engine's loader casts this tensor and the item has no repair values; "
                    "diff it with --overwrite for this engine"
                )
            new, kind = delta.repair_values(item), "applied" if state == item.pre else "repaired"
        elif state == item.pre:
            new, kind = apply_values(item.op, current, decoded.values), "applied"
        elif item.op == "xor":
            if item.repair is None:
                raise IntegrityError(f"{item.tensor}: a torn item needs its repair section, which is missing")
            new, kind = delta.repair_values(item), "repaired"
        else:
            new, kind = decoded.values, "repaired"  # overwrite and replace carry absolute values
        if digest_bytes(new) != item.post:
            raise IntegrityError(
                f"{item.tensor} {item.region.to_json()}: computed values do not match the delta's post digest; "
                "the delta is corrupt or the weights changed during the apply"
            )
        return kind, self.write(placement, located, new)

    # ------------------------------------------------------------------ verify

    def verify(self, table: dict[str, TensorEntry] | None = None) -> dict[str, Any]:
        """Read every canonical tensor back through its placement and compare digests."""
        if table is None:
            if not self.state.table:
                raise DcrError("this engine has no recorded version yet; pass the delta to verify against")
            table = {n: TensorEntry(t["dtype"], tuple(t["shape"]), t["digest"]) for n, t in self.state.table.items()}
        self._begin()
        check_layout_kept(self.model)
        mismatched = []
        for name, entry in sorted(table.items()):
            digest = StreamingDigest()
            digest.update(self.read_tensor(name, entry))
            if digest.hexdigest() != entry.digest:
                mismatched.append(name)
        return {"tensors": len(table), "mismatched": mismatched, "fingerprint": fingerprint(table)}


def _np_int(dtype: torch.dtype) -> np.dtype:
    return {1: np.dtype(np.uint8), 2: np.dtype("<i2"), 4: np.dtype("<i4"), 8: np.dtype("<i8")}[dtype.itemsize]


def _to_canonical(held: torch.Tensor, dest: Destination, canonical: torch.dtype) -> torch.Tensor:
    """Integer bits of the canonical dtype for elements held in ``dest`` (undoing a widening cast)."""
    if not dest.cast(canonical):
        return held
    return held.view(dest.dst_dtype).to(canonical).view(int_dtype(canonical))


def _as_uint(values: torch.Tensor) -> np.ndarray:
    array = values.cpu().numpy()
    return array.view(np.dtype(f"<u{array.dtype.itemsize}"))
