"""dcr apply."""

from __future__ import annotations

import os

import click

from ..errors import DcrError
from .common import emit_json, handle_errors
from .store_options import parse_storage_options, storage_options
from .vllm_cmd import VLLM_OPTION_HELP, apply_vllm


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
@click.option("--verify", "verify_after", is_flag=True, help="Re-digest every tensor afterwards (as dcr verify).")
@click.option("--version", help="With a store URL: the version to apply (default: the store's newest).")
@click.option(
    "--since",
    metavar="VERSION",
    help="With a store URL: the receiver is at committed VERSION; apply the cheapest path (chain or shortcuts).",
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
    from ..receive.checkpoint import apply
    from ..store import acknowledge, is_store, open_delta

    if bool(into) == bool(vllm_url):
        raise DcrError("give exactly one receiver: --into CHECKPOINT_DIR or --vllm URL")
    if bool(ack_url) != bool(receiver):
        raise DcrError("--ack URL and --receiver NAME go together")
    options = parse_storage_options(storage_option)
    if vllm_url:
        if version is not None or any(is_store(d, options) for d in deltas):
            raise DcrError("with --vllm, pass delta directories the engine can read (dcr pull a store's version first)")
        # The engine's workers open the deltas themselves: make local paths absolute.
        steps = apply_vllm(tuple(os.path.abspath(d) if "://" not in d else d for d in deltas), vllm_url, as_json)
        if ack_url and receiver:
            acknowledge(
                ack_url, steps.target.version, receiver, fingerprint=steps.target.fingerprint, storage_options=options
            )
            if not as_json:
                click.echo(f"acknowledged {steps.target.version} as {receiver!r} on {ack_url}")
        return
    assert into is not None
    # Store URLs resolve to one of their versions; anything else is a delta (or a directory of them).
    opened = [open_delta(d, version, storage_options=options) if is_store(d, options) else d for d in deltas]
    if since is not None:  # the cheapest path among chain and shortcuts (store/keyframes.py)
        from ..store.keyframes import open_plan, plan

        if len(deltas) != 1 or not is_store(deltas[0], options):
            raise DcrError("--since needs exactly one store URL")
        chosen = plan(deltas[0], since, version, allow_keyframe=False, storage_options=options)
        if not as_json:
            click.echo(chosen.describe())
        opened = list(open_plan(deltas[0], chosen, storage_options=options))
        if not opened:
            opened = [open_delta(deltas[0], since, storage_options=options)]  # already there: a no-op apply
    if version is not None and all(isinstance(d, str) for d in opened):
        raise DcrError("--version applies to store URLs only")
    result = apply(
        opened,
        into=into,
        workers=workers,
        verify=verify_after,
        log=None if as_json else click.echo,
    )
    if ack_url and receiver:
        acknowledge(ack_url, result.version, receiver, fingerprint=result.fingerprint, storage_options=options)
    if as_json:
        emit_json(result.to_json())
    else:
        if result.steps:
            click.echo(result.message)
        if ack_url:
            click.echo(f"acknowledged {result.version} as {receiver!r} on {ack_url}")
