"""The Qwen3 dense family: HF `Qwen3ForCausalLM`, LLaMA's tables plus a per-head RMSNorm on q and k.

HF Qwen3 normalises each head of q and k over `head_dim` (`self_attn.q_norm` / `k_norm`, eps `rms_norm_eps`)
before RoPE, as megatron-core's `qk_layernorm` does; `head_dim` is its own field (Qwen3Config defaults it to
128, so a config that omits it is refused), and `attention_bias` puts a bias on q, k, v and o together, which
no ModelSpec switch holds. FasterTransformer and TensorRT-LLM have no Qwen3 form here.
"""

from __future__ import annotations

from typing import Any

from mconvert.errors import MConvertError
from mconvert.mappings import llama, qwen2
from mconvert.mappings.record import Family, GgufLayout, Plugin, Rule
from mconvert.mappings.fields import REFUSED, Field
from mconvert.spec import ModelSpec

NAME = "qwen3"
L, H = llama.L, llama.H

# the per-head q/k RMSNorms every family with them names alike (Qwen3, Qwen3-MoE, GLM-4.5, Gemma 3)
QK_NORM_TABLE = {
    L + "self_attention.q_layernorm.weight": Rule((H + "self_attn.q_norm.weight",)),
    L + "self_attention.k_layernorm.weight": Rule((H + "self_attn.k_norm.weight",)),
}
QK_NORM_GGUF = {H + "self_attn.q_norm.weight": "blk.*.attn_q_norm.weight",
                H + "self_attn.k_norm.weight": "blk.*.attn_k_norm.weight"}

TABLE = Plugin(
    family=NAME,
    table={**llama.TABLE.table, **QK_NORM_TABLE},
    hf_drops=llama.TABLE.hf_drops,
)

# Every field of transformers 4.57's Qwen3Config: the RoPE fields (rope_scaling included), Qwen2's sliding
# window fields, and its all-or-nothing attention bias.
HF_FIELDS: dict[str, Field] = {
    **llama.ROPE_FIELDS,
    **{k: v for k, v in qwen2.HF_FIELDS.items() if k not in llama.ROPE_FIELDS},
    "attention_bias": Field(REFUSED, "biases on q, k, v and o without MLP biases are not mapped", False),
}


def to_hf(spec: ModelSpec) -> dict[str, Any]:
    """Qwen3Config fields: qk-norm, no linear bias, head_dim and rope scaling explicit, the window (Qwen2's
    fields)."""
    llama.check_rope_style(spec, FAMILY.architecture, qk_norm=True)
    if spec.has_qkv_bias or spec.add_bias_linear:
        raise MConvertError("a qwen3-family model has no linear bias (HF Qwen3's attention_bias is all-or-nothing)")
    if spec.rotary_interleaved:
        raise MConvertError(f"HF {FAMILY.architecture}: rotary_interleaved=True with per-head q/k norm is not "
                            "mapped (the norm weights would need the same reordering); conversion refused")
    return {**llama.rope_fields(spec), "attention_bias": False, **qwen2.window_fields(spec)}


# Qwen3Config's head_dim when config.json leaves it out (transformers, and vLLM, which reads its config through
# transformers); a reader falling back to the modeling code's getattr default takes hidden_size / heads instead
HF_DEFAULT_HEAD_DIM = 128


def from_hf(cfg: dict[str, Any], common: dict[str, Any], source: str) -> ModelSpec:
    """A Qwen3Config dict -> ModelSpec (qk-norm, no bias); an absent `head_dim` is read only where both readings
    of it (the class default 128, hidden_size / num_attention_heads) agree."""
    if cfg.get("head_dim") is None and (cfg["hidden_size"] != HF_DEFAULT_HEAD_DIM * cfg["num_attention_heads"]):
        raise MConvertError(f"{source}: a Qwen3 config must state head_dim (transformers defaults it to "
                            f"{HF_DEFAULT_HEAD_DIM}, not hidden_size / num_attention_heads); add it")
    return llama.rope_spec(cfg, common, add_bias_linear=False, add_qkv_bias=False, qk_layernorm=True,
                           source=source).replace(**qwen2.window_from_hf(cfg, source))


def recognise(fields: dict[str, Any]) -> bool:
    """Megatron args without model_family: qk-norm without any linear bias is Qwen3."""
    return bool(fields["qk_layernorm"]) and not fields["add_qkv_bias"] and not fields["add_bias_linear"]


PRESETS = {
    # head_dim 32 with hidden 128 and 8 heads: head_dim != hidden / heads, as in the Qwen3 releases
    "tiny-qwen3": llama.rope_preset(NAME, num_layers=2, hidden_size=128, num_attention_heads=8,
                                    num_query_groups=2, kv_channels=32, ffn_hidden_size=256, vocab_size=1000,
                                    max_position_embeddings=128, norm_epsilon=1e-6, rotary_base=1000000.0,
                                    tie_embeddings=True, qk_layernorm=True),
}

# llama.cpp's QWEN3 architecture: NeoX-order rope (no q/k permutation) and the per-head q/k norms.
GGUF = GgufLayout(
    arch="qwen3",
    tensors={**llama.GGUF_TENSORS, **QK_NORM_GGUF},
    permute_qk=False,
    refuse=llama.gguf_refuse_rope_freqs,
)

FAMILY = Family(**llama.rope_family(
    NAME, "Qwen3", plugin=TABLE, hf_fields=HF_FIELDS, to_hf=to_hf, from_hf=from_hf, presets=PRESETS,
    recognise=recognise, recognise_order=20,
    ft=None,  # FasterTransformer has no q/k norm
    trtllm=None,  # no confirmed TensorRT-LLM Qwen3 layout
    gguf=GGUF,
    hf_window="per_layer",
    vllm=qwen2.VLLM,  # vLLM runs Qwen3 on its Qwen2Model
))
