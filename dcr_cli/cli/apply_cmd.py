"""dcr apply."""

from __future__ import annotations

import click

from ..errors import DcrError
from .common import emit_json, handle_errors
from .store_options import parse_storage_options, storage_options


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
@click.option("--version", help="With a store URL: the version to apply (default: the store's newest).")
@click.option("--ack", "ack_url", metavar="URL", help="After applying, acknowledge the version on this store.")
@click.option("--receiver", help="This receiver's name, for --ack.")
@storage_options
@click.option("--json", "as_json", is_flag=True, help="Print a machine-readable summary on stdout.")
@handle_errors
def command(
    deltas: tuple[str, ...],
    into: str,
    workers: int | None,
    verify_after: bool,
    version: str | None,
    ack_url: str | None,
    receiver: str | None,
    storage_option: tuple[str, ...],
    as_json: bool,
) -> None:
    """Apply DELTAS (paths, URLs, a directory of deltas, or a store URL) to a checkpoint, in place.

    Several deltas are applied as a chain, ordered from the checkpoint's version;
    ones already applied are skipped. After a crash, re-run the same command.
    """
    from ..receivers.checkpoint import apply
    from ..store import acknowledge, is_store, open_delta

    if bool(ack_url) != bool(receiver):
        raise DcrError("--ack URL and --receiver NAME go together")
    options = parse_storage_options(storage_option)
    # Store URLs resolve to one of their versions; anything else is a delta (or a directory of them).
    opened = [open_delta(d, version, storage_options=options) if is_store(d, options) else d for d in deltas]
    if version is not None and all(isinstance(d, str) for d in opened):
        raise DcrError("--version applies to store URLs only")
    result = apply(
        opened,
        into=into,
        workers=workers,
        verify=verify_after,
        log=None if as_json else click.echo,
    )
    if ack_url and receiver:
        acknowledge(ack_url, result.version, receiver, fingerprint=result.fingerprint, storage_options=options)
    if as_json:
        emit_json(result.to_json())
    else:
        if result.steps:
            click.echo(result.message)
        if ack_url:
            click.echo(f"acknowledged {result.version} as {receiver!r} on {ack_url}")
