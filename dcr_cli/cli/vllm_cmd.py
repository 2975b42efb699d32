"""``--vllm URL`` for ``dcr apply`` and ``dcr verify``: a running vLLM server as the receiver.

Parsing and printing only; the work is ``dcr_cli.api.apply_vllm`` / ``verify_vllm``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .common import emit_json, say

VLLM_OPTION_HELP = (
    'URL of a vLLM server started with the dcr plugin, --weight-transfer-config \'{"backend": "dcr"}\' '
    "and VLLM_SERVER_DEV_MODE=1; update its resident weights in place."
)


def apply_vllm(
    deltas: tuple[str, ...],
    url: str,
    *,
    version: str | None,
    since: str | None,
    wait: float | None,
    on_wait: Callable[[str], None],
    verify: bool,
    ack: str | None,
    receiver: str | None,
    options: dict[str, Any],
    as_json: bool,
) -> None:
    from ..api import apply_vllm as run

    result = run(
        deltas,
        url,
        version=version,
        since=since,
        wait=wait,
        on_wait=on_wait,
        verify=verify,
        ack=ack,
        receiver=receiver,
        storage_options=options,
        log=None if as_json else say,
    )
    if as_json:
        emit_json({"vllm": url, "steps": result["steps"]})


def verify_vllm(url: str, against: str | None, as_json: bool) -> None:
    from ..api import verify_vllm as run
    from ..errors import VerifyFailed

    try:
        answer = run(url, against)
    except VerifyFailed as exc:
        if as_json:
            emit_json({"vllm": url, "ok": False, "error": str(exc)})
        raise
    if as_json:
        emit_json({"vllm": url, "ok": True, "tensors": answer["tensors"], "fingerprint": answer["fingerprint"]})
    else:
        say(f"ok: {answer['tensors']} tensors of the vLLM engine match ({answer['fingerprint'][:16]}…)")
