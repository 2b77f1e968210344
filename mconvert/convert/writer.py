"""The one Writer protocol every output format implements, and the one report every writing verb returns.

A writer is constructed on the atomic temporary output directory (`io.atomic.atomic_output_dir`) with
everything it needs to know up front (ModelSpec, layout, dtype); `driver.drive` then feeds it one unit at a
time from the Source method `reads` names, and calls `close()` once (or `abort()` on any error, before the
temporary directory is removed). HF (`hf.writer.HFWriter`), Megatron (`megatron.writer.MegatronWriter`), FasterTransformer
(`fastertransformer.FTWriter`) and TensorRT-LLM (`trtllm.TrtllmWriter`) implement it. ONNX does not: optimum
and torch.onnx export a whole HF model in one call (no unit stream to feed), so `to_onnx` keeps its own flow and
returns the same report shape.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Protocol

import torch

from mconvert.convert.base import Unit

# Keys of every writing verb's report, in print order; a verb adds its own after these.
REPORT_KEYS = ("verb", "source", "output", "family", "layout", "dtype", "files", "warnings", "peak_rss_bytes",
               "seconds")


class Writer(Protocol):
    """One output format, written unit by unit into a directory it was constructed on."""

    reads: Literal["hf", "mcore"]  # which Source read the driver calls: read_hf (HF names) or read_mcore
    # (optional) `takes_parts = True`: `add` may take a unit in consecutive parts (`Source.read_hf_parts`; an
    # mcore writer's `add(unit, part, complete=False)` for each of `Source.read_mcore_parts`, then
    # `add(unit, {}, complete=True)`)

    def add(self, unit: Unit, tensors: dict[str, torch.Tensor]) -> None:
        """Take one unit's full tensors (embedding, layer i, final, in the Source's unit order)."""

    def close(self) -> list[Path]:
        """Finish every file (configs, indexes, checks of what was written); the files written."""

    def abort(self) -> None:
        """Stop streams, threads and open files after an error; the driver then removes the directory."""


class Report(dict):
    """A writing verb's report: a dict with `REPORT_KEYS` first (JSON as is), whose keys read as attributes too."""

    def __getattr__(self, key: str) -> Any:
        try:
            return self[key]
        except KeyError:
            raise AttributeError(key) from None


def files_report(root: Path, ranks: dict[str, int] | None = None, default_rank: int = 0) -> list[dict[str, Any]]:
    """Every file under `root` with its size, sorted by relative path (the report's `files`). `ranks` (under
    torchrun): the torchrun rank that wrote each file, `default_rank` for files it does not name."""
    out = []
    for p in sorted(root.rglob("*")):
        if p.is_file():
            rel = str(p.relative_to(root))
            out.append({"path": rel, "bytes": p.stat().st_size,
                        **({} if ranks is None else {"rank": ranks.get(rel, default_rank)})})
    return out


def make_report(verb: str, source: str, output: str | Path, family: str, layout: str, dtype: str,
                files: list[dict[str, Any]], warnings: list[str], peak_rss_bytes: int | None, seconds: float,
                **extras: Any) -> Report:
    """The report of one writing verb: the common keys, then the verb's own (`extras`)."""
    common = dict(verb=verb, source=source, output=str(output), family=family, layout=layout, dtype=dtype,
                  files=files, warnings=list(warnings), peak_rss_bytes=peak_rss_bytes, seconds=round(seconds, 3))
    clash = set(common) & set(extras)
    if clash:
        raise ValueError(f"report extras repeat common keys: {sorted(clash)}")
    return Report(common, **extras)
