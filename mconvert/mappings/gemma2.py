"""The Gemma 2 family: HF `Gemma2ForCausalLM` ⇄ Megatron, with the Gemma block Gemma 3 shares.

The Gemma block (transformers' modeling_gemma2 / modeling_gemma3; Megatron-Bridge's `gemma2_provider.py`,
`gemma3_provider.py`): four RMSNorms per layer, each scaling by (1 + w) (megatron-core's
`layernorm_zero_centered_gamma`: the stored weight is HF's, no +1 on conversion); the attention and MLP outputs
normed before the residual add (the Bridge's `linear_proj.post_layernorm` / `linear_fc2.post_layernorm`); the
embedding multiplied by sqrt(hidden_size); a GeLU-tanh gated MLP; attention scaled by
`query_pre_attn_scalar**-0.5`; optional tanh soft-capping of the attention scores and the final logits; sliding
and full attention layers by `layer_types`. Gemma 2 ropes every layer alike. The name table follows the
Bridge's `gemma2_bridge.py` / `gemma3_bridge.py`. No FasterTransformer or TensorRT-LLM form holds the block.
"""

from __future__ import annotations

import math
from typing import Any

from mconvert.errors import MConvertError
from mconvert.mappings import llama, qwen2
from mconvert.mappings.record import BridgeProviders, Family, GgufLayout, Plugin, Rule, VllmFacts, check_qk_norm
from mconvert.mappings.fields import INT, NUM, STR, Field, mapped, refused
from mconvert.spec import ModelSpec

NAME = "gemma2"
L, H = llama.L, llama.H
QKV, FC1 = llama.QKV, llama.FC1

TABLE = Plugin(
    family=NAME,
    table={
        "embedding.word_embeddings.weight": Rule(("model.embed_tokens.weight",), "vocab"),
        L + "input_layernorm.weight": Rule((H + "input_layernorm.weight",)),
        L + "self_attention.linear_qkv.weight": Rule(tuple(n + ".weight" for n in QKV), "qkv"),
        L + "self_attention.linear_proj.weight": Rule((H + "self_attn.o_proj.weight",)),
        L + "self_attention.linear_proj.post_layernorm.weight": Rule((H + "post_attention_layernorm.weight",)),
        L + "pre_mlp_layernorm.weight": Rule((H + "pre_feedforward_layernorm.weight",)),
        L + "mlp.linear_fc1.weight": Rule(tuple(n + ".weight" for n in FC1), "gated"),
        L + "mlp.linear_fc2.weight": Rule((H + "mlp.down_proj.weight",)),
        L + "mlp.linear_fc2.post_layernorm.weight": Rule((H + "post_feedforward_layernorm.weight",)),
        "decoder.final_layernorm.weight": Rule(("model.norm.weight",)),
        "output_layer.weight": Rule(("lm_head.weight",), "vocab"),
    },
    hf_drops={},
)

HIDDEN_ACT = "gelu_pytorch_tanh"
CLASS_DEFAULTS = {"sliding_window": 4096, "query_pre_attn_scalar": 256, "attn_logit_softcapping": 50.0,
                  "final_logit_softcapping": 30.0, "head_dim": 256, "rope_theta": 10000.0}


# Every field of transformers 4.57's Gemma2Config beyond the common ones (the fields published configs carry that
# neither transformers' nor vLLM's Gemma code reads, `hidden_act` and `sliding_window_size`, pass by that rule)
HF_FIELDS: dict[str, Field] = {
    **{k: v for k, v in llama.ROPE_FIELDS.items() if k not in ("hidden_act", "rope_scaling")},
    "hidden_activation": mapped("activation", STR, HIDDEN_ACT, (HIDDEN_ACT,)),
    "attention_bias": refused("attention biases are not mapped for Gemma", False),
    "query_pre_attn_scalar": mapped("softmax_scale", NUM),
    "attn_logit_softcapping": mapped("attn_logit_softcapping", NUM),
    "final_logit_softcapping": mapped("final_logit_softcapping", NUM),
    "sliding_window": mapped("window_size", INT),
    "layer_types": mapped("window_pattern", (list,)),
}


def scalar_to_hf(spec: ModelSpec) -> float | int:
    """softmax_scale -> `query_pre_attn_scalar`, a whole number when one gives transformers exactly the scale."""
    s = spec.attention_scale
    for q in (round(s ** -2), s ** -2):
        if q ** -0.5 == s:
            return q
    raise MConvertError(f"softmax_scale={s!r} has no query_pre_attn_scalar q with q**-0.5 equal to it; "
                        "conversion refused")


def window_fields(spec: ModelSpec) -> dict[str, Any]:
    """`sliding_window` and `layer_types`; a model without a window still states one (the HF class always
    windows its sliding layers): every layer full attention."""
    types = [qwen2.LAYER_TYPES[spec.layer_window(i) is not None] for i in range(spec.num_layers)]
    window = llama.hf_sliding_window(spec)
    return {"sliding_window": window if window is not None else spec.max_position_embeddings,
            "layer_types": types}


def window_from_hf(cfg: dict[str, Any], pattern: int, source: str) -> dict[str, Any]:
    """ModelSpec window kwargs: `layer_types`, else every `pattern`-th layer (1-based) full attention, the rest
    sliding (the config class's rule); the window from `sliding_window`."""
    n = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if types is None:
        types = [qwen2.LAYER_TYPES[bool((i + 1) % pattern)] for i in range(n)]
    shown = repr(types) if len(repr(types)) <= 80 else repr(types)[:77] + "..."
    if not isinstance(types, list) or len(types) != n or any(t not in qwen2.LAYER_TYPES for t in types):
        raise MConvertError(f"{source}: config field layer_types={shown} must list {n} entries, each "
                            f"{' or '.join(qwen2.LAYER_TYPES)}; conversion refused")
    pattern_ = tuple(int(t == "sliding_attention") for t in types)
    window = llama.window_from_hf(cfg.get("sliding_window", CLASS_DEFAULTS["sliding_window"]), source)
    if any(pattern_) and window is None:
        raise MConvertError(f"{source}: config field layer_types marks sliding_attention layers and sliding_window is "
                            "null; fix config.json")
    return {"window_size": window if any(pattern_) else None, "window_pattern": pattern_}


def check_block(spec: ModelSpec, architecture: str, qk_norm: bool) -> None:
    """Refuse a model the HF Gemma class cannot compute: the whole Gemma block, RoPE over the full head."""
    problems = []
    if spec.normalization != "RMSNorm" or not spec.norm_zero_centered or not spec.sandwich_norms:
        problems.append("zero-centred RMSNorm with sandwich norms")
    if spec.activation != "geglu":
        problems.append("a GeLU-tanh gated MLP (activation='geglu')")
    if not spec.scale_embeddings:
        problems.append("embeddings scaled by sqrt(hidden_size)")
    if spec.position_embedding_type != "rope" or spec.rotary_percent != 1 or spec.rotary_interleaved:
        problems.append("rotate-half RoPE over the whole head")
    if spec.add_bias_linear or spec.has_qkv_bias:
        problems.append("no linear biases")
    if problems:
        raise MConvertError(f"HF {architecture} computes {', '.join(problems)}; this {spec.family}-family model "
                            "differs; conversion refused")
    check_qk_norm(spec, architecture, qk_norm)


def block_fields(spec: ModelSpec) -> dict[str, Any]:
    """The config.json fields both Gemma classes share, every one explicit."""
    return dict(
        hidden_size=spec.hidden_size, intermediate_size=spec.ffn_hidden_size, num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_attention_heads, num_key_value_heads=spec.num_groups, head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings, vocab_size=spec.vocab_size,
        rms_norm_eps=spec.norm_epsilon, rope_theta=spec.rotary_base, hidden_activation=HIDDEN_ACT,
        tie_word_embeddings=spec.tie_embeddings, attention_bias=False, attention_dropout=0.0,
        query_pre_attn_scalar=scalar_to_hf(spec), attn_logit_softcapping=spec.attn_logit_softcapping,
        final_logit_softcapping=spec.final_logit_softcapping)


def block_spec(cfg: dict[str, Any], common: dict[str, Any], defaults: dict[str, Any], qk_layernorm: bool,
               source: str) -> ModelSpec:
    """A Gemma config dict -> ModelSpec, absent fields at the config class's `defaults`."""
    def get(name: str) -> Any:
        return cfg.get(name, defaults.get(name))

    nh = int(cfg["num_attention_heads"])
    q = get("query_pre_attn_scalar")
    if isinstance(q, bool) or not isinstance(q, (int, float)) or not math.isfinite(q) or q <= 0:
        raise MConvertError(f"{source}: config field query_pre_attn_scalar={q!r} must be a positive number; fix it")
    caps = {}
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        v = get(name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0):
            raise MConvertError(f"{source}: config field {name}={v!r} must be a positive number or null; fix it")
        caps[name] = None if v is None else float(v)
    kvh = int(cfg.get("num_key_value_heads") or nh)
    return ModelSpec(
        num_layers=int(cfg["num_hidden_layers"]), hidden_size=int(cfg["hidden_size"]), num_attention_heads=nh,
        ffn_hidden_size=int(cfg["intermediate_size"]), max_position_embeddings=int(get("max_position_embeddings")),
        num_query_groups=kvh if kvh != nh else None, kv_channels=int(get("head_dim")), normalization="RMSNorm",
        norm_epsilon=float(cfg.get("rms_norm_eps", 1e-6)), activation="geglu", position_embedding_type="rope",
        rotary_base=float(get("rope_theta")), add_bias_linear=False, tie_embeddings=bool(cfg.get("tie_word_embeddings",
                                                                                                 True)),
        qk_layernorm=qk_layernorm, norm_zero_centered=True, sandwich_norms=True, scale_embeddings=True,
        softmax_scale=float(q) ** -0.5, **caps, **common)


def to_hf(spec: ModelSpec) -> dict[str, Any]:
    """Gemma2Config fields: the block, one rope base, no rope scaling (Gemma2Config has none)."""
    check_block(spec, FAMILY.architecture, qk_norm=False)
    if spec.rope_scaling is not None or spec.rotary_base_local is not None:
        raise MConvertError(f"HF {FAMILY.architecture} ropes every layer with one unscaled base; this model has "
                            f"rope_scaling={spec.rope_scaling!r}, rotary_base_local={spec.rotary_base_local!r} (the "
                            "gemma3 family holds them); conversion refused")
    return {**block_fields(spec), **window_fields(spec)}


def from_hf(cfg: dict[str, Any], common: dict[str, Any], source: str) -> ModelSpec:
    """A Gemma2Config dict -> ModelSpec."""
    defaults = {**CLASS_DEFAULTS, "max_position_embeddings": 8192}
    return block_spec(cfg, common, defaults, False, source).replace(**window_from_hf(cfg, 2, source))


def gemma_preset(family: str, **kw: Any) -> ModelSpec:
    """A Gemma-block preset: zero-centred sandwich RMSNorms, GeGLU, scaled embeddings, RoPE, no bias, tied."""
    base: dict[str, Any] = dict(normalization="RMSNorm", activation="geglu", position_embedding_type="rope",
                                add_bias_linear=False, tie_embeddings=True, norm_zero_centered=True,
                                sandwich_norms=True, scale_embeddings=True, norm_epsilon=1e-6)
    return ModelSpec(family=family, **{**base, **kw})


PRESETS = {
    # Gemma 2's shapes in small: head_dim 64 independent of hidden / heads, query_pre_attn_scalar 48 (not
    # head_dim), both soft-caps, even layers (0-based) sliding with a 16-key window, odd layers full
    "tiny-gemma2": gemma_preset(NAME, num_layers=4, hidden_size=128, num_attention_heads=4, num_query_groups=2,
                                kv_channels=64, ffn_hidden_size=256, vocab_size=1000, max_position_embeddings=128,
                                softmax_scale=48 ** -0.5, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                                window_size=15, window_pattern=(1, 0, 1, 0)),
}


def recognise(fields: dict[str, Any]) -> bool:
    """Megatron args without model_family: the Gemma block without q/k norm and one rope base is Gemma 2."""
    return bool(fields.get("sandwich_norms")) and not fields["qk_layernorm"] and fields.get(
        "rotary_base_local") is None


def vllm_config_checks(cfg: dict[str, Any]) -> tuple[list[str], list[str]]:
    """verify's config.json checks for vLLM's Gemma classes."""
    problems, notes = llama.rope_config_checks(cfg)
    if cfg.get("hidden_activation", HIDDEN_ACT) != HIDDEN_ACT:
        problems.append(f"hidden_activation={cfg.get('hidden_activation')!r}: vLLM's Gemma runs {HIDDEN_ACT}")
    return problems, notes


VLLM = VllmFacts(
    required={**llama.ROPE_VLLM.required, "query_pre_attn_scalar": "attention scale",
              "sliding_window": "the local layers' window", "head_dim": "head_dim (Gemma's is its own)"},
    eps_key="rms_norm_eps",
    head_dim=lambda cfg: int(cfg["head_dim"]),
    config_checks=vllm_config_checks,
    rope=True,
)

# ---- GGUF (llama.cpp's gemma2 / gemma3 architectures) ---------------------------------------------------
# gguf-py's TensorNameMap for Gemma; llama.cpp's converter (conversion/gemma.py) adds 1 to every `*norm.weight`
# and drops lm_head (its gemma2 reads no output tensor).
GGUF_TENSORS: dict[str, str] = {
    **{k: v for k, v in llama.GGUF_TENSORS.items() if not k.endswith(".bias") and k != "lm_head.weight"
       and "post_attention_layernorm" not in k},
    H + "post_attention_layernorm.weight": "blk.*.post_attention_norm.weight",
    H + "pre_feedforward_layernorm.weight": "blk.*.ffn_norm.weight",
    H + "post_feedforward_layernorm.weight": "blk.*.post_ffw_norm.weight",
}
# llama.cpp's load_hparams: the n_layer it takes for the 27B model, whose attention it scales by
# 1/sqrt(hidden / heads) (else 1/sqrt(head_dim)), and the fixed sliding pattern (every N-th layer full)
GGUF_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
GGUF_SWA_PATTERN = {"gemma2": 2, "gemma3": 6}


def gguf_refuse(spec: ModelSpec, arch: str) -> None:
    """What llama.cpp's gemma2 / gemma3 cannot compute: it fixes the attention scale by model size, the sliding
    layers' pattern, and reads the head from the embedding (gemma2)."""
    heads_dim = spec.hidden_size / spec.num_attention_heads
    want = 1 / math.sqrt(heads_dim if spec.num_layers == GGUF_27B_LAYERS[arch] else spec.head_dim)
    if abs(spec.attention_scale - want) > 1e-6 * want:
        raise MConvertError(f"query_pre_attn_scalar {scalar_to_hf(spec)}: llama.cpp's {arch} scales attention by "
                            f"{want:.6g} for this size (1/sqrt(head_dim), or hidden/heads for its 27B); "
                            "conversion refused")
    n = GGUF_SWA_PATTERN[arch]
    fixed = tuple(int((i + 1) % n != 0) for i in range(spec.num_layers))
    if spec.window_size is None or spec.window_pattern not in (fixed, None if all(fixed) else fixed):
        raise MConvertError(f"{spec.window_description()}: llama.cpp's {arch} windows every layer but each "
                            f"{n}-th (1-based); conversion refused")
    if arch == "gemma2" and not spec.tie_embeddings:
        raise MConvertError("an untied head: llama.cpp's gemma2 reads its head from token_embd; conversion refused")


def gguf_metadata(spec: ModelSpec) -> dict[str, int | float]:
    """The window (HF's count of keys, as llama.cpp's standard sliding window counts them) and the soft-caps, as
    gguf-py's `add_sliding_window` / `add_*_logit_softcapping` key them."""
    out: dict[str, int | float] = {"attention.sliding_window": int(llama.hf_sliding_window(spec))}
    if spec.attn_logit_softcapping is not None:
        out["attn_logit_softcapping"] = float(spec.attn_logit_softcapping)
    if spec.final_logit_softcapping is not None:
        out["final_logit_softcapping"] = float(spec.final_logit_softcapping)
    return out


# ---- Megatron-Bridge (`models/gemma/`; the sized classes of earlier releases only change defaults) -------------
def bridge_number(where: str, name: str, v: Any) -> float:
    """A run_config.yaml field that must be a positive number."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise MConvertError(f"{where} {name}={v!r} must be a positive number; fix it")
    return v


def bridge_block(m: dict[str, Any], where: str, family: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """What every Gemma provider builds: its own layer spec (required: the Gemma block is built there) with
    post-attention and post-MLP norms, and embeddings scaled by √hidden. Returns (the fields left, the args)."""
    m = dict(m)
    spec = m.pop("transformer_layer_spec", None)
    spec = spec.get("_target_") if isinstance(spec, dict) else None
    own = f"megatron.bridge.models.gemma.{family}_provider.{family}_layer_spec"
    if spec != own:
        raise MConvertError(f"{where} transformer_layer_spec={spec} is not supported under the {family} provider: "
                            f"only its own {own} (the Gemma block) is mapped; conversion refused")
    return m, {"model_family": family, "sandwich_norms": True, "scale_embeddings": True}


def bridge_args(m: dict[str, Any], where: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Gemma 2's provider: odd layers (1-based) windowed, attention scaled by 1/√query_pre_attn_scalar (its
    attention does not read softmax_scale), both soft-caps read from their fields."""
    m, implied = bridge_block(m, where, NAME)
    implied["softmax_scale"] = bridge_number(where, "query_pre_attn_scalar", m.pop("query_pre_attn_scalar", None)) ** -0.5
    m.pop("softmax_scale", None)  # Gemma2DotProductAttention does not read it
    if m.get("window_size") is not None:
        implied["window_attn_skip_freq"] = 2
    return m, implied


BRIDGE = BridgeProviders(
    classes=tuple(f"megatron.bridge.models.gemma.gemma2_provider.Gemma2ModelProvider{n}" for n in ("", "2B", "9B", "27B")),
    args=bridge_args,
)


# ggml-cpu's GeLU (the gate of GeGLU) reads an f16 table (GGML_GELU_FP16): an f32 file computes at f16 precision
GGUF = GgufLayout(arch="gemma2", tensors=GGUF_TENSORS, permute_qk=False, refuse=lambda s: gguf_refuse(s, "gemma2"),
                  states=("window", "gemma"), norm_shift=1.0, metadata=gguf_metadata, compute_dtype="float16")

FAMILY = Family(
    name=NAME, architecture="Gemma2ForCausalLM", model_type="gemma2", base_architecture="Gemma2Model",
    plugin=TABLE, hf_fields=HF_FIELDS, to_hf=to_hf, from_hf=from_hf, vllm=VLLM, presets=PRESETS,
    recognise=recognise, recognise_order=6,  # before qwen3 (q/k norm without biases) and llama
    ft=None, trtllm=None,  # neither format states zero-centred sandwich norms, scaled embeddings or soft-capping
    hf_window="per_layer",
    gemma=True,
    gguf=GGUF,
    bridge=BRIDGE,
)
