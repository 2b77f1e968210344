"""The GLM-4.7-Flash family: HF `Glm4MoeLiteForCausalLM` (transformers ≥ 5; vLLM's `glm4_moe_lite`) — the
DeepSeek-V3 function under GLM's name, read and written with `deepseek_v3`'s tables and rules.

Both engines build it from DeepSeek's parts: transformers' `Glm4MoeLiteAttention` is `DeepseekV3Attention` and its
router, experts and decoder layer are GLM-4.5's (sigmoid scores plus `e_score_correction_bias`, groups scored by
their top 2 experts, `norm_topk_prob`, × `routed_scaling_factor`, shared experts); vLLM's model is
`DeepseekV2MLAAttention` (interleaved rope, always) with GLM-4.5's MoE (sigmoid, always) and DeepSeek's MTP layer
names (`glm4_moe_lite_mtp`). So the weights are DeepSeek-V3's, name for name, and megatron-core's MLA and sigmoid
router compute it.

What differs from DeepseekV3Config is stated, not assumed:
- the dense first layers: transformers ≥ 5 builds them from `mlp_layer_types` (default: one dense layer), vLLM
  from `first_k_dense_replace`; both are read, must agree, and both are written;
- `partial_rotary_factor` (a top-level key of the published config, inside `rope_parameters` in transformers 5)
  would shorten transformers' rope; only 1.0 is read (a `rope_parameters` beyond plain rope is refused);
- transformers does not read `num_nextn_predict_layers` (it builds no MTP layer), vLLM does: it maps to
  `mtp_num_layers` as DeepSeek-V3's does;
- the class defaults are GLM-4.7-Flash's (`CLASS_DEFAULTS`).

Megatron checkpoints remember the class through `model_family` (`glm4_moe_lite`), so an export writes back
`Glm4MoeLiteForCausalLM` / `glm4_moe_lite`, which transformers ≥ 5 and vLLM load as they load the original.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from mconvert.errors import MConvertError
from mconvert.mappings import deepseek_v3, llama
from mconvert.mappings.fields import INT, Field, mapped, refused
from mconvert.spec import ModelSpec

NAME = "glm4_moe_lite"
ARCH = "Glm4MoeLiteForCausalLM"

# Every field of transformers 5's Glm4MoeLiteConfig, and the published config's own keys, beyond the common ones
HF_FIELDS: dict[str, Field] = {
    **deepseek_v3.HF_FIELDS,
    # checked against first_k_dense_replace in from_hf (the two engines read one each)
    "mlp_layer_types": Field("neutral", "the dense/sparse pattern; from_hf checks it equals first_k_dense_replace's"),
    "first_k_dense_replace": mapped("moe_layer_freq", INT),
    "partial_rotary_factor": refused("a partial rope inside MLA's rope dims is not megatron-core's MLA", 1.0),
    "output_router_logits": Field("neutral", "training only (the auxiliary loss's inputs)"),
    "qk_head_dim": Field("neutral", "qk_nope_head_dim + qk_rope_head_dim (transformers 5 saves it)"),
}

# Glm4MoeLiteConfig's defaults (GLM-4.7-Flash's own values)
CLASS_DEFAULTS = {"first_k_dense_replace": 1, "moe_intermediate_size": 1536, "n_shared_experts": 1, "n_group": 1,
                  "topk_group": 1, "n_routed_experts": 64, "num_experts_per_tok": 4, "routed_scaling_factor": 1.8}
LATENT_DEFAULTS = {"q_lora_rank": 768, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 192,
                   "v_head_dim": 256, "rms_norm_eps": 1e-5}


def _dense_first(cfg: dict[str, Any], layers: int, source: str) -> int:
    """The count of leading dense layers both engines build: transformers' `mlp_layer_types` (its default: one)
    and vLLM's `first_k_dense_replace` must agree."""
    types = cfg.get("mlp_layer_types")
    stated = cfg.get("first_k_dense_replace")
    if types is None:
        k = 1 if stated is None else int(stated)
        if k != 1:
            raise MConvertError(f"{source}: first_k_dense_replace={k} without mlp_layer_types: transformers then "
                                "builds one dense layer and vLLM builds first_k_dense_replace; add mlp_layer_types")
        return k
    if not isinstance(types, list) or len(types) != layers or not set(types) <= {"dense", "sparse"}:
        raise MConvertError(f"{source}: mlp_layer_types must list 'dense' or 'sparse' for each of the "
                            f"{layers} layers; found {types!r}")
    k = types.index("sparse") if "sparse" in types else layers
    if "dense" in types[k:]:
        raise MConvertError(f"{source}: mlp_layer_types={types!r} has a dense layer after a sparse one; neither "
                            "vLLM (first_k_dense_replace) nor megatron-core's DeepSeek layout builds it")
    if stated is not None and int(stated) != k:
        raise MConvertError(f"{source}: mlp_layer_types has {k} dense first layers and first_k_dense_replace="
                            f"{stated}: transformers builds the first, vLLM the second; make them agree")
    return k


def from_hf(cfg: dict[str, Any], common: dict[str, Any], source: str) -> ModelSpec:
    """A Glm4MoeLiteConfig dict -> ModelSpec: DeepSeek-V3's reading with this class's defaults."""
    full = {**LATENT_DEFAULTS, **cfg}
    layers = int(full.get("num_hidden_layers", 47))
    full["first_k_dense_replace"] = _dense_first(cfg, layers, source)
    # the dense-attention head width stands in until the MLA fields replace it (GLM-4.7-Flash's 2048 / 20 heads
    # is no whole width)
    base = llama.rope_spec({**full, "num_key_value_heads": full.get("num_attention_heads"), "rope_scaling": None,
                            "head_dim": int(full["v_head_dim"])},
                           common, add_bias_linear=False, add_qkv_bias=False, source=source)
    return deepseek_v3.moe_from_hf(full, base, CLASS_DEFAULTS).replace(
        kv_channels=None, q_lora_rank=full["q_lora_rank"], kv_lora_rank=int(full["kv_lora_rank"]),
        qk_rope_head_dim=int(full["qk_rope_head_dim"]), qk_nope_head_dim=int(full["qk_nope_head_dim"]),
        v_head_dim=int(full["v_head_dim"]), **llama.rope_scaling_from_hf(full, source, mla=True))


PRESETS = {
    # zai-org/GLM-4.7-Flash (its config.json's values), for `plan` estimates: MLA with a q latent, 2048 wide over 20
    # heads, one dense first layer, 64 experts (top-4, × 1.8), one shared expert, one MTP layer
    "glm-4.7-flash": deepseek_v3.deepseek_preset(
        num_layers=47, hidden_size=2048, num_attention_heads=20, ffn_hidden_size=10240, vocab_size=154880,
        max_position_embeddings=202752, norm_epsilon=1e-5, rotary_base=1000000.0, q_lora_rank=768,
        kv_lora_rank=512, qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256, num_experts=64,
        moe_ffn_hidden_size=1536, moe_router_topk=4, moe_router_topk_scaling_factor=1.8,
        moe_shared_expert_intermediate_size=1536, moe_layer_freq=tuple([0] + [1] * 46), mtp_num_layers=1,
        params_dtype="bfloat16").replace(family=NAME),
}


def to_hf(spec: ModelSpec) -> dict[str, Any]:
    """Glm4MoeLiteConfig fields: DeepSeek-V3's, with the dense layers stated for both engines."""
    out = deepseek_v3.to_hf(spec, ARCH)
    k = out["first_k_dense_replace"]
    out["mlp_layer_types"] = ["dense"] * k + ["sparse"] * (spec.num_layers - k)
    return out


# DeepSeek-V3's record (tables, vLLM facts) under GLM's class names, without FT / TensorRT-LLM / GGUF layouts; never
# inferred from Megatron args (MLA without model_family is deepseek_v3)
FAMILY = dataclasses.replace(
    deepseek_v3.FAMILY, **llama.rope_family(
        NAME, "Glm4MoeLite", plugin=dataclasses.replace(deepseek_v3.TABLE, family=NAME), hf_fields=HF_FIELDS,
        to_hf=to_hf, from_hf=from_hf, presets=PRESETS, recognise=None, vllm=deepseek_v3.MLA_VLLM, ft=None, trtllm=None,
        gguf=None,  # llama.cpp's reading of Glm4MoeLiteForCausalLM is not checked here
        remote_model_types=(), transformers_stand_in="deepseek_v3"))
