"""``dcr verify``: prove that a checkpoint directory holds exactly the target bits.

Every tensor is digested (BLAKE3 of its stored bytes, read with pread in bounded chunks),
changed or not, and compared with a
tensor table: a delta's target table, or the table a receiver recorded when it
last reached a version (format_spec/receiver-checkpoint.md §5).

``dcr apply --verify`` calls this under its lock with the digests its own read-back proof just
computed (``read_back``): those tensors were read from the files after the last write, so they are
not read a second time; every other tensor is. Each tensor is digested once after the write either
way, and the report is the same.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..checkpoints.safetensors_dir import SafetensorsCheckpoint
from ..delta.reader import Delta
from ..errors import IncompatibleError
from ..format.manifest import TensorEntry, fingerprint
from ..io.gc_pause import fewer_collections
from ..io.pool import check_workers, default_workers
from . import plan as receiver_plan
from .checkpoint.inplace import InPlaceFiles, digest_tensors
from .checkpoint.state import read_recorded_table, read_state


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
    read_back: int = 0  # tensors whose digest an apply's read-back proof computed in this process (not read again)

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
                shown = ", ".join(receiver_plan.quote(n) for n in names[:8]) + (
                    f", … ({len(names)} in all)" if len(names) > 8 else ""
                )
                parts.append(f"{label}: {shown}")
        return f"{self.checkpoint}: MISMATCH against {self.against}; " + "; ".join(parts)


def compare_tables(
    expected: dict[str, TensorEntry], actual: dict[str, TensorEntry]
) -> tuple[list[str], list[str], list[str], list[str]]:
    """(digest differs, missing, unexpected, dtype/shape differs), each sorted."""
    mismatched, layout = [], []
    for name in sorted(expected.keys() & actual.keys()):
        e, a = expected[name], actual[name]
        if e.dtype != a.dtype or (e.shape != a.shape and tuple(e.shape) != tuple(a.shape)):
            layout.append(name)
        elif e.digest != a.digest:
            mismatched.append(name)
    return mismatched, sorted(set(expected) - set(actual)), sorted(set(actual) - set(expected)), layout


@fewer_collections()
def verify(
    checkpoint: str | os.PathLike[str],
    *,
    against: str | os.PathLike[str] | Delta | None = None,
    workers: int | None = None,
    read_back: Mapping[str, str] | None = None,
) -> VerifyReport:
    """Digest every tensor of ``checkpoint`` and compare with the expected table.

    ``against`` is a delta (path, URL or :class:`Delta`) whose target table is expected. Without
    it, the table recorded in CKPT/.dcr by the last ``dcr apply`` is expected.
    ``read_back``: tensor name -> digest of tensors the caller read back from these very files after
    its last write to them, with nothing able to write them since (``dcr apply --verify``, under the
    receiver's lock); they are not read again.
    Returns a report; it raises only when there is nothing to compare with.
    """
    check_workers(workers)
    root = Path(checkpoint)
    if not root.is_dir():
        raise IncompatibleError(f"{root} is not a checkpoint directory")
    if against is not None:
        delta = against if isinstance(against, Delta) else Delta.open(against)
        receiver_plan.check_table(delta.manifest, f"{delta.url} (nothing to verify against: fetch it again)")
        expected = delta.manifest.tensors
        expected_version: str | None = delta.manifest.target.version
        expected_fp = delta.manifest.target.fingerprint  # what check_table just proved the table hashes to
        label = delta.url
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
        expected_fp = state.fingerprint  # read_recorded_table returns only a table of that fingerprint
    started = time.perf_counter()
    known = read_back or {}
    with SafetensorsCheckpoint(root) as ckpt, InPlaceFiles(dict(ckpt.tensors)) as files:
        locations = ckpt.tensors
        rest = [n for n in locations if n not in known]
        actual = digest_tensors(files, workers or default_workers(), rest) if rest else {}
        reused = {n: TensorEntry(loc.dtype, loc.shape, known[n]) for n, loc in locations.items() if n in known}
        actual = {**actual, **reused} if reused else actual
        nbytes = sum(t.nbytes for t in locations.values())
    seconds = time.perf_counter() - started
    mismatched, missing, unexpected, layout = compare_tables(expected, actual)
    ok = not (mismatched or missing or unexpected or layout)
    # Equal tables (names, dtypes, shapes, digests) have one fingerprint: hashed again only where they differ.
    computed = expected_fp if ok else fingerprint(actual)
    return VerifyReport(
        checkpoint=str(root),
        ok=ok,
        against=label,
        expected_version=expected_version,
        expected_fingerprint=expected_fp,
        computed_fingerprint=computed,
        tensors=len(actual),
        bytes=nbytes,
        seconds=seconds,
        mismatched=mismatched,
        missing=missing,
        unexpected=unexpected,
        layout=layout,
        read_back=len(reused),
    )
