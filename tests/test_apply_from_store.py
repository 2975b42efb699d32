"""`dcr apply` straight from a store URL (real S3 endpoint), acknowledging what it applied."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
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
    proc = run_dcr(
        *diff_args(ckpts[0], ckpts[1], tmp_path / "d1", "v0", "v1"),
        "--push",
        s3_url,
        "--json",
        env=env,
    )
    out = json_out(proc)
    from dcr_cli.delta.reader import Delta
    from dcr_cli.store.transfer import split_roles

    data_blocks, repair_blocks = split_roles(Delta.open(tmp_path / "d1").manifest)
    assert data_blocks and repair_blocks
    # Every data block went up while the diff ran; the push afterwards found them all in place, published,
    # and only then uploaded the repair blocks (store-v1 §4.1), saying so on stderr the moment it published.
    assert out["push"]["present_blocks"] == len(data_blocks) > 0
    assert out["push"]["uploaded_blocks"] == out["push"]["repair_uploaded_blocks"] == len(repair_blocks)
    assert out["push"]["repair_blocks"] == len(repair_blocks) and not out["push"]["repair_pending"]
    assert f"{s3_url}: published v1 (repair blocks follow)" in proc.stderr.splitlines()
    assert [e["version"] for e in json_out(run_dcr("log", s3_url, "--json", env=env))] == ["v1"]
    pulled = json_out(run_dcr("pull", s3_url, "-o", str(tmp_path / "got"), "--json", env=env))
    assert pulled["version"] == "v1"
    receiver = tmp_path / "receiver"
    shutil.copytree(ckpts[0], receiver)
    json_out(run_dcr("apply", str(tmp_path / "got"), "--into", str(receiver), "--json", env=env))
    assert read_bits(receiver) == read_bits(ckpts[1])


def test_apply_from_s3_fetches_each_data_block_once_and_no_repair_block(
    s3_endpoint: S3Endpoint, s3_url: str, tmp_path: Path
) -> None:
    """delta-v1 §7.3: a normal apply never fetches repair blocks; data blocks were read twice before (3.25x)."""
    from store_fixtures import CountingProxy, big_delta

    from dcr_cli.delta.reader import Delta
    from dcr_cli.store import Store, push

    delta = big_delta(tmp_path, sparse=True)  # many small data and repair blocks
    push(delta, s3_url, storage_options=s3_endpoint.storage_options)
    manifest = Delta.open(delta).manifest
    data = {b.id: b.size for b in manifest.blocks if b.role == "data"}
    repair = {b.id: b.size for b in manifest.blocks if b.role == "repair"}
    assert len(data) > 4 and len(repair) > 4
    receiver = tmp_path / "receiver"
    shutil.copytree(tmp_path / "big-c0", receiver)
    record = Store(s3_url, s3_endpoint.storage_options).require_version("v1")

    proxy = CountingProxy(s3_endpoint.url)
    try:
        env = {**s3_endpoint.env(), "FSSPEC_S3_ENDPOINT_URL": proxy.url}
        out = json_out(run_dcr("apply", s3_url, "--version", "v1", "--into", str(receiver), "--json", env=env))
    finally:
        proxy.close()
    assert out["version"] == "v1" and read_bits(receiver) == read_bits(tmp_path / "big-c1")
    for block_id, size in data.items():
        assert proxy.requests_for(f"/blocks/{block_id}") == 1, block_id  # one ranged GET, no HEAD
        assert size <= proxy.bytes_for(f"/blocks/{block_id}") < size + 2048  # its bytes, once (plus headers)
    for block_id in repair:
        assert proxy.requests_for(f"/blocks/{block_id}") == 0, block_id
    payload = sum(data.values()) + record.manifest_bytes
    requests = sum(proxy.requests.values())
    assert proxy.total_bytes() < payload + 2048 * requests  # records and headers only, besides the payload
    print(
        f"apply from s3: {proxy.total_bytes()} bytes in {requests} requests for a {payload} byte payload "
        f"(data {sum(data.values())} + manifest; repair {sum(repair.values())} not fetched): "
        f"{proxy.total_bytes() / payload:.2f}x"
    )


def test_apply_from_a_local_store_reads_no_repair_block(tmp_path: Path) -> None:
    """delta-v1 §7.3 holds for a store on a local path too (a shared mount is a transfer): an apply reads
    none of its repair blocks, so one that is damaged there does not stop it; a delta directory's are
    checked whole before the first write, as before."""
    from store_fixtures import big_delta

    from dcr_cli.delta.reader import Delta
    from dcr_cli.store import push

    delta = big_delta(tmp_path, sparse=True)
    url = str(tmp_path / "store")
    push(delta, url)
    repair = sorted({b.id for b in Delta.open(delta).manifest.blocks if b.role == "repair"})
    assert repair
    for block_id in repair:  # damaged in the store: only a torn item would ever read them
        stored = tmp_path / "store" / "blocks" / block_id
        raw = bytearray(stored.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        stored.chmod(0o644)
        stored.write_bytes(bytes(raw))
    receiver = tmp_path / "receiver"
    shutil.copytree(tmp_path / "big-c0", receiver)
    out = json_out(run_dcr("apply", url, "--version", "v1", "--into", str(receiver), "--verify", "--json"))
    assert out["version"] == "v1" and out["verified"]["ok"] and read_bits(receiver) == read_bits(tmp_path / "big-c1")

    local = tmp_path / "local-delta"
    shutil.copytree(delta, local)
    for block_id in repair:
        shutil.copy(tmp_path / "store" / "blocks" / block_id, local / "blocks" / block_id)
    again = tmp_path / "receiver-2"
    shutil.copytree(tmp_path / "big-c0", again)
    refused = run_dcr("apply", str(local), "--into", str(again))
    assert refused.returncode != 0 and "repair block" in refused.stderr and "corrupt" in refused.stderr
    assert read_bits(again) == read_bits(tmp_path / "big-c0")


def test_a_repair_section_is_fetched_only_when_read(s3_endpoint: S3Endpoint, s3_url: str, tmp_path: Path) -> None:
    from store_fixtures import CountingProxy, big_delta

    from dcr_cli.store import open_delta, push

    delta = big_delta(tmp_path, sparse=True)
    push(delta, s3_url, storage_options=s3_endpoint.storage_options)
    proxy = CountingProxy(s3_endpoint.url)
    try:
        remote = open_delta(s3_url, "v1", storage_options={**s3_endpoint.storage_options, "endpoint_url": proxy.url})
        remote.verify_blocks(("data",))
        remote.check_repair_blocks()
        fetched = proxy.total_bytes()
        for item in remote.manifest.items:
            remote.decode(item)  # served from the blocks verify_blocks kept
        assert proxy.total_bytes() == fetched
        item = remote.manifest.items[3]
        assert item.repair is not None
        repair_block = remote.manifest.blocks[item.repair.block]
        assert proxy.requests_for(f"/blocks/{repair_block.id}") == 0
        assert remote.has_block(repair_block)
        remote.repair_values(item)
        got = proxy.bytes_for(f"/blocks/{repair_block.id}")
        assert item.repair.length <= got < item.repair.length + 2048  # the section, not the block
    finally:
        proxy.close()


def test_a_store_delta_reopens_from_its_location(s3_endpoint: S3Endpoint, s3_url: str, tmp_path: Path) -> None:
    """Delta.url is a location (what a vLLM worker opens), the label is for people."""
    from store_fixtures import make_deltas

    from dcr_cli.delta.reader import Delta
    from dcr_cli.errors import FormatError, IntegrityError
    from dcr_cli.store import open_delta, push

    _, (d1,) = make_deltas(tmp_path, 1)
    local = str(tmp_path / "store")
    opts = s3_endpoint.storage_options
    for url, options in ((local, {}), (s3_url, opts)):
        push(d1, url, storage_options=options)
        stored = open_delta(url, "v1", storage_options=options)
        assert stored.label == f"{url} (version v1)" and stored.url != stored.label
        again = Delta.open(stored.url, storage_options=options)
        assert again.id == stored.id == Delta.open(d1).id
        for item in again.manifest.items:
            assert again.decode(item).values.tobytes() == stored.decode(item).values.tobytes()
    # The name is the manifest's digest: a location naming other bytes is refused.
    manifests = tmp_path / "store" / "manifests"
    (name,) = [p.name for p in manifests.iterdir()]
    (manifests / ("0" * 64 + ".json")).write_bytes((manifests / name).read_bytes())
    with pytest.raises(IntegrityError, match="digest"):
        Delta.open(manifests / ("0" * 64 + ".json"))
    with pytest.raises(FormatError, match="not a dcr delta"):
        Delta.open(manifests / ("1" * 64 + ".json"))


def test_vllm_applies_a_delta_opened_from_a_store(tmp_path: Path) -> None:
    """dcr_cli.apply_to_llm(llm, dcr_cli.open_delta(store, "v1")) failed with "... is not a dcr delta"."""
    from conftest import require_or_skip

    require_or_skip("vllm")
    from vllm_support import (
        differing,
        engine_env,
        ensure_plugin_entry_point,
        fresh_engine,
        resident_bits,
        start_llm,
        train_run,
    )

    import dcr_cli

    engine_env()
    ensure_plugin_entry_point()
    paths = train_run(tmp_path / "run", "qwen3", tie=False, steps=1)
    store = str(tmp_path / "store")
    dcr_cli.push(paths[0].parent / "d1", store)
    llm = start_llm(paths[0])
    dcr_cli.apply_to_llm(llm, dcr_cli.open_delta(store, "step-1"))
    fresh = fresh_engine(paths[1])
    assert differing(resident_bits(llm), fresh.bits) == []
    dcr_cli.verify_llm(llm, dcr_cli.open_delta(store, "step-1"))
