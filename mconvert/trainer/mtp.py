"""Multi-token prediction (DeepSeek-V3) as megatron-core 0.16.1's `MultiTokenPredictionBlock` computes it.

MTP layer k predicts the token k + 2 ahead: the ids shifted left by k + 1 (megatron-core's `roll_tensor`: the
vacated end holds id 0) go through the model's embedding, `enorm`; the previous depth's hidden state (the
decoder's output after its final norm for k = 0) through `hnorm`; `eh_proj` [H, 2H] (column-parallel, output
all-gathered) projects [enorm(emb); hnorm(h)] to H, one transformer layer (built as the last decoder layer) and
`final_layernorm` follow; the model's own head gives its logits. The loss joins the backward pass only (megatron-
core's `MTPLossAutoScaler`): mtp_loss_scaling_factor / depth · mean over the shifted labels of each depth.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mconvert.spec import ModelSpec, ParamDecl
from mconvert.trainer.layers import ColumnParallelLinear, gather_from_tp
from mconvert.trainer.parallel import ParallelState

Make = Callable[[ParamDecl | None], nn.Parameter | None]
LOSS_SCALING_FACTOR = 0.1  # megatron-core's mtp_loss_scaling_factor


def shift_left(t: torch.Tensor, by: int = 1) -> torch.Tensor:
    """[B, S] -> shifted left along the sequence by `by`, the end filled with 0 (megatron-core's roll_tensor)."""
    out = torch.roll(t, shifts=-by, dims=-1)
    out[..., t.shape[-1] - by:] = 0
    return out


class _Norm(nn.Module):
    def __init__(self, spec: ModelSpec, weight: nn.Parameter | None, bias: nn.Parameter | None) -> None:
        super().__init__()
        self.rms, self.eps = spec.normalization == "RMSNorm", spec.norm_epsilon
        self.weight = weight
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rms:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


class MTPLayer(nn.Module):
    """One MTP depth under megatron-core's names (`enorm`, `hnorm`, `eh_proj`, `transformer_layer`,
    `final_layernorm`); `transformer_layer` is built by the caller from the spec's MTP layer declarations."""

    def __init__(self, spec: ModelSpec, decls: dict[str, ParamDecl], make: Make, st: ParallelState,
                 transformer_layer: nn.Module) -> None:
        super().__init__()
        self.st = st

        def norm(name: str) -> _Norm:
            return _Norm(spec, make(decls[name + ".weight"]), make(decls.get(name + ".bias")))

        self.enorm, self.hnorm = norm("enorm"), norm("hnorm")
        self.eh_proj = ColumnParallelLinear(make(decls["eh_proj.weight"]), None, st)
        self.transformer_layer = transformer_layer
        self.final_layernorm = norm("final_layernorm")

    def forward(self, ids: torch.Tensor, hidden: torch.Tensor, embedding: nn.Module, rope: Any) -> torch.Tensor:
        """ids: this depth's (already shifted) ids [B, S]; hidden [B, S, H]; returns the normed output [B, S, H]."""
        h = torch.cat([self.enorm(embedding(ids)), self.hnorm(hidden)], dim=-1)
        h = gather_from_tp(self.eh_proj(h), self.st)
        return self.final_layernorm(self.transformer_layer(h, rope))


class MTPBlock(nn.Module):
    """`mtp.layers.{k}`; `forward` gives each depth's hidden state in depth order."""

    def __init__(self, layers: list[MTPLayer]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.loss_scale = 1.0  # the gradient of the MTP loss per micro-batch (1/M, as the main loss's)

    def forward(self, ids: torch.Tensor, hidden: torch.Tensor, embedding: nn.Module, rope: Any) -> list[torch.Tensor]:
        out = []
        for layer in self.layers:
            ids = shift_left(ids)
            hidden = layer(ids, hidden, embedding, rope)
            out.append(hidden)
        return out


def mtp_loss(per_token_losses: list[torch.Tensor]) -> torch.Tensor:
    """mtp_loss_scaling_factor / depth · Σ_k (mean of depth k's per-token loss over its valid positions); the
    per-token losses are against the labels shifted left by k + 1 (the last k + 1 positions have none)."""
    total = torch.zeros((), device=per_token_losses[0].device)
    for k, loss in enumerate(per_token_losses):
        valid = torch.ones_like(loss)
        valid[..., loss.shape[-1] - (k + 1):] = 0
        total = total + (loss * valid).sum() / valid.sum()
    return total * (LOSS_SCALING_FACTOR / len(per_token_losses))


class _AttachLoss(torch.autograd.Function):
    """Identity on `x`; backward also sends `scale` as the gradient of `loss` (megatron-core's MTPLossAutoScaler)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.save_for_backward(loss)
        return x

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        (loss,) = ctx.saved_tensors
        return g, torch.full_like(loss, ctx.scale), None


def attach_loss(x: torch.Tensor, loss: torch.Tensor, scale: float) -> torch.Tensor:
    """`x` unchanged; in backward `loss` receives gradient `scale`."""
    return _AttachLoss.apply(x, loss, scale)
