"""The one worker pool: ordered results, in-flight work bounded by a count or by bytes."""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Callable, Generator, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Generic, TypeVar

from ..errors import IncompatibleError

T = TypeVar("T")


def check_workers(workers: object) -> None:
    """What the command line's ``--workers`` type checks, for callers of the Python API: None (all
    cores) or an integer of at least 1; else one IncompatibleError line before any work."""
    if workers is not None and not (isinstance(workers, int) and not isinstance(workers, bool) and workers >= 1):
        raise IncompatibleError(f"workers must be an integer of at least 1 (or None: all cores), not {workers!r}")


def default_workers() -> int:
    """The cores this process may run on (its affinity mask, not the machine's core count)."""
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1))


class Inline(Generic[T]):
    """A task for ``ordered_parallel`` to run on the consuming thread, in its turn, not on the pool.

    For work that holds the GIL almost throughout (a batch of tiny items: many small reads, decodes
    and digests): on the pool two such tasks only take turns at the GIL, and each turn is a thread
    hand-off. Inline, it runs while the pool works on the larger tasks submitted around it.
    """

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[[], T]) -> None:
        self.fn = fn

    def __call__(self) -> T:
        return self.fn()


def ordered_parallel(tasks: Iterable[Callable[[], T]], workers: int) -> Iterator[T]:
    """Run tasks on a thread pool, yielding results in submission order.

    At most 2 x workers tasks are in flight, which bounds memory when tasks are
    alike. Threads suffice: numpy, zstd and BLAKE3 release the GIL for the heavy
    work. Tasks of very different sizes take ``ordered_stream`` and a byte budget.
    An :class:`Inline` task runs on the calling thread when its result is due.
    """
    with ThreadPoolExecutor(max_workers=workers) as pool:
        window: deque[Future[T] | Inline[T]] = deque()
        for task in tasks:
            window.append(task if isinstance(task, Inline) else pool.submit(task))
            if len(window) >= 2 * workers:
                yield _settle(window.popleft())
        while window:
            yield _settle(window.popleft())


def parallel(tasks: Iterable[Callable[[], T]], workers: int) -> list[T]:
    """Run every task on a thread pool at once, results in order; the first failure cancels what has
    not started. For I/O that waits (store requests): all of them in flight, not a window."""
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        futures = [pool.submit(task) for task in tasks]
        try:
            return [future.result() for future in futures]
        except BaseException:
            for future in futures:
                future.cancel()
            raise


def in_background(fn: Callable[[], T], name: str) -> Future[T]:
    """``fn`` on a daemon thread of its own, started now; its result (or exception) in the future returned.

    For one slow setup step (a store's client, a round trip) that the caller's own work can overlap:
    the caller waits on the future only where it needs the answer.
    """
    done: Future[T] = Future()

    def run() -> None:
        try:
            result = fn()
        except BaseException as exc:  # handed to the waiter, who raises it
            done.set_exception(exc)
        else:
            done.set_result(result)

    threading.Thread(target=run, name=name, daemon=True).start()
    return done


def _settle(entry: Future[T] | Inline[T]) -> T:
    return entry() if isinstance(entry, Inline) else entry.result()


class _Slot(Generic[T]):
    """One task in flight: its declared cost, the results it produced that are not consumed yet."""

    def __init__(self, cost: int) -> None:
        self.cost = cost
        self.results: deque[tuple[T, int]] = deque()
        self.done = False
        self.error: BaseException | None = None
        self.inline: Inline[Iterable[T]] | None = None  # run by the consumer when it is the oldest


class _Cancelled(Exception):
    pass


def ordered_stream(
    tasks: Iterable[tuple[int, Callable[[], Iterable[T]]]],
    workers: int,
    *,
    budget: int,
    size: Callable[[T], int] = lambda _: 0,
) -> Generator[T, None, None]:
    """Run streaming tasks on a thread pool; yield every task's results, in task order, as they come.

    A task is ``(cost, fn)``: ``fn()`` returns an iterable of results (a generator streams them), and
    ``cost`` is the bytes it may hold while it runs (its working memory). Held bytes are the costs of
    the tasks in flight plus the ``size`` of the results produced and not yet consumed. A task starts
    only while held bytes plus its cost stay within ``budget``, or when nothing is in flight (so one
    task larger than the budget runs alone); a task that is not the oldest in flight waits before it
    keeps a result that would exceed the budget, and the oldest never waits, so the pool always
    progresses. The results of the oldest task are yielded as soon as they are produced.

    A task whose ``fn`` is an :class:`Inline` runs on the consuming thread when it is the oldest (its
    results are yielded as it produces them, with no hand-off between threads); its cost is held from
    its admission to its end, like a pool task's, while the pool runs the tasks admitted after it.
    """
    cond = threading.Condition()
    slots: deque[_Slot[T]] = deque()  # in flight, in task order
    state = {"held": 0, "cancelled": False}

    def run(slot: _Slot[T], fn: Callable[[], Iterable[T]]) -> None:
        try:
            for result in fn():
                nbytes = size(result)
                with cond:
                    while slots[0] is not slot and state["held"] + nbytes > budget and not state["cancelled"]:
                        cond.wait()
                    if state["cancelled"]:
                        raise _Cancelled
                    slot.results.append((result, nbytes))
                    state["held"] += nbytes
                    cond.notify_all()
        except _Cancelled:
            pass
        except BaseException as exc:  # handed to the consumer, in task order
            slot.error = exc
        finally:
            with cond:
                slot.done = True
                cond.notify_all()

    source = iter(tasks)
    pending = next(source, None)
    pool = ThreadPoolExecutor(max_workers=workers)
    try:
        while True:
            # Admit what fits (fetching the next task outside the lock: building one may take time).
            while pending is not None:
                cost, fn = pending
                with cond:
                    if slots and (state["held"] + cost > budget or len(slots) >= 4 * workers):
                        break
                    slot: _Slot[T] = _Slot(cost)
                    slots.append(slot)
                    state["held"] += cost
                if isinstance(fn, Inline):
                    slot.inline = fn
                else:
                    pool.submit(run, slot, fn)
                pending = next(source, None)
            with cond:
                if not slots:
                    return
                head = slots[0]
            if head.inline is not None:  # the oldest task, run here: results go straight to the consumer
                inline, head.inline = head.inline, None
                try:
                    yield from inline()
                finally:
                    with cond:
                        slots.popleft()
                        state["held"] -= head.cost
                        cond.notify_all()
                continue
            with cond:
                while not head.results and not head.done:
                    cond.wait()
                if head.results:
                    result, nbytes = head.results.popleft()
                    state["held"] -= nbytes
                    cond.notify_all()
                else:
                    slots.popleft()
                    state["held"] -= head.cost
                    cond.notify_all()
                    if head.error is not None:
                        raise head.error
                    continue
            yield result
    finally:
        with cond:
            state["cancelled"] = True
            cond.notify_all()
        pool.shutdown(wait=True, cancel_futures=True)
