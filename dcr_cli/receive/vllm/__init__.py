"""Live vLLM engines as receivers (format_spec/receiver-vllm.md).

``apply_to_llm(llm, delta)`` / ``verify_llm(llm, delta)`` for an ``LLM`` in this process and
``apply_to_server(url, delta)`` / ``verify_server(url, delta)`` for ``vllm serve``
(``apply_chain_to_server(url, deltas)``: a chain under one claim); both need the
engine started with the dcr plugin installed and ``weight_transfer_config={"backend": "dcr"}``.
Importing this package does not import vLLM.
"""

from __future__ import annotations

from .client import apply_chain_to_server, apply_to_llm, apply_to_server, verify_llm, verify_server

__all__ = ["apply_chain_to_server", "apply_to_llm", "apply_to_server", "verify_llm", "verify_server"]
