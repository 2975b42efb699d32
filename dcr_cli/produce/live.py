"""Diff live tensors inside the trainer: no checkpoint per step (issue 14, format_spec/producers.md).

Live tensors are one more source for the engine (engine.py). A mapping of names to
torch tensors becomes either

- the identity plan (one process, plain tensors): exactly what ``dcr diff`` of an HF
  directory holding those tensors plans, so the delta is bit-identical to it; or
- training shards (DTensor local shards, explicit ``LiveShard`` boxes, several ranks, or
  a name profile): each rank's local boxes are the stored chunks of a training
  checkpoint, with the offsets DCP computes for them (``__create_chunk_list__``). The
  ranks exchange this metadata once (like DCP's global plan), replicas are
  deduplicated as ``dcp.save`` does, and the plan is the DCP plan: each rank writes
  the part ``dcr diff --rank R`` of the equivalent ``dcp.save`` checkpoint writes.

Scans run on the tensors' own device with torch integer views (compare, positions,
XOR values), one band of at most CHUNK_BYTES at a time; encoding runs on CPU threads.
Canonical tensor digests need a whole tensor in C order: its owner rank receives the
other ranks' boxes (point to point, in one global order) and hashes it on the CPU.

``Producer`` keeps the last committed bits as integers (one copy of the rank's shard)
and the changes of each uncommitted version (positions and values only); committing a
version applies them to the baseline, so a retry or an abandoned version diffs against
the same baseline again.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..checkpoints.shards import Chunk, ShardCheckpoint, ShardReader, StoredTensor, identity_canonical, intersect
from ..delta.reader import Delta
from ..delta.summary import DiffSummary, summarize
from ..errors import DcrError, IncompatibleError
from ..format.codec import DEFAULT_LEVEL, EncodedItem, encode_changes
from ..format.digest import digest_bytes
from ..format.dtypes import dtype as lookup_dtype
from ..format.dtypes import from_torch, numel, torch_int
from ..format.kernels import scan_changes
from ..format.manifest import MANIFEST_NAME, Op, Region, TensorEntry
from ..format.store_records import is_label
from .engine import check_options, execute
from .plan import Plan, assign_tensors, check_compatible, check_layouts, plan_shards, plan_tensors

if TYPE_CHECKING:
    import torch

Names = Mapping[str, str] | Callable[[str], "str | None"]
Box = tuple[tuple[int, ...], tuple[int, ...]]


@dataclass(frozen=True)
class LiveShard:
    """A local box of a global tensor that is not a DTensor (e.g. a Megatron tensor-parallel shard)."""

    tensor: torch.Tensor
    offsets: tuple[int, ...]
    global_shape: tuple[int, ...]


@dataclass
class _Entry:
    key: str
    dtype: str
    shape: tuple[int, ...]
    boxes: list[tuple[Box, torch.Tensor]]  # (offsets, sizes) -> local integer view
    plain: bool  # a whole plain tensor (every rank holds all of it)


def _int_view(t: torch.Tensor, key: str) -> torch.Tensor:
    """The stored bits as signed integers of the same width (every torch op is defined on them)."""
    import torch

    if t.layout != torch.strided or t.is_meta:  # no dense elements to diff: refused in one line, not by torch
        kind = "meta" if t.is_meta else str(t.layout).removeprefix("torch.")
        raise IncompatibleError(f"{key}: a live tensor must hold dense values in memory, not a {kind} tensor")
    t = t.detach()
    return t.contiguous().view(torch_int(t.element_size()))


def _entries(tensors: Mapping[str, Any], names: Names | None) -> list[_Entry]:
    import torch
    from torch.distributed.tensor import DTensor

    rename: Callable[[str], str | None]
    if names is None:
        rename = lambda k: k  # noqa: E731
    elif callable(names):
        rename = names
    else:
        rename = names.get
    out = []
    for key, value in tensors.items():
        new_key = rename(key)
        if new_key is None:
            continue
        values = value if isinstance(value, (list, tuple)) else [value]
        boxes: list[tuple[Box, torch.Tensor]] = []
        plain = False
        shape: tuple[int, ...] = ()
        dt = ""
        for v in values:
            if isinstance(v, DTensor):
                shape, dt = tuple(v.shape), from_torch(v.dtype).name
                local = v.to_local()
                for c in v.__create_chunk_list__():  # type: ignore[attr-defined]
                    boxes.append(((tuple(c.offsets), tuple(c.sizes)), _int_view(local, key)))
            elif isinstance(v, LiveShard):
                shape, dt = tuple(v.global_shape), from_torch(v.tensor.dtype).name
                boxes.append(((tuple(v.offsets), tuple(v.tensor.shape)), _int_view(v.tensor, key)))
            elif isinstance(v, torch.Tensor):
                shape, dt, plain = tuple(v.shape), from_torch(v.dtype).name, True
                boxes.append((((0,) * v.dim(), tuple(v.shape)), _int_view(v, key)))
            else:
                raise IncompatibleError(f"{key}: a live tensor must be a torch.Tensor, a DTensor or a LiveShard")
        out.append(_Entry(new_key, dt, shape, boxes, plain and len(values) == 1))
    if len({e.key for e in out}) != len(out):
        raise IncompatibleError("two live tensors map to one name; check the name map")
    return out


def _meta(entries: list[_Entry]) -> list[tuple[str, str, tuple[int, ...], list[Box]]]:
    return [(e.key, e.dtype, e.shape, [box for box, _ in e.boxes]) for e in entries]


class LiveReader(ShardReader):
    """Every rank's boxes as the stored chunks of a checkpoint; this rank's bits as local integer views.

    A chunk's ``location`` is the rank that holds (and emits) it; its ``file`` is the file
    ``dcp.save`` would write it to, so the plan is the one for that checkpoint.
    """

    def __init__(
        self, stored: dict[str, StoredTensor], local: dict[tuple[str, tuple[int, ...]], torch.Tensor], root: str
    ) -> None:
        self.stored, self.local, self.root = stored, local, root
        self.remote: dict[tuple[str, tuple[int, ...]], np.ndarray] = {}  # boxes received for a digest

    def tensor(self, key: str, chunk: Chunk) -> torch.Tensor:
        return self.local[(key, chunk.offsets)].reshape(chunk.sizes)

    def read_chunk(self, key: str, chunk: Chunk) -> np.ndarray:
        """The chunk's bits on the CPU, as numpy unsigned integers (for digests)."""
        got = self.remote.get((key, chunk.offsets))
        if got is not None:
            return got
        t = self.tensor(key, chunk)
        return t.cpu().numpy().view(lookup_dtype(self.stored[key].dtype).uint)


def _global_layout(
    metas: list[list[tuple[str, str, tuple[int, ...], list[Box]]]], root: str
) -> dict[str, StoredTensor]:
    """Every rank's boxes, deduplicated as torch.distributed.checkpoint's dedup_save_plans does."""
    holders: dict[tuple[str, tuple[int, ...]], list[int]] = {}
    sizes: dict[tuple[str, tuple[int, ...]], tuple[int, ...]] = {}
    info: dict[str, tuple[str, tuple[int, ...]]] = {}
    for rank, meta in enumerate(metas):
        for key, dt, shape, boxes in meta:
            if info.setdefault(key, (dt, shape)) != (dt, shape):
                raise IncompatibleError(f"{root}: ranks disagree on {key}'s dtype or shape")
            for offsets, box_sizes in boxes:
                index = (key, offsets)
                if sizes.setdefault(index, box_sizes) != box_sizes:
                    raise IncompatibleError(f"{root}: ranks hold different boxes of {key} at {list(offsets)}")
                holders.setdefault(index, []).append(rank)
    load = [0] * len(metas)
    chunks: dict[str, list[Chunk]] = {key: [] for key in info}
    for (key, offsets), ranks in holders.items():  # first occurrence order, as DCP iterates
        rank = min(ranks, key=lambda r: load[r])
        load[rank] += numel(sizes[(key, offsets)]) * lookup_dtype(info[key][0]).itemsize or 1
        chunks[key].append(Chunk(offsets, sizes[(key, offsets)], f"__{rank}_0.distcp", rank))
    return {key: StoredTensor(key, dt, shape, chunks[key]) for key, (dt, shape) in info.items()}


@dataclass
class _Group:
    """This process's rank in the producers (a torch.distributed group, or one process)."""

    rank: int = 0
    world: int = 1
    group: Any = None

    @classmethod
    def current(cls, group: Any = None) -> _Group:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return cls()
        return cls(dist.get_rank(group), dist.get_world_size(group), group)

    def all_gather(self, obj: Any) -> list[Any]:
        if self.world == 1:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier(group=self.group)

    def device(self) -> torch.device:
        import torch
        import torch.distributed as dist

        if self.world > 1 and dist.get_backend(self.group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def send(self, t: torch.Tensor, dst: int) -> None:
        import torch
        import torch.distributed as dist

        data = t.contiguous().reshape(-1).view(torch.uint8).to(self.device())
        dist.send(data, self.global_rank(dst), self.group)

    def recv(self, nbytes: int, src: int) -> np.ndarray:
        import torch
        import torch.distributed as dist

        buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device())
        dist.recv(buf, self.global_rank(src), self.group)
        return buf.cpu().numpy().view(np.uint8)

    def global_rank(self, rank: int) -> int:
        if self.group is None:
            return rank
        import torch.distributed as dist

        return dist.get_global_rank(self.group, rank)


def _owners(ckpt: ShardCheckpoint, world: int) -> dict[str, int]:
    owner = {}
    for r in range(world):
        for name in assign_tensors(ckpt, r, world) if world > 1 else list(ckpt.canonical):
            owner[name] = r
    return owner


def gather_digests(ckpt: ShardCheckpoint, group: _Group, names: Sequence[str] | None = None) -> dict[str, str]:
    """Digests of the canonical tensors this rank owns (``assign_tensors``), from every rank's boxes.

    Collective: every rank walks the same (tensor, box) list; a box's holder sends it to the
    tensor's owner, which hashes the assembled tensor. Memory: one canonical tensor at a time.
    """
    reader = ckpt.reader
    assert isinstance(reader, LiveReader)
    owner = _owners(ckpt, group.world)
    out = {}
    for name in sorted(ckpt.canonical) if names is None else names:
        o = owner[name]
        needed: dict[tuple[str, tuple[int, ...]], tuple[str, Chunk]] = {}
        for seg in ckpt.canonical[name].segments:
            for chunk in reader.stored[seg.key].chunks:
                if chunk.numel and intersect(chunk.offsets, chunk.sizes, seg.offsets, seg.sizes) is not None:
                    needed.setdefault((seg.key, chunk.offsets), (seg.key, chunk))
        for index, (key, chunk) in needed.items():
            if chunk.location == o or group.rank not in (o, chunk.location):
                continue
            if group.rank == chunk.location:
                group.send(reader.tensor(key, chunk), o)
            else:
                dt = lookup_dtype(reader.stored[key].dtype)
                raw = group.recv(chunk.numel * dt.itemsize, chunk.location)
                reader.remote[index] = raw.view(dt.uint).reshape(chunk.sizes)
        if group.rank == o:
            out[name] = ckpt.canonical_digest(name)
        reader.remote.clear()
    return out


# Tensors on the CPU are scanned by the compiled kernel (False: by the torch path a GPU takes; tests).
CPU_KERNEL = True
# A scanned band: (base band view, positions, new values), kept to advance a baseline on commit.
Change = tuple["torch.Tensor", "torch.Tensor", "torch.Tensor"]


def torch_scan(level: int | None, record: Callable[[Change], None] | None = None) -> Any:
    """The device scan: compare, positions and XOR values with torch integer views; encode on the CPU.

    Tensors on the CPU are scanned in place by the compiled kernel (``format.kernels``), through
    zero-copy numpy views: the same bits, at the file path's speed.
    """
    import torch

    def scan(name: str, region: Region, base: Any, new: Any, op: Op, residual: str | None) -> EncodedItem | None:
        uint = np.dtype(f"<u{new.element_size()}")
        if CPU_KERNEL and base.device.type == "cpu" and new.device.type == "cpu":
            b_np = base.reshape(-1).numpy().view(uint)
            n_np = new.reshape(-1).numpy().view(uint)
            positions_np, masks_np, news_np = scan_changes(b_np, n_np)
            if record is not None and len(positions_np):
                record((base, torch.from_numpy(positions_np), torch.from_numpy(news_np.view(f"<i{uint.itemsize}"))))
            return encode_changes(
                name, region, positions_np, masks_np, news_np, len(n_np), lambda: (b_np, n_np), op=op, level=level,
                residual=residual,
            )  # fmt: skip
        b = base.to(new.device, non_blocking=True).reshape(-1)
        n = new.reshape(-1)
        positions = torch.nonzero(b != n).reshape(-1)
        news = n[positions]
        if record is not None and len(positions):
            record((base, positions.to(base.device), news.to(base.device)))
        masks = b[positions] ^ news

        def dense() -> tuple[np.ndarray, np.ndarray]:
            return b.cpu().numpy().view(uint), n.cpu().numpy().view(uint)

        return encode_changes(
            name, region, positions.cpu().numpy(), masks.cpu().numpy().view(uint), news.cpu().numpy().view(uint),
            len(n), dense, op=op, level=level, residual=residual,
        )  # fmt: skip

    return scan


class _FlatSide:
    """Plain whole tensors as a side of the identity plan (the plan of an HF directory)."""

    def __init__(self, tensors: dict[str, torch.Tensor], layout: dict[str, tuple[str, tuple[int, ...]]]) -> None:
        self.tensors, self._layout = tensors, layout

    def flat(self, name: str, start: int, stop: int) -> torch.Tensor:
        return self.tensors[name].reshape(-1)[start:stop]

    def canonical_digest(self, name: str) -> str:
        t = self.tensors[name]
        return digest_bytes(t.reshape(-1).cpu().numpy().view(np.uint8))

    def cached_digests(self) -> dict[str, str]:
        return {}

    def remember_digests(self, digests: dict[str, str]) -> None:
        return None

    def table(self, digests: dict[str, str]) -> dict[str, TensorEntry]:
        return {n: TensorEntry(d, s, digests[n]) for n, (d, s) in sorted(self._layout.items())}


class _ChunkSide:
    """Live training shards as a side: chunk reads are device tensors; digests were gathered before."""

    def __init__(self, ckpt: ShardCheckpoint) -> None:
        self.ckpt = ckpt
        reader = ckpt.reader
        assert isinstance(reader, LiveReader)
        self.reader = reader

    def read_chunk(self, key: str, chunk: Chunk) -> torch.Tensor:
        return self.reader.tensor(key, chunk)

    def release(self, key: str, chunk: Chunk) -> None:
        return None

    def canonical_digest(self, name: str) -> str:
        return self.ckpt.canonical_digest(name)

    def cached_digests(self) -> dict[str, str]:
        return {}

    def remember_digests(self, digests: dict[str, str]) -> None:
        return None

    def table(self, digests: dict[str, str]) -> dict[str, TensorEntry]:
        return self.ckpt.table(digests)


@dataclass
class _Layout:
    """A live state's plan inputs: plain tensors (identity plan) or a training-shard view."""

    flat: dict[str, torch.Tensor] | None  # identity plan: canonical name -> whole integer view
    dtypes: dict[str, str]  # identity plan: canonical name -> stored dtype
    ckpt: ShardCheckpoint | None  # training shards
    group: _Group = field(default_factory=_Group)

    @property
    def layout(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        if self.ckpt is not None:
            return self.ckpt.layout()
        assert self.flat is not None
        return {n: (self.dtypes[n], tuple(t.shape)) for n, t in self.flat.items()}


def _layouts(
    sides: list[Mapping[str, Any]], names: Names | None, profile: dict[str, Any] | None, group: _Group
) -> list[_Layout]:
    """Inspect each state (collectively across ranks) and build its plan inputs; all sides alike."""
    entries = [_entries(s, names) for s in sides]
    shards = group.world > 1 or profile is not None or any(not e.plain for es in entries for e in es)
    if not shards:
        return [
            _Layout({e.key: e.boxes[0][1] for e in es}, {e.key: e.dtype for e in es}, None, group) for es in entries
        ]
    metas = group.all_gather([_meta(es) for es in entries])
    result = []
    for i, es in enumerate(entries):
        stored = _global_layout([m[i] for m in metas], "<live tensors>")
        local = {(e.key, box[0]): view for e in es for box, view in e.boxes}
        reader = LiveReader(stored, local, "<live tensors>")
        result.append(_Layout(None, {}, _canonical_checkpoint(reader, profile), group))
    return result


def _canonical_checkpoint(reader: LiveReader, profile: dict[str, Any] | None) -> ShardCheckpoint:
    profile = profile or {}
    if "hidden_size" in profile:  # a Megatron profile (the model's HF config.json)
        from ..checkpoints.megatron import megatron_canonical, tied_duplicates

        ckpt = ShardCheckpoint(reader, megatron_canonical(reader, profile), "live", tied_duplicates(reader, profile))
    else:
        include, strip = tuple(profile.get("include") or ()), str(profile.get("strip_prefix") or "")
        ckpt = ShardCheckpoint(reader, identity_canonical(reader, include, strip), "live")
    if ckpt.residual_reasons():
        name, why = next(iter(ckpt.residual_reasons().items()))
        raise IncompatibleError(
            f"live tensors: {name} needs a value-changing conversion ({why}); pass tensors in the receivers'"
            " dtype and layout (cast in the trainer), or diff checkpoints with dcr diff"
        )
    return ckpt


def _plan(base: _Layout, new: _Layout, overwrite: Sequence[str]) -> tuple[Plan, Any, Any]:
    if new.ckpt is None:
        assert base.flat is not None and new.flat is not None
        check_layouts(base.layout, new.layout)
        layout = new.layout
        return plan_tensors(layout, overwrite), _FlatSide(base.flat, layout), _FlatSide(new.flat, layout)
    assert base.ckpt is not None
    check_compatible(base.ckpt, new.ckpt)
    g = new.group
    rank, world = (g.rank, g.world) if g.world > 1 else (None, None)
    plan = plan_shards(
        base.ckpt, new.ckpt, overwrite=overwrite, rank=rank, world_size=world,
        my_chunk=lambda key, chunk: chunk.location == g.rank,
    )  # fmt: skip
    return plan, _ChunkSide(base.ckpt), _ChunkSide(new.ckpt)


def _digests(side: _Layout, known: Mapping[str, str] | None, plan: Plan) -> dict[str, str]:
    """The digests of a side this rank reports: ``known`` ones, else gathered (a collective) for shards.

    For the identity plan, the digest units fill in what is missing during execution.
    """
    if known is not None:
        missing = [n for n in plan.digested if n not in known]
        if missing and side.ckpt is not None:
            raise IncompatibleError(f"no base digest for {missing[0]!r}; pass every tensor this rank owns")
        return {n: known[n] for n in plan.digested if n in known}
    if side.ckpt is None:
        return {}
    return gather_digests(side.ckpt, side.group)


def _run(
    base: _Layout,
    new: _Layout,
    out: str | os.PathLike[str],
    *,
    base_version: str | None,
    target_version: str | None,
    overwrite: Sequence[str],
    workers: int | None,
    level: int | None,
    on_block: Callable[[str, bytes], None] | None,
    base_digests: Mapping[str, str] | None,
    record: Callable[[Change], None] | None,
    created: str | None,
) -> tuple[DiffSummary | None, dict[str, str], dict[str, str]]:
    """Plan, gather digests, execute; with several ranks, rank 0 assembles the parts. Collective.

    Returns the summary and the (base, target) digests of the tensors this rank owns.
    """
    plan, b_side, n_side = _plan(base, new, overwrite)
    b_digests = _digests(base, base_digests, plan)
    n_digests = _digests(new, None, plan)
    summary = execute(
        plan,
        b_side,
        n_side,
        out,
        base_version=base_version,
        target_version=target_version,
        workers=workers,
        level=level,
        on_block=on_block,
        scan=torch_scan(level, record),
        base_digests=b_digests,
        target_digests=n_digests,
        created=created,
    )
    g = new.group
    if plan.rank is not None:
        g.barrier()
        if g.rank == 0:
            from ..delta.parts import assemble

            assemble(out)
        g.barrier()
        from ..delta.reader import Delta

        summary = summarize(Path(out), Delta.open(out).manifest)
    return summary, b_digests, n_digests


def diff_tensors(
    base: Mapping[str, Any],
    new: Mapping[str, Any],
    out: str | os.PathLike[str],
    *,
    base_version: str | None = None,
    target_version: str | None = None,
    names: Names | None = None,
    profile: dict[str, Any] | None = None,
    overwrite: Sequence[str] = (),
    workers: int | None = None,
    level: int | None = DEFAULT_LEVEL,
    on_block: Callable[[str, bytes], None] | None = None,
    base_digests: Mapping[str, str] | None = None,
    group: Any = None,
    created: str | None = None,
) -> DiffSummary | None:
    """Write the delta from live tensors ``base`` to live tensors ``new`` (name -> torch tensor).

    Values are plain tensors, DTensors (their local shards), or ``LiveShard`` boxes; on CPU or
    CUDA. ``names`` maps trainer names to canonical (HF) names (a mapping, or a function that
    returns None to leave a tensor out); ``profile`` is what ``dcr diff --profile/--include/
    --strip-prefix`` takes (index-only maps). Under torch.distributed every rank calls this
    (collective): each writes its part of ``out`` (a shared directory) and rank 0 assembles it;
    every rank returns the summary. One process with plain tensors plans exactly what
    ``dcr diff`` of an HF directory of them plans; DTensors plan what ``dcr diff`` of their
    ``dcp.save`` checkpoint plans (same delta bits, except ``created``).
    """
    check_options(workers, level, None, None)
    g = _Group.current(group)
    b_layout, n_layout = _layouts([base, new], names, profile, g)
    summary, _, _ = _run(
        b_layout, n_layout, out, base_version=base_version, target_version=target_version, overwrite=overwrite,
        workers=workers, level=level, on_block=on_block, base_digests=base_digests, record=None, created=created,
    )  # fmt: skip
    return summary


class Producer:
    """A trainer-side producer: diff each step's live tensors against the last committed version.

    ``baseline`` is the committed state: a mapping of live tensors (copied now, as integer
    bits) or the path of an HF checkpoint of it (read once, at the first ``diff``).
    Memory: one copy of this rank's shard of the weights (``baseline_bytes``), in host memory
    (pinned when the tensors are on CUDA), or on ``device`` if given; plus the changed
    positions and values of the uncommitted version. ``diff(state, version)`` writes
    ``out/<version>`` (``on_delta(path)`` is then called, e.g. to publish it); the baseline
    advances only on ``committed(version)``, so a retry, or a version never committed, is
    diffed against the same baseline again.
    """

    def __init__(
        self,
        out: str | os.PathLike[str],
        baseline: Mapping[str, Any] | str | os.PathLike[str],
        *,
        base_version: str | None = None,
        names: Names | None = None,
        profile: dict[str, Any] | None = None,
        overwrite: Sequence[str] = (),
        device: str | None = None,
        workers: int | None = None,
        level: int | None = DEFAULT_LEVEL,
        on_block: Callable[[str, bytes], None] | None = None,
        on_delta: Callable[[Path], None] | None = None,
        group: Any = None,
    ) -> None:
        self.out = Path(out)
        self.names, self.profile, self.overwrite = names, profile, tuple(overwrite)
        self.device, self.workers, self.level = device, workers, level
        self.on_block, self.on_delta = on_block, on_delta
        check_options(workers, level, None, None)
        if not isinstance(baseline, (str, os.PathLike, Mapping)):
            raise IncompatibleError(
                f"baseline must be a mapping of live tensors or an HF checkpoint path, not {type(baseline).__name__}"
            )
        self.group = _Group.current(group)
        self.base_version = base_version
        self._source = baseline if isinstance(baseline, (str, os.PathLike)) else None
        self._baseline: _Layout | None = None
        self._base_digests: dict[str, str] | None = None
        self._pending: dict[str, tuple[list[Change], dict[str, str]]] = {}
        self._committed: set[str] = set()  # labels this producer committed (never a new version's)
        if self._source is None:
            assert not isinstance(baseline, (str, os.PathLike))
            self._baseline = self._snapshot(baseline)

    @property
    def baseline_bytes(self) -> int:
        """Bytes of the baseline this rank holds (one copy of its shard)."""
        if self._baseline is None:
            return 0
        views = self._baseline.flat.values() if self._baseline.flat is not None else self._baseline_views()
        return sum(v.numel() * v.element_size() for v in views)

    def _baseline_views(self) -> list[torch.Tensor]:
        assert self._baseline is not None and self._baseline.ckpt is not None
        reader = self._baseline.ckpt.reader
        assert isinstance(reader, LiveReader)
        return list(reader.local.values())

    def _storage(self, t: torch.Tensor) -> torch.Tensor:
        import torch

        if self.device is not None:
            return torch.empty(t.shape, dtype=t.dtype, device=self.device)
        pin = t.is_cuda and torch.cuda.is_available()
        return torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)

    def _snapshot(self, state: Mapping[str, Any]) -> _Layout:
        """A baseline from live tensors: their layout, with every local box copied as integer bits."""
        (layout,) = _layouts([state], self.names, self.profile, self.group)
        if layout.flat is not None:
            copies = {k: self._storage(v).copy_(v) for k, v in layout.flat.items()}
            return _Layout(copies, layout.dtypes, None, layout.group)
        assert layout.ckpt is not None and isinstance(layout.ckpt.reader, LiveReader)
        reader = layout.ckpt.reader
        reader.local = {k: self._storage(v).copy_(v) for k, v in reader.local.items()}
        return layout

    def _from_checkpoint(self, state: Mapping[str, Any]) -> _Layout:
        """A baseline read once from an HF checkpoint, in the layout of ``state`` (this rank's boxes)."""
        from ..checkpoints.safetensors_dir import SafetensorsCheckpoint
        from ..checkpoints.shards import chunk_pieces

        layout = self._snapshot(state)  # shapes and boxes; the bits are replaced below
        assert self._source is not None
        with SafetensorsCheckpoint(self._source) as hf:
            check_layouts(hf.layout(), layout.layout)

            def canonical(name: str) -> np.ndarray:
                return hf.view(name).reshape(layout.layout[name][1])

            if layout.flat is not None:
                for name, buf in layout.flat.items():
                    _fill(buf, canonical(name))
                return layout
            ckpt = layout.ckpt
            assert ckpt is not None and isinstance(ckpt.reader, LiveReader)
            for (key, offsets), buf in ckpt.reader.local.items():
                chunk = next(c for c in ckpt.reader.stored[key].chunks if c.offsets == offsets)
                host = np.zeros(chunk.sizes, dtype=lookup_dtype(ckpt.reader.stored[key].dtype).uint)
                for piece in chunk_pieces(chunk, ckpt.segments_by_key.get(key, [])):
                    box = tuple(
                        slice(o, o + s) for o, s in zip(piece.canonical_offsets, piece.canonical_sizes, strict=True)
                    )
                    host[piece.slices] = canonical(piece.name)[box].reshape(host[piece.slices].shape)
                _fill(buf, host)
        return layout

    def diff(self, state: Mapping[str, Any], version: str) -> DiffSummary | None:
        """Write the delta from the committed baseline to ``state`` as ``out/<version>``. Collective.

        A version diffed before and not committed is replaced (its delta is rewritten). ``version``
        names the directory: it must be a store label (store-v1 §1.1), other than the baseline's.
        """
        import torch

        # Checked before anything is read or removed: out/<version> of an unchecked version ("", ".",
        # "../x", "/x") is out itself, a directory beside it or anywhere, and an earlier attempt is rmtree'd.
        if not isinstance(version, str) or not is_label(version):
            raise IncompatibleError(
                f"version {version!r} is not a valid label (it names the delta's directory): use 1-128 characters "
                "from A-Z a-z 0-9 . _ -, starting with a letter or digit"
            )
        if version == self.base_version:
            raise IncompatibleError(f"version {version!r} is the baseline's label: give the new version a new label")
        if self._baseline is None:
            self._baseline = self._from_checkpoint(state)
        (current,) = _layouts([state], self.names, self.profile, self.group)
        target = self.out / version
        # Rank 0 writes out/: it alone looks, and every rank learns its verdict (none waits for a rank that refused).
        verdict = self._replaceable(target, version) if self.group.rank == 0 else None
        refusal = self.group.all_gather(verdict)[0]
        if refusal:
            raise IncompatibleError(refusal)
        if target.exists() and self.group.rank == 0:
            shutil.rmtree(target)  # an earlier, uncommitted attempt at this version
        self.group.barrier()
        changes: list[Change] = []
        with torch.no_grad():
            summary, base_digests, digests = _run(
                self._baseline, current, target, base_version=self.base_version, target_version=version,
                overwrite=self.overwrite, workers=self.workers, level=self.level, on_block=self.on_block,
                base_digests=self._base_digests, record=changes.append, created=None,
            )  # fmt: skip
        self._pending = {version: (changes, digests)}
        self._base_digests = base_digests  # a retry need not hash the baseline again
        if self.on_delta is not None and self.group.rank == 0:
            self.on_delta(target)
        return summary

    def _replaceable(self, target: Path, version: str) -> str | None:
        """Why ``out/<version>`` must not be replaced (None: it may). Only an earlier attempt at this version
        from the current baseline may be: a delta of a version committed before (its base is another
        version) is a published step of the chain, and it stays."""
        if version in self._committed:
            return f"version {version!r} was committed already: give the new version a new label"
        try:
            base = Delta.open(target).manifest.base.version if (target / MANIFEST_NAME).is_file() else None
        except DcrError:
            base = None  # not a readable delta: an attempt cut short, replaced
        if base is not None and base != self.base_version:
            return (
                f"{target} holds the delta {base} -> {version}, not an attempt from the baseline "
                f"{self.base_version}: give the new version a new label, or move that delta away"
            )
        return None

    def committed(self, version: str) -> None:
        """``version`` is committed (every receiver acknowledged it): it becomes the baseline."""
        if version not in self._pending:
            raise IncompatibleError(f"version {version!r} was not the last one diffed; nothing to commit")
        changes, digests = self._pending.pop(version)
        advance(changes)
        self._pending.clear()
        self._base_digests = digests
        self._committed.update(v for v in (self.base_version, version) if v is not None)
        self.base_version = version


def advance(changes: list[Change]) -> None:
    """Write each scanned band's new values into the baseline band it was compared with (a view)."""
    import torch

    with torch.no_grad():
        for view, positions, values in changes:
            index = positions.to(view.device).long()
            if view.is_contiguous():
                view.view(-1)[index] = values.to(view.device)
            else:
                view[torch.unravel_index(index, view.shape)] = values.to(view.device)


def _fill(buf: torch.Tensor, host: np.ndarray) -> None:
    import torch

    host = host if host.flags.writeable and host.flags.c_contiguous else np.array(host)  # mmap views are read-only
    src = torch.from_numpy(host.view(f"<i{host.dtype.itemsize}")).reshape(buf.shape)
    buf.copy_(src)
