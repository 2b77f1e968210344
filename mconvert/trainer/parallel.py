"""TP × PP × DP (× EP inside DP) process groups in Megatron's rank order.

Global rank = tp + TP · (dp + DP · pp): tensor-parallel ranks are adjacent (fastest), then data
parallel, then pipeline stages — Megatron's default "tp-cp-ep-dp-pp" order with cp = 1, so a
checkpoint written here names the same ranks Megatron would.

Experts follow megatron-core's expert rank generator (expert TP = TP): the same global rank reads
etp + TP · (ep + EP · (edp + DP/EP · pp)), so inside a stage the data-parallel index splits into
ep = dp mod EP (adjacent DP ranks form an expert-parallel group) and edp = dp div EP (the
expert-data-parallel replica). EP must divide DP; world = TP · PP · DP as without experts.
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


def expert_coords(dp_rank: int, ep: int) -> tuple[int, int]:
    """Data-parallel index -> (ep_rank, expert-data-parallel rank), megatron-core's tp-ep-dp-pp order."""
    return dp_rank % ep, dp_rank // ep


def check_expert_layout(dp: int, ep: int) -> None:
    """EP groups live inside the data-parallel ranks of a stage (expert TP = TP): EP must divide DP."""
    if ep < 1 or dp % ep:
        raise MConvertError(
            f"--ep {ep} must divide DP={dp}: expert-parallel ranks are data-parallel ranks of the dense layers "
            "(megatron-core's order, expert TP = TP); raise --dp or lower --ep"
        )


def group_ranks(tp: int, dp: int, pp: int, ep: int = 1) -> dict[str, list[list[int]]]:
    """Every group of every kind, as lists of global ranks (the order all ranks create them in).

    EP: the ranks holding different experts of one replica; EDP: the replicas of the same experts."""
    check_expert_layout(dp, ep)
    out: dict[str, list[list[int]]] = {"TP": [], "DP": [], "PP": [], "embedding": [], "EP": [], "EDP": []}
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
    for p in range(pp):
        for r in range(dp // ep):
            for t in range(tp):
                out["EP"].append([global_rank(t, e + ep * r, p, tp, dp) for e in range(ep)])
        for e in range(ep):
            for t in range(tp):
                out["EDP"].append([global_rank(t, e + ep * r, p, tp, dp) for r in range(dp // ep)])
    return out


@dataclass
class ParallelState:
    """This rank's place in the TP × PP × DP grid and its process groups (None when a group has one rank)."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    rank: int = 0
    ep: int = 1  # expert-parallel size (divides dp)
    tp_group: Any = None
    dp_group: Any = None
    pp_group: Any = None
    embedding_group: Any = None
    ep_group: Any = None  # same stage, TP rank and replica; different experts
    edp_group: Any = None  # same stage, TP rank and experts; the replicas expert gradients are summed over
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
    def ep_rank(self) -> int:
        return expert_coords(self.dp_rank, self.ep)[0]

    @property
    def edp_rank(self) -> int:
        return expert_coords(self.dp_rank, self.ep)[1]

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
                     sequence_parallel: bool = False, ep: int = 1) -> ParallelState:
    """Join the launcher's process group (env://) and build every TP/DP/PP/embedding/EP/EDP group."""
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
    st = ParallelState(tp=tp, pp=pp, dp=dp, rank=rank, ep=ep, device=dev,
                       sequence_parallel=sequence_parallel and tp > 1)
    for kind, lists in group_ranks(tp, dp, pp, ep).items():
        for ranks in lists:
            g = dist.new_group(ranks)  # every rank creates every group, in the same order
            if rank in ranks:
                if kind == "PP":
                    st.pp_ranks = tuple(ranks)
                if kind == "TP":
                    st.tp_ranks = tuple(ranks)
                if len(ranks) > 1:
                    setattr(st, {"TP": "tp_group", "DP": "dp_group", "PP": "pp_group",
                                 "embedding": "embedding_group", "EP": "ep_group", "EDP": "edp_group"}[kind], g)
    return st


def shutdown() -> None:
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
