"""The tokenizer read from its files (`tokenizer_files.read_tokenizer`, no transformers import) against
transformers' own tokenizer of the same directory: the same vocabulary, added tokens, special flags and bos/eos ids where the
files settle them, transformers itself where they do not, and the GGUF vocabulary (tokens, types, scores,
pre-tokenizer, add_space_prefix) equal either way, for every kind of tokenizer hf-to-gguf writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import transformers

import mconvert.convert.deploy.gguf as gguf_mod
from mconvert.convert.hf.tokenizer import load_tokenizer
from mconvert.convert.hf.tokenizer_files import FileTokenizer, files_tokenizer
from mconvert.data import EOS, build_tokenizer, corpus_text

ROWS = 1100  # embedding rows past every tokenizer's vocabulary: [PADi] rows too


def _bpe(root: Path, name: str, cls=transformers.PreTrainedTokenizerFast, **kw) -> Path:
    d = root / name
    tok = cls(tokenizer_object=build_tokenizer(), **kw)
    tok.save_pretrained(d)
    return d


def _spm(root: Path, name: str, via_slow: bool = False) -> Path:
    import sentencepiece as spm

    raw = root / f"{name}-raw"
    raw.mkdir()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus_text().splitlines()), model_prefix=str(raw / "sp"), model_type="bpe",
        vocab_size=320, byte_fallback=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
        add_dummy_prefix=True, split_digits=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, num_threads=1,
        minloglevel=2, user_defined_symbols=["<user>"])
    # through the slow class (its save adds added_tokens.json and add_prefix_space), or the fast class alone
    cls = transformers.LlamaTokenizer if via_slow else transformers.LlamaTokenizerFast
    tok = cls(vocab_file=str(raw / "sp.model"), legacy=True)
    tok.add_special_tokens({"additional_special_tokens": ["<|special|>"]})
    tok.add_tokens(["\u2581added word"])
    d = root / name
    if via_slow:
        tok.save_pretrained(raw / "slow")
        tok = transformers.LlamaTokenizerFast.from_pretrained(raw / "slow", legacy=True)
    tok.save_pretrained(d)
    return d


def _edit(d: Path, name: str, change) -> Path:
    obj = json.loads((d / name).read_text())
    change(obj)
    (d / name).write_text(json.dumps(obj))
    return d


def _kinds(root: Path) -> dict[str, tuple[Path, bool]]:
    """name -> (tokenizer dir, whether the files settle it)."""
    out = {
        "bpe": (_bpe(root, "bpe", bos_token=EOS, eos_token=EOS, unk_token=EOS), True),
        "gpt2-class": (_bpe(root, "gpt2", transformers.GPT2TokenizerFast), True),
        "qwen2-class": (_bpe(root, "qwen2", transformers.Qwen2TokenizerFast), True),
        "bpe-added": (_bpe(root, "bpe-added", additional_special_tokens=["<|im_start|>"]), True),
        "spm": (_spm(root, "spm"), True),
        "spm-via-slow": (_spm(root, "spm-via-slow", via_slow=True), False),
    }
    # what transformers adds on top of tokenizer.json: read by transformers
    d = _bpe(root, "special-not-added", bos_token=EOS, eos_token=EOS)
    out["special-not-added"] = (_edit(d, "special_tokens_map.json", lambda m: m.update(pad_token="Hello")), False)
    d = _bpe(root, "config-added", bos_token=EOS, eos_token=EOS)
    out["config-added"] = (_edit(d, "tokenizer_config.json", lambda c: c["added_tokens_decoder"].update(
        {"1050": {"content": "<new>", "lstrip": False, "rstrip": False, "normalized": False, "single_word": False,
                  "special": True}})), False)
    d = _spm(root, "spm-prefix")
    out["spm-prefix"] = (_edit(d, "tokenizer_config.json", lambda c: c.update(add_prefix_space=False)), False)
    d = _bpe(root, "other-class", bos_token=EOS, eos_token=EOS)
    out["other-class"] = (_edit(d, "tokenizer_config.json", lambda c: c.update(tokenizer_class="BloomTokenizerFast")),
                          False)
    return out


@pytest.fixture(scope="module")
def kinds(tmp_path_factory) -> dict[str, tuple[Path, bool]]:
    return _kinds(tmp_path_factory.mktemp("tok-files"))


NAMES = ("bpe", "gpt2-class", "qwen2-class", "bpe-added", "spm", "spm-via-slow", "special-not-added", "config-added",
         "spm-prefix", "other-class")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", NAMES)
def test_files_read_as_transformers_reads_them_and_the_gguf_vocabulary_is_the_same(kinds, monkeypatch, name):
    d, settled = kinds[name]
    ours, theirs = files_tokenizer(d), load_tokenizer(d)
    assert isinstance(ours, FileTokenizer) == settled
    if settled:
        assert ours.get_vocab() == theirs.get_vocab()
        assert ours.get_added_vocab() == theirs.get_added_vocab()
        assert {i: (t.content, t.special) for i, t in ours.added_tokens_decoder.items()} == \
            {i: (t.content, t.special) for i, t in theirs.added_tokens_decoder.items()}
        assert ours.init_kwargs.get("add_prefix_space") == theirs.init_kwargs.get("add_prefix_space")
        assert (ours.bos_token_id, ours.eos_token_id) == (theirs.bos_token_id, theirs.eos_token_id)
    vocab = gguf_mod.gguf_vocab(d, ROWS)
    monkeypatch.setattr(gguf_mod, "read_tokenizer", load_tokenizer)
    assert vocab == gguf_mod.gguf_vocab(d, ROWS)


def test_hf_to_gguf_imports_no_transformers(tmp_path, kinds):
    """The GGUF vocabulary of a tokenizer save_pretrained wrote is read without importing transformers."""
    import subprocess
    import sys

    code = ("import sys; from pathlib import Path; from mconvert.convert.deploy.gguf import gguf_vocab; "
            f"gguf_vocab(Path({str(kinds['spm'][0])!r}), {ROWS}); gguf_vocab(Path({str(kinds['bpe'][0])!r}), {ROWS}); "
            "print('transformers' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "False"
