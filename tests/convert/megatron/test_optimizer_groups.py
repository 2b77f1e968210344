"""Weight-decay param groups across formats: the trainer's AdamW groups are megatron-core's (`wd_mult` 1 for
weights, 0 for biases and 1-d parameters), judged by megatron-core's own `get_standard_config_overrides`;
megatron-core runs with weight decay reshard with their optimizer into trainer states and back, and megatron-core
resumed from them takes the step the straight run took; one-group trainer checkpoints still resume.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from mcore_ref import run_mcore
from test_external_mcore import SPECS

from mconvert.convert.verbs import reshard
from mconvert.io.safeload import safe_load

ITER = "iter_0000002"
WD = 0.1


def _mcore_wd_mult(name: str, tensor: torch.Tensor) -> float:
    """megatron-core 0.16.1's own rule: the standard overrides give wd_mult 0 to the parameters they match."""
    from megatron.core.optimizer import OptimizerConfig, get_standard_config_overrides

    overrides = get_standard_config_overrides(OptimizerConfig(lr=1e-3))
    return 0.0 if any(k.matches(tensor, name) for k in overrides) else 1.0


def _check_groups(st: dict, model_key: str = "model") -> None:
    """Every parameter sits in the group of its megatron-core wd_mult, whose weight_decay is WD · wd_mult."""
    groups = st["optimizer"]["param_groups"]
    assert [g["wd_mult"] for g in groups] == [1.0, 0.0]
    for g in groups:
        assert g["weight_decay"] == pytest.approx(WD * g["wd_mult"]) and g["lr_mult"] == 1.0
        assert g["param_names"]
        for name in g["param_names"]:
            assert _mcore_wd_mult(name, st[model_key][name]) == g["wd_mult"], name


RUN = dict(micro_batch_size=2, global_batch_size=4, seq_length=32, quiet=True, seed=7, preset="tiny-llama",
           num_layers=2)


def _train(save: Path, steps: int, resume: bool = False, wd: float = WD, tp: int = 1) -> list[float]:
    import mconvert.trainer.train as train_mod

    cfg = train_mod.TrainConfig(tp=tp, pp=1, steps=steps, save=str(save), resume=resume, force=not resume,
                                weight_decay=wd, **RUN)
    return train_mod.train(cfg)["losses"]


@pytest.mark.timeout(600)
def test_trainer_groups_are_megatron_cores_and_resume_through_torch_dist(tmp_path: Path) -> None:
    """The trainer with --weight-decay 0.1 saves megatron-core's two groups (membership by megatron-core's rule);
    through torch_dist (groups keyed by wd_mult, weight_decay 0.1 / 0.0) and back to torch the trainer resumes
    with the losses of the run that went straight on, and the decay acts (losses differ from a run without)."""
    ckpt = tmp_path / "ckpt"
    _train(ckpt, 2)
    _check_groups(safe_load(ckpt / ITER / "mp_rank_00" / "model_optim_rng.pt"))
    shutil.copytree(ckpt, tmp_path / "same")
    want = _train(tmp_path / "same", 4, resume=True)
    reshard(ckpt, tmp_path / "dist", tp=1, pp=1, format="torch_dist", with_optimizer=True)
    groups = safe_load(tmp_path / "dist" / ITER / "common.pt")["optimizer"]["optimizer"]["param_groups"]
    assert [(g["wd_mult"], g["weight_decay"]) for g in groups] == [(1.0, WD), (0.0, 0.0)]
    reshard(tmp_path / "dist", tmp_path / "back", tp=1, pp=1, format="torch", with_optimizer=True)
    _check_groups(safe_load(tmp_path / "back" / ITER / "mp_rank_00" / "model_optim_rng.pt"))
    got = _train(tmp_path / "back", 4, resume=True)
    assert len(got) == 2 and all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(got, want)), (got, want)
    shutil.copytree(ckpt, tmp_path / "nowd")
    other = _train(tmp_path / "nowd", 4, resume=True, wd=0.0)
    assert other != want  # the weight decay is applied


@pytest.mark.timeout(600)
def test_one_group_trainer_checkpoint_still_resumes(tmp_path: Path) -> None:
    """A weight-decay run's checkpoint with its Adam states put into one group for every parameter (the form a
    run without weight decay saves) resumes into the two groups, each state back on its parameter: the losses of
    the run that went straight on."""
    ckpt = tmp_path / "ckpt"
    _train(ckpt, 2)
    shutil.copytree(ckpt, tmp_path / "same")
    want = _train(tmp_path / "same", 4, resume=True)
    f = ckpt / ITER / "mp_rank_00" / "model_optim_rng.pt"
    st = dict(safe_load(f))
    g0, g1 = st["optimizer"]["param_groups"]
    one = {k: v for k, v in g0.items() if k not in ("wd_mult", "lr_mult", "params", "param_names")}
    one.update(decoupled_weight_decay=False, param_names=g0["param_names"] + g1["param_names"],
               params=g0["params"] + g1["params"])
    st["optimizer"] = {"state": st["optimizer"]["state"], "param_groups": [one]}
    torch.save(st, f.with_suffix(".tmp"))  # beside, then renamed: `st` still maps the old file
    f.with_suffix(".tmp").replace(f)
    for m in ckpt.rglob("*manifest*"):
        m.unlink()
    got = _train(ckpt, 4, resume=True)
    assert len(got) == 2 and all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(got, want)), (got, want)


def _with_wd(fn):
    """Run a harness function of test_torch_dist_write with megatron-core's own OptimizerParamScheduler setting
    each group's weight decay (WD · wd_mult), as Megatron-LM's training loop does."""
    def run(ctx, *a):
        import test_torch_dist_write as w
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        plain = w._dist_optimizer

        def scheduled(c):
            ddp, opt = plain(c)
            OptimizerParamScheduler(opt, init_lr=1e-2, max_lr=1e-2, min_lr=1e-2, lr_warmup_steps=0,
                                    lr_decay_steps=10, lr_decay_style="constant", start_wd=WD, end_wd=WD,
                                    wd_incr_steps=10, wd_incr_style="constant")
            return ddp, opt
        w._dist_optimizer = scheduled
        try:
            return fn(ctx, *a)
        finally:
            w._dist_optimizer = plain
    return run


def _train_save_go_on_wd(ctx, root: str, batches: list[torch.Tensor]) -> float:
    from test_torch_dist_write import _train_save_go_on
    return _with_wd(_train_save_go_on)(ctx, root, batches)


def _load_go_on_wd(ctx, ckpt_dir: str, batches: list[torch.Tensor]) -> float:
    from test_torch_dist_write import _load_go_on
    return _with_wd(_load_go_on)(ctx, ckpt_dir, batches)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_megatron_core_weight_decay_groups_through_trainer_states_resume(tmp_path: Path) -> None:
    """megatron-core (TP=2, distributed optimizer, weight decay 0.1 scheduled per wd_mult) -> torch TP=1 with
    trainer states in its two groups (membership by megatron-core's rule, weight_decay 0.1 / 0.0) -> torch_dist
    TP=2: megatron-core's param groups come back equal, and megatron-core resumed there at TP=1 takes the same
    next step as the run that went straight on (loss within 1e-5)."""
    spec = SPECS["llama"]
    g = torch.Generator().manual_seed(5)
    batches = [torch.randint(0, spec.vocab_size, (2, 16), generator=g) for _ in range(4)]
    root = tmp_path / "mcore"
    straight = run_mcore(spec, 2, _train_save_go_on_wd, (str(root), batches))
    ref_groups = safe_load(root / ITER / "common.pt")["optimizer"]["optimizer"]["param_groups"]
    assert sorted((g["wd_mult"], g["weight_decay"]) for g in ref_groups) == [(0.0, 0.0), (1.0, WD)]
    reshard(root, tmp_path / "torch", tp=1, pp=1, format="torch", with_optimizer=True)
    _check_groups(safe_load(tmp_path / "torch" / ITER / "mp_rank_00" / "model_optim_rng.pt"))
    reshard(tmp_path / "torch", tmp_path / "dist", tp=2, pp=1, format="torch_dist", with_optimizer=True)
    groups = safe_load(tmp_path / "dist" / ITER / "common.pt")["optimizer"]["optimizer"]["param_groups"]
    assert groups == ref_groups
    [resumed] = run_mcore(spec, 1, _load_go_on_wd, (str(tmp_path / "dist" / ITER), batches))
    print(f"next-step loss: straight on {straight[0]:.7f}; resumed through trainer states {resumed:.7f}")
    assert abs(resumed - straight[0]) <= 1e-5 * abs(straight[0])


def _mcore_groups(**over) -> dict:
    """common.pt's `optimizer` entry with megatron-core's two default groups (weight decay 0.1 on wd_mult 1)."""
    base = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "amsgrad": False, "step": 2}
    groups = [{"wd_mult": m, "lr_mult": 1.0, "is_expert_parallel": False, "is_decoupled_lr": False,
               "default_config": True, "max_lr": 1e-3, "min_lr": 1e-3, "weight_decay": WD * m, **base}
              for m in (1.0, 0.0)]
    for g, key, value in over.get("edits", []):
        groups[g][key] = value
    return {"optimizer": {"param_groups": groups}, "param_state_sharding_type": "fully_reshardable"}


@pytest.mark.parametrize(("edits", "message"), [
    ([(1, "lr_mult", 0.5)], r"param group 1 has lr_mult=0\.5"),
    ([(0, "is_decoupled_lr", True)], r"param group 0 has is_decoupled_lr=True"),
    ([(1, "is_expert_parallel", True)], r"param group 1 has is_expert_parallel=True"),
    ([(1, "wd_mult", 0.5)], r"wd_mult \[1\.0, 0\.5\] and differ"),
    ([(1, "step", 3)], r"different Adam steps \[2\.0, 3\.0\]"),
])
def test_megatron_core_groups_the_trainer_has_no_group_for_are_refused(edits: list, message: str) -> None:
    """Groups the trainer's wd_mult groups cannot hold are one MConvertError naming common.pt and the key."""
    from mconvert.convert.megatron.optimizer import to_trainer_optimizer
    from mconvert.errors import MConvertError

    with pytest.raises(MConvertError, match=r"^ckpt/common\.pt: .*" + message):
        to_trainer_optimizer(_mcore_groups(edits=edits), "ckpt/common.pt")


def test_groups_map_both_ways_by_wd_mult() -> None:
    """megatron-core's groups -> the trainer's (wd_mult / weight_decay kept, parameters placed by megatron-core's
    own rule) -> megatron-core's again, equal; one trainer group gives its hyperparameters to both groups."""
    from mconvert.convert.megatron.optimizer import to_mcore_optimizer, to_trainer_optimizer, trainer_group
    from mconvert.errors import MConvertError

    src = _mcore_groups()
    groups, step = to_trainer_optimizer(src, "c")
    assert step == 2.0 and [(g["wd_mult"], g["weight_decay"]) for g in groups] == [(1.0, WD), (0.0, 0.0)]
    for name, shape in (("decoder.layers.0.self_attention.linear_qkv.weight", (6, 4)),
                        ("decoder.layers.0.self_attention.linear_qkv.bias", (6,)),
                        ("decoder.final_layernorm.weight", (4,)), ("embedding.word_embeddings.weight", (9, 4)),
                        ("model0.decoder.layers.1.mlp.linear_fc1.layer_norm_weight", (4,))):
        t = torch.zeros(shape)
        assert groups[trainer_group(groups, name, t.dim())]["wd_mult"] == _mcore_wd_mult(name, t), name
    back = to_mcore_optimizer(groups, step, "t", min_lr=1e-3)
    assert back == src
    one = [{k: v for k, v in groups[0].items() if k not in ("wd_mult", "lr_mult")}]
    both = to_mcore_optimizer(one, step, "t")["optimizer"]["param_groups"]
    assert [(g["wd_mult"], g["weight_decay"]) for g in both] == [(1.0, WD), (0.0, WD)]
    with pytest.raises(MConvertError, match=r"^t: the trainer's param group 1 has wd_mult 0\.5"):
        to_mcore_optimizer([groups[0], {**groups[1], "wd_mult": 0.5}, {**groups[1], "wd_mult": 0.0}], step, "t")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("value", ["-0.1", "nan"])
def test_negative_or_nan_weight_decay_is_one_line(tmp_path: Path, capsys, value: str) -> None:
    """`train --weight-decay -0.1` / `nan`: one error line naming the flag, nothing written."""
    from safety_common import assert_one_line_error, run_cli

    code, _, err = run_cli(["train", "--steps", "1", "--weight-decay", value, "--save", tmp_path / "x"], capsys)
    assert_one_line_error(code, err, "--weight-decay must be >= 0")
    assert not (tmp_path / "x").exists()
