"""llama.cpp's names for the tokenizers a GGUF embeds (`tokenizer.ggml.model` / `tokenizer.ggml.pre`).

llama.cpp's `llama-vocab.cpp` applies a fixed split regex per pre-tokenizer name; a byte-level BPE
`tokenizer.json` is matched to a name by its own regex, never guessed. A regex not listed has no GGUF form.
A SentencePiece `tokenizer.model` is llama.cpp's `llama` vocabulary: pieces, scores and piece types as the
model proto holds them, tokenized by llama.cpp's own score-ordered merges (`llm_tokenizer_spm`).
"""

from __future__ import annotations

# `tokenizer.ggml.model` of a byte-level BPE (llama.cpp's LLAMA_VOCAB_TYPE_BPE)
BPE_MODEL = "gpt2"

# split regex -> `tokenizer.ggml.pre`
PRE_TOKENIZERS: dict[str, str] = {
    # GPT-2's, which `ByteLevel(use_regex=True)` applies itself
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+": "gpt-2",
    # Llama 3's
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|"
    "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+": "llama-bpe",
    # Qwen2's (digits one at a time)
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|"
    "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+": "qwen2",
}

# the regex `ByteLevel(use_regex=True)` stands for
BYTE_LEVEL_REGEX = next(k for k, v in PRE_TOKENIZERS.items() if v == "gpt-2")

# `tokenizer.ggml.model` / `.pre` of a SentencePiece model (llama.cpp's LLAMA_VOCAB_TYPE_SPM)
SPM_MODEL = "llama"
SPM_PRE = "default"
SPM_FILE = "tokenizer.model"
# the score convert_hf_to_gguf.py gives added tokens, and rows the tokenizer does not fill
ADDED_SCORE = -1000.0
UNFILLED_SCORE = -10000.0
# SentencePiece settings llama.cpp's SPM tokenizer reproduces ("spec.field" of the model proto -> the value it
# assumes, and what a model with another value would get wrong); `add_dummy_prefix` is carried as
# add_space_prefix
SPM_SETTINGS: dict[str, tuple[object, str]] = {
    "normalizer_spec.remove_extra_whitespaces": (False, "llama.cpp keeps runs of spaces"),
    "normalizer_spec.escape_whitespaces": (True, "llama.cpp always spells a space as \u2581"),
    "trainer_spec.treat_whitespace_as_suffix": (False, "llama.cpp puts \u2581 before a word"),
}
