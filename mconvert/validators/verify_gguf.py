"""`mconvert verify MODEL.gguf`: does llama.cpp load it, tokenize like transformers, and (with `--against`)
compute what the checkpoint computes?

Checks, each by name: `manifest` (the digest in the manifest beside the file), `metadata` (architecture, tokenizer keys, the
token list as long as `token_embd`'s rows), `tensors` (with `--against`: every name and shape the reference's
spec plans), `load` (llama.cpp itself opens it), `tokenizer` (llama.cpp's tokens of a set of texts equal
transformers' and detokenize back to the text), `greedy` (llama.cpp's greedy tokens equal transformers' on
the reference), `logits` (validate's comparison, all positions).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from mconvert.errors import MConvertError
from mconvert.mappings import families
from mconvert.validators.formats import describe, has_tokenizer
from mconvert.validators.tokens import BUILTIN_TEXT, load_tokenizer

# texts the tokenizers must agree on: prose, digits, punctuation, runs of spaces and newlines, non-ASCII
ROUND_TRIP_TEXTS = (
    BUILTIN_TEXT,
    "Hello world!\n\n  Indented  twice,\ttabbed; 12345 67 8.9e-10 -- done.",
    "naïve café — “quoted” ünïcödé, 日本語 and emoji 🙂 at the end",
    "   leading spaces and trailing   ",
)
GREEDY_PROMPT = 8
GREEDY_TOKENS = 16


def verify_gguf(path: str | Path, against: str | Path | None = None, device: str = "auto",
                n_tokens: int = 32, python: str | Path | None = None) -> Any:
    """Every check on one GGUF file; errors are collected in the report, never raised."""
    from mconvert.io.atomic import check_file_manifest
    from mconvert.validators.gguf_runner import read_gguf_metadata, run_llama_cpp
    from mconvert.validators.verify import VerifyReport

    t0 = time.perf_counter()
    p = Path(path)
    rep = VerifyReport(path=str(p), engine="llama.cpp")
    problems = check_file_manifest(p)
    if not problems:
        rep.add("manifest", "ok", "the digest matches the manifest beside the file")
    elif "no " in problems[0] and "beside it" in problems[0]:
        rep.add("manifest", "warn", problems[0])
    else:
        rep.add("manifest", "error", problems[0])
    meta = read_gguf_metadata(p)
    _metadata(meta, rep)
    ref_spec = None
    if against is not None:
        ref_spec = _reference_spec(Path(against), rep)
        if ref_spec is not None:
            _tensors(meta, ref_spec, rep)
    tok_dir = _tokenizer_dir(p, against)
    tok = load_tokenizer(tok_dir) if tok_dir is not None else None
    request: dict[str, Any] = {}
    texts_ids: list[list[int]] = []
    prompt: list[int] = []
    if tok is not None:
        texts_ids = [list(tok(t, add_special_tokens=False)["input_ids"]) for t in ROUND_TRIP_TEXTS]
        request["tokenize"] = list(ROUND_TRIP_TEXTS)
        request["detokenize"] = texts_ids
        prompt = texts_ids[0][:GREEDY_PROMPT]
        if ref_spec is not None:
            request["generate"] = {"prompt": prompt, "max_tokens": GREEDY_TOKENS}
    try:
        result, _ = run_llama_cpp(p, request, python)
    except MConvertError as e:
        rep.add("load", "error", str(e))
        rep.seconds = time.perf_counter() - t0
        return rep
    rep.add("load", "ok", f"llama.cpp loads it: n_vocab {result['n_vocab']}, n_embd {result['n_embd']}, "
            f"n_ctx_train {result['n_ctx_train']}")
    if tok is None:
        rep.add("tokenizer", "warn", "no HF tokenizer beside the file or the --against model: round trip not checked")
    else:
        _round_trip(texts_ids, result, rep)
    if ref_spec is not None and tok is not None:
        _greedy(Path(against), prompt, result.get("generate", []), describe(p).dtype, rep)
    elif against is None:
        rep.add("greedy", "warn", "greedy tokens and logits need --against CKPT")
    if against is not None:
        from mconvert.validators.validate import validate

        lv = validate(against, [p], device=device, n_tokens=n_tokens)
        rep.logits = lv.to_json()
        r = lv.results[0]
        rep.add("logits", "ok" if r.passed else "error",
                f"llama.cpp logits vs {against}: " + ("within the tolerance" if r.passed else "; ".join(r.failures)))
    rep.seconds = time.perf_counter() - t0
    return rep


def _metadata(meta: dict[str, Any], rep: Any) -> None:
    arch = meta.get("general.architecture")
    known = sorted({f.gguf.arch for f in families.all_families() if f.gguf is not None})
    if arch not in known:
        rep.add("metadata", "error", f"general.architecture {arch!r} is none mconvert writes ({', '.join(known)})")
        return
    missing = [k for k in ("tokenizer.ggml.model", f"{arch}.block_count", f"{arch}.context_length") if k not in meta]
    if "n_vocab" not in meta:
        missing.append("tokenizer.ggml.tokens (an array of strings)")
    if missing:
        rep.add("metadata", "error", f"missing {', '.join(missing)}")
        return
    emb = meta["tensors"].get("token_embd.weight")
    if emb is None or len(emb[0]) != 2 or emb[0][0] != meta["n_vocab"]:
        rep.add("metadata", "error", f"token list has {meta['n_vocab']} tokens, token_embd.weight "
                f"{f'has shape {list(emb[0])}' if emb else 'is missing'}")
        return
    rep.add("metadata", "ok", f"{arch}, {meta['n_vocab']} tokens ({meta.get('tokenizer.ggml.model')}), "
            f"{meta.get('file_type_name')}")


def _reference_spec(ckpt: Path, rep: Any) -> Any:
    from mconvert.convert.sources import open_source

    try:
        with open_source(ckpt) as src:
            return src.spec
    except MConvertError as e:
        rep.add("tensors", "error", f"--against {ckpt}: {e}")
        return None


def _tensors(meta: dict[str, Any], spec: Any, rep: Any) -> None:
    """Every tensor the reference's spec plans, by name and shape, and nothing else."""
    from mconvert.convert.deploy.gguf import prepare

    try:
        plan = {t.name: t.shape for t in prepare(spec, "f32").tensors}
    except MConvertError as e:
        rep.add("tensors", "error", str(e))
        return
    have = {k: v[0] for k, v in meta["tensors"].items()}
    bad = [f"missing {n}" for n in sorted(set(plan) - set(have))]
    bad += [f"unexpected {n}" for n in sorted(set(have) - set(plan))]
    bad += [f"{n} has shape {list(have[n])}, expected {list(plan[n])}" for n in sorted(set(plan) & set(have))
            if tuple(have[n]) != tuple(plan[n])]
    if bad:
        rep.add("tensors", "error", f"{bad[0]}" + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""))
    else:
        rep.add("tensors", "ok", f"all {len(plan)} tensors the reference plans, shapes equal")


def _tokenizer_dir(p: Path, against: str | Path | None) -> Path | None:
    cands = [p.parent]
    if against is not None:
        a = Path(against)
        cands = [a, a / "tokenizer", a.parent] + cands
    return next((c for c in cands if has_tokenizer(c)), None)


def _round_trip(texts_ids: list[list[int]], result: dict[str, Any], rep: Any) -> None:
    for i, (want, got) in enumerate(zip(texts_ids, result.get("tokenize", []))):
        if list(got) != want:
            at = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            rep.add("tokenizer", "error", f"text {i}: llama.cpp's tokens differ from transformers' at position {at} "
                    f"({got[at:at + 3]} vs {want[at:at + 3]}); the pre-tokenizer or merges were not carried")
            return
    for i, (text, back) in enumerate(zip(ROUND_TRIP_TEXTS, result.get("detokenize", []))):
        if back != text:
            rep.add("tokenizer", "error", f"text {i}: llama.cpp detokenizes to {back[:40]!r}, not the text")
            return
    rep.add("tokenizer", "ok", f"{len(texts_ids)} texts: llama.cpp tokenizes as transformers and detokenizes back")


def _greedy(ref: Path, prompt: list[int], got: list[int], dtype: str, rep: Any) -> None:
    from mconvert.validators.runners import source_model

    model = source_model(ref, "cpu")
    ids = torch.tensor([prompt])
    want: list[int] = []
    with torch.inference_mode():
        for _ in range(GREEDY_TOKENS):
            nxt = int(model(input_ids=ids, use_cache=False).logits[0, -1].argmax())
            want.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    if got == want:
        rep.add("greedy", "ok", f"{GREEDY_TOKENS} greedy tokens equal transformers' on {ref}")
        return
    at = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    # rounded weights may flip a near-tie: only a full-precision file must agree token for token
    status = "error" if dtype == "float32" else "warn"
    rep.add("greedy", status, f"greedy tokens differ from transformers' at step {at} ({got[at:at + 3]} vs "
            f"{want[at:at + 3]})")
