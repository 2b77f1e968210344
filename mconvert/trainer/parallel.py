"""TP × PP × DP process groups in Megatron's rank order.

Global rank = tp + TP · (dp + DP · pp): tensor-parallel ranks are adjacent (fastest), then data
parallel, then pipeline stages — Megatron's default "tp-cp-ep-dp-pp" order with cp = ep = 1, so a
checkpoint written here names the same ranks Megatron would.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from mconvert.errors import MConvertError


def global_rank(tp_rank: int, dp_rank: int, pp_rank: int, tp: int, dp: int) -> int:
    """Megatron's order: TP fastest, then DP, then PP."""
    return tp_rank + tp * (dp_rank + dp * pp_rank)


def coords(rank: int, tp: int, dp: int, pp: int) -> tuple[int, int, int]:
    """Global rank -> (tp_rank, dp_rank, pp_rank); inverse of `global_rank`."""
    if not 0 <= rank < tp * dp * pp:
        raise MConvertError(f"rank {rank} outside world of TP={tp}×DP={dp}×PP={pp}")
    return rank % tp, (rank // tp) % dp, rank // (tp * dp)


def group_ranks(tp: int, dp: int, pp: int) -> dict[str, list[list[int]]]:
    """Every group of every kind, as lists of global ranks (the order all ranks create them in)."""
    out: dict[str, list[list[int]]] = {"TP": [], "DP": [], "PP": [], "embedding": []}
    for p in range(pp):
        for d in range(dp):
            out["TP"].append([global_rank(t, d, p, tp, dp) for t in range(tp)])
    for p in range(pp):
        for t in range(tp):
            out["DP"].append([global_rank(t, d, p, tp, dp) for d in range(dp)])
    for d in range(dp):
        for t in range(tp):
            ranks = [global_rank(t, d, p, tp, dp) for p in range(pp)]
            out["PP"].append(ranks)
            if pp > 1:
                out["embedding"].append([ranks[0], ranks[-1]])
    return out


@dataclass
class ParallelState:
    """This rank's place in the TP × PP × DP grid and its process groups (None when a group has one rank)."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    rank: int = 0
    tp_group: Any = None
    dp_group: Any = None
    pp_group: Any = None
    embedding_group: Any = None
    pp_ranks: tuple[int, ...] = (0,)
    tp_ranks: tuple[int, ...] = (0,)
    device: torch.device = torch.device("cpu")
    sequence_parallel: bool = False  # activations outside attention/MLP split along the sequence over TP

    @property
    def tp_rank(self) -> int:
        return coords(self.rank, self.tp, self.dp, self.pp)[0]

    @property
    def dp_rank(self) -> int:
        return coords(self.rank, self.tp, self.dp, self.pp)[1]

    @property
    def pp_rank(self) -> int:
        return coords(self.rank, self.tp, self.dp, self.pp)[2]

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def prev_rank(self) -> int:
        return self.pp_ranks[self.pp_rank - 1]

    @property
    def next_rank(self) -> int:
        return self.pp_ranks[self.pp_rank + 1]


def backend_for(device: str | None = None) -> str:
    """NCCL when CUDA is there (and asked for), gloo otherwise."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return "nccl" if device.startswith("cuda") else "gloo"


def init_distributed(tp: int, pp: int, dp: int, device: str | None = None, timeout_s: int = 600,
                     sequence_parallel: bool = False) -> ParallelState:
    """Join the launcher's process group (env://) and build every TP/DP/PP/embedding group."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != tp * pp * dp:
        raise MConvertError(f"world size {world} != TP={tp} × PP={pp} × DP={dp}; launch TP·PP·DP processes")
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    backend = backend_for(device)
    dev = torch.device("cpu")
    if backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    rank = dist.get_rank()
    st = ParallelState(tp=tp, pp=pp, dp=dp, rank=rank, device=dev, sequence_parallel=sequence_parallel and tp > 1)
    for kind, lists in group_ranks(tp, dp, pp).items():
        for ranks in lists:
            g = dist.new_group(ranks)  # every rank creates every group, in the same order
            if rank in ranks:
                if kind == "PP":
                    st.pp_ranks = tuple(ranks)
                if kind == "TP":
                    st.tp_ranks = tuple(ranks)
                if len(ranks) > 1:
                    setattr(st, {"TP": "tp_group", "DP": "dp_group", "PP": "pp_group",
                                 "embedding": "embedding_group"}[kind], g)
    return st


def shutdown() -> None:
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
