"""``dcr apply --into``: update a Hugging Face checkpoint directory in place, crash-safe.

Normative text: format_spec/receiver-checkpoint.md. In short:

* Every check runs before the first byte is written: manifests, file names, the tensor layout,
  the receiver's version (the delta's base), the target table, every data block's digest, and
  a first pass over every item: its sections decode (digests, frames), its current elements are
  classified, and its new values digest to ``post``. On a fresh apply every item must be at its
  pre-image; done and torn items are legitimate only when resuming the same base -> target.
* The one exception is the streaming apply (§4.4), a refit's steady case: a delta of xor items
  onto a receiver whose recorded version is the base. Its items are checked and written in one
  pass, each as soon as its own checks pass (from a store: once its sections have arrived, while
  the rest is still downloading). If a later check fails, the items written are undone (xor
  is its own inverse), proven by their ``pre`` digests, and the receiver is left at its base.
* The receiver's version lives in ``CKPT/.dcr/state.json``, replaced atomically; while a delta
  is being applied it says so ("applying X -> Y"). An exclusive ``flock`` keeps appliers apart.
* Only the affected elements are written, in place, with pwrite (inplace.py).
* Before the state says "at target", the touched tensors are read back and their digests
  compared with the target table: a version is recorded only when the receiver holds it.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np

from ...checkpoints.safetensors_dir import SafetensorsCheckpoint, TensorLocation
from ...delta.reader import Delta, DeltaLike, open_deltas
from ...errors import DcrError, IncompatibleError, IntegrityError, VerifyFailed
from ...format.digest import digest_bytes
from ...format.dtypes import dtype as lookup_dtype
from ...format.kernels import compile_scatter, run_bounds
from ...format.kernels import scatter as scatter_into
from ...format.manifest import Item, Manifest, TensorEntry, fingerprint
from ...io.gc_pause import fewer_collections, no_collections
from ...io.pool import Inline, check_workers, default_workers, ordered_parallel
from .. import plan as receiver_plan
from .batch import Batch, prepare_batch
from .inplace import BATCH_BYTES as DIGEST_BATCH_BYTES
from .inplace import BATCH_TENSORS as DIGEST_BATCH_TENSORS
from .inplace import (
    SMALL_DIGEST_BYTES,
    SMALL_TENSOR_BYTES,
    InPlaceFiles,
    Run,
    digest_small,
    digest_small_tensors,
    digest_tensors,
    runs_of,
)
from .state import (
    HISTORY_LENGTH,
    ReceiverState,
    explain_enospc,
    file_stats,
    read_recorded_table,
    read_state,
    receiver_lock,
    ref,
    same_files,
    state_dir,
    write_recorded_table,
    write_state,
)

# Memory the first pass may keep for the write pass (the checked-first order, receiver-checkpoint.md
# §4.1 step 6): each item staged compactly, as the vLLM receiver stages it: only the elements that
# change, their new bits in the storage width and 32-bit element indices (6 bytes a BF16 element),
# plus its runs. A 3% step of a 3 GiB BF16 model (48 M changed elements) stages in 288 MiB, a 3% step
# of a 10 GiB one still fits, and a receiver sized for the vLLM receiver (the same 1 GiB) fits this
# one. Items beyond it are read, decoded and verified again when they are written, so memory stays
# this budget plus the items in flight (O(largest item)) whatever the model's size.
PREPARED_BYTES = 1 << 30
# What the budget counts for one Run kept with a staged item (a slotted object of four ints).
RUN_COST = 176
INDEX32 = np.iinfo(np.int32).max  # a tensor of at most this many elements is staged with 32-bit indices
T = TypeVar("T")
# Items are checked and written in batches of consecutive ones (see item_batches): an item of
# BATCH_ELEMENTS or more is a task of its own; smaller ones go together until they cover
# BATCH_COVER elements or number BATCH_ITEMS.
BATCH_ELEMENTS = 1 << 16
BATCH_COVER = 1 << 18
BATCH_ITEMS = 512


# --------------------------------------------------------------------------- results


@dataclass
class ItemCounts:
    done: int = 0  # already at the post-image: skipped
    applied: int = 0  # at the pre-image: the delta was applied
    repaired: int = 0  # torn: rewritten with absolute target values
    changed_elements: int = 0

    def add(self, kind: str, elements: int) -> None:
        if kind == "done":
            self.done += 1
            return
        if kind == "pending":
            self.applied += 1
        elif kind == "torn":
            self.repaired += 1
        else:
            raise ValueError(f"unknown item outcome {kind!r}")
        self.changed_elements += elements


@dataclass
class StepResult:
    delta: str
    delta_id: str
    base_version: str
    target_version: str
    status: str  # "applied" | "resumed"
    items: int
    done: int
    applied: int
    repaired: int
    changed_elements: int
    seconds: float
    proof_seconds: float = 0.0  # reading back the touched tensors before recording the target


@dataclass
class ApplyResult:
    checkpoint: str
    version: str
    fingerprint: str
    steps: list[StepResult]
    skipped: list[str]  # deltas already applied
    message: str
    verified: dict | None = None  # with verify: the report (VerifyReport.to_json), as dcr verify --json prints it
    fetched_early: int = 0  # blocks fetched while the receiver waited for the version (store-v1 §4.6)

    @property
    def noop(self) -> bool:
        return not self.steps

    def to_json(self) -> dict:
        return {**asdict(self), "noop": self.noop}


# --------------------------------------------------------------------------- opening and checking deltas


def expand_deltas(deltas: DeltaLike | Sequence[DeltaLike]) -> list[Delta]:
    """Open deltas given as paths/URLs or Delta objects (a local directory of deltas expands to its
    children); a delta given twice counts once."""
    unique: dict[str, Delta] = {}
    for d in open_deltas(deltas):
        unique.setdefault(d.id, d)
    return list(unique.values())


def check_delta(delta: Delta) -> None:
    """Everything about a delta that can be checked without the receiver: manifest table, block digests."""
    receiver_plan.check_table(delta.manifest, delta.url)
    delta.prefetch_blocks(("data",))  # from a store: fetched once, in the background, while the first pass reads
    delta.check_repair_blocks()  # optional; local ones must be intact, a store's are fetched only if needed


def check_layout(delta: Delta, ckpt: SafetensorsCheckpoint, root: Path) -> None:
    """Format v1 deltas keep the layout: the checkpoint must hold exactly the delta's tensors, dtypes and shapes."""
    tensors = delta.manifest.tensors
    for name, entry in sorted(tensors.items()):
        loc = ckpt.tensors.get(name)
        if loc is None:
            raise IncompatibleError(f"tensor {name!r} of {delta.url} is missing from {root}")
        if (loc.dtype, loc.shape) != (entry.dtype, tuple(entry.shape)):
            raise IncompatibleError(
                f"tensor {name!r} is {loc.dtype}{list(loc.shape)} in {root} but "
                f"{entry.dtype}{list(entry.shape)} in {delta.url}"
            )
    extra = sorted(set(ckpt.tensors) - set(tensors))
    if extra:
        raise IncompatibleError(f"tensor {extra[0]!r} of {root} is not in {delta.url} ({len(extra)} such)")
    for file in sorted({loc.file for loc in ckpt.tensors.values()}):
        links = file.stat().st_nlink
        if links > 1:
            # An in-place write would change every other name of the file too (cp -al snapshots, caches).
            raise IncompatibleError(
                f"{file} has {links} hard links; applying in place would change the other copies too: "
                "replace it with a private copy (cp --reflink=auto) first"
            )


# --------------------------------------------------------------------------- items


@dataclass(slots=True)
class Prepared:
    """An item after the first pass: its outcome, and (within the budget) what to write."""

    kind: receiver_plan.Kind
    count: int
    index: np.ndarray | slice | None = None
    runs: list[Run] | None = None
    new: np.ndarray | None = None
    batch: Batch | None = None  # an item of a batch prepared together (batch.py): written with it

    @property
    def nbytes(self) -> int:
        held = [a for a in (self.index, self.new) if isinstance(a, np.ndarray)]
        return sum(a.nbytes for a in held) + RUN_COST * len(self.runs or ())

    def drop(self) -> Prepared:
        return Prepared(self.kind, self.count)


def staged(
    kind: receiver_plan.Kind,
    count: int,
    index: np.ndarray | slice,
    runs: list[Run],
    current: np.ndarray,
    new: np.ndarray,
    numel: int,
) -> Prepared:
    """An item's outcome, ready to write, in its compact form: at sorted canonical ``index`` only the
    elements whose new bits differ from ``current`` (an overwrite item's carried value, a torn item's
    element already written, may not), their runs renumbered to what is left (a run keeps its span,
    inside the item's region; one left empty goes), and 32-bit indices where the tensor allows them.
    A contiguous whole range (a ``replace`` item) stays as it is: its new values are written whole."""
    if not isinstance(index, np.ndarray):
        return Prepared(kind, count, index, runs, new)
    differs = current != new
    if not bool(differs.all()):
        at = np.zeros(differs.size + 1, dtype=np.int64)
        np.cumsum(differs, out=at[1:])
        keep = np.flatnonzero(differs)
        index, new = index[keep], new[keep]
        runs = [Run(r.first, r.last, lo, hi) for r in runs if (lo := int(at[r.lo])) < (hi := int(at[r.hi]))]
    if numel <= INDEX32 and index.dtype != np.int32:
        index = index.astype(np.int32)
    return Prepared(kind, count, index, runs, np.ascontiguousarray(new))


def _repair(delta: Delta, item: Item) -> np.ndarray:
    assert item.repair is not None
    if not delta.has_block(delta.manifest.blocks[item.repair.block]):
        raise delta.source.missing_repair(  # exit 4 if the store's push is still uploading it, else 2
            f"{receiver_plan.quote(item.tensor)}: an interrupted write left this item torn and its repair block is "
            "not here"
        )
    return delta.repair_values(item)


@dataclass(slots=True)
class _Located:
    """An item's decoded data (section digest and frames checked) and its current elements in the files."""

    values: np.ndarray
    index: np.ndarray | slice
    runs: list[Run]
    current: np.ndarray
    digest: str


def _place(delta: Delta, item: Item, files: InPlaceFiles) -> tuple[np.ndarray, np.ndarray | slice, list[Run]]:
    """An item's decoded values (section digest and frames checked), its canonical index and runs."""
    loc = files.locations[item.tensor]
    decoded = delta.decode(item)
    index = receiver_plan.canonical_index(item.region, decoded.positions, loc.shape)
    runs: list[Run] = []
    if isinstance(index, np.ndarray):
        local, stride = None, 1  # a flat range is one contiguous stretch of the tensor
        if item.region.is_box:
            local = decoded.positions if decoded.positions is not None else np.arange(item.region.size)
            stride = receiver_plan.contiguous_run(item.region, loc.shape)
        runs = runs_of(index, local, stride, decoded.values.dtype.itemsize)
    return decoded.values, index, runs


def _locate(delta: Delta, item: Item, files: InPlaceFiles) -> _Located:
    values, index, runs = _place(delta, item, files)
    current = files.gather(item.tensor, index, runs)
    return _Located(values, index, runs, current, _digest(current))


def stream_item(delta: Delta, item: Item, files: InPlaceFiles, writing: Callable[[], None]) -> Prepared:
    """``prepare_item`` of a pending item and its write, with one read of its runs (``hold_runs``): the
    streaming apply's items of a task of their own (up to 16 MiB each), their bytes still in cache.
    ``writing()`` is called once every check has passed, just before the first write (it may raise)."""
    values, index, runs = _place(delta, item, files)
    if not isinstance(index, np.ndarray):  # a whole range: read, then written whole
        at = _Located(values, index, runs, files.gather(item.tensor, index, runs), "")
        buf = None
    else:
        buf, where = files.hold_runs(item.tensor, index, runs)
        at = _Located(values, index, runs, buf[where], "")
    at.digest = _digest(at.current)
    if at.digest != item.pre:
        receiver_plan.classify(at.digest, item, False, f"{files.locations[item.tensor].file.parent}")  # raises
    new = receiver_plan.new_values(item, "pending", at.current, values, lambda: _repair(delta, item))
    writing()
    if buf is None:
        files.scatter(item.tensor, index, runs, new)
    else:
        scatter_into(buf, where, np.ascontiguousarray(new, dtype=buf.dtype))
        files.write_held(item.tensor, runs, buf)
    return Prepared("pending", item.count)


def _check_not_replaced(files: InPlaceFiles, root: Path, *, written: bool) -> None:
    """Refuse to go on (or to record the target) once another writer has renamed a file over one this apply
    opened: its writes and its proof went to a file that is no longer the checkpoint's."""
    moved = files.replaced()
    if moved:
        when = "while dcr apply wrote it; nothing is recorded" if written else "before dcr apply wrote it"
        raise IntegrityError(
            f"{moved[0]} was replaced by another writer {when} ({len(moved)} such): stop whatever else writes "
            f"{root}, then re-run the same dcr apply"
        )


def _digest(values: np.ndarray) -> str:
    return digest_small(values) if values.nbytes <= SMALL_DIGEST_BYTES else digest_bytes(values)


def prepare_item(delta: Delta, item: Item, files: InPlaceFiles, resuming: bool) -> Prepared:
    """Decode (section digest, frames), read the current elements, classify, compute and check new values."""
    at = _locate(delta, item, files)
    index, runs, current, current_digest = at.index, at.runs, at.current, at.digest
    if current_digest == item.pre:  # the common case, decided as classify decides it
        kind: receiver_plan.Kind = "pending"
    else:
        kind = receiver_plan.classify(current_digest, item, resuming, f"{files.locations[item.tensor].file.parent}")
    if kind == "done":
        return Prepared(kind, item.count)
    new = receiver_plan.new_values(item, kind, current, at.values, lambda: _repair(delta, item))
    return staged(kind, item.count, index, runs, current, new, files.locations[item.tensor].numel)


def prepare_items(
    delta: Delta, items: Sequence[Item], files: InPlaceFiles, resuming: bool, lo: int = -1
) -> list[Prepared]:
    """``prepare_item`` of consecutive items, their data sections read together first (``Delta.preread``).
    Items [lo, lo + len) of the manifest (lo >= 0) are first tried as one batch (batch.py): the same
    checks and new values, in one compiled call; where it declines, item by item."""

    def what(i: int) -> str:
        return f"{items[i].tensor} {items[i].region.to_json()}"

    if lo >= 0:
        batch = prepare_batch(delta, items, lo, files, what)
        if batch is not None:
            return [Prepared("pending", item.count, batch=batch) for item in items]
    delta.preread([it.data for it in items], what)
    return [prepare_item(delta, item, files, resuming) for item in items]


def _scatter(files: InPlaceFiles, item: Item, p: Prepared) -> None:
    assert p.index is not None and p.new is not None
    files.scatter(item.tensor, p.index, p.runs or [], p.new)


class _Cancelled(Exception):
    """An item not written because another one failed first."""


def item_batches(items: Sequence[Item]) -> Iterator[tuple[int, int, bool]]:
    """Consecutive items as [lo, hi) index ranges, one task each, and whether it is a batch of small
    items: those (an MoE delta has 100k items of a few KiB) go together until they cover BATCH_COVER
    elements or number BATCH_ITEMS; an item of BATCH_ELEMENTS or more is a task of its own. Items are
    handled in the same order either way."""
    lo, covered = 0, 0
    for i, item in enumerate(items):
        size = item.region.size
        if size >= BATCH_ELEMENTS:
            if lo < i:
                yield lo, i, True
            yield i, i + 1, False
            lo, covered = i + 1, 0
            continue
        covered += size
        if covered >= BATCH_COVER or i + 1 - lo >= BATCH_ITEMS:
            yield lo, i + 1, True
            lo, covered = i + 1, 0
    if lo < len(items):
        yield lo, len(items), True


def _task(fn: Callable[[], T], small: bool) -> Callable[[], T]:
    """Small items hold the GIL throughout: their batch runs on the consuming thread (pool.Inline)."""
    return Inline(fn) if small else fn


def first_pass(delta: Delta, files: InPlaceFiles, resuming: bool, workers: int) -> list[Prepared]:
    """Every check of delta-v1 §7.2 for every item, before the first write; keeps what fits the budget."""
    with no_collections():  # a few objects per item, alive until the writes and without cycles: nothing to collect
        return _first_pass(delta, files, resuming, workers)


def _first_pass(delta: Delta, files: InPlaceFiles, resuming: bool, workers: int) -> list[Prepared]:
    items = delta.manifest.items

    def task(lo: int, hi: int, small: bool) -> Callable[[], list[Prepared]]:
        return _task(lambda: prepare_items(delta, items[lo:hi], files, resuming, lo if small else -1), small)

    out: list[Prepared] = []
    kept = 0
    for batch in ordered_parallel((task(*b) for b in item_batches(items)), workers):
        together = batch[0].batch if batch else None
        if together is not None:  # a batch prepared as one: kept or dropped as one
            together.compact()
            nbytes = together.nbytes
            if kept + nbytes <= PREPARED_BYTES:
                kept += nbytes
            else:
                together.drop()
            out.extend(batch)
            continue
        for prepared in batch:
            nbytes = prepared.nbytes
            if kept + nbytes <= PREPARED_BYTES:
                kept += nbytes
                out.append(prepared)
            else:
                out.append(prepared.drop())
    return out


def write_items(
    delta: Delta, prepared: list[Prepared], files: InPlaceFiles, resuming: bool, workers: int
) -> Iterator[Prepared]:
    """Write every item that is not done, on a pool (at most 2 x workers in flight); yields outcomes in order.

    On the first failure, items not yet written are cancelled (a failed write stops the apply
    promptly); once every running write has finished, the first real error is raised.
    """
    failed = threading.Event()
    items = delta.manifest.items
    if len(prepared) != len(items):
        raise ValueError("one prepared outcome per item")

    def run(item: Item, first: Prepared) -> Prepared:
        try:
            p = first
            if p.kind != "done" and p.new is None:  # beyond the budget: read and verify it again
                p = prepare_item(delta, item, files, resuming)
            if p.kind == "done":
                return p
            if failed.is_set():
                raise _Cancelled
            _scatter(files, item, p)
            return p
        except _Cancelled:
            raise
        except BaseException:
            failed.set()
            raise

    def run_together(lo: int, hi: int, together: Batch) -> list[Prepared] | None:
        """A batch prepared as one (batch.py), prepared again if it was dropped; None: item by item."""
        try:
            if together.new is None:
                again = prepare_batch(
                    delta, items[lo:hi], lo, files, lambda i: f"{items[lo + i].tensor} {items[lo + i].region.to_json()}"
                )
                if again is None:  # no longer what the first pass found: the per-item path says why
                    return None
                together = again
            if failed.is_set():
                raise _Cancelled
            together.write(files, failed.is_set)
            if failed.is_set():
                raise _Cancelled
            return prepared[lo:hi]
        except _Cancelled:
            raise
        except BaseException:
            failed.set()
            raise

    def run_batch(lo: int, hi: int) -> list[Prepared]:
        together = prepared[lo].batch
        if together is not None and (together.lo, together.hi) == (lo, hi):
            done = run_together(lo, hi, together)
            if done is not None:
                return done
            return [run(items[i], Prepared("pending", items[i].count)) for i in range(lo, hi)]  # prepared again
        return [run(items[i], prepared[i]) for i in range(lo, hi)]  # stops at the first failure

    error: BaseException | None = None
    window: deque[Future[list[Prepared]]] = deque()
    pool = ThreadPoolExecutor(max_workers=workers)

    def settle(future: Future[list[Prepared]]) -> list[Prepared]:
        nonlocal error
        try:
            return future.result()
        except _Cancelled:
            return []
        except BaseException as exc:
            error = error or exc
            return []

    try:
        for lo, hi, _small in item_batches(items):
            if failed.is_set():
                break
            window.append(pool.submit(run_batch, lo, hi))
            while len(window) >= 2 * workers:
                outcomes = settle(window.popleft())
                if error is None:
                    yield from outcomes
        while window:
            outcomes = settle(window.popleft())
            if error is None:
                yield from outcomes
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    if error is not None:
        raise error


# --------------------------------------------------------------------------- streaming


def streams(delta: Delta, prior: ReceiverState | None, resumed: bool) -> bool:
    """Whether the items may be written as they are checked, each as soon as its sections have arrived
    (receiver-checkpoint.md §4.4): a fresh apply of xor items onto a receiver whose recorded version is
    the delta's base. Every item written can then be undone exactly (xor is its own inverse), so a
    check that fails later (a block that arrives corrupt, an item not at its pre-image) leaves the
    receiver proven at its base again, with nothing lost."""
    m = delta.manifest
    return (
        not resumed
        and prior is not None
        and prior.applying is None
        and prior.fingerprint == m.base.fingerprint
        and all(item.op == "xor" for item in m.items)
    )


class _Written:
    """The item ranges [lo, hi) a streaming pass started writing: all an undo has to look at."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.ranges: list[tuple[int, int]] = []

    def add(self, lo: int, hi: int) -> None:
        with self._lock:
            self.ranges.append((lo, hi))


def stream_items(delta: Delta, files: InPlaceFiles, workers: int, written: _Written) -> Iterator[Prepared]:
    """Check and write every item in one pass, on the pool: each batch is written by the task that
    checked it, as soon as its sections have arrived and passed every check of delta-v1 §7.2 (its
    bytes still in cache, and nothing held for a second pass). Yields outcomes in item order.

    On the first failure the tasks not yet writing stop; every task has finished when the first
    real error is raised (``ordered_parallel`` waits for its pool), so ``written`` is then final."""
    items = delta.manifest.items
    failed = threading.Event()
    errors: list[BaseException] = []

    def writing(lo: int, hi: int) -> None:
        """Items [lo, hi) passed every check: stop here if another task failed, else log them for an undo
        (which reads their sections again: the fetcher keeps what arrived, whatever the rest of a block)."""
        if failed.is_set():
            raise _Cancelled
        written.add(lo, hi)

    def task(lo: int, hi: int, small: bool) -> Callable[[], list[Prepared]]:
        def run() -> list[Prepared]:
            try:
                if failed.is_set():
                    raise _Cancelled
                if not small:  # an item of its own: checked and written with one read of its elements
                    return [stream_item(delta, items[lo], files, lambda: writing(lo, hi))]
                prepared = prepare_items(delta, items[lo:hi], files, False, lo)
                writing(lo, hi)
                together = prepared[0].batch if prepared else None
                if together is not None:  # written whole: a batch stopped between writes would tear items
                    together.write(files, lambda: False)
                else:
                    for item, p in zip(items[lo:hi], prepared, strict=True):
                        _scatter(files, item, p)
                return [Prepared(p.kind, p.count) for p in prepared]
            except _Cancelled:
                raise
            except BaseException as exc:
                errors.append(exc)
                failed.set()
                raise

        return _task(run, small)

    try:
        with no_collections():  # as in first_pass
            for outcomes in ordered_parallel((task(*b) for b in item_batches(items)), workers):
                yield from outcomes
    except _Cancelled:
        raise errors[0] from None


def _undo_item(delta: Delta, item: Item, files: InPlaceFiles) -> bool:
    """Bring one xor item back to its pre-image, proven by its digest; False where it already is.

    At ``post`` its elements are xored with the mask again; torn (a write cut short), each element
    holds its base or its target value, and the base is the target (the repair values) xor the mask."""
    at = _locate(delta, item, files)
    if at.digest == item.pre:
        return False
    target = at.current if at.digest == item.post else _repair(delta, item)
    base = receiver_plan.apply_values("xor", target, at.values)
    if _digest(base) != item.pre:
        raise IntegrityError(
            f"{receiver_plan.quote(item.tensor)} {item.region.to_json()}: its undone values do not match the "
            "delta's pre digest"
        )
    files.scatter(item.tensor, at.index, at.runs, base)
    return True


def _roll_back(
    root: Path, delta: Delta, files: InPlaceFiles, written: _Written, prior: ReceiverState, error: Exception
) -> Exception:
    """After a failed streaming pass: undo what it wrote, make that durable, record the base again.

    Returns the error to raise: ``error`` itself when nothing had been written (the state file is
    then rewritten exactly as it was), else one of the same kind (OSError keeps its errno) whose
    message also says what became of the receiver: back at its base, or, if the undo failed too
    (a write error, a repair block not there), left "applying" as after a crash, for a re-run of the
    same apply (with the delta whole) to finish."""
    items = delta.manifest.items
    undone = 0
    try:
        for lo, hi in sorted(written.ranges):
            for item in items[lo:hi]:
                undone += _undo_item(delta, item, files)
        if undone:
            files.sync()
            with SafetensorsCheckpoint(root) as ckpt:
                prior = ReceiverState(prior.version, prior.fingerprint, None, file_stats(root, ckpt), prior.history)
        write_state(root, prior)
    except Exception as exc:
        return _restated(
            error,
            f"the items already written could not be undone ({one_line_of(exc)}): {root} is left in the middle of "
            f"applying {delta.url}; re-run the same dcr apply once the delta is whole to finish it",
        )
    if not undone:
        return error
    return _restated(error, f"the {undone} items written were undone: {root} is back at version {prior.version}")


def one_line_of(exc: BaseException) -> str:
    text = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    return " ".join(text.split()) or type(exc).__name__


def _restated(error: Exception, outcome: str) -> Exception:
    """``error`` with ``outcome`` in place of a "Nothing was written" it may end with (no longer the whole
    truth), or after it; of the same class, where that class takes a message (else ``error``)."""
    if isinstance(error, OSError):
        text = f"{error.strerror or error}; {outcome}"
        return type(error)(error.errno, text, error.filename) if error.errno is not None else OSError(text)
    if not isinstance(error, DcrError):
        return error
    message = re.sub(r"[.;]?\s*Nothing was written\.?$", "", str(error))
    try:
        return type(error)(f"{message}; {outcome}")
    except TypeError:  # an error class with another constructor: its own message
        return error


# --------------------------------------------------------------------------- apply


@dataclass
class _Start:
    fingerprint: str
    version: str
    table: dict[str, TensorEntry] | None  # the receiver's table, where known
    resume: Delta | None
    history: list[str]
    recorded: bool = False  # the version is the state's, for files it describes (not just hashed)


def _establish(
    root: Path,
    ckpt: SafetensorsCheckpoint,
    files: InPlaceFiles,
    opened: list[Delta],
    workers: int,
    say: Callable[[str], None],
) -> tuple[_Start, ReceiverState | None]:
    """The receiver's version: from the state where the files are the ones it describes, else by hashing."""
    state = read_state(root)
    now = file_stats(root, ckpt)
    if state is not None and state.applying is not None:
        a = state.applying
        resume = next((d for d in opened if d.id == a["delta_id"]), None) or next(
            (d for d in opened if receiver_plan.same_transition(a, d.manifest)), None
        )
        if resume is None:
            raise IncompatibleError(
                f"{root} is in the middle of applying delta {a['delta_id'][:16]}… "
                f"({a['base'].get('version')} -> {a['target'].get('version')}); "
                "re-run dcr apply with that delta (or one with the same base and target) to finish it"
            )
        base = resume.manifest.base
        if same_files(state.files, now):
            table = read_recorded_table(root, base.fingerprint)
            return _Start(base.fingerprint, base.version, table, resume, list(state.history)), state
        say(f"{root}: the files of the interrupted apply were replaced since; re-hashing")
        # Replaced (say, renamed over by another writer while the apply ran): the apply resumes where every
        # tensor no item touches still holds its base digest and every tensor of a replaced file holds its
        # base or its target digest (another writer's copy of either end; only the files dcr itself was
        # writing may hold torn items). Each item is then classified by its own digests (done, pending,
        # or torn: rewritten with its absolute target values) and the proof covers every touched tensor,
        # as after a crash. Anything else (a replaced file of another version) is hashed as it stands.
        table = digest_tensors(files, workers)
        base_table = read_recorded_table(root, base.fingerprint)
        target_table = resume.manifest.tensors
        untouched = set(resume.manifest.tensors) - receiver_plan.touched(resume.manifest)
        replaced = _replaced_files(state.files, now)
        in_replaced = [n for n, loc in ckpt.tensors.items() if os.path.relpath(loc.file, root.resolve()) in replaced]

        held = {n: e.digest for n, e in table.items()}
        base_digests = {n: e.digest for n, e in (base_table or {}).items()}

        def at_base(n: str) -> bool:
            return n in held and held[n] == base_digests.get(n)

        def at_an_end(n: str) -> bool:
            return at_base(n) or (n in held and n in target_table and held[n] == target_table[n].digest)

        if base_table is not None and all(at_base(n) for n in untouched) and all(at_an_end(n) for n in in_replaced):
            return _Start(base.fingerprint, base.version, base_table, resume, list(state.history)), state
        fp = fingerprint(table)
        return _Start(fp, _label(fp, opened), table, None, []), state
    elif state is not None and state.fingerprint and state.files == now:
        table = read_recorded_table(root, state.fingerprint)
        return _Start(
            state.fingerprint, state.version or state.fingerprint[:16], table, None, list(state.history), True
        ), state
    elif state is not None:
        say(f"{root}: files changed since dcr last recorded a version; re-hashing")
    # Whatever wrote the files, dcr's record of earlier versions no longer holds.
    table = digest_tensors(files, workers)
    fp = fingerprint(table)
    return _Start(fp, _label(fp, opened), table, None, []), state


def _replaced_files(recorded: dict[str, list[int]], now: dict[str, list[int]]) -> set[str]:
    """The files (relative names) that are not the ones recorded: another name, size or inode, or new."""
    return {
        name for name, st in now.items()
        if len(recorded.get(name) or ()) != 4 or (recorded[name][0], recorded[name][3]) != (st[0], st[3])
    }  # fmt: skip


def warm_up() -> None:
    """Load what the first item's decode would load (zstd contexts, the compiled kernels from numba's
    on-disk cache) by decoding tiny sections made here: a receiver that waits for a version
    (``apply --wait``) does it before it starts waiting, so the first item of the refit does not."""
    from ...format import codec

    positions = np.array([0, 3, 300], dtype=np.int64)
    codec.decode_positions(codec.encode_positions(positions), len(positions), 1000, "warm-up")
    for name in ("BF16", "F32", "F64"):
        dt = lookup_dtype(name)
        values = np.arange(4, dtype=dt.uint)
        codec.decode_values(codec.encode_values(values), len(values), dt, "warm-up")
    # The writes' kernels for every element width (compile_writes loads those a delta needs once it
    # is published: tenths of a second on the refit's critical path, unless they are loaded now).
    for uint in (np.uint8, np.uint16, np.uint32, np.uint64):
        compile_scatter(np.dtype(uint))
    run_bounds(positions, None, 1, 1, 1 << 20)  # how items split into runs, with and without stretches
    run_bounds(positions, positions, 2, 1, 1 << 20)


@fewer_collections()
def apply(
    deltas: DeltaLike | Sequence[DeltaLike],
    *,
    into: str | os.PathLike[str],
    workers: int | None = None,
    verify: bool = False,
    log: Callable[[str], None] | None = None,
) -> ApplyResult:
    """Bring checkpoint directory ``into`` to the target of ``deltas``, in place.

    ``deltas`` is one delta (path, URL or :class:`Delta`), several (applied as a chain ordered by
    base -> target from the checkpoint's current version), or a local directory of deltas.
    Deltas already applied are skipped. A crash at any point is recovered by calling this again
    with the same deltas (or any with the same base and target). ``verify`` then checks every tensor
    against the target table, still under the lock, as ``dcr verify`` does: the tensors the apply's
    proof read back after its writes with the digests it computed, every other tensor by reading it.
    """
    check_workers(workers)
    root = Path(into)
    if not root.is_dir():
        raise IncompatibleError(f"{root} is not a checkpoint directory")
    workers = workers or default_workers()
    say = log or (lambda _msg: None)
    opened = expand_deltas(deltas)
    # Digests of tensors read back after their last write in this call, under the lock (the proofs):
    # --verify does not read them again.
    read_back: dict[str, str] = {}
    SafetensorsCheckpoint(root).close()  # a readable checkpoint (headers, names) before .dcr/ is created
    with receiver_lock(root), SafetensorsCheckpoint(root) as ckpt:
        # v1 deltas keep the layout, so every delta given must match it; checking first names the
        # missing or reshaped tensor instead of reporting a mere fingerprint mismatch.
        for d in opened:
            check_layout(d, ckpt, root)
        for stale in state_dir(root).glob(".*.tmp-*"):  # left by a writer killed mid-replace
            stale.unlink(missing_ok=True)
        locations = dict(ckpt.tensors)
        with InPlaceFiles(locations) as reader:
            start, state = _establish(root, ckpt, reader, opened, workers, say)
        plan, behind = receiver_plan.order_chain(opened, start.fingerprint, start.resume, start.history)
        history = start.history
        if not plan:
            stats = file_stats(root, ckpt)
            if state is None or state.fingerprint != start.fingerprint or state.files != stats:
                table = start.table or _table_for(start.fingerprint, opened)
                if table is None:
                    with InPlaceFiles(locations) as reader:
                        table = digest_tensors(reader, workers)
                write_recorded_table(root, table)
                write_state(root, ReceiverState(start.version, start.fingerprint, None, stats, history))
            message = f"{root}: already at version {start.version}; nothing to apply"
            if behind:
                message += f" ({', '.join(d.url for d in behind)} applied before)"
            say(message)
            result = ApplyResult(str(root), start.version, start.fingerprint, [], [d.url for d in behind], message)
        else:
            _check_plan(plan, start.table)
            ckpt.close()
            steps: list[StepResult] = []
            base_table = start.table
            recorded = start.recorded  # each later step starts from the state the one before recorded
            for d in plan:
                step, digests = _apply_one(
                    root, d, locations, workers, history, base_table, resumed=d is start.resume, recorded=recorded
                )
                recorded = True
                steps.append(step)
                read_back.update(digests)  # a later step's proof replaces an earlier one's for what it touched
                base_table = d.manifest.tensors
                step = steps[-1]
                say(
                    f"{root}: {step.status} {step.base_version} -> {step.target_version}: "
                    f"{step.applied} items applied, {step.repaired} repaired, {step.done} already done "
                    f"({step.changed_elements:,} elements, {step.seconds:.2f}s)"
                )
            final = plan[-1].manifest.target
            result = ApplyResult(
                str(root),
                final.version,
                final.fingerprint,
                steps,
                [d.url for d in behind],
                f"{root}: now at version {final.version}",
            )
        if verify:  # still under the lock: nobody can change the files between apply and verify
            from ..verify import verify as verify_checkpoint

            against = plan[-1] if plan else None
            report = verify_checkpoint(root, against=against, workers=workers, read_back=read_back)
            if not report.ok:
                raise VerifyFailed(report.summary())
            result.verified = report.to_json()
            say(report.summary())
    return result


def compile_writes(m: Manifest) -> None:
    """Compile (or load from numba's cache) the scatter kernel the writes use (``kernels.scatter``) for
    every element width the delta writes, and bytes for batches, before the first write: no write
    then waits for the compiler."""
    widths = {lookup_dtype(m.tensors[name].dtype).uint for name in receiver_plan.touched(m)}
    for uint in sorted(widths | {np.dtype(np.uint8)}, key=lambda d: d.itemsize):
        compile_scatter(uint)


def _check_plan(plan: list[Delta], start_table: dict[str, TensorEntry] | None) -> None:
    """Before the first write: every delta's table and blocks, its untouched tensors, every later delta's sections."""
    base_table = start_table
    for k, d in enumerate(plan):
        check_delta(d)
        if base_table is not None:
            receiver_plan.check_untouched(d.manifest, base_table, d.url)
        if k:  # the first delta's items are checked (and classified) by its first pass
            for item in d.manifest.items:
                d.decode(item)
            d.verify_blocks(("data",))
        base_table = d.manifest.tensors


def _label(fp: str, deltas: list[Delta]) -> str:
    for d in deltas:
        for version in (d.manifest.base, d.manifest.target):
            if version.fingerprint == fp:
                return version.version
    return fp[:16]


def _table_for(fp: str, deltas: list[Delta]) -> dict[str, TensorEntry] | None:
    return next((d.manifest.tensors for d in deltas if d.manifest.target.fingerprint == fp), None)


class _Proof:
    """The read-back proof and the fsyncs, overlapped with the write pass.

    ``written(i)`` is called with each item's index once its outcome is in (every item up to it has
    then been written: write_items yields in order). A tensor whose last item that is gets digested
    on a pool of its own, read back from the file, while later items are still being written; a file
    whose last item that is gets fsynced in the background. ``finish`` digests what is left (the
    untouched tensors, where the base table is unknown), waits for every digest and fsync, and fsyncs
    every written file once more (``files.sync``: nothing is left dirty by then, so it costs little and
    does not depend on this bookkeeping). Nothing here writes; the state is written by the caller
    after ``finish``, so a crash at any instant still leaves "applying" or the proven target.
    """

    def __init__(self, files: InPlaceFiles, items: Sequence[Item], names: Sequence[str], workers: int) -> None:
        self.files = files
        self.names = list(names)
        wanted = set(names)
        last_tensor: dict[str, int] = {}
        last_file: dict[Path, int] = {}
        for i, item in enumerate(items):
            last_tensor[item.tensor] = i
            last_file[files.locations[item.tensor].file] = i
        self._tensors_at: dict[int, list[str]] = {}
        for name, i in last_tensor.items():
            if name in wanted:
                self._tensors_at.setdefault(i, []).append(name)
        self._files_at: dict[int, list[Path]] = {}
        for file, i in last_file.items():
            self._files_at.setdefault(i, []).append(file)
        self._digest_pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="dcr-proof")
        self._sync_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dcr-fsync")
        self._digests: list[Future[list[tuple[str, str]]]] = []
        self._syncs: list[Future[None]] = []
        self._batch: list[str] = []
        self._batch_bytes = 0
        self._submitted: set[str] = set()

    def written(self, i: int) -> None:
        for name in self._tensors_at.get(i, ()):
            self._add(name)
        for file in self._files_at.get(i, ()):
            self._syncs.append(self._sync_pool.submit(self.files.sync_file, file))

    def _add(self, name: str) -> None:
        """Small tensors are digested in batches (a task per tensor of a few KiB costs more than its hash)."""
        self._submitted.add(name)
        size = self.files.locations[name].nbytes
        if size > SMALL_TENSOR_BYTES:
            self._submit([name])
            return
        self._batch.append(name)
        self._batch_bytes += size
        if self._batch_bytes >= DIGEST_BATCH_BYTES or len(self._batch) >= DIGEST_BATCH_TENSORS:
            self._flush()

    def _flush(self) -> None:
        if self._batch:
            files, names = self.files, self._batch
            locations = files.locations
            names.sort(key=lambda n: (str(locations[n].file), locations[n].start))  # file order: one read a stretch
            self._digests.append(self._digest_pool.submit(digest_small_tensors, files, names))
            self._batch, self._batch_bytes = [], 0

    def _submit(self, names: list[str]) -> None:
        files = self.files
        self._digests.append(self._digest_pool.submit(lambda: [(n, files.digest(n)) for n in names]))

    def finish(self, workers: int) -> dict[str, str]:
        """Every digest of the proof (name -> digest), once every write is durable."""
        self._flush()
        rest = [n for n in self.names if n not in self._submitted]
        digests = {n: t.digest for n, t in digest_tensors(self.files, workers, rest).items()} if rest else {}
        for future in self._digests:
            digests.update(future.result())
        for sync in self._syncs:
            sync.result()
        self.files.sync()
        return digests

    def close(self) -> None:
        """Stop what has not started and wait for what runs (before the files are closed)."""
        self._digest_pool.shutdown(wait=True, cancel_futures=True)
        self._sync_pool.shutdown(wait=True, cancel_futures=True)


def _apply_one(
    root: Path,
    delta: Delta,
    locations: dict[str, TensorLocation],
    workers: int,
    history: list[str],
    base_table: dict[str, TensorEntry] | None,
    *,
    resumed: bool,
    recorded: bool = False,
) -> tuple[StepResult, dict[str, str]]:
    """One delta: first pass, state -> applying, writes, fsync, proof, table, state -> target.

    Returns the step and the proof's digests (tensor name -> digest read back after the writes)."""
    m = delta.manifest
    started = time.perf_counter()
    compile_writes(m)
    prior = read_state(root) if recorded else None  # the version read from the state, not just hashed
    streaming = streams(delta, prior, resumed)
    with InPlaceFiles(locations, writable=True) as files, explain_enospc(root):
        files.open_all(touched := sorted(receiver_plan.touched(m)))
        prepared: list[Prepared] = []
        if not streaming:
            prepared = first_pass(delta, files, resumed, workers)  # raises before anything is written
            delta.verify_blocks(("data",))  # every data block whole (waits for a store's download), before any write
        if base_table is not None and read_recorded_table(root, m.base.fingerprint) is None:
            write_recorded_table(root, base_table)  # so that a resume can check what it did not touch
        with SafetensorsCheckpoint(root) as ckpt:
            before = file_stats(root, ckpt)
        _check_not_replaced(files, root, written=False)
        # From here on the files may be between versions; the state says which delta is in flight.
        applying = {"delta_id": delta.id, "base": ref(m.base), "target": ref(m.target), "url": delta.url}
        write_state(root, ReceiverState(None, None, applying, before, history))
        counts = ItemCounts()
        # The proof: the touched tensors (every tensor, where the base table is unknown) must now
        # hash to the target table; nothing claims the target before this holds. Each is read back
        # as soon as its last item is written, while the fsyncs run (see _Proof).
        names = touched if base_table is not None else sorted(m.tensors)
        proof = _Proof(files, m.items, names, workers)
        try:
            if streaming:
                assert prior is not None
                written = _Written()
                try:
                    for i, outcome in enumerate(stream_items(delta, files, workers, written)):
                        counts.add(outcome.kind, outcome.count)
                        proof.written(i)
                    delta.verify_blocks(("data",))  # every data block whole, before the target is claimed
                except Exception as exc:  # an interrupt is a crash: a re-run finishes the apply
                    proof.close()  # no digest or fsync runs while the undo writes
                    reported = _roll_back(root, delta, files, written, prior, exc)
                    if reported is exc:
                        raise
                    raise reported from exc
            else:
                for i, outcome in enumerate(write_items(delta, prepared, files, resumed, workers)):
                    counts.add(outcome.kind, outcome.count)
                    proof.written(i)
            proof_started = time.perf_counter()
            digests = proof.finish(workers)
            proof_seconds = time.perf_counter() - proof_started
        finally:
            proof.close()
        # The proof read the files written through these descriptors: they must still be the checkpoint's.
        _check_not_replaced(files, root, written=True)
    bad = receiver_plan.unproven(m, digests)
    if bad:
        raise receiver_plan.proof_failure(m, bad, str(root))
    with SafetensorsCheckpoint(root) as ckpt:
        stats = file_stats(root, ckpt)
    write_recorded_table(root, m.tensors)
    history[:] = [*(h for h in history if h != m.base.fingerprint), m.base.fingerprint][-HISTORY_LENGTH:]
    write_state(root, ReceiverState(m.target.version, m.target.fingerprint, None, stats, history))
    step = StepResult(
        delta=delta.url,
        delta_id=delta.id,
        base_version=m.base.version,
        target_version=m.target.version,
        status="resumed" if resumed else "applied",
        items=len(m.items),
        done=counts.done,
        applied=counts.applied,
        repaired=counts.repaired,
        changed_elements=counts.changed_elements,
        seconds=time.perf_counter() - started,
        proof_seconds=proof_seconds,
    )
    return step, digests
