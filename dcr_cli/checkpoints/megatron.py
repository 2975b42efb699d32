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
- tied output layer: a duplicate of the embedding, checked (residual "tied"), never emitted;
- megatron-core's ``singleton_local_shards`` layout: a key per layer (``decoder.layers.<L>.*``, no layer
  axis), SwiGLU fc1 as ``*_w`` (gate) and ``*_v`` (up), a key per expert (``mlp.experts.experts.<E>.*``,
  no expert axis); TE GroupedLinear's ``mlp.experts.linear_fc1.weight<E>``. Every stored key a tensor
  is read from is checked to have the shape the profile implies.

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


# megatron-core's ``singleton_local_shards`` layout (megatron-core 0.16: SequentialMLP, legacy GroupedMLP and
# TEGroupedMLP write the same keys) and what non-homogeneous layers write are read as well as the default:
# layers not stacked (``decoder.layers.<L>.name``, no layer axis), SwiGLU fc1 split into ``<key>_w`` (gate)
# and ``<key>_v`` (up), experts under their own global keys (``mlp.experts.experts.<E>.linear_fc1.weight_w``).
# TE GroupedLinear's module spelling ``mlp.experts.linear_fc1.weight<E>`` (E global) is read too.

# Where one layer's (and one expert's) tensor is stored: the key, and the leading indices that select
# the layer (and expert) in it; () when the key holds that layer (or expert) alone.
Located = tuple[str, tuple[int, ...]]


def expert_spellings(key: Callable[[str], str], layer: int, e: int, fc: str) -> list[Located]:
    """Where expert ``e`` of ``layer`` may be stored: its own key (``singleton_local_shards``: SequentialMLP,
    GroupedMLP and TEGroupedMLP alike), TE GroupedLinear's ``weight<E>``, then stacked in a per-layer key
    [E, ...] or in the [L, E, ...] key of the default layout."""
    own, stacked = f"decoder.layers.{layer}.mlp.experts.", "decoder.layers.mlp.experts."
    return [
        (key(f"{own}experts.{e}.{fc}.weight"), ()),
        (key(f"{own}{fc}.weight{e}"), ()),
        (key(f"{own}experts.{fc}.weight"), (e,)),
        (key(f"{own}{fc}.weight"), (e,)),
        (key(f"{stacked}{fc}.weight"), (layer, e)),
        (key(f"{stacked}experts.{fc}.weight"), (layer, e)),
    ]


_REQUIRED_DIMS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
_OPTIONAL_DIMS = ("num_key_value_heads", "head_dim", "intermediate_size", "moe_intermediate_size")
_EXPERT_COUNTS = ("num_experts", "num_local_experts")


def check_profile(config: Any) -> None:
    """Every value of a Megatron profile that the map reads, of the type it is read as (producers.md §4).

    Values are never coerced: ``bool("false")`` is True, so a flag spelled as a string would turn on a
    value-changing conversion (``zero_centered_gamma``) or drop a tensor (``tie_word_embeddings``), and
    a string of module names would be matched character by character; each is refused in one line.
    """

    def refuse(what: str, value: object, want: str) -> IncompatibleError:
        return IncompatibleError(f"Megatron profile: {what} must be {want}, not {value!r}")

    if not isinstance(config, dict):
        raise refuse("the profile", config, "a JSON object (the model's HF config.json)")
    for name in _REQUIRED_DIMS:
        if name not in config:
            raise IncompatibleError(f"Megatron profile lacks a model dimension: {name}")
        if not _is_positive(config[name]):
            raise refuse(name, config[name], "a positive integer")
    for name in _OPTIONAL_DIMS:
        if config.get(name) is not None and not _is_positive(config[name]):
            raise refuse(name, config[name], "a positive integer (or absent)")
    for name in _EXPERT_COUNTS:
        v = config.get(name)
        if v is not None and not (_is_positive(v) or (v == 0 and not isinstance(v, bool))):
            raise refuse(name, v, "a non-negative integer (or absent)")
    experts = config.get("num_experts") or config.get("num_local_experts")
    if config.get("intermediate_size") is None and not (experts and config.get("moe_intermediate_size")):
        raise IncompatibleError("Megatron profile lacks a model dimension: intermediate_size")
    tied = config.get("tie_word_embeddings")
    if tied is not None and not isinstance(tied, bool):
        raise refuse("tie_word_embeddings", tied, "true or false")
    meg = config.get("megatron")
    if meg is not None:
        if not isinstance(meg, dict):
            raise refuse('"megatron"', meg, 'an object ({"zero_centered_gamma": bool, "prefix": str})')
        if meg.get("prefix") is not None and not isinstance(meg["prefix"], str):
            raise refuse("megatron.prefix", meg["prefix"], "a string")
        if meg.get("zero_centered_gamma") is not None and not isinstance(meg["zero_centered_gamma"], bool):
            raise refuse("megatron.zero_centered_gamma", meg["zero_centered_gamma"], "true or false")
    quant = config.get("quantization_config")
    skip = quant.get("modules_to_not_convert") if isinstance(quant, dict) else None
    if skip is not None and not (isinstance(skip, list) and all(isinstance(m, str) for m in skip)):
        raise refuse("quantization_config.modules_to_not_convert", skip, "a list of module names")


def megatron_canonical(reader: ShardReader, config: dict[str, Any]) -> dict[str, CanonicalTensor]:
    check_profile(config)
    stored = reader.stored
    meg = config.get("megatron") or {}
    prefix = meg.get("prefix")
    if prefix is None:
        hits = [k[: -len(EMBEDDING_KEY)] for k in stored if k.endswith(EMBEDDING_KEY)]
        if len(hits) != 1:
            raise IncompatibleError(f"{reader.root}: cannot find the one {EMBEDDING_KEY} of a Megatron checkpoint")
        prefix = hits[0]
    # check_profile refused every value of another type: the dimensions are ints, the flags bools.
    zero_centered: bool = meg.get("zero_centered_gamma", False)
    hidden: int = config["hidden_size"]
    layers: int = config["num_hidden_layers"]
    heads: int = config["num_attention_heads"]
    groups: int = config.get("num_key_value_heads") or heads
    head_dim: int = config.get("head_dim") or hidden // heads
    vocab: int = config["vocab_size"]
    hf_dtype = _hf_dtype(config)
    tied: bool = config.get("tie_word_embeddings", False)
    experts: int = config.get("num_experts") or config.get("num_local_experts") or 0
    heads_per_group = heads // groups

    out: dict[str, CanonicalTensor] = {}

    def key(name: str) -> str:
        return prefix + name

    def need(*names: str) -> str:
        """The first of alternative spellings (layer specs differ: local vs Transformer Engine) that is stored."""
        for name in names:
            if key(name) in stored:
                return key(name)
        raise IncompatibleError(
            f"{reader.root}: Megatron key {key(names[0])!r} is missing (does --profile match the model?)"
        )

    def located(candidates: list[Located], shape: tuple[int, ...], what: str) -> Located:
        """The first candidate stored, checked to hold ``shape`` after its leading (layer, expert) indices."""
        for k, lead in candidates:
            if k not in stored:
                continue
            have = tuple(stored[k].shape)
            if len(have) != len(lead) + len(shape) or have[len(lead) :] != shape:
                raise IncompatibleError(
                    f"{reader.root}: {k} is {list(have)}, the profile implies {what} {list(shape)} ({shape[0]} rows)"
                    + (f" after {len(lead)} stacked axes" if lead else "")
                    + "; does --profile match the model?"
                )
            return k, lead
        raise IncompatibleError(
            f"{reader.root}: Megatron key {candidates[0][0]!r} is missing (does --profile match the model?)"
        )

    def in_layer(layer: int, names: tuple[str, ...], shape: tuple[int, ...]) -> Located:
        """A layer's tensor: its own key ``decoder.layers.<L>.name`` or the stacked ``decoder.layers.name``."""
        cands: list[Located] = []
        for name in names:
            cands += [(key(f"decoder.layers.{layer}.{name}"), ()), (key(f"decoder.layers.{name}"), (layer,))]
        return located(cands, shape, names[0])

    def seg(at: Located, off: tuple[int, ...], size: tuple[int, ...], name: str, dst: tuple[int, ...]) -> Segment:
        k, lead = at
        return Segment(k, (*lead, *off), ((1,) * len(lead) + size), name, dst)

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

    def per_layer(names: tuple[str, ...], name: str, shape: tuple[int, ...], norm: bool = False) -> None:
        zero = (0,) * len(shape)
        for layer in range(layers):
            n = f"model.layers.{layer}.{name}"
            add(n, shape, [seg(in_layer(layer, names, shape), zero, shape, n, zero)], norm)

    def gated(cands: list[Located], rows: int, cols: int, gate: str, up: str, what: str) -> tuple[Segment, Segment]:
        """SwiGLU fc1 ``[gate; up]``: one [2F, H] tensor, or its ``_w`` (gate) and ``_v`` (up) halves."""
        for k, lead in cands:
            w, v = k + "_w", k + "_v"
            if w in stored or v in stored:
                if not (w in stored and v in stored):
                    raise IncompatibleError(
                        f"{reader.root}: {w if w in stored else v} is stored without its SwiGLU other half "
                        f"{v if w in stored else w}; the checkpoint is incomplete"
                    )
                at_w = located([(w, lead)], (rows, cols), what + " gate half")
                at_v = located([(v, lead)], (rows, cols), what + " up half")
                return (
                    seg(at_w, (0, 0), (rows, cols), gate, (0, 0)),
                    seg(at_v, (0, 0), (rows, cols), up, (0, 0)),
                )
            if k in stored:
                at = located([(k, lead)], (2 * rows, cols), what)
                return seg(at, (0, 0), (rows, cols), gate, (0, 0)), seg(at, (rows, 0), (rows, cols), up, (0, 0))
        raise IncompatibleError(
            f"{reader.root}: Megatron key {cands[0][0]!r} is missing (does --profile match the model?)"
        )

    # embedding and output layer: crop the vocab padding
    emb = need(EMBEDDING_KEY)
    whole_emb = (vocab, hidden)
    add("model.embed_tokens.weight", whole_emb, [Segment(emb, (0, 0), whole_emb, "model.embed_tokens.weight", (0, 0))])
    out_key = key("output_layer.weight")
    if not tied:
        need("output_layer.weight")
        whole(out_key, "lm_head.weight", whole_emb)
    whole(need("decoder.final_layernorm.weight"), "model.norm.weight", (hidden,), norm=True)

    att = "self_attention."
    norm_names = (att + "linear_qkv.layer_norm_weight", "input_layernorm.weight")
    per_layer(norm_names, "input_layernorm.weight", (hidden,), True)
    rows_per_group = (heads_per_group + 2) * head_dim
    q_rows = heads_per_group * head_dim
    for layer in range(layers):
        qkv = in_layer(layer, (att + "linear_qkv.weight",), (groups * rows_per_group, hidden))
        q, k_, v = (f"model.layers.{layer}.self_attn.{p}_proj.weight" for p in "qkv")
        segs: dict[str, list[Segment]] = {q: [], k_: [], v: []}
        for g in range(groups):
            base = g * rows_per_group
            segs[q].append(seg(qkv, (base, 0), (q_rows, hidden), q, (g * q_rows, 0)))
            segs[k_].append(seg(qkv, (base + q_rows, 0), (head_dim, hidden), k_, (g * head_dim, 0)))
            segs[v].append(seg(qkv, (base + q_rows + head_dim, 0), (head_dim, hidden), v, (g * head_dim, 0)))
        add(q, (heads * head_dim, hidden), segs[q])
        add(k_, (groups * head_dim, hidden), segs[k_])
        add(v, (groups * head_dim, hidden), segs[v])
    per_layer((att + "linear_proj.weight",), "self_attn.o_proj.weight", (hidden, heads * head_dim))
    qn = att + "q_layernorm.weight"
    if key("decoder.layers." + qn) in stored or key(f"decoder.layers.0.{qn}") in stored:
        per_layer((qn,), "self_attn.q_norm.weight", (head_dim,), norm=True)
        per_layer((att + "k_layernorm.weight",), "self_attn.k_norm.weight", (head_dim,), norm=True)

    mlp = "mlp."
    if experts:
        inter = config.get("moe_intermediate_size") or config["intermediate_size"]
        norm_names = ("pre_mlp_layernorm.weight", mlp + "linear_fc1.layer_norm_weight")
        per_layer(norm_names, "post_attention_layernorm.weight", (hidden,), True)
        per_layer((mlp + "router.weight",), "mlp.gate.weight", (experts, hidden))
        for layer in range(layers):
            for e in range(experts):
                pre = f"model.layers.{layer}.mlp.experts.{e}."
                gate, up, down = pre + "gate_proj.weight", pre + "up_proj.weight", pre + "down_proj.weight"
                fc1 = expert_spellings(key, layer, e, "linear_fc1")
                g_seg, u_seg = gated(fc1, inter, hidden, gate, up, "expert linear_fc1")
                add(gate, (inter, hidden), [g_seg])
                add(up, (inter, hidden), [u_seg])
                fc2 = located(expert_spellings(key, layer, e, "linear_fc2"), (hidden, inter), "expert linear_fc2")
                add(down, (hidden, inter), [seg(fc2, (0, 0), (hidden, inter), down, (0, 0))])
    else:
        inter = config["intermediate_size"]
        norm_names = (mlp + "linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight")
        per_layer(norm_names, "post_attention_layernorm.weight", (hidden,), True)
        for layer in range(layers):
            pre = f"model.layers.{layer}.mlp."
            gate, up = pre + "gate_proj.weight", pre + "up_proj.weight"
            joint = mlp + "linear_fc1.weight"
            cands = [(key(f"decoder.layers.{layer}.{joint}"), ()), (key(f"decoder.layers.{joint}"), (layer,))]
            g_seg, u_seg = gated(cands, inter, hidden, gate, up, "linear_fc1")
            add(gate, (inter, hidden), [g_seg])
            add(up, (inter, hidden), [u_seg])
        per_layer((mlp + "linear_fc2.weight",), "mlp.down_proj.weight", (hidden, inter))
    _check_layer_count(reader.root, stored, key("decoder.layers."), layers)
    return quantize_fp8(out, config, reader.stored)


def _check_layer_count(root: Any, stored: dict[str, StoredTensor], layers_prefix: str, layers: int) -> None:
    """The checkpoint holds exactly the profile's layers: a stacked key's first axis, or the indices of
    per-layer keys. Without this a profile with fewer layers would diff only the first ones, silently."""
    for k, t in stored.items():
        if not k.startswith(layers_prefix):
            continue
        head = k[len(layers_prefix) :].split(".", 1)[0]
        if head.isdigit():
            if int(head) >= layers:
                raise IncompatibleError(
                    f"{root}: {k} is layer {head}, but the profile has {layers} layers; does --profile match the model?"
                )
        elif t.shape and t.shape[0] != layers:
            raise IncompatibleError(
                f"{root}: {k} stacks {t.shape[0]} layers, but the profile has {layers}; does --profile match the model?"
            )


# The 2-D linear weights of attention and MLP (experts included); not embeddings, norms, router, lm_head.
FP8_LINEAR = re.compile(
    r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(experts\.\d+\.)?(gate|up|down)_proj)\.weight"
)


def _is_positive(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0  # bool is an int in Python


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
    if not (isinstance(block, list) and len(block) == 2 and all(_is_positive(b) for b in block)):
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
