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
