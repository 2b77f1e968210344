"""Every conversion verb in one place, each a short function over the same steps: parse its options, open the
Source, work out what is written (`plan`, or the format's `prepare`: its refusals, config and sizes), then
`--dry-run`'s report or the driver's loop into the format's Writer (`driver.write_output`).

The Python API of the tool: the CLI calls these and prints their reports.
"""

from __future__ import annotations

import time
from pathlib import Path

from mconvert import dtypes
from mconvert.convert.deploy import fastertransformer as ft
from mconvert.convert.deploy import gguf, trtllm
from mconvert.convert.driver import dry_run_report, drive, peak_rss_bytes, write_output
from mconvert.convert.sources import open_source
from mconvert.convert.writer import Report, make_report
from mconvert.errors import MConvertError
from mconvert.io.atomic import atomic_output_file, check_output, check_output_file, file_manifest_path
from mconvert.io.crc import crc_in_background, skip_crc_checks, wait_crc_checks


# ---- FasterTransformer ----------------------------------------------------------------------------------
@crc_in_background
def megatron_to_ft(src: str | Path, out: str | Path, infer_tp: int, dtype: str = "fp32", force: bool = False,
                   allow_approx_gelu: bool = False, iteration: str | None = None, progress: bool = False,
                   dry_run: bool = False, accept_window_as_full: bool = False) -> Report:
    """`megatron-to-ft`: write `OUT/<infer_tp>-gpu/` atomically, then run the FT layout check on it.
    `accept_window_as_full`: a sliding-window model is written for FT's full attention, and the report says so."""
    t0 = time.perf_counter()
    dtype = ft.ft_dtype(dtype)  # a wrong --dtype is refused before the source is opened
    check_output(out, force, (src,))
    source = open_source(src, iteration=iteration)
    try:  # refuse before any work
        prepared = ft.prepare(source.spec, infer_tp, dtype, allow_approx_gelu, accept_window_as_full, str(source.path))
    except BaseException:
        source.close()
        raise
    extras = dict(section=prepared.layout.section, infer_tp=infer_tp, ft_dir=str(Path(out) / f"{infer_tp}-gpu"),
                  notes=prepared.notes)
    if dry_run:
        plan = {"dtype": dtypes.canonical(dtype), "files": prepared.files,
                "note": "tensor bytes only; nothing was written"}
        return dry_run_report("megatron-to-ft", source, out, plan, prepared.where, t0, **extras)
    return write_output("megatron-to-ft", source, out, lambda tmp: ft.FTWriter(tmp, prepared),
                        force=force, inputs=(src,), layout=prepared.where, dtype=dtypes.canonical(dtype), t0=t0,
                        progress=progress, check=lambda tmp: ft.refuse_written(tmp / f"{infer_tp}-gpu"), **extras)


# ---- TensorRT-LLM ---------------------------------------------------------------------------------------
@crc_in_background
def megatron_to_trtllm(src: str | Path, out: str | Path, tp: int = 1, dtype: str = "auto", force: bool = False,
                       iteration: str | None = None, progress: bool = False, dry_run: bool = False,
                       accept_window_as_full: bool = False) -> Report:
    """`megatron-to-trtllm`: write config.json + rank{i}.safetensors atomically, then run `check_trtllm_dir` on
    the result. `accept_window_as_full`: a sliding-window model is written as full attention, and the report
    says so."""
    t0 = time.perf_counter()
    dtypes.choose(dtype, trtllm.TRT_DTYPES)  # a wrong --dtype is refused before the source is opened
    check_output(out, force, (src,))
    source = open_source(src, iteration=iteration)
    try:  # refuse before any work
        prepared = trtllm.prepare(source.spec, tp, dtype, accept_window_as_full, str(source.path))
    except BaseException:
        source.close()
        raise
    extras = dict(architecture=prepared.config["architecture"], tp=tp, tensors_per_rank=len(prepared.shapes),
                  notes=prepared.notes)
    if dry_run:
        plan = {"dtype": prepared.dtype, "files": prepared.files,
                "note": "rank files: tensor bytes only (the safetensors header is not counted); nothing was written"}
        return dry_run_report("megatron-to-trtllm", source, out, plan, prepared.where, t0, **extras)
    return write_output("megatron-to-trtllm", source, out, lambda tmp: trtllm.TrtllmWriter(tmp, prepared),
                        force=force, inputs=(src,), layout=prepared.where, dtype=prepared.dtype, t0=t0,
                        progress=progress, check=trtllm.refuse_written, **extras)


# ---- GGUF (llama.cpp) -----------------------------------------------------------------------------------
@crc_in_background
def to_gguf(src_path: str | Path, out: str | Path, outtype: str = "f16", tokenizer: str | Path | None = None,
            iteration: int | str | None = None, force: bool = False, verb: str = "megatron-to-gguf",
            permute: bool = True, progress: bool = False, dry_run: bool = False,
            accept_window_as_full: bool = False) -> Report:
    """`megatron-to-gguf` / `hf-to-gguf`: a Megatron checkpoint (torch or torch_dist, any TP/PP) or HF dir -> one
    GGUF file, streamed unit by unit through the driver's loop, written atomically with its manifest beside it.
    Returns the common report. `accept_window_as_full`: a sliding-window model is written as full attention, and
    the report says so."""
    t0 = time.perf_counter()
    gguf.outtype_types(outtype)
    check_output_file(out, force, (src_path, tokenizer))
    src = open_source(src_path, iteration=iteration, tokenizer=tokenizer)
    if verb == "megatron-to-gguf" and src.format == "hf":
        raise MConvertError(f"{src_path}: this is a HuggingFace directory; use hf-to-gguf")
    if verb == "hf-to-gguf" and src.format != "hf":
        raise MConvertError(f"{src_path}: not a HuggingFace directory (detected {src.format}); use megatron-to-gguf")
    if not getattr(src, "vocab_known", True):
        raise MConvertError(f"{src_path}: vocab size unknown (args have no vocab_size and no tokenizer was found); "
                            "pass --tokenizer DIR")
    tok_dir = Path(tokenizer) if tokenizer is not None else src.tokenizer_dir
    prepared = gguf.prepare(src.spec, outtype, accept_window_as_full)  # every refusal before any tensor is read
    spec, warnings = prepared.spec, list(prepared.notes)
    extras = dict(arch=prepared.layout.arch, outtype=outtype, tokenizer=str(tok_dir),
                  permuted_qk=prepared.layout.permute_qk and permute)
    if dry_run:
        skip_crc_checks()  # nothing is written: the dry run reads no tensor data
        src.close()
        files = [{"path": Path(out).name, "bytes": None}, {"path": file_manifest_path(out).name, "bytes": None}]
        return make_report(verb, src.describe(), out, spec.family, "gguf", outtype, files, warnings, None,
                           time.perf_counter() - t0, dry_run=True, tensors=len(prepared.tensors),
                           tensor_bytes=prepared.tensor_bytes, **extras)
    try:
        with gguf.gguf_log("gguf") as said, atomic_output_file(out, force, inputs=(src_path, tokenizer,
                                                                                     src.tokenizer_dir)) as tmp:
            writer = gguf.GgufWriter(tmp, prepared, tok_dir, name=Path(src_path).name, permute=permute)
            drive(src, writer, verb, progress)
            wait_crc_checks()  # the input's checks, run in the background, before the output is committed
    finally:
        src.close()
    warnings += writer.warnings + [f"gguf-py: {w}" for w in said]
    files = [{"path": Path(out).name, "bytes": Path(out).stat().st_size},
             {"path": file_manifest_path(out).name, "bytes": file_manifest_path(out).stat().st_size}]
    return make_report(verb, src.describe(), out, spec.family, "gguf", outtype, files, warnings, peak_rss_bytes(),
                       time.perf_counter() - t0, tensors=len(prepared.tensors), **extras)
