"""The ``dcr`` command line: a thin click layer over the Python API.

Each command lives in its own module of this package and is registered below.
"""

from __future__ import annotations

import click

from .. import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="dcr")
def main() -> None:
    """Bit-exact, delta-compressed weight refit for RL.

    Exit codes: 0 ok, 1 verification mismatch, 2 bad input, 3 conflict.
    """


def _register() -> None:
    from . import diff_cmd, inspect_cmd, vllm_cmd

    for module in (diff_cmd, inspect_cmd):
        main.add_command(module.command)
    # Until apply/verify carry --vllm themselves (vllm_cmd.apply_vllm / verify_vllm).
    main.add_command(vllm_cmd.apply_command)
    main.add_command(vllm_cmd.verify_command)


_register()
