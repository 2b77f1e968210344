"""The tokenizer a GGUF embeds is a function of the input and is the one transformers loads: a vocabulary that
gives one id to two tokens is refused (the tokenizers library decodes such an id either way, from run to run),
a stray merges.txt or tokenizer.model never wins over the tokenizer.json transformers reads, and every input
gguf-py cannot read is one line naming its file and key. Attacks run through the real CLI in a child process
under a 6 GB address-space cap and a 60 s limit."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from safety_common import assert_one_line_error, run_cli_capped
from tokenizer_common import MODEL_FILES, instruct_hf


def _model_and_tokenizer(tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the instruct model (weights, config, generation config) and of its tokenizer, apart."""
    src = instruct_hf()
    hf, tok = tmp_path / "hf", tmp_path / "tok"
    hf.mkdir()
    for f in MODEL_FILES:
        shutil.copy(src / f, hf / f)
    shutil.copytree(src, tok, ignore=lambda d, names: [n for n in names if n in MODEL_FILES])
    return hf, tok


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

    hf, tok = _model_and_tokenizer(tmp_path)
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
    hf, tok = _model_and_tokenizer(tmp_path)
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

    hf, tok = _model_and_tokenizer(tmp_path)
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
    hf, tok = _model_and_tokenizer(tmp_path)
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
