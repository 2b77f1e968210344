"""The aligned hashing file writer: bytes go to disk front to back as soon as a unit is converted, hashed on the way.

`HashingFile` writes from a background thread that also feeds the manifest's hash (BLAKE3 by default, sha256 on
request: `MANIFEST_HASHES`), so the caller converts the next unit while the previous one is written and hashed,
and the manifest need not read the file back (`atomic.record_digest`). `crc32` is the standard CRC-32 of zlib,
computed by ISA-L where installed (the same value, several times faster). Large files go through page-aligned staging chunks with O_DIRECT, so the output
skips the page cache. Every format writer (safetensors, torch.save zip, FasterTransformer raw arrays) writes
through it.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import hashlib
import mmap
import os
import queue
import threading
import zlib
from collections.abc import Callable
from collections import deque
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from mconvert.errors import MConvertError


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of `t` in row-major order (a copy only when `t` is not contiguous)."""
    if not t.is_contiguous():
        t = t.contiguous()
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def numel(shape: Iterable[int]) -> int:
    """The number of elements of `shape` (1 for a scalar)."""
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _fast_crc32() -> Callable[..., int]:
    """ISA-L's CRC-32 (`isal`), else zlib's: both compute the standard CRC-32 that zip records store."""
    try:
        from isal import isal_zlib
    except ImportError:  # pragma: no cover - isal is a dependency; zlib gives the same value, slower
        return zlib.crc32
    return isal_zlib.crc32


crc32: Callable[..., int] = _fast_crc32()  # crc32(data, start=0) -> int, as zlib.crc32

MANIFEST_HASHES = ("blake3", "sha256")  # the manifest's hash algorithms; the first is the default
_manifest_hash = MANIFEST_HASHES[0]


def set_manifest_hash(name: str) -> None:
    """Choose the hash the writers compute and the manifest records (process-wide; the CLI's --manifest-hash)."""
    global _manifest_hash
    _manifest_hash = check_hash_name(name)


def manifest_hash() -> str:
    """The hash algorithm new manifests use."""
    return _manifest_hash


def check_hash_name(name: str) -> str:
    """`name` if it is a manifest hash algorithm, else an MConvertError listing them."""
    if name not in MANIFEST_HASHES:
        raise MConvertError(f"unknown manifest hash {name!r}; choose one of {', '.join(MANIFEST_HASHES)}")
    return name


def new_hasher(name: str) -> Any:
    """A fresh hashlib-style object (update, hexdigest) for manifest algorithm `name`. BLAKE3 hashes on every
    core: its tree splits one large buffer across threads, where sha256 is one sequential chain."""
    if check_hash_name(name) == "sha256":
        return hashlib.sha256()
    import blake3

    return blake3.blake3(max_threads=blake3.blake3.AUTO)


def hash_file(path: str | Path, name: str, chunk: int = 16 << 20, mapped: bool = False) -> str:
    """The hex digest of the file at `path` under manifest algorithm `name`, read through one reused buffer.

    `mapped=True` (for files of our own output only) hashes the page cache in place through a sliding window
    of `chunk` bytes of mapping instead, without copying each byte into the buffer first: about twice the
    speed. It is never used on an input: a mapping of a file another process truncates meanwhile faults
    (SIGBUS) where a read returns short, and only a file inside the output being written is safe from
    that. The window keeps at most `chunk` bytes mapped, so the resident set stays bounded."""
    h = new_hasher(name)
    if mapped and _hash_mapped(path, h, chunk):
        return h.hexdigest()
    buf = memoryview(bytearray(chunk))
    with open(path, "rb", buffering=0) as f:
        while k := f.readinto(buf):
            h.update(buf[:k])
    return h.hexdigest()


def _hash_mapped(path: str | Path, h: Any, window: int) -> bool:
    """Feed the file at `path` to `h` through read-only mappings of `window` bytes (rounded down to the
    mapping granularity, which every offset must be a multiple of); False, with `h` untouched, where the file
    cannot be mapped (the caller then reads it)."""
    window = max(mmap.ALLOCATIONGRANULARITY, window // mmap.ALLOCATIONGRANULARITY * mmap.ALLOCATIONGRANULARITY)
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        pos = 0
        while pos < size:
            n = min(window, size - pos)
            try:
                view = mmap.mmap(f.fileno(), n, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ, offset=pos)
            except (OSError, ValueError):
                if pos == 0:
                    return False  # a file system without mappings: read it instead
                raise
            try:
                h.update(view)
            finally:
                view.close()
            pos += n
    return True


DIRECT_MIN_BYTES = 256 << 20  # files planned at least this large are written with O_DIRECT (see HashingFile)
CHUNK = 16 << 20  # one O_DIRECT write (default); three of them are a file's staging memory
_ALIGN = 4096


class HashingFile:
    """Sequential writer + the manifest's hash off the caller's thread; at most `max_pending` bytes queued.

    The queued buffers keep their tensors alive until consumed, so callers may drop them at once.

    `direct=True` (callers pass it for files of `DIRECT_MIN_BYTES` and more) writes with O_DIRECT through
    page-aligned staging chunks: one thread copies the queued bytes into a chunk and hashes it, a second writes
    full chunks to the disk, the last one padded to 4 KiB and the file then cut to its size. The bytes skip
    the page cache: a buffered write must first get a fresh page-cache page for every 4 KiB (on a VM that
    returns freed memory to its host, a host-side fault as well), where O_DIRECT costs little CPU and waits
    on the disk off both cores. Where the file system refuses O_DIRECT (tmpfs, some FUSE), it falls back to
buffered writes with the same chunks; the bytes and the digest are the same either way."""

    def __init__(self, path: str | Path, max_pending: int = 64 << 20, direct: bool = False,
                 chunk: int = CHUNK, algorithm: str | None = None) -> None:
        self.path = Path(path)
        self.algorithm = check_hash_name(algorithm or _manifest_hash)
        self._chunk = chunk
        self.direct = False
        if direct and hasattr(os, "O_DIRECT"):
            try:
                self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
                self.direct = True
            except OSError:
                self.direct = False
        if not self.direct:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._h = new_hasher(self.algorithm)
        self._total = 0  # bytes written so far (writer thread)
        self._q: deque[tuple[memoryview, Any]] = deque()
        self._pending = 0
        self._max = max_pending
        self._cv = threading.Condition()
        self._closed = False
        self._error: BaseException | None = None
        if self.direct:
            self._chunks = [_take_chunk(chunk) for _ in range(3)]  # page-aligned, reused across files
            self._free: Any = queue.Queue()
            for i in range(len(self._chunks)):
                self._free.put(i)
            self._full: Any = queue.Queue()
            self._io = threading.Thread(target=self._run_io, name=f"odirect {self.path.name}", daemon=True)
            self._io.start()
        self._t = threading.Thread(target=self._run, name=f"write {self.path.name}", daemon=True)
        self._t.start()

    # ---- writer thread: queue -> (staging chunk + hash) or (file + hash) -------------------------------------
    def _run(self) -> None:
        cur, fill = (self._free.get(), 0) if self.direct else (None, 0)
        while True:
            with self._cv:
                while not self._q and not self._closed:
                    self._cv.wait()
                if not self._q:
                    break
                mv, keep = self._q.popleft()
            queued = len(mv) if isinstance(mv, memoryview) else 0
            try:
                if self._error is None:
                    if callable(mv):  # bytes known only now (`write_later`)
                        mv = memoryview(mv()).cast("B")
                    elif isinstance(keep, Checksum):  # `write(..., crc=...)`: CRC-32 here, off the caller
                        keep.value = crc32(mv)
                    self._total += len(mv)
                    self._h.update(mv)  # both hashes release the GIL for large buffers, as os.write does
                    if not self.direct:
                        write_all(self._fd, mv)
                    else:
                        pos = 0
                        while pos < len(mv):
                            n = min(len(mv) - pos, self._chunk - fill)
                            _memmove(self._chunks[cur], fill, mv[pos:pos + n])
                            fill, pos = fill + n, pos + n
                            if fill == self._chunk:
                                self._full.put((cur, fill))
                                cur, fill = self._free.get(), 0
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                self._error = e.with_traceback(None)  # its frames would pin the buffers
            if isinstance(keep, Checksum):
                keep.keep = None  # the CRC stays (the caller holds it); the bytes go
            with self._cv:
                self._pending -= queued
                self._cv.notify_all()
            del mv, keep
        if self.direct:
            if fill and self._error is None:
                self._full.put((cur, fill))
            self._full.put(None)

    def _run_io(self) -> None:
        """O_DIRECT writes of full chunks in order; the last (partial) one padded to the block size."""
        while True:
            item = self._full.get()
            if item is None:
                return
            i, n = item
            try:
                if self._error is None:
                    padded = -(-n // _ALIGN) * _ALIGN
                    if padded != n:
                        self._chunks[i][n:padded] = bytes(padded - n)
                    write_all(self._fd, memoryview(self._chunks[i])[:padded], self)
            except BaseException as e:  # noqa: BLE001
                self._error = e.with_traceback(None)  # its frames would pin the chunk's buffer
            self._free.put(i)

    def _direct_refused(self) -> None:
        """The file system took the O_DIRECT open but refuses the write (EINVAL): go on buffered."""
        fcntl.fcntl(self._fd, fcntl.F_SETFL, fcntl.fcntl(self._fd, fcntl.F_GETFL) & ~os.O_DIRECT)

    def write_later(self, produce: Any) -> None:
        """Queue a call that returns the next bytes, made on the writer thread in turn — after every byte
        queued before it was written (and its CRC-32 taken): for bytes that depend on those CRCs."""
        with self._cv:
            self._raise()
            self._q.append((produce, None))
            self._cv.notify_all()

    def write(self, data: bytes | memoryview, keep: Any = None, crc: "Checksum | None" = None) -> None:
        """Queue `data` (keep `keep` — e.g. its tensor — alive until written). With `crc`, its CRC-32 is taken
        on the writer thread into `crc.value` (with `crc.keep` kept alive instead of `keep`)."""
        mv = memoryview(data).cast("B")
        if crc is not None:
            crc.keep, keep = keep, crc
        if not len(mv):
            if crc is not None:
                crc.value = 0
            return
        with self._cv:
            while self._pending and self._pending + len(mv) > self._max and self._error is None:
                self._cv.wait()
            self._raise()
            self._q.append((mv, keep))
            self._pending += len(mv)
            self._cv.notify_all()

    def _raise(self) -> None:
        if self._error is not None:
            e = self._error
            if isinstance(e, OSError):  # disk full / file-size limit / EROFS: atomic_output_dir names OUT
                raise OSError(e.errno, e.strerror, str(self.path)) from None
            raise MConvertError(f"{self.path}: write failed ({getattr(e, 'strerror', None) or e})") from None

    def _stop(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._t.join()
        if self.direct:
            self._io.join()

    def close(self) -> str:
        """Flush, close, and return the hex digest (of `self.algorithm`) of everything written."""
        self._stop()
        try:
            if self.direct and self._error is None:
                os.ftruncate(self._fd, self._total)  # the padding of the last chunk
        finally:
            self._close_fd()
        self._raise()
        return self._h.hexdigest()

    def abort(self) -> None:
        with self._cv:
            self._q.clear()
            self._error = self._error or MConvertError("aborted")
        self._stop()
        self._close_fd()

    def _close_fd(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self._release()

    def _release(self) -> None:
        for c in getattr(self, "_chunks", []):
            _CHUNK_POOL.setdefault(len(c), []).append(c)
        self._chunks = []


_CHUNK_POOL: dict[int, list[Any]] = {}


def _take_chunk(size: int) -> Any:
    """A page-aligned staging chunk: a free one of this size (its pages already resident: a new page costs a
    fault each, on a VM a host-side one too), else a new mapping."""
    free = _CHUNK_POOL.get(size)
    if free:
        return free.pop()
    # private: anonymous shared memory is shmem, where transparent huge pages are usually off
    return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


class Checksum:
    """A CRC-32 the writer thread fills in (`HashingFile.write(..., crc=)`): zip records need the CRC of bytes
    that are hashed on that thread anyway."""

    __slots__ = ("value", "keep")

    def __init__(self) -> None:
        self.value: int | None = None
        self.keep: Any = None


def write_all(fd: int, mv: memoryview, owner: HashingFile | None = None) -> None:
    """os.write until every byte of `mv` is written; an O_DIRECT `owner` whose file system refuses the write
    (EINVAL) is switched to buffered writes and the write retried."""
    done = 0
    while done < len(mv):
        try:
            done += os.write(fd, mv[done:])
        except OSError as e:
            if owner is None or e.errno != errno.EINVAL or not owner.direct:
                raise
            owner._direct_refused()  # then the same write, buffered


_libc_memmove: Any = None


def _memmove(dst: Any, offset: int, src: memoryview) -> None:
    """dst[offset:offset + len(src)] = src without holding the GIL (ctypes releases it): the main thread
    keeps converting while the writer thread copies into its staging chunk."""
    global _libc_memmove
    if _libc_memmove is None:
        _libc_memmove = ctypes.CDLL(None).memmove
        _libc_memmove.restype = ctypes.c_void_p
        _libc_memmove.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
    if src.readonly or len(src) < (1 << 20):  # headers and small tensors: a plain slice copy
        dst[offset:offset + len(src)] = src
        return
    d, s = ctypes.c_char.from_buffer(dst, offset), ctypes.c_char.from_buffer(src)
    _libc_memmove(ctypes.addressof(d), ctypes.addressof(s), len(src))
    del d, s  # release the buffer exports (an mmap with exports cannot be closed)

