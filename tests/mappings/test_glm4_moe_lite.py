"""GLM-4.7-Flash (`Glm4MoeLiteForCausalLM`, transformers ≥ 5 and vLLM) read and written as the DeepSeek-V3 function,
proven against transformers 5's own class (in the vLLM venv, whose transformers has it; the pinned 4.57 has not)
and megatron-core's GPTModel:

- a random Glm4MoeLite model made and saved by transformers 5 -> hf-to-megatron TP=2 EP=2 -> megatron-core's logits
  equal transformers'; megatron-to-hf gives back the same tensors, byte for byte, under a config transformers 5
  loads as `Glm4MoeLiteForCausalLM` with the same logits; the controls (the export read with rope_interleave
  false, or with the correction bias dropped) move transformers' logits past the tolerance;
- the published GLM-4.7-Flash config reads as DeepSeek-V3's MLA and router with GLM's values; what the engines
  compute differently (the dense-layer pattern each reads, partial rope, plain rope, unnormalised top-k) is refused
  by name.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from mcore_ref import run_mcore
from safetensors.torch import load_file, save_file

from mconvert.layouts.megatron import rank_file
from mconvert.convert.verbs import hf_to_megatron, megatron_to_hf
from mconvert.errors import MConvertError
from mconvert.io.safeload import safe_load
from mconvert.mappings.families import hf_config, spec_from_hf_config, spec_from_megatron_args
from safety_common import run_cli

TOL = 1e-4  # relative to the largest |logit|
TP, EP = 2, 2
TOKENS = torch.randint(0, 1000, (2, 24), generator=torch.Generator().manual_seed(7))
REF = Path(__file__).parents[1] / "helpers" / "glm4_moe_lite_ref.py"
VENV = Path(os.environ.get("VLLM_VENV", Path.home() / ".cache/mconvert/vllm-venv"))
PYTHON = VENV / "bin" / "python"


def _has_class() -> bool:
    return PYTHON.is_file() and any(VENV.glob("lib/python3*/site-packages/transformers/models/glm4_moe_lite/"
                                              "modeling_glm4_moe_lite.py"))


needs_t5 = pytest.mark.skipif(not _has_class(), reason=f"no vLLM venv with transformers' Glm4MoeLite at {VENV} "
                              "(make vllm-env builds it)")


def _ref(*args: str | Path) -> None:
    subprocess.run([str(PYTHON), str(REF), *map(str, args)], check=True, timeout=600,
                   env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})


def _t5_logits(d: Path, work: Path) -> torch.Tensor:
    """transformers 5's logits for TOKENS from HF dir `d` (its class must be Glm4MoeLiteForCausalLM)."""
    torch.save(TOKENS, work / "tokens.pt")
    _ref("logits", d, work / "tokens.pt", work / "out.pt")
    got = torch.load(work / "out.pt", weights_only=True)
    assert got["class"] == "Glm4MoeLiteForCausalLM"
    return got["logits"]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def _load_forward(ctx, files: dict, tokens: torch.Tensor) -> torch.Tensor:
    ctx.model.load_state_dict(files[(ctx.tp_rank, ctx.ep_rank)], strict=True)
    return ctx.logits(tokens)


def _variant(src: Path, dst: Path, config: dict | None = None, zero: str | None = None) -> Path:
    """A copy of HF dir `src` with `config` merged into config.json and tensors ending in `zero` zeroed."""
    shutil.copytree(src, dst)
    if config:
        cfg = json.loads((src / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps({**cfg, **config}))
    if zero:
        st = load_file(src / "model.safetensors")
        save_file({k: torch.zeros_like(v) if k.endswith(zero) else v for k, v in st.items()},
                  dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@needs_t5
@pytest.mark.slow
def test_transformers5_glm4_moe_lite_loads_into_megatron_core_and_back(tmp_path: Path, capsys) -> None:
    _ref("make", tmp_path / "hf")
    want = _t5_logits(tmp_path / "hf", tmp_path)
    hf_to_megatron(tmp_path / "hf", tmp_path / "m", tp=TP, ep=EP)
    args = vars(safe_load(rank_file(tmp_path / "m", "release", 0, 0, 1, 0, EP))["args"])
    assert args["model_family"] == "glm4_moe_lite"  # the class an export writes back
    spec = spec_from_megatron_args(args)
    files = {(t, e): safe_load(rank_file(tmp_path / "m", "release", t, 0, 1, e, EP))["model"]
             for t in range(TP) for e in range(EP)}
    got = run_mcore(spec, TP, _load_forward, (files, TOKENS), ep=EP)[0]
    diff = _rel(got[..., : spec.vocab_size], want)
    assert diff <= TOL, diff

    megatron_to_hf(tmp_path / "m", tmp_path / "back")
    src, back = load_file(tmp_path / "hf" / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert src.keys() == back.keys()
    assert all(src[k].dtype == back[k].dtype and src[k].numpy().tobytes() == back[k].numpy().tobytes() for k in src)
    cfg = json.loads((tmp_path / "back" / "config.json").read_text())
    assert (cfg["architectures"], cfg["model_type"]) == (["Glm4MoeLiteForCausalLM"], "glm4_moe_lite")
    assert (cfg["mlp_layer_types"], cfg["first_k_dense_replace"]) == (["dense", "sparse", "sparse"], 1)
    again = _rel(_t5_logits(tmp_path / "back", tmp_path), want)
    assert again <= 1e-6, again
    # the pinned transformers lacks the class: verify runs its DeepseekV3ForCausalLM on the same config, the same
    # function (the export has no tokenizer, which verify reports)
    _, out, err = run_cli(["verify", str(tmp_path / "back"), "--against", str(tmp_path / "m")], capsys)
    assert "match DeepseekV3ForCausalLM" in out + err and "1 error(s): tokenizer" in out + err, out + err
    from mconvert.validators.runners import hf_logits

    stand_in = _rel(hf_logits(tmp_path / "back", TOKENS, "cpu")[0].float(), want)
    assert stand_in <= 1e-6, stand_in

    # the controls: what the export states matters to transformers
    flipped = _rel(_t5_logits(_variant(tmp_path / "back", tmp_path / "flip", {"rope_interleave": False}), tmp_path),
                   want)
    no_bias = _rel(_t5_logits(_variant(tmp_path / "back", tmp_path / "nob", zero="e_score_correction_bias"),
                              tmp_path), want)
    assert flipped > 100 * TOL and no_bias > 100 * TOL, (flipped, no_bias)
    print(f"[figures] transformers 5 Glm4MoeLite -> Megatron TP=2 EP=2: megatron-core vs transformers {diff:.1e}; "
          f"back to HF: tensors identical, transformers {again:.1e}; controls: rope_interleave false {flipped:.1e}, "
          f"no correction bias {no_bias:.1e}")


@needs_t5
@pytest.mark.slow
def test_vllm_serves_the_export_with_transformers5_tokens(tmp_path: Path) -> None:
    """vLLM's own glm4_moe_lite model (DeepseekV2MLAAttention + GLM's MoE) serves megatron-to-hf's export: the
    greedy tokens and prompt logprobs of transformers 5's Glm4MoeLiteForCausalLM."""
    from mconvert.validators.vllm_check import NATIVE_OPS, SERVE_SCRIPT

    _ref("make", tmp_path / "hf")
    hf_to_megatron(tmp_path / "hf", tmp_path / "m", tp=TP, ep=EP)
    megatron_to_hf(tmp_path / "m", tmp_path / "back")
    prompts = [[5, 17, 99, 400, 3, 8, 250, 11], [7, 7, 300, 12, 600, 44, 2, 90]]
    (tmp_path / "rq.json").write_text(json.dumps({"jobs": [{
        "model": str(tmp_path / "back"), "prompts": prompts, "max_tokens": 8, "max_model_len": 128,
        "skip_tokenizer_init": True, "chats": [], "custom_ops": list(NATIVE_OPS)}]}))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0", HF_HUB_OFFLINE="1",
               VLLM_NO_USAGE_STATS="1")
    r = subprocess.run([str(PYTHON), str(SERVE_SCRIPT), str(tmp_path / "rq.json"), str(tmp_path / "rs.json")],
                       capture_output=True, text=True, timeout=900, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    served = json.loads((tmp_path / "rs.json").read_text())["jobs"][0]["results"]
    (tmp_path / "prompts.json").write_text(json.dumps(prompts))
    _ref("greedy", tmp_path / "back", tmp_path / "prompts.json", 8, tmp_path / "ref.json")
    ref = json.loads((tmp_path / "ref.json").read_text())
    assert ref["class"] == "Glm4MoeLiteForCausalLM"
    worst = max(abs(a - b) for s, t in zip(served, ref["results"])
                for a, b in zip(s["prompt_logprobs"], t["prompt_logprobs"]))
    assert [s["tokens"] for s in served] == [t["tokens"] for t in ref["results"]]
    assert worst <= 1e-4, worst
    print(f"[figures] vLLM serves the glm4_moe_lite export: transformers 5's greedy tokens, prompt logprobs within "
          f"{worst:.1e}")


# zai-org/GLM-4.7-Flash's config.json values as a public vLLM test cites them (tests/transformers_utils of
# vllm-project/vllm: "_glm4_moe_lite_min_config"), with num_nextn_predict_layers 1 as other public readers of the
# published file cite it; the Hub file itself is not reachable from here, so this is no verbatim copy
GLM_4_7_FLASH = {
    "model_type": "glm4_moe_lite", "architectures": ["Glm4MoeLiteForCausalLM"], "vocab_size": 154880,
    "hidden_size": 2048, "intermediate_size": 10240, "moe_intermediate_size": 1536, "num_hidden_layers": 47,
    "num_attention_heads": 20, "num_key_value_heads": 20, "hidden_act": "silu", "rms_norm_eps": 1e-5,
    "attention_dropout": 0.0, "attention_bias": False, "max_position_embeddings": 202752, "rope_theta": 1_000_000.0,
    "rope_scaling": None, "partial_rotary_factor": 1.0, "q_lora_rank": 768, "kv_lora_rank": 512,
    "qk_nope_head_dim": 192, "qk_rope_head_dim": 64, "v_head_dim": 256, "n_routed_experts": 64, "n_shared_experts": 1,
    "num_experts_per_tok": 4, "norm_topk_prob": True, "routed_scaling_factor": 1.8, "n_group": 1, "topk_group": 1,
    "topk_method": "noaux_tc", "first_k_dense_replace": 1, "num_nextn_predict_layers": 1,
    "tie_word_embeddings": False, "dtype": "bfloat16", "pad_token_id": 154820, "eos_token_id": [154820, 154827, 154829]}


def test_published_glm_4_7_flash_reads_as_deepseek_v3_mla_and_router() -> None:
    spec = spec_from_hf_config(GLM_4_7_FLASH)
    assert (spec.family, spec.q_lora_rank, spec.kv_lora_rank, spec.qk_nope_head_dim, spec.qk_rope_head_dim,
            spec.v_head_dim) == ("glm4_moe_lite", 768, 512, 192, 64, 256)
    assert (spec.num_experts, spec.moe_ffn_hidden_size, spec.moe_router_topk, spec.moe_router_score_function,
            spec.moe_router_enable_expert_bias, spec.moe_router_topk_scaling_factor, spec.moe_router_num_groups,
            spec.moe_shared_expert_intermediate_size, spec.moe_layer_freq[:2], spec.mtp_num_layers) == (
        64, 1536, 4, "sigmoid", True, 1.8, None, 1536, (0, 1), 1)
    assert (spec.rotary_base, spec.norm_epsilon, spec.rope_scaling) == (1e6, 1e-5, None)
    out = hf_config(spec)
    assert (out["architectures"], out["model_type"], out["mlp_layer_types"][:2], len(out["mlp_layer_types"])) == (
        ["Glm4MoeLiteForCausalLM"], "glm4_moe_lite", ["dense", "sparse"], 47)
    assert spec_from_hf_config(out) == spec
    # transformers 5's spelling of the same rope: rope_parameters, the factor copied into it
    t5 = {k: v for k, v in GLM_4_7_FLASH.items() if k not in ("rope_theta", "rope_scaling")}
    rope = {"rope_theta": 1e6, "rope_type": "default", "partial_rotary_factor": 1.0}
    assert spec_from_hf_config({**t5, "rope_parameters": rope}) == spec


@pytest.mark.parametrize("changes,message", [
    ({"first_k_dense_replace": 2}, "transformers then builds one dense layer"),
    ({"mlp_layer_types": ["dense"] * 2 + ["sparse"] * 45}, "make them agree"),
    ({"mlp_layer_types": ["dense", "sparse", "dense"] + ["sparse"] * 44}, "dense layer after a sparse one"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5},
      "rope_theta": None}, "rope_parameters="),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 1.0},
      "rope_theta": None, "partial_rotary_factor": None}, "rope_parameters="),
    ({"rope_interleave": False}, "rope_interleave=False"),
    ({"norm_topk_prob": False}, "norm_topk_prob=False"),
    ({"model_type": "glm4_moe"}, "contradicts"),
])
def test_what_the_engines_compute_differently_is_refused_by_name(changes: dict, message: str) -> None:
    with pytest.raises(MConvertError, match=message):
        spec_from_hf_config({**GLM_4_7_FLASH, **changes})
