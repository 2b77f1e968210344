"""`verify --vllm-python`: serve the export in a real vLLM engine (its own interpreter, a subprocess) and
compare its greedy tokens and prompt logprobs with transformers on the same prompts.

"vLLM loaded it" proves nothing (it loads an all-zero missing head without a word), so outputs are compared.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from mconvert.io.paths import check_tree_contained, inside_file, load_json_object
from mconvert.errors import MConvertError
from mconvert.validators.engine_probe import chat_ids
from mconvert.validators.formats import has_tokenizer, reference_attention, reference_config
from mconvert.validators.tokens import make_batch

SERVE_SCRIPT = Path(__file__).with_name("vllm_serve.py")
ENV_SCRIPT = Path(__file__).with_name("vllm_env.sh")
LOGPROB_TOL = 1e-4  # fp32 engine vs fp32 transformers: the same weights differ by kernel rounding only
# vLLM's CPU rotary kernel (`_C.rotary_embedding`) reads a query shaped [tokens, heads, dim] as tokens × heads
# one-head tokens and rotates most heads by another token's position; multi-latent attention (DeepseekV2/V3) calls
# it so, GPU kernels take that shape. vLLM's own PyTorch rope computes what its GPU kernels do, on every shape.
NATIVE_OPS = ("-rotary_embedding",)
TIE_MARGIN = 1e-4  # a greedy divergence where transformers' top-2 logits are closer than this is a tie
# The conversation served through `LLM.chat` when the export has a chat template (vLLM renders it itself).
CHAT = [{"role": "system", "content": "You tell short stories."},
        {"role": "user", "content": "Tell me about the fox and the river."}]


def default_vllm_venv() -> Path:
    """Where `make vllm-env` builds the vLLM venv (VLLM_VENV overrides)."""
    return Path(os.environ.get("VLLM_VENV") or Path.home() / ".cache" / "mconvert" / "vllm-venv")


def ensure_vllm_env(venv: Path | None = None, timeout: float = 1800) -> Path:
    """Build the vLLM venv with the same script `make vllm-env` runs (reused when present); its python."""
    venv = venv or default_vllm_venv()
    py = venv / "bin" / "python"
    if (venv / ".mconvert-vllm-ok").is_file() and py.exists():
        return py
    r = subprocess.run(["bash", str(ENV_SCRIPT), str(venv)], capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        tail = [ln for ln in r.stderr.splitlines() if "is ignored" not in ln][-3:]
        raise MConvertError(f"building the vLLM venv at {venv} failed: {' | '.join(tail)}")
    return py


def _prompts(d: Path, vocab: int, n_prompts: int, length: int) -> list[list[int]]:
    t, _ = make_batch(vocab, length, n_prompts, None, d if has_tokenizer(d) else None)
    return t.tolist()


def _chat_ids(d: Path) -> list[list[int]]:
    """transformers' prompt ids of `CHAT` through the export's default chat template ([] without a template),
    rendered in a bounded child (`engine_probe.chat_ids`)."""
    if not has_tokenizer(d):
        return []
    return chat_ids(d, CHAT)[:1]


def _transformers_reference(d: Path, prompts: list[list[int]], max_tokens: int) -> list[dict[str, Any]]:
    # heavy optional import: transformers loads only when a model is run
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    v = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        model = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32, local_files_only=True,
                                                     trust_remote_code=False, **reference_attention(d),
                                                     **reference_config(d)).eval()
    finally:
        hf_logging.set_verbosity(v)
        if bars:
            hf_logging.enable_progress_bar()
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            logits = model(input_ids=ids, use_cache=False).logits[0].double()
            lp = torch.log_softmax(logits[:-1], -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
            toks, margins = [], []
            cur = ids
            for _ in range(max_tokens):
                last = model(input_ids=cur, use_cache=False).logits[0, -1].double()
                top2 = torch.topk(last, 2).values
                nxt = int(last.argmax())
                toks.append(nxt)
                margins.append(float(top2[0] - top2[1]))
                cur = torch.cat([cur, torch.tensor([[nxt]])], dim=1)
            out.append({"tokens": toks, "margins": margins, "prompt_logprobs": lp.tolist()})
    return out


def vllm_compare(d: Path, vllm_python: Path, timeout: float = 600) -> dict[str, Any]:
    """Serve `d` in vLLM, compare with transformers; a JSON-able dict with `passed` and `summary`."""
    return vllm_compare_many([d], vllm_python, timeout)[0]


def vllm_compare_many(
    dirs: list[Path], vllm_python: Path, timeout: float = 900, n_prompts: int = 2, prompt_len: int = 16,
    max_tokens: int = 16, custom_ops: tuple[str, ...] = NATIVE_OPS,
) -> list[dict[str, Any]]:
    """Serve each dir in turn in one vLLM process (one import), compare each with transformers; `custom_ops` is
    vLLM's `CompilationConfig.custom_ops` ("-NAME": vLLM's PyTorch form of that op, not its CPU kernel)."""
    if not Path(vllm_python).exists():
        raise MConvertError(f"--vllm-python {vllm_python}: no such interpreter; build one with `make vllm-env`")

    jobs = []
    for d in dirs:
        check_tree_contained(d, f"{d}: model file")  # vLLM and transformers open the files by name
        cfg = load_json_object(inside_file(d, "config.json", f"{d}: config"), "config", "re-export the model")
        max_pos = int(cfg.get("max_position_embeddings") or cfg.get("n_positions") or 128)
        max_len = min(128, max_pos)
        plen = min(prompt_len, max_len // 2)
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
        if isinstance(window, int) and not isinstance(window, bool):  # prompts the window masks keys of
            plen = min(max(plen, 2 * window), max_len // 2)
        chat = _chat_ids(d)
        chat_len = max((len(c) for c in chat), default=0)
        if chat_len + max_tokens > max_len:
            chat = []  # the model's positions cannot hold the rendered conversation: token prompts only
        jobs.append({"model": str(d.absolute()), "prompts": _prompts(d, int(cfg["vocab_size"]), n_prompts, plen),
                     "max_tokens": min(max_tokens, max_len - max(plen, chat_len if chat else 0)),
                     "max_model_len": max_len, "skip_tokenizer_init": not has_tokenizer(d),
                     "chats": [CHAT] * len(chat), "chat_ids": chat, "custom_ops": list(custom_ops)})
    with tempfile.TemporaryDirectory(prefix="mconvert-vllm-") as tmp:
        rq, rs = Path(tmp) / "request.json", Path(tmp) / "result.json"
        rq.write_text(json.dumps({"jobs": [{k: v for k, v in j.items() if k != "chat_ids"} for j in jobs]}))
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0", HF_HUB_OFFLINE="1",
                   TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
                   TOKENIZERS_PARALLELISM="false")
        env.pop("PYTHONPATH", None)
        t0 = time.perf_counter()
        try:
            r = subprocess.run([str(vllm_python), str(SERVE_SCRIPT), str(rq), str(rs)], capture_output=True,
                               text=True, timeout=timeout, env=env, cwd=tmp)
        except subprocess.TimeoutExpired:
            raise MConvertError(f"vLLM did not finish serving {dirs[0]} within {timeout:.0f} s") from None
        wall = time.perf_counter() - t0
        if r.returncode != 0 or not rs.is_file():
            err = [ln for ln in r.stderr.splitlines() if ln.strip()]
            cause = next((ln for ln in reversed(err) if "Error" in ln or "error" in ln), err[-1] if err else "?")
            fail = {"passed": False, "summary": f"vLLM failed to serve (exit {r.returncode}): {cause[:300]}",
                    "wall_seconds": wall}
            return [dict(fail) for _ in dirs]
        got = json.loads(rs.read_text())
    out = []
    for d, job, g in zip(dirs, jobs, got["jobs"]):
        prompts = job["prompts"] + job["chat_ids"]
        ref = _transformers_reference(d, prompts, job["max_tokens"])
        for r, p in zip(ref, prompts):
            r["prompt_ids"] = p
        g.update(vllm_version=got["vllm_version"], import_seconds=got["import_seconds"], custom_ops=list(custom_ops))
        out.append(_judge(g, ref, wall))
    return out


def _judge(got: dict[str, Any], ref: list[dict[str, Any]], wall: float) -> dict[str, Any]:
    per = []
    max_lp = 0.0
    total, agree = 0, 0
    passed = len(got["results"]) == len(ref)  # a prompt vLLM dropped is a failure, never skipped
    for g, r in zip(got["results"], ref):
        diffs = [abs(a - b) for a, b in zip(g["prompt_logprobs"], r["prompt_logprobs"]) if a is not None]
        lp = max(diffs) if diffs and all(math.isfinite(x) for x in diffs) else float("inf")  # NaN: fail
        max_lp = max(max_lp, lp)
        first = next((i for i, (a, b) in enumerate(zip(g["tokens"], r["tokens"])) if a != b), None)
        n = len(r["tokens"])
        same = first is None and len(g["tokens"]) == n
        upto = n if first is None else first
        total += n
        agree += upto
        tie = first is not None and r["margins"][first] < TIE_MARGIN
        # a chat prompt is rendered by each side from the export's template: the ids must agree first
        same_prompt = g.get("prompt_ids", r["prompt_ids"]) == r["prompt_ids"]
        ok = (same or tie) and lp <= LOGPROB_TOL and same_prompt
        passed &= ok
        per.append({"vllm_tokens": g["tokens"], "transformers_tokens": r["tokens"], "first_divergence": first,
                    "divergence_is_tie": tie, "prompt_logprob_max_abs": _finite(lp), "passed": ok,
                    "chat": g.get("chat", False), "prompt_ids_equal": same_prompt,
                    "prompt_ids": r["prompt_ids"]})
    lp_txt = f"within {max_lp:.1e}" if math.isfinite(max_lp) else "not finite (NaN/Inf)"
    chats = sum(1 for x in per if x["chat"])
    chat_txt = f" ({chats} of them a chat through LLM.chat, prompt ids equal)" if chats and all(
        x["prompt_ids_equal"] for x in per) else f" ({chats} chat prompt(s) rendered differently)" if chats else ""
    summary = (f"vLLM {got['vllm_version']}: greedy tokens {agree}/{total} equal to transformers'{chat_txt}, prompt logprobs "
               f"{lp_txt} (limit {LOGPROB_TOL:g}); engine start {got['start_seconds']:.1f} s "
               f"(+{got['import_seconds']:.1f} s import)"
               + (f"; vLLM custom_ops {' '.join(got['custom_ops'])}" if got.get("custom_ops") else ""))
    return {"passed": passed, "summary": summary, "vllm_version": got["vllm_version"],
            "custom_ops": got.get("custom_ops", []),
            "import_seconds": got["import_seconds"],
            "start_seconds": got["start_seconds"], "generate_seconds": got["generate_seconds"], "wall_seconds": wall,
            "token_agreement": agree / max(total, 1), "prompt_logprob_max_abs": _finite(max_lp), "prompts": per,
            "chat_prompts": chats}


def _finite(x: float) -> float | None:
    """JSON-safe: None for a non-finite difference (NaN/Inf in either side's logprobs)."""
    return x if math.isfinite(x) else None
