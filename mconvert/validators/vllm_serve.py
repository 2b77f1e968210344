"""Serve an HF dir in a real vLLM engine and write greedy tokens and prompt logprobs as JSON.

Run by the vLLM venv's interpreter (not ours: vLLM pins transformers 5.x), as a plain script:
    VLLM_CPU_KVCACHE_SPACE=1 $VLLM_PY vllm_serve.py REQUEST.json OUT.json
It imports nothing from mconvert. The engine spawns worker processes, hence the __main__ guard.
REQUEST: {"jobs": [{"model": DIR, "prompts": [[ids]], "max_tokens": N, "max_model_len": L,
           "skip_tokenizer_init": bool, "chats": [[{"role", "content"}]], "custom_ops": ["-op", ...]}]} — several
models share one import of vLLM (~15 s). "custom_ops" (optional) is vLLM's `CompilationConfig.custom_ops`: "-NAME"
runs that op in vLLM's own PyTorch form instead of its CPU kernel. "chats" (optional) go through `LLM.chat`: vLLM renders the model's own chat template; each result
then also gives the prompt ids vLLM made of it.
The engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, "uni" executor): spawning the engine
core and a worker re-imports vLLM twice more and triples the start time on a small machine.
"""

import gc
import json
import os
import sys
import time


def main() -> None:
    req_path, out_path = sys.argv[1], sys.argv[2]
    with open(req_path) as f:
        jobs = json.load(f)["jobs"]
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # else vLLM reserves most of the RAM for KV cache
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine in this process: one import, not three
    t0 = time.time()
    # optional: vLLM lives in its own venv, never in mconvert's
    import vllm
    from vllm import LLM, SamplingParams

    # optional: vLLM lives in its own venv, never in mconvert's
    from vllm.inputs import TokensPrompt

    import_s = time.time() - t0
    out = {"vllm_version": vllm.__version__, "import_seconds": import_s, "jobs": []}
    for req in jobs:
        t1 = time.time()
        extra = {"compilation_config": {"custom_ops": list(req["custom_ops"])}} if req.get("custom_ops") else {}
        llm = LLM(
            model=req["model"],
            dtype="float32",
            enforce_eager=True,
            max_model_len=int(req["max_model_len"]),
            skip_tokenizer_init=bool(req.get("skip_tokenizer_init", False)),
            seed=0,
            trust_remote_code=False,
            distributed_executor_backend="uni",
            **extra,
        )
        start_s = time.time() - t1
        params = SamplingParams(
            temperature=0.0,
            max_tokens=int(req["max_tokens"]),
            prompt_logprobs=0,
            logprobs=0,
            ignore_eos=True,
            detokenize=not req.get("skip_tokenizer_init", False),
        )
        t2 = time.time()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in req["prompts"]], params, use_tqdm=False)
        if req.get("chats"):
            outs = list(outs) + list(llm.chat(req["chats"], params, use_tqdm=False, add_generation_prompt=True))
        gen_s = time.time() - t2
        results = []
        for i, o in enumerate(outs):
            prompt = list(o.prompt_token_ids)
            plp = []
            for pos, d in enumerate(o.prompt_logprobs or []):
                if d is None:  # the first prompt token has no logprob
                    continue
                lp = d.get(prompt[pos])
                plp.append(None if lp is None else float(lp.logprob))
            results.append({"tokens": list(o.outputs[0].token_ids), "prompt_logprobs": plp, "prompt_ids": prompt,
                            "chat": i >= len(req["prompts"])})
        out["jobs"].append({"model": req["model"], "start_seconds": start_s, "generate_seconds": gen_s,
                            "results": results})
        del llm
        gc.collect()
    with open(out_path, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
