"""dcr push."""

from __future__ import annotations

import click

from .common import emit_json, handle_errors, human_bytes, say, sized_progress
from .store_options import parse_rate, parse_storage_options, storage_options


@click.command("push")
@click.argument("delta")
@click.argument("url")
@click.option("--workers", type=click.IntRange(min=1), default=8, show_default=True, help="Parallel uploads.")
@click.option("--limit-rate", metavar="BYTES/S", help="Cap the upload rate, e.g. 50M (bytes per second).")
@click.option(
    "--allow-unsafe-publish",
    is_flag=True,
    help="Publish on a store that cannot create objects atomically (safe only with a single producer).",
)
@click.option(
    "--verify-remote",
    is_flag=True,
    help="Also download the blocks already on the store and replace any that are corrupt.",
)
@storage_options
@click.option("--json", "as_json", is_flag=True, help="Machine-readable summary on stdout.")
@click.option("--progress/--no-progress", default=True, help="Progress bar on a terminal.")
@handle_errors
def command(
    delta: str,
    url: str,
    workers: int,
    limit_rate: str | None,
    allow_unsafe_publish: bool,
    verify_remote: bool,
    storage_option: tuple[str, ...],
    as_json: bool,
    progress: bool,
) -> None:
    """Publish DELTA on the store at URL, uploading only what the store lacks.

    The version label is the delta's target version. Re-running after a kill
    uploads only the rest; re-running after success changes nothing.

    Data blocks, manifest and version record go first: the moment the version
    is visible, one line on stderr says so (receivers can start then); the
    repair blocks follow, and dcr push exits once they are uploaded too.
    """
    from ..store import push
    from ..store.transfer import PushResult

    def published(result: PushResult) -> None:
        if result.repair_pending and not result.already_published:  # a re-run published nothing
            say(f"{url}: published {result.version} (repair blocks follow)", err=True)

    with sized_progress("push", progress) as (on_total, advance):
        result = push(
            delta,
            url,
            storage_options=parse_storage_options(storage_option),
            workers=workers,
            progress=advance,
            on_total=on_total,
            limit_rate=parse_rate(limit_rate),
            allow_unsafe_publish=allow_unsafe_publish,
            verify_remote=verify_remote,
            on_published=published,
        )
    if as_json:
        emit_json(result.to_json())
    elif result.already_published:
        restored = [f"uploaded {result.uploaded_blocks} blocks it lacked"] if result.uploaded_blocks else []
        restored += ["wrote its damaged manifest again"] if result.manifest_restored else []
        said = f"; {' and '.join(restored)}" if restored else ""
        say(f"{url}: version {result.version} was already published with this delta{said}")
    else:
        refreshed = (
            f", {result.refreshed_blocks} of them written again so that gc keeps them"
            if result.refreshed_blocks
            else ""
        )
        repair = (
            f"; {result.repair_uploaded_blocks} of them repair blocks "
            f"({human_bytes(result.repair_uploaded_bytes)}), uploaded after publication"
            if result.repair_uploaded_blocks
            else ""
        )
        say(
            f"{url}: published {result.version} (base {result.base}): uploaded {result.uploaded_blocks} blocks "
            f"({human_bytes(result.uploaded_bytes)}), {result.present_blocks} already there{refreshed}{repair}"
        )
