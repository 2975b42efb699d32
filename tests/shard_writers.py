"""Real multi-rank training checkpoints for the shard tests and benchmarks (gloo on CPU).

``write_fsdp_checkpoints`` trains a small model under FSDP2 (``fully_shard``)
on W CPU ranks and saves, for a base and a target step: a PyTorch DCP
directory (``dcp.save``) and DCP's own Hugging Face export
(``HuggingFaceStorageWriter(save_distributed=True, enable_consolidation=True)``:
``hf/sharded/shard-*.safetensors`` plus the consolidated ``hf/*.safetensors``).

``write_megatron_checkpoints`` writes megatron-core's documented ``torch_dist``
layout by hand (megatron-core is not installed here; see format_spec/producers.md):
DCP directories whose keys are megatron's sharded keys, written with torch's
ShardedTensor from each tensor-parallel rank's local shards.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def spawn_ranks(worker: Callable[..., None], world: int, *args: object) -> None:
    """Runs ``worker(rank, world, *args)`` on ``world`` gloo ranks on the CPU; returns once every rank is done.

    The ranks meet through a FileStore, so there is no TCP port to race for,
    and a rank leaves only after every rank has torn down its process group:
    a rank that exits while a peer is still tearing down gloo can abort that
    peer (seen in CI as "terminate called without an active exception").
    """
    leave = mp.get_context("spawn").Barrier(world)
    with tempfile.TemporaryDirectory(prefix="dcr-gloo-") as tmp:
        mp.spawn(_rank_main, args=(world, f"{tmp}/store", leave, worker, args), nprocs=world, join=True)


def _rank_main(
    rank: int, world: int, store_file: str, leave: Any, worker: Callable[..., None], args: tuple[object, ...]
) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=world)
    worker(rank, world, *args)  # an exception here fails mp.spawn, which stops the other ranks
    dist.barrier()
    dist.destroy_process_group()
    leave.wait(timeout=600)


# ---------------------------------------------------------------- FSDP2 / DTensor
class TinyModel(torch.nn.Module):
    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.proj = torch.nn.Linear(hidden, hidden * 3)
        self.out = torch.nn.Linear(hidden * 3, hidden, bias=False)
        self.head = torch.nn.Linear(hidden, 2)  # 2 rows over 3 ranks: one chunk is empty
        self.norm = torch.nn.LayerNorm(hidden)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.out(torch.relu(self.proj(self.embed(tokens))))))


def _fsdp_worker(rank: int, world: int, out: str, vocab: int, hidden: int, steps: int) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    torch.manual_seed(0)
    model = TinyModel(vocab, hidden).to(torch.bfloat16)
    mesh = init_device_mesh("cpu", (world,))
    for m in (model.embed, model.proj, model.out, model.head):
        fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    # Column-sharded and replicated DTensors and a plain tensor, as other parallel layouts write them.
    g = torch.Generator().manual_seed(1)
    col_full = torch.randn(5, 4 * world + 1, generator=g).to(torch.bfloat16)  # Shard(1), uneven
    rep_full = torch.randn(7, generator=g).to(torch.bfloat16)
    extra = {
        "extra.col_sharded": distribute_tensor(col_full, mesh, [Shard(1)]),
        "extra.replicated": distribute_tensor(rep_full, mesh, [Replicate()]),
        "extra.plain_f32": torch.randn(3, 3, generator=g),
    }
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def save(tag: str) -> None:
        sd = {**model.state_dict(), **extra}
        dcp.save(sd, checkpoint_id=f"{out}/{tag}/dcp")
        dcp.save(
            sd,
            storage_writer=HuggingFaceStorageWriter(
                f"{out}/{tag}/hf", save_distributed=True, enable_consolidation=True
            ),
        )

    save("base")
    data = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        tokens = torch.randint(0, vocab // 2, (4, 6), generator=data)  # half the vocab: untouched rows stay
        model(tokens).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        # Special bit patterns in a rank's local shard: NaN with a payload, -0.0, an infinity.
        local = model.proj.weight.to_local().view(torch.int16)
        if local.numel() >= 3:
            local.view(-1)[0] = 0x7FC1  # NaN, payload 1
            local.view(-1)[1] = -0x8000  # -0.0
            local.view(-1)[2] = 0x7F80  # +inf
        extra["extra.col_sharded"].to_local().view(torch.int16).view(-1)[-1] ^= 1
        extra["extra.replicated"].to_local()[3] += 1.0  # the same change on every replica
        extra["extra.plain_f32"][1, 2] = float("nan")
    save("target")


def write_fsdp_checkpoints(out: str | Path, world: int = 3, vocab: int = 37, hidden: int = 16, steps: int = 2) -> Path:
    out = Path(out)
    spawn_ranks(_fsdp_worker, world, str(out), vocab, hidden, steps)
    return out


# ---------------------------------------------------------------- Megatron torch_dist (hand-written layout)
def megatron_globals(cfg: dict, seed: int) -> dict[str, torch.Tensor]:
    """Megatron-layout global tensors (what torch_dist stores), random, deterministic."""
    g = torch.Generator().manual_seed(seed)
    L, H = cfg["num_hidden_layers"], cfg["hidden_size"]
    heads, groups, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    vp = cfg["megatron"]["padded_vocab_size"]
    norm_dtype = torch.float32 if cfg["megatron"].get("norms_f32") else torch.bfloat16

    def r(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.02).to(dtype)

    t = {
        "embedding.word_embeddings.weight": r(vp, H),
        "decoder.final_layernorm.weight": r(H, dtype=norm_dtype),
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight": r(L, H, dtype=norm_dtype),
        "decoder.layers.self_attention.linear_qkv.weight": r(L, (heads + 2 * groups) * d, H),
        "decoder.layers.self_attention.linear_proj.weight": r(L, H, heads * d),
        "decoder.layers.self_attention.q_layernorm.weight": r(L, d, dtype=norm_dtype),
        "decoder.layers.self_attention.k_layernorm.weight": r(L, d, dtype=norm_dtype),
    }
    if cfg.get("tie_word_embeddings"):
        t["output_layer.weight"] = t["embedding.word_embeddings.weight"].clone()
    else:
        t["output_layer.weight"] = r(vp, H)
    if cfg.get("num_experts"):
        E, F = cfg["num_experts"], cfg["moe_intermediate_size"]
        t["decoder.layers.pre_mlp_layernorm.weight"] = r(L, H, dtype=norm_dtype)
        t["decoder.layers.mlp.router.weight"] = r(L, E, H)
        t["decoder.layers.mlp.experts.linear_fc1.weight"] = r(L, E, 2 * F, H)
        t["decoder.layers.mlp.experts.linear_fc2.weight"] = r(L, E, H, F)
    else:
        F = cfg["intermediate_size"]
        t["decoder.layers.mlp.linear_fc1.layer_norm_weight"] = r(L, H, dtype=norm_dtype)
        t["decoder.layers.mlp.linear_fc1.weight"] = r(L, 2 * F, H)
        t["decoder.layers.mlp.linear_fc2.weight"] = r(L, H, F)
    return t


def megatron_local_boxes(key: str, shape: tuple[int, ...], cfg: dict, rank: int, tp: int) -> list[tuple[list, list]]:
    """The boxes (offsets, sizes) TP/EP rank ``rank`` owns of global tensor ``key``, as megatron-core shards them.

    Stacked layers: one box per layer. Column parallel splits the output axis
    (qkv by query groups, fc1 as [gate_t ; up_t] fragments), row parallel the
    input axis, the vocab-parallel embedding/output layer split rows; norms and
    the router are replicated, saved by replica 0 (rank 0) only; experts are
    split across ranks by expert (expert parallel).
    """
    layered = key.startswith("decoder.layers.")
    n_layers = shape[0] if layered else 1
    body = shape[1:] if layered else shape
    boxes: list[tuple[list, list]] = []

    def split(axis: int, parts: int, index: int) -> tuple[list, list]:
        off, size = [0] * len(body), list(body)
        n = body[axis] // parts
        off[axis], size[axis] = index * n, n
        return off, size

    for layer in range(n_layers):
        if key.endswith("linear_qkv.weight") or (key.endswith("linear_fc1.weight") and "experts" not in key):
            if key.endswith("linear_fc1.weight"):
                f = body[0] // 2  # [gate ; up]: this rank's gate rows and its up rows
                n = f // tp
                local = [([rank * n, 0], [n, body[1]]), ([f + rank * n, 0], [n, body[1]])]
            else:
                local = [split(0, tp, rank)]
        elif key.endswith("linear_proj.weight") or (key.endswith("linear_fc2.weight") and "experts" not in key):
            local = [split(1, tp, rank)]
        elif key.startswith("embedding.") or key.startswith("output_layer."):
            local = [split(0, tp, rank)]
        elif "experts" in key:
            local = [split(0, tp, rank)]  # expert parallel over the same ranks
        else:
            local = [([0] * len(body), list(body))] if rank == 0 else []  # replicated: written once
        for off, size in local:
            boxes.append(([layer, *off], [1, *size]) if layered else (off, size))
    return boxes


def _megatron_worker(rank: int, world: int, out: str, cfg: dict, seeds: dict[str, int]) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, init_from_local_shards

    for tag, seed in seeds.items():
        full = megatron_globals(cfg, seed)
        if tag == "target":
            full = mutate_megatron(full, cfg)
        sd = {}
        for key, tensor in full.items():
            shards = []
            for off, size in megatron_local_boxes(key, tuple(tensor.shape), cfg, rank, world):
                sl = tuple(slice(o, o + s) for o, s in zip(off, size, strict=True))
                local = tensor[sl].clone()
                shards.append(Shard(local, ShardMetadata(off, size, f"rank:{rank}/cpu")))
            sd[key] = init_from_local_shards(shards, *tensor.shape)
        dcp.save(sd, checkpoint_id=f"{out}/{tag}/torch_dist")


def mutate_megatron(t: dict[str, torch.Tensor], cfg: dict) -> dict[str, torch.Tensor]:
    """A training-step-like change: small perturbations of a few elements, plus NaN and -0.0 bit patterns."""
    g = torch.Generator().manual_seed(7)
    out = {}
    for key, x in t.items():
        y = x.clone()
        flat = y.view(-1)
        n = max(1, flat.numel() // 20)
        idx = torch.randint(0, flat.numel(), (n,), generator=g)
        flat[idx] = (flat[idx].float() * 1.01 + 1e-3).to(flat.dtype)
        if key == "decoder.layers.self_attention.linear_qkv.weight":
            ints = flat.view(torch.int16)
            ints[5] = 0x7FC3
            ints[6] = -0x8000
        out[key] = y
    if cfg.get("tie_word_embeddings"):
        out["output_layer.weight"] = out["embedding.word_embeddings.weight"].clone()
    return out


def write_megatron_checkpoints(out: str | Path, cfg: dict, world: int = 2) -> Path:
    out = Path(out)
    spawn_ranks(_megatron_worker, world, str(out), cfg, {"base": 11, "target": 11})
    return out


def megatron_to_hf(t: dict[str, torch.Tensor], cfg: dict) -> dict[str, torch.Tensor]:
    """Reference dense conversion (independent of dcr): full Megatron tensors -> HF state dict."""
    L, H = cfg["num_hidden_layers"], cfg["hidden_size"]
    heads, groups, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    V = cfg["vocab_size"]
    hpg = heads // groups
    zc = cfg["megatron"].get("zero_centered_gamma", False)
    hf_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[cfg["torch_dtype"]]

    def norm(x: torch.Tensor) -> torch.Tensor:
        return ((x.float() + 1.0) if zc else x).to(hf_dtype)

    def w(x: torch.Tensor) -> torch.Tensor:
        return x.to(hf_dtype)

    out = {"model.embed_tokens.weight": w(t["embedding.word_embeddings.weight"][:V])}
    if not cfg.get("tie_word_embeddings"):
        out["lm_head.weight"] = w(t["output_layer.weight"][:V])
    out["model.norm.weight"] = norm(t["decoder.final_layernorm.weight"])
    for i in range(L):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = norm(t["decoder.layers.self_attention.linear_qkv.layer_norm_weight"][i])
        qkv = t["decoder.layers.self_attention.linear_qkv.weight"][i].reshape(groups, hpg + 2, d, H)
        out[p + "self_attn.q_proj.weight"] = w(qkv[:, :hpg].reshape(heads * d, H))
        out[p + "self_attn.k_proj.weight"] = w(qkv[:, hpg].reshape(groups * d, H))
        out[p + "self_attn.v_proj.weight"] = w(qkv[:, hpg + 1].reshape(groups * d, H))
        out[p + "self_attn.o_proj.weight"] = w(t["decoder.layers.self_attention.linear_proj.weight"][i])
        out[p + "self_attn.q_norm.weight"] = norm(t["decoder.layers.self_attention.q_layernorm.weight"][i])
        out[p + "self_attn.k_norm.weight"] = norm(t["decoder.layers.self_attention.k_layernorm.weight"][i])
        if cfg.get("num_experts"):
            out[p + "post_attention_layernorm.weight"] = norm(t["decoder.layers.pre_mlp_layernorm.weight"][i])
            out[p + "mlp.gate.weight"] = w(t["decoder.layers.mlp.router.weight"][i])
            for e in range(cfg["num_experts"]):
                gate, up = t["decoder.layers.mlp.experts.linear_fc1.weight"][i, e].chunk(2)
                out[p + f"mlp.experts.{e}.gate_proj.weight"] = w(gate)
                out[p + f"mlp.experts.{e}.up_proj.weight"] = w(up)
                out[p + f"mlp.experts.{e}.down_proj.weight"] = w(
                    t["decoder.layers.mlp.experts.linear_fc2.weight"][i, e]
                )
        else:
            out[p + "post_attention_layernorm.weight"] = norm(t["decoder.layers.mlp.linear_fc1.layer_norm_weight"][i])
            gate, up = t["decoder.layers.mlp.linear_fc1.weight"][i].chunk(2)
            out[p + "mlp.gate_proj.weight"] = w(gate)
            out[p + "mlp.up_proj.weight"] = w(up)
            out[p + "mlp.down_proj.weight"] = w(t["decoder.layers.mlp.linear_fc2.weight"][i])
    return {k: v.contiguous() for k, v in out.items()}


# ---------------------------------------------------------------- real megatron-core (when installed)
REAL_MEGATRON_KEYS = {
    # spellings of megatron-core's local layer spec -> the names megatron_to_hf uses
    "decoder.layers.mlp.experts.experts.linear_fc1.weight": "decoder.layers.mlp.experts.linear_fc1.weight",
    "decoder.layers.mlp.experts.experts.linear_fc2.weight": "decoder.layers.mlp.experts.linear_fc2.weight",
}


def megatron_gpt_worker(
    rank: int,
    world: int,
    out: str,
    cfg: dict,
    tp: int,
    ep: int,
    etp: int | None = None,
    grouped: bool = False,
    singleton: bool = False,
    poisoned: tuple[str, ...] = ("linear_qkv.weight",),
) -> None:
    """Builds megatron-core's GPTModel (local layer spec, CPU init) and saves base and target as torch_dist.

    The target is a training-step-like change in every rank's local shards, plus a NaN payload and
    -0.0 in every parameter whose name ends with one of ``poisoned``. ``etp``: expert tensor parallel
    size (None: megatron's default, the attention TP). ``singleton``: megatron's
    singleton_local_shards layout, passed as its own save path does (to the model and as the
    checkpoint's content_metadata).
    """
    # megatron-core's torch_dist saver synchronizes CUDA and reduces a flag on the current CUDA device;
    # with a CPU-only torch these two calls are the only obstacle, so they are pointed at the CPU.
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp
    )
    kw = dict(
        num_layers=cfg["num_hidden_layers"],
        hidden_size=cfg["hidden_size"],
        num_attention_heads=cfg["num_attention_heads"],
        num_query_groups=cfg["num_key_value_heads"],
        kv_channels=cfg["head_dim"],
        ffn_hidden_size=cfg["intermediate_size"],
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        normalization="RMSNorm",
        add_bias_linear=False,
        use_cpu_initialization=True,
        params_dtype=torch.bfloat16,
        bf16=True,
        qk_layernorm=True,
        tensor_model_parallel_size=tp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
    )
    if cfg.get("num_experts"):
        kw.update(num_moe_experts=cfg["num_experts"], moe_ffn_hidden_size=cfg["moe_intermediate_size"],
                  moe_router_topk=2, moe_grouped_gemm=grouped)  # fmt: skip
    torch.manual_seed(0)
    model = GPTModel(
        TransformerConfig(**kw),
        get_gpt_layer_local_spec(num_experts=cfg.get("num_experts"), qk_layernorm=True, moe_grouped_gemm=grouped),
        vocab_size=cfg["megatron"]["padded_vocab_size"],
        max_sequence_length=32,
        share_embeddings_and_output_weights=bool(cfg.get("tie_word_embeddings")),
        position_embedding_type="rope",
    )
    metadata = {"singleton_local_shards": True} if singleton else None
    for tag in ("base", "target"):
        if tag == "target":
            g = torch.Generator().manual_seed(rank)
            with torch.no_grad():
                for name, p in model.named_parameters():
                    flat = p.data.view(-1)
                    idx = torch.randint(0, flat.numel(), (max(1, flat.numel() // 20),), generator=g)
                    flat[idx] = (flat[idx].float() * 1.01 + 1e-3).to(flat.dtype)
                    if name.endswith(poisoned):
                        ints = flat.view(torch.int16)
                        ints[3], ints[4] = 0x7FC3, -0x8000
        Path(f"{out}/{tag}/torch_dist").mkdir(parents=True, exist_ok=True)
        dist_checkpointing.save(
            model.sharded_state_dict(metadata=metadata), f"{out}/{tag}/torch_dist", content_metadata=metadata
        )
        dist.barrier()


def _real_megatron_worker(rank: int, world: int, out: str, cfg: dict) -> None:
    """TP = world for a dense model, EP = world for an MoE."""
    tp, ep = (1, world) if cfg.get("num_experts") else (world, 1)
    megatron_gpt_worker(rank, world, out, cfg, tp=tp, ep=ep)


def write_real_megatron_checkpoints(out: str | Path, cfg: dict, world: int = 2) -> Path:
    out = Path(out)
    spawn_ranks(_real_megatron_worker, world, str(out), cfg)
    return out


def full_tensors_from_dcp(path: str | Path, scratch: str | Path, moe: bool = False) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP checkpoint, whole, loaded by torch's own DCP reader (the reference, not dcr)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    file = Path(scratch) / "full.pt"
    dcp_to_torch_save(str(path), str(file))
    full = torch.load(file, weights_only=False)
    file.unlink()
    keys = dict(REAL_MEGATRON_KEYS)
    if moe:  # the local MoE spec keeps the pre-MLP norm under the dense spelling
        keys["decoder.layers.mlp.linear_fc1.layer_norm_weight"] = "decoder.layers.pre_mlp_layernorm.weight"
    return {keys.get(k, k): v for k, v in full.items() if isinstance(v, torch.Tensor)}
