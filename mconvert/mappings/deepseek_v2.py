"""The DeepSeek-V2 family: HF `DeepseekV2ForCausalLM` (DeepSeek-V2, DeepSeek-V2-Lite) — DeepSeek-V3's multi-latent
attention and MoE layout with DeepSeek-V2's router, read and written with `deepseek_v3`'s name table.

What the engines compute (transformers 4.57 `modeling_deepseek_v2.py`, vLLM's `deepseek_v2.py`), and megatron-core's
equal:
- attention: MLA with or without a q latent; the rope dims rotate as interleaved pairs (complex multiplication in
  transformers, always interleaved in vLLM), the function of megatron-core's MLA, which de-interleaves q and k alike
  before rotating halves (no field says it: V2 configs have no `rope_interleave`);
- router: softmax over every expert in fp32, the top-k of those probabilities as the weights, never renormalised,
  times `routed_scaling_factor` = megatron-core's `moe_router_pre_softmax` with `moe_router_topk_scaling_factor`.
  `topk_method: greedy` chooses from every expert; `group_limited_greedy` first keeps the `topk_group` best of
  `n_group` groups, a group scored by its best expert, where megatron-core scores it by the sum of its top
  k / group_topk. With topk_group ≥ k both choose the greedy top-k (the groups holding the top-k experts outrank
  every other group), so topk_group = k maps to megatron-core's groups and topk_group > k to no groups; with
  topk_group < k (DeepSeek-V2's 3 of 8 groups for k = 6) the two choose differently and the model is refused;
- shared experts (transformers calls them unconditionally: a model without them is refused), dense first layers
  (`first_k_dense_replace`), no expert bias, no MTP layer.

Refused by name where the engines disagree: `norm_topk_prob: true` (transformers ignores it, vLLM renormalises),
`scoring_func` other than softmax (transformers ignores it), `moe_layer_freq` other than 1 (vLLM reads it,
transformers does not). MLA's YaRN maps as DeepSeek-V3's; transformers 4.x's DeepseekV2Attention omits the YaRN
softmax factor mscale(factor, mscale_all_dim)² that DeepSeek's own code, vLLM, transformers 5 and megatron-core
apply, so with YaRN the pinned transformers is no reference for this class.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from mconvert.errors import MConvertError
from mconvert.mappings import deepseek_v3, llama
from mconvert.mappings.fields import NUM, Field, mapped, refused
from mconvert.mappings.record import EXPERT_FF_KEY
from mconvert.spec import ModelSpec

NAME = "deepseek_v2"
ARCH = "DeepseekV2ForCausalLM"
TOPK_METHODS = ("greedy", "group_limited_greedy")

# Every field of transformers 4.57's DeepseekV2Config, and DeepSeek's published config keys, beyond the common ones
HF_FIELDS: dict[str, Field] = {
    **{k: v for k, v in deepseek_v3.HF_FIELDS.items() if k not in ("rope_interleave", "num_nextn_predict_layers")},
    "rope_interleave": Field("neutral", "transformers' DeepseekV2 and vLLM rotate interleaved pairs whatever it says"),
    "routed_scaling_factor": mapped("moe_router_topk_scaling_factor", NUM),
    "scoring_func": refused("DeepseekV2ForCausalLM scores with softmax in transformers whatever this says (vLLM "
                            "follows it)", "softmax"),
    "topk_method": refused(f"DeepseekV2ForCausalLM routes with {' or '.join(TOPK_METHODS)}", "greedy",
                           ok=lambda v, cfg: v in TOPK_METHODS),
    "norm_topk_prob": refused("transformers' DeepseekV2 never renormalises the top-k weights and vLLM does when this "
                              "is true", False),
    "num_nextn_predict_layers": refused("DeepseekV2ForCausalLM builds no multi-token prediction layer", 0),
    "mlp_bias": refused("megatron-core's DeepSeek MLPs have no biases", False),
}

# DeepseekV2Config's defaults (transformers 4.57) of the fields read below
CLASS_DEFAULTS = {"first_k_dense_replace": 0, "moe_intermediate_size": 1407, "n_shared_experts": 2,
                  "n_routed_experts": 64, "routed_scaling_factor": 1.0, "topk_method": "greedy", "q_lora_rank": 1536,
                  "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128}


def check_group_rule(spec: ModelSpec, where: str = f"HF {ARCH}") -> None:
    """HF's group_limited_greedy scores a group by its best expert, megatron-core by the sum of its top
    k / group_topk: refuse a model where the two choose differently."""
    groups, group_topk = spec.moe_router_num_groups, spec.moe_router_group_topk
    if groups is not None and group_topk < groups and spec.moe_router_topk != group_topk:  # type: ignore[operator]
        raise MConvertError(f"{where}: group_limited_greedy scores an expert group by its best expert; megatron-core "
                            f"by the sum of its top moe_router_topk / moe_router_group_topk = "
                            f"{spec.moe_router_topk // group_topk} (k={spec.moe_router_topk}, "  # type: ignore[operator]
                            f"topk_group={group_topk}); the two choose different experts; conversion refused")


def to_hf(spec: ModelSpec) -> dict[str, Any]:
    """DeepseekV2Config fields (with vLLM's scoring_func / topk_method); refuses what the class cannot compute."""
    if not (spec.is_mla and spec.is_moe and spec.moe_router_score_function == "softmax"
            and spec.moe_router_pre_softmax):
        raise MConvertError(f"HF {ARCH} needs multi-latent attention and the pre-softmax router (softmax over every "
                            f"expert, then top-k); this model has kv_lora_rank={spec.kv_lora_rank}, num_experts="
                            f"{spec.num_experts}, score function {spec.moe_router_score_function!r}, "
                            f"moe_router_pre_softmax={spec.moe_router_pre_softmax}; conversion refused")
    if spec.moe_router_enable_expert_bias or spec.mtp_num_layers:
        raise MConvertError(f"HF {ARCH} has no expert bias and no multi-token prediction layer; this model has "
                            f"moe_router_enable_expert_bias={spec.moe_router_enable_expert_bias}, mtp_num_layers="
                            f"{spec.mtp_num_layers}; conversion refused")
    shared = spec.moe_shared_expert_intermediate_size or 0
    if not shared or shared % spec.expert_ffn_hidden_size:
        raise MConvertError(f"HF {ARCH} runs shared experts, a whole count of expert widths, in every MoE layer; "
                            f"moe_shared_expert_intermediate_size={spec.moe_shared_expert_intermediate_size} with "
                            f"moe_ffn_hidden_size={spec.expert_ffn_hidden_size}; conversion refused")
    check_group_rule(spec)
    base = llama.rope_fields(spec.replace(num_experts=None, kv_lora_rank=None, q_lora_rank=None,
                                          kv_channels=spec.v_head_dim))
    base.pop("head_dim", None)
    groups = spec.moe_router_num_groups
    return {**base, "intermediate_size": spec.ffn_hidden_size, "moe_intermediate_size": spec.expert_ffn_hidden_size,
            "n_routed_experts": spec.num_experts, "num_experts_per_tok": spec.moe_router_topk,
            "n_shared_experts": shared // spec.expert_ffn_hidden_size,
            "routed_scaling_factor": spec.moe_router_topk_scaling_factor or 1.0,
            "topk_method": "group_limited_greedy" if groups else "greedy", "n_group": groups or 1,
            "topk_group": spec.moe_router_group_topk or 1, "norm_topk_prob": False, "scoring_func": "softmax",
            "first_k_dense_replace": deepseek_v3.first_dense(spec, ARCH), "moe_layer_freq": 1,
            "kv_lora_rank": spec.kv_lora_rank, "q_lora_rank": spec.q_lora_rank,
            "qk_rope_head_dim": spec.qk_rope_head_dim, "qk_nope_head_dim": spec.qk_nope_head_dim,
            "v_head_dim": spec.v_head_dim, "attention_bias": False}


def from_hf(cfg: dict[str, Any], common: dict[str, Any], source: str) -> ModelSpec:
    """A DeepseekV2Config dict -> ModelSpec (the class's defaults where a field is absent)."""
    def get(k: str) -> Any:
        v = cfg.get(k)
        return CLASS_DEFAULTS[k] if v is None and k in CLASS_DEFAULTS else v

    if get("num_experts_per_tok") is None:
        raise MConvertError(f"{source}: num_experts_per_tok is not set (DeepseekV2Config's default None routes to no "
                            "expert); give it")
    if not cfg.get("n_shared_experts", CLASS_DEFAULTS["n_shared_experts"]):  # null: transformers builds none
        raise MConvertError(f"{source}: n_shared_experts={cfg.get('n_shared_experts')!r}: transformers' DeepseekV2 "
                            "runs shared experts in every MoE layer and cannot hold a model without them; conversion "
                            "refused")
    base = llama.rope_spec({**cfg, "num_key_value_heads": cfg.get("num_attention_heads"), "rope_scaling": None},
                           common, add_bias_linear=False, add_qkv_bias=False, source=source)
    k, width = int(get("first_k_dense_replace")), int(get("moe_intermediate_size"))
    groups, group_topk = int(cfg.get("n_group") or 1), int(cfg.get("topk_group") or 1)
    # every group kept, or at least k groups kept (the groups holding the top-k experts outrank the others): HF
    # chooses the greedy top-k
    grouped = get("topk_method") == "group_limited_greedy" and group_topk < groups and (
        group_topk <= int(get("num_experts_per_tok")))
    spec = base.replace(
        kv_channels=None, num_experts=int(get("n_routed_experts")), moe_ffn_hidden_size=width,
        moe_router_topk=int(get("num_experts_per_tok")), moe_router_score_function="softmax",
        moe_router_pre_softmax=True, moe_router_topk_scaling_factor=float(get("routed_scaling_factor")),
        moe_router_num_groups=groups if grouped else None, moe_router_group_topk=group_topk if grouped else None,
        moe_shared_expert_intermediate_size=int(get("n_shared_experts")) * width,
        moe_layer_freq=tuple([0] * k + [1] * (base.num_layers - k)),
        q_lora_rank=cfg.get("q_lora_rank", CLASS_DEFAULTS["q_lora_rank"]), kv_lora_rank=int(get("kv_lora_rank")),
        qk_rope_head_dim=int(get("qk_rope_head_dim")), qk_nope_head_dim=int(get("qk_nope_head_dim")),
        v_head_dim=int(get("v_head_dim")), **llama.rope_scaling_from_hf(cfg, source, mla=True))
    check_group_rule(spec, source)
    return spec


def recognise(fields: dict[str, Any]) -> bool:
    """Megatron args without model_family: multi-latent attention with the pre-softmax router is DeepSeek-V2's."""
    return fields.get("kv_lora_rank") is not None and bool(fields.get("moe_router_pre_softmax")) and (
        fields.get("moe_router_score_function", "softmax") == "softmax")


def v2_preset(**kw: Any) -> ModelSpec:
    """A DeepSeek-V2-style preset: MLA, the pre-softmax router, shared experts, RMSNorm, SwiGLU, untied."""
    base: dict[str, Any] = dict(moe_router_score_function="softmax", moe_router_pre_softmax=True, norm_epsilon=1e-6)
    return llama.rope_preset(NAME, **{**base, **kw})


PRESETS = {
    # DeepSeek-V2-Lite's structure, small: 3 layers (the first dense), 8 heads of q/k 32 + 64 and v 32, no q latent,
    # kv latent 512 + 64 rope rows (576: vLLM's CPU MLA kernel); 16 experts of width 32, top-4 by the pre-softmax
    # router, × 2 (V2-Lite's own factor is 1), two shared experts
    "tiny-deepseek-v2-lite": v2_preset(
        num_layers=3, hidden_size=128, num_attention_heads=8, ffn_hidden_size=256, vocab_size=1000,
        max_position_embeddings=128, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=32, qk_rope_head_dim=64,
        v_head_dim=32, num_experts=16, moe_ffn_hidden_size=32, moe_router_topk=4, moe_router_topk_scaling_factor=2.0,
        moe_shared_expert_intermediate_size=64, moe_layer_freq=(0, 1, 1)),
    # deepseek-ai/DeepSeek-V2-Lite (its config.json's values, YaRN included), for `plan` estimates
    "deepseek-v2-lite": v2_preset(
        num_layers=27, hidden_size=2048, num_attention_heads=16, ffn_hidden_size=10944, vocab_size=102400,
        max_position_embeddings=163840, rope_scaling="yarn", rope_scaling_factor=40.0,
        rope_original_max_position_embeddings=4096, yarn_mscale=0.707, yarn_mscale_all_dim=0.707, q_lora_rank=None,
        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, num_experts=64,
        moe_ffn_hidden_size=1408, moe_router_topk=6, moe_router_topk_scaling_factor=1.0,
        moe_shared_expert_intermediate_size=2816, moe_layer_freq=tuple([0] + [1] * 26), params_dtype="bfloat16"),
}


# ---- GGUF: llama.cpp's deepseek2 (`build_moe_ffn` in llama-graph.cpp) ----------------------------------------
SOFTMAX_GATING = 1  # gguf-py's ExpertGatingFuncType.SOFTMAX, llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX


def gguf_metadata(spec: ModelSpec) -> dict[str, int | float | bool | str]:
    """deepseek2's keys for this router: softmax over every expert (`expert_gating_func`), the top-k weights not
    renormalised, × `routed_scaling_factor`; MLA's keys as DeepSeek-V3's. No expert groups: every group rule this
    class maps (`check_group_rule`) chooses the greedy top-k, which llama.cpp computes without groups (its own
    group score, the sum of a group's top 2 experts, is neither HF's nor megatron-core's here)."""
    hf = to_hf(spec)
    return {EXPERT_FF_KEY: hf["moe_intermediate_size"], "expert_shared_count": hf["n_shared_experts"],
            "leading_dense_block_count": hf["first_k_dense_replace"], "expert_group_count": 1,
            "expert_group_used_count": 1, "expert_gating_func": SOFTMAX_GATING,
            "expert_weights_scale": float(hf["routed_scaling_factor"]), "expert_weights_norm": False,
            **deepseek_v3.mla_gguf_metadata(spec)}


GGUF = dataclasses.replace(deepseek_v3.GGUF, metadata=gguf_metadata)


# DeepSeek-V3's record (tables, vLLM's MLA facts, llama.cpp's deepseek2 tensors) under DeepSeek-V2's class names
# and router; no FT / TensorRT-LLM layout (no MLA there)
FAMILY = dataclasses.replace(
    deepseek_v3.FAMILY, **llama.rope_family(
        NAME, "DeepseekV2", plugin=dataclasses.replace(deepseek_v3.TABLE, family=NAME), hf_fields=HF_FIELDS,
        to_hf=to_hf, from_hf=from_hf, presets=PRESETS, recognise=recognise, recognise_order=3,
        vllm=deepseek_v3.MLA_VLLM, ft=None, trtllm=None, gguf=GGUF, remote_model_types=(),
        transformers_stand_in=None))
