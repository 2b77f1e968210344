"""Adam states follow their parameters through a reshard, also with virtual pipeline chunks (`model<c>.` names).

The synthetic states are functions of the parameter shard they belong to (exp_avg = 2·p, exp_avg_sq = |p|),
so after any correct re-sharding the same relation must hold for every parameter on every rank."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from mconvert.convert.verbs import hf_to_megatron, reshard
from mconvert.io.safeload import safe_load
from mconvert.errors import MConvertError


def _add_optimizer(root: Path) -> None:
    for f in sorted(root.rglob("model_optim_rng.pt")):
        st = dict(safe_load(f))
        chunks = sorted(k for k in st if k.startswith("model"))
        names, state = [], {}
        for c in chunks:
            for k, v in st[c].items():
                if isinstance(v, torch.Tensor):
                    name = k if c == "model" else f"{c}.{k}"
                    state[len(names)] = {"step": torch.tensor(3.0), "exp_avg": 2 * v, "exp_avg_sq": v.abs()}
                    names.append(name)
        st["optimizer"] = {"state": state, "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8,
                                                             "weight_decay": 0.0, "params": list(range(len(names))),
                                                             "param_names": names}]}
        st["opt_param_scheduler"] = {"num_steps": 12}
        torch.save(st, f.with_suffix(".tmp"))
        f.with_suffix(".tmp").replace(f)
    (root / "mconvert-manifest.json").unlink(missing_ok=True)


def _check_states(root: Path) -> int:
    n = 0
    for f in sorted(root.rglob("model_optim_rng.pt")):
        st = safe_load(f)
        opt = st["optimizer"]
        group = opt["param_groups"][0]
        assert group["lr"] == 1e-3 and st["opt_param_scheduler"] == {"num_steps": 12}
        for pid, name in zip(group["params"], group["param_names"]):
            chunk, key = name.split(".", 1) if name.startswith("model") and name[5].isdigit() else ("model", name)
            p = st[chunk][key]
            s = opt["state"][pid]
            assert torch.equal(s["exp_avg"], 2 * p) and torch.equal(s["exp_avg_sq"], p.abs()), (f, name)
            assert float(s["step"]) == 3.0
            n += 1
    return n


def test_states_follow_params_through_vpp_and_tp(tmp_path):
    cfg = transformers.GPT2Config(n_embd=32, n_layer=4, n_head=4, vocab_size=100, n_positions=16)
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(tmp_path / "hf")
    hf_to_megatron(tmp_path / "hf", tmp_path / "a", tp=2, pp=2, vpp=2)
    _add_optimizer(tmp_path / "a")
    assert _check_states(tmp_path / "a") > 0
    reshard(tmp_path / "a", tmp_path / "b", tp=4, pp=1, with_optimizer=True)
    assert _check_states(tmp_path / "b") == 4 * (4 * 12 + 4)  # per rank: 4 layers × 12 + wte, wpe, ln_f w/b
    reshard(tmp_path / "b", tmp_path / "c", tp=2, pp=2, vpp=2, with_optimizer=True)
    _check_states(tmp_path / "c")
    for f in sorted((tmp_path / "a").rglob("model_optim_rng.pt")):
        a, c = safe_load(f), safe_load(tmp_path / "c" / f.relative_to(tmp_path / "a"))
        assert a["optimizer"]["param_groups"][0]["param_names"] == c["optimizer"]["param_groups"][0]["param_names"]
        for k in ("model0", "model1"):
            assert list(a[k]) == list(c[k])
            assert all(torch.equal(a[k][n], c[k][n]) for n in a[k] if isinstance(a[k][n], torch.Tensor))


def test_with_optimizer_needs_states(tmp_path):
    cfg = transformers.GPT2Config(n_embd=16, n_layer=2, n_head=2, vocab_size=50, n_positions=8)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(tmp_path / "hf")
    hf_to_megatron(tmp_path / "hf", tmp_path / "a", tp=2)
    with pytest.raises(MConvertError, match="no optimizer state to re-shard"):
        reshard(tmp_path / "a", tmp_path / "b", tp=1, pp=1, with_optimizer=True)
    assert not (tmp_path / "b").exists()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("key,bad", [("exp_avg", float("nan")), ("exp_avg_sq", float("inf")),
                                     ("master_param", float("-inf"))])
def test_nan_or_inf_in_optimizer_states_is_refused(tmp_path, capsys, key, bad):
    """One poisoned element in one Adam state (or a master copy kept beside them) on TP rank 1, PP stage 1:
    `reshard --with-optimizer` refuses naming the file, the parameter and the state key, and writes nothing.
    Without --with-optimizer the states are not read and the weights (all finite) reshard fine."""
    from safety_common import assert_one_line_error, run_cli

    cfg = transformers.GPT2Config(n_embd=16, n_layer=2, n_head=2, vocab_size=50, n_positions=8)
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(tmp_path / "hf")
    hf_to_megatron(tmp_path / "hf", tmp_path / "a", tp=2, pp=2)
    _add_optimizer(tmp_path / "a")
    f = tmp_path / "a" / "release" / "mp_rank_01_001" / "model_optim_rng.pt"
    st = dict(safe_load(f))
    group = st["optimizer"]["param_groups"][0]
    name = next(n for n in group["param_names"] if n.endswith("mlp.linear_fc1.weight"))
    s = st["optimizer"]["state"][group["param_names"].index(name)]
    s["master_param"] = st["model"][name].float().clone()
    s[key] = s[key].clone()
    s[key].view(-1)[5] = bad
    torch.save(st, f.with_suffix(".tmp"))  # not over the file safe_load has memory-mapped
    f.with_suffix(".tmp").replace(f)
    code, _, err = run_cli(["reshard", tmp_path / "a", tmp_path / "b", "--tp", "1", "--pp", "1",
                            "--with-optimizer"], capsys)
    assert_one_line_error(code, err, str(f), f"'{key}'", f"'{name}'", "NaN or Inf")
    assert not (tmp_path / "b").exists()
    code, _, err = run_cli(["reshard", tmp_path / "a", tmp_path / "c", "--tp", "1", "--pp", "1"], capsys)
    assert code == 0, err
