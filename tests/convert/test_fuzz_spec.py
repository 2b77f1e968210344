"""Hypothesis over ModelSpec fields, HF configs and Megatron args, valid and invalid: every combination ends
in a clean MConvertError or in a correct result — correct meaning transformers' own model class (built on the
meta device from our config) has exactly the parameter names and shapes our mapping produces, the TP split
declared valid by check_parallel really splits, and the configs round-trip."""

from __future__ import annotations

import argparse
import math

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from hf_ref import hf_model_shapes
from mconvert.errors import MConvertError
from mconvert.mappings import to_hf
from mconvert.mappings.transforms import merge, split
from mconvert.mappings.families import hf_config, preset, spec_from_hf_config, spec_from_megatron_args
from mconvert.spec import ModelSpec

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)

INVALID = {  # one field at a time is set to a value no format can hold (or a combination HF cannot express)
    "family": ["bert", ""], "num_layers": [0, -1], "hidden_size": [0, -4, 7, 33], "num_attention_heads": [0, -2, 5],
    "ffn_hidden_size": [0, -8], "vocab_size": [0, -5], "max_position_embeddings": [0, -1],
    "num_query_groups": [0, -2, 3, 5], "kv_channels": [0, -4], "normalization": ["BatchNorm", "LayerNorm", "RMSNorm"],
    "norm_epsilon": [0.0, -1.0, float("nan"), float("inf")], "activation": ["relu", "swiglu", "gelu"],
    "position_embedding_type": ["alibi", "rope", "learned_absolute"], "rotary_percent": [0.5, 0.0, 2.0, -1.0],
    "add_bias_linear": [True], "add_qkv_bias": [True, False], "make_vocab_size_divisible_by": [0, -8],
    "qk_layernorm": [True, False], "rope_scaling": ["dynamic", None, "llama3"], "rope_scaling_factor": [0.5, 1.0],
}


@st.composite
def spec_fields(draw) -> dict:
    """A consistent spec of a random family and shape; half the time one field is then set to a value from
    INVALID (zero/negative sizes, indivisible heads or groups, a combination the family's HF class lacks)."""
    family = draw(st.sampled_from(["gpt2", "llama", "mistral", "qwen2", "qwen3"]))
    heads = draw(st.sampled_from([1, 2, 3, 4, 6, 8]))
    groups = heads if family == "gpt2" else draw(st.sampled_from([g for g in (1, 2, 3, 4, 6, 8) if heads % g == 0]))
    hd = draw(st.sampled_from([2, 4, 8, 16]))
    gated = family != "gpt2"
    fields = dict(
        family=family,
        num_layers=draw(st.integers(1, 4)),
        hidden_size=heads * hd,
        num_attention_heads=heads,
        ffn_hidden_size=draw(st.sampled_from([4, 6, 8, 12, 24])),
        vocab_size=draw(st.integers(2, 300)),
        max_position_embeddings=draw(st.sampled_from([2, 16, 64])),
        num_query_groups=None if groups == heads else groups,
        kv_channels=draw(st.sampled_from([None, hd, 2 * hd])) if gated else None,
        normalization="RMSNorm" if gated else "LayerNorm",
        norm_epsilon=draw(st.sampled_from([1e-5, 1e-6])),
        activation="swiglu" if gated else draw(st.sampled_from(["gelu", "gelu_new"])),
        position_embedding_type="rope" if gated else "learned_absolute",
        rotary_base=draw(st.sampled_from([10000.0, 1e6])) if gated else 10000.0,
        add_bias_linear=family == "gpt2" or (family == "llama" and draw(st.booleans())),
        add_qkv_bias=family == "qwen2",
        qk_layernorm=family == "qwen3",
        rope_scaling=draw(st.sampled_from([None, "llama3", "linear"])) if gated else None,
        rope_scaling_factor=draw(st.sampled_from([2.0, 8.0])),
        tie_embeddings=draw(st.booleans()),
        make_vocab_size_divisible_by=draw(st.sampled_from([1, 8, 128])),
    )
    if draw(st.booleans()):
        key = draw(st.sampled_from(sorted(INVALID)))
        fields[key] = draw(st.sampled_from(INVALID[key]))
    return fields


def _our_hf_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    out: dict[str, tuple[int, ...]] = {}
    for unit, decls in [("embedding", spec.embedding_params()), ("final", spec.final_params())] + [
            (i, spec.layer_params(i)) for i in range(spec.num_layers)]:
        mcore = {d.name: torch.zeros(d.shape) for d in decls}
        out.update({k: tuple(v.shape) for k, v in to_hf(spec, unit, mcore).items()})
    return out


@settings(max_examples=150, **SETTINGS)
@given(spec_fields(), st.sampled_from([1, 2, 3, 4, 8]), st.sampled_from([1, 2, 3]))
def test_any_spec_is_refused_cleanly_or_maps_onto_transformers(fields, tp, pp):
    try:
        spec = ModelSpec(**fields)
    except MConvertError as e:
        assert "\n" not in str(e)
        event("refused by ModelSpec")
        return
    # what was accepted is sane
    assert spec.num_layers > 0 and spec.hidden_size > 0 and spec.head_dim > 0 and spec.num_groups > 0
    assert spec.num_attention_heads % spec.num_groups == 0 and spec.padded_vocab_size(tp) >= spec.vocab_size
    assert all(n > 0 for d in spec.params(tp) for n in d.shape)
    try:
        spec.check_parallel(tp, pp)
    except MConvertError:
        event("TP/PP refused")
    else:
        event("TP/PP split and merged")  # declared splittable: every parameter splits into TP equal shards and merges back exactly
        for d in spec.params(tp):
            full = torch.arange(math.prod(d.shape), dtype=torch.float32).reshape(d.shape)
            shards = split(full, d.kind, tp, d.name)
            assert len({s.shape for s in shards}) == 1
            assert torch.equal(merge(shards, d.kind, d.name), full)
    try:
        cfg = hf_config(spec)
    except MConvertError as e:
        assert "\n" not in str(e)
        event("no HF form (refused)")
        return
    assert spec_from_hf_config(cfg) == spec.replace(make_vocab_size_divisible_by=128)
    assert spec_from_megatron_args(spec.to_megatron_args(tp, pp)) == spec
    if spec.vocab_size < 2 or spec.max_position_embeddings < 2:
        return
    assert _our_hf_shapes(spec) == hf_model_shapes(cfg)
    event("matches transformers' model")


def _mutations():
    base = hf_config(preset("tiny-llama"))
    keys = sorted(base)
    values = st.one_of(st.none(), st.integers(-3, 300), st.floats(allow_nan=True), st.text(max_size=4),
                       st.lists(st.integers(0, 3), max_size=2), st.booleans(), st.dictionaries(st.text(max_size=2),
                                                                                              st.integers(), max_size=1))
    edit = st.tuples(st.sampled_from(keys), st.one_of(st.just("<delete>"), values))
    return st.lists(edit, min_size=1, max_size=3).map(lambda edits: _apply(dict(base), edits))


def _apply(cfg: dict, edits) -> dict:
    for k, v in edits:
        if v == "<delete>":
            cfg.pop(k, None)
        else:
            cfg[k] = v
    return cfg


@settings(max_examples=80, **SETTINGS)
@given(_mutations())
def test_a_malformed_config_json_is_one_clean_error(cfg):
    """Deleted keys, wrong types (None, text, lists, NaN), bad values: never a TypeError/ValueError traceback."""
    try:
        spec = spec_from_hf_config(cfg, source="x/config.json")
    except MConvertError as e:  # one line, or a summary counting one line per refused field
        assert all("\n" not in line for line in (e.summary, *e.details))
        assert not e.details or f": {len(e.details)} " in e.summary
        return
    assert spec.num_layers > 0 and spec.hidden_size > 0


@settings(max_examples=60, **SETTINGS)
@given(st.lists(st.tuples(st.sampled_from(sorted(vars(preset("tiny-gpt2").to_megatron_args(2, 2)))),
                          st.one_of(st.none(), st.integers(-3, 300), st.floats(allow_nan=True), st.text(max_size=4),
                                    st.booleans())), min_size=1, max_size=3))
def test_malformed_megatron_args_are_one_clean_error(edits):
    args = vars(preset("tiny-gpt2").to_megatron_args(2, 2))
    for k, v in edits:
        args[k] = v
    try:
        spec = spec_from_megatron_args(argparse.Namespace(**args), source="x/model_optim_rng.pt")
    except MConvertError as e:  # one line, or a summary counting one line per refused field
        assert all("\n" not in line for line in (e.summary, *e.details))
        assert not e.details or f": {len(e.details)} " in e.summary
        return
    assert spec.num_layers > 0 and spec.hidden_size > 0


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-llama", "tiny-qwen2", "tiny-mistral", "tiny-gemma2", "tiny-gemma3"])
def test_presets_map_onto_transformers(name):
    spec = preset(name)
    assert _our_hf_shapes(spec) == hf_model_shapes(hf_config(spec))


def test_untied_gpt2_keeps_its_head_through_hf_to_megatron_and_back(tmp_path):
    """Found by the spec fuzz: config.json of an untied GPT-2 was read as tied and its lm_head dropped."""
    import transformers

    from mconvert.convert.verbs import hf_to_megatron, megatron_to_hf

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, n_inner=64, vocab_size=50, n_positions=16,
                                  tie_word_embeddings=False)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    model.save_pretrained(tmp_path / "hf")
    hf_to_megatron(tmp_path / "hf", tmp_path / "mg", tp=2)
    megatron_to_hf(tmp_path / "mg", tmp_path / "back")
    back = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "back").eval()
    x = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        assert torch.equal(model(x).logits, back(x).logits)
