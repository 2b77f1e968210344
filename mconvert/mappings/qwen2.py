"""The Qwen2 family: HF `Qwen2ForCausalLM`, LLaMA's tables with a qkv-only bias.

HF Qwen2 applies `sliding_window` only with `use_sliding_window`, and only on the layers `layer_types` marks
`sliding_attention`; without `layer_types`, Qwen2Config marks layers `max_window_layers` and up (0-based) as
sliding, the ones below as full attention. TensorRT-LLM's LLaMA class has no qkv-only bias, so there is no
TensorRT-LLM form.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from mconvert.errors import MConvertError
from mconvert.mappings import llama
from mconvert.mappings.record import Family, GgufLayout
from mconvert.mappings.fields import BOOL, INT, Field, mapped, refused
from mconvert.spec import ModelSpec

NAME = "qwen2"
CLASS_DEFAULTS = {"sliding_window": 4096, "max_window_layers": 28}  # Qwen2Config's (and Qwen3Config's) defaults
LAYER_TYPES = ("full_attention", "sliding_attention")

HF_FIELDS: dict[str, Field] = {
    **llama.ROPE_FIELDS,
    "use_sliding_window": mapped("window_size", BOOL),
    "sliding_window": mapped("window_size", INT),
    "max_window_layers": mapped("window_pattern", INT),
    "layer_types": mapped("window_pattern", (list,)),
    # Qwen's 1M-context releases: vLLM serves dual-chunk attention with its own rotary embedding past chunk_size,
    # transformers and megatron-core attend in full; the weights are the ordinary ones
    "dual_chunk_attention_config": refused(
        "vLLM serves dual-chunk attention past its chunk_size, which transformers and Megatron do not compute; "
        "remove the field to convert the same weights for contexts up to chunk_size", None),
}


def window_fields(spec: ModelSpec) -> dict[str, Any]:
    """The window fields of Qwen2Config / Qwen3Config. No window: switched off, as before. A window: switched on,
    `layer_types` explicit, and `max_window_layers` when the windowed layers are the top ones (the only form it
    can state; transformers reads `layer_types` first)."""
    if spec.window_size is None:
        return {"use_sliding_window": False, "sliding_window": None, "max_window_layers": spec.num_layers}
    windowed = [spec.layer_window(i) is not None for i in range(spec.num_layers)]
    out: dict[str, Any] = {"use_sliding_window": True, "sliding_window": llama.hf_sliding_window(spec)}
    first = windowed.index(True)
    if all(windowed[first:]):
        out["max_window_layers"] = first
    out["layer_types"] = [LAYER_TYPES[w] for w in windowed]
    return out


def window_from_hf(cfg: dict[str, Any], source: str) -> dict[str, Any]:
    """ModelSpec window kwargs from Qwen2Config's fields, as Qwen2Config resolves them: `sliding_window` only with
    `use_sliding_window`; windowed layers from `layer_types`, else from `max_window_layers`."""
    num_layers = int(cfg["num_hidden_layers"])
    on = cfg.get("use_sliding_window") is True
    window = llama.window_from_hf(cfg.get("sliding_window", CLASS_DEFAULTS["sliding_window"]), source) if on else None
    types = cfg.get("layer_types")
    if types is None:
        mwl = cfg.get("max_window_layers", CLASS_DEFAULTS["max_window_layers"])
        if isinstance(mwl, bool) or not isinstance(mwl, int) or mwl < 0:
            raise MConvertError(f"{source}: config field max_window_layers={mwl!r} must be a whole number >= 0; fix it")
        pattern = [int(window is not None and i >= mwl) for i in range(num_layers)]
    else:
        shown = repr(types) if len(repr(types)) <= 80 else repr(types)[:77] + "..."
        if len(types) != num_layers or any(t not in LAYER_TYPES for t in types):
            raise MConvertError(f"{source}: config field layer_types={shown} must list {num_layers} entries, each "
                                f"{' or '.join(LAYER_TYPES)} (other attention kinds are not mapped); conversion refused")
        pattern = [int(t == "sliding_attention") for t in types]
        if any(pattern) and window is None:
            raise MConvertError(f"{source}: config field layer_types={shown} marks sliding_attention layers but the "
                                "window is off (use_sliding_window is not true, or sliding_window is null): "
                                "transformers cannot build their mask; fix config.json")
    return {"window_size": window if any(pattern) else None, "window_pattern": tuple(pattern)}


def vllm_config_checks(cfg: dict[str, Any]) -> tuple[list[str], list[str]]:
    """verify's config.json checks for vLLM's Qwen2Model (Qwen3 runs on it too): LLaMA's, and a window on only
    some layers, which vLLM refuses (it asserts max_window_layers == num_hidden_layers when layer_types mixes
    kinds, and then windows no layer)."""
    problems, notes = llama.rope_config_checks(cfg)
    types = cfg.get("layer_types")
    if isinstance(types, list) and len(set(map(str, types))) > 1:
        problems.append(f"layer_types windows {types.count('sliding_attention')} of {len(types)} layers: vLLM's "
                        "Qwen2Model serves a sliding window only on every layer — serve this export with "
                        "transformers")
    return problems, notes


VLLM = dataclasses.replace(llama.ROPE_VLLM, config_checks=vllm_config_checks)


def to_hf(spec: ModelSpec) -> dict[str, Any]:
    """Qwen2Config fields: a qkv bias and no other, the window and its layers."""
    llama.check_rope_style(spec, FAMILY.architecture)
    if spec.add_bias_linear or not spec.add_qkv_bias:
        raise MConvertError("a qwen2-family model has a qkv bias and no other linear bias")
    return {**llama.rope_fields(spec), **window_fields(spec)}


def from_hf(cfg: dict[str, Any], common: dict[str, Any], source: str) -> ModelSpec:
    """A Qwen2Config dict -> ModelSpec (qkv bias only; the window and its layers)."""
    return llama.rope_spec(cfg, common, add_bias_linear=False, add_qkv_bias=True,
                           source=source).replace(**window_from_hf(cfg, source))


def recognise(fields: dict[str, Any]) -> bool:
    """Megatron args without model_family: a qkv bias without the other linear biases is Qwen2."""
    return bool(fields["add_qkv_bias"]) and not fields["add_bias_linear"]


PRESETS = {
    "tiny-qwen2": llama.rope_preset(NAME, num_layers=2, hidden_size=128, num_attention_heads=4,
                                    num_query_groups=2, ffn_hidden_size=256, vocab_size=1000,
                                    max_position_embeddings=128, norm_epsilon=1e-6, rotary_base=1000000.0,
                                    add_qkv_bias=True),
    # Qwen2's per-layer window: layer 0 full attention, layer 1 a window of 16 keys (max_window_layers 1)
    "tiny-qwen2-swa": llama.rope_preset(NAME, num_layers=2, hidden_size=128, num_attention_heads=4,
                                        num_query_groups=2, ffn_hidden_size=256, vocab_size=1000,
                                        max_position_embeddings=128, norm_epsilon=1e-6, rotary_base=1000000.0,
                                        add_qkv_bias=True, window_size=15, window_pattern=(0, 1)),
}

# llama.cpp's QWEN2 architecture ropes in NeoX order, as HF does: q and k are written unpermuted.
GGUF = GgufLayout(arch="qwen2", tensors=llama.GGUF_TENSORS, permute_qk=False, refuse=llama.gguf_refuse_rope_freqs)

FAMILY = Family(**llama.rope_family(
    NAME, "Qwen2", hf_fields=HF_FIELDS, to_hf=to_hf, from_hf=from_hf, presets=PRESETS, recognise=recognise,
    recognise_order=10,
    trtllm=None,  # TensorRT-LLM's LLaMA class has no qkv-only bias
    gguf=GGUF,
    hf_window="per_layer",
    vllm=VLLM,
))
