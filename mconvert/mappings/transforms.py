"""Pure shard math: split a full tensor into TP shards and merge them back, per split kind.

No I/O, no torch.distributed. Every function checks element counts so a wrong layout fails loudly
instead of producing a model with wrong outputs. Split kinds are declared in `mconvert.spec`.
"""

from __future__ import annotations

import torch

from mconvert.errors import MConvertError
from mconvert.spec import SPLIT_DIM, SPLIT_KINDS


def _check_kind(kind: str) -> None:
    if kind not in SPLIT_KINDS:
        raise MConvertError(f"unknown split kind {kind!r}")


def split_dim(kind: str, ndim: int) -> int | None:
    """The dim a `kind` parameter of `ndim` dims is split on (row-parallel biases are replicated)."""
    _check_kind(kind)
    d = SPLIT_DIM[kind]
    if d is not None and d >= ndim:
        return None
    return d


def split(full: torch.Tensor, kind: str, tp: int, name: str = "tensor") -> list[torch.Tensor]:
    """Full tensor -> `tp` shards (views where possible; `gated` builds [gate_r; up_r] per rank)."""
    d = split_dim(kind, full.dim())
    if d is None:
        return [full] * tp
    if full.shape[d] % tp:
        raise MConvertError(f"{name}: dim {d} of shape {tuple(full.shape)} is not divisible by TP={tp}")
    if kind == "gated":
        if full.shape[0] % (2 * tp):
            raise MConvertError(f"{name}: gated rows {full.shape[0]} not divisible by 2·TP={2 * tp}")
        gate, up = full.chunk(2, dim=0)
        return [torch.cat([g, u], dim=0) for g, u in zip(gate.chunk(tp, 0), up.chunk(tp, 0))]
    return list(full.chunk(tp, dim=d))


def shard(full: torch.Tensor, kind: str, tp: int, rank: int, name: str = "tensor") -> torch.Tensor:
    """One rank's shard of `full` (what the trainer's layer on that rank holds)."""
    return split(full, kind, tp, name)[rank]


def merge(shards: list[torch.Tensor], kind: str, name: str = "tensor") -> torch.Tensor:
    """TP shards -> full tensor. Shapes must agree across ranks; element counts are checked."""
    if not shards:
        raise MConvertError(f"{name}: no shards to merge")
    shape0 = tuple(shards[0].shape)
    for r, s in enumerate(shards):
        if tuple(s.shape) != shape0:
            raise MConvertError(
                f"{name}: TP rank {r} has shape {tuple(s.shape)} but rank 0 has {shape0}; "
                "the shards do not belong to one checkpoint"
            )
    d = split_dim(kind, shards[0].dim())
    if d is None or len(shards) == 1:
        return shards[0]
    if kind == "gated":
        if shape0[0] % 2:
            raise MConvertError(f"{name}: gated shard has an odd row count {shape0[0]}")
        halves = [s.chunk(2, dim=0) for s in shards]
        full = torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    else:
        full = torch.cat(shards, dim=d)
    total = sum(s.numel() for s in shards)
    assert full.numel() == total, f"{name}: merged {full.numel()} elements from {total}"
    return full
