"""dcr pull."""

from __future__ import annotations

from typing import Any

import click

from .common import emit_json, handle_errors, human_bytes, say, sized_progress
from .store_options import parse_rate, parse_storage_options, storage_options


@click.command("pull")
@click.argument("url")
@click.option("-o", "--output", "out", required=True, type=click.Path(), help="Delta directory to create.")
@click.option("--version", "version", help="Version to fetch (default: the pending version, else the head).")
@click.option(
    "--since",
    metavar="VERSION",
    help="Fetch the deltas a receiver at VERSION applies (the cheapest route: chain and shortcuts), in apply "
    "order, as OUTPUT/<version> and OUTPUT/shortcut-<base>-<target>.",
)
@click.option(
    "--join",
    "join",
    is_flag=True,
    help="A receiver with no state: fetch the newest keyframe as the checkpoint directory OUTPUT.",
)
@click.option("--repair", is_flag=True, help="Also fetch repair blocks (to repair a receiver torn by a crash).")
@click.option("--workers", type=click.IntRange(min=1), default=8, show_default=True, help="Parallel downloads.")
@click.option("--limit-rate", metavar="BYTES/S", help="Cap the download rate, e.g. 50M (bytes per second).")
@storage_options
@click.option("--json", "as_json", is_flag=True, help="Machine-readable summary on stdout.")
@click.option("--progress/--no-progress", default=True, help="Progress bar on a terminal.")
@handle_errors
def command(
    url: str,
    out: str,
    version: str | None,
    since: str | None,
    join: bool,
    repair: bool,
    workers: int,
    limit_rate: str | None,
    storage_option: tuple[str, ...],
    as_json: bool,
    progress: bool,
) -> None:
    """Download a version from the store at URL; every byte is verified before OUTPUT appears.

    With --since, fetch the deltas a lagging receiver needs, along the route dcr apply --since takes.
    """
    from ..store import pull, pull_since

    options = parse_storage_options(storage_option)
    if join:  # a receiver with no state: the newest keyframe (store/keyframes.py)
        from .compact_cmd import join_pull

        join_pull(url, out, since, options, as_json)
        return
    common: dict[str, Any] = dict(storage_options=options, workers=workers, limit_rate=parse_rate(limit_rate))
    with sized_progress("pull", progress) as (on_total, advance):
        common.update(progress=advance, on_total=on_total, repair=repair)
        if since is not None:
            # The route apply --since takes (the chain and the store's shortcuts, no keyframe); its path line first.
            results = pull_since(url, since, out, version=version, log=None if as_json else say, **common)
        else:
            results = [pull(url, out, version=version, **common)]
    if as_json:
        emit_json(results[0].to_json() if since is None else {"versions": [r.to_json() for r in results]})
        return
    if not results:
        say(f"{url}: nothing to fetch; a receiver at {since} is up to date")
    for r in results:
        what = f"{r.version} (base {r.base})" if r.kind == "chain" else f"shortcut {r.base}..{r.version}"
        if r.already_present:
            say(f"{r.path}: already holds {what}")
        else:
            say(
                f"{r.path}: {what} verified; downloaded {r.downloaded_blocks} blocks "
                f"({human_bytes(r.downloaded_bytes)}), reused {r.reused_blocks}"
            )
