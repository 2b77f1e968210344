"""Multi-latent attention with YaRN (DeepSeek-V3's own rope: factor 40, mscale = mscale_all_dim = 1), proven
against code we did not write.

megatron-core 0.16.1's GPTModel with MLA and `rope_type='yarn'` blends the rope part's frequencies, multiplies its
cos and sin by get_mscale(f, mscale) / get_mscale(f, mscale_all_dim) and MLA's softmax scale by
get_mscale(f, mscale_all_dim)²; transformers' DeepseekV3 reads `rope_scaling` with its own rule for the cos/sin
factor and scales its softmax by get_mscale(f, mscale_all_dim)² when mscale_all_dim is non-zero. The sequences
here run past `original_max_position_embeddings` (32), where the blended frequencies matter.

- megatron-core's own checkpoint at TP=2 EP=2 -> megatron-to-hf -> transformers' logits equal megatron-core's;
  dropping the mscale pair or changing the factor in that config.json moves them (the controls); HF -> Megatron
  at TP=2 EP=2 gives back megatron-core's rank files tensor for tensor;
- a transformers-initialised DeepseekV3 whose YaRN states only mscale_all_dim (so Megatron's mscale is solved
  for) -> hf-to-megatron TP=2 EP=2 -> megatron-core's logits equal transformers'; back to HF, the same bytes;
- the trainer's tiny-deepseek-v3-yarn checkpoint loads into megatron-core with our logits;
- Megatron-LM's args read as megatron-core builds MLATransformerConfig from them; what is ambiguous is refused.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from hf_ref import move_off_init
from mcore_ref import McoreContext, perturb, run_mcore, save_checkpoints
from sparse_hf import deepseek_lite_config

from mconvert.convert.verbs import hf_to_megatron, megatron_to_hf
from mconvert.layouts.megatron import rank_file
from mconvert.errors import MConvertError
from mconvert.io.safeload import safe_load
from mconvert.mappings.families import preset, spec_from_hf_config, spec_from_megatron_args

TOL = 1e-4  # relative to the largest |logit|
ITERATION = 3
TP, EP = 2, 2
SPEC = preset("tiny-deepseek-v3-yarn").replace(mtp_num_layers=None)
TOKENS = torch.randint(0, 1000, (2, 48), generator=torch.Generator().manual_seed(11))  # 16 positions past 32


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def _save(ctx: McoreContext, root: str, tokens: torch.Tensor) -> torch.Tensor:
    """Per rank: weights off their init, a non-negative expert bias, the legacy rank file; the logits."""
    perturb(ctx)
    for name, buf in ctx.model.named_buffers():
        if name.endswith("expert_bias"):
            buf.copy_(0.3 * torch.arange(buf.numel(), dtype=buf.dtype).remainder(5))
    save_checkpoints(ctx, root, ITERATION)
    return ctx.logits(tokens)


def _load_forward(ctx: McoreContext, files: dict, tokens: torch.Tensor) -> torch.Tensor:
    ctx.model.load_state_dict(files[(ctx.tp_rank, ctx.ep_rank)], strict=True)
    return ctx.logits(tokens)


def _rank_models(root: Path, iteration: int | str) -> dict:
    return {(t, e): safe_load(rank_file(root, iteration, t, 0, 1, e, EP))["model"] for t in range(TP) for e in range(EP)}


def _hf_logits(d: Path, tokens: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    assert type(model).__name__ == "DeepseekV3ForCausalLM"
    with torch.no_grad():
        return model(tokens).logits.float()


def _with_rope(src: Path, dst: Path, **rope) -> Path:
    """A copy of HF dir `src` whose rope_scaling is changed by `rope` (a None value drops the key)."""
    dst.mkdir()
    for f in src.iterdir():
        shutil.copy(f, dst / f.name)
    cfg = json.loads((src / "config.json").read_text())
    rs = {**cfg["rope_scaling"], **rope}
    cfg["rope_scaling"] = {k: v for k, v in rs.items() if v is not None}
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.fixture(scope="module")
def mcore_saved(tmp_path_factory) -> tuple[Path, torch.Tensor]:
    root = tmp_path_factory.mktemp("mla_yarn") / "ckpt"
    logits = run_mcore(SPEC, TP, _save, (str(root), TOKENS), ep=EP)[0][..., : SPEC.vocab_size]
    return root, logits


@pytest.mark.slow
def test_megatron_cores_mla_yarn_converts_to_transformers_logits(mcore_saved, tmp_path: Path) -> None:
    root, want = mcore_saved
    args = vars(safe_load(rank_file(root, ITERATION, 0, 0, 1, 0, EP))["args"])
    assert (args["rope_type"], args["rotary_scaling_factor"], args["original_max_position_embeddings"]) == (
        "yarn", 4.0, 32)
    megatron_to_hf(root, tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["rope_scaling"] == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                                   "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
    got = _hf_logits(tmp_path / "hf", TOKENS)
    diff, tail = _rel(got, want), _rel(got[:, 32:], want[:, 32:])
    assert diff <= TOL and tail <= TOL, (diff, tail)
    # controls: transformers without the mscale pair (cos/sin x 1.14, softmax unscaled) or with another factor
    no_pair = _rel(_hf_logits(_with_rope(tmp_path / "hf", tmp_path / "no_pair", mscale=None, mscale_all_dim=None),
                              TOKENS), want)
    factor2 = _rel(_hf_logits(_with_rope(tmp_path / "hf", tmp_path / "factor2", factor=2.0), TOKENS), want)
    assert no_pair > 100 * TOL and factor2 > 100 * TOL, (no_pair, factor2)
    # and back to Megatron at the same layout: megatron-core's own rank files, tensor for tensor (the vocab's
    # padding rows, which HF does not hold, excepted)
    hf_to_megatron(tmp_path / "hf", tmp_path / "m2", tp=TP, ep=EP)
    first, back = _rank_models(root, ITERATION), _rank_models(tmp_path / "m2", "release")
    for (t, e), model in first.items():
        for k, v in model.items():
            if torch.is_tensor(v):
                rows = slice(None)
                if k in ("embedding.word_embeddings.weight", "output_layer.weight"):
                    rows = slice(0, max(0, min(v.shape[0], SPEC.vocab_size - t * v.shape[0])))
                assert torch.equal(back[(t, e)][k][rows], v[rows]), (t, e, k)
    print(f"[figures] megatron-core MLA + YaRN (factor 4, 32 -> 128 positions) TP=2 EP=2 -> HF: transformers vs "
          f"megatron-core {diff:.1e} (positions 32-47: {tail:.1e}); controls: mscale pair dropped {no_pair:.1e}, "
          f"factor 2 {factor2:.1e}")


def _random_hf(d: Path, rope_scaling: dict) -> None:
    """A transformers-initialised DeepseekV3ForCausalLM of tiny-deepseek-v3's shapes with `rope_scaling`, its
    weights off their init (norms off 1, a non-negative correction bias)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(
        vocab_size=1000, hidden_size=128, intermediate_size=256, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=8, num_key_value_heads=8, n_shared_experts=1, n_routed_experts=16, routed_scaling_factor=2.5,
        kv_lora_rank=512, q_lora_rank=64, qk_rope_head_dim=64, v_head_dim=32, qk_nope_head_dim=32, n_group=4,
        topk_group=2, num_experts_per_tok=4, first_k_dense_replace=1, max_position_embeddings=128,
        rms_norm_eps=1e-6, tie_word_embeddings=False, rope_scaling=rope_scaling)
    torch.manual_seed(2)
    model = DeepseekV3ForCausalLM(cfg).eval()
    move_off_init(model)
    model.save_pretrained(d)


@pytest.mark.slow
def test_hf_yarn_with_mscale_all_dim_only_loads_into_megatron_core_at_tp2_ep2(tmp_path: Path) -> None:
    """transformers then scales cos/sin by get_mscale(f) and the softmax by get_mscale(f, 0.8)²: Megatron keeps
    mscale_all_dim 0.8 (the softmax) and gets the mscale that gives transformers' cos/sin factor."""
    _random_hf(tmp_path / "hf", {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                                 "mscale_all_dim": 0.8})
    want = _hf_logits(tmp_path / "hf", TOKENS)
    hf_to_megatron(tmp_path / "hf", tmp_path / "m", tp=TP, ep=EP)
    args = vars(safe_load(rank_file(tmp_path / "m", "release", 0, 0, 1, 0, EP))["args"])
    spec = spec_from_megatron_args(args)
    assert (args["rope_type"], args["mscale_all_dim"]) == ("yarn", 0.8) and args["mscale"] != 1.0
    got = run_mcore(spec, TP, _load_forward, (_rank_models(tmp_path / "m", "release"), TOKENS), ep=EP)[0]
    diff = _rel(got[..., : spec.vocab_size], want)
    assert diff <= TOL, diff
    megatron_to_hf(tmp_path / "m", tmp_path / "hf2")
    megatron_to_hf(tmp_path / "m", tmp_path / "hf3")
    assert (tmp_path / "hf2" / "model.safetensors").read_bytes() == (tmp_path / "hf3" / "model.safetensors").read_bytes()
    from safetensors.torch import load_file

    src, back = load_file(tmp_path / "hf" / "model.safetensors"), load_file(tmp_path / "hf2" / "model.safetensors")
    assert src.keys() == back.keys() and all(torch.equal(src[k], back[k]) for k in src)
    cfg = json.loads((tmp_path / "hf2" / "config.json").read_text())
    assert (cfg["rope_scaling"]["mscale"], cfg["rope_scaling"]["mscale_all_dim"]) == (args["mscale"], 0.8)
    # transformers' factor from the written pair is the source's; the equal tensors sit at other file offsets,
    # which moves the CPU matmuls' rounding only
    again = _rel(_hf_logits(tmp_path / "hf2", TOKENS), want)
    assert again <= 1e-6, again
    print(f"[figures] transformers DeepseekV3 (YaRN factor 4, mscale_all_dim 0.8 only) -> Megatron TP=2 EP=2: "
          f"megatron-core vs transformers {diff:.1e} (Megatron mscale {args['mscale']!r}); HF -> Megatron -> HF: "
          f"tensors identical, transformers logits {again:.1e}")


@pytest.mark.slow
def test_trainer_mla_yarn_trains_converts_and_validates(tmp_path: Path) -> None:
    """The trainer's tiny-deepseek-v3-yarn at TP=2 EP=2 (64-token sequences, twice the original context): its
    export's transformers logits are the checkpoint's, and `validate` passes on 96 tokens."""
    from mconvert.trainer.infer import megatron_logits
    from mconvert.trainer.train import TrainConfig, train
    from mconvert.validators.validate import validate

    train(TrainConfig(preset="tiny-deepseek-v3-yarn", tp=TP, pp=1, dp=EP, ep=EP, steps=2, seq_length=64,
                      micro_batch_size=2, global_batch_size=8, lr=1e-2, seed=42, quiet=True, save=str(tmp_path / "t"),
                      moe_aux_loss_coeff=0.0))
    spec = preset("tiny-deepseek-v3-yarn")
    ours = megatron_logits(tmp_path / "t", TOKENS)
    megatron_to_hf(tmp_path / "t", tmp_path / "hf")
    hf = _hf_logits(tmp_path / "hf", TOKENS)
    diff = _rel(hf, ours)
    assert diff <= TOL, diff
    assert spec.rope_scaling == "yarn"
    report = validate(tmp_path / "t", [tmp_path / "hf"], n_tokens=96)
    assert report.passed, report.to_json()
    print(f"[figures] trainer tiny-deepseek-v3-yarn TP=2 EP=2 -> HF: transformers vs ours {diff:.1e}; validate passes")


# ---- Megatron-LM's args --------------------------------------------------------------------------------------
def _args(**changes) -> dict:
    """Megatron-LM args of the preset, then `changes` (a value of `...` removes the arg)."""
    a = vars(preset("tiny-deepseek-v3-yarn").to_megatron_args())
    a.update(changes)
    return {k: v for k, v in a.items() if v is not ...}


def test_megatron_lm_deepseek_v3_args_read_as_mla_transformer_config_builds_them() -> None:
    """DeepSeek-V3's Megatron-LM recipe: --rotary-scaling-factor 40 --mscale 1.0 --mscale-all-dim 1.0 and no
    --rope-type (MLA takes YaRN); original_max_position_embeddings / beta_fast / beta_slow have no argument, so
    MLATransformerConfig's defaults (4096, 32, 1) hold."""
    spec = spec_from_megatron_args(_args(rope_type=None, rotary_scaling_factor=40.0, original_max_position_embeddings=...,
                                         beta_fast=..., beta_slow=...))
    assert (spec.rope_scaling, spec.rope_scaling_factor, spec.rope_original_max_position_embeddings,
            spec.yarn_beta_fast, spec.yarn_beta_slow, spec.yarn_mscale, spec.yarn_mscale_all_dim) == (
        "yarn", 40.0, 4096, 32.0, 1.0, 1.0, 1.0)
    no_factor = spec_from_megatron_args(_args(rope_type=..., rotary_scaling_factor=...))
    assert no_factor.rope_scaling_factor == 40.0  # MLATransformerConfig's default
    assert spec_from_megatron_args(_args(rotary_scaling_factor=1.0)).rope_scaling is None  # stretches nothing
    assert spec_from_megatron_args(_args(rope_type="rope", mscale_all_dim=0.0)).rope_scaling is None


@pytest.mark.parametrize("changes,message", [
    (dict(rotary_scaling_factor=None), r"rotary_scaling_factor=None must be a finite number"),
    (dict(beta_fast="32"), r"beta_fast='32' must be int or float"),
    (dict(yarn_beta_fast=16.0), r"yarn_beta_fast=16.0 with multi_latent_attention: megatron-core's MLA ignores it"),
    (dict(yarn_correction_range_round_to_int=False), r"yarn_correction_range_round_to_int=False with multi_latent"),
    (dict(position_embedding_type="yarn"), r"position_embedding_type='yarn' with multi_latent_attention"),
    (dict(rope_type="rope"), r"rope_type='rope' with rotary_scaling_factor=4.0 and mscale_all_dim=1.0"),
    (dict(rope_type="ntk"), r"rope_type='ntk' is not supported"),
])
def test_ambiguous_mla_yarn_args_are_refused_by_name(changes: dict, message: str) -> None:
    from mconvert.mappings.fields import check_megatron_args

    with pytest.raises(MConvertError, match=message):
        a = _args(**changes)
        check_megatron_args(a, "args")
        spec_from_megatron_args(a)


def _hf_config(**rope) -> dict:
    cfg = json.loads((Path(__file__).parents[1] / "data" / "configs" / "deepseek-ai__DeepSeek-V3.json").read_text())
    cfg.pop("quantization_config")
    cfg["rope_scaling"] = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, **rope}
    return cfg


@pytest.mark.parametrize("rope,pair", [
    (dict(mscale=1.0, mscale_all_dim=1.0), (1.0, 1.0)),  # DeepSeek-V3's: both engines take the ratio
    (dict(mscale=0.707), (1.0, 0.0)),  # transformers ignores mscale without mscale_all_dim
    (dict(), (1.0, 0.0)),
])
def test_hf_mscale_pair_reads_as_transformers_computes_it(rope: dict, pair: tuple) -> None:
    spec = spec_from_hf_config(_hf_config(**rope))
    assert (spec.yarn_mscale, spec.yarn_mscale_all_dim) == pair


@pytest.mark.parametrize("rope,message", [
    (dict(truncate=False), "always rounds YaRN's correction range"),
    (dict(mscale_all_dim=-0.5), "a negative mscale_all_dim scales multi-latent attention's softmax"),
])
def test_hf_mla_yarn_megatron_cannot_compute_is_refused(rope: dict, message: str) -> None:
    with pytest.raises(MConvertError, match=message):
        spec_from_hf_config(_hf_config(**rope))


def test_deepseek_v3_671b_preset_is_the_published_config() -> None:
    """The plan preset is the model DeepSeek-V3's own config.json describes (its YaRN rope included)."""
    cfg = json.loads((Path(__file__).parents[1] / "data" / "configs" / "deepseek-ai__DeepSeek-V3.json").read_text())
    assert spec_from_hf_config(cfg).replace(bos_token_id=None, eos_token_id=None) == preset("deepseek-v3-671b")


def test_kimi_k2_reads_as_deepseek_v3_and_exports_a_config_transformers_builds() -> None:
    """Kimi K2's config (model_type kimi_k2, DeepseekV3ForCausalLM, auto_map to DeepSeek's modeling code; its YaRN
    with beta_fast 1) is the DeepSeek-V3 function: read as if its model_type were deepseek_v3, and exported under
    deepseek_v3, which transformers builds natively (no remote code) with the same rope."""
    from transformers import AutoConfig, DeepseekV3Config

    from mconvert.mappings.families import hf_config

    cfg = json.loads((Path(__file__).parents[1] / "data" / "configs" / "moonshotai__Kimi-K2.json").read_text())
    spec = spec_from_hf_config(cfg)
    assert spec == spec_from_hf_config({**cfg, "model_type": "deepseek_v3"})
    assert (spec.family, spec.yarn_beta_fast, spec.yarn_beta_slow, spec.rope_scaling_factor) == (
        "deepseek_v3", 1.0, 1.0, 32.0)
    out = hf_config(spec)
    assert (out["model_type"], out["architectures"], "auto_map" in out) == ("deepseek_v3", ["DeepseekV3ForCausalLM"],
                                                                           False)
    built = AutoConfig.for_model(**{k: v for k, v in out.items() if k != "model_type"}, model_type="deepseek_v3")
    assert isinstance(built, DeepseekV3Config)
    assert {k: built.rope_scaling[k] for k in ("factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")} == {
        k: float(cfg["rope_scaling"][k]) for k in ("factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")}
    from mconvert.spec import megatron_lm_unstated

    assert "beta_fast=1.0" in megatron_lm_unstated(spec)[0] and not megatron_lm_unstated(preset("deepseek-v3-671b"))
    with pytest.raises(MConvertError, match="model_type='kimi_k3' contradicts"):
        spec_from_hf_config({**cfg, "model_type": "kimi_k3"})


# moonshotai/Moonlight-16B-A3B's config.json as published (values as vendored in a public test's copy; the Hub
# file is not reachable from here): DeepSeek-V2-Lite's shape (MLA without a q latent, 64 experts, 2 shared) under
# DeepSeek-V3's class and sigmoid router, no rope scaling
MOONLIGHT = deepseek_lite_config(
    3, bos_token_id=163584, eos_token_id=163586, intermediate_size=11264, max_position_embeddings=8192,
    norm_topk_prob=True, num_nextn_predict_layers=0, rms_norm_eps=1e-05, rope_theta=50000.0,
    routed_scaling_factor=2.446, scoring_func="sigmoid", topk_method="noaux_tc", transformers_version="4.46.3",
    vocab_size=163840)


def test_moonlight_reads_as_mla_without_q_latent_and_plain_rope() -> None:
    from mconvert.mappings.families import hf_config

    spec = spec_from_hf_config(MOONLIGHT)
    assert (spec.q_lora_rank, spec.kv_lora_rank, spec.rope_scaling, spec.num_experts,
            spec.moe_shared_expert_intermediate_size, spec.moe_router_num_groups) == (None, 512, None, 64, 2816, None)
    assert spec_from_hf_config(hf_config(spec)) == spec


def test_deepseek_v2_classes_read_as_the_deepseek_v2_family() -> None:
    """DeepseekV2ForCausalLM routes with softmax scores, top-k not renormalised (megatron-core's pre-softmax
    router; tests/convert/hf/test_deepseek_v2_lite.py): Moonlight's fields under that class read as it, and its
    norm_topk_prob true, which transformers' DeepseekV2 ignores and vLLM's applies, is refused by name."""
    v2 = {**MOONLIGHT, "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
          "scoring_func": "softmax", "topk_method": "greedy"}
    with pytest.raises(MConvertError, match="norm_topk_prob=True"):
        spec_from_hf_config(v2)
    spec = spec_from_hf_config({**v2, "norm_topk_prob": False})
    assert (spec.family, spec.moe_router_score_function, spec.moe_router_pre_softmax,
            spec.moe_router_enable_expert_bias) == ("deepseek_v2", "softmax", True, False)


def test_hf_mla_yarn_of_factor_1_is_plain_rope() -> None:
    """Factor 1 stretches nothing and both engines then scale nothing: plain rope, as Megatron's args read back."""
    spec = spec_from_hf_config(_hf_config(factor=1.0, mscale=1.0, mscale_all_dim=1.0))
    assert spec.rope_scaling is None
    back = spec_from_megatron_args(vars(spec.to_megatron_args()))
    assert back == spec.replace(bos_token_id=None, eos_token_id=None)


def test_inspect_counts_mla_rope_args_as_read() -> None:
    from mconvert.convert.inspect import describe_megatron_args

    read = describe_megatron_args(_args())["read"]
    assert {"rope_type", "rotary_scaling_factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
            "mscale", "mscale_all_dim"} <= set(read)
