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

YaRN (`rope_scaling='yarn'`, megatron-core's `rope_type='yarn'`): the rope part's frequencies are blended and its
cos and sin multiplied by get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim) (`rope_tables`), and the
softmax scale is multiplied by get_mscale(factor, mscale_all_dim)² (`softmax_scale`), as megatron-core's MLA does.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from mconvert.rope import yarn_get_mscale, yarn_inv_freq
from mconvert.spec import ModelSpec, ParamDecl
from mconvert.trainer.layers import ColumnParallelLinear, RowParallelLinear, copy_to_tp, gather_from_tp
from mconvert.trainer.parallel import ParallelState

Make = Callable[[ParamDecl | None], nn.Parameter | None]


def rope_tables(spec: ModelSpec, seq: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [S, qk_rope_head_dim] for MLA's rope part (freqs repeated, rotate_half, as megatron-core); with YaRN
    its blended frequencies, cos and sin times its attention factor (megatron-core's `YarnRotaryEmbedding`, which
    MLA builds without `correction_range_round_to_int`, so the range is always rounded)."""
    dim = spec.qk_rope_head_dim
    if spec.rope_scaling == "yarn":
        inv = yarn_inv_freq(dim, spec.rotary_base, spec.rope_scaling_factor, spec.rope_original_max_position_embeddings,
                            spec.yarn_beta_fast, spec.yarn_beta_slow, True)
    else:
        inv = 1.0 / (spec.rotary_base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    freqs = torch.outer(torch.arange(seq, dtype=torch.float32), inv).to(device)
    emb = torch.cat([freqs, freqs], dim=-1)
    factor = spec.yarn_attention_factor if spec.rope_scaling == "yarn" else 1.0
    return emb.cos() * factor, emb.sin() * factor


def softmax_scale(spec: ModelSpec) -> float:
    """megatron-core MLA's softmax scale: get_mscale(factor, mscale_all_dim)² / sqrt(nope + rope) (1 / sqrt(...)
    without YaRN)."""
    m = yarn_get_mscale(spec.rope_scaling_factor, spec.yarn_mscale_all_dim) if spec.rope_scaling == "yarn" else 1.0
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
