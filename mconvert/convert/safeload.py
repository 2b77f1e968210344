"""The only way mconvert opens a pickle-based checkpoint: weights-only, memory-mapped, one allow-list.

`torch.load(weights_only=True)` refuses every global not on the list; this module lists exactly the
ones Megatron-LM checkpoints carry (args Namespace, enums, numpy RNG state, io.BytesIO in TE extra
state) and stands in for classes whose modules are not installed. Anything else is refused by name.
Never `weights_only=False`.
"""

from __future__ import annotations

import argparse
import io
import types
from pathlib import Path
from typing import Any

import torch

from mconvert.errors import MConvertError


class StandIn:
    """Stand-in for a class from a module that is not installed (Megatron's enums): keeps the args."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args
        self.kwargs = kwargs

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __repr__(self) -> str:
        return f"{type(self).__name__}{self.args}"


def _stand_in(qualname: str) -> tuple[type, str]:
    cls = type(qualname.rsplit(".", 1)[1], (StandIn,), {"__module__": qualname.rsplit(".", 1)[0]})
    return (cls, qualname)


def _numpy_globals() -> dict[str, Any]:
    import numpy as np

    out: dict[str, Any] = {"numpy.ndarray": np.ndarray, "numpy.dtype": np.dtype}
    for mod in ("numpy.core.multiarray", "numpy._core.multiarray"):
        out[f"{mod}._reconstruct"] = (np._core.multiarray._reconstruct, f"{mod}._reconstruct")
        out[f"{mod}.scalar"] = (np._core.multiarray.scalar, f"{mod}.scalar")
    for name in dir(np.dtypes):
        if name.endswith("DType"):
            out[f"numpy.dtypes.{name}"] = getattr(np.dtypes, name)
    return out


# Megatron-LM / megatron-core enums seen in `args` and in saved state.
_MEGATRON_STAND_INS = (
    "megatron.core.enums.ModelType",
    "megatron.core.transformer.enums.AttnBackend",
    "megatron.core.transformer.enums.AttnMaskType",
    "megatron.core.transformer.enums.AttnType",
    "megatron.core.transformer.enums.LayerType",
    "megatron.core.enums.Fp8Recipe",
    "megatron.core.transformer.enums.CudaGraphScope",
    "megatron.model.enums.AttnMaskType",
    "megatron.model.enums.LayerType",
    "megatron.model.enums.AttnType",
    "megatron.model.enums.PositionEmbeddingType",
)


def _allow_list() -> dict[str, Any]:
    allow: dict[str, Any] = {
        "argparse.Namespace": argparse.Namespace,
        "types.SimpleNamespace": types.SimpleNamespace,
        "_io.BytesIO": io.BytesIO,
        "io.BytesIO": io.BytesIO,
        "builtins.set": set,
        "builtins.frozenset": frozenset,
    }
    allow.update(_numpy_globals())
    for q in _MEGATRON_STAND_INS:
        allow[q] = _stand_in(q)
    return allow


ALLOW_LIST = _allow_list()


def safe_load(path: str | Path, what: str = "checkpoint") -> Any:
    """Load a torch pickle weights-only (mmap when possible). One-line MConvertError on anything unsafe or broken."""
    path = Path(path)
    if not path.is_file():
        raise MConvertError(f"{path}: {what} file not found")
    try:
        needed = torch.serialization.get_unsafe_globals_in_checkpoint(str(path))
    except Exception as e:  # not a zip file, truncated central directory, ...
        raise MConvertError(
            f"{path}: not a readable torch checkpoint ({_short(e)}); the file is truncated or corrupt — re-copy it"
        ) from None
    refused = [g for g in needed if g not in ALLOW_LIST]
    if refused:
        raise MConvertError(
            f"{path}: refuses to unpickle global {refused[0]!r} (not on mconvert's allow-list); "
            "this file may run code when loaded — do not load it with weights_only=False"
        )
    try:
        # the whole list: classes built inside a REDUCE (numpy dtypes) are not reported by the scan
        with torch.serialization.safe_globals(list(ALLOW_LIST.values())):
            try:
                return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as e:
                if "mmap" not in str(e):
                    raise
                return torch.load(path, map_location="cpu", weights_only=True)
    except MConvertError:
        raise
    except Exception as e:
        raise MConvertError(
            f"{path}: cannot load {what} ({_short(e)}); the file is truncated or corrupt"
        ) from None


def _short(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0][:200]}" if msg else type(e).__name__
