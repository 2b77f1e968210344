"""FasterTransformer layout pins: every .bin `megatron-to-ft` writes, byte for byte, against truth mconvert did not write.

Truth used here, and nothing of mconvert's FT code (no `load_ft_tensor`, `section_layout`, mappings or runner):
- the tensors of transformers' own `GPT2LMHeadModel` / `LlamaForCausalLM` (their `state_dict()`), and their
  configs for the config.ini fields;
- the on-disk layout that FasterTransformer's own code defines (NVIDIA/FasterTransformer), transcribed by hand
  into the expected-array builders below:
  * `examples/pytorch/gpt/utils/huggingface_gpt_convert.py` (HF GPT-2 -> `[gpt]` files; it reads the same
    transformers tensors we read, so its recipe applied to them is the expected file content),
  * `examples/pytorch/gpt/utils/megatron_ckpt_convert.py` (the same file names and splits from a Megatron
    checkpoint: rank `i * factor + j`, QKV as `[H, 3, H/t]`, the layer index global),
  * `src/fastertransformer/models/multi_gpu_gpt/ParallelGptDecoderLayerWeight.cc` (the shapes the `[gpt]`
    loader reads per rank: QKV `{H, 3H/t}`, bias `{3, H/t}`, dense `{H/t, H}`, fc1 `{H, F/t}`, fc2 `{F/t, H}`),
  * `examples/cpp/llama/huggingface_llama_convert.py` (HF LLaMA -> `[llama]` files: QKV =
    `stack([q, k, v])` transposed to `[in, 3, out]` and split on the last axis, `o_proj`/`down_proj`
    transposed and split on rows, `gate_proj`/`up_proj` transposed and split on columns),
  * `src/fastertransformer/models/llama/LlamaWeight.cc` + `LlamaDecoderLayerWeight.cc` (the `[llama]` file
    names: `model.wte.weight.bin`, `model.final_layernorm.weight.bin`, `model.lm_head.weight.bin`,
    `model.layers.<l>.*`, and the per-rank element counts).

The pipeline is the one users run: transformers model -> `mconvert hf-to-megatron --tp 2` ->
`mconvert megatron-to-ft --infer-tp T`, for T below, equal to and above the training TP.
"""

from __future__ import annotations

import configparser
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from mconvert.cli import main as cli_main

TRAIN_TP = 2
INFER_TPS = (1, 2, 4)  # merge, same, split: all three rank mappings of megatron_ckpt_convert.py


def _cli(*argv: str) -> None:
    try:
        rc = cli_main(list(argv))
    except SystemExit as e:  # the console entry exits only on failure; 0 would still be success
        rc = e.code
    assert rc in (0, None), f"mconvert {' '.join(argv)} exited {rc}"


def _randomise(model: torch.nn.Module, seed: int) -> None:
    """Every parameter random and distinct (HF zero-inits biases and one-inits norms, which would hide a swap)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype))


def _state(model: torch.nn.Module) -> dict[str, np.ndarray]:
    return {k: v.detach().to(torch.float32).numpy().copy() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory) -> dict:
    """A tiny tied GPT-2 (4 heads of 16, F = 4H as FT's converter assumes), and its Megatron TP=2 checkpoint."""
    d = tmp_path_factory.mktemp("gpt2_pins")
    cfg = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32, layer_norm_epsilon=2e-5,
                     activation_function="gelu_new", bos_token_id=3, eos_token_id=5, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg).eval()
    _randomise(model, 11)
    model.save_pretrained(d / "hf", safe_serialization=True)
    _cli("hf-to-megatron", str(d / "hf"), str(d / "meg"), "--tp", str(TRAIN_TP))
    return {"dir": d, "config": cfg, "sd": _state(model)}


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> dict:
    """A tiny untied MHA LLaMA (num_key_value_heads == num_attention_heads: FT's [llama] has no GQA)."""
    d = tmp_path_factory.mktemp("llama_pins")
    cfg = LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
                      intermediate_size=96, vocab_size=128, max_position_embeddings=64, rms_norm_eps=2e-5,
                      rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                      attention_bias=False, mlp_bias=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    _randomise(model, 12)
    model.save_pretrained(d / "hf", safe_serialization=True)
    _cli("hf-to-megatron", str(d / "hf"), str(d / "meg"), "--tp", str(TRAIN_TP))
    return {"dir": d, "config": cfg, "sd": _state(model)}


def _to_ft(src: dict, t: int) -> Path:
    out = src["dir"] / f"ft{t}"
    if not out.exists():
        _cli("megatron-to-ft", str(src["dir"] / "meg"), str(out), "--infer-tp", str(t))
    return out / f"{t}-gpu"


def _split(x: np.ndarray, t: int, axis: int) -> list[np.ndarray]:
    return np.split(x, t, axis=axis)  # FT's converters: rank r is the r-th equal piece


def _assert_files(ft: Path, want: dict[str, np.ndarray]) -> None:
    """Every .bin FT's layout names holds exactly `want[name]` (raw little-endian fp32, C order); no other .bin."""
    have = sorted(p.name for p in ft.glob("*.bin"))
    assert have == sorted(want), (sorted(set(have) - set(want)), sorted(set(want) - set(have)))
    for name, x in want.items():
        got = np.fromfile(ft / name, dtype="<f4")
        exp = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
        assert got.shape == exp.shape, f"{name}: {got.size} values, FT's layout has {exp.size}"
        assert np.array_equal(got, exp), f"{name}: values differ from FT's layout of the transformers tensor"


def _ini(ft: Path, section: str) -> configparser.SectionProxy:
    cp = configparser.ConfigParser()
    cp.read(ft / "config.ini")
    assert cp.has_section(section), cp.sections()
    return cp[section]


# ---- [gpt] ---------------------------------------------------------------------------------------------
def gpt2_expected(sd: dict[str, np.ndarray], cfg: GPT2Config, t: int) -> dict[str, np.ndarray]:
    """FT's `[gpt]` files for a transformers GPT-2, as huggingface_gpt_convert.py lays them out.

    transformers' GPT-2 keeps Conv1D weights as `[in, out]`, which is FT's orientation as is; `c_attn` is
    `[H, 3H]` with columns q | k | v, each heads-major, so `reshape(H, 3, H)` split on the last axis gives
    rank r the heads `[r·n/t, (r+1)·n/t)` of q, k and v alike (the `[H, 3, H/t]` the loader reads)."""
    H = cfg.n_embd
    want = {
        "model.wte.bin": sd["transformer.wte.weight"],
        "model.wpe.bin": sd["transformer.wpe.weight"],
        "model.final_layernorm.weight.bin": sd["transformer.ln_f.weight"],
        "model.final_layernorm.bias.bin": sd["transformer.ln_f.bias"],
        # tied: no model.lm_head.weight.bin (GPT2Model, which the converter reads, has no head; FT then uses wte)
    }
    for i in range(cfg.n_layer):
        hf, ft = f"transformer.h.{i}.", f"model.layers.{i}."
        want |= {
            ft + "input_layernorm.weight.bin": sd[hf + "ln_1.weight"],
            ft + "input_layernorm.bias.bin": sd[hf + "ln_1.bias"],
            ft + "post_attention_layernorm.weight.bin": sd[hf + "ln_2.weight"],
            ft + "post_attention_layernorm.bias.bin": sd[hf + "ln_2.bias"],
            ft + "attention.dense.bias.bin": sd[hf + "attn.c_proj.bias"],
            ft + "mlp.dense_4h_to_h.bias.bin": sd[hf + "mlp.c_proj.bias"],
        }
        per_rank = {
            "attention.query_key_value.weight": _split(sd[hf + "attn.c_attn.weight"].reshape(H, 3, H), t, -1),
            "attention.query_key_value.bias": _split(sd[hf + "attn.c_attn.bias"].reshape(3, H), t, -1),
            "attention.dense.weight": _split(sd[hf + "attn.c_proj.weight"], t, 0),
            "mlp.dense_h_to_4h.weight": _split(sd[hf + "mlp.c_fc.weight"], t, -1),
            "mlp.dense_h_to_4h.bias": _split(sd[hf + "mlp.c_fc.bias"], t, -1),
            "mlp.dense_4h_to_h.weight": _split(sd[hf + "mlp.c_proj.weight"], t, 0),
        }
        for key, parts in per_rank.items():
            for r, x in enumerate(parts):
                want[f"{ft}{key}.{r}.bin"] = x
    return want


def test_gpt2_expectation_matches_ft_loader_shapes(gpt2):
    """The expected arrays have the per-rank shapes ParallelGptDecoderLayerWeight.cc reads (a self-check of
    the transcription, independent of mconvert)."""
    cfg, t = gpt2["config"], 2
    H, F = cfg.n_embd, 4 * cfg.n_embd
    want = gpt2_expected(gpt2["sd"], cfg, t)
    p = "model.layers.1."
    assert want[p + "attention.query_key_value.weight.1.bin"].shape == (H, 3, H // t)
    assert want[p + "attention.query_key_value.bias.1.bin"].shape == (3, H // t)
    assert want[p + "attention.dense.weight.1.bin"].shape == (H // t, H)
    assert want[p + "mlp.dense_h_to_4h.weight.1.bin"].shape == (H, F // t)
    assert want[p + "mlp.dense_h_to_4h.bias.1.bin"].shape == (F // t,)
    assert want[p + "mlp.dense_4h_to_h.weight.1.bin"].shape == (F // t, H)


@pytest.mark.parametrize("t", INFER_TPS)
def test_gpt2_ft_files_are_transformers_tensors_in_ft_layout(gpt2, t):
    ft = _to_ft(gpt2, t)
    _assert_files(ft, gpt2_expected(gpt2["sd"], gpt2["config"], t))


@pytest.mark.parametrize("t", INFER_TPS)
def test_gpt2_ft_config_ini_matches_transformers_config(gpt2, t):
    cfg = gpt2["config"]
    g = _ini(_to_ft(gpt2, t), "gpt")
    # the fields huggingface_gpt_convert.py derives from the transformers config
    assert int(g["head_num"]) == cfg.n_head
    assert int(g["size_per_head"]) == cfg.n_embd // cfg.n_head
    assert int(g["inter_size"]) == 4 * cfg.n_embd  # n_inner=None: transformers' MLP is 4·n_embd wide
    assert int(g["max_pos_seq_len"]) == cfg.n_positions
    assert int(g["num_layer"]) == cfg.n_layer
    assert int(g["vocab_size"]) == cfg.vocab_size
    assert (int(g["start_id"]), int(g["end_id"])) == (cfg.bos_token_id, cfg.eos_token_id)
    assert g["weight_data_type"] == "fp32"
    assert int(g["tensor_para_size"]) == t
    # FT's gptVariantParams default is 1e-6; the model's own epsilon must be written
    assert float(g["layernorm_eps"]) == cfg.layer_norm_epsilon


# ---- [llama] -------------------------------------------------------------------------------------------
def llama_expected(sd: dict[str, np.ndarray], cfg: LlamaConfig, t: int) -> dict[str, np.ndarray]:
    """FT's `[llama]` files for a transformers LLaMA, as huggingface_llama_convert.py lays them out.

    nn.Linear weights are `[out, in]`: the converter stacks q, k, v to `[3, out, in]`, transposes to
    `[in, 3, out]` and splits the last axis (rank r: heads `[r·n/t, (r+1)·n/t)` of each, in transformers'
    own row order, which FT's NeoX-style rotary reads as is); every other 2-D weight is transposed to
    `[in, out]`, then split on columns (gate, up) or rows (o_proj, down_proj)."""
    want = {
        "model.wte.weight.bin": sd["model.embed_tokens.weight"],
        "model.final_layernorm.weight.bin": sd["model.norm.weight"],
        "model.lm_head.weight.bin": sd["lm_head.weight"],
    }
    for i in range(cfg.num_hidden_layers):
        hf, ft = f"model.layers.{i}.", f"model.layers.{i}."
        want |= {
            ft + "input_layernorm.weight.bin": sd[hf + "input_layernorm.weight"],
            ft + "post_attention_layernorm.weight.bin": sd[hf + "post_attention_layernorm.weight"],
        }
        qkv = np.stack([sd[hf + f"self_attn.{n}_proj.weight"] for n in "qkv"]).transpose(2, 0, 1)
        per_rank = {
            "attention.query_key_value.weight": _split(qkv, t, -1),
            "attention.dense.weight": _split(sd[hf + "self_attn.o_proj.weight"].T, t, 0),
            "mlp.gate_proj.weight": _split(sd[hf + "mlp.gate_proj.weight"].T, t, -1),
            "mlp.up_proj.weight": _split(sd[hf + "mlp.up_proj.weight"].T, t, -1),
            "mlp.down_proj.weight": _split(sd[hf + "mlp.down_proj.weight"].T, t, 0),
        }
        for key, parts in per_rank.items():
            for r, x in enumerate(parts):
                want[f"{ft}{key}.{r}.bin"] = x
    return want


def test_llama_expectation_matches_ft_loader_sizes(llama):
    """Element counts per rank as LlamaDecoderLayerWeight.cc reads them (self-check of the transcription)."""
    cfg, t = llama["config"], 2
    H, F = cfg.hidden_size, cfg.intermediate_size
    want = llama_expected(llama["sd"], cfg, t)
    p = "model.layers.0."
    assert want[p + "attention.query_key_value.weight.1.bin"].shape == (H, 3, H // t)
    assert want[p + "attention.dense.weight.1.bin"].size == H // t * H
    assert want[p + "mlp.gate_proj.weight.1.bin"].shape == (H, F // t)
    assert want[p + "mlp.up_proj.weight.1.bin"].size == H * F // t
    assert want[p + "mlp.down_proj.weight.1.bin"].shape == (F // t, H)
    assert want["model.lm_head.weight.bin"].size == cfg.vocab_size * H


@pytest.mark.parametrize("t", INFER_TPS)
def test_llama_ft_files_are_transformers_tensors_in_ft_layout(llama, t):
    ft = _to_ft(llama, t)
    _assert_files(ft, llama_expected(llama["sd"], llama["config"], t))


@pytest.mark.parametrize("t", INFER_TPS)
def test_llama_ft_config_ini_matches_transformers_config(llama, t):
    cfg = llama["config"]
    g = _ini(_to_ft(llama, t), "llama")
    hd = cfg.hidden_size // cfg.num_attention_heads
    # the fields huggingface_llama_convert.py derives from the transformers config
    assert int(g["head_num"]) == cfg.num_attention_heads
    assert int(g["size_per_head"]) == hd
    assert int(g["inter_size"]) == cfg.intermediate_size
    assert int(g["num_layer"]) == cfg.num_hidden_layers
    assert int(g["rotary_embedding"]) == hd
    assert int(g["vocab_size"]) == cfg.vocab_size
    assert (int(g["start_id"]), int(g["end_id"])) == (cfg.bos_token_id, cfg.eos_token_id)
    assert g["weight_data_type"] == "fp32"
    # not written by FT's llama converter; mconvert adds them, so they must still be the model's own
    assert int(g["tensor_para_size"]) == t
    assert float(g["layernorm_eps"]) == cfg.rms_norm_eps
