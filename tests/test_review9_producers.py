"""review9: the producers refuse hostile arguments in one line, before anything is read, written or removed.

- ``Producer.diff(state, version)``: ``version`` names ``out/<version>``, and an earlier attempt there is
  removed; an unchecked version ("../x", "", ".", "/x") removed directories outside the output, or the
  output itself.
- ``dcr diff --push``: labels that the push after the diff would refuse are refused before the diff, so
  nothing is uploaded to the store (nor the store created) for a delta that cannot be published.
- The Python API checks what the command line's option types check, and refuses live tensors without
  dense values, with a DcrError instead of a bare torch or concurrent.futures exception.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from checkpoints import write_checkpoint
from conftest import run_dcr

import dcr_cli
from dcr_cli.errors import DcrError, IncompatibleError


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(8, 8, generator=g).to(torch.bfloat16), "b": torch.randn(8, generator=g)}


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("version", ["../keep", "", ".", "..", "a/b", "/ABS", ".hidden", "v1.json", "x" * 129])
def test_a_producer_refuses_a_version_that_is_not_a_label_and_removes_nothing(tmp_path: Path, version: str) -> None:
    keep = tmp_path / "keep"
    keep.mkdir()
    (keep / "precious.txt").write_text("not a delta")
    out = tmp_path / "deltas"
    producer = dcr_cli.Producer(out, baseline=_state(0), base_version="v0")
    producer.diff(_state(1), version="v1")
    before = {"keep": _tree(keep), "out": _tree(out)}
    version = version.replace("/ABS", str(keep))  # an absolute path: out / "/x" is "/x"
    with pytest.raises(IncompatibleError, match="not a valid label"):
        producer.diff(_state(2), version=version)
    assert {"keep": _tree(keep), "out": _tree(out)} == before
    producer.committed("v1")  # the refused call left the pending version as it was


def test_a_producer_refuses_the_baselines_own_label(tmp_path: Path) -> None:
    producer = dcr_cli.Producer(tmp_path / "deltas", baseline=_state(0), base_version="v0")
    with pytest.raises(IncompatibleError, match="baseline's label"):
        producer.diff(_state(1), version="v0")
    assert not (tmp_path / "deltas").exists()
    producer.diff(_state(1), version="v1")
    producer.committed("v1")
    with pytest.raises(IncompatibleError, match="baseline's label"):
        producer.diff(_state(2), version="v1")  # v1 is the baseline now


def _pair(tmp_path: Path) -> tuple[Path, Path]:
    return write_checkpoint(tmp_path / "a", _state(0)), write_checkpoint(tmp_path / "b", _state(1))


@pytest.mark.parametrize(
    ("labels", "code", "says"),
    [
        (["--target-version", "bad/label"], 2, "not a valid label"),
        (["--target-version", ".."], 2, "not a valid label"),
        (["--base-version", "x", "--target-version", "x"], 3, "also the base's label"),
    ],
)
def test_diff_push_refuses_an_unpublishable_label_before_the_diff(
    tmp_path: Path, labels: list[str], code: int, says: str
) -> None:
    a, b = _pair(tmp_path)
    store = tmp_path / "store"
    proc = run_dcr("diff", str(a), str(b), "-o", str(tmp_path / "d"), *labels, "--push", f"file://{store}")
    assert proc.returncode == code, proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("dcr: error: ") and says in proc.stderr
    assert not (tmp_path / "d").exists()  # the diff did not run
    assert not store.exists()  # nothing uploaded, no store created


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"workers": -1}, "workers"),
        ({"workers": 0}, "workers"),
        ({"level": 99}, "level"),
        ({"level": 0}, "level"),
        ({"rank": 1}, "rank and world_size together"),
        ({"world_size": 2}, "rank and world_size together"),
        ({"rank": 2, "world_size": 2}, "rank and world_size together"),
        ({"rank": -1, "world_size": 2}, "rank and world_size together"),
    ],
)
def test_api_diff_checks_what_the_cli_checks(tmp_path: Path, options: dict, says: str) -> None:
    a, b = _pair(tmp_path)
    with pytest.raises(IncompatibleError, match=says):
        dcr_cli.diff(a, b, tmp_path / "d", **options)
    assert not (tmp_path / "d").exists()


def test_api_live_diffs_check_their_options_too(tmp_path: Path) -> None:
    with pytest.raises(IncompatibleError, match="workers"):
        dcr_cli.diff_tensors(_state(0), _state(1), tmp_path / "d", workers=-2)
    with pytest.raises(IncompatibleError, match="level"):
        dcr_cli.Producer(tmp_path / "p", baseline=_state(0), level=23)
    assert not (tmp_path / "d").exists() and not (tmp_path / "p").exists()


@pytest.mark.parametrize("kind", ["meta", "sparse"])
def test_live_tensors_without_dense_values_are_refused_in_one_line(tmp_path: Path, kind: str) -> None:
    def odd(t: torch.Tensor) -> torch.Tensor:
        return t.to("meta") if kind == "meta" else t.to_sparse()

    base, new = _state(0), _state(1)
    with pytest.raises(IncompatibleError, match=f"'?b'?: a live tensor must hold dense values.*{kind}"):
        dcr_cli.diff_tensors({**base, "b": odd(base["b"])}, {**new, "b": odd(new["b"])}, tmp_path / "d")
    assert not (tmp_path / "d").exists()


def test_a_producer_baseline_of_the_wrong_type_is_a_dcr_error(tmp_path: Path) -> None:
    with pytest.raises(DcrError, match="baseline must be a mapping of live tensors or an HF checkpoint path"):
        dcr_cli.Producer(tmp_path / "p", baseline=5)  # type: ignore[arg-type]


def test_api_squash_apply_and_verify_check_workers_and_level(tmp_path: Path) -> None:
    a, b = _pair(tmp_path)
    delta = tmp_path / "d"
    dcr_cli.diff(a, b, delta)
    with pytest.raises(IncompatibleError, match="level must be a zstd level"):
        dcr_cli.squash([delta], tmp_path / "s", level=99)
    with pytest.raises(IncompatibleError, match="workers must be an integer"):
        dcr_cli.squash([delta], tmp_path / "s", workers=-1)
    assert not (tmp_path / "s").exists()
    with pytest.raises(IncompatibleError, match="workers must be an integer"):
        dcr_cli.apply(delta, into=a, workers=-1)
    assert not (a / ".dcr").exists()  # nothing written, not even the receiver's state directory
    with pytest.raises(IncompatibleError, match="workers must be an integer"):
        dcr_cli.verify(a, against=delta, workers=0)


def test_a_producer_never_removes_the_delta_of_a_committed_version(tmp_path: Path) -> None:
    """Only an earlier, uncommitted attempt at a version (from the current baseline) is replaced. Before,
    reusing an older committed label removed that committed delta (``out/v1`` became ``v2 -> v1``)."""
    out = tmp_path / "deltas"
    producer = dcr_cli.Producer(out, baseline=_state(0), base_version="v0")
    for i in (1, 2):
        producer.diff(_state(i), version=f"v{i}")
        producer.committed(f"v{i}")
    kept = _tree(out / "v1")
    with pytest.raises(IncompatibleError, match="committed already"):
        producer.diff(_state(3), version="v1")
    # A producer started afresh from v2 (it does not remember v1): the delta's own base tells.
    again = dcr_cli.Producer(out, baseline=_state(2), base_version="v2")
    with pytest.raises(IncompatibleError, match="not an attempt from the baseline v2"):
        again.diff(_state(3), version="v1")
    assert _tree(out / "v1") == kept
    again.diff(_state(3), version="v3")
    first = _tree(out / "v3")
    again.diff(_state(4), version="v3")  # an uncommitted attempt is replaced, as before
    assert _tree(out / "v3") != first and _tree(out / "v1") == kept
