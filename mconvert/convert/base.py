"""The contract between format adapters: a Source yields one unit (embedding, a layer, final) at a time.

Pivot (DESIGN.md): full, unsharded tensors. `read_mcore(unit)` gives them under canonical megatron-core
local-spec names (global layer index, vocab rows as stored — padded for a Megatron source);
`read_hf(unit)` gives them under HF names through the family plugin (vocab rows = the true vocab).
Writers consume units one by one, so peak memory is one unit's shards plus the output buffer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, Union

import torch

from mconvert.spec import ModelSpec

Unit = Union[str, int]  # "embedding", 0 .. num_layers-1, "final"


def units_of(spec: ModelSpec) -> list[Unit]:
    return ["embedding", *range(spec.num_layers), "final"]


class Source(Protocol):
    path: Path
    format: str  # "megatron" | "megatron-torch_dist" | "hf"
    spec: ModelSpec
    tokenizer_dir: Path | None  # where tokenizer files live, when known

    def units(self) -> list[Unit]: ...

    def read_mcore(self, unit: Unit) -> dict[str, torch.Tensor]: ...

    def read_hf(self, unit: Unit) -> dict[str, torch.Tensor]: ...
