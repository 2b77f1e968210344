"""Mixture of experts in the trainer, against truth we did not write where there is one.

- megatron-core 0.16.1's own MoE `GPTModel` (SequentialMLP experts, allgather dispatcher) at the run's TP×EP
  (TP=2 EP=2, and PP=2 EP=2) strict-loads each of our `mp_rank_TT[_PPP]_EEE` files as its rank's state dict
  and its logits equal our single-rank model's on the same weights (EP and TP merged by the converter's
  `transforms.merge` and the local → global expert rule), our native runner's at TP×PP×EP and transformers'
  on the converter's HF export, so the layout, the router and the experts are megatron-core's.
- The sharded run (EP=2 inside DP=2, with TP=2 or PP=2) equals one process: init logits and one step's synced
  gradients (load-balancing loss included, at a coefficient large enough to show a mis-scaled aux gradient),
  and its losses equal the EP=1 run's at the same layout for several steps.
- Checkpoint layout facts: one file per (TP, PP, EP) rank, dense weights and router identical in every EP
  file, args carrying the MoE fields; the comm report shows the EP collectives.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import test_trainer_parallel as parallel_tests
import torch

from mconvert.io.safeload import safe_load
from mconvert.layouts.megatron import rank_file
from mconvert.errors import MConvertError
from mconvert.mappings.families import spec_from_megatron_args
from mconvert.mappings.transforms import merge
from mconvert.spec import ModelSpec
from mconvert.trainer.infer import megatron_logits, pipeline_logits
from mconvert.trainer.model import GPTModel
from mconvert.trainer.parallel import ParallelState, group_ranks, init_distributed
from mconvert.trainer.schedule import forward_backward_1f1b
from mconvert.trainer.train import (
    TrainConfig,
    _train,
    build_spec,
    get_micro_batches,
    launch,
    prepare_tokens,
    sync_gradients,
    train,
)

pytestmark = pytest.mark.slow
TOL = 1e-5
AUX = 0.5  # large, so that a wrongly scaled load-balancing gradient shows in the router's grads
PROBE = parallel_tests.PROBE
_EXPERT = re.compile(r"(decoder\.layers\.\d+\.mlp\.experts\.local_experts\.)(\d+)\.")


def _cfg(**kw) -> TrainConfig:
    base = dict(seq_length=32, micro_batch_size=2, global_batch_size=8, lr=2e-3, seed=42, quiet=True,
                moe_aux_loss_coeff=AUX)
    base.update(kw)
    return TrainConfig(**base)


def _global_key(key: str, layers: list[int], first_expert: int) -> str:
    """A rank's state-dict key -> the canonical name (global layer, global expert = ep_rank·E/EP + local)."""
    key = parallel_tests._global_name(key, layers)
    return _EXPERT.sub(lambda m: f"{m.group(1)}{int(m.group(2)) + first_expert}.", key)


def _probe_then_train(cfg: TrainConfig, spec: ModelSpec, tokens: torch.Tensor, out_dir: str) -> dict:
    """Every rank: init logits, one step's synced grads (saved to out_dir), then the real loop."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    st = init_distributed(cfg.tp, cfg.pp, cfg.dp, ep=cfg.ep, sequence_parallel=cfg.sequence_parallel)
    model = GPTModel(spec, st, seed=cfg.seed)
    logits, _ = pipeline_logits(model, st, PROBE)
    model.set_aux_loss(cfg.moe_aux_loss_coeff, 1.0 / cfg.num_micro_batches)
    forward_backward_1f1b(model, get_micro_batches(cfg, st, tokens, 0, spec), st, torch.float32)
    sync_gradients(model, st)
    first = st.ep_rank * spec.num_experts // st.ep
    torch.save({"tp": st.tp_rank, "ep": st.ep_rank, "logits": logits,
                "grads": {_global_key(n, model.global_layers, first): p.grad for n, p in model.named_parameters()}},
               Path(out_dir) / f"rank{st.rank}.pt")
    del model
    try:
        return _train(cfg, spec, tokens, st)
    finally:
        dist.destroy_process_group()


def _reference(spec: ModelSpec, cfg: TrainConfig, tokens: torch.Tensor):
    """The same seed at TP=1 PP=1 DP=1 EP=1, one process, no torch.distributed: logits and one step's grads."""
    st = ParallelState()
    model = GPTModel(spec, st, seed=cfg.seed)
    with torch.no_grad():
        logits = model(PROBE)[..., : spec.vocab_size]
    one = _cfg(tp=1, pp=1, dp=1, seed=cfg.seed)
    model.set_aux_loss(cfg.moe_aux_loss_coeff, 1.0 / one.num_micro_batches)
    forward_backward_1f1b(model, get_micro_batches(one, st, tokens, 0, spec), st, torch.float32)
    return logits, {n: p.grad for n, p in model.named_parameters()}


LAYOUTS = [("tiny-mixtral", dict(tp=2, pp=1, dp=2, ep=2)), ("tiny-qwen3-moe", dict(tp=1, pp=2, dp=2, ep=2)),
           ("tiny-mixtral", dict(tp=2, pp=1, dp=2, ep=2, sequence_parallel=True))]  # how Megatron trains TP + EP


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name,layout", LAYOUTS, ids=[
    f"{n}-tp{d['tp']}pp{d['pp']}ep{d['ep']}{'-sp' if d.get('sequence_parallel') else ''}" for n, d in LAYOUTS])
def test_ep2_run_equals_single_rank_and_ep1_losses(tmp_path: Path, name: str, layout: dict) -> None:
    steps = 4
    cfg = _cfg(preset=name, steps=steps, save=str(tmp_path / "ckpt"), comm_report=True, **layout)
    tokens, vocab = prepare_tokens(None, write=False)
    spec = build_spec(cfg, vocab)
    results = launch(_probe_then_train, (cfg, spec, tokens, str(tmp_path)), cfg.world)
    probes = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(cfg.world)]

    ref_logits, ref_grads = _reference(spec, cfg, tokens)
    logit_diff = max((p["logits"] - ref_logits).abs().max().item() for p in probes if p["logits"] is not None)
    assert logit_diff <= TOL
    shards: dict[str, dict[int, torch.Tensor]] = {}
    for p in probes:  # DP replicas (same EP rank, other replica) must agree after the sync; keep one
        for key, g in p["grads"].items():
            if key == "output_layer.weight" and spec.tie_embeddings:
                continue
            seen = shards.setdefault(key, {})
            if p["tp"] in seen:
                assert torch.equal(seen[p["tp"]], g), key
            seen[p["tp"]] = g
    assert set(shards) == set(ref_grads)  # every expert of every layer held by exactly one EP rank
    worst, router = 0.0, 0.0
    for key, by_tp in shards.items():
        full = merge([by_tp[t] for t in range(cfg.tp)], spec.split_kind(key), key)
        diff = (full - ref_grads[key]).abs().max().item()
        worst = max(worst, diff)
        if key.endswith("router.weight"):
            router = max(router, ref_grads[key].abs().max().item())
    assert worst <= TOL, worst
    assert router > 1e2 * TOL  # the routers learn (their gradient is not vanishing), so the comparison bites

    losses_ep2 = results[next(r for r in results if "losses" in (results[r] or {}))]["losses"]
    assert losses_ep2[-1] < losses_ep2[0]
    # the logged load-balancing loss, reduced over PP and DP, is megatron-core's of the same batch on one rank
    balance = results[next(r for r in results if "losses" in (results[r] or {}))]["load_balancing_losses"]
    want = _mcore_load_balancing_loss(spec, _cfg(preset=name, tp=1, pp=1, dp=1), tokens)
    assert len(balance) == steps and abs(balance[0] - want) <= 1e-5 * want, (balance[0], want)
    loss_diff = 0.0
    if not layout.get("sequence_parallel"):  # the SP case's grads above already equal one process's
        ep1 = train(_cfg(preset=name, steps=steps, **{**layout, "ep": 1}))["losses"]
        loss_diff = max(abs(a - b) for a, b in zip(losses_ep2, ep1, strict=True))
        assert loss_diff <= TOL

    # the comm report has the EP dispatch (all-gather) and combine (reduce-scatter) of every MoE layer
    comm = {(r[0], r[1]): r for r in results[0]["comm"]}
    assert comm[("all-gather", "EP")][2] > 0 and comm[("reduce-scatter", "EP")][2] > 0
    assert (("all-gather", "TP") in comm) == bool(layout.get("sequence_parallel"))  # SP gathers the sequence
    print(f"[figures] {name} {layout}: logits max|Δ| {logit_diff:.2e}, grads max|Δ| {worst:.2e}, "
          f"EP2 vs EP1 losses max|Δ| {loss_diff:.2e}")


def _merged_tp1_ep1(spec: ModelSpec, files: dict[tuple[int, int, int], dict], tp: int, pp: int) -> dict:
    """Every rank file's model merged into one TP=1 EP=1 state dict: the converter's TP merge per split kind,
    experts renamed local → global (ep_rank·E/EP + i), stage-local layers → global."""
    ep = 1 + max(e for _, _, e in files)
    per_stage = spec.num_layers // pp
    shards: dict[str, dict[int, torch.Tensor]] = {}
    for (t, p, e), model in files.items():
        layers = list(range(p * per_stage, (p + 1) * per_stage))
        for key, v in model.items():
            if not isinstance(v, torch.Tensor):
                continue
            name = _global_key(key, layers, e * spec.num_experts // ep)
            if name == "output_layer.weight" and spec.tie_embeddings:
                continue
            have = shards.setdefault(name, {})
            if t in have:  # dense weights and the router repeat in every EP file: identical
                assert torch.equal(have[t], v), f"{name} differs between EP files"
            have[t] = v
    return {k: merge([v[t] for t in range(tp)], spec.split_kind(k), k) for k, v in shards.items()}


def _load_rank_file(ctx, files: dict[tuple[int, int, int], dict], tokens: torch.Tensor):
    ctx.model.load_state_dict(files[(ctx.tp_rank, ctx.pp_rank, ctx.ep_rank)], strict=True)
    return ctx.logits(tokens)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("name,tp,pp,swap", [("tiny-mixtral", 2, 1, False), ("tiny-qwen3-moe", 1, 2, True)],
                         ids=["tiny-mixtral-tp2ep2", "tiny-qwen3-moe-pp2ep2"])
def test_moe_checkpoint_loads_strict_per_rank_into_mcore_and_logits_match(tmp_path: Path, name: str, tp: int,
                                                                          pp: int, swap: bool) -> None:
    from mcore_ref import run_mcore

    ep = 2
    ckpt = tmp_path / "ckpt"
    train(_cfg(preset=name, tp=tp, pp=pp, dp=ep, ep=ep, steps=2, lr=1e-2, save=str(ckpt)))
    dirs = sorted(d.name for d in (ckpt / "iter_0000002").iterdir())
    want = sorted(Path(rank_file(ckpt, 2, t, p, pp, e, ep)).parent.name
                  for t in range(tp) for p in range(pp) for e in range(ep))
    assert dirs == want and all(d.endswith(("_000", "_001")) for d in dirs)
    states = {(t, p, e): safe_load(rank_file(ckpt, 2, t, p, pp, e, ep))
              for t in range(tp) for p in range(pp) for e in range(ep)}
    args = states[(0, 0, 1)]["args"]
    assert (args.num_experts, args.moe_router_topk, args.expert_model_parallel_size) == (4, 2, 2)
    assert args.moe_ffn_hidden_size == spec_from_megatron_args(args).expert_ffn_hidden_size
    spec = spec_from_megatron_args(args)
    files = {k: v["model"] for k, v in states.items()}
    for model in files.values():  # local expert indices: each file holds E/EP experts, 0-based
        experts = {int(m.group(2)) for k in model for m in [_EXPERT.match(k)] if m}
        assert experts == set(range(spec.num_experts // ep))

    mcore = run_mcore(spec, tp, _load_rank_file, (files, PROBE), pp=pp, ep=ep)
    ref = next(r for r in reversed(mcore) if r is not None)[..., : spec.vocab_size]
    ours = GPTModel(spec, ParallelState(), seed=None)
    res = ours.load_state_dict(_merged_tp1_ep1(spec, files, tp, pp), strict=False)
    assert not res.unexpected_keys and all(k.endswith("._extra_state") for k in res.missing_keys)
    with torch.no_grad():
        logits = ours(PROBE)[..., : spec.vocab_size]
    diff = (logits - ref).abs().max().item()
    assert diff <= TOL, diff
    native = megatron_logits(ckpt, PROBE)  # the runner `validate` uses, at the checkpoint's own TP×PP×EP
    native_diff = (native - ref).abs().max().item()
    assert native_diff <= TOL, native_diff
    # and the converter takes the trainer's EP files to HF, whose transformers model gives the same logits
    from transformers import AutoModelForCausalLM

    from mconvert.convert.verbs import megatron_to_hf

    megatron_to_hf(ckpt, tmp_path / "hf")
    hf_model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    with torch.no_grad():
        hf = hf_model(PROBE).logits
    hf_diff = (hf - ref).abs().max().item()
    assert hf_diff <= TOL, hf_diff

    if swap:  # the expert index matters: the last stage's two EP files exchanged (experts get the other offset)
        swapped = dict(files)
        for t in range(tp):
            swapped[(t, pp - 1, 0)], swapped[(t, pp - 1, 1)] = files[(t, pp - 1, 1)], files[(t, pp - 1, 0)]
        off = run_mcore(spec, tp, _load_rank_file, (swapped, PROBE), pp=pp, ep=ep)
        off_diff = (next(r for r in reversed(off) if r is not None)[..., : spec.vocab_size] - ref).abs().max().item()
        assert off_diff > 1e3 * TOL
    print(f"[figures] {name} TP={tp} PP={pp} EP={ep}: megatron-core vs ours (merged) max|Δ| {diff:.2e}, "
          f"vs native runner {native_diff:.2e}, vs transformers {type(hf_model).__name__} {hf_diff:.2e}")


def test_expert_groups_follow_megatron_core_order() -> None:
    """megatron-core's RankGenerator (tp-ep-dp-pp for experts, expert TP = TP) on the same sizes gives the same
    EP and expert-data-parallel groups as ours."""
    from megatron.core.parallel_state import RankGenerator

    for tp, dp, pp, ep in [(2, 4, 2, 2), (1, 4, 1, 4), (2, 2, 1, 1), (1, 6, 2, 3)]:
        ours = group_ranks(tp, dp, pp, ep)
        gen = RankGenerator(tp=tp, ep=ep, dp=dp // ep, pp=pp, cp=1, order="tp-cp-ep-dp-pp")
        assert sorted(ours["EP"]) == sorted(gen.get_ranks("ep")), (tp, dp, pp, ep)
        assert sorted(ours["EDP"]) == sorted(gen.get_ranks("dp")), (tp, dp, pp, ep)
        dense = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=1, order="tp-cp-ep-dp-pp")
        assert sorted(ours["DP"]) == sorted(dense.get_ranks("dp"))


@pytest.mark.parametrize("kw,message", [
    (dict(preset="tiny-mixtral", dp=2, ep=4), "--ep 4 must divide DP=2"),
    (dict(preset="tiny-mixtral", dp=3, ep=3, global_batch_size=6), "EP=3 does not divide num_experts=4"),
    (dict(preset="tiny-llama", dp=2, ep=2), "needs a mixture-of-experts model"),
    (dict(preset="tiny-llama", num_experts=4), "preset tiny-llama is of the dense family 'llama'"),
    (dict(preset="tiny-mixtral", moe_topk=1), "--moe-topk 1"),
    (dict(preset="tiny-mixtral", moe_aux_loss_coeff=-1.0), "--moe-aux-loss-coeff must be >= 0"),
])
def test_bad_moe_layouts_are_refused_by_name(kw: dict, message: str) -> None:
    cfg = _cfg(**kw)
    with pytest.raises(MConvertError, match=re.escape(message)):
        cfg.validate()
        build_spec(cfg, 1000)


@pytest.mark.timeout(300)
def test_moe_resume_continues_the_same_run_and_refuses_another_ep(tmp_path: Path) -> None:
    """EP=2 checkpoint at step 2, resumed to 4: the same losses as one run to 4 (experts, router and their Adam
    state come back per EP rank); resuming it at EP=1 is refused before training."""
    layout = dict(preset="tiny-mixtral", dp=2, ep=2)
    straight = train(_cfg(steps=4, **layout))["losses"]
    ckpt = tmp_path / "ckpt"
    train(_cfg(steps=2, save=str(ckpt), **layout))
    resumed = train(_cfg(steps=4, save=str(ckpt), resume=True, **layout))["losses"]
    assert len(resumed) == 2
    assert max(abs(a - b) for a, b in zip(resumed, straight[2:], strict=True)) <= TOL
    with pytest.raises(MConvertError, match=r"EP=1"):
        train(_cfg(steps=6, save=str(ckpt), resume=True, preset="tiny-mixtral", dp=2, ep=1))


def test_flops_count_the_k_experts_a_token_meets() -> None:
    """`num_floating_point_operations_so_far` counts k of E experts per token, as Megatron's MoE formula does."""
    from mconvert.mappings.families import preset
    from mconvert.trainer.train import active_parameters

    spec = preset("tiny-mixtral")
    H, F, L, E, k = spec.hidden_size, spec.expert_ffn_hidden_size, spec.num_layers, spec.num_experts, spec.moe_router_topk
    assert active_parameters(spec) == spec.num_parameters() - L * (E - k) * 3 * H * F  # SwiGLU: gate, up, down
    dense = preset("tiny-llama")
    assert active_parameters(dense) == dense.num_parameters()


@pytest.mark.timeout(120)
def test_cli_refuses_an_ep_that_does_not_divide_dp_in_one_line(tmp_path: Path) -> None:
    import subprocess
    import sys

    out = tmp_path / "never"
    r = subprocess.run([sys.executable, "-m", "mconvert.cli", "train", "--preset", "tiny-mixtral", "--dp", "2",
                        "--ep", "4", "--steps", "1", "--save", str(out)],
                       capture_output=True, text=True, timeout=100)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "--ep 4 must divide DP=2" in r.stderr and not out.exists()


def _mcore_load_balancing_loss(spec: ModelSpec, cfg: TrainConfig, tokens: torch.Tensor) -> float:
    """megatron-core's `load_balancing_loss` of step 1 (`track_moe_metrics`: each layer's aux loss ÷ its
    coefficient, mean over micro-batches and layers), from its own `switch_load_balancing_loss_func` on the
    router logits of our single-rank model at the run's seed, fed the run's micro-batches."""
    from megatron.core.transformer.moe.moe_utils import switch_load_balancing_loss_func

    model = GPTModel(spec, ParallelState(), seed=cfg.seed)
    per_layer: list[float] = []

    def hook(moe: torch.nn.Module, args: tuple) -> None:
        h = args[0].reshape(-1, spec.hidden_size)
        logits = torch.nn.functional.linear(h, moe.router.weight).float()
        routed = torch.zeros_like(logits).scatter_(1, logits.topk(spec.moe_router_topk, dim=-1).indices, 1.0)
        aux = switch_load_balancing_loss_func(torch.softmax(logits, dim=-1), routed.sum(dim=0), h.shape[0],
                                              spec.moe_router_topk, spec.num_experts, cfg.moe_aux_loss_coeff)
        per_layer.append(float(aux) / cfg.moe_aux_loss_coeff)

    for moe in model.moe_layers():
        moe.register_forward_pre_hook(hook)
    with torch.no_grad():
        for mb in get_micro_batches(cfg, ParallelState(), tokens, 0, spec):
            model(mb["tokens"], mb["labels"])
    assert len(per_layer) == spec.num_layers * cfg.num_micro_batches
    return sum(per_layer) / len(per_layer)


@pytest.mark.timeout(300)
def test_training_logs_the_load_balancing_loss_as_megatron_core_computes_it(tmp_path: Path) -> None:
    """Each step logs megatron-core's `load_balancing_loss` beside the LM loss (and `--json` lists it)."""
    import json
    import subprocess
    import sys

    cfg = _cfg(preset="tiny-mixtral", steps=1, tp=1, pp=1, dp=1)
    tokens, vocab = prepare_tokens(None, write=False)
    spec = build_spec(cfg, vocab)
    got = _train(cfg, spec, tokens, ParallelState())["load_balancing_losses"]
    want = _mcore_load_balancing_loss(spec, cfg, tokens)
    assert len(got) == 1 and abs(got[0] - want) <= 1e-5 * want, (got, want)
    assert 0.5 < want < 4  # about 1 for the near-uniform router at init: not a comparison of two zeros

    cmd = [sys.executable, "-m", "mconvert.cli", "train", "--preset", "tiny-mixtral", "--steps", "2", "--json",
           "--seq-length", "32", "--global-batch-size", "4", "--micro-batch-size", "2"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert len(out["losses"]) == len(out["load_balancing_losses"]) == 2
    lines = [ln for ln in res.stderr.splitlines() if ln.lstrip().startswith("iteration")]
    assert len(lines) == 2 and all(f"load_balancing_loss {v:.6f}" in ln
                                   for ln, v in zip(lines, out["load_balancing_losses"])), lines
