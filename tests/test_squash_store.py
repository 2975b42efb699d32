"""Keyframes, shortcuts and path choice on a real (local) store: lagging and new receivers catch up exactly."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers_checkpoints import copy_checkpoint, read_raw

import dcr_cli
from dcr_cli.delta.reader import Delta
from dcr_cli.errors import DcrError, IncompatibleError
from dcr_cli.store import Store
from dcr_cli.store.keyframes import compact, join, open_plan, plan, publish_keyframe, shortcuts

REPO = Path(__file__).resolve().parents[1]
STEPS = 7


@pytest.fixture(scope="module")
def stream(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """(checkpoints step-0..7, deltas, a store with all 7 versions committed)."""
    tmp = tmp_path_factory.mktemp("stream")
    ck, deltas, store = tmp / "ck", tmp / "d", tmp / "store"
    subprocess.run(
        [sys.executable, str(REPO / "examples" / "train_tiny.py"), str(ck), "--steps", str(STEPS)],
        check=True,
        capture_output=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=600,
    )
    for k in range(1, STEPS + 1):
        out = deltas / f"step-{k}"
        dcr_cli.diff(ck / f"step-{k - 1}", ck / f"step-{k}", out, base_version=f"step-{k - 1}",
                     target_version=f"step-{k}", workers=1)  # fmt: skip
        dcr_cli.push(out, str(store))
        dcr_cli.acknowledge(str(store), f"step-{k}", "r0")
        dcr_cli.commit(str(store), f"step-{k}", receivers=["r0"])
    return ck, deltas, store


def test_plain_store_keeps_the_chain(stream: tuple[Path, Path, Path], tmp_path: Path) -> None:
    _ck, _, store = stream
    p = plan(str(store), "step-4", allow_keyframe=False)
    assert [(s.kind, s.base, s.target) for s in p.steps] == [
        ("chain", "step-4", "step-5"),
        ("chain", "step-5", "step-6"),
        ("chain", "step-6", "step-7"),
    ]
    assert p.bytes == p.chain_bytes


def test_keyframe_shortcuts_join_and_catch_up(stream: tuple[Path, Path, Path], tmp_path: Path, dcr) -> None:
    ck, deltas, src = stream
    store = tmp_path / "store"
    shutil.copytree(src, store)
    url = str(store)
    # A keyframe must hold the committed state it claims.
    with pytest.raises(IncompatibleError, match="holds"):
        publish_keyframe(url, ck / "step-1", version="step-2")
    frame = publish_keyframe(url, ck / "step-2", version="step-2")
    assert frame.version == "step-2" and frame.fingerprint == Delta.open(deltas / "step-2").manifest.target.fingerprint
    result = compact(url, every=2)
    assert result.published == ["step-2..step-4", "step-2..step-6"]
    assert compact(url, every=2).present == result.published  # re-running publishes nothing new
    sc = {s.record.version: s for s in shortcuts(Store(url))}
    chain_4_6 = sum(Delta.open(deltas / f"step-{k}").manifest.payload_bytes() for k in range(3, 7))
    assert sc["step-6"].record.payload_bytes < chain_4_6
    assert sc["step-6"].chain == [f"step-{k}" for k in range(3, 7)]

    # A receiver at the keyframe's version takes the shortcut, then the chain; pull verifies and says so.
    proc = dcr("pull", url, "--since", "step-2", "-o", str(tmp_path / "p"), check=True)
    assert "path: shortcut step-2..step-6 + chain step-6..step-7" in proc.stdout
    recv = copy_checkpoint(ck / "step-2", tmp_path / "recv")
    dcr("apply", str(tmp_path / "p"), "--into", str(recv), check=True)
    assert read_raw(recv) == read_raw(ck / "step-7")
    # The same without a local copy: apply STORE --since reads the chosen deltas in place.
    recv2 = copy_checkpoint(ck / "step-2", tmp_path / "recv2")
    proc = dcr("apply", url, "--since", "step-2", "--into", str(recv2), check=True)
    assert "shortcut step-2..step-6" in proc.stdout
    assert read_raw(recv2) == read_raw(ck / "step-7")

    # A receiver with no state joins from the keyframe and follows the chain.
    proc = dcr("pull", url, "--join", "-o", str(tmp_path / "new"), check=True)
    assert "joined at keyframe step-2" in proc.stdout
    assert read_raw(tmp_path / "new") == read_raw(ck / "step-2")
    dcr("apply", url, "--since", "step-2", "--into", str(tmp_path / "new"), check=True)
    dcr("verify", str(tmp_path / "new"), "--against", str(deltas / "step-7"), check=True)

    # A receiver far behind: keyframe route vs the whole chain, chosen by bytes.
    p = plan(url, "step-0")
    assert p.chain_bytes is not None and p.bytes <= p.chain_bytes
    assert p.keyframe_bytes is not None and p.keyframe_bytes > frame.bytes

    # A corrupt keyframe file is refused before the directory appears.
    (model,) = [f for f in frame.files if f.name == "model.safetensors"]
    victim = store / "keyframes" / "step-2" / f"{model.digest}-model.safetensors"  # named by its content
    data = bytearray(victim.read_bytes())
    data[-1] ^= 1
    victim.write_bytes(bytes(data))
    proc = dcr("pull", url, "--join", "-o", str(tmp_path / "bad"))
    assert proc.returncode == 2 and "corrupt" in proc.stderr and not (tmp_path / "bad").exists()


def test_gc_keeps_the_newest_keyframes_shortcuts(stream: tuple[Path, Path, Path], tmp_path: Path) -> None:
    ck, _deltas, src = stream
    store = tmp_path / "store"
    shutil.copytree(src, store)
    url = str(store)
    publish_keyframe(url, ck / "step-1", version="step-1")
    compact(url, every=3)  # step-1..step-4, step-1..step-7
    publish_keyframe(url, ck / "step-4", version="step-4")
    compact(url, every=3)  # step-4..step-7
    before = {(s.record.base.version, s.record.version) for s in shortcuts(Store(url))}
    assert before == {("step-1", "step-4"), ("step-1", "step-7"), ("step-4", "step-7")}
    dcr_cli.gc(url, keep=1, grace_s=0)
    after = shortcuts(Store(url))
    assert [(s.record.base.version, s.record.version) for s in after] == [("step-4", "step-7")]
    assert not (store / "keyframes" / "step-1").exists() or not list((store / "keyframes" / "step-1").iterdir())
    assert not (store / "keyframes" / "step-1.json").exists()
    # What is kept still works: join at step-4, then the shortcut reaches step-7 (older versions are gone).
    join(url, tmp_path / "new")
    p = plan(url, "step-4", allow_keyframe=False)
    assert [s.kind for s in p.steps] == ["shortcut"]
    # From step-5 the chain's deltas are gone (keep=1): only the keyframe route is left.
    with pytest.raises(DcrError, match="no path from step-5"):
        plan(url, "step-5", allow_keyframe=False)
    assert [s.kind for s in plan(url, "step-5").steps] == ["keyframe", "shortcut"]
    deltas_in_place = open_plan(url, p)
    dcr_cli.apply(deltas_in_place, into=tmp_path / "new", workers=1)
    assert read_raw(tmp_path / "new") == read_raw(ck / "step-7")
    # dcr check still sees a sound store (it examines the kept shortcut too).
    checked = dcr_cli.check(url)
    assert checked.ok, checked.problems
