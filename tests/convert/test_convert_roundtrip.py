"""Round trips against truth we did not write: random transformers models -> hf-to-megatron at TP/PP ->
megatron-to-hf must give every tensor byte-identical, an equivalent config, and identical logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
import transformers

from mconvert.mappings.families import spec_from_hf_config
from mconvert.convert.verbs import hf_to_megatron, megatron_to_hf

CONFIGS = {
    "gpt2": lambda: transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_inner=64, vocab_size=100,
                                            n_positions=32, activation_function="gelu_new"),
    # GQA with a single KV group: every TP > 1 splits a group across ranks
    "llama-g1": lambda: transformers.LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                                 num_attention_heads=8, num_key_value_heads=1, head_dim=4,
                                                 vocab_size=100, max_position_embeddings=32, rms_norm_eps=1e-5),
    "llama-g2-tied": lambda: transformers.LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=100,
                                                      max_position_embeddings=32, tie_word_embeddings=True,
                                                      rope_theta=5000.0),
    "qwen2": lambda: transformers.Qwen2Config(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                              num_attention_heads=4, num_key_value_heads=2, vocab_size=100,
                                              max_position_embeddings=32, tie_word_embeddings=False),
    # attention_bias + mlp_bias: o_proj / down_proj biases replicated, gate/up biases split as [gate_r; up_r]
    "llama-bias": lambda: transformers.LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=100,
                                                   max_position_embeddings=32, attention_bias=True, mlp_bias=True),
    # per-head q/k RMSNorm, head_dim 16 != hidden 32 / 4 heads, untied
    "qwen3": lambda: transformers.Qwen3Config(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                              vocab_size=100, max_position_embeddings=32,
                                              tie_word_embeddings=False),
    # Llama-3.1 rope scaling with megatron-core's bands
    "llama3": lambda: transformers.LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                               num_attention_heads=4, num_key_value_heads=2, vocab_size=100,
                                               max_position_embeddings=32, rope_theta=500000.0,
                                               rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                             "original_max_position_embeddings": 8192}),
    "mistral": lambda: transformers.MistralConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                                  num_attention_heads=4, num_key_value_heads=1, vocab_size=100,
                                                  max_position_embeddings=32, sliding_window=None),
    # a window of 4 keys on every layer, shorter than TOKENS (10)
    "mistral-swa": lambda: transformers.MistralConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                                      num_attention_heads=4, num_key_value_heads=1, vocab_size=100,
                                                      max_position_embeddings=32, sliding_window=4),
    # Qwen2's per-layer window: layer 0 windowed, layer 1 full attention (a pattern max_window_layers cannot state)
    "qwen2-swa": lambda: transformers.Qwen2Config(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=100,
                                                  max_position_embeddings=32, use_sliding_window=True,
                                                  sliding_window=4, layer_types=["sliding_attention",
                                                                                 "full_attention"]),
}
TOKENS = torch.tensor([[1, 5, 17, 99, 42, 3, 64, 8, 0, 77]])


def _randomize(model: torch.nn.Module) -> None:
    """Random values everywhere (norms and biases too), so a swapped tensor cannot hide."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory) -> dict[str, tuple[torch.nn.Module, Path]]:
    out = {}
    for name, cfg in CONFIGS.items():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(cfg(), attn_implementation="eager").eval()
        _randomize(model)
        d = tmp_path_factory.mktemp(name)
        model.save_pretrained(d)
        out[name] = (model, d)
    return out


def _logits(model_dir: Path) -> torch.Tensor:
    m = transformers.AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()
    with torch.no_grad():
        return m(TOKENS).logits


LAYOUTS = [(1, 2), (2, 1), (4, 2)]  # TP 1/2/4 and PP 1/2 each appear


@pytest.mark.parametrize("name,tp,pp", [(n, t, p) for n in CONFIGS for t, p in LAYOUTS if n != "llama-bias"]
                         + [("llama-bias", 2, 2)])
def test_hf_megatron_hf_is_identical(hf_models, tmp_path, name, tp, pp):
    model, src = hf_models[name]
    hf_to_megatron(src, tmp_path / "mg", tp=tp, pp=pp)
    megatron_to_hf(tmp_path / "mg", tmp_path / "back")
    a, b = load_file(src / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    cfg_a = json.loads((src / "config.json").read_text())
    cfg_b = json.loads((tmp_path / "back" / "config.json").read_text())
    assert spec_from_hf_config(cfg_a) == spec_from_hf_config(cfg_b)
    assert cfg_b["architectures"] == cfg_a["architectures"]
    with torch.no_grad():
        want = model(TOKENS).logits
    assert torch.equal(_logits(tmp_path / "back"), want)


def test_megatron_files_have_the_declared_layout(hf_models, tmp_path):
    """TP=4 over a single KV group: every rank holds a contiguous quarter of the fused qkv rows."""
    from mconvert.io.safeload import safe_load

    model, src = hf_models["llama-g1"]
    hf_to_megatron(src, tmp_path / "mg", tp=4, pp=2)
    st = safe_load(tmp_path / "mg" / "release" / "mp_rank_03_001" / "model_optim_rng.pt")
    m = st["model"]
    assert m["decoder.layers.0.self_attention.linear_qkv.weight"].shape == ((8 + 2) * 4 // 4, 32)
    assert m["output_layer.weight"].shape == (512 // 4, 32)  # vocab 100 padded to a multiple of 128·TP = 512
    assert st["args"].padded_vocab_size == 512 and st["args"].tensor_model_parallel_size == 4
    assert "embedding.word_embeddings.weight" not in m and "decoder.final_layernorm.weight" in m


def test_pytorch_model_bin_input(hf_models, tmp_path):
    """HF dirs with only pytorch_model.bin (what transformers' Megatron script reads) convert the same way."""
    model, _ = hf_models["gpt2"]
    model.save_pretrained(tmp_path / "bin", safe_serialization=False)
    assert not list((tmp_path / "bin").glob("*.safetensors"))
    hf_to_megatron(tmp_path / "bin", tmp_path / "mg", tp=2, pp=2)
    megatron_to_hf(tmp_path / "mg", tmp_path / "back")
    with torch.no_grad():
        assert torch.equal(_logits(tmp_path / "back"), model(TOKENS).logits)


def test_a_window_travels_in_megatron_core_args(hf_models, tmp_path):
    """HF's window of 4 keys on layer 0 only is megatron-core's window_size (3, 0) on layer 0 only, as megatron-core's
    own `is_layer_window_attention` reads the written args."""
    from megatron.core.transformer.utils import is_layer_window_attention

    from mconvert.io.safeload import safe_load

    _, src = hf_models["qwen2-swa"]
    hf_to_megatron(src, tmp_path / "mg", tp=2, pp=2)
    args = safe_load(tmp_path / "mg" / "release" / "mp_rank_00_001" / "model_optim_rng.pt")["args"]
    assert tuple(args.window_size) == (3, 0)
    assert [is_layer_window_attention(args.window_size, args.window_attn_skip_freq, n) for n in (1, 2)] == [True, False]
