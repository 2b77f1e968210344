"""The GGUF byte format (version 3), written front to back through the aligned hashing writer.

A GGUF file is: the magic `GGUF`, the version, the tensor count and the key-value count (u32, u32, u64, u64,
little-endian); each key-value (the key as a string, its value type as u32, the value); each tensor's info (name,
dimension count u32, the dimensions innermost first as u64, the ggml type u32, the data offset u64 from the start
of the data section); then the data section, which starts at the next multiple of the alignment
(`general.alignment`, else 32) and holds each tensor's bytes padded with zeros to that alignment. A string is its
UTF-8 length (u64) and bytes; an array its element type (u32), count (u64) and elements. This is the layout of
gguf-py's `GGUFWriter` (llama.cpp's writer, `gguf_writer.py` / `constants.py`) and of llama.cpp's `gguf.cpp`
reader.

Nothing here knows a model family: the caller hands the key-values, the tensor infos in file order, then each
tensor's bytes in that order (`GgufFile.write`). The bytes go through `HashingFile` (O_DIRECT for large files,
the manifest's hash taken on the way), so the file is never read back for its manifest.
"""

from __future__ import annotations

import math
import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mconvert.errors import MConvertError
from mconvert.io import buffers
from mconvert.io.atomic import record_digest
from mconvert.io.hashing import DIRECT_MIN_BYTES, HashingFile, RandomDirectFile

MAGIC = 0x46554747  # "GGUF" read as a little-endian u32
VERSION = 3
DEFAULT_ALIGNMENT = 32
ALIGNMENT_KEY = "general.alignment"

# value types (gguf-py's GGUFValueType)
UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY, UINT64, INT64, FLOAT64 = range(13)
_SCALAR = {UINT8: "B", INT8: "b", UINT16: "H", INT16: "h", UINT32: "I", INT32: "i", FLOAT32: "f", BOOL: "?",
           UINT64: "Q", INT64: "q", FLOAT64: "d"}

# ggml types written here -> (elements per block, bytes per block) (ggml.h's ggml_type, gguf-py's GGML_QUANT_SIZES)
F32, F16, Q8_0, BF16 = 0, 1, 8, 30
BLOCKS = {F32: (1, 4), F16: (1, 2), Q8_0: (32, 34), BF16: (1, 2)}
Q8_BLOCK = 32
# bfloat16, which numpy lacks, travels as its raw bits: the one unsigned 16-bit type a weight arrives in
BF16_BITS = np.dtype(np.uint16)
F16_MAX = 65504.0
F16_OVERFLOW = 65520.0  # the smallest magnitude IEEE round-to-nearest-even takes to float16's Inf


@dataclass(frozen=True)
class KeyValue:
    """One metadata entry: its value type and, for an array, its element type (None: from the first element,
    as gguf-py's `GGUFValueType.get_type` reads a Python value)."""

    key: str
    value: Any
    type: int
    sub_type: int | None = None


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the file: its name, shape in row-major (torch) order and ggml type."""

    name: str
    shape: tuple[int, ...]
    type: int

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.shape, self.type)


def tensor_nbytes(shape: Sequence[int], ggml_type: int) -> int:
    """The bytes of a tensor of `shape` (row-major) in `ggml_type`: whole blocks along the last dimension."""
    if ggml_type not in BLOCKS:
        raise MConvertError(f"ggml type {ggml_type} is not written here (F32, F16, BF16, Q8_0 are)")
    block, size = BLOCKS[ggml_type]
    if shape and shape[-1] % block:
        raise MConvertError(f"a {list(shape)} tensor has rows of {shape[-1]}, not whole {block}-element blocks")
    return math.prod(shape[:-1]) * (shape[-1] // block if shape else 1) * size


def pad_to(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


def _string(s: str | bytes) -> bytes:
    b = s.encode("utf-8") if isinstance(s, str) else bytes(s)
    return struct.pack("<Q", len(b)) + b


def _class_type(cls: type) -> int:
    # the order matters: bool is an int in Python
    if issubclass(cls, (str, bytes, bytearray)):
        return STRING
    if issubclass(cls, list):
        return ARRAY
    if issubclass(cls, float):
        return FLOAT32
    if issubclass(cls, bool):
        return BOOL
    if issubclass(cls, int):
        return INT32
    raise MConvertError(f"GGUF metadata: a value of type {cls.__name__} has no GGUF type")


def _element_type(v: Any) -> int:
    return _class_type(type(v))


def encode_value(value: Any, vtype: int, sub_type: int | None = None) -> bytes:
    """A value's bytes (without its type tag)."""
    fmt = _SCALAR.get(vtype)
    if fmt is not None:
        return struct.pack("<" + fmt, value)
    if vtype == STRING:
        return _string(value)
    if vtype != ARRAY:
        raise MConvertError(f"GGUF metadata: value type {vtype} unknown")
    if not isinstance(value, (Sequence, bytes)) or isinstance(value, str) or not len(value):
        raise MConvertError("GGUF metadata: an array must be a non-empty sequence")
    elt = sub_type if sub_type is not None else UINT8 if isinstance(value, bytes) else _element_type(value[0])
    if sub_type is None and not isinstance(value, bytes) and {_class_type(c) for c in set(map(type, value))} != {elt}:
        raise MConvertError("GGUF metadata: the elements of an array must have one type")
    head = struct.pack("<IQ", elt, len(value))
    fmt = _SCALAR.get(elt)
    if fmt is not None:
        return head + struct.pack(f"<{len(value)}{fmt}", *value)
    if elt == STRING:
        return head + b"".join(_string(v) for v in value)
    return head + b"".join(encode_value(v, elt) for v in value)


def encode_header(kvs: Sequence[KeyValue], tensors: Sequence[TensorInfo], alignment: int) -> bytes:
    """Everything before the data section: magic, version, counts, key-values, tensor infos (offsets padded to
    `alignment`)."""
    out = [struct.pack("<IIQQ", MAGIC, VERSION, len(tensors), len(kvs))]
    seen: set[str] = set()
    for kv in kvs:
        if kv.key in seen:
            raise MConvertError(f"GGUF metadata: key {kv.key!r} twice")
        seen.add(kv.key)
        out += [_string(kv.key), struct.pack("<I", kv.type), encode_value(kv.value, kv.type, kv.sub_type)]
    offset = 0
    names: set[str] = set()
    for t in tensors:
        if t.name in names:
            raise MConvertError(f"GGUF: tensor {t.name!r} twice")
        names.add(t.name)
        dims = tuple(reversed(t.shape))
        out += [_string(t.name), struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, t.type, offset)]
        offset += pad_to(t.nbytes, alignment)
    return b"".join(out)


def alignment_of(kvs: Sequence[KeyValue]) -> int:
    """The data alignment a reader takes from these key-values: `general.alignment`, else 32."""
    a = next((kv.value for kv in kvs if kv.key == ALIGNMENT_KEY), DEFAULT_ALIGNMENT)
    if not isinstance(a, int) or a <= 0 or a % 8:
        raise MConvertError(f"GGUF metadata: {ALIGNMENT_KEY} {a!r} is not a positive multiple of 8")
    return a


class GgufFile:
    """A GGUF file written in one pass: the header at open, then each tensor's bytes (`write`) in the order of
    `tensors`; `close` checks all were written and records the manifest digest taken while writing.

    `positional`: the tensors are written at their offsets in any order, a tensor in pieces (`write_at`: an
    expert's slice of the experts stacked in one tensor), through a `RandomDirectFile`; its digest follows the
    writes made in file order and reads back only what came ahead of them, as soon as the bytes before it are
    all written."""

    def __init__(self, path: str | Path, kvs: Sequence[KeyValue], tensors: Sequence[TensorInfo],
                 positional: bool = False) -> None:
        self.path = Path(path)
        self.tensors = list(tensors)
        self.alignment = alignment_of(kvs)
        head = encode_header(kvs, self.tensors, self.alignment)
        data = sum(pad_to(t.nbytes, self.alignment) for t in self.tensors)
        self.size = (pad_to(len(head), self.alignment) if self.tensors else len(head)) + data
        self._next = 0
        self.positional = positional
        if not positional:
            self._f: Any = HashingFile(self.path, direct=self.size >= DIRECT_MIN_BYTES)
            self._f.write(head + bytes(self.size - data - len(head)))
            return
        self._f = RandomDirectFile(self.path, self.size, direct=self.size >= DIRECT_MIN_BYTES)
        self._f.write(head + bytes(self.size - data - len(head)), 0)
        self.offsets: list[int] = []  # each tensor's first byte in the file
        at = self.size - data
        for t in self.tensors:
            self.offsets.append(at)
            pad = pad_to(t.nbytes, self.alignment) - t.nbytes
            if pad:
                self._f.write(bytes(pad), at + t.nbytes)
            at += t.nbytes + pad
        self._filled = [0] * len(self.tensors)  # bytes of each tensor written so far
        self._reach = 0  # the end of the furthest write made ahead of the tensors written whole in file order

    def write_at(self, index: int, data: np.ndarray | bytes | memoryview, at: int = 0) -> None:
        """(positional) Bytes [at, at + n) of tensor `index` (an array as its row-major bytes, kept alive until
        written, not copied). Once the tensors before a point are all whole, the digest is taken up to it."""
        if not self.positional:  # front to back: the next tensor, whole
            if index != self._next or at:
                raise MConvertError(f"internal: {self.path}: tensor {self.tensors[index].name} written out of order")
            self.write(data)
            return
        t = self.tensors[index]
        if isinstance(data, np.ndarray):
            data = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        n = memoryview(data).nbytes
        if at < 0 or at + n > t.nbytes:
            raise MConvertError(f"{self.path}: tensor {t.name}: bytes [{at}, {at + n}) outside its {t.nbytes}")
        if index > self._next or at != self._filled[index]:  # ahead of the bytes written in file order
            self._reach = max(self._reach, self.offsets[index] + at + n)
        self._f.write(data, self.offsets[index] + at, keep=data)
        self._filled[index] += n
        if self._filled[index] == t.nbytes and index == self._next:
            while self._next < len(self.tensors) and self._filled[self._next] == self.tensors[self._next].nbytes:
                self._next += 1
            end = self.offsets[self._next] if self._next < len(self.tensors) else self.size
            if self._reach > self.offsets[index]:  # bytes came ahead of this tensor: the digest may wait on them
                self._f.catch_up(end)

    def write(self, data: np.ndarray | bytes | memoryview) -> None:
        """The next tensor's bytes (an array as its row-major bytes), then its padding. The array is kept alive
        until written, not copied."""
        if self.positional:
            self.write_at(self._next, data)
            return
        if self._next >= len(self.tensors):
            raise MConvertError(f"{self.path}: more tensors written than the {len(self.tensors)} planned")
        t = self.tensors[self._next]
        if isinstance(data, np.ndarray):
            data = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        n = memoryview(data).nbytes
        if n != t.nbytes:
            raise MConvertError(f"{self.path}: tensor {t.name}: {n} bytes, its info says {t.nbytes}")
        self._f.write(data)
        pad = pad_to(n, self.alignment) - n
        if pad:
            self._f.write(bytes(pad))
        self._next += 1

    def drain(self) -> None:
        """Wait until every byte handed to `write` so far is in the file (see `HashingFile.drain`)."""
        self._f.drain()

    def close(self) -> str:
        """Finish the file (every planned tensor written) and record its digest for the manifest."""
        if self._next != len(self.tensors):
            self._f.abort()
            raise MConvertError(f"{self.path}: tensor {self.tensors[self._next].name} was never written")
        digest = self._f.close()
        record_digest(self.path, digest, self._f.algorithm)
        return digest

    def abort(self) -> None:
        self._f.abort()


Q8_SLICE = 1 << 17  # values quantized at once: the working buffers stay in cache, the calls per slice few


def cast(x: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """`x.astype(dtype)` (IEEE round-to-nearest-even, as gguf-py's) into reused memory (`buffers.array`)."""
    out = buffers.array(x.shape, dtype)
    np.copyto(out, x, casting="unsafe")
    return out


def to_float32(x: np.ndarray, name: str = "tensor", fix: str = "no GGUF type holds them; rescale the model") -> np.ndarray:
    """`x` (float16, float32, or bfloat16 bits) as float32, exactly; a float32 array as it is; float64 rounded,
    refused where a finite value would become Inf."""
    if x.dtype == np.float32:
        return x
    if x.dtype == BF16_BITS:  # a bfloat16 is the top half of the float32 of the same value
        out = buffers.array(x.shape, np.dtype(np.float32))
        bits = out.view(np.uint32)
        bits[...] = x
        bits <<= 16
        return out
    if x.dtype == np.float64:
        with np.errstate(over="ignore"):  # an overflow is refused below, by name
            out = x.astype(np.float32)
        if out.size and not (np.isfinite(out.min()) and np.isfinite(out.max())):
            raise MConvertError(f"{name}: holds values up to {float(np.abs(x).max()):.6g}, beyond what float32 holds, "
                                f"so they would be stored as Inf; {fix}")
        return out
    if x.dtype != np.float16:
        raise MConvertError(f"{name}: a {x.dtype} tensor has no GGUF form here (float16, bfloat16, float32 and "
                            "float64 are read)")
    return widen_half(x.view(np.uint16), buffers.array(x.shape, np.dtype(np.float32)))


def to_float16(x: np.ndarray, name: str, fix: str) -> np.ndarray:
    """`x` as float16, rounded to nearest even as gguf-py's `astype` (a float16 array as it is), refused where
    a finite value would become Inf: one line naming the tensor, its largest magnitude and `fix`."""
    if x.dtype == np.float16:
        return x
    f = to_float32(x, name, fix)
    if f.size:
        big = max(-float(f.min()), float(f.max()))
        if big >= F16_OVERFLOW:
            raise MConvertError(f"{name}: holds values up to {big:.6g}, beyond what float16 holds (±{F16_MAX:g}), "
                                f"so they would be stored as Inf; {fix}")
    return cast(f, np.dtype(np.float16))


def widen_half(bits: np.ndarray, out: np.ndarray, sign: np.ndarray | None = None) -> np.ndarray:
    """float16 values (their raw bits) as float32 into `out` (same shape), exactly as numpy's cast, for every
    finite value (subnormals included): the exponent and mantissa moved to float32's places, rescaled by
    2^(127 - 15), the sign put back. Integer steps and one multiply, each vectorised, where numpy's own half
    cast is a scalar loop. `sign`: a uint32 working buffer of `out`'s shape (else one is allocated)."""
    b = out.view(np.uint32)
    b[...] = bits
    sign = np.bitwise_and(b, 0x8000, out=sign)
    np.bitwise_and(b, 0x7FFF, out=b)
    np.left_shift(b, 13, out=b)
    out *= np.float32(2.0 ** 112)
    np.left_shift(sign, 16, out=sign)
    np.bitwise_or(b, sign, out=b)
    return out


# ggml's roundf on a float32 magnitude v < 2^23, in float32 steps: trunc(v + the largest float32 below 1/2). The
# sum rounds to nearest even; that nudge below 1/2 (2^-25) is under half a unit in the last place of every sum of
# 1 and more, so a fraction of 1/2 and more reaches the next integer and one below 1/2 stays under it, never
# rounded up to it (v + 1/2 in float32 would take 0.49999997 to 1)
ROUND_NUDGE = np.float32(np.nextafter(np.float32(0.5), np.float32(0)))


class _Q8Work:
    """One quantization's working buffers, for slices of up to `size` values (whole 32-blocks), each reused
    once its step is done so that a slice's working set stays small: the block maxima fold where the values
    and the spread 1/scales go next; the int8 values and their signs go where the 1/scales were spread."""

    def __init__(self, size: int, bits: np.dtype) -> None:
        self.mag = np.empty(size, dtype=bits)
        floats = np.empty(2 * size, dtype=np.float32)
        self.values, self.inv_full = floats[:size], floats[size:]
        fold = floats.view(np.uint8)
        n = size * bits.itemsize
        self.fold_a, self.fold_b = fold[:n].view(bits), fold[n:2 * n].view(bits)
        rest = self.inv_full.view(np.uint8)
        self.q, self.sign = rest[:size], rest[size:2 * size].view(np.int8)
        k = size // Q8_BLOCK
        self.top, self.d, self.inv = np.empty(k, dtype=np.uint32), *(np.empty(k, dtype=np.float32) for _ in range(2))
        self.f32: np.ndarray | None = None  # a wider source's float32 values (float64)


_WORK = threading.local()  # each converting thread's `_Q8Work`s, by (values, bits dtype)


def _q8_work(size: int, bits: np.dtype) -> _Q8Work:
    """This thread's working buffers for slices of `size` values, kept for its next tensor of the same slice
    size: new ones would be fresh pages (a page fault each) for every tensor."""
    cache = getattr(_WORK, "by_size", None)
    if cache is None:
        cache = _WORK.by_size = {}
    w = cache.get((size, bits))
    if w is None:
        if len(cache) >= 4:  # a few slice sizes in turn (a model's row widths), not one per tensor
            cache.clear()
        w = cache[(size, bits)] = _Q8Work(size, bits)
    return w


def block_maxima(mag: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Each 32-block's largest element of the flat contiguous `mag` (a view, one per block): the running maximum
    of 2, 4, ... 32 neighbours, each step one contiguous elementwise pass (a 32-wide reduction per block would be
    one short loop per block); `a`, `b`: working buffers of `mag`'s size, never overlapping the pass they feed."""
    n = mag.size
    np.maximum(mag[:n - 1], mag[1:], out=a[:n - 1])
    src, dst, span = a, b, 2
    for width in (2, 4, 8, 16):
        live = n - 2 * width + 1  # positions whose window of 2 * width lies inside the slice
        np.maximum(src[:live], src[width:live + width], out=dst[:live])
        src, dst, span = dst, src, 2 * width
    return src[:n - span + 1:Q8_BLOCK]


def quantize_q8_0(x: np.ndarray, rows: int | None = None, name: str = "tensor",
                  fix: str = "write --outtype bf16 or f32") -> np.ndarray:
    """`x` (float16, float32 or bfloat16 bits; last dimension whole 32-blocks) as q8_0 blocks (a float16 scale,
    its largest magnitude / 127, then 32 int8 values rounded half away from zero), bit for bit what ggml's
    `quantize_row_q8_0_ref` and gguf-py's `Q8_0.quantize_blocks` compute on its float32 values. `rows` rows at a
    time (by default about `Q8_SLICE` values) through the same working buffers, every step in place.

    Each step is one contiguous elementwise pass where it can be: a finite IEEE float's magnitude orders as
    its bits with the sign cleared, read as an unsigned integer, so each block's largest magnitude is found on
    those bits (`block_maxima`) and only that one per block is widened; the values are quantized as
    magnitudes (a float16 magnitude widened exactly: its bits moved to float32's places, times 2^(127 - 15)),
    times the block's 1/scale spread over its 32 values, rounded (`ROUND_NUDGE`) and cast to integers; the
    sign goes back on the int8 values (two's complement: (q xor s) - s, s = 0 or -1 from the sign bit), as
    roundf(-v) = -roundf(v). A scale beyond float16's range (it would be stored as Inf; a NaN or Inf value
    among them) is refused, naming the tensor and `fix`."""
    n = x.shape[-1]
    if n % Q8_BLOCK:
        raise MConvertError(f"a {list(x.shape)} tensor has rows of {n}, not whole q8_0 blocks")
    rows = rows or max(1, Q8_SLICE // n)
    flat = x.reshape(-1, n)
    per_row = n // Q8_BLOCK
    out = buffers.array((flat.shape[0] * per_row, 2 + Q8_BLOCK), np.dtype(np.uint8))
    half = x.dtype in (np.float16, BF16_BITS)
    work = _q8_work(min(rows, flat.shape[0]) * n, np.dtype(np.uint16 if half else np.uint32))
    for a in range(0, flat.shape[0], rows):
        src = flat[a:a + rows]
        _quantize_slice(src, out[a * per_row:(a + src.shape[0]) * per_row], work, name, fix)
    return out.reshape(*x.shape[:-1], per_row * (2 + Q8_BLOCK))


def _quantize_slice(src: np.ndarray, blk: np.ndarray, w: _Q8Work, name: str, fix: str) -> None:
    """`src` (whole rows) quantized into its q8_0 blocks `blk` ([blocks, 34] bytes) through `w`'s buffers."""
    size, k = src.size, blk.shape[0]
    if src.dtype in (np.float16, BF16_BITS):
        bits, signed, sign_bit = np.ascontiguousarray(src).reshape(-1).view(np.uint16), np.int16, 15
        inf = 0x7C00 if src.dtype == np.float16 else 0x7F80
    else:
        if src.dtype != np.float32:  # float64: its float32 values, as gguf-py quantizes them
            if w.f32 is None:
                w.f32 = np.empty(w.mag.size, dtype=np.float32)
            np.copyto(w.f32[:size].reshape(src.shape), src, casting="unsafe")
            src = w.f32[:size]
        bits, signed, sign_bit = np.ascontiguousarray(src).reshape(-1).view(np.uint32), np.int32, 31
        inf = 0x7F800000
    mag = np.bitwise_and(bits, (1 << sign_bit) - 1, out=w.mag[:size])
    top = w.top[:k]
    np.copyto(top, block_maxima(mag, w.fold_a[:size], w.fold_b[:size]))
    if int(top.max()) >= inf:  # all exponent bits set
        raise MConvertError(f"{name}: holds NaN or Inf values; the model is corrupt — re-copy or re-export it")
    amax, values = _magnitudes(top, src.dtype, w.d[:k]), w.values[:size]
    big = float(amax.max())
    if not big / 127 <= F16_MAX:  # a NaN compares false
        raise MConvertError(f"{name}: holds values up to {big:.6g}, beyond what q8_0's float16 block scales hold "
                            f"(±{127 * F16_MAX:g}), so a scale would be stored as Inf; {fix}")
    d = np.divide(amax, np.float32(127), out=amax)
    inv = w.inv[:k]
    inv.fill(0)
    np.divide(np.float32(1), d, out=inv, where=d != 0)
    v = _magnitudes(mag, src.dtype, values)
    inv_full = w.inv_full[:size]
    np.copyto(inv_full.reshape(k, Q8_BLOCK), inv[:, None])
    v *= inv_full  # the magnitudes in units of the scale, as gguf-py's float32 product
    v += ROUND_NUDGE
    q = w.q[:size]
    np.copyto(q, v, casting="unsafe")  # truncated: |v| <= 127 rounded half up
    s = w.sign[:size]
    np.right_shift(bits.view(signed), sign_bit, out=s, casting="unsafe")  # 0, or -1 where negative
    qs = q.view(np.int8)
    qs ^= s
    blk[:, :2].view(np.float16)[...] = d[:, None]
    np.subtract(qs.reshape(k, Q8_BLOCK), s.reshape(k, Q8_BLOCK), out=blk[:, 2:].view(np.int8))


def _magnitudes(mag: np.ndarray, dtype: np.dtype, out: np.ndarray) -> np.ndarray:
    """Float magnitudes (their bits with the sign cleared, of a `dtype` value) as float32 into `out`, exactly."""
    if dtype not in (np.float16, BF16_BITS):  # float32 bits
        return mag.view(np.float32)
    u = out.view(np.uint32)
    np.copyto(u, mag)
    if dtype == BF16_BITS:  # a bfloat16 is the top half of the float32 of the same value
        u <<= 16
        return out
    u <<= 13
    out *= np.float32(2.0 ** 112)
    return out
