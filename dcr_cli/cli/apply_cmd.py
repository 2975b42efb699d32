"""dcr apply."""

from __future__ import annotations

import click

from .common import emit_json, handle_errors


@click.command("apply")
@click.argument("deltas", nargs=-1, required=True)
@click.option(
    "--into",
    "into",
    required=True,
    type=click.Path(file_okay=False),
    help="Checkpoint directory to update in place.",
)
@click.option("--workers", type=click.IntRange(min=1), help="Threads to use (default: all cores).")
@click.option("--verify", "verify_after", is_flag=True, help="Re-digest every tensor afterwards (as dcr verify).")
@click.option("--json", "as_json", is_flag=True, help="Print a machine-readable summary on stdout.")
@handle_errors
def command(deltas: tuple[str, ...], into: str, workers: int | None, verify_after: bool, as_json: bool) -> None:
    """Apply DELTAS (paths, URLs or a directory of deltas) to a checkpoint, in place.

    Several deltas are applied as a chain, ordered from the checkpoint's version;
    ones already applied are skipped. After a crash, re-run the same command.
    """
    from ..receivers.checkpoint import apply

    result = apply(
        list(deltas),
        into=into,
        workers=workers,
        verify=verify_after,
        log=None if as_json else click.echo,
    )
    if as_json:
        emit_json(result.to_json())
    elif result.steps:
        click.echo(result.message)
