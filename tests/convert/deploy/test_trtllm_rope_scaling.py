"""TensorRT-LLM's LLaMA layout with rope scaling (llama3 and linear), against truth we did not write:
transformers 4.57's `LlamaForCausalLM` with `rope_scaling` gives the logits, and transformers' own `AutoConfig`
gives the `rope_scaling` that TensorRT-LLM's `LLaMAConfig.from_hugging_face` copies into `rotary_scaling`.

A random transformers model goes through `hf-to-megatron --tp 2 --pp 2` and `megatron-to-trtllm --tp 2`; the
reference runner's logits equal transformers' within 1e-4 of the largest logit. The control: the same rank
files with `rotary_scaling` removed from config.json give logits far outside that tolerance.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers

from mconvert.convert.verbs import hf_to_megatron
from mconvert.convert.deploy.trtllm import check_trtllm_dir
from mconvert.convert.verbs import megatron_to_trtllm
from mconvert.errors import MConvertError
from mconvert.validators.trtllm_runner import trtllm_logits

REL_TOL = 1e-4
# 96 positions of a 128-position model: with rope_theta 500000 and head_dim 64 the llama3 bands (megatron-core
# fixes original_max_position_embeddings 8192) rescale the low-frequency pairs, whose rotations already differ
# here; linear scaling divides every position by its factor
PROBE = torch.randint(0, 1000, (2, 96), generator=torch.Generator().manual_seed(5))
SCALINGS = {
    "llama3": dict(rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}),
    "linear": dict(rope_theta=10000.0, rope_scaling={"rope_type": "linear", "factor": 4.0}),
}


def _hf_config(name: str) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=64, vocab_size=1000, max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=False,
        **{k: (dict(v) if isinstance(v, dict) else v) for k, v in SCALINGS[name].items()})


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[torch.Tensor, Path, Path]]:
    """name -> (transformers' logits on PROBE, its save_pretrained dir, our TensorRT-LLM TP=2 checkpoint)."""
    out = {}
    for name in SCALINGS:
        tmp = tmp_path_factory.mktemp(f"trt_{name}")
        model = transformers.LlamaForCausalLM(_hf_config(name)).eval()
        g = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for n, p in model.named_parameters():
                noise = torch.randn(p.shape, generator=g)
                p.copy_(1.0 + 0.2 * noise if n.endswith("norm.weight") else 0.1 * noise)
            logits = model(PROBE).logits.float()
        model.save_pretrained(tmp / "hf")
        hf_to_megatron(tmp / "hf", tmp / "mg", tp=2, pp=2)
        megatron_to_trtllm(tmp / "mg", tmp / "trt", tp=2)
        out[name] = (logits, tmp / "hf", tmp / "trt")
    return out


def _diff(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    return (got - want).abs().max().item(), want.abs().max().item()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", list(SCALINGS))
def test_trtllm_logits_with_rope_scaling_equal_transformers(exports, name) -> None:
    want, _, trt = exports[name]
    assert check_trtllm_dir(trt) == []
    got = trtllm_logits(trt, PROBE)
    diff, scale = _diff(got, want)
    print(f"[figures] {name} TensorRT-LLM TP=2 vs transformers: max|Δ| {diff:.2e}, max|logit| {scale:.3f}")
    assert diff <= REL_TOL * scale
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("name", list(SCALINGS))
def test_rotary_scaling_is_what_from_hugging_face_stores(exports, name) -> None:
    """TensorRT-LLM's from_hugging_face: rotary_scaling = getattr(hf_config, "rope_scaling"), rotary_base =
    rope_theta, with hf_config from transformers' AutoConfig (here of the model transformers saved)."""
    _, hf, trt = exports[name]
    cfg = json.loads((trt / "config.json").read_text())
    hf_cfg = transformers.AutoConfig.from_pretrained(hf)
    assert cfg["rotary_scaling"] == hf_cfg.rope_scaling
    assert cfg["rotary_base"] == hf_cfg.rope_theta
    assert cfg["rotary_scaling"]["rope_type"] == name


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", list(SCALINGS))
def test_without_rotary_scaling_the_logits_differ_measurably(exports, tmp_path, name) -> None:
    """The control: the scaling changes the function at the probed positions, so the match above proves it."""
    want, _, trt = exports[name]
    plain = tmp_path / "plain"
    shutil.copytree(trt, plain)
    cfg = json.loads((plain / "config.json").read_text())
    cfg["rotary_scaling"] = None
    (plain / "config.json").write_text(json.dumps(cfg))
    got = trtllm_logits(plain, PROBE)
    diff, scale = _diff(got, want)
    print(f"[figures] {name} without rotary_scaling: max|Δ| {diff:.2e} vs tolerance {REL_TOL * scale:.2e}")
    assert diff > 100 * REL_TOL * scale
    assert (got[:, 0] - want[:, 0]).abs().max().item() <= REL_TOL * scale  # position 0 has no rotation


@pytest.mark.timeout(120)
def test_meta_style_llama3_scaling_takes_tensorrt_llms_defaults(exports, tmp_path) -> None:
    """Meta checkpoints give TensorRT-LLM `{"type": "llama3"}` alone; its llama3 scaling then uses factor 8 and
    the 1 / 4 / 8192 bands, which are this model's: the logits stay transformers'."""
    want, _, trt = exports["llama3"]
    meta = tmp_path / "meta"
    shutil.copytree(trt, meta)
    cfg = json.loads((meta / "config.json").read_text())
    cfg["rotary_scaling"] = {"type": "llama3"}
    (meta / "config.json").write_text(json.dumps(cfg))
    diff, scale = _diff(trtllm_logits(meta, PROBE), want)
    assert diff <= REL_TOL * scale


@pytest.mark.timeout(120)
@pytest.mark.parametrize("scaling,named", [
    ({"type": "mrope"}, "rotary_scaling type 'mrope' is not computed by mconvert's TensorRT-LLM"),
    ({"rope_type": "dynamic", "factor": 2.0}, "rotary_scaling type 'dynamic' is not computed"),
    ({"type": "su"}, "rotary_scaling type 'su' is not a TensorRT-LLM rotary scaling type"),
    ({"type": "linear", "factor": "4"}, "rotary_scaling.factor = '4' must be a positive number"),
    ({"type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0},
     "high_freq_factor 1 must exceed low_freq_factor 4"),
    ([1, 2], "rotary_scaling"),
])
def test_validate_refuses_a_rotary_scaling_it_does_not_compute(exports, tmp_path, capsys, scaling, named) -> None:
    """A scaling the runner does not compute is refused by name (one error line, exit non-zero), never run
    unscaled; the checkpoint is left as it was."""
    from safety_common import assert_one_line_error, run_cli

    _, hf, trt = exports["llama3"]
    bad = tmp_path / "bad"
    shutil.copytree(trt, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["rotary_scaling"] = scaling
    text = json.dumps(cfg)
    (bad / "config.json").write_text(text)
    with pytest.raises(MConvertError, match="rotary_scaling"):
        trtllm_logits(bad, PROBE)
    code, _, err = run_cli(["validate", bad, hf], capsys)  # as the reference: its refusal ends the run
    assert_one_line_error(code, err, named)
    assert (bad / "config.json").read_text() == text
