"""ONNX export (`mconvert to-onnx`) through optimum-onnx, with OUR tolerance enforced by onnxruntime.

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
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from mconvert.io.atomic import atomic_output_dir, check_output
from mconvert.io.paths import check_tree_contained, inside_file, load_json_object
from mconvert import dtypes
from mconvert.convert.driver import megatron_to_hf, peak_rss_bytes
from mconvert.io.paths import copy_contained
from mconvert.convert.sources import detect_format, open_source
from mconvert.convert.writer import Report, make_report
from mconvert.mappings import families
from mconvert.errors import MConvertError, renamed

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


def _is_hf_dir(p: Path, iteration: str | None = None) -> bool:
    return detect_format(p, iteration) == "hf"


def refuse_moe(cfg: dict[str, Any], source: str) -> None:
    """Refuse a mixture-of-experts family (its `Family.moe`) before any export: the ONNX graph of a routed MLP
    is not validated here."""
    archs = cfg.get("architectures") or []
    fam = next((f for f in map(families.by_architecture, archs if isinstance(archs, list) else []) if f), None)
    fam = fam or families.by_model_type(cfg.get("model_type"))
    if fam is not None and fam.moe:
        raise MConvertError(f"{source}: {fam.architecture} (mixture of experts) is not mapped to ONNX (the routed "
                            "MLP's export is not validated); conversion refused — serve the HF export with "
                            "transformers or vLLM")


@contextlib.contextmanager
def _hf_dir_for(src: Path, iteration: str | None) -> Any:
    """Yield an HF dir for `src`: itself, or a temporary fp32 export of a Megatron checkpoint."""
    if _is_hf_dir(src, iteration):
        cfg = load_json_object(inside_file(src, "config.json", f"{src}: config"), "config", "fix it or re-copy the model directory")  # before optimum
        refuse_moe(cfg, str(src))
        yield src
        return

    with tempfile.TemporaryDirectory(prefix="mconvert-onnx-hf-") as tmp:
        hf = Path(tmp) / "hf"
        megatron_to_hf(src, hf, iteration=iteration, dtype="fp32")
        refuse_moe(load_json_object(hf / "config.json", "config", "re-run the conversion"), str(src))
        try:
            yield hf
        except MConvertError as e:  # named as the checkpoint: the scratch export is gone once this returns
            raise MConvertError(renamed(str(e), hf, f"{src}'s HF export")) from None


@contextlib.contextmanager
def _quiet() -> Any:
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


# The dtype of the exported graph: optimum's main_export loads the model in fp32 (its `dtype` default) and the
# torch exporter asks for float32, whatever config.json states; the logits check runs in fp32 too.
EXPORT_DTYPE = "float32"


def _describe_hf(hf_dir: Path) -> str:
    """The family (`model_type`) of the HF directory optimum exports, from its config.json (for the report)."""
    cfg = load_json_object(inside_file(hf_dir, "config.json", f"{hf_dir}: config"), "config",
                           "fix it or re-copy the model directory")
    return str(cfg.get("model_type", ""))


def to_onnx(src: str | Path, out: str | Path, with_past: bool = True, opset: int | None = None,
            force: bool = False, rtol: float = DEFAULT_RTOL, exporter: str = "optimum",
            iteration: str | None = None, *, check: OnnxCheck, dry_run: bool = False) -> OnnxResult | Report:
    """`mconvert to-onnx`: export, then refuse (leaving no OUT) unless onnxruntime matches transformers.

    `check(onnx_dir, hf_dir)` runs both on the same tokens (the validators' `check_onnx_against_hf`).
    `dry_run`: the source is opened and refused as it would be; the report names what would be written."""
    t0 = time.perf_counter()
    src, out = Path(src), Path(out)
    if exporter not in ("optimum", "torch"):
        raise MConvertError(f"--exporter {exporter!r}: choose optimum or torch")
    if exporter == "torch" and with_past:
        raise MConvertError("the torch.onnx fallback exports no KV cache; pass --no-past with --exporter torch")
    check_output(out, force, (src,))
    from_megatron = not _is_hf_dir(src, iteration)  # also the one-line error for a non-checkpoint
    if not from_megatron and iteration is not None:  # it would be ignored: the export is of the directory as is
        raise MConvertError(f"--iteration {iteration}: {src} is a HuggingFace directory, which has no iterations; "
                            "drop --iteration (it chooses among a Megatron checkpoint's iter_* directories)")
    task = "text-generation-with-past" if with_past else "text-generation"
    described = f"{'megatron' if from_megatron else 'hf'} checkpoint {src}"
    # Every config field is mapped or refused, as by every verb: optimum exports what transformers' tracing
    # sees at its dummy length, and a field that acts only on longer inputs (dynamic NTK rope past
    # max_position_embeddings) would pass the logits check and be baked out of the graph.
    with open_source(src, iteration=iteration, verify=False) as source:
        spec = source.spec
        if dry_run:
            described = source.describe()
    if dry_run:
        family, dtype = spec.family, EXPORT_DTYPE
        weights = spec.num_parameters() * dtypes.lookup(dtype).itemsize  # type: ignore[union-attr]
        return make_report("to-onnx", described, out, family, task, dtype,
                           [{"path": "model.onnx", "bytes": None}], [], None, time.perf_counter() - t0,
                           dry_run=True, exporter=exporter, opset=opset, rtol=rtol, weight_bytes=weights,
                           note="optimum writes model.onnx and, for large graphs (or as it chooses), the weights "
                                "as model.onnx_data; weight_bytes is their size from the parameter count")
    notes: list[str] = []
    with _hf_dir_for(src, iteration) as hf_dir, atomic_output_dir(out, force, inputs=(src,)) as tmp:
        family, dtype = _describe_hf(hf_dir), EXPORT_DTYPE
        check_tree_contained(hf_dir, f"{hf_dir}: model file")  # optimum and transformers open files by name
        if from_megatron:
            notes.append("Megatron source exported to a temporary fp32 HF dir first")
        with _quiet():
            if exporter == "optimum":
                _export_optimum(hf_dir, tmp, with_past, opset)
            else:
                _export_torch(hf_dir, tmp, opset)
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
    return OnnxResult(str(out), task, exporter, opset, files, prefill, decode, rtol,
                      round(time.perf_counter() - t0, 2), notes, described, family, dtype, peak_rss_bytes())
