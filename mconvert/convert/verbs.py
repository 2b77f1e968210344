"""Every conversion verb in one place, each a short function over the same steps: parse its options, open the
Source, work out what is written (`plan`, or the format's `prepare`: its refusals, config and sizes), then
`--dry-run`'s report or the driver's loop into the format's Writer (`driver.write_output`).

The Python API of the tool: the CLI calls these and prints their reports.
"""

from __future__ import annotations

import time
from pathlib import Path

from mconvert.convert.deploy import gguf
from mconvert.convert.driver import drive, peak_rss_bytes
from mconvert.convert.sources import open_source
from mconvert.convert.writer import Report, make_report
from mconvert.errors import MConvertError
from mconvert.io.atomic import atomic_output_file, check_output_file, file_manifest_path
from mconvert.io.crc import crc_in_background, skip_crc_checks, wait_crc_checks


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
