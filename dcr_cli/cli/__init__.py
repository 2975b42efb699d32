"""The ``dcr`` command line: a thin click layer over the Python API.

Each command lives in its own module of this package and is registered below.
"""

from __future__ import annotations

import click

from .._version import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="dcr")
def main() -> None:
    """Bit-exact, delta-compressed weight refit for RL.

    Exit codes: 0 ok, 1 verification mismatch, 2 bad input, 3 conflict, 4 not ready yet.
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
