"""Adam state re-sharding helpers: index a torch Adam `state_dict()` by parameter name, and rebuild one.

The trainer saves `optimizer` = `torch.optim.Adam(...).state_dict()` built from `named_parameters()`, so
`param_groups[g]['param_names']` names each param id with its model state_dict key (stage-local layer index;
with virtual pipeline chunks the name is prefixed `model<c>.`). `exp_avg` / `exp_avg_sq` have the parameter's
sharded shape and follow its split kind; `step` is replicated.
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
