"""Block-scaled FP8 HF checkpoints (DeepSeek-V3, Kimi K2): `float8_e4m3fn` weights with a float32
`<name>_scale_inv` per block of `weight_block_size` (128×128) — pure block math, no I/O.

The layout (DeepSeek's `inference/kernel.py` `weight_dequant`, transformers' `FP8Linear` and
`FineGrainedFP8HfQuantizer`, vLLM's `Fp8LinearMethod`): `scale_inv` is `[ceil(rows/bm), ceil(cols/bn)]`; the
weight is `q · scale_inv[i // bm, j // bn]`, a partial last block scaled by its own maximum. Quantizing takes
transformers' rule: per block `scale = 448 / max|w|` (float32), `q = clamp(w · scale, ±448)` cast to e4m3,
`scale_inv = 1 / scale`; an all-zero block (which that rule would turn into NaN) gets `scale_inv = 1` and zeros.
config.json says `quantization_config: {quant_method: fp8, fmt: e4m3, activation_scheme: dynamic,
weight_block_size: [bm, bn]}`.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from mconvert.errors import MConvertError
from mconvert.layouts.fp8 import DEFAULT_BLOCK as DEFAULT_BLOCK  # the layout's names, for the callers of this module
from mconvert.layouts.fp8 import SCALE_SUFFIX, quantized_name, scale_shape

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


def block_config(config: Mapping[str, Any], where: str) -> tuple[int, int] | None:
    """The block size of config.json's block-scaled FP8 `quantization_config`; None without one. Any other
    quantization (a method, format, activation scheme or per-tensor scale not read here) is one error naming it."""
    q = config.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict):
        raise MConvertError(f"{where}: quantization_config is {type(q).__name__}, not an object; fix config.json")
    method = q.get("quant_method")
    if method != "fp8":
        raise MConvertError(f"{where}: quantization_config quant_method={method!r} is not read (mconvert reads "
                            "block-scaled FP8, quant_method 'fp8' with weight_block_size); dequantize the model "
                            "with its own tool first")
    if q.get("fmt", "e4m3") != "e4m3":
        raise MConvertError(f"{where}: quantization_config fmt={q.get('fmt')!r} is not read (only e4m3)")
    if q.get("activation_scheme", "dynamic") != "dynamic":
        raise MConvertError(f"{where}: quantization_config activation_scheme={q.get('activation_scheme')!r} "
                            "(static input scales) is not read; only 'dynamic'")
    block = q.get("weight_block_size")
    if block is None:
        raise MConvertError(f"{where}: quantization_config quant_method 'fp8' without weight_block_size (one "
                            "scale per tensor) is not read; only block-scaled FP8")
    if (not isinstance(block, list) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise MConvertError(f"{where}: quantization_config weight_block_size={block!r}; expected two whole "
                            "numbers > 0 like [128, 128]")
    return block[0], block[1]


def hf_quantization_config(block: tuple[int, int], not_converted: list[str]) -> dict[str, Any]:
    """config.json's `quantization_config` for block-scaled FP8 (DeepSeek-V3's keys; `modules_to_not_convert`:
    the linear modules left unquantized, which transformers and vLLM then build unquantized)."""
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": list(block), "modules_to_not_convert": not_converted}


def dequantize(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], dtype: torch.dtype,
               name: str) -> torch.Tensor:
    """`q · scale_inv` per block, into a new `dtype` tensor, one row of blocks at a time (memory: the output and
    one block row in float32)."""
    if q.dim() != 2 or tuple(scale_inv.shape) != scale_shape(tuple(q.shape), block):
        raise MConvertError(f"{name}: an FP8 weight of shape {list(q.shape)} needs a {SCALE_SUFFIX} of shape "
                            f"{list(scale_shape(tuple(q.shape), block)) if q.dim() == 2 else '[2-D]'} for "
                            f"blocks of {list(block)}, found {list(scale_inv.shape)}; the checkpoint is damaged")
    rows, cols = q.shape
    out = torch.empty((rows, cols), dtype=dtype)
    s = scale_inv.float()
    for i, r0 in enumerate(range(0, rows, block[0])):
        r1 = min(r0 + block[0], rows)
        row_scale = s[i].repeat_interleave(block[1])[:cols]
        out[r0:r1] = (q[r0:r1].float() * row_scale).to(dtype)
    return out


def quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, float32 scale_inv) of 2-D `w`, one row of blocks at a time (the module docstring's rule)."""
    rows, cols = w.shape
    bm, bn = block
    q = torch.empty((rows, cols), dtype=FP8)
    scale_inv = torch.empty(scale_shape((rows, cols), block), dtype=torch.float32)
    nb = scale_inv.shape[1]
    for i, r0 in enumerate(range(0, rows, bm)):
        r1 = min(r0 + bm, rows)
        x = w[r0:r1].float()
        padded = torch.nn.functional.pad(x, (0, nb * bn - cols)).view(r1 - r0, nb, bn)
        amax = padded.abs().amax(dim=(0, 2))  # [nb]
        scale = FP8_MAX / amax
        zero = amax == 0
        scale[zero] = 1.0
        full = scale.repeat_interleave(bn)[:cols]
        q[r0:r1] = torch.clamp(x * full, min=-FP8_MAX, max=FP8_MAX).to(FP8)
        scale_inv[i] = scale.reciprocal()
    return q, scale_inv


def quantize_tensors(tensors: Mapping[str, torch.Tensor], block: tuple[int, int]) -> dict[str, torch.Tensor]:
    """HF tensors with each projection weight replaced by its e4m3 weight followed by its `_scale_inv` (meta
    tensors, already planned entries, pass as they are)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if t.is_meta or not quantized_name(name) or t.dim() != 2:
            out[name] = t
            continue
        out[name], out[name + SCALE_SUFFIX] = quantize(t, block)
    return out


def quantized_entries(entries: list[tuple[str, torch.dtype, tuple[int, ...]]],
                      block: tuple[int, int]) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """A writer's planned (name, dtype, shape) entries as `quantize_tensors` turns them."""
    out = []
    for name, dtype, shape in entries:
        if quantized_name(name) and len(shape) == 2:
            out += [(name, FP8, shape), (name + SCALE_SUFFIX, torch.float32, scale_shape(shape, block))]
        else:
            out.append((name, dtype, shape))
    return out


# vLLM's block-FP8 loader (`validate_fp8_block_shape` / `validate_fp8_block_shape_moe`, vllm
# model_executor/layers/quantization/utils/fp8_utils.py) needs each TP rank's slice of a projection to be whole
# blocks: a RowParallelLinear's input slice a multiple of the block's columns; every output slice of a
# ColumnParallelLinear, and every sub-matrix of a merged one (QKVParallelLinear, MergedColumnParallelLinear:
# even at TP=1, all but the last), a multiple of its rows; a fused MoE's intermediate slice a multiple of the rows
# (and, at TP>1, of the columns). How vLLM's model files build each HF projection:
VLLM_ROW_PARALLEL = ("o_proj", "down_proj", "w2")
# merged sub-matrices other than the last one: checked at every TP (MLA's q_a_proj is the first part of
# DeepSeek's fused_qkv_a_proj, which vLLM never splits over TP)
VLLM_MERGED_FIRST = ("gate_proj", "q_a_proj")
VLLM_NOT_SPLIT = ("q_a_proj", "kv_a_proj_with_mqa", "eh_proj")  # ReplicatedLinear, fused_qkv_a_proj (disable_tp),
# DeepSeekMTP's eh_proj (a torch Linear)


def vllm_tp_misfit(name: str, shape: tuple[int, ...], tp: int, block: tuple[int, int], head_dim: int,
                   merged_qkv: bool) -> str | None:
    """Why vLLM at tensor parallelism `tp` refuses block-scaled FP8 projection `name` of full `shape` (None: it
    loads it); `head_dim`: a k/v head's rows (a k/v projection of fewer heads than `tp` is replicated, one head per
    rank); `merged_qkv`: q/k/v are one QKVParallelLinear (standard attention; MLA's q_proj stands alone)."""
    if not quantized_name(name) or len(shape) != 2:
        return None
    bn, bk = block
    module = name[: -len(".weight")].rsplit(".", 1)[-1]
    rows, cols = shape
    checks: list[tuple[int, int, str]] = []  # (size, block dim, what)
    if ".experts." in name:  # vLLM's FusedMoE: the experts' intermediate width split over TP
        inter = (cols if module in VLLM_ROW_PARALLEL else rows) // tp
        checks.append((inter, bn, "intermediate rows"))
        if tp > 1:
            checks.append((inter, bk, "intermediate columns"))
    elif module in VLLM_ROW_PARALLEL:
        if tp > 1:
            checks.append((cols // tp, bk, "input columns"))
    elif module in VLLM_NOT_SPLIT:
        if module in VLLM_MERGED_FIRST:
            checks.append((rows, bn, "output rows"))
    else:
        part = rows // tp
        if module in ("k_proj", "v_proj") and merged_qkv:
            part = max(part, head_dim)
        first = module in VLLM_MERGED_FIRST or (merged_qkv and module in ("q_proj", "k_proj"))
        if tp > 1 or first:
            checks.append((part, bn, "output rows"))
    for size, b, what in checks:
        if size % b:
            return (f"its {what} per vLLM TP rank are {size}, not a multiple of the FP8 block's {b} (vLLM's "
                    f"validate_fp8_block_shape refuses it at TP={tp})")
    return None


def check_vllm_tp(spec: Any, tp: int, fp8_blocks: bool, source: str) -> None:
    """`megatron-to-hf --fp8-tp N`: every block-scaled FP8 projection of `spec` loads in vLLM at TP=N
    (`vllm_tp_misfit`, from the shapes alone), else one error naming the first that does not."""
    from mconvert.convert.bounds import expected_hf_shapes

    if not fp8_blocks:
        raise MConvertError(f"--fp8-tp {tp} describes the --fp8-blocks export; add --fp8-blocks or drop --fp8-tp")
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise MConvertError(f"--fp8-tp {tp!r}: expected the vLLM tensor-parallel size, a whole number >= 1")
    for name, shape in expected_hf_shapes(spec).items():
        why = vllm_tp_misfit(name, shape, tp, DEFAULT_BLOCK, spec.head_dim, not spec.is_mla)
        if why is not None:
            raise MConvertError(f"{source}: --fp8-tp {tp}: {name.replace('*', '0')} {list(shape)}: {why}; serve at "
                                "another TP (or with vLLM's expert parallelism for the experts), or drop --fp8-blocks")
