"""dcr inspect."""

from __future__ import annotations

import sys

import click

from .common import emit_json, handle_errors, human_bytes, printable


@click.command("inspect")
@click.argument("delta")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--all", "show_all", is_flag=True, help="List unchanged tensors too.")
@handle_errors
def command(delta: str, as_json: bool, show_all: bool) -> None:
    """Show what DELTA (a directory or URL) holds."""
    from ..delta.inspect import inspect

    report = inspect(delta, changed_only=not show_all)
    if as_json:
        emit_json(report.to_json())
        return
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    # Labels, tensor names and reasons come from the manifest: print them verbatim, never as rich markup,
    # and with control characters escaped (a newline in a name must not split its row).
    title = printable(f"{report.base_version} -> {report.target_version}  (format {report.format_version})")
    table = Table(title=escape(title))
    for col, justify in (
        ("tensor", "left"),
        ("dtype", "left"),
        ("changed", "right"),
        ("%", "right"),
        ("op", "left"),
        ("bytes", "right"),
        ("ratio", "right"),
        ("residual", "left"),
    ):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for r in report.tensors:
        table.add_row(
            escape(printable(r.tensor)),
            escape(printable(r.dtype)),
            f"{r.changed_elements:,}",
            f"{r.change_rate:.2%}",
            ",".join(r.ops) or "-",
            human_bytes(r.payload_bytes),
            f"{r.ratio:.1f}x" if r.ratio else "-",
            escape(printable(r.residual or "")),
        )
    console = Console() if sys.stdout.isatty() else Console(width=200)  # pipes: never cut tensor names
    console.print(table)
    total = report.payload_bytes + report.manifest_bytes
    console.print(
        f"total: {report.changed_elements:,}/{report.total_elements:,} elements changed "
        f"({report.changed_elements / max(1, report.total_elements):.3%}); "
        f"payload {human_bytes(report.payload_bytes)} + manifest {human_bytes(report.manifest_bytes)} "
        f"vs full {human_bytes(report.full_bytes)} ({report.full_bytes / max(1, total):.1f}x); "
        f"repair {human_bytes(report.repair_bytes)}; {report.items} items in {report.blocks} blocks"
    )
