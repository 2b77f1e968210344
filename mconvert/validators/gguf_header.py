"""A strict reader of a GGUF file's header: its key/value metadata and its tensor table, read through a
read-only mapping with every length, count and offset checked against the file's size before it is used.

gguf-py's `GGUFReader` trusts the counts a file states: an array whose count runs past the end of the file loops
without end (each item past the end reads as zero bytes) while its parts pile up in memory, and an array of a
few million one-byte items costs gigabytes. Here an array of scalars is skipped in one step, every count must fit
in the bytes left, and each tensor's data must lie inside the file, aligned, and apart from every other tensor's.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mconvert.io.paths import open_regular
from mconvert.errors import MConvertError

MAGIC = b"GGUF"
VERSIONS = (2, 3)  # what llama.cpp and gguf-py read
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
STRING, ARRAY = 8, 9
# GGUF value type -> (struct format, size) of its scalars
SCALARS: dict[int, tuple[str, int]] = {0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4),
                                       5: ("<i", 4), 6: ("<f", 4), 7: ("<B", 1), 10: ("<Q", 8), 11: ("<q", 8),
                                       12: ("<d", 8)}
TYPE_NAMES = {0: "UINT8", 1: "INT8", 2: "UINT16", 3: "INT16", 4: "UINT32", 5: "INT32", 6: "FLOAT32", 7: "BOOL",
              8: "STRING", 9: "ARRAY", 10: "UINT64", 11: "INT64", 12: "FLOAT64"}
FIX = "the file is truncated, damaged or crafted — re-create it with `mconvert hf-to-gguf` / `megatron-to-gguf`"


@dataclass(frozen=True)
class GgufArray:
    """An array value: its item type and length (the items themselves are not kept)."""

    item_type: int
    count: int


@dataclass(frozen=True)
class GgufTensor:
    name: str
    dims: tuple[int, ...]  # ggml order (ne[0] first: the row length)
    type_name: str  # GGMLQuantizationType name (F32, F16, BF16, Q8_0, ...)
    offset: int  # from the start of the data section
    nbytes: int


@dataclass
class GgufHeader:
    version: int
    fields: dict[str, Any] = field(default_factory=dict)  # scalars decoded; arrays as GgufArray
    types: dict[str, int] = field(default_factory=dict)  # key -> its GGUF value type
    tensors: list[GgufTensor] = field(default_factory=list)
    alignment: int = DEFAULT_ALIGNMENT
    data_start: int = 0


class _Cursor:
    def __init__(self, path: Path, buf: Any, size: int) -> None:
        self.path, self.buf, self.size, self.pos = path, buf, size, 0

    def fail(self, what: str) -> MConvertError:
        return MConvertError(f"{self.path}: not a readable GGUF file ({what}); {FIX}")

    def take(self, n: int, what: str) -> int:
        """The offset of the next `n` bytes, refused when fewer are left."""
        if n < 0 or n > self.size - self.pos:
            raise self.fail(f"{what} would take {n:,} bytes at offset {self.pos:,}, the file has {self.size - self.pos:,} "
                            "left")
        at = self.pos
        self.pos += n
        return at

    def scalar(self, vtype: int, what: str) -> Any:
        fmt, n = SCALARS[vtype]
        return struct.unpack_from(fmt, self.buf, self.take(n, what))[0]

    def u32(self, what: str) -> int:
        return self.scalar(4, what)

    def u64(self, what: str) -> int:
        return self.scalar(10, what)

    def string(self, what: str) -> str:
        n = self.u64(f"the length of {what}")
        at = self.take(n, what)
        try:
            return bytes(self.buf[at:at + n]).decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not UTF-8 text") from None

    def skip_string(self, what: str) -> None:
        self.take(self.u64(f"the length of {what}"), what)


def read_gguf_header(path: str | Path) -> GgufHeader:
    """The header of the GGUF file `path`; anything malformed is one MConvertError naming the file and the part."""
    p = Path(path)
    fd = open_regular(p)
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            raise MConvertError(f"{p}: empty file, not a GGUF model; {FIX}")
        with mmap.mmap(fd, size, access=mmap.ACCESS_READ) as buf:
            return _parse(_Cursor(p, buf, size))
    except OSError as e:
        raise MConvertError(f"{p}: cannot read ({e.strerror or e})") from None
    finally:
        os.close(fd)


def _parse(c: _Cursor) -> GgufHeader:
    if bytes(c.buf[c.take(4, "the magic"):4]) != MAGIC:
        raise c.fail("no GGUF magic at the start")
    version = c.u32("the version")
    if version not in VERSIONS:
        if int.from_bytes(version.to_bytes(4, "little"), "big") in VERSIONS:
            raise c.fail("a big-endian GGUF; llama.cpp on this machine reads little-endian files")
        raise c.fail(f"version {version}; llama.cpp reads versions {', '.join(map(str, VERSIONS))}")
    h = GgufHeader(version=version)
    n_tensors, n_kv = c.u64("the tensor count"), c.u64("the key/value count")
    # the smallest key/value (an empty key, its type, a one-byte value) and tensor entry (an empty name, a dim
    # count, its type, its offset): a count larger than the bytes left allow is refused before any loop
    if n_kv * 13 > c.size - c.pos:
        raise c.fail(f"{n_kv:,} key/value pairs cannot fit in the {c.size - c.pos:,} bytes left")
    for i in range(n_kv):
        key = c.string(f"the name of key/value {i}")
        if key in h.fields:
            raise c.fail(f"key {key!r} appears twice")
        vtype = c.u32(f"the type of {key!r}")
        h.types[key] = vtype
        h.fields[key] = _value(c, vtype, key)
    if n_tensors * 24 > c.size - c.pos:
        raise c.fail(f"{n_tensors:,} tensors cannot fit in the {c.size - c.pos:,} bytes left")
    infos = [_tensor_info(c, i) for i in range(n_tensors)]
    if "general.alignment" in h.fields:
        a = h.fields["general.alignment"]
        if h.types["general.alignment"] != 4 or a == 0 or a & (a - 1):
            raise c.fail(f"general.alignment {a!r} is not a UINT32 power of two")
        h.alignment = a
    h.data_start = -(-c.pos // h.alignment) * h.alignment
    h.tensors = _place(c, h, infos)
    return h


def _value(c: _Cursor, vtype: int, key: str) -> Any:
    if vtype == STRING:
        return c.string(f"the value of {key!r}")
    if vtype in SCALARS:
        v = c.scalar(vtype, f"the value of {key!r}")
        if vtype == 7:
            if v > 1:
                raise c.fail(f"{key!r} is a BOOL of value {v}")
            return bool(v)
        return v
    if vtype != ARRAY:
        raise c.fail(f"{key!r} has unknown value type {vtype}")
    itype = c.u32(f"the item type of {key!r}")
    count = c.u64(f"the length of {key!r}")
    left = c.size - c.pos
    if itype in SCALARS:
        c.take(count * SCALARS[itype][1], f"the {count:,} {TYPE_NAMES[itype]} items of {key!r}")
    elif itype == STRING:
        if count * 8 > left:
            raise c.fail(f"{key!r} claims {count:,} strings, more than the {left:,} bytes left hold")
        for j in range(count):
            c.skip_string(f"item {j} of {key!r}")
    else:  # llama.cpp reads no nested array either
        raise c.fail(f"{key!r} is an array of {TYPE_NAMES.get(itype, f'unknown type {itype}')}")
    return GgufArray(itype, count)


def _tensor_info(c: _Cursor, i: int) -> tuple[str, tuple[int, ...], int, int]:
    name = c.string(f"the name of tensor {i}")
    n_dims = c.u32(f"the dimension count of {name!r}")
    if not 1 <= n_dims <= MAX_DIMS:
        raise c.fail(f"tensor {name!r} has {n_dims} dimensions (1 to {MAX_DIMS})")
    dims = tuple(c.u64(f"dimension {d} of {name!r}") for d in range(n_dims))
    return name, dims, c.u32(f"the type of {name!r}"), c.u64(f"the offset of {name!r}")


def _place(c: _Cursor, h: GgufHeader, infos: list[tuple[str, tuple[int, ...], int, int]]) -> list[GgufTensor]:
    """Each tensor's byte range: a known ggml type, whole blocks per row, aligned, inside the file, and apart
    from every other tensor's."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType  # heavy optional import: only when a GGUF is read

    out: list[GgufTensor] = []
    seen: set[str] = set()
    for name, dims, ttype, offset in infos:
        if name in seen:
            raise c.fail(f"tensor {name!r} appears twice")
        seen.add(name)
        try:
            qtype = GGMLQuantizationType(ttype)
            block, type_size = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise c.fail(f"tensor {name!r} has unknown ggml type {ttype}") from None
        n = 1
        for d in dims:
            n *= d
        if n >= 1 << 62:
            raise c.fail(f"tensor {name!r} has dimensions {list(dims)}, too many elements")
        if dims[0] % block:
            raise c.fail(f"tensor {name!r} of type {qtype.name} has rows of {dims[0]} elements, not whole blocks "
                         f"of {block}")
        nbytes = n // block * type_size
        if offset % h.alignment:
            raise c.fail(f"tensor {name!r} starts at data offset {offset:,}, not a multiple of the alignment "
                         f"{h.alignment}")
        if h.data_start + offset + nbytes > c.size:
            raise c.fail(f"tensor {name!r} needs bytes {h.data_start + offset:,}+{nbytes:,}, past the end of the "
                         f"file ({c.size:,} bytes)")
        out.append(GgufTensor(name, dims, qtype.name, offset, nbytes))
    by_offset = sorted(out, key=lambda t: t.offset)
    for a, b in zip(by_offset, by_offset[1:]):
        if a.offset + a.nbytes > b.offset:
            raise c.fail(f"tensors {a.name!r} and {b.name!r} overlap (data offsets {a.offset:,}+{a.nbytes:,} and "
                         f"{b.offset:,})")
    return out
