"""transformers as an independent reference for HF names and shapes: its own model class, built on the meta
device from a config dict (no memory, no weights)."""

from __future__ import annotations

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
