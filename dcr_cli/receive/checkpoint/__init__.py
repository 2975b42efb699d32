"""The checkpoint-directory receiver (``dcr apply --into``), format_spec/receiver-checkpoint.md.

* ``state``: ``.dcr/state.json``, ``.dcr/table.json`` and the lock;
* ``inplace``: pread/pwrite of tensor elements, digests of tensors;
* ``applier``: checks, the first pass, the writes and the proof, per delta of a chain.

The item logic shared with the vLLM receiver is in ``receive/plan.py``.
"""

from __future__ import annotations

from .applier import ApplyResult, StepResult, apply, expand_deltas, warm_up
from .state import ReceiverState, file_stats, read_recorded_table, read_state, write_state

__all__ = [
    "ApplyResult",
    "ReceiverState",
    "StepResult",
    "apply",
    "expand_deltas",
    "file_stats",
    "read_recorded_table",
    "read_state",
    "warm_up",
    "write_state",
]
