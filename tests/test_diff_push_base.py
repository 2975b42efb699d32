"""dcr diff --push refuses a base that is not the store's committed head before it diffs and before it
uploads a block, where the base's digests are cached (the steady state of a trainer's stream); the
push at the end refuses it as before where they are not."""

from __future__ import annotations

from pathlib import Path

from conftest import run_dcr
from store_fixtures import commit_each, make_deltas


def _store_files(store: Path) -> set[str]:
    return {str(p.relative_to(store)) for p in store.rglob("*")}


def test_diff_push_refuses_a_base_behind_the_head_before_the_diff_and_uploads_nothing(tmp_path: Path) -> None:
    (c0, _, c2), (d1, _) = make_deltas(tmp_path, 2)  # c0's digests are in the digest cache now
    store = tmp_path / "store"
    commit_each(str(store), [d1])  # the head is v1
    before = _store_files(store)
    out = tmp_path / "stale"
    got = run_dcr(
        "diff", str(c0), str(c2), "-o", str(out), "--base-version", "v0", "--target-version", "v2",
        "--push", str(store),
    )  # fmt: skip
    assert got.returncode != 0
    assert got.stderr.strip().splitlines() == [
        f"dcr: error: the delta's base (v0) is not the committed baseline of {store} (v1); "
        f"re-run dcr diff against v1 (dcr status {store} --json shows it)"
    ]
    assert not out.exists()  # refused before the diff wrote anything (it scanned meanwhile: reads only)
    assert not list(tmp_path.glob(".stale.partial-*"))  # not even the writer's partial directory
    assert _store_files(store) == before  # and before any block or announcement went up


def test_diff_push_from_the_head_publishes_and_a_published_version_is_left_to_the_push(tmp_path: Path) -> None:
    (_, c1, c2), (d1, _) = make_deltas(tmp_path, 2)
    store = tmp_path / "store"
    commit_each(str(store), [d1])
    args = ("--base-version", "v1", "--target-version", "v2", "--push", str(store))
    run_dcr("diff", str(c1), str(c2), "-o", str(tmp_path / "a"), *args, check=True)
    run_dcr("ack", str(store), "v2", "--receiver", "r", check=True)
    run_dcr("commit", str(store), "v2", "--receiver", "r", check=True)
    # The head is v2 now, and v2 is published: the same diff again (another output) is not refused for
    # its base before the diff; the push at the end compares the deltas themselves, as it always has.
    again = run_dcr("diff", str(c1), str(c2), "-o", str(tmp_path / "b"), *args)
    assert "committed baseline" not in again.stderr
    assert (tmp_path / "b" / "manifest.json").exists()


def test_without_cached_digests_the_push_still_refuses_the_base_after_the_diff(tmp_path: Path) -> None:
    (c0, _, c2), (d1, _) = make_deltas(tmp_path, 2)
    store = tmp_path / "store"
    commit_each(str(store), [d1])
    got = run_dcr(
        "diff", str(c0), str(c2), "-o", str(tmp_path / "stale"), "--base-version", "v0", "--target-version", "v2",
        "--push", str(store), env={"DCR_CACHE_DIR": ""},
    )  # fmt: skip
    assert got.returncode != 0
    assert "is not the committed baseline" in got.stderr
    assert not (store / "versions" / "v2.json").exists()


def test_a_store_that_cannot_take_the_push_refuses_it_before_anything_is_written(tmp_path: Path) -> None:
    """The store's client is set up on a thread while the scan starts; its refusal still comes before the
    first write, with or without cached base digests (the writer waits for the set-up either way)."""
    (c0, c1, _), _ = make_deltas(tmp_path, 2)
    for name, env in (("cached", None), ("uncached", {"DCR_CACHE_DIR": ""})):
        out = tmp_path / f"d-{name}"
        got = run_dcr(
            "diff", str(c0), str(c1), "-o", str(out), "--base-version", "v0", "--target-version", "v1",
            "--push", "dir::memory://dcr-no-atomic-create", env=env,
        )  # fmt: skip
        assert got.returncode != 0
        lines = got.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("dcr: error: dir::memory://dcr-no-atomic-create: this store")
        assert "cannot create an object atomically" in lines[0]
        assert not out.exists() and not list(tmp_path.glob(f".{out.name}.partial-*"))
