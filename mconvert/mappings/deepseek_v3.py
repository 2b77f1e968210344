"""The DeepSeek-V3 family: HF `DeepseekV3ForCausalLM` — multi-latent attention, DeepSeek MoE (sigmoid router
with expert bias, group-limited top-k, shared experts, dense first layers) and multi-token prediction.

Names (megatron-core local spec → HF): MLA's `linear_q_down_proj` → `q_a_proj`, `q_layernorm` → `q_a_layernorm`,
`linear_q_up_proj` → `q_b_proj`, `linear_q_proj` → `q_proj` (no q LoRA), `linear_kv_down_proj` (rows: the kv
latent, then the rope part) → `kv_a_proj_with_mqa`, `kv_layernorm` → `kv_a_layernorm`, `linear_kv_up_proj`
(rows per head: k_nope, then v) → `kv_b_proj`, `linear_proj` → `o_proj`; all unchanged, since megatron-core
de-interleaves the rope dims before rotating as HF does with `rope_interleave: true`. The router is `mlp.gate`
(its `expert_bias` → `e_score_correction_bias`), the shared experts `mlp.shared_experts.{gate,up,down}_proj`.

HF scores a group by its top 2 experts; megatron-core by its top (k / topk_group): `to_hf` refuses a model whose
rule differs. config.json carries `scoring_func: sigmoid` and `topk_method: noaux_tc`, which transformers does
not write and vLLM reads. MTP layer K (`mtp.layers.K.*`; newer Megatron-LM spells its `transformer_layer`
`mtp_model_layer`) is HF's `model.layers.{num_hidden_layers + K}`: its transformer layer under the decoder
layers' names, `enorm`, `hnorm`, `eh_proj`, `shared_head.norm` (its `final_layernorm`), and copies of the shared
embedding and head (`embed_tokens`, `shared_head.head`), as DeepSeek publishes them and vLLM reads them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from mconvert.errors import MConvertError
from mconvert.mappings import llama, qwen3_moe
from mconvert.mappings.record import EXPERT_FF_KEY, Family, GgufLayout, Plugin, Rule
from mconvert.mappings.fields import BOOL, INT, NUM, Field, mapped, neutral, refused
from mconvert.spec import ModelSpec

NAME = "deepseek_v3"
L, H = llama.L, llama.H
A, HA = L + "self_attention.", H + "self_attn."
X, HX = L + "mlp.experts.local_experts.*.", H + "mlp.experts.*."

# The DeepSeek MoE layer (GLM-4.5's too): the dense MLP of the first layers, the router with its expert bias,
# the shared experts and the routed experts
MOE_TABLE = {
    L + "pre_mlp_layernorm.weight": Rule((H + "post_attention_layernorm.weight",)),
    L + "mlp.linear_fc1.weight": Rule((H + "mlp.gate_proj.weight", H + "mlp.up_proj.weight"), "gated"),
    L + "mlp.linear_fc2.weight": Rule((H + "mlp.down_proj.weight",)),
    L + "mlp.router.weight": Rule((H + "mlp.gate.weight",)),
    L + "mlp.router.expert_bias": Rule((H + "mlp.gate.e_score_correction_bias",)),
    L + "mlp.shared_experts.linear_fc1.weight": Rule((H + "mlp.shared_experts.gate_proj.weight",
                                                      H + "mlp.shared_experts.up_proj.weight"), "gated"),
    L + "mlp.shared_experts.linear_fc2.weight": Rule((H + "mlp.shared_experts.down_proj.weight",)),
    X + "linear_fc1.weight": Rule((HX + "gate_proj.weight", HX + "up_proj.weight"), "gated"),
    X + "linear_fc2.weight": Rule((HX + "down_proj.weight",)),
}
# An MTP layer's own tensors (`mtp.layers.K.X` read as `decoder.layers.{L + K}.mtp.X`: plugin.mtp_view)
MTP_TABLE = {
    L + "mtp.enorm.weight": Rule((H + "enorm.weight",)),
    L + "mtp.hnorm.weight": Rule((H + "hnorm.weight",)),
    L + "mtp.eh_proj.weight": Rule((H + "eh_proj.weight",)),
    L + "mtp.final_layernorm.weight": Rule((H + "shared_head.norm.weight",)),
}
# DeepSeek's published checkpoints hold model.layers.{L + K}.embed_tokens / shared_head.head, and vLLM's
# deepseek_mtp (and glm4_moe_mtp) loaders read them
MTP_COPIES = {"embedding.word_embeddings.weight": H + "embed_tokens.weight",
              "output_layer.weight": H + "shared_head.head.weight"}

TABLE = Plugin(
    family=NAME,
    table={
        "embedding.word_embeddings.weight": llama.TABLE.table["embedding.word_embeddings.weight"],
        L + "input_layernorm.weight": Rule((H + "input_layernorm.weight",)),
        A + "linear_q_proj.weight": Rule((HA + "q_proj.weight",)),
        A + "linear_q_down_proj.weight": Rule((HA + "q_a_proj.weight",)),
        A + "q_layernorm.weight": Rule((HA + "q_a_layernorm.weight",)),
        A + "linear_q_up_proj.weight": Rule((HA + "q_b_proj.weight",)),
        A + "linear_kv_down_proj.weight": Rule((HA + "kv_a_proj_with_mqa.weight",)),
        A + "kv_layernorm.weight": Rule((HA + "kv_a_layernorm.weight",)),
        A + "linear_kv_up_proj.weight": Rule((HA + "kv_b_proj.weight",)),
        A + "linear_proj.weight": Rule((HA + "o_proj.weight",)),
        **MOE_TABLE,
        "decoder.final_layernorm.weight": llama.TABLE.table["decoder.final_layernorm.weight"],
        "output_layer.weight": llama.TABLE.table["output_layer.weight"],
        **MTP_TABLE,
    },
    hf_drops=llama.TABLE.hf_drops,
    mtp_copies=MTP_COPIES,
)

# The DeepSeek MoE and MTP fields (DeepseekV3Config's, Glm4MoeConfig's)
MOE_HF_FIELDS: dict[str, Field] = {
    "moe_intermediate_size": mapped("moe_ffn_hidden_size", INT),
    "n_routed_experts": mapped("num_experts", INT),
    "num_experts_per_tok": mapped("moe_router_topk", INT),
    "n_shared_experts": mapped("moe_shared_expert_intermediate_size", INT),
    "routed_scaling_factor": mapped("moe_router_topk_scaling_factor", NUM),
    "n_group": mapped("moe_router_num_groups", INT),
    "topk_group": mapped("moe_router_group_topk", INT),
    "first_k_dense_replace": mapped("moe_layer_freq", INT),
    "norm_topk_prob": refused("weights not renormalised over the top-k are not megatron-core's sigmoid router",
                              True),
    "num_nextn_predict_layers": mapped("mtp_num_layers", INT),
}

# Every field of transformers 4.57's DeepseekV3Config beyond the common ones.
HF_FIELDS: dict[str, Field] = {
    **{k: v for k, v in llama.HF_FIELDS.items() if k not in ("head_dim", "mlp_bias")},
    "head_dim": Field("neutral", "transformers sets it to qk_rope_head_dim itself"),
    "qk_head_dim": Field("neutral", "qk_nope_head_dim + qk_rope_head_dim"),
    **MOE_HF_FIELDS,
    "kv_lora_rank": mapped("kv_lora_rank", INT),
    "q_lora_rank": mapped("q_lora_rank", INT),
    "qk_rope_head_dim": mapped("qk_rope_head_dim", INT),
    "qk_nope_head_dim": mapped("qk_nope_head_dim", INT),
    "v_head_dim": mapped("v_head_dim", INT),
    "rope_interleave": refused("rope_interleave=false is not megatron-core's MLA rope", True),
    "scoring_func": refused("transformers' DeepseekV3 scores with sigmoid whatever this says and vLLM follows it, so "
                            "the engines disagree (DeepSeek-V2's softmax router is DeepseekV2ForCausalLM's)",
                            "sigmoid"),
    "topk_method": refused("only noaux_tc (expert-bias top-k) is mapped", "noaux_tc"),
    # vLLM's DeepSeek model makes layer i MoE when i >= first_k_dense_replace and i % moe_layer_freq == 0
    # (transformers reads no such field): 1, DeepSeek's published value, is every layer after the dense ones
    "moe_layer_freq": refused("MoE on only every moe_layer_freq-th layer (vLLM reads it; transformers does not) is "
                              "not mapped", 1),
    **neutral("training only", "aux_loss_alpha", "seq_aux", "ep_size", "moe_layer_freq_unused"),
    "use_cache": qwen3_moe.HF_FIELDS.get("use_cache", Field("neutral", "inference cache")),
    "pretraining_tp": Field("neutral", "always 1 in transformers' DeepSeek-V3"),
    "attention_bias": mapped("add_bias_linear", BOOL, False),
}


def first_dense(spec: ModelSpec, arch: str = "DeepseekV3ForCausalLM") -> int:
    """HF first_k_dense_replace: the count of leading dense layers; refuses a pattern that is not k dense, then
    MoE."""
    pattern = [int(spec.is_moe_layer(i)) for i in range(spec.num_layers)]
    k = pattern.index(1)
    if any(v == 0 for v in pattern[k:]):
        raise MConvertError(f"HF {arch} has dense layers only first (first_k_dense_replace); this "
                            f"model's MoE layer pattern is {pattern}; conversion refused")
    return k


def to_hf(spec: ModelSpec, arch: str = "DeepseekV3ForCausalLM") -> dict[str, Any]:
    """DeepseekV3Config fields (with vLLM's scoring_func / topk_method); refuses what the class `arch` cannot
    compute."""
    if not (spec.is_mla and spec.is_moe and spec.moe_router_score_function == "sigmoid"):
        raise MConvertError(f"HF {arch} needs multi-latent attention and the sigmoid MoE router; this model has "
                            f"kv_lora_rank={spec.kv_lora_rank}, num_experts={spec.num_experts}, "
                            f"score function {spec.moe_router_score_function!r}; conversion refused"
                            + (" (the pre-softmax router is DeepSeek-V2's: model_family deepseek_v2)"
                               if spec.moe_router_pre_softmax else ""))
    # a dense-attention head width stands in for MLA's own (hidden / heads need not be whole: GLM-4.7-Flash)
    base = llama.rope_fields(spec.replace(num_experts=None, kv_lora_rank=None, q_lora_rank=None,
                                          kv_channels=spec.v_head_dim))
    base.pop("head_dim", None)
    return {**base, **moe_to_hf(spec, arch), "kv_lora_rank": spec.kv_lora_rank, "q_lora_rank": spec.q_lora_rank,
            "qk_rope_head_dim": spec.qk_rope_head_dim, "qk_nope_head_dim": spec.qk_nope_head_dim,
            "v_head_dim": spec.v_head_dim, "rope_interleave": True, "scoring_func": "sigmoid",
            "topk_method": "noaux_tc", "attention_bias": False}


def check_group_rule(spec: ModelSpec, arch: str) -> None:
    """HF scores an expert group by its top 2 experts, megatron-core by its top k / group top-k: refuse a model
    where the two differ (either way of the conversion)."""
    groups, group_topk = spec.moe_router_num_groups or 1, spec.moe_router_group_topk or 1
    if groups > 1 and spec.moe_router_topk // group_topk != 2:
        raise MConvertError(f"HF {arch} scores an expert group by its top 2 experts; megatron-core by its top "
                            f"moe_router_topk / moe_router_group_topk = {spec.moe_router_topk // group_topk}; "
                            "conversion refused")


def moe_to_hf(spec: ModelSpec, arch: str) -> dict[str, Any]:
    """The DeepSeek MoE and MTP config fields (DeepseekV3Config's, Glm4MoeConfig's); refuses what HF's router
    computes differently."""
    if spec.mtp_num_layers and spec.tie_embeddings:
        raise MConvertError(f"HF {arch}'s multi-token prediction layers carry a copy of an untied head "
                            "(shared_head.head); this model ties its head to the embedding; conversion refused")
    if not (spec.is_moe and spec.moe_router_score_function == "sigmoid" and spec.moe_router_enable_expert_bias):
        raise MConvertError(f"HF {arch} routes with sigmoid scores and an expert bias; this model has num_experts="
                            f"{spec.num_experts}, score function {spec.moe_router_score_function!r}, expert bias "
                            f"{spec.moe_router_enable_expert_bias}; conversion refused")
    groups, group_topk = spec.moe_router_num_groups or 1, spec.moe_router_group_topk or 1
    check_group_rule(spec, arch)
    shared = spec.moe_shared_expert_intermediate_size or 0
    if shared % spec.expert_ffn_hidden_size:
        raise MConvertError(f"HF {arch} states shared experts as a count of expert widths; "
                            f"moe_shared_expert_intermediate_size={shared} is not a multiple of "
                            f"moe_ffn_hidden_size={spec.expert_ffn_hidden_size}; conversion refused")
    return {"intermediate_size": spec.ffn_hidden_size,
            "moe_intermediate_size": spec.expert_ffn_hidden_size, "n_routed_experts": spec.num_experts,
            "num_experts_per_tok": spec.moe_router_topk, "n_shared_experts": shared // spec.expert_ffn_hidden_size,
            "routed_scaling_factor": spec.moe_router_topk_scaling_factor or 1.0, "n_group": groups,
            "topk_group": group_topk, "first_k_dense_replace": first_dense(spec, arch), "norm_topk_prob": True,
            "num_nextn_predict_layers": spec.mtp_num_layers or 0}


def from_hf(cfg: dict[str, Any], common: dict[str, Any], source: str) -> ModelSpec:
    """A DeepseekV3Config dict -> ModelSpec (transformers' defaults where a field is absent)."""
    base = llama.rope_spec({**cfg, "num_key_value_heads": cfg.get("num_attention_heads"), "rope_scaling": None},
                           common, add_bias_linear=False, add_qkv_bias=False, source=source)
    return moe_from_hf(cfg, base.replace(kv_channels=None), CLASS_DEFAULTS).replace(
        q_lora_rank=cfg.get("q_lora_rank", 1536), kv_lora_rank=int(cfg.get("kv_lora_rank", 512)),
        qk_rope_head_dim=int(cfg.get("qk_rope_head_dim", 64)), qk_nope_head_dim=int(cfg.get("qk_nope_head_dim", 128)),
        v_head_dim=int(cfg.get("v_head_dim", 128)), **llama.rope_scaling_from_hf(cfg, source, mla=True))


# DeepseekV3Config's defaults of the MoE fields
CLASS_DEFAULTS = {"first_k_dense_replace": 3, "moe_intermediate_size": 2048, "n_shared_experts": 1, "n_group": 8,
                  "topk_group": 4, "n_routed_experts": 256, "num_experts_per_tok": 8, "routed_scaling_factor": 2.5}


def moe_from_hf(cfg: dict[str, Any], base: ModelSpec, defaults: dict[str, Any]) -> ModelSpec:
    """`base` with the DeepSeek MoE and MTP fields of a config dict (the class's `defaults` where absent)."""
    def get(k: str) -> Any:
        return cfg.get(k, defaults[k])

    k = int(get("first_k_dense_replace"))
    width = int(get("moe_intermediate_size"))
    shared = int(get("n_shared_experts") or 0)
    groups, group_topk = int(get("n_group") or 1), int(get("topk_group") or 1)
    out = base.replace(
        num_experts=int(get("n_routed_experts")), moe_ffn_hidden_size=width,
        moe_router_topk=int(get("num_experts_per_tok")), moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True, moe_router_topk_scaling_factor=float(get("routed_scaling_factor")),
        moe_router_num_groups=groups if groups > 1 else None, moe_router_group_topk=group_topk if groups > 1 else None,
        moe_shared_expert_intermediate_size=shared * width or None,
        moe_layer_freq=tuple([0] * k + [1] * (base.num_layers - k)),
        mtp_num_layers=int(cfg.get("num_nextn_predict_layers") or 0) or None)
    check_group_rule(out, cfg.get("architectures", ["HF"])[0] if cfg.get("architectures") else "HF")
    return out


def deepseek_preset(**kw: Any) -> ModelSpec:
    """A DeepSeek-V3-style preset: MLA, sigmoid router with expert bias, shared experts, RMSNorm, SwiGLU, untied."""
    base: dict[str, Any] = dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                                norm_epsilon=1e-6)
    return llama.rope_preset(NAME, **{**base, **kw})


PRESETS = {
    # 3 layers (the first dense), 8 heads of q/k 32 + 64 and v 32, q latent 64, kv latent 512 + 64 rope rows
    # (576: vLLM's CPU MLA kernel; TP 2 and 4 split it); 16 experts of width 32 in 4 groups (top-2 groups, top-4
    # experts: HF's top-2 group score), one shared expert, routed weights × 2.5; one MTP layer
    "tiny-deepseek-v3": deepseek_preset(
        num_layers=3, hidden_size=128, num_attention_heads=8, ffn_hidden_size=256, vocab_size=1000,
        max_position_embeddings=128, q_lora_rank=64, kv_lora_rank=512, qk_nope_head_dim=32, qk_rope_head_dim=64,
        v_head_dim=32, num_experts=16, moe_ffn_hidden_size=32, moe_router_topk=4, moe_router_num_groups=4,
        moe_router_group_topk=2, moe_router_topk_scaling_factor=2.5, moe_shared_expert_intermediate_size=32,
        moe_layer_freq=(0, 1, 1), mtp_num_layers=1),
    # tiny-deepseek-v3 with DeepSeek-V3's YaRN (factor 40 → 4 here, mscale = mscale_all_dim = 1, which also scales
    # MLA's softmax) over 32 original positions stretched to 128
    "tiny-deepseek-v3-yarn": deepseek_preset(
        num_layers=3, hidden_size=128, num_attention_heads=8, ffn_hidden_size=256, vocab_size=1000,
        max_position_embeddings=128, q_lora_rank=64, kv_lora_rank=512, qk_nope_head_dim=32, qk_rope_head_dim=64,
        v_head_dim=32, num_experts=16, moe_ffn_hidden_size=32, moe_router_topk=4, moe_router_num_groups=4,
        moe_router_group_topk=2, moe_router_topk_scaling_factor=2.5, moe_shared_expert_intermediate_size=32,
        moe_layer_freq=(0, 1, 1), mtp_num_layers=1, rope_scaling="yarn", rope_scaling_factor=4.0,
        rope_original_max_position_embeddings=32, yarn_mscale=1.0, yarn_mscale_all_dim=1.0),
    # DeepSeek-V3 / R1 (HF config.json of deepseek-ai/DeepSeek-V3, its YaRN included), for `plan` estimates
    "deepseek-v3-671b": deepseek_preset(
        num_layers=61, hidden_size=7168, num_attention_heads=128, ffn_hidden_size=18432, vocab_size=129280,
        max_position_embeddings=163840, rope_scaling="yarn", rope_scaling_factor=40.0,
        rope_original_max_position_embeddings=4096, yarn_mscale=1.0, yarn_mscale_all_dim=1.0, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, num_experts=256, moe_ffn_hidden_size=2048, moe_router_topk=8, moe_router_num_groups=8,
        moe_router_group_topk=4, moe_router_topk_scaling_factor=2.5, moe_shared_expert_intermediate_size=2048,
        moe_layer_freq=tuple([0] * 3 + [1] * 58), mtp_num_layers=1, params_dtype="bfloat16"),
}


# ---- GGUF (llama.cpp) -----------------------------------------------------------------------------------
# The DeepSeek MoE layer's GGUF names (deepseek2's and glm4moe's): the dense MLP of the first layers, the router
# (`ffn_gate_inp`) with its expert bias (`exp_probs_b`), the shared experts (`_shexp`) and the routed experts
# stacked [experts, out, in] (`_exps`)
MOE_GGUF: dict[str, str] = {
    H + "post_attention_layernorm.weight": "blk.*.ffn_norm.weight",
    **{H + f"mlp.{hf}.weight": f"blk.*.{gg}.weight" for hf, gg in (
        ("gate_proj", "ffn_gate"), ("up_proj", "ffn_up"), ("down_proj", "ffn_down"))},
    H + "mlp.gate.weight": "blk.*.ffn_gate_inp.weight",
    H + "mlp.gate.e_score_correction_bias": "blk.*.exp_probs_b.bias",
    **{H + f"mlp.shared_experts.{hf}.weight": f"blk.*.{gg}_shexp.weight" for hf, gg in (
        ("gate_proj", "ffn_gate"), ("up_proj", "ffn_up"), ("down_proj", "ffn_down"))},
    **{HX + f"{hf}.weight": f"blk.*.{gg}_exps.weight" for hf, gg in (
        ("gate_proj", "ffn_gate"), ("up_proj", "ffn_up"), ("down_proj", "ffn_down"))},
}
# An MTP layer's own tensors as llama.cpp's `nextn` block holds them (glm4moe; deepseek2 reads none)
MTP_GGUF: dict[str, str] = {
    H + "enorm.weight": "blk.*.nextn.enorm.weight",
    H + "hnorm.weight": "blk.*.nextn.hnorm.weight",
    H + "eh_proj.weight": "blk.*.nextn.eh_proj.weight",
    H + "shared_head.norm.weight": "blk.*.nextn.shared_head_norm.weight",
    H + "embed_tokens.weight": "blk.*.nextn.embed_tokens.weight",
    H + "shared_head.head.weight": "blk.*.nextn.shared_head_head.weight",
}
SIGMOID_GATING = 2  # gguf-py's ExpertGatingFuncType.SIGMOID, llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID


def moe_gguf_metadata(spec: ModelSpec, arch: str) -> dict[str, int | float | bool | str]:
    """The DeepSeek MoE's llama.cpp keys, as convert_hf_to_gguf.py writes them from the config.json mconvert
    exports (the same `moe_to_hf` values): experts' width, shared experts, leading dense layers, groups, sigmoid
    gating, the routed weights' scale and their renormalisation."""
    hf = moe_to_hf(spec, arch)
    return {EXPERT_FF_KEY: hf["moe_intermediate_size"], "expert_shared_count": hf["n_shared_experts"],
            "leading_dense_block_count": hf["first_k_dense_replace"], "expert_group_count": hf["n_group"],
            "expert_group_used_count": hf["topk_group"], "expert_gating_func": SIGMOID_GATING,
            "expert_weights_scale": float(hf["routed_scaling_factor"]), "expert_weights_norm": True}


def gguf_metadata(spec: ModelSpec) -> dict[str, int | float | bool | str]:
    """deepseek2's keys (`DeepseekV2Model.set_gguf_parameters`): the DeepSeek MoE's and MLA's."""
    return {**moe_gguf_metadata(spec, FAMILY.architecture), **mla_gguf_metadata(spec)}


def mla_gguf_metadata(spec: ModelSpec) -> dict[str, int | float | bool | str]:
    """MLA in llama.cpp's deepseek2: one KV head of the latent plus the rope part (key_length kv_lora_rank + rope,
    value_length kv_lora_rank), the per-head sizes as the `_mla` keys; the rotary width is the rope part."""
    rope = spec.qk_rope_head_dim
    return {"attention.head_count_kv": 1,
            "attention.key_length": spec.kv_lora_rank + rope, "attention.value_length": spec.kv_lora_rank,
            **({"attention.q_lora_rank": spec.q_lora_rank} if spec.q_lora_rank else {}),
            "attention.kv_lora_rank": spec.kv_lora_rank, "attention.key_length_mla": spec.qk_nope_head_dim + rope,
            "attention.value_length_mla": spec.v_head_dim, "rope.dimension_count": rope}


def _kv_b(spec: ModelSpec, x: Any) -> tuple[Any, Any]:
    """kv_b_proj [heads · (nope + v), kv_lora_rank] -> (k_b [heads, kv_lora_rank, nope], v_b [heads, v,
    kv_lora_rank]): k_b transposed per head, as llama.cpp's absorbed MLA multiplies by it."""
    kv = x.reshape(spec.num_attention_heads, spec.qk_nope_head_dim + spec.v_head_dim, x.shape[-1])
    return kv[:, :spec.qk_nope_head_dim].swapaxes(1, 2), kv[:, spec.qk_nope_head_dim:]


# llama.cpp's deepseek2 (0.3.36) reads a model of these layer counts as DeepSeek-V2-Lite's, without q LoRA
# (`attn_q`), and every other one as with q LoRA (`attn_q_a` / `attn_q_b`, `attention.q_lora_rank`)
GGUF_LITE_LAYERS = (26, 27)


def gguf_refuse(spec: ModelSpec) -> None:
    """What llama.cpp's deepseek2 cannot load: q LoRA against its layer-count rule. (Its YaRN, which scales the
    softmax by its own rule, is stated by `gguf.yarn_keys` and refused there where no key reaches it.)"""
    lite = spec.num_layers in GGUF_LITE_LAYERS
    if (spec.q_lora_rank is None) != lite:
        raise MConvertError(f"this {spec.family}-family model has {spec.num_layers} layers and q_lora_rank="
                            f"{spec.q_lora_rank}; llama.cpp's deepseek2 takes a model of 26 or 27 layers to be "
                            "without q LoRA (DeepSeek-V2-Lite) and any other to be with it, so it cannot load this "
                            "GGUF; conversion refused")


# llama.cpp's DEEPSEEK2 architecture (convert_hf_to_gguf.py's DeepseekV2Model): MLA's projections under their own
# names, kv_b_proj split into attn_k_b (transposed per head) and attn_v_b, q/k rows as HF's (rope_interleave:
# llama.cpp's deepseek2 ropes the de-interleaved pairs as HF does), YaRN's softmax factor through
# `rope.scaling.yarn_log_multiplier`; MTP layers are skipped (`skip_mtp`)
GGUF = GgufLayout(
    arch="deepseek2",
    tensors={
        **{k: v for k, v in llama.GGUF_TENSORS.items() if ".self_attn." not in k and ".mlp." not in k},
        **{HA + f"{hf}.weight": f"blk.*.{gg}.weight" for hf, gg in (
            ("q_proj", "attn_q"), ("q_a_proj", "attn_q_a"), ("q_a_layernorm", "attn_q_a_norm"),
            ("q_b_proj", "attn_q_b"), ("kv_a_proj_with_mqa", "attn_kv_a_mqa"), ("kv_a_layernorm", "attn_kv_a_norm"),
            ("o_proj", "attn_output"))},
        **MOE_GGUF,
    },
    permute_qk=False,
    refuse=gguf_refuse,
    metadata=gguf_metadata,
    pieces={HA + "kv_b_proj.weight": (("blk.*.attn_k_b.weight", lambda spec, x: _kv_b(spec, x)[0]),
                                      ("blk.*.attn_v_b.weight", lambda spec, x: _kv_b(spec, x)[1]))},
    mtp_blocks=False,
    yarn_log_mul=True,
)


def recognise(fields: dict[str, Any]) -> bool:
    """Megatron args without model_family: multi-latent attention is DeepSeek-V3-style."""
    return fields.get("kv_lora_rank") is not None


def mla_config_checks(cfg: dict[str, Any]) -> tuple[list[str], list[str]]:
    """verify's config.json checks for multi-latent attention: (problems, notes)."""
    problems, notes = llama.rope_config_checks(cfg)
    if cfg.get("rope_interleave", True) is not True:
        problems.append(f"rope_interleave={cfg['rope_interleave']!r}: transformers then rotates halves, vLLM's "
                        "DeepSeek model rotates interleaved pairs whatever the flag")
    return problems, notes


# vLLM's CPU MLA caches the kv latent and the rope key together, one kernel width: kv_lora_rank + qk_rope_head_dim
MLA_VLLM = dataclasses.replace(
    llama.ROPE_VLLM, config_checks=mla_config_checks, cpu_head_dims=(576,),
    head_dim=lambda cfg: int(cfg.get("kv_lora_rank", 512)) + int(cfg.get("qk_rope_head_dim", 64)),
    head_dim_label="kv_lora_rank + qk_rope_head_dim")


FAMILY = Family(**llama.rope_family(
    NAME, "DeepseekV3", plugin=TABLE, hf_fields=HF_FIELDS, to_hf=to_hf, from_hf=from_hf, presets=PRESETS,
    recognise=recognise, recognise_order=4, vllm=MLA_VLLM,
    ft=None,  # FasterTransformer has no MLA
    trtllm=None,  # no confirmed TensorRT-LLM MLA layout here
    gguf=GGUF,
    moe=True,
    deepseek=True,
    # Kimi K2 (moonshotai): architectures DeepseekV3ForCausalLM, auto_map to DeepSeek-V3's own modeling code
    remote_model_types=("kimi_k2",),
))
