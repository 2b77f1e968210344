"""TensorRT-LLM reference runner: logits of a `to-trtllm` checkpoint's rank files computed with torch, combined
as TensorRT-LLM's ColumnLinear / RowLinear do (the engine itself needs a GPU build)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from mconvert.convert.trtllm import check_trtllm_dir, read_trtllm_config, trtllm_layout_of
from mconvert.errors import MConvertError
from mconvert.validators.ft_runner import causal_attention, gelu_tanh, layer_norm, rms_norm, rope_neox, split_heads


@torch.no_grad()
def trtllm_logits(path: str | Path, tokens: torch.Tensor, device: str = "cpu") -> torch.Tensor:
    """Logits [B, S, V] from the rank files, combined as TensorRT-LLM's ColumnLinear / RowLinear do."""
    d = Path(path)
    problems = check_trtllm_dir(d)
    if problems:
        raise MConvertError(f"not a valid TensorRT-LLM checkpoint: {problems[0]}")
    cfg = read_trtllm_config(d / "config.json")
    t = int(cfg["mapping"]["tp_size"])
    ranks = [{k: v.float().to(device) for k, v in load_file(str(d / f"rank{r}.safetensors")).items()}
             for r in range(t)]
    layout = trtllm_layout_of(cfg["architecture"])
    H, L, V, eps = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"], cfg["norm_epsilon"]
    nh = cfg["num_attention_heads"]
    nkv = cfg.get("num_key_value_heads") or nh
    hd = cfg.get("head_size") or H // nh
    nq_l, nkv_l = nh // t, max(nkv, t) // t
    tokens = tokens.to(device)
    S = tokens.shape[1]
    r0 = ranks[0]
    x = r0["transformer.vocab_embedding.weight"][tokens]
    if layout.position_embedding_type == "learned_absolute":
        x = x + r0["transformer.position_embedding.weight"][:S]

    def norm(x: torch.Tensor, name: str) -> torch.Tensor:
        if layout.norm == "LayerNorm":
            return layer_norm(x, r0[name + ".weight"], r0[name + ".bias"], eps)
        return rms_norm(x, r0[name + ".weight"], eps)

    for i in range(L):
        p = f"transformer.layers.{i}."
        h = norm(x, p + "input_layernorm")
        attn = torch.zeros_like(x)
        for w in ranks:
            qkv = h @ w[p + "attention.qkv.weight"].t()
            if p + "attention.qkv.bias" in w:
                qkv = qkv + w[p + "attention.qkv.bias"]
            q, k, v = qkv.split([nq_l * hd, nkv_l * hd, nkv_l * hd], -1)
            q, k, v = split_heads(q, nq_l), split_heads(k, nkv_l), split_heads(v, nkv_l)
            if layout.position_embedding_type.startswith("rope"):
                rot = int(cfg.get("rotary_embedding_dim") or hd)
                q, k = rope_neox(q, rot, float(cfg["rotary_base"])), rope_neox(k, rot, float(cfg["rotary_base"]))
            k, v = k.repeat_interleave(nq_l // nkv_l, 1), v.repeat_interleave(nq_l // nkv_l, 1)
            attn += causal_attention(q, k, v) @ w[p + "attention.dense.weight"].t()
        x = x + attn + r0.get(p + "attention.dense.bias", 0)
        h = norm(x, p + "post_layernorm")
        mlp = torch.zeros_like(x)
        for w in ranks:
            fc = h @ w[p + "mlp.fc.weight"].t() + w.get(p + "mlp.fc.bias", 0)
            if layout.gated:
                inter = torch.nn.functional.silu(fc) * (h @ w[p + "mlp.gate.weight"].t() + w.get(p + "mlp.gate.bias", 0))
            else:
                inter = gelu_tanh(fc)
            mlp += inter @ w[p + "mlp.proj.weight"].t()
        x = x + mlp + r0.get(p + "mlp.proj.bias", 0)
    x = norm(x, "transformer.ln_f")
    if "lm_head.weight" in r0:
        logits = torch.cat([x @ w["lm_head.weight"].t() for w in ranks], -1)
    else:
        logits = x @ r0["transformer.vocab_embedding.weight"].t()
    return logits[..., :V].float()
