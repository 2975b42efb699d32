"""Synthetic BF16 checkpoints for the benchmarks, built locally (nothing is downloaded).

* ``dense_specs``: Llama-3-8B-like shapes (q/k/v/o with 4:1 grouped KV heads, SwiGLU MLP at 3.5x the
  width, RMSNorms, untied embedding and LM head), width and depth scaled to a requested size.
* ``moe_specs``: Qwen3-MoE-like shapes (per layer: attention, q/k norms, router, ``experts`` each with
  gate/up/down projections), scaled in width; Qwen3-30B-A3B is 48 layers x 128 experts.

Checkpoints are Hugging Face directories of sharded safetensors with ``model.safetensors.index.json``,
written and changed tensor by tensor in bounded chunks (memory stays O(chunk), never O(model)).

Changes act as an optimizer's would on the stored BF16 values, never as random bits:

* ``uniform``: a uniformly random fraction of the elements moves by one or two ulps (the stored
  magnitude's integer ±1 or ±2; the sign is kept);
* ``adam``: an Adam-like step on a hidden FP32 master copy (the BF16 value plus sub-ulp noise, as
  mixed-precision training keeps it): ``master - lr * g`` with a unit-scale normalized update ``g``,
  rounded to nearest-even BF16. Only elements whose update crosses a rounding boundary change, so
  small-magnitude weights change more often, as in real RL steps. ``lr`` is calibrated for a
  requested change rate.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

CHUNK = 4 << 20  # elements per generation / change chunk (8 MiB of BF16)
INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class Spec:
    name: str
    shape: tuple[int, ...]
    std: float  # scale of the initial values (norm weights are ~1, the rest ~0.02)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return 2 * self.numel


def describe(specs: list[Spec]) -> str:
    total = sum(s.nbytes for s in specs)
    largest = max(specs, key=lambda s: s.nbytes)
    return (
        f"{len(specs)} tensors, {total / 2**30:.2f} GiB BF16, largest {largest.name} "
        f"{'x'.join(map(str, largest.shape))} ({largest.nbytes / 2**20:.0f} MiB)"
    )


def dense_specs(size_bytes: int, hidden: int | None = None) -> tuple[list[Spec], str]:
    """Llama-3-8B-like layers at a width chosen for ``size_bytes`` (hidden 4096 from 2.5 GiB up), or ``hidden``.

    With a fixed ``hidden`` the largest tensor stays the same whatever the size (only the depth changes):
    two sizes then tell memory that grows with the model from memory that grows with the largest tensor."""
    gib = 2**30
    hidden = hidden or (
        4096
        if size_bytes >= 2.5 * gib
        else 2048
        if size_bytes >= 0.6 * gib
        else 1024
        if size_bytes >= 96 << 20
        else 256
    )
    inter = hidden * 7 // 2  # 14336 at 4096
    kv = hidden // 4  # 8 KV heads of 128 at 4096
    vocab = 8 * hidden
    per_layer = 2 * (2 * hidden * hidden + 2 * kv * hidden + 3 * inter * hidden + 2 * hidden)
    fixed = 2 * (2 * vocab * hidden + hidden)
    layers = max(1, round((size_bytes - fixed) / per_layer))
    specs = [Spec("model.embed_tokens.weight", (vocab, hidden), 0.02)]
    for i in range(layers):
        p = f"model.layers.{i}"
        specs += [
            Spec(f"{p}.input_layernorm.weight", (hidden,), 1.0),
            Spec(f"{p}.self_attn.q_proj.weight", (hidden, hidden), 0.02),
            Spec(f"{p}.self_attn.k_proj.weight", (kv, hidden), 0.02),
            Spec(f"{p}.self_attn.v_proj.weight", (kv, hidden), 0.02),
            Spec(f"{p}.self_attn.o_proj.weight", (hidden, hidden), 0.02),
            Spec(f"{p}.post_attention_layernorm.weight", (hidden,), 1.0),
            Spec(f"{p}.mlp.gate_proj.weight", (inter, hidden), 0.02),
            Spec(f"{p}.mlp.up_proj.weight", (inter, hidden), 0.02),
            Spec(f"{p}.mlp.down_proj.weight", (hidden, inter), 0.02),
        ]
    specs += [Spec("model.norm.weight", (hidden,), 1.0), Spec("lm_head.weight", (vocab, hidden), 0.02)]
    return specs, f"dense 8B-like: hidden {hidden}, intermediate {inter}, kv {kv}, vocab {vocab}, {layers} layers"


def moe_specs(
    size_bytes: int | None = None,
    *,
    layers: int = 12,
    experts: int = 64,
    hidden: int | None = None,
    moe_intermediate: int | None = None,
    fused: bool = False,
) -> tuple[list[Spec], str]:
    """Qwen3-MoE-like layers; the width is ``hidden`` or fitted to ``size_bytes`` (multiple of 64).

    ``fused``: each layer's experts stored as three stacked [experts, out, in] tensors instead of
    3 x experts tensors (the same bytes and values in few tensors, for per-tensor overhead figures).
    """
    if hidden is None:
        assert size_bytes is not None
        # experts dominate: layers * experts * 3 * (3/8 h) * h * 2 bytes = 2.25 * layers * experts * h^2
        hidden = max(64, int(math.sqrt(size_bytes / (2.25 * layers * experts * 1.15)) // 64 * 64))
    mi = moe_intermediate or max(8, hidden * 3 // 8)  # 768 at 2048 (Qwen3-30B-A3B)
    head_dim = 64 if hidden < 1024 else 128
    heads = max(1, hidden // head_dim)
    kv_heads = max(1, heads // 8)
    vocab = 8 * hidden
    specs = [Spec("model.embed_tokens.weight", (vocab, hidden), 0.02)]
    for i in range(layers):
        p = f"model.layers.{i}"
        specs += [
            Spec(f"{p}.input_layernorm.weight", (hidden,), 1.0),
            Spec(f"{p}.self_attn.q_proj.weight", (heads * head_dim, hidden), 0.02),
            Spec(f"{p}.self_attn.k_proj.weight", (kv_heads * head_dim, hidden), 0.02),
            Spec(f"{p}.self_attn.v_proj.weight", (kv_heads * head_dim, hidden), 0.02),
            Spec(f"{p}.self_attn.o_proj.weight", (hidden, heads * head_dim), 0.02),
            Spec(f"{p}.self_attn.q_norm.weight", (head_dim,), 1.0),
            Spec(f"{p}.self_attn.k_norm.weight", (head_dim,), 1.0),
            Spec(f"{p}.post_attention_layernorm.weight", (hidden,), 1.0),
            Spec(f"{p}.mlp.gate.weight", (experts, hidden), 0.02),
        ]
        if fused:
            specs += [
                Spec(f"{p}.mlp.experts.gate_proj.weight", (experts, mi, hidden), 0.02),
                Spec(f"{p}.mlp.experts.up_proj.weight", (experts, mi, hidden), 0.02),
                Spec(f"{p}.mlp.experts.down_proj.weight", (experts, hidden, mi), 0.02),
            ]
        else:
            for e in range(experts):
                q = f"{p}.mlp.experts.{e}"
                specs += [
                    Spec(f"{q}.gate_proj.weight", (mi, hidden), 0.02),
                    Spec(f"{q}.up_proj.weight", (mi, hidden), 0.02),
                    Spec(f"{q}.down_proj.weight", (hidden, mi), 0.02),
                ]
    specs += [Spec("model.norm.weight", (hidden,), 1.0), Spec("lm_head.weight", (vocab, hidden), 0.02)]
    layout = "fused experts" if fused else f"{layers * experts * 3} expert tensors"
    return specs, (
        f"MoE Qwen3-like: {layers} layers x {experts} experts ({layout}), hidden {hidden}, "
        f"expert intermediate {mi}, vocab {vocab}"
    )


# -- safetensors writing -----------------------------------------------------------------------------------------------


def shard_plan(specs: list[Spec], shard_bytes: int) -> list[list[Spec]]:
    shards: list[list[Spec]] = [[]]
    size = 0
    for s in specs:
        if shards[-1] and size + s.nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(s)
        size += s.nbytes
    return shards


def _header(specs: list[Spec]) -> bytes:
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for s in specs:
        header[s.name] = {"dtype": "BF16", "shape": list(s.shape), "data_offsets": [offset, offset + s.nbytes]}
        offset += s.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8)


def shard_name(k: int, n: int) -> str:
    return f"model-{k + 1:05d}-of-{n:05d}.safetensors"


def chunks(numel: int) -> Iterator[tuple[int, int]]:
    for start in range(0, numel, CHUNK):
        yield start, min(numel, start + CHUNK)


def write_checkpoint(root: Path, shards: list[list[Spec]], fill: Callable[[Spec, int, int], np.ndarray]) -> Path:
    """Write a sharded checkpoint; ``fill(spec, start, stop)`` returns the uint16 bits of that chunk."""
    root.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    total = 0
    for k, part in enumerate(shards):
        name = shard_name(k, len(shards))
        header = _header(part)
        tmp = root / f".{name}.tmp"
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(header)))
            f.write(header)
            for s in part:
                for start, stop in chunks(s.numel):
                    bits = fill(s, start, stop)
                    assert bits.dtype == np.uint16 and bits.size == stop - start
                    f.write(bits.tobytes())
                weight_map[s.name] = name
                total += s.nbytes
        os.replace(tmp, root / name)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (root / INDEX).write_text(json.dumps(index, indent=1))
    return root


class Reader:
    """Memory-mapped read access to a checkpoint written by write_checkpoint (raw uint16 bits)."""

    def __init__(self, root: Path) -> None:
        self.views: dict[str, np.ndarray] = {}
        weight_map = json.loads((root / INDEX).read_text())["weight_map"]
        for file in sorted(set(weight_map.values())):
            path = root / file
            with open(path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(n))
            data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n)
            for name, meta in header.items():
                if name == "__metadata__":
                    continue
                a, b = meta["data_offsets"]
                self.views[name] = data[a:b].view(np.uint16)

    def chunk(self, name: str, start: int, stop: int) -> np.ndarray:
        return self.views[name][start:stop]


# -- values and changes ------------------------------------------------------------------------------------------------


def _seed(*parts: object) -> np.random.Generator:
    key = "/".join(map(str, parts)).encode()
    return np.random.default_rng(int.from_bytes(__import__("hashlib").blake2b(key, digest_size=8).digest(), "little"))


def bf16_round(x: np.ndarray) -> np.ndarray:
    """float32 -> BF16 bits, round to nearest even (finite inputs)."""
    u = x.astype(np.float32).view(np.uint32)
    return ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)


def initial_bits(spec: Spec, start: int, stop: int, seed: int) -> np.ndarray:
    rng = _seed("init", seed, spec.name, start)
    values = rng.standard_normal(stop - start, dtype=np.float32) * np.float32(spec.std)
    if spec.std >= 1.0:
        values = np.float32(1.0) + values * np.float32(0.05)  # norm weights around 1
    return bf16_round(values)


def nudge(bits: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Move each value by one or two ulps (magnitude integer ± 1..2, sign kept); never the same bits."""
    sign = bits & np.uint16(0x8000)
    mag = (bits & np.uint16(0x7FFF)).astype(np.int32)
    step = np.where(rng.random(bits.size) < 0.8, 1, 2) * np.where(rng.random(bits.size) < 0.5, -1, 1)
    new = mag + step
    new = np.where((new < 1) | (new >= 0x7F80), mag - step, new)  # stay finite and non-zero
    return (sign | new.astype(np.uint16)).astype(np.uint16)


def uniform_step(old: np.ndarray, rate: float, rng: np.random.Generator) -> np.ndarray:
    out = np.array(old, dtype=np.uint16, copy=True)
    k = rng.binomial(out.size, rate)
    pos = np.unique(rng.integers(0, out.size, size=k))
    out[pos] = nudge(out[pos], rng)
    return out


def adam_step(old: np.ndarray, lr: float, rng: np.random.Generator) -> np.ndarray:
    """Round-to-nearest BF16 of (FP32 master - lr * g); the master is the BF16 value plus sub-ulp noise."""
    master_bits = (old.astype(np.uint32) << np.uint32(16)) + rng.integers(0, 1 << 16, old.size, dtype=np.uint32)
    master_bits -= np.uint32(1 << 15)  # within half an ulp of the stored value on either side
    master = master_bits.view(np.float32)
    g = np.clip(rng.standard_normal(old.size, dtype=np.float32), -3, 3)  # Adam's m/sqrt(v): unit scale
    return bf16_round(master - np.float32(lr) * g)


def calibrate_adam_lr(rate: float, std: float = 0.02) -> float:
    """The lr at which adam_step changes about ``rate`` of the elements of N(0, std) weights."""
    rng = np.random.default_rng(1234)
    sample = bf16_round(rng.standard_normal(1 << 20, dtype=np.float32) * np.float32(std))
    lr = 1e-5
    for _ in range(4):
        got = float((adam_step(sample, lr, np.random.default_rng(5)) != sample).mean())
        lr *= rate / max(got, 1e-6)
    return lr


@dataclass(frozen=True)
class Step:
    kind: str  # "uniform" or "adam"
    rate: float  # fraction of elements (uniform) or the calibrated target (adam)

    @property
    def label(self) -> str:
        return f"{'u' if self.kind == 'uniform' else 'adam'}{self.rate * 100:g}%"


def build_chain(
    root: Path,
    specs: list[Spec],
    steps: list[Step],
    *,
    shard_bytes: int,
    seed: int = 0,
    log: Callable[[str], None] = print,
) -> list[Path]:
    """Checkpoints c0 (initial) .. cN (c_k = step k applied to c_{k-1}) under ``root``; reused when present."""
    shards = shard_plan(specs, shard_bytes)
    meta = {
        "specs": [[s.name, list(s.shape), s.std] for s in specs],
        "steps": [[s.kind, s.rate] for s in steps],
        "shard_bytes": shard_bytes,
        "seed": seed,
        "chunk": CHUNK,
        "v": 2,
    }
    stamp = root / "corpus.json"
    paths = [root / f"c{k}" for k in range(len(steps) + 1)]
    if stamp.exists() and json.loads(stamp.read_text()) == meta and all((p / INDEX).exists() for p in paths):
        return paths
    root.mkdir(parents=True, exist_ok=True)
    stamp.unlink(missing_ok=True)
    log(f"building corpus in {root}: {describe(specs)}, {len(shards)} shards")
    write_checkpoint(paths[0], shards, lambda s, a, b: initial_bits(s, a, b, seed))
    for k, st in enumerate(steps, start=1):
        prev = Reader(paths[k - 1])
        lr = calibrate_adam_lr(st.rate) if st.kind == "adam" else 0.0

        def fill(s: Spec, a: int, b: int, k: int = k, st: Step = st, lr: float = lr, prev: Reader = prev) -> np.ndarray:
            old = prev.chunk(s.name, a, b)
            rng = _seed("step", seed, k, s.name, a)
            return uniform_step(old, st.rate, rng) if st.kind == "uniform" else adam_step(old, lr, rng)

        write_checkpoint(paths[k], shards, fill)
        log(f"  c{k}: {st.label}" + (f" (lr {lr:.3g})" if lr else ""))
    stamp.write_text(json.dumps(meta))
    return paths
