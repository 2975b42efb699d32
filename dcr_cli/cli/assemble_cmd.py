"""dcr assemble."""

from __future__ import annotations

from pathlib import Path

import click

from .common import emit_json, handle_errors, say


@click.command("assemble")
@click.argument("out", type=click.Path(file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print a machine-readable summary on stdout.")
@handle_errors
def command(out: str, as_json: bool) -> None:
    """Merge the producers' parts under OUT (from `dcr diff --rank R --world-size W`) into one delta."""
    from ..delta.parts import assemble
    from ..delta.summary import summarize

    summary = summarize(Path(out), assemble(out))
    if as_json:
        emit_json(summary.to_json())
    else:
        say(f"{summary.delta}: assembled, {summary.changed_elements} changed elements")
