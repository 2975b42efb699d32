"""The engine receiver's first-pass budget (PREPARED_BYTES): one budget for a whole apply, staged
items included, counted in the bytes the items really hold. On plain torch modules whose
``load_weights`` plays vLLM's loader, as in tests/test_engine_predict.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file

import dcr_cli.receive.vllm.apply as engine_apply
from dcr_cli.delta.reader import Delta
from dcr_cli.produce import diff
from dcr_cli.receive.vllm.apply import EngineReceiver, Located, Prepared

NAMES = [f"t{i:02d}" for i in range(12)]


class Separate(torch.nn.Module):
    """One 64 x 64 FP16 parameter per checkpoint tensor, loaded by a plain copy."""

    def __init__(self) -> None:
        super().__init__()
        self.p = torch.nn.ParameterDict(
            {n: torch.nn.Parameter(torch.zeros(64, 64, dtype=torch.float16), requires_grad=False) for n in NAMES}
        )

    def load_weights(self, weights):  # type: ignore[no-untyped-def]
        for name, t in weights:
            self.p[name].data.copy_(t)


def _chain(tmp: Path) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], Delta]:
    rng = np.random.default_rng(5)
    base = {n: rng.standard_normal((64, 64)).astype(np.float16) for n in NAMES}
    target = {}
    for n, x in base.items():
        t = x.copy()
        t.view(np.uint16).reshape(-1)[rng.choice(4096, 600, replace=False)] ^= 1
        target[n] = t
    for label, table in (("c0", base), ("c1", target)):
        (tmp / label).mkdir()
        save_file(table, str(tmp / label / "model.safetensors"))
    diff(tmp / "c0", tmp / "c1", tmp / "d", base_version="v0", target_version="v1", workers=1)
    return base, target, Delta.open(str(tmp / "d"))


def test_an_update_keeps_items_within_what_its_staged_pass_left_of_the_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``prepare`` stages what fits PREPARED_BYTES; the update's first pass for the other items may
    keep only what is left, not a budget of its own on top (it held up to twice PREPARED_BYTES)."""
    base, target, delta = _chain(tmp_path)
    module = Separate()
    for n, x in base.items():
        module.p[n].data.copy_(torch.from_numpy(x))
    receiver = EngineReceiver(module)

    probe = EngineReceiver(Separate())  # one item's footprint, on a receiver of the same layout
    probe.state = receiver.state
    one = max(p.nbytes for p in _first_pass_of(probe, delta, base).values())
    budget = 5 * one  # about 5 of the 12 items fit
    monkeypatch.setattr(engine_apply, "PREPARED_BYTES", budget)

    held: list[int] = []
    first_pass = EngineReceiver._untouched_and_first_pass

    def recording(self: EngineReceiver, d: Delta, *args: object, **kw: object) -> None:
        first_pass(self, d, *args, **kw)  # type: ignore[arg-type]
        skip = kw.get("skip") or (args[2] if len(args) > 2 else None) or {}
        held.append(sum(p.nbytes for p in {**skip, **self._prepared}.values()))  # type: ignore[union-attr]

    monkeypatch.setattr(EngineReceiver, "_untouched_and_first_pass", recording)
    assert receiver.prepare(delta) == "apply"
    assert receiver._staged is not None and 0 < len(receiver._staged.prepared) < len(delta.manifest.items)
    report = receiver.apply(delta)
    assert report.status == "applied" and receiver.state.version == "v1"
    assert len(held) == 2 and max(held) <= budget, (held, budget)
    for n, t in target.items():  # exact, the items the budget did not keep decoded again for their writes
        assert np.array_equal(module.p[n].data.numpy().view(np.uint16), t.view(np.uint16)), n


def _first_pass_of(receiver: EngineReceiver, delta: Delta, base: dict[str, np.ndarray]) -> dict[int, Prepared]:
    module = receiver.model
    assert isinstance(module, Separate)
    for n, x in base.items():
        module.p[n].data.copy_(torch.from_numpy(x))
    receiver.prepare(delta)
    assert receiver._staged is not None
    return receiver._staged.prepared


def test_an_items_bytes_count_a_view_and_its_base_once() -> None:
    """A destination's index that is a view of the item's canonical positions (a tensor alone in its
    parameter) holds no memory of its own."""
    canonical = np.arange(1000, dtype=np.int64)
    located = Located(None, slice(0, 1000), canonical[:], torch.zeros(1))  # type: ignore[arg-type]
    alone = Prepared(np.zeros(1000, np.uint16), [located], 1000, canonical=canonical)
    assert alone.nbytes == 1000 * 2 + 1000 * 8
    copied = Prepared(np.zeros(1000, np.uint16), [Located(None, slice(0, 1000), canonical + 7, torch.zeros(1))], 1000,  # type: ignore[arg-type]
                      canonical=canonical)  # fmt: skip
    assert copied.nbytes == 1000 * 2 + 2 * 1000 * 8
