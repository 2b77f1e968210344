"""A tokenizer's vocabulary read from its files by the `tokenizers` library alone, without transformers.

transformers' fast tokenizer is the `tokenizers` library's `Tokenizer` of `tokenizer.json` plus what
`PreTrainedTokenizerFast.__init__` adds on top: the added tokens of tokenizer_config.json's
`added_tokens_decoder` that tokenizer.json does not hold as they are, the special tokens (the class's defaults,
tokenizer_config.json's, special_tokens_map.json's) that are not added tokens yet, and for some classes a
tokenizer converted from the slow one instead of tokenizer.json. Where the files show that none of that happens
(the case of every tokenizer `save_pretrained` writes), the `Tokenizer` alone has the vocabulary, added tokens and
their special flags transformers would; anywhere else `read_tokenizer` hands the directory to transformers
(`load_tokenizer`), so what is read never depends on which path read it. Importing transformers costs seconds
of CPU; the `tokenizers` library, a fraction of one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mconvert.convert.hf.tokenizer import check_tokenizer_files, check_unique_ids, load_tokenizer
from mconvert.io.paths import inside_file, read_small

# tokenizer_class -> the special tokens its fast class defaults to (transformers' `*TokenizerFast.__init__`);
# a class not listed here is read by transformers
CLASS_DEFAULTS: dict[str | None, dict[str, str | None]] = {
    None: {},
    "PreTrainedTokenizerFast": {},
    "TokenizersBackend": {},
    **{c: {"unk_token": "<|endoftext|>", "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"}
       for c in ("GPT2Tokenizer", "GPT2TokenizerFast")},
    **{c: {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"}
       for c in ("LlamaTokenizer", "LlamaTokenizerFast")},
    **{c: {"unk_token": "<unk>", "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"}
       for c in ("GemmaTokenizer", "GemmaTokenizerFast")},
    **{c: {"unk_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}
       for c in ("Qwen2Tokenizer", "Qwen2TokenizerFast")},
}
# classes that convert the slow tokenizer instead of reading tokenizer.json when add_prefix_space is set
FROM_SLOW_ON_PREFIX = ("LlamaTokenizer", "LlamaTokenizerFast", "GemmaTokenizer", "GemmaTokenizerFast")
SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
ADDED_FIELDS = ("content", "lstrip", "rstrip", "normalized", "single_word", "special")


@dataclass(frozen=True)
class AddedToken:
    content: str
    special: bool


@dataclass(frozen=True)
class FileTokenizer:
    """What the GGUF metadata reads of transformers' tokenizer (`get_vocab`, `get_added_vocab`,
    `added_tokens_decoder`, `init_kwargs`), from the files."""

    vocab: dict[str, int]
    added_tokens_decoder: dict[int, AddedToken]
    init_kwargs: dict[str, Any]
    special_tokens: dict[str, str | None]  # bos_token, eos_token, ... -> the token (None: none)

    @property
    def bos_token_id(self) -> int | None:
        return self._id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._id("eos_token")

    def _id(self, key: str) -> int | None:
        tok = self.special_tokens.get(key)
        return None if tok is None else self.vocab[tok]

    def get_vocab(self) -> dict[str, int]:
        return dict(self.vocab)

    def get_added_vocab(self) -> dict[str, int]:
        return {t.content: i for i, t in self.added_tokens_decoder.items()}


def read_tokenizer(tok_dir: Path) -> Any:
    """The tokenizer of `tok_dir` as transformers' fast tokenizer has it: from the files where they settle it
    (`FileTokenizer`), else transformers' own (`load_tokenizer`)."""
    return files_tokenizer(tok_dir) or load_tokenizer(tok_dir)


def _json(tok_dir: Path, name: str) -> Any:
    return json.loads(read_small(inside_file(tok_dir, name, f"{tok_dir}: tokenizer file"), "tokenizer"))


def _contents(value: Any) -> list[str | None] | None:
    """The token text(s) a special-token entry names (a string, an AddedToken dict, a list of them); None when
    the entry has another shape (transformers decides)."""
    if value is None or isinstance(value, str):
        return [value]
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return [value["content"]]
    if isinstance(value, list):
        out: list[str | None] = []
        for v in value:
            c = _contents(v)
            if c is None:
                return None
            out += c
        return out
    return None


def files_tokenizer(tok_dir: Path) -> FileTokenizer | None:
    """The tokenizer of `tok_dir` from its files, or None where transformers would hold something the files do
    not show (then transformers reads it)."""
    check_tokenizer_files(tok_dir)  # what load_tokenizer refuses first, by file
    check_unique_ids(tok_dir)
    if not (tok_dir / "tokenizer.json").is_file():
        return None
    cfg = _json(tok_dir, "tokenizer_config.json") if (tok_dir / "tokenizer_config.json").is_file() else {}
    if (tok_dir / "added_tokens.json").exists() and not isinstance(cfg.get("added_tokens_decoder"), dict):
        return None  # transformers reads the legacy added_tokens.json only without an added_tokens_decoder
    if not (tok_dir / "tokenizer_config.json").is_file() and (tok_dir / "config.json").exists():
        return None  # transformers takes the class from config.json's model type
    cls = cfg.get("tokenizer_class")
    if not isinstance(cls, (str, type(None))) or cls not in CLASS_DEFAULTS or "auto_map" in cfg or cfg.get("from_slow"):
        return None
    if cfg.get("add_prefix_space") is not None and cls in FROM_SLOW_ON_PREFIX:
        return None
    try:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_str(read_small(inside_file(tok_dir, "tokenizer.json", f"{tok_dir}: tokenizer file"),
                                            "tokenizer").decode("utf-8"))
        raw_added = _json(tok_dir, "tokenizer.json").get("added_tokens") or []
    except Exception:  # noqa: BLE001 - transformers reads it again and names what is wrong
        return None
    added = {a.get("id"): {k: a.get(k) for k in ADDED_FIELDS} for a in raw_added if isinstance(a, dict)}
    # tokenizer_config.json's added tokens: transformers adds again each one tokenizer.json does not hold as is
    for i, a in (cfg.get("added_tokens_decoder") or {}).items():
        if not isinstance(a, dict) or not str(i).isdigit() or added.get(int(i)) != {k: a.get(k) for k in ADDED_FIELDS}:
            return None
    names: list[str | None] = []
    specials = dict(CLASS_DEFAULTS[cls])
    tables = [cfg, _json(tok_dir, "special_tokens_map.json") if (tok_dir / "special_tokens_map.json").is_file() else {}]
    for table in tables:
        if not isinstance(table, dict):
            return None
        for key in (*SPECIAL_KEYS, "additional_special_tokens"):
            if key in table:
                c = _contents(table[key])
                if c is None:
                    return None
                names += c
        extra = table.get("extra_special_tokens") or {}
        c = _contents(list(extra.values()) if isinstance(extra, dict) else extra)
        if c is None:
            return None
        names += c
    names += [v for k, v in specials.items() if not any(isinstance(t, dict) and k in t for t in tables)]
    contents = {a["content"] for a in added.values()}
    # a special token that is not an added token yet: transformers adds it (a new id, or a changed type)
    if any(n is not None and n not in contents for n in names):
        return None
    # the special tokens as transformers sets them: the class's defaults under tokenizer_config.json's, and
    # special_tokens_map.json's over both only where tokenizer_config.json has no added_tokens_decoder (its
    # legacy branch)
    chosen: dict[str, str | None] = dict(specials)
    for table in tables if not isinstance(cfg.get("added_tokens_decoder"), dict) else tables[:1]:
        for key in SPECIAL_KEYS:
            if key in table:
                chosen[key] = (_contents(table[key]) or [None])[0]
    decoder = {int(i): AddedToken(t.content, bool(t.special)) for i, t in tok.get_added_tokens_decoder().items()}
    return FileTokenizer(tok.get_vocab(with_added_tokens=True), dict(sorted(decoder.items())), dict(cfg), chosen)
