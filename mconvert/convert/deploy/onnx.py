"""ONNX export (`mconvert to-onnx`, whose verb is in `convert/verbs.py`) through optimum-onnx, with OUR tolerance
enforced by onnxruntime. `prepare` is the one place its refusals, task and sizes are worked out (the verb and its
`--dry-run` call it); `export` runs the exporter.

optimum's `main_export` (task `text-generation` or `text-generation-with-past`) writes `model.onnx`
(+ `model.onnx_data` external data when the graph exceeds protobuf's 2 GB) and only *warns* when its own
validation misses; here the export is rejected instead unless onnxruntime's logits match transformers' within
`rtol` (max |Δ| / max |ref|) on a prefill pass and, with the cache, on one cached decode step too.
A Megatron source is first written as an HF dir (fp32) in a temporary directory by the HF writer.
Fallback (`exporter="torch"`): plain `torch.onnx.export` of the logits-only graph (no KV cache), for
installs without optimum-onnx or architectures it does not know; checked the same way.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from mconvert.io.paths import inside_file, load_json_object
from mconvert import dtypes
from mconvert.io.paths import copy_contained
from mconvert.convert.writer import Report, make_report
from mconvert.mappings import families
from mconvert.errors import MConvertError
from mconvert.spec import ModelSpec

DEFAULT_RTOL = 1e-4

# (ONNX dir, HF dir) -> (prefill relative logits difference, cached-decode one or None)
OnnxCheck = Callable[[Path, Path], tuple[float, "float | None"]]


@dataclass
class OnnxResult:
    """What `to_onnx` wrote and the differences it measured against transformers."""

    out: str
    task: str
    exporter: str
    opset: int | None
    files: dict[str, int]
    prefill_rel_diff: float
    decode_rel_diff: float | None
    rtol: float
    seconds: float
    notes: list[str] = field(default_factory=list)
    source: str = ""
    family: str = ""
    dtype: str = ""
    peak_rss_bytes: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def report(self) -> Report:
        """The common report shape of the writing verbs (`convert/writer.py`)."""
        files = [{"path": name, "bytes": size} for name, size in self.files.items()]
        return make_report("to-onnx", self.source, self.out, self.family, self.task, self.dtype, files, [],
                           self.peak_rss_bytes, self.seconds, exporter=self.exporter, opset=self.opset,
                           prefill_rel_diff=self.prefill_rel_diff, decode_rel_diff=self.decode_rel_diff,
                           rtol=self.rtol, notes=self.notes)


# The dtype of the exported graph: optimum's main_export loads the model in fp32 (its `dtype` default) and the
# torch exporter asks for float32, whatever config.json states; the logits check runs in fp32 too.
EXPORT_DTYPE = "float32"
EXPORTERS = ("optimum", "torch")


def task_of(exporter: str, with_past: bool) -> str:
    """The export task of the options (`text-generation`, with the KV cache `-with-past`); an exporter mconvert
    does not run, or the cache asked of the torch fallback, is refused."""
    if exporter not in EXPORTERS:
        raise MConvertError(f"--exporter {exporter!r}: choose optimum or torch")
    if exporter == "torch" and with_past:
        raise MConvertError("the torch.onnx fallback exports no KV cache; pass --no-past with --exporter torch")
    return "text-generation-with-past" if with_past else "text-generation"


@dataclass(frozen=True)
class OnnxPrepared:
    """What one ONNX export writes, worked out from the spec before anything is exported: its task, exporter,
    the graph's dtype and the bytes of its weights."""

    task: str
    exporter: str
    dtype: str
    weight_bytes: int


def prepare(spec: ModelSpec, exporter: str = "optimum", with_past: bool = True, source: str = "") -> OnnxPrepared:
    """The one place ONNX's refusals and sizes are worked out (the verb and its `--dry-run` call it): the options
    (`task_of`), then a mixture-of-experts family (its `Family.moe`), refused before any export because the ONNX
    graph of a routed MLP is not validated here; `source` names the input in that refusal."""
    task = task_of(exporter, with_past)
    fam = families.of(spec)
    if fam.moe:
        raise MConvertError(f"{source}: {fam.architecture} (mixture of experts) is not mapped to ONNX (the routed "
                            "MLP's export is not validated); conversion refused — serve the HF export with "
                            "transformers or vLLM")
    weights = spec.num_parameters() * dtypes.lookup(EXPORT_DTYPE).itemsize  # type: ignore[union-attr]
    return OnnxPrepared(task, exporter, EXPORT_DTYPE, weights)


@contextlib.contextmanager
def quiet() -> Any:
    """Silence transformers/optimum/torch.onnx chatter during export (our report says what matters)."""
    # heavy optional import: transformers loads only when a model is run
    from transformers.utils import logging as hf_logging

    with contextlib.suppress(ImportError):  # importing optimum configures its loggers: do it before muting
        import optimum.exporters.onnx  # noqa: F401
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    loggers = [logging.getLogger(n) for n in ("optimum", "torch.onnx", "root")]
    old = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    logging.disable(logging.WARNING)  # optimum re-arms its loggers while exporting; silence WARNING and below
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(logging.NOTSET)
        hf_logging.set_verbosity(level)
        for lg, lv in zip(loggers, old):
            lg.setLevel(lv)


def _export_optimum(hf_dir: Path, out: Path, with_past: bool, opset: int | None) -> None:
    try:  # optional at run time: without optimum-onnx the torch exporter still works
        from optimum.exporters.onnx import main_export
    except ImportError as e:
        raise MConvertError(f"optimum-onnx is not installed ({e}); pip install optimum-onnx, or --exporter torch") from None
    task = "text-generation-with-past" if with_past else "text-generation"
    try:
        main_export(str(hf_dir), output=out, task=task, opset=opset, device="cpu", do_validation=False,
                    local_files_only=True, library_name="transformers", trust_remote_code=False)
    except Exception as e:  # optimum raises ValueError/KeyError/RuntimeError for unsupported models
        raise MConvertError(f"optimum could not export {hf_dir} ({type(e).__name__}: {str(e).splitlines()[0][:200]})") from None


class _LogitsOnly(torch.nn.Module):
    """Wraps a causal LM so the traced graph is input_ids, attention_mask -> logits (no cache)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        # A ready 4-D additive mask (causal & padding) keeps transformers' vmap-based mask builder out of the trace.
        S = input_ids.shape[1]
        causal = torch.ones(S, S, dtype=torch.bool, device=input_ids.device).tril()
        keep = causal[None, None] & attention_mask.bool()[:, None, None, :]
        mask = torch.zeros(keep.shape, dtype=torch.float32).masked_fill(~keep, torch.finfo(torch.float32).min)
        return self.model(input_ids=input_ids, attention_mask=mask, use_cache=False).logits


def _export_torch(hf_dir: Path, out: Path, opset: int | None) -> None:
    """Fallback: `torch.onnx.export` (TorchScript exporter) of the logits-only graph; copies config.json."""
    # heavy optional import: transformers loads only when a model is run
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32, attn_implementation="eager",
                                                 trust_remote_code=False, local_files_only=True)
    model.eval()
    ids = torch.zeros(1, 8, dtype=torch.long)
    torch.onnx.export(
        _LogitsOnly(model), (ids, torch.ones_like(ids)), str(out / "model.onnx"),
        input_names=["input_ids", "attention_mask"], output_names=["logits"],
        dynamic_axes={"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "seq"},
                      "logits": {0: "batch", 1: "seq"}},
        opset_version=opset or 17, dynamo=False,
    )
    for name in ("config.json", "generation_config.json"):
        if (hf_dir / name).is_file():
            copy_contained(hf_dir, name, out, "json")


def hf_model_type(hf_dir: Path) -> str:
    """The family (`model_type`) of the HF directory optimum exports, from its config.json (for the report)."""
    cfg = load_json_object(inside_file(hf_dir, "config.json", f"{hf_dir}: config"), "config",
                           "fix it or re-copy the model directory")
    return str(cfg.get("model_type", ""))


def export(hf_dir: Path, out: Path, prepared: OnnxPrepared, opset: int | None) -> None:
    """Export the HF directory into `out` with the prepared exporter and task, its chatter silenced."""
    with quiet():
        if prepared.exporter == "optimum":
            _export_optimum(hf_dir, out, prepared.task == "text-generation-with-past", opset)
        else:
            _export_torch(hf_dir, out, opset)
