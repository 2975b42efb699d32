"""dcr apply into a live vLLM engine vs vLLM's own dense reload of the same checkpoint, side by side.

    PYTHONPATH=. python benchmarks/bench_vllm.py [--size medium] [--rates 0.03,0.005] [--repeat 3]
    PYTHONPATH=. python benchmarks/bench_vllm.py --source train --size small    # two real AdamW steps
    PYTHONPATH=. python benchmarks/bench_vllm.py --rates 0.03,0.03,0.03,0.005,0.005 --repeat 5   # best of several

Synthetic corpus (default, nothing downloaded): a Qwen3-shaped BF16 checkpoint with random weights
(``--size``: tiny ~4 MiB, small ~44 MiB, medium ~0.5 GiB, large ~1 GiB; ``moe``: Qwen3-MoE-shaped with
128 experts per layer in 8 layers, 3,147 tensors in 51 MiB, ``moe-48``: 48 layers, 18,867 tensors, where
the number of tensors and items is what costs); each later version changes
the given fraction of all elements at uniformly random positions (a step in the low mantissa bits,
like an RL step in BF16). Version v1 is the first rate, v2.. each rate in turn, so the engine sees

* the first apply v0 -> v1: it also establishes the engine's base version by reading back and
  digesting every tensor through the placement (once per engine);
* one steady apply per rate (check, pause, sparse in-place update, proof, version bump,
  prefix-cache reset, resume), each with its pause window (pause .. resume, as the client sees it);
* ``verify_llm`` (every tensor read back and digested);
* vLLM's dense reload of the last version: ``model.load_weights`` of every tensor read from the
  safetensors file (page cache; what a full refit costs without dcr, excluding any transfer);
* per apply, the floor of its proof: BLAKE3 of the same bytes the proof hashes (the canonical
  bytes of every tensor the delta touches, which are the target checkpoint's), held in memory, on
  all cores (best of BLAKE3's own threads per tensor and one thread per tensor on a pool, as dcr
  does), and the apply's time above it: how far the apply is from what an exact proof costs here.
  On one rank the proof's digests are taken before the pause (``predict``: each touched tensor as
  it will be after the writes, receiver-vllm.md §3), so the pause holds only the writes, each read
  back; the floor then bounds the prepare, not the pause.

Every ratio is against that dense reload, measured in the same run on the same engine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]

SHAPES = {
    # hidden, intermediate, layers, heads, kv heads, vocab (head_dim 64 throughout)
    "tiny": (128, 384, 2, 2, 1, 1024),
    "small": (512, 1536, 4, 8, 4, 8192),
    "medium": (1024, 3072, 16, 16, 8, 32000),
    "large": (2048, 6144, 10, 32, 8, 32000),
}
# Qwen3-MoE-shaped, narrow (the tests' tiny model: hidden 128, expert width 64), with Qwen3-30B-A3B's
# 128 experts per layer, in the per-expert spelling of Hugging Face checkpoints: layers, experts. What
# costs there is the number of tensors and items (moe: 3,147 tensors, 51 MiB; moe-48: 48 layers as the
# 30B model, 18,867 tensors).
MOE_SHAPES = {"moe": (8, 128), "moe-48": (48, 128)}


def synthetic_versions(work: Path, size: str, rates: list[float], seed: int = 0) -> list[Path]:
    """v0 (random BF16 weights) and one version per rate, each changing that fraction of v(k-1)."""
    import torch
    from safetensors.torch import save_file

    config, shapes = _moe_shapes(size) if size in MOE_SHAPES else _dense_shapes(size)
    rng = np.random.default_rng(seed)
    bits: dict[str, np.ndarray] = {}
    for name, shape in shapes.items():
        n = int(np.prod(shape))
        if name.endswith("norm.weight"):
            values = np.ones(n, dtype=np.float32) + rng.standard_normal(n, dtype=np.float32) * 0.01
        else:
            values = rng.standard_normal(n, dtype=np.float32) * 0.02
        bits[name] = (values.view(np.uint32) >> 16).astype(np.uint16)
    cfg = config.to_dict()
    cfg.update(torch_dtype="bfloat16", dtype="bfloat16", architectures=config.architectures)

    def save(k: int) -> Path:
        out = work / f"v{k}"
        out.mkdir(parents=True)
        state = {n: torch.from_numpy(b.view(np.int16)).view(torch.bfloat16).reshape(shapes[n]) for n, b in bits.items()}
        save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
        (out / "config.json").write_text(json.dumps(cfg, indent=2, default=str))
        return out

    paths = [save(0)]
    for k, rate in enumerate(rates, start=1):
        for b in bits.values():
            mask = rng.random(b.size) < rate
            b[mask] ^= rng.integers(1, 4, size=int(mask.sum()), dtype=np.uint16)
        paths.append(save(k))
    return paths


def _dense_shapes(size: str) -> tuple[Any, dict[str, tuple[int, ...]]]:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    hidden, inter, layers, heads, kv, vocab = SHAPES[size]
    config = Qwen3Config(
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        vocab_size=vocab,
        head_dim=64,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        architectures=["Qwen3ForCausalLM"],
    )
    with torch.device("meta"):
        return config, {n: tuple(t.shape) for n, t in Qwen3ForCausalLM(config).state_dict().items()}


def _moe_shapes(size: str) -> tuple[Any, dict[str, tuple[int, ...]]]:
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    if str(REPO / "tests") not in sys.path:
        sys.path.insert(0, str(REPO / "tests"))
    from moe_support import MOE_SIZES  # the tests' tiny Qwen3-MoE, with more layers and experts

    layers, experts = MOE_SHAPES[size]
    dims = {**MOE_SIZES["qwen3_moe"], "num_hidden_layers": layers, "num_experts": experts}
    hidden, width = dims["hidden_size"], dims["moe_intermediate_size"]
    config = Qwen3MoeConfig(
        **dims, max_position_embeddings=512, tie_word_embeddings=False, architectures=["Qwen3MoeForCausalLM"]
    )
    with torch.device("meta"):  # transformers fuses the experts in memory; checkpoints spell them one by one
        shapes = {
            n: tuple(t.shape) for n, t in Qwen3MoeForCausalLM(config).state_dict().items() if ".mlp.experts." not in n
        }
    for layer in range(layers):
        for e in range(experts):
            prefix = f"model.layers.{layer}.mlp.experts.{e}."
            shapes |= {prefix + "gate_proj.weight": (width, hidden), prefix + "up_proj.weight": (width, hidden)}
            shapes[prefix + "down_proj.weight"] = (hidden, width)
    return config, shapes


def proof_floor(
    checkpoint: Path, names: set[str], expected: dict[str, str] | None, repeat: int = 3
) -> tuple[float, int]:
    """Seconds to BLAKE3 the canonical bytes of ``names`` held in memory, on all cores (best of two ways).

    The bytes are the target checkpoint's tensors (what the proof reads back through the
    placement), copied into memory first; their digests must be the delta's table (``expected``,
    where given).
    Returns (seconds, bytes).
    """
    from concurrent.futures import ThreadPoolExecutor

    import blake3
    import torch
    from safetensors import safe_open

    held: list[np.ndarray] = []
    with safe_open(str(checkpoint / "model.safetensors"), "pt") as f:
        for name in sorted(names):
            held.append(f.get_tensor(name).contiguous().reshape(-1).view(torch.uint8).numpy().copy())
            if expected is not None:
                assert blake3.blake3(held[-1].data).hexdigest() == expected[name], f"{name}: not the delta's bytes"
    held.sort(key=lambda a: -a.nbytes)  # largest first, as the proof runs them
    workers = len(os.sched_getaffinity(0))

    def auto() -> None:
        for a in held:
            blake3.blake3(a.data, max_threads=blake3.blake3.AUTO).digest()

    def pooled() -> None:
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(lambda a: blake3.blake3(a.data).digest(), held))

    best = float("inf")
    for _ in range(repeat):
        for way in (auto, pooled):
            t = time.perf_counter()
            way()
            best = min(best, time.perf_counter() - t)
    return best, sum(a.nbytes for a in held)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", default="synthetic", choices=["synthetic", "train"])
    parser.add_argument("--size", default="medium", choices=[*SHAPES, *MOE_SHAPES])
    parser.add_argument("--rates", default="0.03,0.03,0.005", help="change rate of each version after v0")
    parser.add_argument("--repeat", type=int, default=3, help="dense reloads and verifies to time (median)")
    parser.add_argument("--lr", type=float, default=1e-6, help="--source train: AdamW learning rate")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    parser.add_argument("--keep", action="store_true", help="keep the corpus and deltas (removed by default)")
    args = parser.parse_args()

    sys.path[:0] = [str(REPO / "tests"), str(REPO / "examples")]
    from vllm_support import engine_env, ensure_plugin_entry_point, resident_model, start_llm

    from dcr_cli.produce import diff
    from dcr_cli.receive.vllm import apply_to_llm, verify_llm

    engine_env()
    ensure_plugin_entry_point()
    work = Path(tempfile.mkdtemp(prefix="dcr-bench-vllm-"))
    try:
        if args.source == "train":
            from train_tiny import train

            if args.size not in ("tiny", "small"):
                parser.error("--source train builds tiny or small only")
            paths = train(work, 2, args.size, lr=args.lr)
            rates: list[float | None] = [None, None]
        else:
            rates = [float(r) for r in args.rates.split(",")]
            paths = synthetic_versions(work, args.size, rates)  # type: ignore[arg-type]
        deltas = []
        for i in range(1, len(paths)):
            out = work / f"d{i}"
            deltas.append(diff(paths[i - 1], paths[i], out, base_version=f"v{i - 1}", target_version=f"v{i}"))
        checkpoint_bytes = sum(f.stat().st_size for f in paths[-1].glob("*.safetensors"))

        llm = start_llm(paths[0])
        figures: dict[str, Any] = {"size": args.size, "checkpoint_mib": checkpoint_bytes / 2**20, "applies": []}
        for i in range(1, len(paths)):
            t = time.perf_counter()
            report = apply_to_llm(llm, work / f"d{i}")
            wall = time.perf_counter() - t
            figures["applies"].append({"delta": f"d{i}", "rate": rates[i - 1], "wall": wall, **report})

        verify_times = []
        for _ in range(args.repeat):
            t = time.perf_counter()
            verify_llm(llm)
            verify_times.append(time.perf_counter() - t)
        verify_s = statistics.median(verify_times)

        from safetensors import safe_open

        model = resident_model(llm)
        dense_times = []
        with safe_open(str(paths[-1] / "model.safetensors"), "pt") as f:  # untimed: the file into page cache
            model.load_weights((name, f.get_tensor(name)) for name in f.keys())  # noqa: SIM118
        for _ in range(args.repeat):
            t = time.perf_counter()
            with safe_open(str(paths[-1] / "model.safetensors"), "pt") as f:
                model.load_weights((name, f.get_tensor(name)) for name in f.keys())  # noqa: SIM118
            llm.reset_prefix_cache()
            dense_times.append(time.perf_counter() - t)
        verify_llm(llm)  # the dense reload of the same checkpoint leaves the same bits
        dense = statistics.median(dense_times)
        figures.update(dense=dense, dense_all=dense_times, verify=verify_s)

        from dcr_cli.delta.reader import Delta

        for i, a in enumerate(figures["applies"], start=1):  # the proof's floor, per apply
            m = Delta.open(str(work / f"d{i}")).manifest
            table = {n: e.digest for n, e in m.tensors.items()}
            floor, nbytes = proof_floor(paths[i], {item.tensor for item in m.items}, table)
            a.update(floor=floor, floor_bytes=nbytes, floor_tensors=len({item.tensor for item in m.items}))
            if i == 1:  # the first apply also reads back every tensor of the base (its fingerprint)
                a["fingerprint_floor"] = proof_floor(paths[0], set(m.tensors), None)[0]

        import dcr_cli

        cores = len(os.sched_getaffinity(0))
        print(f"model: {args.size}, checkpoint {checkpoint_bytes / 2**20:.1f} MiB, cores {cores}")
        print(f"dcr_cli from {Path(dcr_cli.__file__).parent} (the engine runs in this process)")
        print(
            f"vLLM dense reload (load_weights, median of {args.repeat}):      {dense * 1e3:8.1f} ms   1.00x"
            f"   (all: {', '.join(f'{t * 1e3:.0f}' for t in dense_times)} ms)"
        )
        for k, a in enumerate(figures["applies"]):
            label = "first " if k == 0 else "steady"
            rate = "" if a["rate"] is None else f"{a['rate']:.1%}"
            print(
                f"dcr apply {a['delta']} ({label}, {rate:>5} changed, {a['written_elements']:>10,} elements): "
                f"{a['wall'] * 1e3:8.1f} ms  {a['wall'] / dense:5.2f}x"
            )
            parts = a.get("phases") or {}
            if parts:
                shown = ", ".join(f"{k} {v * 1e3:.0f}" for k, v in parts.items())
                print(f"    in-engine phases (ms): {shown}")
            if "writes_and_proof" in parts:  # one rank: writes and proof interleaved on all cores
                cpu = parts.get("writes_cpu", 0.0) + parts.get("proof_cpu", 0.0)
                print(
                    f"    writes + proof {parts['writes_and_proof'] * 1e3:.1f} ms wall "
                    f"({parts.get('proof_cpu', 0.0) / max(cpu, 1e-9):.0%} of their thread time is the proof's hashing)"
                )
            elif "proof_seconds" in a:
                share = a["proof_seconds"] / max(a["wall"], 1e-9)
                print(f"    proof {a['proof_seconds'] * 1e3:.1f} ms ({share:.0%} of the apply)")
            if parts.get("fingerprint"):
                fp = parts["fingerprint"]
                print(f"    first read-back fingerprint {fp * 1e3:.1f} ms  {fp / dense:5.2f}x", end="")
                if "fingerprint_floor" in a:
                    floor = a["fingerprint_floor"]
                    print(f"   (its floor, BLAKE3 of every tensor in memory: {floor * 1e3:.1f} ms)", end="")
                print()
            print(
                f"    proof floor (predict, before the pause, on one rank): BLAKE3 of the {a['floor_tensors']} tensors "
                f"({a['floor_bytes'] / 2**20:.0f} MiB, in memory, {cores} cores): {a['floor'] * 1e3:.1f} ms "
                f"{a['floor'] / dense:5.2f}x; the apply above it: {(a['wall'] - a['floor']) * 1e3:.1f} ms "
                f"{(a['wall'] - a['floor']) / dense:5.2f}x"
            )
            if "pause_seconds" in a:
                print(
                    f"    engine pause window: {a['pause_seconds'] * 1e3:8.1f} ms  {a['pause_seconds'] / dense:5.2f}x"
                    f"   (checked and read before it: {a.get('prepare_seconds', 0.0) * 1e3:.1f} ms)"
                )
        # Best of each (this box is shared: the least disturbed run of a step is its cost), per rate.
        best_dense = min(dense_times)
        by_rate: dict[Any, list[dict[str, Any]]] = {}
        for a in figures["applies"][1:]:
            by_rate.setdefault(a["rate"], []).append(a)
        print(f"best of each: dense reload {best_dense * 1e3:.1f} ms (of {len(dense_times)})")
        for rate, runs in by_rate.items():
            wall = min(r["wall"] for r in runs)
            floor = min(r["floor"] for r in runs)
            pause = min(r.get("pause_seconds", r["wall"]) for r in runs)
            shown = "" if rate is None else f"{rate:.1%} "
            print(
                f"  steady {shown}(best of {len(runs)}): {wall * 1e3:.1f} ms {wall / best_dense:5.2f}x, pause "
                f"{pause * 1e3:.1f} ms {pause / best_dense:5.2f}x; proof floor {floor * 1e3:.1f} ms "
                f"{floor / best_dense:5.2f}x; apply above the floor {(wall - floor) * 1e3:.1f} ms "
                f"{(wall - floor) / best_dense:5.2f}x"
            )
            figures.setdefault("best", {})[str(rate)] = {"wall": wall, "pause": pause, "floor": floor}
        figures["best_dense"] = best_dense
        label = f"verify_llm (median of {args.repeat}):"
        print(f"{label:<59}{verify_s * 1e3:8.1f} ms  {verify_s / dense:5.2f}x")
        print(f"  load average {os.getloadavg()[0]:.1f}")
        if args.json:
            args.json.write_text(json.dumps(figures, indent=2, default=str))
    finally:
        if not args.keep:  # the corpus is several GiB at the larger sizes
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
