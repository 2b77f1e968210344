"""The neutral rule for HF config fields, and every refusal of one config at once.

Truth we did not write: which names matter comes from an AST walk of the installed transformers (and vLLM,
when its venv is built) sources (`hf_config_reads.py`); the shipped set must hold every name they read. A
field no engine reads passes whatever its value; a field one reads stays mapped or refused, and every
refusal the tables make today still refuses.
"""

from __future__ import annotations

import functools
import json

import pytest
from hf_config_reads import SHIPPED, derive, vllm_root
from safety_common import assert_one_line_error, make_hf_llama, run_cli

from mconvert.errors import MConvertError
from mconvert.mappings.families import FAMILIES, hf_config, hf_reads, hf_table, preset, spec_from_hf_config
from mconvert.mappings.fields import REFUSED, check, refused

PRESET = {"gpt2": "tiny-gpt2", "llama": "tiny-llama", "mistral": "tiny-mistral", "qwen2": "tiny-qwen2",
          "qwen3": "tiny-qwen3", "mixtral": "tiny-mixtral", "qwen3_moe": "tiny-qwen3-moe"}


@functools.cache
def _derived() -> dict[str, set[str]]:
    return {t: set(n) for t, n in derive(vllm_root())["model_types"].items()}  # type: ignore[union-attr]


def _hf(model_type: str, **changes) -> dict:
    cfg = hf_config(preset(PRESET[model_type]))
    cfg.update(changes)
    return cfg


def test_the_shipped_reads_hold_every_name_the_installed_engines_read() -> None:
    """Re-derived from the installed sources: a name the shipped file lacks would pass unread. Regenerate with
    `python tests/helpers/hf_config_reads.py --write`."""
    shipped = json.loads(SHIPPED.read_text())["model_types"]
    assert set(shipped) == {f.model_type for f in FAMILIES.values()}, "a family's model_type is not covered"
    missing = {t: sorted(names - set(shipped[t])) for t, names in _derived().items() if names - set(shipped[t])}
    assert not missing, f"names the engines read that {SHIPPED.name} lacks: {missing}"


def test_the_walk_finds_the_reads_it_must() -> None:
    """The walker sees each form of read: attributes (`config.rms_norm_eps`), getattr (transformers'
    `getattr(config, "head_dim", ...)`), the config class's derived fields (Qwen2's `use_sliding_window`), the
    attribute_map targets (GPT-2's `n_embd`), and vLLM's reads when its venv is built."""
    d = _derived()
    assert {"rms_norm_eps", "head_dim", "rope_scaling", "tie_word_embeddings", "attention_chunk_size"} <= d["llama"]
    assert {"use_sliding_window", "max_window_layers"} <= d["qwen2"]
    assert {"n_embd", "scale_attn_by_inverse_layer_idx"} <= d["gpt2"]
    assert {"norm_topk_prob", "decoder_sparse_step"} <= d["qwen3_moe"]
    if vllm_root() is not None:  # vLLM's Qwen3-MoE adds a shared expert that transformers' class has not
        assert "shared_expert_intermediate_size" in d["qwen3_moe"]


# Fields of published configs that no engine reads: tool stamps, loader metadata, tokenizer ids.
STAMPS = {"unsloth_version": "2024.9", "unsloth_fixed": True, "transformers.js_config": {"dtype": "q4"},
          "is_llama_config": True, "_model_name_or_path": "/ckpt/step-1000", "_num_labels": 2, "unk_token_id": 0,
          "mask_token_id": 4, "additional_special_tokens_ids": [], "max_sequence_length": 4096}


@pytest.mark.parametrize("model_type", sorted(PRESET))
def test_a_field_no_engine_reads_passes_whatever_its_value(model_type: str) -> None:
    unread = set(STAMPS) - _derived()[model_type]
    assert unread == set(STAMPS), f"read by an engine now: {sorted(set(STAMPS) - unread)}"
    assert spec_from_hf_config(_hf(model_type, **STAMPS)) == spec_from_hf_config(_hf(model_type))


def test_values_that_state_the_architectures_own_behaviour_pass() -> None:
    """Qwen3-MoE configs as Qwen publishes them: q/k norm on (the class always has it), no shared expert."""
    plain = spec_from_hf_config(_hf("qwen3_moe"))
    assert spec_from_hf_config(_hf("qwen3_moe", use_qk_norm=True, shared_expert_intermediate_size=0)) == plain
    with pytest.raises(MConvertError, match="config field shared_expert_intermediate_size=512 is not supported"):
        spec_from_hf_config(_hf("qwen3_moe", shared_expert_intermediate_size=512), source="x/config.json")


def test_rope_parameters_read_only_as_transformers_5_writes_plain_rope() -> None:
    """transformers 5 writes rope_theta only inside `rope_parameters`; read there (tests/convert/hf/test_hf_config_corpus.py
    proves it on published re-saves). Scaling given there, per-layer-type parameters and a rope_theta that
    contradicts the config's own are refused by name."""
    theta = _hf("llama")["rope_theta"]
    for value in ({"rope_type": "default", "rope_theta": theta * 2},
                  {"full_attention": {"rope_type": "default", "rope_theta": theta}},
                  {"rope_type": "linear", "rope_theta": theta, "factor": 2.0}):
        with pytest.raises(MConvertError, match="x/config.json: config field rope_parameters="):
            spec_from_hf_config(_hf("llama", rope_parameters=value), source="x/config.json")


# Every refusal of an HF config field mconvert makes, with a value it refuses.
TODAY_REFUSED = [
    *((t, n, v) for t in PRESET for n, v in (
        ("add_cross_attention", True), ("is_encoder_decoder", True), ("cross_attention_hidden_size", 512),
        ("pruned_heads", {"0": [1]}), ("quantization_config", {"quant_method": "gptq"}),
        ("quantization", {"group_size": 64, "bits": 4}),
        ("rope_parameters", {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}),
        # read by transformers' masking and vLLM, classified by no table: chunked attention
        ("attention_chunk_size", 8),
    )),
    ("gpt2", "rope_scaling", {"rope_type": "linear", "factor": 2.0}),
    ("gpt2", "scale_attn_weights", False), ("gpt2", "scale_attn_by_inverse_layer_idx", True),
    ("gpt2", "reorder_and_upcast_attn", True), ("gpt2", "activation_function", "relu"),
    *((t, "partial_rotary_factor", 0.5) for t in PRESET if t != "gpt2"),
    *((t, "hidden_act", "gelu") for t in PRESET if t != "gpt2"),
    *((t, "rope_scaling", {"rope_type": "dynamic", "factor": 2.0}) for t in PRESET if t != "gpt2"),
    *((t, "rope_scaling", {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0]})
      for t in PRESET if t != "gpt2"),
    ("qwen3", "attention_bias", True), ("qwen3_moe", "attention_bias", True),
    *((t, "dual_chunk_attention_config", {"chunk_size": 262144, "local_size": 8192,
                                          "original_max_position_embeddings": 262144})
      for t in ("qwen2", "qwen3", "qwen3_moe")),
    ("qwen3_moe", "decoder_sparse_step", 2), ("qwen3_moe", "mlp_only_layers", [0]),
    ("qwen3_moe", "shared_expert_intermediate_size", 512), ("qwen3_moe", "norm_topk_prob", False),
    # the variants of the mapped sliding window and YaRN that no engine pair computes alike
    *((t, "rope_scaling", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                           "truncate": "yes"}) for t in PRESET if t != "gpt2"),
    ("mistral", "sliding_window", 0),
    *((t, "layer_types", ["chunked_attention", "full_attention"]) for t in ("qwen2", "qwen3")),
]


@pytest.mark.parametrize("model_type,name,value", TODAY_REFUSED)
def test_every_refusal_of_today_still_refuses(model_type: str, name: str, value) -> None:
    with pytest.raises(MConvertError, match=f"x/config.json: config field {name}="):
        spec_from_hf_config(_hf(model_type, **{name: value}), source="x/config.json")


@pytest.mark.parametrize("model_type", sorted(PRESET))
def test_the_refusal_list_covers_every_refused_entry_of_the_tables(model_type: str) -> None:
    listed = {n for t, n, _ in TODAY_REFUSED if t == model_type}
    refused_here = {n for n, f in hf_table(model_type).items() if f.kind == REFUSED}
    assert refused_here <= listed, f"refused by the {model_type} table, not in TODAY_REFUSED: {refused_here - listed}"


def test_a_read_name_in_no_table_passes_only_unset() -> None:
    assert hf_reads("llama") is not None and "attention_chunk_size" in hf_reads("llama")
    assert spec_from_hf_config(_hf("llama", attention_chunk_size=None)) == spec_from_hf_config(_hf("llama"))


# ---- every offending field at once ----------------------------------------------------------------------
def test_check_names_every_refused_field_in_one_error() -> None:
    table = {"a": refused("why a", 0), "b": refused("why b", 0)}
    with pytest.raises(MConvertError) as e:
        check({"a": 1, "ok": None, "b": 2, "c": "x", "d": 3}, table, "src", "field", reads={"c"})
    assert e.value.summary == ("src: 3 fields are refused (a, b, c); conversion refused (remove it if it is "
                               "training-only)")
    assert e.value.details == ("field a=1 is not supported: why a", "field b=2 is not supported: why b",
                               "field c='x' is not known to mconvert and may change the model's function")
    assert str(e.value).splitlines() == [e.value.summary, *e.value.details]
    # d: in no table and read by nothing, so it passes; one refusal alone stays the one line it always was
    with pytest.raises(MConvertError) as one:
        check({"a": 1, "d": 3}, table, "src", "field", reads=set())
    assert str(one.value) == "src: field a=1 is not supported: why a; conversion refused" and not one.value.details


def test_the_error_keeps_its_lines_across_processes() -> None:
    import pickle

    e = MConvertError("src: 2 fields are refused (a, b)", ["field a=1", "field b=2"])
    back = pickle.loads(pickle.dumps(e))
    assert (back.summary, back.details, str(back)) == (e.summary, e.details, str(e))


def test_hf_to_megatron_names_every_offending_field_in_one_run(tmp_path, capsys) -> None:
    """The CLI prints the summary as the `error:` line and one indented line per field, nothing written."""
    hf = make_hf_llama(tmp_path / "hf")
    cfg = json.loads((hf / "config.json").read_text())
    cfg.update(partial_rotary_factor=0.5, attention_chunk_size=8, unk_token_id=0, pruned_heads={"0": [1]})
    (hf / "config.json").write_text(json.dumps(cfg))
    code, _, err = run_cli(["hf-to-megatron", hf, tmp_path / "mg"], capsys)
    text = assert_one_line_error(code, err, "partial_rotary_factor=0.5", "attention_chunk_size=8",
                                 "pruned_heads={'0': [1]}", details=3)
    lines = text.splitlines()
    assert lines[0] == (f"error: {hf / 'config.json'}: 3 config fields are refused (partial_rotary_factor, "
                        "attention_chunk_size, pruned_heads); conversion refused (remove it if it is training-only)")
    assert [ln.split("=")[0] for ln in lines[1:]] == ["  config field partial_rotary_factor",
                                                      "  config field attention_chunk_size",
                                                      "  config field pruned_heads"]
    assert "unk_token_id" not in err and sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_the_printer_escapes_each_detail_line_on_its_own(capsys) -> None:
    """A detail holding a newline or a terminal escape cannot add or recolour a line."""
    from mconvert.cli import error_line

    error_line(MConvertError("src: 2 fields are refused (a, b)", ["field a\n\x1b[31mforged=1", "field [b]=2"]))
    assert capsys.readouterr().err.splitlines() == ["error: src: 2 fields are refused (a, b)",
                                                    "  field a\\n\\x1b[31mforged=1", "  field [b]=2"]
