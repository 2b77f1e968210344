"""This process's place among the torchrun processes of one conversion: read from torchrun's environment,
and set for the conversion in progress by `convert.scaleout` (the bytes layer asks which rank checks an input)."""

from __future__ import annotations

import os
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mconvert.errors import MConvertError


@dataclass(frozen=True)
class World:
    """This process's place among the torchrun processes of one conversion (size 1: not under torchrun)."""

    rank: int = 0
    size: int = 1

    @property
    def primary(self) -> bool:
        """Whether this process writes the shared files and commits."""
        return self.rank == 0

    def owner(self, index: int) -> int:
        """The rank that writes file group `index` (round robin: neighbouring groups on different ranks)."""
        return index % self.size

    def owns(self, index: int) -> bool:
        return self.owner(index) == self.rank

    def owns_path(self, path: str | Path) -> bool:
        """Whether this rank runs the background check of input file `path` (a stable spread over the ranks)."""
        return zlib.crc32(str(Path(path).resolve()).encode()) % self.size == self.rank


def world_from_env(env: Any = None) -> World:
    """The World that torchrun's environment (WORLD_SIZE, RANK) describes; World() outside torchrun."""
    env = os.environ if env is None else env
    try:
        size = int(env.get("WORLD_SIZE", "1") or 1)
        rank = int(env.get("RANK", "0") or 0)
    except ValueError:
        raise MConvertError(f"WORLD_SIZE={env.get('WORLD_SIZE')!r} RANK={env.get('RANK')!r}: not integers; run "
                            "under torchrun, or unset them") from None
    if size < 1 or not 0 <= rank < size:
        raise MConvertError(f"RANK={rank} WORLD_SIZE={size}: RANK must lie in [0, WORLD_SIZE); run under torchrun, "
                            "or unset them")
    return World(rank, size)


_WORLD: World = World()


@contextmanager
def active_world(w: World) -> Iterator[None]:
    """Make `w` the World of the conversion in progress (`world()`) for the duration of the block."""
    global _WORLD
    outer, _WORLD = _WORLD, w
    try:
        yield
    finally:
        _WORLD = outer


def refuse_torchrun(verb: str) -> None:
    """Refuse `verb` under torchrun when it cannot share its work: every process would write the whole output
    and all but one would find it taken at the commit."""
    if world_from_env().size > 1:
        raise MConvertError(f"{verb} runs in one process and does not share its work over torchrun "
                            "(WORLD_SIZE > 1); run it without torchrun (megatron-to-hf, hf-to-megatron, reshard, "
                            "megatron-to-ft and megatron-to-trtllm run on torchrun)")


def world() -> World:
    """The World of the conversion in progress (World() outside `shared_atomic_output_dir`)."""
    return _WORLD
