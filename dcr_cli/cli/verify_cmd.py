"""dcr verify."""

from __future__ import annotations

import click

from ..errors import DcrError, VerifyFailed
from .common import emit_json, handle_errors, say
from .store_options import parse_storage_options, storage_options
from .vllm_cmd import verify_vllm


@click.command("verify")
@click.argument("checkpoint", type=click.Path(file_okay=False), required=False)
@click.option("--vllm", "vllm_url", metavar="URL", help="Verify a running vLLM engine (dcr backend) instead.")
@click.option(
    "--against",
    "against",
    help="Delta, or store URL, whose target the checkpoint must hold (default: the recorded version).",
)
@click.option("--version", help="With a store URL as --against: the version (default: the store's newest).")
@click.option("--workers", type=click.IntRange(min=1), help="Threads to use (default: all cores).")
@storage_options
@click.option("--json", "as_json", is_flag=True, help="Print a machine-readable report on stdout.")
@handle_errors
def command(
    checkpoint: str | None,
    vllm_url: str | None,
    against: str | None,
    version: str | None,
    workers: int | None,
    storage_option: tuple[str, ...],
    as_json: bool,
) -> None:
    """Digest every tensor of CHECKPOINT (or of a vLLM engine) and compare with the expected table.

    With --vllm, the engine's resident weights are read back through vLLM's own placement.
    Exit 0 when every tensor matches, 1 otherwise (the mismatching tensors are named).
    """
    from ..api import verify

    if bool(checkpoint) == bool(vllm_url):
        raise DcrError("give exactly one receiver: a CHECKPOINT directory or --vllm URL")
    if vllm_url:
        verify_vllm(vllm_url, against, as_json)
        return
    assert checkpoint is not None
    report = verify(
        checkpoint,
        against=against,
        version=version,
        storage_options=parse_storage_options(storage_option),
        workers=workers,
    )
    if as_json:
        emit_json(report.to_json())
    elif report.ok:
        say(report.summary())
    if not report.ok:
        raise VerifyFailed(report.summary())
