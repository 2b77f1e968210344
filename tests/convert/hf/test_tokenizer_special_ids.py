"""bos/eos ids read from a tokenizer's JSON files (no transformers import) equal what
transformers' AutoTokenizer reports for the same directory — and anything ambiguous falls back to it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import transformers

from mconvert.convert.hf.writer import _special_ids_from_json, _tokenizer_special_ids
from mconvert.data import EOS, build_tokenizer


@pytest.fixture(scope="module")
def bpe():
    return build_tokenizer(vocab_size=300)


def _save(bpe, out: Path, cls: str = "PreTrainedTokenizerFast", **special) -> Path:
    klass = getattr(transformers, cls)
    fast = klass(tokenizer_object=bpe._tokenizer, **special)
    fast.save_pretrained(str(out))
    return out


def _truth(d: Path) -> tuple[int | None, int | None]:
    tok = transformers.AutoTokenizer.from_pretrained(str(d))
    return tok.bos_token_id, tok.eos_token_id


# case -> (how it is saved, whether the JSON fast path answers). It falls back where a class default may apply:
# a token tokenizer_config.json does not name, or a tokenizer_class without `Fast` (transformers saves
# GPT2TokenizerFast as "GPT2Tokenizer").
CASES = {
    "bos=eos": (dict(bos_token=EOS, eos_token=EOS, unk_token=EOS), True),
    "distinct new bos": (dict(bos_token="<s>", eos_token=EOS), True),
    "no bos": (dict(eos_token=EOS), False),
    "gpt2 class": (dict(cls="GPT2TokenizerFast", bos_token="<s>", eos_token="</s>"), False),
    "bos from vocab": (dict(bos_token="a", eos_token=EOS), True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_special_ids_match_autotokenizer(bpe, tmp_path: Path, case: str) -> None:
    saved, fast_answers = CASES[case]
    d = _save(bpe, tmp_path / case.replace(" ", "_"), **saved)
    truth = _truth(d)
    assert _tokenizer_special_ids(d) == truth
    assert _special_ids_from_json(d) == (truth if fast_answers else None)


def test_fast_path_used_for_trainer_layout(bpe, tmp_path: Path) -> None:
    d = _save(bpe, tmp_path / "t", **CASES["bos=eos"][0])
    assert _special_ids_from_json(d) == _truth(d)


def test_disagreeing_special_tokens_map_falls_back(bpe, tmp_path: Path) -> None:
    d = _save(bpe, tmp_path / "t", bos_token="<s>", eos_token=EOS)
    smap = json.loads((d / "special_tokens_map.json").read_text())
    smap["bos_token"] = EOS
    (d / "special_tokens_map.json").write_text(json.dumps(smap))
    assert _special_ids_from_json(d) is None
    assert _tokenizer_special_ids(d) == _truth(d)
