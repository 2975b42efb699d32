"""dcr log."""

from __future__ import annotations

import click

from .common import emit_json, handle_errors, human_bytes
from .store_options import parse_storage_options, storage_options


@click.command("log")
@click.argument("url")
@storage_options
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output on stdout.")
@handle_errors
def command(url: str, storage_option: tuple[str, ...], as_json: bool) -> None:
    """List the versions on the store at URL with their sizes and change rates."""
    from ..store import log

    entries = log(url, storage_options=parse_storage_options(storage_option))
    if as_json:
        emit_json([e.to_json() for e in entries])
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=url)
    for col in ("version", "state", "base", "changed", "size", "vs full", "acked", "created"):
        table.add_column(col)
    for e in entries:
        size = e.payload_bytes + e.manifest_bytes
        table.add_row(
            e.version + ("" if e.available else " (gc'd)"),
            e.state,
            e.base,
            f"{e.change_rate:.3%}",
            human_bytes(size),
            f"{e.full_bytes / max(1, size):.1f}x",
            ",".join(e.acked) or "-",
            e.created,
        )
    Console().print(table)
