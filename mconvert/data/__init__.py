"""The shipped training corpus and the ByteLevel BPE tokenizer built from it (deterministically).

`corpus.txt` is original text (see make_corpus.py). `build_tokenizer()` trains a 1000-token ByteLevel BPE with
the `tokenizers` library; the trainer saves it as HF tokenizer files in the checkpoint root so exports carry it.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

EOS = "<|endoftext|>"
CORPUS = Path(__file__).with_name("corpus.txt")


def corpus_text() -> str:
    return CORPUS.read_text(encoding="utf-8")


def build_tokenizer(vocab_size: int = 1000):
    """ByteLevel BPE trained on the corpus: same merges on every run (single-threaded trainer, fixed input)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # after TOKENIZERS_PARALLELISM is set: tokenizers reads it on import
    from tokenizers import ByteLevelBPETokenizer

    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(corpus_text().split("\n\n"), vocab_size=vocab_size, min_frequency=2,
                            special_tokens=[EOS], show_progress=False)
    return tok


def save_hf_tokenizer(tok, out_dir: str | Path) -> None:
    """tokenizer.json + tokenizer_config.json + special_tokens_map.json (PreTrainedTokenizerFast), eos = bos."""
    # heavy optional import: transformers loads only when a model is run
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=tok._tokenizer if hasattr(tok, "_tokenizer") else tok,
                                   bos_token=EOS, eos_token=EOS, unk_token=EOS)
    fast.save_pretrained(str(out_dir))


def tokenize_corpus(tok) -> torch.Tensor:
    """The whole corpus as one int64 stream, stories separated by <|endoftext|>."""
    eos = tok.token_to_id(EOS)
    ids: list[int] = []
    for doc in corpus_text().split("\n\n"):
        ids.extend(tok.encode(doc.strip()).ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.int64)
