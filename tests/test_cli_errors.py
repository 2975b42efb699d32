"""One error -> exit path (issue 9, issue 10 §9): every failure of the real ``dcr`` is one stderr line and one code.

The codes are those of dcr_cli/errors.py and the README's exit table: DcrError -> its own code, OSError -> 2,
click usage errors -> 2, an unexpected exception -> 70 with a line that says it is a bug, Ctrl-C -> 130.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from store_fixtures import one_error_line

from dcr_cli.cli.common import exit_code_of, one_line
from dcr_cli.errors import (
    EXIT_INTERNAL,
    EXIT_INTERRUPTED,
    ConflictError,
    FormatError,
    NotReadyError,
    VerifyFailed,
)

REPO = Path(__file__).resolve().parents[1]


def _run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("DCR_TRACEBACK", None)
    return subprocess.run(
        [sys.executable, "-m", "dcr_cli", *args], capture_output=True, text=True, env=env, timeout=120, cwd=cwd
    )


def _run_patched(patch: str, *args: str) -> subprocess.CompletedProcess[str]:
    """The real ``dcr`` main in a subprocess, with ``patch`` (Python) run first to inject a failure."""
    code = textwrap.dedent(patch) + f"\nfrom dcr_cli.cli import main\nmain({list(args)!r})\n"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("DCR_TRACEBACK", None)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["apply", "x", "--workers", "0", "--into", "d"], "--workers"),
        (["apply", "x", "--into", "FILE"], "--into"),
        (["inspect", "--no-such-option", "x"], "--no-such-option"),
        (["no-such-command"], "no-such-command"),
        (["apply"], "DELTAS"),
        ([], "no command"),
    ],
)
def test_usage_errors_are_one_line_exit_2(tmp_path: Path, args: list[str], needle: str) -> None:
    (tmp_path / "FILE").write_text("not a directory")
    proc = _run(*args, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    line = one_error_line(proc)
    assert needle in line
    assert "--help" in line  # says what to do next
    assert proc.stdout == ""


def test_help_and_version_still_exit_0() -> None:
    assert _run("--help").returncode == 0
    proc = _run("--version")
    assert proc.returncode == 0 and "dcr" in proc.stdout
    assert _run("apply", "-h").returncode == 0


def test_dcr_error_keeps_its_code(tmp_path: Path) -> None:
    proc = _run("inspect", str(tmp_path / "missing"))
    assert proc.returncode == 2
    assert "is not a dcr delta" in one_error_line(proc)


def test_os_error_is_exit_2() -> None:
    proc = _run_patched(
        """
        import dcr_cli.delta.inspect as m
        def boom(*a, **k):
            raise PermissionError(13, "Permission denied", "/some/file")
        m.inspect = boom
        """,
        "inspect",
        "x",
    )
    assert proc.returncode == 2
    assert one_error_line(proc) == "dcr: error: Permission denied (/some/file)"


def test_unexpected_exception_is_an_internal_error_exit_70() -> None:
    proc = _run_patched(
        """
        import dcr_cli.delta.inspect as m
        def boom(*a, **k):
            raise ZeroDivisionError("division by zero\\nsecond line")
        m.inspect = boom
        """,
        "inspect",
        "x",
    )
    assert proc.returncode == EXIT_INTERNAL == 70
    line = one_error_line(proc, prefix="dcr: internal error: ")
    assert line.startswith("dcr: internal error: ZeroDivisionError: division by zero\\nsecond line")
    assert "this is a bug in dcr; please report it with the command line" in line


def test_internal_error_traceback_on_request() -> None:
    code = "import dcr_cli.delta.inspect as m\ndef boom(*a, **k):\n    raise KeyError('k')\nm.inspect = boom\n"
    code += "from dcr_cli.cli import main\nmain(['inspect', 'x'])\n"
    env = {**os.environ, "PYTHONPATH": str(REPO), "DCR_TRACEBACK": "1"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 70
    assert "Traceback" in proc.stderr and proc.stderr.splitlines()[-1].startswith("dcr: internal error: KeyError")


def test_keyboard_interrupt_is_130() -> None:
    proc = _run_patched(
        """
        import dcr_cli.delta.inspect as m
        def boom(*a, **k):
            raise KeyboardInterrupt
        m.inspect = boom
        """,
        "inspect",
        "x",
    )
    assert proc.returncode == EXIT_INTERRUPTED == 130
    assert one_error_line(proc) == "dcr: error: interrupted"


def test_error_raised_outside_a_command_body_takes_the_same_path() -> None:
    # A failure while click builds the context (before handle_errors runs) still ends as one line.
    proc = _run_patched(
        """
        import click
        def boom(self, *a, **k):
            raise RuntimeError("context failed")
        click.Context.__init__ = boom
        """,
        "inspect",
        "x",
    )
    assert proc.returncode == 70
    assert "RuntimeError: context failed" in one_error_line(proc, prefix="dcr: internal error: ")


def test_exit_code_mapping() -> None:
    assert exit_code_of(FormatError("x"))[0] == 2
    assert exit_code_of(VerifyFailed("x"))[0] == 1
    assert exit_code_of(ConflictError("x"))[0] == 3
    assert exit_code_of(NotReadyError("x"))[0] == 4
    assert exit_code_of(OSError(28, "No space left on device"))[0] == 2
    assert exit_code_of(ValueError("x"))[0] == 70
    assert exit_code_of(KeyboardInterrupt())[0] == 130


def test_messages_are_one_printable_line() -> None:
    hostile = "tensor\nname\x1b[31m\r\u2028\ud800"
    line = one_line(hostile)
    assert "\n" not in line and "\r" not in line and "\x1b" not in line and "\u2028" not in line
    assert line == "tensor\\nname\\x1b[31m\\r\\u2028\\ud800"
    line.encode("utf-8")  # no lone surrogate reaches the terminal
    _, printed = exit_code_of(FormatError(hostile))
    assert printed == f"dcr: error: {line}"
