"""Logit comparison metrics and the dtype-dependent tolerances a comparison must meet.

All metrics are computed in float64 from the float32 logits each runner returns:
max/mean absolute difference, KL(ref || other) per position averaged, top-1 agreement, and each
model's perplexity on the batch (next-token NLL).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

_RANK = {"float32": 0, "float16": 1, "q8_0": 2, "bfloat16": 3}  # ascending looseness of the rows


@dataclass(frozen=True)
class Tolerance:
    """Limits for one comparison. max_abs limit = atol + rtol · max|ref logit|."""

    dtype: str
    atol: float
    rtol: float
    mean_abs: float
    kl: float
    top1: float

    def max_abs_limit(self, ref_scale: float) -> float:
        return self.atol + self.rtol * ref_scale


# Keyed by the less precise dtype of the pair (fp32 vs bf16 uses the bf16 row).
# fp32: different summation orders (TP all-reduce, pipeline, ONNX kernels) move logits by ~1e-6;
# the limits sit ~100x above that and below what a 1e-3 weight perturbation moves them.
TOLERANCES: dict[str, Tolerance] = {
    "float32": Tolerance("float32", atol=1e-4, rtol=1e-5, mean_abs=1e-5, kl=1e-6, top1=0.99),
    "float16": Tolerance("float16", atol=2e-2, rtol=1e-2, mean_abs=5e-3, kl=1e-3, top1=0.97),
    "bfloat16": Tolerance("bfloat16", atol=1e-1, rtol=3e-2, mean_abs=3e-2, kl=1e-2, top1=0.90),
    # GGUF q8_0 (llama.cpp): 8-bit weights in blocks of 32 with one f16 scale, and llama.cpp quantizes the
    # activations of those matmuls to q8_0 too, so its row lies between bf16's and f16's (the figures it rests
    # on are in docs/deployment/gguf.md).
    "q8_0": Tolerance("q8_0", atol=5e-2, rtol=2e-2, mean_abs=1e-2, kl=1e-3, top1=0.95),
}


def tolerance_for(dtype_a: str, dtype_b: str) -> Tolerance:
    """The row for the less precise of two dtypes."""
    a = dtype_a if dtype_a in _RANK else "float32"
    b = dtype_b if dtype_b in _RANK else "float32"
    return TOLERANCES[a if _RANK[a] >= _RANK[b] else b]


@dataclass
class Metrics:
    max_abs: float
    mean_abs: float
    kl: float
    top1: float
    ref_scale: float  # max |ref logit|
    per_position_max_abs: list[float]  # max over batch and vocab, one value per position

    def to_dict(self) -> dict:
        return asdict(self)


def perplexity(logits: torch.Tensor, tokens: torch.Tensor) -> float:
    """exp(mean next-token NLL) of `tokens` under `logits` [B, S, V]."""
    lp = torch.log_softmax(logits[:, :-1].double(), dim=-1)
    nll = -lp.gather(-1, tokens[:, 1:, None]).squeeze(-1)
    return float(math.exp(nll.mean()))


def compare_logits(ref: torch.Tensor, other: torch.Tensor) -> Metrics:
    """Metrics of `other` against `ref` (same shape, float)."""
    r, o = ref.double(), other.double()
    diff = (r - o).abs()
    lr, lo = torch.log_softmax(r, -1), torch.log_softmax(o, -1)
    kl = (lr.exp() * (lr - lo)).sum(-1).clamp_min(0).mean()
    top1 = (r.argmax(-1) == o.argmax(-1)).double().mean()
    return Metrics(
        max_abs=float(diff.max()),
        mean_abs=float(diff.mean()),
        kl=float(kl),
        top1=float(top1),
        ref_scale=float(r.abs().max()),
        per_position_max_abs=[float(x) for x in diff.amax(dim=(0, 2))],
    )


def judge(m: Metrics, tol: Tolerance) -> list[str]:
    """The limits `m` breaks (empty: pass), each as a short phrase."""
    out = []
    lim = tol.max_abs_limit(m.ref_scale)
    if not m.max_abs <= lim:  # NaN fails too
        out.append(f"max abs {m.max_abs:.3g} > {lim:.3g}")
    if not m.mean_abs <= tol.mean_abs:
        out.append(f"mean abs {m.mean_abs:.3g} > {tol.mean_abs:.3g}")
    if not m.kl <= tol.kl:
        out.append(f"KL {m.kl:.3g} > {tol.kl:.3g}")
    if not m.top1 >= tol.top1:
        out.append(f"top-1 {m.top1:.3f} < {tol.top1:.2f}")
    return out


def layer_errors(ref: list[torch.Tensor] | None, other: list[torch.Tensor] | None) -> list[float] | None:
    """Max abs difference of hidden states per layer, when both sides expose comparable ones."""
    if not ref or not other or len(ref) != len(other):
        return None
    if any(a.shape != b.shape for a, b in zip(ref, other)):
        return None
    return [float((a.double() - b.double()).abs().max()) for a, b in zip(ref, other)]
