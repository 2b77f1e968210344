"""The Qwen2-MoE family: HF `Qwen2MoeForCausalLM` (Qwen1.5-MoE, Qwen2-57B-A14B) — Qwen2's attention (qkv bias)
with routed experts and one gated shared expert.

What transformers 4.57 (`modeling_qwen2_moe.py`) computes, and megatron-core's equal:
- router: softmax over every expert in fp32, top-k of those probabilities; renormalised over the k only with
  `norm_topk_prob` — false is megatron-core's `moe_router_pre_softmax` (no renormalisation), true its default
  router (softmax over the top-k logits is the same renormalised weights); no scaling, no groups, no bias;
- shared expert: a SwiGLU MLP of `shared_expert_intermediate_size` whose output is multiplied per token by
  sigmoid(`shared_expert_gate`(x)), a [1, hidden] weight = megatron-core's `moe_shared_expert_gate`
  (`mlp.shared_experts.gate_weight`); the class always builds both.
Dense layers (`decoder_sparse_step` ≠ 1, `mlp_only_layers`) and the sliding window are refused by name.
"""

from __future__ import annotations

from typing import Any

from mconvert.errors import MConvertError
from mconvert.mappings import llama, mixtral, qwen2, qwen3_moe
from mconvert.mappings.fields import BOOL, INT, Field, mapped, refused
from mconvert.mappings.record import Family, GgufLayout, Plugin, Rule, expert_width_key
from mconvert.spec import ModelSpec

NAME = "qwen2_moe"
ARCH = "Qwen2MoeForCausalLM"
L, H = llama.L, llama.H

TABLE = Plugin(
    family=NAME,
    table={
        **mixtral.ATTENTION_TABLE,
        **qwen3_moe.EXPERTS.table(),
        L + "mlp.shared_experts.linear_fc1.weight": Rule((H + "mlp.shared_expert.gate_proj.weight",
                                                          H + "mlp.shared_expert.up_proj.weight"), "gated"),
        L + "mlp.shared_experts.linear_fc2.weight": Rule((H + "mlp.shared_expert.down_proj.weight",)),
        L + "mlp.shared_experts.gate_weight": Rule((H + "mlp.shared_expert_gate.weight",)),
    },
    hf_drops=llama.TABLE.hf_drops,
)

# Every field of transformers 4.57's Qwen2MoeConfig beyond the common ones
HF_FIELDS: dict[str, Field] = {
    **qwen2.HF_FIELDS,
    "use_sliding_window": refused("Qwen2-MoE's sliding window is not mapped", False),
    "sliding_window": Field("neutral", "read only with use_sliding_window (refused)"),
    "max_window_layers": Field("neutral", "read only with use_sliding_window (refused)"),
    "layer_types": refused("Qwen2-MoE's sliding window is not mapped", None,
                           lambda v, _: isinstance(v, list) and set(v) <= {"full_attention"}),
    "moe_intermediate_size": mapped("moe_ffn_hidden_size", INT),
    "num_experts": mapped("num_experts", INT),
    "num_experts_per_tok": mapped("moe_router_topk", INT),
    "norm_topk_prob": mapped("moe_router_pre_softmax", BOOL),  # false: pre-softmax; true: the default router
    "shared_expert_intermediate_size": mapped("moe_shared_expert_intermediate_size", INT),
    "decoder_sparse_step": refused("dense layers between MoE layers (decoder_sparse_step != 1) are not mapped", 1),
    "mlp_only_layers": refused("dense-MLP layers (mlp_only_layers) are not mapped", None, lambda v, _: v == []),
    "qkv_bias": refused("Qwen2-MoE without its qkv bias is not mapped", True),
    "router_aux_loss_coef": mixtral.MOE_NEUTRAL,
    "output_router_logits": mixtral.MOE_NEUTRAL,
}

# Qwen2MoeConfig's defaults (Qwen1.5-MoE-A2.7B's values) of the fields read below
CLASS_DEFAULTS = {"moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632, "num_experts_per_tok": 4,
                  "num_experts": 60, "norm_topk_prob": False}


def to_hf(spec: ModelSpec) -> dict[str, Any]:
    """Qwen2MoeConfig fields; refuses what the class cannot compute."""
    llama.check_rope_style(spec, ARCH)
    if not spec.is_moe or spec.is_mla or spec.add_bias_linear or not spec.add_qkv_bias:
        raise MConvertError(f"HF {ARCH} has Qwen2's attention (a qkv bias, no other) and routed experts; this model "
                            f"has num_experts={spec.num_experts}, kv_lora_rank={spec.kv_lora_rank}, "
                            f"add_qkv_bias={spec.add_qkv_bias}, add_bias_linear={spec.add_bias_linear}; "
                            "conversion refused")
    extra = {k: v for k, v in spec.deepseek_features().items()
             if k not in ("moe_router_pre_softmax", "moe_shared_expert_intermediate_size", "moe_shared_expert_gate")}
    if spec.moe_router_score_function != "softmax" or extra:
        raise MConvertError(f"HF {ARCH} routes with a softmax over every expert, no scale, group or bias, on every "
                            f"layer; this model has {extra or {'moe_router_score_function': 'sigmoid'}}; "
                            "conversion refused")
    if not (spec.moe_shared_expert_intermediate_size and spec.moe_shared_expert_gate):
        raise MConvertError(f"HF {ARCH} always runs one shared expert gated by sigmoid(shared_expert_gate); this "
                            f"model has moe_shared_expert_intermediate_size={spec.moe_shared_expert_intermediate_size}"
                            f", moe_shared_expert_gate={spec.moe_shared_expert_gate}; conversion refused")
    return {**llama.rope_fields(spec.replace(num_experts=None)), "use_sliding_window": False,
            "moe_intermediate_size": spec.expert_ffn_hidden_size, "num_experts": spec.num_experts,
            "num_experts_per_tok": spec.moe_router_topk, "norm_topk_prob": not spec.moe_router_pre_softmax,
            "shared_expert_intermediate_size": spec.moe_shared_expert_intermediate_size, "decoder_sparse_step": 1,
            "mlp_only_layers": [], "qkv_bias": True}


def from_hf(cfg: dict[str, Any], common: dict[str, Any], source: str) -> ModelSpec:
    """A Qwen2MoeConfig dict -> ModelSpec (the class's defaults where a field is absent)."""
    def get(k: str) -> Any:
        v = cfg.get(k)
        return CLASS_DEFAULTS[k] if v is None else v

    if not get("shared_expert_intermediate_size"):
        raise MConvertError(f"{source}: shared_expert_intermediate_size={cfg.get('shared_expert_intermediate_size')!r}"
                            ": transformers' Qwen2-MoE runs its shared expert in every layer; a model without one is "
                            "not this class; conversion refused")
    base = llama.rope_spec(cfg, common, add_bias_linear=False, add_qkv_bias=True, source=source)
    return base.replace(
        num_experts=int(get("num_experts")), moe_ffn_hidden_size=int(get("moe_intermediate_size")),
        moe_router_topk=int(get("num_experts_per_tok")), moe_router_pre_softmax=not get("norm_topk_prob"),
        moe_shared_expert_intermediate_size=int(get("shared_expert_intermediate_size")), moe_shared_expert_gate=True)


def recognise(fields: dict[str, Any]) -> bool:
    """Megatron args without model_family: experts with a gated shared expert and a qkv bias are Qwen2-MoE."""
    return bool(fields.get("moe_shared_expert_gate")) and bool(fields["add_qkv_bias"]) and not fields["add_bias_linear"]


PRESETS = {
    # Qwen1.5-MoE's structure, small: 2 layers, GQA 4 heads over 2 groups, 8 experts of width 64, top-2 by the
    # pre-softmax router (norm_topk_prob false), a gated shared expert of width 128
    "tiny-qwen2-moe": llama.rope_preset(
        NAME, num_layers=2, hidden_size=128, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=256,
        vocab_size=1000, max_position_embeddings=128, norm_epsilon=1e-6, rotary_base=1000000.0, add_qkv_bias=True,
        num_experts=8, moe_ffn_hidden_size=64, moe_router_topk=2, moe_router_pre_softmax=True,
        moe_shared_expert_intermediate_size=128, moe_shared_expert_gate=True),
}

# llama.cpp's QWEN2MOE architecture (convert_hf_to_gguf.py's Qwen2MoeModel, llama.cpp's models/qwen2moe.cpp):
# Qwen2's attention names, the router as `ffn_gate_inp`, the experts stacked [experts, out, in], the shared expert
# as `ffn_*_shexp` gated by sigmoid(`ffn_gate_inp_shexp`); softmax over every expert, the top-k weights never
# renormalised (the pre-softmax router) and not scaled.
GGUF_TENSORS: dict[str, str] = {
    **{k: v for k, v in qwen2.GGUF.tensors.items() if k not in mixtral.DENSE_GGUF},
    **qwen3_moe.EXPERTS.gguf(),
    **{H + f"mlp.shared_expert.{p}_proj.weight": f"blk.*.ffn_{p}_shexp.weight" for p in ("gate", "up", "down")},
    H + "mlp.shared_expert_gate.weight": "blk.*.ffn_gate_inp_shexp.weight",
}


def gguf_refuse(spec: ModelSpec) -> None:
    """What llama.cpp's qwen2moe cannot compute: llama3 rope scaling (no rope_freqs here), and top-k weights
    renormalised (norm_topk_prob true: megatron-core's default router), which its graph never does."""
    llama.gguf_refuse_rope_freqs(spec)
    if not spec.moe_router_pre_softmax:
        raise MConvertError("llama.cpp's qwen2moe never renormalises the top-k expert weights; this qwen2_moe-family "
                            "model does (norm_topk_prob true: megatron-core's default router), so there is no GGUF "
                            "form; conversion refused")


GGUF = GgufLayout(
    arch="qwen2moe", tensors=GGUF_TENSORS, permute_qk=False, refuse=gguf_refuse,
    metadata=lambda spec: {**expert_width_key(spec),
                           "expert_shared_feed_forward_length": spec.moe_shared_expert_intermediate_size},
)


FAMILY = Family(**llama.rope_family(
    NAME, "Qwen2Moe", plugin=TABLE, hf_fields=HF_FIELDS, to_hf=to_hf, from_hf=from_hf, presets=PRESETS,
    recognise=recognise, recognise_order=2,
    ft=None,  # FasterTransformer has no MoE form here
    trtllm=None,  # no confirmed TensorRT-LLM MoE layout
    gguf=GGUF,
    moe=True,
    deepseek=True,  # it holds the pre-softmax router and the gated shared expert (to_hf refuses the rest)
))
