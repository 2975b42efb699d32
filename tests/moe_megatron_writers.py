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

import copy
import re
import sys
import types
from pathlib import Path
from typing import Any

import torch
from shard_writers import _megatron_worker, megatron_gpt_worker, spawn_ranks

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


def _grouped_gemm_stand_in() -> None:
    if "grouped_gemm" not in sys.modules:  # before megatron-core is imported: it looks once, at import
        stand_in = types.ModuleType("grouped_gemm")
        stand_in.ops = types.SimpleNamespace()  # type: ignore[attr-defined]
        sys.modules["grouped_gemm"] = stand_in


def moe_layout(name: str) -> dict[str, Any]:
    """megatron_gpt_worker's arguments for the MoE layout ``name`` of LAYOUTS."""
    layout = LAYOUTS[name]
    return dict(
        tp=int(layout["tp"]),
        ep=int(layout["ep"]),
        etp=int(layout["etp"]),
        grouped=bool(layout["grouped"]),
        singleton=bool(layout.get("singleton")),
        poisoned=("linear_qkv.weight", "weight1", "linear_fc1.weight"),
    )


def _write_together(rank: int, world: int, out: str, jobs: list[tuple[str, dict, dict[str, Any]]]) -> None:
    """Each job (name, cfg, megatron_gpt_worker's layout arguments) in turn on the same gloo ranks, into
    ``out/name``; megatron-core's model-parallel groups are torn down between two."""
    if any(layout.get("grouped") for _, _, layout in jobs):
        _grouped_gemm_stand_in()
    for name, cfg, layout in jobs:
        megatron_gpt_worker(rank, world, f"{out}/{name}", cfg, **layout)
        from megatron.core import parallel_state as ps

        ps.destroy_model_parallel()


# megatron_core_checkpoint's jobs, by name (registered as the test modules are imported), and the
# checkpoints written so far.
_JOBS: dict[str, tuple[dict, dict[str, Any]]] = {}
_WRITTEN: dict[str, Path] = {}


def register_megatron_core(name: str, cfg: dict, **layout: Any) -> None:
    """Declare a checkpoint (base and target torch_dist, megatron_gpt_worker(cfg, **layout) on 2 ranks) that
    ``megatron_core_checkpoint(name)`` gives; a test module registers its own names when it is imported."""
    job = (copy.deepcopy(cfg), layout)
    if _JOBS.setdefault(name, job) != job:
        raise ValueError(f"megatron-core checkpoint {name!r} is registered twice, differently")


def megatron_core_checkpoint(tmp_path_factory: Any, name: str) -> Path:
    """The root (``base/torch_dist``, ``target/torch_dist``) of the registered checkpoint ``name``.

    Two gloo ranks that import torch and megatron-core cost about ten seconds before they write
    anything, so the first call writes every registered checkpoint not written yet, in one run of the
    ranks (by megatron-core's own writer, one after the other, each on its own parallel layout), and
    later calls, from any module of the session, get theirs from it. The checkpoints are only read; the
    module that registered a name may add its own exports beside them (``base/hf``)."""
    if name not in _WRITTEN:
        todo = [(n, *job) for n, job in _JOBS.items() if n not in _WRITTEN]
        root = tmp_path_factory.mktemp("megatron-core")
        spawn_ranks(_write_together, 2, str(root), todo)
        _WRITTEN.update({n: root / n for n, _, _ in todo})
    return _WRITTEN[name]


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


def _hand_written_together(rank: int, world: int, jobs: list[tuple[str, dict]]) -> None:
    for out, cfg in jobs:
        _megatron_worker(rank, world, out, cfg, {"base": 11, "target": 11})


def write_megatron_checkpoints_together(jobs: list[tuple[str | Path, dict]], world: int = 2) -> None:
    """``shard_writers.write_megatron_checkpoints(out, cfg, world)`` (the hand-written torch_dist layout) for
    every (out, cfg) of ``jobs``, in one run of the gloo ranks: they start once, not once per checkpoint."""
    spawn_ranks(_hand_written_together, world, [(str(out), cfg) for out, cfg in jobs])
