"""dcr ack."""

from __future__ import annotations

import click

from .common import emit_json, handle_errors, say
from .store_options import parse_storage_options, storage_options


@click.command("ack")
@click.argument("url")
@click.argument("version")
@click.option("--receiver", required=True, metavar="NAME", help="This receiver's name.")
@click.option("--fingerprint", help="Fingerprint the receiver verified it holds; must be VERSION's.")
@storage_options
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output on stdout.")
@handle_errors
def command(
    url: str, version: str, receiver: str, fingerprint: str | None, storage_option: tuple[str, ...], as_json: bool
) -> None:
    """Acknowledge on the store at URL that receiver NAME holds VERSION (idempotent)."""
    from ..store import acknowledge

    ack = acknowledge(
        url, version, receiver, fingerprint=fingerprint, storage_options=parse_storage_options(storage_option)
    )
    if as_json:
        emit_json(ack)
    else:
        say(f"{url}: {receiver} acknowledged {version}")
