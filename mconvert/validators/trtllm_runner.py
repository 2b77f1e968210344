"""TensorRT-LLM reference runner: logits of a `to-trtllm` checkpoint's rank files computed with torch, combined
as TensorRT-LLM's ColumnLinear / RowLinear do (the engine itself needs a GPU build)."""

from __future__ import annotations

import math
from pathlib import Path

from typing import Any

import torch
from safetensors.torch import load_file

from mconvert.convert.deploy.trtllm import check_trtllm_dir, read_trtllm_config, trtllm_layout_of
from mconvert.errors import MConvertError
from mconvert.rope import megatron_attention_factor, yarn_inv_freq
from mconvert.validators.ft_runner import (
    causal_attention,
    gelu_tanh,
    layer_norm,
    rms_norm,
    rope_inv_freq,
    rope_neox,
    split_heads,
)

# TensorRT-LLM's rotary scaling types (`functional.RotaryScalingType`), named by `rotary_scaling`'s "type" (else
# its "rope_type"); "default" is HF's name for none
TRT_ROTARY_SCALING_TYPES = ("none", "linear", "dynamic", "longrope", "llama3", "yarn", "mrope")


def _number(scaling: dict[str, Any], key: str, default: float, where: str) -> float:
    v = scaling.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
        raise MConvertError(f"{where}: rotary_scaling.{key} = {v!r} must be a positive number; re-export it with "
                            "`mconvert megatron-to-trtllm`")
    return float(v)


def _linear(inv: torch.Tensor, scaling: dict[str, Any], where: str) -> torch.Tensor:
    """Positions divided by `factor` (its absence: 1), as the attention plugin's sinusoid table scales them."""
    return inv / _number(scaling, "factor", 1.0, where)


def _llama3(inv: torch.Tensor, scaling: dict[str, Any], where: str) -> torch.Tensor:
    """Llama-3.1 bands (TensorRT-LLM's `apply_llama3_scaling`, with its values for absent keys): wavelengths above
    original/low_freq_factor divided by `factor`, those below original/high_freq_factor kept, the band between
    interpolated."""
    factor = _number(scaling, "factor", 8.0, where)
    low = _number(scaling, "low_freq_factor", 1.0, where)
    high = _number(scaling, "high_freq_factor", 4.0, where)
    original = _number(scaling, "original_max_position_embeddings", 8192, where)
    if high <= low:
        raise MConvertError(f"{where}: rotary_scaling high_freq_factor {high:g} must exceed low_freq_factor {low:g}")
    wavelen = 2 * math.pi / inv
    smooth = (original / wavelen - low) / (high - low)
    mid = (1 - smooth) * inv / factor + smooth * inv
    return torch.where(wavelen < original / high, inv, torch.where(wavelen > original / low, inv / factor, mid))


def _yarn_params(scaling: dict[str, Any], where: str) -> dict[str, float]:
    """The YaRN values TensorRT-LLM's `Attention.create_attention_const_params` reads from `rotary_scaling`, with
    its defaults for absent keys (it reads no `truncate` and no `attention_factor`)."""
    out = {k: _number(scaling, k, d, where) for k, d in (("factor", 1.0), ("beta_fast", 32.0), ("beta_slow", 1.0),
                                                          ("original_max_position_embeddings", 4096))}
    for k, d in (("mscale", 1.0), ("mscale_all_dim", 0.0)):  # a negative mscale: an attention factor below 1
        v = scaling.get(k, d)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or (
                k == "mscale_all_dim" and v < 0):
            raise MConvertError(f"{where}: rotary_scaling.{k} = {v!r} must be a finite number"
                                f"{' >= 0' if k == 'mscale_all_dim' else ''}; re-export it with "
                                "`mconvert megatron-to-trtllm`")
        out[k] = float(v)
    return out


def _yarn(rotary_dim: int, base: float, scaling: dict[str, Any], where: str) -> torch.Tensor:
    """YaRN as `RopeEmbeddingUtils.create_sinusoidal_positions_yarn` computes it: the correction range always
    rounded."""
    p = _yarn_params(scaling, where)
    return yarn_inv_freq(rotary_dim, base, p["factor"], int(p["original_max_position_embeddings"]), p["beta_fast"],
                         p["beta_slow"], True)


# the types this runner computes -> inverse frequencies from the unscaled ones (yarn: from the rotary dim and
# base, `_yarn`); another known type is refused
ROTARY_SCALINGS = {"none": lambda inv, scaling, where: inv, "linear": _linear, "llama3": _llama3}
COMPUTED = (*ROTARY_SCALINGS, "yarn")


def rotary_mscale(cfg: dict[str, Any], where: str = "config.json") -> float:
    """What TensorRT-LLM multiplies cos and sin by: YaRN's mscale ratio (megatron-core's rule), else 1. The LLaMA
    layout rotates the whole head, so scaling the rotated q and k is scaling cos and sin."""
    scaling = cfg.get("rotary_scaling") or {}
    if scaling.get("type", scaling.get("rope_type")) != "yarn":
        return 1.0
    p = _yarn_params(scaling, where)
    return megatron_attention_factor(p["factor"], p["mscale"], p["mscale_all_dim"])


def rotary_inv_freq(cfg: dict[str, Any], rotary_dim: int, where: str = "config.json") -> torch.Tensor:
    """The inverse frequencies TensorRT-LLM's attention rotates by for this config.json: `rotary_base` scaled as
    `rotary_scaling` says (none, linear, llama3, yarn); a type it does not compute or does not know is refused."""
    inv = rope_inv_freq(rotary_dim, float(cfg.get("rotary_base") or 10000.0))
    scaling = cfg.get("rotary_scaling") or {}
    kind = scaling.get("type", scaling.get("rope_type")) if scaling else "none"
    kind = "none" if kind in (None, "default") else kind
    if kind not in TRT_ROTARY_SCALING_TYPES:
        raise MConvertError(f"{where}: rotary_scaling type {kind!r} is not a TensorRT-LLM rotary scaling type "
                            f"({', '.join(TRT_ROTARY_SCALING_TYPES)})")
    if kind not in COMPUTED:
        raise MConvertError(f"{where}: rotary_scaling type {kind!r} is not computed by mconvert's TensorRT-LLM "
                            f"reference runner (computes: {', '.join(COMPUTED)}); validation refused")
    if kind == "yarn":
        return _yarn(rotary_dim, float(cfg.get("rotary_base") or 10000.0), scaling, where)
    return ROTARY_SCALINGS[kind](inv, scaling, where)


@torch.no_grad()
def trtllm_logits(path: str | Path, tokens: torch.Tensor, device: str = "cpu") -> torch.Tensor:
    """Logits [B, S, V] from the rank files, combined as TensorRT-LLM's ColumnLinear / RowLinear do."""
    d = Path(path)
    problems = check_trtllm_dir(d)
    if problems:
        raise MConvertError(f"not a valid TensorRT-LLM checkpoint: {problems[0]}")
    cfg = read_trtllm_config(d / "config.json")
    t = int(cfg["mapping"]["tp_size"])
    ranks = [{k: v.float().to(device) for k, v in load_file(str(d / f"rank{r}.safetensors")).items()}
             for r in range(t)]
    layout = trtllm_layout_of(cfg["architecture"])
    H, L, V, eps = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"], cfg["norm_epsilon"]
    nh = cfg["num_attention_heads"]
    nkv = cfg.get("num_key_value_heads") or nh
    hd = cfg.get("head_size") or H // nh
    nq_l, nkv_l = nh // t, max(nkv, t) // t
    tokens = tokens.to(device)
    S = tokens.shape[1]
    r0 = ranks[0]
    x = r0["transformer.vocab_embedding.weight"][tokens]
    if layout.position_embedding_type == "learned_absolute":
        x = x + r0["transformer.position_embedding.weight"][:S]

    def norm(x: torch.Tensor, name: str) -> torch.Tensor:
        if layout.norm == "LayerNorm":
            return layer_norm(x, r0[name + ".weight"], r0[name + ".bias"], eps)
        return rms_norm(x, r0[name + ".weight"], eps)

    inv = None
    if layout.position_embedding_type.startswith("rope"):
        rot = int(cfg.get("rotary_embedding_dim") or hd)
        inv = rotary_inv_freq(cfg, rot, str(d / "config.json"))
        mscale = rotary_mscale(cfg, str(d / "config.json"))

    for i in range(L):
        p = f"transformer.layers.{i}."
        h = norm(x, p + "input_layernorm")
        attn = torch.zeros_like(x)
        for w in ranks:
            qkv = h @ w[p + "attention.qkv.weight"].t()
            if p + "attention.qkv.bias" in w:
                qkv = qkv + w[p + "attention.qkv.bias"]
            q, k, v = qkv.split([nq_l * hd, nkv_l * hd, nkv_l * hd], -1)
            q, k, v = split_heads(q, nq_l), split_heads(k, nkv_l), split_heads(v, nkv_l)
            if inv is not None:
                q, k = rope_neox(q, rot, inv_freq=inv) * mscale, rope_neox(k, rot, inv_freq=inv) * mscale
            k, v = k.repeat_interleave(nq_l // nkv_l, 1), v.repeat_interleave(nq_l // nkv_l, 1)
            attn += causal_attention(q, k, v) @ w[p + "attention.dense.weight"].t()
        x = x + attn + r0.get(p + "attention.dense.bias", 0)
        h = norm(x, p + "post_layernorm")
        mlp = torch.zeros_like(x)
        for w in ranks:
            fc = h @ w[p + "mlp.fc.weight"].t() + w.get(p + "mlp.fc.bias", 0)
            if layout.gated:
                inter = torch.nn.functional.silu(fc) * (h @ w[p + "mlp.gate.weight"].t() + w.get(p + "mlp.gate.bias", 0))
            else:
                inter = gelu_tanh(fc)
            mlp += inter @ w[p + "mlp.proj.weight"].t()
        x = x + mlp + r0.get(p + "mlp.proj.bias", 0)
    x = norm(x, "transformer.ln_f")
    if "lm_head.weight" in r0:
        logits = torch.cat([x @ w["lm_head.weight"].t() for w in ranks], -1)
    else:
        logits = x @ r0["transformer.vocab_embedding.weight"].t()
    return logits[..., :V].float()
