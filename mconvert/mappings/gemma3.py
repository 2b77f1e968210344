"""The Gemma 3 text family: HF `Gemma3ForCausalLM` (model_type `gemma3_text`) ⇄ Megatron.

Gemma 2's block (`gemma2.py`) plus a per-head q/k RMSNorm (zero-centred like every Gemma norm; the Bridge's
`q_layernorm` / `k_layernorm`) and two rope bases: the sliding layers rope with `rope_local_base_freq`, unscaled;
the full-attention layers with `rope_theta` and `rope_scaling` (linear on the 4B and larger releases). Without
`layer_types`, every `sliding_window_pattern`-th layer (1-based, default 6) is full attention.
"""

from __future__ import annotations

from typing import Any

from mconvert.errors import MConvertError
from mconvert.mappings import gemma2, llama, qwen3
from mconvert.mappings.record import BridgeProviders, Family, GgufLayout, Plugin
from mconvert.mappings.fields import INT, NUM, Field, mapped, refused
from mconvert.spec import ModelSpec

NAME = "gemma3"
L, H = llama.L, llama.H

TABLE = Plugin(
    family=NAME,
    table={
        **gemma2.TABLE.table,
        **qwen3.QK_NORM_TABLE,
    },
    hf_drops={},
)

CLASS_DEFAULTS = {**gemma2.CLASS_DEFAULTS, "rope_theta": 1_000_000.0, "attn_logit_softcapping": None,
                  "final_logit_softcapping": None, "max_position_embeddings": 131_072, "sliding_window_pattern": 6,
                  "rope_local_base_freq": 10_000.0}

# Every field of transformers 4.57's Gemma3TextConfig beyond the common ones
HF_FIELDS: dict[str, Field] = {
    **gemma2.HF_FIELDS,
    "rope_scaling": llama.ROPE_FIELDS["rope_scaling"],
    "rope_local_base_freq": mapped("rotary_base_local", NUM),
    "sliding_window_pattern": mapped("window_pattern", INT),
    "use_bidirectional_attention": refused("bidirectional attention (EmbeddingGemma) is not a causal LM", False),
    "_sliding_window_pattern": mapped("window_pattern", INT),
    "mm_tokens_per_image": Field("neutral", "the vision tower's token count: not the text model's function"),
    "boi_token_index": Field("neutral", "a multimodal token id: not the text model's function"),
    "eoi_token_index": Field("neutral", "a multimodal token id: not the text model's function"),
    "image_token_index": Field("neutral", "a multimodal token id: not the text model's function"),
}


def to_hf(spec: ModelSpec) -> dict[str, Any]:
    """Gemma3TextConfig fields: the block, q/k norm, both rope bases, rope scaling (global layers) explicit."""
    gemma2.check_block(spec, FAMILY.architecture, qk_norm=True)
    if spec.rope_scaling not in (None, "linear"):
        raise MConvertError(f"HF {FAMILY.architecture}: rope_scaling={spec.rope_scaling!r} is not mapped for Gemma "
                            "(linear on the global layers is); conversion refused")
    local = spec.rotary_base_local if spec.rotary_base_local is not None else spec.rotary_base
    if spec.rotary_base_local is None and spec.rope_scaling is not None and spec.windowed_layers:
        raise MConvertError(f"HF {FAMILY.architecture} ropes its sliding layers unscaled; this model scales every "
                            "layer's rope; conversion refused")
    out = {**gemma2.block_fields(spec), **gemma2.window_fields(spec), "rope_local_base_freq": local,
           "use_bidirectional_attention": False}
    out["rope_scaling"] = llama.rope_scaling_to_hf(spec)
    return out


def from_hf(cfg: dict[str, Any], common: dict[str, Any], source: str) -> ModelSpec:
    """A Gemma3TextConfig dict -> ModelSpec."""
    pattern = cfg.get("sliding_window_pattern", cfg.get("_sliding_window_pattern", 6))
    if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
        raise MConvertError(f"{source}: config field sliding_window_pattern={pattern!r} must be a whole number >= 1; "
                            "fix it")
    spec = gemma2.block_spec(cfg, common, CLASS_DEFAULTS, True, source).replace(
        **llama.rope_scaling_from_hf(cfg, source), **gemma2.window_from_hf(cfg, pattern, source))
    if spec.rope_scaling not in (None, "linear"):
        raise MConvertError(f"{source}: config field rope_scaling type {spec.rope_scaling!r} is not mapped for Gemma "
                            "(linear is); conversion refused")
    local = cfg.get("rope_local_base_freq", CLASS_DEFAULTS["rope_local_base_freq"])
    if isinstance(local, bool) or not isinstance(local, (int, float)) or not local > 0:
        raise MConvertError(f"{source}: config field rope_local_base_freq={local!r} must be a positive number; fix it")
    return spec.replace(rotary_base_local=float(local))


def recognise(fields: dict[str, Any]) -> bool:
    """Megatron args without model_family: the Gemma block with q/k norm is Gemma 3."""
    return bool(fields.get("sandwich_norms")) and bool(fields["qk_layernorm"])


PRESETS = {
    # Gemma 3's shapes in small: head_dim 64 independent of hidden / heads, query_pre_attn_scalar 64, Gemma 3's
    # layer pattern: layers 0-4 sliding (16 keys, base 10000), layer 5 full (base 1e6, linear rope scaling 2)
    "tiny-gemma3": gemma2.gemma_preset(
        NAME, num_layers=6, hidden_size=128, num_attention_heads=4, num_query_groups=2, kv_channels=64,
        ffn_hidden_size=256, vocab_size=1000, max_position_embeddings=128, qk_layernorm=True,
        softmax_scale=64 ** -0.5, rotary_base=1_000_000.0, rotary_base_local=10_000.0, rope_scaling="linear",
        rope_scaling_factor=2.0, window_size=15, window_pattern=(1, 1, 1, 1, 1, 0)),
}

def gguf_refuse(spec: ModelSpec) -> None:
    """llama.cpp's gemma3 besides gemma2's fixed facts: the sliding layers rope with base 10000, unscaled; no
    attention soft-cap (its converter asserts none); a final soft-cap it is not confirmed to read here."""
    gemma2.gguf_refuse(spec, "gemma3")
    if spec.rotary_base_local != 10_000.0:
        raise MConvertError(f"rope_local_base_freq {spec.rotary_base_local}: llama.cpp's gemma3 ropes its sliding "
                            "layers with base 10000; conversion refused")
    if spec.attn_logit_softcapping is not None or spec.final_logit_softcapping is not None:
        raise MConvertError("logit soft-capping on a gemma3 model: llama.cpp's gemma3 is not confirmed to compute "
                            "it here; conversion refused")


def gguf_metadata(spec: ModelSpec) -> dict[str, int | float]:
    """Gemma 2's keys and the sliding layers' rope base, which llama.cpp's converter writes as `rope.freq_base_swa`
    (llama.cpp reads 10000 where it is absent, the only base `gguf_refuse` lets through)."""
    local = spec.rotary_base_local if spec.rotary_base_local is not None else spec.rotary_base
    return {**gemma2.gguf_metadata(spec), "rope.freq_base_swa": float(local)}


GGUF = GgufLayout(arch="gemma3", tensors={**gemma2.GGUF_TENSORS, "lm_head.weight": "output.weight",
                                          **qwen3.QK_NORM_GGUF},
                  permute_qk=False, refuse=gguf_refuse, states=("window", "gemma"), norm_shift=1.0,
                  metadata=gguf_metadata, compute_dtype=gemma2.GGUF.compute_dtype)

def bridge_args(m: dict[str, Any], where: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Gemma 3's provider (text only): `rotary_base` the pair (local, global); a local layer sees `window_size` − 1
    keys back; layer n (1-based) is global when n % sum(`interleaved_attn_pattern`) == 0; the global rope divided by
    `rope_scaling_factor`; Transformer Engine attention, which soft-caps nothing."""
    m, implied = gemma2.bridge_block(m, where, NAME)
    vl, pattern, window = m.pop("is_vision_language", None), m.pop("interleaved_attn_pattern", None), m.pop(
        "window_size", None)
    if vl:
        raise MConvertError(f"{where} is_vision_language={vl!r} is not supported: Gemma 3's vision-language model "
                            "(bidirectional, unwindowed attention) is not mapped; conversion refused")
    for name in ("attn_logit_softcapping", "final_logit_softcapping", "seq_len_interpolation_factor"):
        if m.get(name) is not None:  # Gemma 3's TE attention and output layer do not soft-cap
            raise MConvertError(f"{where} {name}={m[name]!r} is not supported under the gemma3 provider (its "
                                "attention and output layer do not read it, or it scales the local rope too, which "
                                "no Gemma 3 does); conversion refused")
    bases = m.get("rotary_base")
    if not (isinstance(bases, list) and len(bases) == 2):
        raise MConvertError(f"{where} rotary_base={bases!r} must be the pair (local, global) Gemma 3's provide() "
                            "reads; fix it")
    if (not isinstance(pattern, list) or not pattern
            or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in pattern) or sum(pattern) < 1):
        raise MConvertError(f"{where} interleaved_attn_pattern={pattern!r} must be whole numbers (local, global); "
                            "fix it")
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise MConvertError(f"{where} window_size={window!r} must be a whole number >= 1 (keys a local layer "
                            "sees); fix it")
    factor = gemma2.bridge_number(where, "rope_scaling_factor", m.pop("rope_scaling_factor", None) or 1.0)
    m.update(rotary_base=gemma2.bridge_number(where, "rotary_base", bases[1]), rotary_percent=1.0, rope_scaling=False)
    implied.update(rotary_base_local=gemma2.bridge_number(where, "rotary_base", bases[0]), window_size=(window - 1, 0),
                   window_attn_skip_freq=sum(pattern))
    if factor != 1:
        implied["rotary_seq_len_interpolation_factor"] = factor
    return m, implied


BRIDGE = BridgeProviders(
    classes=tuple(f"megatron.bridge.models.gemma.gemma3_provider.Gemma3ModelProvider{n}"
                  for n in ("", "1B", "4B", "12B", "27B")),
    args=bridge_args,
)


FAMILY = Family(
    name=NAME, architecture="Gemma3ForCausalLM", model_type="gemma3_text", base_architecture="Gemma3TextModel",
    plugin=TABLE, hf_fields=HF_FIELDS, to_hf=to_hf, from_hf=from_hf, vllm=gemma2.VLLM, presets=PRESETS,
    recognise=recognise, recognise_order=5,  # before qwen3 (q/k norm without biases)
    ft=None, trtllm=None,  # neither format states the Gemma block
    hf_window="per_layer",
    gemma=True,
    gguf=GGUF,
    bridge=BRIDGE,
)
