"""The streaming driver: THE loop every writing verb (`convert/verbs.py`) runs (`write_output` -> `drive`), moving
one unit (embedding, layer i, final) at a time from a Source (`convert/base.py`) to a `Writer`
(`convert/writer.py`), and the report of `--dry-run` (`dry_run_report`).

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

from mconvert.convert import bounds
from mconvert.convert.base import END, SKIP, SourceBase, Unit, parts_ahead
from mconvert.convert.progress import unit_progress
from mconvert.convert.scaleout import claim_files, shared_atomic_output_dir, world
from mconvert.io.crc import input_check_figures, skip_crc_checks, start_crc_checks, wait_crc_checks
from mconvert.convert.writer import Report, Writer, files_report, make_report
from mconvert.errors import MConvertError


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


def drive(src: SourceBase, writer: Writer, what: str = "", progress: bool = False) -> list[Path]:
    """THE loop: every unit of `src`, in the writer's `unit_order`, read the way the writer's and the source's
    declared fields say (`convert/writer.py`: `reads`, `feeds`, `splits_experts`, `needs`/`wants`;
    `convert/base.py`: `gives_hf_tasks`, `gives_mcore_tasks`, `gives_mcore_parts`), into the writer; then close it.
    On any error the writer is aborted (threads, staging memory, open files) before the caller's output is
    removed."""
    if not isinstance(writer, Writer):
        raise TypeError(f"internal: {type(writer).__name__} is not a convert.writer.Writer")
    if world().size > 1 and not writer.shares_work:
        raise MConvertError(f"{what}: this output runs in one process and does not share its work over torchrun; "
                            "run it without torchrun")
    with _aborting(writer):  # MoE layers one expert at a time where both sides can (memory: one expert)
        start_crc_checks()  # every reader has claimed the input records it checks on the bytes it reads
        if src.held_sizes:  # the source's memory pre-check, for what this writer is fed at once
            bounds.check_memory(bounds.held_by_writer(src.held_sizes, writer.splits_experts,
                                                      writer.feeds != "units"), src.held_source)
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
            if feeds == "states" and writer.takes_parts:  # each part's states with it, as `read_unit_parts` gives
                for tensors, states in src.read_unit_parts(unit, True):
                    writer.add(unit, tensors, states, complete=False)
                writer.add(unit, {}, {}, complete=True)
            elif feeds == "states":
                tensors, states = src.read_unit(unit, True)
                writer.add(unit, tensors, states)
            elif feeds == "parts" and writer.reads == "hf":
                # a torchrun process's shards (`wants`); what is written is freed before the rest is read
                for part in src.read_hf_parts(unit, only=writer.wants(unit)):
                    writer.add(unit, part)
            elif feeds == "parts" and src.gives_mcore_parts:
                for part in src.read_mcore_parts(unit):
                    writer.add(unit, part, complete=False)
                writer.add(unit, {}, complete=True)
            else:
                writer.add(unit, src.read_hf(unit) if writer.reads == "hf" else src.read_mcore(unit))
        return writer.close()


def _chained_reads(src: SourceBase, writer: Writer) -> tuple[Callable[[Unit], Any], bool] | None:
    """How `drive` reads every unit of a writer that takes parts on one pool (`base.parts_ahead`): the source's
    per-unit tasks and whether the writer takes a unit's end apart (`add(unit, {}, complete=True)`); None where
    the loop reads unit by unit (a source without tasks, an MoE model to a Megatron-side writer, whose experts
    come whole one at a time: `base.LayerParts.comes_whole`)."""
    if writer.reads == "hf" and src.gives_hf_tasks:
        return (lambda unit: src.hf_part_tasks(unit, writer.wants(unit))), False
    if writer.reads != "hf" and src.gives_mcore_tasks and not src.spec.is_moe:
        return src.mcore_part_tasks, True
    return None


def write_output(verb: str, src: SourceBase, out: str | Path, make_writer: Callable[[Path], Writer], *, force: bool,
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


def dry_run_report(verb: str, src: SourceBase, out: str | Path, plan: dict[str, Any], layout: str, t0: float,
                   warnings: list[str] | None = None, **extras: Any) -> Report:
    """The report of `--dry-run`: the plan's files, sizes and memory estimate in the common report shape."""
    skip_crc_checks()  # nothing is written: the dry run reads no tensor data
    src.close()
    plan = {k: v for k, v in plan.items() if k not in ("verb", "source", "output")}
    dtype, files = plan.pop("dtype"), plan.pop("files")
    return make_report(verb, src.describe(), out, src.spec.family, layout, dtype, files, warnings or [], None,
                       time.perf_counter() - t0, dry_run=True, **plan, **extras)


@contextmanager
def _aborting(writer: Any) -> Iterator[None]:
    """On any error, stop the writer's streams (threads, staging memory, open files) before the output
    directory is removed: a library caller's process must not keep them."""
    try:
        yield
    except BaseException:
        writer.abort()
        raise


