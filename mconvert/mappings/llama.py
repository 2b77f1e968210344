"""The LLaMA family: HF `LlamaForCausalLM` ⇄ Megatron, and its FasterTransformer `[llama]` and TensorRT-LLM forms.

Its name table, config fields and deployment layouts are shared by the other RMSNorm + SwiGLU + RoPE families
(mistral, qwen2), which import them from here and add their own identity and refusals.
"""

from __future__ import annotations

import math
from typing import Any


from mconvert.errors import MConvertError
from mconvert.mappings.record import (
    FT_BASE_ROTARY,
    DeployRule,
    Family,
    FTFile,
    FTKernels,
    FTLayout,
    GgufLayout,
    Plugin,
    Rule,
    TrtllmLayout,
    VllmFacts,
    check_qk_norm,
)
from mconvert.mappings.fields import BOOL, INT, MAPPED, NEUTRAL, NUM, STR, Field, mapped, refused
from mconvert.rope import hf_attention_factor, megatron_attention_factor, megatron_mscale_for, yarn_get_mscale
from mconvert.spec import ModelSpec

NAME = "llama"
L, H = "decoder.layers.*.", "model.layers.*."
QKV = (H + "self_attn.q_proj", H + "self_attn.k_proj", H + "self_attn.v_proj")
FC1 = (H + "mlp.gate_proj", H + "mlp.up_proj")

TABLE = Plugin(
    family=NAME,
    table={
        "embedding.word_embeddings.weight": Rule(("model.embed_tokens.weight",), "vocab"),
        L + "input_layernorm.weight": Rule((H + "input_layernorm.weight",)),
        L + "self_attention.linear_qkv.weight": Rule(tuple(n + ".weight" for n in QKV), "qkv"),
        L + "self_attention.linear_qkv.bias": Rule(tuple(n + ".bias" for n in QKV), "qkv"),  # qwen2, llama bias
        L + "self_attention.linear_proj.weight": Rule((H + "self_attn.o_proj.weight",)),
        L + "self_attention.linear_proj.bias": Rule((H + "self_attn.o_proj.bias",)),
        L + "pre_mlp_layernorm.weight": Rule((H + "post_attention_layernorm.weight",)),
        L + "mlp.linear_fc1.weight": Rule(tuple(n + ".weight" for n in FC1), "gated"),
        L + "mlp.linear_fc1.bias": Rule(tuple(n + ".bias" for n in FC1), "gated"),
        L + "mlp.linear_fc2.weight": Rule((H + "mlp.down_proj.weight",)),
        L + "mlp.linear_fc2.bias": Rule((H + "mlp.down_proj.bias",)),
        "decoder.final_layernorm.weight": Rule(("model.norm.weight",)),
        "output_layer.weight": Rule(("lm_head.weight",), "vocab"),
    },
    hf_drops={
        H + "self_attn.rotary_emb.inv_freq": None,  # rotary buffer in older transformers saves
    },
)
PLUGIN = TABLE

# config.json fields every RMSNorm + SwiGLU + RoPE family of transformers 4.57 shares
ROPE_FIELDS: dict[str, Field] = {
    "hidden_size": mapped("hidden_size", INT),
    "intermediate_size": mapped("ffn_hidden_size", INT),
    "num_hidden_layers": mapped("num_layers", INT),
    "num_attention_heads": mapped("num_attention_heads", INT),
    "num_key_value_heads": mapped("num_query_groups", INT),
    "head_dim": mapped("kv_channels", INT),
    "max_position_embeddings": mapped("max_position_embeddings", INT),
    "rms_norm_eps": mapped("norm_epsilon", NUM),
    "rope_theta": mapped("rotary_base", NUM),
    "hidden_act": mapped("activation", STR, "silu", ("silu",)),
    "partial_rotary_factor": refused("partial rotary embeddings are not mapped", 1.0),
    "rope_scaling": Field(MAPPED, "read into ModelSpec.rope_scaling and its factors (llama3, linear, yarn; other "
                          "rope types are refused by name)", None, (dict,), "rope_scaling"),
}

# HF `rope_scaling` (transformers' modeling_rope_utils) ⇄ ModelSpec: rope type -> the dict keys it reads
# besides `rope_type` / `type`, each with its ModelSpec field. A type not listed is refused by name.
ROPE_SCALING_KEYS: dict[str, dict[str, str]] = {
    "linear": {"factor": "rope_scaling_factor"},
    "llama3": {"factor": "rope_scaling_factor", "low_freq_factor": "rope_low_freq_factor",
               "high_freq_factor": "rope_high_freq_factor",
               "original_max_position_embeddings": "rope_original_max_position_embeddings"},
}

HF_FIELDS: dict[str, Field] = {
    **ROPE_FIELDS,
    "attention_bias": mapped("add_bias_linear", BOOL),
    "mlp_bias": mapped("add_bias_linear", BOOL),
    "pretraining_tp": Field(NEUTRAL, "a slicing of the same matmuls: the same function"),
}


# ---- HF config ⇄ ModelSpec (shared by the RoPE families) ----------------------------------------------
def check_rope_style(spec: ModelSpec, architecture: str, qk_norm: bool = False) -> None:
    """Refuse a model that an RMSNorm + SwiGLU + RoPE HF class cannot compute (`qk_norm`: the class has
    per-head RMSNorm on q and k, and the model must have it too)."""
    if spec.normalization != "RMSNorm" or not spec.gated or spec.position_embedding_type != "rope":
        raise MConvertError(f"a {spec.family}-family model needs RMSNorm, SwiGLU and RoPE")
    if spec.rotary_percent != 1.0:
        raise MConvertError(f"HF {architecture} cannot express rotary_percent={spec.rotary_percent}")
    check_qk_norm(spec, architecture, qk_norm)


# transformers' yarn keys (modeling_rope_utils._validate_yarn_parameters) besides `rope_type` / `type`
YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
             "attention_factor", "truncate")


def yarn_to_hf(spec: ModelSpec) -> dict[str, Any]:
    """ModelSpec YaRN -> HF `rope_scaling` that makes transformers compute megatron-core's function: factor,
    original context and betas always explicit; `truncate` when off (transformers' default is on); mscale and
    mscale_all_dim when not megatron-core's defaults, and `attention_factor` too when transformers' rule would
    derive another factor from them (it reads the pair only when both are non-zero)."""
    out: dict[str, Any] = {"rope_type": "yarn", "factor": float(spec.rope_scaling_factor),
                           "original_max_position_embeddings": int(spec.rope_original_max_position_embeddings),
                           "beta_fast": float(spec.yarn_beta_fast), "beta_slow": float(spec.yarn_beta_slow)}
    if not spec.yarn_correction_range_round_to_int:
        out["truncate"] = False
    if (spec.yarn_mscale, spec.yarn_mscale_all_dim) != (1.0, 0.0):
        out.update(mscale=float(spec.yarn_mscale), mscale_all_dim=float(spec.yarn_mscale_all_dim))
    if hf_attention_factor(out) != spec.yarn_attention_factor:
        out["attention_factor"] = spec.yarn_attention_factor
    return out


def yarn_from_hf(rs: dict[str, Any], cfg: dict[str, Any], where: str, mla: bool = False) -> dict[str, Any]:
    """HF yarn `rope_scaling` -> ModelSpec kwargs, read with transformers' own fallbacks (an absent or zero beta
    is its default, an absent original context is max_position_embeddings). megatron-core must multiply cos and
    sin by the attention factor transformers computes: the dict's mscale pair when megatron-core derives that
    factor from it, else its defaults when they do, else mscale_all_dim 0 and the mscale that gives it
    (`megatron_mscale_for`); a factor no mscale reaches is refused, both numbers named.

    `mla`: multi-latent attention, whose softmax both engines scale by get_mscale(factor, mscale_all_dim)²
    (transformers' DeepseekV3Attention when mscale_all_dim is non-zero): mscale_all_dim is then the dict's (0
    when absent) and only mscale is solved for; megatron-core's MLA always rounds the correction range."""
    for key in ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
                "attention_factor"):
        v = rs.get(key)
        if (key == "factor" or v is not None) and (isinstance(v, bool) or not isinstance(v, (int, float))):
            raise MConvertError(f"{where}: {key!r} must be a number for rope type 'yarn'; fix it")
        if v is not None and not math.isfinite(v):
            raise MConvertError(f"{where}: {key!r} must be a finite number for rope type 'yarn'; fix it")
    truncate = rs.get("truncate", True)
    if not isinstance(truncate, bool):
        raise MConvertError(f"{where}: 'truncate' must be true or false; fix it")
    factor = rs["factor"]
    m, mad = rs.get("mscale"), rs.get("mscale_all_dim")
    try:
        want = hf_attention_factor(rs)
    except ZeroDivisionError:
        raise MConvertError(f"{where}: mscale_all_dim={mad!r} makes transformers divide by 0.1·mscale_all_dim·"
                            "ln(factor)+1 = 0; fix it") from None
    fixed = 0.0  # the mscale_all_dim megatron-core gets when only mscale is solved for
    if mla:
        if not truncate:
            raise MConvertError(f"{where} is not supported: megatron-core's multi-latent attention always rounds "
                                "YaRN's correction range (truncate true); conversion refused")
        if mad is not None and mad < 0:
            raise MConvertError(f"{where} is not supported: a negative mscale_all_dim scales multi-latent "
                                "attention's softmax by a number megatron-core's args do not hold; conversion refused")
        fixed = float(mad or 0.0)
    # the args keep mscale_all_dim >= 0 (megatron-core's divisor then never 0); a solved mscale covers the rest
    if (m is not None and mad is not None and mad >= 0 and (not mla or mad == fixed)
            and megatron_attention_factor(factor, m, mad) == want):
        pair = (m, mad)
    elif megatron_attention_factor(factor, 1.0, fixed) == want:
        pair = (1.0, fixed)
    else:
        solved = megatron_mscale_for(factor, want, fixed)
        if solved is None:
            head = f"{where} is not supported: transformers computes attention factor {want!r}, "
            if not factor > 1:
                raise MConvertError(head + f"megatron-core computes 1.0 whenever factor <= 1 (here {factor!r}), "
                                    "whatever mscale; conversion refused")
            nearest = megatron_attention_factor(
                factor, 10 * (want * yarn_get_mscale(factor, fixed) - 1) / math.log(factor), fixed)
            why = ("the + 1 rounds away the digits of a factor this close to 0" if math.isfinite(nearest) else
                   "no finite mscale reaches it")
            raise MConvertError(head + f"the nearest megatron-core reaches is {nearest!r} (0.1·mscale·ln(factor)+1 "
                                f"with mscale_all_dim {fixed:g}: {why}); conversion refused")
        pair = (solved, fixed)
    if mla and factor == 1:  # stretches nothing, scales nothing: plain rope, as megatron-core's args read back
        return {}
    return dict(rope_scaling="yarn", rope_scaling_factor=factor,
                rope_original_max_position_embeddings=rs.get("original_max_position_embeddings")
                or cfg.get("max_position_embeddings"),
                yarn_beta_fast=rs.get("beta_fast") or 32.0, yarn_beta_slow=rs.get("beta_slow") or 1.0,
                yarn_mscale=pair[0], yarn_mscale_all_dim=pair[1], yarn_correction_range_round_to_int=truncate)


def rope_scaling_to_hf(spec: ModelSpec) -> dict[str, Any] | None:
    """ModelSpec rope scaling -> HF `rope_scaling`, every key of its type explicit (None: no scaling)."""
    if spec.rope_scaling is None:
        return None
    if spec.rope_scaling == "yarn":
        return yarn_to_hf(spec)
    keys = ROPE_SCALING_KEYS[spec.rope_scaling]
    out: dict[str, Any] = {"rope_type": spec.rope_scaling}
    for key, field_name in keys.items():
        v = getattr(spec, field_name)
        out[key] = int(v) if key == "original_max_position_embeddings" else float(v)
    return out


def rope_scaling_from_hf(cfg: dict[str, Any], source: str, mla: bool = False) -> dict[str, Any]:
    """HF `rope_scaling` -> ModelSpec kwargs; an unmapped type, a missing key or an unknown key is refused
    (`mla`: see `yarn_from_hf`)."""
    rs = cfg.get("rope_scaling")
    if rs is None:
        return {}
    shown = repr(rs) if len(repr(rs)) <= 80 else repr(rs)[:77] + "..."
    where = f"{source}: config field rope_scaling={shown}"
    if not isinstance(rs, dict):
        raise MConvertError(f"{where} must be an object; fix it")
    kind = rs.get("rope_type", rs.get("type"))
    if "rope_type" in rs and "type" in rs and rs["type"] != rs["rope_type"]:
        raise MConvertError(f"{where} states two rope types; keep one")
    if kind == "default" and set(rs) <= {"rope_type", "type"}:
        return {}
    if kind == "yarn":
        unknown = sorted(set(rs) - set(YARN_KEYS) - {"rope_type", "type"})
        if unknown:
            raise MConvertError(f"{where} is not supported: {', '.join(unknown)} not mapped for rope type 'yarn'; "
                                "conversion refused")
        return yarn_from_hf(rs, cfg, where, mla)
    if kind not in ROPE_SCALING_KEYS:
        raise MConvertError(f"{where} is not supported: rope type {kind!r} is not mapped (mapped: "
                            f"{', '.join(ROPE_SCALING_KEYS)}, yarn); conversion refused")
    keys = ROPE_SCALING_KEYS[kind]
    unknown = sorted(set(rs) - set(keys) - {"rope_type", "type"})
    if unknown:
        raise MConvertError(f"{where} is not supported: {', '.join(unknown)} not mapped for rope type "
                            f"{kind!r}; conversion refused")
    out: dict[str, Any] = {"rope_scaling": kind}
    for key, field_name in keys.items():
        v = rs.get(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise MConvertError(f"{where}: {key!r} must be a number for rope type {kind!r}; fix it")
        out[field_name] = v
    return out


def rope_fields(spec: ModelSpec) -> dict[str, Any]:
    """The config.json fields every RoPE family writes (eps and rope always explicit)."""
    return dict(
        hidden_size=spec.hidden_size,
        intermediate_size=spec.ffn_hidden_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_groups,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        vocab_size=spec.vocab_size,
        rms_norm_eps=spec.norm_epsilon,
        rope_theta=spec.rotary_base,
        hidden_act="silu",
        tie_word_embeddings=spec.tie_embeddings,
        attention_dropout=0.0,
    ) | ({"rope_scaling": rope_scaling_to_hf(spec)} if spec.rope_scaling is not None else {})


def rope_spec(cfg: dict[str, Any], common: dict[str, Any], add_bias_linear: bool, add_qkv_bias: bool,
              qk_layernorm: bool = False, source: str = "config.json") -> ModelSpec:
    """A RoPE-family config dict -> ModelSpec, with the family's linear biases, q/k norm and rope scaling."""
    nh = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    kvh = int(cfg.get("num_key_value_heads") or nh)
    return ModelSpec(
        num_layers=int(cfg["num_hidden_layers"]),
        hidden_size=hidden,
        num_attention_heads=nh,
        ffn_hidden_size=int(cfg["intermediate_size"]),
        max_position_embeddings=int(cfg["max_position_embeddings"]),
        num_query_groups=kvh if kvh != nh else None,
        kv_channels=int(cfg.get("head_dim") or hidden // nh),
        normalization="RMSNorm",
        norm_epsilon=float(cfg.get("rms_norm_eps", 1e-6)),
        activation="swiglu",
        position_embedding_type="rope",
        rotary_base=float(cfg.get("rope_theta", 10000.0)),
        add_bias_linear=add_bias_linear,
        add_qkv_bias=add_qkv_bias,
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qk_layernorm=qk_layernorm,
        **rope_scaling_from_hf(cfg, source),
        **common,
    )


def to_hf(spec: ModelSpec) -> dict[str, Any]:
    """LlamaConfig fields; attention and MLP biases are one switch (add_bias_linear)."""
    check_rope_style(spec, FAMILY.architecture)
    return {**rope_fields(spec), "attention_bias": spec.add_bias_linear, "mlp_bias": spec.add_bias_linear}


def from_hf(cfg: dict[str, Any], common: dict[str, Any], source: str) -> ModelSpec:
    """A LlamaConfig dict -> ModelSpec; attention and MLP biases must agree (one ModelSpec switch)."""
    attn_bias = bool(cfg.get("attention_bias", False))
    if attn_bias != bool(cfg.get("mlp_bias", False)):
        raise MConvertError(f"{source}: attention_bias != mlp_bias is not supported")
    return rope_spec(cfg, common, add_bias_linear=attn_bias, add_qkv_bias=False, source=source)


# ---- sliding window ---------------------------------------------------------------------------------------
# HF's `sliding_window` counts the keys a query sees, itself included (masking_utils `sliding_window_overlay`:
# kv_idx > q_idx - sliding_window); megatron-core's `window_size` left size counts the keys before it
# (utils.get_sliding_window_causal_mask: kv_idx >= q_idx - left). So sliding_window = window_size + 1.
def hf_sliding_window(spec: ModelSpec) -> int | None:
    """ModelSpec's window -> HF `sliding_window` (None: no window)."""
    return None if spec.window_size is None else spec.window_size + 1


def window_from_hf(value: Any, source: str, key: str = "sliding_window") -> int | None:
    """HF `sliding_window` -> ModelSpec.window_size; it must be a whole number >= 1 (None: no window)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise MConvertError(f"{source}: config field {key}={value!r} must be a whole number >= 1 (the keys a "
                            "query sees, itself included) or null; fix it")
    return value - 1


# ---- vLLM -----------------------------------------------------------------------------------------------
def rope_config_checks(cfg: dict[str, Any]) -> tuple[list[str], list[str]]:
    """verify's config.json checks for a RoPE family: (problems, notes)."""
    problems, notes = [], []
    if "tie_word_embeddings" not in cfg:
        notes.append("tie_word_embeddings not set (transformers' default applies)")
    nh = int(cfg.get("num_attention_heads", 1))
    kvh = int(cfg.get("num_key_value_heads") or cfg.get("num_attention_heads", 1))
    if nh % kvh:
        problems.append(f"num_attention_heads {nh} is not divisible by num_key_value_heads {kvh}")
    rs = cfg.get("rope_scaling")
    if rs:
        notes.append(f"rope_scaling={rs}")
    if isinstance(rs, dict) and rs.get("rope_type", rs.get("type")) == "yarn":
        try:  # vLLM sizes a YaRN model's context as original positions x factor, not max_position_embeddings
            served = int(rs["original_max_position_embeddings"] * rs["factor"])
        except (KeyError, TypeError):
            problems.append("rope_scaling yarn lacks original_max_position_embeddings or factor, which vLLM needs")
        else:
            if served != cfg.get("max_position_embeddings"):
                notes.append(f"vLLM serves {served} positions (YaRN's original_max_position_embeddings x factor), "
                             f"transformers max_position_embeddings={cfg.get('max_position_embeddings')}")
    return problems, notes


ROPE_VLLM = VllmFacts(
    required={"max_position_embeddings": "max positions", "rms_norm_eps": "RMSNorm eps (HF default 1e-6 differs "
              "from Megatron's 1e-5)", "rope_theta": "RoPE base", "hidden_size": "hidden",
              "num_attention_heads": "heads", "num_hidden_layers": "layers", "intermediate_size": "ffn",
              "vocab_size": "vocab", "num_key_value_heads": "KV heads"},
    eps_key="rms_norm_eps",
    head_dim=lambda cfg: int(cfg.get("head_dim") or int(cfg.get("hidden_size", 0)) // int(cfg.get("num_attention_heads", 1))),
    config_checks=rope_config_checks,
    rope=True,
)


# ---- FasterTransformer [llama] --------------------------------------------------------------------------
def _ft_holds(spec: ModelSpec) -> bool:
    return spec.normalization == "RMSNorm" and spec.gated and spec.position_embedding_type == "rope"


def _ft_refuse(spec: ModelSpec, infer_tp: int, allow_approx_gelu: bool) -> None:
    nh = spec.num_attention_heads
    if spec.num_groups != nh:
        raise MConvertError(
            f"FasterTransformer's LLaMA loader has no grouped-query attention (num_query_groups="
            f"{spec.num_groups} < heads={nh}); use megatron-to-trtllm (TensorRT-LLM supports GQA)"
        )
    if spec.has_qkv_bias or spec.add_bias_linear:
        raise MConvertError("FasterTransformer's LLaMA loader zero-fills every bias; this model has linear biases")
    if spec.rotary_base != FT_BASE_ROTARY:
        raise MConvertError(
            f"FasterTransformer's LLaMA rotary base is fixed at 10000; this model uses {spec.rotary_base:g}"
        )
    if spec.rotary_percent != 1.0:
        raise MConvertError(f"rotary_percent={spec.rotary_percent} is not supported for the FT LLaMA layout")


def _ft_expected_files(cfg: dict[str, Any]) -> list[FTFile]:
    nh, hd = int(cfg["head_num"]), int(cfg["size_per_head"])
    H, F, L, V = nh * hd, int(cfg["inter_size"]), int(cfg["num_layer"]), int(cfg["vocab_size"])
    t = int(cfg["tensor_para_size"])
    files = [
        FTFile("model.wte.weight.bin", (V, H)),
        FTFile("model.final_layernorm.weight.bin", (H,)),
        FTFile("model.lm_head.weight.bin", (V, H)),
    ]
    for i in range(L):
        p = f"model.layers.{i}."
        files += [
            FTFile(p + "input_layernorm.weight.bin", (H,)),
            FTFile(p + "post_attention_layernorm.weight.bin", (H,)),
        ]
        for r in range(t):
            files += [
                FTFile(p + f"attention.query_key_value.weight.{r}.bin", (H, 3, H // t)),
                FTFile(p + f"attention.dense.weight.{r}.bin", (H // t, H)),
                FTFile(p + f"mlp.gate_proj.weight.{r}.bin", (H, F // t)),
                FTFile(p + f"mlp.up_proj.weight.{r}.bin", (H, F // t)),
                FTFile(p + f"mlp.down_proj.weight.{r}.bin", (F // t, H)),
            ]
    return files


_FT_L = "model.layers.*."
FT_FILES: dict[str, DeployRule | None] = {  # FT's LLaMA: every 2-D weight `[in, out]`, QKV `[H, 3, H/t]`
    "embedding.word_embeddings.weight": DeployRule(("model.wte.weight.bin",)),
    L + "input_layernorm.weight": DeployRule((_FT_L + "input_layernorm.weight.bin",)),
    L + "self_attention.linear_qkv.weight": DeployRule((_FT_L + "attention.query_key_value.weight.{r}.bin",),
                                                       "qkv_stack_t"),
    L + "self_attention.linear_proj.weight": DeployRule((_FT_L + "attention.dense.weight.{r}.bin",), "split_t"),
    L + "pre_mlp_layernorm.weight": DeployRule((_FT_L + "post_attention_layernorm.weight.bin",)),
    L + "mlp.linear_fc1.weight": DeployRule((_FT_L + "mlp.gate_proj.weight.{r}.bin",
                                             _FT_L + "mlp.up_proj.weight.{r}.bin"), "gated_t"),
    L + "mlp.linear_fc2.weight": DeployRule((_FT_L + "mlp.down_proj.weight.{r}.bin",), "split_t"),
    "decoder.final_layernorm.weight": DeployRule(("model.final_layernorm.weight.bin",)),
    "output_layer.weight": DeployRule(("model.lm_head.weight.bin",)),  # always read: a tied model gets a copy
}


def _ft_check_config(cfg: dict[str, str], ints: dict[str, int]) -> list[str]:
    if int(cfg["rotary_embedding"]) > ints["size_per_head"]:
        return ["rotary_embedding > size_per_head"]
    return []


FT = FTLayout(
    section="llama",
    required_fields=(
        "model_name", "head_num", "size_per_head", "inter_size", "num_layer", "rotary_embedding", "vocab_size",
        "layernorm_eps", "start_id", "end_id", "weight_data_type", "tensor_para_size",
    ),
    holds=_ft_holds,
    refuse=_ft_refuse,
    expected_files=_ft_expected_files,
    files=FT_FILES,
    config_fields=lambda spec: dict(rotary_embedding=spec.head_dim),
    kernels=FTKernels(embedding="model.wte.weight.bin", positions=None, norm="RMSNorm", biases=False,
                      mlp=("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"), rotary_dim="rotary_embedding"),
    check_config=_ft_check_config,
    always_reads_head=True,
    tied_head_note="tied head: model.lm_head.weight.bin is a copy of model.wte.weight.bin (FT's LLaMA reads both)",
)


# ---- TensorRT-LLM LLaMA ---------------------------------------------------------------------------------
def _trt_refuse(spec: ModelSpec) -> None:
    if spec.rotary_percent != 1.0:
        raise MConvertError(f"rotary_percent={spec.rotary_percent} is not supported for the LLaMA layout")
    if spec.add_qkv_bias and not spec.add_bias_linear:
        raise MConvertError("a qkv-only bias (Qwen2 style) is not part of TensorRT-LLM's LLaMA layout")
    if spec.rope_scaling == "yarn" and not spec.yarn_correction_range_round_to_int:
        raise MConvertError("YaRN with yarn_correction_range_round_to_int=False has no TensorRT-LLM form: its "
                            "create_sinusoidal_positions_yarn always rounds the correction range; conversion refused")


_T = "transformer.layers.*."
TRT_TENSORS: dict[str, DeployRule | None] = {  # TensorRT-LLM's LLaMA: Linear `[out, in]`; mlp.fc = gate, mlp.gate = up
    "embedding.word_embeddings.weight": DeployRule(("transformer.vocab_embedding.weight",)),
    L + "input_layernorm.weight": DeployRule((_T + "input_layernorm.weight",)),
    L + "self_attention.linear_qkv.weight": DeployRule((_T + "attention.qkv.weight",), "qkv_cat"),
    L + "self_attention.linear_qkv.bias": DeployRule((_T + "attention.qkv.bias",), "qkv_cat"),
    L + "self_attention.linear_proj.weight": DeployRule((_T + "attention.dense.weight",), "split"),
    L + "self_attention.linear_proj.bias": DeployRule((_T + "attention.dense.bias",)),
    L + "pre_mlp_layernorm.weight": DeployRule((_T + "post_layernorm.weight",)),
    L + "mlp.linear_fc1.weight": DeployRule((_T + "mlp.fc.weight", _T + "mlp.gate.weight"), "gated"),
    L + "mlp.linear_fc1.bias": DeployRule((_T + "mlp.fc.bias", _T + "mlp.gate.bias"), "gated"),
    L + "mlp.linear_fc2.weight": DeployRule((_T + "mlp.proj.weight",), "split"),
    L + "mlp.linear_fc2.bias": DeployRule((_T + "mlp.proj.bias",)),
    "decoder.final_layernorm.weight": DeployRule(("transformer.ln_f.weight",)),
    "output_layer.weight": DeployRule(("lm_head.weight",), "vocab_padded"),
}


def _trt_config_fields(spec: ModelSpec) -> dict[str, Any]:
    """LLaMAConfig's own fields. `rotary_scaling` is what `LLaMAConfig.from_hugging_face` stores: the HF config's
    `rope_scaling` dict verbatim (here every key of its type explicit), or None."""
    return dict(mlp_bias=spec.add_bias_linear, attn_bias=spec.has_qkv_bias, rotary_base=spec.rotary_base,
                rotary_scaling=rope_scaling_to_hf(spec), residual_mlp=False, disable_weight_only_quant_plugin=False,
                moe={"num_experts": 0, "top_k": 0, "normalization_mode": None})


TRTLLM = TrtllmLayout(
    architecture="LlamaForCausalLM",
    hidden_act=lambda spec: "silu",
    position_embedding_type="rope_gpt_neox",
    config_fields=_trt_config_fields,
    refuse=_trt_refuse,
    tensors=TRT_TENSORS,
    aliases=("MistralForCausalLM",),
    rope_scalings=("llama3", "linear", "yarn"),  # TensorRT-LLM's RotaryScalingType llama3, linear and yarn
)


# ---- GGUF (llama.cpp) -----------------------------------------------------------------------------------
# HF name -> GGUF name as llama.cpp's gguf-py `TensorNameMap` maps the LLaMA-style names (biases follow their
# weights: llama.cpp's LLAMA, QWEN2 and QWEN3 loaders read each one when present).
GGUF_TENSORS: dict[str, str] = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    H + "input_layernorm.weight": "blk.*.attn_norm.weight",
    H + "post_attention_layernorm.weight": "blk.*.ffn_norm.weight",
    **{H + f"self_attn.{hf}.{kind}": f"blk.*.{gg}.{kind}" for hf, gg in (
        ("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"), ("o_proj", "attn_output"))
       for kind in ("weight", "bias")},
    **{H + f"mlp.{hf}.{kind}": f"blk.*.{gg}.{kind}" for hf, gg in (
        ("gate_proj", "ffn_gate"), ("up_proj", "ffn_up"), ("down_proj", "ffn_down")) for kind in ("weight", "bias")},
}


def gguf_refuse_rope_freqs(spec: ModelSpec) -> None:
    """Refuse llama3 rope scaling for an architecture whose llama.cpp loader reads no `rope_freqs` tensor."""
    if spec.rope_scaling == "llama3":
        raise MConvertError(f"rope scaling llama3 of this {spec.family}-family model has no GGUF form: llama.cpp's "
                            f"{spec.family} architecture reads no rope_freqs tensor; conversion refused")


# llama.cpp's LLAMA architecture: `convert_hf_to_gguf.py`'s LlamaModel (Mistral's HF class maps to it too).
GGUF = GgufLayout(arch="llama", tensors=GGUF_TENSORS, permute_qk=True, rope_freqs=True)


# ---- presets --------------------------------------------------------------------------------------------
def rope_preset(family: str, **kw: Any) -> ModelSpec:
    """A RoPE-family preset: RMSNorm, SwiGLU, RoPE, no linear bias, untied head unless `kw` says otherwise."""
    base: dict[str, Any] = dict(normalization="RMSNorm", activation="swiglu", position_embedding_type="rope",
                                add_bias_linear=False, tie_embeddings=False)
    return ModelSpec(family=family, **{**base, **kw})


PRESETS = {
    "tiny-llama": rope_preset(NAME, num_layers=2, hidden_size=128, num_attention_heads=4, num_query_groups=2,
                              ffn_hidden_size=256, vocab_size=1000, max_position_embeddings=128),
    # ~100M parameters, for quick benchmarks
    "llama-100m": rope_preset(NAME, num_layers=12, hidden_size=768, num_attention_heads=12, num_query_groups=4,
                              ffn_hidden_size=2048, vocab_size=32000, max_position_embeddings=1024),
    # Llama-3-405B shapes: only for `--dry-run` estimates from shapes alone (126 layers: PP=16 is uneven)
    "llama3-405b": rope_preset(NAME, num_layers=126, hidden_size=16384, num_attention_heads=128,
                               num_query_groups=8, ffn_hidden_size=53248, vocab_size=128256,
                               max_position_embeddings=131072, rotary_base=500000.0, params_dtype="bfloat16"),
    # Llama-3.x rope scaling. megatron-core fixes the llama3 bands at 8192 original positions; with
    # rotary_base 500000 and head_dim 64 the pairs with wavelengths above 2048 are still rescaled, so the
    # scaling changes positions below 128.
    "tiny-llama3": rope_preset(NAME, num_layers=2, hidden_size=256, num_attention_heads=4, num_query_groups=2,
                               ffn_hidden_size=512, vocab_size=1000, max_position_embeddings=128,
                               rotary_base=500000.0, rope_scaling="llama3", rope_scaling_factor=8.0),
    # YaRN (megatron-core position_embedding_type='yarn'): trained at 64 positions, stretched 4x to 256; with
    # head_dim 32 the pairs past the 5th are interpolated, so sequences beyond 64 tokens probe the scaling
    "tiny-llama-yarn": rope_preset(NAME, num_layers=2, hidden_size=128, num_attention_heads=4, num_query_groups=2,
                                   ffn_hidden_size=256, vocab_size=1000, max_position_embeddings=256,
                                   rope_scaling="yarn", rope_scaling_factor=4.0,
                                   rope_original_max_position_embeddings=64),
}

def rope_family(name: str, stem: str, **differs: Any) -> dict[str, Any]:
    """The fields of an RMSNorm + SwiGLU + RoPE family's `Family` record: LLaMA's name table, vLLM facts and
    deployment layouts; HF classes `<stem>ForCausalLM` / `<stem>Model`, `model_type` = `name`; a family
    states only what differs (`differs` replaces any of these)."""
    base: dict[str, Any] = dict(name=name, architecture=f"{stem}ForCausalLM", model_type=name,
                                base_architecture=f"{stem}Model", plugin=TABLE, vllm=ROPE_VLLM, ft=FT, trtllm=TRTLLM)
    return {**base, **differs}


FAMILY = Family(
    name=NAME,
    architecture="LlamaForCausalLM",
    model_type="llama",
    base_architecture="LlamaModel",
    plugin=TABLE,
    hf_fields=HF_FIELDS,
    to_hf=to_hf,
    from_hf=from_hf,
    vllm=ROPE_VLLM,
    presets=PRESETS,
    recognise=lambda fields: True,  # the default when nothing else matches
    recognise_order=100,
    ft=FT,
    trtllm=TRTLLM,
    gguf=GGUF,
)
