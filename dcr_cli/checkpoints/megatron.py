"""Megatron-core ``torch_dist`` checkpoints of Llama/Qwen3-style dense and MoE models.

``torch_dist`` is a DCP directory (``.metadata`` + ``*.distcp``) whose keys are
megatron-core's sharded keys. This module is the name-and-layout *profile*
that maps them onto Hugging Face canonical tensors, as segments (index-only
maps, format_spec/producers.md):

- stacked layers: ``decoder.layers.*`` tensors carry a leading layer axis [L, ...];
  layer ``l`` is the box ``[l:l+1, ...]`` with that axis dropped;
- MoE expert tensors carry a second stacked axis [L, E, ...];
- column/row tensor parallelism: only changes which chunks exist; segments are
  in global coordinates, so any chunking projects through them;
- ``linear_qkv`` rows interleave per query group ``[q_g (heads/group * d); k_g (d); v_g (d)]``:
  3 x groups row blocks per layer;
- SwiGLU ``linear_fc1`` is ``[gate; up]``: two row blocks;
- vocab padding: rows >= vocab_size of the embedding and output layer are not canonical;
- tied output layer: a duplicate of the embedding, checked (residual "tied"), never emitted.

Value-changing conversions are residual: a stored dtype other than the HF one
(cast, round-to-nearest-even by torch), and ``layernorm_zero_centered_gamma``
(canonical = float32(stored) + 1, cast to the HF dtype).

The model's dimensions come from the Hugging Face ``config.json`` of the
receiver's model (``--profile``), optionally with a ``"megatron"`` object:
``{"zero_centered_gamma": bool, "prefix": str}``. A ``quantization_config`` with
``"quant_method": "fp8"`` (DeepSeek-V3 style) makes the attention and MLP linear
weights FP8 block-quantized, each with a ``weight_scale_inv``: both residual (fp8.py).
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import FormatError, IncompatibleError
from ..format.dtypes import from_torch, to_torch, torch_uint
from ..format.strict_json import load_json
from ..io.reading import read_regular_file
from .fp8 import DEFAULT_BLOCK, Fp8Quantizer, fp8_convert, scale_shape
from .shards import CanonicalTensor, Segment, ShardReader, StoredTensor

EMBEDDING_KEY = "embedding.word_embeddings.weight"


def looks_like_megatron(keys: list[str]) -> bool:
    return any(k.endswith(EMBEDDING_KEY) for k in keys) and any("decoder.layers." in k for k in keys)


def load_profile(path: str | os.PathLike[str] | None) -> dict[str, Any]:
    if path is None:
        raise IncompatibleError(
            "a Megatron torch_dist checkpoint needs --profile CONFIG.json (the HF config.json of the model)"
        )
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        profile = load_json(_read_profile(p), str(p))
    except (OSError, FormatError) as exc:
        raise IncompatibleError(f"cannot read the Megatron profile {p}: {exc}") from None
    if not isinstance(profile, dict):
        raise IncompatibleError(f"the Megatron profile {p} is not a JSON object (give the model's HF config.json)")
    return profile


MAX_PROFILE_BYTES = 16 << 20  # an HF config.json is a few KiB


def _read_profile(path: Path) -> bytes:
    if path.stat().st_size > MAX_PROFILE_BYTES:
        raise FormatError(f"{path}: {path.stat().st_size} bytes is too large for a model config")
    return read_regular_file(path)


RESIDUAL_DTYPES = ("BF16", "F16", "F32")  # the float dtypes a residual conversion reads and writes


def _hf_dtype(config: dict[str, Any]) -> str | None:
    """The checkpoint dtype the HF config names (torch_dtype / dtype), if it is one dcr converts to."""
    try:
        name = from_torch(str(config.get("torch_dtype") or config.get("dtype") or "")).name
    except FormatError:
        return None
    return name if name in RESIDUAL_DTYPES else None


def _cast(src: str, dst: str, add_one: bool) -> Callable[[np.ndarray], np.ndarray]:
    source, target = to_torch(src), to_torch(dst)

    def convert(stored: np.ndarray) -> np.ndarray:
        import torch

        t = torch.from_numpy(np.ascontiguousarray(stored)).view(source)
        if add_one:
            t = t.float() + 1.0
        out = t.to(target)
        return out.view(torch_uint(out.element_size())).numpy().view(f"<u{out.element_size()}")

    return convert


# Keys only megatron-core's ``singleton_local_shards`` layout writes: layers not stacked (one key per
# layer index), SwiGLU fc1 split into ``_w``/``_v`` tensors, experts under their own global keys.
_SINGLETON_KEY = re.compile(
    r"decoder\.layers\.\d+\.|linear_fc1\.(weight|bias)\d*_[wv]$|\.experts\.(experts\.)?\d+\.linear_fc[12]\."
)


def singleton_local_shards_key(stored: dict[str, Any], prefix: str) -> str | None:
    """A stored key of the ``singleton_local_shards`` layout (the first, sorted), or None."""
    hits = sorted(k for k in stored if k.startswith(prefix) and _SINGLETON_KEY.search(k, len(prefix)))
    return hits[0] if hits else None


def megatron_canonical(reader: ShardReader, config: dict[str, Any]) -> dict[str, CanonicalTensor]:
    stored = reader.stored
    meg = config.get("megatron") or {}
    prefix = meg.get("prefix")
    if prefix is None:
        hits = [k[: -len(EMBEDDING_KEY)] for k in stored if k.endswith(EMBEDDING_KEY)]
        if len(hits) != 1:
            raise IncompatibleError(f"{reader.root}: cannot find the one {EMBEDDING_KEY} of a Megatron checkpoint")
        prefix = hits[0]
    zero_centered = bool(meg.get("zero_centered_gamma", False))
    try:
        hidden = int(config["hidden_size"])
        layers = int(config["num_hidden_layers"])
        heads = int(config["num_attention_heads"])
        groups = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or hidden // heads)
        vocab = int(config["vocab_size"])
    except (KeyError, TypeError, ValueError) as exc:
        raise IncompatibleError(f"Megatron profile lacks a model dimension: {exc}") from None
    hf_dtype = _hf_dtype(config)
    tied = bool(config.get("tie_word_embeddings", False))
    experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)
    heads_per_group = heads // groups

    out: dict[str, CanonicalTensor] = {}

    def key(name: str) -> str:
        return prefix + name

    def need(*names: str) -> str:
        """The first of alternative spellings (layer specs differ: local vs Transformer Engine) that is stored."""
        for name in names:
            if key(name) in stored:
                return key(name)
        singleton = singleton_local_shards_key(stored, prefix)
        if singleton is not None:
            raise IncompatibleError(
                f"{reader.root}: saved with megatron-core's singleton_local_shards layout (per-layer keys, SwiGLU "
                f"split into _w/_v, one key per expert, e.g. {singleton!r}), which dcr does not read; save with "
                "the default torch_dist layout (no singleton_local_shards in the sharded_state_dict metadata) "
                "or export to Hugging Face safetensors and diff those"
            )
        raise IncompatibleError(
            f"{reader.root}: Megatron key {key(names[0])!r} is missing (does --profile match the model?)"
        )

    def add(name: str, shape: tuple[int, ...], segments: list[Segment], norm: bool = False) -> None:
        src = stored[segments[0].key].dtype
        dst = hf_dtype or src
        reasons = []
        if src != dst:
            reasons.append(f"dtype cast {src}->{dst}")
        if norm and zero_centered:
            reasons.append("zero-centred norm +1")
        residual = ", ".join(reasons) or None
        if residual:
            check_dtype_support(src)
            check_dtype_support(dst)
        convert = _cast(src, dst, norm and zero_centered) if residual else None
        out[name] = CanonicalTensor(name, dst, shape, segments, residual, convert, src if residual else None)

    def whole(k: str, name: str, shape: tuple[int, ...], norm: bool = False) -> None:
        zero = (0,) * len(shape)
        add(name, shape, [Segment(k, zero, shape, name, zero)], norm)

    def per_layer(k: str, name: str, shape: tuple[int, ...], norm: bool = False) -> None:
        for layer in range(layers):
            zero = (0,) * len(shape)
            n = f"model.layers.{layer}.{name}"
            add(n, shape, [Segment(k, (layer, *zero), (1, *shape), n, zero)], norm)

    # embedding and output layer: crop the vocab padding
    emb = need(EMBEDDING_KEY)
    whole_emb = (vocab, hidden)
    add("model.embed_tokens.weight", whole_emb, [Segment(emb, (0, 0), whole_emb, "model.embed_tokens.weight", (0, 0))])
    out_key = key("output_layer.weight")
    if not tied:
        need("output_layer.weight")
        whole(out_key, "lm_head.weight", whole_emb)
    whole(need("decoder.final_layernorm.weight"), "model.norm.weight", (hidden,), norm=True)

    att = "decoder.layers.self_attention."
    input_norm = need(att + "linear_qkv.layer_norm_weight", "decoder.layers.input_layernorm.weight")
    per_layer(input_norm, "input_layernorm.weight", (hidden,), norm=True)
    qkv = need(att + "linear_qkv.weight")
    rows_per_group = (heads_per_group + 2) * head_dim
    if stored[qkv].shape[1] != groups * rows_per_group:
        raise IncompatibleError(f"{qkv}: {stored[qkv].shape[1]} rows, the profile implies {groups * rows_per_group}")
    for layer in range(layers):
        q, k_, v = (f"model.layers.{layer}.self_attn.{p}_proj.weight" for p in "qkv")
        segs: dict[str, list[Segment]] = {q: [], k_: [], v: []}
        q_rows = heads_per_group * head_dim
        for g in range(groups):
            base = g * rows_per_group
            segs[q].append(Segment(qkv, (layer, base, 0), (1, q_rows, hidden), q, (g * q_rows, 0)))
            segs[k_].append(Segment(qkv, (layer, base + q_rows, 0), (1, head_dim, hidden), k_, (g * head_dim, 0)))
            segs[v].append(
                Segment(qkv, (layer, base + q_rows + head_dim, 0), (1, head_dim, hidden), v, (g * head_dim, 0))
            )
        add(q, (heads * head_dim, hidden), segs[q])
        add(k_, (groups * head_dim, hidden), segs[k_])
        add(v, (groups * head_dim, hidden), segs[v])
    per_layer(need(att + "linear_proj.weight"), "self_attn.o_proj.weight", (hidden, heads * head_dim))
    if key(att + "q_layernorm.weight") in stored:
        per_layer(key(att + "q_layernorm.weight"), "self_attn.q_norm.weight", (head_dim,), norm=True)
        per_layer(need(att + "k_layernorm.weight"), "self_attn.k_norm.weight", (head_dim,), norm=True)

    mlp = "decoder.layers.mlp."
    if experts:
        inter = int(config.get("moe_intermediate_size") or config["intermediate_size"])
        pre_mlp = need("decoder.layers.pre_mlp_layernorm.weight", mlp + "linear_fc1.layer_norm_weight")
        per_layer(pre_mlp, "post_attention_layernorm.weight", (hidden,), True)
        per_layer(need(mlp + "router.weight"), "mlp.gate.weight", (experts, hidden))
        # grouped experts (TEGroupedMLP) or sequential local experts (SequentialMLP)
        fc1 = need(mlp + "experts.linear_fc1.weight", mlp + "experts.experts.linear_fc1.weight")
        fc2 = need(mlp + "experts.linear_fc2.weight", mlp + "experts.experts.linear_fc2.weight")
        for layer in range(layers):
            for e in range(experts):
                pre = f"model.layers.{layer}.mlp.experts.{e}."
                gate, up, down = pre + "gate_proj.weight", pre + "up_proj.weight", pre + "down_proj.weight"
                add(gate, (inter, hidden), [Segment(fc1, (layer, e, 0, 0), (1, 1, inter, hidden), gate, (0, 0))])
                add(up, (inter, hidden), [Segment(fc1, (layer, e, inter, 0), (1, 1, inter, hidden), up, (0, 0))])
                add(down, (hidden, inter), [Segment(fc2, (layer, e, 0, 0), (1, 1, hidden, inter), down, (0, 0))])
    else:
        inter = int(config["intermediate_size"])
        pre_mlp = need(mlp + "linear_fc1.layer_norm_weight", "decoder.layers.pre_mlp_layernorm.weight")
        per_layer(pre_mlp, "post_attention_layernorm.weight", (hidden,), True)
        fc1 = need(mlp + "linear_fc1.weight")
        for layer in range(layers):
            pre = f"model.layers.{layer}.mlp."
            gate, up = pre + "gate_proj.weight", pre + "up_proj.weight"
            add(gate, (inter, hidden), [Segment(fc1, (layer, 0, 0), (1, inter, hidden), gate, (0, 0))])
            add(up, (inter, hidden), [Segment(fc1, (layer, inter, 0), (1, inter, hidden), up, (0, 0))])
        per_layer(need(mlp + "linear_fc2.weight"), "mlp.down_proj.weight", (hidden, inter))
    return quantize_fp8(out, config, reader.stored)


# The 2-D linear weights of attention and MLP (experts included); not embeddings, norms, router, lm_head.
FP8_LINEAR = re.compile(
    r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(experts\.\d+\.)?(gate|up|down)_proj)\.weight"
)


def fp8_block(config: dict[str, Any]) -> tuple[int, int] | None:
    """The block of an fp8 ``quantization_config`` (None without one); anything else is refused."""
    quant = config.get("quantization_config")
    if not quant:
        return None
    if not isinstance(quant, dict) or quant.get("quant_method") != "fp8" or quant.get("fmt", "e4m3") != "e4m3":
        raise IncompatibleError(
            f"unsupported quantization_config {quant!r}: dcr produces only fp8 (e4m3) block quantization"
        )
    block = quant.get("weight_block_size", list(DEFAULT_BLOCK))
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise IncompatibleError(f"quantization_config weight_block_size must be two positive integers, not {block!r}")
    return block[0], block[1]


def quantize_fp8(
    out: dict[str, CanonicalTensor], config: dict[str, Any], stored: dict[str, StoredTensor]
) -> dict[str, CanonicalTensor]:
    """Replace each quantized linear weight by its F8_E4M3 weight and F32 weight_scale_inv (both residual)."""
    block = fp8_block(config)
    if block is None:
        return out
    skip = config["quantization_config"].get("modules_to_not_convert") or []
    tag = f"{block[0]}x{block[1]}"
    for name in [n for n in out if FP8_LINEAR.fullmatch(n)]:
        if any(m in name.removesuffix(".weight") for m in skip):  # substring match, as transformers does
            continue
        t = out[name]
        src = stored[t.segments[0].key].dtype
        check_dtype_support(src)
        joint = Fp8Quantizer(src, block)  # one quantization of the source for both outputs
        quantize = fp8_convert(src, block, "weight", joint)
        out[name] = CanonicalTensor(
            name, "F8_E4M3", t.shape, t.segments, f"fp8 block quantization ({tag})", quantize, src
        )
        scale_name = name + "_scale_inv"
        out[scale_name] = CanonicalTensor(
            scale_name,
            "F32",
            scale_shape(t.shape, block),
            [dataclasses.replace(seg, name=scale_name) for seg in t.segments],
            f"fp8 block scale ({tag})",
            fp8_convert(src, block, "scale", joint),
            src,
            source_shape=t.shape,
        )
    return out


def tied_duplicates(reader: ShardReader, config: dict[str, Any]) -> list[tuple[str, str]]:
    """(stored duplicate key, canonical tensor it must equal): checked on the residual path, never emitted."""
    if not config.get("tie_word_embeddings"):
        return []
    prefix = (config.get("megatron") or {}).get("prefix")
    if prefix is None:
        prefix = next(k[: -len(EMBEDDING_KEY)] for k in reader.stored if k.endswith(EMBEDDING_KEY))
    k = prefix + "output_layer.weight"
    return [(k, "model.embed_tokens.weight")] if k in reader.stored else []


def check_dtype_support(dt: str) -> None:
    if dt not in RESIDUAL_DTYPES:
        raise FormatError(f"Megatron residual conversion from {dt} is not supported")
