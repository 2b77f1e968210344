"""Multi-latent attention (DeepSeek-V2/V3) as megatron-core 0.16.1's `MLASelfAttention` computes it, local spec.

q comes from a q_lora_rank latent (`linear_q_down_proj` → `q_layernorm` → `linear_q_up_proj`) or straight from
the hidden state (`linear_q_proj`); k and v come from one kv_lora_rank latent plus a rope part shared by every
head (`linear_kv_down_proj` rows: the latent, then the rope part → `kv_layernorm` on the latent →
`linear_kv_up_proj`, per head k_nope then v). Each head's q/k is [nope | rope], the rope part rotated after
megatron-core's de-interleave (dims 0,2,4,... then 1,3,5,..., = HF `rope_interleave: true`); v is v_head_dim wide.

Collectives: the down projections are column-split in the local spec, so each rank computes a slice of the
latent and all-gathers it (split bwd), after copy-to-TP of the input (all-reduce bwd); the up projections
split by head (copy-to-TP of the latent); k's rope part, shared by every head, is copied to TP too (all-reduce
of its gradient, which each rank's heads give a part of); `linear_proj` is row-parallel (all-reduce fwd).

YaRN: megatron-core's `YarnRotaryEmbedding` (`yarn_inv_freq`, `yarn_concentration`) and MLA's softmax scale
(`softmax_scale`) are here. The spec states plain rope for MLA; `rope_tables` and `MLAttention.scale` are where
a YaRN stated by the spec (the llama-style families' `rope_scaling` fields) joins.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from mconvert.spec import ModelSpec, ParamDecl
from mconvert.trainer.layers import ColumnParallelLinear, RowParallelLinear, copy_to_tp, gather_from_tp
from mconvert.trainer.parallel import ParallelState

Make = Callable[[ParamDecl | None], nn.Parameter | None]


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention scale for a stretch `factor` (megatron-core's `_yarn_get_mscale`)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_concentration(factor: float, mscale: float, mscale_all_dim: float) -> float:
    """The number cos and sin are multiplied by: mscale(factor, mscale) / mscale(factor, mscale_all_dim)."""
    return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)


def yarn_inv_freq(dim: int, base: float, factor: float, original_max: int, beta_fast: float = 32.0,
                  beta_slow: float = 1.0, round_to_int: bool = True) -> torch.Tensor:
    """YaRN's per-pair frequencies: the base frequencies above the fast-rotation bound, those divided by `factor`
    below the slow bound, a linear ramp between (megatron-core's `YarnRotaryEmbedding.get_emb`)."""
    extra = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    inter = extra / factor

    def bound(rotations: float) -> float:
        return dim * math.log(original_max / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = bound(beta_fast), bound(beta_slow)
    if round_to_int:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1.0 - ramp  # 1: the base frequency (fast rotations), 0: the interpolated one
    return inter * (1 - keep) + extra * keep


def rope_tables(spec: ModelSpec, seq: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [S, qk_rope_head_dim] for MLA's rope part (freqs repeated, rotate_half, as megatron-core)."""
    dim = spec.qk_rope_head_dim
    inv = 1.0 / (spec.rotary_base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    freqs = torch.outer(torch.arange(seq, dtype=torch.float32), inv).to(device)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def softmax_scale(spec: ModelSpec, factor: float = 1.0, mscale_all_dim: float = 0.0) -> float:
    """megatron-core MLA's softmax scale: mscale(factor, mscale_all_dim)² / sqrt(nope + rope)."""
    m = yarn_mscale(factor, mscale_all_dim)
    return m * m / math.sqrt(spec.qk_nope_head_dim + spec.qk_rope_head_dim)


def deinterleave(t: torch.Tensor) -> torch.Tensor:
    """[..., d] -> even dims, then odd dims (megatron-core MLA's order before rotating; HF rope_interleave)."""
    return torch.cat([t[..., 0::2], t[..., 1::2]], dim=-1)


def apply_mla_rope(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """t [B, S, heads, r]: de-interleave, then rotate_half with cos/sin [S, r]."""
    t = deinterleave(t)
    c, s = cos[None, :, None, :].to(t.dtype), sin[None, :, None, :].to(t.dtype)
    x1, x2 = t.chunk(2, dim=-1)
    return t * c + torch.cat((-x2, x1), dim=-1) * s


def latent_norm(spec: ModelSpec, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The latent norms (megatron-core builds them with the model's normalization, without bias)."""
    if spec.normalization == "RMSNorm":
        return F.rms_norm(x, (x.shape[-1],), weight, spec.norm_epsilon)
    return F.layer_norm(x, (x.shape[-1],), weight, None, spec.norm_epsilon)


class _LatentNorm(nn.Module):
    """Holds a latent norm's weight under megatron-core's name (`q_layernorm` / `kv_layernorm`)."""

    def __init__(self, weight: nn.Parameter | None) -> None:
        super().__init__()
        self.weight = weight


class MLAttention(nn.Module):
    """Multi-latent self-attention of one layer (see the module docstring); causal, fp32 softmax."""

    def __init__(self, spec: ModelSpec, decls: dict[str, ParamDecl], make: Make, st: ParallelState) -> None:
        super().__init__()
        self.spec, self.st = spec, st
        self.heads = spec.num_attention_heads // st.tp

        def col(name: str) -> ColumnParallelLinear:
            return ColumnParallelLinear(make(decls[name]), None, st)

        if spec.q_lora_rank is None:
            self.linear_q_proj = col("linear_q_proj.weight")
        else:
            self.linear_q_down_proj = col("linear_q_down_proj.weight")
            self.linear_q_up_proj = col("linear_q_up_proj.weight")
            self.q_layernorm = _LatentNorm(make(decls["q_layernorm.weight"]))
        self.linear_kv_down_proj = col("linear_kv_down_proj.weight")
        self.linear_kv_up_proj = col("linear_kv_up_proj.weight")
        self.kv_layernorm = _LatentNorm(make(decls["kv_layernorm.weight"]))
        self.linear_proj = RowParallelLinear(make(decls["linear_proj.weight"]), None, st)
        self.scale = softmax_scale(spec)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        spec = self.spec
        nope, r, vd = spec.qk_nope_head_dim, spec.qk_rope_head_dim, spec.v_head_dim
        B, S = x.shape[:2]
        cos, sin = rope if rope is not None else rope_tables(spec, S, x.device)
        if spec.q_lora_rank is None:
            q = self.linear_q_proj(x)
        else:
            q_latent = gather_from_tp(self.linear_q_down_proj(x), self.st)
            q = self.linear_q_up_proj(latent_norm(spec, q_latent, self.q_layernorm.weight))
        kv = gather_from_tp(self.linear_kv_down_proj(x), self.st)
        kv_latent, k_rope = kv.split([spec.kv_lora_rank, r], dim=-1)  # type: ignore[list-item]
        k_rope = copy_to_tp(k_rope, self.st)  # shared by every head, this rank's heads give a partial gradient
        kv = self.linear_kv_up_proj(latent_norm(spec, kv_latent, self.kv_layernorm.weight))
        q = q.view(B, S, self.heads, nope + r)
        kv = kv.view(B, S, self.heads, nope + vd)
        q_nope, q_rope = q.split([nope, r], dim=-1)
        k_nope, v = kv.split([nope, vd], dim=-1)
        q_rope = apply_mla_rope(q_rope, cos, sin)
        k_rope = apply_mla_rope(k_rope.unsqueeze(2), cos, sin).expand(B, S, self.heads, r)
        q = torch.cat([q_nope, q_rope], dim=-1)
        k = torch.cat([k_nope, k_rope], dim=-1)
        q, k, v = (t.transpose(1, 2).float() for t in (q, k, v))  # [B, heads, S, d], fp32
        scores = (q @ k.transpose(-1, -2)) * self.scale
        mask = torch.ones(S, S, dtype=torch.bool, device=x.device).triu(1)
        probs = scores.masked_fill(mask, float("-inf")).softmax(dim=-1)
        ctx = (probs @ v).to(x.dtype).transpose(1, 2).reshape(B, S, self.heads * vd)
        return self.linear_proj(ctx)
