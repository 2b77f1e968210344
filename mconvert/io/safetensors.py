"""The safetensors format, once: one header codec (`encode_header` here, `decode_header` and the opened file
`SafetensorsFile` in the torch-free `io/safetensors_arrays.py`) and the files built on it.

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
from mconvert.io.safetensors_arrays import SafetensorsFile
from mconvert.io.casts import narrowed
from mconvert.errors import MConvertError

Entry = tuple[str, torch.dtype, tuple[int, ...]]  # (name, dtype, shape) of one planned tensor



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


class SafetensorsReader(SafetensorsFile):
    """One safetensors file read tensor by tensor with pread into reused memory — not through a mapping of the
    whole file, whose touched pages would count in the resident set until unmapped."""

    def meta(self, key: str) -> torch.Tensor:
        """A meta-device tensor of `key`'s shape and dtype (no memory)."""
        _, row, shape = self.entries[key]
        return torch.empty(shape, dtype=row.torch, device="meta")

    def get(self, key: str) -> torch.Tensor:
        """The tensor `key`, read with pread into pooled memory (`buffers.empty`)."""
        a, row, shape = self.entries[key]
        t = buffers.empty(shape, row.torch)
        mv = memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b"")
        pread_into(self.fd, mv, self.start + a, self.path, key, digest=self.digest)
        return t

    def read_into(self, key: str, dst: torch.Tensor, start: int = 0) -> bool:
        """pread bytes [start, start + dst.nbytes) of tensor `key` straight into `dst` (contiguous, same dtype);
        False when `dst` cannot take them (then use `get`)."""
        a, row, shape = self.entries[key]
        n = dst.numel() * dst.element_size()
        if row.torch != dst.dtype or not dst.is_contiguous() or start + n > numel(shape) * dst.element_size():
            return False
        mv = memoryview(dst.reshape(-1).view(torch.uint8).numpy()) if n else memoryview(b"")
        pread_into(self.fd, mv, self.start + a + start, self.path, key, digest=self.digest)
        return True


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
