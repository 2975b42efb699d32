"""dcr commit."""

from __future__ import annotations

import click

from .common import emit_json, handle_errors, say
from .store_options import parse_storage_options, storage_options


@click.command("commit")
@click.argument("url")
@click.argument("version")
@click.option("--receiver", "receivers", multiple=True, metavar="NAME", help="A receiver that must ack (repeatable).")
@click.option("--quorum", type=click.IntRange(min=1), help="How many acks suffice (of the named receivers, if any).")
@click.option(
    "--wait",
    type=click.FloatRange(min=0),
    metavar="SECONDS",
    help="Wait up to SECONDS for the version to be published and acknowledged instead of exiting 4 at once.",
)
@click.option("--allow-unsafe-publish", is_flag=True, help="Commit on a store that cannot create objects atomically.")
@storage_options
@click.option("--json", "as_json", is_flag=True, help="Machine-readable summary on stdout.")
@handle_errors
def command(
    url: str,
    version: str,
    receivers: tuple[str, ...],
    quorum: int | None,
    wait: float | None,
    allow_unsafe_publish: bool,
    storage_option: tuple[str, ...],
    as_json: bool,
) -> None:
    """Commit VERSION on the store at URL once the receivers acknowledged it.

    Exit 4 (nothing written) while acknowledgements are missing: run it again later.
    The committed version becomes the base of the producer's next dcr diff.
    """
    from ..store import commit

    result = commit(
        url,
        version,
        receivers=receivers,
        quorum=quorum,
        storage_options=parse_storage_options(storage_option),
        allow_unsafe_publish=allow_unsafe_publish,
        wait=wait,
        on_wait=lambda what: say(f"waiting up to {wait:g} s for {what}", err=True),
    )
    if as_json:
        emit_json(result.to_json())
    elif result.already_committed:
        say(f"{url}: {version} was already committed")
    else:
        say(f"{url}: committed {version} (acked by {', '.join(result.acked)}); diff the next step against it")
