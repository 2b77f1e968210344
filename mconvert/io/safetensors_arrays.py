"""The safetensors header's reading half (`decode_header`, the checks safetensors' own loader makes) and
`SafetensorsFile`, a file opened and its header checked, the base of both readers; `SafetensorsArrays`, a file
read tensor by tensor as numpy arrays: what a conversion that needs no torch (HF to GGUF) reads through. `io/safetensors.py` holds the writers and the torch reader on the same codec."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from mconvert import dtypes
from mconvert.dtypes import DType
from mconvert.errors import MConvertError
from mconvert.io import buffers
from mconvert.io.crc import followed_digest
from mconvert.io.hashing import pread_into
from mconvert.io.paths import open_regular, owned_fd

MAX_HEADER_BYTES = 100 << 20  # a larger header is corruption, not a model
# bfloat16, which numpy lacks, is read as its raw bits
BF16_BITS = np.dtype(np.uint16)


_MAX_SIZE = (1 << 63) - 1  # safetensors reads sizes as usize; torch holds them as int64


def _shown(x: Any) -> str:
    """A JSON value as a short phrase for an error line."""
    if x is None or isinstance(x, (bool, int, float)):
        return json.dumps(x)[:40]
    return repr(x[:20]) if isinstance(x, str) else ("a list" if isinstance(x, list) else "an object")


def _size(x: Any, what: str) -> int:
    """`x` as safetensors reads a size (usize): a JSON integer >= 0, never a bool, a fraction or a string."""
    if type(x) is not int or not 0 <= x <= _MAX_SIZE:
        raise ValueError(f"{what} is {_shown(x)}, not a non-negative JSON integer")
    return x


def decode_header(prefix: bytes, read: Any, size: int) -> tuple[int, dict[str, tuple[int, DType, tuple[int, ...]]],
                                                               dict[str, str]]:
    """Parse and check a header: `prefix` is the file's first 8 bytes, `read(n)` returns the n bytes after them,
    `size` is the file's size. Returns (start of the data section, name -> (offset, dtype, shape), metadata);
    a `ValueError` names what is wrong. Each entry's dtype is its row of `mconvert.dtypes`. Accepts what safetensors' own parser accepts: a shape is a list of JSON
    integers >= 0, `data_offsets` two of them, `__metadata__` null or an object of strings."""
    (n,) = struct.unpack("<Q", prefix)
    if n > min(size - 8, MAX_HEADER_BYTES):
        raise ValueError(f"header length {n} exceeds the file")
    try:
        head = json.loads(read(n))
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None
    if not isinstance(head, dict):
        raise ValueError("header is not a JSON object")
    start = 8 + n
    entries: dict[str, tuple[int, DType, tuple[int, ...]]] = {}
    metadata: dict[str, str] = {}
    spans = []
    for k, v in head.items():
        if k == "__metadata__":
            if v is not None and (not isinstance(v, dict) or not all(isinstance(x, str) for x in v.values())):
                raise ValueError("__metadata__ is not an object of strings")
            metadata = v or {}
            continue
        if not isinstance(v, dict):
            raise ValueError(f"tensor {k!r}: entry is {_shown(v)}, not an object")
        for field in ("dtype", "shape", "data_offsets"):
            if field not in v:
                raise ValueError(f"tensor {k!r}: no {field!r}")
        dt = v["dtype"]
        row = dtypes.of_safetensors(dt) if isinstance(dt, str) else None
        if row is None:
            raise ValueError(f"tensor {k!r}: unknown dtype {_shown(dt)}")
        shp, offs = v["shape"], v["data_offsets"]
        if not isinstance(shp, list):
            raise ValueError(f"tensor {k!r}: shape is {_shown(shp)}, not a list")
        if not isinstance(offs, list) or len(offs) != 2:
            raise ValueError(f"tensor {k!r}: data_offsets is {_shown(offs)}, not a [begin, end] pair")
        shape = tuple(_size(d, f"tensor {k!r}: a shape entry") for d in shp)
        a, b = (_size(x, f"tensor {k!r}: a data_offsets entry") for x in offs)
        count = 1
        for d in shape:  # as safetensors: the running product must fit
            count *= d
            if count > _MAX_SIZE:
                raise ValueError(f"tensor {k!r}: shape {list(shape)} overflows")
        if b - a != count * row.itemsize:
            raise ValueError(f"tensor {k!r}: {b - a} bytes for shape {list(shape)} {dt}")
        entries[k] = (a, row, shape)
        spans.append((a, b))
    pos = 0
    for a, b in sorted(spans):
        if a != pos:
            raise ValueError("tensor data offsets do not tile the data section")
        pos = b
    if start + pos != size:
        raise ValueError(f"data section holds {size - start} bytes, the header describes {pos}")
    return start, entries, metadata


class Meta(NamedTuple):
    """A tensor's shape and dtype row, from its header entry (no data)."""

    shape: tuple[int, ...]
    dtype: DType


def array_dtype(row: DType) -> np.dtype:
    """The numpy dtype a tensor of `row` is read as: its own, bfloat16 as its raw bits (`BF16_BITS`); raw bytes
    for a type numpy lacks."""
    if row.name == "bfloat16":
        return BF16_BITS
    return row.np if row.numpy is not None else np.dtype(np.uint8)


class SafetensorsFile:
    """One safetensors file opened (`open_regular`, the descriptor closed with its owner) and its header checked
    (`decode_header`): `start` of the data section, `entries` (name -> (offset, dtype row, shape)), `metadata`,
    and `digest`, the input's manifest digest fed with the bytes as they are read. The readers build on it:
    `SafetensorsArrays` reads numpy arrays, `io/safetensors.py`'s `SafetensorsReader` torch tensors."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = open_regular(path)
        self._close = owned_fd(self, self.fd)
        size = os.fstat(self.fd).st_size
        try:
            self.start, self.entries, self.metadata = decode_header(
                os.pread(self.fd, 8, 0), lambda n: os.pread(self.fd, n, 8), size)
        except (ValueError, KeyError, TypeError, struct.error) as e:
            self._close()
            raise MConvertError(f"{path}: unreadable safetensors file ({str(e)[:120]}); it is truncated or corrupt "
                                "— re-copy it") from None
        self.digest = followed_digest(path)

    def keys(self) -> list[str]:
        return list(self.entries)

    def close(self) -> None:
        self._close()


class SafetensorsArrays(SafetensorsFile):
    """One safetensors file read tensor by tensor with pread into numpy arrays over reused memory
    (`buffers.array`: a slot goes back when the last view of it, a writer's queued bytes included, is freed)."""

    def meta(self, key: str) -> Meta:
        _, row, shape = self.entries[key]
        return Meta(shape, row)

    def get(self, key: str) -> np.ndarray:
        """Tensor `key` as an array of its shape (`array_dtype`)."""
        a, row, shape = self.entries[key]
        dt = array_dtype(row)
        out = buffers.array(shape if dt.itemsize == row.itemsize else (*shape, row.itemsize), dt)
        if out.size:
            pread_into(self.fd, memoryview(out.reshape(-1).view(np.uint8)), self.start + a, self.path, key,
                       digest=self.digest)
        return out
