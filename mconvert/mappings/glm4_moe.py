"""The GLM-4.5 family: HF `Glm4MoeForCausalLM` — grouped-query attention with q/k/v bias (`attention_bias`; o_proj
has none), optional per-head q/k RMSNorm (`use_qk_norm`), partial rotary and the DeepSeek MoE (sigmoid router with
expert bias, group-limited top-k, shared experts, dense first layers) with multi-token prediction layers.

Partial rotary: `partial_rotary_factor` is megatron-core's `rotary_percent`. Both rotate the first
head_dim · factor dims of each head with rotate_half pairs (i, i + rot/2), frequencies 1 / base^(2i / rot), and
pass the rest unchanged, so q/k rows are copied as they are. The MoE layer and the MTP layers use DeepSeek-V3's
names and rules (`deepseek_v3.MOE_TABLE`, `MTP_TABLE`, `MTP_COPIES`).
"""

from __future__ import annotations

from typing import Any

from mconvert.errors import MConvertError
from mconvert.mappings import deepseek_v3, llama, qwen3
from mconvert.mappings.record import Family, GgufLayout, Plugin
from mconvert.mappings.fields import BOOL, NUM, Field, mapped, neutral
from mconvert.spec import ModelSpec

NAME = "glm4_moe"
L, H = llama.L, llama.H

TABLE = Plugin(
    family=NAME,
    table={
        **{k: v for k, v in llama.TABLE.table.items() if k not in deepseek_v3.MOE_TABLE},
        **qwen3.QK_NORM_TABLE,
        **deepseek_v3.MOE_TABLE,
        **deepseek_v3.MTP_TABLE,
    },
    hf_drops=llama.TABLE.hf_drops,
    mtp_copies=deepseek_v3.MTP_COPIES,
)

# Every field of transformers 4.57's Glm4MoeConfig beyond the common ones.
HF_FIELDS: dict[str, Field] = {
    **{k: v for k, v in llama.HF_FIELDS.items() if k not in ("attention_bias", "mlp_bias", "partial_rotary_factor")},
    **deepseek_v3.MOE_HF_FIELDS,
    "partial_rotary_factor": mapped("rotary_percent", NUM),
    "attention_bias": mapped("add_qkv_bias", BOOL),
    "use_qk_norm": mapped("qk_layernorm", BOOL),
    # vLLM's Glm4Moe reads these of DeepSeek's; transformers' class has no other router
    "scoring_func": deepseek_v3.HF_FIELDS["scoring_func"],
    "topk_method": deepseek_v3.HF_FIELDS["topk_method"],
    **neutral("training only", "aux_loss_alpha", "seq_aux", "ep_size", "router_aux_loss_coef"),
    "use_cache": Field("neutral", "inference cache"),
}

# Glm4MoeConfig's defaults of the MoE fields
CLASS_DEFAULTS = {"first_k_dense_replace": 1, "moe_intermediate_size": 1408, "n_shared_experts": 1, "n_group": 1,
                  "topk_group": 1, "n_routed_experts": 128, "num_experts_per_tok": 8, "routed_scaling_factor": 1.0}


def to_hf(spec: ModelSpec) -> dict[str, Any]:
    """Glm4MoeConfig fields (with vLLM's scoring_func / topk_method); refuses what the class cannot compute."""
    arch = FAMILY.architecture
    if spec.is_mla:
        raise MConvertError(f"HF {arch} has grouped-query attention; this model has multi-latent attention "
                            "(kv_lora_rank): use the deepseek_v3 family; conversion refused")
    if spec.add_bias_linear:
        raise MConvertError(f"HF {arch} has biases on q, k and v only (attention_bias); this model has "
                            "add_bias_linear=True (o_proj and MLP biases); conversion refused")
    if spec.rotary_interleaved:
        raise MConvertError(f"HF {arch} rotates rotate_half pairs; rotary_interleaved=True is not mapped")
    spec_ = spec.replace(num_experts=None, rotary_percent=1.0, moe_router_score_function="softmax",
                         moe_router_enable_expert_bias=False, moe_layer_freq=1, mtp_num_layers=None,
                         moe_router_topk_scaling_factor=None, moe_router_num_groups=None, moe_router_group_topk=None,
                         moe_shared_expert_intermediate_size=None)
    return {**llama.rope_fields(spec_), **deepseek_v3.moe_to_hf(spec, arch),
            "partial_rotary_factor": spec.rotary_percent, "attention_bias": spec.has_qkv_bias,
            "use_qk_norm": spec.qk_layernorm, "scoring_func": "sigmoid", "topk_method": "noaux_tc"}


def from_hf(cfg: dict[str, Any], common: dict[str, Any], source: str) -> ModelSpec:
    """A Glm4MoeConfig dict -> ModelSpec (transformers' defaults where a field is absent)."""
    bias = bool(cfg.get("attention_bias", False))
    base = llama.rope_spec(cfg, common, add_bias_linear=False, add_qkv_bias=bias,
                           qk_layernorm=bool(cfg.get("use_qk_norm", False)), source=source)
    base = base.replace(rotary_percent=float(cfg.get("partial_rotary_factor", 0.5)))
    return deepseek_v3.moe_from_hf(cfg, base, CLASS_DEFAULTS)


def recognise(fields: dict[str, Any]) -> bool:
    """Megatron args without model_family: the sigmoid router with fused QKV attention is GLM-4.5-style."""
    return fields.get("kv_lora_rank") is None and fields.get("moe_router_score_function") == "sigmoid"


PRESETS = {
    # 3 layers (the first dense), 8 heads of 32 in 2 KV groups, q/k/v bias, q/k norm, half the head rotated;
    # 16 experts of width 32 in 4 groups (top-2 groups, top-4 experts), one shared expert, routed weights × 2.5;
    # one MTP layer
    "tiny-glm45": llama.rope_preset(
        NAME, num_layers=3, hidden_size=128, num_attention_heads=8, num_query_groups=2, kv_channels=32,
        ffn_hidden_size=256, vocab_size=1000, max_position_embeddings=128, norm_epsilon=1e-5, add_qkv_bias=True,
        qk_layernorm=True, rotary_percent=0.5, num_experts=16, moe_ffn_hidden_size=32, moe_router_topk=4,
        moe_router_num_groups=4, moe_router_group_topk=2, moe_router_topk_scaling_factor=2.5,
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
        moe_shared_expert_intermediate_size=32, moe_layer_freq=(0, 1, 1), mtp_num_layers=1),
}



def gguf_metadata(spec: ModelSpec) -> dict[str, int | float | bool | str]:
    """glm4moe's keys (`Glm4MoeModel.set_gguf_parameters`): the DeepSeek MoE's, the rotary width (head_dim ·
    partial_rotary_factor), and the MTP layers as `nextn` blocks after the decoder's (block_count counts them;
    llama.cpp's main graph runs block_count - nextn_predict_layers blocks)."""
    mtp = spec.mtp_num_layers or 0
    return {**deepseek_v3.moe_gguf_metadata(spec, FAMILY.architecture), "block_count": spec.num_layers + mtp,
            "rope.dimension_count": int(spec.head_dim * spec.rotary_percent),
            **({"nextn_predict_layers": mtp} if mtp else {})}


# llama.cpp's GLM4_MOE architecture (convert_hf_to_gguf.py's Glm4MoeModel): Qwen3-MoE's attention names with
# q/k/v biases, `post_attention_norm` before the MLP, the DeepSeek MoE's names, q/k rows as HF's (NeoX rope of
# the first rotary dims), each MTP layer written as a `nextn` block; GLM's special tokens by their text
GGUF = GgufLayout(
    arch="glm4moe",
    tensors={
        **{k: v for k, v in llama.GGUF_TENSORS.items() if ".mlp." not in k},
        **qwen3.QK_NORM_GGUF,
        **deepseek_v3.MOE_GGUF,
        H + "post_attention_layernorm.weight": "blk.*.post_attention_norm.weight",
        **deepseek_v3.MTP_GGUF,
    },
    permute_qk=False,
    refuse=llama.gguf_refuse_rope_freqs,
    metadata=gguf_metadata,
    mtp_blocks=True,
    # `TextModel._set_vocab_glm`: [gMASK] opens every GLM prompt, <|user|> ends an assistant turn, <|observation|>
    # a tool call (SpecialVocab keeps a bos / unk the tokenizer files already name)
    special_tokens={"bos": "[gMASK]", "eot": "<|user|>", "unk": "<|endoftext|>", "eom": "<|observation|>"},
)

FAMILY = Family(**llama.rope_family(
    NAME, "Glm4Moe", plugin=TABLE, hf_fields=HF_FIELDS, to_hf=to_hf, from_hf=from_hf, presets=PRESETS,
    recognise=recognise, recognise_order=3,
    ft=None,  # FasterTransformer has no MoE form here
    trtllm=None,  # no confirmed TensorRT-LLM GLM-4.5 layout
    gguf=GGUF,
    moe=True,
    deepseek=True,
))
