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
    list's length) and `file_type`'s name; an unreadable file is one MConvertError."""
    # heavy optional import: gguf-py loads only when a GGUF is read
    import gguf

    try:
        r = gguf.GGUFReader(str(path))
    except Exception as e:  # noqa: BLE001 - gguf-py raises ValueError, struct.error, ... for a broken file
        raise MConvertError(f"{path}: not a readable GGUF file ({type(e).__name__}: {str(e)[:200]})") from None
    out: dict[str, Any] = {}
    for key, f in r.fields.items():
        if key == "tokenizer.ggml.tokens":
            out["n_vocab"] = len(f.data)
        elif len(f.types) == 1 and f.types[0] != gguf.GGUFValueType.ARRAY:
            try:
                out[key] = f.contents()
            except Exception:  # noqa: BLE001 - a value gguf-py cannot decode is left out
                pass
    ft = out.get("general.file_type")
    if isinstance(ft, int):
        try:
            out["file_type_name"] = gguf.LlamaFileType(ft).name
        except ValueError:
            out["file_type_name"] = str(ft)
    out["tensors"] = {t.name: (tuple(int(x) for x in reversed(t.shape.tolist())), t.tensor_type.name)
                      for t in r.tensors}
    return out


# general.file_type -> the dtype validate judges it with (its tolerance row)
FILE_TYPE_DTYPES = {"ALL_F32": "float32", "MOSTLY_F16": "float16", "MOSTLY_BF16": "bfloat16", "MOSTLY_Q8_0": "q8_0"}
def gguf_dtype(meta: dict[str, Any]) -> str:
    """The dtype `validate` judges a GGUF by: its file type's, or the precision llama.cpp computes its
    architecture in (`GgufLayout.compute_dtype`) when that is coarser."""
    from mconvert.mappings import families
    from mconvert.validators.compare import tolerance_for

    dtype = FILE_TYPE_DTYPES.get(meta.get("file_type_name", ""), "float32")
    for f in families.all_families():
        if f.gguf is not None and f.gguf.arch == meta.get("general.architecture"):
            dtype = tolerance_for(dtype, f.gguf.compute_dtype).dtype
    return dtype
