"""Key normalization: every Megatron spelling of a parameter -> its canonical megatron-core local-spec name.

Spellings handled: mcore `decoder.*` (local and TE spec: `linear_qkv.layer_norm_weight`,
`linear_fc1.layer_norm_weight`, MLA's `linear_q_up_proj` / `linear_kv_up_proj.layer_norm_weight`), legacy `language_model.*` flat keys and the legacy nested dict
(`model['language_model']['encoder'][...]`, flattened first), `transformer` vs `encoder`,
`input_norm`/`input_layernorm`, `post_attention_norm|layernorm`, `final_norm|final_layernorm`,
`query_key_value`, `dense`, `dense_h_to_4h`, `dense_4h_to_h`, `word_embeddings_for_head`.
The layer index stays stage-local here; the reader makes it global.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

# Explicit drops: buffers and Transformer Engine metadata that are not parameters (`None` = drop).
DROP_SUFFIXES: dict[str, None] = {
    "._extra_state": None,
    ".inv_freq": None,  # rotary buffers (rotary_pos_emb.inv_freq, rotary_emb.inv_freq)
    ".attention.bias": None,  # legacy causal-mask buffers
    ".attention.masked_bias": None,
    ".attn.bias": None,
    ".attn.masked_bias": None,
}

# Legacy prefixes -> mcore prefixes (first match wins, longest first).
PREFIXES: dict[str, str] = {
    "language_model.embedding.": "embedding.",
    "language_model.encoder.": "decoder.",
    "language_model.transformer.": "decoder.",
    "language_model.output_layer.": "output_layer.",
    "word_embeddings_for_head.": "output_layer.",
    "encoder.": "decoder.",
    "transformer.": "decoder.",
}

# Legacy / TE module names -> mcore local-spec names, matched as whole dotted segments.
SEGMENTS: dict[str, str] = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias",
    # MLA in the TE spec: the latent norms fused into the up projections
    "self_attention.linear_q_up_proj.layer_norm_weight": "self_attention.q_layernorm.weight",
    "self_attention.linear_kv_up_proj.layer_norm_weight": "self_attention.kv_layernorm.weight",
    "self_attention.query_key_value": "self_attention.linear_qkv",
    "attention.query_key_value": "self_attention.linear_qkv",
    "self_attention.dense": "self_attention.linear_proj",
    "attention.dense": "self_attention.linear_proj",
    "mlp.dense_h_to_4h": "mlp.linear_fc1",
    "mlp.dense_4h_to_h": "mlp.linear_fc2",
    "input_norm": "input_layernorm",
    "post_attention_norm": "pre_mlp_layernorm",
    "post_attention_layernorm": "pre_mlp_layernorm",
    "final_norm": "final_layernorm",
    "mtp_model_layer": "transformer_layer",  # newer Megatron-LM's name of an MTP layer's transformer layer
}


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Legacy nested model dict -> flat dotted keys; leaves other than tensors/None are kept as they are."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping) and not isinstance(v, torch.Tensor):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def is_dropped(key: str) -> bool:
    return any(key.endswith(s) for s in DROP_SUFFIXES)


def grouped_expert_key(name: str) -> str:
    """TE grouped-GEMM expert spelling -> the SequentialMLP one: `mlp.experts.linear_fc1.weight3` ->
    `mlp.experts.local_experts.3.linear_fc1.weight` (3 = the local expert index); other names pass through."""
    parts = name.split(".")
    if len(parts) < 3 or parts[-3] != "experts" or parts[-2] not in ("linear_fc1", "linear_fc2"):
        return name
    last = parts[-1]
    for kind in ("weight", "bias"):
        if last.startswith(kind) and last[len(kind):].isdigit():
            return ".".join(parts[:-2] + ["local_experts", last[len(kind):], parts[-2], kind])
    return name


def canonical_key(key: str) -> str | None:
    """Any Megatron spelling -> canonical mcore local name (stage-local index), or None for an explicit drop."""
    if is_dropped(key):
        return None
    key = grouped_expert_key(key)
    name = key
    for old, new in PREFIXES.items():
        if name.startswith(old):
            name = new + name[len(old):]
            break
    for old, new in SEGMENTS.items():
        if f".{old}." in f".{name}.":
            name = f".{name}.".replace(f".{old}.", f".{new}.", 1)[1:-1]
    return name


def unit_of(name: str) -> str | int:
    """Canonical name -> its unit: 'embedding', the layer index, or 'final'."""
    if name.startswith("embedding."):
        return "embedding"
    if name.startswith("decoder.layers."):
        return int(name.split(".")[2])
    return "final"


def with_layer(name: str, layer: int) -> str:
    """`decoder.layers.3.x` -> `decoder.layers.<layer>.x`."""
    parts = name.split(".")
    parts[2] = str(layer)
    return ".".join(parts)
