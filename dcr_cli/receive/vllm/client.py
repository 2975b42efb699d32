"""Driving a vLLM engine that runs the dcr backend: over HTTP (``dcr apply --vllm URL``) or in-process.

Server (``VLLM_SERVER_DEV_MODE=1`` mounts the routes used here)::

    POST /collective_rpc {"method": "dcr_rpc", ...}   prepare: base version, placement, blocks, first pass
                                                      (reads only; the engine serves on meanwhile)
    POST /pause?mode=wait&clear_cache=true            the pause window starts: only writes and the proof
    POST /start_weight_update
    POST /update_weights {"update_info": {"delta": LOCATION}}
    POST /finish_weight_update {"weight_version": TARGET}   bumps the version stamped on outputs
    POST /reset_prefix_cache
    POST /resume

In-process: the same steps through ``LLM.collective_rpc`` / ``LLM.update_weights``.
The delta LOCATION must be readable by the engine's workers (a local path on the same machine,
or an fsspec URL such as s3://...).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from ... import errors
from ...delta.reader import Delta
from ...errors import ConflictError, DcrError, IncompatibleError, VerifyFailed
from ...io.gc_pause import fewer_collections
from ..plan import quote

RPC_METHOD = "dcr_rpc"


def delta_location(delta: str | os.PathLike[str] | Delta) -> str:
    """Where the engine's workers find the delta: absolute local paths, URLs unchanged."""
    url = delta.url if isinstance(delta, Delta) else os.fspath(delta)
    return url if "://" in url else os.path.abspath(url)


def open_in_frozen_heap(location: str, offered: str | None = None) -> Delta:
    """``Delta.open`` in a process whose heap vLLM froze (a worker, or the caller of an in-process ``LLM``).

    ``Delta.open`` parses under ``io.gc_pause.no_collections``, whose end promotes the parse's
    survivors unless the host froze its heap, and to find out calls ``gc.get_freeze_count()``, which
    in CPython walks the whole frozen heap: vLLM freezes everything its engine allocated
    (``freeze_gc_heap``), so each open paid 105-117 ms (medium bench, three opens per apply) to learn
    that nothing was to be done. With the collector disabled around the open, ``no_collections`` skips
    that end, which in a frozen heap is exactly what it would have done. ``offered``: see ``Delta.open``
    (the client's early spool: the manifest is read there, not from the store, where it is intact).
    """
    if not gc.isenabled():
        return Delta.open(location, offered=offered)
    gc.disable()
    try:
        return Delta.open(location, offered=offered)
    finally:
        gc.enable()


INTERNAL = "internal"  # backend.INTERNAL: a rank raised an exception dcr did not expect


class EngineInternalError(DcrError):
    """A rank of the engine raised an exception dcr did not expect (a bug in dcr): exit 70, the rank's message.

    A DcrError (callers that catch DcrError see it) whose exit code is the internal error's.
    """

    exit_code = errors.EXIT_INTERNAL


def _error_class(kind: str, default: type[DcrError] = DcrError) -> type[DcrError]:
    if kind == INTERNAL:
        return EngineInternalError
    cls = getattr(errors, kind, None)
    if not (isinstance(cls, type) and issubclass(cls, DcrError)) or cls is DcrError:
        return default
    return cls


def _said(cls: type[DcrError], message: str) -> str:
    if cls is EngineInternalError:
        return f"internal error in the engine (a bug in dcr; please report it): {message}"
    return message


def _answers(results: list[Any]) -> list[dict[str, Any]]:
    """Per-rank answers of dcr_rpc; an error becomes a DcrError with its exit code (a rank's bug first)."""
    answers = [r if isinstance(r, dict) else {"ok": False, "error": str(r)} for r in results]
    failed = sorted((a for a in answers if not a.get("ok")), key=lambda a: a.get("kind") != INTERNAL)
    if failed:
        kind = str(failed[0].get("kind"))
        cls = _error_class(kind)
        raise cls(_said(cls, f"vLLM engine: {failed[0].get('error')}"))
    return answers


# Seconds without a call from the client that claimed an engine after which its claim lapses (a
# client that died): long enough for a pause that waits for running requests, or a slow first pass.
CLAIM_LEASE_S = 300.0


class Engine:
    """The steps of an apply, for either kind of engine."""

    token: str | None = None  # the claim this client holds (sent with every dcr_rpc request)
    in_process = False  # the engine's workers run in this process (they share its heap and its GIL)

    def rpc(self, op: str, **args: Any) -> list[dict[str, Any]]:
        raise NotImplementedError

    def request(self, op: str, args: dict[str, Any]) -> str:
        """The JSON of a dcr_rpc request (with this client's claim token, if it holds one)."""
        return json.dumps({"op": op, **args, **({"token": self.token} if self.token else {})})

    def open_delta(self, location: str) -> Delta:
        """The delta as this client reads it (its versions, fingerprints and id)."""
        return Delta.open(location)

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def start(self) -> None:
        raise NotImplementedError

    def update(self, location: str) -> None:
        raise NotImplementedError

    def finish(self, version: str | None) -> None:
        """Close the update session; stamp ``version`` on outputs (None: a failed update, no stamp)."""
        raise NotImplementedError

    def reset_prefix_cache(self) -> None:
        raise NotImplementedError

    def set_version(self, version: str) -> None:
        raise NotImplementedError


class ServerEngine(Engine):
    """A ``vllm serve`` API server with the dcr plugin, reached over HTTP."""

    def __init__(self, url: str, timeout: float = 3600.0) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout

    def call(self, path: str, body: dict[str, Any] | None = None, method: str = "POST") -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method=method)
        if data is not None:
            request.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                raw = response.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read()[:300].decode(errors="replace").strip()
            if exc.code == 404:
                raise DcrError(
                    f"{self.url}{path} is not served (404); start vLLM with VLLM_SERVER_DEV_MODE=1, which "
                    "mounts its weight-update routes"
                ) from None
            raise DcrError(f"{self.url}{path} answered HTTP {exc.code}: {detail}") from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise DcrError(f"cannot reach the vLLM server at {self.url} ({reason}); is it running?") from None
        return json.loads(raw) if raw else None

    def rpc(self, op: str, **args: Any) -> list[dict[str, Any]]:
        reply = self.call("/collective_rpc", {"method": RPC_METHOD, "args": [self.request(op, args)]})
        results = (reply or {}).get("results")
        if not isinstance(results, list):
            raise DcrError(f"{self.url}: unexpected reply to collective_rpc: {str(reply)[:200]}")
        if any(isinstance(r, str) and "not implemented" in r for r in results):
            raise DcrError(f"{self.url}: the dcr plugin is not installed in the server's environment")
        return _answers(results)

    def pause(self) -> None:
        self.call("/pause?" + urllib.parse.urlencode({"mode": "wait", "clear_cache": "true"}))

    def resume(self) -> None:
        self.call("/resume")

    def start(self) -> None:
        self.call("/start_weight_update")

    def update(self, location: str) -> None:
        self.call("/update_weights", {"update_info": {"delta": location}})

    def finish(self, version: str | None) -> None:
        self.call("/finish_weight_update", {"weight_version": version})

    def reset_prefix_cache(self) -> None:
        self.call("/reset_prefix_cache")

    def set_version(self, version: str) -> None:
        self.call("/update_weight_version", {"new_version": version})


class InProcessEngine(Engine):
    """A ``vllm.LLM`` in this process, started with ``weight_transfer_config={"backend": "dcr"}``."""

    in_process = True

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def open_delta(self, location: str) -> Delta:
        return open_in_frozen_heap(location)  # vLLM froze this process's heap when the engine started

    def rpc(self, op: str, **args: Any) -> list[dict[str, Any]]:
        try:
            results = self.llm.collective_rpc(RPC_METHOD, args=(self.request(op, args),))
        except NotImplementedError:
            raise DcrError("the dcr vLLM plugin is not loaded in this process (vllm.general_plugins)") from None
        return _answers(results)

    def start(self) -> None:
        self.llm.start_weight_update()

    def update(self, location: str) -> None:
        self.llm.update_weights({"update_info": {"delta": location}})

    def finish(self, version: str | None) -> None:
        self.llm.finish_weight_update(weight_version=version)

    def reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()

    def set_version(self, version: str) -> None:
        self.llm.update_weight_version(version)


def apply_to_engine(engine: Engine, delta: str | os.PathLike[str] | Delta, log: Callable[[str], None] | None = None):
    """Prepare (every check and the first pass), pause, update in place, bump the weight version,
    reset the prefix cache, resume. The delta is read and checked before the engine is paused, so
    a bad delta never pauses it; the report's ``pause_seconds`` is the window it did not serve.

    Whatever fails after the pause, the engine is resumed if no rank wrote anything, else left
    paused with a message that says so; a retry of the same command closes the update session an
    interrupted client left open (without a version) and finishes the apply exactly.

    The client claims the engine first and releases it at the end: a second client that applies
    another delta meanwhile is refused (exit 3) before it touches anything; a re-run of the same
    delta takes the claim over (backend.py).
    """
    return apply_chain_to_engine(engine, [delta], log)[0]


def apply_chain_to_engine(
    engine: Engine, deltas: Sequence[str | os.PathLike[str] | Delta], log: Callable[[str], None] | None = None
) -> list[dict[str, Any]]:
    """``apply_to_engine`` of each delta in turn (chain order), under one claim for the whole chain.

    The claim names the chain's last delta: no other client gets between two of its steps, and a
    re-run of the same chain takes an interrupted one's claim over. Returns one report per delta.
    """
    # With the engine in this process, the collector's passes wait for the whole chain: the manifests this
    # client parses are alive until its end, and a young pass over a 20k-item MoE manifest cost the engine
    # 25-50 ms of its GIL at the apply's start. (A remote engine's caller, a trainer say, keeps its own
    # collector: deferring it there for minutes would only let its garbage pile up.)
    with fewer_collections() if engine.in_process else contextlib.nullcontext():
        opened = [
            (delta_location(d), d if isinstance(d, Delta) else engine.open_delta(delta_location(d))) for d in deltas
        ]
        if not opened:
            return []
        _claim(engine, opened[-1][1].id)
        try:
            return [_apply_claimed(engine, location, delta, log) for location, delta in opened]
        finally:
            _release(engine)
            del opened


def _claim(engine: Engine, delta_id: str) -> None:
    """Claim the engine for this client, or fail if another client is updating it (before anything is touched)."""
    engine.token = uuid.uuid4().hex
    try:
        answers = engine.rpc("claim", delta=delta_id, lease=CLAIM_LEASE_S)
    except DcrError as exc:
        engine.token = None
        if "unknown dcr_rpc op" in str(exc):
            raise IncompatibleError(
                "the dcr plugin in the vLLM server's environment is older than this client (it cannot be "
                "claimed); install the same dcr version there and restart the server"
            ) from None
        raise
    held = [a for a in answers if not a.get("claimed")]
    if held:
        _release(engine)  # the ranks that did grant it
        other = held[0]
        raise ConflictError(
            f"another dcr apply is updating this engine (delta {str(other.get('delta'))[:16]}…, last active "
            f"{float(other.get('idle', 0)):.0f} s ago); wait for it to finish, then re-run (a client that died "
            f"loses its claim after {float(other.get('lease', CLAIM_LEASE_S)):.0f} s without a call)"
        )


def _release(engine: Engine) -> None:
    if engine.token is None:
        return
    try:
        engine.rpc("release")
    except Exception:
        pass  # the claim lapses with its lease
    finally:
        engine.token = None


def _apply_claimed(engine: Engine, location: str, opened: Delta, log: Callable[[str], None] | None) -> dict[str, Any]:
    target = opened.manifest.target.version
    started = time.perf_counter()
    # Blocks this client fetched while it waited for the version (apply --wait): offered to the engine's
    # workers, which take the intact ones from here if they run on this node (receiver-vllm.md §7).
    early = opened.early_blocks()
    offer = {"early": early} if early is not None else {}
    answers = engine.rpc("prepare", delta=location, **offer)  # raises before anything is touched
    taken = max(int(a.get("early_blocks") or 0) for a in answers)
    if early is not None and log:
        manifest = ", and the manifest" if all(a.get("manifest_offered") for a in answers) else ""
        log(
            f"{target}: the engine read {taken} of the {opened.fetched_early} blocks fetched early from this node"
            f"{manifest}"
        )
    modes = {a["mode"] for a in answers}
    prepare_seconds = time.perf_counter() - started
    if modes == {"noop"}:
        if any(a.get("session_open") for a in answers):
            # An earlier client proved the target on every rank and was interrupted before it
            # closed the session: close it with the version, and serve again.
            _guarded(engine, "finishing the update an interrupted apply left open", lambda: _close(engine, target))
        else:
            engine.set_version(target)
        if log:
            log(f"the engine already holds version {target}")
        return {"status": "noop", "version": target}
    if len(modes) != 1:
        raise IncompatibleError(f"the engine's ranks disagree about their version ({sorted(modes)}); restart it")
    paused = time.perf_counter()
    try:
        engine.pause()
    except Exception as exc:  # the pause may have taken effect with its reply lost: resume, nothing was written
        _failed(engine, _statuses(engine), (f"pausing the engine failed: {_one_line(exc)}", "DcrError"))
    try:
        _start(engine)
    except Exception as exc:  # nothing was written: serve the old weights again
        _failed(engine, _statuses(engine), (f"starting the weight update failed: {_one_line(exc)}", "DcrError"))
    try:
        engine.update(location)
    except Exception as exc:  # a dropped connection, a timeout, or an engine whose update raised
        statuses = _statuses(engine)
        if statuses is None or not _completed(statuses, opened.manifest.target.fingerprint):
            found = _errors(statuses or [])
            _failed(engine, statuses, found[0] if found else (f"the update failed: {_one_line(exc)}", "DcrError"))
        # else: the update ran to completion on every rank; only its reply was lost.
    # Every rank recorded its outcome and returned normally (nothing is left queued in vLLM's
    # channels): ask all of them, and fail if any one failed.
    try:
        statuses = engine.rpc("status")
    except Exception as exc:
        _failed(engine, None, (f"reading the ranks' status after the update failed: {_one_line(exc)}", "DcrError"))
    failures = _errors(statuses)
    if failures:
        _failed(engine, statuses, failures[0])
    proven = "the delta is applied and proven on every rank, but closing the update"
    _guarded(engine, proven, lambda: _close(engine, target))
    pause_seconds = time.perf_counter() - paused
    report = dict(statuses[0].get("last_report") or {})
    report.update(prepare_seconds=prepare_seconds, pause_seconds=pause_seconds, early_blocks=taken)
    if log:
        log(
            f"vLLM engine at version {target}: {report.get('applied', 0)} items applied, "
            f"{report.get('repaired', 0)} repaired, {report.get('done', 0)} already done "
            f"({report.get('written_elements', 0)} elements written, {report.get('seconds', 0.0):.3f} s); "
            f"paused {pause_seconds:.3f} s (checked and read before the pause in {prepare_seconds:.3f} s)"
        )
    return report


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text if isinstance(exc, DcrError) else f"{type(exc).__name__}: {text}"[:500]


def _start(engine: Engine) -> None:
    """Open the update session; close first a session that an interrupted client left open."""
    try:
        engine.start()
        return
    except Exception as exc:
        statuses = _statuses(engine)
        stale = "already active" in str(exc) or any(s.get("session_open") for s in statuses or [])
        if not stale:
            raise
    engine.finish(None)  # no version stamped: the weights' state is the ranks' own (EngineState)
    engine.start()


def _close(engine: Engine, target: str) -> None:
    engine.finish(target)
    engine.reset_prefix_cache()
    engine.resume()


def _guarded(engine: Engine, what: str, step: Callable[[], None]) -> None:
    """A step after every rank reached the target: on failure the engine is left paused (its
    weights are the target's; no stale version may be served as the new one)."""
    try:
        step()
    except Exception as exc:
        raise DcrError(
            f"{what} failed ({_one_line(exc)}); the engine is left paused: re-run the same command to finish"
        ) from None


def _completed(statuses: list[dict[str, Any]], target_fingerprint: str) -> bool:
    """Every rank finished the update without an error and holds the target (by its fingerprint)."""
    return all(
        not s.get("last_error")
        and s.get("last_report")
        and s["state"].get("applying") is None
        and s["state"].get("fingerprint") == target_fingerprint
        for s in statuses
    )


def _statuses(engine: Engine) -> list[dict[str, Any]] | None:
    try:
        return engine.rpc("status")
    except Exception:
        return None


def _errors(statuses: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(message, error kind) recorded by each rank whose last update failed: a rank's bug first, then rank order."""
    failed = [s for s in statuses if s.get("last_error")]
    found = [(str(s["last_error"]), str(s.get("last_error_kind") or "DcrError")) for s in failed]
    return sorted(found, key=lambda f: f[1] != INTERNAL)


def _failed(engine: Engine, statuses: list[dict[str, Any]] | None, error: tuple[str, str]) -> NoReturn:
    """Raise for a failed update: resume the engine if no rank wrote anything, else leave it paused.

    The update session is closed here (without a version) where it may be open, so that the retry
    can start a new one. The error raised is always ``error``'s; a failing cleanup is added to it.
    """
    message, kind = error
    problems: list[str] = []
    if statuses is None or any(s.get("session_open") is not False for s in statuses):
        try:
            engine.finish(None)
        except Exception as exc:
            if statuses is not None and any(s.get("session_open") for s in statuses):
                problems.append(f"closing the update session failed: {_one_line(exc)}")
            # else: the session was not open (vLLM closes it when its update raised)
    if statuses is None:
        raise DcrError(
            f"the apply failed on the engine ({message}); its status cannot be read, so the engine may be left "
            "paused and part of the delta applied: re-run the same command to finish it exactly"
        )
    applying = sum(s["state"].get("applying") is not None for s in statuses)
    if applying == 0 and not problems:
        try:
            engine.resume()  # refused before any write: the engine still serves its old version
        except Exception as exc:
            problems.append(f"resuming the engine failed: {_one_line(exc)}")
        else:
            cls = _error_class(kind)
            raise cls(_said(cls, f"vLLM engine: {message}; nothing was written and the engine serves its old version"))
    if applying == 0:
        raise DcrError(
            f"the apply failed on the engine ({message}); nothing was written, but {'; '.join(problems)}; "
            "the engine is left paused: re-run the same command to finish"
        )
    # Left paused: the weights are part old, part new. The retry classifies every item again.
    cls = _error_class(kind, DcrError) if kind == INTERNAL else DcrError
    raise cls(
        _said(
            cls,
            f"the apply failed on the engine ({message}); the engine is left paused with part of the delta applied "
            f"({applying} of {len(statuses)} ranks applying{''.join('; ' + p for p in problems)}): "
            "re-run the same command to finish it exactly (torn items are overwritten)",
        )
    )


def verify_engine(engine: Engine, delta: str | os.PathLike[str] | Delta | None = None) -> dict[str, Any]:
    """Read every canonical tensor back through vLLM's placement; raise VerifyFailed on a mismatch."""
    args = {} if delta is None else {"delta": delta_location(delta)}
    early = delta.early_blocks() if isinstance(delta, Delta) else None
    if early is not None:  # the manifest, as prepare reads it: from this node's spool rather than the store
        args["early"] = early
    answer = engine.rpc("verify", **args)[0]
    if answer["mismatched"]:
        names = answer["mismatched"]
        raise VerifyFailed(
            f"{len(names)} of {answer['tensors']} tensors differ from the expected digests: "
            + ", ".join(quote(n) for n in names[:5])
            + (" …" if len(names) > 5 else "")
        )
    return answer


def apply_to_server(url: str, delta: str | os.PathLike[str] | Delta, log: Callable[[str], None] | None = None):
    return apply_to_engine(ServerEngine(url), delta, log)


def apply_chain_to_server(
    url: str, deltas: Sequence[str | os.PathLike[str] | Delta], log: Callable[[str], None] | None = None
) -> list[dict[str, Any]]:
    return apply_chain_to_engine(ServerEngine(url), deltas, log)


def verify_server(url: str, delta: str | os.PathLike[str] | Delta | None = None) -> dict[str, Any]:
    return verify_engine(ServerEngine(url), delta)


def apply_to_llm(llm: Any, delta: str | os.PathLike[str] | Delta, log: Callable[[str], None] | None = None):
    return apply_to_engine(InProcessEngine(llm), delta, log)


def verify_llm(llm: Any, delta: str | os.PathLike[str] | Delta | None = None) -> dict[str, Any]:
    return verify_engine(InProcessEngine(llm), delta)
