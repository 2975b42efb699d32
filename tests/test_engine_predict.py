"""The engine receiver's proof before the writes (receiver-vllm.md §3, §4), on plain torch modules
whose ``load_weights`` plays vLLM's loader (placement is traced through it as for a real engine).

* two tensors the loader copies into one storage are never proven before the writes: another
  tensor's writes change their bits, so they are digested after all the writes;
* a parameter replaced between ``prepare`` and the update drops the staged pass (its indices
  point into the old storage);
* a tensor held through a widening cast is proven on its whole canonical read-back, and a
  re-signed delta whose items miss the table is refused before any write there too.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from manifest_text import manifest_v1
from safetensors.numpy import save_file

from dcr_cli.delta.reader import Delta
from dcr_cli.errors import IntegrityError
from dcr_cli.format.digest import digest_bytes
from dcr_cli.format.manifest import MANIFEST_NAME, TensorEntry, fingerprint
from dcr_cli.produce import diff
from dcr_cli.receive.vllm.apply import EngineReceiver


class OneStorage(torch.nn.Module):
    """Every checkpoint tensor (64 x 64) is copied into the same parameter: tied weights loaded both ways."""

    def __init__(self, dtype: torch.dtype = torch.float16) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(4096, dtype=dtype), requires_grad=False)

    def load_weights(self, weights):  # type: ignore[no-untyped-def]
        for _, t in weights:
            self.w.data.view(64, 64).copy_(t)


def _versions(tmp: Path, tensors: dict[str, list[int]]) -> tuple[np.ndarray, Delta]:
    """A base where every tensor is the same 64 x 64 FP16 matrix, and a target where tensor ``n``
    has the rows ``tensors[n]`` stepped in their low mantissa bit."""
    x = np.random.default_rng(0).standard_normal((64, 64)).astype(np.float16)
    target = {}
    for name, rows in tensors.items():
        t = x.copy()
        for r in rows:
            t.view(np.uint16)[r, :50] ^= 1
        target[name] = t
    for label, table in (("c0", {n: x.copy() for n in tensors}), ("c1", target)):
        (tmp / label).mkdir()
        save_file(table, str(tmp / label / "model.safetensors"))
    diff(tmp / "c0", tmp / "c1", tmp / "d", base_version="v0", target_version="v1", workers=1)
    return x, Delta.open(str(tmp / "d"))


def _engine(x: np.ndarray, dtype: torch.dtype = torch.float16) -> tuple[OneStorage, EngineReceiver]:
    module = OneStorage(dtype)
    module.w.data.copy_(torch.from_numpy(x).reshape(-1).to(dtype))
    return module, EngineReceiver(module)


@pytest.mark.parametrize("staged", [False, True])
def test_tensors_sharing_one_storage_are_digested_after_the_writes_never_predicted(
    tmp_path: Path, staged: bool
) -> None:
    """Base a == b; the target changes row 0 of a and row 1 of b, which one storage cannot hold.
    Each tensor's own items lead to its target, so a prediction per tensor would pass both."""
    x, delta = _versions(tmp_path, {"a": [0], "b": [1]})
    _, receiver = _engine(x)
    if staged:
        assert receiver.prepare(delta) == "apply"
    with pytest.raises(IntegrityError, match="do not hold the target"):
        receiver.apply(delta)
    assert receiver.state.version != "v1" and receiver.state.applying is not None


def test_tensors_sharing_one_storage_still_apply_when_the_target_is_one_tensor(tmp_path: Path) -> None:
    x, delta = _versions(tmp_path, {"a": [0, 3], "b": [0, 3]})
    _, receiver = _engine(x)
    receiver.prepare(delta)
    report = receiver.apply(delta)
    assert report.status == "applied" and report.predicted == 0  # both digested after the writes
    assert receiver.verify(delta.manifest.tensors)["mismatched"] == []


def test_a_parameter_replaced_after_prepare_drops_the_staged_pass_and_the_apply_is_exact(tmp_path: Path) -> None:
    x, delta = _versions(tmp_path, {"a": [0, 7]})
    module, receiver = _engine(x)
    assert receiver.prepare(delta) == "apply"
    old = module.w
    module.w = torch.nn.Parameter(old.data.clone(), requires_grad=False)  # same bits, new storage
    report = receiver.apply(delta)
    assert report.status == "applied" and report.staged == 0 and report.predicted == 1
    assert receiver.verify(delta.manifest.tensors)["mismatched"] == []
    assert torch.equal(old.data, torch.from_numpy(x).reshape(-1))  # nothing went to the old storage


def test_a_widened_tensor_is_predicted_from_its_read_back_and_a_resigned_table_is_refused_before_any_write(
    tmp_path: Path,
) -> None:
    x, delta = _versions(tmp_path, {"a": [0, 9]})
    module, receiver = _engine(x, torch.float32)  # an FP16 checkpoint in an FP32 engine
    bad = tmp_path / "bad"
    shutil.copytree(tmp_path / "d", bad)
    manifest = manifest_v1(bad)
    manifest["tensors"]["a"]["digest"] = digest_bytes(b"not the target")
    table = {n: TensorEntry(t["dtype"], tuple(t["shape"]), t["digest"]) for n, t in manifest["tensors"].items()}
    manifest["target"]["fingerprint"] = fingerprint(table)
    (bad / MANIFEST_NAME).write_text(json.dumps(manifest))
    before = module.w.data.clone()
    with pytest.raises(IntegrityError, match=r"would not hold the target .*nothing was written"):
        receiver.apply(Delta.open(str(bad)))
    assert torch.equal(module.w.data, before) and receiver.state.applying is None
    report = receiver.apply(delta)
    assert report.status == "applied" and report.predicted == 1
    assert receiver.verify(delta.manifest.tensors)["mismatched"] == []
