"""receive/vllm/node_copy.py: the data blocks a waiting client fetched early, offered to the engine.

A client that waits for a version (``apply STORE --version V --wait S --vllm URL``) fetches the blocks
its push announces while it runs, and offers the engine its spool directory; an engine on the same
node hard-links the intact ones from there and checks them: on one rank it reads them in place while
the rest download (``adopt_early_blocks``); on several its node copy takes them
(``download_data_blocks``) and downloads only the rest. Without an engine (tests/test_vllm_from_store.py
runs the whole path in a live vLLM server): a real S3 endpoint (moto) behind a proxy that counts
requests, and a delta of many small blocks.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from store_fixtures import CountingProxy, S3Endpoint, big_delta, decodes_as, published_remotely, removed_after

from dcr_cli.delta.prefetch import BlockFetcher
from dcr_cli.delta.reader import Delta
from dcr_cli.format.manifest import BlockEntry
from dcr_cli.receive.vllm import node_copy


@pytest.fixture
def remote(
    tmp_path: Path, s3_endpoint: S3Endpoint, s3_url: str
) -> Iterator[tuple[Path, Callable[[], Delta], CountingProxy]]:
    """A delta of 16 data blocks published on an S3 store; a function opening it by its store location
    through a counting proxy."""
    local = big_delta(tmp_path, sparse=True)
    with published_remotely(local, s3_endpoint, s3_url) as (open_remote, proxy):
        yield local, open_remote, proxy


def _offer(local: Path, early: Path) -> tuple[list[BlockEntry], dict[str, int]]:
    """An early directory as a client leaves it, with some of its hazards: an intact block, a damaged
    one of the right size, a truncated one, a link to an intact one (not a regular file), and the
    rest absent. Returns the data blocks and the store GETs each should cost the engine."""
    blocks = [b for b in Delta.open(local).manifest.blocks if b.role == "data"]
    intact, damaged, truncated, linked = blocks[:4]
    (early / "blocks").mkdir(parents=True)
    shutil.copy(local / intact.path, early / intact.path)
    raw = bytearray((local / damaged.path).read_bytes())
    raw[len(raw) // 2] ^= 1
    (early / damaged.path).write_bytes(bytes(raw))
    (early / truncated.path).write_bytes((local / truncated.path).read_bytes()[:-1])
    shutil.copy(local / linked.path, early / "elsewhere")
    os.symlink(early / "elsewhere", early / linked.path)
    return blocks, {b.id: (0 if b is intact else 1) for b in blocks}


# (the delta's directory, the opener, the proxy, the offer, the data blocks, the GETs each should cost)
Offered = tuple[Path, Callable[[], Delta], CountingProxy, Path, list[BlockEntry], dict[str, int]]


@pytest.fixture
def offered(remote: tuple[Path, Callable[[], Delta], CountingProxy], tmp_path: Path) -> Offered:
    """The remote delta with an offer beside it (``_offer``): (its directory, the opener, the proxy, the
    offer, the data blocks, the GETs each should cost)."""
    local, open_remote, proxy = remote
    early = tmp_path / "early"
    blocks, gets = _offer(local, early)
    return local, open_remote, proxy, early, blocks, gets


def test_one_rank_reads_the_intact_offered_blocks_in_place_and_fetches_the_rest(
    offered: Offered, tmp_path: Path
) -> None:
    local, open_remote, proxy, early, blocks, gets = offered
    delta = open_remote()
    directory, taken = node_copy.adopt_early_blocks(delta, str(early))
    assert taken == 1
    with removed_after(directory) as taken_dir:
        # Linked, not copied: the engine's directory holds the client's file itself, and nothing else.
        assert os.path.samefile(taken_dir / blocks[0].path, early / blocks[0].path)
        assert sorted(os.listdir(taken_dir / "blocks")) == [blocks[0].id]
        delta.prefetch_blocks()  # the rest download in the background, as without an offer
        delta.verify_blocks()
        decodes_as(delta, local)
        assert {b.id: proxy.gets_for(b.id) for b in blocks} == gets
    assert node_copy.adopt_early_blocks(open_remote(), str(tmp_path / "nothing-here")) == (None, 0)


@pytest.mark.parametrize("offer", [None, "", "relative/early", "/nonexistent/dcr-early"])
def test_no_usable_offer_takes_nothing(
    remote: tuple[Path, Callable[[], Delta], CountingProxy], offer: str | None, tmp_path: Path, monkeypatch
) -> None:
    local, open_remote, proxy = remote
    blocks, _ = _offer(local, tmp_path / "relative" / "early")
    monkeypatch.chdir(tmp_path)  # a relative path is refused even where it would resolve
    delta = open_remote()
    assert node_copy.early_blocks(delta, offer) == []
    with removed_after(node_copy.download_data_blocks(delta, offer)) as copy:
        assert node_copy.taken_early(str(copy), offer) == 0
        assert all(proxy.gets_for(b.id) == 1 for b in blocks)


def test_the_copy_links_the_intact_offered_blocks_and_downloads_the_rest(offered: Offered) -> None:
    local, open_remote, proxy, early, blocks, gets = offered
    right_size_and_regular = [b.id for b in blocks[:2]]
    assert [b.id for b in node_copy.early_blocks(open_remote(), str(early))] == right_size_and_regular
    with removed_after(node_copy.download_data_blocks(open_remote(), str(early))) as copy:
        assert {b.id: proxy.gets_for(b.id) for b in blocks} == gets
        for b in blocks:  # the copy holds every data block, intact, as regular files
            assert (copy / b.path).read_bytes() == (local / b.path).read_bytes()
            assert not (copy / b.path).is_symlink()
        # The intact offer is linked, not copied (no space taken); the others are the copy's own files.
        assert os.path.samefile(copy / blocks[0].path, early / blocks[0].path)
        assert not any(os.path.samefile(copy / b.path, early / b.path) for b in blocks[1:3])
        assert node_copy.taken_early(str(copy), str(early)) == 1
        assert sorted(os.listdir(copy)) == [".lock", "blocks"]  # no part file left behind
        decodes_as(node_copy.read_through_copy(open_remote(), str(copy)), local)
    assert (early / blocks[1].path).exists()  # the offer is the client's: left as it was


def test_the_engine_reads_the_offered_manifest_instead_of_the_store(
    remote: tuple[Path, Callable[[], Delta], CountingProxy], tmp_path: Path
) -> None:
    """The client leaves the manifest's bytes in its spool beside the blocks (``Delta.early_blocks``); each
    rank that opens the delta with that offer reads them there, checked against the digest its
    location names, instead of asking the store. A damaged, truncated or linked copy, a FIFO, or an
    offer that is no absolute directory (or no path at all), costs the usual GET, never a failure."""
    local, open_remote, proxy = remote
    client = open_remote()
    manifest = f"/manifests/{client.id}.json"
    assert proxy.gets_for(manifest) == 1 and not client.manifest_offered
    # What the client offers: its spool, with the blocks that arrived early and the manifest.
    spool = tmp_path / "spool"
    spool.mkdir()
    fetched = [b for b in client.manifest.blocks if b.role == "data"][:2]
    fetcher = BlockFetcher(client.source, fetched, spool=spool)
    deadline = time.monotonic() + 60
    while not fetcher.settled and time.monotonic() < deadline:
        time.sleep(0.01)
    assert fetcher.complete
    client.adopt_fetcher(fetcher)
    offer = client.early_blocks()
    assert offer == str(spool)
    copy = spool / "manifests" / f"{client.id}.json"
    assert copy.read_bytes() == (local / "manifest.json").read_bytes()

    engine = open_remote(offered=offer)
    assert engine.manifest_offered and engine.id == client.id and proxy.gets_for(manifest) == 1  # no GET
    assert engine.manifest.items == client.manifest.items

    good = copy.read_bytes()
    for spoil in ("damaged", "truncated", "linked", "fifo"):
        copy.unlink()
        if spoil == "damaged":
            copy.write_bytes(good[:100] + bytes([good[100] ^ 1]) + good[101:])
        elif spoil == "truncated":
            copy.write_bytes(good[:-1])
        elif spoil == "linked":
            (spool / "elsewhere.json").write_bytes(good)
            os.symlink(spool / "elsewhere.json", copy)
        else:
            os.mkfifo(copy)  # never opened: it would block
        before = proxy.gets_for(manifest)
        again = open_remote(offered=offer)
        assert not again.manifest_offered and again.id == client.id, spoil
        assert proxy.gets_for(manifest) == before + 1, spoil
    for unusable in (None, "", "spool", str(tmp_path / "nowhere"), "/x\x00y", "/\ud800"):
        before = proxy.gets_for(manifest)
        assert not open_remote(offered=unusable).manifest_offered
        assert proxy.gets_for(manifest) == before + 1
