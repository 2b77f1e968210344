"""Tensor-parallel layers: Column/Row/VocabParallel and vocab-parallel cross-entropy.

Each layer pairs a forward collective with its conjugate in backward through an autograd.Function:
  copy-to-TP:      identity fwd, all-reduce bwd   (input of a column-parallel linear)
  reduce-from-TP:  all-reduce fwd, identity bwd   (output of a row-parallel linear / the embedding)
  gather-from-TP:  all-gather fwd, split bwd      (only where full logits are asked for: inference)
  gather-tokens:   all-gather fwd, reduce-scatter bwd over EP (MoE dispatch: every token to every expert rank)
  scatter-tokens:  reduce-scatter fwd, all-gather bwd over EP (MoE combine: each rank gets its tokens' sums)
The parameters arrive already sharded (the model cuts full tensors with `transforms.shard`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mconvert.trainer import comm
from mconvert.trainer.parallel import ParallelState


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return comm.all_reduce(g.contiguous(), ctx.group, "TP"), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        return comm.all_reduce(x.contiguous(), group, "TP")

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return g, None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, rank: int) -> torch.Tensor:
        ctx.rank, ctx.size = rank, x.shape[-1]
        return comm.all_gather(x, group, "TP", dim=-1)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return g[..., ctx.rank * ctx.size:(ctx.rank + 1) * ctx.size].contiguous(), None, None


class _GatherFromSP(torch.autograd.Function):
    """Sequence parallel: all-gather the sequence chunks (dim 1) fwd, reduce-scatter the gradient bwd."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return comm.all_gather(x, group, "TP", dim=1)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return comm.reduce_scatter(g, ctx.group, "TP", dim=1), None


class _ReduceScatterToSP(torch.autograd.Function):
    """Sequence parallel: reduce-scatter partial sums along the sequence (dim 1) fwd, all-gather bwd."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return comm.reduce_scatter(x, group, "TP", dim=1)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return comm.all_gather(g.contiguous(), ctx.group, "TP", dim=1), None


class _GatherTokens(torch.autograd.Function):
    """All-gather along dim 0 over `group` fwd (rank order), reduce-scatter of the gradient bwd."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, name: str) -> torch.Tensor:
        ctx.group, ctx.name = group, name
        return comm.all_gather(x, group, name, dim=0)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return comm.reduce_scatter(g.contiguous(), ctx.group, ctx.name, dim=0), None, None


class _ScatterTokens(torch.autograd.Function):
    """Reduce-scatter along dim 0 over `group` fwd, all-gather of the gradient bwd."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, name: str) -> torch.Tensor:
        ctx.group, ctx.name = group, name
        return comm.reduce_scatter(x.contiguous(), group, name, dim=0)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return comm.all_gather(g.contiguous(), ctx.group, ctx.name, dim=0), None, None


def gather_tokens(x: torch.Tensor, group: Any, name: str = "EP") -> torch.Tensor:
    """[N, ...] on each rank -> [N·ranks, ...] in group rank order; gradients reduce-scattered back."""
    return x if group is None else _GatherTokens.apply(x, group, name)


def scatter_tokens(x: torch.Tensor, group: Any, name: str = "EP") -> torch.Tensor:
    """[N·ranks, ...] partial sums on each rank -> this rank's [N, ...] summed over the group."""
    return x if group is None else _ScatterTokens.apply(x, group, name)


def copy_to_tp(x: torch.Tensor, st: ParallelState) -> torch.Tensor:
    return x if st.tp_group is None else _CopyToTP.apply(x, st.tp_group)


def reduce_from_tp(x: torch.Tensor, st: ParallelState) -> torch.Tensor:
    return x if st.tp_group is None else _ReduceFromTP.apply(x, st.tp_group)


def gather_from_sp(x: torch.Tensor, st: ParallelState) -> torch.Tensor:
    return x if st.tp_group is None else _GatherFromSP.apply(x, st.tp_group)


def reduce_scatter_to_sp(x: torch.Tensor, st: ParallelState) -> torch.Tensor:
    return x if st.tp_group is None else _ReduceScatterToSP.apply(x, st.tp_group)


def gather_from_tp(x: torch.Tensor, st: ParallelState) -> torch.Tensor:
    return x if st.tp_group is None else _GatherFromTP.apply(x, st.tp_group, st.tp_rank)


class _LinearBase(nn.Module):
    """Holds a weight shard (and bias); `_extra_state` = None like megatron-core's local linears."""

    def __init__(self, weight: nn.Parameter | None, bias: nn.Parameter | None, st: ParallelState) -> None:
        super().__init__()
        self.st = st
        if weight is not None:
            self.weight = weight
        else:
            self.register_parameter("weight", None)
        if bias is not None:
            self.bias = bias
        else:
            self.register_parameter("bias", None)

    def get_extra_state(self) -> None:  # megatron-core writes `<linear>._extra_state = None`
        return None

    def set_extra_state(self, state: Any) -> None:
        pass


class LocalLinear(_LinearBase):
    """Y = X W^T (+ b) on this rank's shard, no collective: an MoE expert, whose layer runs the TP and EP
    collectives once around all its experts."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class ColumnParallelLinear(_LinearBase):
    """Y_r = X A_r^T (+ b_r): weight split on dim 0; input copied to TP (all-reduce of its grad), or with
    sequence parallelism all-gathered along the sequence (reduce-scatter of its grad)."""

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        w = self.weight if weight is None else weight
        x = gather_from_sp(x, self.st) if self.st.sequence_parallel else copy_to_tp(x, self.st)
        return F.linear(x, w, self.bias)


class RowParallelLinear(_LinearBase):
    """Y = sum_r X_r A_r^T + b: weight split on dim 1; partial outputs all-reduced over TP (or reduce-scattered
    along the sequence with sequence parallelism), bias added after."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        y = reduce_scatter_to_sp(y, self.st) if self.st.sequence_parallel else reduce_from_tp(y, self.st)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Each TP rank holds rows [r·V/TP, (r+1)·V/TP) of the padded vocab; outside ids give 0, then all-reduce."""

    def __init__(self, weight: nn.Parameter, st: ParallelState) -> None:
        super().__init__()
        self.weight = weight
        self.st = st
        self.start = st.tp_rank * weight.shape[0]
        self.end = self.start + weight.shape[0]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.st.tp_group is None:
            return F.embedding(ids, self.weight)
        outside = (ids < self.start) | (ids >= self.end)
        local = (ids - self.start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.st.sequence_parallel:  # Megatron's reduce_scatter_embeddings
            return reduce_scatter_to_sp(out, self.st)
        return reduce_from_tp(out, self.st)


class _VocabParallelCE(torch.autograd.Function):
    """Cross-entropy over vocab shards: all-reduce of max, target logit and sum(exp); no full logits anywhere."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, st: ParallelState) -> torch.Tensor:
        logits = logits.float()
        vloc = logits.shape[-1]
        start = st.tp_rank * vloc
        lmax = logits.max(dim=-1).values
        comm.all_reduce(lmax, st.tp_group, "TP", op=torch.distributed.ReduceOp.MAX if st.tp_group else None)
        shifted = logits - lmax.unsqueeze(-1)
        outside = (target < start) | (target >= start + vloc)
        local_t = (target - start).masked_fill(outside, 0)
        picked = shifted.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        comm.all_reduce(picked, st.tp_group, "TP")
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        comm.all_reduce(sum_exp, st.tp_group, "TP")
        loss = sum_exp.log() - picked
        exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(exp, local_t, outside)
        return loss

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        softmax, local_t, outside = ctx.saved_tensors
        grad = softmax.clone()
        onehot = torch.zeros_like(grad).scatter_(-1, local_t.unsqueeze(-1), 1.0)
        grad -= onehot * (~outside).unsqueeze(-1).to(grad.dtype)
        return grad * g.unsqueeze(-1), None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, st: ParallelState) -> torch.Tensor:
    """Per-token loss [..] from this rank's vocab shard of the logits [.., V/TP] (fp32)."""
    return _VocabParallelCE.apply(logits, target, st)
