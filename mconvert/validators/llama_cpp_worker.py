"""Runs inside the llama.cpp venv (`make gguf-env`), never imported by mconvert: `python llama_cpp_worker.py
REQUEST.json RESULT_DIR`. It imports only llama_cpp, numpy and the standard library, since that venv has
neither torch nor mconvert.

REQUEST: {"model": path, "threads": n, "logits": [[ids...], ...], "tokenize": [text, ...],
"detokenize": [[ids...], ...], "generate": {"prompt": [ids...], "max_tokens": n}}; every part optional.
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
    result["detokenize"] = [llm.detokenize(ids).decode("utf-8", errors="replace") for ids in req.get("detokenize", [])]
    if gen:
        llm.reset()
        toks: list[int] = []
        for t in llm.generate(gen["prompt"], top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
            toks.append(int(t))
            if len(toks) >= gen["max_tokens"]:
                break
        result["generate"] = toks
    (out / "result.json").write_text(json.dumps(result), encoding="utf-8")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
