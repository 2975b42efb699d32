"""dcr's store over gs://: gcsfs against a real GCS JSON API endpoint (fake-gcs-server on 127.0.0.1).

The emulator enforces ifGenerationMatch=0, the precondition dcr's create-only writes use: a second
create of an existing object is refused (HTTP 412, which gcsfs raises as FileExistsError), so lost
races and the refused re-creation of the store marker that every push after the first counts on are
the real thing here. The one-winner race runs for every backend in test_store.py.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from store_fixtures import GCSEndpoint, delta_files, make_deltas

from dcr_cli.delta.reader import Delta
from dcr_cli.store import Store, acknowledge, check, commit, gc, log, open_delta, pull, pull_since, push, status


@pytest.fixture(scope="module")
def deltas(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Path], list[Path]]:
    return make_deltas(tmp_path_factory.mktemp("ckpts"), 2)


def test_push_pull_commit_round_trip_over_gs(
    gcs_endpoint: GCSEndpoint, gcs_url: str, deltas: tuple[list[Path], list[Path]], tmp_path: Path
) -> None:
    opts = gcs_endpoint.storage_options
    _, (d1, _) = deltas
    pushed = push(d1, gcs_url, storage_options=opts)
    assert (pushed.version, pushed.base, pushed.already_published) == ("v1", "v0", False)
    assert pushed.uploaded_blocks == pushed.blocks > 0
    again = push(d1, gcs_url, storage_options=opts)
    assert again.already_published and again.uploaded_blocks == 0

    pulled = pull(gcs_url, tmp_path / "p1", storage_options=opts, repair=True)
    assert pulled.version == "v1" and pulled.downloaded_blocks == pulled.blocks
    assert delta_files(tmp_path / "p1") == delta_files(d1)  # byte-identical: manifest and every block

    # Read in place (ranged reads of the stored blocks), every section checked against its digest.
    source, remote = Delta.open(d1), open_delta(gcs_url, "v1", storage_options=opts)
    assert remote.id == source.id
    for item in source.manifest.items:
        assert remote.decode(item).values.tobytes() == source.decode(item).values.tobytes()

    acknowledge(gcs_url, "v1", "rollout-a", storage_options=opts)
    assert commit(gcs_url, "v1", receivers=["rollout-a"], storage_options=opts).acked == ["rollout-a"]
    state = status(gcs_url, storage_options=opts)
    assert state["head"]["version"] == "v1" and state["pending"] == [] and not state["latest_hint_stale"]
    assert [(e.version, e.state) for e in log(gcs_url, storage_options=opts)] == [("v1", "committed")]
    (caught_up,) = pull_since(gcs_url, "v0", tmp_path / "chain", storage_options=opts)
    assert caught_up.version == "v1" and Delta.open(caught_up.path).id == source.id

    report = check(gcs_url, read_data=True, storage_options=opts)
    assert report.ok and report.versions == report.committed == 1
    assert report.blocks_read == len({b.id for b in source.manifest.blocks})


def test_gc_ages_objects_by_the_times_gcs_reports(
    gcs_endpoint: GCSEndpoint, gcs_url: str, deltas: tuple[list[Path], list[Path]], tmp_path: Path
) -> None:
    """gc's grace period reads object times from the listing and from fs.info: both must parse on GCS.

    An unreadable time would make every unreferenced object look young forever (gc never removes what has no
    time), so removal after a short grace is what shows the times were read.
    """
    opts = gcs_endpoint.storage_options
    _, (d1, _) = deltas
    push(d1, gcs_url, storage_options=opts)
    acknowledge(gcs_url, "v1", "r", storage_options=opts)
    commit(gcs_url, "v1", receivers=["r"], storage_options=opts)
    store = Store(gcs_url, opts)
    orphan = "0" * 64
    store.put(f"blocks/{orphan}", b"left by a killed push")
    listed = {e.name: e for e in store.list("blocks")}
    assert listed[orphan].mtime is not None and abs(listed[orphan].mtime - time.time()) < 60
    assert store.modified(f"blocks/{orphan}") == listed[orphan].mtime

    young = gc(gcs_url, keep=1, grace_s=600, storage_options=opts)
    assert young.live_versions == ["v1"] and young.removed_blocks == 0 and young.young_unreferenced == 1

    grace_s = 0.5
    time.sleep(grace_s + 0.2)
    aged = gc(gcs_url, keep=1, grace_s=grace_s, storage_options=opts)
    assert aged.removed_blocks == 1 and aged.young_unreferenced == 0
    assert not store.exists(f"blocks/{orphan}")
    assert aged.kept_blocks == len({b.id for b in Delta.open(d1).manifest.blocks})
    assert pull(gcs_url, tmp_path / "p1", storage_options=opts, repair=True).version == "v1"
    assert delta_files(tmp_path / "p1") == delta_files(d1)
    assert check(gcs_url, read_data=True, storage_options=opts).ok


def test_create_is_refused_on_an_existing_object_and_put_overwrites(gcs_endpoint: GCSEndpoint, gcs_url: str) -> None:
    store = Store(gcs_url, gcs_endpoint.storage_options)
    assert store.publish_method == "if-generation-match"  # gcsfs pipe_file(mode="create"): ifGenerationMatch=0
    store.create("versions/taken.json", b"first")
    with pytest.raises(FileExistsError):
        store.create("versions/taken.json", b"second")
    assert store.read("versions/taken.json") == b"first"
    store.put("latest.json", b"old hint")
    store.put("latest.json", b"new hint")  # plain writes replace (the latest.json hint, blocks)
    assert store.read("latest.json") == b"new hint"


def test_a_chain_of_two_versions_over_gs(
    gcs_endpoint: GCSEndpoint, gcs_url: str, deltas: tuple[list[Path], list[Path]], tmp_path: Path
) -> None:
    """Every push creates the store marker create-only, counting on the refusal once the store exists.

    Where that create is not refused, the second push replaces the genesis (v0) with its own base (v1), and the
    committed chain from v0 is lost: the store depends on the precondition beyond racing writers.
    """
    opts = gcs_endpoint.storage_options
    _, (d1, d2) = deltas
    for delta, version in ((d1, "v1"), (d2, "v2")):
        push(delta, gcs_url, storage_options=opts)
        assert Store(gcs_url, opts).genesis().version == "v0", f"pushing {version} replaced the store's genesis"
        acknowledge(gcs_url, version, "r", storage_options=opts)
        commit(gcs_url, version, receivers=["r"], storage_options=opts)
    chain = pull_since(gcs_url, "v0", tmp_path / "chain", storage_options=opts)
    assert [Delta.open(r.path).id for r in chain] == [Delta.open(d).id for d in (d1, d2)]
    assert check(gcs_url, read_data=True, storage_options=opts).ok
