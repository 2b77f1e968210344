"""The Qwen3-MoE family: HF `Qwen3MoeForCausalLM`, Qwen3's attention (per-head q/k RMSNorm) with routed experts.

HF routes with softmax over all router logits, top-k, then renormalises the k only when `norm_topk_prob` is
true — megatron-core's default router (softmax over the top-k logits) is that case, so a config without it
is refused. `moe_intermediate_size` is each expert's width (Megatron's `moe_ffn_hidden_size`);
`intermediate_size` is the dense MLP of `mlp_only_layers` / `decoder_sparse_step` layers, which must not exist.
Its sliding window (`use_sliding_window`) covers every layer: Qwen3MoeConfig reads no `max_window_layers` and no
`layer_types`, though vLLM reads `layer_types`, so one that is present must agree.
"""

from __future__ import annotations

from typing import Any

from mconvert.errors import MConvertError
from mconvert.mappings import llama, mixtral, qwen2, qwen3
from mconvert.mappings.record import Family, GgufLayout, Plugin, expert_width_key
from mconvert.mappings.fields import BOOL, INT, NEUTRAL, Field, mapped, refused
from mconvert.spec import ModelSpec

NAME = "qwen3_moe"
L, H = llama.L, llama.H

# Qwen's names of the router and the experts (Qwen2-MoE's too)
EXPERTS = mixtral.Experts("mlp.gate.weight", *(f"mlp.experts.*.{p}_proj.weight" for p in ("gate", "up", "down")))

TABLE = Plugin(
    family=NAME,
    table={**mixtral.ATTENTION_TABLE, **qwen3.QK_NORM_TABLE, **EXPERTS.table()},
    hf_drops=llama.TABLE.hf_drops,
)

# Every field of transformers 4.57's Qwen3MoeConfig beyond the common ones.
HF_FIELDS: dict[str, Field] = {
    **qwen3.HF_FIELDS,
    "moe_intermediate_size": mapped("moe_ffn_hidden_size", INT),
    "num_experts": mapped("num_experts", INT),
    "num_experts_per_tok": mapped("moe_router_topk", INT),
    "norm_topk_prob": mapped("moe_router_topk", BOOL),  # must be true: checked in from_hf, absent included
    "decoder_sparse_step": refused("dense layers between MoE layers (decoder_sparse_step != 1) are not mapped", 1),
    "mlp_only_layers": refused("dense-MLP layers (mlp_only_layers) are not mapped", None, lambda v, _: v == []),
    "router_aux_loss_coef": mixtral.MOE_NEUTRAL,
    "output_router_logits": mixtral.MOE_NEUTRAL,
    # not a Qwen3MoeConfig field, but vLLM's Qwen3-MoE adds a shared expert when it is positive; Qwen's own
    # configs state 0
    "shared_expert_intermediate_size": refused("a shared expert is not mapped", 0),
    "max_window_layers": Field(NEUTRAL, "Qwen3-MoE's modeling and vLLM's read no max_window_layers"),
}


def window_from_hf(cfg: dict[str, Any], source: str) -> dict[str, Any]:
    """ModelSpec window kwargs: `sliding_window` on every layer with `use_sliding_window`, none without; a
    `layer_types` must say the same of every layer (vLLM windows its layers by it)."""
    on = cfg.get("use_sliding_window") is True
    window = llama.window_from_hf(cfg.get("sliding_window", qwen2.CLASS_DEFAULTS["sliding_window"]), source) if on else None
    types = cfg.get("layer_types")
    expected = [qwen2.LAYER_TYPES[window is not None]] * int(cfg["num_hidden_layers"])
    if types is not None and types != expected:
        raise MConvertError(f"{source}: config field layer_types does not mark every layer {expected[0]}: HF "
                            f"{FAMILY.architecture} windows every layer or none (use_sliding_window), vLLM the ones "
                            "layer_types marks; fix config.json")
    return {"window_size": window, "window_pattern": None}


def to_hf(spec: ModelSpec) -> dict[str, Any]:
    """Qwen3MoeConfig fields: Qwen3's, plus experts with renormalised top-k and every layer sparse."""
    mixtral.check_moe_style(spec, FAMILY.architecture)
    if not spec.qk_layernorm:
        raise MConvertError(f"HF {FAMILY.architecture} needs per-head q/k norm and this model has "
                            "qk_layernorm=False; use the mixtral family; conversion refused")
    fields = qwen3.to_hf(spec.replace(num_experts=None))
    return {**fields, "moe_intermediate_size": spec.expert_ffn_hidden_size, "num_experts": spec.num_experts,
            "num_experts_per_tok": spec.moe_router_topk, "norm_topk_prob": True, "decoder_sparse_step": 1,
            "mlp_only_layers": []}


def from_hf(cfg: dict[str, Any], common: dict[str, Any], source: str) -> ModelSpec:
    """A Qwen3MoeConfig dict -> ModelSpec; `norm_topk_prob` must be true (HF's default is false)."""
    if cfg.get("norm_topk_prob") is not True:
        raise MConvertError(f"{source}: config field norm_topk_prob={cfg.get('norm_topk_prob')!r} is not supported: "
                            "only renormalised top-k routing (norm_topk_prob=true, megatron-core's router) is "
                            "mapped; conversion refused")
    per_layer = ("layer_types", "max_window_layers")  # Qwen3's, which this class does not read
    base = qwen3.from_hf({k: v for k, v in cfg.items() if k not in per_layer}, common, source)
    return base.replace(**window_from_hf(cfg, source),num_experts=int(cfg.get("num_experts", 128)),
                        moe_ffn_hidden_size=int(cfg.get("moe_intermediate_size", 768)),
                        moe_router_topk=int(cfg.get("num_experts_per_tok", 8)))


def recognise(fields: dict[str, Any]) -> bool:
    """Megatron args without model_family: experts with q/k norm and no linear bias are Qwen3-MoE."""
    return (fields.get("num_experts") is not None and bool(fields["qk_layernorm"])
            and not fields["add_qkv_bias"] and not fields["add_bias_linear"])


PRESETS = {
    # head_dim 32 (hidden 128, 8 heads) as in tiny-qwen3; 4 experts of width 64, top-2
    "tiny-qwen3-moe": llama.rope_preset(NAME, num_layers=2, hidden_size=128, num_attention_heads=8,
                                        num_query_groups=2, kv_channels=32, ffn_hidden_size=256, vocab_size=1000,
                                        max_position_embeddings=128, norm_epsilon=1e-6, rotary_base=1000000.0,
                                        tie_embeddings=True, qk_layernorm=True, num_experts=4,
                                        moe_ffn_hidden_size=64, moe_router_topk=2),
}

# llama.cpp's QWEN3MOE architecture (convert_hf_to_gguf.py's Qwen3MoeModel): Qwen3's attention names, the
# router as `ffn_gate_inp`, every expert's gate / up / down stacked [experts, out, in]; the experts' width in
# `expert_feed_forward_length`. llama.cpp always renormalises the top-k weights (norm_topk_prob=true, the
# only routing this family admits).
GGUF = GgufLayout(
    arch="qwen3moe",
    tensors={
        **{k: v for k, v in qwen3.GGUF.tensors.items() if k not in mixtral.DENSE_GGUF},
        **EXPERTS.gguf(),
    },
    permute_qk=False,
    refuse=llama.gguf_refuse_rope_freqs,
    metadata=expert_width_key,
)

FAMILY = Family(**llama.rope_family(
    NAME, "Qwen3Moe", plugin=TABLE, hf_fields=HF_FIELDS, to_hf=to_hf, from_hf=from_hf, presets=PRESETS,
    recognise=recognise, recognise_order=5,
    ft=None,  # FasterTransformer has no MoE form here
    trtllm=None,  # no confirmed TensorRT-LLM MoE layout
    gguf=GGUF,
    hf_window="every",
    moe=True,
))
