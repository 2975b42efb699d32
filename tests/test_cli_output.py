"""Human output never passes a hostile label to the terminal: every command prints through cli.common.say."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
from click.testing import CliRunner
from helpers_checkpoints import copy_checkpoint, mutate, random_tensors, write_checkpoint

from dcr_cli.cli import main
from dcr_cli.produce import diff

HOSTILE = "v1\x1b[2J\x1b[31mFAKE\r\n\u2028dcr: ok"


def test_a_hostile_version_label_is_escaped_in_apply_output(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    t0 = random_tensors(rng, [("a", "BF16", (64, 64)), ("b", "F32", (32,))])
    v0, v1 = write_checkpoint(tmp_path / "v0", t0), write_checkpoint(tmp_path / "v1", mutate(rng, t0, 0.05))
    diff(v0, v1, tmp_path / "d", base_version="v0", target_version=HOSTILE)
    copy_checkpoint(v0, tmp_path / "recv")

    result = CliRunner().invoke(main, ["apply", str(tmp_path / "d"), "--into", str(tmp_path / "recv")])

    assert result.exit_code == 0, result.output
    assert "\x1b" not in result.output and "\r" not in result.output and "\u2028" not in result.output
    lines = result.output.splitlines()
    # The label appears escaped, on the same line as the message that names it, and never starts a line.
    assert any("v1\\x1b[2J\\x1b[31mFAKE\\r\\n" in line for line in lines), result.output
    assert not any(re.match(r"dcr: ok", line) for line in lines)


def test_a_delta_larger_than_its_model_says_so_instead_of_a_zero_ratio(tmp_path: Path) -> None:
    # Tiny tensors: the manifest (digests, sections) outweighs the 24 bytes of the whole model.
    rng = np.random.default_rng(7)
    t0 = random_tensors(rng, [("a", "BF16", (4,)), ("b", "F32", (2,)), ("c", "BF16", (4,))])
    v0, v1 = write_checkpoint(tmp_path / "v0", t0), write_checkpoint(tmp_path / "v1", mutate(rng, t0, 1.0))

    result = CliRunner().invoke(main, ["diff", str(v0), str(v1), "-o", str(tmp_path / "d")])

    assert result.exit_code == 0, result.output
    assert re.search(r"\(\d+\.\dx larger than full\)", result.output), result.output
    assert "0.0x" not in result.output and "smaller than full" not in result.output
