"""The DeepSeek-V3 architecture in the trainer, against megatron-core 0.16.1's own GPTModel.

megatron-core (local spec on CPU over gloo: MLA with its latent norms, DeepSeek MoE with the sigmoid router,
expert bias, group-limited top-k, routed scale and shared experts, a dense first layer by moe_layer_freq, and one
MTP layer) strict-loads each rank file our trainer writes and its logits — the main head's and the MTP layer's —
equal ours on the same weights. The weights are moved off their init first (norms off 1, a large expert bias),
so that a wrong layout, a dropped bias or a wrong rope order cannot hide; the controls show each of those would
be seen.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from deepseek_ref import (PROBE, TOL, hf_mtp_logits, mcore_rank_logits, merged_ranks, moved_off_init, rel_diff,
                          save_single_rank)

from mconvert.io.safeload import safe_load
from mconvert.layouts.megatron import rank_file
from mconvert.errors import MConvertError
from mconvert.mappings.families import preset, spec_from_megatron_args
from mconvert.mappings.transforms import shard
from mconvert.spec import ModelSpec
from mconvert.trainer import mla
from mconvert.trainer.model import GPTModel
from mconvert.trainer.parallel import ParallelState
from mconvert.trainer.train import TrainConfig, train

pytestmark = pytest.mark.slow
def _ours(spec: ModelSpec, state: dict, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    model = GPTModel(spec, ParallelState(), seed=None).eval()
    res = model.load_state_dict(state, strict=False)
    assert not res.unexpected_keys and all(k.endswith("._extra_state") for k in res.missing_keys), res
    with torch.no_grad():
        logits = model(tokens)
    return logits, model.mtp_logits[0]


_RUNS: dict[tuple[int, int], dict] = {}


def _run(tp: int, ep: int, trained_checkpoint) -> dict:
    """Our trainer's checkpoint of tiny-deepseek-v3 (2 steps, the same 8 sequences a step at every layout; the
    session's `trained_checkpoint`): the rank files by (tp_rank, ep_rank), the losses and the directory."""
    if (tp, ep) not in _RUNS:
        ckpt = trained_checkpoint(preset="tiny-deepseek-v3", tp=tp, pp=1, dp=ep, ep=ep, steps=2, seq_length=32,
                                  micro_batch_size=2, global_batch_size=8, lr=1e-2, seed=42, moe_aux_loss_coeff=0.0)
        _RUNS[(tp, ep)] = {(t, e): safe_load(rank_file(ckpt, 2, t, 0, 1, e, ep)) for t in range(tp) for e in range(ep)}
        _RUNS[(tp, ep)]["losses"] = trained_checkpoint.losses[ckpt]
        _RUNS[(tp, ep)]["dir"] = ckpt
    return _RUNS[(tp, ep)]


@pytest.fixture(scope="module", params=[dict(tp=1, ep=1), dict(tp=2, ep=2)], ids=["tp1", "tp2ep2"])
def trained(request, trained_checkpoint):
    """A trainer checkpoint at the layout, its rank files moved off init."""
    tp, ep = request.param["tp"], request.param["ep"]
    states = {k: v for k, v in _run(tp, ep, trained_checkpoint).items() if isinstance(k, tuple)}
    spec = spec_from_megatron_args(states[(0, 0)]["args"])
    files = {k: moved_off_init(v["model"], *k) for k, v in states.items()}
    return spec, tp, ep, states, files


def test_tp2_ep2_run_equals_the_single_rank_run(trained_checkpoint) -> None:
    """Two steps at TP=2 EP=2 (DP=2) give the single-rank run's losses (the main and MTP losses' gradients, the
    router's included, summed right over the ranks) and the same expert biases (the loads behind each bias step
    summed over the TP and DP ranks)."""
    spec = preset("tiny-deepseek-v3")
    single, sharded = _run(1, 1, trained_checkpoint), _run(2, 2, trained_checkpoint)
    one = single[(0, 0)]["model"]
    many = merged_ranks(spec, {k: v["model"] for k, v in sharded.items() if isinstance(k, tuple)}, 2)
    for k, v in one.items():
        if k.endswith("expert_bias"):
            assert torch.equal(many[k], v) and v.abs().max() > 0, k
    losses = max(abs(a - b) for a, b in zip(single["losses"], sharded["losses"], strict=True))
    assert losses <= 1e-4, (single["losses"], sharded["losses"])
    print(f"[figures] tiny-deepseek-v3 TP=2 EP=2 vs TP=1, 2 steps: losses max|Δ| {losses:.1e}, expert biases equal")


def test_args_say_deepseek_v3(trained) -> None:
    spec, tp, ep, states, _ = trained
    assert spec == preset("tiny-deepseek-v3")  # the preset, read back from the args the trainer wrote
    bias = [v for k, v in states[(0, 0)]["model"].items() if k.endswith("expert_bias")]
    assert len(bias) == 3 and all(b.dtype == torch.float32 and b.abs().max() > 0 for b in bias)  # 2 MoE + MTP
    assert (states[(0, 0)]["args"].moe_router_bias_update_rate, states[(0, 0)]["args"].moe_router_score_function) == (
        1e-3, "sigmoid")


def test_megatron_core_strict_loads_and_matches_main_and_mtp_logits(trained) -> None:
    from mcore_ref import run_mcore

    spec, tp, ep, _, files = trained
    ref_main, ref_mtp = run_mcore(spec, tp, mcore_rank_logits, (files, PROBE, False), ep=ep)[0]
    main, mtp = _ours(spec, merged_ranks(spec, files, tp), PROBE)
    d_main, d_mtp = rel_diff(main, ref_main), rel_diff(mtp, ref_mtp)
    assert d_main <= TOL and d_mtp <= TOL, (d_main, d_mtp)
    # controls: the expert bias, megatron-core's rope order and the MTP layer are all seen
    nobias = run_mcore(spec, tp, mcore_rank_logits, (files, PROBE, True), ep=ep)[0][0]
    d_bias = rel_diff(nobias, ref_main)
    assert d_bias > 100 * TOL, d_bias
    keep = mla.deinterleave
    mla.deinterleave = lambda t: t  # HF rope_interleave false: rotate without megatron-core's de-interleave
    try:
        d_rope = rel_diff(_ours(spec, merged_ranks(spec, files, tp), PROBE)[0], ref_main)
    finally:
        mla.deinterleave = keep
    assert d_rope > 100 * TOL, d_rope
    print(f"[figures] tiny-deepseek-v3 TP={tp} EP={ep}: megatron-core vs ours max|Δ|/max|logit| main {d_main:.1e}, "
          f"MTP {d_mtp:.1e}; controls: expert bias zeroed {d_bias:.1e}, rope not de-interleaved {d_rope:.1e}")


def test_a_checkpoint_without_its_mtp_layer_does_not_load(trained) -> None:
    spec, _, _, _, files = trained
    without = {k: v for k, v in merged_ranks(spec, files, trained[1]).items() if not k.startswith("mtp.")}
    with pytest.raises(RuntimeError, match="mtp.layers.0"):
        GPTModel(spec, ParallelState(), seed=None).load_state_dict(without, strict=True)


@pytest.mark.parametrize("kw,message", [
    (dict(kv_lora_rank=32, qk_rope_head_dim=7), "qk_rope_head_dim must be even"),
    (dict(kv_lora_rank=32, rotary_interleaved=True), "de-interleaves"),
    (dict(num_experts=8, moe_router_num_groups=3, moe_router_group_topk=1), "must divide num_experts"),
    (dict(num_experts=8, moe_router_num_groups=4), "go together"),
    (dict(num_experts=8, moe_layer_freq=(1, 0)), "one 0/1 per layer"),
    (dict(num_experts=8, moe_router_score_function="relu"), "moe_router_score_function"),
    (dict(kv_lora_rank=32, window_size=15), r"sliding-window attention\) with multi-latent attention or MTP"),
    (dict(mtp_num_layers=1, window_size=15), r"sliding-window attention\) with multi-latent attention or MTP"),
    (dict(kv_lora_rank=32, rope_scaling="llama3", rope_scaling_factor=4.0), "multi-latent attention rotates"),
    (dict(kv_lora_rank=32, rope_scaling="yarn", rope_scaling_factor=4.0, yarn_correction_range_round_to_int=False),
     "MLA always rounds"),
])
def test_bad_deepseek_fields_are_refused_by_name(kw: dict, message: str) -> None:
    with pytest.raises(MConvertError, match=message):
        preset("tiny-llama").replace(num_layers=3, **kw)


def test_yarn_tables_equal_megatron_core(monkeypatch) -> None:
    """MLA's YaRN (frequencies, cos/sin factor, softmax scale) equals megatron-core's YarnRotaryEmbedding and
    MultiLatentAttention's softmax scale."""
    from megatron.core.models.common.embeddings import yarn_rotary_pos_embedding as yarn

    monkeypatch.setattr(torch.cuda, "current_device", lambda: torch.device("cpu"))
    spec = preset("tiny-deepseek-v3-yarn").replace(rope_scaling_factor=40.0, yarn_mscale=0.9, yarn_mscale_all_dim=0.7)
    dim, base = spec.qk_rope_head_dim, spec.rotary_base
    ref = yarn.YarnRotaryEmbedding(dim, rotary_base=base, scaling_factor=40.0, original_max_position_embeddings=32,
                                   beta_fast=32, beta_slow=1, mscale=0.9, mscale_all_dim=0.7,
                                   use_cpu_initialization=True)
    emb, conc = ref.get_emb(64)
    cos, sin = mla.rope_tables(spec, 64, torch.device("cpu"))
    assert torch.allclose(cos, emb[:, 0, 0].cos() * conc) and torch.allclose(sin, emb[:, 0, 0].sin() * conc)
    want = yarn._yarn_get_mscale(40.0, 0.7) ** 2 / (spec.qk_nope_head_dim + spec.qk_rope_head_dim) ** 0.5
    assert mla.softmax_scale(spec) == pytest.approx(want, rel=1e-12)


def _split_for(spec: ModelSpec, state: dict, tp: int, ep: int) -> dict:
    """A TP=1 EP=1 state dict cut into megatron-core's (tp_rank, ep_rank) state dicts (local expert indices)."""
    out = {}
    per = spec.num_experts // ep  # type: ignore[operator]
    for t in range(tp):
        for e in range(ep):
            sd = {}
            for k, v in state.items():
                parts = k.split(".")
                if "local_experts" in parts:
                    i = parts.index("local_experts") + 1
                    if int(parts[i]) // per != e:
                        continue
                    parts[i] = str(int(parts[i]) % per)
                sd[".".join(parts)] = shard(v, spec.split_kind(k), tp, t, k) if torch.is_tensor(v) else v
            out[(t, e)] = sd
    return out


NO_Q_LORA = preset("tiny-deepseek-v3").replace(q_lora_rank=None)  # DeepSeek-V2-Lite / Moonlight style


def test_without_q_lora_megatron_core_matches_at_tp2() -> None:
    """`linear_q_proj` (no q latent) splits by head like megatron-core's at TP=2."""
    from mcore_ref import run_mcore

    spec = NO_Q_LORA
    model = GPTModel(spec, ParallelState(), seed=11).eval()
    state = moved_off_init(model.state_dict(), 0, 0)
    ref_main, ref_mtp = run_mcore(spec, 2, mcore_rank_logits, (_split_for(spec, state, 2, 1), PROBE, False))[0]
    main, mtp = _ours(spec, state, PROBE)
    d_main, d_mtp = rel_diff(main, ref_main), rel_diff(mtp, ref_mtp)
    assert d_main <= TOL and d_mtp <= TOL, (d_main, d_mtp)
    print(f"[figures] tiny-deepseek-v3 without q LoRA, TP=2: megatron-core vs ours main {d_main:.1e}, MTP {d_mtp:.1e}")


@pytest.mark.parametrize("q_lora", [True, False], ids=["q-lora", "no-q-lora"])
def test_hf_logits_match_ours(tmp_path: Path, q_lora: bool) -> None:
    """megatron-to-hf writes a DeepseekV3ForCausalLM whose transformers logits equal ours. transformers (as
    DeepSeek's reference code) masks the experts of unchosen groups with score 0 where megatron-core masks them
    with -inf: the two agree while every biased score (sigmoid + expert bias) is positive, as here."""
    from transformers import AutoModelForCausalLM

    from mconvert.convert.verbs import megatron_to_hf

    spec = preset("tiny-deepseek-v3") if q_lora else NO_Q_LORA
    model = GPTModel(spec, ParallelState(), seed=5).eval()
    state = moved_off_init(model.state_dict(), 0, 0)
    model.load_state_dict(state)
    megatron_to_hf(save_single_rank(spec, state, tmp_path / "m"), tmp_path / "hf")
    cfg = __import__("json").loads((tmp_path / "hf" / "config.json").read_text())
    assert (cfg["scoring_func"], cfg["topk_method"], cfg["first_k_dense_replace"]) == ("sigmoid", "noaux_tc", 1)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert type(hf).__name__ == "DeepseekV3ForCausalLM"
    with torch.no_grad():
        diff = rel_diff(hf(PROBE).logits, model(PROBE)[..., : spec.vocab_size])
    assert diff <= TOL, diff
    print(f"[figures] tiny-deepseek-v3 ({'q LoRA' if q_lora else 'no q LoRA'}, no MTP) -> HF: transformers vs ours "
          f"{diff:.1e}")


# DeepSeek-V3's model.layers.61 (its one MTP layer) beyond a decoder layer's names, as its published
# model.safetensors.index.json lists them
DEEPSEEK_MTP_NAMES = {"embed_tokens.weight", "enorm.weight", "hnorm.weight", "eh_proj.weight",
                      "shared_head.norm.weight", "shared_head.head.weight"}


def test_mtp_lands_at_deepseeks_names(tmp_path: Path) -> None:
    """The MTP layer is model.layers.{num_hidden_layers}: a MoE decoder layer's tensors, DeepSeek's MTP names,
    and copies of the embedding and head equal to the main ones; num_nextn_predict_layers says it."""
    from safetensors.torch import load_file

    from mconvert.convert.verbs import megatron_to_hf

    spec = preset("tiny-deepseek-v3")
    state = moved_off_init(GPTModel(spec, ParallelState(), seed=5).state_dict(), 0, 0)
    report = megatron_to_hf(save_single_rank(spec, state, tmp_path / "m"), tmp_path / "hf")
    cfg = __import__("json").loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["num_nextn_predict_layers"] == 1
    sd = load_file(str(tmp_path / "hf" / "model.safetensors"))
    mtp = {k[len("model.layers.3."):] for k in sd if k.startswith("model.layers.3.")}
    layer = {k[len("model.layers.2."):] for k in sd if k.startswith("model.layers.2.")}
    assert mtp == layer | DEEPSEEK_MTP_NAMES, mtp ^ (layer | DEEPSEEK_MTP_NAMES)
    assert torch.equal(sd["model.layers.3.embed_tokens.weight"], sd["model.embed_tokens.weight"])
    assert torch.equal(sd["model.layers.3.shared_head.head.weight"], sd["lm_head.weight"])
    assert torch.equal(sd["model.layers.3.eh_proj.weight"], state["mtp.layers.0.eh_proj.weight"])
    assert torch.equal(sd["model.layers.3.shared_head.norm.weight"], state["mtp.layers.0.final_layernorm.weight"])
    n_in = sum(torch.is_tensor(v) for v in state.values())
    assert report["tensors"]["in"] == n_in and report["tensors"]["out"] == len(sd), report["tensors"]
    assert report["tensors"]["out_bytes"] == sum(t.numel() * t.element_size() for t in sd.values())


def test_a_checkpoint_without_its_mtp_layer_is_refused_both_ways_and_by_dry_run(tmp_path: Path) -> None:
    """Controls: a Megatron checkpoint whose args say mtp_num_layers=1 but lacks the layer's tensors, and an HF
    directory whose config says num_nextn_predict_layers=1 but lacks model.layers.3, are refused naming the
    tensor, with no output; verify fails such an HF directory; an MTP copy of the embedding that differs from the
    main one is refused by name."""
    from safetensors.torch import load_file, save_file

    from mconvert.convert.verbs import hf_to_megatron, megatron_to_hf
    from mconvert.validators.verify import verify

    spec = preset("tiny-deepseek-v3")
    state = moved_off_init(GPTModel(spec, ParallelState(), seed=5).state_dict(), 0, 0)
    without = {k: v for k, v in state.items() if not k.startswith("mtp.")}
    with pytest.raises(MConvertError, match=r"mtp\.layers\.0\."):
        megatron_to_hf(save_single_rank(spec, without, tmp_path / "m"), tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
    megatron_to_hf(save_single_rank(spec, state, tmp_path / "m2"), tmp_path / "hf")
    strict = [c for c in verify(tmp_path / "hf").checks if c.name == "weights-strict"]
    assert [c.status for c in strict] == ["ok"], strict  # the tokenizer checks fail: this export has none
    sd = load_file(str(tmp_path / "hf" / "model.safetensors"))
    for name, drop in (("cut", lambda k: k.startswith("model.layers.3.")), ("no-enorm", lambda k: k.endswith("3.enorm.weight"))):
        cut = tmp_path / name
        cut.mkdir()
        (cut / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
        save_file({k: v for k, v in sd.items() if not drop(k)}, str(cut / "model.safetensors"))
        for dry_run in (True, False):  # the dry run refuses what the conversion would
            with pytest.raises(MConvertError, match=r"model\.layers\.3\..* is missing \(needed for mtp\.layers\.0\."):
                hf_to_megatron(cut, tmp_path / f"{name}-m", dry_run=dry_run)
        assert not (tmp_path / f"{name}-m").exists()
        strict = [c for c in verify(cut).checks if c.name == "weights-strict"]
        assert strict[0].status == "error" and "missing" in strict[0].message, strict
        assert "model.layers.3." in strict[0].message, strict
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
    changed = dict(sd)
    changed["model.layers.3.embed_tokens.weight"] = sd["model.embed_tokens.weight"] + 1
    save_file(changed, str(other / "model.safetensors"))
    with pytest.raises(MConvertError, match="model.layers.3.embed_tokens.weight' differs from 'model.embed_tokens"):
        hf_to_megatron(other, tmp_path / "other-m")


def test_newer_megatron_lms_mtp_model_layer_reads_as_transformer_layer() -> None:
    from mconvert.mappings.keys import canonical_key

    assert canonical_key("mtp.layers.0.mtp_model_layer.self_attention.linear_proj.weight") == (
        "mtp.layers.0.transformer_layer.self_attention.linear_proj.weight")


def test_hf_to_megatron_at_tp2_ep2_loads_into_megatron_core_with_transformers_logits(tmp_path: Path) -> None:
    """hf-to-megatron of the DeepseekV3ForCausalLM export writes TP=2 EP=2 rank files that megatron-core strict-loads
    with transformers' logits, that merge back to the original tensors (the vocab's padding rows re-padded), and
    that megatron-to-hf turns into the same safetensors bytes; its MTP layer's logits under megatron-core equal
    those transformers' own modules compute from the HF tensors at DeepSeek's MTP names."""
    from mcore_ref import run_mcore
    from transformers import AutoModelForCausalLM

    from mconvert.convert.verbs import hf_to_megatron, megatron_to_hf

    spec = preset("tiny-deepseek-v3")
    state = moved_off_init(GPTModel(spec, ParallelState(), seed=5).state_dict(), 0, 0)
    megatron_to_hf(save_single_rank(spec, state, tmp_path / "m"), tmp_path / "hf")
    hf_to_megatron(tmp_path / "hf", tmp_path / "m2", tp=2, ep=2)
    files = {(t, e): safe_load(rank_file(tmp_path / "m2", "release", t, 0, 1, e, 2))["model"]
             for t in range(2) for e in range(2)}
    back = merged_ranks(spec, files, 2)
    for k, v in state.items():
        if torch.is_tensor(v):
            rows = spec.vocab_size if k in ("embedding.word_embeddings.weight", "output_layer.weight") else None
            assert torch.equal(back[k][:rows], v[:rows]), k
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf(PROBE).logits
    got, got_mtp = run_mcore(spec, 2, mcore_rank_logits, (files, PROBE, False), ep=2)[0]
    diff = rel_diff(got[..., : spec.vocab_size], want)
    assert diff <= TOL, diff
    want_mtp = hf_mtp_logits(tmp_path / "hf", hf, PROBE)
    d_mtp = rel_diff(got_mtp[..., : spec.vocab_size], want_mtp)
    assert d_mtp <= TOL, d_mtp
    d_main_as_mtp = rel_diff(want, want_mtp)  # control: the MTP layer's logits are not the main head's
    assert d_main_as_mtp > 100 * TOL, d_main_as_mtp
    megatron_to_hf(tmp_path / "m2", tmp_path / "hf2")  # and back from TP=2 EP=2: the same bytes
    first, again = (tmp_path / d / "model.safetensors" for d in ("hf", "hf2"))
    assert first.read_bytes() == again.read_bytes()
    print(f"[figures] tiny-deepseek-v3 HF -> Megatron TP=2 EP=2: megatron-core vs transformers {diff:.1e}, MTP layer "
          f"{d_mtp:.1e} (main vs MTP logits {d_main_as_mtp:.1e})")


def test_sigmoid_router_load_balancing_loss_is_megatron_cores() -> None:
    """The load-balancing loss of the sigmoid router counts what megatron-core's does (normalised sigmoid scores and
    their own top-k, not the biased, group-limited choice)."""
    from megatron.core.transformer.moe.moe_utils import (
        compute_routing_scores_for_aux_loss,
        switch_load_balancing_loss_func,
    )

    from mconvert.trainer.deepseek_moe import Router
    from mconvert.trainer.model import load_balancing_loss

    spec = preset("tiny-deepseek-v3")
    g = torch.Generator().manual_seed(1)
    router = Router(spec, torch.nn.Parameter(torch.randn(16, 128, generator=g)), None, ParallelState())
    router.expert_bias = torch.randn(16, generator=g)  # steers the routed choice, not the loss's counts
    logits, _, top = router(torch.randn(64, 128, generator=g))
    ours = load_balancing_loss(*router.aux_loss_inputs(logits, top), 16, spec.moe_router_topk, 0.01)
    routing_map, scores = compute_routing_scores_for_aux_loss(logits, spec.moe_router_topk, "sigmoid")
    theirs = switch_load_balancing_loss_func(scores, routing_map.sum(dim=0), 64, spec.moe_router_topk, 16, 0.01)
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-6)


def test_te_spec_latent_norms_read_as_the_local_names() -> None:
    """megatron-core's TE spec fuses MLA's latent norms into the up projections (`layer_norm_weight`)."""
    from mconvert.mappings.keys import canonical_key

    te = "decoder.layers.1.self_attention.linear_{}_up_proj.layer_norm_weight"
    assert canonical_key(te.format("q")) == "decoder.layers.1.self_attention.q_layernorm.weight"
    assert canonical_key(te.format("kv")) == "decoder.layers.1.self_attention.kv_layernorm.weight"
    assert canonical_key("decoder.layers.1.self_attention.linear_kv_up_proj.weight") == (
        "decoder.layers.1.self_attention.linear_kv_up_proj.weight")


def test_deepseek_v3_671b_shapes_count_its_published_parameters() -> None:
    """The declarations of DeepSeek-V3's shapes add up to its published 671 B parameters (main model); its MTP
    layer, with the copies of the embedding and head its HF checkpoint holds, makes the published 685 B."""
    spec = preset("deepseek-v3-671b").replace(make_vocab_size_divisible_by=1)
    main = spec.replace(mtp_num_layers=None).num_parameters()
    with_mtp = spec.num_parameters() + 2 * spec.vocab_size * spec.hidden_size
    assert round(main / 1e9) == 671 and round(with_mtp / 1e9, 0) in (684, 685), (main, with_mtp)


def test_deepseek_v3_671b_activates_its_published_37b_parameters() -> None:
    """One token meets 37 B of the 671 B (the published activated count): its first three layers are dense, so
    only the 58 MoE layers leave E - k experts out, and the count stays arithmetic in layers and experts."""
    from mconvert.trainer.train import active_parameters

    spec = preset("deepseek-v3-671b").replace(make_vocab_size_divisible_by=1, mtp_num_layers=None)
    assert spec.num_moe_layers == 58
    assert 37e9 <= active_parameters(spec) < 38e9, active_parameters(spec)


def test_the_native_runner_runs_the_tp2_ep2_checkpoint(trained_checkpoint) -> None:
    """`validate`'s runner (the checkpoint at its own TP=2 EP=2) gives the logits of its weights merged to one rank."""
    from mconvert.trainer.infer import megatron_logits

    spec = preset("tiny-deepseek-v3")
    run = _run(2, 2, trained_checkpoint)
    merged = merged_ranks(spec, {k: v["model"] for k, v in run.items() if isinstance(k, tuple)}, 2)
    want = _ours(spec, merged, PROBE)[0][..., : spec.vocab_size]
    diff = rel_diff(megatron_logits(run["dir"], PROBE), want)
    assert diff <= TOL, diff


def test_reshard_with_optimizer_continues_the_run_at_tp2_ep2(trained_checkpoint, tmp_path: Path) -> None:
    """reshard --with-optimizer of the single-rank checkpoint to TP=2 EP=2 (Adam states follow their tensors, the
    expert bias travels as the buffer it is) continues the run: step 3 there has the step-3 loss of the run
    continued at TP=1."""
    import shutil

    from mconvert.convert.verbs import reshard

    run = _run(1, 1, trained_checkpoint)
    same, wide = tmp_path / "same", tmp_path / "wide"
    shutil.copytree(run["dir"], same)
    reshard(run["dir"], wide, tp=2, pp=1, ep=2, with_optimizer=True)
    cfg = dict(preset="tiny-deepseek-v3", pp=1, steps=3, seq_length=32, micro_batch_size=2, global_batch_size=8,
               lr=1e-2, seed=42, quiet=True, moe_aux_loss_coeff=0.0, resume=True)
    one = train(TrainConfig(tp=1, dp=1, ep=1, save=str(same), **cfg))["losses"]
    two = train(TrainConfig(tp=2, dp=2, ep=2, save=str(wide), **cfg))["losses"]
    assert len(one) == len(two) == 1 and abs(one[0] - two[0]) <= 1e-4, (one, two)


def test_vllms_moe_layer_freq_passes_at_every_layer_and_is_refused_otherwise() -> None:
    """DeepSeek's published config.json states moe_layer_freq 1 (every layer after the dense ones), which vLLM
    reads and transformers does not: 1 is the model both compute; another value only vLLM would build."""
    from mconvert.mappings.families import hf_config, spec_from_hf_config

    spec = preset("tiny-deepseek-v3").replace(mtp_num_layers=None)
    cfg = hf_config(spec)
    assert spec_from_hf_config({**cfg, "moe_layer_freq": 1}) == spec_from_hf_config(cfg)
    with pytest.raises(MConvertError, match="config field moe_layer_freq=2 is not supported"):
        spec_from_hf_config({**cfg, "moe_layer_freq": 2})
