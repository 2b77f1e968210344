"""llama.cpp's names for byte-level BPE tokenizers (GGUF `tokenizer.ggml.model` / `tokenizer.ggml.pre`).

llama.cpp's `llama-vocab.cpp` applies a fixed split regex per pre-tokenizer name; a byte-level BPE
`tokenizer.json` is matched to a name by its own regex, never guessed. A regex not listed has no GGUF form.
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
