"""``dcr apply --vllm URL`` and ``dcr verify --vllm URL``: a running vLLM server as the receiver.

The logic lives in two functions (``apply_vllm``, ``verify_vllm``) that the ``apply`` and
``verify`` commands call when ``--vllm`` is given.
"""

from __future__ import annotations

import sys

import click

from ..format.manifest import Manifest
from .common import emit_json

VLLM_OPTION_HELP = (
    'URL of a vLLM server started with the dcr plugin, --weight-transfer-config \'{"backend": "dcr"}\' '
    "and VLLM_SERVER_DEV_MODE=1; update its resident weights in place."
)


def chain_order(deltas: list[str]) -> list[str]:
    """Delta locations in apply order (base -> target); a local directory of deltas expands to its children.

    Unlike an on-disk receiver, the client does not know the engine's version: the chain must start
    at the one delta whose base no other delta produces (the engine checks that base itself).
    """
    from ..errors import IncompatibleError
    from ..receive.checkpoint import expand_deltas

    opened = {d.url: d.manifest for d in expand_deltas(deltas)}
    targets = {m.target.fingerprint for m in opened.values()}
    starts = [loc for loc, m in opened.items() if m.base.fingerprint not in targets]
    if len(starts) != 1:
        raise IncompatibleError("the deltas do not form one chain (base -> target); pass them one chain at a time")
    by_base = {m.base.fingerprint: loc for loc, m in opened.items()}
    order = [starts[0]]
    while opened[order[-1]].target.fingerprint in by_base and len(order) < len(opened):
        order.append(by_base[opened[order[-1]].target.fingerprint])
    if len(order) != len(opened):
        raise IncompatibleError("the deltas do not form one chain (base -> target); pass them one chain at a time")
    return order


def apply_vllm(deltas: tuple[str, ...], url: str, as_json: bool) -> Manifest:
    """Apply the chain of deltas to the server at ``url``; returns the manifest of the last one."""
    from ..delta.reader import Delta
    from ..receive.vllm import apply_to_server

    reports = []
    order = chain_order(list(deltas))
    for location in order:
        reports.append(apply_to_server(url, location, log=None if as_json else click.echo))
    if as_json:
        emit_json({"vllm": url, "steps": reports})
    return Delta.open(order[-1]).manifest


def verify_vllm(url: str, against: str | None, as_json: bool) -> None:
    from ..errors import VerifyFailed
    from ..receive.vllm import verify_server

    try:
        answer = verify_server(url, against)
    except VerifyFailed as exc:
        if as_json:
            emit_json({"vllm": url, "ok": False, "error": str(exc)})
        click.echo(f"dcr: error: {exc}", err=True)
        sys.exit(exc.exit_code)
    if as_json:
        emit_json({"vllm": url, "ok": True, "tensors": answer["tensors"], "fingerprint": answer["fingerprint"]})
    else:
        click.echo(f"ok: {answer['tensors']} tensors of the vLLM engine match ({answer['fingerprint'][:16]}…)")
