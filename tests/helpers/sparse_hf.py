"""HF directories of a published config without its weights: config.json and a model.safetensors whose header lists
the tensors transformers builds for the config and whose data region is a hole (nothing written, nothing read by a
dry run)."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import torch

# safetensors' dtype names
_ST_DTYPE = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


def write_sparse_hf(cfg: dict[str, Any], d: Path, tensors_as: dict[str, Any] | None = None) -> int:
    """config.json plus a model.safetensors whose header lists the tensors transformers builds for it (the class
    `architectures` names, which wrote the weights, else the causal LM of its model_type; `tensors_as`: config
    fields changed for building them only) and whose data region is a hole of the right length; returns the bytes
    the tensors claim."""
    import transformers
    from transformers.modeling_utils import no_init_weights

    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({**cfg, **(tensors_as or {})}))
    config = transformers.AutoConfig.from_pretrained(d, trust_remote_code=False)
    (d / "config.json").write_text(json.dumps(cfg))
    dtype = getattr(config, "dtype", None) or torch.float32
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    named = getattr(transformers, (cfg.get("architectures") or [""])[0], None)
    with torch.device("meta"), no_init_weights():  # shapes only: no storage, no initialiser run
        if named is not None and isinstance(config, named.config_class):
            model = named._from_config(config, dtype=dtype)
        else:
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    state = dict(model.state_dict())
    state.update(mtp_tensors(config, state))
    if getattr(config, "tie_word_embeddings", False):  # save_pretrained writes the tied copy once
        for k in getattr(model, "_tied_weights_keys", None) or ():
            state.pop(k, None)
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for k, t in state.items():
        n = t.numel() * t.element_size()
        header[k] = {"dtype": _ST_DTYPE[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    _write_header(d / "model.safetensors", header, offset)
    return offset


def mtp_tensors(config: Any, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The multi-token prediction layers `num_nextn_predict_layers` declares, which transformers does not build but
    the published checkpoints hold (DeepSeek-V3's README_WEIGHTS.md, GLM-4.5's safetensors index): layer
    `num_hidden_layers + k` is a decoder layer like the last one plus `enorm`, `hnorm`, `eh_proj` [H, 2H],
    `shared_head.norm`, and copies of the embedding and the head (`embed_tokens`, `shared_head.head`)."""
    n = getattr(config, "num_nextn_predict_layers", 0) or 0
    out: dict[str, torch.Tensor] = {}
    if not n:
        return out
    L = config.num_hidden_layers
    emb = state["model.embed_tokens.weight"]
    norm = state["model.norm.weight"]
    H = emb.shape[1]
    last = f"model.layers.{L - 1}."
    for k in range(n):
        p = f"model.layers.{L + k}."
        out.update({p + key[len(last):]: t for key, t in state.items() if key.startswith(last)})
        out.update({p + "enorm.weight": norm, p + "hnorm.weight": norm, p + "shared_head.norm.weight": norm,
                    p + "eh_proj.weight": torch.empty((H, 2 * H), dtype=emb.dtype, device="meta"),
                    p + "embed_tokens.weight": emb, p + "shared_head.head.weight": state.get("lm_head.weight", emb)})
    return out


def write_config_only(cfg: dict[str, Any], d: Path) -> None:
    """config.json and a model.safetensors that holds no tensor: a model of a family mconvert does not convert
    (transformers may not build it at all), where only mconvert's refusal of the config is under test."""
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(cfg))
    _write_header(d / "model.safetensors", {"__metadata__": {"format": "pt"}}, 0)


def _write_header(path: Path, header: dict[str, Any], data_bytes: int) -> None:
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + data_bytes)  # a hole: nothing is written, nothing is read in a dry run
