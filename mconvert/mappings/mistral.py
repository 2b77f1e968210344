"""The Mistral family: HF `MistralForCausalLM`, LLaMA's tables without linear biases, plus its sliding window.

HF Mistral applies `sliding_window` whenever it is set; a window shorter than the context is refused.
"""

from __future__ import annotations

from typing import Any

from mconvert.errors import MConvertError
from mconvert.mappings import llama
from mconvert.mappings.family import Family
from mconvert.mappings.fields import Field, refused
from mconvert.spec import ModelSpec

NAME = "mistral"


def _window_covers_context(v: Any, cfg: Any) -> bool:
    # a window at least as long as the context never masks anything
    mpe = cfg.get("max_position_embeddings")
    return isinstance(v, int) and not isinstance(v, bool) and isinstance(mpe, int) and v >= mpe


HF_FIELDS: dict[str, Field] = {
    **llama.ROPE_FIELDS,
    "sliding_window": refused("sliding-window attention shorter than the context is not mapped", None,
                              _window_covers_context),
}


def to_hf(spec: ModelSpec) -> dict[str, Any]:
    """MistralConfig fields: no linear bias, no sliding window."""
    llama.check_rope_style(spec, FAMILY.architecture)
    if spec.has_qkv_bias:
        raise MConvertError("a mistral-family model has no linear biases")
    return {**llama.rope_fields(spec), "sliding_window": None}


def from_hf(cfg: dict[str, Any], common: dict[str, Any], source: str) -> ModelSpec:
    """A MistralConfig dict -> ModelSpec (no linear bias)."""
    return llama.rope_spec(cfg, common, add_bias_linear=False, add_qkv_bias=False, source=source)


PRESETS = {
    "tiny-mistral": llama.rope_preset(NAME, num_layers=2, hidden_size=128, num_attention_heads=4,
                                      num_query_groups=1, ffn_hidden_size=256, vocab_size=1000,
                                      max_position_embeddings=128),
}

FAMILY = Family(**llama.rope_family(
    NAME, "Mistral", hf_fields=HF_FIELDS, to_hf=to_hf, from_hf=from_hf, presets=PRESETS,
    recognise=None,  # Megatron args look like LLaMA's: only an explicit model_family names it
    gguf=llama.GGUF,  # convert_hf_to_gguf.py registers MistralForCausalLM as its LlamaModel
    sliding_window_by_default=True,
))
