"""GPT model (one pipeline stage of it) built from ModelSpec, with megatron-core local-spec parameter names.

Every parameter's kind and full shape is read from `spec.layer_params(i)` / `embedding_params` /
`final_params`; the full tensor is drawn from a generator seeded by (seed, canonical name) and this rank
keeps `transforms.shard(full, kind, tp, rank)` of it — so a TP=2 PP=2 model holds exactly the numbers of
the TP=1 model with the same seed. Layer indices in `state_dict()` are local to the stage, as Megatron writes.
"""

from __future__ import annotations

import math
import zlib
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mconvert.layouts.megatron import PipelineSplit
from mconvert.errors import MConvertError
from mconvert.mappings.transforms import shard
from mconvert.rope import yarn_inv_freq
from mconvert.spec import ModelSpec, ParamDecl
from mconvert.trainer.layers import (
    ColumnParallelLinear,
    LocalLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    copy_to_tp,
    gather_from_sp,
    gather_from_tp,
    gather_tokens,
    reduce_from_tp,
    reduce_scatter_to_sp,
    scatter_tokens,
    vocab_parallel_cross_entropy,
)
from mconvert.trainer.deepseek_moe import Router, SharedExperts
from mconvert.trainer.mla import MLAttention
from mconvert.trainer.mla import rope_tables as mla_rope_tables
from mconvert.trainer.mtp import MTPBlock, MTPLayer, attach_loss, mtp_loss
from mconvert.trainer.parallel import ParallelState

INIT_STD = 0.02  # Megatron's init_method_std
COLUMN_KINDS = ("column", "qkv", "gated", "vocab")


def _seed_for(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1)


def full_init(decl: ParamDecl, spec: ModelSpec, seed: int) -> torch.Tensor:
    """The full fp32 tensor of one parameter, identical for any TP/PP (Megatron's init rules).

    Norm weights 1, biases 0, weights N(0, 0.02); linear_proj / linear_fc2 use 0.02/sqrt(2L) (scaled init).
    Vocab rows: the true rows from one generator, padded rows from another (so TP padding never shifts them)."""
    name = decl.name
    leaf = name.rsplit(".", 1)[-1]
    if "layernorm" in name:  # a zero-centred norm scales by 1 + w: its identity is w = 0
        one = leaf == "weight" and not spec.norm_zero_centered
        return torch.ones(decl.shape) if one else torch.zeros(decl.shape)
    if leaf == "bias":
        return torch.zeros(decl.shape)
    std = INIT_STD
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        std = INIT_STD / math.sqrt(2.0 * spec.num_layers)
    gen = torch.Generator().manual_seed(_seed_for(seed, name))
    if decl.kind == "vocab":
        rows, cols = decl.shape
        real = torch.randn((min(spec.vocab_size, rows), cols), generator=gen) * std
        if rows <= spec.vocab_size:
            return real
        pad_gen = torch.Generator().manual_seed(_seed_for(seed, name + "#padding"))
        return torch.cat([real, torch.randn((rows - spec.vocab_size, cols), generator=pad_gen) * std])
    return torch.randn(decl.shape, generator=gen) * std


class _Maker:
    """Creates this rank's shard of each declared parameter (initialised, or empty for loading)."""

    def __init__(self, spec: ModelSpec, st: ParallelState, seed: int | None, dtype: torch.dtype) -> None:
        self.spec, self.st, self.seed, self.dtype = spec, st, seed, dtype

    def __call__(self, decl: ParamDecl | None) -> nn.Parameter | None:
        if decl is None:
            return None
        if self.seed is None:
            meta = torch.empty(decl.shape, device="meta")
            shape = shard(meta, decl.kind, self.st.tp, self.st.tp_rank, decl.name).shape
            t = torch.empty(shape, dtype=self.dtype, device=self.st.device)
        else:
            full = full_init(decl, self.spec, self.seed)
            t = shard(full, decl.kind, self.st.tp, self.st.tp_rank, decl.name)
            t = t.to(dtype=self.dtype, device=self.st.device).clone()
        p = nn.Parameter(t)
        p.split_kind = decl.kind  # type: ignore[attr-defined]  (read by sequence_parallel_params)
        p.expert = decl.expert is not None  # type: ignore[attr-defined]  (grads summed over expert-DP ranks)
        return p


class Norm(nn.Module):
    """LayerNorm or RMSNorm (torch's functional forms, as megatron-core's local spec falls back to)."""

    def __init__(self, spec: ModelSpec, weight: nn.Parameter, bias: nn.Parameter | None) -> None:
        super().__init__()
        self.rms = spec.normalization == "RMSNorm"
        self.eps = spec.norm_epsilon
        self.zero_centered = spec.norm_zero_centered  # scales by 1 + w (megatron-core's zero-centred gamma)
        self.weight = weight
        if bias is not None:
            self.bias = bias
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = (x.shape[-1],)
        if self.zero_centered:  # in fp32, then cast: 1 + w rounded to bf16 would lose w's low bits (HF Gemma too)
            b = self.bias.float() if self.bias is not None else None
            w = self.weight.float() + 1
            out = F.rms_norm(x.float(), shape, w, self.eps) if self.rms else F.layer_norm(x.float(), shape, w, b,
                                                                                            self.eps)
            return out.to(x.dtype)
        if self.rms:
            return F.rms_norm(x, shape, self.weight, self.eps)
        return F.layer_norm(x, shape, self.weight, self.bias, self.eps)


def _linear(cls_kind: str, w: nn.Parameter | None, b: nn.Parameter | None, st: ParallelState) -> nn.Module:
    return (ColumnParallelLinear if cls_kind in COLUMN_KINDS else RowParallelLinear)(w, b, st)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def llama3_inv_freq(inv: torch.Tensor, spec: ModelSpec) -> torch.Tensor:
    """Llama-3.1 frequency scaling: wavelengths above original/low_freq are divided by the factor, those below
    original/high_freq kept, the band between interpolated smoothly (megatron-core's `_apply_scaling`)."""
    factor, low, high = spec.rope_scaling_factor, spec.rope_low_freq_factor, spec.rope_high_freq_factor
    old = spec.rope_original_max_position_embeddings
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old / low, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / high) & ~(wavelen > old / low)
    return torch.where(medium, smoothed, scaled)


def rope_tables(spec: ModelSpec, seq: int, device: torch.device,
                local: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [S, rot_dim] in megatron-core's non-interleaved layout (freqs repeated, rotate_half), with the
    spec's rope scaling: llama3 rescales the frequencies, linear divides the positions by the factor, yarn blends
    scaled and unscaled frequencies and multiplies cos and sin by its attention factor. `local`: the tables of
    the windowed layers of a model with `rotary_base_local` (that base, unscaled)."""
    if local:
        spec = spec.replace(rotary_base=spec.rotary_base_local, rope_scaling=None)
    dim = int(spec.head_dim * spec.rotary_percent)
    inv = 1.0 / (spec.rotary_base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))
    if spec.rope_scaling == "llama3":
        inv = llama3_inv_freq(inv, spec)
    if spec.rope_scaling == "yarn":
        inv = yarn_inv_freq(dim, spec.rotary_base, spec.rope_scaling_factor, spec.rope_original_max_position_embeddings,
                            spec.yarn_beta_fast, spec.yarn_beta_slow, spec.yarn_correction_range_round_to_int, device)
    pos = torch.arange(seq, dtype=torch.float32, device=device)
    if spec.rope_scaling == "linear":
        pos = pos * (1 / spec.rope_scaling_factor)
    freqs = torch.outer(pos, inv)
    emb = torch.cat([freqs, freqs], dim=-1)
    if spec.rope_scaling == "yarn":
        return emb.cos() * spec.yarn_attention_factor, emb.sin() * spec.yarn_attention_factor
    return emb.cos(), emb.sin()


def apply_rope(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """t [B, S, heads, hd]; rotate the first rot_dim features of each head."""
    rot = cos.shape[-1]
    c, s = cos[None, :, None, :].to(t.dtype), sin[None, :, None, :].to(t.dtype)
    t_rot, t_pass = t[..., :rot], t[..., rot:]
    return torch.cat([t_rot * c + rotate_half(t_rot) * s, t_pass], dim=-1)


def attention_mask(S: int, window: int | None, device: torch.device) -> torch.Tensor:
    """[S, S] True where query i may not see key j: j > i (causal), and with a window (megatron-core's left
    size) j < i - window as well."""
    i = torch.arange(S, device=device)[:, None]
    j = torch.arange(S, device=device)[None, :]
    return (j > i) | (j < i - window) if window is not None else j > i


class SelfAttention(nn.Module):
    """Fused QKV (per query group: nq/ng query heads, 1 key, 1 value) → causal (optionally sliding-window) fp32
    attention → row proj."""

    def __init__(self, spec: ModelSpec, decls: dict[str, ParamDecl], make: _Maker, st: ParallelState,
                 window: int | None = None) -> None:
        super().__init__()
        self.spec, self.st, self.window = spec, st, window
        w, b = decls["linear_qkv.weight"], decls.get("linear_qkv.bias")
        self.linear_qkv = _linear(w.kind, make(w), make(b), st)
        w, b = decls["linear_proj.weight"], decls.get("linear_proj.bias")
        self.linear_proj = _linear(w.kind, make(w), make(b), st)
        self.groups = spec.num_groups // st.tp
        self.per_group = spec.num_attention_heads // spec.num_groups
        if spec.qk_layernorm:  # per head over head_dim, the kind of the model's other norms
            self.q_layernorm = Norm(spec, make(decls["q_layernorm.weight"]), make(decls.get("q_layernorm.bias")))
            self.k_layernorm = Norm(spec, make(decls["k_layernorm.weight"]), make(decls.get("k_layernorm.bias")))
        else:
            self.q_layernorm = self.k_layernorm = None

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        hd = self.spec.head_dim
        qkv = self.linear_qkv(x)  # full sequence (gathered under sequence parallelism)
        B, S = qkv.shape[:2]
        qkv = qkv.view(B, S, self.groups, self.per_group + 2, hd)
        q = qkv[:, :, :, : self.per_group].reshape(B, S, self.groups * self.per_group, hd)
        k, v = qkv[:, :, :, self.per_group], qkv[:, :, :, self.per_group + 1]
        if self.q_layernorm is not None:  # after the projection, before RoPE (megatron-core's order)
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        k = k.repeat_interleave(self.per_group, dim=2)
        v = v.repeat_interleave(self.per_group, dim=2)
        q, k, v = (t.transpose(1, 2).float() for t in (q, k, v))  # [B, heads, S, hd], fp32
        scores = (q @ k.transpose(-1, -2)) * self.spec.attention_scale
        cap = self.spec.attn_logit_softcapping
        if cap is not None:  # Gemma 2: cap · tanh(scores / cap), before the mask
            scores = torch.tanh(scores / cap) * cap
        mask = attention_mask(S, self.window, qkv.device)
        probs = scores.masked_fill(mask, float("-inf")).softmax(dim=-1)
        ctx = (probs @ v).to(x.dtype).transpose(1, 2).reshape(B, S, -1)
        return self.linear_proj(ctx)


class MLP(nn.Module):
    """fc1 (column; gated: each rank holds [gate_r; up_r]) → activation → fc2 (row)."""

    def __init__(self, spec: ModelSpec, decls: dict[str, ParamDecl], make: _Maker, st: ParallelState) -> None:
        super().__init__()
        self.activation = spec.activation
        w, b = decls["linear_fc1.weight"], decls.get("linear_fc1.bias")
        self.linear_fc1 = _linear(w.kind, make(w), make(b), st)
        w, b = decls["linear_fc2.weight"], decls.get("linear_fc2.bias")
        self.linear_fc2 = _linear(w.kind, make(w), make(b), st)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(activate(self.linear_fc1(x), self.activation))


def activate(h: torch.Tensor, activation: str) -> torch.Tensor:
    """The MLP activation on fc1's output (swiglu: this rank's [gate_r; up_r] halves)."""
    if activation == "swiglu":
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate) * up
    if activation == "geglu":  # tanh GeLU on the gate (HF gelu_pytorch_tanh, Megatron openai_gelu)
        gate, up = h.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up
    if activation == "gelu_new":  # Megatron openai_gelu
        return 0.5 * h * (1.0 + torch.tanh(0.7978845608028654 * h * (1.0 + 0.044715 * h * h)))
    return F.gelu(h)


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on `x`; in backward also sends `scale` as the gradient of `aux` (megatron-core's
    MoEAuxLossAutoScaler): the load-balancing loss joins the backward pass without changing the output."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.save_for_backward(aux)
        return x

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        (aux,) = ctx.saved_tensors
        return g, torch.full_like(aux, ctx.scale), None


def load_balancing_loss(scores: torch.Tensor, top: torch.Tensor, num_experts: int, topk: int,
                        coeff: float) -> torch.Tensor:
    """megatron-core's switch load-balancing loss of one micro-batch's N tokens:
    coeff · E / (k · N²) · Σ_e (Σ_tokens scores_e) · (tokens counted for e) (`Router.aux_loss_inputs`)."""
    counts = torch.zeros(num_experts, device=scores.device).index_add_(
        0, top.reshape(-1), torch.ones(top.numel(), device=scores.device))
    n = scores.shape[0]
    return (scores.sum(dim=0) * counts).sum() * (num_experts * coeff / (topk * n * n))


class MoE(nn.Module):
    """Router [E, H] (top-k on logits, softmax over the k: megatron-core's default), then this EP rank's
    E/EP experts (SwiGLU, TP-split like the dense MLP) over the tokens of its whole EP group.

    Collectives, once per layer around all experts: copy-to-TP (all-reduce bwd) or, under sequence
    parallelism, all-gather of the sequence; all-gather of tokens, probabilities and choices over EP
    (reduce-scatter bwd); reduce-scatter of the weighted expert outputs over EP (all-gather bwd); all-reduce
    (or reduce-scatter of the sequence) of the TP partial sums. Dropless: every token reaches its k experts."""

    def __init__(self, spec: ModelSpec, decls: dict[str, ParamDecl], make: _Maker, st: ParallelState) -> None:
        super().__init__()
        self.spec, self.st = spec, st
        self.num_experts, self.topk = spec.num_experts, spec.moe_router_topk
        self.router = Router(spec, make(decls["router.weight"]), decls.get("router.expert_bias"), st)
        has_shared = "shared_experts.linear_fc1.weight" in decls
        self.shared_experts = SharedExperts(decls, make, st) if has_shared else None
        per_rank = self.num_experts // st.ep
        self.first = st.ep_rank * per_rank
        experts = []
        for i in range(per_rank):
            pre = f"experts.local_experts.{self.first + i}."  # canonical names carry the global expert index
            experts.append(Expert(spec, {k[len(pre):]: d for k, d in decls.items() if k.startswith(pre)}, make, st))
        self.experts = _LocalExperts(experts)
        self.aux_loss_coeff = 0.0  # set by the trainer; 0 = no load-balancing loss (inference)
        self.aux_loss_scale = 1.0  # gradient of the aux loss per micro-batch: 1/M, and 1/TP (TP sums it)
        self.aux_loss_logged: torch.Tensor | None = None  # Σ over micro-batches of aux / coeff, for the log

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        st = self.st
        x = gather_from_sp(x, st) if st.sequence_parallel else copy_to_tp(x, st)
        shape = x.shape
        h = x.reshape(-1, shape[-1])
        logits, probs, top = self.router(h)
        if self.aux_loss_coeff > 0 and self.training and torch.is_grad_enabled():
            aux = load_balancing_loss(*self.router.aux_loss_inputs(logits, top), self.num_experts, self.topk,
                                      self.aux_loss_coeff)
            probs = _AttachAuxLoss.apply(probs, aux, self.aux_loss_scale / st.tp)
            logged = aux.detach() / self.aux_loss_coeff  # megatron-core logs the loss without its coefficient
            self.aux_loss_logged = logged if self.aux_loss_logged is None else self.aux_loss_logged + logged
        tokens = gather_tokens(h, st.ep_group)
        probs = gather_tokens(probs, st.ep_group)
        top = gather_tokens(top, st.ep_group)
        out = torch.zeros_like(tokens)
        for i, expert in enumerate(self.experts.local_experts):
            rows, slot = (top == self.first + i).nonzero(as_tuple=True)
            if rows.numel():
                out = out.index_add(0, rows, expert(tokens[rows]) * probs[rows, slot].unsqueeze(-1))
        y = scatter_tokens(out, st.ep_group).view(shape)
        if self.shared_experts is not None:  # its TP partial sums join the routed experts' in one reduction
            y = y + self.shared_experts(x)
        return reduce_scatter_to_sp(y, st) if st.sequence_parallel else reduce_from_tp(y, st)


class _LocalExperts(nn.Module):
    """`experts.local_experts.{i}`: megatron-core SequentialMLP's names, i local to this EP rank."""

    def __init__(self, experts: list[nn.Module]) -> None:
        super().__init__()
        self.local_experts = nn.ModuleList(experts)


class Expert(nn.Module):
    """One expert's TP shard: fc1 (each rank [gate_r; up_r]) → SwiGLU → fc2 (rows of its inputs); no
    collective (the MoE layer reduces the partial sums of all experts at once)."""

    def __init__(self, spec: ModelSpec, decls: dict[str, ParamDecl], make: _Maker, st: ParallelState) -> None:
        super().__init__()
        self.activation = spec.activation
        self.linear_fc1 = LocalLinear(make(decls["linear_fc1.weight"]), None, st)
        self.linear_fc2 = LocalLinear(make(decls["linear_fc2.weight"]), None, st)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(activate(self.linear_fc1(x), self.activation))


class TransformerLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer: int, make: _Maker, st: ParallelState,
                 decls: dict[str, ParamDecl] | None = None, prefix: str = "") -> None:
        """Decoder layer `layer`, or (given `decls`) the layer whose declarations are those under `prefix`."""
        super().__init__()
        if decls is None:
            decls, prefix = {d.name: d for d in spec.layer_params(layer)}, f"decoder.layers.{layer}."
        decls = {k[len(prefix):]: d for k, d in decls.items() if k.startswith(prefix)}
        self.input_layernorm = Norm(spec, make(decls["input_layernorm.weight"]), make(decls.get("input_layernorm.bias")))
        attn = {k.split(".", 1)[1]: d for k, d in decls.items() if k.startswith("self_attention.")}
        if spec.is_mla:  # spec validation refuses a window with MLA
            self.self_attention = MLAttention(spec, attn, make, st)
        else:
            self.self_attention = SelfAttention(spec, attn, make, st, window=spec.layer_window(layer))
        self.pre_mlp_layernorm = Norm(spec, make(decls["pre_mlp_layernorm.weight"]),
                                      make(decls.get("pre_mlp_layernorm.bias")))
        mlp = {k.split(".", 1)[1]: d for k, d in decls.items() if k.startswith("mlp.")}
        self.mlp = MoE(spec, mlp, make, st) if "router.weight" in mlp else MLP(spec, mlp, make, st)
        # sandwich norms (Gemma): each branch's output normed before the residual add; registered on the linear
        # they follow, so the state dict names them as Megatron-Bridge's post-norm linears do
        self.post_norms = spec.sandwich_norms
        if self.post_norms:
            self.self_attention.linear_proj.post_layernorm = Norm(
                spec, make(decls["self_attention.linear_proj.post_layernorm.weight"]), None)
            self.mlp.linear_fc2.post_layernorm = Norm(spec, make(decls["mlp.linear_fc2.post_layernorm.weight"]), None)
        self.local_rope = spec.rotary_base_local is not None and spec.layer_window(layer) is not None

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        a = self.self_attention(self.input_layernorm(x), rope)
        x = x + (self.self_attention.linear_proj.post_layernorm(a) if self.post_norms else a)
        m = self.mlp(self.pre_mlp_layernorm(x))
        return x + (self.mlp.linear_fc2.post_layernorm(m) if self.post_norms else m)


class PositionEmbedding(nn.Module):
    """Learned absolute positions [P, H], replicated on every TP rank."""

    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, seq: int) -> torch.Tensor:
        return self.weight[:seq]


class Embedding(nn.Module):
    def __init__(self, spec: ModelSpec, make: _Maker, st: ParallelState) -> None:
        super().__init__()
        decls = {d.name: d for d in spec.embedding_params(st.tp)}
        self.word_embeddings = VocabParallelEmbedding(make(decls["embedding.word_embeddings.weight"]), st)
        pos = decls.get("embedding.position_embeddings.weight")
        self.position_embeddings = PositionEmbedding(make(pos)) if pos is not None else None
        self.scale = math.sqrt(spec.hidden_size) if spec.scale_embeddings else None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.word_embeddings(ids)  # [B, S/TP, H] under sequence parallelism
        if self.scale:  # Gemma: × sqrt(hidden), in the embedding's dtype as HF does
            h = h * torch.tensor(self.scale, dtype=h.dtype)
        if self.position_embeddings is not None:
            pos = self.position_embeddings(ids.shape[1])
            st = self.word_embeddings.st
            if st.sequence_parallel:
                pos = pos.chunk(st.tp, dim=0)[st.tp_rank]
            h = h + pos[None]
        return h


class Decoder(nn.Module):
    def __init__(self, spec: ModelSpec, layers: list[int], make: _Maker, st: ParallelState, post: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList(TransformerLayer(spec, i, make, st) for i in layers)
        if post:
            decls = {d.name: d for d in spec.final_params(st.tp)}
            self.final_layernorm = Norm(spec, make(decls["decoder.final_layernorm.weight"]),
                                        make(decls.get("decoder.final_layernorm.bias")))
        else:
            self.final_layernorm = None


class GPTModel(nn.Module):
    """This rank's pipeline stage: embedding (first stage), its layers, final norm + output layer (last stage).

    `forward(ids_or_hidden, labels)` returns hidden states [B, S, H] (not last stage), per-token loss
    [B, S] (last stage with labels) or this rank's vocab shard of the logits [B, S, V_pad/TP]."""

    def __init__(self, spec: ModelSpec, st: ParallelState, seed: int | None = 1234,
                 dtype: torch.dtype = torch.float32, split: PipelineSplit | None = None) -> None:
        super().__init__()
        check_trainable(spec, st.tp, st.pp, st.ep, split)
        if st.sequence_parallel and (spec.is_mla or spec.mtp_num_layers):
            raise MConvertError("sequence parallelism with multi-latent attention or multi-token prediction is not "
                                "supported here; drop --sequence-parallel")
        self.spec, self.st = spec, st
        make = _Maker(spec, st, seed, dtype)
        self.pre_process, self.post_process = st.is_first_stage, st.is_last_stage
        split = split or PipelineSplit.make(spec.num_layers, st.pp)  # `split`: an uneven one (its own checks)
        self.global_layers = list(split.stage_layers(st.pp_rank)[0])
        if self.pre_process:
            self.embedding = Embedding(spec, make, st)
        self.decoder = Decoder(spec, self.global_layers, make, st, self.post_process)
        if self.post_process:
            head: ParamDecl | None = next((d for d in spec.final_params(st.tp) if d.name == "output_layer.weight"), None)
            if head is None and not self.pre_process:  # tied, PP > 1: the last stage keeps a copy
                head = spec.embedding_params(st.tp)[0]  # same declaration and init as the embedding
            self.output_layer = ColumnParallelLinear(make(head), None, st)
        self.rope = spec.position_embedding_type == "rope"
        self.mtp = self._build_mtp(make) if spec.mtp_num_layers and self.post_process else None
        self.hidden_states: list[torch.Tensor] | None = None  # filled when record_hidden is on
        self.record_hidden = False

    def _build_mtp(self, make: _Maker) -> MTPBlock:
        """The MTP depths (megatron-core builds them on the last stage; with PP = 1 the embedding is there)."""
        layers = []
        for k in range(self.spec.mtp_num_layers or 0):
            p = f"mtp.layers.{k}."
            decls = {d.name[len(p):]: d for d in self.spec.mtp_params(k)}
            inner = TransformerLayer(self.spec, self.spec.num_layers + k, make, self.st, decls, "transformer_layer.")
            layers.append(MTPLayer(self.spec, decls, make, self.st, inner))
        return MTPBlock(layers)

    def all_layers(self) -> list["TransformerLayer"]:
        """This stage's decoder layers, then its MTP depths' transformer layers."""
        mtp = [m.transformer_layer for m in self.mtp.layers] if self.mtp is not None else []
        return [*self.decoder.layers, *mtp]

    def routers(self) -> list[Router]:
        return [moe.router for moe in self.moe_layers()]

    def sequence_parallel_params(self) -> list[nn.Parameter]:
        """Replicated parameters that see only this rank's sequence chunk under sequence parallelism (norms,
        row-parallel biases, position embeddings): their gradients are summed over TP, as Megatron does."""
        if not self.st.sequence_parallel:
            return []
        return [p for p in self.parameters() if getattr(p, "split_kind", None) == "replicated"]

    def tp_summed_params(self) -> list[nn.Parameter]:
        """Replicated parameters whose gradient on each TP rank is a partial sum that Megatron adds up over TP:
        the sequence-parallel ones, and the q/k norms (each rank normalises only its own heads)."""
        out = self.sequence_parallel_params()
        seen = {id(p) for p in out}
        for layer in self.all_layers():
            attn = layer.self_attention
            for norm in (attn.q_layernorm, attn.k_layernorm) if isinstance(attn, SelfAttention) else ():
                if norm is not None:
                    out += [p for p in norm.parameters() if id(p) not in seen]
            if isinstance(layer.mlp, MoE) and self.st.tp > 1 and id(layer.mlp.router.weight) not in seen:
                out.append(layer.mlp.router.weight)  # it multiplies the TP partial sums of the experts
        return out

    def moe_layers(self) -> list[MoE]:
        return [layer.mlp for layer in self.all_layers() if isinstance(layer.mlp, MoE)]

    def expert_params(self) -> list[nn.Parameter]:
        """This EP rank's expert weights: their gradients are summed over expert-data-parallel replicas only."""
        return [p for p in self.parameters() if getattr(p, "expert", False)]

    def pop_aux_loss(self) -> torch.Tensor:
        """This rank's load-balancing losses (each ÷ its coefficient) since the last call, summed over its MoE
        layers and micro-batches; the sums restart."""
        total = torch.zeros((), device=self.st.device)
        for moe in self.moe_layers():
            if moe.aux_loss_logged is not None:
                total = total + moe.aux_loss_logged
            moe.aux_loss_logged = None
        return total

    def set_aux_loss(self, coeff: float, scale: float) -> None:
        """Load-balancing loss coefficient, and its gradient per micro-batch (1/M, as the LM loss's)."""
        for moe in self.moe_layers():
            moe.aux_loss_coeff, moe.aux_loss_scale = coeff, scale
        if self.mtp is not None:
            self.mtp.loss_scale = scale

    def shared_embedding_weight(self) -> nn.Parameter | None:
        """The parameter the embedding group all-reduces (word embeddings on stage 0, its copy on the last)."""
        if not self.spec.tie_embeddings or self.st.pp == 1:
            return None
        if self.pre_process:
            return self.embedding.word_embeddings.weight
        if self.post_process:
            return self.output_layer.weight
        return None

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        ids = x
        if self.pre_process:
            x = self.embedding(x)
        seq = x.shape[1] * (self.st.tp if self.st.sequence_parallel else 1)
        rope = (mla_rope_tables if self.spec.is_mla else rope_tables)(self.spec, seq, x.device) if self.rope else None
        local = (rope_tables(self.spec, seq, x.device, local=True)
                 if self.rope and self.spec.rotary_base_local is not None else None)
        if self.record_hidden:
            self.hidden_states = [x.detach()] if self.pre_process else []
        for layer in self.decoder.layers:
            x = layer(x, local if layer.local_rope else rope)
            if self.record_hidden:
                self.hidden_states.append(x.detach())
        if not self.post_process:
            return x
        x = self.decoder.final_layernorm(x)
        head = self.output_layer.weight if self.output_layer.weight is not None else self.embedding.word_embeddings.weight
        logits = self.output_layer(x, head)
        cap = self.spec.final_logit_softcapping
        if cap is not None:  # Gemma 2: cap · tanh(logits / cap), elementwise on this rank's vocab shard
            logits = torch.tanh(logits / cap) * cap
        if self.mtp is not None:  # each depth's logits from the same head
            self.mtp_logits = [self.output_layer(h, head) for h in self.mtp(ids, x, self.embedding, rope)]
        if labels is None:
            return logits
        loss = vocab_parallel_cross_entropy(logits, labels, self.st)
        if self.mtp is not None and self.training and torch.is_grad_enabled():
            per_depth = [vocab_parallel_cross_entropy(lg, labels_k, self.st) for k, lg in enumerate(self.mtp_logits)
                         for labels_k in [torch.roll(labels, -(k + 1), dims=-1)]]
            loss = attach_loss(loss, mtp_loss(per_depth), self.mtp.loss_scale)
        return loss

    def full_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """All-gather the vocab shards (inference / tests only) and strip the padded rows."""
        return gather_from_tp(logits.float(), self.st)[..., : self.spec.vocab_size]


def check_trainable(spec: ModelSpec, tp: int, pp: int, ep: int = 1, split: PipelineSplit | None = None) -> None:
    """What our layers (and megatron-core) need: TP divides heads, query groups and ffn; PP divides layers (or
    an uneven `split` holds them, one chunk per rank); EP divides the experts; MoE experts are bias-free SwiGLU
    with top-k ≥ 2 (softmax over one choice is 1)."""
    spec.check_parallel(tp, pp, ep=ep, layers=split is None)
    if split is not None and (split.pp, split.vpp, split.num_layers) != (pp, None, spec.num_layers):
        raise MConvertError(f"the pipeline split ({split.describe()}) is not one chunk per rank of {spec.num_layers} "
                            f"layers at PP={pp}; the trainer runs no virtual pipeline")
    if spec.is_moe:
        if spec.activation != "swiglu" or spec.add_bias_linear:
            raise MConvertError(
                f"MoE experts here are bias-free SwiGLU; this model has activation={spec.activation!r}, "
                f"add_bias_linear={spec.add_bias_linear}; use a Mixtral / Qwen3-MoE style preset"
            )
        if spec.moe_router_topk < 2 and spec.moe_router_score_function == "softmax":
            raise MConvertError(
                f"--moe-topk {spec.moe_router_topk}: pick 2..{spec.num_experts} (softmax over the top-k is 1 for k = 1, "
                "megatron-core asks for --moe-router-pre-softmax then, which is not this router)"
            )
    if spec.mtp_num_layers and pp > 1:
        raise MConvertError(f"multi-token prediction (mtp_num_layers={spec.mtp_num_layers}) trains here with PP=1 "
                            "(its layers need the embedding on the last stage); use --pp 1")
    if spec.num_groups % tp:
        raise MConvertError(
            f"TP={tp} does not divide num_query_groups={spec.num_groups}; megatron-core needs it to (pick a smaller TP)"
        )
