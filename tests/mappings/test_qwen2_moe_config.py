"""Qwen2-MoE configs (HF `Qwen2MoeForCausalLM`) read both routers and the gated shared expert; what the class
cannot compute, or megatron-core's model cannot, is refused by name (the function itself is proven in
tests/trainer/test_qwen2_moe.py)."""

from __future__ import annotations

import pytest

from mconvert.errors import MConvertError
from mconvert.mappings.families import hf_config, preset, spec_from_hf_config, spec_from_megatron_args

# Qwen1.5-MoE-A2.7B's structure (Qwen2MoeConfig's defaults are its values), as a config states it
QWEN15_MOE = {
    "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "hidden_size": 2048,
    "intermediate_size": 5632, "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 16,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "vocab_size": 151936,
    "hidden_act": "silu", "tie_word_embeddings": False, "use_sliding_window": False, "sliding_window": 32768,
    "max_window_layers": 21, "decoder_sparse_step": 1, "moe_intermediate_size": 1408,
    "shared_expert_intermediate_size": 5632, "num_experts_per_tok": 4, "num_experts": 60, "norm_topk_prob": False,
    "output_router_logits": False, "router_aux_loss_coef": 0.001, "torch_dtype": "bfloat16"}


def test_qwen15_moe_reads_as_the_pre_softmax_router_with_a_gated_shared_expert() -> None:
    spec = spec_from_hf_config(QWEN15_MOE)
    assert (spec.family, spec.add_qkv_bias, spec.num_experts, spec.moe_router_topk, spec.moe_router_pre_softmax,
            spec.moe_shared_expert_intermediate_size, spec.moe_shared_expert_gate) == (
        "qwen2_moe", True, 60, 4, True, 5632, True)
    assert spec_from_hf_config(hf_config(spec)) == spec
    renorm = spec_from_hf_config({**QWEN15_MOE, "norm_topk_prob": True})
    assert not renorm.moe_router_pre_softmax and spec_from_hf_config(hf_config(renorm)) == renorm
    args = vars(spec.to_megatron_args())
    assert (args["moe_router_pre_softmax"], args["moe_shared_expert_gate"]) == (True, True)
    del args["model_family"]  # recognised from the args alone, as a Megatron-LM checkpoint is
    assert spec_from_megatron_args(args) == spec


@pytest.mark.parametrize("changes,message", [
    ({"use_sliding_window": True}, "use_sliding_window=True"),
    ({"layer_types": ["sliding_attention"] * 24}, "layer_types="),
    ({"decoder_sparse_step": 2}, "decoder_sparse_step=2"),
    ({"mlp_only_layers": [0]}, "mlp_only_layers=[0]"),
    ({"qkv_bias": False}, "qkv_bias=False"),
    ({"shared_expert_intermediate_size": 0}, "shared_expert_intermediate_size=0"),
])
def test_what_the_class_computes_otherwise_is_refused_by_name(changes: dict, message: str) -> None:
    with pytest.raises(MConvertError, match=message.replace("[", r"\[").replace("]", r"\]")):
        spec_from_hf_config({**QWEN15_MOE, **changes})


def test_megatron_models_hf_qwen2_moe_cannot_compute_are_refused() -> None:
    spec = preset("tiny-qwen2-moe")
    for changes, message in ((dict(moe_shared_expert_gate=False), "gated by sigmoid"),
                             (dict(moe_router_topk_scaling_factor=2.0), "no scale, group or bias"),
                             (dict(moe_router_score_function="sigmoid"), "no scale, group or bias"),
                             (dict(add_qkv_bias=False), "a qkv bias")):
        with pytest.raises(MConvertError, match=message):
            hf_config(spec.replace(**changes))
    with pytest.raises(MConvertError, match="moe_shared_expert_gate needs shared experts"):
        spec.replace(moe_shared_expert_intermediate_size=None)
    # a gated shared expert in a family whose HF class has none
    args = preset("tiny-mixtral").to_megatron_args(1, 1)
    args.moe_shared_expert_intermediate_size, args.moe_shared_expert_gate = 128, True
    with pytest.raises(MConvertError, match="not supported for the 'mixtral' family"):
        spec_from_megatron_args(args)
