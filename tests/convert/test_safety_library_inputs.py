"""What third-party libraries are handed: every file a library opens on mconvert's behalf is one mconvert
checked (transformers, tokenizers and gguf-py read a staged copy; a model directory handed by path is checked
entry by entry), and every render or parse of untrusted text runs bounded in time and memory.

Each attack is run through the real CLI in a child process under a 6 GB address-space cap and a 60 s limit;
each has a benign neighbour that must still pass."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safety_common import assert_one_line_error, run_cli_capped
from tokenizer_common import instruct_hf, model_and_tokenizer


def test_config_json_in_the_tokenizer_dir_linking_outside_is_never_read(tmp_path):
    """gguf-py's SpecialVocab and transformers' AutoTokenizer open config.json in the --tokenizer directory by
    name; a link to a file elsewhere is refused by name, and its pad id never lands in an output."""
    from mconvert.convert.hf.tokenizer import load_tokenizer
    from mconvert.errors import MConvertError

    hf, tok = model_and_tokenizer(tmp_path)
    secret = tmp_path / "elsewhere"
    secret.mkdir()
    (secret / "config.json").write_text(json.dumps({"pad_token_id": 7, "model_type": "llama"}))
    (tok / "config.json").symlink_to(secret / "config.json")
    out = tmp_path / "out.gguf"
    code, _, err = run_cli_capped(["hf-to-gguf", hf, out, "--tokenizer", tok])
    assert_one_line_error(code, err, str(tok / "config.json"), "symlink", "outside")
    assert not out.exists()
    with pytest.raises(MConvertError, match="symlink leading outside"):  # every verb's tokenizer loader
        load_tokenizer(tok)


def test_tokenizer_dir_with_links_that_stay_inside_converts(tmp_path):
    """The benign neighbour: config.json and tokenizer.json linked to files inside the tokenizer directory."""
    from mconvert.validators.gguf_runner import read_gguf_metadata

    hf, tok = model_and_tokenizer(tmp_path)
    (tok / "real").mkdir()
    (tok / "tokenizer.json").rename(tok / "real" / "tokenizer.json")
    (tok / "tokenizer.json").symlink_to(Path("real") / "tokenizer.json")
    (tok / "real" / "config.json").write_text(json.dumps({"pad_token_id": 7}))
    (tok / "config.json").symlink_to(Path("real") / "config.json")
    out = tmp_path / "out.gguf"
    code, _, err = run_cli_capped(["hf-to-gguf", hf, out, "--tokenizer", tok])
    assert code == 0, err
    meta = read_gguf_metadata(out)
    assert meta["tokenizer.ggml.padding_token_id"] == json.loads((instruct_hf() / "config.json").read_text())[
        "pad_token_id"]  # tokenizer_config's pad token wins over config.json's, as in gguf-py


@pytest.mark.parametrize("where", ["safetensors", "generation_config.json"])
def test_model_dir_handed_to_transformers_with_a_link_outside_is_refused(tmp_path, capsys, where):
    """`validate` hands the export's directory to transformers' from_pretrained, which opens files by name:
    every entry is checked first."""
    from mconvert.io.paths import check_tree_contained
    from mconvert.errors import MConvertError

    hf, _ = model_and_tokenizer(tmp_path)
    name = "model.safetensors" if where == "safetensors" else where
    (tmp_path / name).write_bytes((hf / name).read_bytes())
    (hf / name).unlink()
    (hf / name).symlink_to(tmp_path / name)
    with pytest.raises(MConvertError, match="symlink leading outside"):
        check_tree_contained(hf, f"{hf}: model file")
    (hf / name).unlink()
    shutil.copy(tmp_path / name, hf / name)
    check_tree_contained(hf, f"{hf}: model file")  # the benign neighbour


# ---- every render of untrusted text is bounded ------------------------------------------------------------
NESTED_LOOPS = ("{% for a in range(100000) %}{% for b in range(100000) %}{% for c in range(100000) %}x"
                "{% endfor %}{% endfor %}{% endfor %}")
DOUBLING = ("{% set s = namespace(x='xxxxxxxx') %}{% for i in range(64) %}{% set s.x = s.x ~ s.x %}{% endfor %}"
            "{{ s.x }}")


def _export_with_template(tmp_path: Path, template: str | None) -> Path:
    d = tmp_path / "export"
    shutil.copytree(instruct_hf(), d)
    if template is not None:
        (d / "chat_template.jinja").write_text(template)
    return d


@pytest.mark.parametrize("template", [NESTED_LOOPS, DOUBLING], ids=["nested-loops", "doubling-string"])
def test_verify_refuses_a_chat_template_that_never_ends_within_the_bounds(tmp_path, template):
    """verify renders each chat template as vLLM's chat endpoint would, in a child bounded in CPU time and
    memory: a template that loops or grows without end is a ✗ line naming its file, never a hang."""
    d = _export_with_template(tmp_path, template)
    code, _, err = run_cli_capped(["verify", d])  # the report goes to stderr
    assert code == 1 and "Traceback" not in err, err
    bad = [ln for ln in err.splitlines() if "✗" in ln]
    assert len(bad) == 1 and "chat-template" in bad[0] and str(d / "chat_template.jinja") in bad[0], err
    assert "NOT READY" in err


def test_verify_renders_a_benign_chat_template(tmp_path):
    """The benign neighbour: the default and the named template render; the export is READY."""
    d = _export_with_template(tmp_path, None)
    code, out, err = run_cli_capped(["verify", d, "--json"])
    assert code == 0, out + err
    checks = {c["name"]: c for c in json.loads(out)["checks"]}
    assert checks["chat-template"]["status"] == "ok" and "2 template(s)" in checks["chat-template"]["message"]


def test_vllm_prompt_ids_are_rendered_bounded(tmp_path):
    """`verify --vllm-python` renders transformers' reference chat ids through the same bounded child."""
    from mconvert.errors import MConvertError
    from mconvert.validators.vllm_check import _chat_ids

    with pytest.raises(MConvertError, match="chat_template.jinja: rendering the chat template"):
        _chat_ids(_export_with_template(tmp_path, NESTED_LOOPS))


# ---- verify checks what the engines refuse ----------------------------------------------------------------
def _mixtral_export(tmp_path: Path) -> Path:
    """A tiny Mixtral saved by transformers, with the instruct model's tokenizer and generation config."""
    import torch
    import transformers

    d = tmp_path / "mixtral"
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=2, vocab_size=1005,
                                     num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
                                     tie_word_embeddings=False)
    transformers.MixtralForCausalLM(cfg).save_pretrained(d)
    src = instruct_hf()
    for f in src.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            (shutil.copytree if f.is_dir() else shutil.copy)(f, d / f.name)
    return d


def _edit_json(path: Path, **changes) -> None:
    obj = json.loads(path.read_text())
    obj.update(changes)
    path.write_text(json.dumps(obj))


def _verify_lines(d: Path) -> tuple[int, list[str], str]:
    code, _, err = run_cli_capped(["verify", d])
    assert "Traceback" not in err, err
    return code, [ln for ln in err.splitlines() if "✗" in ln], err


@pytest.mark.parametrize("topk", [5, 0])
def test_verify_refuses_a_top_k_transformers_cannot_route(tmp_path, topk):
    """num_experts_per_tok past the experts: transformers' router raises (torch.topk); 0: its MoE block adds
    nothing. verify names the key."""
    import torch
    import transformers

    d = _mixtral_export(tmp_path)
    _edit_json(d / "config.json", num_experts_per_tok=topk)
    code, bad, err = _verify_lines(d)
    assert code == 1 and len(bad) == 1, err
    assert "config-engines" in bad[0] and "config.json" in bad[0] and f"num_experts_per_tok={topk}" in bad[0]
    # the engine's own behaviour on this config (code we did not write)
    conf = transformers.MixtralConfig.from_pretrained(d)
    block = transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock(conf)
    x = torch.randn(1, 3, conf.hidden_size)
    if topk > conf.num_local_experts:
        with pytest.raises(RuntimeError, match="out of range"):
            block(x)
    else:
        assert torch.count_nonzero(block(x)[0]) == 0


def test_verify_refuses_a_zero_epsilon(tmp_path):
    """rms_norm_eps 0: transformers' RMSNorm turns a zero row into NaN."""
    import torch
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    d = _export_with_template(tmp_path, None)
    _edit_json(d / "config.json", rms_norm_eps=0)
    code, bad, err = _verify_lines(d)
    assert code == 1 and len(bad) == 1 and "config.json" in bad[0] and "rms_norm_eps=0" in bad[0], err
    assert torch.isnan(LlamaRMSNorm(8, eps=0.0)(torch.zeros(1, 8))).all()


@pytest.mark.parametrize("field, value", [("max_new_tokens", -5), ("early_stopping", "sometimes")])
def test_verify_refuses_a_generation_config_transformers_refuses(tmp_path, field, value):
    """generation_config.json is validated by transformers' own GenerationConfig (in the bounded child)."""
    import transformers

    d = _export_with_template(tmp_path, None)
    _edit_json(d / "generation_config.json", **{field: value})
    code, bad, err = _verify_lines(d)
    assert code == 1 and len(bad) == 1, err
    assert str(d / "generation_config.json") in bad[0] and f"fix {field}" in bad[0], bad
    with pytest.raises(ValueError):
        transformers.GenerationConfig.from_pretrained(d)


def test_verify_passes_benign_dense_and_moe_exports(tmp_path):
    """The benign neighbours: the instruct model and a Mixtral saved by transformers are READY."""
    for d in (_export_with_template(tmp_path, None), _mixtral_export(tmp_path)):
        code, bad, err = _verify_lines(d)
        assert code == 0 and not bad and "READY" in err, err
