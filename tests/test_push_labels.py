"""Labels a store cannot take are refused before anything is written."""

from __future__ import annotations

from pathlib import Path

from conftest import run_dcr
from store_fixtures import make_deltas


def test_a_delta_labelled_as_its_own_base_is_refused_before_the_store_is_created(tmp_path: Path) -> None:
    """A no-op delta (a version to itself, what an engine applies to establish its version) cannot be a
    store's version: before, push created the new store's marker, then refused."""
    (c0,), _ = make_deltas(tmp_path, 0)
    noop = tmp_path / "noop"
    run_dcr("diff", str(c0), str(c0), "-o", str(noop), "--base-version", "v0", "--target-version", "v0", check=True)
    store = tmp_path / "store"
    refused = run_dcr("push", str(noop), str(store))
    assert refused.returncode == 3, refused.stderr
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dcr: error:") and "also the base's label" in lines[0], lines
    assert not store.exists()  # nothing written
