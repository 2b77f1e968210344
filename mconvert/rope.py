"""YaRN rope scaling as arithmetic: the inverse frequencies and the attention factor, and the two rules that
derive the factor (megatron-core's and transformers').

megatron-core 0.16.1 (`models/common/embeddings/yarn_rotary_pos_embedding.py`) and transformers 4.57
(`modeling_rope_utils._compute_yarn_parameters`) compute the same inverse frequencies from the same inputs
(rope base, rotary dim, factor, original max positions, beta_fast, beta_slow, and whether the correction range
is rounded: megatron-core's `correction_range_round_to_int`, transformers' `truncate`), and both multiply cos and
sin by one attention factor. They derive that factor differently: megatron-core from `mscale` and
`mscale_all_dim` whenever both are numbers, transformers from an explicit `attention_factor`, else from the
pair only when both are non-zero, else from the factor alone. Both rules are here so the mappings compare
the numbers each engine computes, not the keys each spells.
"""

from __future__ import annotations

import math
import struct
from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:
    import torch


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction `0.1 * mscale * ln(scale) + 1` (1 when the scale does not stretch)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def megatron_attention_factor(factor: float, mscale: float | None, mscale_all_dim: float | None) -> float:
    """megatron-core's concentration factor (`_yarn_get_concentration_factor`), the number its attention
    multiplies cos and sin by."""
    if mscale is None or mscale_all_dim is None:
        return yarn_get_mscale(factor)
    return float(yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim))


def hf_attention_factor(rope_scaling: Mapping[str, Any]) -> float:
    """transformers' attention factor for a yarn `rope_scaling` dict: `attention_factor` when given, else the
    mscale ratio when `mscale` and `mscale_all_dim` are both non-zero, else the factor's own mscale."""
    factor = rope_scaling["factor"]
    given = rope_scaling.get("attention_factor")
    if given is not None:
        return float(given)
    mscale, mscale_all_dim = rope_scaling.get("mscale"), rope_scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim))
    return yarn_get_mscale(factor)


def _f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def megatron_mscale_for(factor: float, attention_factor: float, mscale_all_dim: float = 0.0) -> float | None:
    """The `mscale` for which megatron-core, with `mscale_all_dim` (0 unless multi-latent attention fixes it, as
    its softmax reads it), multiplies cos and sin by `attention_factor`: its factor is `get_mscale(factor, mscale) /
    get_mscale(factor, mscale_all_dim)`, so mscale = 10·(attention_factor·get_mscale(factor, mscale_all_dim) - 1) /
    ln(factor).

    That quotient is rounded, and so is megatron-core's own arithmetic on it, so the float64 neighbours of the
    quotient are tried: the first whose factor equals `attention_factor` bit for bit, else the one nearest to it
    among those that round to the same float32 (both engines multiply their float32 cos and sin by the factor, so
    that is the number either applies). None when no mscale reaches it: a factor <= 1 (megatron-core then
    multiplies by 1) with an attention factor other than 1, or an attention factor so close to 0 that the `+ 1`
    rounds its digits away."""
    if factor <= 1:
        return 0.0 if attention_factor == 1 else None
    guess = 10 * (attention_factor * yarn_get_mscale(factor, mscale_all_dim) - 1) / math.log(factor)
    if not math.isfinite(guess):
        return None
    below = above = guess
    candidates = [guess]
    for _ in range(_NEIGHBOURS):
        below, above = math.nextafter(below, -math.inf), math.nextafter(above, math.inf)
        candidates += [below, above]
    near = None
    for m in candidates:
        got = megatron_attention_factor(factor, m, mscale_all_dim)
        if got == attention_factor:
            return m
        if _f32(got) == _f32(attention_factor) and (near is None or abs(got - attention_factor) < near[0]):
            near = (abs(got - attention_factor), m)
    return None if near is None else near[1]


_NEIGHBOURS = 16  # float64 steps tried each side of the quotient; the factor moves about one step of its own per step


def _correction_dim(rotations: float, dim: int, base: float, original_max: int) -> float:
    """The rotary dimension whose wavelength turns `rotations` times over `original_max` positions."""
    return (dim * math.log(original_max / (rotations * 2 * math.pi))) / (2 * math.log(base))


def yarn_correction_range(beta_fast: float, beta_slow: float, dim: int, base: float, original_max: int,
                          truncate: bool) -> tuple[float, float]:
    """The dimensions between which YaRN blends interpolation into extrapolation, rounded outwards when
    `truncate`, clamped to [0, dim - 1]."""
    low = _correction_dim(beta_fast, dim, base, original_max)
    high = _correction_dim(beta_slow, dim, base, original_max)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def yarn_inv_freq(dim: int, base: float, factor: float, original_max: int, beta_fast: float, beta_slow: float,
                  truncate: bool, device: "torch.device | str" = "cpu") -> "torch.Tensor":
    """YaRN's inverse frequencies [dim / 2]: the high-frequency pairs unscaled, the low-frequency ones divided by
    `factor`, a linear ramp between the correction range's ends."""
    import torch  # here, so that the ModelSpec checks that import this module need no torch

    exps = torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim
    extra = 1.0 / (base ** exps)
    inter = 1.0 / (factor * base ** exps)
    low, high = yarn_correction_range(beta_fast, beta_slow, dim, base, original_max, truncate)
    if low == high:
        high += 0.001  # both implementations keep the ramp finite this way
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
    keep = 1.0 - ramp  # 1: extrapolate (unscaled), 0: interpolate (divided by the factor)
    return inter * (1 - keep) + extra * keep
