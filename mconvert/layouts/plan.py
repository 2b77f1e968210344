"""`--dry-run`: the files, sizes and estimated peak memory of a conversion, from shapes alone, writing nothing.

Shape-based (ModelSpec + parallel layout; no tensor is read), so the same numbers hold for a model nobody
has on disk (see `estimate.py`, which answers from a preset). Peak memory of the streaming driver =
one unit's source shards + its full/mapped copy + the writer's buffer (HF: the write queue, ≤ 64 MB, and
three 4 MiB O_DIRECT staging chunks; Megatron: per open rank file a 4 MiB queue and three 4 MiB staging
chunks — shards are streamed into their rank files, or spooled to disk until their stage is complete, their Adam
states with them) + the interpreter.
"""

from __future__ import annotations

from typing import Any

from mconvert.layouts.estimate import (
    HF_MAX_SHARD_BYTES,
    ITEMSIZE,
    hf_files,
    load_bandwidth,
    megatron_files,
    torch_dist_files,
    unit_bytes,
)
from mconvert.layouts.megatron import PipelineSplit
from mconvert.io.hashing import CHUNK, IO_WRITES
from mconvert.errors import MConvertError
from mconvert.spec import ModelSpec

STAGING = (IO_WRITES + 1) * CHUNK  # one HashingFile's O_DIRECT staging chunks


def _stage_counts(spec: ModelSpec, pp: int, split: PipelineSplit | None) -> list[int]:
    """Decoder layers per PP rank: the split's (uneven stages, virtual chunks together), else even."""
    return split.layer_counts() if split is not None else PipelineSplit.make(spec.num_layers, pp).layer_counts()


def plan(verb: str, spec: ModelSpec, src_tp: int = 1, src_pp: int = 1, tp: int = 1, pp: int = 1,
         dtype: str | None = None, max_shard_size: int = HF_MAX_SHARD_BYTES, with_optimizer: bool = False,
         base_rss: int | None = None, format: str = "torch", src_ep: int = 1, ep: int = 1,
         src_split: PipelineSplit | None = None, split: PipelineSplit | None = None,
         src_fp8_block: tuple[int, int] | None = None, fp8_block: tuple[int, int] | None = None) -> dict[str, Any]:
    """Files to write (path, bytes), bytes read, and the peak memory estimate of `verb` on `spec`;
    `format`: the Megatron output format (torch rank files or one torch_dist data file); `src_ep` / `ep`: the
    expert-parallel size of the Megatron source / output (one rank file per TP × PP × EP rank); `src_split` /
    `split`: the source's / output's pipeline split (default even); `src_fp8_block` / `fp8_block`: the HF
    source / output holds its projections block-scaled FP8."""
    src_item = ITEMSIZE[spec.params_dtype]
    out_dtype = dtype or spec.params_dtype
    if out_dtype not in ITEMSIZE:
        raise MConvertError(f"unknown dtype {out_dtype!r}")
    out_item = ITEMSIZE[out_dtype]
    if base_rss is None:
        base_rss = int(load_bandwidth()["base_rss_bytes"])
    if verb == "megatron-to-hf":
        read = megatron_files(spec, src_tp, src_pp, src_item, _stage_counts(spec, src_pp, src_split), src_ep,
                              src_split)
        write = hf_files(spec, out_item, max_shard_size, fp8_block)
        unit_in, unit_out = unit_bytes(spec, src_tp, src_item), unit_bytes(spec, 1, out_item)
        # streamed: io.hashing.HashingFile's queue + its O_DIRECT staging chunks
        buffer = min(64 << 20, max_shard_size, max(f["bytes"] for f in write)) + STAGING
    elif verb in ("hf-to-megatron", "reshard"):
        if verb == "hf-to-megatron":
            read = hf_files(spec, src_item, fp8_block=src_fp8_block)
            unit_in = unit_bytes(spec, 1, src_item)
        else:
            read = megatron_files(spec, src_tp, src_pp, src_item, _stage_counts(spec, src_pp, src_split), src_ep,
                                  src_split)
            unit_in = unit_bytes(spec, src_tp, src_item)
        write = megatron_files(spec, tp, pp, out_item, _stage_counts(spec, pp, split), ep, split)
        unit_out = unit_bytes(spec, tp, out_item)
        if format == "torch_dist":  # one data file; one unit's chunks pass through torch.save blobs
            write = torch_dist_files(spec, tp, out_item)
            unit_out = unit_bytes(spec, 1, out_item)
        # streamed rank files (io.torchsave.TorchSaveStream): queue + staging per open (TP, EP) file
        buffer = tp * ep * 4 * (4 << 20)
        if format == "torch_dist":  # io.hashing.HashingFile's queue and staging chunks, one chunk's blob
            buffer = (64 << 20) + STAGING + max(unit_out.values())
        if with_optimizer and format == "torch_dist":  # fp32 param + exp_avg + exp_avg_sq, streamed with it
            states = 3 * 4
            unit_in = {k: int(v * (1 + states / src_item)) for k, v in unit_in.items()}
            unit_out = {k: int(v * (1 + states / out_item)) for k, v in unit_out.items()}
            write = torch_dist_files(spec, tp, out_item + states)
        elif with_optimizer:  # fp32 exp_avg + exp_avg_sq per parameter, read and written alongside
            scale = 1 + 2 * 4 / out_item
            unit_in = {k: int(v * (1 + 2 * 4 / src_item)) for k, v in unit_in.items()}
            for f in write:
                f["bytes"] = int(f["bytes"] * scale)
    else:
        raise MConvertError(f"no plan for verb {verb!r}")
    unit_total = {k: unit_in[k] + unit_out[k] for k in unit_in}
    largest = max(unit_total, key=lambda k: unit_total[k])
    return {
        "verb": verb, "format": format if verb != "megatron-to-hf" else "hf", "dtype": out_dtype, "files": write,
        "write_bytes": sum(f["bytes"] for f in write),
        "read_files": len(read), "read_bytes": sum(f["bytes"] for f in read),
        "largest_unit": largest, "largest_unit_bytes": unit_total[largest], "writer_buffer_bytes": buffer,
        "base_rss_bytes": base_rss, "peak_memory_bytes": unit_total[largest] + buffer + base_rss,
        "note": "tensor bytes only (pickle / header overhead not counted); nothing was written",
    }


def plan_for_source(verb: str, src: Any, **kw: Any) -> dict[str, Any]:
    """`plan` for an opened Source (its spec, TP, PP, EP, pipeline split and FP8 blocks)."""
    out = plan(verb, src.spec, src_tp=src.tp, src_pp=src.pp, src_ep=src.ep, src_split=src.split,
               src_fp8_block=src.fp8_block, **kw)
    out["source"] = src.describe()
    return out
