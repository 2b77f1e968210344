"""Tokenizer artifacts, the generation config and config.json's special-token ids travel both ways through a
Megatron checkpoint root. Truth we did not write: the HF dir is saved by transformers' own `save_pretrained`
(tokenizer with added tokens, a default and a named chat template, a pad id, an eos list, sampling defaults); the
export is read back by transformers (`AutoTokenizer.apply_chat_template`, `GenerationConfig.from_pretrained`).
Symlinks out of the source are refused, never followed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from mconvert.convert.hf.tokenizer import TOKEN_IDS_FILE, TOKENIZER_FILES, tokenizer_files
from safety_common import assert_one_line_error, load_rank, run_cli, save_rank
from tokenizer_common import MESSAGES, chain, instruct_hf, tokenizer_file_names

IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("back", ["out", "out1"])
def test_every_tokenizer_file_and_the_generation_config_come_back_byte_identical(back):
    c = chain()
    names = tokenizer_file_names(c["hf"])
    # what save_pretrained wrote: slow-form files, chat templates both forms of naming
    assert {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
            "additional_chat_templates/tool_use.jinja", "added_tokens.json", "vocab.json", "merges.txt"} <= names
    for d in (c["mg"], c["mg1"], c[back]):
        for n in sorted(names) + ["generation_config.json"]:
            assert (d / n).read_bytes() == (c["hf"] / n).read_bytes(), f"{d / n} differs"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("back", ["out", "out1"])
def test_transformers_reads_the_same_chat_prompt_generation_config_and_ids_from_the_export(back):
    from transformers import AutoTokenizer, GenerationConfig

    c = chain()
    src, exp = AutoTokenizer.from_pretrained(str(c["hf"])), AutoTokenizer.from_pretrained(str(c[back]))
    for template in (None, "tool_use"):
        want = src.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True, chat_template=template)
        got = exp.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True, chat_template=template)
        assert got == want and "<|im_start|>assistant" in want if template is None else got == want
    assert exp.apply_chat_template(MESSAGES, add_generation_prompt=True) == \
        src.apply_chat_template(MESSAGES, add_generation_prompt=True)
    assert exp.get_added_vocab() == src.get_added_vocab() and exp.pad_token_id == src.pad_token_id
    g_src, g_exp = GenerationConfig.from_pretrained(str(c["hf"])), GenerationConfig.from_pretrained(str(c[back]))
    assert g_exp.to_dict() == g_src.to_dict() and isinstance(g_exp.eos_token_id, list)
    cfg_src = json.loads((c["hf"] / "config.json").read_text())
    cfg_exp = json.loads((c[back] / "config.json").read_text())
    assert {k: cfg_exp.get(k) for k in IDS} == {k: cfg_src[k] for k in IDS}
    assert len(cfg_src["eos_token_id"]) == 2 and cfg_src["pad_token_id"] is not None


@pytest.mark.timeout(600)
def test_the_megatron_root_keeps_config_ids_megatron_args_cannot_hold():
    c = chain()
    kept = json.loads((c["mg"] / TOKEN_IDS_FILE).read_text())
    cfg = json.loads((c["hf"] / "config.json").read_text())
    assert kept == {k: cfg[k] for k in IDS}
    assert (c["mg1"] / TOKEN_IDS_FILE).read_bytes() == (c["mg"] / TOKEN_IDS_FILE).read_bytes()


def test_every_tokenizer_file_transformers_saves_is_in_the_table(tmp_path):
    # truth we did not write: the names transformers' tokenizer classes of the served families save
    import transformers

    classes = [transformers.GPT2Tokenizer, transformers.GPT2TokenizerFast, transformers.LlamaTokenizerFast,
               transformers.Qwen2Tokenizer, transformers.Qwen2TokenizerFast,
               transformers.PreTrainedTokenizerFast, transformers.BertTokenizer, transformers.T5TokenizerFast]
    for cls in classes:
        for name in cls.vocab_files_names.values():
            assert name in TOKENIZER_FILES, (cls.__name__, name)
    base = transformers.tokenization_utils_base
    for name in (base.ADDED_TOKENS_FILE, base.SPECIAL_TOKENS_MAP_FILE, base.TOKENIZER_CONFIG_FILE,
                 base.FULL_TOKENIZER_FILE, transformers.utils.CHAT_TEMPLATE_FILE):
        assert name in TOKENIZER_FILES
    (tmp_path / transformers.utils.CHAT_TEMPLATE_DIR).mkdir()
    (tmp_path / transformers.utils.CHAT_TEMPLATE_DIR / "x.jinja").write_text("{{ 1 }}")
    (tmp_path / "tokenizer.3.1.json").write_text("{}")  # a versioned fast tokenizer (fast_tokenizer_files)
    (tmp_path / "config.json").write_text("{}")
    assert tokenizer_files(tmp_path) == ["tokenizer.3.1.json", "additional_chat_templates/x.jinja"]


def _copy_hf(tmp_path: Path) -> Path:
    d = tmp_path / "hf"
    shutil.copytree(instruct_hf(), d)
    return d


@pytest.mark.timeout(120)
@pytest.mark.parametrize("what", ["chat_template.jinja", "additional_chat_templates", "generation_config.json"])
def test_a_symlink_out_of_the_source_is_refused_and_nothing_is_written(tmp_path, capsys, what):
    hf = _copy_hf(tmp_path)
    secret = tmp_path / "secret"
    secret.mkdir()
    (secret / "tool_use.jinja").write_text("PRIVATE KEY\n")
    (secret / "chat_template.jinja").write_text("PRIVATE KEY\n")
    (secret / "generation_config.json").write_text("{}")
    target = hf / what
    shutil.rmtree(target) if target.is_dir() else target.unlink()
    target.symlink_to(secret if what == "additional_chat_templates" else secret / what)
    code, _, err = run_cli(["hf-to-megatron", hf, tmp_path / "out", "--tp", "2"], capsys)
    shown = "additional_chat_templates/tool_use.jinja" if what == "additional_chat_templates" else what
    assert_one_line_error(code, err, str(hf / shown), "symlink", "outside")
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")] == []


@pytest.mark.timeout(120)
def test_more_tokenizer_files_than_a_tokenizer_has_are_refused_before_anything_is_written(tmp_path, capsys):
    from mconvert.convert.hf.tokenizer import MAX_TOKENIZER_FILES

    hf = _copy_hf(tmp_path)
    for i in range(MAX_TOKENIZER_FILES + 1):
        (hf / "additional_chat_templates" / f"t{i:03d}.jinja").write_text("{{ 1 }}")
    code, _, err = run_cli(["hf-to-megatron", hf, tmp_path / "out"], capsys)
    assert_one_line_error(code, err, str(hf), f"more than {MAX_TOKENIZER_FILES} tokenizer files")
    assert not (tmp_path / "out").exists()


@pytest.mark.timeout(120)
def test_a_symlink_inside_the_source_is_copied_as_the_file_it_names(tmp_path, capsys):
    hf = _copy_hf(tmp_path)
    (hf / "chat_template.jinja").rename(hf / "template-store.jinja")
    (hf / "chat_template.jinja").symlink_to("template-store.jinja")
    code, _, err = run_cli(["hf-to-megatron", hf, tmp_path / "out", "--tp", "2"], capsys)
    assert code == 0, err
    out = tmp_path / "out" / "chat_template.jinja"
    assert not out.is_symlink() and out.read_bytes() == (hf / "template-store.jinja").read_bytes()
    assert not (tmp_path / "out" / "template-store.jinja").exists()  # not a tokenizer file name


@pytest.mark.timeout(300)
@pytest.mark.parametrize("bad", [{"pad_token_id": "0"}, {"eos_token_id": []}, {"unk_token_id": 3}])
def test_a_damaged_token_id_file_is_refused_by_name(tmp_path, capsys, bad):
    mg = tmp_path / "mg"
    shutil.copytree(chain()["mg"], mg)
    (mg / TOKEN_IDS_FILE).write_text(json.dumps(bad))
    (mg / "mconvert-manifest.json").unlink()  # an edit by hand, not damage the manifest would name
    code, _, err = run_cli(["megatron-to-hf", mg, tmp_path / "out"], capsys)
    assert_one_line_error(code, err, str(mg / TOKEN_IDS_FILE), next(iter(bad)))
    assert not (tmp_path / "out").exists()


@pytest.mark.timeout(300)
def test_kept_ids_the_args_contradict_give_way_to_the_args_with_a_warning(tmp_path, capsys):
    mg = tmp_path / "mg"
    shutil.copytree(chain()["mg"], mg)
    (mg / TOKEN_IDS_FILE).write_text(json.dumps({"eos_token_id": [7, 8], "pad_token_id": 5}))
    (mg / "mconvert-manifest.json").unlink()
    code, out, err = run_cli(["megatron-to-hf", mg, tmp_path / "out", "--json"], capsys)
    assert code == 0, err
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["eos_token_id"] == 0 and cfg["pad_token_id"] == 5  # the args' eos (the source's first) wins
    assert any("eos_token_id [7, 8] differs from the args' 0" in w for w in json.loads(out)["warnings"])


@pytest.mark.timeout(300)
def test_token_ids_outside_the_vocab_convert_as_stated_with_a_warning(tmp_path, capsys):
    """An eos the vocabulary has no row for (the model never produces it, so generation never stops on it)
    converts as the checkpoint states it, with a warning naming where to correct it: config.json for
    hf-to-megatron, the kept id file or the args for megatron-to-hf. The vocabulary's last id passes."""
    hf = _copy_hf(tmp_path)
    (hf / "mconvert-manifest.json").unlink(missing_ok=True)
    cfg = json.loads((hf / "config.json").read_text())
    vocab = cfg["vocab_size"]

    def warned(rep: str) -> list[str]:
        return [w for w in json.loads(rep)["warnings"] if "outside the vocabulary" in w]

    for eos, bad in ((vocab - 1, False), ([vocab - 1, vocab + 7], True)):
        cfg["eos_token_id"] = eos
        (hf / "config.json").write_text(json.dumps(cfg))
        code, rep, err = run_cli(["hf-to-megatron", hf, tmp_path / f"mg-{bad}", "--json"], capsys)
        assert code == 0, err
        assert len(warned(rep)) == bad and all(str(hf / "config.json") in w for w in warned(rep)), rep
    mg = tmp_path / "mg-True"
    code, rep, err = run_cli(["megatron-to-hf", mg, tmp_path / "back", "--json"], capsys)
    assert code == 0, err
    assert json.loads((tmp_path / "back" / "config.json").read_text())["eos_token_id"] == [vocab - 1, vocab + 7]
    assert len(warned(rep)) == 1 and str(mg / TOKEN_IDS_FILE) in warned(rep)[0], rep
    (mg / TOKEN_IDS_FILE).unlink()
    (mg / "mconvert-manifest.json").unlink()
    for f in mg.rglob("model_optim_rng.pt"):  # the args' own eos, outside the vocabulary
        state = load_rank(f)
        state["args"].eos_token_id = vocab + 7
        save_rank(f.with_name("new.pt"), state)
        f.with_name("new.pt").replace(f)
    code, rep, err = run_cli(["megatron-to-hf", mg, tmp_path / "back2", "--json"], capsys)
    assert code == 0 and len(warned(rep)) == 1 and "the checkpoint's args" in warned(rep)[0], rep


# ---- verify ------------------------------------------------------------------------------------------
def _export_copy(tmp_path: Path) -> Path:
    d = tmp_path / "export"
    shutil.copytree(chain()["out"], d)
    (d / "mconvert-manifest.json").unlink()  # edited by hand below: only the targeted check may speak
    return d


def _status(rep) -> dict[str, tuple[str, str]]:
    return {c.name: (c.status, c.message) for c in rep.checks}


@pytest.mark.timeout(600)
def test_verify_reports_an_export_that_lost_the_sources_chat_template(tmp_path):
    from mconvert.validators.verify import verify

    d = _export_copy(tmp_path)
    st = _status(verify(d, against=chain()["mg"], device="cpu"))
    assert st["chat-template"][0] == "ok" and st["logits"][0] == "ok", st
    (d / "chat_template.jinja").unlink()
    shutil.rmtree(d / "additional_chat_templates")
    rep = verify(d, against=chain()["mg"], device="cpu")
    st = _status(rep)
    assert st["chat-template"][0] == "error" and "no chat template" in st["chat-template"][1], st
    assert rep.errors() and [c.name for c in rep.errors()] == ["chat-template"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("where,field,value,check", [
    ("config.json", "pad_token_id", "vocab", "token-ids"),
    ("config.json", "eos_token_id", "list", "token-ids"),
    ("config.json", "bos_token_id", -1, "token-ids"),
    ("generation_config.json", "eos_token_id", "list", "generation-config"),
    ("generation_config.json", "pad_token_id", "vocab", "generation-config"),
])
def test_verify_reports_special_token_ids_outside_the_vocab(tmp_path, where, field, value, check):
    from mconvert.validators.verify import verify

    d = _export_copy(tmp_path)
    vocab = json.loads((d / "config.json").read_text())["vocab_size"]
    value = {"vocab": vocab, "list": [0, vocab + 5]}.get(value, value) if isinstance(value, str) else value
    obj = json.loads((d / where).read_text())
    obj[field] = value
    (d / where).write_text(json.dumps(obj))
    rep = verify(d)
    st = _status(rep)
    # transformers itself refuses a padding_idx beyond the embedding: the strict-load check names that too
    also = ["weights-strict"] if (where, field) == ("config.json", "pad_token_id") else []
    assert [c.name for c in rep.errors()] == also + [check], st
    assert all("cannot build the model" in st[a][1] for a in also)
    assert f"{field} {value}" in st[check][1] and f"outside vocab_size {vocab}" in st[check][1]
