"""dcr check."""

from __future__ import annotations

import click

from ..errors import VerifyFailed
from .common import emit_json, handle_errors, human_bytes, say
from .store_options import parse_storage_options, storage_options


@click.command("check")
@click.argument("url")
@click.option(
    "--read-data", is_flag=True, help="Download every referenced block and keyframe file and check its digest."
)
@click.option(
    "--read-data-subset",
    metavar="N|P%",
    help="Check a random sample: N blocks or P percent of them (and as many of the keyframe files).",
)
@click.option("--seed", type=int, help="Seed of the random sample (default: different each run).")
@click.option("--workers", type=click.IntRange(min=1), default=8, show_default=True, help="Parallel downloads.")
@storage_options
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output on stdout.")
@handle_errors
def command(
    url: str,
    read_data: bool,
    read_data_subset: str | None,
    seed: int | None,
    workers: int,
    storage_option: tuple[str, ...],
    as_json: bool,
) -> None:
    """Check the store at URL: structure, missing blocks and keyframe files, leftovers of killed pushes, and
    (optionally) bytes.

    Exit 1 if anything is damaged; leftovers alone are reported with exit 0 (dcr gc removes them), and so
    are the repair blocks a push uploads after publishing a version (still going up, or that push was
    stopped: re-run it).
    """
    from ..store import check
    from ..store.audit import parse_subset

    subset = parse_subset(read_data_subset) if read_data_subset else None
    result = check(
        url,
        read_data=read_data,
        subset=subset,
        seed=seed,
        workers=workers,
        storage_options=parse_storage_options(storage_option),
    )
    if as_json:
        emit_json(result.to_json())
    else:
        say(
            f"{url}: {result.versions} versions ({result.committed} committed), {result.blocks} blocks; "
            f"read {result.blocks_read} blocks ({human_bytes(result.bytes_read)})"
        )
        if result.keyframes or result.unreferenced_keyframe_files:
            say(
                f"keyframes: {result.keyframes} ({result.keyframe_files} files); read {result.keyframe_files_read} "
                f"files ({human_bytes(result.keyframe_bytes_read)})"
            )
        if result.shortcuts:
            gone = len(result.unavailable_shortcuts)
            say(f"shortcuts: {result.shortcuts}" + (f" ({gone} without a manifest: not taken)" if gone else ""))
        unreferenced_files = len(result.unreferenced_keyframe_files)
        if result.unreferenced_blocks or result.unreferenced_manifests or unreferenced_files:
            why = (
                "killed pushes, dropped versions, or blocks of the damaged manifests of "
                f"{', '.join(result.unreadable_manifests)}, which are not garbage: restore those manifests "
                "(the delta's manifest.json) before any dcr gc"
                if result.unreadable_manifests
                else "killed pushes or dropped versions; dcr gc removes them"
            )
            say(
                f"unreferenced ({why}): "
                f"{len(result.unreferenced_blocks)} blocks, {len(result.unreferenced_manifests)} manifests"
                + (f", {unreferenced_files} keyframe files" if unreferenced_files else "")
            )
        for version, count in sorted(result.repair_pending.items()):
            say(
                f"repair upload pending or interrupted: {version} lacks {count} repair block(s) (not damage: a "
                f"receiver's normal apply does not read them); if its dcr push is not running, re-run "
                f"dcr push DELTA {url}"
            )
        for problem in result.problems:
            say(f"problem: {problem}", err=True)
    if not result.ok:
        raise VerifyFailed(f"{url}: {len(result.problems)} problems found: {result.problems[0]}")
