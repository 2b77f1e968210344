"""The Qwen2 family: HF `Qwen2ForCausalLM`, LLaMA's tables with a qkv-only bias.

HF Qwen2 applies its sliding window only with `use_sliding_window`, which is refused; TensorRT-LLM's LLaMA
class has no qkv-only bias, so there is no TensorRT-LLM form.
"""

from __future__ import annotations

from typing import Any

from mconvert.errors import MConvertError
from mconvert.mappings import llama
from mconvert.mappings.family import Family, GgufLayout
from mconvert.mappings.fields import NEUTRAL, Field, refused
from mconvert.spec import ModelSpec

NAME = "qwen2"


def _all_full_attention(v: Any, _: Any) -> bool:
    return isinstance(v, list) and all(t == "full_attention" for t in v)


HF_FIELDS: dict[str, Field] = {
    **llama.ROPE_FIELDS,
    "use_sliding_window": refused("sliding-window attention is not mapped", False),
    "sliding_window": Field(NEUTRAL, "read only with use_sliding_window, which is refused"),
    "max_window_layers": Field(NEUTRAL, "read only with use_sliding_window, which is refused"),
    "layer_types": refused("attention layers other than full attention are not mapped", None, _all_full_attention),
}


def to_hf(spec: ModelSpec) -> dict[str, Any]:
    """Qwen2Config fields: a qkv bias and no other, sliding window off."""
    llama.check_rope_style(spec, FAMILY.architecture)
    if spec.add_bias_linear or not spec.add_qkv_bias:
        raise MConvertError("a qwen2-family model has a qkv bias and no other linear bias")
    return {**llama.rope_fields(spec), "use_sliding_window": False, "sliding_window": None,
            "max_window_layers": spec.num_layers}


def from_hf(cfg: dict[str, Any], common: dict[str, Any], source: str) -> ModelSpec:
    """A Qwen2Config dict -> ModelSpec (qkv bias only)."""
    return llama.rope_spec(cfg, common, add_bias_linear=False, add_qkv_bias=True, source=source)


def recognise(fields: dict[str, Any]) -> bool:
    """Megatron args without model_family: a qkv bias without the other linear biases is Qwen2."""
    return bool(fields["add_qkv_bias"]) and not fields["add_bias_linear"]


PRESETS = {
    "tiny-qwen2": llama.rope_preset(NAME, num_layers=2, hidden_size=128, num_attention_heads=4,
                                    num_query_groups=2, ffn_hidden_size=256, vocab_size=1000,
                                    max_position_embeddings=128, norm_epsilon=1e-6, rotary_base=1000000.0,
                                    add_qkv_bias=True),
}

# llama.cpp's QWEN2 architecture ropes in NeoX order, as HF does: q and k are written unpermuted.
GGUF = GgufLayout(arch="qwen2", tensors=llama.GGUF_TENSORS, permute_qk=False, refuse=llama.gguf_refuse_rope_freqs)

FAMILY = Family(**llama.rope_family(
    NAME, "Qwen2", hf_fields=HF_FIELDS, to_hf=to_hf, from_hf=from_hf, presets=PRESETS, recognise=recognise,
    recognise_order=10,
    trtllm=None,  # TensorRT-LLM's LLaMA class has no qkv-only bias
    gguf=GGUF,
))
