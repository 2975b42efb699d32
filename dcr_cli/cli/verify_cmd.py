"""dcr verify."""

from __future__ import annotations

import sys

import click

from .common import emit_json, handle_errors


@click.command("verify")
@click.argument("checkpoint", type=click.Path(file_okay=False))
@click.option("--against", "against", help="Delta whose target the checkpoint must hold (default: recorded version).")
@click.option("--workers", type=click.IntRange(min=1), help="Threads to use (default: all cores).")
@click.option("--json", "as_json", is_flag=True, help="Print a machine-readable report on stdout.")
@handle_errors
def command(checkpoint: str, against: str | None, workers: int | None, as_json: bool) -> None:
    """Digest every tensor of CHECKPOINT and compare with the expected table.

    Exit 0 when every tensor matches, 1 otherwise (the mismatching tensors are named).
    """
    from ..receivers.verify import verify

    report = verify(checkpoint, against=against, workers=workers)
    if as_json:
        emit_json(report.to_json())
    elif report.ok:
        click.echo(report.summary())
    else:
        click.echo(f"dcr: error: {report.summary()}", err=True)
    if not report.ok:
        sys.exit(1)
