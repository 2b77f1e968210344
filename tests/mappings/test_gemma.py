"""Gemma 2 and Gemma 3, against code we did not write: transformers 4.57's `Gemma2ForCausalLM` and
`Gemma3ForCausalLM` (zero-centred sandwich RMSNorms, sqrt(hidden) embedding scale, GeGLU, query_pre_attn_scalar,
soft-capping, sliding and full layers with two rope bases).

- transformers' own random models (norms moved off their init) -> hf-to-megatron TP=2 PP=2 -> megatron-to-hf:
  every tensor byte-identical, config.json read back to the same model;
- the trainer's tiny-gemma3 / tiny-gemma2 checkpoints (TP=2 PP=2) -> megatron-to-hf: transformers' logits equal
  our native forward within 1e-4 of the largest logit on 40 tokens, past the 16-key window (so both the
  sliding and the full layers, and Gemma 3's two rope bases, are exercised);
- controls: the same export computed without the +1 of the norms, without the embedding scale, or without a
  post-norm differs from the native forward by far more than the tolerance.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

from mconvert.convert.verbs import hf_to_megatron, megatron_to_hf
from mconvert.errors import MConvertError
from mconvert.mappings.families import hf_config, preset, spec_from_hf_config, spec_from_megatron_args

REL_TOL = 1e-4
TOKENS = torch.randint(0, 1000, (2, 40), generator=torch.Generator().manual_seed(5))  # window: 16 keys
SMALL = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, vocab_size=1000, max_position_embeddings=128, sliding_window=16)
HF_MODELS = {
    # query_pre_attn_scalar 48 (not head_dim), linear rope scaling on the full layers, every 2nd layer full
    "gemma3": lambda: transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
        **SMALL, sliding_window_pattern=2, query_pre_attn_scalar=48, rope_scaling={"rope_type": "linear",
                                                                                  "factor": 2.0})),
    "gemma2": lambda: transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**SMALL, query_pre_attn_scalar=48)),
}


def _spread(model: torch.nn.Module) -> None:
    """Norm weights off their zero init, so a dropped or doubled +1 cannot hide."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gemma_hf")
    out = {}
    for name, build in HF_MODELS.items():
        torch.manual_seed(0)
        model = build().eval()
        _spread(model)
        model.save_pretrained(root / name)
        out[name] = root / name
    return out


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
@pytest.mark.parametrize("name", list(HF_MODELS))
def test_transformers_gemma_round_trips_byte_identical_at_tp2_pp2(hf_models, tmp_path, name, fmt) -> None:
    hf_to_megatron(hf_models[name], tmp_path / "mg", tp=2, pp=2, format=fmt)
    megatron_to_hf(tmp_path / "mg", tmp_path / "back")
    a = load_file(hf_models[name] / "model.safetensors")
    b = load_file(tmp_path / "back" / "model.safetensors")
    assert set(a) == set(b)
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]
    src = json.loads((hf_models[name] / "config.json").read_text())
    back = json.loads((tmp_path / "back" / "config.json").read_text())
    assert spec_from_hf_config(src) == spec_from_hf_config(back)
    for key in ("layer_types", "sliding_window", "query_pre_attn_scalar", "attn_logit_softcapping",
                "final_logit_softcapping", "rope_scaling", "rope_local_base_freq", "rope_theta"):
        assert back.get(key) == src.get(key), key


# ---- the trainer's checkpoints ----------------------------------------------------------------------------
@pytest.fixture(scope="session")
def trained(tmp_path_factory) -> dict[str, tuple[Path, Path, torch.Tensor]]:
    """preset -> (checkpoint at TP=2 PP=2, its HF export, our native forward's logits on TOKENS)."""
    import mconvert.trainer.train as train_mod
    from mconvert.trainer.infer import megatron_logits

    root = tmp_path_factory.mktemp("gemma_trained")
    out = {}
    for name in ("tiny-gemma3", "tiny-gemma2"):
        cfg = train_mod.TrainConfig(preset=name, tp=2, pp=2, steps=2, save=str(root / name), force=True,
                                    micro_batch_size=2, global_batch_size=4, seq_length=48, quiet=True, seed=7,
                                    device="cpu")
        train_mod.train(cfg)
        megatron_to_hf(root / name, root / f"{name}-hf")
        out[name] = (root / name, root / f"{name}-hf", megatron_logits(root / name, TOKENS))
    return out


def _hf_logits(hf_dir: Path, change=None) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    if change is not None:
        change(model)
    with torch.no_grad():
        return model(TOKENS).logits.float()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny-gemma3", "tiny-gemma2"])
def test_trainer_gemma_exports_match_the_native_forward_past_the_window(trained, name) -> None:
    _, hf_dir, native = trained[name]
    spec = preset(name)
    assert TOKENS.shape[1] > spec.window_size + 1 and spec.windowed_layers != list(range(spec.num_layers))
    got = _hf_logits(hf_dir)
    rel = _rel(got, native)
    print(f"[figures] {name}: transformers vs native, max|Δ|/max|logit| {rel:.2e}")
    assert rel <= REL_TOL and torch.equal(got.argmax(-1), native.argmax(-1))


@pytest.mark.slow
def test_reshard_with_optimizer_keeps_the_function(trained, tmp_path) -> None:
    from mconvert.convert.verbs import reshard
    from mconvert.trainer.infer import megatron_logits

    ckpt, _, native = trained["tiny-gemma3"]
    reshard(ckpt, tmp_path / "tp1", tp=1, pp=1, with_optimizer=True)
    reshard(tmp_path / "tp1", tmp_path / "tp2", tp=2, pp=1, with_optimizer=True)
    rel = _rel(megatron_logits(tmp_path / "tp2", TOKENS), native)
    print(f"[figures] tiny-gemma3 TP2 PP2 -> TP1 -> TP2 PP1 with optimizer: max|Δ|/max|logit| {rel:.2e}")
    assert rel <= REL_TOL


def _minus_one_on_norms(model) -> None:
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.sub_(1.0)  # transformers then scales by w: a converter that dropped the +1


def _unscaled_embedding(model) -> None:
    model.model.embed_tokens.embed_scale = torch.tensor(1.0) if hasattr(model.model.embed_tokens, "embed_scale") \
        else None
    if not hasattr(model.model.embed_tokens, "embed_scale") or model.model.embed_tokens.embed_scale is None:
        forward = model.model.embed_tokens.forward  # Gemma 2 scales inside the model: undo it on the way in
        model.model.embed_tokens.forward = lambda ids: forward(ids) / model.config.hidden_size ** 0.5


def _no_post_mlp_norm(model) -> None:
    for layer in model.model.layers:
        layer.post_feedforward_layernorm = torch.nn.Identity()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny-gemma3", "tiny-gemma2"])
@pytest.mark.parametrize("control", [_minus_one_on_norms, _unscaled_embedding, _no_post_mlp_norm],
                         ids=["no +1", "no embedding scale", "no post-norm"])
def test_controls_without_a_gemma_feature_fail_loudly(trained, name, control) -> None:
    _, hf_dir, native = trained[name]
    rel = _rel(_hf_logits(hf_dir, control), native)
    print(f"[figures] {name} control {control.__name__}: max|Δ|/max|logit| {rel:.2e}")
    assert rel > 100 * REL_TOL


# ---- config facts -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["tiny-gemma3", "tiny-gemma2"])
def test_presets_round_trip_through_hf_config_and_megatron_args(name) -> None:
    spec = preset(name)
    assert spec_from_hf_config(hf_config(spec)) == spec
    assert spec_from_megatron_args(spec.to_megatron_args(tp=2, pp=2)) == spec  # recognised without model_family


def test_gemma_block_on_a_target_without_it_is_refused_by_name() -> None:
    for target in ("FasterTransformer", "TensorRT-LLM"):
        with pytest.raises(MConvertError, match="Gemma block"):
            preset("tiny-gemma2").replace(window_size=None).refuse_unmapped(target)
    with pytest.raises(MConvertError, match="zero-centred RMSNorm"):
        hf_config(preset("tiny-gemma3").replace(norm_zero_centered=False))


def test_bridge_key_spellings_are_the_canonical_names() -> None:
    names = {d.name for d in preset("tiny-gemma3").layer_params(0)}
    for key in ("self_attention.linear_proj.post_layernorm.weight", "mlp.linear_fc2.post_layernorm.weight",
                "self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"):
        assert "decoder.layers.0." + key in names


def test_validate_runs_a_soft_capped_reference_in_transformers_eager_path(hf_models, tmp_path, capsys) -> None:
    """transformers' SDPA path drops Gemma 2's attention-logit soft-capping; `validate` (and verify's and vLLM's
    transformers reference) run such a model eagerly. With attention logits far past the cap, the native forward
    and the eager reference agree and `validate` passes; the same reference in SDPA differs by far more than the
    tolerance (so the check can fail)."""
    from safety_common import run_cli

    from mconvert.trainer.infer import megatron_logits
    from mconvert.validators.runners import hf_logits

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_models["gemma2"], torch_dtype=torch.float32)
    with torch.no_grad():  # q scaled up: attention logits reach well past attn_logit_softcapping (50)
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(40)
    model.save_pretrained(tmp_path / "hf")
    hf_to_megatron(tmp_path / "hf", tmp_path / "mg", tp=2)
    native = megatron_logits(tmp_path / "mg", TOKENS)
    eager, _, _ = hf_logits(tmp_path / "hf", TOKENS, "cpu")
    sdpa = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", torch_dtype=torch.float32,
                                                             attn_implementation="sdpa").eval()
    with torch.no_grad():
        dropped = sdpa(TOKENS).logits.float()
    print(f"[figures] gemma2 capped: eager vs native {_rel(eager.float(), native):.2e}, "
          f"sdpa vs native {_rel(dropped, native):.2e}")
    assert _rel(eager.float(), native) <= REL_TOL < _rel(dropped, native) / 10
    code, out, err = run_cli(["validate", tmp_path / "mg", tmp_path / "hf", "--device", "cpu"], capsys)
    assert code == 0 and "PASS" in out + err, err
