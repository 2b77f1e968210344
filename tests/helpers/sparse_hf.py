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


# The fields DeepSeek-V2-Lite's config.json and Moonlight-16B-A3B's (DeepSeek-V2-Lite's shape under DeepSeek-V3's
# class) publish alike: 27 layers of hidden 2048, MLA with a kv latent of 512 and no q latent, 64 routed experts of
# width 1408 with 2 shared, top-6 of one group, the first layer dense
_DEEPSEEK_LITE_SHAPE = {
    "attention_bias": False, "attention_dropout": 0.0, "aux_loss_alpha": 0.001, "ep_size": 1,
    "first_k_dense_replace": 1, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
    "kv_lora_rank": 512, "moe_intermediate_size": 1408, "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 64,
    "n_shared_experts": 2, "num_attention_heads": 16, "num_experts_per_tok": 6, "num_hidden_layers": 27,
    "num_key_value_heads": 16, "pretraining_tp": 1, "q_lora_rank": None, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "seq_aux": True, "tie_word_embeddings": False, "topk_group": 1, "torch_dtype": "bfloat16",
    "use_cache": True, "v_head_dim": 128}


def deepseek_lite_config(version: int, **fields: Any) -> dict[str, Any]:
    """A published config.json of DeepSeek's remote-code class DeepseekV{version}ForCausalLM (its `architectures`,
    `auto_map`, `model_type`) with DeepSeek-V2-Lite's shape (`_DEEPSEEK_LITE_SHAPE`), then the model's own `fields`."""
    v = f"DeepseekV{version}"
    return {"architectures": [f"{v}ForCausalLM"], "model_type": f"deepseek_v{version}",
            "auto_map": {"AutoConfig": f"configuration_deepseek.{v}Config", "AutoModel": f"modeling_deepseek.{v}Model",
                         "AutoModelForCausalLM": f"modeling_deepseek.{v}ForCausalLM"},
            **_DEEPSEEK_LITE_SHAPE, **fields}
