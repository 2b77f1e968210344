"""Measured collectives: every collective the trainer calls goes through here and is counted.

Each wrapper records (collective, group) -> calls, bytes, seconds, so `--comm-report` shows which
collective each layer really needed instead of describing it. Bytes are the payload of this rank's
tensor (for all-gather: the gathered output; for send/recv: the tensor moved).
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from rich.table import Table

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "send/recv", "broadcast")
GROUPS = ("TP", "PP", "DP", "embedding", "EP", "EDP")


@dataclass
class CommStats:
    """Per-rank tally: (collective, group) -> [calls, bytes, seconds]."""

    table: dict[tuple[str, str], list[float]] = field(default_factory=lambda: defaultdict(lambda: [0, 0, 0.0]))
    enabled: bool = True

    def add(self, op: str, group: str, nbytes: int, seconds: float) -> None:
        if self.enabled:
            row = self.table[(op, group)]
            row[0] += 1
            row[1] += nbytes
            row[2] += seconds

    def rows(self) -> list[tuple[str, str, int, int, float]]:
        return [(op, g, int(v[0]), int(v[1]), float(v[2])) for (op, g), v in sorted(self.table.items())]

    def reset(self) -> None:
        self.table.clear()


STATS = CommStats()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class _Timer:
    def __init__(self, op: str, group: str, nbytes: int) -> None:
        self.op, self.group, self.nbytes = op, group, nbytes

    def __enter__(self) -> "_Timer":
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        STATS.add(self.op, self.group, self.nbytes, time.perf_counter() - self.t0)


def all_reduce(t: torch.Tensor, group: Any, name: str, op: Any = None) -> torch.Tensor:
    """In-place all-reduce (sum by default) over `group`, counted under `name`."""
    if group is None:
        return t
    with _Timer("all-reduce", name, _nbytes(t)):
        dist.all_reduce(t, op=op or dist.ReduceOp.SUM, group=group)
    return t


def all_gather(t: torch.Tensor, group: Any, name: str, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's `t` along `dim` (rank order of the group)."""
    if group is None:
        return t
    n = dist.get_world_size(group)
    parts = [torch.empty_like(t) for _ in range(n)]
    with _Timer("all-gather", name, _nbytes(t) * n):
        dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def reduce_scatter(t: torch.Tensor, group: Any, name: str, dim: int = 0) -> torch.Tensor:
    """Sum over ranks; each rank keeps its chunk of the sum along `dim` (rank order of the group)."""
    if group is None:
        return t
    n, r = dist.get_world_size(group), dist.get_rank(group)
    parts = [p.contiguous() for p in t.chunk(n, dim)]
    out = torch.empty_like(parts[r])
    with _Timer("reduce-scatter", name, _nbytes(t)):
        dist.reduce_scatter(out, parts, group=group)
    return out


def broadcast(t: torch.Tensor, src: int, group: Any, name: str) -> torch.Tensor:
    """In-place broadcast from global rank `src` to `group`."""
    if group is None:
        return t
    with _Timer("broadcast", name, _nbytes(t)):
        dist.broadcast(t, src=src, group=group)
    return t


def p2p(sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]], name: str = "PP") -> None:
    """Batched point-to-point: post every isend/irecv, then wait for all (deadlock-free both ways at once)."""
    if not sends and not recvs:
        return
    nbytes = sum(_nbytes(t) for t, _ in sends) + sum(_nbytes(t) for t, _ in recvs)
    with _Timer("send/recv", name, nbytes):
        ops = [dist.P2POp(dist.isend, t.contiguous(), peer) for t, peer in sends]
        ops += [dist.P2POp(dist.irecv, t, peer) for t, peer in recvs]
        for req in dist.batch_isend_irecv(ops):
            req.wait()


def gather_report(stats: CommStats | None = None) -> list[tuple[str, str, int, int, float, int]] | None:
    """Collect every rank's tally on global rank 0 (not counted): rows summed over ranks, with rank count."""
    stats = stats or STATS
    mine = stats.rows()
    everyone: list[Any] = [None] * dist.get_world_size() if dist.is_initialized() else [mine]
    if dist.is_initialized():
        was = stats.enabled
        stats.enabled = False
        dist.all_gather_object(everyone, mine)
        stats.enabled = was
        if dist.get_rank() != 0:
            return None
    agg: dict[tuple[str, str], list[float]] = {}
    for rows in everyone:
        for op, g, calls, nbytes, secs in rows:
            a = agg.setdefault((op, g), [0, 0, 0.0, 0])
            a[0] += calls
            a[1] += nbytes
            a[2] += secs
            a[3] += 1
    order = {c: i for i, c in enumerate(COLLECTIVES)}
    gorder = {g: i for i, g in enumerate(GROUPS)}
    keys = sorted(agg, key=lambda k: (order.get(k[0], 99), gorder.get(k[1], 99)))
    return [(op, g, int(agg[(op, g)][0]), int(agg[(op, g)][1]), float(agg[(op, g)][2]), int(agg[(op, g)][3]))
            for op, g in keys]


def render_report(rows: list[tuple[str, str, int, int, float, int]], title: str = "communication") -> Any:
    """A rich Table: one row per (collective, group) with calls, bytes and seconds summed over ranks."""
    table = Table(title=title)
    for col, just in (("collective", "left"), ("group", "left"), ("ranks", "right"), ("calls", "right"),
                      ("bytes", "right"), ("seconds", "right")):
        table.add_column(col, justify=just)  # type: ignore[arg-type]
    seen = {(r[0], r[1]) for r in rows}
    for op, g, calls, nbytes, secs, ranks in rows:
        table.add_row(op, g, str(ranks), str(calls), _human(nbytes), f"{secs:.3f}")
    for op in COLLECTIVES:
        if not any(s[0] == op for s in seen):
            table.add_row(op, "-", "0", "0", "0 B", "0.000")
    return table


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)
