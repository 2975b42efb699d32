"""Fuzz: mutated store records and receiver state against the real CLI.

Store: one record of a local store (dcr-store.json, versions/*.json, commits/*.json, latest.json, acks,
the stored manifests) is mutated or deleted; ``apply STORE --version v1`` must refuse with one line and
leave the receiver byte-identical or bring it to v1; ``status``, ``log``, ``check`` must answer with
0, 1 (check: damage found) or one line and 2; a ``pull`` that succeeds must return the exact delta.
Receiver state: ``CKPT/.dcr/state.json`` or ``table.json`` of a receiver at v1 is mutated; ``apply d12``
must refuse or reach v2; ``verify`` must answer 0, 1 or one line and 2.

Both are read with the strict JSON reader (issue 10 §3): hostile JSON there is one line and exit 2.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import fuzz_support as fz
from hypothesis import given
from hypothesis import strategies as st
from test_fuzz_manifest import OPS, SETTINGS

from dcr_cli.format.manifest import manifest_json

DEEP = b"[" * 100_000 + b"]" * 100_000  # hypothesis raises the recursion limit: 1,000 levels may parse


def _exit_code_on_deep_store_record() -> int:
    """A versions/v1.json nested 100,000 levels, read by ``dcr log``."""
    with fz.scratch() as tmp:
        shutil.copytree(fz.world().store, tmp / "s")
        (tmp / "s" / "versions" / "v1.json").write_bytes(DEEP)
        r = fz.run("log", f"file://{tmp / 's'}")
        assert len(r.stderr.splitlines()) == 1 and r.stderr.startswith("dcr: error: "), r.stderr
        return r.code


def _exit_code_on_deep_receiver_state() -> int:
    """A .dcr/state.json nested 100,000 levels, read by ``dcr apply``."""
    w = fz.world()
    with fz.scratch() as tmp:
        recv = _receiver_at_v1(tmp)
        (recv / ".dcr" / "state.json").write_bytes(DEEP)
        before = fz.snapshot(recv)
        r = fz.run("apply", str(w.deltas[1]), "--into", str(recv))
        assert fz.snapshot(recv) == before
        assert len(r.stderr.splitlines()) == 1 and r.stderr.startswith("dcr: error: "), r.stderr
        return r.code


def _receiver_at_v1(tmp: Path) -> Path:
    w = fz.world()
    recv = fz.copy_receiver(w.versions[0], tmp / "r")
    assert fz.run("apply", str(w.deltas[0]), "--into", str(recv), "--workers", "1").code == 0
    return recv


def _records(store: Path) -> list[str]:
    return sorted(str(p.relative_to(store)) for p in store.rglob("*.json"))


def _read_only(args: list[str], what: str, codes: tuple[int, ...]) -> None:
    r = fz.run(*args)
    assert r.exception is None, f"{what}: {args[0]}: {r.exception}"
    assert r.code in codes, f"{what}: {args[0]} exit {r.code}: {r.stderr}"
    if r.code == 2:  # (check's exit 1 is its report of the damage, one line per problem)
        assert len(r.stderr.splitlines()) == 1 and r.stderr.startswith("dcr: error: "), f"{what}: {r.stderr!r}"


@SETTINGS
@given(record=st.integers(0, 100), ops=OPS, delete=st.booleans())
def test_mutated_store_record(record: int, ops: list[tuple[str, int, int]], delete: bool) -> None:
    w = fz.world()
    with fz.scratch() as tmp:
        store = tmp / "s"
        shutil.copytree(w.store, store)
        names = _records(store)
        name = names[record % len(names)]
        path = store / name
        if delete and record % 3 == 0:
            path.unlink()
            what = f"{name} deleted"
        else:
            # manifests/<digest>.json of a 2.x delta is a zstd frame: its JSON is mutated (and written plain)
            _, raw, what = fz.mutate_json(json.loads(manifest_json(path.read_bytes())), ops)
            path.write_bytes(raw)
            what = f"{name}: {what}"
        url = f"file://{store}"
        recv = fz.copy_receiver(w.versions[0], tmp / "r")
        oracle = fz.Oracle.of("store records", recv, w.versions[1])
        oracle.check(fz.run("apply", url, "--version", "v1", "--into", str(recv), "--workers", "1"), what)
        for args, codes in ((["status", url], (0, 2)), (["log", url], (0, 2)), (["check", url], (0, 1, 2))):
            _read_only(args, what, codes)
        r = fz.run("pull", url, "--version", "v2", "-o", str(tmp / "pulled"))
        assert r.exception is None and r.code in (0, 2), f"{what}: pull {r.code} {r.stderr}"
        if r.code == 0:  # every byte verified before use: the pulled delta is the pushed one
            assert (tmp / "pulled" / "manifest.json").read_bytes() == (w.deltas[1] / "manifest.json").read_bytes()
            for block in (w.deltas[1] / "blocks").iterdir():
                pulled = tmp / "pulled" / "blocks" / block.name
                assert not pulled.exists() or pulled.read_bytes() == block.read_bytes(), what
        fz.COUNTS["store records: commands run"] += 5


@SETTINGS
@given(which=st.sampled_from(["state.json", "table.json"]), ops=OPS)
def test_mutated_receiver_state(which: str, ops: list[tuple[str, int, int]]) -> None:
    w = fz.world()
    with fz.scratch() as tmp:
        recv = _receiver_at_v1(tmp)
        path = recv / ".dcr" / which
        _, raw, what = fz.mutate_json(json.loads(path.read_text()), ops)
        path.write_bytes(raw)
        what = f"{which}: {what}"
        oracle = fz.Oracle.of("receiver state", recv, w.versions[2])
        oracle.check(fz.run("apply", str(w.deltas[1]), "--into", str(recv), "--workers", "1"), what)
    with fz.scratch() as tmp:
        recv = _receiver_at_v1(tmp)
        (recv / ".dcr" / which).write_bytes(raw)
        before = fz.snapshot(recv)
        r = fz.run("verify", str(recv))
        assert r.exception is None, what
        assert r.code in (0, 1, 2), f"{what}: verify exit {r.code}: {r.stderr}"
        if r.code:
            assert len(r.stderr.splitlines()) == 1 and r.stderr.startswith("dcr: error: "), f"{what}: {r.stderr!r}"
        assert fz.snapshot(recv) == before, what
        fz.COUNTS["receiver state: verify runs"] += 1


def test_deeply_nested_store_record_is_one_line_exit_2() -> None:
    assert _exit_code_on_deep_store_record() == 2


def test_deeply_nested_receiver_state_is_one_line_exit_2() -> None:
    assert _exit_code_on_deep_receiver_state() == 2
