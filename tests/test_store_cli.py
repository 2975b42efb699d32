"""The store commands as cron runs them: subprocesses, --json, exit codes, SIGKILL and resume, racing pushers."""

from __future__ import annotations

import json
import time
from pathlib import Path

from store_fixtures import (
    FAKE_SECRET,
    S3Endpoint,
    big_delta,
    delta_files,
    diff_args,
    json_out,
    make_deltas,
    run_dcr,
    spawn_dcr,
    step,
    write_checkpoint,
)

from dcr_cli.delta.reader import Delta


def _wait_until(predicate, timeout: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError("condition not reached in time")


def _is_block_name(name: str) -> bool:
    return len(name) == 64 and all(c in "0123456789abcdef" for c in name)


def test_kill_during_push_then_resume(s3_endpoint: S3Endpoint, s3_url: str, tmp_path: Path) -> None:
    delta = big_delta(tmp_path)
    blocks = {b.id: b.size for b in Delta.open(delta).manifest.blocks}
    fs = s3_endpoint.filesystem()
    prefix = s3_url.removeprefix("s3://")

    def stored() -> set[str]:
        fs.invalidate_cache()
        try:
            return {p.rsplit("/", 1)[-1] for p in fs.ls(f"{prefix}/blocks")}
        except FileNotFoundError:
            return set()

    proc = spawn_dcr(
        "push", str(delta), s3_url, "--limit-rate", "200K", "--workers", "2", "--json", env=s3_endpoint.env()
    )
    try:
        _wait_until(lambda: len(stored()) >= 4 or proc.poll() is not None)
        proc.kill()
    finally:
        proc.wait()
    assert proc.returncode == -9, "the push finished before it could be killed"
    assert not fs.exists(f"{prefix}/versions/v1.json")  # nothing published by a killed push
    before = stored()
    assert 4 <= len(before) < len(blocks)

    # dcr check sees the leftovers for what they are: unreferenced uploads, not damage.
    report = json_out(run_dcr("check", s3_url, "--json", env=s3_endpoint.env()))
    assert report["ok"] and set(report["unreferenced_blocks"]) == before & set(blocks)

    result = json_out(run_dcr("push", str(delta), s3_url, "--json", env=s3_endpoint.env()))
    assert result["present_blocks"] >= len(before & set(blocks))
    assert result["uploaded_blocks"] + result["present_blocks"] == len(blocks)
    assert result["uploaded_blocks"] < len(blocks) and not result["already_published"]
    assert stored() == set(blocks)

    pulled = json_out(run_dcr("pull", s3_url, "-o", str(tmp_path / "out"), "--repair", "--json", env=s3_endpoint.env()))
    assert pulled["version"] == "v1"
    assert delta_files(tmp_path / "out") == delta_files(delta)


def test_kill_during_pull_then_resume(s3_endpoint: S3Endpoint, s3_url: str, tmp_path: Path) -> None:
    delta = big_delta(tmp_path)
    json_out(run_dcr("push", str(delta), s3_url, "--json", env=s3_endpoint.env()))
    out = tmp_path / "pulled"
    partial_blocks = tmp_path / ".pulled.partial" / "blocks"

    def fetched() -> set[str]:
        try:
            return {p.name for p in partial_blocks.iterdir() if _is_block_name(p.name)}
        except FileNotFoundError:
            return set()

    args = ("pull", s3_url, "-o", str(out), "--repair", "--workers", "2", "--json")
    proc = spawn_dcr(*args, "--limit-rate", "200K", env=s3_endpoint.env())
    try:
        _wait_until(lambda: len(fetched()) >= 4 or proc.poll() is not None)
        proc.kill()
    finally:
        proc.wait()
    assert proc.returncode == -9, "the pull finished before it could be killed"
    assert not out.exists()  # a killed pull leaves no half-valid delta behind
    kept = fetched()

    result = json_out(run_dcr(*args, env=s3_endpoint.env()))
    assert result["reused_blocks"] == len(kept) >= 4
    assert result["downloaded_blocks"] + result["reused_blocks"] == result["blocks"]
    assert delta_files(out) == delta_files(delta)
    assert not (tmp_path / ".pulled.partial").exists()
    again = json_out(run_dcr(*args, env=s3_endpoint.env()))
    assert again["already_present"] and again["downloaded_blocks"] == 0


def test_two_pushers_racing_for_one_version(s3_endpoint: S3Endpoint, s3_url: str, tmp_path: Path) -> None:
    from safetensors.numpy import load_file

    from dcr_cli.produce import diff

    ckpts, (d1,) = make_deltas(tmp_path, 1)
    rival = write_checkpoint(tmp_path / "rival", step(load_file(str(ckpts[0] / "model.safetensors")), 77))
    diff(ckpts[0], rival, tmp_path / "d1-rival", base_version="v0", target_version="v1", workers=1)
    candidates = {str(d1): Delta.open(d1).id, str(tmp_path / "d1-rival"): Delta.open(tmp_path / "d1-rival").id}
    assert len(set(candidates.values())) == 2

    procs = {d: spawn_dcr("push", d, s3_url, "--json", env=s3_endpoint.env()) for d in candidates}
    outcomes = {d: (p.wait(timeout=120), *p.communicate()) for d, p in procs.items()}
    codes = sorted(code for code, _, _ in outcomes.values())
    assert codes == [0, 3], outcomes
    winner = next(d for d, (code, _, _) in outcomes.items() if code == 0)
    loser_err = next(err for code, _, err in outcomes.values() if code == 3)
    assert loser_err.startswith("dcr: error:") and "v1" in loser_err and len(loser_err.strip().splitlines()) == 1

    log = json_out(run_dcr("log", s3_url, "--json", env=s3_endpoint.env()))
    assert [e["version"] for e in log] == ["v1"]
    json_out(run_dcr("pull", s3_url, "-o", str(tmp_path / "got"), "--json", env=s3_endpoint.env()))
    assert Delta.open(tmp_path / "got").id == candidates[winner]


def test_main_job_through_a_local_store(tmp_path: Path) -> None:
    """diff -> push -> pull -> (receiver applies, verifies) -> ack -> commit -> next diff from status."""
    ckpts, _ = make_deltas(tmp_path / "src", 2)
    store = str(tmp_path / "store")

    def dcr(*args: str) -> dict:
        return json_out(run_dcr(*args, "--json"))

    dcr(*diff_args(ckpts[0], ckpts[1], tmp_path / "d1", "v0", "v1"))
    assert dcr("push", str(tmp_path / "d1"), store)["uploaded_blocks"] > 0
    pulled = dcr("pull", store, "-o", str(tmp_path / "r1"))
    assert pulled["version"] == "v1" and Delta.open(tmp_path / "r1").id == Delta.open(tmp_path / "d1").id
    dcr("ack", store, "v1", "--receiver", "east")

    missing = run_dcr("commit", store, "v1", "--receiver", "east", "--receiver", "west")
    assert missing.returncode == 4 and missing.stderr.startswith("dcr: error:") and "west" in missing.stderr
    dcr("ack", store, "v1", "--receiver", "west")
    assert dcr("commit", store, "v1", "--receiver", "east", "--receiver", "west")["acked"] == ["east", "west"]

    status = dcr("status", store)
    assert status["diff_base"]["version"] == "v1"
    assert status["diff_base"]["fingerprint"] == Delta.open(tmp_path / "d1").manifest.target.fingerprint

    # The producer diffs against the committed base; a delta on any other base is refused (exit 2).
    dcr(*diff_args(ckpts[0], ckpts[2], tmp_path / "bad", "v0", "v2"))
    wrong = run_dcr("push", str(tmp_path / "bad"), store)
    assert wrong.returncode == 2 and "dcr status" in wrong.stderr
    dcr(*diff_args(ckpts[1], ckpts[2], tmp_path / "d2", "v1", "v2"))
    dcr("push", str(tmp_path / "d2"), store)
    log = dcr("log", store)
    assert [(e["version"], e["state"]) for e in log] == [("v1", "committed"), ("v2", "pending")]
    assert all(e["payload_bytes"] > 0 and 0 < e["change_rate"] < 1 for e in log)
    chain = dcr("pull", store, "--since", "v0", "-o", str(tmp_path / "catchup"))
    assert [v["version"] for v in chain["versions"]] == ["v1", "v2"]
    assert dcr("check", store, "--read-data-subset", "1", "--seed", "3")["blocks_read"] == 1
    assert dcr("gc", store, "--keep", "1", "--grace", "0")["live_versions"] == ["v1", "v2"]

    human = run_dcr("status", store)
    assert human.returncode == 0 and "diff base: v1" in human.stdout


def test_errors_are_one_line_and_never_show_credentials(s3_endpoint: S3Endpoint, tmp_path: Path) -> None:
    env = s3_endpoint.env()
    missing = run_dcr(
        "pull", "s3://no-such-bucket-dcr/x", "-o", str(tmp_path / "o"), "-S", f"secret={FAKE_SECRET}", env=env
    )
    assert missing.returncode == 2
    assert missing.stderr.startswith("dcr: error:") and len(missing.stderr.strip().splitlines()) == 1
    assert FAKE_SECRET not in missing.stderr + missing.stdout

    bad_option = run_dcr("status", str(tmp_path), "-S", "novalue", env=env)
    assert bad_option.returncode == 2 and "KEY=VALUE" in bad_option.stderr
    not_a_store = run_dcr("status", str(tmp_path), "--json", env=env)
    assert not_a_store.returncode == 2 and "not a dcr store" in not_a_store.stderr
    assert json.loads("[]") == []


def test_push_json_and_lines_say_what_a_re_run_did(tmp_path: Path) -> None:
    """A re-run of dcr push on a published version says so in --json (``status``) as its text line does, and
    no "published" line on stderr: before, the JSON of a no-op re-run had no status beside published_s, and
    both forms printed "published v1 (repair blocks follow)" for a version this run did not publish."""
    _, (d1,) = make_deltas(tmp_path, 1)
    store = str(tmp_path / "store")
    first = run_dcr("push", str(d1), store, "--json")
    assert first.returncode == 0 and json.loads(first.stdout)["status"] == "published", first.stderr
    assert "published v1 (repair blocks follow)" in first.stderr  # its repair blocks followed publication

    again = run_dcr("push", str(d1), store, "--json")
    report = json.loads(again.stdout)
    assert (report["status"], report["already_published"], report["uploaded_blocks"]) == ("already_published", True, 0)
    assert "published" not in again.stderr, again.stderr
    text = run_dcr("push", str(d1), store)
    assert text.stdout.strip() == f"{store}: version v1 was already published with this delta", text.stdout
    assert "published v1" not in text.stderr, text.stderr

    # A block the store lost: the re-run uploads it, and says that it completed the version, not published it.
    repair = next(b for b in Delta.open(d1).manifest.blocks if b.role == "repair")
    (Path(store) / "blocks" / repair.id).unlink()
    filled = run_dcr("push", str(d1), store, "--json")
    report = json.loads(filled.stdout)
    assert (report["status"], report["already_published"], report["uploaded_blocks"]) == ("completed", True, 1)
    assert "published" not in filled.stderr, filled.stderr
    (Path(store) / "blocks" / repair.id).unlink()
    text = run_dcr("push", str(d1), store)
    assert text.stdout.strip().endswith("was already published with this delta; uploaded 1 blocks it lacked")
