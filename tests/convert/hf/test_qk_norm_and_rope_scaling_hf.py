"""Qwen3 (per-head q/k RMSNorm) and Llama-3.x rope scaling on the HF side, against two references we did not
write: megatron-core 0.16.1's own `GPTModel` (local spec, `qk_layernorm=True`, `rope_scaling=True`, TP=2 over
gloo on CPU) and transformers 4.57's `Qwen3ForCausalLM` / `LlamaForCausalLM` (`rope_scaling` llama3).

- megatron-core writes a Megatron-LM checkpoint (its args without mconvert's `model_family`, so the family is
  recognised from the architecture switches); `mconvert megatron-to-hf` converts it and transformers' logits
  equal megatron-core's within 1e-4 of the largest logit, with the same top-1 everywhere;
- a random transformers model, saved by `save_pretrained`, goes through `hf-to-megatron --tp 2`; the rank
  files load strict into megatron-core's GPTModel, whose logits equal transformers';
- the control: the same export without `rope_scaling` in config.json gives transformers logits that differ
  by far more than the tolerance at the probed positions (the scaling matters there);
- HF -> Megatron -> HF gives every tensor byte-identical (and a second round the same files byte for byte),
  and a reshard TP2 -> TP1 -> TP2 byte-identical rank files.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from hf_ref import assert_logits_close, hf_logits, randomized_models
from mcore_ref import McoreContext, mcore_forward_logits, perturb_dense, run_mcore
from safetensors.torch import load_file

from mconvert.cli import main as cli_main
from mconvert.convert.verbs import hf_to_megatron, megatron_to_hf, reshard
from mconvert.layouts.megatron import rank_file, save_rank_file, write_latest
from mconvert.io.safeload import safe_load
from mconvert.mappings.families import preset, spec_from_megatron_args
from mconvert.spec import ModelSpec

pytestmark = pytest.mark.slow
REL_TOL = 1e-4
ITERATION = 3
# positions 0..95 of a 128-position model: with rope_theta 500000 and head_dim 64 the llama3 scaling
# rescales the low-frequency pairs, whose rotations already differ within these positions
PROBE = torch.randint(0, 1000, (2, 96), generator=torch.Generator().manual_seed(11))
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}  # megatron-core's fixed bands, Llama 3.1's values

MCORE_SPECS = {"qwen3": preset("tiny-qwen3"), "llama3": preset("tiny-llama3")}
HF_CONFIGS = {
    # untied here (the megatron-core Qwen3 above is tied); head_dim 32 != hidden 128 / 8 heads
    "qwen3": lambda: transformers.Qwen3Config(
        hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
        head_dim=32, vocab_size=1000, max_position_embeddings=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
        tie_word_embeddings=False),
    "llama3": lambda: transformers.LlamaConfig(
        hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=64, vocab_size=1000, max_position_embeddings=128, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=dict(LLAMA3_SCALING), tie_word_embeddings=False),
}


# ---- checkpoints written by megatron-core ---------------------------------------------------------------
def _save_as_megatron_lm(ctx: McoreContext, root: str) -> torch.Tensor | None:
    """Per rank: perturb, save as Megatron-LM's `save_checkpoint` does (its args carry no `model_family`),
    return megatron-core's logits on PROBE."""
    from megatron.core.transformer.enums import AttnBackend

    perturb_dense(ctx)
    args = ctx.spec.to_megatron_args(ctx.tp, ctx.pp)
    del args.model_family
    args.params_dtype = torch.float32
    args.attention_backend = AttnBackend.auto
    args.iteration = ITERATION
    state = {"args": args, "checkpoint_version": 3.0, "iteration": ITERATION,
             "model": ctx.model.state_dict_for_save_checkpoint()}
    save_rank_file(rank_file(root, ITERATION, ctx.tp_rank, ctx.pp_rank, ctx.pp), state)
    torch.distributed.barrier()
    if ctx.rank == 0:
        write_latest(root, ITERATION)
    return ctx.logits(PROBE)


@pytest.fixture(scope="module")
def mcore_exports(tmp_path_factory) -> dict[str, tuple[ModelSpec, torch.Tensor, Path]]:
    """name -> (spec, megatron-core's logits, `mconvert megatron-to-hf` export) for each megatron-core model."""
    out = {}
    for name, spec in MCORE_SPECS.items():
        tmp = tmp_path_factory.mktemp(f"mcore_{name}")
        results = run_mcore(spec, 2, _save_as_megatron_lm, (str(tmp / "mg"),))
        assert torch.equal(results[0], results[1])  # both TP ranks gathered the same logits
        assert cli_main(["megatron-to-hf", str(tmp / "mg"), str(tmp / "hf")]) in (0, None)
        out[name] = (spec, results[0][..., : spec.vocab_size], tmp / "hf")
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name,architecture", [("qwen3", "Qwen3ForCausalLM"), ("llama3", "LlamaForCausalLM")])
def test_megatron_core_checkpoints_convert_to_hf_with_its_logits(mcore_exports, name, architecture) -> None:
    spec, want, hf = mcore_exports[name]
    cfg = json.loads((hf / "config.json").read_text())
    assert cfg["architectures"] == [architecture]  # recognised from the args alone
    if name == "llama3":
        assert cfg["rope_scaling"] == LLAMA3_SCALING
    else:
        assert "rope_scaling" not in cfg and cfg["head_dim"] == 32 and cfg["tie_word_embeddings"] is True
    assert_logits_close(hf_logits(hf, PROBE, "eager"), want, f"megatron-core {name} TP=2 -> HF")


@pytest.mark.timeout(120)
def test_without_rope_scaling_the_logits_differ_measurably(mcore_exports, tmp_path) -> None:
    """The control: the scaling changes the function at the probed positions, so the match above proves it."""
    spec, want, hf = mcore_exports["llama3"]
    shutil.copytree(hf, tmp_path / "plain")
    cfg = json.loads((tmp_path / "plain" / "config.json").read_text())
    del cfg["rope_scaling"]
    (tmp_path / "plain" / "config.json").write_text(json.dumps(cfg))
    got = hf_logits(tmp_path / "plain", PROBE, "eager")
    diff, scale = (got - want).abs().max().item(), want.abs().max().item()
    print(f"[figures] llama3 without rope_scaling: max|Δ| {diff:.2e} vs tolerance {REL_TOL * scale:.2e}")
    assert diff > 100 * REL_TOL * scale
    assert torch.allclose(got[:, 0], want[:, 0], rtol=0, atol=REL_TOL * scale)  # position 0 has no rotation


@pytest.mark.timeout(120)
def test_megatron_core_llama3_converts_to_trtllm_with_its_logits(mcore_exports, tmp_path) -> None:
    """megatron-core's llama3 checkpoint (TP=2) -> megatron-to-trtllm --tp 2: the rank files, combined as
    TensorRT-LLM's layers do, give megatron-core's logits; config.json states the scaling as the HF export does."""
    from mconvert.convert.verbs import megatron_to_trtllm
    from mconvert.validators.trtllm_runner import trtllm_logits

    _, want, hf = mcore_exports["llama3"]
    megatron_to_trtllm(hf.parent / "mg", tmp_path / "trt", tp=2)
    assert json.loads((tmp_path / "trt" / "config.json").read_text())["rotary_scaling"] == LLAMA3_SCALING
    assert_logits_close(trtllm_logits(tmp_path / "trt", PROBE), want, "megatron-core llama3 TP=2 -> TensorRT-LLM TP=2")


# ---- models written by transformers ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_models(tmp_path_factory) -> dict[str, tuple[torch.Tensor, Path, Path]]:
    """name -> (transformers' logits, its save_pretrained dir, our hf-to-megatron TP=2 checkpoint)."""
    return randomized_models(HF_CONFIGS, PROBE, tmp_path_factory, hf_to_megatron)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", list(HF_CONFIGS))
def test_hf_to_megatron_loads_strict_into_megatron_core_with_transformers_logits(hf_models, name) -> None:
    want, _, mg = hf_models[name]
    states = [safe_load(mg / "release" / f"mp_rank_{t:02d}" / "model_optim_rng.pt") for t in range(2)]
    spec = spec_from_megatron_args(states[0]["args"])
    assert spec.qk_layernorm == (name == "qwen3") and spec.rope_scaling == ("llama3" if name == "llama3" else None)
    got = mcore_forward_logits(spec, 2, PROBE, [s["model"] for s in states])[..., : spec.vocab_size]
    assert_logits_close(got, want, f"transformers {name} -> hf-to-megatron TP=2 -> megatron-core")


def _sha(root: Path, pattern: str) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob(pattern)) if p.is_file()}


def _tensor_bytes(hf_dir: Path) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    out = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        for k, v in load_file(f).items():
            out[k] = (str(v.dtype), tuple(v.shape), v.contiguous().view(torch.uint8).numpy().tobytes())
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", list(HF_CONFIGS))
def test_round_trips_are_byte_identical(hf_models, tmp_path, name) -> None:
    """HF -> Megatron -> HF: every tensor's bytes equal transformers' own file (our writer orders the
    safetensors header by unit, transformers by name, so the files themselves differ in the header), and a
    second round reproduces our export file for file, byte for byte; reshard TP2 -> TP1 -> TP2 likewise."""
    _, hf, mg = hf_models[name]
    megatron_to_hf(mg, tmp_path / "back")
    assert _tensor_bytes(tmp_path / "back") == _tensor_bytes(hf)
    back = json.loads((tmp_path / "back" / "config.json").read_text())
    src = json.loads((hf / "config.json").read_text())
    for key in ("rope_scaling", "head_dim", "rms_norm_eps", "rope_theta", "tie_word_embeddings", "architectures"):
        assert back.get(key) == src.get(key), key
    hf_to_megatron(tmp_path / "back", tmp_path / "mg2", tp=2, pp=1)
    megatron_to_hf(tmp_path / "mg2", tmp_path / "back2")
    assert _sha(tmp_path / "back2", "*") == _sha(tmp_path / "back", "*")
    reshard(mg, tmp_path / "tp1", tp=1, pp=1)
    reshard(tmp_path / "tp1", tmp_path / "tp2", tp=2, pp=1)
    assert _sha(tmp_path / "tp2", "*.pt") == _sha(mg, "*.pt")


# ---- refusals ------------------------------------------------------------------------------------------
@pytest.mark.timeout(120)
@pytest.mark.parametrize("name,verb,named", [
    ("qwen3", "megatron-to-ft", "qk_layernorm=True (per-head q/k norm) is not mapped to FasterTransformer"),
    ("llama3", "megatron-to-ft", "use_rope_scaling=True, rope_scaling_factor=8) is not mapped to FasterTransformer"),
    ("qwen3", "megatron-to-trtllm", "qk_layernorm=True (per-head q/k norm) is not mapped to TensorRT-LLM"),
])
def test_deployment_formats_without_the_feature_refuse_it_by_name(mcore_exports, tmp_path, capsys, name, verb,
                                                                   named) -> None:
    from safety_common import assert_one_line_error, run_cli

    mg = mcore_exports[name][2].parent / "mg"
    code, _, err = run_cli([verb, mg, tmp_path / "out"], capsys)
    assert_one_line_error(code, err, named)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("preset_name", ["tiny-gpt2", "tiny-llama", "tiny-mistral", "tiny-qwen2"])
def test_a_family_whose_hf_class_has_no_qk_norm_refuses_it(preset_name) -> None:
    from mconvert.errors import MConvertError
    from mconvert.mappings.families import hf_config

    spec = preset(preset_name).replace(qk_layernorm=True)
    with pytest.raises(MConvertError, match=r"has no per-head q/k norm .*qk_layernorm=True; conversion refused"):
        hf_config(spec)


@pytest.mark.timeout(120)
def test_megatron_to_hf_refuses_qk_norm_for_a_llama_before_writing(hf_models, tmp_path, capsys) -> None:
    """A llama-family checkpoint with q/k norm (no HF class computes it) is refused, naming the checkpoint."""
    from safety_common import assert_one_line_error, run_cli

    _, _, mg = hf_models["llama3"]
    src = tmp_path / "mg"
    shutil.copytree(mg, src)
    (src / "mconvert-manifest.json").unlink()  # the rank files are edited below, as a foreign writer would
    for t in range(2):
        f = src / "release" / f"mp_rank_{t:02d}" / "model_optim_rng.pt"
        st = safe_load(f)
        st["args"].qk_layernorm = True
        st["args"].model_family = "llama"
        for i in range(2):
            for qk in ("q_layernorm", "k_layernorm"):
                st["model"][f"decoder.layers.{i}.self_attention.{qk}.weight"] = torch.ones(64)
        torch.save(st, f.with_suffix(".new"))  # a new file: the loaded one stays mapped
        f.with_suffix(".new").replace(f)
    code, _, err = run_cli(["megatron-to-hf", src, tmp_path / "out"], capsys)
    assert_one_line_error(code, err, "LlamaForCausalLM has no per-head q/k norm", str(src))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mg"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("change,named", [
    (lambda c: c.pop("head_dim"), "must state head_dim"),
    (lambda c: c.update(rope_scaling={"rope_type": "dynamic", "factor": 4.0}), "rope type 'dynamic' is not mapped"),
    (lambda c: c.update(attention_bias=True), "config field attention_bias=True is not supported"),
    (lambda c: c.update(use_sliding_window=True, layer_types=["chunked_attention"] * c["num_hidden_layers"]),
     "other attention kinds are not mapped"),
])
def test_a_qwen3_config_hf_to_megatron_cannot_honour_is_refused_by_name(hf_models, tmp_path, capsys, change,
                                                                        named) -> None:
    from safety_common import assert_one_line_error, run_cli

    _, hf, _ = hf_models["qwen3"]
    shutil.copytree(hf, tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    change(cfg)
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))
    code, _, err = run_cli(["hf-to-megatron", tmp_path / "hf", tmp_path / "mg"], capsys)
    assert_one_line_error(code, err, named, "config.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


@pytest.mark.timeout(120)
def test_llama3_bands_megatron_core_cannot_hold_are_refused_by_hf_to_megatron(hf_models, tmp_path, capsys) -> None:
    """megatron-core fixes the llama3 bands (1, 4, 8192): a Llama 3 config with other bands has no Megatron form."""
    from safety_common import assert_one_line_error, run_cli

    _, hf, _ = hf_models["llama3"]
    shutil.copytree(hf, tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    cfg["rope_scaling"]["original_max_position_embeddings"] = 4096
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))
    code, _, err = run_cli(["hf-to-megatron", tmp_path / "hf", tmp_path / "mg"], capsys)
    assert_one_line_error(code, err, "megatron-core's Llama-3 rope scaling fixes")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", list(MCORE_SPECS))
def test_verify_passes_the_export_against_the_megatron_core_checkpoint(mcore_exports, name) -> None:
    """`verify` reads the new config fields (head_dim, rope_scaling) and its native runner (q/k norm, scaled
    rope) agrees with transformers on the export; only what a bare megatron-core save lacks (a tokenizer and
    its eos id) is reported."""
    from mconvert.validators.verify import verify

    hf = mcore_exports[name][2]
    rep = verify(hf, against=hf.parent / "mg", device="cpu")
    status = {c.name: c.status for c in rep.checks}
    assert {n for n, s in status.items() if s == "error"} == {"tokenizer", "generation-config"}, rep.checks
    for n in ("architecture", "config", "weights-strict", "config-vs-checkpoint", "logits"):
        assert status[n] == "ok", (n, rep.checks)
