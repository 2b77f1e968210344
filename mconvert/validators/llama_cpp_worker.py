"""Runs inside the llama.cpp venv (`make gguf-env`), never imported by mconvert: `python llama_cpp_worker.py
REQUEST.json RESULT_DIR`. It imports only llama_cpp, numpy and the standard library, since that venv has
neither torch nor mconvert.

REQUEST: {"model": path, "threads": n, "logits": [[ids...], ...], "tokenize": [text, ...],
"tokenize_special": [text, ...] (special tokens in the text parsed as such), "detokenize": [[ids...], ...],
"generate": {"prompt": [ids...], "max_tokens": n}}; every part optional.
RESULT_DIR gets `logits_{i}.npy` ([S, V] float32 per sequence) and `result.json` (model facts, tokenizations,
detokenizations, greedy tokens).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(request_path: str, out_dir: str) -> None:
    import numpy as np
    from llama_cpp import Llama

    req = json.loads(Path(request_path).read_text(encoding="utf-8"))
    out = Path(out_dir)
    seqs = req.get("logits") or []
    gen = req.get("generate")
    n_ctx = max([len(s) for s in seqs] + [len(gen["prompt"]) + gen["max_tokens"] if gen else 0] + [16])
    # f32 KV cache: the default f16 cache alone moves logits by ~1e-3 relative, far above the f32 file's error
    llm = Llama(model_path=req["model"], n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, logits_all=True,
                type_k=0, type_v=0, n_threads=int(req.get("threads", 2)), verbose=False, seed=0)
    meta = {k: v for k, v in llm.metadata.items() if not k.startswith("tokenizer.ggml.")}
    arch = meta.get("general.architecture", "")
    result: dict = {"n_vocab": llm.n_vocab(), "n_ctx_train": int(meta.get(f"{arch}.context_length", 0)),
                    "n_embd": llm.n_embd(), "metadata": meta}
    for i, ids in enumerate(seqs):
        llm.reset()
        llm.eval(ids)
        np.save(out / f"logits_{i}.npy", np.asarray(llm.scores[: len(ids)], dtype=np.float32))
    result["tokenize"] = [llm.tokenize(t.encode("utf-8"), add_bos=False, special=False) for t in req.get("tokenize", [])]
    result["tokenize_special"] = [llm.tokenize(t.encode("utf-8"), add_bos=False, special=True)
                                  for t in req.get("tokenize_special", [])]
    # llama.cpp's own detokenizer (llama_detokenize) drops the space a vocabulary's add_space_prefix put before
    # the first piece; the binding's per-token join keeps it, so the first piece is stripped here
    strip_first = llm.metadata.get("tokenizer.ggml.add_space_prefix", "false") == "true"
    result["detokenize"] = [_detokenize(llm, ids, strip_first).decode("utf-8", errors="replace")
                            for ids in req.get("detokenize", [])]
    if gen:
        llm.reset()
        toks: list[int] = []
        for t in llm.generate(gen["prompt"], top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
            toks.append(int(t))
            if len(toks) >= gen["max_tokens"]:
                break
        result["generate"] = toks
    (out / "result.json").write_text(json.dumps(result), encoding="utf-8")


def _detokenize(llm, ids: list, strip_first: bool) -> bytes:
    """The text of `ids` as llama.cpp's pieces (llama_token_to_piece), the first one left-stripped when asked."""
    import ctypes

    import llama_cpp

    out, size = b"", 256
    buf = ctypes.create_string_buffer(size)
    for i, t in enumerate(ids):
        n = llama_cpp.llama_token_to_piece(llm._model.vocab, llama_cpp.llama_token(t), buf, size,
                                           1 if (strip_first and i == 0) else 0, False)
        out += buf.raw[:max(n, 0)]
    return out


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
