"""The target==base label refusal is one function (store.repo.check_distinct_labels): dcr diff --push (before
the diff) and dcr push refuse with the same words and the same exit code."""

from __future__ import annotations

from pathlib import Path

from conftest import run_dcr
from store_fixtures import make_deltas


def test_diff_push_and_push_refuse_a_target_labelled_as_its_base_alike(tmp_path: Path) -> None:
    (c0,), _ = make_deltas(tmp_path, 0)
    store = tmp_path / "store"
    early = run_dcr(
        "diff", str(c0), str(c0), "-o", str(tmp_path / "d1"), "--base-version", "v0", "--target-version", "v0",
        "--push", str(store),
    )  # fmt: skip
    run_dcr("diff", str(c0), str(c0), "-o", str(tmp_path / "d2"), "--base-version", "v0", "--target-version", "v0",
            check=True)  # fmt: skip
    late = run_dcr("push", str(tmp_path / "d2"), str(store))
    assert early.returncode == late.returncode == 3, (early.stderr, late.stderr)
    said = [p.stderr.strip().split(": ", 2) for p in (early, late)]  # dcr / error / WHERE: the words
    assert said[0][0] == said[1][0] == "dcr" and said[0][1].startswith("error")
    assert said[0][2].split(": ", 1)[1] == said[1][2].split(": ", 1)[1]
    assert "'v0' is also the base's label" in early.stderr and "--target-version" in early.stderr
    assert not store.exists() and not (tmp_path / "d1").exists()
