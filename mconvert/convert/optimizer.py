"""Adam state re-sharding helpers: index a torch Adam `state_dict()` by parameter name, and rebuild one.

The trainer saves `optimizer` = `torch.optim.Adam(...).state_dict()` built from `named_parameters()`, so
`param_groups[g]['param_names']` names each param id with its model state_dict key (stage-local layer index;
with virtual pipeline chunks the name is prefixed `model<c>.`). `exp_avg` / `exp_avg_sq` have the parameter's
sharded shape and follow its split kind; `step` is replicated. Across formats, the trainer's Adam states map to
and from megatron-core's `fully_reshardable` distributed optimizer (its param groups keyed by `wd_mult`,
`lr_mult`, `is_expert_parallel`, `is_decoupled_lr`; one `step` for all); what does not map is refused.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from mconvert.convert.io.safeload import all_finite
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
        groups.append(dict(group))  # key order kept; params / param_names are rebuilt per target rank
        for pid, name in zip(group["params"], names):
            st = expect(states.get(pid, {}), dict, f"{source}: optimizer state of parameter {name!r}", fix)
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


def shared_step(steps: list[Any], source: str) -> float:
    """The Adam `step` every parameter shares (megatron-core keeps one per optimizer); differing steps are
    refused: one of them would be wrong for some parameters."""
    values = {float(s.item() if isinstance(s, torch.Tensor) else s) for s in steps}
    if len(values) != 1:
        raise MConvertError(f"{source}: parameters are at different Adam steps {sorted(values)[:4]}; megatron-core's "
                            "distributed optimizer keeps one step for all — drop --with-optimizer")
    return values.pop()


def _one_hyper(groups: list[dict[str, Any]], source: str, what: str) -> dict[str, Any]:
    """The Adam hyperparameters all `groups` share (their own keys, without parameters, step or megatron-core's
    group keys); groups that differ in one are refused by that key."""
    if not groups:
        raise MConvertError(f"{source}: the optimizer has no param groups; the file is damaged — drop --with-optimizer")
    first = {k: v for k, v in groups[0].items() if k not in NOT_HYPER}
    for g, group in enumerate(groups[1:], 1):
        for k in sorted(set(first) | {k for k in group if k not in NOT_HYPER}):
            if group.get(k) != first.get(k):
                raise MConvertError(f"{source}: {what} param groups 0 and {g} differ in {k!r} ({first.get(k)!r} vs "
                                    f"{group.get(k)!r}); one set of Adam hyperparameters must serve every parameter "
                                    "in the other format — drop --with-optimizer")
    return first


def to_mcore_optimizer(groups: list[dict[str, Any]], step: float, source: str, is_moe: bool = False,
                       min_lr: float | None = None) -> dict[str, Any]:
    """The trainer's Adam param groups and shared step -> common.pt's `optimizer` entry of megatron-core's
    `fully_reshardable` distributed optimizer: one group per megatron-core group key set (weight-decayed
    weights; biases and norms), each with the trainer's hyperparameters, so every parameter takes the update
    it took in the trainer."""
    if is_moe:
        raise MConvertError(f"{source}: megatron-core keeps a mixture-of-experts model's expert parameters in a second "
                            "(chained) distributed optimizer, which is not written from trainer Adam states — drop "
                            "--with-optimizer or keep --format torch")
    hyper = _one_hyper(groups, source, "the trainer's")
    out = []
    for wd_mult in MCORE_WD_MULTS:
        extra = {"is_expert_parallel": False, "default_config": True, "wd_mult": wd_mult, "lr_mult": 1.0,
                 "is_decoupled_lr": False, "max_lr": hyper.get("lr"), "min_lr": min_lr}
        out.append({**extra, **hyper, "step": step})
    return {"optimizer": {"param_groups": out}, "param_state_sharding_type": "fully_reshardable"}


def to_trainer_optimizer(opt: dict[str, Any], source: str) -> tuple[list[dict[str, Any]], float]:
    """common.pt's `optimizer` entry of megatron-core's distributed optimizer -> (the trainer's one Adam param
    group, the shared step). Groups that differ in a hyperparameter (a weight decay scheduled per `wd_mult`,
    an lr per `lr_mult`) cannot be one torch Adam group and are refused by that key."""
    inner = opt.get("optimizer") if isinstance(opt, dict) else None
    groups = inner.get("param_groups") if isinstance(inner, dict) else None
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise MConvertError(f"{source}: the distributed optimizer has no param_groups list (optimizer.optimizer."
                            "param_groups); a chained or damaged optimizer — drop --with-optimizer")
    hyper = _one_hyper(groups, source, "megatron-core's")
    if any(g.get("step") is None for g in groups):
        raise MConvertError(f"{source}: a distributed-optimizer param group has no 'step'; saved by an Apex/TE "
                            "optimizer that keeps it elsewhere — drop --with-optimizer")
    step = shared_step([g["step"] for g in groups], source)
    # key order as torch's Adam.state_dict() writes a named group: param_names, hyperparameters, params
    return [{"param_names": None, **hyper, "params": None}], step


def trainer_states(state: dict[str, Any], step: float) -> dict[str, Any]:
    """One parameter's megatron-core states (`param` fp32 copy, `exp_avg`, `exp_avg_sq`) -> the trainer's
    Adam state in group 0 with its own `step` tensor (torch's Adam adds to it in place, so never shared). The
    fp32 copy stays behind: the trainer makes its fp32 copies from the weights when it resumes."""
    out: dict[str, Any] = {"group": 0, "step": torch.tensor(step, dtype=torch.float32)}
    out.update({k: v for k, v in state.items() if k != "param"})
    return out


def mcore_states(weight: torch.Tensor, state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """One parameter's trainer Adam state (full shapes) -> megatron-core's `fully_reshardable` states: the
    fp32 copy of the weight (`param`: the trainer's own master is its weight) and every tensor state."""
    out = {"param": weight.float()}
    out.update({k: v for k, v in state.items() if k not in ("group", "step") and isinstance(v, torch.Tensor)
                and v.dim() > 0})
    return out
