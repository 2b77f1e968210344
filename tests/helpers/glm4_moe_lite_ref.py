"""Run by the vLLM venv's python (transformers 5, which has `Glm4MoeLiteForCausalLM`; the pinned 4.57 has not):

    python glm4_moe_lite_ref.py make DIR           # a random tiny Glm4MoeLiteForCausalLM saved by transformers
    python glm4_moe_lite_ref.py logits DIR TOKENS OUT   # its logits for TOKENS (a .pt of int64 ids) into OUT
    python glm4_moe_lite_ref.py greedy DIR PROMPTS N OUT  # per prompt (a JSON list of id lists): N greedy tokens
                                                           # and the prompt's logprobs, as JSON into OUT

The tiny model has GLM-4.7-Flash's structure: q latent, kv latent 512 + 64 rope dims (576, vLLM's CPU MLA
width), one dense first layer, 16 experts in 4 groups (top-2 groups, top-4 experts), one shared expert, routed
weights × 1.8; every weight off its init (norms off 1) and a non-negative correction bias, so every tensor
matters.
"""

from __future__ import annotations

import sys

import torch
from hf_ref import move_off_init  # this script's folder is on sys.path when it runs


def make(d: str) -> None:
    from transformers import Glm4MoeLiteConfig, Glm4MoeLiteForCausalLM

    cfg = Glm4MoeLiteConfig(
        vocab_size=1000, hidden_size=128, intermediate_size=256, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=8, num_key_value_heads=8, n_shared_experts=1, n_routed_experts=16,
        routed_scaling_factor=1.8, kv_lora_rank=512, q_lora_rank=64, qk_rope_head_dim=64, v_head_dim=32,
        qk_nope_head_dim=32, n_group=4, topk_group=2, num_experts_per_tok=4, max_position_embeddings=128,
        rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    torch.manual_seed(2)
    model = Glm4MoeLiteForCausalLM(cfg).eval()
    move_off_init(model)
    model.save_pretrained(d)


def logits(d: str, tokens: str, out: str) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    ids = torch.load(tokens, weights_only=True)
    with torch.no_grad():
        got = model(ids).logits.float()
    torch.save({"class": type(model).__name__, "logits": got}, out)


def greedy(d: str, prompts: str, n: str, out: str) -> None:
    import json

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    got = []
    with torch.no_grad():
        for p in json.loads(open(prompts).read()):
            ids = torch.tensor([p])
            lp = torch.log_softmax(model(ids).logits[0, :-1].double(), -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
            toks, cur = [], ids
            for _ in range(int(n)):
                toks.append(int(model(cur).logits[0, -1].argmax()))
                cur = torch.cat([cur, torch.tensor([[toks[-1]]])], dim=1)
            got.append({"tokens": toks, "prompt_logprobs": lp.tolist()})
    open(out, "w").write(json.dumps({"class": type(model).__name__, "results": got}))


if __name__ == "__main__":
    {"make": make, "logits": logits, "greedy": greedy}[sys.argv[1]](*sys.argv[2:])
