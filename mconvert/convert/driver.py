"""The streaming driver: move one unit (embedding, layer i, final) at a time from a Source to a writer.

Peak memory = one unit's source shards (all TP ranks, memory-mapped) + the merged/mapped unit + the writer's
buffer (one safetensors shard for HF; one pipeline stage for Megatron, whose rank files hold a whole stage).
"""

from __future__ import annotations

import resource
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from mconvert import dtypes
from mconvert.convert.io.atomic import check_output
from mconvert.convert.base import Unit
from mconvert.convert.hf import HFWriter, parse_size
from mconvert.convert.layout import layer_location, stage_layers
from mconvert.convert.megatron import MegatronSource, MegatronWriter
from mconvert.convert.optimizer import index_states
from mconvert.convert.plan import plan_for_source
from mconvert.convert.scaleout import shared_atomic_output_dir, world
from mconvert.convert.io.safeload import crc_in_background, skip_crc_checks, wait_crc_checks
from mconvert.convert.sources import open_source
from mconvert.convert.io.safeload import safe_load
from mconvert.convert.tokenizer import copy_tokenizer
from mconvert.errors import MConvertError
from mconvert.mappings import families

def parse_dtype(name: str) -> torch.dtype | None:
    """'auto' -> None (keep the source dtype); 'bf16' -> torch.bfloat16; anything else is an error."""
    key = name.lower()
    if key == "auto":
        return None
    row = dtypes.lookup(key) if not key.startswith("torch.") else None
    if row is None or row.name not in dtypes.PARAM_DTYPES:
        raise MConvertError(f"--dtype {name!r}: choose auto, fp32, bf16 or fp16")
    return row.torch


def _progress(units: list[Unit], desc: str, enabled: bool) -> Iterator[Unit]:
    if not enabled:
        yield from units
        return

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[u]}"),
                  TimeElapsedColumn(), console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(desc, total=len(units), u="")
        for u in units:
            bar.update(task, u=f"unit {u}")
            yield u
            bar.advance(task)


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


def _files_report(root: Path) -> list[dict[str, Any]]:
    return [{"path": str(p.relative_to(root)), "bytes": p.stat().st_size}
            for p in sorted(root.rglob("*")) if p.is_file()]


@crc_in_background
def megatron_to_hf(ckpt: str | Path, out: str | Path, iteration: int | str | None = None, dtype: str = "auto",
                   tokenizer: str | Path | None = None, max_shard_size: str | int = "5GB", force: bool = False,
                   progress: bool = False, dry_run: bool = False) -> dict[str, Any]:
    """Megatron checkpoint (torch or torch_dist, any TP/PP/VPP) -> HF directory. Returns a report dict."""

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
    if target is not None:
        spec = spec.replace(params_dtype=dtypes.of_torch(target).name)
    if dry_run:
        skip_crc_checks()  # nothing is written: the dry run reads no tensor data
        return {**plan_for_source("megatron-to-hf", src, dtype=spec.params_dtype, max_shard_size=size),
                "output": str(out), "dry_run": True, "warnings": warnings}
    with shared_atomic_output_dir(out, force, inputs=(ckpt, tokenizer, src.tokenizer_dir)) as tmp:
        writer = HFWriter(tmp, spec, size, target)
        if world().size > 1:
            writer.plan_ahead(_source_dtype(src))
        if world().primary:
            writer.prefetch_tokenizer(src.tokenizer_dir)
        with _aborting(writer):
            for unit in _progress(src.units(), "megatron-to-hf", progress):
                _move(writer, unit, lambda u: (src.read_hf(u),))
            writer.close(src.tokenizer_dir)
        wait_crc_checks()  # the input's CRC-32, checked in the background, before the output is committed
        files = _files_report(tmp)
    return {
        "verb": "megatron-to-hf", "source": src.describe(), "output": str(out), "family": spec.family,
        "dtype": spec.params_dtype, "files": files, "tokenizer": str(src.tokenizer_dir) if src.tokenizer_dir else None,
        "peak_rss_bytes": peak_rss_bytes(), "hf_buffer_peak_bytes": writer.peak_buffer_bytes,
        "seconds": round(time.perf_counter() - t0, 3), "warnings": warnings,
    }


@crc_in_background
def hf_to_megatron(hf_dir: str | Path, out: str | Path, tp: int = 1, pp: int = 1, vpp: int | None = None,
                   dtype: str = "auto", force: bool = False, progress: bool = False,
                   dry_run: bool = False) -> dict[str, Any]:
    """HF directory -> Megatron torch checkpoint (release/, mcore local-spec names) at TP/PP(/VPP)."""

    t0 = time.perf_counter()
    target = parse_dtype(dtype)
    check_output(out, force, (hf_dir,))
    src = open_source(hf_dir)
    if src.format != "hf":
        raise MConvertError(f"{hf_dir}: not a HuggingFace directory (detected {src.format}); use reshard instead")
    cfg = getattr(src, "config", {})
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", _window_by_default(src)) else None
    if window:
        raise MConvertError(f"{Path(hf_dir) / 'config.json'}: sliding_window={window} attention cannot be expressed in "
                            "the Megatron args mconvert writes; converting would silently change attention beyond "
                            f"{window} tokens")
    spec = src.spec if target is None else src.spec.replace(params_dtype=dtypes.of_torch(target).name)
    spec.check_parallel(tp, pp, vpp)
    if dry_run:
        skip_crc_checks()  # nothing is written: the dry run reads no tensor data
        return {**plan_for_source("hf-to-megatron", src, tp=tp, pp=pp, dtype=spec.params_dtype),
                "output": str(out), "dry_run": True, "warnings": []}
    with shared_atomic_output_dir(out, force, inputs=(hf_dir, src.tokenizer_dir)) as tmp:
        writer = MegatronWriter(tmp, spec, tp, pp, vpp, iteration="release", dtype=target, preview=_preview(src))
        with _aborting(writer):
            for unit in _progress(src.units(), "hf-to-megatron", progress):
                _move(writer, unit, lambda u: (u, src.read_mcore(u)))
            writer.close()
        wait_crc_checks()  # the input's manifest, checked in the background, before the output is committed
        tok = copy_tokenizer(src.tokenizer_dir, tmp) if world().primary else []
        files = _files_report(tmp)
    return {
        "verb": "hf-to-megatron", "source": src.describe(), "output": str(out), "family": spec.family,
        "tp": tp, "pp": pp, "vpp": vpp, "dtype": spec.params_dtype, "files": files, "tokenizer_files": tok,
        "optimizer": "none (HF checkpoints carry no optimizer state)",
        "peak_rss_bytes": peak_rss_bytes(), "seconds": round(time.perf_counter() - t0, 3), "warnings": [],
    }


@crc_in_background
def reshard(ckpt: str | Path, out: str | Path, tp: int, pp: int, vpp: int | None = None,
            with_optimizer: bool = False, iteration: int | str | None = None, force: bool = False,
            progress: bool = False, dry_run: bool = False) -> dict[str, Any]:
    """Megatron checkpoint -> the same checkpoint at a new TP/PP(/VPP): merge to full tensors, split again.

    Keeps args (TP/PP updated), the iteration and the scheduler; with `with_optimizer` the Adam states follow
    their parameters' layouts so training resumes at the new layout; without it, no optimizer is written."""

    t0 = time.perf_counter()
    check_output(out, force, (ckpt,))
    src = open_source(ckpt, iteration=iteration)
    if src.format == "hf":
        raise MConvertError(f"{ckpt}: a HuggingFace directory has no TP/PP layout; use hf-to-megatron")
    src.spec.check_parallel(tp, pp, vpp)
    if dry_run:
        skip_crc_checks()  # nothing is written: the dry run reads no tensor data
        return {**plan_for_source("reshard", src, tp=tp, pp=pp, with_optimizer=with_optimizer),
                "output": str(out), "dry_run": True, "warnings": []}
    groups = None
    top: dict[str, Any] = {}
    rank_top = None
    if isinstance(src, MegatronSource):
        top = src.top_level()
        for k in ("args", "checkpoint_version", "iteration", "optimizer"):
            top.pop(k, None)
        rng_from = _rng_source_ranks(src, tp, pp, vpp)
        if "rng_state" in top:
            top.pop("rng_state")
            rank_top = lambda t, p: {"rng_state": src.top_level(*rng_from[(t, p)][::-1])["rng_state"]}  # noqa: E731
        if with_optimizer:
            first = safe_load(src.files[(0, 0)])
            _, groups = index_states(first.get("optimizer"), str(src.files[(0, 0)]))
            del first
    elif with_optimizer:
        raise MConvertError(f"{ckpt}: --with-optimizer is supported for Megatron torch-format checkpoints only")
    iteration_out = src.iteration if src.iteration is not None else "release"
    with shared_atomic_output_dir(out, force, inputs=(ckpt, src.tokenizer_dir)) as tmp:
        writer = MegatronWriter(tmp, src.spec, tp, pp, vpp, iteration=iteration_out,
                                args=getattr(src, "args", None), top_level=top, optimizer_groups=groups,
                                rank_top_level=rank_top, preview=_preview(src))  # unused with optimizer states
        with _aborting(writer):
            for unit in _progress(src.units(), "reshard", progress):
                if not writer.needs(unit):  # another torchrun rank writes its stage
                    writer.skip(unit)
                    continue
                if isinstance(src, MegatronSource) and with_optimizer:
                    tensors, states = src.read_unit(unit, with_optimizer)
                else:
                    tensors, states = src.read_mcore(unit), {}
                writer.add(unit, tensors, states if with_optimizer else None)
            writer.close()
        wait_crc_checks()  # the input's CRC-32, checked in the background, before the output is committed
        tok = copy_tokenizer(src.tokenizer_dir, tmp) if world().primary else []
        files = _files_report(tmp)
    return {
        "verb": "reshard", "source": src.describe(), "output": str(out), "family": src.spec.family,
        "tp": tp, "pp": pp, "vpp": vpp, "iteration": iteration_out, "files": files, "tokenizer_files": tok,
        "optimizer": "re-sharded (Adam exp_avg/exp_avg_sq follow their parameters)" if with_optimizer
        else "not written (pass --with-optimizer to re-shard the Adam states)",
        "peak_rss_bytes": peak_rss_bytes(), "seconds": round(time.perf_counter() - t0, 3), "warnings": [],
    }


def _move(writer: Any, unit: Unit, read: Any) -> None:
    """writer.add(*read(unit)), or writer.skip(unit) when another torchrun rank writes what `unit` feeds."""
    if writer.needs(unit):
        writer.add(*read(unit))
    else:
        writer.skip(unit)


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


def _preview(src: Any) -> Any:
    """The source's `preview` when it can give one for every unit (streamed rank files), else None."""
    if src.preview is None or not getattr(src, "can_preview", lambda: True)():
        return None
    return src.preview


def _window_by_default(src: Any) -> bool:
    """Whether the family's HF class applies `sliding_window` whenever it is set (else only with
    `use_sliding_window`)."""
    return families.of(src.spec).sliding_window_by_default


def _rng_source_ranks(src: Any, tp: int, pp: int, vpp: int | None) -> dict[tuple[int, int], tuple[int, int]]:
    """Target (tp_rank, pp_rank) -> the source (tp_rank, pp_rank) whose rng_state it keeps: the same rank when
    the layout is unchanged, else TP rank modulo the source TP and the stage holding the target's first layer."""
    out = {}
    for p in range(pp):
        first = stage_layers(src.spec.num_layers, pp, p, vpp)[0][0]
        sp = layer_location(src.spec.num_layers, src.pp, first, src.vpp)[0]
        for t in range(tp):
            out[(t, p)] = (t % src.tp, sp)
    return out

