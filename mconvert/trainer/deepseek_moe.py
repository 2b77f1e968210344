"""The MoE router of every family and DeepSeek MoE's shared experts, as megatron-core 0.16.1 computes them.

`Router.route` is megatron-core's `topk_routing_with_score_function` (moe_utils.py) without its fused kernel:
- softmax (its default): top-k of the logits, softmax over the k (= HF Mixtral / Qwen3-MoE, norm_topk_prob);
- pre-softmax (`moe_router_pre_softmax`, DeepSeek-V2): softmax over every expert, the top-k of those
  probabilities as the weights, not renormalised;
- sigmoid (DeepSeek-V3): sigmoid scores; the experts are chosen on scores + `expert_bias` (an fp32 buffer that
  only steers the choice), weighted by their unbiased scores renormalised over the k (for k > 1);
- group-limited (n_group / topk_group): experts in `moe_router_num_groups` equal groups, a group scored by the
  sum of its top (k / group_topk) choice scores, the experts chosen from the best `moe_router_group_topk` groups;
- the weights times `moe_router_topk_scaling_factor` (HF routed_scaling_factor) when set.
The expert bias moves outside the optimizer (aux-loss-free balancing, megatron-core's
`get_updated_expert_bias`): after each step, bias += rate · sign(mean load − load) per expert, the loads summed
over the tensor- and data-parallel ranks (one all-reduce).

`SharedExperts` is megatron-core's `SharedExpertMLP`: a SwiGLU MLP of width moe_shared_expert_intermediate_size
beside the routed experts, TP-split like them, optionally scaled per token by sigmoid(x · gate_weight)
(`moe_shared_expert_gate`); its partial sums join theirs in the MoE layer's one reduction.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from mconvert.spec import ModelSpec, ParamDecl
from mconvert.trainer import comm
from mconvert.trainer.layers import LocalLinear
from mconvert.trainer.parallel import ParallelState

Make = Callable[[ParamDecl | None], nn.Parameter | None]
BIAS_UPDATE_RATE = 1e-3  # megatron-core's moe_router_bias_update_rate


def group_limited_topk(scores: torch.Tensor, k: int, groups: int, group_topk: int) -> torch.Tensor:
    """Indices [N, k] of the top-k experts inside the `group_topk` best of `groups` equal expert groups, a group
    scored by the sum of its top (k / group_topk) scores (megatron-core's `group_limited_topk`)."""
    n, e = scores.shape
    per_group = scores.view(n, groups, e // groups)
    group_scores = per_group.topk(k // group_topk, dim=-1).values.sum(dim=-1)
    chosen = group_scores.topk(group_topk, dim=-1, sorted=False).indices
    mask = torch.zeros_like(group_scores).scatter_(1, chosen, 1.0).bool()
    keep = mask.unsqueeze(-1).expand(n, groups, e // groups).reshape(n, e)
    return scores.masked_fill(~keep, float("-inf")).topk(k, dim=-1).indices


def route(logits: torch.Tensor, spec: ModelSpec, expert_bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [N, k] in the logits' dtype, expert indices [N, k]) for router logits [N, E]."""
    k = spec.moe_router_topk
    groups, group_topk = spec.moe_router_num_groups, spec.moe_router_group_topk

    def topk(scores: torch.Tensor) -> torch.Tensor:
        if group_topk:
            return group_limited_topk(scores, k, groups, group_topk)  # type: ignore[arg-type]
        return scores.topk(k, dim=-1).indices

    if spec.moe_router_score_function == "sigmoid":
        scores = torch.sigmoid(logits.float()).type_as(logits)
        top = topk(scores if expert_bias is None else scores + expert_bias)
        probs = scores.gather(1, top)
        if k > 1:
            probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
    elif spec.moe_router_pre_softmax:
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits)
        top = topk(scores)
        probs = scores.gather(1, top)
    else:
        top = topk(logits)
        probs = torch.softmax(logits.gather(1, top), dim=-1, dtype=torch.float32).type_as(logits)
    if spec.moe_router_topk_scaling_factor:
        probs = probs * spec.moe_router_topk_scaling_factor
    return probs, top


class Router(nn.Module):
    """`router.weight` [E, H] (replicated over TP and EP) and, with expert bias, `router.expert_bias` [E] (an fp32
    buffer, saved) with this rank's tokens per expert since the last update (not saved)."""

    def __init__(self, spec: ModelSpec, weight: nn.Parameter, bias: ParamDecl | None, st: ParallelState) -> None:
        super().__init__()
        self.spec = spec
        self.weight = weight
        if bias is not None:
            self.register_buffer("expert_bias", torch.zeros(bias.shape, dtype=torch.float32, device=st.device))
            self.register_buffer("tokens_per_expert", torch.zeros(bias.shape, dtype=torch.float32,
                                                                  device=st.device), persistent=False)
        else:
            self.expert_bias = self.tokens_per_expert = None

    def aux_loss_inputs(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The scores and choices megatron-core's load-balancing loss counts (`compute_routing_scores_for_aux_loss`):
        the softmax of the logits, or for the sigmoid router the sigmoid scores normalised over the experts, each
        with its own top-k (no bias, no groups: not always the routed choice)."""
        if self.spec.moe_router_score_function == "softmax":
            scores = torch.softmax(logits.float(), dim=-1)
        else:
            scores = torch.sigmoid(logits.float())
            scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
        return scores, scores.topk(self.spec.moe_router_topk, dim=-1).indices

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(logits [N, E], weights [N, k], experts [N, k]) for tokens h [N, H]; counts the tokens routed to each
        expert while training."""
        logits = F.linear(h, self.weight.to(h.dtype))
        probs, top = route(logits, self.spec, self.expert_bias)
        if self.tokens_per_expert is not None and self.training and torch.is_grad_enabled():
            self.tokens_per_expert += torch.bincount(top.reshape(-1), minlength=self.weight.shape[0]).float()
        return logits, probs, top


class SharedExperts(nn.Module):
    """`shared_experts.linear_fc1` (each TP rank [gate_r; up_r]) → SwiGLU → `linear_fc2` (rows of its inputs);
    this rank's partial sum, reduced with the routed experts'."""

    def __init__(self, decls: dict[str, ParamDecl], make: Make, st: ParallelState) -> None:
        super().__init__()
        self.linear_fc1 = LocalLinear(make(decls["shared_experts.linear_fc1.weight"]), None, st)
        self.linear_fc2 = LocalLinear(make(decls["shared_experts.linear_fc2.weight"]), None, st)
        self.gate_weight = make(decls.get("shared_experts.gate_weight"))  # [1, H], replicated

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.linear_fc1(x).chunk(2, dim=-1)
        out = self.linear_fc2(F.silu(gate) * up)
        if self.gate_weight is not None:  # megatron-core's moe_shared_expert_gate: a sigmoid per token
            out = out * torch.sigmoid(F.linear(x, self.gate_weight.to(x.dtype)))
        return out


def update_expert_bias(routers: list[Router], st: ParallelState, rate: float = BIAS_UPDATE_RATE) -> None:
    """One aux-loss-free step of every router with an expert bias: loads summed over TP and DP (one
    all-reduce of all layers' counts), bias += rate · sign(mean − load), counts restart."""
    routers = [r for r in routers if r.expert_bias is not None]
    if not routers:
        return
    counts = torch.stack([r.tokens_per_expert for r in routers])
    comm.all_reduce(counts, st.tp_group, "TP")
    comm.all_reduce(counts, st.dp_group, "DP")
    with torch.no_grad():
        offset = counts.mean(dim=-1, keepdim=True) - counts
        for r, off in zip(routers, offset):
            r.expert_bias += torch.sign(off) * rate
            r.tokens_per_expert.zero_()
