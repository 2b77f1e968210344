"""Shared by the deployment tests: a random transformers model of a ModelSpec, and the relative logits error."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from mconvert.mappings.families import hf_config


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def make_hf(spec, path: Path, seed: int = 0) -> Path:
    """A random transformers model of `spec` (norm weights/biases perturbed so their layout matters)."""
    cfg = hf_config(spec)
    config = AutoConfig.for_model(cfg.pop("model_type"), **{k: v for k, v in cfg.items() if k != "torch_dtype"})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "ln" in n or "norm" in n:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path)
    return path
