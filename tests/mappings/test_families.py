"""The families: one module per family, each listed once in `FAMILY_MODULES`, checked against transformers' own tables."""

from __future__ import annotations

import argparse
import ast
import os
import re
from pathlib import Path

import pytest
import transformers
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_MAPPING_NAMES

import mconvert
from mconvert.errors import MConvertError
from mconvert.mappings import families
from mconvert.mappings.families import hf_config, spec_from_hf_config, spec_from_megatron_args

PACKAGE = Path(mconvert.__file__).parent
MAPPINGS = PACKAGE / "mappings"
FAMILY_NAMES = families.names()
VLLM_VENV = Path(os.environ.get("VLLM_VENV", Path.home() / ".cache/mconvert/vllm-venv"))
QUOTED = re.compile(r"""["'](%s)["']""" % "|".join(map(re.escape, FAMILY_NAMES)))  # a family name as a literal


def test_every_module_declaring_a_family_is_listed():
    """`FAMILY_MODULES` names exactly the files of mappings/ that assign `FAMILY` at their top level (read with
    ast here), once each, and each gives one family: a family module left off the list fails here."""
    declared = {p.stem for p in MAPPINGS.glob("*.py")
                if any(isinstance(n, (ast.Assign, ast.AnnAssign)) and "FAMILY" in
                       [t.id for t in (n.targets if isinstance(n, ast.Assign) else [n.target]) if isinstance(t, ast.Name)]
                       for n in ast.parse(p.read_text()).body)}
    assert {"gpt2", "llama", "qwen3_moe"} <= declared
    assert sorted(families.FAMILY_MODULES) == sorted(declared) and len(set(families.FAMILY_MODULES)) == len(declared)
    assert len(families.all_families()) == len(declared)


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_a_family_is_found_by_name_architecture_and_model_type(name):
    fam = families.by_name(name)
    assert families.by_architecture(fam.architecture) is fam
    assert families.by_model_type(fam.model_type) is fam
    # transformers' own auto tables: the causal-LM class and the base model of the model_type (one newer than the
    # pinned transformers, GLM-4.7-Flash's, in the tables of the vLLM venv's transformers)
    if fam.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        auto = sorted(VLLM_VENV.glob("lib/python3*/site-packages/transformers/models/auto/modeling_auto.py"))
        if not auto:
            pytest.skip(f"{fam.model_type} is newer than transformers {transformers.__version__}; no vLLM venv")
        text = auto[0].read_text()
        for cls in (fam.architecture, fam.base_architecture):
            assert f'("{fam.model_type}", "{cls}")' in text, cls
        return
    assert MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[fam.model_type] == fam.architecture
    assert MODEL_MAPPING_NAMES[fam.model_type] == fam.base_architecture


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_each_family_has_presets_of_its_own(name):
    fam = families.by_name(name)
    assert fam.presets and all(s.family == name for s in fam.presets.values())
    assert all(families.preset(p) == s for p, s in fam.presets.items())


def _family_presets():
    """Every family's presets (each has an HF form; the export of MTP layers is refused by name, so a preset
    with them is left out: tests/trainer/test_deepseek_v3.py)."""
    return [(f.name, p) for f in families.all_families() for p in f.presets if not f.presets[p].mtp_num_layers]


@pytest.mark.parametrize("name,preset_name", _family_presets())
def test_hf_config_round_trips_through_transformers_config_class(name, preset_name):
    """Our config.json -> transformers' config class (its defaults filled in) -> our parser -> the same spec."""
    spec = families.preset(preset_name)
    cfg = hf_config(spec)
    theirs = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    assert theirs.model_type == families.by_name(name).model_type
    back = spec_from_hf_config(theirs.to_dict(), source="x/config.json")
    assert back == spec.replace(bos_token_id=back.bos_token_id, eos_token_id=back.eos_token_id)


@pytest.mark.parametrize("name,preset_name", _family_presets())
def test_megatron_args_without_model_family_are_recognised(name, preset_name):
    """Args written by Megatron-LM itself carry no model_family: a family with a recognition rule is found from
    the architecture switches; a family without one (or whose rule these switches miss: Mistral without a
    window) reads as the default family with the same function."""
    spec = families.preset(preset_name)
    args = vars(spec.to_megatron_args(1, 1))
    del args["model_family"]
    got = spec_from_megatron_args(argparse.Namespace(**args))
    rule = families.by_name(name).recognise
    want = name if rule is not None and rule(spec.to_dict() | {"qk_layernorm": spec.qk_layernorm}) else \
        families.default_family().name
    assert got == spec.replace(family=want)


def test_an_unknown_family_is_one_line_naming_the_known_ones():
    with pytest.raises(MConvertError, match=r"unsupported model family 'bert'; supported: deepseek_v2, deepseek_v3, gemma2, gemma3, glm4_moe, glm4_moe_lite, gpt2, llama, mistral, mixtral, qwen2, qwen2_moe, qwen3, qwen3_moe$"):
        families.by_name("bert")
    args = vars(families.preset("tiny-llama").to_megatron_args(1, 1))
    with pytest.raises(MConvertError, match="unsupported model family 'bert'"):
        spec_from_megatron_args(dict(args, model_family="bert"))


def test_no_family_name_is_quoted_outside_mappings():
    """Behaviour differences between families are data in their modules, never `if family == ...` elsewhere."""
    hits = []
    outside = [p for p in sorted(PACKAGE.rglob("*.py")) if MAPPINGS not in p.parents]
    assert PACKAGE / "cli.py" in outside  # the walk reaches the package's modules
    for path in outside:
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if QUOTED.search(line):
                hits.append(f"{path.relative_to(PACKAGE.parent)}:{i}: {line.strip()}")
    assert not hits, "\n".join(hits)


def test_the_grep_rule_catches_a_quoted_family_name():
    """The rule above is not vacuous: the same pattern finds the branch it forbids."""
    assert QUOTED.search('if spec.family == "gpt2":') and QUOTED.search("x = {'qwen2': 1}")
    assert not QUOTED.search('preset = "tiny-llama"')


@pytest.mark.parametrize("edit,words", [
    (lambda c: c.update(eos_token_id=[]), "eos_token_id is an empty list"),
    (lambda c: c.pop("vocab_size"), "missing field 'vocab_size'"),
])
def test_config_without_a_vocab_or_with_an_empty_eos_list_is_refused_by_name(edit, words):
    cfg = families.hf_config(families.preset("tiny-llama"))
    edit(cfg)
    with pytest.raises(MConvertError, match=words):
        families.spec_from_hf_config(cfg, "x/config.json")


def _deployable_variants(spec):
    """`spec`, and `spec` as FasterTransformer's LLaMA loader takes it: MHA, no rope scaling, no qkv bias, the
    default rotary base. The presets show the features FT refuses, so without the variant FT's LLaMA table would be
    checked against no model; for a model that has none of them the variant is `spec` itself."""
    plain = spec.replace(num_query_groups=None, rope_scaling=None, add_qkv_bias=False, rotary_base=10000.0)
    return [spec] if plain == spec else [spec, plain]


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_deployment_tables_place_every_parameter_of_the_models_they_accept(name):
    """FT and TensorRT-LLM tables name known storage forms only, and every parameter ModelSpec declares for a
    preset (or its MHA variant) the layout accepts has a place (the split itself comes from the parameter's split
    kind). Each layout accepts at least one of them, so the check runs for every table."""
    from mconvert.mappings import deploy
    from mconvert.mappings.wildcards import Registry

    fam = families.by_name(name)
    specs = [v for spec in fam.presets.values() for v in _deployable_variants(spec)]
    for what, layout, table in (("FT", fam.ft, fam.ft and fam.ft.files),
                                ("TensorRT-LLM", fam.trtllm, fam.trtllm and fam.trtllm.tensors)):
        if layout is None:
            continue
        deploy.check_table(table, f"{name} {what}")
        reg = Registry(table)
        checked = 0
        for spec in specs:
            try:
                spec.refuse_unmapped(what)
                layout.refuse(spec, 1, True) if what == "FT" else layout.refuse(spec)
            except MConvertError:
                continue
            missing = [d.name for d in spec.params() if reg.match(d.name) is None]
            assert not missing, f"{name} {what}: no place for {missing}"
            assert reg.match(deploy.HEAD) is not None  # a tied model's head copy and an untied head
            checked += 1
        assert checked, f"{name} {what}: the layout refuses every preset and variant, so no table entry is checked"
