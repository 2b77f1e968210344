"""Qwen2-MoE (HF `Qwen2MoeForCausalLM`: qkv bias, the pre-softmax router or the renormalised one by
`norm_topk_prob`, one shared expert gated by sigmoid(shared_expert_gate)) against transformers' own class and
megatron-core 0.16.1's GPTModel (`moe_router_pre_softmax`, `moe_shared_expert_gate`):

- a random Qwen2MoeForCausalLM saved by transformers -> hf-to-megatron TP=2 EP=2 -> megatron-core's logits equal
  transformers'; megatron-to-hf gives back the same tensors, byte for byte; the controls (the router renormalised, the shared
  expert's gate dropped) move megatron-core's logits past the tolerance;
- megatron-core's own saves (legacy and torch_dist) convert to one HF checkpoint with megatron-core's logits;
- our trainer at TP=2 EP=2 gives the single-rank run's losses (the gate's gradient summed over TP like the
  router's) and its checkpoint strict-loads into megatron-core with our logits.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from deepseek_ref import PROBE, TOL, mcore_rank_logits, merged_ranks, moved_off_init, rel_diff
from mcore_ref import run_mcore
from safetensors.torch import load_file

from mconvert.convert.verbs import hf_to_megatron, megatron_to_hf
from mconvert.io.safeload import safe_load
from mconvert.layouts.megatron import rank_file
from mconvert.mappings.families import hf_config, preset, spec_from_megatron_args
from mconvert.trainer.model import GPTModel
from mconvert.trainer.parallel import ParallelState

pytestmark = pytest.mark.slow
SPEC = preset("tiny-qwen2-moe")


def _load_forward(ctx, files: dict, tokens: torch.Tensor) -> torch.Tensor:
    ctx.model.load_state_dict(files[(ctx.tp_rank, ctx.ep_rank)], strict=True)
    return ctx.logits(tokens)


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_transformers_qwen2_moe_loads_into_megatron_core_and_back(tmp_path: Path, norm_topk_prob: bool) -> None:
    from hf_ref import move_off_init
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = {**hf_config(SPEC), "norm_topk_prob": norm_topk_prob}
    torch.manual_seed(2)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg)).eval()
    assert type(model).__name__ == "Qwen2MoeForCausalLM"
    move_off_init(model)
    model.save_pretrained(tmp_path / "hf")
    with torch.no_grad():
        want = model(PROBE).logits
    hf_to_megatron(tmp_path / "hf", tmp_path / "m", tp=2, ep=2)
    spec = spec_from_megatron_args(safe_load(rank_file(tmp_path / "m", "release", 0, 0, 1, 0, 2))["args"])
    assert (spec.family, spec.moe_router_pre_softmax, spec.moe_shared_expert_gate) == (
        "qwen2_moe", not norm_topk_prob, True)
    files = {(t, e): safe_load(rank_file(tmp_path / "m", "release", t, 0, 1, e, 2))["model"]
             for t in range(2) for e in range(2)}
    got = run_mcore(spec, 2, _load_forward, (files, PROBE), ep=2)[0][..., : spec.vocab_size]
    diff = rel_diff(got, want)
    assert diff <= TOL, diff
    megatron_to_hf(tmp_path / "m", tmp_path / "back")
    src, back = load_file(tmp_path / "hf" / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert src.keys() == back.keys()
    assert all(src[k].dtype == back[k].dtype and src[k].numpy().tobytes() == back[k].numpy().tobytes() for k in src)
    assert json.loads((tmp_path / "back" / "config.json").read_text())["norm_topk_prob"] is norm_topk_prob
    # controls: megatron-core with the other router, and without the shared expert's gate (sigmoid(0) = 1/2)
    other = run_mcore(spec.replace(moe_router_pre_softmax=norm_topk_prob), 2, _load_forward, (files, PROBE),
                      ep=2)[0][..., : spec.vocab_size]
    ungated = {k: {n: torch.zeros_like(v) if n.endswith("gate_weight") else v for n, v in sd.items()}
               for k, sd in files.items()}
    half = run_mcore(spec, 2, _load_forward, (ungated, PROBE), ep=2)[0][..., : spec.vocab_size]
    d_router, d_gate = rel_diff(other, want), rel_diff(half, want)
    assert d_router > 100 * TOL and d_gate > 100 * TOL, (d_router, d_gate)
    print(f"[figures] transformers Qwen2-MoE (norm_topk_prob={norm_topk_prob}) -> Megatron TP=2 EP=2: megatron-core "
          f"vs transformers {diff:.1e}; back: same tensors; controls: other router {d_router:.1e}, gate zeroed "
          f"{d_gate:.1e}")


def test_trainer_tp2_ep2_equals_one_rank_and_megatron_core(trained_checkpoint) -> None:
    runs = {}
    for tp, ep in ((1, 1), (2, 2)):
        ckpt = trained_checkpoint(preset="tiny-qwen2-moe", tp=tp, pp=1, dp=ep, ep=ep, steps=2, seq_length=32,
                                  micro_batch_size=2, global_batch_size=8, lr=1e-2, seed=42, moe_aux_loss_coeff=0.01)
        runs[tp] = (ckpt, trained_checkpoint.losses[ckpt])
    losses = max(abs(a - b) for a, b in zip(runs[1][1], runs[2][1], strict=True))
    assert losses <= 1e-4, (runs[1][1], runs[2][1])
    ckpt = runs[2][0]
    states = {(t, e): safe_load(rank_file(ckpt, 2, t, 0, 1, e, 2)) for t in range(2) for e in range(2)}
    spec = spec_from_megatron_args(states[(0, 0)]["args"])
    assert spec == SPEC
    files = {k: moved_off_init(v["model"], *k) for k, v in states.items()}
    ref = run_mcore(spec, 2, mcore_rank_logits, (files, PROBE, False), ep=2)[0][0]
    model = GPTModel(spec, ParallelState(), seed=None).eval()
    res = model.load_state_dict(merged_ranks(spec, files, 2), strict=False)
    assert not res.unexpected_keys and all(k.endswith("._extra_state") for k in res.missing_keys), res
    with torch.no_grad():
        diff = rel_diff(model(PROBE), ref)
    assert diff <= TOL, diff
    print(f"[figures] tiny-qwen2-moe TP=2 EP=2 vs TP=1, 2 steps: losses max|Δ| {losses:.1e}; megatron-core vs ours "
          f"{diff:.1e}")


def _save(ctx, root: str, tokens: torch.Tensor) -> torch.Tensor:
    """Per rank: weights off their init, megatron-core's own legacy and torch_dist saves, the main head's logits."""
    from mcore_ref import perturb, save_checkpoints

    perturb(ctx)
    save_checkpoints(ctx, root, 3, torch_dist=True)
    return ctx.logits(tokens)


def test_megatron_core_saves_convert_to_its_logits_and_one_hf_checkpoint(tmp_path: Path) -> None:
    """megatron-core's own TP=2 EP=2 saves (legacy rank files and dist_checkpointing, args without model_family)
    convert to the same HF bytes, whose transformers logits are megatron-core's; through hf-to-megatron --format
    torch_dist and back, the same bytes again."""
    from transformers import AutoModelForCausalLM

    root = tmp_path / "mcore"
    ref = run_mcore(SPEC, 2, _save, (str(root), PROBE), ep=2)[0][..., : SPEC.vocab_size]
    megatron_to_hf(root, tmp_path / "hf")
    megatron_to_hf(Path(str(root) + "_dist"), tmp_path / "hf-dist")
    assert (tmp_path / "hf" / "model.safetensors").read_bytes() == (
        tmp_path / "hf-dist" / "model.safetensors").read_bytes()
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert type(hf).__name__ == "Qwen2MoeForCausalLM"
    with torch.no_grad():
        diff = rel_diff(hf(PROBE).logits, ref)
    assert diff <= TOL, diff
    hf_to_megatron(tmp_path / "hf", tmp_path / "dist2", tp=2, ep=2, format="torch_dist")
    megatron_to_hf(tmp_path / "dist2", tmp_path / "hf2")
    assert (tmp_path / "hf" / "model.safetensors").read_bytes() == (tmp_path / "hf2" / "model.safetensors").read_bytes()
    print(f"[figures] megatron-core's own TP=2 EP=2 saves of tiny-qwen2-moe (legacy and torch_dist) -> the same HF "
          f"bytes; transformers vs megatron-core {diff:.1e}")
