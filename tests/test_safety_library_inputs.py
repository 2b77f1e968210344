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
from tokenizer_common import MODEL_FILES, instruct_hf


def _model_and_tokenizer(tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the instruct model (weights and config only) and of its tokenizer in a directory of its own."""
    src = instruct_hf()
    hf, tok = tmp_path / "hf", tmp_path / "tok"
    hf.mkdir()
    for f in MODEL_FILES:
        shutil.copy(src / f, hf / f)
    shutil.copytree(src, tok, ignore=lambda d, names: [n for n in names if n in MODEL_FILES])
    return hf, tok


def test_config_json_in_the_tokenizer_dir_linking_outside_is_never_read(tmp_path):
    """gguf-py's SpecialVocab and transformers' AutoTokenizer open config.json in the --tokenizer directory by
    name; a link to a file elsewhere is refused by name, and its pad id never lands in an output."""
    from mconvert.convert.tokenizer import load_tokenizer
    from mconvert.errors import MConvertError

    hf, tok = _model_and_tokenizer(tmp_path)
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

    hf, tok = _model_and_tokenizer(tmp_path)
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
    from mconvert.convert.io.paths import check_tree_contained
    from mconvert.errors import MConvertError

    hf, _ = _model_and_tokenizer(tmp_path)
    name = "model.safetensors" if where == "safetensors" else where
    (tmp_path / name).write_bytes((hf / name).read_bytes())
    (hf / name).unlink()
    (hf / name).symlink_to(tmp_path / name)
    with pytest.raises(MConvertError, match="symlink leading outside"):
        check_tree_contained(hf, f"{hf}: model file")
    (hf / name).unlink()
    shutil.copy(tmp_path / name, hf / name)
    check_tree_contained(hf, f"{hf}: model file")  # the benign neighbour
