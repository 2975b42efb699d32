"""dcr gc."""

from __future__ import annotations

import click

from .common import emit_json, handle_errors, human_bytes, say
from .store_options import parse_duration, parse_storage_options, storage_options


@click.command("gc")
@click.argument("url")
@click.option("--keep", type=int, required=True, help="Committed versions to keep (the newest N; at least 1).")
@click.option(
    "--grace",
    default="1h",
    show_default=True,
    help="Leave objects no version references alone until this old (a push may be in progress); "
    "keep it above 15 min plus your longest push, or a push reusing old blocks may lose them.",
)
@click.option("--dry-run", is_flag=True, help="Report what would be removed, remove nothing.")
@storage_options
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output on stdout.")
@handle_errors
def command(url: str, keep: int, grace: str, dry_run: bool, storage_option: tuple[str, ...], as_json: bool) -> None:
    """Remove blocks and manifests that no live version of the store at URL needs.

    Live: the newest KEEP committed versions and every pending version.
    """
    from ..store import gc

    result = gc(
        url,
        keep=keep,
        grace_s=parse_duration(grace),
        dry_run=dry_run,
        storage_options=parse_storage_options(storage_option),
    )
    if as_json:
        emit_json(result.to_json())
        return
    verb = "would remove" if dry_run else "removed"
    say(
        f"{url}: {verb} {result.removed_blocks} blocks ({human_bytes(result.removed_bytes)}) and "
        f"{result.removed_manifests} manifests; kept {result.kept_blocks} blocks for "
        f"{', '.join(result.live_versions) or 'no versions'}"
        + (
            f"; {result.young_unreferenced} recent unreferenced objects left for later"
            if result.young_unreferenced
            else ""
        )
        + (
            f"; removed {result.removed_keyframe_files} keyframe files no record names (a publish stopped early)"
            if result.removed_keyframe_files
            else ""
        )
        + "".join(
            # A shortcut is derived data: gc drops an unusable one instead of stopping; compact rebuilds it.
            f"; {'would drop' if dry_run else 'dropped'} shortcut {label}, as {why} "
            f"(dcr compact {url} --every K publishes it again)"
            for label, why in result.dropped_shortcuts.items()
        )
    )
