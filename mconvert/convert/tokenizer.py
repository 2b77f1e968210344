"""HF tokenizer directories next to a checkpoint: find, check, load (never running code from them) and copy."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from mconvert.convert.io.paths import LIMITS, copy_contained, inside_file, load_json_object
from mconvert.errors import MConvertError, escape_controls

TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
    "tokenizer.model", "added_tokens.json", "vocab.txt",
)


# Small tokenizer files whose top level is a JSON object (tokenizer.json is checked where it is parsed).
_TOKENIZER_JSON = ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json")
_TOKENIZER_FIX = "re-save the tokenizer (or pass --tokenizer DIR)"


def check_tokenizer_files(tok_dir: Path) -> None:
    """Refuse, naming the file, a tokenizer dir whose small JSON files are not JSON objects."""
    for name in _TOKENIZER_JSON:
        if (tok_dir / name).is_file():
            path = inside_file(tok_dir, name, f"{tok_dir}: tokenizer file {name}")
            load_json_object(path, "tokenizer file", _TOKENIZER_FIX, kind="tokenizer")


class TokenizerCodeRefused(MConvertError):
    """A tokenizer that only the code shipped in its directory can build: refused, never run."""


def load_tokenizer(tok_dir: Path) -> Any:
    """transformers' tokenizer of `tok_dir`, never running code shipped in it: `trust_remote_code=False` and
    local files only, so no `[y/N]` prompt either. A tokenizer that only its own code can build (`auto_map`
    without a class transformers has) is refused by name; any other failure is one MConvertError."""
    # heavy optional import: transformers loads only when a tokenizer is read
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    check_tokenizer_dir(tok_dir)
    check_tokenizer_files(tok_dir)
    try:
        if (tok_dir / "tokenizer_config.json").is_file() or (tok_dir / "vocab.json").is_file():
            return AutoTokenizer.from_pretrained(str(tok_dir), trust_remote_code=False, local_files_only=True)
        return PreTrainedTokenizerFast(tokenizer_file=str(tok_dir / "tokenizer.json"))
    except Exception as e:  # noqa: BLE001 - transformers raises many types for a broken tokenizer dir
        if "trust_remote_code" in str(e):
            raise TokenizerCodeRefused(
                f"{tok_dir}: the tokenizer names its own code (auto_map) and no class transformers has; mconvert "
                "never runs code from a checkpoint — remove auto_map or pass --tokenizer DIR with a standard tokenizer"
            ) from None
        text = escape_controls(str(e).split("\n", 1)[0])[:200]
        raise MConvertError(f"{tok_dir}: tokenizer files present but unreadable ({type(e).__name__}: {text}); "
                            f"{_TOKENIZER_FIX}") from None


# Files transformers may open when it loads a tokenizer directory: each must be a regular file inside it.
TOKENIZER_READ_FILES = TOKENIZER_FILES + ("chat_template.jinja", "chat_template.json", "spiece.model")


def check_tokenizer_dir(d: Path) -> Path:
    """Refuse a tokenizer directory whose files (`TOKENIZER_READ_FILES`) are symlinks leading outside it, FIFOs,
    devices or larger than a tokenizer file holds: transformers and the copy into OUT would follow them."""
    for f in TOKENIZER_READ_FILES:
        if os.path.lexists(d / f):
            st = inside_file(d, f, f"{d}: tokenizer file {f}").stat()
            if st.st_size > LIMITS["tokenizer"]:
                raise MConvertError(f"{d / f}: {st.st_size:,} bytes, more than a tokenizer file holds "
                                    f"(limit {LIMITS['tokenizer']:,}); check the tokenizer directory")
    return d


def find_tokenizer_dir(*candidates: Path | None) -> Path | None:
    """The first directory that holds HF tokenizer files, checked by `check_tokenizer_dir`."""
    for d in candidates:
        if d is not None and d.is_dir() and any(os.path.lexists(d / f)
                                                for f in TOKENIZER_FILES[:2] + ("tokenizer.model",)):
            check_tokenizer_dir(d)
            check_tokenizer_files(d)
            return d
    return None


def copy_tokenizer(src_dir: Path | None, out: Path) -> list[str]:
    """Copy the tokenizer files of `src_dir` into `out` (each a regular file inside `src_dir`); their names."""
    copied = []
    if src_dir is not None:
        check_tokenizer_dir(src_dir)
        for f in TOKENIZER_FILES:
            if (src_dir / f).is_file():
                copy_contained(src_dir, f, out)
                copied.append(f)
    return copied


def tokenizer_length(tok_dir: Path) -> int:
    """len(tokenizer) of an HF tokenizer dir (the true vocab when the args do not say)."""
    return len(load_tokenizer(tok_dir))
