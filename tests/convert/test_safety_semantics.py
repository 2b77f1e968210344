"""Inputs whose flags or copies change what the model computes: each is converted to the function the source
computes, or refused with one line — never converted silently into another model.

Truth we did not write: megatron-core's own GeLU functions (the fused bias-GeLU its MLP calls under
`bias_activation_fusion`, and torch's erf GeLU of the unfused path), transformers' activation table, and models
saved by transformers itself.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
from safety_common import assert_one_line_error, load_rank, rank_file, run_cli, save_rank

from mconvert.errors import MConvertError
from mconvert.mappings.families import hf_config, preset, spec_from_megatron_args

ERF_GPT = preset("tiny-gpt2").replace(activation="gelu")


def _gpt_args(**changes) -> argparse.Namespace:
    args = ERF_GPT.to_megatron_args(1, 1)
    for k, v in changes.items():
        setattr(args, k, v)
    return args


def _mcore_gelu(fused: bool):
    """The activation megatron-core's MLP applies to fc1's output (bias added): `bias_gelu_impl` when fused,
    else `F.gelu` (transformer/mlp.py)."""
    if not fused:
        return torch.nn.functional.gelu
    from megatron.core.fusions import fused_bias_gelu

    fn = getattr(fused_bias_gelu.bias_gelu, "_torchdynamo_orig_callable", fused_bias_gelu.bias_gelu)
    return lambda x: fn(torch.zeros_like(x), x)


@pytest.mark.parametrize("changes,fused", [
    ({}, False),
    ({"bias_gelu_fusion": True}, True),  # Megatron-LM's option, on by default there
    ({"bias_activation_fusion": True}, True),  # megatron-core's config name
    ({"bias_gelu_fusion": True, "add_bias_linear": False}, False),  # Megatron-LM turns the fusion off without biases
    ({"use_te_activation_func": True}, True),  # Transformer Engine's gelu: the tanh form (common/util/math.h)
])
def test_the_exported_activation_computes_what_megatron_core_computed(changes: dict, fused: bool) -> None:
    from transformers.activations import ACT2FN

    spec = spec_from_megatron_args(_gpt_args(**changes), source="x/model_optim_rng.pt")
    if not spec.add_bias_linear:  # a bias-free GPT has no HF GPT-2 form; the activation is what counts here
        spec = spec.replace(add_bias_linear=True)
    exported = ACT2FN[hf_config(spec)["activation_function"]]
    x = torch.linspace(-6, 6, 4001)
    truth = _mcore_gelu(fused)(x)
    assert (exported(x) - truth).abs().max() <= 1e-6
    other = _mcore_gelu(not fused)(x)
    assert (exported(x) - other).abs().max() > 1e-4  # the two GeLUs differ: the check can tell them apart


def test_written_args_name_the_gelu_the_model_computes() -> None:
    """Megatron-LM turns its fused (tanh) GeLU on unless told otherwise; written args say which GeLU it is."""
    for act in ("gelu", "gelu_new"):
        args = ERF_GPT.replace(activation=act).to_megatron_args(1, 1)
        assert args.bias_gelu_fusion is False
        assert spec_from_megatron_args(args).activation == act


@pytest.mark.parametrize("changes,field", [
    ({"norm_epsilon": 0.0}, "norm_epsilon"),
    ({"norm_epsilon": 0.0, "layernorm_epsilon": 1e-2}, "norm_epsilon"),
    ({"norm_epsilon": -1e-5}, "norm_epsilon"),
    ({"rotary_base": 0}, "rotary_base"),
    ({"rotary_base": -5.0}, "rotary_base"),
])
def test_a_zero_or_negative_epsilon_or_rope_base_in_megatron_args_is_refused_by_name(changes: dict,
                                                                                     field: str) -> None:
    args = preset("tiny-llama").to_megatron_args(1, 1)
    for k, v in changes.items():
        setattr(args, k, v)
    with pytest.raises(MConvertError, match=rf"x/model_optim_rng.pt: field '{field}'"):
        spec_from_megatron_args(args, source="x/model_optim_rng.pt")


def test_an_older_args_epsilon_is_read_when_norm_epsilon_is_absent() -> None:
    args = preset("tiny-llama").to_megatron_args(1, 1)
    del args.norm_epsilon
    args.layernorm_epsilon = 1e-6
    assert spec_from_megatron_args(args).norm_epsilon == 1e-6


# ---- end to end, through the CLI -----------------------------------------------------------------------
def _gpt2_hf(out: Path, **config) -> Path:
    """A random tiny GPT-2 saved by transformers itself."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32, **config)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def tied_pp2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tied GPT-2 as a Megatron TP=2 PP=2 checkpoint: the last stage holds the embedding's copy."""
    from mconvert.convert.verbs import hf_to_megatron

    d = tmp_path_factory.mktemp("tied")
    hf_to_megatron(_gpt2_hf(d / "hf", activation_function="gelu"), d / "ckpt", tp=2, pp=2)
    (d / "ckpt" / "mconvert-manifest.json").unlink()  # as Megatron-LM writes it: edits are not caught as damage
    return d / "ckpt"


def test_a_fused_gelu_checkpoint_exports_the_tanh_gelu(tied_pp2: Path, tmp_path: Path, capsys) -> None:
    import shutil

    ck = Path(shutil.copytree(tied_pp2, tmp_path / "ck"))
    for t in range(2):
        for p in range(2):
            f = rank_file(ck, t, p)
            state = load_rank(f)
            state["args"].bias_gelu_fusion = True
            save_rank(f, state)
    code, _, err = run_cli(["megatron-to-hf", ck, tmp_path / "hf"], capsys)
    assert code == 0, err
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["activation_function"] == "gelu_new"


@pytest.mark.parametrize("verb", [["megatron-to-hf"], ["reshard", "--tp", "1", "--pp", "1"]])
def test_a_tied_head_copy_that_differs_from_the_embedding_is_refused(tied_pp2: Path, tmp_path: Path, capsys,
                                                                      verb: list[str]) -> None:
    import shutil

    ck = Path(shutil.copytree(tied_pp2, tmp_path / "ck"))
    last = rank_file(ck, 1, 1)
    state = load_rank(last)
    key = next(k for k in state["model"] if k.endswith("output_layer.weight"))
    state["model"][key][3, 5] += 0.25  # megatron-core's logits would use this copy, the export the embedding
    save_rank(last, state)
    code, _, err = run_cli([verb[0], ck, tmp_path / "out", *verb[1:]], capsys)
    assert_one_line_error(code, err, "mp_rank_01_001", "output_layer.weight", "mp_rank_01_000", "differs")
    assert not (tmp_path / "out").exists()


def test_the_untouched_tied_copy_converts(tied_pp2: Path, tmp_path: Path, capsys) -> None:
    code, _, err = run_cli(["megatron-to-hf", tied_pp2, tmp_path / "hf"], capsys)
    assert code == 0, err


def test_a_tensor_the_config_turns_off_is_refused(tmp_path: Path, capsys) -> None:
    """A q_proj.bias in a Llama whose config says attention_bias=false: transformers would drop it (with a
    warning) and compute a model the weights do not describe."""
    from safetensors.torch import load_file, save_file
    from safety_common import make_hf_llama

    hf = make_hf_llama(tmp_path / "hf")
    tensors = load_file(hf / "model.safetensors")
    tensors["model.layers.1.self_attn.q_proj.bias"] = torch.randn(64)
    save_file(tensors, str(hf / "model.safetensors"), metadata={"format": "pt"})
    code, _, err = run_cli(["hf-to-megatron", hf, tmp_path / "out", "--tp", "1", "--pp", "1"], capsys)
    assert_one_line_error(code, err, "model.layers.1.self_attn.q_proj.bias", "model.safetensors")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("theta", [0, -5.0])
def test_a_zero_or_negative_rope_theta_in_config_json_is_refused(tmp_path: Path, capsys, theta: float) -> None:
    from safety_common import make_hf_llama

    hf = make_hf_llama(tmp_path / "hf")
    cfg = json.loads((hf / "config.json").read_text())
    cfg["rope_theta"] = theta
    (hf / "config.json").write_text(json.dumps(cfg))
    code, _, err = run_cli(["hf-to-megatron", hf, tmp_path / "out", "--tp", "1", "--pp", "1"], capsys)
    assert_one_line_error(code, err, "rope_theta", "config.json")


@pytest.mark.parametrize("changes,words", [
    ({"model_type": "gpt2"}, ["model_type='gpt2'", "architectures"]),  # transformers would build a GPT-2
    ({"architectures": ["LlamaForCausalLM", "GPT2LMHeadModel"]}, ["more than one model"]),
])
def test_a_config_naming_two_models_is_refused(tmp_path: Path, capsys, changes: dict, words: list[str]) -> None:
    from safety_common import make_hf_llama

    hf = make_hf_llama(tmp_path / "hf")
    cfg = json.loads((hf / "config.json").read_text())
    cfg.update(changes)
    (hf / "config.json").write_text(json.dumps(cfg))
    code, _, err = run_cli(["hf-to-megatron", hf, tmp_path / "out", "--tp", "1", "--pp", "1"], capsys)
    assert_one_line_error(code, err, "config.json", *words)
    assert not (tmp_path / "out").exists()


# ---- --dtype into a type of smaller range ---------------------------------------------------------------------
def _with_big_weight(src: Path, dst: Path, key: str) -> Path:
    """A copy of the HF directory `src` whose tensor `key` holds 1e6 at [0, 0]: finite in float32 and bfloat16,
    Inf in float16 (whose largest value is 65504)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    (dst / "mconvert-manifest.json").unlink(missing_ok=True)
    f = next(p for p in dst.glob("*.safetensors") if key in load_file(p))
    state = load_file(f)
    state[key][0, 0] = 1e6
    save_file(state, f, metadata={"format": "pt"})
    return dst


@pytest.mark.timeout(300)
@pytest.mark.parametrize("verb", ["megatron-to-hf", "hf-to-megatron", "hf-to-megatron torch_dist", "megatron-to-ft",
                                  "megatron-to-trtllm"])
def test_a_dtype_that_turns_a_weight_into_inf_is_refused_by_tensor(verb, tmp_path, capsys):
    """--dtype fp16 of a model with a weight of 1e6 wrote Inf into the output with exit 0. Refused, naming the
    tensor and its largest magnitude, with nothing written; a wider --dtype keeps the value."""
    from safetensors.torch import load_file

    from deploy_common import make_hf
    from mconvert.convert.verbs import hf_to_megatron
    from safety_common import base

    gpt2 = verb == "megatron-to-ft"  # FasterTransformer's LLaMA has no grouped-query attention
    hf = make_hf(preset("tiny-gpt2"), tmp_path / "gpt2") if gpt2 else base()["hf"]
    key = "transformer.h.0.mlp.c_fc.weight" if gpt2 else "model.layers.0.mlp.down_proj.weight"
    big = _with_big_weight(hf, tmp_path / "big", key)
    if verb.startswith("megatron-to-"):
        src = tmp_path / "ck"
        hf_to_megatron(big, src, tp=2, pp=1)  # in float32: the value is kept
        cmd = [verb, src, tmp_path / "out"] + (["--infer-tp", "1"] if gpt2 else [])
        # FT's file of c_fc; TensorRT-LLM's rank file and its name of down_proj
        names = (("dense_h_to_4h.weight",) if gpt2 else ("rank0.safetensors", "mlp.proj.weight")
                 if verb == "megatron-to-trtllm" else ("down_proj",))
    else:
        cmd = ["hf-to-megatron", big, tmp_path / "out"] + (["--format", "torch_dist"] if "torch_dist" in verb else [])
        names = ("linear_fc2.weight",)
    wide = "fp32" if gpt2 else "bf16"  # FasterTransformer holds fp32 and fp16 only
    code, _, err = run_cli([*cmd, "--dtype", "fp16"], capsys)
    assert_one_line_error(code, err, *names, "1e+06", "float16", "Inf", f"--dtype {wide}")
    assert not (tmp_path / "out").exists()
    code, _, err = run_cli([*cmd, "--dtype", wide], capsys)
    assert code == 0, err
    if verb == "megatron-to-hf":
        got = load_file(next((tmp_path / "out").glob("*.safetensors")))[key]
        assert got.dtype == torch.bfloat16 and float(got[0, 0]) == 1e6 // 4096 * 4096  # bf16's nearest value
