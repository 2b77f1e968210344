"""The one Writer contract every output format implements, and the one report every writing verb returns.

A writer is constructed on the atomic temporary output directory (`io.atomic.atomic_output_dir`) with
everything it needs to know up front (ModelSpec, layout, dtype; the verb has checked the layout once with
`ModelSpec.check_parallel`); `driver.drive` then feeds it one unit at a time, the way its declared
capabilities (`Writer`'s fields) say, and calls `close()` once (or `abort()` on any error, before the temporary
directory is removed). HF (`hf.writer.HFWriter`), Megatron (`megatron.writer.MegatronWriter`,
`megatron.torch_dist_writer.TorchDistWriter`), FasterTransformer (`deploy.fastertransformer.FTWriter`), TensorRT-LLM
(`deploy.trtllm.TrtllmWriter`) and GGUF (`deploy.gguf.GgufWriter`) subclass it. ONNX does not: optimum and torch.onnx export a
whole HF model in one call (no unit stream to feed), so `to_onnx` keeps its own flow and returns the same report
shape.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from mconvert.convert.base import Unit

if TYPE_CHECKING:
    import torch

# Keys of every writing verb's report, in print order; a verb adds its own after these.
REPORT_KEYS = ("verb", "source", "output", "family", "layout", "dtype", "files", "warnings", "peak_rss_bytes",
               "seconds")

Feeds = Literal["units", "parts", "states"]


class Writer:
    """One output format, written unit by unit into a directory it was constructed on.

    Every capability the driver reads is declared here with its default; a writer overrides what it does (a
    class attribute, an instance attribute set in `__init__`, or a property) and `drive` reads only these
    fields, so what a writer is fed is read off its class, never guessed from what it happens to define."""

    # which Source read the driver calls: read_hf (HF names) or read_mcore (megatron-core names)
    reads: Literal["hf", "mcore"]
    # `add` may take a unit in consecutive parts: `Source.read_hf_parts` for an HF-side writer; for an
    # mcore-side one `add(unit, part, complete=False)` per part of `Source.read_mcore_parts`, then
    # `add(unit, {}, complete=True)`
    takes_parts: bool = False
    # `add(unit, tensors, states)`: each parameter's optimizer states come with it (`Source.read_unit`); with
    # `takes_parts` too, a unit's parts come with their states (`Source.read_unit_parts`, `complete=False`, then
    # `add(unit, {}, {}, complete=True)`)
    takes_states: bool = False
    # an MoE layer may come as its dense part and one unit per expert (`base.LayerPart`), when the source can
    # read it so too: memory is one expert, not one layer of experts
    splits_experts: bool = False
    # under torchrun each process writes its share of the files (`needs`, `skip`, `wants` say which); a writer
    # that does not runs in one process and the driver refuses torchrun for it
    shares_work: bool = False

    @property
    def feeds(self) -> Feeds:
        """What `add` takes: a unit's optimizer states with its tensors (in parts when it `takes_parts`), a unit
        in parts, or whole units."""
        return "states" if self.takes_states else "parts" if self.takes_parts else "units"

    def unit_order(self, units: list[Unit]) -> list[Unit]:
        """The order this writer takes the source's units in (default: the source's: embedding, layers, final);
        a writer whose files are laid out up front takes them in file order."""
        return units

    def needs(self, unit: Unit) -> bool:
        """Whether this process reads `unit` (`shares_work`: another torchrun process may write what it feeds)."""
        return True

    def skip(self, unit: Unit) -> None:
        """Pass `unit` by unread (`needs` is False): another process writes what it feeds."""

    def wants(self, unit: Unit) -> set[str] | None:
        """The HF names of `unit` this process keeps (an HF-side writer taking parts); None: every name. A
        source may leave the others unread."""
        return None

    def add(self, unit: Unit, tensors: dict[str, torch.Tensor], states: dict[str, dict] | None = None,
            complete: bool = True) -> None:
        """Take one unit's full tensors (embedding, layer i, final, in `unit_order`); `states` (`takes_states`):
        their optimizer states; `complete=False` (`takes_parts`, mcore side): more of the unit follows."""
        raise NotImplementedError

    def close(self) -> list[Path]:
        """Finish every file (configs, indexes, checks of what was written); the files written."""
        raise NotImplementedError

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
