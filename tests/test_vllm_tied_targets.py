"""Tied tensors (two checkpoint tensors the loader copies into the same storage elements) whose
targets disagree cannot both be held: the engine must not record the version. Each such tensor is
digested after every write of its group, so the proof sees what the last write left."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from dcr_cli.delta.reader import Delta
from dcr_cli.errors import DcrError
from dcr_cli.produce import diff
from dcr_cli.receive.vllm.apply import EngineReceiver

R, C = 16, 16


class Tied(torch.nn.Module):
    """``a`` and ``b`` both land in ``w`` (as an embedding tied to the LM head), ``c`` in ``u``."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(R, C, dtype=torch.bfloat16), requires_grad=False)
        self.u = torch.nn.Parameter(torch.zeros(R, C, dtype=torch.bfloat16), requires_grad=False)

    def load_weights(self, weights):  # type: ignore[no-untyped-def]
        for name, t in weights:
            (self.u.data if name == "c" else self.w.data).copy_(t)


def _save(path: Path, table: dict[str, np.ndarray]) -> None:
    path.mkdir()
    save_file(
        {n: torch.from_numpy(x.view(np.int16)).view(torch.bfloat16) for n, x in table.items()},
        str(path / "m.safetensors"),
    )


def _loaded(table: dict[str, np.ndarray]) -> Tied:
    module = Tied()
    module.load_weights([(n, torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)) for n, x in table.items()])
    return module


@pytest.mark.parametrize("agree", [True, False])
def test_tied_targets_that_disagree_are_refused_and_no_version_is_recorded(tmp_path: Path, agree: bool) -> None:
    rng = np.random.default_rng(11)
    shared = rng.integers(0, 1 << 16, (R, C), dtype=np.uint16)
    base = {"a": shared, "b": shared.copy(), "c": rng.integers(0, 1 << 16, (R, C), dtype=np.uint16)}
    target = {n: x.copy() for n, x in base.items()}
    for x in target.values():
        x[rng.random(x.shape) < 0.1] ^= 1
    target["b"] = target["a"].copy()
    if not agree:
        target["b"][3, 4] ^= 0x40  # b's target differs from a's at one element
    _save(tmp_path / "c0", base)
    _save(tmp_path / "c1", target)
    diff(tmp_path / "c0", tmp_path / "c1", tmp_path / "d", base_version="v0", target_version="v1", workers=1)
    module = _loaded(base)
    receiver = EngineReceiver(module)
    delta = Delta.open(str(tmp_path / "d"))
    if agree:
        assert receiver.apply(delta).status == "applied" and receiver.state.version == "v1"
        assert receiver.verify(delta.manifest.tensors)["mismatched"] == []
        return
    with pytest.raises(DcrError, match=r"'[ab]'"):
        receiver.apply(delta)
    assert receiver.state.version != "v1"  # the engine holds only one of the two: nothing recorded
    assert receiver.verify(delta.manifest.tensors)["mismatched"]  # (which verify confirms)
