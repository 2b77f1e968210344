"""Optimizer states across formats: the trainer's Adam states (torch rank files) <-> megatron-core's distributed
optimizer (`fully_reshardable`, torch_dist), proven by the programs that resume from them.

- megatron-core trains with its distributed optimizer and saves torch_dist; `reshard --with-optimizer --format
  torch` gives trainer Adam states, and back to torch_dist megatron-core resumes from them and takes the same
  next step as the run that went straight on;
- the built-in trainer saves Adam states; through torch_dist and back the trainer resumes with the same losses;
- synthetic states that are functions of their parameter (exp_avg = 2·p, exp_avg_sq = |p|) keep that relation
  through torch -> torch_dist -> torch at other layouts (VPP included); what cannot be carried is refused.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import transformers
from mcore_ref import run_mcore
from test_convert_optimizer import _add_optimizer, _check_states
from test_external_mcore import SPECS
from test_torch_dist_write import _dcp_read_all, _load_go_on, _train_save_go_on

from mconvert.convert.verbs import hf_to_megatron, reshard
from mconvert.io.atomic import MANIFEST
from mconvert.io.safeload import safe_load
from mconvert.errors import MConvertError

ITER = "iter_0000002"


def _tensor_names(model: dict) -> list[str]:
    return [k for k, v in model.items() if isinstance(v, torch.Tensor)]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_megatron_core_optimizer_through_trainer_states_resumes_in_megatron_core(tmp_path: Path) -> None:
    """megatron-core (TP=2, distributed optimizer) -> torch TP=1 with trainer Adam states (one group named by
    the model's keys, every parameter at step 2 with its own step tensor) -> torch_dist TP=2: every state tensor
    and the param groups are megatron-core's own again, and megatron-core resumed from it at TP=1 takes the
    same next step as the run that went straight on (loss within 1e-5)."""
    spec = SPECS["llama"]
    g = torch.Generator().manual_seed(5)
    batches = [torch.randint(0, spec.vocab_size, (2, 16), generator=g) for _ in range(4)]
    root = tmp_path / "mcore"
    straight = run_mcore(spec, 2, _train_save_go_on, (str(root), batches))
    rep = reshard(root, tmp_path / "torch", tp=1, pp=1, format="torch", with_optimizer=True)
    assert rep["format"] == "torch" and "re-sharded" in rep["optimizer"]
    st = safe_load(tmp_path / "torch" / ITER / "mp_rank_00" / "model_optim_rng.pt")
    [group] = st["optimizer"]["param_groups"]
    assert group["param_names"] == _tensor_names(st["model"]) and group["lr"] == 1e-2
    assert "wd_mult" not in group and "step" not in group  # megatron-core's own keys stay behind
    states = st["optimizer"]["state"]
    assert {float(s["step"]) for s in states.values()} == {2.0}
    assert len({id(s["step"]) for s in states.values()}) == len(states)  # torch's Adam adds to each in place
    for pid, name in zip(group["params"], group["param_names"]):
        assert set(states[pid]) == {"step", "exp_avg", "exp_avg_sq"}
        assert states[pid]["exp_avg"].shape == st["model"][name].shape

    rep = reshard(tmp_path / "torch", tmp_path / "dist", tp=2, pp=1, format="torch_dist", with_optimizer=True)
    assert rep["format"] == "torch_dist"
    ours, ref = _dcp_read_all(tmp_path / "dist" / ITER), _dcp_read_all(root / ITER)
    opt_keys = sorted(k for k in ref if k.startswith("optimizer.state."))
    assert opt_keys and opt_keys == sorted(k for k in ours if k.startswith("optimizer.state."))
    for k in opt_keys:
        assert torch.equal(ours[k], ref[k]), k
    common = torch.load(tmp_path / "dist" / ITER / "common.pt", weights_only=False)  # our own file
    ref_common = torch.load(root / ITER / "common.pt", weights_only=False)  # megatron-core's, just written
    assert common["optimizer"] == ref_common["optimizer"]
    [resumed] = run_mcore(spec, 1, _load_go_on, (str(tmp_path / "dist" / ITER), batches))
    print(f"next-step loss: straight on {straight[0]:.7f}; resumed through trainer states {resumed:.7f}")
    assert abs(resumed - straight[0]) <= 1e-5 * abs(straight[0])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_trainer_adam_states_through_torch_dist_resume_the_trainer(tmp_path: Path) -> None:
    """The trainer (TP=2) saves at step 2; torch -> torch_dist (TP=1) -> torch (TP=1 PP=2) with the optimizer:
    the trainer resumed there has the losses of steps 3 and 4 of the run that went straight on (step 4's
    loss depends on the Adam states of step 3's update)."""
    import mconvert.trainer.train as train_mod

    run = dict(micro_batch_size=2, global_batch_size=4, seq_length=32, quiet=True, seed=7, preset="tiny-llama",
               num_layers=4)

    def train(save: Path, tp: int, pp: int, steps: int, resume: bool = False) -> list[float]:
        cfg = train_mod.TrainConfig(tp=tp, pp=pp, steps=steps, save=str(save), resume=resume, force=not resume,
                                    **run)
        return train_mod.train(cfg)["losses"]

    ckpt = tmp_path / "ckpt"
    train(ckpt, 2, 1, 2)
    shutil.copytree(ckpt, tmp_path / "same")
    want = train(tmp_path / "same", 2, 1, 4, resume=True)
    reshard(ckpt, tmp_path / "dist", tp=1, pp=1, format="torch_dist", with_optimizer=True)
    common = safe_load(tmp_path / "dist" / ITER / "common.pt")
    groups = common["optimizer"]["optimizer"]["param_groups"]
    assert [g["wd_mult"] for g in groups] == [1.0, 0.0] and {g["step"] for g in groups} == {2.0}
    reshard(tmp_path / "dist", tmp_path / "back", tp=1, pp=2, format="torch", with_optimizer=True)
    got = train(tmp_path / "back", 1, 2, 4, resume=True)
    print(f"losses of steps 3, 4: straight on {want}; resumed through torch_dist {got}")
    assert len(got) == len(want) == 2
    for a, b in zip(got, want):
        assert abs(a - b) <= 1e-5 * abs(b), (got, want)


def _gpt2(tmp_path: Path) -> Path:
    cfg = transformers.GPT2Config(n_embd=32, n_layer=4, n_head=4, vocab_size=100, n_positions=16)
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(tmp_path / "hf")
    return tmp_path / "hf"


@pytest.mark.timeout(300)
def test_synthetic_states_keep_their_relation_through_torch_dist(tmp_path: Path) -> None:
    """exp_avg = 2·p and exp_avg_sq = |p| on every rank after torch (TP2 PP2 VPP2) -> torch_dist (TP1) ->
    torch (TP2 PP1 and back to TP2 PP2 VPP2, byte for byte the first files' model and states); in torch_dist
    the `param` state is the weight in fp32 and the groups carry the trainer's lr and the shared step."""
    hf_to_megatron(_gpt2(tmp_path), tmp_path / "a", tp=2, pp=2, vpp=2)
    _add_optimizer(tmp_path / "a")
    reshard(tmp_path / "a", tmp_path / "d", tp=1, pp=1, format="torch_dist", with_optimizer=True)
    dist = _dcp_read_all(tmp_path / "d" / "release")
    weights = [k for k in dist if isinstance(dist[k], torch.Tensor) and not k.startswith("optimizer.")]
    assert weights
    for k in weights:
        assert torch.equal(dist[f"optimizer.state.param.{k}"], dist[k].float()), k
        assert torch.equal(dist[f"optimizer.state.exp_avg.{k}"], 2 * dist[k]), k
    groups = safe_load(tmp_path / "d" / "release" / "common.pt")["optimizer"]["optimizer"]["param_groups"]
    assert [(g["wd_mult"], g["lr"], g["max_lr"], g["step"]) for g in groups] == [(1.0, 1e-3, 1e-3, 3.0),
                                                                                  (0.0, 1e-3, 1e-3, 3.0)]
    reshard(tmp_path / "d", tmp_path / "b", tp=2, pp=1, format="torch", with_optimizer=True)
    assert _check_states(tmp_path / "b") == 2 * (4 * 12 + 4)
    reshard(tmp_path / "d", tmp_path / "c", tp=2, pp=2, vpp=2, format="torch", with_optimizer=True)
    for f in sorted((tmp_path / "a").rglob("model_optim_rng.pt")):
        a, c = safe_load(f), safe_load(tmp_path / "c" / f.relative_to(tmp_path / "a"))
        ga, gc = a["optimizer"]["param_groups"][0], c["optimizer"]["param_groups"][0]
        assert {k: v for k, v in ga.items() if k != "params"} == {k: v for k, v in gc.items()
                                                                  if k in ga and k != "params"}
        for k in ("model0", "model1"):
            assert list(a[k]) == list(c[k])
            assert all(torch.equal(a[k][n], c[k][n]) for n in _tensor_names(a[k]))
        for pa, pc in zip(ga["params"], gc["params"]):
            sa, sc = a["optimizer"]["state"][pa], c["optimizer"]["state"][pc]
            assert sa.keys() == sc.keys() and all(torch.equal(sa[s], sc[s]) for s in sa)


def _edit(path: Path, fn) -> None:
    st = dict(safe_load(path))
    fn(st)
    torch.save(st, path.with_suffix(".tmp"))
    path.with_suffix(".tmp").replace(path)


@pytest.mark.timeout(300)
def test_states_that_do_not_map_are_refused_by_name(tmp_path: Path) -> None:
    """Trainer states at different steps, or in groups with different hyperparameters, do not fit megatron-core's
    one step and its groups; megatron-core groups with an lr_mult have no trainer group: each is one MConvertError naming the file and the key, and nothing is written."""
    hf_to_megatron(_gpt2(tmp_path), tmp_path / "a", tp=2)
    _add_optimizer(tmp_path / "a")
    rank0 = tmp_path / "a" / "release" / "mp_rank_00" / "model_optim_rng.pt"
    _edit(rank0, lambda st: st["optimizer"]["state"][4].__setitem__("step", torch.tensor(4.0)))
    with pytest.raises(MConvertError, match=r"different Adam steps \[3\.0, 4\.0\]"):
        reshard(tmp_path / "a", tmp_path / "o1", tp=1, pp=1, format="torch_dist", with_optimizer=True)

    def two_groups(st: dict) -> None:
        [g] = st["optimizer"]["param_groups"]
        half = len(g["params"]) // 2
        st["optimizer"]["param_groups"] = [
            {**g, "params": g["params"][:half], "param_names": g["param_names"][:half]},
            {**g, "lr": 5e-4, "params": g["params"][half:], "param_names": g["param_names"][half:]}]
        for s in st["optimizer"]["state"].values():
            s["step"] = torch.tensor(3.0)
    _edit(rank0, two_groups)
    with pytest.raises(MConvertError, match=r"mp_rank_00.*param groups 0 and 1 differ in 'lr'"):
        reshard(tmp_path / "a", tmp_path / "o2", tp=1, pp=1, format="torch_dist", with_optimizer=True)

    hf_to_megatron(tmp_path / "hf", tmp_path / "b", tp=2)
    _add_optimizer(tmp_path / "b")
    reshard(tmp_path / "b", tmp_path / "d", tp=1, pp=1, format="torch_dist", with_optimizer=True)
    (tmp_path / "d" / MANIFEST).unlink()  # both manifests: the edit stands for one Megatron-LM made
    (tmp_path / "d" / "release" / "integrity.json").unlink()
    common = tmp_path / "d" / "release" / "common.pt"
    _edit(common, lambda st: [g.__setitem__("lr_mult", 2.0 - g["wd_mult"])
                              for g in st["optimizer"]["optimizer"]["param_groups"]])
    with pytest.raises(MConvertError, match=r"common\.pt: megatron-core's param group 1 has lr_mult=2\.0"):
        reshard(tmp_path / "d", tmp_path / "o3", tp=2, pp=1, format="torch", with_optimizer=True)
    assert not any((tmp_path / o).exists() for o in ("o1", "o2", "o3"))


# ---- rng_state ----------------------------------------------------------------------------------------------
def _load_rng(ctx, ckpt_dir: str) -> object:
    """What Megatron-LM's load does for torch_dist rng: this rank's `rng_state` ShardedObject, loaded by
    megatron-core's dist_checkpointing.load."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    want = ShardedObject("rng_state", None, (ctx.pp, ctx.tp), (ctx.pp_rank, ctx.tp_rank), replica_id=0)
    return dist_checkpointing.load({"rng_state": want}, ckpt_dir)["rng_state"]


def _same_rng(a: object, b: object) -> bool:
    """Equal rng states: python / numpy tuples, torch byte tensors, nested in lists and dicts."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if hasattr(a, "shape") and hasattr(a, "dtype"):  # numpy array
        return bool((a == b).all()) and a.dtype == b.dtype  # type: ignore[attr-defined,union-attr]
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same_rng(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same_rng(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_rng_state_goes_into_torch_dist_and_back(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """megatron-core's legacy torch save (TP=2, an rng_state per rank) -> torch_dist: megatron-core's
    dist_checkpointing.load gives each rank its own rng list back; -> torch again: every rank file has its
    rng_state and its weights back."""
    from test_external_mcore import ITERATION, _saved

    spec, _, _, mcore_torch, _ = _saved("llama", 1, tmp_path_factory)
    it = f"iter_{ITERATION:07d}"
    reshard(mcore_torch, tmp_path / "dist", tp=2, pp=1, format="torch_dist")
    got = run_mcore(spec, 2, _load_rng, (str(tmp_path / "dist" / it),))
    for t in range(2):
        want = safe_load(mcore_torch / it / f"mp_rank_{t:02d}" / "model_optim_rng.pt")["rng_state"]
        assert _same_rng(got[t], want), t
    reshard(tmp_path / "dist", tmp_path / "back", tp=2, pp=1, format="torch")
    for t in range(2):
        rel_path = Path(it) / f"mp_rank_{t:02d}" / "model_optim_rng.pt"
        back, orig = safe_load(tmp_path / "back" / rel_path), safe_load(mcore_torch / rel_path)
        assert _same_rng(back["rng_state"], orig["rng_state"]), t
        assert sorted(_tensor_names(back["model"])) == sorted(_tensor_names(orig["model"]))
        assert all(torch.equal(back["model"][k], orig["model"][k]) for k in _tensor_names(orig["model"]))


@pytest.mark.timeout(300)
def test_moe_trainer_states_into_torch_dist_are_refused_by_name(tmp_path: Path, capsys) -> None:
    """megatron-core keeps a MoE model's expert parameters in a second (chained) distributed optimizer: trainer
    Adam states of Mixtral into torch_dist are one error line naming the reason, and no OUT."""
    from safety_common import assert_one_line_error, run_cli
    from test_moe import _random_hf

    hf_to_megatron(_random_hf("mixtral", tmp_path / "hf"), tmp_path / "a", tp=1, ep=2)
    _add_optimizer(tmp_path / "a")
    code, _, err = run_cli(["reshard", tmp_path / "a", tmp_path / "o", "--tp", "1", "--ep", "1", "--format",
                            "torch_dist", "--with-optimizer"], capsys)
    assert_one_line_error(code, err, "mp_rank_00_000", "mixture-of-experts", "chained")
    assert not (tmp_path / "o").exists()


@pytest.mark.timeout(300)
def test_rng_state_per_rank_and_an_incomplete_grid(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each rank file's own rng_state (TP=2 PP=2) comes back to the same rank through torch_dist; reading the
    rng objects leaves no file in the temporary directory, not even from a source nobody closes; a torch_dist
    checkpoint whose rng_state misses one (pp, tp) rank is refused naming that rank, not half carried."""
    import pickle
    import tempfile

    from mconvert.io.safeload import safe_load_dcp_metadata
    from mconvert.convert.sources import open_source

    hf_to_megatron(_gpt2(tmp_path), tmp_path / "a", tp=2, pp=2)
    files = sorted((tmp_path / "a").rglob("model_optim_rng.pt"))
    for i, f in enumerate(files):
        rng = [{"torch_rng_state": torch.manual_seed(i).get_state(), "rank": i}]
        _edit(f, lambda st, rng=rng: st.__setitem__("rng_state", rng))
    (tmp_path / "a" / MANIFEST).unlink()
    reshard(tmp_path / "a", tmp_path / "d", tp=2, pp=2, format="torch_dist")
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    reshard(tmp_path / "d", tmp_path / "b", tp=2, pp=2, format="torch")
    for i, f in enumerate(files):
        back = safe_load(tmp_path / "b" / f.relative_to(tmp_path / "a"))["rng_state"]
        assert back[0]["rank"] == i and torch.equal(back[0]["torch_rng_state"], torch.manual_seed(i).get_state())
    unclosed = open_source(tmp_path / "d")
    assert unclosed.top_level(1, 1)["rng_state"][0]["rank"] == 3
    assert list((tmp_path / "tmp").iterdir()) == []
    md_file = tmp_path / "d" / "release" / ".metadata"
    md = safe_load_dcp_metadata(md_file)
    del md.state_dict_metadata["rng_state/shard_1.0_2.2"]
    md.storage_data = {k: v for k, v in md.storage_data.items() if k.fqn != "rng_state/shard_1.0_2.2"}
    with open(md_file, "wb") as fh:
        pickle.dump(md, fh)  # our own metadata, one entry fewer
    (tmp_path / "d" / MANIFEST).unlink()
    (tmp_path / "d" / "release" / "integrity.json").unlink()
    with pytest.raises(MConvertError, match=r"rng_state is saved for 3 of the 4 \(pp, tp\) ranks; rank \(1, 0\)"):
        open_source(tmp_path / "d")
