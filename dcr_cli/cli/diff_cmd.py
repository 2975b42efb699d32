"""dcr diff."""

from __future__ import annotations

import click

from .common import byte_progress, emit_json, handle_errors, human_bytes


@click.command("diff")
@click.argument("base", type=click.Path(file_okay=False))
@click.argument("new", type=click.Path(file_okay=False))
@click.option("-o", "--output", "out", required=True, type=click.Path(), help="Delta directory to create.")
@click.option("--base-version", help="Label of BASE (default: derived from its content).")
@click.option("--target-version", help="Label of NEW (default: derived from its content).")
@click.option("--workers", type=click.IntRange(min=1), help="Threads to use (default: all cores).")
@click.option(
    "--level", type=click.IntRange(1, 22), default=None, help="Standard zstd level instead of dcr's tuned parameters."
)
@click.option(
    "--overwrite",
    "overwrite",
    multiple=True,
    metavar="GLOB",
    help="Send tensors matching GLOB as absolute values (receivers that cast or quantize). Repeatable.",
)
@click.option("--json", "as_json", is_flag=True, help="Print a machine-readable summary on stdout.")
@click.option("--progress/--no-progress", default=True, help="Progress bar on a terminal.")
@handle_errors
def command(
    base: str,
    new: str,
    out: str,
    base_version: str | None,
    target_version: str | None,
    workers: int | None,
    level: int | None,
    overwrite: tuple[str, ...],
    as_json: bool,
    progress: bool,
) -> None:
    """Write the delta from checkpoint BASE to checkpoint NEW."""
    from ..diff import diff
    from ..sources.safetensors_dir import SafetensorsCheckpoint

    with SafetensorsCheckpoint(new) as ckpt:
        total = sum(t.nbytes for t in ckpt.tensors.values())
    with byte_progress(total, "diff", progress) as advance:
        summary = diff(
            base,
            new,
            out,
            base_version=base_version,
            target_version=target_version,
            workers=workers,
            level=level,
            overwrite=overwrite,
            progress=advance,
        )
    if as_json:
        emit_json(summary.to_json())
    else:
        click.echo(
            f"{summary.delta}: {summary.base_version} -> {summary.target_version}, "
            f"{summary.changed_elements}/{summary.total_elements} elements changed ({summary.change_rate:.3%}), "
            f"{human_bytes(summary.payload_bytes + summary.manifest_bytes)} "
            f"({summary.full_bytes / max(1, summary.payload_bytes + summary.manifest_bytes):.1f}x smaller than full)"
        )
