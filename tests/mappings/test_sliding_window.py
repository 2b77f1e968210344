"""Sliding-window attention, proven against code we did not write.

- Which layers a window covers and how wide it is: megatron-core's own `is_layer_window_attention` and
  `get_sliding_window_causal_mask` for the Megatron args, transformers' own config classes and attention modules
  for config.json (the logits of megatron-core's GPTModel against the HF export are in test_external_mcore.py,
  random HF models round-tripping byte for byte in test_convert_roundtrip.py).
- The trainer's window: its checkpoint converts to HF whose transformers logits `validate` finds equal on a
  sequence longer than the window, and unequal once the export's window is switched off.
- Targets without a window (FasterTransformer, TensorRT-LLM, GGUF) refuse by name unless
  --accept-window-as-full; optimum's ONNX export computes the window, and its check covers it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
import transformers
from deploy_common import make_hf
from safety_common import run_cli

from mconvert.errors import MConvertError
from mconvert.mappings.families import hf_config, preset, spec_from_hf_config, spec_from_megatron_args

SWA = preset("tiny-mistral-swa")  # window_size 15: 16 keys per query, 128 positions


# ---- the Megatron args, as megatron-core reads them ---------------------------------------------------
@pytest.mark.parametrize("window_size,skip_freq", [((7, 0), None), ((7, 0), 2), ((7, 0), 3), ((3, 0), [0, 1, 1, 0]),
                                                   ((3, 0), 1), ((-1, 0), None)])
def test_megatron_window_args_mean_what_megatron_core_computes(window_size, skip_freq) -> None:
    """Each layer's window, as read from `window_size` / `window_attn_skip_freq`, is megatron-core's: the layers
    `is_layer_window_attention` marks, each query seeing the keys `get_sliding_window_causal_mask` leaves open."""
    from megatron.core.transformer.utils import get_sliding_window_causal_mask, is_layer_window_attention

    from mconvert.trainer.model import attention_mask

    args = preset("tiny-llama").replace(num_layers=4).to_megatron_args()
    args.window_size, args.window_attn_skip_freq = window_size, skip_freq
    spec = spec_from_megatron_args(args)
    for layer in range(4):
        theirs = is_layer_window_attention(window_size, skip_freq, layer + 1) and window_size[0] >= 0
        assert (spec.layer_window(layer) is not None) == theirs, layer
        if theirs:
            with torch.device("cpu"):
                want = _cpu(get_sliding_window_causal_mask, 12, 12, window_size)
            assert torch.equal(attention_mask(12, spec.layer_window(layer), torch.device("cpu")), want)
    written = spec.to_megatron_args()
    for layer in range(4):  # and the args written back mark the same layers
        got = spec.window_size is not None and is_layer_window_attention(
            written.window_size, getattr(written, "window_attn_skip_freq", None), layer + 1)
        assert got == (spec.layer_window(layer) is not None)


def _cpu(fn, *args):
    """megatron-core's mask helper allocates on "cuda"; the same call, on the CPU."""
    from torch.overrides import TorchFunctionMode

    class OnCpu(TorchFunctionMode):
        def __torch_function__(self, func, types, a=(), kw=None):
            kw = dict(kw or {})
            if str(kw.get("device", "")).startswith("cuda"):
                kw["device"] = "cpu"
            return func(*a, **kw)

    with OnCpu():
        return fn(*args)


@pytest.mark.parametrize("name,value,match", [
    ("window_size", (8, 4), "right size 4"), ("window_size", (8, -1), "right size -1"),
    ("window_size", "(8, 0)", "must be tuple or list"), ("window_size", (8.0, 0), "pair of whole numbers"), ("window_size", (-2, 0), "left size must be"),
    ("window_attn_skip_freq", [1, 0], "list of 3 ones"),
])
def test_windows_megatron_core_would_not_compute_causally_are_refused(name, value, match) -> None:
    args = preset("tiny-llama").to_megatron_args()
    args.window_size = (8, 0)
    setattr(args, name, value)
    if name == "window_attn_skip_freq":
        args.num_layers = 3
    with pytest.raises(MConvertError, match=match) as e:
        spec_from_megatron_args(args, source="x/model_optim_rng.pt")
    assert str(e.value).startswith("x/model_optim_rng.pt: ") and "\n" not in str(e.value)


# ---- config.json, as transformers builds it ---------------------------------------------------------------
def _hf_windows(cfg: dict) -> list[int | None]:
    """The window each layer of transformers' model of `cfg` applies (its attention modules' own attribute where
    the class keeps one per layer, else the config's, which Mistral / Mixtral pass to every layer)."""
    cfg = dict(cfg)
    config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return [getattr(layer.self_attn, "sliding_window", config.sliding_window) for layer in model.model.layers]


HF_CASES = {
    "mistral": ("tiny-mistral", {"sliding_window": 6}),
    "mistral class default": ("tiny-mistral", {"sliding_window": "absent"}),  # MistralConfig's 4096
    "mixtral": ("tiny-mixtral", {"sliding_window": 6}),
    "qwen2 max_window_layers": ("tiny-qwen2", {"use_sliding_window": True, "sliding_window": 6,
                                               "max_window_layers": 1, "num_hidden_layers": 3}),
    "qwen2 off": ("tiny-qwen2", {"use_sliding_window": False, "sliding_window": 6, "max_window_layers": 0}),
    "qwen2 class defaults": ("tiny-qwen2", {"use_sliding_window": True, "sliding_window": "absent",
                                            "max_window_layers": "absent", "num_hidden_layers": 30}),
    "qwen3 layer_types": ("tiny-qwen3", {"use_sliding_window": True, "sliding_window": 6, "num_hidden_layers": 3,
                                         "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}),
    "qwen3_moe": ("tiny-qwen3-moe", {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1}),
}


@pytest.mark.parametrize("case", sorted(HF_CASES))
def test_hf_window_fields_mean_what_transformers_computes(case: str) -> None:
    name, changes = HF_CASES[case]
    cfg = hf_config(preset(name))
    for k, v in changes.items():
        cfg.pop(k, None)
        if v != "absent":
            cfg[k] = v
    cfg.pop("layer_types", None) if "layer_types" not in changes else None
    spec = spec_from_hf_config(cfg)
    ours = [None if spec.layer_window(i) is None else spec.layer_window(i) + 1 for i in range(spec.num_layers)]
    assert ours == _hf_windows(cfg)
    back = hf_config(spec)  # and what we write, transformers reads the same
    assert _hf_windows(back) == ours


@pytest.mark.parametrize("name,changes,match", [
    ("tiny-qwen2", {"use_sliding_window": False, "layer_types": ["sliding_attention", "full_attention"]},
     "window is off"),
    ("tiny-qwen3", {"use_sliding_window": True, "layer_types": ["full_attention", "chunked_attention"]},
     "other attention kinds"),
    ("tiny-qwen3-moe", {"use_sliding_window": True, "sliding_window": 6, "layer_types": ["full_attention"] * 2},
     "windows every layer or none"),
    ("tiny-mistral", {"sliding_window": 0}, "whole number >= 1"),
])
def test_hf_window_fields_transformers_or_vllm_would_misread_are_refused(name, changes, match) -> None:
    cfg = {**hf_config(preset(name)), **changes}
    with pytest.raises(MConvertError, match=match) as e:
        spec_from_hf_config(cfg, source="x/config.json")
    assert str(e.value).startswith("x/config.json: ") and "\n" not in str(e.value)


@pytest.mark.parametrize("spec,match", [
    (preset("tiny-llama").replace(window_size=7), "HF LlamaForCausalLM has no sliding window"),
    (SWA.replace(window_pattern=(1, 0)), "applies its sliding_window to every layer"),
    (preset("tiny-qwen3-moe").replace(window_size=7, window_pattern=(0, 1)), "applies its sliding_window"),
])
def test_a_window_the_hf_class_cannot_compute_is_refused(spec, match) -> None:
    with pytest.raises(MConvertError, match=match):
        hf_config(spec)


# ---- the trainer's window, through megatron-to-hf and validate -----------------------------------------------
@pytest.fixture(scope="module")
def trained_swa(trained_checkpoint) -> Path:
    return trained_checkpoint(preset="tiny-mistral-swa", tp=2, pp=1, steps=2, force=True, micro_batch_size=2,
                              global_batch_size=4, seq_length=48, seed=7, device=None)


@pytest.mark.slow
def test_trainer_window_converts_and_validates_beyond_the_window(trained_swa, tmp_path) -> None:
    from mconvert.convert.verbs import megatron_to_hf, reshard
    from mconvert.validators.validate import validate

    reshard(trained_swa, tmp_path / "pp2", tp=1, pp=2)  # the window travels in the args of every layout
    megatron_to_hf(tmp_path / "pp2", tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (cfg["architectures"], cfg["sliding_window"]) == (["MistralForCausalLM"], 16)
    rep = validate(trained_swa, [tmp_path / "hf"], device="cpu", n_tokens=8)  # lengthened past the window
    assert rep.tokens["window"] == 16 and rep.tokens["seq_len"] == 32 and rep.tokens["beyond_window"]
    assert rep.passed, rep.results[0].failures
    cfg["sliding_window"] = None  # the control: the same weights with full attention
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))
    control = validate(trained_swa, [tmp_path / "hf"], device="cpu")
    assert not control.passed


# ---- targets without a window -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def swa_hf(tmp_path_factory) -> Path:
    from mconvert.data import build_tokenizer, save_hf_tokenizer

    # one KV head per query head: FasterTransformer's LLaMA loader has no grouped-query attention
    hf = make_hf(SWA.replace(num_query_groups=None), tmp_path_factory.mktemp("swa_hf") / "hf")
    save_hf_tokenizer(build_tokenizer(), hf)  # GGUF embeds one
    return hf


@pytest.mark.parametrize("verb,out", [("megatron-to-ft", "ft"), ("megatron-to-trtllm", "trt"),
                                      ("hf-to-gguf", "m.gguf")])
def test_targets_without_a_window_refuse_it_by_name_unless_accepted(swa_hf, tmp_path, capsys, verb, out) -> None:
    target = {"megatron-to-ft": "FasterTransformer", "megatron-to-trtllm": "TensorRT-LLM", "hf-to-gguf": "GGUF"}[verb]
    code, _, err = run_cli([verb, str(swa_hf), str(tmp_path / out)], capsys)
    assert code == 1 and err.startswith("error:") and err.count("\n") <= 1
    assert f"sliding-window attention (window_size=(15, 0), HF sliding_window=16, on every layer) is not mapped to " \
           f"{target}" in err and "--accept-window-as-full" in err
    assert not (tmp_path / out).exists()
    code, stdout, _ = run_cli([verb, str(swa_hf), str(tmp_path / out), "--accept-window-as-full", "--json"], capsys)
    assert code == 0, stdout
    rep = json.loads(stdout)
    said = rep.get("notes", []) + rep.get("warnings", [])
    assert any("written as full attention" in s and "up to 16 tokens" in s for s in said), said


def test_a_window_covering_the_context_needs_no_flag(tmp_path, capsys) -> None:
    """A window at least as long as the context masks nothing the model ever sees: every target takes it."""
    hf = make_hf(SWA.replace(window_size=127), tmp_path / "hf")
    code, stdout, _ = run_cli(["hf-to-gguf", str(hf), str(tmp_path / "m.gguf"), "--dry-run", "--json"], capsys)
    assert code == 0 and json.loads(stdout)["warnings"] == []


@pytest.mark.slow
def test_onnx_export_computes_the_window(swa_hf, tmp_path) -> None:
    """optimum's export traces transformers' sliding-window mask: its own check (a sequence of twice the window)
    passes, and onnxruntime's logits differ from the same weights with full attention beyond the window."""
    from mconvert.convert.verbs import to_onnx
    from mconvert.validators.onnx_runner import check_onnx_against_hf, onnx_logits

    res = to_onnx(swa_hf, tmp_path / "onnx", with_past=False, check=check_onnx_against_hf)
    assert res.report()["prefill_rel_diff"] <= 1e-4
    tokens = torch.randint(0, SWA.vocab_size, (1, 40), generator=torch.Generator().manual_seed(3))
    got = onnx_logits(tmp_path / "onnx", tokens)
    full = transformers.AutoModelForCausalLM.from_pretrained(swa_hf, sliding_window=None).eval()
    with torch.no_grad():
        want_full = full(tokens).logits
    assert (got[:, :16] - want_full[:, :16]).abs().max() <= 1e-4 * want_full.abs().max()
    assert (got[:, 16:] - want_full[:, 16:]).abs().max() > 1e-3 * want_full.abs().max()


def test_recognised_mistral_from_megatron_lm_args() -> None:
    """Megatron-LM writes no model_family: one window on every layer and no bias reads as Mistral."""
    args = vars(SWA.to_megatron_args())
    del args["model_family"]
    assert spec_from_megatron_args(argparse.Namespace(**args)) == SWA


def test_torch_dist_output_carries_the_window(tmp_path) -> None:
    """hf-to-megatron --format torch_dist writes megatron-core's window args into common.pt; back to HF, the same
    window on the same layers and the same tensors, byte for byte."""
    from safetensors.torch import load_file

    from mconvert.convert.verbs import hf_to_megatron, megatron_to_hf

    hf = make_hf(preset("tiny-qwen2-swa"), tmp_path / "hf")
    hf_to_megatron(hf, tmp_path / "dist", tp=2, pp=2, format="torch_dist")
    megatron_to_hf(tmp_path / "dist", tmp_path / "back")
    a, b = (json.loads((d / "config.json").read_text()) for d in (hf, tmp_path / "back"))
    assert (b["sliding_window"], b["layer_types"]) == (a["sliding_window"], a["layer_types"]) == (
        16, ["full_attention", "sliding_attention"])
    x, y = load_file(hf / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def test_train_window_size_flag(tmp_path, capsys) -> None:
    """`train --window-size W` windows every layer (HF sliding_window W + 1); a family whose HF class has no window
    is refused before anything runs."""
    from mconvert.trainer.train import TrainConfig, build_spec

    spec = build_spec(TrainConfig(preset="tiny-mistral", window_size=7, seq_length=32), 1000)
    assert spec.window_size == 7 and spec.windowed_layers == [0, 1] and hf_config(spec)["sliding_window"] == 8
    code, _, err = run_cli(["train", "--preset", "tiny-llama", "--window-size", "7", "--steps", "1", "--save",
                            tmp_path / "x"], capsys)
    assert code == 1 and "has no sliding window" in err and not (tmp_path / "x").exists()
    code, _, err = run_cli(["train", "--preset", "tiny-mistral", "--window-size", "-1", "--steps", "1"], capsys)
    assert code == 1 and "--window-size must be >= 0" in err
