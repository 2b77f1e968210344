"""Reading a Megatron checkpoint's frame, shared by the torch and torch_dist sources: the iteration directory,
the top-level dict, its `args`, and the ModelSpec they describe with the true vocab."""

from __future__ import annotations

import argparse
import os
import types
from pathlib import Path
from typing import Any

from mconvert.layouts.megatron import TRACKER, iteration_dir_name, parse_rank_dir, read_latest
from mconvert.io.paths import contained
from mconvert.convert.hf.tokenizer import find_tokenizer_dir, tokenizer_length
from mconvert.errors import MConvertError, type_name
from mconvert.mappings import families
from mconvert.spec import ModelSpec

# Files whose presence in an iteration directory marks the torch_dist format.
DIST_MARKERS = ("common.pt", "metadata.json", ".metadata")


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


def resolve_iteration_dir(root: Path, iteration: int | str | None) -> tuple[Path, int | str | None]:
    """CKPT root (+ --iteration or the tracker file, else the newest iter_* dir) -> (iteration dir, iteration).

    A path that already is an iteration dir (holds mp_rank_* dirs or torch_dist files) is returned as is."""
    if is_iteration_dir(root):
        name = root.name
        it: int | str | None = "release" if name == "release" else (int(name[5:]) if name.startswith("iter_") else None)
        return root, it
    if iteration is not None:
        if str(iteration) != "release":
            try:
                iteration = int(iteration)
            except ValueError:
                raise MConvertError(f"--iteration {iteration!r}: expected a number or 'release'") from None
            if iteration < 0:  # iter_-000001 is no name Megatron writes
                raise MConvertError(f"--iteration {iteration}: expected a number >= 0 or 'release'")
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


def is_iteration_dir(d: Path) -> bool:
    """Whether `d` is itself an iteration dir: torch_dist files or mp_rank_* dirs in it."""
    if any((d / m).exists() for m in DIST_MARKERS):
        return True
    return any(p.is_dir() and parse_rank_dir(p.name) for p in d.iterdir())


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
