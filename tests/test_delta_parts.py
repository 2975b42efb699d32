"""Producer parts: two ranks finishing at the same moment both succeed with the same delta."""

from __future__ import annotations

from pathlib import Path

import pytest

from dcr_cli.delta import parts
from dcr_cli.delta.reader import Delta


def _parts(tmp_path: Path) -> Path:
    """Two ranks' parts, written as a producer writes them (each rank digests one of two tensors)."""
    from dcr_cli.delta.writer import DeltaWriter

    out = tmp_path / "d"
    layout = {"a": ("F32", (4,)), "b": ("F32", (4,))}
    for rank, name in enumerate(sorted(layout)):
        writer = DeltaWriter(parts.part_dir(out, rank))
        parts.finish_part(
            writer,
            rank=rank,
            world_size=2,
            layout=layout,
            base_digests={name: f"{rank:x}" * 64},
            target_digests={name: f"{rank + 2:x}" * 64},
            residual={},
            base_version="v0",
            target_version="v1",
        )
    assert parts.complete_parts(out) is not None
    return out


def test_the_rank_that_loses_the_assembly_race_gets_the_assembled_delta(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loser saw every part, then the winner assembled and let go of the lock: it raised ConflictError."""
    out = _parts(tmp_path)
    seen = parts.complete_parts

    def winner_finishes_meanwhile(path: str | Path) -> tuple[int, list[Path]] | None:
        found = seen(path)
        monkeypatch.setattr(parts, "complete_parts", seen)
        parts.assemble(path)  # the other rank, between this rank's look at the parts and its lock
        return found

    monkeypatch.setattr(parts, "complete_parts", winner_finishes_meanwhile)
    manifest = parts.try_assemble_last(out)
    assert manifest is not None and manifest == Delta.open(out).manifest
    assert not (out / parts.PARTS_DIR).exists() and not (out / parts.LOCK_NAME).exists()
    # A rank arriving after the assembly succeeds with the same delta as well.
    assert parts.try_assemble_last(out) == manifest
