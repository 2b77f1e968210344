"""Every Megatron arg and HF config field is mapped, refused, or function-neutral (mappings/fields.py).

Truth we did not write: the field lists come from the installed megatron-core `TransformerConfig` and
transformers' config classes, so a version bump that adds a field fails here until it is classified; the
Llama-3.1 checkpoint is written by megatron-core's own GPTModel with the args Megatron-LM stores for it.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
from pathlib import Path

import pytest
import torch
from safety_common import assert_one_line_error, make_hf_llama, run_cli

from mconvert.errors import MConvertError
from mconvert.mappings.fields import MEGATRON_ARGS, NEUTRAL, check, neutral, refused
from mconvert.mappings.families import FAMILIES, by_name, hf_config, hf_table, preset, spec_from_hf_config, spec_from_megatron_args

HF_CLASSES = {"gpt2": "GPT2Config", "llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config",
              "qwen3": "Qwen3Config", "mixtral": "MixtralConfig", "qwen3_moe": "Qwen3MoeConfig",
              "deepseek_v3": "DeepseekV3Config", "gemma2": "Gemma2Config", "gemma3": "Gemma3TextConfig",
              "glm4_moe": "Glm4MoeConfig"}


def _transformer_config_fields() -> list[str]:
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.transformer.transformer_config import TransformerConfig

    return [f.name for cls in (TransformerConfig, ModelParallelConfig) for f in dataclasses.fields(cls)]


def test_every_megatron_core_transformer_config_field_is_classified() -> None:
    missing = [n for n in _transformer_config_fields() if n not in MEGATRON_ARGS]
    assert not missing, f"unclassified megatron-core TransformerConfig fields: {missing}"


@pytest.mark.parametrize("model_type", sorted(HF_CLASSES))
def test_every_transformers_config_field_is_classified(model_type: str) -> None:
    import transformers

    cls = getattr(transformers, HF_CLASSES[model_type])
    names = set(cls().to_dict())  # a default instance: the family's fields and PretrainedConfig's
    names |= {p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "kwargs")}
    names |= set(transformers.PretrainedConfig().to_dict())
    missing = sorted(names - set(hf_table(by_name(model_type).model_type)))
    assert not missing, f"unclassified {HF_CLASSES[model_type]} fields: {missing}"


def test_the_function_changing_examples_are_not_neutral() -> None:
    """The args the issue names as changing the function are mapped or refused, never waved through."""
    for name in ("use_rope_scaling", "rope_scaling_factor", "rotary_seq_len_interpolation_factor", "qk_layernorm",
                 "num_experts", "multi_latent_attention", "softmax_scale", "apply_residual_connection_post_layernorm",
                 "layernorm_zero_centered_gamma", "window_size", "squared_relu", "activation_func",
                 "add_bias_linear", "rotary_interleaved", "fp8_param", "swiglu", "normalization"):
        assert MEGATRON_ARGS[name].kind != NEUTRAL, name
    for name in ("rope_scaling", "sliding_window", "attention_bias", "mlp_bias", "head_dim",
                 "partial_rotary_factor"):
        for model_type in ("llama", "mistral", "qwen2", "qwen3"):
            f = hf_table(model_type).get(name)
            if f is not None and not (model_type in ("qwen2", "qwen3") and name == "sliding_window"):
                assert f.kind != NEUTRAL, (model_type, name)
    assert hf_table("gpt2")["scale_attn_by_inverse_layer_idx"].kind != NEUTRAL


def _args(**changes) -> argparse.Namespace:
    args = preset("tiny-llama").to_megatron_args(1, 1)
    for k, v in changes.items():
        setattr(args, k, v)
    return args


def test_an_unknown_megatron_arg_is_refused_by_name_unless_unset() -> None:
    with pytest.raises(MConvertError, match=r"x/model_optim_rng.pt: .*frobnicate_heads=3 is not known"):
        spec_from_megatron_args(_args(frobnicate_heads=3), source="x/model_optim_rng.pt")
    # argparse's "never given": None for a value option, False for a flag
    assert spec_from_megatron_args(_args(frobnicate_heads=None, frobnicate=False)) == preset("tiny-llama")


def test_a_section_entry_covers_the_keys_its_table_does_not_list() -> None:
    """`quant.*` classifies every `quant.<key>` except those listed by name; a key of another section is
    unknown."""
    table = {**neutral("quantization options", "quant.*"), "quant.algo": refused("quantized weights", None)}
    check({"quant.group_size": 64, "quant.zero_point": True, "quant.algo": None}, table, "cfg", "field")
    with pytest.raises(MConvertError, match=r"^cfg: field quant.algo='W8' is not supported: quantized weights;"):
        check({"quant.algo": "W8"}, table, "cfg", "field")
    with pytest.raises(MConvertError, match=r"^cfg: field moe.top_k=2 is not known to mconvert"):
        check({"moe.top_k": 2}, table, "cfg", "field")


def test_a_refusal_ends_in_the_verdict_its_caller_gives() -> None:
    table = {"x": refused("why", 0)}
    with pytest.raises(MConvertError) as refused_x:
        check({"x": 1}, table, "src", "field", "validation refused — re-export it", unknown_hint="")
    assert str(refused_x.value) == "src: field x=1 is not supported: why; validation refused — re-export it"
    with pytest.raises(MConvertError) as unknown_y:
        check({"y": 2}, table, "src", "field", "validation refused — re-export it", unknown_hint="")
    assert str(unknown_y.value) == ("src: field y=2 is not known to mconvert and may change the model's function; "
                                    "validation refused — re-export it")
    # the conversion verbs' wording, which their tests assert piecemeal
    with pytest.raises(MConvertError) as conversion:
        check({"y": 2}, table, "src", "field")
    assert str(conversion.value).endswith("; conversion refused (remove it if it is training-only)")


def test_neutral_megatron_args_pass_whatever_their_value() -> None:
    args = _args(lr=3e-4, adam_beta2=0.95, hidden_dropout=0.1, init_method_std=0.006, moe_router_topk=8,
                 attention_softmax_in_fp32=False, apply_query_key_layer_scaling=True, bias_gelu_fusion=True,
                 recompute_granularity="full", tokenizer_type="Llama2Tokenizer", data_path=["1.0", "corpus"])
    assert spec_from_megatron_args(args) == preset("tiny-llama")


@pytest.mark.parametrize("name,value", [
    ("qk_l2_norm", True), ("apply_residual_connection_post_layernorm", True), ("window_size", (128, 1)),
    ("softmax_scale", 0.1), ("layernorm_zero_centered_gamma", True), ("apply_layernorm_1p", True),
    ("squared_relu", True),
    ("mrope_section", [16, 24, 24]), ("no_rope_freq", 4),
    ("num_experts", 8), ("multi_latent_attention", True), ("spec", ["my.module", "my_spec"]),
    ("gated_linear_unit", True), ("mtp_num_layers", 1), ("fp8_param", True),
])
def test_a_function_changing_megatron_arg_is_refused_by_name(name: str, value) -> None:
    args = _args(**{name: value})
    if name == "gated_linear_unit":
        args.swiglu = False  # GeGLU: gated, not SwiGLU
    with pytest.raises(MConvertError, match=f"{name}="):
        spec_from_megatron_args(args, source="x/model_optim_rng.pt")


@pytest.mark.parametrize("name,value", [("rotary_scaling_factor", 40.0), ("mscale", 0.707), ("mscale_all_dim", 0.0),
                                        ("yarn_beta_fast", 32.0), ("rope_type", "yarn")])
def test_a_yarn_factor_passes_where_no_yarn_rope_reads_it(name: str, value) -> None:
    """megatron-core reads YaRN's factors (and `rope_type`) only for YaRN rope, MLA and DSA; with plain rope they are
    dead. (MLA's are read: tests/mappings/test_deepseek_yarn.py.)"""
    assert spec_from_megatron_args(_args(**{name: value})) == preset("tiny-llama")
    for live in ({"experimental_attention_variant": "dsa"},):
        with pytest.raises(MConvertError, match=f"{name}="):
            spec_from_megatron_args(_args(**{name: value}, **live), source="x/model_optim_rng.pt")


def test_rope_scaling_and_qk_layernorm_args_are_read_into_the_spec() -> None:
    """megatron-core's own names for Llama-3.x / Qwen3 features are mapped, not refused."""
    spec = spec_from_megatron_args(_args(use_rope_scaling=True, rope_scaling_factor=32.0, qk_layernorm=True))
    assert (spec.rope_scaling, spec.rope_scaling_factor, spec.qk_layernorm) == ("llama3", 32.0, True)
    assert (spec.rope_low_freq_factor, spec.rope_high_freq_factor, spec.rope_original_max_position_embeddings) == (
        1.0, 4.0, 8192)  # megatron-core's `_apply_scaling` constants
    spec = spec_from_megatron_args(_args(rotary_seq_len_interpolation_factor=4))
    assert (spec.rope_scaling, spec.rope_scaling_factor) == ("linear", 4.0)


def test_refused_megatron_args_at_their_defaults_pass() -> None:
    """Megatron-LM stores every option; the refused ones hold their defaults in a plain Llama run."""
    args = _args(use_rope_scaling=False, rope_scaling_factor=8.0, rotary_scaling_factor=1.0, mscale=1.0,
                 qk_layernorm=False, softmax_type="vanilla", glu_linear_offset=0.0, hybrid_attention_ratio=0.0,
                 encoder_num_layers=2, add_position_embedding=True, gated_linear_unit=True,
                 use_rotary_position_embeddings=True, rope_type="rope", num_experts=None)
    assert spec_from_megatron_args(args) == preset("tiny-llama")


@pytest.mark.parametrize("name,value,expect", [
    ("swiglu", "yes", "swiglu='yes' must be bool"),
    ("normalization", "LayerNorm1p", "normalization='LayerNorm1p' is not supported"),
    ("position_embedding_type", "mrope", "position_embedding_type='mrope' is not supported"),
    ("untie_embeddings_and_output_weights", 1, "untie_embeddings_and_output_weights=1 must be bool"),
    ("num_query_groups", "2", "'num_query_groups' = '2' is not a finite number"),
])
def test_a_megatron_arg_of_the_wrong_type_is_refused_by_name(name: str, value, expect: str) -> None:
    with pytest.raises(MConvertError, match=expect):
        spec_from_megatron_args(_args(**{name: value}), source="x/model_optim_rng.pt")


def _hf(model_type: str, **changes) -> dict:
    spec = preset({"gpt2": "tiny-gpt2", "llama": "tiny-llama", "mistral": "tiny-mistral", "qwen2": "tiny-qwen2",
                   "qwen3": "tiny-qwen3", "mixtral": "tiny-mixtral", "qwen3_moe": "tiny-qwen3-moe",
                   "deepseek_v3": "tiny-deepseek-v3", "gemma2": "tiny-gemma2", "gemma3": "tiny-gemma3",
                   "glm4_moe": "tiny-glm45"}[model_type])
    cfg = hf_config(spec)
    cfg.update(changes)
    return cfg


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_a_config_written_by_transformers_parses(model_type: str) -> None:
    """transformers' own save (every default field written) passes the table."""
    import transformers

    if model_type not in HF_CLASSES:  # newer than the pinned transformers: tests/mappings/test_glm4_moe_lite.py
        pytest.skip(f"transformers {transformers.__version__} has no {model_type} class")
    cfg = _hf(model_type)
    if not by_name(model_type).gemma:  # mistral's class default (4096) is longer than this context
        cfg.pop("sliding_window", None)
    full = getattr(transformers, HF_CLASSES[model_type])(**cfg).to_dict()
    if model_type in ("mistral", "mixtral"):
        full["sliding_window"] = None
    ours = spec_from_hf_config(_hf(model_type))
    assert spec_from_hf_config(full).replace(bos_token_id=None, eos_token_id=None) == ours


@pytest.mark.parametrize("model_type,name,value", [
    # a yarn attention factor no mscale gives megatron-core (it multiplies by 1 whenever factor <= 1)
    ("llama", "rope_scaling", {"rope_type": "yarn", "factor": 1.0, "attention_factor": 0.5}),
    ("qwen2", "rope_scaling", {"type": "dynamic", "factor": 2.0}),
    ("mistral", "rope_scaling", {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}),
    ("llama", "rope_scaling", {"rope_type": "linear", "factor": 2.0, "attention_factor": 0.5}),
    ("qwen3", "rope_scaling", {"rope_type": "llama3", "factor": 8.0}),
    ("qwen3", "attention_bias", True),
    ("qwen3", "layer_types", ["chunked_attention", "full_attention"]),
    ("gpt2", "scale_attn_by_inverse_layer_idx", True),
    ("gpt2", "scale_attn_weights", False),
    ("llama", "partial_rotary_factor", 0.5),
    ("qwen2", "layer_types", ["sliding_attention", "full_attention"]),  # with use_sliding_window off
    ("mistral", "sliding_window", 0),
    ("llama", "pruned_heads", {"0": [1]}),
    ("llama", "quantization_config", {"quant_method": "gptq"}),
    ("llama", "attention_chunk_size", 8),  # read by transformers and vLLM, in no table
])
def test_a_function_changing_hf_field_is_refused_by_name(model_type: str, name: str, value) -> None:
    with pytest.raises(MConvertError, match=f"x/config.json: config field {name}="):
        spec_from_hf_config(_hf(model_type, **{name: value}), source="x/config.json")


@pytest.mark.parametrize("model_type,name,value", [
    ("llama", "attention_bias", "no"), ("llama", "tie_word_embeddings", "false"), ("gpt2", "activation_function", 1),
    ("qwen2", "hidden_act", "gelu"), ("mistral", "eos_token_id", "2"),
])
def test_an_hf_field_of_the_wrong_type_is_refused_by_name(model_type: str, name: str, value) -> None:
    with pytest.raises(MConvertError, match=f"config field {name}="):
        spec_from_hf_config(_hf(model_type, **{name: value}), source="x/config.json")


# ---- the Llama-3.1 case: megatron-core writes use_rope_scaling / rope_scaling_factor ------------------------


def _save_llama31(ctx, root: str) -> None:
    """One rank of a Megatron-LM save of a megatron-core GPTModel trained with Llama-3.1 rope scaling."""
    from mconvert.layouts.megatron import rank_file, save_rank_file, write_latest

    args = ctx.spec.to_megatron_args(ctx.tp, ctx.pp)
    args.params_dtype = torch.float32
    args.use_rope_scaling = True  # Megatron-LM --use-rope-scaling; megatron-core GPTModel(rope_scaling=True)
    args.rope_scaling_factor = 8.0
    state = {"args": args, "checkpoint_version": 3.0, "iteration": 1,
             "model": ctx.model.state_dict_for_save_checkpoint()}
    save_rank_file(rank_file(root, 1, ctx.tp_rank, ctx.pp_rank, ctx.pp), state)
    if ctx.rank == 0:
        write_latest(root, 1)


@pytest.mark.timeout(300)
def test_a_megatron_core_llama31_checkpoint_states_its_scaling_for_hf_and_is_refused_for_ft(tmp_path: Path,
                                                                                            capsys) -> None:
    from mcore_ref import run_mcore

    run_mcore(preset("tiny-llama"), 1, _save_llama31, (str(tmp_path / "mg"),))
    code, _, err = run_cli(["megatron-to-hf", tmp_path / "mg", tmp_path / "hf"], capsys)
    assert code == 0, err
    # megatron-core's llama3 bands (low 1, high 4, 8192 original positions) are written out, every key explicit
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["rope_scaling"] == {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}
    # FasterTransformer has no rope scaling: refused naming Megatron's arg, nothing written
    code, _, err = run_cli(["megatron-to-ft", tmp_path / "mg", tmp_path / "ft"], capsys)
    assert_one_line_error(code, err, "use_rope_scaling=True", "not mapped to FasterTransformer")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "mg"]  # no hidden partial output either


@pytest.mark.timeout(120)
@pytest.mark.parametrize("rope_scaling,named", [
    ({"rope_type": "dynamic", "factor": 4.0}, "'dynamic' is not mapped"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
     "'original_max_position_embeddings' must be a number"),
])
def test_an_hf_config_with_an_unmapped_rope_scaling_is_refused_naming_it(tmp_path: Path, capsys, rope_scaling,
                                                                         named) -> None:
    hf = make_hf_llama(tmp_path / "hf")
    cfg = json.loads((hf / "config.json").read_text())
    cfg["rope_scaling"] = rope_scaling
    (hf / "config.json").write_text(json.dumps(cfg))
    code, _, err = run_cli(["hf-to-megatron", hf, tmp_path / "mg"], capsys)
    assert_one_line_error(code, err, "rope_scaling=", named, "config.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
