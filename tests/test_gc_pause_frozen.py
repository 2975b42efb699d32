"""``promote_survivors`` (the end of every collector pause) asks whether the host froze the heap once per
process, not at every pause: ``gc.get_freeze_count()`` walks the whole frozen heap in CPython, 105-117 ms
a call in a vLLM process, and every ``Delta.open`` and apply ends a pause or two. A heap that is not
frozen is still asked about every time (free while nothing is frozen), so that a host freezing it later
keeps it frozen.
"""

from __future__ import annotations

import gc
import sys
from types import FrameType
from typing import Any

from test_pertensor import assert_still_frozen, unfrozen_heap

from dcr_cli.io.gc_pause import fewer_collections, forget_frozen_heap, no_collections, promote_survivors

__all__ = ["unfrozen_heap"]  # the fixture, used by name below


def _freeze_count_calls(run: Any) -> int:
    """How often ``run()`` calls ``gc.get_freeze_count`` (a C call, seen by a profile hook)."""
    calls = 0

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        nonlocal calls
        if event == "c_call" and arg is gc.get_freeze_count:
            calls += 1

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return calls


def _pauses(n: int) -> None:
    """``n`` times each way a pause ends: no_collections, fewer_collections, promote_survivors itself."""
    for _ in range(n):
        with no_collections():
            pass
        with fewer_collections():
            pass
        promote_survivors()


def test_a_frozen_heap_is_asked_about_once_not_at_every_pause(unfrozen_heap: None) -> None:
    sentinel = [object() for _ in range(100)]
    gc.freeze()  # as vLLM does at start-up
    try:
        frozen = gc.get_freeze_count()
        calls = _freeze_count_calls(lambda: _pauses(50))
        assert calls == 1, calls  # was 150: one walk of the frozen heap per pause
        assert_still_frozen(sentinel, frozen)
    finally:
        gc.unfreeze()
        forget_frozen_heap()


def test_a_heap_frozen_after_the_first_pause_stays_frozen(unfrozen_heap: None) -> None:
    """The answer 'not frozen' is never kept: each pause on an unfrozen heap asks (a cheap question then)."""
    kept = [[i] for i in range(100)]
    with no_collections():
        pass
    assert id(kept[0]) in {id(x) for x in gc.get_objects(generation=2)}  # promoted: the heap was not frozen
    assert _freeze_count_calls(lambda: _pauses(3)) == 9  # asked at each promotion
    sentinel = [1]
    gc.freeze()  # the host freezes later
    try:
        frozen = gc.get_freeze_count()
        with no_collections():
            kept.append([0])
        promote_survivors()
        assert_still_frozen(sentinel, frozen)
    finally:
        gc.unfreeze()
        forget_frozen_heap()
    # Told that the host unfroze it, the pause promotes survivors again.
    with no_collections():
        late = [[0]]
    assert id(late[0]) in {id(x) for x in gc.get_objects(generation=2)}
