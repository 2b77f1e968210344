"""FasterTransformer reference runner: logits from an FT directory with plain torch, no CUDA engine.

It reads the per-rank `.R.bin` files exactly as FT's loader does (shapes from config.ini) and combines them
the way FT's tensor-parallel kernels do: column-parallel GEMMs (QKV, h→4h / gate / up) run per rank on
the rank's head/feature slice, row-parallel GEMMs (attention dense, 4h→h / down) produce per-rank partial
sums that are all-reduced (summed), and the head is computed per rank on FT's padded vocab slice and
all-gathered. Config semantics are FT's, per section as its family layout declares them (`FTKernels`):
`[gpt]` = pre-LayerNorm, tanh GeLU (`GeluActivation`), learned positions, head = `model.lm_head.weight.bin` if
present else `model.wte.bin`; `[llama]` = RMSNorm, SiLU-gated MLP, GPT-NeoX rotary over `rotary_embedding`
dims with base 10000; eps from `layernorm_eps`.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from mconvert.convert.deploy.fastertransformer import (
    check_ft_dir,
    ft_expected_files,
    load_ft_tensor,
    read_ft_config,
    resolve_ft_dir,
    section_layout,
)
from mconvert.errors import MConvertError
from mconvert.mappings.record import FT_BASE_ROTARY


# ---- primitives shared with the TensorRT-LLM runner ----------------------------------------------------
def layer_norm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, eps: float) -> torch.Tensor:
    mu = x.mean(-1, keepdim=True)
    var = (x - mu).pow(2).mean(-1, keepdim=True)
    y = (x - mu) * torch.rsqrt(var + eps) * w
    return y + b if b is not None else y


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """FT's GeluActivation: 0.5·x·(1 + tanh(0.79788456·(x + 0.044715·x³)))."""
    return 0.5 * x * (1.0 + torch.tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)))


def rope_inv_freq(rotary_dim: int, base: float, device: str | torch.device = "cpu") -> torch.Tensor:
    """The unscaled rotary inverse frequencies base^(-2i/rotary_dim), one per rotary pair."""
    return 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim))


def rope_neox(x: torch.Tensor, rotary_dim: int, base: float = 10000.0, inv_freq: torch.Tensor | None = None) -> torch.Tensor:
    """GPT-NeoX / HF rotate_half rotary on the first `rotary_dim` dims of each head. x: [B, nh, S, hd].
    `inv_freq`: the (scaled) inverse frequencies to rotate by; None: the unscaled ones of `base`."""
    S = x.shape[-2]
    inv = rope_inv_freq(rotary_dim, base, x.device) if inv_freq is None else inv_freq.to(x.device)
    ang = torch.outer(torch.arange(S, dtype=torch.float32, device=x.device), inv)
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
    r, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rot = torch.cat([-r[..., half:], r[..., :half]], -1)
    return torch.cat([r * cos + rot * sin, rest], -1)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Softmax(q·kᵀ/√d + causal mask)·v with fp32 softmax; q,k,v [B, nh, S, hd] -> [B, S, nh·hd]."""
    S, hd = q.shape[-2], q.shape[-1]
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
    mask = torch.ones(S, S, dtype=torch.bool, device=q.device).triu(1)
    probs = scores.masked_fill(mask, float("-inf")).softmax(-1)
    ctx = probs @ v
    return ctx.transpose(1, 2).reshape(q.shape[0], S, -1)


def split_heads(x: torch.Tensor, nh: int) -> torch.Tensor:
    """[B, S, nh·hd] -> [B, nh, S, hd]."""
    B, S, _ = x.shape
    return x.view(B, S, nh, -1).transpose(1, 2)


def vocab_parallel_head(x: torch.Tensor, head: torch.Tensor, tp: int, vocab: int) -> torch.Tensor:
    """FT: pad the head to ceil(V/t)·t rows, one GEMM per rank on its slice, all-gather, drop padding."""
    local = -(-vocab // tp)
    padded = torch.zeros(local * tp, head.shape[1], dtype=head.dtype, device=head.device)
    padded[: head.shape[0]] = head
    return torch.cat([x @ w.t() for w in padded.chunk(tp, 0)], -1)[..., :vocab]


# ---- the runner ----------------------------------------------------------------------------------------
@torch.no_grad()
def ft_logits(ft_dir: str | Path, tokens: torch.Tensor, device: str = "cpu") -> torch.Tensor:
    """Logits [B, S, V] (float32) of an FT directory for `tokens` [B, S] (positions 0..S-1, no padding)."""
    d = resolve_ft_dir(ft_dir)
    problems = check_ft_dir(d)
    if problems:
        raise MConvertError(f"not a loadable FT directory: {problems[0]}")
    section, cfg = read_ft_config(d)
    dtype = cfg["weight_data_type"]
    files = {f.name: f for f in ft_expected_files(section, cfg)}

    def w(name: str) -> torch.Tensor:
        return load_ft_tensor(d, files[name], dtype).to(device)

    nh, hd, t = int(cfg["head_num"]), int(cfg["size_per_head"]), int(cfg["tensor_para_size"])
    H, L, V, eps = nh * hd, int(cfg["num_layer"]), int(cfg["vocab_size"]), float(cfg["layernorm_eps"])
    tokens = tokens.to(device)
    if tokens.dim() != 2:
        raise MConvertError(f"tokens must be [batch, seq], got shape {tuple(tokens.shape)}")
    if int(tokens.max()) >= V or int(tokens.min()) < 0:
        raise MConvertError(f"token ids must lie in [0, {V})")
    S = tokens.shape[1]
    k = section_layout(section).kernels
    rot = int(cfg[k.rotary_dim]) if k.rotary_dim else 0
    wte = w(k.embedding)
    x = wte[tokens]
    if k.positions is not None:
        if S > int(cfg["max_pos_seq_len"]):
            raise MConvertError(f"sequence length {S} > max_pos_seq_len {cfg['max_pos_seq_len']}")
        x = x + w(k.positions)[:S]

    def norm(x: torch.Tensor, name: str) -> torch.Tensor:
        if k.norm == "LayerNorm":
            return layer_norm(x, w(name + ".weight.bin"), w(name + ".bias.bin"), eps)
        return rms_norm(x, w(name + ".weight.bin"), eps)

    for i in range(L):
        p = f"model.layers.{i}."
        h = norm(x, p + "input_layernorm")
        attn = torch.zeros_like(x)
        for r in range(t):  # column-parallel QKV on the rank's heads, row-parallel dense: partial sums
            qkv = h @ w(p + f"attention.query_key_value.weight.{r}.bin").reshape(H, 3 * H // t)
            if k.biases:
                qkv = qkv + w(p + f"attention.query_key_value.bias.{r}.bin").reshape(-1)
            q, kk, v = (split_heads(z, nh // t) for z in qkv.chunk(3, -1))
            if k.rotary_dim:
                q, kk = rope_neox(q, rot, FT_BASE_ROTARY), rope_neox(kk, rot, FT_BASE_ROTARY)
            attn += causal_attention(q, kk, v) @ w(p + f"attention.dense.weight.{r}.bin")
        x = x + attn + (w(p + "attention.dense.bias.bin") if k.biases else 0)
        h = norm(x, p + "post_attention_layernorm")
        mlp = torch.zeros_like(x)
        for r in range(t):
            if len(k.mlp) == 2:  # GeLU: in, out
                inter = h @ w(p + f"{k.mlp[0]}.weight.{r}.bin")
                if k.biases:
                    inter = inter + w(p + f"{k.mlp[0]}.bias.{r}.bin")
                mlp += gelu_tanh(inter) @ w(p + f"{k.mlp[1]}.weight.{r}.bin")
            else:  # SiLU-gated: gate, up, down
                gate = torch.nn.functional.silu(h @ w(p + f"{k.mlp[0]}.weight.{r}.bin"))
                mlp += (gate * (h @ w(p + f"{k.mlp[1]}.weight.{r}.bin"))) @ w(p + f"{k.mlp[2]}.weight.{r}.bin")
        x = x + mlp + (w(p + f"{k.mlp[-1]}.bias.bin") if k.biases else 0)
    x = norm(x, "model.final_layernorm")
    head = w(k.head) if (not k.head_optional or (d / k.head).is_file()) else wte
    return vocab_parallel_head(x, head, t, V).float()
