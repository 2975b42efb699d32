"""The ``dcr`` command line: a thin click layer over the Python API.

Each command lives in its own module of this package and is registered below.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import click

from .._version import __version__
from .common import fail


class DcrGroup(click.Group):
    """The ``dcr`` group: click parses, and every failure leaves through one path (``common.fail``).

    click's standalone mode would print usage errors as four lines with its own exit codes; here a
    usage error, an error raised by a command and an unexpected exception each end as one line.
    """

    def main(  # type: ignore[override]
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except SystemExit:
            raise
        except BaseException as exc:
            fail(exc)
        # Without standalone mode click returns the code of an explicit exit (--help, --version).
        sys.exit(rv if isinstance(rv, int) and not isinstance(rv, bool) else 0)


@click.group(cls=DcrGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="dcr")
def main() -> None:
    """Bit-exact, delta-compressed weight refit for RL.

    Exit codes: 0 ok, 1 verification mismatch, 2 bad input, 3 conflict, 4 not ready yet,
    70 internal error (a bug in dcr), 130 interrupted.
    """


def _register() -> None:
    from . import (
        ack_cmd,
        apply_cmd,
        assemble_cmd,
        check_cmd,
        commit_cmd,
        compact_cmd,
        diff_cmd,
        gc_cmd,
        inspect_cmd,
        log_cmd,
        pull_cmd,
        push_cmd,
        squash_cmd,
        status_cmd,
        verify_cmd,
    )

    for module in (
        diff_cmd,
        assemble_cmd,
        inspect_cmd,
        apply_cmd,
        verify_cmd,
        push_cmd,
        pull_cmd,
        ack_cmd,
        commit_cmd,
        status_cmd,
        log_cmd,
        gc_cmd,
        check_cmd,
        squash_cmd,
        compact_cmd,
    ):
        main.add_command(module.command)


_register()
