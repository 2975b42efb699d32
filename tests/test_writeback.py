"""An in-place apply starts its files' writeback as it goes (io.files.start_writeback), so that its final
fsync does not write every dirty page at once while the cores wait (issue 12 §3, the on-disk receiver)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest
from store_fixtures import step, write_checkpoint

from dcr_cli.io import files as io_files
from dcr_cli.receive.checkpoint import inplace


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sync_file_range is Linux's")
def test_start_writeback_calls_the_kernel(tmp_path: Path) -> None:
    call = io_files._writeback_call()
    assert call is not None
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT)
    try:
        os.write(fd, b"x" * (1 << 20))
        assert call(fd) == 0  # accepted for a file written to
        io_files.start_writeback(fd)
    finally:
        os.close(fd)
    assert call(fd) == -1  # a closed descriptor is refused: the kernel really was asked (EBADF)


def test_an_apply_starts_writeback_every_few_mib_and_stays_exact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from safetensors.numpy import load_file

    from dcr_cli import apply
    from dcr_cli.produce import diff

    rng = np.random.default_rng(3)
    base = {"w": rng.standard_normal(12 << 20).astype(np.float32), "small": np.ones(64, dtype=np.float32)}
    target = step(base, 5, rate=0.03)  # 3% of a 48 MiB tensor, uniformly: every page is written, run by run
    c0, c1 = write_checkpoint(tmp_path / "c0", base), write_checkpoint(tmp_path / "c1", target)
    diff(c0, c1, tmp_path / "d", base_version="v0", target_version="v1", workers=1)
    written_to: list[int] = []
    real = inplace.start_writeback

    def counted(fd: int) -> None:
        written_to.append(os.fstat(fd).st_ino)
        real(fd)

    monkeypatch.setattr(inplace, "start_writeback", counted)
    apply(tmp_path / "d", into=c0)
    ino = (c0 / "model.safetensors").stat().st_ino
    nbytes = base["w"].nbytes
    # A start once WRITEBACK_BYTES have been written since the last (each run of up to RUN_BYTES counted
    # whole), all of them of the file written.
    w, run = inplace.WRITEBACK_BYTES, inplace.RUN_BYTES
    assert nbytes // (w + run) <= len(written_to) <= nbytes // w, len(written_to)
    assert set(written_to) == {ino}
    got = load_file(str(c0 / "model.safetensors"))
    assert {k: v.view(np.uint32).tobytes() for k, v in got.items()} == {
        k: v.view(np.uint32).tobytes() for k, v in target.items()
    }


def test_the_delta_writer_starts_writeback_as_a_block_fills(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dcr_cli.delta import writer
    from dcr_cli.delta.reader import Delta
    from dcr_cli.produce import diff

    rng = np.random.default_rng(4)
    base = {"w": rng.standard_normal(8 << 20).astype(np.float32)}
    target = {"w": rng.standard_normal(8 << 20).astype(np.float32)}  # every element: 32 MiB of values
    c0, c1 = write_checkpoint(tmp_path / "c0", base), write_checkpoint(tmp_path / "c1", target)
    started: list[int] = []
    real = writer.start_writeback
    monkeypatch.setattr(writer, "start_writeback", lambda fd: (started.append(fd), real(fd)))
    diff(c0, c1, tmp_path / "d", base_version="v0", target_version="v1", workers=1)
    written = sum(b.size for b in Delta.open(tmp_path / "d").manifest.blocks)
    assert written >= 3 * writer.SYNC_BYTES
    # One start per SYNC_BYTES written into a block, none waited for; the block files are whole all the same.
    assert written // (2 * writer.SYNC_BYTES) <= len(started) <= written // writer.SYNC_BYTES, (len(started), written)
    Delta.open(tmp_path / "d").verify_blocks(("data", "repair"))
