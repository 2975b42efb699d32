"""dcr verify."""

from __future__ import annotations

import os
import sys

import click

from ..errors import DcrError
from .common import emit_json, handle_errors
from .vllm_cmd import verify_vllm


@click.command("verify")
@click.argument("checkpoint", type=click.Path(file_okay=False), required=False)
@click.option("--vllm", "vllm_url", metavar="URL", help="Verify a running vLLM engine (dcr backend) instead.")
@click.option("--against", "against", help="Delta whose target the checkpoint must hold (default: recorded version).")
@click.option("--workers", type=click.IntRange(min=1), help="Threads to use (default: all cores).")
@click.option("--json", "as_json", is_flag=True, help="Print a machine-readable report on stdout.")
@handle_errors
def command(
    checkpoint: str | None, vllm_url: str | None, against: str | None, workers: int | None, as_json: bool
) -> None:
    """Digest every tensor of CHECKPOINT (or of a vLLM engine) and compare with the expected table.

    With --vllm, the engine's resident weights are read back through vLLM's own placement.
    Exit 0 when every tensor matches, 1 otherwise (the mismatching tensors are named).
    """
    from ..receive.verify import verify

    if bool(checkpoint) == bool(vllm_url):
        raise DcrError("give exactly one receiver: a CHECKPOINT directory or --vllm URL")
    if vllm_url:
        verify_vllm(vllm_url, os.path.abspath(against) if against and "://" not in against else against, as_json)
        return
    assert checkpoint is not None

    report = verify(checkpoint, against=against, workers=workers)
    if as_json:
        emit_json(report.to_json())
    elif report.ok:
        click.echo(report.summary())
    else:
        click.echo(f"dcr: error: {report.summary()}", err=True)
    if not report.ok:
        sys.exit(1)
