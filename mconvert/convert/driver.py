"""The streaming driver: THE loop every writing verb runs (`write_output` -> `drive`), moving one unit
(embedding, layer i, final) at a time from a Source to a `Writer` (`convert/writer.py`), and the conversion verbs
megatron-to-hf, hf-to-megatron and reshard (the deployment verbs live beside their writers and run the same loop).

Peak memory = one unit's source shards (all TP ranks, memory-mapped) + the merged/mapped unit + the writer's
buffer (one safetensors shard for HF; one pipeline stage for Megatron, whose rank files hold a whole stage).
"""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from mconvert import dtypes
from mconvert.convert.hf import fp8
from mconvert.convert.base import END, SKIP, Unit, parts_ahead
from mconvert.convert.megatron.dp_buckets import check_optimizer_layout
from mconvert.io.atomic import check_output
from mconvert.convert.hf.writer import HFWriter, parse_size
from mconvert.convert.megatron.layout import PipelineSplit, parse_pipeline_layout
from mconvert.convert.megatron.source import MegatronSource
from mconvert.convert.megatron.writer import megatron_writer
from mconvert.convert.megatron.optimizer import check_mcore_groups, index_states
from mconvert.convert.plan import plan_for_source
from mconvert.convert.progress import unit_progress
from mconvert.convert.scaleout import claim_files, shared_atomic_output_dir, world
from mconvert.io.crc import crc_in_background, input_check_figures, skip_crc_checks, start_crc_checks, wait_crc_checks
from mconvert.convert.sources import open_source
from mconvert.io.safeload import safe_load
from mconvert.convert.hf.tokenizer import TOKEN_ID_KEYS, carry_to_megatron, find_carried_dir, ids_outside_vocab
from mconvert.convert.writer import Report, Writer, files_report, make_report
from mconvert.errors import MConvertError
from mconvert.mappings import families
from mconvert.mappings.plugin import transposed_in_hf


def _torch_dist_writer(*args: Any, **kwargs: Any) -> Writer:
    """`TorchDistWriter(...)`; torch.distributed.checkpoint is a heavy import every verb would pay at start-up, so
    it is imported only when a torch_dist output is written."""
    from mconvert.convert.megatron.torch_dist_writer import TorchDistWriter

    return TorchDistWriter(*args, **kwargs)


def parse_dtype(name: str) -> torch.dtype | None:
    """'auto' -> None (keep the source dtype); 'bf16' -> torch.bfloat16; anything else is an error."""
    key = dtypes.choose(name)
    return None if key == "auto" else dtypes.lookup(key).torch  # type: ignore[union-attr]


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far: VmHWM (per address space, so a parent's peak before
    fork+exec is not counted, unlike ru_maxrss), else ru_maxrss (KiB on Linux)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def drive(src: Any, writer: Writer, what: str = "", progress: bool = False) -> list[Path]:
    """THE loop: every unit of `src`, in the writer's `unit_order`, read the way its declared fields say
    (`convert/writer.py`: `reads`, `feeds`, `splits_experts`, `needs`/`wants`), into the writer; then close it.
    On any error the writer is aborted (threads, staging memory, open files) before the caller's output is
    removed."""
    if not isinstance(writer, Writer):
        raise TypeError(f"internal: {type(writer).__name__} is not a convert.writer.Writer")
    if world().size > 1 and not writer.shares_work:
        raise MConvertError(f"{what}: this output runs in one process and does not share its work over torchrun; "
                            "run it without torchrun")
    with _aborting(writer):  # MoE layers one expert at a time where both sides can (memory: one expert)
        start_crc_checks()  # every reader has claimed the input records it checks on the bytes it reads
        units = writer.unit_order(list(src.units(writer.splits_experts)))
        feeds = writer.feeds
        chained = _chained_reads(src, writer) if feeds == "parts" else None
        if chained is not None:  # every unit's parameters on one pool
            tasks, ends = chained
            for unit, part in parts_ahead(unit_progress(units, what, progress), writer.needs, tasks, ends):
                if part is SKIP:
                    writer.skip(unit)  # another torchrun rank writes what it feeds
                elif part is END:
                    writer.add(unit, {}, complete=True)
                elif ends:
                    writer.add(unit, part, complete=False)
                else:
                    writer.add(unit, part)
            return writer.close()
        for unit in unit_progress(units, what, progress):
            if not writer.needs(unit):  # another torchrun rank writes what it feeds
                writer.skip(unit)
                continue
            if feeds == "states":
                tensors, states = src.read_unit(unit, True)
                writer.add(unit, tensors, states)
            elif feeds == "parts" and writer.reads == "hf":
                # a torchrun process's shards (`wants`); what is written is freed before the rest is read
                for part in src.read_hf_parts(unit, only=writer.wants(unit)):
                    writer.add(unit, part)
            elif feeds == "parts" and hasattr(src, "read_mcore_parts"):
                for part in src.read_mcore_parts(unit):
                    writer.add(unit, part, complete=False)
                writer.add(unit, {}, complete=True)
            else:
                writer.add(unit, src.read_hf(unit) if writer.reads == "hf" else src.read_mcore(unit))
        return writer.close()


def _chained_reads(src: Any, writer: Writer) -> tuple[Callable[[Unit], Any], bool] | None:
    """How `drive` reads every unit of a writer that takes parts on one pool (`base.parts_ahead`): the source's
    per-unit tasks and whether the writer takes a unit's end apart (`add(unit, {}, complete=True)`); None where
    the loop reads unit by unit (a source without tasks, an MoE model to a Megatron-side writer, whose experts
    come whole one at a time: `base.LayerParts.comes_whole`)."""
    if writer.reads == "hf" and hasattr(src, "hf_part_tasks"):
        return (lambda unit: src.hf_part_tasks(unit, writer.wants(unit))), False
    if writer.reads != "hf" and hasattr(src, "mcore_part_tasks") and not src.spec.is_moe:
        return src.mcore_part_tasks, True
    return None


def write_output(verb: str, src: Any, out: str | Path, make_writer: Callable[[Path], Writer], *, force: bool,
                 inputs: tuple[Any, ...], layout: str, dtype: str, t0: float, warnings: list[str] | None = None,
                 progress: bool = False, finish: Callable[[Path], dict[str, Any]] | None = None,
                 check: Callable[[Path], None] | None = None, **extras: Any) -> Report:
    """One writing verb's output: the writer, constructed on the atomic temporary directory, driven over every
    unit; the input's background CRC checks awaited; `finish(tmp)` (side files, checks of what was written:
    returns more report keys) run before the directory is committed; `check(tmp)` run on the whole output by the
    committing process once every torchrun rank wrote its part; the source closed; the report built."""
    listed: list[dict[str, Any]] = []

    def written(tmp: Path, ranks: dict[str, int]) -> None:  # the committing process, once every rank wrote
        listed[:] = files_report(tmp, ranks if world().size > 1 else None)

    try:
        with shared_atomic_output_dir(out, force, inputs=inputs, check=check, written=written) as tmp:
            paths = drive(src, make_writer(tmp), verb, progress)
            wait_crc_checks()  # the input's CRC-32 / manifest, checked in the background, before the commit
            more = finish(tmp) if finish is not None else {}
            checked = input_check_figures()
            if checked is not None:
                more["input_manifest"] = checked
            w = world()
            if w.size > 1:
                more["processes"] = w.size
                if not w.primary:  # its own files: rank 0's report lists every rank's
                    claim_files(list(paths or []))
                    listed[:] = sorted(({"path": os.path.relpath(p, tmp), "bytes": os.path.getsize(p), "rank": w.rank}
                                        for p in paths or [] if os.path.isfile(p)), key=lambda f: f["path"])
    finally:
        src.close()
    return make_report(verb, src.describe(), out, src.spec.family, layout, dtype, listed, warnings or [],
                       peak_rss_bytes(), time.perf_counter() - t0, **extras, **more)


def dry_run_report(verb: str, src: Any, out: str | Path, plan: dict[str, Any], layout: str, t0: float,
                   warnings: list[str] | None = None, **extras: Any) -> Report:
    """The report of `--dry-run`: the plan's files, sizes and memory estimate in the common report shape."""
    skip_crc_checks()  # nothing is written: the dry run reads no tensor data
    src.close()
    plan = {k: v for k, v in plan.items() if k not in ("verb", "source", "output")}
    dtype, files = plan.pop("dtype"), plan.pop("files")
    return make_report(verb, src.describe(), out, src.spec.family, layout, dtype, files, warnings or [], None,
                       time.perf_counter() - t0, dry_run=True, **plan, **extras)


def parallel_layout(tp: int, pp: int = 1, vpp: int | None = None, ep: int | None = None,
                    split: PipelineSplit | None = None) -> str:
    """`TP=2 PP=2` (`VPP=2`, `EP=2` when set, an uneven split's args): the layout of a Megatron output."""
    return (f"TP={tp} PP={pp}" + (f" VPP={vpp}" if vpp else "") + (f" EP={ep}" if ep else "")
            + (f" ({split.describe()})" if split is not None and not split.even else ""))


def target_split(num_layers: int, pp: int, vpp: int | None, pipeline: dict[str, Any] | None,
                 mtp_num_layers: int | None = None, src: Any = None) -> tuple[PipelineSplit, int | None]:
    """The output's pipeline split and VPP: from `pipeline` (Megatron-LM's split args by name, as given on the
    command line; a layout string sets the VPP when none is given), else the source's own when PP and VPP are
    unchanged, else even."""
    given = {k: v for k, v in (pipeline or {}).items() if v not in (None, False)}
    layout = given.get("pipeline_model_parallel_layout")
    if layout is not None and vpp is None:
        chunks = len(parse_pipeline_layout(layout)) // pp
        vpp = chunks if chunks > 1 else None
    if not given and src is not None and getattr(src, "split", None) is not None and (src.pp, src.vpp) == (pp, vpp):
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

    t0 = time.perf_counter()
    target = parse_dtype(dtype)
    size = parse_size(max_shard_size)
    check_output(out, force, (ckpt, tokenizer))
    src = open_source(ckpt, iteration=iteration, tokenizer=tokenizer)
    if src.format == "hf":
        raise MConvertError(f"{ckpt}: this is already a HuggingFace directory; use hf-to-megatron for the other way")
    warnings: list[str] = []
    if not getattr(src, "vocab_known", True):
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
    cfg = getattr(src, "config", {})
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
                                                      str(Path(hf_dir) / "config.json")),
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
        bridge = format == "torch_dist" and getattr(src, "writer", None) is not None
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
        check_mcore_groups(top["optimizer"], str(getattr(src, "iter_dir", Path(ckpt)) / "common.pt"))
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
                                      args=getattr(src, "args", None), top_level=top,
                                      with_states=with_optimizer and dist_source,
                                      optimizer_groups=groups if not dist_source else None,
                                      source=str(src.files[(0, 0)] if isinstance(src, MegatronSource) else ckpt),
                                      rng_state=rng, ep=ep,
                                      optimizer_layout=optimizer_layout or getattr(src, "optimizer_layout", None)
                                      or "fully_reshardable", bridge=bridge,
                                      bridge_source=(getattr(src, "bridge_config", None),
                                                     src.train_state() if hasattr(src, "train_state") else None),
                                      split=split)
        return megatron_writer(tmp, src.spec, tp, pp, vpp, ep, iteration=iteration_out,
                               args=getattr(src, "args", None), top_level=top, optimizer_groups=groups,
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


def _source_dtype(src: Any) -> torch.dtype:
    """The dtype of the source's tensors, from its preview (no data read) or else its spec."""
    if src.preview is not None and getattr(src, "can_preview", lambda: True)():
        first = src.preview(src.units()[0])
        if first:
            return next(iter(first.values())).dtype
    return dtypes.lookup(src.spec.params_dtype).torch


@contextmanager
def _aborting(writer: Any) -> Iterator[None]:
    """On any error, stop the writer's streams (threads, staging memory, open files) before the output
    directory is removed: a library caller's process must not keep them."""
    try:
        yield
    except BaseException:
        writer.abort()
        raise


def _carried_dir(src: Any) -> Path | None:
    """Where a Megatron source keeps the HF metadata carried through it (its root, else the given path)."""
    return find_carried_dir(getattr(src, "root", None), getattr(src, "path", None))


def _preview(src: Any) -> Any:
    """The source's `preview` when it can give one for every unit (streamed rank files), else None."""
    if src.preview is None or not getattr(src, "can_preview", lambda: True)():
        return None
    return src.preview


def _rng_source_ranks(src: Any, tp: int, split: PipelineSplit) -> dict[tuple[int, int], tuple[int, int]]:
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

