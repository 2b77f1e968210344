"""`mconvert validate`: run a reference and other models, each in its own format, on the same tokens, and
judge their logits against the reference with dtype-dependent tolerances.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.table import Table

from mconvert import dtypes
from mconvert.errors import MConvertError, rich_safe
from mconvert.validators.compare import (
    TOLERANCES,
    compare_logits,
    judge,
    layer_errors,
    perplexity,
    tolerance_for,
)
from mconvert.validators.formats import ModelInfo, norm_dtype, describe
from mconvert.validators.plot import plot_errors
from mconvert.validators.runners import RunOutput, resolve_device, run_model
from mconvert.validators.tokens import make_batch

SCHEMA = "mconvert.validate/1"


@dataclass
class ModelResult:
    """One model's run and (for non-reference models) its comparison with the reference."""

    path: str
    format: str
    dtype: str
    layout: dict[str, Any]
    vocab_size: int | None
    seconds: float | None = None
    perplexity: float | None = None
    metrics: dict[str, Any] | None = None
    per_layer_max_abs: list[float] | None = None
    tolerance: dict[str, Any] | None = None
    failures: list[str] = field(default_factory=list)
    error: str | None = None
    passed: bool = False


@dataclass
class ValidateReport:
    """Everything `validate` measured; `to_json()` is the documented `--json` schema."""

    device: str
    tokens: dict[str, Any]
    reference: ModelResult
    results: list[ModelResult]
    passed: bool
    seconds: float

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "passed": self.passed,
            "device": self.device,
            "seconds": round(self.seconds, 3),
            "tokens": self.tokens,
            "tolerances": {k: asdict(v) for k, v in TOLERANCES.items()},
            "reference": asdict(self.reference),
            "results": [asdict(r) for r in self.results],
        }


def validate(
    ref: str | Path,
    others: list[str | Path],
    device: str = "auto",
    n_tokens: int = 32,
    text_file: str | Path | None = None,
    batch: int = 2,
    plot: str | Path | None = None,
) -> ValidateReport:
    """Run `ref` and every model in `others` on one token batch; compare each with `ref`."""
    t0 = time.perf_counter()
    dev = resolve_device(device)
    if not others:
        raise MConvertError("validate: give at least one model to compare with the reference")
    infos = [describe(ref)] + [describe(o) for o in others]
    window = max((i.window for i in infos if i.window), default=None)
    tokens, source = _tokens(infos, n_tokens, batch, text_file, window)

    ref_info = infos[0]
    ref_res = _result(ref_info)
    ref_out = run_model(ref_info, tokens, dev)  # the reference must run; its error aborts
    _computed_dtype(ref_info, ref_res, ref_out)
    ref_res.seconds, ref_res.perplexity, ref_res.passed = ref_out.seconds, perplexity(ref_out.logits, tokens), True

    results: list[ModelResult] = []
    per_pos: dict[str, list[float]] = {}
    per_layer: dict[str, list[float]] = {}
    for info in infos[1:]:
        res = _result(info)
        results.append(res)
        try:
            out = run_model(info, tokens, dev)
        except MConvertError as e:
            res.error, res.failures = str(e), [f"did not run: {e}"]
            continue
        except Exception as e:  # a runner crashing on one model must not hide the others' verdicts
            msg = (str(e).strip().splitlines() or [""])[0][:300]
            res.error, res.failures = f"{type(e).__name__}: {msg}", [f"runner failed: {type(e).__name__}: {msg}"]
            continue
        _computed_dtype(info, res, out)
        _judge(res, ref_info, ref_out, info, out, tokens)
        if res.metrics:
            per_pos[_label(info)] = res.metrics["per_position_max_abs"]
        if res.per_layer_max_abs:
            per_layer[_label(info)] = res.per_layer_max_abs
    report = ValidateReport(
        device=dev,
        tokens={"batch": int(tokens.shape[0]), "seq_len": int(tokens.shape[1]), "source": source,
                "text": str(text_file) if text_file else "built-in",
                **({"window": window, "beyond_window": int(tokens.shape[1]) > window} if window else {})},
        reference=ref_res,
        results=results,
        passed=all(r.passed for r in results),
        seconds=time.perf_counter() - t0,
    )
    if plot:
        plot_errors(Path(plot), per_pos, per_layer, title=f"logit error vs {_label(ref_info)}")
    return report


def _tokens(infos: list[ModelInfo], n_tokens: int, batch: int, text_file: str | Path | None,
            window: int | None = None):
    """The token batch; with a sliding window (keys per query) a sequence no longer than it is lengthened to twice
    the window (within the context), so the comparison covers positions where the window masks keys."""
    vocabs = [i.vocab_size for i in infos if i.vocab_size]
    if not vocabs:
        raise MConvertError(f"{infos[0].path}: cannot tell the vocabulary size of any model given")
    max_pos = min([i.max_positions for i in infos if i.max_positions] or [n_tokens])
    if n_tokens < 2:
        raise MConvertError(f"--tokens {n_tokens}: need at least 2 tokens per sequence")
    if n_tokens > max_pos:
        raise MConvertError(f"--tokens {n_tokens} exceeds max_position_embeddings {max_pos}; use --tokens {max_pos}")
    if window is not None and n_tokens <= window < max_pos:
        n_tokens = min(max_pos, 2 * window)
    text = None
    if text_file is not None:
        try:
            text = Path(text_file).read_text(encoding="utf-8", errors="replace")
        except OSError as e:
            raise MConvertError(f"--text {text_file}: cannot read ({e.strerror})") from None
    tok_dir = next((i.tokenizer_dir for i in infos if i.tokenizer_dir is not None), None)
    return make_batch(min(vocabs), n_tokens, batch, text, tok_dir)


def _result(info: ModelInfo) -> ModelResult:
    return ModelResult(path=str(info.path), format=info.format, dtype=info.dtype, layout=dict(info.layout),
                       vocab_size=info.vocab_size)


def _computed_dtype(info: ModelInfo, res: ModelResult, out: RunOutput) -> None:
    """The tolerance row follows the dtype the engine computed in when it reports one: a config that states a
    coarser dtype than the engine ran in must not loosen the limits a model is judged by."""
    if out.dtype is not None:
        info.dtype = res.dtype = norm_dtype(out.dtype)


def _judge(res: ModelResult, ref_info: ModelInfo, ref_out: RunOutput, info: ModelInfo, out: RunOutput,
           tokens: torch.Tensor) -> None:
    res.seconds = out.seconds
    tol = tolerance_for(ref_info.dtype, info.dtype)
    res.tolerance = asdict(tol)
    v_ref, v_out = ref_out.logits.shape[-1], out.logits.shape[-1]
    if v_ref != v_out:
        hint = " (vocab padding left in?)" if v_out > v_ref else ""
        res.failures = [f"vocab: {v_out} logit columns, reference has {v_ref}{hint}"]
        res.perplexity = perplexity(out.logits, tokens)
        return
    m = compare_logits(ref_out.logits, out.logits)
    res.metrics = m.to_dict()
    res.metrics["max_abs_limit"] = tol.max_abs_limit(m.ref_scale)
    res.perplexity = perplexity(out.logits, tokens)
    res.per_layer_max_abs = layer_errors(ref_out.hidden, out.hidden)
    res.failures = judge(m, tol)
    res.passed = not res.failures


def _label(info: ModelInfo) -> str:
    lay = ",".join(f"{k}={v}" for k, v in info.layout.items() if k != "iteration")
    return f"{info.path.name} [{info.format}{' ' + lay if lay else ''}]"


def render(report: ValidateReport, console) -> None:
    """The rich table: one row per model, its metrics against the limits applied, and the verdict."""
    window = (f", sliding window {report.tokens['window']} keys" if report.tokens.get("window") else "")
    t = Table(title=f"validate on {report.device}: {report.tokens['batch']}×{report.tokens['seq_len']} tokens "
              f"({rich_safe(report.tokens['source'])}{window})", title_justify="left")
    for col in ("model", "format", "dtype", "max abs (limit)", "mean abs", "KL(ref‖x)", "top-1", "ppl", "verdict"):
        t.add_column(col, overflow="fold")
    r = report.reference
    t.add_row(rich_safe(Path(r.path).name), rich_safe(_fmt_layout(r)), _short_dtype(r.dtype), "—", "—", "—", "—",
              f"{r.perplexity:.4g}", "[cyan]REF[/]")
    used = set()
    for x in report.results:
        m = x.metrics or {}
        if x.tolerance:
            used.add(x.tolerance["dtype"])
        verdict = "[green]PASS[/]" if x.passed else "[bold red]FAIL[/]"
        t.add_row(
            rich_safe(Path(x.path).name), rich_safe(_fmt_layout(x)), _short_dtype(x.dtype),
            f"{m['max_abs']:.2e} ({m['max_abs_limit']:.1e})" if m else "—", f"{m['mean_abs']:.2e}" if m else "—",
            f"{m['kl']:.1e}" if m else "—", f"{m['top1']:.3f}" if m else "—",
            f"{x.perplexity:.4g}" if x.perplexity is not None else "—", verdict,
        )
    console.print(t)
    for d in sorted(used):
        tol = TOLERANCES[d]
        console.print(f"  limits ({_short_dtype(d)}): max abs ≤ {tol.atol:g} + {tol.rtol:g}·max|ref|, "
                      f"mean abs ≤ {tol.mean_abs:g}, KL ≤ {tol.kl:g}, top-1 ≥ {tol.top1:g}", highlight=False)
    for x in report.results:
        if not x.passed:
            console.print(f"  [red]✗[/] {rich_safe(x.path)}: {rich_safe('; '.join(x.failures))}", highlight=False,
                          soft_wrap=True)
    n_bad = sum(not x.passed for x in report.results)
    if n_bad:
        console.print(f"[bold red]FAIL[/]: {n_bad} of {len(report.results)} model(s) differ from the reference")
    else:
        console.print(f"[bold green]PASS[/]: all {len(report.results)} model(s) match the reference")


def _short_dtype(d: str) -> str:
    return dtypes.short_name(d)


def _fmt_layout(x: ModelResult) -> str:
    lay = " ".join(f"{k}={v}" for k, v in x.layout.items() if k != "iteration")
    return f"{x.format} {lay}".strip()
