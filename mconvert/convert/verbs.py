"""Every conversion verb in one place, each a short function over the same steps: parse its options, open the
Source, work out what is written (`plan`, or the format's `prepare`: its refusals, config and sizes), then
`--dry-run`'s report or the driver's loop into the format's Writer (`driver.write_output`).

The Python API of the tool: the CLI calls these and prints their reports. A deployment format's writer module
is imported by the verb that writes it: a process pays only for the verb it runs.
"""

from __future__ import annotations

import contextlib
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mconvert import dtypes
from mconvert.convert.base import SourceBase
from mconvert.convert.driver import dry_run_report, drive, peak_rss_bytes, write_output
from mconvert.convert.hf.tokenizer import TOKEN_ID_KEYS, carry_to_megatron, find_carried_dir, ids_outside_vocab
from mconvert.layouts.megatron import PipelineSplit, parse_pipeline_layout
from mconvert.layouts.plan import plan_for_source
from mconvert.convert.scaleout import world
from mconvert.convert.sources import detect_format, open_source
from mconvert.convert.writer import Report, Writer, make_report
from mconvert.errors import MConvertError, renamed
from mconvert.io.atomic import atomic_output_dir, atomic_output_file, check_output, check_output_file, file_manifest_path
from mconvert.io.crc import crc_in_background, skip_crc_checks, wait_crc_checks
from mconvert.io.paths import check_tree_contained
from mconvert.mappings import families
from mconvert.mappings.plugin import transposed_in_hf
from mconvert.spec import megatron_lm_unstated

if TYPE_CHECKING:
    import torch

    from mconvert.convert.deploy.onnx import OnnxCheck, OnnxResult


# ---- Megatron <-> HuggingFace ------------------------------------------------------------------------
def _torch_dist_writer(*args: Any, **kwargs: Any) -> Writer:
    """`TorchDistWriter(...)`; torch.distributed.checkpoint is a heavy import every verb would pay at start-up, so
    it is imported only when a torch_dist output is written."""
    from mconvert.convert.megatron.torch_dist_writer import TorchDistWriter

    return TorchDistWriter(*args, **kwargs)


def parse_dtype(name: str) -> torch.dtype | None:
    """'auto' -> None (keep the source dtype); 'bf16' -> torch.bfloat16; anything else is an error."""
    key = dtypes.choose(name)
    return None if key == "auto" else dtypes.lookup(key).torch  # type: ignore[union-attr]


def parallel_layout(tp: int, pp: int = 1, vpp: int | None = None, ep: int | None = None,
                    split: PipelineSplit | None = None) -> str:
    """`TP=2 PP=2` (`VPP=2`, `EP=2` when set, an uneven split's args): the layout of a Megatron output."""
    return (f"TP={tp} PP={pp}" + (f" VPP={vpp}" if vpp else "") + (f" EP={ep}" if ep else "")
            + (f" ({split.describe()})" if split is not None and not split.even else ""))


def target_split(num_layers: int, pp: int, vpp: int | None, pipeline: dict[str, Any] | None,
                 mtp_num_layers: int | None = None, src: SourceBase | None = None) -> tuple[PipelineSplit, int | None]:
    """The output's pipeline split and VPP: from `pipeline` (Megatron-LM's split args by name, as given on the
    command line; a layout string sets the VPP when none is given), else the source's own when PP and VPP are
    unchanged, else even."""
    given = {k: v for k, v in (pipeline or {}).items() if v not in (None, False)}
    layout = given.get("pipeline_model_parallel_layout")
    if layout is not None and vpp is None:
        chunks = len(parse_pipeline_layout(layout)) // pp
        vpp = chunks if chunks > 1 else None
    if not given and src is not None and src.split is not None and (src.pp, src.vpp) == (pp, vpp):
        return src.split, vpp
    return PipelineSplit.make(num_layers, pp, vpp, given.get("decoder_first_pipeline_num_layers"),
                              given.get("decoder_last_pipeline_num_layers"), layout,
                              bool(given.get("account_for_embedding_in_pipeline_split")),
                              bool(given.get("account_for_loss_in_pipeline_split")), mtp_num_layers), vpp


@crc_in_background
def megatron_to_hf(ckpt: str | Path, out: str | Path, iteration: int | str | None = None, dtype: str = "auto",
                   tokenizer: str | Path | None = None, max_shard_size: str | int = "5GB", force: bool = False,
                   progress: bool = False, dry_run: bool = False, fp8_blocks: bool = False,
                   fp8_tp: int | None = None) -> dict[str, Any]:
    """Megatron checkpoint (torch or torch_dist, any TP/PP/VPP) -> HF directory. Returns a report dict.
    `fp8_blocks`: the projection weights written block-scaled FP8 (e4m3, 128×128 scales; `convert/hf/fp8.py`);
    `fp8_tp`: the vLLM tensor-parallel size those weights must load at (refused before any work otherwise)."""
    from mconvert.convert.hf import fp8
    from mconvert.convert.hf.writer import HFWriter, parse_size


    t0 = time.perf_counter()
    target = parse_dtype(dtype)
    size = parse_size(max_shard_size)
    check_output(out, force, (ckpt, tokenizer))
    src = open_source(ckpt, iteration=iteration, tokenizer=tokenizer)
    if src.format == "hf":
        raise MConvertError(f"{ckpt}: this is already a HuggingFace directory; use hf-to-megatron for the other way")
    warnings: list[str] = []
    if not src.vocab_known:
        warnings.append(f"vocab size unknown (args have no vocab_size and no tokenizer was found): exporting all "
                        f"{src.spec.vocab_size} padded rows; pass --tokenizer DIR to strip them")
    untied_warning = families.of(src.spec).vllm.untied_export_warning
    if untied_warning and not src.spec.tie_embeddings:
        warnings.append(untied_warning)
    spec = src.spec
    families.refuse_for_hf(spec, str(ckpt))  # before any tensor is read
    if fp8_blocks and any(transposed_in_hf(spec, d.name) for d in spec.layer_params(0)):
        raise MConvertError(f"--fp8-blocks: the {spec.family} family's HF projections are Conv1D weights (stored "
                            "transposed), which neither transformers' FP8Linear nor vLLM read as block-scaled FP8; "
                            "drop --fp8-blocks")
    if fp8_tp is not None:
        fp8.check_vllm_tp(spec, fp8_tp, fp8_blocks, str(ckpt))
    if target is not None:
        spec = spec.replace(params_dtype=dtypes.of_torch(target).name)
    if dry_run:
        return dry_run_report("megatron-to-hf", src, out, plan_for_source("megatron-to-hf", src,
                              dtype=spec.params_dtype, max_shard_size=size,
                              fp8_block=fp8.DEFAULT_BLOCK if fp8_blocks else None), "hf", t0, warnings)
    writers: list[HFWriter] = []

    def hf_writer(tmp: Path) -> HFWriter:
        primary = world().primary  # under torchrun rank 0 alone writes the configs and the tokenizer
        writers.append(HFWriter(tmp, spec, size, target, tokenizer_dir=src.tokenizer_dir if primary else None,
                                carried=_carried_dir(src), fp8_block=fp8.DEFAULT_BLOCK if fp8_blocks else None))
        if world().size > 1:
            writers[0].plan_ahead(_source_dtype(src))
        return writers[0]

    def finish(tmp: Path) -> dict[str, Any]:
        warnings.extend(writers[0].warnings)  # kept token ids the args overrule
        counts = {"tensors": writers[0].tally(_source_dtype(src))} if world().size == 1 else {}
        return {"hf_buffer_peak_bytes": writers[0].peak_buffer_bytes, **counts}

    return write_output("megatron-to-hf", src, out, hf_writer, force=force,
                        inputs=(ckpt, tokenizer, src.tokenizer_dir), layout="hf", dtype=spec.params_dtype, t0=t0,
                        warnings=warnings, progress=progress, finish=finish,
                        tokenizer=str(src.tokenizer_dir) if src.tokenizer_dir else None)


@crc_in_background
def hf_to_megatron(hf_dir: str | Path, out: str | Path, tp: int = 1, pp: int = 1, vpp: int | None = None,
                   dtype: str = "auto", force: bool = False, progress: bool = False,
                   dry_run: bool = False, format: str = "torch", ep: int = 1, bridge: bool = False,
                   pipeline: dict[str, Any] | None = None) -> dict[str, Any]:
    """HF directory -> Megatron checkpoint (release/, mcore local-spec names) at TP/PP(/VPP)/EP, in the torch
    (rank files) or torch_dist (megatron-core dist_checkpointing) format; `bridge`: torch_dist in iter_0000000/
    with the files Megatron-Bridge loads it from (run_config.yaml, train_state.pt); `pipeline`: Megatron-LM's
    uneven split args (`target_split`)."""
    from mconvert.convert.megatron.writer import megatron_writer


    t0 = time.perf_counter()
    check_format(format)
    check_bridge(bridge, format)
    target = parse_dtype(dtype)
    check_output(out, force, (hf_dir,))
    src = open_source(hf_dir)
    if src.format != "hf":
        raise MConvertError(f"{hf_dir}: not a HuggingFace directory (detected {src.format}); use reshard instead")
    if target is not None:  # block-scaled FP8 weights dequantize straight into the output dtype
        src.dequantize_to(target)
    cfg = src.config or {}
    spec = src.spec if target is None else src.spec.replace(params_dtype=dtypes.of_torch(target).name)
    split, vpp = target_split(spec.num_layers, pp, vpp, pipeline, spec.mtp_num_layers)
    spec.check_parallel(tp, pp, vpp, ep, layers=False)
    layout = parallel_layout(tp, pp, vpp, ep if spec.is_moe else None, split)
    if dry_run:
        return dry_run_report("hf-to-megatron", src, out, plan_for_source("hf-to-megatron", src, tp=tp, pp=pp, ep=ep,
                              dtype=spec.params_dtype, format=format, split=split), layout, t0, tp=tp, pp=pp, vpp=vpp,
                              **({"ep": ep} if spec.is_moe else {}))

    def writer(tmp: Path) -> Writer:
        if format == "torch_dist":
            return _torch_dist_writer(tmp, spec, tp, pp, vpp, iteration=0 if bridge else "release", dtype=target,
                                      ep=ep, bridge=bridge, split=split)
        return megatron_writer(tmp, spec, tp, pp, vpp, ep, iteration="release", dtype=target, preview=_preview(src),
                               split=split)

    return write_output(
        "hf-to-megatron", src, out, writer,
        force=force, inputs=(hf_dir, src.tokenizer_dir), layout=layout, dtype=spec.params_dtype, t0=t0,
        progress=progress, warnings=ids_outside_vocab({k: cfg.get(k) for k in TOKEN_ID_KEYS}, spec.vocab_size,
                                                      str(Path(hf_dir) / "config.json")) + megatron_lm_unstated(spec),
        finish=lambda tmp: {"tokenizer_files": carry_to_megatron(src.tokenizer_dir, src.path, tmp, config=cfg)
                            if world().primary else []},
        tp=tp, pp=pp, vpp=vpp, **({"ep": ep} if spec.is_moe else {}), format=format,
        optimizer="none (HF checkpoints carry no optimizer state)")


@crc_in_background
def reshard(ckpt: str | Path, out: str | Path, tp: int, pp: int, vpp: int | None = None,
            with_optimizer: bool = False, iteration: int | str | None = None, force: bool = False,
            progress: bool = False, dry_run: bool = False, format: str | None = None,
            ep: int = 1, optimizer_layout: str | None = None, bridge: bool | None = None,
            pipeline: dict[str, Any] | None = None) -> dict[str, Any]:
    """Megatron checkpoint -> the same checkpoint at a new TP/PP(/VPP)/EP: merge to full tensors, split again.

    Keeps args (TP/PP updated), the iteration and the scheduler; with `with_optimizer` the Adam states follow
    their parameters' layouts so training resumes at the new layout; without it, no optimizer is written.
    `format`: torch or torch_dist output (default: the source's format). `optimizer_layout`: the distributed
    optimizer's layout in torch_dist output (default: the source's, else fully_reshardable). `bridge`: torch_dist
    output Megatron-Bridge loads (run_config.yaml, train_state.pt; default: when the source is a Bridge one).
    `pipeline`: Megatron-LM's uneven split args for the output (default: the source's split at its own PP/VPP,
    else even)."""
    from mconvert.convert.megatron.dp_buckets import check_optimizer_layout
    from mconvert.convert.megatron.optimizer import check_mcore_groups, index_states
    from mconvert.convert.megatron.source import MegatronSource
    from mconvert.convert.megatron.writer import megatron_writer
    from mconvert.io.safeload import safe_load


    t0 = time.perf_counter()
    if format is not None:
        check_format(format)
    check_output(out, force, (ckpt,))
    src = open_source(ckpt, iteration=iteration)
    if src.format == "hf":
        raise MConvertError(f"{ckpt}: a HuggingFace directory has no TP/PP layout; use hf-to-megatron")
    if format is None:
        format = "torch_dist" if src.format == "megatron-torch_dist" else "torch"
    dist_source = src.format == "megatron-torch_dist"
    if bridge is None:
        bridge = format == "torch_dist" and src.writer is not None
    check_bridge(bridge, format)
    groups = None
    if optimizer_layout is not None:
        check_optimizer_layout(optimizer_layout)
    if optimizer_layout is not None and not (with_optimizer and format == "torch_dist"):
        raise MConvertError(f"--optimizer-layout {optimizer_layout}: applies to the optimizer states of torch_dist "
                            "output; add --with-optimizer and --format torch_dist, or drop it")
    if with_optimizer and dist_source:
        src.check_optimizer()
        if format == "torch":  # megatron-core's distributed optimizer -> the trainer's Adam states
            groups = src.trainer_optimizer()
    split, vpp = target_split(src.spec.num_layers, pp, vpp, pipeline, src.spec.mtp_num_layers, src)
    src.spec.check_parallel(tp, pp, vpp, ep, layers=False)
    layout = parallel_layout(tp, pp, vpp, ep if src.spec.is_moe else None, split)
    if dry_run:
        return dry_run_report("reshard", src, out, plan_for_source("reshard", src, tp=tp, pp=pp, ep=ep,
                              with_optimizer=with_optimizer, format=format, split=split), layout, t0, tp=tp, pp=pp,
                              vpp=vpp,
                              **({"ep": ep} if src.spec.is_moe else {}))
    # common.pt's / rank 0's entries; megatron-core's param groups only with its states into torch_dist
    top = {k: v for k, v in src.top_level().items() if k not in ("args", "checkpoint_version", "iteration")
           and (with_optimizer and dist_source and format == "torch_dist" or k != "optimizer")}
    rank_top = rng = None
    if "rng_state" in top:  # per rank: each target rank keeps the one of the source rank it maps to
        top.pop("rng_state")
        rng_from = _rng_source_ranks(src, tp, split)
        rng = lambda t, p: src.top_level(*rng_from[(t, p)][::-1])["rng_state"]  # noqa: E731
        rank_top = lambda t, p: {"rng_state": rng(t, p)}  # noqa: E731
    if "optimizer" in top:  # carried as it is: its hyperparameters are checked as torch's Adam checks them
        check_mcore_groups(top["optimizer"], str((src.iter_dir or Path(ckpt)) / "common.pt"))
    if isinstance(src, MegatronSource) and with_optimizer:
        first = safe_load(src.files[(0, 0)])
        _, groups = index_states(first.get("optimizer"), str(src.files[(0, 0)]))
        del first
    iteration_out = src.iteration if src.iteration is not None else "release"
    if bridge and iteration_out == "release":  # Megatron-Bridge's loader takes the newest iter_* dir
        iteration_out = 0

    def writer(tmp: Path) -> Writer:
        if format == "torch_dist":
            return _torch_dist_writer(tmp, src.spec, tp, pp, vpp, iteration=iteration_out,
                                      args=src.args, top_level=top,
                                      with_states=with_optimizer and dist_source,
                                      optimizer_groups=groups if not dist_source else None,
                                      source=str(src.files[(0, 0)] if isinstance(src, MegatronSource) else ckpt),
                                      rng_state=rng, ep=ep,
                                      optimizer_layout=optimizer_layout or src.optimizer_layout
                                      or "fully_reshardable", bridge=bridge,
                                      bridge_source=(src.bridge_config, src.train_state()),
                                      split=split)
        return megatron_writer(tmp, src.spec, tp, pp, vpp, ep, iteration=iteration_out,
                               args=src.args, top_level=top, optimizer_groups=groups,
                               rank_top_level=rank_top, preview=_preview(src),  # unused with optimizer states
                               split=split)

    return write_output(
        "reshard", src, out, writer,
        force=force, inputs=(ckpt, src.tokenizer_dir), layout=layout, dtype=src.spec.params_dtype, t0=t0,
        progress=progress,
        finish=lambda tmp: {"tokenizer_files": carry_to_megatron(src.tokenizer_dir, _carried_dir(src), tmp)
                            if world().primary else []},
        tp=tp, pp=pp, vpp=vpp, **({"ep": ep} if src.spec.is_moe else {}), iteration=iteration_out, format=format,
        optimizer="re-sharded (Adam exp_avg/exp_avg_sq follow their parameters)" if with_optimizer
        else "not written (pass --with-optimizer to re-shard the Adam states)")


OUTPUT_FORMATS = ("torch", "torch_dist")


def check_bridge(bridge: bool, format: str) -> None:
    """`--bridge` adds Megatron-Bridge's files to a torch_dist checkpoint; the rank-file format has no place for them."""
    if bridge and format != "torch_dist":
        raise MConvertError(f"--bridge: Megatron-Bridge loads torch_dist checkpoints; add --format torch_dist "
                            f"(not {format})")


def check_format(format: str) -> None:
    """`--format`: the Megatron checkpoint formats mconvert writes."""
    if format not in OUTPUT_FORMATS:
        raise MConvertError(f"--format {format!r}: choose torch (mp_rank_* rank files) or torch_dist "
                            "(megatron-core dist_checkpointing)")


def _source_dtype(src: SourceBase) -> torch.dtype:
    """The dtype of the source's tensors, from its preview (no data read) or else its spec."""
    if src.preview is not None and src.can_preview():
        first = src.preview(src.units()[0])
        if first:
            return next(iter(first.values())).dtype
    return dtypes.lookup(src.spec.params_dtype).torch


def _carried_dir(src: SourceBase) -> Path | None:
    """Where a Megatron source keeps the HF metadata carried through it (its root, else the given path)."""
    return find_carried_dir(src.root, src.path)


def _preview(src: SourceBase) -> Any:
    """The source's `preview` when it can give one for every unit (streamed rank files), else None."""
    if src.preview is None or not src.can_preview():
        return None
    return src.preview


def _rng_source_ranks(src: SourceBase, tp: int, split: PipelineSplit) -> dict[tuple[int, int], tuple[int, int]]:
    """Target (tp_rank, pp_rank) -> the source (tp_rank, pp_rank) whose rng_state it keeps: the same rank when
    the layout is unchanged, else TP rank modulo the source TP and the stage holding the target's first layer
    (a stage without layers: the same PP rank, or the source's last)."""
    out = {}
    for p in range(split.pp):
        first = next((r[0] for r in split.stage_layers(p) if len(r)), None)
        sp = src.split.layer_location(first)[0] if first is not None else min(p, src.pp - 1)
        for t in range(tp):
            out[(t, p)] = (t % src.tp, sp)
    return out


# ---- FasterTransformer ----------------------------------------------------------------------------------
@crc_in_background
def megatron_to_ft(src: str | Path, out: str | Path, infer_tp: int, dtype: str = "fp32", force: bool = False,
                   allow_approx_gelu: bool = False, iteration: str | None = None, progress: bool = False,
                   dry_run: bool = False, accept_window_as_full: bool = False) -> Report:
    """`megatron-to-ft`: write `OUT/<infer_tp>-gpu/` atomically, then run the FT layout check on it.
    `accept_window_as_full`: a sliding-window model is written for FT's full attention, and the report says so."""
    from mconvert.convert.deploy import fastertransformer as ft

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
    from mconvert.convert.deploy import trtllm

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
    from mconvert.convert.deploy import gguf

    t0 = time.perf_counter()
    gguf.outtype_types(outtype)
    check_output_file(out, force, (src_path, tokenizer))
    # the GGUF writer takes numpy arrays: an HF directory of safetensors is read as them, without torch
    src = open_source(src_path, iteration=iteration, tokenizer=tokenizer, arrays=True)
    if verb == "megatron-to-gguf" and src.format == "hf":
        raise MConvertError(f"{src_path}: this is a HuggingFace directory; use hf-to-gguf")
    if verb == "hf-to-gguf" and src.format != "hf":
        raise MConvertError(f"{src_path}: not a HuggingFace directory (detected {src.format}); use megatron-to-gguf")
    if not src.vocab_known:
        raise MConvertError(f"{src_path}: vocab size unknown (args have no vocab_size and no tokenizer was found); "
                            "pass --tokenizer DIR")
    tok_dir = Path(tokenizer) if tokenizer is not None else src.tokenizer_dir
    prepared = gguf.prepare(src.spec, outtype, accept_window_as_full)  # every refusal before any tensor is read
    if src.held_sizes:  # what the GGUF writer is fed at once (one expert), before the output is opened
        from mconvert.convert import bounds

        bounds.check_memory(bounds.held_by_writer(src.held_sizes, gguf.GgufWriter.splits_experts,
                                                  gguf.GgufWriter.takes_parts), src.held_source)
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


# ---- ONNX (no unit stream: optimum exports a whole HF model) ----------------------------------------------
def to_onnx(src: str | Path, out: str | Path, with_past: bool = True, opset: int | None = None,
            force: bool = False, rtol: float | None = None, exporter: str = "optimum",
            iteration: str | None = None, *, check: OnnxCheck,
            dry_run: bool = False) -> OnnxResult | Report:
    """`to-onnx`: export, then refuse (leaving no OUT) unless onnxruntime matches transformers.

    `check(onnx_dir, hf_dir)` runs both on the same tokens (the validators' `check_onnx_against_hf`).
    `dry_run`: the source is opened and refused as it would be; the report names what would be written. `rtol`:
    the largest relative logits difference accepted (default `onnx.DEFAULT_RTOL`)."""
    from mconvert.convert.deploy import onnx

    t0 = time.perf_counter()
    rtol = onnx.DEFAULT_RTOL if rtol is None else rtol
    src, out = Path(src), Path(out)
    onnx.task_of(exporter, with_past)  # the options are refused before anything is opened
    check_output(out, force, (src,))
    from_megatron = detect_format(src, iteration) != "hf"  # also the one-line error for a non-checkpoint
    if not from_megatron and iteration is not None:  # it would be ignored: the export is of the directory as is
        raise MConvertError(f"--iteration {iteration}: {src} is a HuggingFace directory, which has no iterations; "
                            "drop --iteration (it chooses among a Megatron checkpoint's iter_* directories)")
    described = f"{'megatron' if from_megatron else 'hf'} checkpoint {src}"
    # Every config field is mapped or refused, as by every verb: optimum exports what transformers' tracing
    # sees at its dummy length, and a field that acts only on longer inputs (dynamic NTK rope past
    # max_position_embeddings) would pass the logits check and be baked out of the graph.
    with open_source(src, iteration=iteration, verify=False) as source:
        spec = source.spec
        prepared = onnx.prepare(spec, exporter, with_past, str(src))
        if dry_run:
            described = source.describe()
    if dry_run:
        return make_report("to-onnx", described, out, spec.family, prepared.task, prepared.dtype,
                           [{"path": "model.onnx", "bytes": None}], [], None, time.perf_counter() - t0,
                           dry_run=True, exporter=exporter, opset=opset, rtol=rtol, weight_bytes=prepared.weight_bytes,
                           note="optimum writes model.onnx and, for large graphs (or as it chooses), the weights "
                                "as model.onnx_data; weight_bytes is their size from the parameter count")
    notes: list[str] = []
    with _hf_dir_for(src, from_megatron, iteration) as hf_dir, atomic_output_dir(out, force, inputs=(src,)) as tmp:
        family = onnx.hf_model_type(hf_dir)
        check_tree_contained(hf_dir, f"{hf_dir}: model file")  # optimum and transformers open files by name
        if from_megatron:
            notes.append("Megatron source exported to a temporary fp32 HF dir first")
        onnx.export(hf_dir, tmp, prepared, opset)
        with onnx.quiet():
            prefill, decode = check(tmp, hf_dir)
        worst = max(prefill, decode or 0.0)
        if not worst <= rtol:  # also catches NaN
            raise MConvertError(
                f"ONNX export does not match transformers: max relative logits difference {worst:.3g} > {rtol:g} "
                f"(prefill {prefill:.3g}" + (f", cached decode {decode:.3g})" if decode is not None else ")")
            )
        if with_past and decode is None:
            raise MConvertError("exported model has no past_key_values inputs although --with-past was asked")
        files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}
    if "model.onnx_data" in files:
        notes.append("weights stored as external data in model.onnx_data (graph > 2 GB protobuf limit)")
    return onnx.OnnxResult(str(out), prepared.task, exporter, opset, files, prefill, decode, rtol,
                           round(time.perf_counter() - t0, 2), notes, described, family, prepared.dtype,
                           peak_rss_bytes())


@contextlib.contextmanager
def _hf_dir_for(src: Path, from_megatron: bool, iteration: str | None) -> Iterator[Path]:
    """An HF dir for `src`: itself, or a temporary fp32 export of a Megatron checkpoint (`megatron_to_hf`)."""
    if not from_megatron:
        yield src
        return
    with tempfile.TemporaryDirectory(prefix="mconvert-onnx-hf-") as tmp:
        hf = Path(tmp) / "hf"
        megatron_to_hf(src, hf, iteration=iteration, dtype="fp32")
        try:
            yield hf
        except MConvertError as e:  # named as the checkpoint: the scratch export is gone once this returns
            raise MConvertError(renamed(str(e), hf, f"{src}'s HF export")) from None
