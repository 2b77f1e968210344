"""The read-buffer pool (issue 7) never hands out memory that anything still references."""

from __future__ import annotations

import torch

from mconvert.convert.stream import BufferPool


def test_pool_reuses_only_unreferenced_buffers() -> None:
    pool = BufferPool(cap=64 << 20)
    n = 4 << 20
    a = pool.get(n)
    a.fill_(1)
    b = pool.get(n)  # `a` is alive: must be other memory
    assert a.data_ptr() != b.data_ptr()
    view = a.view(torch.float32)[10:20]
    del a
    c = pool.get(n)  # a view of `a`'s storage is alive
    assert c.data_ptr() != view.untyped_storage().data_ptr()
    arr = b.numpy()
    del b
    d = pool.get(n)  # numpy array of `b` is alive
    assert d.data_ptr() != arr.ctypes.data
    ptr = view.untyped_storage().data_ptr()
    del view
    e = pool.get(n)  # now the first buffer is free again and reused
    assert e.data_ptr() == ptr
    assert e.numel() == n and e.untyped_storage().nbytes() == n


def test_pool_cap_lets_idle_buffers_go() -> None:
    pool = BufferPool(cap=8 << 20)
    for k in range(1, 6):
        x = pool.get(k << 20)
        del x
    assert sum(b.numel() for b in pool._bufs) <= (8 << 20) + (5 << 20)
