"""Checkpoints written by the built-in trainer (an independent TP/PP implementation): they convert to HF
whose transformers logits match the trainer's own, reshard TP2·PP2 → TP4·PP1 → TP2·PP2 byte for byte
(optimizer included), and training resumed after a reshard gives the same next-step losses."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
import torch
import transformers

import mconvert.trainer.train as train_mod
from mconvert.convert.verbs import megatron_to_hf, reshard
from mconvert.io.safeload import safe_load

pytestmark = pytest.mark.slow

RUN = dict(micro_batch_size=2, global_batch_size=4, seq_length=32, quiet=True, seed=7)
MODELS = {
    "gpt2": dict(preset="tiny-gpt2", num_layers=4, num_attention_heads=4),  # tied: output_layer copy at PP>1
    "llama": dict(preset="tiny-llama", num_layers=4),  # GQA 2 groups (< TP 4), SwiGLU, untied
}


def _train(save: Path, tp: int, pp: int, steps: int, resume: bool = False, **model) -> list[float]:
    cfg = train_mod.TrainConfig(tp=tp, pp=pp, steps=steps, save=str(save), resume=resume, force=not resume,
                                **RUN, **model)
    return train_mod.train(cfg)["losses"]


@pytest.fixture(scope="module", params=list(MODELS))
def trained(request, trained_checkpoint) -> tuple[str, Path]:
    """The family trained 2 steps at TP=2 PP=2 (the session's `trained_checkpoint`, read only)."""
    return request.param, trained_checkpoint(tp=2, pp=2, steps=2, **RUN, **MODELS[request.param])


def _sha(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*.pt"))}


def test_reshard_round_trip_is_byte_identical_with_optimizer(trained, tmp_path):
    name, ckpt = trained
    rep = reshard(ckpt, tmp_path / "tp4", tp=4, pp=1, with_optimizer=True)
    assert rep["iteration"] == 2 and "re-sharded" in rep["optimizer"]
    st = safe_load(tmp_path / "tp4" / "iter_0000002" / "mp_rank_03" / "model_optim_rng.pt")
    assert st["args"].tensor_model_parallel_size == 4 and st["args"].pipeline_model_parallel_size == 1
    names = st["optimizer"]["param_groups"][0]["param_names"]
    assert names == [k for k, v in st["model"].items() if isinstance(v, torch.Tensor)]
    for pid, pname in zip(st["optimizer"]["param_groups"][0]["params"], names):
        assert st["optimizer"]["state"][pid]["exp_avg"].shape == st["model"][pname].shape
    reshard(tmp_path / "tp4", tmp_path / "back", tp=2, pp=2, with_optimizer=True)
    assert _sha(tmp_path / "back") == _sha(ckpt)
    no_opt = reshard(ckpt, tmp_path / "noopt", tp=4, pp=1)
    assert "not written" in no_opt["optimizer"]
    assert "optimizer" not in safe_load(tmp_path / "noopt" / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt")


def test_hf_logits_match_the_trainers_own(trained, tmp_path):
    from mconvert.trainer.infer import megatron_logits

    name, ckpt = trained
    tokens = torch.tensor([[5, 17, 230, 999, 3, 42, 7, 100], [1, 2, 3, 4, 5, 6, 7, 8]])
    want = megatron_logits(ckpt, tokens)
    rep = megatron_to_hf(ckpt, tmp_path / "hf")
    assert (tmp_path / "hf" / "tokenizer.json").is_file() and rep["warnings"] == []
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
    with torch.no_grad():
        got = model(tokens).logits
    assert got.shape == want.shape
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("trained", ["gpt2"], indirect=True)  # one family: each run forks TP·PP processes
def test_training_resumed_after_reshard_gives_the_same_losses(trained, tmp_path):
    name, ckpt = trained
    shutil.copytree(ckpt, tmp_path / "same")
    want = _train(tmp_path / "same", 2, 2, 3, resume=True, **MODELS[name])
    reshard(ckpt, tmp_path / "tp4", tp=4, pp=1, with_optimizer=True)
    got = _train(tmp_path / "tp4", 4, 1, 3, resume=True, **MODELS[name])
    assert len(got) == len(want) == 1
    assert abs(got[0] - want[0]) <= 1e-5, (got, want)
