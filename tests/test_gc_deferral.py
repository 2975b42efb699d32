"""``DeferredCollections``: the collector's passes deferred across calls (a vLLM worker's, from a prepare to
its client's release), never for longer than the limit after the last ``defer``, from any thread.

What can go wrong: thresholds left raised (the older generations all but stopped in a serving process),
or restored while a scope still expects them raised, or a deferral ended early by a stale timer.
"""

from __future__ import annotations

import gc
import threading
import time

from dcr_cli.io import gc_pause
from dcr_cli.io.gc_pause import YOUNG, DeferredCollections, fewer_collections


def _restored(before: tuple[int, ...], within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while gc.get_threshold() != before and time.monotonic() < deadline:
        time.sleep(0.01)
    return gc.get_threshold() == before


def test_a_deferral_ends_at_resume_or_at_its_limit() -> None:
    before = gc.get_threshold()
    deferral = DeferredCollections()
    deferral.defer(60)
    assert deferral.deferred and gc.get_threshold()[0] == YOUNG
    deferral.resume()
    assert not deferral.deferred and gc.get_threshold() == before
    deferral.resume()  # (nothing to end)
    deferral.defer(0.05)  # a caller that never comes back
    assert _restored(before) and not deferral.deferred


def test_each_defer_extends_the_limit_and_a_stale_timer_ends_nothing() -> None:
    before = gc.get_threshold()
    deferral = DeferredCollections()
    deferral.defer(0.6)
    time.sleep(0.4)
    deferral.defer(0.6)  # the next prepare: 0.6 s from now, not from the first
    time.sleep(0.35)
    assert deferral.deferred and gc.get_threshold()[0] == YOUNG
    stale = deferral._timer
    assert stale is not None
    deferral.resume()
    deferral.defer(60)
    deferral._expire(stale)  # the old timer, run late (it fired while another thread held the lock)
    assert deferral.deferred and gc.get_threshold()[0] == YOUNG
    deferral.resume()
    assert gc.get_threshold() == before


def test_a_limit_reached_inside_another_scope_restores_at_that_scopes_end() -> None:
    before = gc.get_threshold()
    deferral = DeferredCollections()
    deferral.defer(0.05)
    with fewer_collections():  # (an apply, on the worker's thread)
        time.sleep(0.3)  # the limit runs out meanwhile
        assert not deferral.deferred and gc.get_threshold()[0] == YOUNG  # still raised for the scope
    assert gc.get_threshold() == before and gc_pause._depth == 0


def test_defers_and_resumes_from_many_threads_leave_the_thresholds_as_they_were() -> None:
    before = gc.get_threshold()
    deferral = DeferredCollections()

    def storm() -> None:
        for k in range(500):
            deferral.defer(0.001)
            with fewer_collections():
                pass
            if k % 3 == 0:
                deferral.resume()

    threads = [threading.Thread(target=storm) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    deferral.resume()
    assert gc.get_threshold() == before and gc_pause._depth == 0
