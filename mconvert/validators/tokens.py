"""The token batch every format is run on: a text through the tokenizer found beside a model, or a
deterministic batch derived from a built-in text when no tokenizer is known.
"""

from __future__ import annotations

from pathlib import Path

import torch

from mconvert.convert.hf.tokenizer import load_tokenizer as load
from mconvert.errors import MConvertError

BUILTIN_TEXT = (
    "The quick brown fox jumps over the lazy dog. A checkpoint is only as good as the logits it computes, "
    "so we run every format on the same tokens and compare what comes out. Pipeline stages hand activations "
    "to one another; tensor-parallel ranks each hold a slice of every matrix, and the sum of their work must "
    "equal the work of one device holding the whole. Queries, keys and values are grouped; gates and ups are "
    "halves of one projection; the vocabulary is padded to a multiple of the parallel size. When any of these "
    "is laid out wrong the model still loads, still runs, and quietly computes something else. "
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000. Punctuation: (a, b); [c: d] {e - f}! \"quoted\" 'text'? "
)


def load_tokenizer(tok_dir: Path):
    """A transformers tokenizer from a directory (tokenizer.json alone is enough); never runs code from it."""
    return load(tok_dir)


def make_batch(
    vocab_size: int,
    n_tokens: int = 32,
    batch: int = 2,
    text: str | None = None,
    tokenizer_dir: Path | None = None,
) -> tuple[torch.Tensor, str]:
    """A [batch, n_tokens] int64 tensor and a line saying where it came from.

    Consecutive windows of the tokenized text (repeated when short); without a tokenizer the text's
    UTF-8 bytes taken modulo the vocabulary (deterministic, same on every run)."""
    text = text if text is not None else BUILTIN_TEXT
    if not text.strip():
        raise MConvertError("--text: the file is empty; give a text with at least a few words")
    need = batch * n_tokens
    if tokenizer_dir is not None:
        tok = load_tokenizer(tokenizer_dir)
        ids = list(tok(text, add_special_tokens=False)["input_ids"])
        source = f"tokenizer at {tokenizer_dir}"
        if not ids:
            raise MConvertError(f"{tokenizer_dir}: the tokenizer produced no tokens for the text")
    else:
        ids = [b % vocab_size for b in text.encode("utf-8")]
        source = "built-in deterministic ids (UTF-8 bytes mod vocab; no tokenizer found)"
    while len(ids) < need:
        ids = ids + ids
    t = torch.tensor(ids[:need], dtype=torch.long).view(batch, n_tokens)
    if int(t.max()) >= vocab_size:
        raise MConvertError(
            f"tokenizer at {tokenizer_dir} yields id {int(t.max())} >= vocab_size {vocab_size}; "
            "the tokenizer does not belong to this model"
        )
    return t, source
