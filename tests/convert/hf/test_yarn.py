"""YaRN rope scaling, against code we did not write on both ends: megatron-core 0.16.1's GPTModel with
`position_embedding_type='yarn'` (its `config.yarn_*` attributes set as Megatron-LM's `_apply_yarn_config_from_args`
sets them) and transformers 4.57's `LlamaForCausalLM` / `Qwen2ForCausalLM` with `rope_scaling {rope_type: yarn}`.

Every probe is longer than the original context (64 positions), where YaRN's interpolated frequencies and its
attention factor change the function; a control with the scaling (or only the attention factor) dropped differs.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from hf_ref import assert_logits_close, hf_logits, randomized_models
from mcore_ref import McoreContext, mcore_forward_logits, perturb_dense, run_mcore
from safetensors.torch import load_file

from mconvert.cli import main as cli_main
from mconvert.convert.verbs import hf_to_megatron, megatron_to_hf
from mconvert.io.safeload import safe_load
from mconvert.layouts.megatron import rank_file, save_rank_file, write_latest
from mconvert.errors import MConvertError
from mconvert.mappings.families import hf_config, preset, spec_from_hf_config, spec_from_megatron_args
from mconvert.spec import ModelSpec

pytestmark = pytest.mark.slow
REL_TOL = 1e-4
ITERATION = 3
ORIGINAL = 64  # tiny-llama-yarn's original context; every probe runs past it
PROBE = torch.randint(0, 1000, (2, 160), generator=torch.Generator().manual_seed(13))

MCORE_SPECS = {
    # Qwen2.5-style: megatron-core's defaults (betas 32/1, mscale 1, mscale_all_dim 0, rounded range)
    "yarn": preset("tiny-llama-yarn"),
    # an mscale transformers' rule would not read (mscale_all_dim 0), an unrounded range, another beta_fast
    "yarn-mscale": preset("tiny-llama-yarn").replace(yarn_mscale=0.7, yarn_correction_range_round_to_int=False,
                                                     yarn_beta_fast=16.0, rotary_base=20000.0),
}


# ---- checkpoints written by megatron-core ---------------------------------------------------------------
def _save_as_megatron_lm(ctx: McoreContext, root: str, dist_root: str) -> torch.Tensor | None:
    """Per rank: perturb, save the legacy torch layout as Megatron-LM's `save_checkpoint` does and a torch_dist
    one by `dist_checkpointing.save` (args without `model_family`), return megatron-core's logits on PROBE."""
    from megatron.core import dist_checkpointing
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
    dist_dir = Path(dist_root) / f"iter_{ITERATION:07d}"
    dist_dir.mkdir(parents=True, exist_ok=True)
    torch.distributed.barrier()
    dargs = ctx.spec.to_megatron_args(ctx.tp, ctx.pp, ckpt_format="torch_dist")
    del dargs.model_family
    dargs.params_dtype = torch.float32
    dist_checkpointing.save({"model": ctx.model.sharded_state_dict(), "args": dargs, "checkpoint_version": 3.0,
                             "iteration": ITERATION}, str(dist_dir))
    if ctx.rank == 0:
        write_latest(root, ITERATION)
        write_latest(dist_root, ITERATION)
    return ctx.logits(PROBE)


@pytest.fixture(scope="module")
def mcore_exports(tmp_path_factory) -> dict[str, tuple[ModelSpec, torch.Tensor, Path]]:
    """name -> (spec, megatron-core's logits, tmp dir with `mg` (torch), `dist` (torch_dist) and their HF exports
    `hf`, `hf_dist`)."""
    out = {}
    for name, spec in MCORE_SPECS.items():
        tmp = tmp_path_factory.mktemp(f"mcore_{name}")
        results = run_mcore(spec, 2, _save_as_megatron_lm, (str(tmp / "mg"), str(tmp / "dist")))
        assert torch.equal(results[0], results[1])
        for src, dst in (("mg", "hf"), ("dist", "hf_dist")):
            assert cli_main(["megatron-to-hf", str(tmp / src), str(tmp / dst)]) in (0, None)
        out[name] = (spec, results[0][..., : spec.vocab_size], tmp)
    return out


EXPECTED_HF = {
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32.0,
             "beta_slow": 1.0},
    # transformers reads mscale only with a non-zero mscale_all_dim: the factor megatron-core computes is stated
    "yarn-mscale": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 16.0,
                    "beta_slow": 1.0, "truncate": False, "mscale": 0.7, "mscale_all_dim": 0.0,
                    "attention_factor": 0.1 * 0.7 * 1.3862943611198906 + 1.0},
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name,export", [("yarn", "hf"), ("yarn", "hf_dist"), ("yarn-mscale", "hf"),
                                         ("yarn-mscale", "hf_dist")])
def test_megatron_core_yarn_checkpoints_convert_to_hf_with_its_logits(mcore_exports, name, export) -> None:
    spec, want, tmp = mcore_exports[name]
    cfg = json.loads((tmp / export / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["max_position_embeddings"] == 256
    assert cfg["rope_scaling"] == pytest.approx(EXPECTED_HF[name])
    assert_logits_close(hf_logits(tmp / export, PROBE, "eager"), want, f"megatron-core {name} TP=2 ({export}) -> HF over {PROBE.shape[1]} tokens")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name,drop", [("yarn", "rope_scaling"), ("yarn-mscale", "rope_scaling"),
                                       ("yarn-mscale", "attention_factor")])
def test_without_yarn_or_its_attention_factor_the_logits_differ(mcore_exports, tmp_path, name, drop) -> None:
    """The controls: the export without its rope_scaling, or with only the stated attention factor dropped (so
    transformers falls back to 0.1·ln(factor)+1), misses megatron-core's logits by far more than the tolerance."""
    spec, want, tmp = mcore_exports[name]
    shutil.copytree(tmp / "hf", tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    if drop == "rope_scaling":
        del cfg["rope_scaling"]
    else:
        del cfg["rope_scaling"]["attention_factor"]
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))
    got = hf_logits(tmp_path / "hf", PROBE, "eager")
    diff, scale = (got - want).abs().max().item(), want.abs().max().item()
    print(f"[figures] {name} without {drop}: max|Δ| {diff:.2e} vs tolerance {REL_TOL * scale:.2e}")
    assert diff > 100 * REL_TOL * scale


# ---- the trainer ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trained(trained_checkpoint) -> tuple[Path, ModelSpec]:
    ckpt = trained_checkpoint(preset="tiny-llama-yarn", tp=2, pp=1, steps=2, seq_length=32, micro_batch_size=2,
                              global_batch_size=4, lr=1e-2, seed=7)
    return ckpt, spec_from_megatron_args(safe_load(rank_file(ckpt, 2, 0, 0, 1))["args"])


@pytest.mark.timeout(300)
def test_trainer_yarn_checkpoint_loads_into_megatron_core_with_its_logits(trained) -> None:
    """megatron-core loads the trainer's TP=2 checkpoint strict and its YaRN forward equals the trainer's."""
    from mconvert.trainer.infer import megatron_logits

    ckpt, spec = trained
    assert spec == preset("tiny-llama-yarn").replace(vocab_size=spec.vocab_size)
    args = safe_load(rank_file(ckpt, 2, 0, 0, 1))["args"]
    assert (args.position_embedding_type, args.rotary_scaling_factor, args.yarn_original_max_position_embeddings) \
        == ("yarn", 4.0, 64)  # Megatron-LM's own arg names
    sds = [safe_load(rank_file(ckpt, 2, t, 0, 1))["model"] for t in range(2)]
    ref = mcore_forward_logits(spec, 2, PROBE, sds)[..., : spec.vocab_size]
    diff = (megatron_logits(ckpt, PROBE) - ref).abs().max().item()
    print(f"[figures] tiny-llama-yarn TP=2 trainer vs megatron-core: logits max|Δ| {diff:.2e}")
    assert diff <= 1e-5


@pytest.mark.timeout(300)
def test_trainer_yarn_to_hf_validates_past_the_original_context(trained, tmp_path) -> None:
    from mconvert.validators.validate import validate

    ckpt, _ = trained
    megatron_to_hf(ckpt, tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["rope_scaling"] == EXPECTED_HF["yarn"]
    rep = validate(ckpt, [tmp_path / "hf"], device="cpu", n_tokens=128)
    r = rep.results[0]
    print(f"[figures] tiny-llama-yarn TP=2 -> HF, validate over 128 tokens: max|Δ| {r.metrics['max_abs']:.2e}, "
          f"max|logit| {r.metrics['ref_scale']:.3f}")
    assert rep.passed, r.failures
    assert r.metrics["top1"] == 1.0


# ---- models written by transformers ---------------------------------------------------------------------
HF_CONFIGS = {
    # every key explicit, in the spelling mconvert writes, so the config round-trips key for key
    "llama": lambda: transformers.LlamaConfig(
        hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=1000, max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                      "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.5},
        tie_word_embeddings=False),
    # as Qwen publishes its long-context configs: `type`, factor and original context only
    "qwen2": lambda: transformers.Qwen2Config(
        hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=1000, max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=1000000.0,
        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
        tie_word_embeddings=False),
    # q/k norm before the rotary (megatron-core's order too), head_dim != hidden / heads, unrounded range
    "qwen3": lambda: transformers.Qwen3Config(
        hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
        head_dim=32, vocab_size=1000, max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=1000000.0,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "truncate": False},
        tie_word_embeddings=True),
}


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory) -> dict[str, tuple[torch.Tensor, Path, Path]]:
    """name -> (transformers' logits, its save_pretrained dir, our hf-to-megatron TP=2 checkpoint)."""
    return randomized_models(HF_CONFIGS, PROBE, tmp_path_factory, hf_to_megatron)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(HF_CONFIGS))
def test_hf_yarn_to_megatron_loads_strict_into_megatron_core_with_transformers_logits(hf_models, name) -> None:
    want, _, mg = hf_models[name]
    states = [safe_load(mg / "release" / f"mp_rank_{t:02d}" / "model_optim_rng.pt") for t in range(2)]
    args = states[0]["args"]
    assert args.position_embedding_type == "yarn" and args.yarn_original_max_position_embeddings == 64
    spec = spec_from_megatron_args(args)
    got = mcore_forward_logits(spec, 2, PROBE, [s["model"] for s in states])[..., : spec.vocab_size]
    assert_logits_close(got, want, f"transformers {name} yarn -> hf-to-megatron TP=2 -> megatron-core")


def _sha(root: Path, pattern: str) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob(pattern)) if p.is_file()}


def _tensor_bytes(hf_dir: Path) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    out = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        for k, v in load_file(f).items():
            out[k] = (str(v.dtype), tuple(v.shape), v.contiguous().view(torch.uint8).numpy().tobytes())
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(HF_CONFIGS))
def test_yarn_round_trips_are_byte_identical(hf_models, tmp_path, name) -> None:
    """HF -> Megatron (torch, and torch_dist) -> HF: every tensor's bytes equal transformers' file, rope_scaling
    computes the same function (key for key where the source spells it as mconvert does), and a second round
    reproduces the first export file for file."""
    want, hf, mg = hf_models[name]
    megatron_to_hf(mg, tmp_path / "back")
    assert _tensor_bytes(tmp_path / "back") == _tensor_bytes(hf)
    back = json.loads((tmp_path / "back" / "config.json").read_text())
    src = json.loads((hf / "config.json").read_text())
    if name == "llama":
        assert back["rope_scaling"] == src["rope_scaling"]
    assert spec_from_hf_config(back) == spec_from_hf_config(src)
    assert_logits_close(hf_logits(tmp_path / "back", PROBE, "eager"), want.float(), f"transformers {name} yarn -> Megatron -> HF")
    hf_to_megatron(tmp_path / "back", tmp_path / "mg2", tp=2, pp=1)
    megatron_to_hf(tmp_path / "mg2", tmp_path / "back2")
    assert _sha(tmp_path / "back2", "*") == _sha(tmp_path / "back", "*")
    # torch_dist: its common.pt args carry the YaRN args as the rank files' do
    hf_to_megatron(hf, tmp_path / "dist", tp=2, pp=1, format="torch_dist")
    megatron_to_hf(tmp_path / "dist", tmp_path / "back3")
    assert _tensor_bytes(tmp_path / "back3") == _tensor_bytes(hf)
    assert json.loads((tmp_path / "back3" / "config.json").read_text())["rope_scaling"] == back["rope_scaling"]


# ---- refusals ------------------------------------------------------------------------------------------
BASE = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}


# What transformers computes from these, megatron-core computes only with other Megatron args: read literally, the
# keys would give it another attention factor (the literal pair is the control).
ARGS_OTHER_THAN_THE_KEYS = {
    # transformers ignores mscale while mscale_all_dim is 0: 0.1·ln 4+1 = 1.1386 (megatron-core literally: 1.0693)
    "mscale-without-all-dim": ({"mscale": 0.5, "mscale_all_dim": 0.0}, (1.0, 0.0), (0.5, 0.0)),
    # transformers ignores the pair while mscale is 0: 1.1386 (megatron-core literally: 0.8782)
    "mscale-zero": ({"mscale": 0.0, "mscale_all_dim": 1.0}, (1.0, 0.0), (0.0, 1.0)),
    # an attention_factor megatron-core has no field for: mscale 0 gives 1 (its defaults: 1.1386)
    "attention-factor-1": ({"attention_factor": 1.0}, (0.0, 0.0), (1.0, 0.0)),
    # below 1: a negative mscale
    "attention-factor-0.5": ({"attention_factor": 0.5}, (-3.6067376022224087, 0.0), (1.0, 0.0)),
    # no float64 mscale gives 1.7 bit for bit: the nearest is one float64 step above, the same float32
    "attention-factor-1.7": ({"attention_factor": 1.7}, (5.0494326431113725, 0.0), (1.0, 0.0)),
}


@pytest.fixture(scope="module")
def keys_mapped_to_other_args(hf_models, tmp_path_factory) -> dict[str, tuple[Path, torch.Tensor, Path]]:
    """name -> (the Llama of HF_CONFIGS with the variant's rope_scaling, transformers' logits, hf-to-megatron)."""
    _, hf, _ = hf_models["llama"]
    out = {}
    for name, (change, _, _) in ARGS_OTHER_THAN_THE_KEYS.items():
        tmp = tmp_path_factory.mktemp(f"keys_{name}")
        shutil.copytree(hf, tmp / "hf")
        cfg = json.loads((tmp / "hf" / "config.json").read_text())
        cfg["rope_scaling"] = {**BASE, "beta_fast": 32.0, "beta_slow": 1.0, **change}
        (tmp / "hf" / "config.json").write_text(json.dumps(cfg))
        (tmp / "hf" / "mconvert-manifest.json").unlink(missing_ok=True)
        hf_to_megatron(tmp / "hf", tmp / "mg", tp=1, pp=1)
        out[name] = (tmp / "hf", hf_logits(tmp / "hf", PROBE, "eager"), tmp / "mg")
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(ARGS_OTHER_THAN_THE_KEYS))
def test_hf_yarn_keys_megatron_core_reads_otherwise_map_to_args_with_transformers_logits(
        keys_mapped_to_other_args, tmp_path, name) -> None:
    """hf-to-megatron writes mscale_all_dim 0 and the mscale whose factor is transformers' (or megatron-core's
    defaults when those give it): megatron-core's GPTModel, loaded strict from the checkpoint and configured from
    its args, matches transformers over 160 tokens (64 trained), while the keys read literally miss by far; back
    to HF, transformers' logits are bit for bit the source's."""
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import _yarn_get_concentration_factor

    change, pair, literal = ARGS_OTHER_THAN_THE_KEYS[name]
    hf, want, mg = keys_mapped_to_other_args[name]
    state = safe_load(mg / "release" / "mp_rank_00" / "model_optim_rng.pt")
    args = state["args"]
    assert (args.mscale, args.mscale_all_dim) == pair
    model = transformers.AutoModelForCausalLM.from_pretrained(hf, torch_dtype=torch.float32)
    theirs = float(model.model.rotary_emb.attention_scaling)
    mine = _yarn_get_concentration_factor(args.rotary_scaling_factor, args.mscale, args.mscale_all_dim)
    print(f"[figures] {name}: transformers' attention factor {theirs!r}, megatron-core's from the args {mine!r}")
    assert torch.tensor(mine, dtype=torch.float32) == torch.tensor(theirs, dtype=torch.float32)
    assert abs(mine - theirs) <= 2**-52 * max(1.0, theirs)
    spec = spec_from_megatron_args(args)
    assert_logits_close(mcore_forward_logits(spec, 1, PROBE, [state["model"]])[..., : spec.vocab_size], want,
           f"transformers {change} -> hf-to-megatron -> megatron-core")
    as_keys = spec.replace(yarn_mscale=literal[0], yarn_mscale_all_dim=literal[1])
    diff = (mcore_forward_logits(as_keys, 1, PROBE, [state["model"]])[..., : spec.vocab_size] - want).abs().max()
    print(f"[figures] {name}: megatron-core with mscale {literal[0]}, mscale_all_dim {literal[1]}: max|Δ| {diff:.2e}")
    assert diff > 100 * REL_TOL * want.abs().max()
    megatron_to_hf(mg, tmp_path / "back")
    back = json.loads((tmp_path / "back" / "config.json").read_text())["rope_scaling"]
    print(f"[figures] {name}: exported rope_scaling {back}")
    assert torch.equal(hf_logits(tmp_path / "back", PROBE, "eager"), want)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("change,named", [
    ({"factor": 1.0, "attention_factor": 0.5},
     "transformers computes attention factor 0.5, megatron-core computes 1.0 whenever factor <= 1 (here 1.0)"),
    ({"attention_factor": 1e-17}, "transformers computes attention factor 1e-17, the nearest megatron-core reaches "
                                  "is 0.0"),
    ({"attention_factor": float("nan")}, "'attention_factor' must be a finite number for rope type 'yarn'"),
    ({"mscale": 1.0, "mscale_all_dim": -10 / 1.3862943611198906},
     "makes transformers divide by 0.1·mscale_all_dim·ln(factor)+1 = 0"),
    ({"finetuned": True}, "finetuned not mapped for rope type 'yarn'"),
    ({"truncate": "yes"}, "'truncate' must be true or false"),
    ({"beta_fast": "32"}, "'beta_fast' must be a number for rope type 'yarn'"),
])
def test_hf_yarn_variants_megatron_core_cannot_compute_are_refused_by_name(hf_models, tmp_path, capsys, change,
                                                                           named) -> None:
    from safety_common import assert_one_line_error, run_cli

    _, hf, _ = hf_models["llama"]
    shutil.copytree(hf, tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    cfg["rope_scaling"] = {**BASE, **change}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))
    code, _, err = run_cli(["hf-to-megatron", tmp_path / "hf", tmp_path / "mg"], capsys)
    assert_one_line_error(code, err, named)
    assert "rope_scaling" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_every_attention_factor_megatron_core_can_reach_is_mapped_to_it() -> None:
    """Over factors and attention factors from 0.05 to 20 (above and below 1, round and not): the Megatron args
    hf-to-megatron writes make megatron-core's own `_yarn_get_concentration_factor` return transformers' own
    attention factor (`_compute_yarn_parameters`): bit for bit in float64 mostly, else within 2^-52 (relative above
    1, absolute below) and the same float32, the precision both engines multiply cos and sin in."""
    import random

    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import _yarn_get_concentration_factor
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = hf_config(preset("tiny-llama-yarn"))
    rng = random.Random(5)
    exact = total = 0
    for factor in (1.5, 2.0, 4.0, 8.0, 32.0, 40.0, 3.7):
        for a in [0.05, 0.5, 0.9, 1.0, 1.2, 1.7, 2.0, 20.0] + [rng.uniform(0.05, 20.0) for _ in range(40)]:
            rs = {**BASE, "factor": factor, "attention_factor": a}
            args = spec_from_hf_config({**cfg, "rope_scaling": rs}).to_megatron_args()
            mine = _yarn_get_concentration_factor(args.rotary_scaling_factor, args.mscale, args.mscale_all_dim)
            theirs = ROPE_INIT_FUNCTIONS["yarn"](transformers.LlamaConfig(**{**cfg, "rope_scaling": rs}), "cpu")[1]
            assert abs(mine - theirs) <= 2**-52 * max(1.0, theirs), (factor, a, mine, theirs)
            assert torch.tensor(mine, dtype=torch.float32) == torch.tensor(theirs, dtype=torch.float32), (factor, a)
            exact += mine == theirs
            total += 1
    print(f"[figures] attention factors megatron-core reproduces bit for bit in float64: {exact} of {total}")
    assert exact > 0.8 * total


def test_hf_yarn_forms_that_compute_megatron_cores_function_are_mapped() -> None:
    """What transformers computes decides: an mscale it does not read (no mscale_all_dim) maps to megatron-core's
    defaults, an attention_factor equal to the derived one passes, a zero beta is transformers' default, an
    absent original context is max_position_embeddings."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = hf_config(preset("tiny-llama-yarn"))
    plain = spec_from_hf_config({**cfg, "rope_scaling": dict(BASE)})
    for change in ({"mscale": 0.5}, {"attention_factor": plain.yarn_attention_factor}, {"beta_fast": 0},
                   {"mscale": 1.0, "mscale_all_dim": 0.0}):
        assert spec_from_hf_config({**cfg, "rope_scaling": {**BASE, **change}}) == plain, change
    no_original = {k: v for k, v in BASE.items() if k != "original_max_position_embeddings"}
    assert spec_from_hf_config({**cfg, "rope_scaling": no_original}).rope_original_max_position_embeddings == 256
    both = spec_from_hf_config({**cfg, "rope_scaling": {**BASE, "mscale": 1.0, "mscale_all_dim": 1.0}})
    assert both.yarn_attention_factor == 1.0  # DeepSeek's pair: the factors cancel in both engines
    # a negative mscale_all_dim transformers reads: the args keep mscale_all_dim 0 and state the factor in mscale
    rs = {**BASE, "mscale": 1.0, "mscale_all_dim": -0.5}
    neg = spec_from_hf_config({**cfg, "rope_scaling": rs})
    theirs = ROPE_INIT_FUNCTIONS["yarn"](transformers.LlamaConfig(**{**cfg, "rope_scaling": rs}), "cpu")[1]
    assert (neg.yarn_mscale_all_dim, neg.yarn_attention_factor) == (0.0, theirs)


@pytest.mark.parametrize("change,named", [
    ({"use_rope_scaling": True}, "position_embedding_type='yarn' together with use_rope_scaling=True"),
    ({"rotary_seq_len_interpolation_factor": 2.0}, "together with rotary_seq_len_interpolation_factor=2.0"),
    ({"rotary_percent": 0.5}, "megatron-core's YaRN rotates the whole head"),
    ({"rotary_interleaved": True}, "rotary_interleaved=True"),
    ({"yarn_beta_slow": 0.0}, "yarn_beta_slow must be positive"),
    ({"yarn_correction_range_round_to_int": 1}, "yarn_correction_range_round_to_int=1 must be bool"),
])
def test_megatron_yarn_args_megatron_core_computes_otherwise_are_refused_by_name(change, named) -> None:
    args = preset("tiny-llama-yarn").to_megatron_args()
    for k, v in change.items():
        setattr(args, k, v)
    with pytest.raises(MConvertError, match=re.escape(named)):
        spec_from_megatron_args(args)


def test_megatron_lm_yarn_args_left_unset_take_its_defaults() -> None:
    """Megatron-LM stores None for a YaRN arg never given and `_apply_yarn_config_from_args` hands GPTModel
    YarnRotaryEmbedding's default instead: the reader does the same."""
    args = preset("tiny-llama-yarn").to_megatron_args()
    for name in ("yarn_original_max_position_embeddings", "yarn_beta_fast", "yarn_beta_slow"):
        setattr(args, name, None)
    spec = spec_from_megatron_args(args)
    assert (spec.rope_original_max_position_embeddings, spec.yarn_beta_fast, spec.yarn_beta_slow) == (4096, 32.0, 1.0)


# ---- GGUF / llama.cpp ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def with_tokenizer(hf_models, tmp_path_factory) -> dict[str, Path]:
    """name -> transformers' saved model (HF_CONFIGS) with the trainer's byte-level BPE tokenizer beside it."""
    from mconvert.data import build_tokenizer, save_hf_tokenizer

    tmp = tmp_path_factory.mktemp("gguf_src")
    save_hf_tokenizer(build_tokenizer(), tmp / "tok")
    out = {}
    for name, (_, hf, _) in hf_models.items():
        shutil.copytree(hf, tmp / name)
        for f in (tmp / "tok").iterdir():
            shutil.copy(f, tmp / name / f.name)
        out[name] = tmp / name
    return out


def _with_rope_scaling(hf: Path, dst: Path, rope_scaling: dict | None) -> Path:
    """A copy of `hf` whose config.json states `rope_scaling` (None: no scaling)."""
    shutil.copytree(hf, dst)
    cfg = json.loads((dst / "config.json").read_text())
    if rope_scaling is None:
        del cfg["rope_scaling"]
    else:
        cfg["rope_scaling"] = rope_scaling
    (dst / "config.json").write_text(json.dumps(cfg))
    (dst / "mconvert-manifest.json").unlink(missing_ok=True)  # an edited copy, not the export it describes
    return dst


def _gguf_rel(hf: Path, gguf: Path) -> tuple[bool, float]:
    from mconvert.validators.validate import validate

    rep = validate(hf, [gguf], device="cpu", n_tokens=128)
    m = rep.results[0].metrics
    return rep.passed, m["max_abs"] / m["ref_scale"]


@pytest.mark.gguf
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("name,arch", [("llama", "llama"), ("qwen2", "qwen2"), ("attention-factor-0.5", "llama")])
def test_yarn_gguf_matches_transformers_in_llama_cpp_past_the_original_context(llama_cpp, with_tokenizer, tmp_path,
                                                                              name, arch) -> None:
    """hf-to-gguf of transformers' YaRN models: llama.cpp (rope.scaling.* keys; the Llama's mscale pair, and an
    attention_factor of 0.5, give an attention factor other than 0.1·ln(factor)+1, stated as `attn_factor`, its
    ratio to that) matches transformers over 128 tokens."""
    from mconvert.convert.verbs import to_gguf
    from mconvert.validators.gguf_runner import read_gguf_metadata

    if name in ARGS_OTHER_THAN_THE_KEYS:
        hf = _with_rope_scaling(with_tokenizer["llama"], tmp_path / "hf",
                                {**BASE, "beta_fast": 32.0, "beta_slow": 1.0, **ARGS_OTHER_THAN_THE_KEYS[name][0]})
    else:
        hf = with_tokenizer[name]
    f32 = tmp_path / "m.gguf"
    to_gguf(hf, f32, "f32", verb="hf-to-gguf")
    meta = read_gguf_metadata(f32)
    assert (meta[f"{arch}.rope.scaling.type"], meta[f"{arch}.rope.scaling.factor"],
            meta[f"{arch}.rope.scaling.original_context_length"]) == ("yarn", 4.0, 64)
    assert (f"{arch}.rope.scaling.attn_factor" in meta) == (name != "qwen2")
    ok, rel = _gguf_rel(hf, f32)
    print(f"[figures] {name} yarn GGUF f32 in llama.cpp vs transformers over 128 tokens: max|Δ|/max|logit| {rel:.2e}")
    assert ok and rel < REL_TOL


@pytest.mark.gguf
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("drop", ["rope_scaling", "mscale"])
def test_a_yarn_gguf_without_the_scaling_or_its_factor_fails_the_comparison(llama_cpp, with_tokenizer, tmp_path,
                                                                             drop) -> None:
    """The controls: the GGUF of the Llama's config without YaRN (or without the mscale pair, so the factor falls
    back to 0.1·ln(factor)+1) misses transformers' logits of the model with it."""
    from mconvert.convert.verbs import to_gguf

    hf = with_tokenizer["llama"]
    kept = json.loads((hf / "config.json").read_text())["rope_scaling"]
    plain = _with_rope_scaling(hf, tmp_path / "plain", None if drop == "rope_scaling" else
                               {k: v for k, v in kept.items() if not k.startswith("mscale")})
    to_gguf(plain, tmp_path / "plain.gguf", "f32", verb="hf-to-gguf")
    ok, rel = _gguf_rel(hf, tmp_path / "plain.gguf")
    print(f"[figures] llama yarn GGUF without {drop}: max|Δ|/max|logit| {rel:.2e}")
    assert not ok and rel > 100 * REL_TOL


@pytest.mark.timeout(300)
@pytest.mark.parametrize("change,named", [
    ({"beta_fast": 16.0}, "yarn_beta_fast=16.0"),
    ({"beta_slow": 2.0}, "yarn_beta_slow=2.0"),
    ({"truncate": False}, "yarn_correction_range_round_to_int=False"),
])
def test_yarn_llama_cpp_computes_otherwise_is_refused_for_gguf_by_name(with_tokenizer, tmp_path, capsys, change,
                                                                       named) -> None:
    from safety_common import assert_one_line_error, run_cli

    hf = _with_rope_scaling(with_tokenizer["qwen2"], tmp_path / "hf", {**BASE, **change})
    code, _, err = run_cli(["hf-to-gguf", hf, tmp_path / "m.gguf"], capsys)
    assert_one_line_error(code, err, named, "llama.cpp's qwen2 architecture fixes beta_fast 32 and beta_slow 1")
    assert not (tmp_path / "m.gguf").exists()


# ---- vLLM ---------------------------------------------------------------------------------------------------
@pytest.mark.vllm
@pytest.mark.timeout(1800)
def test_converted_yarn_models_serve_in_vllm_with_transformers_greedy_tokens(mcore_exports) -> None:
    """vLLM serves both megatron-core exports (the second with truncate false, beta_fast 16 and an explicit
    attention_factor) with transformers' greedy tokens from prompts of 64 tokens (the original context) to
    position 96, and prompt logprobs within vLLM's tolerance; without the scaling transformers' own greedy
    tokens differ, so the agreement covers YaRN."""
    import os

    from mconvert.validators.vllm_check import LOGPROB_TOL, ensure_vllm_env, vllm_compare_many

    if os.environ.get("MCONVERT_SKIP_VLLM"):
        pytest.skip("MCONVERT_SKIP_VLLM set")
    dirs = [mcore_exports[name][2] / "hf" for name in MCORE_SPECS]
    results = vllm_compare_many(dirs, ensure_vllm_env(), prompt_len=64, max_tokens=32)
    for name, d, r in zip(MCORE_SPECS, dirs, results):
        assert r["passed"], r["summary"]
        assert r["token_agreement"] == 1.0 and r["prompt_logprob_max_abs"] <= LOGPROB_TOL
        print(f"[figures] vLLM {name}: {r['summary']}; prompt logprobs max|Δ| {r['prompt_logprob_max_abs']:.2e}")
        model = transformers.AutoModelForCausalLM.from_pretrained(d, torch_dtype=torch.float32).eval()
        model.config.rope_scaling = None
        plain = transformers.AutoModelForCausalLM.from_config(model.config, torch_dtype=torch.float32).eval()
        plain.load_state_dict(model.state_dict())
        changed = 0
        for p in r["prompts"]:
            assert len(p["prompt_ids"]) == 64 and p["vllm_tokens"] == p["transformers_tokens"]
            ids = torch.tensor([p["prompt_ids"]])
            with torch.no_grad():
                out = plain.generate(ids, max_new_tokens=len(p["vllm_tokens"]), do_sample=False)
            changed += out[0, 64:].tolist() != p["vllm_tokens"]
        assert changed == len(r["prompts"]), f"{name}: greedy tokens without YaRN equal those with it"


# vLLM's own reading of a config's rope_scaling (its transformers, `patch_rope_parameters`, `get_rope`): the number
# its YaRN multiplies cos and sin by, per model dir
VLLM_FACTOR = """
import json, sys
import torch
from transformers import AutoConfig
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.transformers_utils.config import patch_rope_parameters
out = {}
with set_current_vllm_config(VllmConfig()):
    for d in sys.argv[1:]:
        cfg = AutoConfig.from_pretrained(d)
        patch_rope_parameters(cfg)
        rope = get_rope(cfg.hidden_size // cfg.num_attention_heads, max_position=cfg.max_position_embeddings,
                        rope_parameters=cfg.rope_parameters, dtype=torch.float32)
        out[d] = [type(rope).__name__, rope.mscale]
print("VLLM_FACTOR " + json.dumps(out))
"""


@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_vllm_reads_transformers_yarn_factor_from_the_sources_and_their_exports(keys_mapped_to_other_args,
                                                                                tmp_path) -> None:
    """For the HF keys megatron-core reads otherwise, vLLM's YaRN multiplies by transformers' attention factor,
    both on the source config and on the megatron-to-hf export of the mapped checkpoint (which states
    attention_factor whenever the mscale pair alone would not give it)."""
    import os
    import subprocess

    from mconvert.validators.vllm_check import ensure_vllm_env

    if os.environ.get("MCONVERT_SKIP_VLLM"):
        pytest.skip("MCONVERT_SKIP_VLLM set")
    dirs = []
    for name, (hf, _, mg) in keys_mapped_to_other_args.items():
        megatron_to_hf(mg, tmp_path / name)
        dirs += [hf, tmp_path / name]
    r = subprocess.run([str(ensure_vllm_env()), "-c", VLLM_FACTOR, *map(str, dirs)], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(next(ln for ln in r.stdout.splitlines() if ln.startswith("VLLM_FACTOR "))[len("VLLM_FACTOR "):])
    for d in dirs:
        model = transformers.AutoModelForCausalLM.from_pretrained(d, torch_dtype=torch.float32)
        want = float(model.model.rotary_emb.attention_scaling)
        print(f"[figures] {d.parent.name if d.name == 'hf' else d.name} ({d.name}): vLLM {got[str(d)]}, "
              f"transformers {want!r}")
        assert got[str(d)] == ["YaRNScalingRotaryEmbedding", want]


# ---- TensorRT-LLM, FasterTransformer, ONNX ---------------------------------------------------------------
@pytest.mark.timeout(300)
@pytest.mark.parametrize("source", ["megatron-core", "transformers", "attention-factor-0.5"])
def test_yarn_converts_to_trtllm_with_the_sources_logits(request, tmp_path, source) -> None:
    """TensorRT-LLM's LLaMA checkpoint states YaRN in `rotary_scaling` (the HF dict, as `from_hugging_face`
    copies it); its attention reads factor, original context, betas and the mscale pair (megatron-core's rule),
    and the reference runner computes that: megatron-core's default YaRN, transformers' Llama whose mscale
    pair gives another attention factor, and one whose attention_factor 0.5 became a negative mscale, match their
    sources at TP=2; without the scaling they do not."""
    from mconvert.convert.verbs import megatron_to_trtllm
    from mconvert.validators.trtllm_runner import trtllm_logits

    if source == "megatron-core":
        _, want, tmp = request.getfixturevalue("mcore_exports")["yarn"]
        mg = tmp / "mg"
    elif source == "transformers":
        want, _, mg = request.getfixturevalue("hf_models")["llama"]
        want = want.float()
    else:
        _, want, mg = request.getfixturevalue("keys_mapped_to_other_args")[source]
    megatron_to_trtllm(mg, tmp_path / "trt", 2)
    cfg = json.loads((tmp_path / "trt" / "config.json").read_text())
    assert cfg["rotary_scaling"]["rope_type"] == "yarn"
    assert_logits_close(trtllm_logits(tmp_path / "trt", PROBE), want, f"{source} yarn -> TensorRT-LLM TP=2")
    del cfg["rotary_scaling"]
    (tmp_path / "trt" / "config.json").write_text(json.dumps(cfg))
    diff = (trtllm_logits(tmp_path / "trt", PROBE) - want).abs().max().item()
    assert diff > 100 * REL_TOL * want.abs().max().item()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("verb,named", [
    ("megatron-to-trtllm", "yarn_correction_range_round_to_int=False has no TensorRT-LLM form"),
    ("megatron-to-ft", "position_embedding_type='yarn', rotary_scaling_factor=4) is not mapped to FasterTransformer"),
])
def test_deployment_formats_that_compute_another_yarn_refuse_it_by_name(mcore_exports, tmp_path, capsys, verb,
                                                                        named) -> None:
    from safety_common import assert_one_line_error, run_cli

    _, _, tmp = mcore_exports["yarn-mscale"]
    code, _, err = run_cli([verb, tmp / "mg", tmp_path / "out", "--tp", "1"], capsys)
    assert_one_line_error(code, err, named)
    assert not (tmp_path / "out").exists()


@pytest.mark.timeout(600)
def test_yarn_to_onnx_matches_transformers_past_the_original_context(hf_models, tmp_path) -> None:
    """optimum traces transformers' YaRN (static inverse frequencies and attention factor, unlike dynamic NTK), so
    the ONNX graph computes it at every length: onnxruntime equals transformers over 160 tokens, prefill and
    cached decode, for the Llama whose mscale pair gives another attention factor."""
    from mconvert.convert.verbs import to_onnx
    from mconvert.validators.onnx_runner import check_onnx_against_hf

    _, hf, _ = hf_models["llama"]
    to_onnx(hf, tmp_path / "onnx", with_past=True, check=check_onnx_against_hf)
    prefill, decode = check_onnx_against_hf(tmp_path / "onnx", hf, seq=160)
    print(f"[figures] llama yarn ONNX vs transformers over 160 tokens: prefill {prefill:.2e}, decode {decode:.2e}")
    assert prefill < REL_TOL and decode is not None and decode < REL_TOL


@pytest.mark.timeout(300)
def test_verify_passes_the_yarn_export_against_the_megatron_core_checkpoint(mcore_exports) -> None:
    """`verify` reads rope_scaling yarn and its native runner (YaRN frequencies and attention factor) agrees with
    transformers on the export over 128 tokens; only what a bare megatron-core save lacks is reported."""
    from mconvert.validators.verify import verify

    tmp = mcore_exports["yarn-mscale"][2]
    rep = verify(tmp / "hf", against=tmp / "mg", device="cpu", n_tokens=128)
    status = {c.name: c.status for c in rep.checks}
    assert {n for n, s in status.items() if s == "error"} == {"tokenizer", "generation-config"}, rep.checks
    for n in ("architecture", "config", "weights-strict", "config-vs-checkpoint", "logits"):
        assert status[n] == "ok", (n, rep.checks)
