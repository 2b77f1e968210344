"""The tokenizer a GGUF embeds is a function of the input and is the one transformers loads: a vocabulary that
gives one id to two tokens is refused (the tokenizers library decodes such an id either way, from run to run),
a stray merges.txt or tokenizer.model never wins over the tokenizer.json transformers reads, and every input
gguf-py cannot read is one line naming its file and key. Attacks run through the real CLI in a child process
under a 6 GB address-space cap and a 60 s limit."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safety_common import assert_one_line_error, run_cli_capped
from tokenizer_common import model_and_tokenizer


def _duplicate_id(tok: Path) -> tuple[str, str, int]:
    """Give the byte token '"' the id of '!' in tokenizer.json's model.vocab (as a damaged or hand-edited
    file would); the two tokens and the id."""
    path = tok / "tokenizer.json"
    j = json.loads(path.read_text())
    vocab = j["model"]["vocab"]
    vocab['"'] = vocab["!"]
    path.write_text(json.dumps(j))
    return "!", '"', vocab["!"]


def test_duplicate_ids_in_tokenizer_json_are_refused_every_run(tmp_path):
    """The reference loader decodes a shared id either way from one load to the next; mconvert refuses it by
    name, on every run, rather than write a GGUF that differs between runs."""
    import tokenizers

    hf, tok = model_and_tokenizer(tmp_path)
    a, b, i = _duplicate_id(tok)
    text = (tok / "tokenizer.json").read_text()
    assert {tokenizers.Tokenizer.from_str(text).id_to_token(i) for _ in range(40)} == {a, b}
    lines = []
    for run in range(2):
        out = tmp_path / f"out{run}.gguf"
        code, _, err = run_cli_capped(["hf-to-gguf", hf, out, "--tokenizer", tok])
        lines.append(assert_one_line_error(code, err, str(tok / "tokenizer.json"), "model.vocab", f"id {i}"))
        assert not out.exists()
    assert lines[0] == lines[1]


def test_gguf_of_a_benign_tokenizer_is_the_same_bytes_every_run(tmp_path):
    """The benign neighbour: two runs (two processes) write byte-identical GGUFs."""
    hf, tok = model_and_tokenizer(tmp_path)
    outs = []
    for run in range(2):
        out = tmp_path / f"run{run}" / "model.gguf"
        code, _, err = run_cli_capped(["hf-to-gguf", hf, out, "--tokenizer", tok])
        assert code == 0, err
        outs.append(out.read_bytes())
    assert outs[0] == outs[1]


# ---- transformers' precedence: tokenizer.json over stray slow files -----------------------------------------
def _gguf_tokens(path: Path) -> tuple[str, list[str], list[str]]:
    """(tokenizer.ggml.model, tokens, merges) of a GGUF, read by gguf-py's own reader."""
    import gguf

    r = gguf.GGUFReader(str(path))

    def strings(key: str) -> list[str]:
        f = r.fields.get(key)
        return [] if f is None else [bytes(f.parts[i]).decode() for i in f.data]

    model = r.fields["tokenizer.ggml.model"]
    return bytes(model.parts[model.data[0]]).decode(), strings("tokenizer.ggml.tokens"), strings(
        "tokenizer.ggml.merges")


def test_a_stray_tokenizer_model_never_wins_over_tokenizer_json(tmp_path):
    """A SentencePiece tokenizer.model beside a byte-level BPE tokenizer.json: transformers loads
    tokenizer.json, and so does the GGUF (its tokens are transformers' ids in order)."""
    import transformers
    from test_gguf import _spm_tokenizer_dir

    hf, tok = model_and_tokenizer(tmp_path)
    shutil.copy(_spm_tokenizer_dir() / "tokenizer.model", tok / "tokenizer.model")
    out = tmp_path / "out.gguf"
    code, _, err = run_cli_capped(["hf-to-gguf", hf, out, "--tokenizer", tok])
    assert code == 0, err
    model, tokens, _ = _gguf_tokens(out)
    truth = transformers.AutoTokenizer.from_pretrained(tok)
    assert model == "gpt2"
    assert tokens[:len(truth)] == truth.convert_ids_to_tokens(list(range(len(truth))))


def test_a_tokenizer_model_that_is_the_tokenizer_json_is_written_as_sentencepiece(tmp_path):
    """The benign neighbour: a llama-2-style directory whose tokenizer.json was converted from its
    tokenizer.model keeps the SentencePiece form convert_hf_to_gguf.py writes."""
    from test_gguf import _spm_model

    out = tmp_path / "spm.gguf"
    code, _, err = run_cli_capped(["hf-to-gguf", _spm_model(), out])
    assert code == 0, err
    assert _gguf_tokens(out)[0] == "llama"


def test_a_stray_merges_txt_never_wins_over_tokenizer_json(tmp_path):
    """merges.txt beside a tokenizer.json: gguf-py would read it when tokenizer.json holds no merges; the GGUF
    takes tokenizer.json's merges (as transformers does) and one without any is refused by name."""
    hf, tok = model_and_tokenizer(tmp_path)
    j = json.loads((tok / "tokenizer.json").read_text())
    want = [" ".join(m) if isinstance(m, list) else m for m in j["model"]["merges"]]
    (tok / "merges.txt").write_text("#version: 0.2\n" + "\n".join(reversed(want)) + "\n")  # a different order
    out = tmp_path / "out.gguf"
    code, _, err = run_cli_capped(["hf-to-gguf", hf, out, "--tokenizer", tok])
    assert code == 0, err
    assert _gguf_tokens(out)[2] == want
    j["model"]["merges"] = []
    (tok / "tokenizer.json").write_text(json.dumps(j))
    code, _, err = run_cli_capped(["hf-to-gguf", hf, tmp_path / "none.gguf", "--tokenizer", tok])
    assert_one_line_error(code, err, str(tok), "tokenizer.json holds no BPE merges")


# ---- every input gguf-py reads ends in one line naming its file ---------------------------------------------
def _cfg(tok: Path, obj) -> None:
    (tok / "config.json").write_text(json.dumps(obj))


def _tok_json(edit):
    def apply(tok: Path) -> None:
        j = json.loads((tok / "tokenizer.json").read_text())
        edit(j)
        (tok / "tokenizer.json").write_text(json.dumps(j))
    return apply


def _chat_json(tok: Path) -> None:
    (tok / "chat_template.jinja").unlink()
    (tok / "chat_template.json").write_text("[1]")


SPLIT = {"type": "Sequence", "pretokenizers": [{"type": "Split", "pattern": {"Regex": [1]}, "behavior": "Isolated"},
                                               {"type": "ByteLevel", "use_regex": False}]}
DAMAGED = {  # each ended in `internal error` without the file; the words its line must hold
    "config.json eos -2": (lambda t: _cfg(t, {"eos_token_id": -2}), ["config.json", "eos_token_id -2"]),
    "config.json array": (lambda t: _cfg(t, [1, 2]), ["config.json", "expected a JSON object"]),
    "config.json text_config string": (lambda t: _cfg(t, {"text_config": "x"}), ["config.json", "text_config"]),
    "tokenizer.json model array": (_tok_json(lambda j: j.__setitem__("model", [1])), ["tokenizer.json", "model"]),
    "tokenizer.json pre_tokenizer string": (_tok_json(lambda j: j.__setitem__("pre_tokenizer", "x")),
                                            ["tokenizer.json", "pre_tokenizer"]),
    "tokenizer.json Split regex array": (_tok_json(lambda j: j.__setitem__("pre_tokenizer", SPLIT)),
                                         ["tokenizer.json", "pattern.Regex"]),
    "chat_template.json array": (_chat_json, ["chat_template.json", "expected a JSON object"]),
}


@pytest.mark.parametrize("name", list(DAMAGED))
def test_tokenizer_inputs_gguf_py_cannot_read_are_one_line_naming_the_file(tmp_path, name):
    edit, words = DAMAGED[name]
    hf, tok = model_and_tokenizer(tmp_path)
    edit(tok)
    out = tmp_path / "out.gguf"
    code, _, err = run_cli_capped(["hf-to-gguf", hf, out, "--tokenizer", tok])
    line = assert_one_line_error(code, err, str(tok), *words)
    assert "mconvert-tokenizer-" not in line and not out.exists()


def test_a_real_config_with_pad_token_id_minus_one_is_refused_by_key(tmp_path):
    """Llama-1-era configs say `pad_token_id: -1` for "no pad token"; llama.cpp's converter (gguf-py's
    SpecialVocab) raises on it, so the model's own config.json is refused naming the key and the fix."""
    import gguf

    hf, tok = model_and_tokenizer(tmp_path)
    for f in tok.iterdir():  # the tokenizer beside the model, as a downloaded model directory holds it
        (shutil.copytree if f.is_dir() else shutil.copy)(f, hf / f.name)
    cfg = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**cfg, "pad_token_id": -1}))
    code, _, err = run_cli_capped(["hf-to-gguf", hf, tmp_path / "out.gguf"])
    assert_one_line_error(code, err, str(hf / "config.json"), "pad_token_id -1", "set it to null")
    with pytest.raises(ValueError, match="pad: -1"):  # the reference converter's own reader
        gguf.SpecialVocab(hf, n_vocab=cfg["vocab_size"])
    (hf / "config.json").write_text(json.dumps({**cfg, "pad_token_id": None}))  # the benign neighbour
    code, _, err = run_cli_capped(["hf-to-gguf", hf, tmp_path / "out.gguf"])
    assert code == 0, err


def test_gguf_py_log_lines_become_report_warnings_naming_the_users_file(tmp_path):
    """gguf-py logs what it ignores (a chat_template that is not text); the line goes into the report's
    warnings, naming the user's tokenizer_config.json, never onto stderr beside the report."""
    hf, tok = model_and_tokenizer(tmp_path)
    cfg = json.loads((tok / "tokenizer_config.json").read_text())
    (tok / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": 5}))
    code, out, err = run_cli_capped(["hf-to-gguf", hf, tmp_path / "out.gguf", "--tokenizer", tok, "--json"])
    assert code == 0, err
    assert "Bad type" not in err and "mconvert-tokenizer-" not in out + err, err
    warnings = json.loads(out)["warnings"]
    assert any("Bad type for chat_template" in w and str(tok / "tokenizer_config.json") in w for w in warnings)
