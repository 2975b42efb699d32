"""Pieces every command shares: the one error -> exit-code path, JSON output, progress bars."""

from __future__ import annotations

import atexit
import contextlib
import gc
import json
import os
import sys
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import wraps
from typing import Any, NoReturn

import click

from ..errors import EXIT_BAD_INPUT, EXIT_INTERNAL, EXIT_INTERRUPTED, DcrError
from ..io.files import NO_ROOM

BUG_HINT = "this is a bug in dcr; please report it with the command line"


def printable(text: str) -> str:
    """``text`` with control characters (newlines, escape codes), line separators and lone surrogates
    written as Python escapes, so a hostile name can neither split a line nor reach the terminal."""
    out = []
    for ch in text:
        code = ord(ch)
        if code < 0x20 or 0x7F <= code < 0xA0 or 0xD800 <= code < 0xE000 or ch in "\u2028\u2029":
            out.append(ch.encode("unicode_escape", "backslashreplace").decode("ascii"))
        else:
            out.append(ch)
    return "".join(out)


def say(text: str, err: bool = False) -> None:
    """Print one line of human output. Every command's messages go through here: they carry version
    labels, receiver names and paths that come from manifests and store records, which may be hostile.

    A reader that went away (``dcr apply … | head -1``, a log shipper restarting) must not stop the work
    these lines report on: a refit half done between two deltas, its --ack never sent. The stream is
    pointed at /dev/null and the command goes on; its exit code still says how the work went."""
    try:
        click.echo(printable(text), err=err)
    except BrokenPipeError:
        _discard_output(sys.stderr if err else sys.stdout)


def _discard_output(stream: Any) -> None:
    """Send what is still buffered for ``stream``, and everything written to it later, to /dev/null (so the
    interpreter's flush at exit does not raise again)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, stream.fileno())
    finally:
        os.close(devnull)


def one_line(text: str) -> str:
    """A message as one printable line (see :func:`printable`)."""
    return printable(text).strip() or "(no message)"


def exit_code_of(exc: BaseException) -> tuple[int, str]:
    """The exit code and the one stderr line for an exception: THE mapping of every command.

    DcrError -> its own code; OSError -> 2 (no room to write: the file and the next step named);
    click usage errors -> 2; an interrupt -> 130; anything else is a bug in dcr -> 70 (EX_SOFTWARE) with a line
    that says so.
    """
    if isinstance(exc, DcrError):
        return exc.exit_code, f"dcr: error: {one_line(str(exc))}"
    if isinstance(exc, click.exceptions.NoArgsIsHelpError):
        path = exc.ctx.command_path if exc.ctx is not None else "dcr"
        return EXIT_BAD_INPUT, f"dcr: error: no command given (see '{path} --help')"
    if isinstance(exc, click.UsageError):
        hint = f" (see '{exc.ctx.command_path} --help')" if exc.ctx is not None else ""
        return EXIT_BAD_INPUT, f"dcr: error: {one_line(exc.format_message())}{hint}"
    if isinstance(exc, click.ClickException):
        return EXIT_BAD_INPUT, f"dcr: error: {one_line(exc.format_message())}"
    if isinstance(exc, (KeyboardInterrupt, click.Abort)):
        return EXIT_INTERRUPTED, "dcr: error: interrupted"
    if isinstance(exc, OSError) and exc.errno in NO_ROOM:
        where = f"writing {exc.filename}" if exc.filename is not None else "writing a file"
        said = str(exc.strerror or exc)
        step = (
            ""
            if "re-run the same" in said
            else "; free space (or raise the file-size limit), then re-run the same command"
        )
        return EXIT_BAD_INPUT, f"dcr: error: {one_line(f'{said} ({where}){step}')}"
    if isinstance(exc, OSError):
        where = exc.filename if exc.filename is not None else "I/O"
        return EXIT_BAD_INPUT, f"dcr: error: {one_line(f'{exc.strerror or exc} ({where})')}"
    return EXIT_INTERNAL, f"dcr: internal error: {type(exc).__name__}: {one_line(str(exc))} ({BUG_HINT})"


def fail(exc: BaseException) -> NoReturn:
    """Print the one line for ``exc`` on stderr and exit with its code."""
    code, line = exit_code_of(exc)
    if code == EXIT_INTERNAL and os.environ.get("DCR_TRACEBACK"):
        traceback.print_exception(exc, file=sys.stderr)
    with contextlib.suppress(OSError):  # stderr is gone (closed pipe): the exit code still tells
        click.echo(line, err=True)
    sys.exit(code)


_exit_freeze_registered = False


def freeze_heap_at_exit() -> None:
    """At interpreter exit, move every live object to the collector's permanent generation first.

    The interpreter's shutdown runs full cyclic collections over whatever is still alive; after a
    command over an MoE checkpoint that is every manifest item and table entry of 100k tensors, and
    the passes find nothing (measured: ~0.05 ms per tensor of a ``dcr diff``). ``gc.freeze`` is O(1)
    and only exempts the objects alive at exit from those passes: the atexit handlers registered
    before this one still run (after it), streams are still flushed, memory is returned with the
    process, and ``__del__`` of a cycle left over at exit is not guaranteed by Python anyway. In a
    process that runs commands in-process (tests), it only changes that process's own exit.
    """
    global _exit_freeze_registered
    if not _exit_freeze_registered:
        _exit_freeze_registered = True
        atexit.register(gc.freeze)


def handle_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Route every failure of a command through :func:`fail` (one line on stderr, one exit code)."""

    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        freeze_heap_at_exit()
        try:
            return fn(*args, **kwargs)
        except (SystemExit, click.exceptions.Exit):
            raise
        except BaseException as exc:
            fail(exc)

    return wrapper


def emit_json(obj: Any) -> None:
    try:
        click.echo(json.dumps(obj, indent=2, sort_keys=False))
    except BrokenPipeError:  # the work is done; a reader that left early is no failure of it (see say)
        _discard_output(sys.stdout)


Counter = Callable[[int], None]  # called with a byte count


@contextmanager
def sized_progress(
    label: str, enabled: bool
) -> Iterator[tuple[Callable[[int], None] | None, Callable[[int], None] | None]]:
    """(set the total, advance) of a rich progress bar on stderr when it is a terminal; (None, None)
    otherwise (cron, pipes). The API call being shown says its size itself once it knows it."""
    if not enabled or not sys.stderr.isatty():
        yield None, None
        return
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    with Progress(
        TextColumn(label), BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn(), transient=True
    ) as bar:
        task = bar.add_task(label, total=None)
        yield (lambda n: bar.update(task, total=n)), (lambda n: bar.advance(task, n))


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n} B"
