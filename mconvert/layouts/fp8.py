"""Block-scaled FP8 HF checkpoints as a layout (DeepSeek-V3's release, see `convert/hf/fp8.py` for the block
math): which weights are stored as `float8_e4m3fn`, the float32 `<name>_scale_inv` beside each and its shape,
and their bytes — from names and shapes alone, without torch."""

from __future__ import annotations

import math

SCALE_SUFFIX = "_scale_inv"
DEFAULT_BLOCK = (128, 128)
UNQUANTIZED_PROJ = "eh_proj"


def quantized_name(name: str) -> bool:
    """Whether HF weight `name` belongs to a linear projection that block-scaled FP8 stores quantized: the
    attention and MLP projections (`*_proj`, MLA's `kv_a_proj_with_mqa`, Mixtral's expert `w1/w2/w3`); never
    embeddings, `lm_head`, norms, biases or MoE routers (`mlp.gate`, which DeepSeek's release keeps in bf16), nor
    an MTP layer's `eh_proj`: vLLM's DeepSeek and GLM MTP models build it as a plain torch Linear, which would
    take e4m3 bytes as values and leave the scale unread."""
    if not name.endswith(".weight"):
        return False
    module = name[: -len(".weight")].rsplit(".", 1)[-1]
    return module != UNQUANTIZED_PROJ and (module.endswith(("_proj", "_proj_with_mqa")) or module in ("w1", "w2", "w3"))


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    """`scale_inv`'s shape: one float32 per (possibly partial) block."""
    rows, cols = shape
    return math.ceil(rows / block[0]), math.ceil(cols / block[1])


def stored_bytes(name: str, shape: tuple[int, ...], itemsize: int, block: tuple[int, int]) -> tuple[int, int]:
    """(bytes, tensors) HF weight `name` of `shape` takes in a block-scaled FP8 checkpoint whose other tensors
    have `itemsize`: a quantized projection is one byte an element plus its float32 scales."""
    numel = math.prod(shape)
    if quantized_name(name) and len(shape) == 2:
        return numel + 4 * math.prod(scale_shape(shape, block)), 2
    return numel * itemsize, 1
