"""``dcr verify``: prove that a checkpoint directory holds exactly the target bits.

Every tensor is digested (BLAKE3 of its stored bytes, straight from the page
cache through a read-only memory map), changed or not, and compared with a
tensor table: a delta's target table, or the table a receiver recorded when it
last reached a version (format_spec/receiver-checkpoint.md §5).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..checkpoints.safetensors_dir import SafetensorsCheckpoint
from ..errors import IncompatibleError, IntegrityError
from ..format.digest import digest_bytes
from ..format.manifest import TensorEntry, fingerprint
from ..io.pool import default_workers, ordered_parallel


def digest_tensors(ckpt: SafetensorsCheckpoint, workers: int | None = None) -> dict[str, TensorEntry]:
    """The checkpoint's tensor table: dtype, shape and digest of every tensor, sorted by name.

    Large tensors are hashed by BLAKE3's own thread pool; the many small ones
    are spread over a thread pool of our own (BLAKE3 releases the GIL).
    """
    names = sorted(ckpt.tensors, key=lambda n: -ckpt.tensors[n].nbytes)

    def task(name: str) -> Callable[[], tuple[str, str]]:
        return lambda: (name, digest_bytes(ckpt.view(name)))

    digests = dict(ordered_parallel((task(n) for n in names), workers or default_workers()))
    return ckpt.tensor_table(digests)


@dataclass
class VerifyReport:
    checkpoint: str
    ok: bool
    against: str  # the delta's URL, or "state" for the table recorded by the last apply
    expected_version: str | None
    expected_fingerprint: str
    computed_fingerprint: str
    tensors: int
    bytes: int
    seconds: float
    mismatched: list[str] = field(default_factory=list)  # digest differs
    missing: list[str] = field(default_factory=list)  # expected, absent from the checkpoint
    unexpected: list[str] = field(default_factory=list)  # present, not expected
    layout: list[str] = field(default_factory=list)  # dtype or shape differs

    @property
    def bad(self) -> list[str]:
        return sorted({*self.mismatched, *self.missing, *self.unexpected, *self.layout})

    def to_json(self) -> dict:
        return {**asdict(self), "bad": self.bad}

    def summary(self) -> str:
        if self.ok:
            return (
                f"{self.checkpoint}: ok, {self.tensors} tensors match version {self.expected_version or '?'} "
                f"(fingerprint {self.computed_fingerprint[:16]}…)"
            )
        parts = []
        for label, names in (
            ("digest differs", self.mismatched),
            ("missing", self.missing),
            ("unexpected", self.unexpected),
            ("dtype/shape differs", self.layout),
        ):
            if names:
                shown = ", ".join(names[:8]) + (f", … ({len(names)} in all)" if len(names) > 8 else "")
                parts.append(f"{label}: {shown}")
        return f"{self.checkpoint}: MISMATCH against {self.against}; " + "; ".join(parts)


def compare_tables(
    expected: dict[str, TensorEntry], actual: dict[str, TensorEntry]
) -> tuple[list[str], list[str], list[str], list[str]]:
    """(digest differs, missing, unexpected, dtype/shape differs), each sorted."""
    mismatched, layout = [], []
    for name in sorted(set(expected) & set(actual)):
        e, a = expected[name], actual[name]
        if (e.dtype, tuple(e.shape)) != (a.dtype, tuple(a.shape)):
            layout.append(name)
        elif e.digest != a.digest:
            mismatched.append(name)
    return mismatched, sorted(set(expected) - set(actual)), sorted(set(actual) - set(expected)), layout


def verify(
    checkpoint: str | os.PathLike[str],
    *,
    against: str | os.PathLike[str] | None = None,
    workers: int | None = None,
) -> VerifyReport:
    """Digest every tensor of ``checkpoint`` and compare with the expected table.

    ``against`` is a delta (path or URL) whose target table is expected. Without
    it, the table recorded in CKPT/.dcr by the last ``dcr apply`` is expected.
    Returns a report; it raises only when there is nothing to compare with.
    """
    from .checkpoint import read_recorded_table, read_state

    root = Path(checkpoint)
    if not root.is_dir():
        raise IncompatibleError(f"{root} is not a checkpoint directory")
    if against is not None:
        from ..delta.reader import Delta

        delta = Delta.open(against)
        expected = delta.manifest.tensors
        if fingerprint(expected) != delta.manifest.target.fingerprint:
            raise IntegrityError(
                f"{against}: manifest tensor table does not match its target fingerprint (tampered?); "
                "nothing to verify against — fetch the delta again"
            )
        expected_version: str | None = delta.manifest.target.version
        label = str(against)
    else:
        state = read_state(root)
        if state is not None and state.applying is not None:
            raise IncompatibleError(
                f"{root} is in the middle of a dcr apply (to version {state.applying['target'].get('version')}); "
                "re-run that dcr apply to finish it, or pass --against DELTA"
            )
        if state is None or state.fingerprint is None:
            raise IncompatibleError(
                f"{root} has no recorded version (no completed dcr apply); pass --against DELTA to verify it"
            )
        recorded = read_recorded_table(root, state.fingerprint)
        if recorded is None:
            raise IncompatibleError(f"{root}/.dcr holds no tensor table for its version; pass --against DELTA")
        expected, expected_version, label = recorded, state.version, "state"
    started = time.perf_counter()
    with SafetensorsCheckpoint(root) as ckpt:
        actual = digest_tensors(ckpt, workers)
        nbytes = sum(t.nbytes for t in ckpt.tensors.values())
    seconds = time.perf_counter() - started
    mismatched, missing, unexpected, layout = compare_tables(expected, actual)
    computed = fingerprint(actual)
    ok = not (mismatched or missing or unexpected or layout)
    return VerifyReport(
        checkpoint=str(root),
        ok=ok,
        against=label,
        expected_version=expected_version,
        expected_fingerprint=fingerprint(expected),
        computed_fingerprint=computed,
        tensors=len(actual),
        bytes=nbytes,
        seconds=seconds,
        mismatched=mismatched,
        missing=missing,
        unexpected=unexpected,
        layout=layout,
    )
