"""The one dtype table of mconvert: every element type a checkpoint may hold, under every name a format uses.

A row ties together the canonical name (torch's attribute name, what `ModelSpec.params_dtype` and HF's
`torch_dtype` say), the short names users type (`bf16`), the safetensors code, the numpy dtype (little-endian;
none for bfloat16, which numpy lacks) and the size of one element. Every reader and writer looks names up here,
so two formats cannot disagree about what `F16` or `fp16` means. torch is imported only when a torch dtype is
asked for, so `spec.py` and the validators can use the table without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from mconvert.errors import MConvertError

if TYPE_CHECKING:
    import numpy
    import torch


@dataclass(frozen=True)
class DType:
    """One element type: canonical name, the aliases users type, safetensors code, numpy code, bytes per element."""

    name: str
    aliases: tuple[str, ...]
    safetensors: str
    numpy: str | None
    itemsize: int
    floating: bool
    onnx: str  # ONNX TensorProto element type name; onnxruntime spells it `tensor(<lower-case>)`

    @property
    def torch(self) -> torch.dtype:
        import torch

        return getattr(torch, self.name)

    @property
    def np(self) -> numpy.dtype:
        """The numpy dtype (little-endian); a `KeyError` for types numpy cannot hold (bfloat16)."""
        import numpy

        if self.numpy is None:
            raise KeyError(f"{self.name} has no numpy dtype")
        return numpy.dtype(self.numpy)


TABLE: tuple[DType, ...] = (
    DType("float32", ("fp32",), "F32", "<f4", 4, True, "FLOAT"),
    DType("float16", ("fp16",), "F16", "<f2", 2, True, "FLOAT16"),
    DType("bfloat16", ("bf16",), "BF16", None, 2, True, "BFLOAT16"),
    DType("float64", ("fp64",), "F64", "<f8", 8, True, "DOUBLE"),
    DType("int64", ("i64",), "I64", "<i8", 8, False, "INT64"),
    DType("int32", ("i32",), "I32", "<i4", 4, False, "INT32"),
    DType("int16", ("i16",), "I16", "<i2", 2, False, "INT16"),
    DType("int8", ("i8",), "I8", "|i1", 1, False, "INT8"),
    DType("uint8", ("u8",), "U8", "|u1", 1, False, "UINT8"),
    DType("bool", (), "BOOL", "|b1", 1, False, "BOOL"),
)
# Stored only, never computed in: block-scaled FP8 weights (DeepSeek-V3's HF release), read dequantized with their
# scales (`convert/hf/fp8.py`) and written by `--fp8-blocks`; no `--dtype` names them and ONNX never holds them.
STORED_ONLY: tuple[DType, ...] = (
    DType("float8_e4m3fn", (), "F8_E4M3", None, 1, True, "FLOAT8E4M3FN"),
)

# The dtypes a model's weights may be converted to and computed in (`--dtype`, `params_dtype`).
PARAM_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")

_BY_NAME = {d.name: d for d in TABLE}
_BY_ALIAS = {**{a: d for d in TABLE for a in d.aliases}, **_BY_NAME}
_BY_CODE = {d.safetensors: d for d in TABLE + STORED_ONLY}
_BY_TORCH = {d.name: d for d in TABLE + STORED_ONLY}
_BY_ONNX = {d.onnx: d for d in TABLE}


def lookup(name: str) -> DType | None:
    """The row for a canonical name, an alias (`bf16`) or a torch spelling (`torch.bfloat16`); None if unknown."""
    return _BY_ALIAS.get(name.removeprefix("torch."))


def of_torch(dtype: torch.dtype) -> DType | None:
    """The row of a torch dtype (the stored-only float8_e4m3fn too); None for types no format here stores
    (complex, other float8 formats, ...)."""
    return _BY_TORCH.get(str(dtype).removeprefix("torch."))


def of_safetensors(code: str) -> DType | None:
    """The row of a safetensors dtype code (`"BF16"`, the stored-only `"F8_E4M3"`); None if mconvert does not read
    that code."""
    return _BY_CODE.get(code) if isinstance(code, str) else None


def of_onnx(elem_type: str) -> DType | None:
    """The row of an ONNX element type: a TensorProto name (`"FLOAT16"`) or onnxruntime's `"tensor(float16)"`."""
    if elem_type.startswith("tensor(") and elem_type.endswith(")"):
        elem_type = elem_type[7:-1].upper()
    return _BY_ONNX.get(elem_type)


def canonical(name: str) -> str:
    """`"bf16"` -> `"bfloat16"`; an unknown name comes back unchanged (callers refuse it in their own words)."""
    row = lookup(name)
    return row.name if row else name


def short_name(name: str) -> str:
    """`"bfloat16"` -> `"bf16"`: the name users type (the canonical name when there is no alias)."""
    row = lookup(name)
    return row.aliases[0] if row and row.aliases else name


def choices(allowed: tuple[str, ...] = PARAM_DTYPES, auto: bool = True) -> list[str]:
    """The `--dtype` words of a verb writing the `allowed` dtypes: `auto` (keep the source's) first when it may."""
    return (["auto"] if auto else []) + [short_name(n) for n in allowed]


def choose(name: str, allowed: tuple[str, ...] = PARAM_DTYPES, auto: bool = True, why: str = "") -> str:
    """The canonical dtype of `--dtype NAME` (or `"auto"`) for a verb that writes the `allowed` dtypes; anything
    else is one MConvertError listing the verb's choices (and `why` it has no more)."""
    key = name.lower()
    if auto and key == "auto":
        return "auto"
    row = _BY_ALIAS.get(key)  # torch spellings are not --dtype words
    if row is None or row.name not in allowed:
        words = choices(allowed, auto)
        listed = ", ".join(words[:-1]) + f" or {words[-1]}" if len(words) > 1 else words[0]
        raise MConvertError(f"--dtype {name!r}: choose {listed}" + (f" ({why})" if why else ""))
    return row.name
