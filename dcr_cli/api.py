"""The Python API where the layer-3 packages meet: receivers fed from stores, acknowledgements, and
live producers publishing to stores.

``apply`` / ``verify`` take what the command line takes: delta directories, directories of
deltas, store URLs (resolved to one of their versions), or opened :class:`Delta` objects. An
acknowledgement (``ack``) is sent only after the receiver has proven that it holds the version
(the receivers raise otherwise), so a store never counts a receiver that does not hold it.
"""

from __future__ import annotations

import functools
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .delta.reader import Delta, DeltaLike
from .delta.summary import DiffSummary
from .errors import DcrError
from .receive import plan as receiver_plan
from .receive.checkpoint import ApplyResult, expand_deltas, warm_up
from .receive.checkpoint import apply as apply_checkpoint
from .receive.verify import VerifyReport
from .receive.verify import verify as verify_checkpoint

if TYPE_CHECKING:
    from .produce.live import Producer as LiveProducer


def resolve(
    deltas: DeltaLike | Sequence[DeltaLike],
    version: str | None,
    storage_options: dict[str, Any] | None,
    wait: float | None = None,
    on_wait: Callable[[str], None] | None = None,
    early_fetch: bool = False,
) -> list[DeltaLike]:
    """Store URLs become the Delta of one version (``version``, default the newest); the rest is kept.

    ``wait``: the one location given is a store URL where ``version`` may not be published yet (nor the
    store created): wait up to that many seconds for it (``early_fetch``: fetching the blocks its push
    announces meanwhile, for a receiver that reads them in this process)."""
    from .store import is_store, open_delta

    given = [deltas] if isinstance(deltas, (str, os.PathLike, Delta)) else list(deltas)
    if wait is not None and (version is None or len(given) != 1 or isinstance(given[0], Delta)):
        raise DcrError("--wait needs one store URL and --version: the version to wait for")
    out: list[DeltaLike] = []
    for d in given:
        if isinstance(d, (str, os.PathLike)) and (
            wait is not None or "://" in os.fspath(d) or is_store(os.fspath(d), storage_options)
        ):
            opened = open_delta(
                os.fspath(d),
                version,
                storage_options=storage_options,
                wait=wait,
                on_wait=on_wait,
                early_fetch=early_fetch,
            )
            out.append(opened)
        else:
            out.append(d)
    if version is not None and not any(isinstance(d, Delta) for d in out):
        raise DcrError("--version applies to store URLs only")
    return out


def _acknowledge(
    url: str,
    receiver: str,
    version: str,
    fp: str,
    storage_options: dict[str, Any] | None,
    opened: Sequence[DeltaLike] = (),
) -> None:
    from .store import acknowledge
    from .store.repo import StoreBlockSource

    # The store the deltas came from, if it is the one acknowledged on: its client and marker are ready.
    stores = [d.source.store for d in opened if isinstance(d, Delta) and isinstance(d.source, StoreBlockSource)]
    store = next((s for s in stores if s.url == url), None)
    acknowledge(url, version, receiver, fingerprint=fp, storage_options=storage_options, store=store)


def _ack_pair(ack: str | None, receiver: str | None) -> None:
    if bool(ack) != bool(receiver):
        raise DcrError("--ack URL and --receiver NAME go together")


def apply(
    deltas: DeltaLike | Sequence[DeltaLike],
    *,
    into: str | os.PathLike[str],
    version: str | None = None,
    since: str | None = None,
    ack: str | None = None,
    receiver: str | None = None,
    storage_options: dict[str, Any] | None = None,
    workers: int | None = None,
    verify: bool = False,
    log: Callable[[str], None] | None = None,
    wait: float | None = None,
    on_wait: Callable[[str], None] | None = None,
) -> ApplyResult:
    """Bring checkpoint directory ``into`` to the target of ``deltas`` (receive/checkpoint), then ack it.

    ``since``: with one store URL, the receiver is at committed version ``since``; the cheapest path by
    bytes among the chain and the store's shortcuts is applied (store-v1 §6).
    ``wait``: with one store URL and ``version``, wait up to that many seconds for the version to be
    published (a receiver started before its producer publishes: its start-up is off the refit's path);
    ``on_wait`` is told what it waits for, once, when it starts waiting.
    """
    _ack_pair(ack, receiver)
    if wait is not None and since is not None:
        raise DcrError("--wait and --since do not go together: --wait waits for one --version")
    if wait is not None:
        warm_up()  # while nothing is published yet: the first item then decodes at full speed
    chosen = _catch_up(deltas, since, version, storage_options, log) if since is not None else None
    opened = chosen if chosen is not None else resolve(deltas, version, storage_options, wait, on_wait, True)
    early = sum(d.fetched_early for d in opened if isinstance(d, Delta))
    if log and early:
        log(f"{version}: {early} blocks fetched while its push was still running")
    try:
        result = apply_checkpoint(opened, into=into, workers=workers, verify=verify, log=log)
        result.fetched_early = early
    finally:
        for d in opened:  # a store's blocks download in the background: stop what is no longer needed
            if isinstance(d, Delta):
                d.cancel_fetches()
    if ack and receiver:
        _acknowledge(ack, receiver, result.version, result.fingerprint, storage_options, opened)
    return result


def _catch_up(
    deltas: DeltaLike | Sequence[DeltaLike],
    since: str,
    version: str | None,
    storage_options: dict[str, Any] | None,
    log: Callable[[str], None] | None,
) -> list[DeltaLike]:
    """The deltas of the cheapest path from ``since`` on a store (no keyframe: apply updates in place)."""
    from .store import is_store, open_delta
    from .store.keyframes import open_plan, plan

    given = [deltas] if isinstance(deltas, (str, os.PathLike, Delta)) else list(deltas)
    if len(given) != 1 or isinstance(given[0], Delta) or not is_store(os.fspath(given[0]), storage_options):
        raise DcrError("--since needs exactly one store URL")
    url = os.fspath(given[0])
    chosen = plan(url, since, version, allow_keyframe=False, storage_options=storage_options)
    if log:
        log(chosen.describe())
    opened: list[DeltaLike] = list(open_plan(url, chosen, storage_options=storage_options))
    return opened or [open_delta(url, since, storage_options=storage_options)]  # already there: a no-op apply


def apply_vllm(
    deltas: DeltaLike | Sequence[DeltaLike],
    url: str,
    *,
    version: str | None = None,
    since: str | None = None,
    ack: str | None = None,
    receiver: str | None = None,
    storage_options: dict[str, Any] | None = None,
    verify: bool = False,
    log: Callable[[str], None] | None = None,
    wait: float | None = None,
    on_wait: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Apply a chain of deltas to the vLLM server at ``url``; returns {vllm, version, fingerprint, steps,
    fetched_early}.

    ``deltas``, ``version``, ``since`` and ``wait`` are those of :func:`apply`. A store URL is resolved
    here, with ``storage_options``; the engine's workers then read the chosen manifests by their store
    locations (``STORE/manifests/<digest>.json``) with the engine's own fsspec configuration, and fetch
    and check every block before the engine is paused (receiver-vllm.md §7). With ``wait``, the blocks
    the push announces are fetched here while it runs (``fetched_early`` of them), and an engine on this
    node reads them from here instead of the store. ``verify``: then read
    back every tensor of the engine, not only the touched ones the apply proved (``dcr verify --vllm``).
    """
    from .receive.vllm import apply_chain_to_server, verify_server

    _ack_pair(ack, receiver)
    if wait is not None and since is not None:
        raise DcrError("--wait and --since do not go together: --wait waits for one --version")
    chosen = _catch_up(deltas, since, version, storage_options, log) if since is not None else None
    # Waiting, the blocks the push announces are fetched meanwhile and offered to the engine (an engine on this node).
    opened = chosen if chosen is not None else resolve(deltas, version, storage_options, wait, on_wait, True)
    early = sum(d.fetched_early for d in opened if isinstance(d, Delta))
    if log and early:
        log(f"{version}: {early} blocks fetched while its push was still running")
    # The engine's workers open the deltas themselves: local paths are made absolute.
    located = [d if isinstance(d, Delta) or "://" in os.fspath(d) else os.path.abspath(d) for d in opened]
    order = receiver_plan.engine_chain(expand_deltas(located))
    steps = apply_chain_to_server(url, order, log=log)  # one claim for the whole chain
    target = order[-1].manifest.target
    if verify:
        answer = verify_server(url, order[-1])
        if log:
            log(f"ok: {answer['tensors']} tensors of the vLLM engine match ({answer['fingerprint'][:16]}…)")
    if ack and receiver:
        _acknowledge(ack, receiver, target.version, target.fingerprint, storage_options, opened)
        if log:
            log(f"acknowledged {target.version} as {receiver!r} on {ack}")
    return {
        "vllm": url,
        "version": target.version,
        "fingerprint": target.fingerprint,
        "steps": steps,
        "fetched_early": early,
    }


def verify(
    checkpoint: str | os.PathLike[str],
    *,
    against: DeltaLike | None = None,
    version: str | None = None,
    storage_options: dict[str, Any] | None = None,
    workers: int | None = None,
) -> VerifyReport:
    """``dcr verify CKPT [--against DELTA|STORE_URL [--version V]]`` (receive/verify)."""
    expected: DeltaLike | None = None
    if against is not None:
        (expected,) = resolve(against, version, storage_options)
    elif version is not None:
        raise DcrError("--version applies to a store URL given with --against")
    if expected is not None and not isinstance(expected, Delta):
        expected = Delta.open(expected)
    return verify_checkpoint(checkpoint, against=expected, workers=workers)


def verify_vllm(url: str, against: DeltaLike | None = None) -> dict[str, Any]:
    """Read the engine's weights back through its placement; raises VerifyFailed on a mismatch."""
    from .receive.vllm import verify_server

    if against is not None and not isinstance(against, Delta) and "://" not in os.fspath(against):
        against = os.path.abspath(against)
    return verify_server(url, against)


# --------------------------------------------------------------------------- live producers


@functools.cache
def _store_producer() -> Callable[..., LiveProducer]:
    """The store-publishing live producer, defined on first use: the producer package loads the
    encoder and its numba kernels, which a receiver's ``dcr apply``/``dcr verify`` never needs."""
    from .produce.live import Producer as LiveProducer

    class _StoreProducer(LiveProducer):
        """A live producer that uploads each block as it is written and publishes each delta on a store."""

        def __init__(self, url: str, storage_options: dict[str, Any] | None, root: Path, *args: Any, **kw: Any) -> None:
            super().__init__(root, *args, **kw)
            self.url, self.storage_options = url, storage_options or {}

        def diff(self, state: Mapping[str, Any], version: str) -> DiffSummary | None:
            from .store import BlockUploader, push

            uploader = BlockUploader(self.url, self.storage_options, announce=version)
            self.on_block = uploader
            try:
                try:
                    summary = super().diff(state, version)
                finally:
                    self.on_block = None
                    uploader.wait_uploads()  # the blocks; their announcements go on during the push's questions
                if self.group.rank != 0:
                    uploader.close()  # this rank's announcements, before rank 0's push publishes and removes them
                self.group.barrier()
                if self.group.rank == 0:
                    push(
                        self.out / version,
                        self.url,
                        storage_options=self.storage_options,
                        fresh=uploader.uploaded,
                        on_published=lambda _: uploader.close(),  # the announcements, before the push removes them
                    )
            finally:
                uploader.close()
            self.group.barrier()
            return summary

    return _StoreProducer


def Producer(
    out_or_store_url: str | os.PathLike[str],
    baseline: Mapping[str, Any] | str | os.PathLike[str],
    *,
    storage_options: dict[str, Any] | None = None,
    staging: str | os.PathLike[str] | None = None,
    **kwargs: Any,
) -> LiveProducer:
    """A live-tensor producer (``dcr_cli.produce.live.Producer``) writing to a delta directory or a store.

    With a store URL (``s3://…``, ``file://…``) each block is uploaded as soon as it is written and
    the delta is published when complete (as ``dcr diff --push``); deltas are staged in ``staging``
    (a directory every rank can reach; default: a temporary directory).
    """
    from .produce.live import Producer as LiveProducer

    if "://" not in str(out_or_store_url):
        return LiveProducer(out_or_store_url, baseline, **kwargs)
    root = Path(staging) if staging is not None else Path(tempfile.mkdtemp(prefix="dcr-live-"))
    return _store_producer()(str(out_or_store_url), storage_options, root, baseline, **kwargs)
