"""review9: ``dcr diff --strip-prefix`` of a DCP checkpoint never names a tensor "".

Before, ``--strip-prefix model.x`` turned the stored tensor ``model.x`` into a tensor named "" and
wrote the delta (exit 0); no receiver's checkpoint holds such a tensor. Now it is refused in one line.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from conftest import run_dcr


def test_a_strip_prefix_that_leaves_a_tensor_without_a_name_is_refused(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    base = {"model.x": torch.randn(4, 4, generator=g).to(torch.bfloat16), "y": torch.randn(3, generator=g)}
    new = {k: v.clone() for k, v in base.items()}
    new["model.x"][0, 0] += 1
    dcp.save(base, checkpoint_id=str(tmp_path / "a"), no_dist=True)
    dcp.save(new, checkpoint_id=str(tmp_path / "b"), no_dist=True)
    out = tmp_path / "d"
    proc = run_dcr("diff", str(tmp_path / "a"), str(tmp_path / "b"), "-o", str(out), "--strip-prefix", "model.x")
    assert proc.returncode == 2, proc.stdout
    assert proc.stderr.count("\n") == 1 and "leaves 'model.x' with no name" in proc.stderr
    assert not out.exists()
    ok = run_dcr("diff", str(tmp_path / "a"), str(tmp_path / "b"), "-o", str(out), "--strip-prefix", "model.")
    assert ok.returncode == 0, ok.stderr
