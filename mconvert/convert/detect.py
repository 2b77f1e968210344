"""The one format detector: which on-disk format a path holds, from file names and small text files only.

A table of rules tried in order; the first that matches names the format. The conversion verbs accept
checkpoints (`CHECKPOINTS`), the validators every format (`FORMATS`); a recognised format the caller does not
accept is refused by its name rather than as "not a checkpoint". Nothing is unpickled here.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from mconvert.convert.megatron.checkpoint import DIST_MARKERS, is_iteration_dir, resolve_iteration_dir
from mconvert.io.paths import load_json_object
from mconvert.layouts.megatron import TRACKER
from mconvert.errors import MConvertError


def _megatron_root(p: Path) -> bool:
    """A Megatron checkpoint root (tracker file, iter_*/ or release/ dirs) or one of its iteration dirs."""
    if os.path.lexists(p / TRACKER) or is_iteration_dir(p) or (p / "release").is_dir():
        return True
    return any(d.is_dir() and d.name[5:].isdigit() for d in p.glob("iter_*"))


def _megatron_kind(p: Path, iteration: int | str | None) -> str:
    """torch or torch_dist: what the iteration dir the checkpoint resolves to holds."""
    d, _ = resolve_iteration_dir(p, iteration)
    return "megatron-torch_dist" if any(os.path.lexists(d / m) for m in DIST_MARKERS) else "megatron"


def _has_weights(p: Path) -> bool:
    return (any(p.glob("*.safetensors")) or any(p.glob("pytorch_model*.bin"))
            or (p / "model.safetensors.index.json").is_file())


def _ft(p: Path) -> bool:
    return (p / "config.ini").is_file() or any(p.glob("*-gpu/config.ini"))


def _onnx(p: Path) -> bool:
    return any(p.glob("*.onnx"))


def _trtllm(p: Path) -> bool:
    """rank*.safetensors beside a config.json with TensorRT-LLM's `architecture` (HF's is `architectures`)."""
    if not (p / "config.json").is_file() or not any(p.glob("rank*.safetensors")):
        return False
    try:
        cfg = load_json_object(p / "config.json", "config")
    except MConvertError:
        return False
    return "architecture" in cfg and "architectures" not in cfg


def _hf(p: Path) -> bool:
    return (p / "config.json").is_file() and _has_weights(p)


@dataclass(frozen=True)
class Rule:
    """One format: the test on a directory, its name in messages and what marks it."""

    kind: Callable[[Path, int | str | None], str | None]  # the format it names, or None (no match)
    formats: tuple[str, ...]  # the formats `kind` may name
    what: str
    markers: str


def _when(test: Callable[[Path], bool], fmt: str) -> Callable[[Path, int | str | None], str | None]:
    return lambda p, it: fmt if test(p) else None


RULES: tuple[Rule, ...] = (
    Rule(lambda p, it: _megatron_kind(p, it) if _megatron_root(p) else None, ("megatron", "megatron-torch_dist"),
         "a Megatron checkpoint", f"{TRACKER}, iter_*/, release/, mp_rank_*/"),
    Rule(_when(_ft, "ft"), ("ft",), "a FasterTransformer directory", "config.ini"),
    Rule(_when(_onnx, "onnx"), ("onnx",), "an ONNX directory", "model.onnx"),
    Rule(_when(_trtllm, "trtllm"), ("trtllm",), "a TensorRT-LLM checkpoint", "rank*.safetensors"),
    Rule(_when(_hf, "hf"), ("hf",), "a HuggingFace directory", "config.json"),
)
CHECKPOINTS = ("hf", "megatron", "megatron-torch_dist")  # what the conversion verbs read
FORMATS = ("megatron", "megatron-torch_dist", "hf", "ft", "onnx", "trtllm", "gguf")  # what the validators run
FILE_FORMATS = {".onnx": "onnx", ".gguf": "gguf"}  # single-file formats, by suffix


def detect_format(path: str | Path, iteration: int | str | None = None,
                  accept: tuple[str, ...] = CHECKPOINTS) -> str:
    """The format at `path` (one of `accept`); one MConvertError naming the path otherwise: what it is when it
    is a format the caller does not take, or which markers are missing."""
    p = Path(path)
    if not p.exists():
        raise MConvertError(f"{p}: no such file or directory")
    if not p.is_dir():
        fmt = FILE_FORMATS.get(p.suffix)
        if fmt is not None and fmt in accept:
            return fmt
        raise MConvertError(f"{p}: a file, not a model directory; pass the directory that holds the model"
                            + (" (or a .gguf / .onnx file)" if "gguf" in accept else ""))
    for rule in RULES:
        fmt = rule.kind(p, iteration)
        if fmt is None:
            continue
        if fmt not in accept:
            takes = [r.what for r in RULES if set(r.formats) & set(accept)]
            listed = ", ".join(takes[:-1]) + f" or {takes[-1]}" if len(takes) > 1 else takes[0]
            raise MConvertError(f"{p}: {rule.what} ({fmt}); this reads {listed}")
        return fmt
    if "hf" in accept and (p / "config.json").is_file():
        raise MConvertError(f"{p}: config.json but no weights (*.safetensors, pytorch_model*.bin); re-copy the "
                            "model directory")
    markers = [r.markers for r in RULES if set(r.formats) & set(accept)]
    raise MConvertError(f"{p}: not a checkpoint (no {', '.join(markers[:-1])} or {markers[-1]})")
