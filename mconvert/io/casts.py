"""Casts and finite checks of tensors: `all_finite` and `value_range` (one reduction pass), `narrowed` (the
`--dtype` cast, refused where a finite value would become Inf) and `check_narrowed` (the same refusal for a cast
a writer made itself). Every source and writer that casts or checks values calls these."""

from __future__ import annotations

import math

import torch

from mconvert import dtypes
from mconvert.errors import MConvertError


def all_finite(t: torch.Tensor, chunk: int = 1 << 24) -> bool:
    """No NaN/Inf in `t`. One reduction pass, no temporary mask: min and max are both finite exactly when
    every element is (a NaN propagates into both, +Inf is the max, -Inf the min), without the temporary
    boolean tensor of `isfinite().all()`. `chunk` is kept for callers that pass it."""
    if not t.is_floating_point():  # integers are finite; complex keeps the elementwise check
        return t.numel() == 0 or bool(torch.isfinite(t).all())
    lo, hi = value_range(t)
    return math.isfinite(lo) and math.isfinite(hi)  # two scalars: Python's test, no torch op


def narrowed(t: torch.Tensor, dtype: torch.dtype, name: str) -> torch.Tensor:
    """`t.to(dtype)` for `--dtype`, refused where the target type turns a finite value into Inf (float16 holds
    magnitudes up to 65504; the source's values are already checked finite)."""
    out = t.to(dtype)
    check_narrowed(t, out, name)
    return out


def check_narrowed(src: torch.Tensor, out: torch.Tensor, name: str,
                   fix: str = "convert to bf16 (--dtype bf16) or keep the source's dtype (--dtype auto)") -> None:
    """Refuse `out`, the cast of finite `src` to a floating type of smaller range, when a value overflowed to
    Inf: one line naming the tensor, its largest magnitude and `fix`. A cast that keeps the range passes
    unchecked."""
    if not (src.is_floating_point() and out.is_floating_point()) or out.device.type == "meta":  # a layout preview
        return
    top = torch.finfo(out.dtype).max
    if top >= torch.finfo(src.dtype).max or all_finite(out):
        return
    big = float(src.detach().abs().max())
    raise MConvertError(f"{name}: holds values up to {big:.6g}, beyond what {dtypes.of_torch(out.dtype).name} holds "
                        f"(±{top:g}), so they would be stored as Inf; {fix}")


def value_range(t: torch.Tensor) -> tuple[float, float]:
    """(min, max) of a floating-point tensor in one reduction pass; NaN in both when any element is NaN
    (`all_finite`'s pass, for a caller that also wants the sign). (0.0, 0.0) when it is empty."""
    if t.numel() == 0:
        return 0.0, 0.0
    lo, hi = torch.aminmax(t.reshape(-1))
    return lo.item(), hi.item()
