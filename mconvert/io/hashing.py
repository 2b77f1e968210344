"""The aligned hashing file writers: bytes go to disk as soon as a unit is converted, hashed on the way.

`HashingFile` writes a file front to back from a background thread that also feeds the manifest's hash (BLAKE3
by default, sha256 on request: `MANIFEST_HASHES`), so the caller converts the next unit while the previous one is
written and hashed, and the manifest need not read the file back (`atomic.record_digest`). `crc32` is the
standard CRC-32 of zlib, computed by ISA-L where installed (the same value, several times faster). Large files
go through page-aligned staging chunks with O_DIRECT, so the output skips the page cache. Every format writer
(safetensors, torch.save zip, FasterTransformer raw arrays) writes through it, except a file filled at its
offsets in any order (TensorRT-LLM's rank files, a GGUF whose MoE layers come one expert at a time):
`RandomDirectFile`.
"""

from __future__ import annotations

import bisect
import ctypes
import errno
import fcntl
import functools
import hashlib
import itertools
import mmap
import os
import queue
import stat
import threading
import sys
import time
import zlib
from collections.abc import Callable
from collections import deque
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mconvert.errors import MConvertError

if TYPE_CHECKING:
    import torch


def is_tensor(x: Any) -> bool:
    """Whether `x` is a torch tensor, without importing torch: a process that never imported it holds none."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of `t` in row-major order (a copy only when `t` is not contiguous)."""
    import torch

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


def new_hasher(name: str, threads: bool = True) -> Any:
    """A fresh hashlib-style object (update, hexdigest) for manifest algorithm `name`. BLAKE3 hashes on every
    core (`threads`): its tree splits one large buffer across threads, where sha256 is one sequential chain —
    for a hash nothing else runs beside (a finished file). Without `threads` it stays on the caller's thread:
    for a hash taken beside other work (an input's blocks as its readers bring them, an output's bytes on its
    writer thread while the next tensor is read), where the pool's threads, spinning between buffers, take
    the cores from that work and from the disk writes' completions."""
    if check_hash_name(name) == "sha256":
        return hashlib.sha256()
    import blake3

    return blake3.blake3(max_threads=blake3.blake3.AUTO if threads else 1)


MAP_WINDOW = 4 << 20  # hash_file(mapped=True): bytes of the file mapped at a time (they count in the resident set)


def hash_file(path: str | Path, name: str, chunk: int = 16 << 20, mapped: bool = False) -> str:
    """The hex digest of the file at `path` under manifest algorithm `name`, read through one reused buffer.

    `mapped=True` (for files of our own output only) hashes the page cache in place through a sliding window
    of `chunk` bytes of mapping instead, without copying each byte into the buffer first: about twice the
    speed. It is never used on an input: a mapping of a file another process truncates meanwhile faults
    (SIGBUS) where a read returns short, and only a file inside the output being written is safe from
    that. The window keeps at most MAP_WINDOW bytes mapped (the mapped pages count in the resident set, and
    `write_manifest` hashes four files at once), so the resident set stays bounded."""
    h = new_hasher(name)
    if mapped and _hash_mapped(path, h, min(chunk, MAP_WINDOW)):
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


GAP_READ = 8 << 20  # FollowedDigest reads a gap of unread bytes up to this size itself (headers, a pickle)
FOLLOW_BLOCK = 1 << 20  # one pread while the input's checks are taken on the way: the block is still in L2
CATCH_UP = 64 << 20  # FollowedDigest reads again at most this much per block fed (see `_catch_up`)
# How long a block read ahead of the hashed prefix waits for the reads in flight before it (see `saw`)
FOLLOW_WAIT_S = 0.5
_FOLLOW_BUF = threading.local()  # each thread's block buffer for the bytes a FollowedDigest reads itself


def pread_into(fd: int, mv: memoryview, pos: int, path: Path, key: str, crc: Any = None,
               digest: "FollowedDigest | None" = None) -> None:
    """Fill `mv` with the bytes of input file `path` (descriptor `fd`) from `pos` (tensor `key`). With a
    record-wise CRC-32 check (`crc.ZipRecords`) or a manifest digest (`FollowedDigest`) to feed, it reads
    FOLLOW_BLOCK bytes at a time and hands each block to them while it is in cache (the digest first: when
    the CRC refuses a block, the manifest still names the changed file)."""
    got, total = 0, len(mv)
    step = total if crc is None and digest is None else FOLLOW_BLOCK
    token = digest.begin(pos, total) if digest is not None else None
    try:
        while got < total:
            n = os.preadv(fd, [mv[got:got + step]], pos + got)
            if n <= 0:
                raise MConvertError(f"{path}: file ended while reading tensor {key!r}; it is truncated — re-copy it")
            if digest is not None:
                digest.saw(pos + got, mv[got:got + n], fd, token)
            if crc is not None:
                crc.saw(pos + got, mv[got:got + n])
            got += n
    finally:
        if digest is not None:
            digest.end(token)  # type: ignore[arg-type]


class FollowedDigest:
    """The manifest digest of one input file, taken on the bytes the conversion reads anyway (`saw`), so an
    intact input costs no second pass over its bytes.

    Both manifest hashes are chains over the file front to back, and the conversion reads its input almost in
    file order: a unit at a time, the units in the order they were written. So a block read at the `cursor`
    (everything before it hashed) is hashed there and then, while it is in cache. A block read just ahead of
    the cursor while a read in flight (`begin`..`end`) delivers the bytes before it (the readers' pool reads
    neighbouring tensors of one file at once) waits for the cursor, at most FOLLOW_WAIT_S (once per read: a
    read that timed out waits no more), and is hashed then: its reader trails the other one through the file
    instead of having the block read again. A block
    still ahead after that is noted as seen; once the cursor reaches it, the thread that brought it there
    reads it again from the page cache. Bytes nobody reads (zip headers, a pickle) are read here when no read
    in flight will deliver them and the gap is at most GAP_READ. `finish` hashes whatever is left from the
    cursor to the end and compares: a reader waits only for reads in flight before its block, so every chain
    of waits ends at the read at the cursor, and a file read in any order still gets its whole digest, with
    more bytes read twice."""

    def __init__(self, path: str | Path, algorithm: str, want: str, size: int) -> None:
        self.path, self.algorithm, self.want, self.size = Path(path), algorithm, want, size
        self._h = new_hasher(algorithm, threads=False)
        self._lock = threading.Lock()
        self._moved = threading.Condition(self._lock)  # the cursor moved, or a read in flight ended
        self.cursor = 0  # every byte before it is hashed
        self._seen: list[list[int]] = []  # sorted, disjoint [start, end) read ahead of the cursor, not hashed
        self._flight: dict[int, list[int]] = {}  # reads in progress: token -> [next byte they deliver, end]
        self._gave_up: set[int] = set()  # reads whose wait for the reads before them timed out: no more waits
        self._tokens = itertools.count()
        self.attached = False  # a reader of the conversion feeds it (else one pass on the background thread)
        self.on_read = 0  # bytes hashed from the conversion's own reads
        self.again = 0  # bytes this digest read itself
        self.done = False  # finished: `problem` is the verdict
        self.problem: str | None = None  # why the file does not match its manifest entry

    def begin(self, pos: int, n: int) -> int:
        """A read of [pos, pos + n) starts (its blocks follow through `saw`); the token for `saw` and `end`."""
        with self._lock:
            token = next(self._tokens)
            self._flight[token] = [pos, pos + n]
            return token

    def end(self, token: int) -> None:
        """The read `token` is over (done or failed)."""
        with self._lock:
            self._flight.pop(token, None)
            self._gave_up.discard(token)
            self._moved.notify_all()

    def _delivers(self, a: int, b: int) -> bool:
        """Whether a read in flight has yet to deliver some byte of [a, b)."""
        return any(nxt < b and end > a for nxt, end in self._flight.values())

    def saw(self, pos: int, data: memoryview, fd: int, token: int | None = None) -> None:
        """Bytes [pos, pos + len(data)) of the file were just read through descriptor `fd` (by read `token`)."""
        end = pos + len(data)
        with self._lock:
            if token in self._flight:
                self._flight[token][0] = end
            if pos > self.cursor and token not in self._gave_up and self._delivers(self.cursor, pos):
                if not self._wait_for(pos):  # the read before it stalls: this read's blocks go on unwaited
                    self._gave_up.add(token)
            if self.problem is not None or self.done or end <= self.cursor:
                return
            if pos > self.cursor:
                if pos - self.cursor > GAP_READ or self._delivers(self.cursor, pos):
                    self._note(pos, end)
                    if self._seen[0][0] <= self.cursor:  # a catch-up cut short by CATCH_UP goes on
                        self._catch_up(fd)
                    return
                self._read(fd, pos)  # the few bytes nobody reads before it
                if self.problem is not None:
                    return
            self._h.update(data[self.cursor - pos:])
            self.on_read += end - self.cursor
            self.cursor = end
            self._catch_up(fd)
            self._moved.notify_all()

    def _wait_for(self, pos: int) -> bool:
        """(lock held) Wait, at most FOLLOW_WAIT_S, until the cursor reaches `pos` or no read in flight delivers
        the bytes before it; False when the time ran out. The reads it waits for lie before `pos`, so they
        never wait for this one."""
        deadline = time.monotonic() + FOLLOW_WAIT_S
        while pos > self.cursor and self.problem is None and not self.done and self._delivers(self.cursor, pos):
            left = deadline - time.monotonic()
            if left <= 0 or not self._moved.wait(left):
                return False
        return True

    def _note(self, start: int, end: int) -> None:
        """Add [start, end) to the blocks seen ahead of the cursor (merged with the ones it touches)."""
        seen = self._seen
        i = bisect.bisect_left(seen, [start, start])
        if i and seen[i - 1][1] >= start:
            i -= 1
            start = seen[i][0]
        j = i
        while j < len(seen) and seen[j][0] <= end:
            end = max(end, seen[j][1])
            j += 1
        seen[i:j] = [[start, end]]

    def _catch_up(self, fd: int) -> None:
        """Hash again the blocks seen ahead of the cursor that the cursor now reaches (gaps of at most GAP_READ
        before them included): those bytes were read moments ago and are in the page cache. At most
        CATCH_UP bytes per call, since the other readers of the file wait on the lock meanwhile; the next
        block fed, or `finish`, goes on from there."""
        seen, limit = self._seen, self.cursor + CATCH_UP
        while seen and self.problem is None and self.cursor < limit:
            start, end = seen[0]
            if end <= self.cursor:
                seen.pop(0)
            elif start <= self.cursor or (start - self.cursor <= GAP_READ and not self._delivers(self.cursor, start)):
                self._read(fd, min(end, limit))
            else:
                return

    def _read(self, fd: int, stop: int) -> None:
        """Read and hash [cursor, stop) through `fd`; a file that ends before is a problem."""
        buf = getattr(_FOLLOW_BUF, "mv", None)
        if buf is None:  # one per thread, not per file: a checkpoint may have hundreds of files
            buf = _FOLLOW_BUF.mv = memoryview(bytearray(FOLLOW_BLOCK))
        while self.cursor < stop:
            try:
                k = os.preadv(fd, [buf[: min(FOLLOW_BLOCK, stop - self.cursor)]], self.cursor)
            except OSError as e:
                self.problem = f"{self.path}: cannot read ({e.strerror})"
                return
            if k <= 0:
                self.problem = f"{self.path}: ends at byte {self.cursor:,}, the manifest says {self.size:,}"
                return
            self._h.update(buf[:k])
            self.again += k
            self.cursor += k
        self._moved.notify_all()

    def finish(self) -> str | None:
        """Hash the rest of the file (from the cursor) and compare with the manifest: None when it matches, else
        the problem (kept: a second call returns it again). A block at a time under the lock, so readers still
        feeding it wait for one block at most."""
        try:  # never blocks: a FIFO swapped in for the file opens at once and is refused below
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
        except OSError as e:
            return f"{self.path}: cannot read ({e.strerror})"
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return f"{self.path}: not a regular file any more"
            while True:
                with self._lock:
                    if self.problem is not None or self.done:
                        return self.problem
                    if self.cursor < self.size:
                        self._read(fd, min(self.size, self.cursor + FOLLOW_BLOCK))
                        continue
                    self.done, self._seen = True, []
                    size = os.fstat(fd).st_size
                    if size != self.size:
                        self.problem = f"{self.path}: size {size} != manifest {self.size}"
                    elif self._h.hexdigest() != self.want:
                        self.problem = f"{self.path}: {self.algorithm} differs from the manifest (file changed or corrupt)"
                    return self.problem
        finally:
            os.close(fd)


DIRECT_MIN_BYTES = 256 << 20  # files planned at least this large are written with O_DIRECT (see HashingFile)
CHUNK = 4 << 20  # one O_DIRECT write (default): one disk request at most devices' largest (`_take_chunk`)
IO_WRITES = 2  # O_DIRECT writes of one file in flight at once
_ALIGN = 4096


class _OutputFile:
    """What both aligned writers share: the file opened for writing (O_DIRECT where asked and the file system
    takes it), the switch to buffered writes where a write is refused, and the error a writer thread left,
    raised in the caller's thread."""

    path: Path
    _error: BaseException | None

    def _open(self, direct: bool) -> None:
        """Open `self.path` for writing (created, truncated); `self.direct`: whether O_DIRECT took."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        self.direct = False
        if direct and hasattr(os, "O_DIRECT"):
            try:
                self._fd = os.open(self.path, flags | os.O_DIRECT, 0o644)
                self.direct = True
                return
            except OSError:
                pass
        self._fd = os.open(self.path, flags, 0o644)

    def _direct_refused(self) -> None:
        """The file system took the O_DIRECT open but refuses the write (EINVAL): go on buffered."""
        fcntl.fcntl(self._fd, fcntl.F_SETFL, fcntl.fcntl(self._fd, fcntl.F_GETFL) & ~os.O_DIRECT)

    def _close_fd(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self._release()

    def _release(self) -> None:
        """(after close) Give back what the writer holds besides the descriptor."""

    def _raise(self) -> None:
        if self._error is not None:
            e = self._error
            if isinstance(e, OSError):  # disk full / file-size limit / EROFS: atomic_output_dir names OUT
                raise OSError(e.errno, e.strerror, str(self.path)) from None
            raise MConvertError(f"{self.path}: write failed ({getattr(e, 'strerror', None) or e})") from None


class _SameHash:
    """The second hash of a HashingFile whose `also` is its own algorithm: nothing to take twice."""

    def __init__(self, h: Any) -> None:
        self._h = h

    def update(self, data: Any) -> None:
        pass

    def hexdigest(self) -> str:
        return self._h.hexdigest()


class HashingFile(_OutputFile):
    """Sequential writer + the manifest's hash off the caller's thread; at most `max_pending` bytes queued.

    The queued buffers keep their tensors alive until consumed, so callers may drop them at once.

    `direct=True` (callers pass it for files of `DIRECT_MIN_BYTES` and more) writes with O_DIRECT through
    page-aligned staging chunks: one thread copies the queued bytes into a chunk and hashes it, two more write
    full chunks to the disk at their offsets, two writes in flight (a disk keeps busy between them), the last
    chunk padded to 4 KiB and the file then cut to its size. The bytes skip the page cache: a buffered write
    must first get a fresh page-cache page for every 4 KiB (on a VM that returns freed memory to its host, a
    host-side fault as well), where O_DIRECT costs little CPU and waits on the disk off both cores. Where the
    file system refuses O_DIRECT (tmpfs, some FUSE), it falls back to buffered writes with the same chunks;
    the bytes and the digest are the same either way."""

    def __init__(self, path: str | Path, max_pending: int = 64 << 20, direct: bool = False,
                 chunk: int = CHUNK, algorithm: str | None = None, also: str | None = None) -> None:
        self.path = Path(path)
        self.algorithm = check_hash_name(algorithm or _manifest_hash)
        self._chunk = chunk
        self._open(direct)
        self._h = new_hasher(self.algorithm, threads=False)  # beside the conversion (`new_hasher`)
        # `also`: a second algorithm taken on the same bytes (a format's own manifest: Megatron-LM's sha256);
        # `digests` holds both once closed. With O_DIRECT it hashes each full staging chunk on a thread of its
        # own, beside the disk writes: a sequential sha256 on the copying thread would halve its throughput
        self._also = (_SameHash(self._h) if also in (None, self.algorithm)
                      else new_hasher(check_hash_name(also), threads=False))
        self._also_name = also or self.algorithm
        self.digests: dict[str, str] = {}
        self._also_q: Any = None
        self._total = 0  # bytes written so far (writer thread)
        self._q: deque[tuple[Any, Any, int]] = deque()  # (bytes, tensor or a call; what to keep; bytes queued)
        self._pending = 0
        self._max = max_pending
        self._cv = threading.Condition()
        self._closed = False
        self._error: BaseException | None = None
        if self.direct:
            # one chunk filled while IO_WRITES are written; page-aligned, reused across files
            self._chunks = [_take_chunk(chunk) for _ in range(IO_WRITES + 1)]
            self._free: Any = queue.Queue()
            for i in range(len(self._chunks)):
                self._free.put(i)
            self._full: Any = queue.Queue()
            self._io = [threading.Thread(target=self._run_io, name=f"odirect {self.path.name}", daemon=True)
                        for _ in range(IO_WRITES)]
            if not isinstance(self._also, _SameHash):  # a chunk is free once written and hashed
                self._also_q = queue.Queue()
                self._users = [0] * len(self._chunks)
                self._users_lock = threading.Lock()
                self._io.append(threading.Thread(target=self._run_also, name=f"{also} {self.path.name}", daemon=True))
            for t in self._io:
                t.start()
        self._t = threading.Thread(target=self._run, name=f"write {self.path.name}", daemon=True)
        self._t.start()

    # ---- writer thread: queue -> (staging chunk, CRC + hash of it) or (CRC + hash + file) -----------------
    def _run(self) -> None:
        cur, fill = (self._free.get(), 0) if self.direct else (None, 0)
        at = 0  # the file offset of chunk `cur`
        while True:
            with self._cv:
                while not self._q and not self._closed:
                    self._cv.wait()
                if not self._q:
                    break
                data, keep, queued = self._q.popleft()
            ck = keep if isinstance(keep, Checksum) else None  # `write(..., crc=...)`: CRC-32 here, off the caller
            part: Any = None
            try:
                if self._error is None:
                    if callable(data):  # bytes known only now (`write_later`)
                        data = memoryview(data()).cast("B")
                    crc = 0
                    for part in data if isinstance(data, tuple) else (data,):  # a tuple: blocks written in turn
                        if not self.direct:
                            mv = _Staged(part).whole()
                            if ck is not None:
                                crc = crc32(mv, crc)
                            self._h.update(mv)  # both hashes release the GIL for large buffers, as os.write does
                            self._also.update(mv)
                            write_all(self._fd, mv)
                            self._total += len(mv)
                            del mv
                            continue
                        # each piece is copied into the chunk, then checksummed and hashed there, still in cache
                        src = _Staged(part)
                        pos = 0
                        while pos < src.nbytes:
                            n = min(src.nbytes - pos, self._chunk - fill)
                            src.copy_into(self._chunks[cur], fill, pos, n)
                            piece = memoryview(self._chunks[cur])[fill:fill + n]
                            if ck is not None:
                                crc = crc32(piece, crc)
                            self._h.update(piece)
                            del piece
                            fill, pos = fill + n, pos + n
                            if fill == self._chunk:
                                self._hand_on(cur, fill, at)
                                cur, fill, at = self._free.get(), 0, at + fill
                        self._total += src.nbytes
                        del src
                    if ck is not None:
                        ck.value = crc
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                self._error = e.with_traceback(None)  # its frames would pin the buffers
            if ck is not None:
                ck.keep = None  # the CRC stays (the caller holds it); the bytes go
            with self._cv:
                self._pending -= queued
                self._cv.notify_all()
            del data, keep, ck, part  # the last block too: its memory goes back now
        if self.direct:
            if fill and self._error is None:
                self._hand_on(cur, fill, at)
            for _ in range(IO_WRITES):
                self._full.put(None)
            if self._also_q is not None:
                self._also_q.put(None)

    def _hand_on(self, i: int, n: int, at: int) -> None:
        """Staging chunk `i`, its `n` bytes filled, to the disk writers (at offset `at`) and the second hash."""
        if self._also_q is not None:
            self._users[i] = 2
            self._also_q.put((i, n))
        self._full.put((i, n, at))

    def _chunk_done(self, i: int) -> None:
        """One user of staging chunk `i` is done with it; the last one frees it for the copying thread."""
        if self._also_q is not None:
            with self._users_lock:
                self._users[i] -= 1
                if self._users[i]:
                    return
        self._free.put(i)

    def _run_also(self) -> None:
        """The second hash (`also`) over the full staging chunks, in file order."""
        while True:
            item = self._also_q.get()
            if item is None:
                return
            i, n = item
            try:
                if self._error is None:
                    self._also.update(memoryview(self._chunks[i])[:n])
            except BaseException as e:  # noqa: BLE001
                self._error = e.with_traceback(None)
            self._chunk_done(i)

    def _run_io(self) -> None:
        """O_DIRECT writes of full chunks at their offsets; the last (partial) one padded to the block size."""
        while True:
            item = self._full.get()
            if item is None:
                return
            i, n, at = item
            try:
                if self._error is None:
                    padded = -(-n // _ALIGN) * _ALIGN
                    if padded != n:
                        self._chunks[i][n:padded] = bytes(padded - n)
                    write_all(self._fd, memoryview(self._chunks[i])[:padded], self, at)
            except BaseException as e:  # noqa: BLE001
                self._error = e.with_traceback(None)  # its frames would pin the chunk's buffer
            self._chunk_done(i)

    def write_later(self, produce: Any) -> None:
        """Queue a call that returns the next bytes, made on the writer thread in turn — after every byte
        queued before it was written (and its CRC-32 taken): for bytes that depend on those CRCs."""
        with self._cv:
            self._raise()
            self._q.append((produce, None, 0))
            self._cv.notify_all()

    def write(self, data: "bytes | memoryview | torch.Tensor | tuple[torch.Tensor, ...]", keep: Any = None,
              crc: "Checksum | None" = None) -> None:
        """Queue `data` (keep `keep` — e.g. its tensor — alive until written). A tensor is written as its
        row-major bytes: the copy that a view with strided rows (a row-split TP shard) needs is made on the
        writer thread, straight into the staging chunk where the file is written with O_DIRECT. A tuple of
        tensors (`transforms.RowBlocks`) is written as their bytes one after the other, one record. With `crc`,
        the CRC-32 is taken on the writer thread into `crc.value` (with `crc.keep` kept alive instead of `keep`)."""
        if isinstance(data, tuple):
            n = sum(t.numel() * t.element_size() for t in data)
            keep = data if keep is None else keep
        elif is_tensor(data):
            n = data.numel() * data.element_size()
            keep = data if keep is None else keep
        else:
            data = memoryview(data).cast("B")
            n = len(data)
        if crc is not None:
            crc.keep, keep = keep, crc
        if not n:
            if crc is not None:
                crc.value = 0
            return
        with self._cv:
            while self._pending and self._pending + n > self._max and self._error is None:
                self._cv.wait()
            self._raise()
            self._q.append((data, keep, n))
            self._pending += n
            self._cv.notify_all()

    def drain(self) -> None:
        """Wait until every byte queued so far has been taken by the writer thread: written to the file (with
        O_DIRECT: written, or waiting in the staging chunk being filled)."""
        with self._cv:
            while (self._q or self._pending) and self._error is None:
                self._cv.wait()
            self._raise()

    def _stop(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._t.join()
        for t in self._io if self.direct else ():
            t.join()

    def close(self) -> str:
        """Flush, close, and return the hex digest (of `self.algorithm`) of everything written."""
        self._stop()
        try:
            if self.direct and self._error is None:
                os.ftruncate(self._fd, self._total)  # the padding of the last chunk
        finally:
            self._close_fd()
        self._raise()
        self.digests = {self.algorithm: self._h.hexdigest(), self._also_name: self._also.hexdigest()}
        return self.digests[self.algorithm]

    def abort(self) -> None:
        with self._cv:
            self._q.clear()
            self._error = self._error or MConvertError("aborted")
        self._stop()
        self._close_fd()


    def _release(self) -> None:
        for c in getattr(self, "_chunks", []):
            _give_chunk(c)
        self._chunks = []


_CHUNK_POOL: dict[int, list[Any]] = {}


@functools.lru_cache(maxsize=1)
def huge_page_bytes() -> int:
    """The size of a transparent huge page (/sys), 0 where the kernel offers none."""
    try:
        return int(Path("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size").read_text())
    except (OSError, ValueError):
        return 0


def _take_chunk(size: int) -> Any:
    """A page-aligned staging chunk: a free one of this size (its pages already resident: a new page costs a
    fault each, on a VM a host-side one too), else a new mapping, on transparent huge pages where the kernel
    has them (asked for with madvise, so a system set to `madvise` gives them too). The block layer cuts an
    O_DIRECT write into disk requests at the device's segment limit, one segment per physically contiguous run:
    from 4 KiB pages that is max_segments × 4 KiB (about 1 MB on virtio and NVMe), from 2 MiB pages the
    device's largest request (max_sectors_kb, often 4 MiB), as large as the page cache's own writeback sends
    them; a disk pays per request, a virtual disk most of all. The few chunks a process has are mapped once
    and reused, so a huge page's first touch (its zeroing) is paid once per chunk, not per write."""
    free = _CHUNK_POOL.get(size)
    if free:
        return free.pop()
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS  # not shared: anonymous shared memory is shmem, without THP
    huge = huge_page_bytes()
    if not huge or size % huge or not hasattr(mmap, "MADV_HUGEPAGE"):
        return mmap.mmap(-1, size, flags=flags)
    m = mmap.mmap(-1, size + huge, flags=flags)  # room to start at a huge-page boundary; the rest is never touched
    ref = ctypes.c_char.from_buffer(m)
    start = -ctypes.addressof(ref) % huge
    del ref  # the buffer export (an mmap with exports cannot be closed)
    m.madvise(mmap.MADV_HUGEPAGE, start, size)
    return memoryview(m)[start:start + size]  # keeps the mapping alive


def _give_chunk(chunk: Any) -> None:
    """A staging chunk no writer uses any more: kept, resident, for the next `_take_chunk` of its size."""
    _CHUNK_POOL.setdefault(len(chunk), []).append(chunk)


class _SharedWrites:
    """The staging thread, staging chunks and O_DIRECT writer threads every `RandomDirectFile` of the process
    shares (one set per chunk size), so neither the threads nor the staging memory grow with the number of
    rank files. The staging thread takes the queued writes in order (at most QUEUED bytes waiting): it
    feeds each file's digest, assembles the partly covered blocks, and copies the aligned bytes into a free
    chunk, while IO_WRITES chunks are written; the caller converts the next tensor meanwhile."""

    QUEUED = 64 << 20

    def __init__(self, chunk: int) -> None:
        self.chunk = chunk
        self._chunks = [_take_chunk(chunk) for _ in range(IO_WRITES + 1)]
        self._free: Any = queue.Queue()
        for i in range(len(self._chunks)):
            self._free.put(i)
        self._full: Any = queue.Queue()
        self._q: deque[tuple[RandomDirectFile, memoryview, int, Any]] = deque()
        self._queued = 0
        self._cv = threading.Condition()
        threading.Thread(target=self._run_stage, name="odirect-stage", daemon=True).start()
        for k in range(IO_WRITES):
            threading.Thread(target=self._run_io, name=f"odirect-{k}", daemon=True).start()

    def enqueue(self, owner: "RandomDirectFile", data: memoryview, at: int, keep: Any) -> None:
        """Queue `data` for file offset `at` of `owner` (`keep` alive until it is staged)."""
        with owner._cv:
            owner._pending += 1
        with self._cv:
            while self._queued and self._queued + len(data) > self.QUEUED:
                self._cv.wait()
            self._q.append((owner, data, at, keep))
            self._queued += len(data)
            self._cv.notify_all()

    def _run_stage(self) -> None:
        while True:
            with self._cv:
                while not self._q:
                    self._cv.wait()
                owner, data, at, keep = self._q.popleft()
            try:
                if owner._error is None:
                    owner._stage(self, data, at)
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                owner._error = e.with_traceback(None)
            n = len(data)
            del data, keep
            with self._cv:
                self._queued -= n
                self._cv.notify_all()
            with owner._cv:
                owner._pending -= 1
                owner._cv.notify_all()

    def submit(self, owner: "RandomDirectFile", data: memoryview, at: int) -> None:
        """(staging thread) Copy `data` (at most one chunk, a multiple of 4 KiB) into a free chunk and queue its
        write at `at`."""
        i = self._free.get()
        try:
            _memmove(self._chunks[i], 0, data)
        except BaseException:
            self._free.put(i)  # the chunk serves the next write; the failure goes to the owner
            raise
        with owner._cv:
            owner._pending += 1
        self._full.put((owner, i, len(data), at))

    def _run_io(self) -> None:
        while True:
            owner, i, n, at = self._full.get()
            try:
                if owner._error is None:
                    write_all(owner._fd, memoryview(self._chunks[i])[:n], owner, at)
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                owner._error = e.with_traceback(None)
            self._free.put(i)
            with owner._cv:
                owner._pending -= 1
                owner._cv.notify_all()


AHEAD_KEEP = 4 << 20  # RandomDirectFile keeps writes ahead of its digest's front up to this many bytes in all
_SHARED_WRITES: dict[int, _SharedWrites] = {}
_SHARED_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_SHARED_WRITES.clear)  # a forked child has none of the threads


def _shared_writes(chunk: int) -> _SharedWrites:
    with _SHARED_LOCK:
        if chunk not in _SHARED_WRITES:
            _SHARED_WRITES[chunk] = _SharedWrites(chunk)
        return _SHARED_WRITES[chunk]


class RandomDirectFile(_OutputFile):
    """A file of planned `size` written at any offsets in any order (a TensorRT-LLM rank file, filled as units
    arrive), with O_DIRECT where the file system takes it, so its bytes skip the page cache as HashingFile's do.

    Each write is done off the caller's thread (`_SharedWrites`: one staging thread and one set of chunks for
    every such file): its 4 KiB-aligned interior is copied into a page-aligned staging chunk and written from
    there; the blocks it covers only in part (shared with the neighbouring tensor, the header, the end of the
    file) are assembled in memory and written once every byte of them has come: a few KiB per tensor at most.

    The digest is a chain over the file front to back: bytes written where everything before them is hashed
    are hashed there and then; writes ahead of that point are kept until the chain reaches them (AHEAD_KEEP
    bytes in all); from the first write ahead that was not kept on, `close` reads the rest back (O_DIRECT
    into a chunk: no page-cache pages for it either). A writer that brings its tensors in file order
    (`TrtllmWriter.unit_order`) so reads back little or nothing. One caller thread; `direct=False` writes
    buffered, on the same staging thread."""

    def __init__(self, path: str | Path, size: int, direct: bool = True, chunk: int = CHUNK,
                 algorithm: str | None = None) -> None:
        self.path, self.size = Path(path), int(size)
        self.algorithm = check_hash_name(algorithm or _manifest_hash)
        self._chunk = chunk
        self._open(direct)
        self._spans: list[list[int]] = []  # the byte ranges written so far, sorted and merged
        self._edges: dict[int, list[Any]] = {}  # block index -> [its bytes so far, how many came]
        self._error: BaseException | None = None
        self._cv = threading.Condition()
        self._pending = 0  # writes queued for staging and chunks queued for the disk, not yet done
        self._h = new_hasher(self.algorithm, threads=False)  # beside the conversion (`new_hasher`)
        self._front = 0  # every byte before it is hashed
        self._ahead: dict[int, bytes] = {}  # small writes ahead of the front: offset -> their bytes
        self._ahead_bytes = 0
        self._far = self.size  # the first byte of a write ahead that was not kept: the front stops there
        if self.direct:
            self._block = mmap.mmap(-1, _ALIGN, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # page-aligned

    def write(self, data: bytes | memoryview, at: int, keep: Any = None) -> None:
        """Write `data` at file offset `at` (each byte of the file exactly once over the file's life), on the
        staging thread (`keep`, e.g. the tensor `data` views, is kept alive until then)."""
        self._raise()
        mv = memoryview(data).cast("B")
        a, b = at, at + len(mv)
        if a < 0 or b > self.size:
            raise MConvertError(f"internal: {self.path.name}: bytes [{a}, {b}) lie outside its {self.size} bytes")
        self._cover(a, b)
        if len(mv):
            _shared_writes(self._chunk).enqueue(self, mv, a, keep)

    def _stage(self, shared: _SharedWrites, mv: memoryview, a: int) -> None:
        """(staging thread) The digest, then the bytes: buffered, or the partly covered blocks assembled and
        the aligned interior through the shared chunks."""
        self._follow(a, mv)
        b = a + len(mv)
        if not self.direct:
            write_all(self._fd, mv, None, a)
            return
        lo = min(b, -(-a // _ALIGN) * _ALIGN)  # the first block boundary in [a, b], else b
        hi = max(lo, b // _ALIGN * _ALIGN)  # the last one
        if lo > a:
            self._edge(a, mv[: lo - a])
        for pos in range(lo, hi, self._chunk):
            shared.submit(self, mv[pos - a:min(hi, pos + self._chunk) - a], pos)
        if hi < b:
            self._edge(hi, mv[hi - a:])

    def _cover(self, a: int, b: int) -> None:
        """Add [a, b) to the bytes written (kept as sorted, merged spans); bytes written twice are an error."""
        if a == b:
            return
        spans = self._spans
        i = bisect.bisect_right(spans, [a, b])
        if (i and spans[i - 1][1] > a) or (i < len(spans) and spans[i][0] < b):
            raise MConvertError(f"internal: {self.path.name}: bytes [{a}, {b}) written more than once")
        if i and spans[i - 1][1] == a:
            i -= 1
            a = spans[i][0]
            del spans[i]
        if i < len(spans) and spans[i][0] == b:
            b = spans[i][1]
            del spans[i]
        spans.insert(i, [a, b])

    def _follow(self, a: int, mv: memoryview) -> None:
        """Feed the chained digest: bytes at the front now, small ones ahead of it once it gets there. The
        front stops at the first byte of a write ahead that was not kept (`close` reads from there on)."""
        if not len(mv):
            return
        if a == self._front:
            self._h.update(mv)
            self._front += len(mv)
            while self._front in self._ahead:
                kept = self._ahead.pop(self._front)
                self._ahead_bytes -= len(kept)
                self._h.update(kept)
                self._front += len(kept)
        elif a > self._front and a < self._far:
            if self._ahead_bytes + len(mv) <= AHEAD_KEEP:
                self._ahead[a] = bytes(mv)
                self._ahead_bytes += len(mv)
                return
            self._far = a  # the front stops here; kept bytes beyond it are of no use
            for k in [k for k in self._ahead if k > a]:
                self._ahead_bytes -= len(self._ahead.pop(k))

    def _edge(self, at: int, piece: memoryview) -> None:
        """Bytes of one partly covered block; the block goes to the disk once all of its bytes came."""
        k, off = divmod(at, _ALIGN)
        ent = self._edges.get(k)
        if ent is None:
            ent = self._edges[k] = [bytearray(_ALIGN), 0]
        ent[0][off:off + len(piece)] = piece
        ent[1] += len(piece)
        if ent[1] == min(_ALIGN, self.size - k * _ALIGN):
            del self._edges[k]
            self._block[:] = ent[0]
            write_all(self._fd, memoryview(self._block), self, k * _ALIGN)

    def drain(self) -> None:
        """Wait until every write queued for this file is staged and on the disk (or failed)."""
        with self._cv:
            while self._pending:
                self._cv.wait()

    def close(self) -> str:
        """Finish the writes, cut the file to its size, and return its digest (of `self.algorithm`). A byte
        never written is an error (a bug in the writer: the file would hold zeros there)."""
        try:
            self.drain()
            self._raise()
            if self.size and self._spans != [[0, self.size]]:
                gap = self._spans[0][1] if self._spans and self._spans[0][0] == 0 else 0
                raise MConvertError(f"internal: {self.path.name}: byte {gap} of its {self.size} never written")
            os.ftruncate(self._fd, self.size)  # the padding of a last block written whole
        finally:
            self._close_fd()
        return self._digest()

    def catch_up(self, stop: int) -> None:
        """Move the digest's front to `stop` (every byte before it written) where writes ahead of the front
        stopped it: once those writes are on the disk, their bytes are read back and hashed now rather than at
        `close`, so only what was written out of order is read again. Nothing is read where the front is not
        stopped (it follows the writes itself) or is already there; the caller waits for the writes either way."""
        self.drain()  # the digest is fed on the staging thread: its front is known once the writes are staged
        self._raise()
        if self._far == self.size or stop <= self._front:
            return
        k = stop // _ALIGN  # the block at `stop`: in memory while some of its bytes are still to come
        on_disk = stop // _ALIGN * _ALIGN if self.direct and k in self._edges else stop
        if on_disk > self._front:
            self._read_back(on_disk)
        if stop > self._front:  # the rest lies in that block
            self._h.update(memoryview(self._edges[k][0])[self._front - k * _ALIGN:stop - k * _ALIGN])
            self._front = stop
        self._far = self.size
        for k in [k for k in self._ahead if k < stop]:
            self._ahead_bytes -= len(self._ahead.pop(k))
        while self._front in self._ahead:
            kept = self._ahead.pop(self._front)
            self._ahead_bytes -= len(kept)
            self._h.update(kept)
            self._front += len(kept)

    def _digest(self) -> str:
        """The chained digest, the bytes from the front on read back from the file (O_DIRECT when written so:
        from a block boundary, the bytes before the front skipped)."""
        if self._front < self.size:
            self._read_back(self.size)
        return self._h.hexdigest()

    def _read_back(self, stop: int) -> None:
        """Hash the file's bytes from the front to `stop` (the file's end, or a block boundary when O_DIRECT)
        as read back from it."""
        fd = -1
        if self.direct:
            try:
                fd = os.open(self.path, os.O_RDONLY | os.O_DIRECT)
            except OSError:
                fd = -1
        start = self._front // _ALIGN * _ALIGN if fd >= 0 else self._front
        if fd < 0:
            fd = os.open(self.path, os.O_RDONLY)
        buf = _take_chunk(self._chunk)
        mv = memoryview(buf)
        try:
            pos = start
            while pos < stop:
                try:
                    k = os.preadv(fd, [mv[:min(len(mv), pad_block(stop - pos))]], pos)
                except OSError as e:
                    if e.errno != errno.EINVAL or pos != start or start == self._front:
                        raise
                    os.close(fd)  # the file system refuses O_DIRECT reads: through the page cache
                    fd = os.open(self.path, os.O_RDONLY)
                    start = pos = self._front
                    continue
                if k <= 0:
                    raise MConvertError(f"{self.path}: ends at byte {pos:,} while its digest is taken")
                skip = max(0, self._front - pos)
                self._h.update(mv[skip:min(k, stop - pos)])
                pos += k
            self._front = stop
        finally:
            mv.release()
            os.close(fd)
            _give_chunk(buf)

    def abort(self) -> None:
        """Stop after a failure without judging the file (it is removed with the rest of the output)."""
        self._error = self._error or MConvertError("aborted")
        self.drain()
        self._close_fd()


def pad_block(n: int) -> int:
    """`n` rounded up to whole 4 KiB blocks (an O_DIRECT read's length)."""
    return -(-n // _ALIGN) * _ALIGN


class Checksum:
    """A CRC-32 the writer thread fills in (`HashingFile.write(..., crc=)`): zip records need the CRC of bytes
    that are hashed on that thread anyway."""

    __slots__ = ("value", "keep")

    def __init__(self) -> None:
        self.value: int | None = None
        self.keep: Any = None


class _Staged:
    """The row-major bytes of a buffer or tensor, copied piece by piece into staging memory (`copy_into`). A
    tensor whose rows are contiguous but not adjacent (a row-split TP shard, a view of its merged parameter)
    is gathered row by row by torch's copy, without a contiguous copy first; any other layout is made
    contiguous once (`buffers.contiguous`)."""

    def __init__(self, data: "memoryview | torch.Tensor") -> None:
        self.rows: torch.Tensor | None = None
        self.flat: memoryview | None = None
        if is_tensor(data):
            import torch

            from mconvert.io import buffers

            t = data.detach()
            if t.dim() == 2 and not t.is_contiguous() and t.stride(1) == 1 and t.shape[0] > 1 and t.shape[1] \
                    and t.device.type == "cpu":
                self.rows = t.view(torch.uint8)  # [R, row bytes], rows at their stride
                self.width = self.rows.shape[1]
                self.nbytes = self.rows.numel()
                return
            data = tensor_bytes(buffers.contiguous(t))  # contiguous already, else one copy here (reused memory)
        self.flat = data
        self.nbytes = len(data)

    def whole(self) -> memoryview:
        """All the bytes at once (a buffered file writes them as they are)."""
        if self.flat is None:
            assert self.rows is not None
            from mconvert.io import buffers

            self.flat = tensor_bytes(buffers.contiguous(self.rows))
        return self.flat

    def copy_into(self, chunk: Any, at: int, pos: int, n: int) -> None:
        """chunk[at:at + n] = the bytes [pos, pos + n) of the data."""
        if self.flat is not None:
            _memmove(chunk, at, self.flat[pos:pos + n])
            return
        assert self.rows is not None
        import torch

        dst = torch.frombuffer(chunk, dtype=torch.uint8, count=n, offset=at)
        w, done = self.width, 0
        r, o = divmod(pos, w)
        if o:  # the end of a row the previous piece began
            k = min(w - o, n)
            dst[:k].copy_(self.rows[r, o:o + k])
            done, r = k, r + 1
        full = (n - done) // w
        if full:  # whole rows: one strided copy (torch releases the GIL)
            dst[done:done + full * w].view(full, w).copy_(self.rows[r:r + full])
            done, r = done + full * w, r + full
        if done < n:  # the start of a row the next piece ends
            dst[done:n].copy_(self.rows[r, :n - done])
        del dst


def write_all(fd: int, mv: memoryview, owner: HashingFile | None = None, at: int | None = None) -> None:
    """os.write (os.pwrite at file offset `at`) until every byte of `mv` is written; an O_DIRECT `owner` whose
    file system refuses the write (EINVAL) is switched to buffered writes and the write retried."""
    done = 0
    while done < len(mv):
        try:
            done += os.write(fd, mv[done:]) if at is None else os.pwrite(fd, mv[done:], at + done)
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

