"""``dcr apply --into``: update a Hugging Face checkpoint directory in place, crash-safe.

Normative text: format_spec/receiver-checkpoint.md. In short:

* All checks run before the first byte is written: manifests, file names,
  the tensor layout, the receiver's version (the delta's base), the target
  table and every data block's digest.
* The receiver's version lives in ``CKPT/.dcr/state.json``, replaced
  atomically; while a delta is being applied it says so ("applying X -> Y").
* An exclusive ``flock`` on ``CKPT/.dcr/lock`` keeps two appliers apart.
* Every item is classified by the digest of its affected elements before it
  is written: post-image -> done (skip), pre-image -> pending (apply),
  anything else -> torn (absolute overwrite from the repair section). So a
  re-run after a crash at any instant finishes the job and nothing is XORed twice.
* Only the affected elements are written, in place, through a shared memory
  map of the data section; safetensors headers are never rewritten.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import mmap
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..checkpoints.safetensors_dir import INDEX_NAME, SafetensorsCheckpoint, TensorLocation
from ..delta.reader import Delta
from ..errors import ConflictError, FormatError, IncompatibleError, IntegrityError, VerifyFailed
from ..format.codec import apply_values
from ..format.digest import digest_bytes, is_digest
from ..format.dtypes import dtype as lookup_dtype
from ..format.manifest import MANIFEST_NAME, Item, TensorEntry, VersionRef, fingerprint
from ..io.files import fsync_dir, write_atomic
from ..io.pool import default_workers
from .verify import digest_tensors

STATE_DIR = ".dcr"
STATE_NAME = "state.json"
TABLE_NAME = "table.json"
LOCK_NAME = "lock"
STATE_FORMAT = "dcr.receiver-state"
STATE_VERSION = 1
HISTORY_LENGTH = 256

DeltaLike = str | os.PathLike[str] | Delta


# --------------------------------------------------------------------------- state


@dataclass
class ReceiverState:
    """What CKPT/.dcr/state.json records (format_spec/receiver-checkpoint.md §2)."""

    version: str | None  # label of the version the checkpoint holds; None while unknown
    fingerprint: str | None
    applying: dict[str, Any] | None = None  # {delta_id, base: {version, fingerprint}, target: {...}}
    files: dict[str, list[int]] = field(default_factory=dict)  # name -> [size, mtime_ns, ctime_ns, inode]
    history: list[str] = field(default_factory=list)  # fingerprints of earlier versions reached by dcr apply

    def to_json_bytes(self) -> bytes:
        obj = {"format": STATE_FORMAT, "format_version": STATE_VERSION, **asdict(self)}
        return json.dumps(obj, indent=1, sort_keys=True).encode()


def state_dir(root: Path) -> Path:
    return root / STATE_DIR


def read_state(root: str | os.PathLike[str]) -> ReceiverState | None:
    path = state_dir(Path(root)) / STATE_NAME
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        obj = json.loads(raw)
        if obj.get("format") != STATE_FORMAT:
            raise ValueError
        if obj.get("format_version") != STATE_VERSION:
            raise FormatError(
                f"{path}: receiver state version {obj.get('format_version')} is not supported; upgrade dcr"
            )
        applying = obj.get("applying")
        if applying is not None and not (
            isinstance(applying.get("delta_id"), str)
            and _is_ref(applying.get("base"))
            and _is_ref(applying.get("target"))
        ):
            raise ValueError
        version, fp = obj.get("version"), obj.get("fingerprint")
        if not (version is None or isinstance(version, str)) or not (fp is None or is_digest(fp)):
            raise ValueError
        history = [h for h in obj.get("history") or [] if is_digest(h)]
        return ReceiverState(version, fp, applying, dict(obj.get("files") or {}), history)
    except (ValueError, TypeError, AttributeError, KeyError):
        raise FormatError(f"{path} is not a dcr receiver state file; remove it to re-establish the version") from None


def _is_ref(obj: Any) -> bool:
    """A {version, fingerprint} pair as the state records it."""
    return isinstance(obj, dict) and isinstance(obj.get("version"), str) and is_digest(obj.get("fingerprint"))


def write_state(root: Path, state: ReceiverState) -> None:
    """Replace the state file atomically and durably: temp file, fsync, rename, fsync dir."""
    path = state_dir(root) / STATE_NAME
    with _explain_enospc(path):
        write_atomic(path, state.to_json_bytes())
        fsync_dir(state_dir(root))


@contextlib.contextmanager
def _explain_enospc(path: Path) -> Iterator[None]:
    try:
        yield
    except OSError as exc:
        if exc.errno != errno.ENOSPC:
            raise
        raise OSError(exc.errno, f"{exc.strerror}; free space and re-run the same dcr apply", str(path)) from exc


def write_recorded_table(root: Path, table: dict[str, TensorEntry]) -> None:
    """Keep the tensor table of the version reached, so ``dcr verify`` can name tensors without the delta."""
    obj = {"fingerprint": fingerprint(table), "tensors": {n: t.to_json() for n, t in sorted(table.items())}}
    with _explain_enospc(state_dir(root) / TABLE_NAME):
        write_atomic(state_dir(root) / TABLE_NAME, json.dumps(obj, separators=(",", ":")).encode())


def read_recorded_table(root: str | os.PathLike[str], expected_fingerprint: str) -> dict[str, TensorEntry] | None:
    path = state_dir(Path(root)) / TABLE_NAME
    try:
        obj = json.loads(path.read_bytes())
        table = {n: TensorEntry(t["dtype"], tuple(t["shape"]), t["digest"]) for n, t in obj["tensors"].items()}
    except (FileNotFoundError, ValueError, TypeError, KeyError, AttributeError):
        return None
    return table if fingerprint(table) == expected_fingerprint else None


def file_stats(root: Path, ckpt: SafetensorsCheckpoint) -> dict[str, list[int]]:
    """Identity of the checkpoint's files; a change means someone else wrote them, so the state is stale."""
    files = {loc.file for loc in ckpt.tensors.values()}
    if (root / INDEX_NAME).exists():
        files.add(root / INDEX_NAME)
    stats = {}
    for path in sorted(files):
        st = path.stat()
        stats[os.path.relpath(path, root.resolve())] = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
    return stats


@contextlib.contextmanager
def receiver_lock(root: Path) -> Iterator[None]:
    """Exclusive, non-blocking: a second applier fails at once instead of interleaving writes."""
    directory = state_dir(root)
    directory.mkdir(exist_ok=True)
    fd = os.open(directory / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConflictError(
                f"another dcr apply holds {directory / LOCK_NAME}; wait for it to finish, then re-run"
            ) from None
        yield
    finally:
        os.close(fd)  # releases the lock


# --------------------------------------------------------------------------- writable maps


class WritableTensors:
    """Shared, writable memory maps of the checkpoint's files, exposing each tensor's data as a flat uint array.

    Writes land in the page cache that every reader of the file shares; only
    data sections are ever written, so headers stay intact for mapped readers.
    """

    def __init__(self, locations: dict[str, TensorLocation]) -> None:
        self.locations = locations
        self._fds: dict[Path, int] = {}
        self._maps: dict[Path, mmap.mmap] = {}

    def view(self, name: str) -> np.ndarray:
        loc = self.locations[name]
        uint = lookup_dtype(loc.dtype).uint
        if loc.numel == 0:
            return np.empty(0, dtype=uint)
        m = self._maps.get(loc.file)
        if m is None:
            fd = os.open(loc.file, os.O_RDWR)
            self._fds[loc.file] = fd
            m = self._maps[loc.file] = mmap.mmap(fd, 0, access=mmap.ACCESS_WRITE)
        return np.frombuffer(m, dtype=uint, count=loc.numel, offset=loc.start)

    def sync(self) -> None:
        """Make every write durable: msync the maps, then fsync the files."""
        for path, m in self._maps.items():
            m.flush()
            os.fsync(self._fds[path])

    def close(self) -> None:
        for m in self._maps.values():
            with contextlib.suppress(BufferError):
                m.close()
        for fd in self._fds.values():
            os.close(fd)
        self._maps.clear()
        self._fds.clear()


def _write_values(view: np.ndarray, index: np.ndarray | slice, values: np.ndarray) -> None:
    """The only place an apply writes tensor bytes (tests inject write failures here)."""
    view[index] = values


# --------------------------------------------------------------------------- items


@dataclass
class ItemCounts:
    done: int = 0  # already at the post-image: skipped
    applied: int = 0  # at the pre-image: the delta was applied
    repaired: int = 0  # torn: rewritten with absolute target values
    changed_elements: int = 0

    def add(self, kind: str, elements: int) -> None:
        setattr(self, kind, getattr(self, kind) + 1)
        if kind != "done":
            self.changed_elements += elements


def _canonical_index(item: Item, positions: np.ndarray | None, shape: tuple[int, ...]) -> np.ndarray | slice:
    region = item.region
    if positions is None:  # replace: the whole region
        if not region.is_box:
            assert region.start is not None and region.stop is not None
            return slice(region.start, region.stop)
        positions = np.arange(region.size, dtype=np.int64)
    return region.to_canonical(positions, shape)


def apply_item(delta: Delta, item: Item, view: np.ndarray, shape: tuple[int, ...]) -> str:
    """Classify one item by the digest of its affected elements, then bring it to its post-image.

    Returns "done", "applied" or "repaired". The new values are checked against
    the item's post digest before anything is written.
    """
    decoded = delta.decode(item)
    index = _canonical_index(item, decoded.positions, shape)
    current = view[index].copy() if isinstance(index, slice) else view[index]  # fancy indexing copies already
    state = digest_bytes(current)
    if state == item.post:
        return "done"
    if state == item.pre:
        new, kind = apply_values(item.op, current, decoded.values), "applied"
    elif item.op == "xor":
        if item.repair is None or not _repair_available(delta, item):
            raise IntegrityError(
                f"{item.tensor}: an interrupted write left this item torn and its repair block is not here; "
                "fetch the delta with its repair blocks and re-run"
            )
        new, kind = delta.repair_values(item), "repaired"
    else:
        new, kind = decoded.values, "repaired"  # overwrite and replace carry absolute values already
    if digest_bytes(new) != item.post:
        raise IntegrityError(
            f"{item.tensor} {item.region.to_json()}: computed values do not match the delta's post digest; "
            "the delta is corrupt or the checkpoint was modified during the apply"
        )
    _write_values(view, index, new)
    return kind


def _repair_available(delta: Delta, item: Item) -> bool:
    assert item.repair is not None
    return delta.has_block(delta.manifest.blocks[item.repair.block])


# --------------------------------------------------------------------------- planning


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


@dataclass
class ApplyResult:
    checkpoint: str
    version: str
    fingerprint: str
    steps: list[StepResult]
    skipped: list[str]  # deltas already applied
    message: str

    @property
    def noop(self) -> bool:
        return not self.steps

    def to_json(self) -> dict:
        return {**asdict(self), "noop": self.noop}


def expand_deltas(deltas: DeltaLike | Sequence[DeltaLike]) -> list[Delta]:
    """Open deltas given as paths/URLs or Delta objects; a local directory of deltas expands to its children."""
    if isinstance(deltas, (str, os.PathLike, Delta)):
        deltas = [deltas]
    opened: list[Delta] = []
    for d in deltas:
        if isinstance(d, Delta):
            opened.append(d)
            continue
        path = Path(os.fspath(d))
        if "://" not in os.fspath(d) and path.is_dir() and not (path / MANIFEST_NAME).exists():
            children = sorted(p for p in path.iterdir() if (p / MANIFEST_NAME).is_file())
            if not children:
                raise FormatError(f"{path} is neither a dcr delta nor a directory of deltas")
            opened.extend(Delta.open(p) for p in children)
        else:
            opened.append(Delta.open(d))
    unique: dict[str, Delta] = {}
    for d in opened:
        unique.setdefault(d.id, d)
    if not unique:
        raise FormatError("no delta given")
    return list(unique.values())


def plan_chain(
    deltas: list[Delta], start_fp: str, resume: Delta | None, history: Sequence[str] = ()
) -> tuple[list[Delta], list[Delta]]:
    """Order deltas by base -> target from the receiver's version. Returns (to apply, already applied).

    ``history`` holds fingerprints of versions the receiver passed through before: a delta leading to
    one of them (or to the current version) was applied already.
    """
    by_base: dict[str, Delta] = {}
    for d in deltas:
        if d is resume:
            continue
        other = by_base.setdefault(d.manifest.base.fingerprint, d)
        if other is not d:
            raise IncompatibleError(
                f"{other.url} and {d.url} both start at version {d.manifest.base.version}; pass only one of them"
            )
    plan: list[Delta] = [resume] if resume else []
    fp = resume.manifest.target.fingerprint if resume else start_fp
    while fp in by_base and by_base[fp] not in plan:  # "not in plan": a cycle of deltas ends the chain
        plan.append(by_base[fp])
        fp = by_base[fp].manifest.target.fingerprint
    # Deltas that lead up to where the receiver already is were applied before.
    behind_fps = {resume.manifest.base.fingerprint if resume else start_fp, *history}
    behind: list[Delta] = []
    changed = True
    while changed:
        changed = False
        for d in deltas:
            if d not in plan and d not in behind and d.manifest.target.fingerprint in behind_fps:
                behind.append(d)
                behind_fps.add(d.manifest.base.fingerprint)
                changed = True
    stray = [d for d in deltas if d not in plan and d not in behind]
    if stray:
        d = stray[0]
        if not plan and len(deltas) == 1:
            raise IncompatibleError(
                f"the checkpoint is not at the base of {d.url}: it holds fingerprint {start_fp[:16]}…, the delta "
                f"needs version {d.manifest.base.version} ({d.manifest.base.fingerprint[:16]}…); apply the missing "
                "deltas first or refit it densely"
            )
        raise IncompatibleError(
            f"{d.url} (version {d.manifest.base.version} -> {d.manifest.target.version}) does not link to the "
            f"chain from the checkpoint's fingerprint {start_fp[:16]}…; pass the deltas in between or leave it out"
        )
    return plan, behind


def check_delta(delta: Delta) -> None:
    """Everything about a delta that can be checked without the receiver: manifest, block digests."""
    m = delta.manifest
    if fingerprint(m.tensors) != m.target.fingerprint:
        raise IntegrityError(f"{delta.url}: manifest tensor table does not match its target fingerprint (tampered?)")
    delta.verify_blocks(("data",))  # from a store: fetched once here, and kept for the apply
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


# --------------------------------------------------------------------------- apply


def apply(
    deltas: DeltaLike | Sequence[DeltaLike],
    *,
    into: str | os.PathLike[str],
    workers: int | None = None,
    verify: bool = False,
    log: Callable[[str], None] | None = None,
) -> ApplyResult:
    """Bring checkpoint directory ``into`` to the target of ``deltas``, in place.

    ``deltas`` is one delta (path, URL or :class:`Delta`), several (applied as
    a chain ordered by base -> target from the checkpoint's current version),
    or a local directory of deltas. Deltas already applied are skipped. A crash
    at any point is recovered by calling this again with the same deltas.
    ``verify`` re-digests the whole checkpoint afterwards (``dcr verify``).
    """
    root = Path(into)
    if not root.is_dir():
        raise IncompatibleError(f"{root} is not a checkpoint directory")
    workers = workers or default_workers()
    say = log or (lambda _msg: None)
    opened = expand_deltas(deltas)
    SafetensorsCheckpoint(root).close()  # a readable checkpoint (headers, names) before .dcr/ is created
    with receiver_lock(root), SafetensorsCheckpoint(root) as ckpt:
        # v1 deltas keep the layout, so every delta given must match it; checking first names the
        # missing or reshaped tensor instead of reporting a mere fingerprint mismatch.
        for d in opened:
            check_layout(d, ckpt, root)
        for stale in state_dir(root).glob(".*.tmp-*"):  # left by a writer killed mid-replace
            stale.unlink(missing_ok=True)
        state = read_state(root)
        resume: Delta | None = None
        table: dict[str, TensorEntry] | None = None
        history: list[str] = list(state.history) if state is not None else []
        if state is not None and state.applying is not None:
            resume = next((d for d in opened if d.id == state.applying["delta_id"]), None)
            if resume is None:
                a = state.applying
                raise IncompatibleError(
                    f"{root} is in the middle of applying delta {a['delta_id'][:16]}… "
                    f"({a['base'].get('version')} -> {a['target'].get('version')}); "
                    "re-run dcr apply with that delta to finish it"
                )
            start_fp = resume.manifest.base.fingerprint
            start_version = resume.manifest.base.version
        elif state is not None and state.fingerprint and state.files == file_stats(root, ckpt):
            start_fp, start_version = state.fingerprint, state.version or state.fingerprint[:16]
        else:
            if state is not None:
                say(f"{root}: files changed since dcr last recorded a version; re-hashing")
            history = []  # whatever wrote the files, dcr's record of earlier versions no longer holds
            table = digest_tensors(ckpt, workers)
            start_fp = fingerprint(table)
            start_version = _label(start_fp, opened)
        plan, behind = plan_chain(opened, start_fp, resume, history)
        if not plan:
            if state is None or state.fingerprint != start_fp or state.files != file_stats(root, ckpt):
                write_recorded_table(root, table or _table_for(start_fp, opened) or digest_tensors(ckpt, workers))
                write_state(root, ReceiverState(start_version, start_fp, None, file_stats(root, ckpt), history))
            message = f"{root}: already at version {start_version}; nothing to apply"
            if behind:
                message += f" ({', '.join(d.url for d in behind)} applied before)"
            say(message)
            result = ApplyResult(str(root), start_version, start_fp, [], [d.url for d in behind], message)
        else:
            # Everything that can fail on bad input fails here, before the first write.
            for d in plan:
                check_delta(d)
            ckpt.close()

            steps: list[StepResult] = []
            for d in plan:
                steps.append(_apply_one(root, d, ckpt.tensors, workers, history, resumed=d is resume))
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
            from .verify import verify as verify_checkpoint

            report = verify_checkpoint(root, against=plan[-1].url if plan else None, workers=workers)
            if not report.ok:
                raise VerifyFailed(report.summary())
            say(report.summary())
    return result


def _label(fp: str, deltas: list[Delta]) -> str:
    for d in deltas:
        for ref in (d.manifest.base, d.manifest.target):
            if ref.fingerprint == fp:
                return ref.version
    return fp[:16]


def _table_for(fp: str, deltas: list[Delta]) -> dict[str, TensorEntry] | None:
    return next((d.manifest.tensors for d in deltas if d.manifest.target.fingerprint == fp), None)


def _run_items(
    delta: Delta, views: dict[str, np.ndarray], locations: dict[str, TensorLocation], workers: int
) -> Iterator[tuple[str, int]]:
    """Apply items on a thread pool, at most 2 x workers in flight (bounded memory).

    On the first failure, items not yet started are cancelled, so a failed
    write stops the apply promptly instead of running on into more writes.
    """
    pool = ThreadPoolExecutor(max_workers=workers)
    window: deque[tuple[Future[str], int]] = deque()
    failed = threading.Event()

    def run(item: Item) -> str:
        if failed.is_set():
            return "cancelled"
        try:
            return apply_item(delta, item, views[item.tensor], locations[item.tensor].shape)
        except BaseException:
            failed.set()
            raise

    try:
        for item in delta.manifest.items:
            window.append((pool.submit(run, item), item.count))
            while len(window) >= 2 * workers:
                future, count = window.popleft()
                yield future.result(), count
        while window:
            future, count = window.popleft()
            yield future.result(), count
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _ref(ref: VersionRef) -> dict[str, str]:
    return {"version": ref.version, "fingerprint": ref.fingerprint}


def _apply_one(
    root: Path,
    delta: Delta,
    locations: dict[str, TensorLocation],
    workers: int,
    history: list[str],
    *,
    resumed: bool,
) -> StepResult:
    """Apply one delta (state -> applying, items, fsync, table, state -> target). Appends to ``history``."""
    m = delta.manifest
    started = time.perf_counter()
    # From here on the files may be between versions; the state says which delta is in flight.
    write_state(
        root,
        ReceiverState(
            None,
            None,
            {"delta_id": delta.id, "base": _ref(m.base), "target": _ref(m.target), "url": delta.url},
            {},
            history,
        ),
    )
    maps = WritableTensors(locations)
    counts = ItemCounts()
    try:
        with _explain_enospc(root):
            # Views are created up front, in this thread, so workers never race to open a map.
            views = {name: maps.view(name) for name in {it.tensor for it in m.items}}
            for kind, elements in _run_items(delta, views, locations, workers):
                counts.add(kind, elements)
            maps.sync()
    finally:
        maps.close()
    with SafetensorsCheckpoint(root) as ckpt:
        stats = file_stats(root, ckpt)
    write_recorded_table(root, m.tensors)
    history[:] = [*(h for h in history if h != m.base.fingerprint), m.base.fingerprint][-HISTORY_LENGTH:]
    write_state(root, ReceiverState(m.target.version, m.target.fingerprint, None, stats, history))
    return StepResult(
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
    )
