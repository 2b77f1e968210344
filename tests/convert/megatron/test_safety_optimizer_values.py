"""`reshard --with-optimizer` writes Adam hyperparameters and steps that a resumed run takes unchecked
(`load_state_dict` never validates them): each is checked as torch.optim.Adam's constructor checks it (lr, eps,
weight_decay >= 0, betas in [0, 1)), NaN and Inf refused, and a step must count updates (finite, >= 0).
Attacks run through the real CLI in a child process under a 6 GB address-space cap and a 60 s limit."""

from __future__ import annotations

import math
from functools import lru_cache
from pathlib import Path

import pytest
import torch
from safety_common import add_adam_states, assert_one_line_error, copy_of, run_cli_capped
from scratch import scratch_dir

_WORK = scratch_dir("mconvert-optvalues-", __name__)


@lru_cache(maxsize=None)
def _with_adam() -> Path:
    ckpt = copy_of("ckpt", _WORK / "adam")
    add_adam_states(ckpt)
    return ckpt


def _edit_all_ranks(ckpt: Path, key: str, value) -> None:
    from mconvert.io.safeload import safe_load
    from mconvert.layouts.megatron import save_rank_file

    for f in sorted((ckpt / "release").glob("mp_rank_*/model_optim_rng.pt")):
        state = safe_load(f)  # memory-mapped: save_rank_file writes a new file and renames it over this one
        opt = state["optimizer"]
        if key == "step":
            for st in opt["state"].values():
                st["step"] = torch.tensor(float(value))
        else:
            opt["param_groups"][0][key] = value
        save_rank_file(f, state)
        del state


CASES = [("lr", math.nan), ("lr", -1e-4), ("betas", (0.9, 1.0)), ("betas", (-0.1, 0.95)), ("eps", -1e-8),
         ("weight_decay", -0.1), ("step", -3)]


@pytest.mark.parametrize("key,value", CASES, ids=[f"{k}={v}" for k, v in CASES])
def test_reshard_with_optimizer_refuses_values_torchs_adam_refuses(tmp_path, key, value):
    import shutil

    ckpt = tmp_path / "ckpt"
    shutil.copytree(_with_adam(), ckpt)
    _edit_all_ranks(ckpt, key, value)
    out = tmp_path / "out"
    code, _, err = run_cli_capped(["reshard", ckpt, out, "--tp", "1", "--pp", "1", "--with-optimizer"])
    line = assert_one_line_error(code, err, "model_optim_rng.pt", f"{key}=")
    assert "--with-optimizer" in line and not out.exists()
    if key != "step":  # the reader's own rule (code we did not write): its constructor refuses the value
        with pytest.raises(ValueError):
            torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))], **{key: value})


def test_reshard_with_optimizer_carries_valid_values(tmp_path):
    """The benign neighbour: lr 0 (a frozen run), betas (0, 0.999), weight decay 0 pass and are carried."""
    import shutil

    from mconvert.io.safeload import safe_load

    ckpt = tmp_path / "ckpt"
    shutil.copytree(_with_adam(), ckpt)
    _edit_all_ranks(ckpt, "lr", 0.0)
    _edit_all_ranks(ckpt, "betas", (0.0, 0.999))
    out = tmp_path / "out"
    code, _, err = run_cli_capped(["reshard", ckpt, out, "--tp", "1", "--pp", "1", "--with-optimizer"])
    assert code == 0, err
    group = safe_load(out / "release" / "mp_rank_00" / "model_optim_rng.pt")["optimizer"]["param_groups"][0]
    assert (group["lr"], tuple(group["betas"])) == (0.0, (0.0, 0.999))
