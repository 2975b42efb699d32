"""review9: a Megatron profile's values are checked, never coerced (format_spec/producers.md §4).

Before, ``bool("false")`` turned a flag spelled as a string on: ``"zero_centered_gamma": "false"``
diffed the norms as zero-centred (+1: other target bits, exit 0), ``"tie_word_embeddings": "false"``
dropped ``lm_head``; ``"modules_to_not_convert": "o_proj"`` was matched character by character (no
weight quantized); ``vocab_size: 0`` wrote an empty embedding; and a missing ``intermediate_size``,
a non-integer ``num_experts``, a ``"megatron"`` or ``prefix`` of the wrong type raised KeyError,
ValueError, AttributeError or TypeError (``dcr: internal error``, exit 70).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from conftest import run_dcr
from test_shards_megatron import DENSE, built

from dcr_cli.errors import IncompatibleError
from dcr_cli.produce import diff


@pytest.fixture(scope="module")
def megatron(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return built(tmp_path_factory, "dense")  # write_megatron_checkpoints(root, DENSE, world=2), shared


def _with(change: dict[str, Any], megatron_options: dict[str, Any] | None = None, drop: str = "") -> dict[str, Any]:
    cfg = copy.deepcopy(DENSE)
    cfg.update(change)
    if megatron_options is not None:
        cfg["megatron"].update(megatron_options)
    cfg.pop(drop, None)
    return cfg


@pytest.mark.parametrize(
    ("cfg", "says"),
    [
        (_with({}, {"zero_centered_gamma": "false"}), "megatron.zero_centered_gamma must be true or false"),
        (_with({"tie_word_embeddings": "false"}), "tie_word_embeddings must be true or false"),
        (
            _with({"quantization_config": {"quant_method": "fp8", "modules_to_not_convert": "o_proj"}}),
            "modules_to_not_convert must be a list of module names",
        ),
        (_with({"vocab_size": 0}), "vocab_size must be a positive integer"),
        (_with({"num_attention_heads": True}), "num_attention_heads must be a positive integer"),
        (_with({"num_attention_heads": "4"}), "num_attention_heads must be a positive integer"),
        (_with({}, drop="intermediate_size"), "lacks a model dimension: intermediate_size"),
        (_with({"num_experts": "x"}), "num_experts must be a non-negative integer"),
        (_with({"megatron": "x"}), '"megatron" must be an object'),
        (_with({}, {"prefix": 5}), "megatron.prefix must be a string"),
        (
            _with({"quantization_config": {"quant_method": "fp8", "weight_block_size": [True, 16]}}),
            "weight_block_size must be two positive integers",
        ),
    ],
)
def test_a_profile_value_of_the_wrong_type_is_refused_before_anything_is_written(
    megatron: Path, tmp_path: Path, cfg: dict[str, Any], says: str
) -> None:
    with pytest.raises(IncompatibleError, match=says):
        diff(megatron / "base" / "torch_dist", megatron / "target" / "torch_dist", tmp_path / "d", profile=cfg)
    assert not (tmp_path / "d").exists()


def test_the_cli_refuses_a_flag_spelled_as_a_string_in_one_line(megatron: Path, tmp_path: Path) -> None:
    profile = tmp_path / "config.json"
    profile.write_text(json.dumps(_with({}, {"zero_centered_gamma": "false"})))
    proc = run_dcr(
        "diff",
        str(megatron / "base" / "torch_dist"),
        str(megatron / "target" / "torch_dist"),
        "-o",
        str(tmp_path / "d"),
        "--profile",
        str(profile),
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "zero_centered_gamma must be true or false" in proc.stderr
    assert not (tmp_path / "d").exists()


def test_the_same_profile_with_real_values_still_diffs(megatron: Path, tmp_path: Path) -> None:
    summary = diff(megatron / "base" / "torch_dist", megatron / "target" / "torch_dist", tmp_path / "d", profile=DENSE)
    assert summary is not None and summary.changed_elements > 0
