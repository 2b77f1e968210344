"""DeepSeek-V2's router (megatron-core's `moe_router_pre_softmax`: softmax over every expert, top-k of those
probabilities, not renormalised, × the routed scale) in the trainer and in conversion, against megatron-core
0.16.1's own GPTModel and transformers' `DeepseekV2ForCausalLM`:

- our trainer's TP=2 EP=2 checkpoint strict-loads into megatron-core with our logits; the same weights under the
  post-softmax router (top-k of the logits, softmax over the k) move the logits past the tolerance;
- megatron-to-hf of our checkpoints (greedy top-k; group-limited top-k where HF's best-expert group score and
  megatron-core's top-k sum agree; with and without a q latent) gives transformers' logits of ours;
- megatron-core's own save (no model_family in its args) converts to a DeepseekV2ForCausalLM whose transformers
  logits are megatron-core's; hf-to-megatron at TP=2 EP=2 gives back megatron-core's tensors and megatron-to-hf the
  same safetensors bytes, as its torch_dist save (`dist_checkpointing`) does.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from deepseek_ref import PROBE, TOL, mcore_rank_logits, merged_ranks, moved_off_init, rel_diff, save_single_rank
from mcore_ref import McoreContext, perturb, run_mcore, save_checkpoints

from mconvert.layouts.megatron import rank_file
from mconvert.convert.verbs import hf_to_megatron, megatron_to_hf
from mconvert.io.safeload import safe_load
from mconvert.mappings.families import preset, spec_from_megatron_args
from mconvert.spec import ModelSpec
from mconvert.trainer.model import GPTModel
from mconvert.trainer.parallel import ParallelState

pytestmark = pytest.mark.slow
SPEC = preset("tiny-deepseek-v2-lite")


def _ours(spec: ModelSpec, state: dict, tokens: torch.Tensor) -> torch.Tensor:
    model = GPTModel(spec, ParallelState(), seed=None).eval()
    res = model.load_state_dict(state, strict=False)
    assert not res.unexpected_keys and all(k.endswith("._extra_state") for k in res.missing_keys), res
    with torch.no_grad():
        return model(tokens)


def test_trained_tp2_ep2_checkpoint_is_megatron_cores_pre_softmax_router(trained_checkpoint) -> None:
    ckpt = trained_checkpoint(preset="tiny-deepseek-v2-lite", tp=2, pp=1, dp=2, ep=2, steps=2, seq_length=32,
                              micro_batch_size=2, global_batch_size=8, lr=1e-2, seed=42, moe_aux_loss_coeff=0.0)
    states = {(t, e): safe_load(rank_file(ckpt, 2, t, 0, 1, e, 2)) for t in range(2) for e in range(2)}
    args = states[(0, 0)]["args"]
    assert (args.moe_router_pre_softmax, args.moe_router_score_function) == (True, "softmax")
    spec = spec_from_megatron_args(args)
    assert spec == SPEC
    files = {k: moved_off_init(v["model"], *k) for k, v in states.items()}
    ref = run_mcore(spec, 2, mcore_rank_logits, (files, PROBE, False), ep=2)[0][0]
    merged = merged_ranks(spec, files, 2)
    diff = rel_diff(_ours(spec, merged, PROBE), ref)
    assert diff <= TOL, diff
    post = rel_diff(_ours(spec.replace(moe_router_pre_softmax=False), merged, PROBE), ref)  # control
    assert post > 100 * TOL, post
    print(f"[figures] tiny-deepseek-v2-lite trained at TP=2 EP=2: megatron-core vs ours {diff:.1e}; control: the "
          f"post-softmax router {post:.1e}")


@pytest.mark.parametrize("changes", [
    {}, dict(moe_router_num_groups=8, moe_router_group_topk=4), dict(q_lora_rank=64)],
    ids=["greedy", "group-limited", "q-lora"])
def test_megatron_to_hf_gives_transformers_logits_of_ours(tmp_path: Path, changes: dict) -> None:
    """With 8 groups of 2 experts, top-4 groups and top-4 experts, HF's best-expert group score is megatron-core's
    top-(4 / 4) sum (both then choose the greedy top-4); the control flips our router to post-softmax."""
    from transformers import AutoModelForCausalLM

    spec = SPEC.replace(**changes)
    model = GPTModel(spec, ParallelState(), seed=5).eval()
    state = moved_off_init(model.state_dict(), 0, 0)
    megatron_to_hf(save_single_rank(spec, state, tmp_path / "m"), tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    grouped = "moe_router_num_groups" in changes
    assert (cfg["architectures"], cfg["scoring_func"], cfg["norm_topk_prob"], cfg["topk_method"]) == (
        ["DeepseekV2ForCausalLM"], "softmax", False, "group_limited_greedy" if grouped else "greedy")
    assert (cfg["n_group"], cfg["topk_group"]) == ((8, 4) if grouped else (1, 1))
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert type(hf).__name__ == "DeepseekV2ForCausalLM"
    with torch.no_grad():
        want = hf(PROBE).logits
    diff = rel_diff(_ours(spec, state, PROBE)[..., : spec.vocab_size], want)
    assert diff <= TOL, diff
    post = rel_diff(_ours(spec.replace(moe_router_pre_softmax=False), state, PROBE)[..., : spec.vocab_size], want)
    assert post > 100 * TOL, post
    print(f"[figures] tiny-deepseek-v2-lite {'/'.join(changes) or 'greedy'} -> HF: transformers vs ours {diff:.1e}; "
          f"control post-softmax {post:.1e}")


def _save(ctx: McoreContext, root: str, tokens: torch.Tensor) -> torch.Tensor:
    """Per rank: weights off their init, megatron-core's own legacy and torch_dist saves, the main head's logits."""
    perturb(ctx)
    save_checkpoints(ctx, root, 3, torch_dist=True)
    return ctx.logits(tokens)


def test_megatron_core_save_converts_to_transformers_logits_and_round_trips(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    root = tmp_path / "mcore"
    ref = run_mcore(SPEC, 2, _save, (str(root), PROBE), ep=2)[0][..., : SPEC.vocab_size]
    megatron_to_hf(root, tmp_path / "hf")  # its args name no family: recognised as DeepSeek-V2's
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["architectures"] == ["DeepseekV2ForCausalLM"]
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    with torch.no_grad():
        diff = rel_diff(hf(PROBE).logits, ref)
    assert diff <= TOL, diff
    hf_to_megatron(tmp_path / "hf", tmp_path / "m2", tp=2, ep=2)
    for t in range(2):
        for e in range(2):
            theirs = safe_load(rank_file(root, 3, t, 0, 1, e, 2))["model"]
            back = safe_load(rank_file(tmp_path / "m2", "release", t, 0, 1, e, 2))["model"]
            tensors = {k for k, v in theirs.items() if torch.is_tensor(v)}
            assert tensors == {k for k, v in back.items() if torch.is_tensor(v)}
            for k in tensors:  # the vocab's padding rows are megatron-core's noise there, zeros here
                per = theirs[k].shape[0]
                vocab = k in ("embedding.word_embeddings.weight", "output_layer.weight")
                rows = min(max(SPEC.vocab_size - t * per, 0), per) if vocab else None
                assert torch.equal(back[k][:rows], theirs[k][:rows]), k
    megatron_to_hf(tmp_path / "m2", tmp_path / "hf2")
    megatron_to_hf(Path(str(root) + "_dist"), tmp_path / "hf-dist")  # megatron-core's dist_checkpointing save
    want = (tmp_path / "hf" / "model.safetensors").read_bytes()
    for again in ("hf2", "hf-dist"):
        assert (tmp_path / again / "model.safetensors").read_bytes() == want, again
    print(f"[figures] megatron-core's own TP=2 EP=2 save of tiny-deepseek-v2-lite -> HF: transformers vs megatron-core "
          f"{diff:.1e}; HF -> Megatron TP=2 EP=2 -> HF and its torch_dist save -> HF: the same bytes")


def test_grouped_pre_softmax_router_load_balancing_loss_is_megatron_cores() -> None:
    """The load-balancing loss counts what megatron-core's does: the softmax scores with their own top-k, not the
    group-limited choice the tokens are routed by."""
    from megatron.core.transformer.moe.moe_utils import (
        compute_routing_scores_for_aux_loss,
        switch_load_balancing_loss_func,
    )

    from mconvert.trainer.deepseek_moe import Router
    from mconvert.trainer.model import load_balancing_loss

    spec = SPEC.replace(moe_router_num_groups=8, moe_router_group_topk=4)
    g = torch.Generator().manual_seed(1)
    router = Router(spec, torch.nn.Parameter(torch.randn(16, 128, generator=g)), None, ParallelState())
    logits, _, _ = router(torch.randn(64, 128, generator=g))
    ours = load_balancing_loss(*router.aux_loss_inputs(logits), 16, spec.moe_router_topk, 0.01)
    routing_map, scores = compute_routing_scores_for_aux_loss(logits, spec.moe_router_topk, "softmax")
    theirs = switch_load_balancing_loss_func(scores, routing_map.sum(dim=0), 64, spec.moe_router_topk, 16, 0.01)
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-6)
