"""dcr squash."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from typing import TYPE_CHECKING

import click

from .common import emit_json, handle_errors, human_bytes, say

if TYPE_CHECKING:
    import numpy as np


@click.command("squash")
@click.argument("deltas", nargs=-1, required=True)
@click.option("-o", "--output", "out", required=True, type=click.Path(), help="Delta directory to create.")
@click.option(
    "--base",
    "base",
    type=click.Path(exists=True, file_okay=False),
    help="A checkpoint at the first delta's base: read only where the chain overwrites values it does not carry.",
)
@click.option("--workers", type=click.IntRange(min=1), help="Threads to use (default: all cores).")
@click.option(
    "--level", type=click.IntRange(1, 22), default=None, help="Standard zstd level instead of dcr's tuned parameters."
)
@click.option("--json", "as_json", is_flag=True, help="Print a machine-readable summary on stdout.")
@handle_errors
def command(
    deltas: tuple[str, ...], out: str, base: str | None, workers: int | None, level: int | None, as_json: bool
) -> None:
    """Compose the chain DELTAS (in order, base -> target; or a directory of deltas) into one delta OUT.

    No checkpoint is needed: XOR masks compose, overwrites win, elements that return to their base
    value drop out, and every item's pre/post digests are derived from the chain and checked.
    """
    import numpy as np

    from ..delta.squash import squash

    with ExitStack() as stack:
        base_values: Callable[[str, np.ndarray], np.ndarray] | None = None
        if base is not None:
            from ..checkpoints.safetensors_dir import SafetensorsCheckpoint

            ckpt = stack.enter_context(SafetensorsCheckpoint(base))

            def base_values(name: str, flat: np.ndarray) -> np.ndarray:
                return np.asarray(ckpt.view(name)[flat])

        summary = squash(list(deltas), out, workers=workers, level=level, base_values=base_values)
    if as_json:
        emit_json(summary.to_json())
        return
    say(
        f"{summary.delta}: {summary.base_version} -> {summary.target_version}, "
        f"{summary.changed_elements} changed elements, {human_bytes(summary.payload_bytes)} payload"
    )
