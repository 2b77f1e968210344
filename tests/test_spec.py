"""ModelSpec: presets, Megatron args and HF config round trips, checked against transformers' own classes."""

import argparse
import types

import pytest
import torch
import transformers

from mconvert.errors import MConvertError
from mconvert.mappings.families import PRESETS, hf_config, preset, spec_from_hf_config, spec_from_megatron_args

TINY = [n for n in PRESETS if n.startswith("tiny-")]
TINY_HF = TINY  # every tiny preset has an HF form


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_has_a_vllm_cpu_head_dim(name):
    spec = PRESETS[name]
    if spec.is_mla:  # vLLM's CPU MLA kernel attends over the kv latent and the rope part
        assert spec.kv_lora_rank + spec.qk_rope_head_dim == 576
    else:
        assert spec.head_dim in (32, 64, 128)


@pytest.mark.parametrize("name", TINY_HF + ["gpt2-100m", "llama-100m"])
def test_param_count_equals_transformers_model(name):
    """Our declared full shapes add up to exactly the parameters transformers builds from our config (which holds
    no MTP layer: their export is refused by name)."""
    spec = PRESETS[name].replace(mtp_num_layers=None)
    cfg = transformers.AutoConfig.for_model(**hf_config(spec))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    theirs = {n: tuple(p.shape) for n, p in model.named_parameters()}  # tied head listed once
    ours = spec.replace(make_vocab_size_divisible_by=1).num_parameters()
    assert sum(torch.Size(s).numel() for s in theirs.values()) == ours


@pytest.mark.parametrize("name", TINY_HF)
def test_hf_config_round_trip_through_transformers(name):
    spec = PRESETS[name].replace(mtp_num_layers=None)
    cfg = transformers.AutoConfig.for_model(**hf_config(spec))
    assert type(cfg).__name__.lower().startswith(spec.family.replace("_", ""))  # qwen3_moe: Qwen3MoeConfig
    back = spec_from_hf_config(cfg.to_dict())
    assert back == spec.replace(bos_token_id=back.bos_token_id, eos_token_id=back.eos_token_id)


def test_hf_config_always_writes_eps_and_rope():
    cfg = hf_config(preset("tiny-llama"))
    assert cfg["rms_norm_eps"] == 1e-5 and cfg["rope_theta"] == 10000.0
    assert cfg["num_key_value_heads"] == 2 and cfg["head_dim"] == 32
    assert hf_config(preset("tiny-gpt2"))["layer_norm_epsilon"] == 1e-5


@pytest.mark.parametrize("name", list(PRESETS))
def test_megatron_args_round_trip(name):
    spec = PRESETS[name]
    args = spec.to_megatron_args(tp=2, pp=2)
    assert isinstance(args, argparse.Namespace)
    assert spec_from_megatron_args(args) == spec


def test_megatron_mha_keeps_one_query_group_like_megatron():
    args = preset("tiny-gpt2").to_megatron_args()
    assert args.group_query_attention is False and args.num_query_groups == 1
    assert spec_from_megatron_args(args).num_groups == args.num_attention_heads


def test_transformers_script_style_args():
    """SimpleNamespace, ffn_hidden_size=None (= 4H), openai_gelu, no vocab_size: what transformers' script writes."""
    ns = types.SimpleNamespace(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=2,
        ffn_hidden_size=None,
        max_position_embeddings=128,
        padded_vocab_size=1024,
        openai_gelu=True,
        tokenizer_type="GPT2BPETokenizer",
    )
    spec = spec_from_megatron_args(ns)
    assert spec.family == "gpt2" and spec.ffn_hidden_size == 256 and spec.activation == "gelu_new"


def test_vocab_padding_is_megatrons():
    spec = preset("tiny-gpt2").replace(vocab_size=50257)
    assert spec.padded_vocab_size(1) == 50304
    assert spec.padded_vocab_size(8) == 51200


@pytest.mark.parametrize(
    "tp,pp,msg",
    [(3, 1, "num_attention_heads"), (1, 3, "num_layers"), (8, 1, "num_attention_heads")],
)
def test_parallel_sizes_that_do_not_divide_are_refused(tp, pp, msg):
    with pytest.raises(MConvertError, match=msg):
        preset("tiny-llama").check_parallel(tp, pp)


def test_split_declarations():
    spec = preset("tiny-llama")
    assert spec.split_kind("decoder.layers.1.self_attention.linear_qkv.weight") == "qkv"
    assert spec.split_kind("decoder.layers.0.mlp.linear_fc1.weight") == "gated"
    assert spec.split_kind("decoder.layers.0.mlp.linear_fc2.weight") == "row"
    assert spec.split_kind("embedding.word_embeddings.weight") == "vocab"
    assert spec.split_kind("output_layer.weight") == "vocab"
    assert preset("tiny-gpt2").split_kind("decoder.layers.0.mlp.linear_fc1.bias") == "column"
    with pytest.raises(MConvertError, match="no split declaration"):
        spec.split_kind("decoder.layers.0.mlp.router.weight")


def test_unsupported_architecture_is_one_line():
    with pytest.raises(MConvertError, match="unsupported architecture"):
        spec_from_hf_config({"architectures": ["BertModel"], "model_type": "bert", "vocab_size": 10})
