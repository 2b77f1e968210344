"""ONNX runner: logits of an exported decoder (`model.onnx`, optionally with KV-cache inputs) via onnxruntime.

Inputs are fed by name as optimum's export declares them: `input_ids`, `attention_mask`, `position_ids`,
and for a `text-generation-with-past` export `past_key_values.N.{key,value}` (an empty cache, length 0, on
the first pass). `onnx_step` runs one pass with a given cache and returns the `present.*` outputs, so the
cached decode path can be checked too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from mconvert import dtypes
from mconvert.errors import MConvertError
from mconvert.validators.formats import reference_attention


def _np_dtype(ort_type: str) -> Any:
    """numpy dtype of an onnxruntime input type (`tensor(float16)`), float32 for what numpy cannot hold."""
    row = dtypes.of_onnx(ort_type)
    return row.np if row is not None and row.numpy is not None else np.float32


def resolve_onnx_file(path: str | Path) -> Path:
    """A `.onnx` file, or a dir holding `model.onnx` (or exactly one `*.onnx`)."""
    p = Path(path)
    if p.is_file() and p.suffix == ".onnx":
        return p
    if (p / "model.onnx").is_file():
        return p / "model.onnx"
    files = sorted(p.glob("*.onnx"))
    if len(files) == 1:
        return files[0]
    raise MConvertError(f"{p}: no model.onnx (or several *.onnx); not an ONNX export directory")


def onnx_session(path: str | Path, device: str = "cpu") -> Any:
    """An onnxruntime InferenceSession on CPU, or CUDA (falling back to CPU only if CUDA is unavailable)."""
    # heavy optional import: onnxruntime loads only when an ONNX model is run
    import onnxruntime as ort

    f = resolve_onnx_file(path)
    providers = ["CPUExecutionProvider"]
    if str(device).startswith("cuda"):
        if "CUDAExecutionProvider" not in ort.get_available_providers():
            raise MConvertError("device=cuda but this onnxruntime has no CUDAExecutionProvider (pip onnxruntime-gpu)")
        providers = ["CUDAExecutionProvider", "CPUExecutionProvider"]
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    try:
        return ort.InferenceSession(str(f), sess_options=opts, providers=providers)
    except Exception as e:  # corrupt file / missing external data -> one line
        raise MConvertError(f"{f}: onnxruntime cannot load it ({str(e).splitlines()[0]})") from None


def past_inputs(sess: Any) -> list[Any]:
    """The `past_key_values.*` inputs of a session (none for an export without the KV cache)."""
    return [i for i in sess.get_inputs() if i.name.startswith("past_key_values.")]


def empty_past(sess: Any, batch: int) -> dict[str, np.ndarray]:
    """Zero-length cache tensors for every `past_key_values.*` input: [B, kv_heads, 0, head_dim]."""
    out = {}
    for i in past_inputs(sess):
        dims = [d if isinstance(d, int) else None for d in i.shape]
        if len(dims) != 4 or dims[1] is None or dims[3] is None:
            raise MConvertError(f"past input {i.name} has shape {i.shape}; expected [batch, heads, past, head_dim]")
        out[i.name] = np.zeros((batch, dims[1], 0, dims[3]), dtype=_np_dtype(i.type))
    return out


def onnx_step(sess: Any, tokens: torch.Tensor, past: dict[str, np.ndarray] | None = None,
              past_len: int = 0) -> tuple[torch.Tensor, dict[str, np.ndarray]]:
    """One forward pass: logits [B, S, V] and the `present.*` outputs renamed to the next pass's past inputs."""
    ids = tokens.cpu().numpy().astype(np.int64)
    B, S = ids.shape
    names = {i.name for i in sess.get_inputs()}
    feed: dict[str, np.ndarray] = {"input_ids": ids}
    if "attention_mask" in names:
        feed["attention_mask"] = np.ones((B, past_len + S), dtype=np.int64)
    if "position_ids" in names:
        feed["position_ids"] = np.broadcast_to(np.arange(past_len, past_len + S, dtype=np.int64), (B, S)).copy()
    if past_inputs(sess):
        feed.update(past if past is not None else empty_past(sess, B))
    unknown = names - set(feed)
    if unknown:
        raise MConvertError(f"the ONNX model wants inputs mconvert does not know how to fill: {sorted(unknown)}")
    outs = sess.run(None, feed)
    by_name = {o.name: v for o, v in zip(sess.get_outputs(), outs)}
    if "logits" not in by_name:
        raise MConvertError(f"the ONNX model has no 'logits' output (outputs: {sorted(by_name)})")
    present = {k.replace("present.", "past_key_values.", 1): v for k, v in by_name.items() if k.startswith("present.")}
    return torch.from_numpy(np.asarray(by_name["logits"], dtype=np.float32)), present


@torch.no_grad()
def onnx_logits(onnx_dir: str | Path, tokens: torch.Tensor, device: str = "cpu") -> torch.Tensor:
    """Logits [B, S, V] float32 of an ONNX export for `tokens` [B, S] (empty cache when the model takes one)."""
    if tokens.dim() != 2:
        raise MConvertError(f"tokens must be [batch, seq], got shape {tuple(tokens.shape)}")
    sess = onnx_session(onnx_dir, device)
    logits, _ = onnx_step(sess, tokens)
    return logits


def rel_diff(a: torch.Tensor, ref: torch.Tensor) -> float:
    """max |a - ref| / max |ref| (the tolerance measure used throughout mconvert)."""
    a, ref = a.float(), ref.float()
    return float((a - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


@torch.no_grad()
def check_onnx_against_hf(onnx_dir: Path, hf_dir: Path, batch: int = 2, seq: int = 16) -> tuple[float, float | None]:
    """Run onnxruntime and transformers on the same random tokens; (prefill diff, cached-decode diff or None).

    With a sliding window the sequence is twice the window (within the context), so the export is checked where
    the window masks keys."""
    from transformers import AutoModelForCausalLM  # heavy optional import, only when an export is checked

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32, trust_remote_code=False,
                                                 local_files_only=True, **reference_attention(hf_dir)).eval()
    cfg = model.config
    window = getattr(cfg, "sliding_window", None)
    if isinstance(window, int) and not isinstance(window, bool):
        seq = max(seq, 2 * window)
    seq = min(seq, getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", seq))
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)
    ref = model(input_ids=tokens, use_cache=False).logits
    sess = onnx_session(onnx_dir)
    if not past_inputs(sess):
        logits, _ = onnx_step(sess, tokens)
        return rel_diff(logits, ref), None
    pre, past = onnx_step(sess, tokens[:, :-1])
    prefill = rel_diff(pre, ref[:, :-1])
    step, _ = onnx_step(sess, tokens[:, -1:], past=past, past_len=seq - 1)
    return prefill, rel_diff(step, ref[:, -1:])
