"""Two pushes of the same delta at once: the one whose record creation loses says so (store-v1 §4.1)."""

from __future__ import annotations

from pathlib import Path

import pytest
from store_fixtures import make_deltas, run_dcr

from dcr_cli.store import Store, push
from dcr_cli.store.transfer import PushResult


def test_the_push_that_loses_the_create_race_of_the_same_delta_does_not_say_published(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before, both said "published" (and both printed "published v1 (repair blocks follow)"): a cron
    script counting publications counted two."""
    _, (d1,) = make_deltas(tmp_path, 1)
    url = str(tmp_path / "store")
    create = Store.create
    raced: list[str] = []

    def another_push_first(self: Store, rel: str, data: bytes) -> None:
        if rel == "versions/v1.json" and not raced:
            raced.append(rel)
            other = run_dcr("push", str(d1), url, "--json")  # a real second push, which wins
            assert other.returncode == 0 and '"status": "published"' in other.stdout, other.stdout + other.stderr
        create(self, rel, data)

    monkeypatch.setattr(Store, "create", another_push_first)
    seen: list[PushResult] = []
    result = push(d1, url, on_published=seen.append)
    assert raced and result.already_published and result.status != "published", result
    assert [r.already_published for r in seen] == [True]  # push_cmd prints its "published" line only if False
