"""dcr verify: every tensor is re-digested and compared; mismatches are named; exit codes 0/1/2."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from helpers_checkpoints import copy_checkpoint, mutate, random_tensors, record_digests, write_checkpoint
from manifest_text import manifest_v1

import dcr_cli
from dcr_cli.checkpoints.safetensors_dir import SafetensorsCheckpoint
from dcr_cli.cli import main
from dcr_cli.errors import IncompatibleError
from dcr_cli.format.digest import digest_bytes
from dcr_cli.produce import diff


def run_cli(*args: object) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.stdout, result.stderr


SPECS = [("a", "BF16", (30, 20)), ("b", "F32", (17,)), ("c", "U8", ()), ("unchanged", "I32", (9,))]


@pytest.fixture
def applied(tmp_path: Path) -> tuple[Path, Path]:
    """(receiver brought to v1 by dcr apply, delta v0 -> v1)."""
    rng = np.random.default_rng(5)
    t0 = random_tensors(
        rng, [("a", "BF16", (30, 20)), ("b", "F32", (17,)), ("c", "U8", ()), ("unchanged", "I32", (9,))]
    )
    t1 = mutate(rng, t0, 0.2, names=["a", "b", "c"])
    write_checkpoint(tmp_path / "v0", t0, shards=2)
    write_checkpoint(tmp_path / "v1", t1, shards=2)
    diff(tmp_path / "v0", tmp_path / "v1", tmp_path / "delta", base_version="v0", target_version="v1")
    recv = copy_checkpoint(tmp_path / "v0", tmp_path / "recv")
    dcr_cli.apply(tmp_path / "delta", into=recv)
    return recv, tmp_path / "delta"


def flip_bit(root: Path, tensor: str, element: int = 0) -> None:
    """Flip the lowest bit of one stored element, in place."""
    with SafetensorsCheckpoint(root) as ckpt:
        loc = ckpt.tensors[tensor]
    with open(loc.file, "r+b") as f:
        f.seek(loc.start + element * (loc.nbytes // max(1, loc.numel)))
        byte = f.read(1)[0]
        f.seek(-1, 1)
        f.write(bytes([byte ^ 1]))


def test_ok_against_delta_and_against_recorded_state(applied: tuple[Path, Path]) -> None:
    recv, delta = applied
    code, out, _ = run_cli("verify", recv, "--against", delta)
    assert code == 0 and "ok, 4 tensors match version v1" in out
    code, out, _ = run_cli("verify", recv)  # no delta: the table recorded by the last apply
    assert code == 0 and "v1" in out


@pytest.mark.parametrize("against_delta", [True, False])
def test_mismatch_names_the_tensor_even_if_unchanged_by_the_delta(
    applied: tuple[Path, Path], against_delta: bool
) -> None:
    recv, delta = applied
    flip_bit(recv, "unchanged", 3)  # a tensor no item touches: still checked
    args = ["verify", recv, "--json"] + (["--against", delta] if against_delta else [])
    code, out, _ = run_cli(*args)
    assert code == 1
    report = json.loads(out)
    assert report["ok"] is False and report["mismatched"] == ["unchanged"] and report["bad"] == ["unchanged"]
    code, out, err = run_cli(*args[:-1] if not against_delta else ["verify", recv, "--against", delta])
    assert code == 1 and err.startswith("dcr: error: ") and "unchanged" in err


def test_json_report_fields(applied: tuple[Path, Path]) -> None:
    recv, delta = applied
    code, out, _ = run_cli("verify", recv, "--against", delta, "--json")
    report = json.loads(out)
    assert code == 0 and report["ok"] is True
    assert report["expected_fingerprint"] == report["computed_fingerprint"]
    assert report["tensors"] == 4 and report["bytes"] == 30 * 20 * 2 + 17 * 4 + 1 + 9 * 4
    assert report["mismatched"] == report["missing"] == report["unexpected"] == report["layout"] == []


def test_missing_and_unexpected_tensors_are_named(applied: tuple[Path, Path], tmp_path: Path) -> None:
    _, delta = applied
    rng = np.random.default_rng(1)
    other = write_checkpoint(tmp_path / "other", random_tensors(rng, [("a", "BF16", (30, 20)), ("zzz", "U8", (2,))]))
    report = dcr_cli.verify(other, against=delta)
    assert not report.ok
    assert report.missing == ["b", "c", "unchanged"] and report.unexpected == ["zzz"] and report.mismatched == ["a"]


def test_shape_difference_is_named(applied: tuple[Path, Path], tmp_path: Path) -> None:
    _, delta = applied
    rng = np.random.default_rng(1)
    other = write_checkpoint(
        tmp_path / "other",
        random_tensors(
            rng, [("a", "BF16", (20, 30)), ("b", "F32", (17,)), ("c", "U8", ()), ("unchanged", "I32", (9,))]
        ),
    )
    assert "a" in dcr_cli.verify(other, against=delta).layout


def test_without_state_or_delta_is_bad_input(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    plain = write_checkpoint(tmp_path / "plain", random_tensors(rng, [("a", "U8", (3,))]))
    code, _, err = run_cli("verify", plain)
    assert code == 2 and "--against" in err
    with pytest.raises(IncompatibleError):
        dcr_cli.verify(plain)


def test_verify_after_apply_flag(tmp_path: Path) -> None:
    rng = np.random.default_rng(9)
    t0 = random_tensors(rng, [("w", "F16", (100,))])
    write_checkpoint(tmp_path / "v0", t0)
    write_checkpoint(tmp_path / "v1", mutate(rng, t0, 0.1))
    diff(tmp_path / "v0", tmp_path / "v1", tmp_path / "d")
    recv = copy_checkpoint(tmp_path / "v0", tmp_path / "recv")
    code, out, err = run_cli("apply", tmp_path / "d", "--into", recv, "--verify")
    assert code == 0, err
    assert "ok, 1 tensors match" in out


def test_against_a_delta_whose_table_was_tampered_is_refused(applied: tuple[Path, Path]) -> None:
    """A table edited to match a wrong checkpoint must not make verify say ok: it is tied to the fingerprint."""
    recv, delta = applied
    flip_bit(recv, "a")
    with SafetensorsCheckpoint(recv) as ckpt:
        wrong = digest_bytes(ckpt.view("a"))
    manifest = manifest_v1(delta)
    manifest["tensors"]["a"]["digest"] = wrong
    (delta / "manifest.json").write_text(json.dumps(manifest))
    code, _, err = run_cli("verify", recv, "--against", delta)
    assert code == 2 and "fingerprint" in err


def test_missing_checkpoint_directory_is_named_as_such(tmp_path: Path) -> None:
    code, _, err = run_cli("verify", tmp_path / "nope")
    assert code == 2 and "is not a checkpoint directory" in err


@pytest.mark.parametrize("table", ['{"tensors": []}', "[1]", '{"tensors": {"a": 5}}', "{trunc"])
def test_damaged_recorded_table_is_a_clear_error(applied: tuple[Path, Path], table: str) -> None:
    recv, _ = applied
    (recv / ".dcr" / "table.json").write_text(table)
    code, _, err = run_cli("verify", recv)
    assert code == 2 and "no tensor table" in err


def _two_versions(tmp_path: Path) -> tuple[Path, Path]:
    """(receiver at v0, delta v0 -> v1 that touches "a" and "b" and leaves "c" and "unchanged")."""
    rng = np.random.default_rng(11)
    t0 = random_tensors(rng, SPECS)
    write_checkpoint(tmp_path / "v0", t0, shards=2)
    write_checkpoint(tmp_path / "v1", mutate(rng, t0, 0.2, names=["a", "b"]), shards=2)
    diff(tmp_path / "v0", tmp_path / "v1", tmp_path / "d", base_version="v0", target_version="v1")
    return copy_checkpoint(tmp_path / "v0", tmp_path / "recv"), tmp_path / "d"


def test_apply_verify_digests_each_tensor_once_after_the_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--verify reuses the proof's read-back digests of the touched tensors and reads only the others."""
    recv, delta = _two_versions(tmp_path)
    digested: list[str] = []
    record_digests(monkeypatch, digested.append)
    dcr_cli.apply(delta, into=recv)  # records the state (the base table is known from here on)
    # Back to v0 by a reverse delta, then forward again with --verify: the base table is known.
    diff(tmp_path / "v1", tmp_path / "v0", tmp_path / "back", base_version="v1", target_version="v0")
    dcr_cli.apply(tmp_path / "back", into=recv)
    digested.clear()
    result = dcr_cli.apply(delta, into=recv, verify=True)
    assert sorted(digested) == ["a", "b", "c", "unchanged"]  # each once: a, b by the proof, c, unchanged by verify
    assert result.verified is not None and result.verified["ok"] is True
    assert result.verified["read_back"] == 2 and result.verified["tensors"] == 4
    separate = dcr_cli.verify(recv, against=delta)  # the same report as dcr verify, but for the reuse count
    assert {**separate.to_json(), "seconds": 0, "read_back": 2} == {**result.verified, "seconds": 0}


def test_apply_verify_still_reads_what_the_proof_did_not(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tensor the apply did not touch, damaged after its proof, is found by --verify (it reads it)."""
    from dcr_cli.receive.checkpoint import applier

    recv, delta = _two_versions(tmp_path)
    real = applier._Proof.finish

    def finish_then_damage(self: applier._Proof, workers: int) -> dict[str, str]:
        out = real(self, workers)
        flip_bit(recv, "unchanged", 2)
        return out

    monkeypatch.setattr(applier._Proof, "finish", finish_then_damage)
    code, out, err = run_cli("apply", delta, "--into", recv, "--verify")
    assert code == 1 and "MISMATCH" in err and "unchanged" in err, (out, err)
