"""Multi-process trainer checks (CPU, gloo), each against truth we did not write where one exists:

- TP=2 PP=2 and TP=2 DP=2 (4 processes), tiny-llama and tiny-gpt2: process groups in Megatron order, the
  sharded init's logits and one step's gradients equal the TP=1 PP=1 model (≤ 1e-5), loss goes down, the
  comm report holds the collectives each layout needs;
- megatron-core 0.16.1's GPTModel (local spec, tests/helpers/mcore_ref.py) loads every rank's `model` strict at the
  same TP/PP and its logits equal our native multi-process run (`megatron_logits`);
- resume 10 + 10 == 20 straight (losses and final tensors identical), bf16 storage, --steps 0.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from mconvert.mappings.families import spec_from_megatron_args
from mconvert.layouts.megatron import rank_file, read_latest
from mconvert.io.safeload import safe_load
from mconvert.mappings.transforms import merge
from mconvert.spec import ModelSpec
from mconvert.trainer.infer import megatron_logits, pipeline_logits
from mconvert.trainer.model import GPTModel
from mconvert.trainer.parallel import ParallelState, global_rank, group_ranks, init_distributed
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
PROBE = torch.randint(0, 1000, (2, 24), generator=torch.Generator().manual_seed(11))


def _cfg(**kw) -> TrainConfig:
    base = dict(seq_length=32, micro_batch_size=2, global_batch_size=8, lr=2e-3, seed=42, quiet=True)
    base.update(kw)
    return TrainConfig(**base)


def _probe_then_train(cfg: TrainConfig, spec: ModelSpec, tokens: torch.Tensor, out_dir: str) -> dict:
    """Runs on every rank: init logits, one step's synced grads (saved to out_dir), then the real loop."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    st = init_distributed(cfg.tp, cfg.pp, cfg.dp, sequence_parallel=cfg.sequence_parallel)
    model = GPTModel(spec, st, seed=cfg.seed)
    logits, _ = pipeline_logits(model, st, PROBE)
    forward_backward_1f1b(model, get_micro_batches(cfg, st, tokens, 0, spec), st, torch.float32)
    sync_gradients(model, st)
    groups = {k: (dist.get_process_group_ranks(getattr(st, f"{k}_group")) if getattr(st, f"{k}_group") else None)
              for k in ("tp", "dp", "pp")}
    torch.save({"tp": st.tp_rank, "pp": st.pp_rank, "dp": st.dp_rank, "layers": model.global_layers,
                "grads": {n: p.grad for n, p in model.named_parameters()}, "logits": logits, "groups": groups},
               Path(out_dir) / f"rank{st.rank}.pt")
    del model
    try:
        return _train(cfg, spec, tokens, st)
    finally:
        dist.destroy_process_group()


def _global_name(key: str, layers: list[int]) -> str:
    if key.startswith("decoder.layers."):
        local = int(key.split(".")[2])
        return key.replace(f"decoder.layers.{local}.", f"decoder.layers.{layers[local]}.", 1)
    return key


def _reference(spec: ModelSpec, cfg: TrainConfig, tokens: torch.Tensor):
    """The same seed at TP=1 PP=1 DP=1, one process, no torch.distributed: logits and one step's grads."""
    st = ParallelState()
    model = GPTModel(spec, st, seed=cfg.seed)
    with torch.no_grad():
        logits = model(PROBE)[..., : spec.vocab_size]
    one = _cfg(tp=1, pp=1, dp=1, seed=cfg.seed)
    forward_backward_1f1b(model, get_micro_batches(one, st, tokens, 0, spec), st, torch.float32)
    return logits, {n: p.grad for n, p in model.named_parameters()}


LAYOUTS = [
    ("tiny-llama", dict(tp=2, pp=2, dp=1)),
    ("tiny-gpt2", dict(tp=2, pp=2, dp=1)),
    ("tiny-llama", dict(tp=2, pp=1, dp=2)),
    ("tiny-gpt2", dict(tp=2, pp=1, dp=2)),
    ("tiny-gpt2", dict(tp=2, pp=2, dp=1, sequence_parallel=True)),  # learned positions + tied head under SP
]


@pytest.mark.parametrize("name,layout", LAYOUTS, ids=[f"{n}-tp{d['tp']}pp{d['pp']}dp{d['dp']}{'-sp' if d.get('sequence_parallel') else ''}" for n, d in LAYOUTS])
def test_sharded_run_equals_single_rank_and_trains(tmp_path, name, layout):
    steps = 8
    cfg = _cfg(preset=name, steps=steps, save=str(tmp_path / "ckpt"), comm_report=True, **layout)
    tokens, vocab = prepare_tokens(None, write=False)
    spec = build_spec(cfg, vocab)
    results = launch(_probe_then_train, (cfg, spec, tokens, str(tmp_path)), cfg.world)
    world = cfg.world
    probes = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(world)]

    # process groups are Megatron's order
    expect = group_ranks(cfg.tp, cfg.dp, cfg.pp)
    for r, p in enumerate(probes):
        assert global_rank(p["tp"], p["dp"], p["pp"], cfg.tp, cfg.dp) == r
        for k, kind in (("tp", "TP"), ("dp", "DP"), ("pp", "PP")):
            mine = next(g for g in expect[kind] if r in g)
            assert p["groups"][k] == (mine if len(mine) > 1 else None)

    ref_logits, ref_grads = _reference(spec, cfg, tokens)
    logits = next(p["logits"] for p in probes if p["logits"] is not None)
    logit_diff = (logits - ref_logits).abs().max().item()
    assert logit_diff <= TOL

    # merge the DP-rank-0 gradient shards back to full tensors; compare every parameter
    shards: dict[str, dict[int, torch.Tensor]] = {}
    for p in probes:
        if p["dp"] != 0:
            continue
        for key, g in p["grads"].items():
            gname = _global_name(key, p["layers"])
            if key == "output_layer.weight" and spec.tie_embeddings:
                gname = "embedding.word_embeddings.weight"  # the last stage's synced copy
                key = "copy"
            shards.setdefault(gname + ("#copy" if key == "copy" else ""), {})[p["tp"]] = g
    assert {k.split("#")[0] for k in shards} == set(ref_grads)
    worst = 0.0
    for k, by_tp in shards.items():
        gname = k.split("#")[0]
        full = merge([by_tp[t] for t in range(cfg.tp)], spec.split_kind(gname), gname)
        worst = max(worst, (full - ref_grads[gname]).abs().max().item())
    assert worst <= TOL, worst
    print(f"[figures] {name} {layout}: init logits max|Δ| {logit_diff:.2e}, step-1 grads max|Δ| {worst:.2e}")

    out = {}
    for r in sorted(results):
        out.update(results[r] or {})
    losses = out["losses"]
    assert len(losses) == steps and losses[-1] < losses[0] - 0.2, losses
    print(f"[figures] {name} {layout}: losses {[round(x, 4) for x in losses]}")

    # the comm report measured what this layout needs
    seen = {(row[0], row[1]) for row in out["comm"]}
    assert ("all-reduce", "TP") in seen and ("broadcast", "TP") in seen
    assert (("send/recv", "PP") in seen) == (cfg.pp > 1)
    sp = cfg.sequence_parallel
    assert (("all-gather", "TP") in seen) == sp and (("reduce-scatter", "TP") in seen) == sp
    assert (("all-reduce", "DP") in seen) == (cfg.dp > 1)
    assert (("all-reduce", "embedding") in seen) == (cfg.pp > 1 and spec.tie_embeddings)

    # checkpoint layout: only DP rank 0 wrote; tracker names the last iteration; Adam names its params
    ckpt = Path(cfg.save)
    assert read_latest(ckpt) == steps
    files = sorted(p.parent.name for p in (ckpt / f"iter_{steps:07d}").glob("*/model_optim_rng.pt"))
    assert len(files) == cfg.tp * cfg.pp
    state = safe_load(rank_file(ckpt, steps, 1, cfg.pp - 1, cfg.pp))
    assert state["checkpoint_version"] == 3.0 and state["iteration"] == steps
    args = state["args"]
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.data_parallel_size) == (
        cfg.tp, cfg.pp, cfg.dp)
    assert args.padded_vocab_size == spec.padded_vocab_size(cfg.tp) and args.vocab_size == 1000
    opt = state["optimizer"]
    names = opt["param_groups"][0]["param_names"]
    assert names == [k for k, v in state["model"].items() if v is not None]
    for i, n in enumerate(names):
        assert opt["state"][i]["exp_avg"].shape == state["model"][n].shape
    assert {"random_rng_state", "np_rng_state", "torch_rng_state", "rng_tracker_states"} <= set(state["rng_state"][0])

    if (name, layout["pp"]) in (("tiny-llama", 2), ("tiny-gpt2", 1)):
        _check_against_mcore(ckpt, spec, cfg, steps)


def _check_against_mcore(ckpt: Path, spec: ModelSpec, cfg: TrainConfig, it: int) -> None:
    """megatron-core loads each rank file strict (same TP/PP) and its logits equal our native run's."""
    from mcore_ref import mcore_forward_logits

    sds = [safe_load(rank_file(ckpt, it, t, p, cfg.pp))["model"] for p in range(cfg.pp) for t in range(cfg.tp)]
    ref = mcore_forward_logits(spec, cfg.tp, PROBE, sds, pp=cfg.pp)[..., : spec.vocab_size]
    ours = megatron_logits(ckpt, PROBE)
    assert ours.shape == (2, 24, 1000)
    diff = (ours - ref).abs().max().item()
    print(f"[figures] mcore TP={cfg.tp} PP={cfg.pp}: strict load ok, logits max|Δ| {diff:.2e}")
    assert diff <= TOL


def test_resume_equals_straight_run_and_loads_into_mcore_at_tp1(tmp_path):
    """tiny-gpt2 (tied: the last stage's head copy is restored too) at TP=1 PP=2: 10 + resume 10 == 20."""
    a, b = tmp_path / "a", tmp_path / "b"
    first = train(_cfg(preset="tiny-gpt2", tp=1, pp=2, steps=10, save=str(a)))["losses"]
    second = train(_cfg(preset="tiny-gpt2", tp=1, pp=2, steps=20, save=str(a), resume=True))["losses"]
    straight = train(_cfg(preset="tiny-gpt2", tp=1, pp=2, steps=20, save=str(b)))["losses"]
    assert len(first) == 10 and len(second) == 10
    assert first + second == straight
    print(f"[figures] resume: 10+10 {[round(x, 4) for x in first + second]} == straight")
    for p in range(2):
        sa, sb = safe_load(rank_file(a, 20, 0, p, 2)), safe_load(rank_file(b, 20, 0, p, 2))
        for k, v in sa["model"].items():
            assert (v is None and sb["model"][k] is None) or torch.equal(v, sb["model"][k]), k
        assert torch.equal(sa["optimizer"]["state"][0]["exp_avg_sq"], sb["optimizer"]["state"][0]["exp_avg_sq"])
    assert (a / "tokenizer.json").is_file() and (a / "tokenizer_config.json").is_file()
    spec = spec_from_megatron_args(safe_load(rank_file(b, 20, 0, 0, 2))["args"])
    _check_against_mcore(b, spec, _cfg(tp=1, pp=2), 20)


def test_bf16_and_steps0(tmp_path):
    """--dtype bf16 stores every model tensor in bf16 (args.bf16); --steps 0 writes the seeded init."""
    out = train(_cfg(preset="tiny-llama", tp=2, pp=1, steps=3, dtype="bf16", save=str(tmp_path / "bf")))
    assert len(out["losses"]) == 3
    st = safe_load(rank_file(tmp_path / "bf", 3, 1, 0, 1))
    assert st["args"].bf16 and st["args"].params_dtype == "torch.bfloat16"
    assert {v.dtype for v in st["model"].values() if v is not None} == {torch.bfloat16}
    train(_cfg(preset="tiny-llama", tp=1, pp=2, steps=0, save=str(tmp_path / "init")))
    assert read_latest(tmp_path / "init") == 0
    spec = out["spec"].replace(params_dtype="float32")
    ref = GPTModel(spec, ParallelState(), seed=42).state_dict()
    got = safe_load(rank_file(tmp_path / "init", 0, 0, 1, 2))["model"]
    assert torch.equal(got["decoder.layers.0.mlp.linear_fc1.weight"], ref["decoder.layers.1.mlp.linear_fc1.weight"])
    assert torch.equal(got["output_layer.weight"], ref["output_layer.weight"])
    shutil.rmtree(tmp_path / "init")


def test_single_process_run_after_parent_used_openmp(tmp_path):
    """A forked rank after this process used its OpenMP pool must not deadlock (launch keeps forked ranks
    single-threaded); the 1-rank checkpoint runs natively and gives the logits of the file loaded here."""
    a = torch.randn(256, 256)
    for _ in range(5):
        a = (a @ a).tanh()  # this process has now used its OpenMP pool
    out = train(_cfg(preset="tiny-llama", tp=1, pp=1, steps=3, save=str(tmp_path / "one")))
    assert len(out["losses"]) == 3
    state = safe_load(rank_file(tmp_path / "one", 3, 0, 0, 1))
    model = GPTModel(out["spec"], ParallelState(), seed=None)
    model.load_state_dict(state["model"], strict=True)
    with torch.no_grad():
        ref = model(PROBE)[..., :1000]
    logits, hidden = megatron_logits(tmp_path / "one", PROBE, return_hidden=True)
    assert len(hidden) == out["spec"].num_layers + 1 and hidden[0].shape == (2, 24, out["spec"].hidden_size)
    assert (logits - ref).abs().max().item() <= TOL
