"""What a written delta amounts to: the totals ``dcr diff`` and ``dcr assemble`` print."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..format.digest import digest_bytes
from ..format.manifest import Manifest


@dataclass
class DiffSummary:
    delta: str
    delta_id: str
    base_version: str
    target_version: str
    tensors: int
    total_elements: int
    changed_elements: int
    payload_bytes: int
    manifest_bytes: int
    repair_bytes: int
    full_bytes: int
    # The delta was there already, complete, from an earlier run of the same diff (nothing was written).
    already_there: bool = False

    @property
    def change_rate(self) -> float:
        return self.changed_elements / self.total_elements if self.total_elements else 0.0

    def to_json(self) -> dict[str, Any]:
        out = {**asdict(self), "change_rate": self.change_rate}
        if not self.already_there:
            del out["already_there"]  # the summary of a delta just written, as before
        return out


def summarize(path: Path, manifest: Manifest) -> DiffSummary:
    raw = manifest.file_bytes()
    return DiffSummary(
        delta=str(path),
        delta_id=digest_bytes(raw),
        base_version=manifest.base.version,
        target_version=manifest.target.version,
        tensors=len(manifest.tensors),
        total_elements=manifest.total_elements(),
        changed_elements=manifest.changed_elements(),
        payload_bytes=manifest.payload_bytes(),
        manifest_bytes=len(raw),
        repair_bytes=manifest.repair_bytes(),
        full_bytes=manifest.full_bytes(),
    )
