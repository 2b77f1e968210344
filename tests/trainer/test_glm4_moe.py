"""GLM-4.5 (`Glm4MoeForCausalLM`): q/k/v bias, q/k norm, partial rotary and the DeepSeek MoE with an MTP layer.

Truth is transformers' own Glm4Moe (a random one it builds and saves, and the export of our trainer's tiny-glm45)
and megatron-core's GPTModel on the rank files `hf-to-megatron` writes at TP=2 EP=2.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from deepseek_ref import (PROBE, TOL, hf_mtp_logits, mcore_rank_logits, merged_ranks, moved_off_init, rel_diff,
                          save_single_rank)

from mconvert.layouts.megatron import rank_file
from mconvert.io.safeload import safe_load
from mconvert.mappings.families import preset, spec_from_hf_config
from mconvert.trainer.model import GPTModel
from mconvert.trainer.parallel import ParallelState

pytestmark = pytest.mark.slow


def glm4_mtp_logits(hf_dir: Path, hf, tokens: torch.Tensor) -> torch.Tensor:
    """MTP layer 0's logits from the HF tensors at model.layers.{num_hidden_layers}, by transformers' own
    Glm4MoeDecoderLayer and RMSNorm composed as vLLM's glm4_moe_mtp does (DeepSeek's MTP)."""
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeDecoderLayer, Glm4MoeRMSNorm

    return hf_mtp_logits(hf_dir, hf, tokens, Glm4MoeDecoderLayer, Glm4MoeRMSNorm)


def test_tiny_glm45_exports_to_transformers_logits_and_back_at_tp2_ep2(tmp_path: Path) -> None:
    """Our trainer's tiny-glm45 (weights moved off init, a non-zero expert bias) -> Glm4MoeForCausalLM: transformers'
    logits equal ours; hf-to-megatron TP=2 EP=2 rank files give megatron-core the same main and MTP logits and
    come back to the same safetensors bytes. Controls: rotating the whole head (partial_rotary_factor 1) and
    dropping the MTP layer's weights are both seen."""
    from mcore_ref import run_mcore
    from transformers import AutoModelForCausalLM

    from mconvert.convert.verbs import hf_to_megatron, megatron_to_hf

    spec = preset("tiny-glm45")
    model = GPTModel(spec, ParallelState(), seed=5).eval()
    state = moved_off_init(model.state_dict(), 0, 0)
    model.load_state_dict(state)
    report = megatron_to_hf(save_single_rank(spec, state, tmp_path / "m"), tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (cfg["partial_rotary_factor"], cfg["attention_bias"], cfg["use_qk_norm"], cfg["num_nextn_predict_layers"],
            cfg["scoring_func"], cfg["topk_method"]) == (0.5, True, True, 1, "sigmoid", "noaux_tc")
    assert report["tensors"]["mtp_copies"] == 2
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert type(hf).__name__ == "Glm4MoeForCausalLM"
    with torch.no_grad():
        want = hf(PROBE).logits
        ours = model(PROBE)[..., : spec.vocab_size]
    diff = rel_diff(want, ours)
    assert diff <= TOL, diff
    d_mtp_ours = rel_diff(glm4_mtp_logits(tmp_path / "hf", hf, PROBE), model.mtp_logits[0][..., : spec.vocab_size])
    assert d_mtp_ours <= TOL, d_mtp_ours
    whole = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32, partial_rotary_factor=1.0)
    with torch.no_grad():
        d_rope = rel_diff(whole.eval()(PROBE).logits, ours)
    assert d_rope > 100 * TOL, d_rope

    hf_to_megatron(tmp_path / "hf", tmp_path / "m2", tp=2, ep=2)
    files = {(t, e): safe_load(rank_file(tmp_path / "m2", "release", t, 0, 1, e, 2))["model"]
             for t in range(2) for e in range(2)}
    got, got_mtp = run_mcore(spec, 2, mcore_rank_logits, (files, PROBE, False), ep=2)[0]
    d_main = rel_diff(got[..., : spec.vocab_size], want)
    d_mtp = rel_diff(got_mtp[..., : spec.vocab_size], glm4_mtp_logits(tmp_path / "hf", hf, PROBE))
    assert d_main <= TOL and d_mtp <= TOL, (d_main, d_mtp)
    back = merged_ranks(spec, files, 2)
    for k, v in state.items():
        if torch.is_tensor(v):
            rows = spec.vocab_size if k in ("embedding.word_embeddings.weight", "output_layer.weight") else None
            assert torch.equal(back[k][:rows], v[:rows]), k
    megatron_to_hf(tmp_path / "m2", tmp_path / "hf2")
    assert (tmp_path / "hf" / "model.safetensors").read_bytes() == (tmp_path / "hf2" / "model.safetensors").read_bytes()
    print(f"[figures] tiny-glm45 -> HF: transformers vs ours {diff:.1e}, MTP {d_mtp_ours:.1e}; HF -> Megatron TP=2 "
          f"EP=2: megatron-core vs transformers main {d_main:.1e}, MTP {d_mtp:.1e}; control: whole-head rope {d_rope:.1e}")


def test_transformers_random_glm4_moe_round_trips_at_tp2_ep2(tmp_path: Path) -> None:
    """A Glm4MoeForCausalLM that transformers builds and saves itself (random weights, a random expert bias, no
    q/k norm, dense first layer, group-limited routing) -> hf-to-megatron TP=2 EP=2 -> megatron-to-hf: the same
    tensors and megatron-core's logits on the rank files equal transformers'."""
    from mcore_ref import run_mcore
    from safetensors.torch import load_file
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    from mconvert.convert.verbs import hf_to_megatron, megatron_to_hf

    cfg = Glm4MoeConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=32, partial_rotary_factor=0.5,
                        attention_bias=True, use_qk_norm=False, moe_intermediate_size=32, num_experts_per_tok=4,
                        n_shared_experts=1, n_routed_experts=8, routed_scaling_factor=1.5, n_group=2, topk_group=2,
                        first_k_dense_replace=1, max_position_embeddings=64, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    hf = Glm4MoeForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, t in hf.state_dict().items():
            if name.endswith("e_score_correction_bias"):
                t.copy_(0.3 * torch.rand_like(t))
            elif name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                t.copy_(1 + 0.2 * torch.randn_like(t))
            elif name.endswith("gate.weight") or name.endswith("proj.bias"):
                t.normal_(0, 0.5)
    hf.save_pretrained(tmp_path / "hf")
    spec = spec_from_hf_config(json.loads((tmp_path / "hf" / "config.json").read_text()))
    assert (spec.family, spec.rotary_percent, spec.add_qkv_bias, spec.moe_router_num_groups) == ("glm4_moe", 0.5, True, 2)
    hf_to_megatron(tmp_path / "hf", tmp_path / "m", tp=2, ep=2)
    megatron_to_hf(tmp_path / "m", tmp_path / "hf2")
    a, b = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("hf", "hf2"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    tokens = PROBE % cfg.vocab_size
    with torch.no_grad():
        want = hf(tokens).logits
    files = {(t, e): safe_load(rank_file(tmp_path / "m", "release", t, 0, 1, e, 2))["model"]
             for t in range(2) for e in range(2)}
    got = run_mcore(spec, 2, mcore_rank_logits, (files, tokens, False), ep=2)[0][0][..., : cfg.vocab_size]
    diff = rel_diff(got, want)
    assert diff <= TOL, diff
    print(f"[figures] transformers' random Glm4Moe -> Megatron TP=2 EP=2: megatron-core vs transformers {diff:.1e}; "
          "back to HF: every tensor equal")
