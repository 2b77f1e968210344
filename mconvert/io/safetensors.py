"""The safetensors format, once: one header codec (`encode_header` / `decode_header`) and the files built on it.

A safetensors file is an 8-byte little-endian header length, a JSON header (padded with spaces to a multiple
of 8) mapping each tensor name to its dtype code, shape and `[begin, end)` offsets in the data section, then
the data. Writers plan the whole header before the first tensor arrives (names, dtypes and shapes follow from
ModelSpec), so memory stays one unit: `SafetensorsStream` writes the tensors in header order through a
`HashingFile`, `SafetensorsRandomWriter` takes them in any order through a `RandomDirectFile` (each rank file
of a TensorRT-LLM engine is filled as units arrive). `SafetensorsReader` preads one tensor at a time after the
checks safetensors' own loader makes (known dtypes, sizes that match the shapes, offsets that tile the data
section).
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from mconvert import dtypes
from mconvert.io import buffers
from mconvert.io.hashing import (
    DIRECT_MIN_BYTES,
    HashingFile,
    RandomDirectFile,
    numel,
    pread_into,
    tensor_bytes,
)
from mconvert.io.paths import open_regular, owned_fd
from mconvert.io.crc import followed_digest
from mconvert.io.casts import narrowed
from mconvert.errors import MConvertError

Entry = tuple[str, torch.dtype, tuple[int, ...]]  # (name, dtype, shape) of one planned tensor

MAX_HEADER_BYTES = 100 << 20  # a larger header is corruption, not a model


def nbytes(dtype: torch.dtype, shape: Iterable[int]) -> int:
    """The bytes a tensor of `dtype` and `shape` holds on disk; an `MConvertError` for a dtype no file stores."""
    row = dtypes.of_torch(dtype)
    if row is None:
        raise MConvertError(f"dtype {dtype} cannot be stored in safetensors")
    return numel(shape) * row.itemsize


def encode_header(entries: Iterable[Entry], metadata: dict[str, str] | None = None) -> tuple[bytes, dict[str, int]]:
    """The 8-byte length + JSON header of a file holding `entries` back to back in this order (8-aligned), and
    each entry's offset in the data section."""
    head: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offsets: dict[str, int] = {}
    off = 0
    for name, dtype, shape in entries:
        row = dtypes.of_torch(dtype)
        if row is None:
            raise MConvertError(f"{name}: dtype {dtype} cannot be stored in safetensors")
        n = numel(shape) * row.itemsize
        head[name] = {"dtype": row.safetensors, "shape": list(shape), "data_offsets": [off, off + n]}
        offsets[name] = off
        off += n
    raw = json.dumps(head, separators=(",", ":")).encode()
    raw += b" " * (-(len(raw) + 8) % 8)
    return struct.pack("<Q", len(raw)) + raw, offsets


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


def decode_header(prefix: bytes, read: Any, size: int) -> tuple[int, dict[str, Entry], dict[str, str]]:
    """Parse and check a header: `prefix` is the file's first 8 bytes, `read(n)` returns the n bytes after them,
    `size` is the file's size. Returns (start of the data section, name -> (offset, dtype, shape), metadata);
    a `ValueError` names what is wrong. Accepts what safetensors' own parser accepts: a shape is a list of JSON
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
    entries: dict[str, tuple[int, torch.dtype, tuple[int, ...]]] = {}
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
        entries[k] = (a, row.torch, shape)
        spans.append((a, b))
    pos = 0
    for a, b in sorted(spans):
        if a != pos:
            raise ValueError("tensor data offsets do not tile the data section")
        pos = b
    if start + pos != size:
        raise ValueError(f"data section holds {size - start} bytes, the header describes {pos}")
    return start, entries, metadata


class SafetensorsReader:
    """One safetensors file read tensor by tensor with pread into reused memory — not through a mapping of the
    whole file, whose touched pages would count in the resident set until unmapped."""

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
        self.digest = followed_digest(path)  # the input's manifest digest, fed with the bytes as they are read

    def keys(self) -> list[str]:
        return list(self.entries)

    def meta(self, key: str) -> torch.Tensor:
        """A meta-device tensor of `key`'s shape and dtype (no memory)."""
        _, dtype, shape = self.entries[key]
        return torch.empty(shape, dtype=dtype, device="meta")

    def get(self, key: str) -> torch.Tensor:
        """The tensor `key`, read with pread into pooled memory (`buffers.empty`)."""
        a, dtype, shape = self.entries[key]
        t = buffers.empty(shape, dtype)
        mv = memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b"")
        pread_into(self.fd, mv, self.start + a, self.path, key, digest=self.digest)
        return t

    def read_into(self, key: str, dst: torch.Tensor, start: int = 0) -> bool:
        """pread bytes [start, start + dst.nbytes) of tensor `key` straight into `dst` (contiguous, same dtype);
        False when `dst` cannot take them (then use `get`)."""
        a, dtype, shape = self.entries[key]
        n = dst.numel() * dst.element_size()
        if dtype != dst.dtype or not dst.is_contiguous() or start + n > numel(shape) * dst.element_size():
            return False
        mv = memoryview(dst.reshape(-1).view(torch.uint8).numpy()) if n else memoryview(b"")
        pread_into(self.fd, mv, self.start + a + start, self.path, key, digest=self.digest)
        return True

    def close(self) -> None:
        self._close()


class SafetensorsStream:
    """One safetensors file written in a planned order: header first, then each tensor as it arrives."""

    def __init__(self, path: str | Path, entries: list[Entry], metadata: dict[str, str] | None = None) -> None:
        self.path = Path(path)
        self.entries = list(entries)
        self.names = [e[0] for e in self.entries]
        self._next = 0
        head, _ = encode_header(self.entries, metadata)
        total = len(head) + sum(nbytes(e[1], e[2]) for e in self.entries)
        self._f = HashingFile(self.path, direct=total >= DIRECT_MIN_BYTES)
        self._f.write(head)

    def add(self, name: str, t: torch.Tensor) -> None:
        """Write the next tensor; it must be the one the header planned (name, dtype, shape)."""
        if self._next >= len(self.entries):
            raise MConvertError(f"{self.path}: tensor {name!r} arrived after the planned ones were all written")
        want, dtype, shape = self.entries[self._next]
        if name != want or t.dtype != dtype or tuple(t.shape) != tuple(shape):
            raise MConvertError(
                f"{self.path}: got {name!r} {t.dtype} {tuple(t.shape)} where {want!r} {dtype} {tuple(shape)} was "
                "planned from the model config; the checkpoint disagrees with its own config (pass --dtype if only "
                "the dtype differs)"
            )
        self._f.write(t)  # a strided view (GQA's q/k/v of a fused qkv) is copied on the writer's thread
        self._next += 1

    @property
    def next_name(self) -> str | None:
        """The name the next `add` must bring (None when every planned tensor is written)."""
        return self.names[self._next] if self._next < len(self.names) else None

    @property
    def complete(self) -> bool:
        return self._next == len(self.entries)

    def close(self) -> str:
        """Close and return the file's digest (the manifest's hash); every planned tensor must have been written."""
        digest = self._f.close()
        if not self.complete:
            raise MConvertError(f"internal: {self.path} closed after {self._next} of {len(self.entries)} tensors")
        return digest

    def abort(self) -> None:
        self._f.abort()


class SafetensorsRandomWriter:
    """A safetensors file whose header is written first, the tensors then in any order at their offsets
    (`RandomDirectFile`: O_DIRECT for files of `DIRECT_MIN_BYTES` and more).

    `close` refuses a file with a tensor never written (it would read as garbage) and returns the file's
    digest. `layout` names the plan in error messages (a tensor the plan does not hold is the caller's bug or
    a layout the format refuses)."""

    def __init__(self, path: Path, entries: list[Entry], metadata: dict[str, str] | None = None,
                 layout: str = "planned layout") -> None:
        self.path, self.layout = path, layout
        head, offsets = encode_header(entries, metadata)
        self._spans = {name: (offsets[name], dtype, tuple(shape)) for name, dtype, shape in entries}
        self._base = len(head)
        total = self._base + sum(nbytes(e[1], e[2]) for e in entries)
        self._f = RandomDirectFile(path, total, direct=total >= DIRECT_MIN_BYTES)
        try:
            self._f.write(head, 0)
        except BaseException:
            self._f.abort()
            raise
        self._todo = set(self._spans)

    def offset(self, name: str) -> int:
        """Where tensor `name`'s bytes begin in the file."""
        if name not in self._spans:
            raise MConvertError(f"{self.path.name}: tensor {name} is not in the {self.layout}")
        return self._base + self._spans[name][0]

    def write(self, name: str, x: torch.Tensor) -> None:
        """Write `x` (converted to the planned dtype) at `name`'s place, once."""
        if name not in self._spans:
            raise MConvertError(f"{self.path.name}: tensor {name} is not in the {self.layout}")
        if name not in self._todo:
            raise MConvertError(f"internal: {self.path.name}: tensor {name} written twice")
        off, dtype, shape = self._spans[name]
        if tuple(x.shape) != shape:
            raise MConvertError(f"{self.path.name}: {name} has shape {list(x.shape)}, layout says {list(shape)}")
        data = buffers.contiguous(narrowed(x.detach().cpu(), dtype, f"{self.path.name}: {name}"))
        self._f.write(tensor_bytes(data) if data.numel() else b"", self._base + off, keep=data)
        self._todo.discard(name)

    def close(self) -> str:
        """Finish the file and return its digest (the manifest's hash); a tensor never written is an error (a
        bug in the writer, not in the input)."""
        if self._todo:
            self._f.abort()
            raise MConvertError(f"internal: {self.path.name}: tensors never written: {sorted(self._todo)[:3]}")
        return self._f.close()

    def abort(self) -> None:
        """Close after a failure without judging the file: the failure in flight (disk full, a refusal) is the
        one to report, and the file is about to be removed with the rest of the output."""
        self._f.abort()
