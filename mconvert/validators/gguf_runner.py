"""Run a `.gguf` in llama.cpp itself: llama-cpp-python in its own venv (`make gguf-env`), driven through
`llama_cpp_worker.py` in a subprocess; and read a GGUF's metadata with gguf-py (no llama.cpp needed).
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import torch

from mconvert.errors import MConvertError

GGUF_VENV = Path.home() / ".cache" / "mconvert" / "gguf-venv"
STAMP = ".mconvert-gguf-ok"
WORKER = Path(__file__).with_name("llama_cpp_worker.py")
ENV_SCRIPT = Path(__file__).with_name("gguf_env.sh")
TIMEOUT_S = 600


def gguf_python(explicit: str | Path | None = None) -> Path:
    """The llama.cpp venv's interpreter: `explicit`, else $MCONVERT_GGUF_PYTHON, else the venv `make gguf-env`
    builds; one MConvertError saying how to build it when there is none."""
    cand = explicit or os.environ.get("MCONVERT_GGUF_PYTHON")
    if cand:
        p = Path(cand)
        if not (p.is_file() and os.access(p, os.X_OK)):
            raise MConvertError(f"{p}: not an executable Python interpreter (the llama.cpp venv's bin/python)")
        return p
    venv = Path(os.environ.get("GGUF_VENV", GGUF_VENV))
    if (venv / STAMP).is_file() and (venv / "bin" / "python").is_file():
        return venv / "bin" / "python"
    raise MConvertError(f"llama.cpp (llama-cpp-python) is not installed in {venv}: run `make gguf-env` "
                        f"(or `bash {ENV_SCRIPT}`; a source build, ~10 min) and try again")


def run_llama_cpp(model: str | Path, request: dict[str, Any], python: str | Path | None = None,
                  threads: int | None = None) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """Run one request through llama.cpp on `model`: (result.json, logits [S, V] per requested sequence)."""
    import numpy as np

    py = gguf_python(python)
    threads = threads or max(1, min(4, len(os.sched_getaffinity(0))))
    with tempfile.TemporaryDirectory(prefix="mconvert-llama-cpp-") as tmp:
        req = Path(tmp) / "request.json"
        req.write_text(json.dumps({"model": str(Path(model).absolute()), "threads": threads, **request}))
        try:
            proc = subprocess.run([str(py), str(WORKER), str(req), tmp], capture_output=True, text=True,
                                  timeout=TIMEOUT_S, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            raise MConvertError(f"{model}: llama.cpp did not finish within {TIMEOUT_S} s") from None
        if proc.returncode != 0:
            tail = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1][:300]
            raise MConvertError(f"{model}: llama.cpp cannot run this file ({tail})")
        result = json.loads((Path(tmp) / "result.json").read_text(encoding="utf-8"))
        logits = [torch.from_numpy(np.load(Path(tmp) / f"logits_{i}.npy"))
                  for i in range(len(request.get("logits") or []))]
    return result, logits


def gguf_logits(path: Path, tokens: torch.Tensor, python: str | Path | None = None) -> torch.Tensor:
    """Logits [B, S, V] of a GGUF at every position, computed by llama.cpp (f32 KV cache)."""
    _, logits = run_llama_cpp(path, {"logits": tokens.tolist()}, python)
    return torch.stack(logits)


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """The scalar metadata of a GGUF (architecture-prefixed keys kept as written) plus `n_vocab` (the token
    list's length, when it is a list of strings), `file_type`'s name and every tensor's shape (outermost first)
    and type; the header is read strictly (`gguf_header`): an unreadable file is one MConvertError."""
    import gguf  # heavy optional import: gguf-py loads only when a GGUF is read

    from mconvert.validators.gguf_header import GgufArray, read_gguf_header

    h = read_gguf_header(path)
    out: dict[str, Any] = {k: v for k, v in h.fields.items() if not isinstance(v, GgufArray)}
    tokens = h.fields.get("tokenizer.ggml.tokens")
    if isinstance(tokens, GgufArray) and tokens.item_type == 8:  # an array of strings
        out["n_vocab"] = tokens.count
    ft = out.get("general.file_type")
    if isinstance(ft, int) and not isinstance(ft, bool):
        try:
            out["file_type_name"] = gguf.LlamaFileType(ft).name
        except ValueError:
            out["file_type_name"] = str(ft)
    out["tensors"] = {t.name: (tuple(reversed(t.dims)), t.type_name) for t in h.tensors}
    return out


# a tensor's ggml type -> the dtype validate judges it with (its tolerance row); any other type has no row
TENSOR_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "Q8_0": "q8_0"}


def gguf_dtype(meta: dict[str, Any], path: str | Path = "") -> str:
    """The dtype `validate` judges a GGUF by: the coarsest its tensors are stored in (never the `general.file_type`
    the file states about itself, which a file can get wrong), or the precision llama.cpp computes its
    architecture in (`GgufLayout.compute_dtype`) when that is coarser. A tensor type without a tolerance row is
    one MConvertError."""
    from mconvert.mappings import families
    from mconvert.validators.compare import tolerance_for

    dtype = "float32"
    for name, (_, tname) in meta.get("tensors", {}).items():
        if tname not in TENSOR_DTYPES:
            raise MConvertError(f"{path}: tensor {name!r} is stored as {tname}; validate has tolerances for "
                                f"{', '.join(TENSOR_DTYPES)} only — convert with --outtype f32, f16, bf16 or q8_0")
        dtype = tolerance_for(dtype, TENSOR_DTYPES[tname]).dtype
    for f in families.all_families():
        if f.gguf is not None and f.gguf.arch == meta.get("general.architecture"):
            dtype = tolerance_for(dtype, f.gguf.compute_dtype).dtype
    return dtype
