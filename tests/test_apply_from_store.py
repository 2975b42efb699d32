"""`dcr apply` straight from a store URL (real S3 endpoint), acknowledging what it applied."""

from __future__ import annotations

import shutil
from pathlib import Path

from checkpoints import read_bits
from store_fixtures import S3Endpoint, diff_args, json_out, make_deltas, run_dcr


def test_apply_from_s3_store_with_ack_then_commit(s3_endpoint: S3Endpoint, s3_url: str, tmp_path: Path) -> None:
    env = s3_endpoint.env()
    ckpts, deltas = make_deltas(tmp_path / "src", 2)
    receiver = tmp_path / "receiver"
    shutil.copytree(ckpts[0], receiver)
    json_out(run_dcr("push", str(deltas[0]), s3_url, "--json", env=env))

    # Only the rollout node's own name is accepted with --ack, and both go together.
    lone = run_dcr("apply", s3_url, "--into", str(receiver), "--ack", s3_url, env=env)
    assert lone.returncode == 2 and "--receiver" in lone.stderr
    assert read_bits(receiver) == read_bits(ckpts[0])

    out = json_out(
        run_dcr(
            "apply",
            s3_url,
            "--version",
            "v1",
            "--into",
            str(receiver),
            "--ack",
            s3_url,
            "--receiver",
            "east",
            "--json",
            env=env,
        )
    )
    assert out["version"] == "v1"
    assert read_bits(receiver) == read_bits(ckpts[1])
    committed = json_out(run_dcr("commit", s3_url, "v1", "--receiver", "east", "--json", env=env))
    assert committed["acked"] == ["east"]

    # A second version, applied from the store's newest without naming it.
    json_out(run_dcr("push", str(deltas[1]), s3_url, "--json", env=env))
    json_out(run_dcr("apply", s3_url, "--into", str(receiver), "--json", env=env))
    assert read_bits(receiver) == read_bits(ckpts[2])


def test_diff_push_overlaps_upload_and_publishes(s3_endpoint: S3Endpoint, s3_url: str, tmp_path: Path) -> None:
    env = s3_endpoint.env()
    ckpts, _ = make_deltas(tmp_path / "src", 1)
    out = json_out(
        run_dcr(
            *diff_args(ckpts[0], ckpts[1], tmp_path / "d1", "v0", "v1"),
            "--push",
            s3_url,
            "--json",
            env=env,
        )
    )
    # Every block went up while the diff ran; the push afterwards found them all in place.
    assert out["push"]["uploaded_blocks"] == 0 and out["push"]["present_blocks"] > 0
    assert [e["version"] for e in json_out(run_dcr("log", s3_url, "--json", env=env))] == ["v1"]
    pulled = json_out(run_dcr("pull", s3_url, "-o", str(tmp_path / "got"), "--json", env=env))
    assert pulled["version"] == "v1"
    receiver = tmp_path / "receiver"
    shutil.copytree(ckpts[0], receiver)
    json_out(run_dcr("apply", str(tmp_path / "got"), "--into", str(receiver), "--json", env=env))
    assert read_bits(receiver) == read_bits(ckpts[1])
