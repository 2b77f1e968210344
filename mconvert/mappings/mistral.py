"""The Mistral family: HF `MistralForCausalLM`, LLaMA's tables without linear biases, plus its sliding window.

HF Mistral applies `sliding_window` to every layer whenever it is set, and MistralConfig defaults it to 4096 when
config.json omits it; megatron-core's `window_size=(sliding_window - 1, 0)` is the same mask.
"""

from __future__ import annotations

from typing import Any

from mconvert.errors import MConvertError
from mconvert.mappings import llama
from mconvert.mappings.record import Family
from mconvert.mappings.fields import INT, Field, mapped
from mconvert.spec import ModelSpec

NAME = "mistral"
CLASS_DEFAULT_WINDOW = 4096  # MistralConfig's `sliding_window` when config.json omits the key

HF_FIELDS: dict[str, Field] = {
    **llama.ROPE_FIELDS,
    "sliding_window": mapped("window_size", INT),
}


def to_hf(spec: ModelSpec) -> dict[str, Any]:
    """MistralConfig fields: no linear bias; the window (every layer) always explicit, null for none."""
    llama.check_rope_style(spec, FAMILY.architecture)
    if spec.has_qkv_bias:
        raise MConvertError("a mistral-family model has no linear biases")
    return {**llama.rope_fields(spec), "sliding_window": llama.hf_sliding_window(spec)}


def from_hf(cfg: dict[str, Any], common: dict[str, Any], source: str) -> ModelSpec:
    """A MistralConfig dict -> ModelSpec (no linear bias; an absent `sliding_window` is the class's 4096)."""
    window = llama.window_from_hf(cfg.get("sliding_window", CLASS_DEFAULT_WINDOW), source)
    return llama.rope_spec(cfg, common, add_bias_linear=False, add_qkv_bias=False,
                           source=source).replace(window_size=window)


def recognise(fields: dict[str, Any]) -> bool:
    """Megatron args without model_family: one window on every layer, no linear bias, no q/k norm is Mistral."""
    return (fields.get("window_size") is not None and fields.get("window_pattern") is None
            and not fields["add_bias_linear"] and not fields["add_qkv_bias"] and not fields["qk_layernorm"])


PRESETS = {
    "tiny-mistral": llama.rope_preset(NAME, num_layers=2, hidden_size=128, num_attention_heads=4,
                                      num_query_groups=1, ffn_hidden_size=256, vocab_size=1000,
                                      max_position_embeddings=128),
    # a window of 16 keys (window_size 15) on every layer, shorter than the 128-token context
    "tiny-mistral-swa": llama.rope_preset(NAME, num_layers=2, hidden_size=128, num_attention_heads=4,
                                          num_query_groups=2, ffn_hidden_size=256, vocab_size=1000,
                                          max_position_embeddings=128, window_size=15),
}

FAMILY = Family(**llama.rope_family(
    NAME, "Mistral", hf_fields=HF_FIELDS, to_hf=to_hf, from_hf=from_hf, presets=PRESETS,
    recognise=recognise, recognise_order=50,  # else Megatron args look like LLaMA's
    gguf=llama.GGUF,  # convert_hf_to_gguf.py registers MistralForCausalLM as its LlamaModel
    hf_window="every",
))
