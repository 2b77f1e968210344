"""Truth helpers for the DeepSeek-V3-style models (MLA, DeepSeek MoE, MTP), shared by the DeepSeek-V3 and GLM-4.5
tests: rank files moved off their init, megatron-core's own forward of one rank file (main and MTP logits), the
rank files merged by the converter's merge, a one-rank checkpoint, and the MTP logits composed from transformers'
own modules."""

from __future__ import annotations

import zlib
from pathlib import Path

import torch

from mconvert.layouts.megatron import rank_file, save_rank_file, write_latest
from mconvert.mappings.transforms import merge
from mconvert.spec import ModelSpec

TOL = 1e-4  # relative to the largest |logit|
PROBE = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(3))


def moved_off_init(model: dict, tp_rank: int, ep_rank: int) -> dict:
    """Every tensor of a rank's state dict moved off its init (same noise for a tensor every rank holds whole,
    per-rank noise for split ones); the expert bias large enough to change which experts are chosen."""
    out = {}
    for k, v in model.items():
        if not isinstance(v, torch.Tensor):
            out[k] = v
            continue
        whole = "layernorm" in k or "norm." in k or k.endswith(("router.weight", "expert_bias"))
        expert = ".local_experts." in k
        g = torch.Generator().manual_seed(zlib.crc32(f"{k}:{'' if whole else tp_rank}:{ep_rank if expert else ''}"
                                                     .encode()))
        noise = torch.randn(v.shape, generator=g)
        if k.endswith("expert_bias"):  # non-negative: see test_hf_logits_match_ours
            out[k] = 0.3 * noise.abs()
        elif k.endswith("norm.weight") or k.endswith("layernorm.weight"):
            out[k] = 1.0 + 0.2 * noise
        else:
            out[k] = v + 0.05 * noise
    return out


def mcore_rank_logits(ctx, files: dict, tokens: torch.Tensor, zero_bias: bool):
    """Strict-load this rank's file; the main logits and the MTP layer's (forward with labels, as MTP needs)."""
    sd = dict(files[(ctx.tp_rank, ctx.ep_rank)])
    if zero_bias:
        sd = {k: torch.zeros_like(v) if k.endswith("expert_bias") else v for k, v in sd.items()}
    ctx.model.load_state_dict(sd, strict=True)
    seen: list[torch.Tensor] = []  # copies: megatron-core's cross-entropy works on the logits in place
    ctx.model.output_layer.register_forward_hook(lambda mod, args, out: seen.append(out[0].detach().clone()))
    b, s = tokens.shape
    pos = torch.arange(s).unsqueeze(0).expand(b, -1)
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)[None, None]
    with torch.no_grad():
        ctx.model(tokens, pos, mask, labels=tokens, runtime_gather_output=True)
    main, mtp = seen[-1], (seen[0] if len(seen) > 1 else None)  # megatron-core runs the MTP head first
    return main.transpose(0, 1).float(), None if mtp is None else mtp.transpose(0, 1).float()


def merged_ranks(spec: ModelSpec, files: dict, tp: int) -> dict:
    """The rank files merged to one TP=1 EP=1 state dict (the converter's merge per split kind)."""
    ep = 1 + max(e for _, e in files)
    shards: dict[str, dict[int, torch.Tensor]] = {}
    for (t, e), model in files.items():
        for k, v in model.items():
            if not isinstance(v, torch.Tensor):
                continue
            parts = k.split(".")
            if "local_experts" in parts:
                i = parts.index("local_experts") + 1
                parts[i] = str(int(parts[i]) + e * spec.num_experts // ep)  # type: ignore[operator]
            shards.setdefault(".".join(parts), {})[t] = v
    return {k: merge([v[t] for t in range(tp)], spec.split_kind(k), k) for k, v in shards.items()}


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def save_single_rank(spec: ModelSpec, state: dict, root: Path) -> Path:
    save_rank_file(rank_file(root, 1, 0, 0, 1), {"args": spec.to_megatron_args(), "checkpoint_version": 3.0,
                                                  "iteration": 1, "model": state})
    write_latest(root, 1)
    return root


def hf_mtp_logits(hf_dir: Path, hf, tokens: torch.Tensor, decoder_layer=None, rms_norm=None) -> torch.Tensor:
    """MTP layer 0's logits computed from the HF tensors at model.layers.{num_hidden_layers} by transformers' own
    modules, as DeepSeek's MTP (and vLLM's deepseek_mtp / glm4_moe_mtp) composes them: the next tokens through that
    layer's embed_tokens and enorm, the main model's last hidden state through hnorm, eh_proj of [e; h], the
    model's decoder layer class at that index (`decoder_layer`; DeepseekV3DecoderLayer), shared_head.norm
    (`rms_norm`; DeepseekV3RMSNorm), shared_head.head."""
    from safetensors.torch import load_file
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm

    from mconvert.trainer.mtp import shift_left

    decoder_layer, rms_norm = decoder_layer or DeepseekV3DecoderLayer, rms_norm or DeepseekV3RMSNorm
    cfg = hf.config
    n, eps = cfg.num_hidden_layers, cfg.rms_norm_eps
    sd = load_file(str(hf_dir / "model.safetensors"))
    p = f"model.layers.{n}."
    layer = decoder_layer(cfg, layer_idx=n).eval()
    layer.load_state_dict({k[len(p):]: v for k, v in sd.items() if k.startswith(p)}, strict=False)
    norms = {}
    for name in ("enorm", "hnorm", "shared_head.norm"):
        norms[name] = rms_norm(cfg.hidden_size, eps)
        norms[name].weight.data.copy_(sd[p + name + ".weight"])
    b, s = tokens.shape
    pos = torch.arange(s).unsqueeze(0).expand(b, -1)
    mask = torch.full((s, s), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        h = hf.model(tokens).last_hidden_state
        e = torch.nn.functional.embedding(shift_left(tokens), sd[p + "embed_tokens.weight"])
        x = torch.cat([norms["enorm"](e), norms["hnorm"](h)], dim=-1) @ sd[p + "eh_proj.weight"].T
        x = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=hf.model.rotary_emb(x, pos))
        x = x[0] if isinstance(x, tuple) else x
        return norms["shared_head.norm"](x) @ sd[p + "shared_head.head.weight"].T
