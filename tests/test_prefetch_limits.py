"""The block fetcher's spool: descriptors do not grow with the number of blocks, and a full spool disk
is named as such (review findings; dcr_cli/delta/prefetch.py)."""

from __future__ import annotations

import errno
import os
import resource
import tempfile
from pathlib import Path

import fsspec
import pytest
from test_apply_hostile import small_tmpfs

from dcr_cli.delta.prefetch import BlockFetcher
from dcr_cli.delta.source import BlockSource
from dcr_cli.format.digest import digest_bytes
from dcr_cli.format.manifest import BlockEntry


def memory_store(name: str, count: int, size: int) -> tuple[BlockSource, list[BlockEntry]]:
    """``count`` distinct blocks on fsspec's memory filesystem, which dcr treats as remote."""
    fs = fsspec.filesystem("memory")
    blocks = []
    for i in range(count):
        data = i.to_bytes(4, "little") * (size // 4)
        block_id = digest_bytes(data)
        fs.pipe(f"/{name}/blocks/{block_id}", data)
        blocks.append(BlockEntry(block_id, len(data), "data"))
    source = BlockSource(fs, f"/{name}", label=f"memory://{name}")
    assert source.remote
    return source, blocks


def test_thousands_of_spooled_blocks_hold_no_descriptors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    source, blocks = memory_store("many", 600, 16 << 10)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    open_before = len(os.listdir("/proc/self/fd"))
    # A limit well below the block count: one descriptor per spooled block would run out.
    resource.setrlimit(resource.RLIMIT_NOFILE, (open_before + 64, hard))
    try:
        fetcher = BlockFetcher(source, blocks, memory=0)
        fetcher.wait_all()
        assert fetcher.read(blocks[-1].id, 0, 8) == (599).to_bytes(4, "little") * 2
        fetcher.close()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert len(os.listdir("/proc/self/fd")) <= open_before + 1


def test_a_full_spool_disk_names_the_spool_and_tmpdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source, blocks = memory_store("big", 4, 256 << 10)
    with small_tmpfs(tmp_path / "tiny", "256k") as tiny:
        monkeypatch.setattr(tempfile, "tempdir", str(tiny))
        fetcher = BlockFetcher(source, blocks, memory=0)
        with pytest.raises(OSError) as caught:
            fetcher.wait_all()
        fetcher.close()
    assert caught.value.errno == errno.ENOSPC
    assert "downloaded blocks" in str(caught.value) and "TMPDIR" in str(caught.value)


def test_fetchers_share_one_memory_allowance(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # A late joiner checks every delta of a chain before its first write, so their fetchers live
    # together: the blocks they keep in memory must stay within one process-wide allowance.
    import gc

    from dcr_cli.delta import prefetch

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    allowance = prefetch._Allowance(3 * (64 << 10))
    monkeypatch.setattr(prefetch, "_MEMORY", allowance)
    fetchers = []
    for k in range(4):  # four deltas of two 64 KiB blocks: 512 KiB, against an allowance of 192 KiB
        source, blocks = memory_store(f"chain{k}", 2, 64 << 10)
        fetcher = BlockFetcher(source, blocks)
        fetcher.wait_all()
        assert fetcher.read(blocks[1].id, 0, 4) == (1).to_bytes(4, "little")  # spilled or not, the same bytes
        fetchers.append(fetcher)
    in_memory = sum(b.data is not None for f in fetchers for b in f._blocks.values())
    assert in_memory == 3  # the first three blocks fitted; every later one went to a temporary file
    for f in fetchers:
        f.close()
    del f, fetcher, fetchers
    gc.collect()
    assert allowance.take(3 * (64 << 10))  # all of it was given back when the fetchers were collected
