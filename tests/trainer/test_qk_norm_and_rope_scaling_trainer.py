"""Qwen3-style qk-norm and Llama-3.x rope scaling in the trainer, against megatron-core 0.16.1 (truth we did not
write): its own `GPTModel` (local spec, `qk_layernorm=True`, `rope_scaling=True` / `seq_len_interpolation_factor`)
loads our trainer's TP=2 checkpoint strict and its logits equal our native runner's (the one `validate` uses);
the same weights with the scaling switched off give measurably different logits at the probed positions; our
TP=2 PP=2 run equals TP=1 (init logits and one step's gradients, the TP-summed q/k-norm grads included).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import test_trainer_parallel as parallel_tests
import torch

from mconvert.layouts.megatron import rank_file
from mconvert.io.safeload import safe_load
from mconvert.errors import MConvertError
from mconvert.mappings.transforms import merge
from mconvert.mappings.families import hf_config, preset, spec_from_megatron_args
from mconvert.spec import ModelSpec
from mconvert.trainer.infer import megatron_logits
from mconvert.trainer.model import GPTModel
from mconvert.trainer.parallel import ParallelState
from mconvert.trainer.train import TrainConfig, build_spec, launch, prepare_tokens

pytestmark = pytest.mark.slow
TOL = 1e-5
PROBE = torch.randint(0, 1000, (2, 96), generator=torch.Generator().manual_seed(5))  # positions 0..95 < 128


def _cfg(**kw) -> TrainConfig:
    # lr 1e-2: two Adam steps move every norm weight ~0.02 off 1, so a misplaced q/k norm shows in the logits
    base = dict(seq_length=32, micro_batch_size=2, global_batch_size=4, lr=1e-2, seed=7, quiet=True)
    base.update(kw)
    return TrainConfig(**base)


@pytest.fixture(scope="module")
def trained(trained_checkpoint) -> dict[str, tuple[Path, ModelSpec]]:
    """`mconvert train --preset P --tp 2 --steps 2` for both presets (one shared run each)."""
    out = {}
    for name in ("tiny-qwen3", "tiny-llama3"):
        cfg = vars(_cfg(preset=name, tp=2, pp=1, steps=2))
        ckpt = trained_checkpoint(**{k: v for k, v in cfg.items() if k != "save"})
        out[name] = (ckpt, spec_from_megatron_args(safe_load(rank_file(ckpt, 2, 0, 0, 1))["args"]))
    return out


def _shards(ckpt: Path, tp: int) -> list[dict]:
    return [safe_load(rank_file(ckpt, 2, t, 0, 1))["model"] for t in range(tp)]


def _mcore(spec: ModelSpec, sds: list[dict]) -> torch.Tensor:
    from mcore_ref import mcore_forward_logits

    return mcore_forward_logits(spec, 2, PROBE, sds)[..., : spec.vocab_size]


@pytest.mark.timeout(120)
def test_qwen3_checkpoint_loads_strict_into_mcore_qk_layernorm_and_logits_match(trained) -> None:
    ckpt, spec = trained["tiny-qwen3"]
    assert spec == preset("tiny-qwen3").replace(vocab_size=spec.vocab_size)
    assert spec.qk_layernorm and spec.head_dim == 32 != spec.hidden_size // spec.num_attention_heads
    sds = _shards(ckpt, 2)
    qn = sds[0]["decoder.layers.1.self_attention.q_layernorm.weight"]
    assert qn.shape == (32,) and (qn - 1).abs().max() > 1e-3  # trained off its init
    for key in ("q_layernorm.weight", "k_layernorm.weight"):  # replicated: every TP rank holds the same values
        k = f"decoder.layers.0.self_attention.{key}"
        assert torch.equal(sds[0][k], sds[1][k])
    ref = _mcore(spec, sds)
    ours = megatron_logits(ckpt, PROBE)
    diff = (ours - ref).abs().max().item()
    print(f"[figures] tiny-qwen3 TP=2 vs megatron-core qk_layernorm: logits max|Δ| {diff:.2e}")
    assert diff <= TOL
    # control: the trained norm weights reset to 1 change megatron-core's logits (the norms are applied)
    reset = [{k: torch.ones_like(v) if "q_layernorm" in k or "k_layernorm" in k else v for k, v in sd.items()}
             for sd in sds]
    off = (_mcore(spec, reset) - ref).abs().max().item()
    print(f"[figures] tiny-qwen3: q/k norm weights reset to 1: max|Δ| {off:.2e}")
    assert off > 100 * TOL


@pytest.mark.timeout(120)
def test_llama3_rope_scaling_matches_mcore_and_matters(trained) -> None:
    ckpt, spec = trained["tiny-llama3"]
    assert (spec.rope_scaling, spec.rope_scaling_factor, spec.rope_original_max_position_embeddings) == (
        "llama3", 8.0, 8192)
    args = safe_load(rank_file(ckpt, 2, 0, 0, 1))["args"]
    assert args.use_rope_scaling is True and args.rope_scaling_factor == 8.0  # megatron-core's own arg names
    sds = _shards(ckpt, 2)
    ref = _mcore(spec, sds)
    ours = megatron_logits(ckpt, PROBE)
    diff = (ours - ref).abs().max().item()
    unscaled = _mcore(spec.replace(rope_scaling=None), sds)
    off = (unscaled - ref).abs().max().item()
    print(f"[figures] tiny-llama3 TP=2 vs megatron-core rope_scaling: logits max|Δ| {diff:.2e}; "
          f"scaling off: max|Δ| {off:.2e}")
    assert diff <= TOL
    assert off > 100 * TOL  # the scaling changes these positions: a run that ignored it would fail above


def _perturbed_tp1(spec: ModelSpec) -> dict:
    """Our TP=1 model's state dict with every parameter moved off its init (norms off 1, biases off 0)."""
    model = GPTModel(spec, ParallelState(), seed=3)
    g = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.2 * noise if name.endswith("layernorm.weight") else 0.05 * noise)
    return model.state_dict()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("variant", ["linear", "layernorm-qk"])
def test_linear_interpolation_and_layernorm_qk_norm_match_mcore(variant: str) -> None:
    """Linear position interpolation (`rotary_seq_len_interpolation_factor`) and LayerNorm q/k norms (with a
    bias) at TP=1: our forward equals megatron-core's on the same perturbed weights, and the feature matters."""
    from mcore_ref import mcore_forward_logits

    if variant == "linear":
        spec = preset("tiny-llama3").replace(rope_scaling="linear", rope_scaling_factor=4.0)
        assert spec.to_megatron_args().rotary_seq_len_interpolation_factor == 4.0
        off_spec = spec.replace(rope_scaling=None)
    else:
        spec = preset("tiny-gpt2").replace(qk_layernorm=True)
        assert "decoder.layers.0.self_attention.q_layernorm.bias" in {d.name for d in spec.layer_params(0)}
        off_spec = None
    sd = _perturbed_tp1(spec)
    model = GPTModel(spec, ParallelState(), seed=None)
    model.load_state_dict(sd, strict=True)
    with torch.no_grad():
        ours = model(PROBE)[..., : spec.vocab_size]
    ref = mcore_forward_logits(spec, 1, PROBE, [sd])[..., : spec.vocab_size]
    diff = (ours - ref).abs().max().item()
    print(f"[figures] {variant} TP=1 vs megatron-core: logits max|Δ| {diff:.2e}")
    assert diff <= TOL
    if off_spec is not None:
        off = (mcore_forward_logits(off_spec, 1, PROBE, [sd])[..., : spec.vocab_size] - ref).abs().max().item()
        print(f"[figures] {variant}: scaling off max|Δ| {off:.2e}")
        assert off > 1e3 * TOL


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name,sp", [("tiny-qwen3", False), ("tiny-llama3", False), ("tiny-qwen3", True)],
                         ids=["tiny-qwen3", "tiny-llama3", "tiny-qwen3-sp"])
def test_tp2_pp2_equals_tp1_logits_and_grads(tmp_path: Path, name: str, sp: bool) -> None:
    """The sharded init's logits and one step's synced gradients equal the TP=1 PP=1 model's; the q/k-norm
    grads, partial per TP rank, are summed over TP (once, also under sequence parallelism) so both ranks hold
    the full gradient."""
    cfg = parallel_tests._cfg(preset=name, tp=2, pp=2, dp=1, steps=1, save=str(tmp_path / "ckpt"),
                              sequence_parallel=sp)
    tokens, vocab = prepare_tokens(None, write=False)
    spec = build_spec(cfg, vocab)
    launch(parallel_tests._probe_then_train, (cfg, spec, tokens, str(tmp_path)), cfg.world)
    with torch.serialization.safe_globals([range]):  # the probes (written just above) hold each stage's layers
        probes = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(cfg.world)]
    ref_logits, ref_grads = parallel_tests._reference(spec, cfg, tokens)
    logits = next(p["logits"] for p in probes if p["logits"] is not None)
    logit_diff = (logits - ref_logits).abs().max().item()
    assert logit_diff <= TOL
    shards: dict[str, dict[int, torch.Tensor]] = {}
    for p in probes:
        for key, g in p["grads"].items():
            gname = parallel_tests._global_name(key, p["layers"])
            if key == "output_layer.weight" and spec.tie_embeddings:
                gname = "embedding.word_embeddings.weight#copy"  # the last stage's synced copy
            shards.setdefault(gname, {})[p["tp"]] = g
    assert {k.split("#")[0] for k in shards} == set(ref_grads)
    worst = 0.0
    for k, by_tp in shards.items():
        gname = k.split("#")[0]
        if spec.split_kind(gname) == "replicated":
            assert torch.allclose(by_tp[0], by_tp[1], atol=TOL, rtol=0), gname
        full = merge([by_tp[t] for t in range(cfg.tp)], spec.split_kind(gname), gname)
        worst = max(worst, (full - ref_grads[gname]).abs().max().item())
    assert worst <= TOL, worst
    norms = [k for k in shards if "q_layernorm" in k or "k_layernorm" in k]
    assert bool(norms) == spec.qk_layernorm
    print(f"[figures] {name}{' SP' if sp else ''} TP=2 PP=2 vs TP=1: logits max|Δ| {logit_diff:.2e}, grads max|Δ| {worst:.2e}")


def test_rope_scaling_and_qk_fields_validate_and_round_trip_megatron_args() -> None:
    base = preset("tiny-llama")
    for bad, match in [
        (dict(rope_scaling="dynamic"), "unsupported rope_scaling 'dynamic'"),
        (dict(rope_scaling="llama3", rope_scaling_factor=float("nan")), "rope_scaling_factor must be a finite"),
        (dict(rope_scaling="linear", rope_scaling_factor=0.5), "rope_scaling_factor must be >= 1"),
        (dict(rope_scaling="llama3", rope_scaling_factor=8.0, rope_low_freq_factor=4.0), "must exceed"),
    ]:
        with pytest.raises(MConvertError, match=match):
            base.replace(**bad)
    # megatron-core hard-codes the llama3 bands: other bands cannot be written as Megatron args
    odd = base.replace(rope_scaling="llama3", rope_scaling_factor=8.0, rope_original_max_position_embeddings=32)
    with pytest.raises(MConvertError, match="megatron-core's Llama-3 rope scaling fixes"):
        odd.to_megatron_args()
    # a model without them writes none of the new args and compares equal to the old spec
    assert not {"qk_layernorm", "use_rope_scaling", "rotary_seq_len_interpolation_factor"} & set(
        vars(base.to_megatron_args()))
    # both scalings at once is refused by name
    args = base.to_megatron_args()
    args.use_rope_scaling, args.rotary_seq_len_interpolation_factor = True, 2
    with pytest.raises(MConvertError, match="use_rope_scaling=True together with rotary_seq_len"):
        spec_from_megatron_args(args, source="x/model_optim_rng.pt")
    # Megatron-LM's own defaults: --use-rope-scaling alone means factor 8
    args = base.to_megatron_args()
    args.use_rope_scaling = True
    assert spec_from_megatron_args(args).rope_scaling_factor == 8.0
    # HF states both (Qwen3's q_norm / k_norm, Llama's rope_scaling); a family whose HF class has no q/k norm
    # refuses it by name, and FasterTransformer refuses both
    assert hf_config(preset("tiny-qwen3"))["architectures"] == ["Qwen3ForCausalLM"]
    assert hf_config(preset("tiny-llama3"))["rope_scaling"]["rope_type"] == "llama3"
    with pytest.raises(MConvertError, match="LlamaForCausalLM has no per-head q/k norm .*qk_layernorm=True"):
        hf_config(preset("tiny-llama").replace(qk_layernorm=True))
    with pytest.raises(MConvertError, match="qk_layernorm=True .* not mapped to FasterTransformer"):
        preset("tiny-qwen3").refuse_unmapped("FasterTransformer")
    with pytest.raises(MConvertError, match=r"rope_scaling='llama3'.*use_rope_scaling=True.*not mapped to Faster"):
        preset("tiny-llama3").refuse_unmapped("FasterTransformer")
