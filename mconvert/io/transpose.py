"""The 2-D transposed copy: OpenBLAS's vectorised `somatcopy` (bundled with numpy's wheels) where it is
bit-exact, torch's copy otherwise. The shard math (`mappings.transforms`) and the buffers call it."""

from __future__ import annotations

import ctypes
import glob
import os
import threading
from collections.abc import Callable
from typing import Any

import torch

from mconvert.errors import MConvertError

# ---- 2-D transposes: the one copy GPT-2's Conv1D layout costs per byte ---------------------------------------
# torch copies a transposed float matrix through a scalar 60x60 block loop; OpenBLAS's `somatcopy` (bundled with
# numpy's wheels) runs vectorised kernels instead. It scales by alpha = 1.0, which keeps
# every finite value, infinity and denormal bit for bit (only a signalling NaN would come back quiet, and every
# source refuses NaN before a transpose); a self-test at load time compares it with torch, else torch is used.
_OMATCOPY: Any = None
_OMATCOPY_LOCK = threading.Lock()
_OMATCOPY_CANDIDATES = (  # (library file pattern under numpy's install, symbol), newest numpy first
    ("numpy.libs/libscipy_openblas64_*.so*", "scipy_cblas_somatcopy64_"),
    ("numpy.libs/libopenblas64_*.so*", "cblas_somatcopy64_"),
    ("numpy.libs/libopenblas*.so*", "cblas_somatcopy"),
)


def _load_omatcopy() -> Any:
    """OpenBLAS's cblas_somatcopy from numpy's bundled library, checked against torch on a small matrix with
    denormals, infinities and signed zeros; False when absent or not bit-exact."""
    try:
        import numpy

        root = os.path.dirname(os.path.dirname(numpy.__file__))
    except ImportError:  # pragma: no cover - torch depends on numpy being importable here
        return False
    for pattern, symbol in _OMATCOPY_CANDIDATES:
        for path in sorted(glob.glob(os.path.join(root, pattern))):
            try:
                fn = getattr(ctypes.CDLL(path), symbol)
            except (OSError, AttributeError):
                continue
            fn.restype = None
            fn.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_float,
                           ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64)
            probe = torch.tensor([1e-45, -0.0, float("inf"), -3.4e38, 1.5, -1e-40], dtype=torch.float32)
            a = probe.repeat(70 * 71 // 6 + 1)[: 70 * 71].reshape(70, 71)
            b = torch.empty(71, 70, dtype=torch.float32)
            fn(101, 112, 70, 71, 1.0, a.data_ptr(), 71, b.data_ptr(), 70)  # row-major, transposed
            if torch.equal(b.view(torch.int32), a.t().contiguous().view(torch.int32)):
                return fn
    return False


def _omatcopy() -> Any:
    global _OMATCOPY
    if _OMATCOPY is None:
        with _OMATCOPY_LOCK:
            if _OMATCOPY is None:
                _OMATCOPY = False if os.environ.get("MCONVERT_NO_BLAS_TRANSPOSE") else _load_omatcopy()
    return _OMATCOPY


def vectorised() -> bool:
    """Whether float32 transposes go through OpenBLAS (a caller picks its fused path on it)."""
    return bool(_omatcopy())


def copy_transposed(src: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """`src.t()` of a 2-D `src` [R, C] copied into `out` [C, R] (a slice of a larger matrix or a preallocated
    buffer, rows contiguous) or into a fresh tensor; returns it. float32 goes through OpenBLAS's vectorised
    transpose where available, anything else through torch."""
    if src.dim() != 2:
        raise MConvertError(f"internal: transposed copy of a {src.dim()}-D tensor {tuple(src.shape)}")
    rows, cols = src.shape
    if out is None:
        out = torch.empty((cols, rows), dtype=src.dtype, device=src.device)
    elif tuple(out.shape) != (cols, rows) or out.dtype != src.dtype:
        raise MConvertError(f"internal: transposed copy of {tuple(src.shape)} {src.dtype} into "
                            f"{tuple(out.shape)} {out.dtype}")
    fn = _omatcopy() if src.dtype == torch.float32 and src.numel() >= 4096 else False
    if (fn and src.stride(1) == 1 and out.stride(1) == 1 and src.stride(0) >= cols and out.stride(0) >= rows
            and src.device.type == out.device.type == "cpu"):
        fn(101, 112, rows, cols, 1.0, src.data_ptr(), src.stride(0), out.data_ptr(), out.stride(0))
        return out
    out.copy_(src.t())
    return out


def transposed(t: torch.Tensor, empty: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None = None) -> torch.Tensor:
    """`t.t().contiguous()` of a 2-D tensor (see `copy_transposed`), into `empty(shape, dtype)` when given."""
    return copy_transposed(t, None if empty is None else empty((t.shape[1], t.shape[0]), t.dtype))
