"""transformers as an independent reference for HF names and shapes: its own model class, built on the meta
device from a config dict (no memory, no weights)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def hf_model_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Parameter shapes of transformers' own class for `cfg`, built on the meta device (no memory)."""
    import transformers

    config = transformers.AutoConfig.for_model(**cfg)
    cls = getattr(transformers, cfg["architectures"][0])
    with torch.device("meta"):
        model = cls(config)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()
              if not k.endswith((".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq"))}
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    return shapes


def hf_logits(hf_dir: Path, tokens: torch.Tensor, attn_implementation: str | None = None) -> torch.Tensor:
    """transformers' own logits for `tokens` from a saved model directory, in float32 (the truth the exports
    are held to). `attn_implementation="eager"` where a test compares against a reference that uses it."""
    import transformers

    kw = {"attn_implementation": attn_implementation} if attn_implementation else {}
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32, **kw).eval()
    with torch.no_grad():
        return model(tokens).logits.float()


def randomize(model: torch.nn.Module, seed: int = 3) -> None:
    """Random values everywhere (norm weights around 1, q/k norms included), so a swapped or dropped tensor
    cannot hide behind an initial value."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.2 * noise if n.endswith("norm.weight") else 0.1 * noise)


def move_off_init(model: torch.nn.Module, seed: int = 4) -> None:
    """Every weight moved off its init (norms around 1, the rest by small noise) and a non-negative expert
    correction bias large enough to change the routing (DeepSeek-style routers). Needs only torch, so a script
    run by another venv's python (the vLLM venv's transformers) imports it too."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.2 * noise if name.endswith("norm.weight") else p + 0.05 * noise)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.rand(b.shape, generator=g))


def randomized_models(configs: dict[str, Callable[[], Any]], tokens: torch.Tensor, tmp_path_factory: Any,
                      to_megatron: Callable[..., Any]) -> dict[str, tuple[torch.Tensor, Path, Path]]:
    """name -> (transformers' logits on `tokens`, its save_pretrained dir, `to_megatron(hf, mg, tp=2, pp=1)`'s
    checkpoint) for each config: the transformers side of a megatron-core comparison."""
    import transformers

    out = {}
    for name, cfg in configs.items():
        tmp = tmp_path_factory.mktemp(f"hf_{name}")
        model = transformers.AutoModelForCausalLM.from_config(cfg(), attn_implementation="eager").eval()
        randomize(model)
        model.save_pretrained(tmp / "hf")
        with torch.no_grad():
            logits = model(tokens).logits
        to_megatron(tmp / "hf", tmp / "mg", tp=2, pp=1)
        out[name] = (logits, tmp / "hf", tmp / "mg")
    return out


def assert_logits_close(got: torch.Tensor, want: torch.Tensor, what: str, rel_tol: float = 1e-4) -> float:
    """max |got - want| within `rel_tol` of max |want| and the same top-1 token everywhere; prints the figures
    (`[figures]` lines) and returns the max difference."""
    diff, scale = (got - want).abs().max().item(), want.abs().max().item()
    print(f"[figures] {what}: max|Δ| {diff:.2e}, max|logit| {scale:.3f}")
    assert diff <= rel_tol * scale, f"{what}: max abs diff {diff} > {rel_tol} * {scale}"
    assert torch.equal(got.argmax(-1), want.argmax(-1)), f"{what}: top-1 differs"
    return diff
