"""Megatron-Bridge checkpoints both ways: what Megatron-Bridge writes converts to HF tensor-identical, and
Megatron-Bridge's own loader and HF export read what mconvert writes (`-m bridge`: Megatron-Bridge 0.6.2 runs in
its own venv, mconvert/validators/bridge_env.sh, through tests/helpers/bridge_helper.py). Without that venv: the
run_config.yaml Megatron-Bridge 0.6.2 wrote (tests/data/) is read, its function-changing fields and hostile files
refused by name."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import pytest
import torch
import yaml
from hf_ref import move_off_init
from safety_common import assert_one_line_error, hf_tensors, make_hf_llama, run_cli
from scratch import scratch_dir

ROOT = Path(__file__).resolve().parents[3]
ENV_SCRIPT = ROOT / "mconvert" / "validators" / "bridge_env.sh"
HELPER = ROOT / "tests" / "helpers" / "bridge_helper.py"
REAL_RUN_CONFIG = ROOT / "tests" / "data" / "bridge_0.6.2_llama_run_config.yaml"
# the run_config.yaml Megatron-Bridge writes for a published HF config (bridge_helper.py dump), by that config
PUBLISHED = {"deepseek-ai__DeepSeek-V3": "bridge_0.6.2_deepseek_v3_run_config.yaml",
             "zai-org__GLM-4.5": "bridge_0.6.2_glm45_run_config.yaml",
             "google__gemma-2-9b-it": "bridge_0.6.2_gemma2_run_config.yaml",
             "lucas-remigio__gemma-3-1b-merged": "bridge_0.6.2_gemma3_run_config.yaml"}
WORK = scratch_dir("mconvert-bridge-", __name__)


def _with_tokenizer(d: Path) -> Path:
    from mconvert.data import build_tokenizer, save_hf_tokenizer

    save_hf_tokenizer(build_tokenizer(), d)
    return d


@lru_cache(maxsize=None)
def hf_model(name: str) -> Path:
    """transformers' own random tiny model with the trainer's tokenizer: `llama` is the model the stored
    run_config.yaml describes; `qwen3` has qk-norm and tied embeddings; `qwen3_moe` routes 4 experts, top 2;
    `gemma2` / `gemma3` the Gemma block (windows, soft-caps; two rope bases, linear scaling); `deepseek_v3` has MLA with q LoRA and YaRN, a dense first layer, a MoE layer (sigmoid router, expert bias, 2
    groups, a shared expert) and an MTP layer; `glm4_moe` qk-norm, qkv bias, half-rotary rope, a dense first layer
    and a MoE layer."""
    import transformers

    d = WORK / f"hf-{name}"
    if name in ("gemma2", "gemma3"):  # 6 layers: Gemma 3's 5 local, 1 global; a query_pre_attn_scalar of its own
        torch.manual_seed(5)
        small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, vocab_size=1000, max_position_embeddings=128,
                     sliding_window=8, query_pre_attn_scalar=24)
        model = (transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**small)) if name == "gemma2" else
                 transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
                     **small, rope_scaling={"rope_type": "linear", "factor": 2.0})))
        move_off_init(model)
        model.save_pretrained(d)
    elif name == "deepseek_v3":
        _deepseek_with_mtp(d)
    elif name == "glm4_moe":
        torch.manual_seed(3)
        cfg = transformers.Glm4MoeConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                         n_shared_experts=1, n_routed_experts=4, routed_scaling_factor=2.5, n_group=1,
                                         topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1,
                                         max_position_embeddings=128, partial_rotary_factor=0.5, use_qk_norm=True,
                                         attention_bias=True, tie_word_embeddings=False)
        model = transformers.Glm4MoeForCausalLM(cfg)
        move_off_init(model)
        model.save_pretrained(d)
    elif name == "llama":
        make_hf_llama(d, vocab=1000)
    elif name == "qwen3_moe":
        torch.manual_seed(2)
        cfg = transformers.Qwen3MoeConfig(hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                          head_dim=16, vocab_size=1000, max_position_embeddings=64, num_experts=4,
                                          num_experts_per_tok=2, norm_topk_prob=True, tie_word_embeddings=False)
        transformers.Qwen3MoeForCausalLM(cfg).save_pretrained(d)
    else:
        torch.manual_seed(1)
        cfg = transformers.Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, head_dim=16, vocab_size=1000, max_position_embeddings=64,
                                       rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True)
        transformers.Qwen3ForCausalLM(cfg).save_pretrained(d)
    return _with_tokenizer(d)


def _deepseek_with_mtp(d: Path) -> None:
    """transformers' DeepseekV3 (3 layers) saved with its last layer as the MTP layer, as DeepSeek publishes one:
    `model.layers.2.*` with enorm, hnorm, eh_proj, shared_head.norm and copies of the embedding and head
    (transformers builds no MTP layer; Megatron-Bridge and mconvert read them)."""
    import transformers
    from safetensors.torch import load_file, save_file

    torch.manual_seed(3)
    cfg = transformers.DeepseekV3Config(
        vocab_size=1000, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4, routed_scaling_factor=2.5,
        kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16, v_head_dim=16, qk_nope_head_dim=16, n_group=2,
        topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1, max_position_embeddings=128, rms_norm_eps=1e-6,
        tie_word_embeddings=False, rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                                                 "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0})
    model = transformers.DeepseekV3ForCausalLM(cfg)
    move_off_init(model)
    model.save_pretrained(d)
    t = load_file(d / "model.safetensors")
    H, m = cfg.hidden_size, "model.layers.2."
    t.update({m + "enorm.weight": 1 + 0.1 * torch.randn(H), m + "hnorm.weight": 1 + 0.1 * torch.randn(H),
              m + "eh_proj.weight": 0.02 * torch.randn(H, 2 * H), m + "shared_head.norm.weight": 1 + 0.1 * torch.randn(H),
              m + "embed_tokens.weight": t["model.embed_tokens.weight"].clone(),
              m + "shared_head.head.weight": t["lm_head.weight"].clone()})
    save_file(t, str(d / "model.safetensors"), metadata={"format": "pt"})
    c = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**c, "num_hidden_layers": 2, "num_nextn_predict_layers": 1}))


@lru_cache(maxsize=None)
def ours(name: str = "llama", tp: int = 1, ep: int = 1) -> Path:
    """mconvert's torch_dist output with Megatron-Bridge's files (--bridge)."""
    from mconvert.convert.verbs import hf_to_megatron

    out = WORK / f"ours-{name}-tp{tp}-ep{ep}"
    hf_to_megatron(hf_model(name), out, tp=tp, ep=ep, format="torch_dist", bridge=True)
    return out


def _real_bridge_layout(dst: Path, edit: dict | None = None, text: str | bytes | None = None) -> Path:
    """A copy of ours() whose run_config.yaml is the one Megatron-Bridge wrote (its `model:` fields `edit`ed), or
    `text`; without mconvert's manifest and Megatron-LM's integrity.json, as Megatron-Bridge leaves neither (its
    runs verify no integrity by default)."""
    shutil.copytree(ours(), dst)
    (dst / "mconvert-manifest.json").unlink()
    (dst / "iter_0000000" / "integrity.json").unlink()
    rc = dst / "iter_0000000" / "run_config.yaml"
    if text is not None:
        rc.write_bytes(text if isinstance(text, bytes) else text.encode())
    elif edit:
        cfg = yaml.safe_load(REAL_RUN_CONFIG.read_text())
        for k, v in edit.items():
            cfg["model"][k] = v
        rc.write_text(yaml.safe_dump(cfg))
    else:
        shutil.copy(REAL_RUN_CONFIG, rc)
    return dst


def _same_tensors(a: Path, b: Path, absent: tuple[str, ...] = ()) -> None:
    """`b` holds `a`'s tensors, equal, but those named in `absent`."""
    ta, tb = hf_tensors(a), hf_tensors(b)
    assert sorted(set(ta) - set(absent)) == sorted(tb)
    for k in tb:
        assert ta[k].dtype == tb[k].dtype and ta[k].shape == tb[k].shape, k
        assert torch.equal(ta[k], tb[k]), k


# ---- without Megatron-Bridge: the run_config.yaml it wrote ----------------------------------------------------
def test_the_run_config_megatron_bridge_wrote_is_read_and_converts_tensor_identical(capsys, tmp_path):
    ckpt = _real_bridge_layout(tmp_path / "ckpt")
    code, _, err = run_cli(["megatron-to-hf", ckpt, tmp_path / "hf"], capsys)
    assert code == 0, err
    _same_tensors(hf_model("llama"), tmp_path / "hf")
    code, out, err = run_cli(["inspect", ckpt, "--json"], capsys)
    assert code == 0, err
    info = json.loads(out)["bridge"]
    assert info["text"] == "written by Megatron-Bridge, provider GPTModelProvider"
    assert {"num_layers", "share_embeddings_and_output_weights", "gated_linear_unit"} <= set(info["fields_read"])


def test_a_run_config_beside_the_iteration_dirs_is_read_only_for_a_checkpoint_without_args(capsys, tmp_path):
    ckpt = _real_bridge_layout(tmp_path / "ckpt")
    it = ckpt / "iter_0000000"
    (it / "run_config.yaml").rename(ckpt / "run_config.yaml")
    (ckpt / "run_config.yaml").write_text((ckpt / "run_config.yaml").read_text().replace("num_layers: 2", "num_layers: 9"))
    code, out, err = run_cli(["inspect", ckpt, "--json"], capsys)  # common.pt's args win: the stray file is not read
    assert code == 0 and "bridge" not in json.loads(out) and json.loads(out)["spec"]["num_layers"] == 2, err
    torch.save({"checkpoint_version": 3.0, "iteration": 0}, it / "common.pt")  # as Megatron-Bridge's: no args
    code, _, err = run_cli(["inspect", ckpt], capsys)
    assert_one_line_error(code, err, "num_layers=9")  # now it is the model: 9 layers, 2 stored


def test_every_verb_that_reads_megatron_checkpoints_reads_a_megatron_bridge_one(capsys, tmp_path):
    ckpt = _real_bridge_layout(tmp_path / "ckpt")
    code, out, err = run_cli(["validate", hf_model("llama"), ckpt], capsys)  # logits against transformers'
    assert code == 0, err + out  # validate exits 0 only when every model matches the reference
    for argv in (["megatron-to-trtllm", ckpt, tmp_path / "trt"], ["megatron-to-gguf", ckpt, tmp_path / "m.gguf"],
                 ["megatron-to-hf", ckpt, tmp_path / "plan", "--dry-run"]):
        code, _, err = run_cli(argv, capsys)
        assert code == 0, f"{argv[0]}: {err}"


@pytest.mark.parametrize("field, value, words", [
    ("window_size", [16, 3], "window_size"),
    ("softmax_type", "off-by-one", "softmax_type"),
    ("multi_latent_attention", True, "transformer_layer_spec"),  # GPTModelProvider's spec builds no MLA
    ("use_mup", True, "use_mup"),
    ("activation_func", {"_target_": "torch.nn.functional.relu", "_call_": False}, "activation_func"),
    ("gated_linear_unit", False, "gated_linear_unit"),
    ("position_embedding_type", "yarn", "position_embedding_type"),
    ("transformer_layer_spec", {"_target_": "my_project.custom_spec", "_call_": False}, "transformer_layer_spec"),
    ("apply_residual_connection_post_layernorm", True, "apply_residual_connection_post_layernorm"),
    ("a_future_bridge_option", 3, "a_future_bridge_option"),
    ("_target_", "megatron.bridge.models.deepseek.deepseek_provider.DeepSeekV32ModelProvider", "sparse attention"),
    ("_target_", "megatron.bridge.models.gemma.gemma3_provider.Gemma3ModelProvider1B", "gemma3_layer_spec"),
    ("_target_", "megatron.bridge.models.gemma.gemma_provider.GemmaModelProvider", "not known to mconvert"),
])
def test_a_function_changing_provider_field_is_refused_by_name(capsys, tmp_path, field, value, words):
    ckpt = _real_bridge_layout(tmp_path / "ckpt", edit={field: value})
    code, _, err = run_cli(["megatron-to-hf", ckpt, tmp_path / "hf"], capsys)
    assert_one_line_error(code, err, words, "run_config.yaml")
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_the_provider_megatron_bridge_writes_for_a_published_model_is_its_hf_model(name):
    """MLAModelProvider (DeepSeek-V3: MLA, its YaRN, dense and MoE layers, MTP), GLM-4.5's GPTModelProvider
    (megatron-core's block spec) and the Gemma 2 / 3 providers (the Gemma block their provide() builds) read as the
    ModelSpec of the HF config they were made from."""
    import dataclasses

    from mconvert.convert.megatron import bridge
    from mconvert.mappings.families import spec_from_hf_config, spec_from_megatron_args

    cfg = bridge.read_run_config(ROOT / "tests" / "data" / PUBLISHED[name])
    read = spec_from_megatron_args(bridge.megatron_args(cfg, name), source=name)
    hf = spec_from_hf_config(json.loads((ROOT / "tests" / "data" / "configs" / f"{name}.json").read_text()))

    def same(s):  # run_config.yaml holds no token ids and Bridge's vocab divisor; one router group is none
        grouped = (s.moe_router_num_groups or 1) > 1
        return dataclasses.replace(s, bos_token_id=None, eos_token_id=None, make_vocab_size_divisible_by=1,
                                   moe_router_num_groups=s.moe_router_num_groups if grouped else None,
                                   moe_router_group_topk=s.moe_router_group_topk if grouped else None)
    assert same(read) == same(hf)
    if name.startswith("google__gemma-2"):
        assert read.window_pattern == (1, 0) * 21 and read.final_logit_softcapping == 30 and read.sandwich_norms
    elif "gemma-3" in name:
        assert read.rotary_base_local == 10000 and read.window_size == 511 and read.scale_embeddings
    else:
        assert read.mtp_num_layers == 1 and read.moe_layer_freq[0] == 0
        assert name != "deepseek-ai__DeepSeek-V3" or (read.is_mla and (read.rope_scaling, read.rope_scaling_factor) ==
                                                       ("yarn", 40))


@pytest.mark.parametrize("edit, words", [
    ({"transformer_layer_spec": {"_target_": "megatron.bridge.models.gpt_provider.default_layer_spec",
                                 "_call_": False}}, "transformer_layer_spec"),  # standard attention in every layer
    ({"transformer_layer_spec": {"_target_": "megatron.core.models.gpt.gpt_layer_specs.get_gpt_decoder_block_spec",
                                 "_partial_": True, "use_transformer_engine": True, "qk_l2_norm": True}},
     "transformer_layer_spec"),
    ({"moe_router_score_function": "softmax"}, "moe_router_pre_softmax"),  # read by the softmax router
    ({"rope_type": "rope", "mscale_all_dim": 0.707}, "mscale_all_dim"),
    ({"_target_": "megatron.bridge.models.deepseek.deepseek_provider.DeepSeekV32ModelProvider"}, "sparse attention"),
])
def test_what_the_deepseek_provider_builds_beyond_its_fields_is_refused_by_name(edit, words):
    from mconvert.convert.megatron import bridge
    from mconvert.errors import MConvertError
    from mconvert.mappings.families import spec_from_megatron_args

    cfg = bridge.read_run_config(ROOT / "tests" / "data" / PUBLISHED["deepseek-ai__DeepSeek-V3"])
    cfg["model"].update(edit)
    with pytest.raises(MConvertError, match=words):
        spec_from_megatron_args(bridge.megatron_args(cfg, "run_config.yaml"), source="run_config.yaml")


@pytest.mark.parametrize("edit, words", [
    ({"is_vision_language": True}, "is_vision_language"),  # bidirectional, unwindowed
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),  # its TE attention does not soft-cap
    ({"seq_len_interpolation_factor": 2.0}, "seq_len_interpolation_factor"),  # would scale the local rope too
    ({"rotary_base": 10000.0}, "rotary_base"),  # provide() unpacks (local, global)
    ({"transformer_layer_spec": {"_target_": "megatron.bridge.models.gpt_provider.default_layer_spec",
                                 "_call_": False}}, "gemma3_layer_spec"),
    ({"activation_func": {"_target_": "torch.nn.functional.gelu", "_call_": False}}, "activation_func"),  # erf GeGLU
])
def test_what_the_gemma3_provider_cannot_build_as_its_fields_say_is_refused_by_name(edit, words):
    from mconvert.convert.megatron import bridge
    from mconvert.errors import MConvertError
    from mconvert.mappings.families import spec_from_megatron_args

    cfg = bridge.read_run_config(ROOT / "tests" / "data" / PUBLISHED["lucas-remigio__gemma-3-1b-merged"])
    cfg["model"].update(edit)
    with pytest.raises(MConvertError, match=words):
        spec_from_megatron_args(bridge.megatron_args(cfg, "run_config.yaml"), source="run_config.yaml")


def test_a_field_the_mapping_needs_is_refused_when_absent(capsys, tmp_path):
    cfg = yaml.safe_load(REAL_RUN_CONFIG.read_text())
    del cfg["model"]["share_embeddings_and_output_weights"]
    ckpt = _real_bridge_layout(tmp_path / "ckpt", text=yaml.safe_dump(cfg))
    code, _, err = run_cli(["megatron-to-hf", ckpt, tmp_path / "hf"], capsys)
    assert_one_line_error(code, err, "share_embeddings_and_output_weights", "run_config.yaml")


@pytest.mark.parametrize("kind, text, words", [
    ("python tag", 'model: !!python/object/apply:os.system ["touch {pwned}"]\n', "not plain YAML data"),
    ("python name", "model:\n  _target_: !!python/name:os.system\n", "not plain YAML data"),
    ("alias bomb", "a: &a [x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]\n"
                   "c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]\nmodel: {x: *c}\n", "aliases"),
    ("huge", "model:\n  num_layers: 2\n" + "# padding\n" * (500_000), "bytes"),
    ("a list", "- model\n- run\n", "no `model:` mapping"),
    ("not text", b"model: \xff\xfe\n", "not UTF-8"),
])
def test_a_hostile_run_config_is_refused_with_one_line(capsys, tmp_path, kind, text, words):
    pwned = tmp_path / "PWNED"
    text = text.replace("{pwned}", str(pwned)) if isinstance(text, str) else text
    ckpt = _real_bridge_layout(tmp_path / "ckpt", text=text)
    code, _, err = run_cli(["megatron-to-hf", ckpt, tmp_path / "hf"], capsys)
    assert_one_line_error(code, err, words, "run_config.yaml")
    assert not pwned.exists() and not (tmp_path / "hf").exists()


def test_a_run_config_that_is_a_symlink_is_refused(capsys, tmp_path):
    ckpt = _real_bridge_layout(tmp_path / "ckpt")
    rc = ckpt / "iter_0000000" / "run_config.yaml"
    shutil.copy(rc, tmp_path / "elsewhere.yaml")
    rc.unlink()
    rc.symlink_to(tmp_path / "elsewhere.yaml")
    code, _, err = run_cli(["megatron-to-hf", ckpt, tmp_path / "hf"], capsys)
    assert_one_line_error(code, err, "run_config.yaml")


def test_bridge_output_needs_torch_dist_and_a_vocab_that_splits_over_tp(capsys, tmp_path):
    code, _, err = run_cli(["hf-to-megatron", hf_model("llama"), tmp_path / "a", "--bridge"], capsys)
    assert_one_line_error(code, err, "--bridge", "torch_dist")
    odd = _with_tokenizer(make_hf_llama(tmp_path / "odd", vocab=1001))
    code, _, err = run_cli(["hf-to-megatron", odd, tmp_path / "b", "--format", "torch_dist", "--bridge", "--tp", "2"],
                           capsys)
    assert_one_line_error(code, err, "vocab size 1001", "TP=2")
    code, _, err = run_cli(["hf-to-megatron", hf_model("gemma3"), tmp_path / "c", "--format", "torch_dist", "--bridge"],
                           capsys)
    assert_one_line_error(code, err, "--bridge", "Gemma providers")
    assert not (tmp_path / "c").exists()


def test_reshard_keeps_a_megatron_bridge_checkpoint_loadable_by_megatron_bridge(capsys, tmp_path):
    ckpt = _real_bridge_layout(tmp_path / "ckpt")
    torch.save({"step": torch.tensor(0), "consumed_train_samples": torch.tensor(4096)},
               ckpt / "iter_0000000" / "train_state.pt")  # a run's counters
    code, _, err = run_cli(["reshard", ckpt, tmp_path / "tp2", "--tp", "2"], capsys)
    assert code == 0, err
    cfg = yaml.safe_load((tmp_path / "tp2" / "iter_0000000" / "run_config.yaml").read_text())
    real = yaml.safe_load(REAL_RUN_CONFIG.read_text())  # the run's config is carried, its layout rewritten
    assert cfg["model"]["tensor_model_parallel_size"] == 2 and cfg["model"]["should_pad_vocab"] is False
    layout = {"tensor_model_parallel_size", "make_vocab_size_divisible_by"}  # 8 -> 4: 1000 rows split over TP=2
    assert cfg["model"]["make_vocab_size_divisible_by"] * 2 * 125 == 1000
    assert {k: v for k, v in cfg["model"].items() if k not in layout} == \
        {k: v for k, v in real["model"].items() if k not in layout}
    assert cfg["tokenizer"] == real["tokenizer"] and cfg["checkpoint"] == real["checkpoint"]
    state = torch.load(tmp_path / "tp2" / "latest_train_state.pt", weights_only=True)
    assert int(state["consumed_train_samples"]) == 4096
    code, _, err = run_cli(["megatron-to-hf", tmp_path / "tp2", tmp_path / "hf"], capsys)
    assert code == 0, err
    _same_tensors(hf_model("llama"), tmp_path / "hf")
    code, _, err = run_cli(["reshard", ckpt, tmp_path / "plain", "--tp", "2", "--no-bridge"], capsys)
    assert code == 0, err
    assert not list((tmp_path / "plain").rglob("run_config.yaml"))


# ---- Megatron-Bridge itself ------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def bridge_python() -> str:
    """The Megatron-Bridge venv's interpreter, the venv built when absent (make bridge-env)."""
    r = subprocess.run(["bash", str(ENV_SCRIPT)], capture_output=True, text=True, timeout=3600)
    assert r.returncode == 0, f"make bridge-env failed: {r.stderr[-2000:]}"
    return r.stdout.strip().splitlines()[-1]


def _run_bridge(python: str, *argv: Path | str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    r = subprocess.run([python, str(HELPER), *map(str, argv)], capture_output=True, text=True, timeout=1200,
                       cwd=WORK, env={**env, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, f"Megatron-Bridge failed ({sys.executable}):\n{r.stderr[-4000:]}"


@pytest.mark.bridge
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("name", ["llama", "qwen3", "qwen3_moe"])
def test_a_checkpoint_megatron_bridge_writes_converts_back_to_hf_tensor_identical(bridge_python, capsys, tmp_path,
                                                                                  name):
    ckpt = tmp_path / "bridge-ckpt"
    _run_bridge(bridge_python, "import", hf_model(name), ckpt)
    assert (ckpt / "iter_0000000" / "run_config.yaml").is_file() and not (ckpt / "iter_0000000" / "common.pt").exists()
    code, _, err = run_cli(["megatron-to-hf", ckpt, tmp_path / "hf"], capsys)
    assert code == 0, err
    _same_tensors(hf_model(name), tmp_path / "hf")
    assert (tmp_path / "hf" / "tokenizer.json").is_file()  # carried from the checkpoint's tokenizer/
    # its tokenizer/ (saved by transformers 5) is read where a verb needs the tokenizer itself
    code, _, err = run_cli(["megatron-to-gguf", ckpt, tmp_path / "m.gguf"], capsys)
    assert code == 0, err
    # re-sharded by mconvert, it stays a checkpoint Megatron-Bridge loads: its own export gives the same tensors
    code, _, err = run_cli(["reshard", ckpt, tmp_path / "tp2", "--tp", "2"], capsys)
    assert code == 0, err
    _run_bridge(bridge_python, "export", hf_model(name), tmp_path / "tp2", tmp_path / "hf2")
    _same_tensors(hf_model(name), tmp_path / "hf2")


@pytest.mark.bridge
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("name", ["deepseek_v3", "glm4_moe"])
def test_a_deepseek_v3_or_glm45_checkpoint_megatron_bridge_writes_converts_and_reshards(bridge_python, capsys,
                                                                                        tmp_path, name):
    """Megatron-Bridge's own import of DeepSeek-V3 (MLAModelProvider) and GLM-4.5 (GPTModelProvider with
    megatron-core's block spec): mconvert converts it to the HF tensors it came from, and a re-shard of it (TP 2,
    EP 2) converts the same and loads in Megatron-Bridge, whose export writes the same tensors (all but the MTP
    layer's embedding and head copies, which its DeepSeek bridge does not write)."""
    ckpt = tmp_path / "bridge-ckpt"
    _run_bridge(bridge_python, "import", hf_model(name), ckpt)
    model = yaml.safe_load((ckpt / "iter_0000000" / "run_config.yaml").read_text())["model"]
    assert model["_target_"].rsplit(".", 1)[-1] == ("MLAModelProvider" if name == "deepseek_v3" else "GPTModelProvider")
    assert model["transformer_layer_spec"]["_target_"].endswith("get_gpt_decoder_block_spec")
    code, _, err = run_cli(["megatron-to-hf", ckpt, tmp_path / "plan", "--dry-run"], capsys)
    assert code == 0 and not (tmp_path / "plan").exists(), err
    code, _, err = run_cli(["megatron-to-hf", ckpt, tmp_path / "hf"], capsys)
    assert code == 0, err
    _same_tensors(hf_model(name), tmp_path / "hf")
    code, _, err = run_cli(["reshard", ckpt, tmp_path / "tp2", "--tp", "2", "--ep", "2"], capsys)
    assert code == 0, err
    code, _, err = run_cli(["megatron-to-hf", tmp_path / "tp2", tmp_path / "hf-tp2"], capsys)
    assert code == 0, err
    _same_tensors(hf_model(name), tmp_path / "hf-tp2")
    _run_bridge(bridge_python, "export", hf_model(name), tmp_path / "tp2", tmp_path / "hf2")
    copies = ("model.layers.2.embed_tokens.weight", "model.layers.2.shared_head.head.weight")
    _same_tensors(hf_model(name), tmp_path / "hf2", absent=copies if name == "deepseek_v3" else ())


@pytest.mark.bridge
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_a_gemma_checkpoint_under_the_run_config_megatron_bridge_writes_converts_and_reshards(bridge_python, capsys,
                                                                                            tmp_path, name):
    """Megatron-Bridge's Gemma 2 / 3 layer specs are Transformer Engine's alone, so it cannot build the model on CPU:
    the run_config.yaml is the one it writes for the HF model (its provider from AutoBridge), the torch_dist beside
    it mconvert's (the names Bridge's Gemma bridges map: `linear_proj.post_layernorm`, ...). It converts to the HF
    tensors and config it came from, also re-sharded."""
    ckpt = tmp_path / "ckpt"
    code, _, err = run_cli(["hf-to-megatron", hf_model(name), ckpt, "--format", "torch_dist"], capsys)
    assert code == 0, err
    (ckpt / "release").rename(ckpt / "iter_0000000")  # laid out as Megatron-Bridge saves
    (ckpt / "latest_checkpointed_iteration.txt").write_text("0")
    for f in (ckpt / "mconvert-manifest.json", ckpt / "iter_0000000" / "integrity.json"):
        f.unlink()  # Megatron-Bridge leaves neither
    torch.save({"checkpoint_version": 3.0, "iteration": 0}, ckpt / "iter_0000000" / "common.pt")  # no args: Bridge's
    _run_bridge(bridge_python, "dump", hf_model(name) / "config.json", ckpt / "iter_0000000" / "run_config.yaml")
    assert "gemma" in yaml.safe_load((ckpt / "iter_0000000" / "run_config.yaml").read_text())["model"]["_target_"]
    from mconvert.mappings.families import spec_from_hf_config

    def spec(d):
        s = spec_from_hf_config(json.loads((d / "config.json").read_text()))
        return s.replace(softmax_scale=round(s.softmax_scale, 12))  # 24 ** -0.5 both ways, to the last bit or so
    for out, argv in (("hf", []), ("hf-tp2", ["reshard", ckpt, tmp_path / "tp2", "--tp", "2"])):
        if argv:
            code, _, err = run_cli(argv, capsys)
            assert code == 0, err
        code, _, err = run_cli(["megatron-to-hf", tmp_path / "tp2" if argv else ckpt, tmp_path / out], capsys)
        assert code == 0, err
        _same_tensors(hf_model(name), tmp_path / out)
        assert spec(tmp_path / out) == spec(hf_model(name))
    carried = yaml.safe_load((tmp_path / "tp2" / "iter_0000000" / "run_config.yaml").read_text())["model"]
    assert carried["_target_"].endswith(("Gemma2ModelProvider", "Gemma3ModelProvider"))  # re-shard keeps Bridge's
    assert carried["tensor_model_parallel_size"] == 2


@pytest.mark.bridge
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("name, tp, ep", [("llama", 2, 1), ("qwen3", 1, 1), ("qwen3_moe", 2, 2), ("deepseek_v3", 2, 2),
                                         ("glm4_moe", 2, 2)])
def test_megatron_bridge_export_reads_mconvert_torch_dist_into_the_same_hf_tensors(bridge_python, tmp_path, name, tp,
                                                                                  ep):
    """Also MLA (MLAModelProvider) and dense + MoE layers (megatron-core's block spec) as mconvert writes them; the
    MTP layer's embedding and head copies are not written by Bridge's DeepSeek export."""
    _run_bridge(bridge_python, "export", hf_model(name), ours(name, tp, ep), tmp_path / "hf")
    copies = ("model.layers.2.embed_tokens.weight", "model.layers.2.shared_head.head.weight")
    _same_tensors(hf_model(name), tmp_path / "hf", absent=copies if name == "deepseek_v3" else ())


@pytest.mark.parametrize("name", ["deepseek_v3", "glm4_moe"])
def test_the_provider_mconvert_writes_for_mla_and_mixed_moe_layers_reads_back_as_the_model(name):
    """--bridge writes MLAModelProvider with MLA's fields (DeepSeek-V3) and megatron-core's block spec for dense and
    MoE layers mixed (both), so that what Megatron-Bridge builds from it is the model (its export: the -m bridge
    test above)."""
    from mconvert.convert.megatron import bridge
    from mconvert.mappings.families import spec_from_hf_config, spec_from_megatron_args

    spec = spec_from_hf_config(json.loads((hf_model(name) / "config.json").read_text()))
    model = bridge.provider_fields(spec, 2, 1, None, 2)
    assert model["transformer_layer_spec"]["_target_"].endswith("get_gpt_decoder_block_spec")
    assert model["_target_"].endswith("MLAModelProvider" if name == "deepseek_v3" else "GPTModelProvider")
    read = spec_from_megatron_args(bridge.megatron_args({"model": yaml.safe_load(yaml.safe_dump(model))}, "x"))
    assert read.replace(bos_token_id=None, eos_token_id=None) == spec.replace(bos_token_id=None, eos_token_id=None)


def test_a_window_in_the_provider_reaches_the_export(capsys, tmp_path):
    """A feature the Megatron table maps (here a sliding window) is read from run_config.yaml too: the export
    states it (HF sliding_window = megatron-core's left size + 1), never drops it."""
    ckpt = _real_bridge_layout(tmp_path / "ckpt", edit={"window_size": [16, 0]})
    code, _, err = run_cli(["megatron-to-hf", ckpt, tmp_path / "hf"], capsys)
    assert code == 0, err
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["sliding_window"] == 17 and cfg["model_type"] == "mistral", cfg
