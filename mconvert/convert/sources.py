"""`open_source(path)`: detect the checkpoint format and return a Source (see `base.py`).

Megatron torch (`latest_checkpointed_iteration.txt`, `iter_*` / `release`, `mp_rank_*`), Megatron torch_dist
(`common.pt` / `metadata.json` / `.metadata` in the iteration dir; `mconvert.convert.torch_dist.TorchDistSource`,
imported lazily) and HuggingFace dirs (`config.json` + safetensors or pytorch_model*.bin).
"""

from __future__ import annotations

import argparse
import os
import types
from pathlib import Path
from typing import Any

import torch

from mconvert.convert.base import Unit, units_of
from mconvert.convert.layout import TRACKER, iteration_dir_name, parse_rank_dir, read_latest
from mconvert.convert.io.paths import LIMITS, contained, copy_contained, inside_file, load_json_object
from mconvert.errors import MConvertError, escape_controls, type_name
from mconvert.mappings import families
from mconvert.spec import ModelSpec

TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
    "tokenizer.model", "added_tokens.json", "vocab.txt",
)
_DIST_MARKERS = ("common.pt", "metadata.json", ".metadata")


class SourceBase:
    """What every Source shares: `units()` and `read_hf` = the family plugin over `read_mcore`."""

    path: Path
    format: str
    spec: ModelSpec
    tokenizer_dir: Path | None = None
    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    iteration: int | str | None = None

    # `preview(unit)`: what `read_mcore(unit)` returns, as meta tensors, without reading data — sources that
    # can say define it (Megatron torch, HF safetensors); writers then lay their files out ahead (issue 7)
    preview = None

    def units(self) -> list[Unit]:
        return units_of(self.spec)

    def read_mcore(self, unit: Unit) -> dict[str, torch.Tensor]:  # pragma: no cover - abstract
        raise NotImplementedError

    def read_hf(self, unit: Unit) -> dict[str, torch.Tensor]:
        """Full tensors under HF names, vocab stripped to the true vocab."""
        from mconvert.mappings import to_hf

        return to_hf(self.spec, unit, self.read_mcore(unit), source=str(self.path))

    def describe(self) -> str:
        par = f"TP={self.tp} PP={self.pp}" + (f" VPP={self.vpp}" if self.vpp else "")
        return f"{self.format} checkpoint {self.path} ({self.spec.family}, {par})"


def checkpoint_dict(state: Any, file: str | Path) -> dict[str, Any]:
    """The top level of a Megatron rank file or `common.pt`, which must be a dict; anything else is one
    MConvertError naming the file."""
    if not isinstance(state, dict):
        raise MConvertError(f"{file}: top level is {type_name(state)}, not the dict Megatron saves (args, model, "
                            "...); not a Megatron checkpoint file, or a damaged one — re-copy it")
    return state


def args_dict(args: Any, file: str | Path) -> dict[str, Any]:
    """Megatron `args` (argparse.Namespace, SimpleNamespace or dict) as a dict; missing or of another type is
    one MConvertError naming the file and the key."""
    if isinstance(args, dict):
        return dict(args)
    if isinstance(args, (argparse.Namespace, types.SimpleNamespace)):
        return dict(vars(args))
    what = "missing" if args is None else f"{type_name(args)}, not an argparse.Namespace"
    raise MConvertError(f"{file}: 'args' is {what}; cannot tell the model's shape — re-copy the checkpoint "
                        "(Megatron-LM saves its args in every rank file)")


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


def resolve_iteration_dir(root: Path, iteration: int | str | None) -> tuple[Path, int | str | None]:
    """CKPT root (+ --iteration or the tracker file, else the newest iter_* dir) -> (iteration dir, iteration).

    A path that already is an iteration dir (holds mp_rank_* dirs or torch_dist files) is returned as is."""
    if _is_iteration_dir(root):
        name = root.name
        it: int | str | None = "release" if name == "release" else (int(name[5:]) if name.startswith("iter_") else None)
        return root, it
    if iteration is not None:
        if str(iteration) != "release":
            try:
                iteration = int(iteration)
            except ValueError:
                raise MConvertError(f"--iteration {iteration!r}: expected a number or 'release'") from None
        d = root / iteration_dir_name(iteration)
        if d.is_dir():
            contained(root, d.name, f"{root}: iteration directory")
        if not d.is_dir():
            have = sorted(p.name for p in root.iterdir() if p.is_dir() and (p.name.startswith("iter_") or p.name == "release"))
            raise MConvertError(f"{d}: no such iteration directory; available: {', '.join(have) or 'none'} "
                                "(pass one of them to --iteration)")
        return d, iteration
    if os.path.lexists(root / TRACKER):  # a FIFO or symlink here is refused by read_latest, not skipped
        it = read_latest(root)
        d = root / iteration_dir_name(it)
        if not d.is_dir():
            raise MConvertError(f"{root / TRACKER} names iteration {it} but {d} does not exist; pass --iteration")
        return contained(root, d.name, f"{root / TRACKER}: iteration directory"), it
    iters = sorted(p for p in root.glob("iter_*") if p.is_dir() and p.name[5:].isdigit())
    if iters:
        return contained(root, iters[-1].name, f"{root}: iteration directory"), int(iters[-1].name[5:])
    if (root / "release").is_dir():
        return contained(root, "release", f"{root}: iteration directory"), "release"
    raise MConvertError(f"{root}: not a checkpoint (no {TRACKER}, iter_*/, release/, mp_rank_*/ or config.json)")


def _is_iteration_dir(d: Path) -> bool:
    if any((d / m).exists() for m in _DIST_MARKERS):
        return True
    return any(p.is_dir() and parse_rank_dir(p.name) for p in d.iterdir())


def detect_format(path: str | Path, iteration: int | str | None = None) -> str:
    """'hf', 'megatron' or 'megatron-torch_dist' (one-line error when it is none of them)."""
    p = Path(path)
    if not p.exists():
        raise MConvertError(f"{p}: no such file or directory")
    if not p.is_dir():
        raise MConvertError(f"{p}: expected a checkpoint directory, got a file")
    if (p / "config.json").is_file() and (any(p.glob("*.safetensors")) or any(p.glob("pytorch_model*.bin"))
                                          or (p / "model.safetensors.index.json").is_file()):
        return "hf"
    d, _ = resolve_iteration_dir(p, iteration)
    if any((d / m).exists() for m in _DIST_MARKERS):
        return "megatron-torch_dist"
    return "megatron"


def open_source(path: str | Path, iteration: int | str | None = None, tokenizer: str | Path | None = None,
                verify: bool = True):
    """Open any supported checkpoint as a Source: units of full tensors, read one unit at a time.

    `verify`: an input mconvert wrote is first checked against its manifest (sha256 of every file)."""
    if verify:  # before anything is read, the tracker file included
        from mconvert.convert.io.atomic import verify_input

        verify_input(path)
    fmt = detect_format(path, iteration)
    if fmt == "hf":
        from mconvert.convert.hf import HFSource

        return HFSource(Path(path), tokenizer=tokenizer)
    if fmt == "megatron-torch_dist":
        try:
            from mconvert.convert.torch_dist import TorchDistSource
        except ImportError as e:
            raise MConvertError(f"{path}: torch_dist checkpoints need mconvert.convert.torch_dist ({e})") from None
        return TorchDistSource(Path(path), iteration=iteration, tokenizer=tokenizer)
    from mconvert.convert.megatron import MegatronSource

    return MegatronSource(Path(path), iteration=iteration, tokenizer=tokenizer)


def tokenizer_length(tok_dir: Path) -> int:
    """len(tokenizer) of an HF tokenizer dir (the true vocab when the args do not say)."""
    return len(load_tokenizer(tok_dir))


def megatron_spec(args: dict, source: str, tokenizer: str | Path | None, *roots: Path) -> tuple[ModelSpec, Path | None, bool]:
    """ModelSpec of a Megatron checkpoint's args with its true vocab (args, else the tokenizer's length).

    Returns (spec, tokenizer dir, whether the true vocab is known)."""
    tok_dir = find_tokenizer_dir(Path(tokenizer) if tokenizer else None, *roots)
    if tokenizer and tok_dir is None:
        raise MConvertError(f"{tokenizer}: no tokenizer files (tokenizer.json / tokenizer_config.json) there")
    vocab = args.get("vocab_size") or args.get("orig_vocab_size") or args.get("true_vocab_size")
    known = vocab is not None
    if vocab is None and tok_dir is not None:
        vocab, known = tokenizer_length(tok_dir), True
    spec = families.spec_from_megatron_args(args, source=source)
    if vocab is not None:
        spec = spec.replace(vocab_size=int(vocab))
    return spec, tok_dir, known
