"""Adam state re-sharding helpers: index a torch Adam `state_dict()` by parameter name, and rebuild one.

The trainer saves `optimizer` = `torch.optim.Adam(...).state_dict()` built from `named_parameters()`, so
`param_groups[g]['param_names']` names each param id with its model state_dict key (stage-local layer index;
with virtual pipeline chunks the name is prefixed `model<c>.`). `exp_avg` / `exp_avg_sq` have the parameter's
sharded shape and follow its split kind; `step` is replicated. Across formats, the trainer's Adam states map to
and from megatron-core's `fully_reshardable` distributed optimizer (its param groups keyed by `wd_mult`,
`lr_mult`, `is_expert_parallel`, `is_decoupled_lr`; one `step` for all); what does not map is refused.
"""

from __future__ import annotations

import math
import sys
from typing import Any

import torch

from mconvert.io.casts import all_finite
from mconvert.errors import MConvertError, expect
from mconvert.mappings.transforms import merge, split

STATE_TENSORS = ("exp_avg", "exp_avg_sq")


def has_states(opt: Any) -> bool:
    """True when `opt` is a torch optimizer state_dict with per-parameter state (not an empty placeholder)."""
    return isinstance(opt, dict) and bool(opt.get("state")) and isinstance(opt.get("param_groups"), list)


def index_states(opt: dict, source: str) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
    """Adam state_dict -> ({param name: {'group': g, 'step', 'exp_avg', 'exp_avg_sq'}}, group hyperparameters).

    Needs `param_names` in every group (torch >= 2.6 records them when the optimizer is built from
    `named_parameters()`); without them the ids cannot be tied to parameters."""
    if not has_states(opt):
        raise MConvertError(f"{source}: no optimizer state to re-shard (optimizer is missing or empty); "
                            "drop --with-optimizer")
    fix = "the file is damaged — re-copy it or drop --with-optimizer"
    by_name: dict[str, dict[str, Any]] = {}
    groups: list[dict[str, Any]] = []
    states = expect(opt["state"], dict, f"{source}: optimizer state", fix)
    for g, group in enumerate(opt["param_groups"]):
        expect(group, dict, f"{source}: optimizer param_groups[{g}]", fix)
        names = group.get("param_names")
        if not isinstance(names, list) or len(names) != len(expect(group.get("params", []), list,
                                                                   f"{source}: optimizer param_groups[{g}].params", fix)):
            raise MConvertError(f"{source}: optimizer param_groups[{g}] has no param_names; build the optimizer "
                                "from model.named_parameters() so states can be tied to parameters")
        check_adam_hyper(group, source, f"optimizer param_groups[{g}]")
        groups.append(dict(group))  # key order kept; params / param_names are rebuilt per target rank
        for pid, name in zip(group["params"], names):
            st = expect(states.get(pid, {}), dict, f"{source}: optimizer state of parameter {name!r}", fix)
            if "step" in st:
                check_step(st["step"], source, f"the optimizer state of parameter {name!r}")
            by_name[name] = {"group": g, **st}
    return by_name, groups


def check_finite(state: dict[str, Any], param: str, source: str) -> None:
    """Refuse one parameter's optimizer state when any of its floating-point tensors (exp_avg, exp_avg_sq,
    max_exp_avg_sq, a master copy, ...) holds NaN or Inf: resuming from it would train on garbage."""
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and value.is_floating_point() and not all_finite(value):
            raise MConvertError(f"{source}: optimizer state {key!r} of parameter {param!r} holds NaN or Inf values; "
                                "the run diverged or the file is corrupt — convert an earlier iteration "
                                "(--iteration N) or drop --with-optimizer")


def build_state_dict(params: list[tuple[str, dict[str, Any]]], groups: list[dict[str, Any]]) -> dict[str, Any]:
    """[(param name, {'group', 'step', 'exp_avg', 'exp_avg_sq'})] in named_parameters order -> Adam state_dict.

    Ids are numbered group by group in order, as `torch.optim.Optimizer.state_dict()` numbers them."""
    state: dict[int, dict[str, Any]] = {}
    out_groups = []
    pid = 0
    for g, hyper in enumerate(groups):
        ids, names = [], []
        for name, st in params:
            if st["group"] != g:
                continue
            entry = {sys.intern(k): v for k, v in st.items() if k != "group"}
            if entry:
                state[pid] = entry
            ids.append(pid)
            names.append((name + ".")[:-1])  # a distinct str object, as the trainer's own (pickle memo identity)
            pid += 1
        fresh = {"params": ids, "param_names": names}
        group = {sys.intern(k): fresh.get(k, v) for k, v in hyper.items()}
        group.update({k: v for k, v in fresh.items() if k not in group})
        out_groups.append(group)
    return {"state": state, "param_groups": out_groups}


def merge_states(per_rank: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    """One parameter's states from every TP rank -> full-shape states (same split kind as the parameter)."""
    out: dict[str, Any] = {"group": per_rank[0]["group"]}
    if "step" in per_rank[0]:
        out["step"] = per_rank[0]["step"]
    for key in STATE_TENSORS:
        if key in per_rank[0]:
            if any(key not in r for r in per_rank):
                raise MConvertError(f"optimizer state {key!r} of {name} is missing on some TP ranks")
            out[key] = merge([r[key] for r in per_rank], kind, f"{name}.{key}")
    for k, v in per_rank[0].items():  # other per-parameter state (e.g. max_exp_avg_sq): kept when replicated
        if k not in out and k != "group":
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                out[k] = merge([r[k] for r in per_rank], kind, f"{name}.{k}")
            else:
                out[k] = v
    return out


def split_states(full: dict[str, Any], kind: str, tp: int, name: str) -> list[dict[str, Any]]:
    """Full-shape states -> one dict per target TP rank."""
    outs: list[dict[str, Any]] = [{} for _ in range(tp)]
    for k, v in full.items():
        if isinstance(v, torch.Tensor) and v.dim() > 0 and k != "step":
            for r, s in enumerate(split(v, kind, tp, f"{name}.{k}")):
                outs[r][k] = s
        else:
            for r in range(tp):
                outs[r][k] = v
    return outs


# ---- across formats: the trainer's Adam (torch rank files) <-> megatron-core's distributed optimizer ------------
# megatron-core 0.16.1 matches a saved param group to its own by these keys (`param_group_identifier_keys`)
MCORE_GROUP_KEYS = ("wd_mult", "lr_mult", "is_expert_parallel", "is_decoupled_lr")
# what `_get_param_groups` adds to a torch Adam group, in the order its groups hold them; `step` follows the Adam
# hyperparameters (`DistributedOptimizer.state_dict` writes the one step every parameter shares there)
MCORE_EXTRA_KEYS = ("is_expert_parallel", "default_config", "wd_mult", "lr_mult", "is_decoupled_lr", "max_lr",
                    "min_lr")
# megatron-core's default groups of a dense model: weight-decayed weights, then biases and 1-d parameters
# (norms) with wd_mult 0 (`get_standard_config_overrides`)
MCORE_WD_MULTS = (1.0, 0.0)
NOT_HYPER = ("params", "param_names", "step", *MCORE_EXTRA_KEYS)


_ADAM_FIX = "the file is damaged or was edited — re-copy it, or drop --with-optimizer"


def _number(v: Any) -> float | None:
    """A plain number, or a one-element tensor's value; None for anything else (a bool, text, a list)."""
    if isinstance(v, torch.Tensor) and v.numel() == 1:
        v = v.item()
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v)


def check_adam_hyper(group: dict[str, Any], source: str, where: str) -> None:
    """Refuse the Adam hyperparameters of one param group as torch.optim.Adam's constructor refuses them (lr,
    eps and weight_decay >= 0, each beta in [0, 1)), NaN and Inf included: `load_state_dict` takes a group's
    values unchecked, so a resumed run would train with them. megatron-core's own lr bounds (`max_lr`,
    `min_lr`) are held to the same rule."""
    for key in ("lr", "eps", "weight_decay", "max_lr", "min_lr"):
        if key in group and group[key] is not None:
            v = _number(group[key])
            if v is None or not math.isfinite(v) or v < 0:
                raise MConvertError(f"{source}: {where} has {key}={group[key]!r}; torch's Adam takes a finite {key} "
                                    f">= 0 — {_ADAM_FIX}")
    if "betas" in group:
        betas = group["betas"]
        pair = [_number(b) for b in betas] if isinstance(betas, (list, tuple)) and len(betas) == 2 else None
        if pair is None or any(b is None or not 0.0 <= b < 1.0 for b in pair):
            raise MConvertError(f"{source}: {where} has betas={betas!r}; torch's Adam takes two betas in [0, 1) — "
                                f"{_ADAM_FIX}")


def check_step(step: Any, source: str, where: str) -> float:
    """An Adam `step` (a count of updates: finite, >= 0; the bias corrections 1 - beta**step need it so)."""
    v = _number(step)
    if v is None or not math.isfinite(v) or v < 0:
        raise MConvertError(f"{source}: {where} has step={step!r}; an Adam step counts updates (a finite number "
                            f">= 0) — {_ADAM_FIX}")
    return v


def check_mcore_groups(opt: Any, source: str, depth: int = 4) -> None:
    """`check_adam_hyper` and `check_step` on every param group of megatron-core's optimizer entry (common.pt's
    `optimizer`, a chained optimizer's parts included), as it is carried into a torch_dist output."""
    if not isinstance(opt, dict) or depth < 0:
        return
    groups = opt.get("param_groups")
    if isinstance(groups, list):
        for g, group in enumerate(groups):
            if isinstance(group, dict):
                check_adam_hyper(group, source, f"megatron-core's param group {g}")
                if group.get("step") is not None:
                    check_step(group["step"], source, f"megatron-core's param group {g}")
    for v in opt.values():
        if isinstance(v, dict):
            check_mcore_groups(v, source, depth - 1)


def shared_step(steps: list[Any], source: str) -> float:
    """The Adam `step` every parameter shares (megatron-core keeps one per optimizer); differing steps are
    refused: one of them would be wrong for some parameters."""
    values = {check_step(s, source, "the optimizer") for s in steps}
    if len(values) != 1:
        raise MConvertError(f"{source}: parameters are at different Adam steps {sorted(values)[:4]}; megatron-core's "
                            "distributed optimizer keeps one step for all — drop --with-optimizer")
    return values.pop()


def wd_mult_of(name: str, ndim: int) -> float:
    """megatron-core's default weight-decay multiplier of one parameter (`get_standard_config_overrides`):
    0 for biases and 1-d parameters (norms), 1 for the rest."""
    return 0.0 if ndim == 1 or name.endswith(".bias") else 1.0


def trainer_param_groups(named: list[tuple[str, torch.Tensor]], weight_decay: float) -> list[dict[str, Any]]:
    """named_parameters -> the trainer's Adam param groups. With weight decay, megatron-core's groups:
    weight-decayed weights (`wd_mult` 1), then biases and 1-d parameters (`wd_mult` 0), each group's
    weight_decay = wd · wd_mult. Without, the two would hold the same hyperparameters: one group holds all."""
    if not weight_decay:
        return [{"params": [p for _, p in named], "param_names": [n for n, _ in named], "weight_decay": 0.0}]
    groups = []
    for m in MCORE_WD_MULTS:
        members = [(n, p) for n, p in named if wd_mult_of(n, p.dim()) == m]
        groups.append({"params": [p for _, p in members], "param_names": [n for n, _ in members],
                       "wd_mult": m, "lr_mult": 1.0, "weight_decay": weight_decay * m})
    return groups


# what the trainer sets on its groups itself when it resumes, whatever a saved group holds
SET_ON_RESUME = ("weight_decay", "decoupled_weight_decay", "wd_mult", "lr_mult")


def regroup(saved: dict[str, Any], target: list[dict[str, Any]], source: str) -> dict[str, Any]:
    """A saved Adam state_dict -> the same states in `target`'s groups (by parameter name), so a checkpoint of
    another grouping (one group for every parameter) loads into the trainer's groups. Each target group takes
    the hyperparameters of the saved group its parameters come from and keeps its own `SET_ON_RESUME` keys."""
    if [g.get("param_names") for g in saved.get("param_groups", [])] == [g["param_names"] for g in target]:
        return saved
    by_name, groups = index_states(saved, source)
    params: list[tuple[str, dict[str, Any]]] = []
    hypers: list[dict[str, Any]] = []
    for g, tgroup in enumerate(target):
        hyper: dict[str, Any] | None = None
        for name in tgroup["param_names"]:
            if name not in by_name:
                raise MConvertError(f"{source}: the optimizer has no state for parameter {name!r}; the checkpoint "
                                    "is of another model — repeat the original flags to resume")
            st = dict(by_name[name])
            own = {k: v for k, v in groups[st["group"]].items()
                   if k not in ("params", "param_names", *SET_ON_RESUME)}
            if hyper is not None and own != hyper:
                raise MConvertError(f"{source}: parameters of the trainer's param group {g} come from saved groups with different hyperparameters; "
                                    "they cannot share one Adam group — resume with the optimizer that saved it")
            hyper = own
            params.append((name, {**st, "group": g}))
        extra = {k: tgroup[k] for k in SET_ON_RESUME if k in tgroup}
        hypers.append({"param_names": None, **extra, **(hyper or {}), "params": None})
    return build_state_dict(params, hypers)


def _hyper(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k not in NOT_HYPER}


def _one_hyper(groups: list[dict[str, Any]], source: str, what: str) -> dict[str, Any]:
    """The Adam hyperparameters all `groups` share (their own keys, without parameters, step or megatron-core's
    group keys); groups that differ in one are refused by that key."""
    if not groups:
        raise MConvertError(f"{source}: the optimizer has no param groups; the file is damaged — drop --with-optimizer")
    first = _hyper(groups[0])
    for g, group in enumerate(groups[1:], 1):
        for k in sorted(set(first) | set(_hyper(group))):
            if group.get(k) != first.get(k):
                raise MConvertError(f"{source}: {what} param groups 0 and {g} differ in {k!r} ({first.get(k)!r} vs "
                                    f"{group.get(k)!r}); one set of Adam hyperparameters must serve every parameter "
                                    "in the other format — drop --with-optimizer")
    return first


def _hyper_per_wd_mult(groups: list[dict[str, Any]], source: str) -> dict[float, dict[str, Any]]:
    """The trainer's groups -> {wd_mult: Adam hyperparameters} for megatron-core's groups. Groups that record
    `wd_mult` (the trainer's) map by it; groups without (one group for all) give their one set to both, as
    megatron-core without a scheduler holds its groups (the same weight_decay on every parameter)."""
    if groups and all("wd_mult" in g for g in groups):
        out: dict[float, dict[str, Any]] = {}
        for m in MCORE_WD_MULTS:
            same = [g for g in groups if float(g["wd_mult"]) == m]
            if not same:
                raise MConvertError(f"{source}: the trainer's optimizer has no param group with wd_mult {m}; the file "
                                    "is damaged — drop --with-optimizer")
            out[m] = _one_hyper(same, source, f"the trainer's wd_mult {m}")
        for g, group in enumerate(groups):
            if float(group["wd_mult"]) not in MCORE_WD_MULTS or float(group.get("lr_mult", 1.0)) != 1.0:
                raise MConvertError(f"{source}: the trainer's param group {g} has wd_mult {group['wd_mult']!r} / "
                                    f"lr_mult {group.get('lr_mult')!r}; megatron-core's default groups have wd_mult "
                                    "1 or 0 and lr_mult 1 — drop --with-optimizer")
        return out
    hyper = _one_hyper(groups, source, "the trainer's")
    return {m: hyper for m in MCORE_WD_MULTS}


def to_mcore_optimizer(groups: list[dict[str, Any]], step: float, source: str, is_moe: bool = False,
                       min_lr: float | None = None) -> dict[str, Any]:
    """The trainer's Adam param groups and shared step -> common.pt's `optimizer` entry of megatron-core's
    `fully_reshardable` distributed optimizer: one group per megatron-core group key set (weight-decayed
    weights; biases and norms), each with the hyperparameters of the trainer's group of that `wd_mult`, so every
    parameter takes the update it took in the trainer."""
    if is_moe:
        raise MConvertError(f"{source}: megatron-core keeps a mixture-of-experts model's expert parameters in a second "
                            "(chained) distributed optimizer, which is not written from trainer Adam states — drop "
                            "--with-optimizer or keep --format torch")
    per_mult = _hyper_per_wd_mult(groups, source)
    out = []
    for wd_mult in MCORE_WD_MULTS:
        hyper = per_mult[wd_mult]
        extra = {"is_expert_parallel": False, "default_config": True, "wd_mult": wd_mult, "lr_mult": 1.0,
                 "is_decoupled_lr": False, "max_lr": hyper.get("lr"), "min_lr": min_lr}
        out.append({**extra, **hyper, "step": step})
    return {"optimizer": {"param_groups": out}, "param_state_sharding_type": "fully_reshardable"}


def to_trainer_optimizer(opt: dict[str, Any], source: str) -> tuple[list[dict[str, Any]], float]:
    """common.pt's `optimizer` entry of megatron-core's distributed optimizer -> (the trainer's Adam param
    groups, the shared step). Groups that share every hyperparameter become one group; groups that differ (the
    weight decay Megatron-LM schedules per `wd_mult`) become the trainer's groups by `wd_mult`. What the trainer
    has no group for (an `lr_mult`, a decoupled lr, expert-parallel groups, other wd_mults) is refused by key."""
    inner = opt.get("optimizer") if isinstance(opt, dict) else None
    groups = inner.get("param_groups") if isinstance(inner, dict) else None
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups) or not groups:
        raise MConvertError(f"{source}: the distributed optimizer has no param_groups list (optimizer.optimizer."
                            "param_groups); a chained or damaged optimizer — drop --with-optimizer")
    if any(g.get("step") is None for g in groups):
        raise MConvertError(f"{source}: a distributed-optimizer param group has no 'step'; saved by an Apex/TE "
                            "optimizer that keeps it elsewhere — drop --with-optimizer")
    check_mcore_groups(opt, source)
    step = shared_step([g["step"] for g in groups], source)
    for g, group in enumerate(groups):
        for key, ok in (("lr_mult", 1.0), ("is_decoupled_lr", False), ("is_expert_parallel", False)):
            if group.get(key, ok) != ok:
                raise MConvertError(f"{source}: megatron-core's param group {g} has {key}={group[key]!r}; the trainer's "
                                    f"Adam groups differ only in weight decay ({key} {ok!r}) — drop --with-optimizer")
    hypers = [_hyper(g) for g in groups]
    if all(h == hypers[0] for h in hypers):
        # key order as torch's Adam.state_dict() writes a named group: param_names, hyperparameters, params
        return [{"param_names": None, **hypers[0], "params": None}], step
    mults = [float(g.get("wd_mult", -1.0)) for g in groups]
    if sorted(mults) != sorted(MCORE_WD_MULTS):
        raise MConvertError(f"{source}: megatron-core's param groups have wd_mult {mults} and differ in "
                            "hyperparameters; the trainer groups parameters by wd_mult 1 (weights) and 0 (biases, "
                            "norms) only — drop --with-optimizer")
    out = []
    for m in MCORE_WD_MULTS:
        g = mults.index(m)
        out.append({"param_names": None, "wd_mult": m, "lr_mult": 1.0, **hypers[g], "params": None})
    return out, step


def trainer_group(groups: list[dict[str, Any]], name: str, ndim: int) -> int:
    """The index of the trainer group that holds parameter `name` (`ndim` dimensions): its `wd_mult` group, or
    the one group when the groups do not record `wd_mult`."""
    if len(groups) == 1 and "wd_mult" not in groups[0]:
        return 0
    m = wd_mult_of(name, ndim)
    for g, group in enumerate(groups):
        if float(group.get("wd_mult", -1.0)) == m:
            return g
    raise MConvertError(f"internal: no trainer param group with wd_mult {m} for {name}")


def trainer_states(state: dict[str, Any], step: float, group: int = 0) -> dict[str, Any]:
    """One parameter's megatron-core states (`param` fp32 copy, `exp_avg`, `exp_avg_sq`) -> the trainer's
    Adam state in `group` with its own `step` tensor (torch's Adam adds to it in place, so never shared). The
    fp32 copy stays behind: the trainer makes its fp32 copies from the weights when it resumes."""
    out: dict[str, Any] = {"group": group, "step": torch.tensor(step, dtype=torch.float32)}
    out.update({k: v for k, v in state.items() if k != "param"})
    return out


def mcore_states(weight: torch.Tensor, state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """One parameter's trainer Adam state (full shapes) -> megatron-core's `fully_reshardable` states: the
    fp32 copy of the weight (`param`: the trainer's own master is its weight) and every tensor state."""
    out = {"param": weight.float()}
    out.update({k: v for k, v in state.items() if k not in ("group", "step") and isinstance(v, torch.Tensor)
                and v.dim() > 0})
    return out
