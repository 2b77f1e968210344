"""The families: the list of family modules of `mconvert.mappings` (`FAMILY_MODULES`), lookups over them, and
configs parsed with them.

Each module `FAMILY_MODULES` names declares one `FAMILY` record (`mappings/record.py`). Lookups go by name,
HF architecture, `model_type` or Megatron args; the HF config ⇄ ModelSpec and Megatron args -> ModelSpec entry points live here
(not in `spec.py`, which knows no family), and so do the presets each family declares.
"""

from __future__ import annotations

import functools
import importlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mconvert.errors import MConvertError
from mconvert.mappings.record import Family
from mconvert.mappings.fields import (
    ARGS_NUMBERS,
    HF_COMMON,
    HF_NUMBERS,
    Field,
    check,
    check_megatron_args,
    check_numbers,
    full_rotary,
)
from mconvert import dtypes
from mconvert.spec import (
    ModelSpec,
    deepseek_features,
    deepseek_from_megatron_args,
    gemma_from_megatron_args,
    moe_from_megatron_args,
    rope_and_qk_from_megatron_args,
    window_from_megatron_args,
)


READS_FILE = "hf_config_reads.json"  # in mconvert/data: what each engine's code reads, per model_type

# Every family: the module of this package that declares its `FAMILY` record, one line each. Adding a family is
# adding its line (any place: the families are taken in module-name order).
FAMILY_MODULES = (
    "deepseek_v2",
    "deepseek_v3",
    "gemma2",
    "gemma3",
    "glm4_moe",
    "glm4_moe_lite",
    "gpt2",
    "llama",
    "mistral",
    "mixtral",
    "qwen2",
    "qwen2_moe",
    "qwen3",
    "qwen3_moe",
)


@functools.cache
def _registry() -> dict[str, Family]:
    found: dict[str, Family] = {}
    package = __name__.rpartition(".")[0]
    for module in sorted(FAMILY_MODULES):  # only these load: the shared machinery (torch) waits for a verb
        fam = getattr(importlib.import_module(f"{package}.{module}"), "FAMILY", None)
        if not isinstance(fam, Family):
            raise RuntimeError(f"{package}.{module} is listed in FAMILY_MODULES but declares no FAMILY = Family(...)")
        if fam.name in found:
            raise RuntimeError(f"two family modules declare the family {fam.name!r}")
        found[fam.name] = fam
    return found


def all_families() -> list[Family]:
    """Every family, in module-name order."""
    return list(_registry().values())


def names() -> list[str]:
    """Every family's name, in module-name order."""
    return list(_registry())


def by_name(name: str) -> Family:
    """The family called `name`; one MConvertError listing the known ones otherwise."""
    fam = _registry().get(name)
    if fam is None:
        raise MConvertError(f"unsupported model family {name!r}; supported: {', '.join(_registry())}")
    return fam


def of(spec: ModelSpec) -> Family:
    """The family of a ModelSpec."""
    return by_name(spec.family)


def by_architecture(arch: str) -> Family | None:
    """The family whose HF causal-LM class is `arch`, or None."""
    return next((f for f in _registry().values() if f.architecture == arch), None)


def by_model_type(model_type: Any) -> Family | None:
    """The family of an HF `model_type`, or None."""
    return next((f for f in _registry().values() if f.model_type == model_type), None)


def default_family() -> Family:
    """The family Megatron args fall back to when no other recognises them."""
    order = sorted((f for f in _registry().values() if f.recognise is not None), key=lambda f: f.recognise_order)
    return order[-1]


def recognise(fields: Mapping[str, Any]) -> Family:
    """The family of Megatron-parsed ModelSpec fields without `model_family`: the first whose rule matches
    (among the MoE families for a model with experts, the dense ones otherwise)."""
    moe = fields.get("num_experts") is not None
    order = sorted((f for f in _registry().values() if f.recognise is not None and f.moe == moe),
                   key=lambda f: f.recognise_order)
    found = next((f for f in order if f.recognise(dict(fields))), None)  # type: ignore[misc]
    if found is None:
        raise MConvertError("Megatron args name no model_family and no family recognises them; set model_family")
    return found


# ---- presets -------------------------------------------------------------------------------------------
@functools.cache
def _presets() -> dict[str, ModelSpec]:
    out: dict[str, ModelSpec] = {}
    for fam in _registry().values():
        out.update(fam.presets)
    return out


def presets() -> dict[str, ModelSpec]:
    """Every family's named presets (`tiny-*` for tests, `*-100m`, `gpt2-1b` for bench, `llama3-405b` shapes)."""
    return dict(_presets())


def preset(name: str) -> ModelSpec:
    """A named ModelSpec; one MConvertError listing the presets otherwise."""
    try:
        return _presets()[name]
    except KeyError:
        raise MConvertError(f"unknown preset {name!r}; choose one of: {', '.join(_presets())}") from None


def __getattr__(name: str) -> Any:
    """`PRESETS` (name -> ModelSpec) and `FAMILIES` (name -> Family), built on first use."""
    if name == "PRESETS":
        return presets()
    if name == "FAMILIES":
        return dict(_registry())
    raise AttributeError(name)


# ---- HF config.json ------------------------------------------------------------------------------------
def hf_table(model_type: str) -> dict[str, Field]:
    """The classification of every config.json field of one HF family (common attributes included)."""
    fam = by_model_type(model_type)
    if fam is None:
        raise MConvertError(f"no config field table for model_type {model_type!r}")
    return {**HF_COMMON, **fam.hf_fields}


@functools.cache
def _shipped_reads() -> dict[str, frozenset[str]]:
    raw = json.loads((Path(__file__).parents[1] / "data" / READS_FILE).read_text(encoding="utf-8"))
    return {t: frozenset(names) for t, names in raw["model_types"].items()}


def hf_reads(model_type: str) -> frozenset[str] | None:
    """Every config attribute a reference implementation of `model_type` reads (transformers' and vLLM's model
    code and the shared code it calls, derived from their sources by `tests/helpers/hf_config_reads.py`); None for a
    model_type the shipped file does not cover, where every name counts as read."""
    return _shipped_reads().get(model_type)


def check_moe_class(spec: ModelSpec) -> None:
    """Refuse a MoE model for a dense family's HF class and a dense model for a MoE class."""
    fam = of(spec)
    if spec.is_moe != fam.moe:
        what = "mixture-of-experts" if spec.is_moe else "dense"
        moe = [f.name for f in all_families() if f.moe]
        raise MConvertError(f"a {what} model cannot be written as HF {fam.architecture} (family {fam.name}); "
                            + (f"MoE families: {', '.join(moe)}" if spec.is_moe else "it has no num_experts")
                            + "; conversion refused")


def check_window_class(spec: ModelSpec) -> None:
    """Refuse a sliding window the family's HF class cannot compute: none at all, or one on only some layers
    when the class windows every layer."""
    fam = of(spec)
    if spec.window_size is None or fam.hf_window == "per_layer" or (fam.hf_window == "every"
                                                                    and spec.window_pattern is None):
        return
    layered = [f.name for f in all_families() if f.hf_window == "per_layer"]
    why = ("has no sliding window" if fam.hf_window is None else
           "applies its sliding_window to every layer, and this model has full-attention layers")
    raise MConvertError(f"HF {fam.architecture} {why}; this {spec.family}-family model has "
                        f"{spec.window_description()}; conversion refused (per-layer windows: "
                        f"{', '.join(layered)}; a Megatron checkpoint without linear biases and one window on every "
                        "layer reads as the mistral family)")


def hf_config(spec: ModelSpec) -> dict[str, Any]:
    """config.json content for transformers / vLLM. Every eps and rope setting is written explicitly."""
    spec.refuse_unmapped("HF")
    check_moe_class(spec)
    check_window_class(spec)
    check_gemma_class(spec)
    fam = of(spec)
    cfg: dict[str, Any] = {"architectures": [fam.architecture], "model_type": fam.model_type}
    cfg.update(fam.to_hf(spec))
    cfg["torch_dtype"] = spec.params_dtype
    if spec.bos_token_id is not None:
        cfg["bos_token_id"] = spec.bos_token_id
    if spec.eos_token_id is not None:
        cfg["eos_token_id"] = spec.eos_token_id
    return cfg


def refuse_for_hf(spec: ModelSpec, source: str) -> None:
    """Refuse, before any tensor is read, a model whose HF config.json cannot state it (naming `source`)."""
    spec.refuse_unmapped("HF", source)
    try:
        check_moe_class(spec)
        check_window_class(spec)
        check_gemma_class(spec)
        of(spec).to_hf(spec)
    except MConvertError as e:
        raise MConvertError(f"{source}: {e}") from None


def fold_rope_parameters(cfg: dict[str, Any]) -> dict[str, Any]:
    """The config with the rope_theta that transformers 5 writes only inside `rope_parameters`
    (`{"rope_type": "default", "rope_theta": θ}`, no top-level rope_theta) read as rope_theta, the function the
    writer's transformers computes (transformers 4 ignores the key and takes its class default); any other
    `rope_parameters` is left to the field table."""
    rp = cfg.get("rope_parameters")
    if (cfg.get("rope_theta") is None and isinstance(rp, dict)
            and set(rp) - {"partial_rotary_factor"} == {"rope_type", "rope_theta"} and rp["rope_type"] == "default"
            and full_rotary(rp, cfg)):
        return {**cfg, "rope_theta": rp["rope_theta"]}
    return cfg


def spec_from_hf_config(cfg: dict[str, Any], source: str = "config.json") -> ModelSpec:
    """Parse an HF config.json dict. A field of the wrong type is one MConvertError naming it."""
    if not isinstance(cfg, dict):
        raise MConvertError(f"{source}: expected a JSON object, found {type(cfg).__name__}; fix or re-export it")
    cfg = fold_rope_parameters(cfg)
    check_numbers(cfg, HF_NUMBERS, (), source)
    try:
        return _from_hf_config(cfg, source)
    except (TypeError, ValueError, OverflowError, ZeroDivisionError, AttributeError, IndexError) as e:
        raise MConvertError(f"{source}: malformed config ({type(e).__name__}: {e}); fix or re-export it") from None


def _check_one_class(cfg: dict[str, Any], archs: list[Any], fam: Family, source: str) -> None:
    """`architectures` and `model_type` must name one model: transformers' Auto classes build the class of
    `model_type`, vLLM the first architecture it knows, so a contradiction would have the two serve different
    models."""
    named = {f.name for f in map(by_architecture, archs) if f is not None}
    if len(named) > 1:
        raise MConvertError(f"{source}: architectures={archs!r} name more than one model; keep the one these weights "
                            "belong to")
    model_type = cfg.get("model_type")
    if model_type is not None and by_model_type(model_type) is not fam and model_type not in fam.remote_model_types:
        raise MConvertError(f"{source}: model_type={model_type!r} contradicts architectures={archs!r} (a "
                            f"{fam.architecture} has model_type {fam.model_type!r}); transformers builds the class of "
                            "model_type and vLLM that of architectures — fix config.json")


def _from_hf_config(cfg: dict[str, Any], source: str) -> ModelSpec:
    archs = cfg.get("architectures") or []
    fam = next((f for f in map(by_architecture, archs) if f is not None), None)
    if fam is None and not archs:  # named classes decide (a classification head is no causal LM of its type)
        fam = by_model_type(cfg.get("model_type", ""))
    if fam is None:
        raise MConvertError(
            f"{source}: unsupported architecture {archs or cfg.get('model_type')!r}; "
            f"supported: {', '.join(f.architecture for f in all_families())}"
        )
    _check_one_class(cfg, archs, fam, source)
    check(cfg, hf_table(fam.model_type), source, "config field", reads=hf_reads(fam.model_type))
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32").replace("torch.", "")
    if cfg.get("eos_token_id") == []:
        raise MConvertError(f"{source}: eos_token_id is an empty list; give the end-of-text id (or a list of them)")
    try:
        common = dict(
            family=fam.name,
            vocab_size=int(cfg["vocab_size"]),
            params_dtype=dtype if dtype in dtypes.PARAM_DTYPES else "float32",
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=cfg.get("eos_token_id")
            if not isinstance(cfg.get("eos_token_id"), list)
            else cfg["eos_token_id"][0],
        )
        return fam.from_hf(cfg, common, source)
    except KeyError as e:
        raise MConvertError(f"{source}: missing field {e.args[0]!r}") from None


# ---- Megatron args -------------------------------------------------------------------------------------
def spec_from_megatron_args(args: Any, family: str | None = None, source: str = "args") -> ModelSpec:
    """Parse a Megatron args Namespace (or SimpleNamespace / dict) — tolerant of older names.

    A field of the wrong type (None, text, NaN where a size belongs) is one MConvertError naming it."""
    try:
        a = vars(args) if not isinstance(args, dict) else dict(args)
    except TypeError:
        raise MConvertError(f"{source}: args is a {type(args).__name__}, not a Namespace or dict") from None
    check_numbers(a, ARGS_NUMBERS, ("hidden_size", "num_attention_heads", "num_layers"), source)
    check_megatron_args(a, source)
    try:
        return _from_megatron_args(a, family, source)
    except (TypeError, ValueError, OverflowError, ZeroDivisionError, AttributeError) as e:
        raise MConvertError(f"{source}: malformed Megatron args ({type(e).__name__}: {e})") from None


def _tanh_gelu(a: dict[str, Any]) -> bool:
    """Whether a GeLU MLP computed the tanh approximation: megatron-core's fused bias-GeLU
    (`bias_activation_fusion`, from Megatron-LM's `bias_gelu_fusion`, which it turns off without linear biases)
    and Transformer Engine's GeLU (`use_te_activation_func`) are both tanh GeLU; only the unfused path calls
    torch's exact erf GeLU."""
    fused = bool(a.get("bias_activation_fusion") or (a.get("bias_gelu_fusion") and a.get("add_bias_linear", True)))
    return fused or bool(a.get("use_te_activation_func"))


def _from_megatron_args(a: dict[str, Any], family: str | None, source: str) -> ModelSpec:
    def get(name: str, default: Any = None) -> Any:
        v = a.get(name, default)
        return default if v is None else v

    named = family if family is not None else get("model_family", None)
    if named is not None:  # a named family refuses what it cannot hold before the DeepSeek args are parsed
        _check_deepseek(by_name(named), a, source)
    try:
        H = int(a["hidden_size"])
        nh = int(a["num_attention_heads"])
        L = int(a["num_layers"])
    except KeyError as e:
        raise MConvertError(f"{source}: Megatron args lack {e.args[0]!r}; is this a Megatron checkpoint?") from None
    swiglu = bool(get("swiglu", False))
    gqa = bool(get("group_query_attention", False))
    groups = int(get("num_query_groups", nh)) if gqa else None
    ffn = get("ffn_hidden_size", None) or 4 * H
    eps = get("norm_epsilon", None)
    if eps is None:  # Megatron-LM's older name; a norm_epsilon given (0 included) is the one the model used
        eps = get("layernorm_epsilon", 1e-5)
    padded = get("padded_vocab_size", None)
    vocab = get("vocab_size", None) or get("true_vocab_size", None) or padded
    if vocab is None:
        raise MConvertError(f"{source}: Megatron args have neither vocab_size nor padded_vocab_size")
    dtype = "bfloat16" if get("bf16", False) else "float16" if get("fp16", False) else "float32"
    rope = get("position_embedding_type", "learned_absolute") in ("rope", "yarn")  # yarn: a scaled rope
    fields: dict[str, Any] = dict(
        num_layers=L,
        hidden_size=H,
        num_attention_heads=nh,
        ffn_hidden_size=int(ffn),
        vocab_size=int(vocab),
        max_position_embeddings=int(get("max_position_embeddings", get("seq_length", 2048))),
        num_query_groups=groups if groups and groups != nh else None,
        kv_channels=int(get("kv_channels", H // nh)),
        normalization=get("normalization", "LayerNorm"),
        norm_epsilon=float(eps),
        activation="swiglu" if swiglu else ("geglu" if get("gated_linear_unit", False) else
                                            "gelu_new" if get("openai_gelu", False) or _tanh_gelu(a) else "gelu"),
        position_embedding_type="rope" if rope else "learned_absolute",
        rotary_base=float(get("rotary_base", 10000)),
        rotary_percent=float(get("rotary_percent", 1.0)),
        rotary_interleaved=bool(get("rotary_interleaved", False)),
        add_bias_linear=bool(get("add_bias_linear", True)),
        add_qkv_bias=bool(get("add_qkv_bias", False)),
        tie_embeddings=not bool(get("untie_embeddings_and_output_weights", False)),
        make_vocab_size_divisible_by=int(get("make_vocab_size_divisible_by", 128)),
        params_dtype=dtype,
        **{**rope_and_qk_from_megatron_args(a, source), **moe_from_megatron_args(a),
           **deepseek_from_megatron_args(a, source), **window_from_megatron_args(a, L, source),
           **gemma_from_megatron_args(a)},
    )
    if family is None:
        family = get("model_family", None)
    fam = by_name(family) if family is not None else recognise(fields)
    n = fields.get("num_experts")
    if (n is not None) != fam.moe:
        moe = ", ".join(f.name for f in all_families() if f.moe)
        raise MConvertError(
            f"{source}: Megatron arg num_experts={n!r} is not supported for the "
            + (f"dense family {fam.name!r} (MoE families: {moe})" if n is not None else
               f"MoE family {fam.name!r}, which needs num_experts")
            + "; conversion refused"
        )
    _check_deepseek(fam, {**fields, "multi_latent_attention": fields.get("kv_lora_rank") is not None}, source)
    spec = ModelSpec(family=fam.name, **fields)
    check_gemma_class(spec, source)
    return spec


def check_gemma_class(spec: ModelSpec, source: str = "") -> None:
    """Refuse the Gemma block's fields for a family whose HF class does not compute them, naming the first."""
    extra = spec.gemma_features()
    if extra and not of(spec).gemma:
        gemma = ", ".join(f.name for f in all_families() if f.gemma)
        raise MConvertError(f"{source + ': ' if source else ''}{extra[0]} (the Gemma block) is not supported for the "
                            f"{spec.family!r} family (Gemma families: {gemma}); conversion refused")


def _check_deepseek(fam: Any, values: Mapping[str, Any], source: str) -> None:
    """Refuse DeepSeek-V3 architecture args for a family that cannot hold them, naming the first."""
    extra = deepseek_features(values)
    if extra and not fam.deepseek:
        k, v = next(iter(extra.items()))
        raise MConvertError(f"{source}: Megatron arg {k}={v!r} is not supported for the {fam.name!r} family (the "
                            "DeepSeek architectures are the deepseek_v2 and deepseek_v3 families'); conversion refused")
