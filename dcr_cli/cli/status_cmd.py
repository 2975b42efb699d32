"""dcr status."""

from __future__ import annotations

import click

from .common import emit_json, handle_errors, say
from .store_options import parse_storage_options, storage_options


@click.command("status")
@click.argument("url")
@storage_options
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output on stdout.")
@handle_errors
def command(url: str, storage_option: tuple[str, ...], as_json: bool) -> None:
    """Show the committed head of the store at URL (the base of the next dcr diff) and pending versions."""
    from ..store import status

    report = status(url, storage_options=parse_storage_options(storage_option))
    if as_json:
        emit_json(report)
        return
    head = report["head"]
    say(f"head:      {head['version']} ({head['fingerprint'][:16]}…){'' if report['committed'] else ' (genesis)'}")
    say(f"diff base: {head['version']}  — the next dcr diff must start from this state")
    for p in report["pending"]:
        say(f"pending:   {p['version']} acked by {', '.join(p['acked']) or 'nobody yet'}")
    if report["latest_hint_stale"]:
        say(f"note: latest.json names {report['latest_hint']}, which is not the head (a harmless lag)")
