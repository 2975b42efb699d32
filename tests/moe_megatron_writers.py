"""megatron-core MoE checkpoints written by megatron-core itself (GPTModel + dist_checkpointing, torch_dist, gloo).

One writer for several parallel layouts of the same tiny Qwen3-MoE-like GPT (4 experts, top-2,
qk-norm, RMSNorm kept in F32 by megatron, vocab padded 50 -> 64): expert parallel, attention
tensor parallel with expert tensor parallel, attention tensor parallel with experts expert-parallel
over the same ranks, and SequentialMLP or the legacy GroupedMLP experts.

The legacy GroupedMLP refuses to be built without the ``grouped_gemm`` CUDA extension, although
only its forward uses it; the writer gives it an empty stand-in module, so megatron-core's own
``GroupedMLP.sharded_state_dict`` (weight1/weight2 [H, E_local*2F] re-viewed per expert) runs.
"""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import torch
from shard_writers import megatron_gpt_worker, spawn_ranks

LAYOUTS: dict[str, dict[str, int | bool]] = {
    "ep2-sequential": dict(tp=1, ep=2, etp=1, grouped=False),
    "ep2-grouped": dict(tp=1, ep=2, etp=1, grouped=True),  # legacy GroupedMLP
    "tp2-etp2": dict(tp=2, ep=1, etp=2, grouped=False),  # expert tensor parallel
    "tp2-ep2": dict(tp=2, ep=2, etp=1, grouped=False),  # attention TP, experts EP over the same 2 ranks
    # megatron-core's singleton_local_shards layout: per-layer keys, SwiGLU fc1 as _w/_v, a key per expert
    "ep2-sequential-singleton": dict(tp=1, ep=2, etp=1, grouped=False, singleton=True),
    "ep2-grouped-singleton": dict(tp=1, ep=2, etp=1, grouped=True, singleton=True),
    "tp2-etp2-singleton": dict(tp=2, ep=1, etp=2, grouped=False, singleton=True),  # _w/_v halves split by TP
}


def _worker(rank: int, world: int, out: str, cfg: dict, layout: dict) -> None:
    if layout["grouped"] and "grouped_gemm" not in sys.modules:
        stand_in = types.ModuleType("grouped_gemm")
        stand_in.ops = types.SimpleNamespace()  # type: ignore[attr-defined]
        sys.modules["grouped_gemm"] = stand_in
    megatron_gpt_worker(
        rank,
        world,
        out,
        cfg,
        tp=int(layout["tp"]),
        ep=int(layout["ep"]),
        etp=int(layout["etp"]),
        grouped=bool(layout["grouped"]),
        singleton=bool(layout.get("singleton")),
        poisoned=("linear_qkv.weight", "weight1", "linear_fc1.weight"),
    )


def write_megatron_moe(out: str | Path, cfg: dict, layout: str) -> Path:
    out = Path(out)
    spawn_ranks(_worker, 2, str(out), cfg, LAYOUTS[layout])
    return out


def restack_singleton(full: dict[str, torch.Tensor], cfg: dict) -> dict[str, torch.Tensor]:
    """A singleton_local_shards checkpoint's tensors in the default layout's keys, by plain torch (not dcr):
    per-layer keys stacked on a layer axis, ``_w``/``_v`` concatenated, per-expert keys stacked on an expert axis."""
    out = {k: v for k, v in full.items() if not k.startswith("decoder.layers.")}
    per_layer: dict[str, dict[int, torch.Tensor]] = {}
    for k, v in full.items():
        m = re.fullmatch(r"decoder\.layers\.(\d+)\.(.+)", k)
        if m:
            per_layer.setdefault(m.group(2), {})[int(m.group(1))] = v
    for name in [n for n in per_layer if n.endswith("_v")]:
        gate, up = per_layer.pop(name[:-2] + "_w"), per_layer.pop(name)
        per_layer[name[:-2]] = {i: torch.cat([gate[i], up[i]]) for i in gate}
    experts: dict[str, dict[int, dict[int, torch.Tensor]]] = {}
    for name in list(per_layer):
        m = re.fullmatch(r"mlp\.experts\.experts\.(\d+)\.(.+)", name)
        if m:
            experts.setdefault(m.group(2), {})[int(m.group(1))] = per_layer.pop(name)
    for name, by_expert in experts.items():
        E = cfg["num_experts"]
        per_layer[f"mlp.experts.experts.{name}"] = {
            i: torch.stack([by_expert[e][i] for e in range(E)]) for i in by_expert[0]
        }
    for name, by_layer in per_layer.items():
        out[f"decoder.layers.{name}"] = torch.stack([by_layer[i] for i in range(cfg["num_hidden_layers"])])
    return out


def chunk_boxes(path: str | Path, key: str) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The (offsets, sizes) of every chunk DCP stored for ``key`` (read from its .metadata by torch)."""
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(path)).read_metadata().state_dict_metadata[key]
    return sorted((tuple(c.offsets), tuple(c.sizes)) for c in meta.chunks)  # type: ignore[union-attr]


TE_EXPERT = re.compile(r"(decoder\.layers\.\d+\.mlp\.experts\.)experts\.(\d+)\.(linear_fc[12])\.weight(_[wv])?")


def write_te_grouped_spelling(src: str | Path, dst: str | Path, scratch: str | Path) -> Path:
    """A hand-made copy of a singleton_local_shards checkpoint with its experts under Transformer Engine
    GroupedLinear's own spelling, ``decoder.layers.<L>.mlp.experts.linear_fc1.weight<E>`` (E global, the
    SwiGLU fc1 joint [gate; up] as GroupedLinear holds it), saved by torch.distributed.checkpoint
    (Transformer Engine does not run on a CPU-only torch, so TEGroupedMLP itself cannot write it here)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    file = Path(scratch) / "te.pt"
    dcp_to_torch_save(str(src), str(file))
    full = {k: v for k, v in torch.load(file, weights_only=False).items() if isinstance(v, torch.Tensor)}
    file.unlink()
    out: dict[str, torch.Tensor] = {}
    for k, v in full.items():
        m = TE_EXPERT.fullmatch(k)
        if m is None:
            out[k] = v
        elif m.group(4) != "_v":
            name = f"{m.group(1)}{m.group(3)}.weight{m.group(2)}"
            out[name] = torch.cat([v, full[k[:-2] + "_v"]]) if m.group(4) == "_w" else v
    dcp.save(out, storage_writer=dcp.FileSystemWriter(str(dst)), no_dist=True)
    return Path(dst)
