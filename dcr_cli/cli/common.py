"""Pieces every command shares: error handling, JSON output, progress bars."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import wraps
from typing import Any

import click

from ..errors import DcrError


def _fail(message: str, code: int) -> None:
    click.echo(f"dcr: error: {message}", err=True)
    sys.exit(code)


def handle_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn DcrError (and I/O failures) into one line on stderr and an exit code."""

    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except DcrError as exc:
            _fail(str(exc), exc.exit_code)
        except OSError as exc:
            _fail(f"{exc.strerror or exc} ({exc.filename or 'I/O'})", 2)
        except KeyboardInterrupt:
            _fail("interrupted", 130)

    return wrapper


def emit_json(obj: Any) -> None:
    click.echo(json.dumps(obj, indent=2, sort_keys=False))


@contextmanager
def byte_progress(total: int, label: str, enabled: bool) -> Iterator[Callable[[int], None] | None]:
    """A rich progress bar on stderr when it is a terminal; nothing otherwise (cron, pipes)."""
    if not enabled or not sys.stderr.isatty():
        yield None
        return
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    with Progress(
        TextColumn(label),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        transient=True,
    ) as bar:
        task = bar.add_task(label, total=total)
        yield lambda n: bar.advance(task, n)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n} B"
