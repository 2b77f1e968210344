"""HF tokenizer directories next to a checkpoint: find, check, load (never running code from them) and copy."""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from mconvert.io.paths import LIMITS, contained, copy_contained, inside_file, load_json_object
from mconvert.errors import MConvertError, escape_controls, renamed

# Every file transformers' `save_pretrained` writes for a tokenizer, of any class: the names in its tokenizer
# classes' `vocab_files_names`, the shared files and both chat-template forms. A table, so that a model's own
# files (config.json, weights) never travel as tokenizer files; pickled vocabularies (vocab.pkl, vocab.bin) are
# left out because loading them runs code.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
    "tokenizer.model", "added_tokens.json", "vocab.txt", "chat_template.jinja", "chat_template.json",
    "spiece.model", "sentencepiece.bpe.model", "sentencepiece.model", "spm.model", "bpe.codes",
    "normalizer.json", "emoji.json", "byte_maps.json", "entity_vocab.json", "vocab-src.json", "vocab-tgt.json",
    "word_shape.json", "word_pronunciation.json", "prophetnet.tokenizer",
)
# Patterns (one directory level at most): versioned fast tokenizers named by `fast_tokenizer_files`, and the
# named chat templates transformers keeps beside chat_template.jinja.
TOKENIZER_PATTERNS = ("tokenizer.*.json", "additional_chat_templates/*.jinja")
CHAT_TEMPLATE_DIR = "additional_chat_templates"
# A tokenizer is a handful of files; more than this many, or more bytes in all, is not one.
MAX_TOKENIZER_FILES = 64
MAX_TOKENIZER_BYTES = 1 << 30
# The HF generation config travels beside the tokenizer, byte for byte, through a Megatron checkpoint root.
GENERATION_CONFIG = "generation_config.json"
# config.json's special-token ids (Megatron args hold bos/eos as single ints and no pad id at all), kept in the
# Megatron root so that megatron-to-hf writes them back exactly, lists included.
TOKEN_IDS_FILE = "hf_token_ids.json"
TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


# Small tokenizer files whose top level is a JSON object (tokenizer.json is checked where it is parsed).
_TOKENIZER_JSON = ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json",
                   "chat_template.json")
_TOKENIZER_FIX = "re-save the tokenizer (or pass --tokenizer DIR)"


def ids_outside_vocab(ids: dict[str, Any], vocab_size: int, where: str) -> list[str]:
    """A warning for each special-token id (an int, or a list of them) the model's vocabulary has no row for: the
    model never produces it, and generation never stops on such an eos. The conversion keeps the id as the
    checkpoint states it (the function is unchanged); the warning says where to correct it."""
    out = []
    for name, v in ids.items():
        bad = [i for i in (v if isinstance(v, list) else [v])
               if isinstance(i, int) and not isinstance(i, bool) and not 0 <= i < vocab_size]
        if bad:
            never = f"the model never produces {'it' if len(bad) == 1 else 'them'}"
            if name == "eos_token_id":
                never += ", so generation never stops on it"
            out.append(f"{name} {v} lies outside the vocabulary (ids 0 to {vocab_size - 1}): {never}; correct it in "
                       f"{where}")
    return out


def check_tokenizer_files(tok_dir: Path) -> None:
    """Refuse, naming the file, a tokenizer dir whose small JSON files are not JSON objects."""
    for name in _TOKENIZER_JSON:
        if (tok_dir / name).is_file():
            path = inside_file(tok_dir, name, f"{tok_dir}: tokenizer file {name}")
            load_json_object(path, "tokenizer file", _TOKENIZER_FIX, kind="tokenizer")


def check_unique_ids(tok_dir: Path) -> None:
    """Refuse a tokenizer whose vocabulary gives one id to two tokens (tokenizer.json's `model.vocab` or its
    `added_tokens`; vocab.json without a tokenizer.json): the tokenizers library keeps its id -> token map in a
    hash map, so such an id decodes as either token, differently from run to run, and nothing written from it
    (a GGUF's token list) would be a function of the input."""
    fix = "give each token its own id and re-save the tokenizer"
    if (tok_dir / "tokenizer.json").is_file():
        path = inside_file(tok_dir, "tokenizer.json", f"{tok_dir}: tokenizer file")
        obj = load_json_object(path, "tokenizer file", _TOKENIZER_FIX, kind="tokenizer")
        model = obj.get("model")
        tables = [("model.vocab", model.get("vocab") if isinstance(model, dict) else None)]
        added = obj.get("added_tokens")
        if isinstance(added, list):
            tables.append(("added_tokens", [(a.get("content"), a.get("id")) for a in added if isinstance(a, dict)]))
    elif (tok_dir / "vocab.json").is_file():
        path = inside_file(tok_dir, "vocab.json", f"{tok_dir}: tokenizer file")
        tables = [("the vocabulary", load_json_object(path, "tokenizer file", _TOKENIZER_FIX, kind="tokenizer"))]
    else:
        return
    for where, table in tables:
        pairs = list(table.items()) if isinstance(table, dict) else table if isinstance(table, list) else []
        seen: dict[Any, Any] = {}
        for token, i in pairs:
            if not isinstance(i, int) or isinstance(i, bool):
                continue
            if i in seen and seen[i] != token:
                a, b = (escape_controls(str(t))[:40] for t in (seen[i], token))
                raise MConvertError(f"{path}: {where} gives id {i} to both {a!r} and {b!r}; the tokenizers library "
                                    f"then decodes id {i} as either, differently from run to run — {fix}")
            seen.setdefault(i, token)


class TokenizerCodeRefused(MConvertError):
    """A tokenizer that only the code shipped in its directory can build: refused, never run."""


def _transformers5_fast(tok_dir: Path) -> bool:
    """Whether transformers 5 saved this tokenizer under its name for a tokenizer.json-backed one,
    `TokenizersBackend` (Megatron-Bridge's tokenizer/ is such): transformers 4's PreTrainedTokenizerFast."""
    if not (tok_dir / "tokenizer.json").is_file() or not (tok_dir / "tokenizer_config.json").is_file():
        return False
    cfg = load_json_object(tok_dir / "tokenizer_config.json", "tokenizer config", _TOKENIZER_FIX)
    return cfg.get("tokenizer_class") == "TokenizersBackend"


@contextmanager
def staged_tokenizer(tok_dir: Path, *also: str, skip: tuple[str, ...] = ()) -> Iterator[Path]:
    """A private directory holding copies of `tok_dir`'s tokenizer files (the table's, less `skip`) and of the
    `also` files present there, each checked as an input file (inside `tok_dir` once every symlink is followed,
    regular, bounded in size). A library given this directory (transformers, tokenizers, gguf-py) opens only
    what mconvert checked, whatever file names it tries; the copy is removed on the way out."""
    tmp = Path(tempfile.mkdtemp(prefix="mconvert-tokenizer-"))
    try:
        copy_tokenizer(tok_dir, tmp, skip)
        for f in also:
            if os.path.lexists(tok_dir / f):
                inside_file(tok_dir, f, f"{tok_dir}: file {f}")
                copy_contained(tok_dir, f, tmp, kind="json" if f.endswith(".json") else "tokenizer")
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load_tokenizer(tok_dir: Path) -> Any:
    """transformers' tokenizer of `tok_dir`, never running code shipped in it: `trust_remote_code=False` and
    local files only, so no `[y/N]` prompt either; transformers reads a staged copy (`staged_tokenizer`), so
    it opens nothing mconvert did not check. A tokenizer that only its own code can build (`auto_map`
    without a class transformers has) is refused by name; any other failure is one MConvertError."""
    # heavy optional import: transformers loads only when a tokenizer is read
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    check_tokenizer_files(tok_dir)
    check_unique_ids(tok_dir)
    # transformers reads config.json for the tokenizer class when tokenizer_config.json names none
    with staged_tokenizer(tok_dir, "config.json") as d:
        try:
            if _transformers5_fast(d):
                return PreTrainedTokenizerFast.from_pretrained(str(d), local_files_only=True)
            if (d / "tokenizer_config.json").is_file() or (d / "vocab.json").is_file():
                return AutoTokenizer.from_pretrained(str(d), trust_remote_code=False, local_files_only=True)
            return PreTrainedTokenizerFast(tokenizer_file=str(d / "tokenizer.json"))
        except Exception as e:  # noqa: BLE001 - transformers raises many types for a broken tokenizer dir
            if "trust_remote_code" in str(e):
                raise TokenizerCodeRefused(
                    f"{tok_dir}: the tokenizer names its own code (auto_map) and no class transformers has; "
                    "mconvert never runs code from a checkpoint — remove auto_map or pass --tokenizer DIR with a "
                    "standard tokenizer"
                ) from None
            text = escape_controls(renamed(str(e).split("\n", 1)[0], d, tok_dir))[:200]
            raise MConvertError(f"{tok_dir}: tokenizer files present but unreadable ({type(e).__name__}: {text}); "
                                f"{_TOKENIZER_FIX}") from None


def tokenizer_files(d: Path) -> list[str]:
    """The tokenizer files of `d` by the table (`TOKENIZER_FILES`, `TOKENIZER_PATTERNS`): names relative to `d`,
    in a stable order, whatever kind of file each is (`check_tokenizer_dir` decides whether it may be read)."""
    names = [f for f in TOKENIZER_FILES if os.path.lexists(d / f)]
    for pattern in TOKENIZER_PATTERNS:
        folder, _, leaf = pattern.rpartition("/")
        base = d / folder if folder else d
        if folder and not base.is_dir():
            continue
        try:
            with os.scandir(base) as it:
                found = []
                for e in it:
                    if fnmatch.fnmatchcase(e.name, leaf) and e.name not in TOKENIZER_FILES:
                        found.append(f"{folder}/{e.name}" if folder else e.name)
                        if len(names) + len(found) > MAX_TOKENIZER_FILES:
                            break
        except OSError:
            continue
        names += sorted(found)
    return names


def check_tokenizer_dir(d: Path) -> Path:
    """Refuse a tokenizer directory whose files (`tokenizer_files`) are symlinks leading outside it, FIFOs,
    devices, larger than a tokenizer file holds, or more in number or bytes than a tokenizer has: transformers
    and the copy into OUT would follow them."""
    names = tokenizer_files(d)
    if len(names) > MAX_TOKENIZER_FILES:
        raise MConvertError(f"{d}: more than {MAX_TOKENIZER_FILES} tokenizer files ({names[-1]} ...); a tokenizer "
                            "has a handful — check the tokenizer directory")
    total = 0
    for f in names:
        st = inside_file(d, f, f"{d}: tokenizer file {f}").stat()
        if st.st_size > LIMITS["tokenizer"]:
            raise MConvertError(f"{d / f}: {st.st_size:,} bytes, more than a tokenizer file holds "
                                f"(limit {LIMITS['tokenizer']:,}); check the tokenizer directory")
        total += st.st_size
    if total > MAX_TOKENIZER_BYTES:
        raise MConvertError(f"{d}: tokenizer files hold {total:,} bytes, more than a tokenizer does (limit "
                            f"{MAX_TOKENIZER_BYTES:,}); check the tokenizer directory")
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


def copy_tokenizer(src_dir: Path | None, out: Path, skip: tuple[str, ...] = ()) -> list[str]:
    """Copy every tokenizer file of `src_dir` (the table's, less `skip`; each a regular file inside `src_dir`,
    bounded in size) into `out` under the same relative name; their names."""
    copied: list[str] = []
    if src_dir is not None:
        check_tokenizer_dir(src_dir)
        for f in tokenizer_files(src_dir):
            if f in skip:
                continue
            folder, _, leaf = f.rpartition("/")
            if folder:  # a named chat template: the folder itself may not lead outside either
                contained(src_dir, f, f"{src_dir}: tokenizer file {f}")
                (out / folder).mkdir(exist_ok=True)
            copy_contained(src_dir / folder, leaf, out / folder, kind="tokenizer")
            copied.append(f)
    return copied


def has_chat_template(d: Path) -> bool:
    """Whether the tokenizer in `d` carries a chat template (chat_template.jinja / .json, a named template, or
    a `chat_template` key in tokenizer_config.json)."""
    if any((d / f).is_file() for f in ("chat_template.jinja", "chat_template.json")):
        return True
    if any(f.startswith(CHAT_TEMPLATE_DIR + "/") for f in tokenizer_files(d)):
        return True
    if (d / "tokenizer_config.json").is_file():
        path = inside_file(d, "tokenizer_config.json", f"{d}: tokenizer file tokenizer_config.json")
        return bool(load_json_object(path, "tokenizer file", _TOKENIZER_FIX, kind="tokenizer").get("chat_template"))
    return False


# ---- HF metadata carried through a Megatron checkpoint root ---------------------------------------------
def find_carried_dir(*candidates: Path | None) -> Path | None:
    """The first directory holding HF metadata carried beside a checkpoint (generation config, token ids)."""
    for d in candidates:
        if d is not None and any(os.path.lexists(d / f) for f in (GENERATION_CONFIG, TOKEN_IDS_FILE)):
            return d
    return None


def _check_id(value: Any, where: str, fix: str) -> Any:
    ok = value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 0) or (
        isinstance(value, list) and value and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                                  for i in value))
    if not ok:
        raise MConvertError(f"{where}: {value!r} is not a token id (an id >= 0, a non-empty list of them, or "
                            f"null); {fix}")
    return value


def token_ids_of(config: dict[str, Any]) -> dict[str, Any]:
    """config.json's special-token id fields that are present (values as stored: int, list or null)."""
    return {k: config[k] for k in TOKEN_ID_KEYS if k in config}


def read_token_ids(d: Path | None) -> dict[str, Any] | None:
    """The ids kept in `d`'s `hf_token_ids.json` (checked: known keys, token-id values), or None without one."""
    if d is None or not os.path.lexists(d / TOKEN_IDS_FILE):
        return None
    fix = f"fix it or delete {TOKEN_IDS_FILE} (config.json then takes the ids from the args and tokenizer)"
    obj = load_json_object(inside_file(d, TOKEN_IDS_FILE, f"{d}: token ids"), "token-id file", fix)
    for k, v in obj.items():
        if k not in TOKEN_ID_KEYS:
            raise MConvertError(f"{d / TOKEN_IDS_FILE}: unknown key {escape_controls(k)[:60]!r} (expected "
                                f"{', '.join(TOKEN_ID_KEYS)}); {fix}")
        _check_id(v, f"{d / TOKEN_IDS_FILE}: {k}", fix)
    return obj


def carry_to_megatron(tok_dir: Path | None, meta_dir: Path | None, out: Path,
                      config: dict[str, Any] | None = None) -> list[str]:
    """Write into a Megatron root `out` what an HF export needs back: the tokenizer files, the generation config
    (bytes as they are) and the special-token ids (from `config` when given, else those kept in `meta_dir`)."""
    names = copy_tokenizer(tok_dir, out)
    if meta_dir is not None and os.path.lexists(meta_dir / GENERATION_CONFIG):
        path = inside_file(meta_dir, GENERATION_CONFIG, f"{meta_dir}: generation config")
        load_json_object(path, "generation config", "fix or delete it")
        copy_contained(meta_dir, GENERATION_CONFIG, out, kind="json")
        names.append(GENERATION_CONFIG)
    ids = token_ids_of(config) if config is not None else read_token_ids(meta_dir)
    if ids:
        for k, v in ids.items():
            _check_id(v, f"config.json: {k}", "fix config.json")
        (out / TOKEN_IDS_FILE).write_text(json.dumps(ids, indent=2) + "\n")
        names.append(TOKEN_IDS_FILE)
    return names


def tokenizer_length(tok_dir: Path) -> int:
    """len(tokenizer) of an HF tokenizer dir (the true vocab when the args do not say)."""
    return len(load_tokenizer(tok_dir))
