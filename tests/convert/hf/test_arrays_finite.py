"""`convert/hf/arrays.all_finite` (the NaN/Inf check of every tensor `hf-to-gguf` reads as numpy arrays) against
numpy's own `isfinite`, on every float16 and bfloat16 bit pattern, across its slices and its reused mask."""

from __future__ import annotations

import numpy as np
import pytest

from mconvert.convert.hf import arrays


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_all_finite_agrees_with_isfinite_on_every_bit_pattern(monkeypatch, dtype):
    monkeypatch.setattr(arrays, "FINITE_SLICE", 1000)  # several slices per tensor, a short last one
    bits = np.arange(1 << 16, dtype=np.uint16)
    as_float = bits.view(np.float16) if dtype == "float16" else (bits.astype(np.uint32) << 16).view(np.float32)
    finite = np.isfinite(as_float)
    assert arrays.all_finite(bits[finite], dtype)
    rng = np.random.default_rng(0)
    for bad in rng.choice(np.flatnonzero(~finite), 40, replace=False):
        for at in (0, 999, 1000, 4321):  # a slice's first and last value, the next slice's first, the last one
            x = rng.choice(bits[finite], 4322)
            x[at] = bad
            assert arrays.all_finite(x, dtype) is False, (hex(bad), at)
            assert arrays.all_finite(np.delete(x, at), dtype) is True  # the same thread's mask, reused
