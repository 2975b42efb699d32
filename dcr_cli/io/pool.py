"""The one worker pool: ordered results, bounded in-flight work."""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


def default_workers() -> int:
    """The cores this process may run on (its affinity mask, not the machine's core count)."""
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1))


def ordered_parallel(tasks: Iterable[Callable[[], T]], workers: int) -> Iterator[T]:
    """Run tasks on a thread pool, yielding results in submission order.

    At most 2 x workers tasks are in flight, which bounds memory. Threads
    suffice: numpy, zstd and BLAKE3 release the GIL for the heavy work.
    """
    with ThreadPoolExecutor(max_workers=workers) as pool:
        window: deque[Future[T]] = deque()
        for task in tasks:
            window.append(pool.submit(task))
            if len(window) >= 2 * workers:
                yield window.popleft().result()
        while window:
            yield window.popleft().result()
