"""Reused, resident memory for the tensors a conversion reads and re-lays: no fresh pages per tensor.

A new buffer costs a page fault and a zeroed page per 4 KiB on first touch (on a VM that returns freed memory
to its host, a host-side fault as well), and the bytes a conversion reads or merges are written exactly once
before they are used, so the zeroing buys nothing. `empty(shape, dtype)` hands out a tensor over a slot of a
process-wide pool of anonymous mappings; the slot goes back to the pool when the last tensor viewing it is
freed (its numpy owner's finalizer), never before: every view, the writer's queued bytes included, holds the
owner. A tensor takes an idle slot of its size, else the smallest idle one up to FIT times larger, else the
largest smaller idle one grown to its size (its resident pages kept); the pool holds at most a quarter more
bytes than were ever live at once (idle slots are unmapped, least recently used first, to stay within that).
"""

from __future__ import annotations

import math
import mmap
import os
import threading
import weakref
from collections import OrderedDict, deque
from typing import TYPE_CHECKING

import numpy

if TYPE_CHECKING:
    import torch

MIN_BYTES = 1 << 20  # smaller tensors come from the allocator: their pages are reused by malloc already
# Idle slots may exceed the largest live total by 1/SLACK of it: a conversion lends slots of a few sizes in a
# changing mix, and with no slack each miss evicts a slot the next tensor of that size needs (fresh pages)
SLACK = 4
# A tensor with no idle slot of its size takes the smallest idle slot up to FIT times its size (the rest of the
# slot stays unused while it is lent) rather than new memory: a pool of exact sizes only misses at every change
# of the mix (hf-to-megatron's merged weights, their transposes and their TP shards)
FIT = 4
_PAGE = mmap.PAGESIZE


class BufferPool:
    """Slots of anonymous memory, each reused for tensors of its size, or up to FIT times smaller.

    Bytes are accounted per slot: `live` are lent out, `idle` wait in the pool; `live + idle` never exceeds
    the largest `live` seen (what the process's own allocator would have held at that moment) by more than
    1/SLACK of it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: OrderedDict[int, mmap.mmap] = OrderedDict()  # id -> slot, least recently returned first
        self._returned: deque[mmap.mmap] = deque()  # freed by a finalizer, not yet idle
        self.live = 0
        self.idle = 0
        self.high = 0  # the largest `live` so far
        self.reused = 0  # slots handed out again (tests, bench)
        self.mapped = 0  # slots created
        self.grown = 0  # idle slots grown for a larger tensor

    def array(self, shape: tuple[int, ...] | list[int], dtype: numpy.dtype) -> numpy.ndarray:
        """An uninitialised contiguous numpy array of `shape` and `dtype` over a pooled slot: every view of it
        (a tensor over it too) holds the slot's owner, whose finalizer gives the slot back."""
        shape = tuple(int(d) for d in shape)
        n = math.prod(shape) * numpy.dtype(dtype).itemsize
        slot = self._take(n)
        owner = numpy.frombuffer(slot, dtype=numpy.uint8, count=n) if n else numpy.empty(0, numpy.uint8)
        weakref.finalize(owner, self._give, slot)
        return owner.view(dtype).reshape(shape)

    def empty(self, shape: tuple[int, ...] | list[int] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised contiguous CPU tensor of `shape` and `dtype` over a pooled slot."""
        import torch

        shape = tuple(int(d) for d in shape)
        n = math.prod(shape) * dtype.itemsize
        return torch.from_numpy(self.array((n,), numpy.dtype(numpy.uint8))).view(dtype).view(shape)

    def _take(self, n: int) -> mmap.mmap:
        size = max(_PAGE, -(-n // _PAGE) * _PAGE)
        with self._lock:
            self._drain()
            best = next((k for k, s in reversed(self._idle.items()) if len(s) == size), None)
            if best is None:  # else the smallest idle slot that holds it, if it is not FIT times too large
                fits = [(len(s), k) for k, s in self._idle.items() if size < len(s) <= FIT * size]
                best = min(fits)[1] if fits else None
            if best is not None:
                slot = self._idle.pop(best)
                self.idle -= len(slot)
                self.live += len(slot)
                self.reused += 1
                self.high = max(self.high, self.live)
                return slot
            slot = self._grown(size)
            if slot is not None:
                return slot
            self.live += size
            self.high = max(self.high, self.live)
            self._evict()
            self.mapped += 1
        # private: anonymous shared memory is shmem, where transparent huge pages are usually off
        slot = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if size >= (2 << 20) and hasattr(mmap, "MADV_HUGEPAGE") and os.environ.get("THP_MEM_ALLOC_ENABLE") == "1":
            try:
                slot.madvise(mmap.MADV_HUGEPAGE)  # as torch's own large buffers under the CLI: fewer faults
            except OSError:
                pass
        return slot

    def _grown(self, size: int) -> mmap.mmap | None:
        """(lock held) The largest idle slot smaller than `size`, grown to it (mremap): its pages are resident
        already, so only the extension is new memory, where a new slot of `size` would be new throughout and
        the idle one unmapped later. None when no slot is idle or none can be grown now."""
        smaller = [(len(s), k) for k, s in self._idle.items() if len(s) < size]
        if not smaller:
            return None
        was, key = max(smaller)
        slot = self._idle[key]
        try:
            slot.resize(size)
        except (BufferError, OSError, ValueError, SystemError):  # a dying view still exports it, or no mremap
            return None
        del self._idle[key]
        self.idle -= was
        self.live += size
        self.grown += 1
        self.high = max(self.high, self.live)
        self._evict()
        return slot

    def _evict(self) -> None:
        """(lock held) Unmap idle slots, least recently returned first, until the pool is within its bound."""
        while self._idle and self.live + self.idle > self.high + self.high // SLACK:
            _, old = self._idle.popitem(last=False)
            self.idle -= len(old)
            del old  # unmapped with its last reference (a dying view may still hold it a moment)

    def _give(self, slot: mmap.mmap) -> None:
        """(finalizer) The last tensor over `slot` is gone: keep it for the next tensor of its size. A finalizer
        can run inside `_take` (a garbage collection while the lock is held), so the slot is queued and
        taken in whenever the lock is free."""
        self._returned.append(slot)
        if self._lock.acquire(blocking=False):
            try:
                self._drain()
            finally:
                self._lock.release()

    def _drain(self) -> None:
        """(lock held) Move the returned slots to the idle ones."""
        while self._returned:
            slot = self._returned.popleft()
            self.live -= len(slot)
            self._idle[id(slot)] = slot
            self.idle += len(slot)

    def trim(self) -> None:
        """Unmap every idle slot (the conversion is done); the next conversion's bound starts from what is lent
        now."""
        with self._lock:
            self._drain()
            self._idle.clear()  # each slot is unmapped with its last reference
            self.idle = 0
            self.high = self.live


POOL = BufferPool()


def empty(shape: tuple[int, ...] | list[int] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """`torch.empty(shape, dtype=dtype)` for a tensor whose every byte is written before it is read: from the
    pool when it is large (`MIN_BYTES`), else from torch's allocator. `MCONVERT_NO_BUFFER_POOL=1` turns the pool
    off."""
    import torch

    n = math.prod(tuple(shape)) * dtype.itemsize
    if n < MIN_BYTES or _DISABLED:
        return torch.empty(tuple(shape), dtype=dtype)
    return POOL.empty(shape, dtype)


def array(shape: tuple[int, ...], dtype: numpy.dtype) -> numpy.ndarray:
    """`empty` for a numpy array (a reader that needs no torch): pooled when large."""
    n = math.prod(shape) * numpy.dtype(dtype).itemsize
    if n < MIN_BYTES or _DISABLED:
        return numpy.empty(shape, dtype=dtype)
    return POOL.array(shape, dtype)


_DISABLED = bool(os.environ.get("MCONVERT_NO_BUFFER_POOL"))


def contiguous(t: torch.Tensor) -> torch.Tensor:
    """`t.contiguous()`, the copy (when one is needed) in pooled memory: a row-split shard a writer streams, a
    transposed shard a FasterTransformer file holds. A 2-D transposed view (its `.t()` has contiguous rows)
    is copied by `io.transpose.copy_transposed`, the vectorised transpose, not torch's element-wise copy."""
    if t.is_contiguous():
        return t
    out = empty(tuple(t.shape), t.dtype)
    if t.dim() == 2 and t.stride(0) == 1 and t.shape[0] > 1 and t.shape[1] > 1:
        from mconvert.io.transpose import copy_transposed

        return copy_transposed(t.t(), out)
    out.copy_(t)
    return out


def column_major(t: torch.Tensor) -> torch.Tensor:
    """`t` (2-D) with the same values laid out column-major (its `.t()` contiguous) in pooled memory, so the
    transpose its consumer makes next (GPT-2's Conv1D) is free and its bytes land in reused pages; any
    other tensor as it is."""
    from mconvert.io.transpose import transposed

    if t.dim() != 2 or t.t().is_contiguous():
        return t
    return transposed(t, empty).t()
