"""`open_source(path)`: detect the checkpoint format and return a Source (see `base.py`).

Megatron torch (`latest_checkpointed_iteration.txt`, `iter_*` / `release`, `mp_rank_*`), Megatron torch_dist
(`common.pt` / `metadata.json` / `.metadata` in the iteration dir) and HuggingFace dirs (`config.json` +
safetensors or pytorch_model*.bin).
"""

from __future__ import annotations

from pathlib import Path

from mconvert.convert.io.atomic import verify_input
from mconvert.convert.base import SourceBase
from mconvert.convert.checkpoint import DIST_MARKERS, resolve_iteration_dir
from mconvert.convert.hf import HFSource
from mconvert.convert.megatron import MegatronSource
from mconvert.convert.torch_dist import TorchDistSource
from mconvert.errors import MConvertError


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
    if any((d / m).exists() for m in DIST_MARKERS):
        return "megatron-torch_dist"
    return "megatron"


def open_source(path: str | Path, iteration: int | str | None = None, tokenizer: str | Path | None = None,
                verify: bool = True) -> SourceBase:
    """Open any supported checkpoint as a Source: units of full tensors, read one unit at a time.

    `verify`: an input mconvert wrote is first checked against its manifest (the digest of every file)."""
    if verify:  # before anything is read, the tracker file included
        verify_input(path)
    fmt = detect_format(path, iteration)
    if fmt == "hf":
        return HFSource(Path(path), tokenizer=tokenizer)
    if fmt == "megatron-torch_dist":
        return TorchDistSource(Path(path), iteration=iteration, tokenizer=tokenizer)
    return MegatronSource(Path(path), iteration=iteration, tokenizer=tokenizer)
