"""``--vllm URL`` for ``dcr apply`` and ``dcr verify``: a running vLLM server as the receiver.

The option's help, and ``dcr verify --vllm``'s printing; the work is ``dcr_cli.api.apply_vllm`` (called by
``dcr apply``, beside its checkpoint receiver) / ``verify_vllm``.
"""

from __future__ import annotations

from .common import emit_json, say

VLLM_OPTION_HELP = (
    'URL of a vLLM server started with the dcr plugin, --weight-transfer-config \'{"backend": "dcr"}\' '
    "and VLLM_SERVER_DEV_MODE=1; update its resident weights in place."
)


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
