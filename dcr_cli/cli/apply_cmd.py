"""dcr apply."""

from __future__ import annotations

from collections.abc import Callable

import click

from ..errors import DcrError
from .common import emit_json, handle_errors, say
from .store_options import parse_storage_options, storage_options
from .vllm_cmd import VLLM_OPTION_HELP


@click.command("apply")
@click.argument("deltas", nargs=-1, required=True)
@click.option(
    "--into",
    "into",
    type=click.Path(file_okay=False),
    help="Checkpoint directory to update in place.",
)
@click.option("--vllm", "vllm_url", metavar="URL", help=VLLM_OPTION_HELP)
@click.option("--workers", type=click.IntRange(min=1), help="Threads to use (default: all cores).")
@click.option(
    "--verify",
    "verify_after",
    is_flag=True,
    help="Check every tensor afterwards, as dcr verify (the touched ones by the apply's own read-back).",
)
@click.option("--version", help="With a store URL: the version to apply (default: the store's newest).")
@click.option(
    "--since",
    metavar="VERSION",
    help="With a store URL: the receiver is at committed VERSION; apply the cheapest path (chain or shortcuts).",
)
@click.option(
    "--wait",
    type=click.FloatRange(min=0),
    metavar="SECONDS",
    help="With a store URL and --version: wait up to SECONDS for the version to be published (start the "
    "receiver before the producer publishes); exit 4 if it is not.",
)
@click.option("--ack", "ack_url", metavar="URL", help="After applying, acknowledge the version on this store.")
@click.option("--receiver", help="This receiver's name, for --ack.")
@storage_options
@click.option("--json", "as_json", is_flag=True, help="Print a machine-readable summary on stdout.")
@handle_errors
def command(
    deltas: tuple[str, ...],
    into: str | None,
    vllm_url: str | None,
    workers: int | None,
    verify_after: bool,
    version: str | None,
    since: str | None,
    wait: float | None,
    ack_url: str | None,
    receiver: str | None,
    storage_option: tuple[str, ...],
    as_json: bool,
) -> None:
    """Apply DELTAS in place to a checkpoint directory (--into) or a running vLLM engine (--vllm).

    DELTAS are delta directories (paths or URLs), directories of deltas, or a store URL. Several
    deltas are applied as a chain, ordered from the receiver's version; ones already applied are
    skipped. After a crash or a failed write, re-run the same command: it finishes bit-exactly.
    """
    from ..api import apply

    if bool(into) == bool(vllm_url):
        raise DcrError("give exactly one receiver: --into CHECKPOINT_DIR or --vllm URL")
    options = parse_storage_options(storage_option)
    if vllm_url:
        if workers is not None:
            raise DcrError("--workers applies to --into: a vLLM engine applies on its own workers' threads")
        from ..api import apply_vllm

        engine = apply_vllm(
            deltas,
            vllm_url,
            version=version,
            since=since,
            wait=wait,
            on_wait=_waiting(wait),
            verify=verify_after,
            ack=ack_url,
            receiver=receiver,
            storage_options=options,
            log=None if as_json else say,
        )
        if as_json:
            emit_json({"vllm": vllm_url, "steps": engine["steps"], "fetched_early": engine["fetched_early"]})
        return
    assert into is not None
    try:
        result = apply(
            deltas,
            into=into,
            version=version,
            since=since,
            ack=ack_url,
            receiver=receiver,
            storage_options=options,
            workers=workers,
            verify=verify_after,
            log=None if as_json else say,
            wait=wait,
            on_wait=_waiting(wait),
        )
    except OSError as exc:
        from ..io.files import NO_ROOM, named

        if exc.errno in NO_ROOM and exc.filename is None:  # an in-place write of the checkpoint's files
            raise named(exc, into) from exc
        raise
    if as_json:
        emit_json(result.to_json())
    else:
        if result.steps:
            say(result.message)
        if ack_url:
            say(f"acknowledged {result.version} as {receiver!r} on {ack_url}")


def _waiting(wait: float | None) -> Callable[[str], None]:
    """What --wait prints on stderr (also with --json) once it is waiting: the command is then ready."""
    return lambda what: say(f"waiting up to {wait:g} s for {what}", err=True)
