"""dcr inspect."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING

import click

from .common import emit_json, handle_errors, human_bytes, printable

if TYPE_CHECKING:
    from ..delta.inspect import DeltaReport

# Up to this many rows the table is drawn by rich (boxes, terminal width); a longer one (an MoE
# delta lists 100k tensors) is printed as plain aligned columns, which costs microseconds a row
# instead of rich's layout engine (~1 ms a row) and pipes into grep/awk one tensor per line.
RICH_ROWS = 500
COLUMNS = ("tensor", "dtype", "changed", "%", "op", "bytes", "ratio", "residual")
RIGHT = frozenset({"changed", "%", "bytes", "ratio"})


def _safe(text: str) -> str:
    """:func:`printable`, with the common case (nothing to escape) answered by one C call: every
    character it escapes (controls, surrogates, line/paragraph separators) is non-printable to Python."""
    return text if text.isprintable() else printable(text)


def _cells(report: DeltaReport) -> Iterable[tuple[str, ...]]:
    for r in report.tensors:
        yield (
            _safe(r.tensor),
            _safe(r.dtype),
            f"{r.changed_elements:,}",
            f"{r.change_rate:.2%}",
            ",".join(r.ops) or "-",
            human_bytes(r.payload_bytes),
            f"{r.ratio:.1f}x" if r.ratio else "-",
            _safe(r.residual or ""),
        )


def plain_table(title: str, rows: list[tuple[str, ...]]) -> list[str]:
    """The table as aligned text lines: a title, a header, a rule, one line per row (no trailing blanks)."""
    widths = [len(c) for c in COLUMNS]
    for row in rows:
        for i, cell in enumerate(row):
            if len(cell) > widths[i]:
                widths[i] = len(cell)
    last = len(COLUMNS) - 1

    def line(cells: tuple[str, ...]) -> str:
        parts = [
            cell.rjust(widths[i]) if COLUMNS[i] in RIGHT else (cell if i == last else cell.ljust(widths[i]))
            for i, cell in enumerate(cells)
        ]
        return "  ".join(parts).rstrip()

    return [title, line(COLUMNS), "  ".join("-" * w for w in widths), *(line(r) for r in rows)]


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
    # Labels, tensor names and reasons come from the manifest: print them verbatim, never as rich markup,
    # and with control characters escaped (a newline in a name must not split its row).
    title = _safe(f"{report.base_version} -> {report.target_version}  (format {report.format_version})")
    total = report.payload_bytes + report.manifest_bytes
    footer = (
        f"total: {report.changed_elements:,}/{report.total_elements:,} elements changed "
        f"({report.changed_elements / max(1, report.total_elements):.3%}); "
        f"payload {human_bytes(report.payload_bytes)} + manifest {human_bytes(report.manifest_bytes)} "
        f"vs full {human_bytes(report.full_bytes)} ({report.full_bytes / max(1, total):.1f}x); "
        f"repair {human_bytes(report.repair_bytes)}; {report.items} items in {report.blocks} blocks"
    )
    rows = list(_cells(report))
    if len(rows) > RICH_ROWS:
        click.echo("\n".join([*plain_table(title, rows), footer]))
        return
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=escape(title))
    for col in COLUMNS:
        table.add_column(col, justify="right" if col in RIGHT else "left")
    for row in rows:
        table.add_row(*(escape(cell) for cell in row))
    console = Console() if sys.stdout.isatty() else Console(width=200)  # pipes: never cut tensor names
    console.print(table)
    console.print(footer)
