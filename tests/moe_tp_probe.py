"""Run by test_moe_vllm_tp.py in its own process: dcr apply into a multi-rank vLLM engine serving an MoE.

    python tests/moe_tp_probe.py ROOT STEPS TP ENGINE_ARGS_JSON CRASH_AT_ITEM

Starts an engine with ``tensor_parallel_size=TP`` (one worker process per rank, plus whatever
ENGINE_ARGS_JSON adds, e.g. ``{"enable_expert_parallel": true}``) on ROOT/step-STEPS: a fresh
engine on the target. Records every parameter's and buffer's bits on every rank (as digests) and
the greedy tokens, takes it back to step-0 with ROOT/back, then forward with ROOT/d1..dSTEPS, where
d1 is killed on every rank in the middle of a write at item CRASH_AT_ITEM and retried. Prints one
JSON report line. The worker-side functions below run inside vLLM's worker processes
(``collective_rpc`` ships them by value, as this file is ``__main__``).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any


def _resident_digests(worker: Any) -> dict[str, str]:
    """sha256 of the bits of every parameter and buffer of this rank's model."""
    import hashlib

    import torch

    model = worker.model_runner.get_model()
    widths = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    out = {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        data = t.detach().contiguous()
        if data.numel():
            data = data.view(widths[data.element_size()])
        out[name] = hashlib.sha256(data.cpu().numpy().tobytes()).hexdigest()
    return out


def _expert_split(worker: Any) -> list[int]:
    """Local expert count of each fused-MoE layer on this rank."""
    model = worker.model_runner.get_model()
    return [int(m.w13_weight.shape[0]) for _, m in model.named_modules() if hasattr(m, "w13_weight")]


def _install_crash(worker: Any, at_item: int) -> None:
    """At item ``at_item``, write half of the item's elements on this rank, then fail (on every rank).

    The dcr backend records each rank's failure and returns normally (vLLM 0.32's multiprocess
    executor would otherwise leave the other ranks' replies queued after the first failed one);
    the client reads the recorded errors and closes the update session.
    """
    from dcr_cli.receive.vllm import apply as engine_apply

    receiver_cls = engine_apply.EngineReceiver
    real_item = receiver_cls.__dict__.get("_dcr_real_apply_item", receiver_cls.apply_item)
    real_write = engine_apply._write_elements
    seen = {"items": 0}

    def apply_item(receiver: Any, delta: Any, item: Any, placement: Any, *args: Any, **kwargs: Any) -> Any:
        seen["items"] += 1
        if seen["items"] < at_item:
            return real_item(receiver, delta, item, placement, *args, **kwargs)

        def half_write(flat: Any, index: Any, values: Any) -> None:
            keep = max(1, len(index) // 2)
            real_write(flat, index[:keep], values[:keep])
            raise RuntimeError("transfer killed")

        engine_apply._write_elements = half_write
        try:
            real_item(receiver, delta, item, placement, *args, **kwargs)
        finally:
            engine_apply._write_elements = real_write
        raise RuntimeError("transfer killed")  # a rank that held none of this item fails here too

    receiver_cls._dcr_real_apply_item = real_item
    receiver_cls.apply_item = apply_item


def _remove_crash(worker: Any) -> None:
    from dcr_cli.receive.vllm import apply as engine_apply

    receiver_cls = engine_apply.EngineReceiver
    receiver_cls.apply_item = receiver_cls.__dict__["_dcr_real_apply_item"]


def main() -> None:
    root, steps, tp = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    extra, crash_at = json.loads(sys.argv[4]), int(sys.argv[5])
    from vllm_support import start_llm

    started = time.perf_counter()
    llm = start_llm(root / f"step-{steps}", tensor_parallel_size=tp, **extra)
    startup = time.perf_counter() - started
    print(f"engine up after {startup:.1f} s", flush=True)
    code = 1
    try:
        report = _run(llm, root, steps, crash_at)
        report["startup_s"] = startup
        print("DCR-MOE-TP-REPORT " + json.dumps(report), flush=True)
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        # Stop the engine core and its workers explicitly (see vllm_tp_probe.py), also after a failure.
        llm.llm_engine.engine_core.shutdown(timeout=60)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _run(llm: Any, root: Path, steps: int, crash_at: int) -> dict[str, Any]:
    from vllm_support import greedy

    from dcr_cli.errors import DcrError
    from dcr_cli.receive.vllm import apply_to_llm, verify_llm

    target_bits = llm.collective_rpc(_resident_digests)
    target_tokens = greedy(llm)
    back = apply_to_llm(llm, root / "back")
    verify_llm(llm, root / "back")
    base_bits, base_tokens = llm.collective_rpc(_resident_digests), greedy(llm)

    llm.collective_rpc(_install_crash, args=(crash_at,))
    crash = ""
    try:
        apply_to_llm(llm, root / "d1")
    except DcrError as exc:
        crash = str(exc)
    llm.collective_rpc(_remove_crash)
    torn_differs = llm.collective_rpc(_resident_digests) != base_bits
    forward = [apply_to_llm(llm, root / f"d{i}") for i in range(1, steps + 1)]
    verify_llm(llm)
    final_bits = llm.collective_rpc(_resident_digests)
    return {
        "ranks": len(target_bits),
        "experts_per_rank": llm.collective_rpc(_expert_split),
        "tensors_per_rank": [len(r) for r in target_bits],
        "differing": sorted({n for t, f in zip(target_bits, final_bits, strict=True) for n in t if t[n] != f.get(n)}),
        "back_changed_bits": base_bits != target_bits,
        "crash": crash,
        "torn_differs": torn_differs,
        "tokens_equal": greedy(llm) == target_tokens,
        "base_tokens_differ": base_tokens != target_tokens,
        "reports": [back, *forward],
        "version": llm.get_weight_version(),
    }


if __name__ == "__main__":
    main()
