"""Mixture of experts against truth we did not write: megatron-core's own MoE GPTModel and transformers' classes.

megatron-core 0.16.1 builds `tiny-mixtral` / `tiny-qwen3-moe` as MoE GPTModels (local spec: SequentialMLP
experts, allgather dispatcher, its default softmax top-k router) at TP×EP over gloo on CPU. Each rank saves its
own `state_dict_for_save_checkpoint()` (local expert indices, as megatron-core names them) into the legacy
layout Megatron-LM's `get_checkpoint_name` gives it: `mp_rank_TT_EEE/model_optim_rng.pt` (no `_PPP` at PP=1),
with args, checkpoint_version 3.0 and iteration. The file assembly follows Megatron-LM's naming rules; every
tensor and key inside comes from megatron-core. mconvert converts them and transformers' MixtralForCausalLM /
Qwen3MoeForCausalLM must give megatron-core's logits (max abs ≤ 1e-4 · max|logit|, same top-1); the other way,
hf-to-megatron's rank files strict-load into megatron-core's MoE model on every rank and give transformers'
logits.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from hf_ref import hf_logits
from mcore_ref import McoreContext, run_mcore
from mcore_ref import perturb as _perturb
from mcore_ref import save_checkpoints
from safetensors.torch import load_file

from mconvert.cli import main as cli_main
from mconvert.io.atomic import MANIFEST
from mconvert.layouts.megatron import rank_file, save_rank_file
from mconvert.convert.megatron.source import MegatronSource
from mconvert.io.safeload import safe_load
from mconvert.errors import MConvertError
from mconvert.mappings.families import hf_config, preset, spec_from_hf_config, spec_from_megatron_args
from mconvert.spec import ModelSpec
from safety_common import add_adam_states

ITERATION = 10
SPECS = {"mixtral": preset("tiny-mixtral"), "qwen3_moe": preset("tiny-qwen3-moe")}
# (family, TP, EP) runs of megatron-core: EP alone, and TP with EP
RUNS = [("mixtral", 1, 2), ("qwen3_moe", 2, 2)]


def _save_legacy(ctx: McoreContext, root: str, tokens: torch.Tensor) -> torch.Tensor:
    """Per rank: perturb, save the legacy torch rank file as Megatron-LM names it and megatron-core's own
    torch_dist checkpoint (`dist_checkpointing.save` of `sharded_state_dict()`) beside it; return the logits."""
    _perturb(ctx)
    save_checkpoints(ctx, root, ITERATION, torch_dist=True, params_dtype=torch.float32)
    return ctx.logits(tokens)


def _load_rank_files(ctx: McoreContext, root: str, tokens: torch.Tensor) -> torch.Tensor:
    """Per rank: strict-load this (TP, EP) rank's file of an mconvert checkpoint, return the logits."""
    path = rank_file(root, "release", ctx.tp_rank, 0, 1, ctx.ep_rank, ctx.ep)
    ctx.model.load_state_dict(safe_load(path)["model"], strict=True)
    return ctx.logits(tokens)


def _close(got: torch.Tensor, ref: torch.Tensor) -> bool:
    return bool((got - ref).abs().max() <= 1e-4 * ref.abs().max() and torch.equal(got.argmax(-1), ref.argmax(-1)))


def _tokens(spec: ModelSpec) -> torch.Tensor:
    return torch.randint(0, spec.vocab_size, (2, 12), generator=torch.Generator().manual_seed(7))


_SAVED: dict[tuple[str, int, int], tuple] = {}


def _saved(family: str, tp: int, ep: int, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    """One megatron-core run per (family, TP, EP), shared by this module's tests."""
    if (family, tp, ep) not in _SAVED:
        spec = SPECS[family]
        root = tmp_path_factory.mktemp(f"mcore_{family}_tp{tp}_ep{ep}") / "ckpt"
        tokens = _tokens(spec)
        results = run_mcore(spec, tp, _save_legacy, (str(root), tokens), ep=ep)
        # every rank computed the same logits (the EP ranks sum their experts' outputs in their own order)
        assert all(torch.allclose(r, results[0], rtol=0, atol=1e-5 * results[0].abs().max()) for r in results)
        _SAVED[(family, tp, ep)] = (spec, tokens, results[0][..., : spec.vocab_size], root)
    return _SAVED[(family, tp, ep)]


def _convert(*argv: str) -> None:
    cli_main(list(argv))  # a failure exits (SystemExit 1) with its one-line error


def _digests(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.suffix in (".pt", ".safetensors", ".txt")}


# ---- megatron-core's checkpoints -> HF ----------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("family,tp,ep", RUNS)
def test_megatron_core_moe_checkpoints_convert_to_matching_hf(family: str, tp: int, ep: int, tmp_path: Path,
                                                              tmp_path_factory: pytest.TempPathFactory) -> None:
    spec, tokens, ref, root = _saved(family, tp, ep, tmp_path_factory)
    names = sorted(p.name for p in (root / f"iter_{ITERATION:07d}").iterdir())
    assert names == [f"mp_rank_{t:02d}_{e:03d}" for t in range(tp) for e in range(ep)]  # no _PPP at PP=1
    _convert("megatron-to-hf", str(root), str(tmp_path / "hf"))
    cfg = spec_from_hf_config(json.loads((tmp_path / "hf" / "config.json").read_text()))
    assert cfg.family == family and cfg.num_experts == spec.num_experts
    got = hf_logits(tmp_path / "hf", tokens)
    assert _close(got, ref), f"max abs {(got - ref).abs().max():.3g} vs max |logit| {ref.abs().max():.3g}"


@pytest.mark.slow
@pytest.mark.parametrize("family,tp,ep", RUNS)
def test_megatron_core_torch_dist_moe_checkpoints_convert_to_the_same_hf(
        family: str, tp: int, ep: int, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """megatron-core's torch_dist save stacks the experts as [layers, experts, ...] in global order; read one
    expert's box at a time, it gives the legacy checkpoint's HF tensors and megatron-core's logits."""
    spec, tokens, ref, root = _saved(family, tp, ep, tmp_path_factory)
    _convert("megatron-to-hf", str(root), str(tmp_path / "legacy"))
    _convert("megatron-to-hf", str(root) + "_dist", str(tmp_path / "dist"))
    a, b = (load_file(tmp_path / d / "model.safetensors") for d in ("legacy", "dist"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert _close(hf_logits(tmp_path / "dist", tokens), ref)


@pytest.mark.slow
def test_a_torch_dist_moe_source_is_planned_at_its_saved_ep(tmp_path: Path,
                                                           tmp_path_factory: pytest.TempPathFactory) -> None:
    """megatron-core's torch_dist save at EP=2: the dry run's source and read side say EP=2, as for the legacy
    rank files of the same run (one rank file per EP rank there)."""
    from mconvert.convert.verbs import megatron_to_hf

    _, _, _, root = _saved("mixtral", 1, 2, tmp_path_factory)
    legacy = megatron_to_hf(root, tmp_path / "a", dry_run=True)
    dist = megatron_to_hf(str(root) + "_dist", tmp_path / "b", dry_run=True)
    assert "EP=2" in dist["source"] and "EP=2" in legacy["source"]
    assert dist["read_files"] == legacy["read_files"] == 2
    assert dist["largest_unit"] == legacy["largest_unit"]


@pytest.mark.slow
def test_swapped_ep_rank_dirs_change_the_logits(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """EP ranks 0 and 1 exchanged (their experts move to the other half of the router's columns): the
    conversion still runs — the files are well-formed — but the model is another one, and the logits say so."""
    spec, tokens, ref, root = _saved("mixtral", 1, 2, tmp_path_factory)
    swapped = tmp_path / "swapped"
    shutil.copytree(root, swapped)
    it = swapped / f"iter_{ITERATION:07d}"
    os.rename(it / "mp_rank_00_000", it / "tmp")
    os.rename(it / "mp_rank_00_001", it / "mp_rank_00_000")
    os.rename(it / "tmp", it / "mp_rank_00_001")
    _convert("megatron-to-hf", str(swapped), str(tmp_path / "hf"))
    got = hf_logits(tmp_path / "hf", tokens)
    assert (got - ref).abs().max() > 0.05 * ref.abs().max()


@pytest.mark.slow
def test_a_reader_that_drops_the_ep_offset_is_refused(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Local expert indices read as global ones (the EP offset dropped) leave experts 2 and 3 unread: the
    opening checks refuse by name instead of writing a model with half its experts."""
    _, _, _, root = _saved("mixtral", 1, 2, tmp_path_factory)
    monkeypatch.setattr(MegatronSource, "_global_expert", lambda self, name, raw, file: name)
    with pytest.raises(MConvertError, match=r"parameter 'decoder\.layers\.0\.mlp\.experts\.local_experts\.2\."
                                            r"linear_fc1\.weight' is missing"):
        MegatronSource(root)


@pytest.mark.slow
def test_a_dense_weight_that_differs_between_ep_ranks_is_refused_naming_both_files(
        tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    _, _, _, root = _saved("mixtral", 1, 2, tmp_path_factory)
    bad = tmp_path / "bad"
    shutil.copytree(root, bad)
    f = rank_file(bad, ITERATION, 0, 0, 1, 1, 2)
    state = safe_load(f)
    state["model"]["decoder.layers.1.mlp.router.weight"] = state["model"]["decoder.layers.1.mlp.router.weight"] + 1
    save_rank_file(f, state)
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(MConvertError, match=r"mp_rank_00_001/model_optim_rng\.pt: dense weight "
                                            r"'decoder\.layers\.1\.mlp\.router\.weight' differs from .*"
                                            r"mp_rank_00_000/model_optim_rng\.pt"):
        from mconvert.convert.verbs import megatron_to_hf
        megatron_to_hf(bad, tmp_path / "hf")
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no half-written output


@pytest.mark.slow
def test_te_grouped_gemm_expert_spelling_reads_as_the_local_one(tmp_path: Path,
                                                                tmp_path_factory: pytest.TempPathFactory) -> None:
    """TE's grouped GEMM stores `mlp.experts.linear_fc1.weight{i}` for local expert i: the same tensors."""
    _, _, _, root = _saved("mixtral", 1, 2, tmp_path_factory)
    te = tmp_path / "te"
    shutil.copytree(root, te)
    for e in range(2):
        f = rank_file(te, ITERATION, 0, 0, 1, e, 2)
        state = safe_load(f)
        model = {}
        for k, v in state["model"].items():
            if ".local_experts." in k:
                head, rest = k.split(".local_experts.")
                i, lin, kind = rest.split(".")
                k = f"{head}.{lin}.{kind}" if kind == "_extra_state" else f"{head}.{lin}.{kind}{i}"
            model[k] = v
        state["model"] = model
        save_rank_file(f, state)
    _convert("megatron-to-hf", str(root), str(tmp_path / "a"))
    _convert("megatron-to-hf", str(te), str(tmp_path / "b"))
    a, b = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_a_grouped_gemm_ordered_source_reshards_expert_by_expert_and_strict_loads(tmp_path: Path) -> None:
    """TE's grouped GEMM lists every expert's fc1, then every expert's fc2. Moved one expert at a time, the
    written rank files hold each expert's fc1 and fc2 together, in megatron-core's SequentialMLP module order
    (what hf-to-megatron writes), and megatron-core strict-loads them with transformers' logits."""
    spec = SPECS["mixtral"]
    hf = _random_hf("mixtral", tmp_path / "hf")
    a, grouped, b = tmp_path / "a", tmp_path / "grouped", tmp_path / "b"
    _convert("hf-to-megatron", str(hf), str(a), "--tp", "2", "--ep", "2")
    shutil.copytree(a, grouped)
    (grouped / MANIFEST).unlink()
    for f in sorted((grouped / "release").glob("mp_rank_*/model_optim_rng.pt")):
        state = safe_load(f)
        dense, fc1, fc2 = {}, {}, {}
        for k, v in state["model"].items():
            if ".local_experts." not in k:
                dense[k] = v
                continue
            head, rest = k.split(".local_experts.")
            i, lin, kind = rest.split(".")
            if kind != "_extra_state":  # TE keeps one per grouped linear, not one per expert
                (fc1 if lin == "linear_fc1" else fc2)[f"{head}.{lin}.{kind}{i}"] = v
        state["model"] = {**dense, **fc1, **fc2}
        save_rank_file(f, state)
    _convert("reshard", str(grouped), str(b), "--tp", "2", "--ep", "2")
    for f in sorted((a / "release").glob("mp_rank_*/model_optim_rng.pt")):
        want = safe_load(f)["model"]
        got = safe_load(b / f.relative_to(a))["model"]
        assert list(got) == list(want)  # same keys in the same order: expert by expert
        assert all(v is None and got[k] is None or torch.equal(v, got[k]) for k, v in want.items())
    tokens = _tokens(spec)
    results = run_mcore(spec, 2, _load_rank_files, (str(b), tokens), ep=2)
    assert _close(results[0][..., : spec.vocab_size], hf_logits(hf, tokens))


# ---- HF -> megatron-core ---------------------------------------------------------------------------------
def _random_hf(family: str, d: Path) -> Path:
    import transformers

    spec = SPECS[family]
    cfg = transformers.AutoConfig.for_model(**hf_config(spec))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1 + (1.0 if p.dim() == 1 else 0.0))
    model.save_pretrained(d)
    return d


@pytest.mark.slow
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_hf_to_megatron_at_tp2_ep2_strict_loads_into_megatron_core(family: str, tmp_path: Path) -> None:
    hf = _random_hf(family, tmp_path / "hf")
    spec = SPECS[family]
    tokens = _tokens(spec)
    _convert("hf-to-megatron", str(hf), str(tmp_path / "mg"), "--tp", "2", "--ep", "2")
    names = sorted(p.name for p in (tmp_path / "mg" / "release").iterdir())
    assert names == ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]
    args = safe_load(rank_file(tmp_path / "mg", "release", 1, 0, 1, 1, 2))["args"]
    assert (args.expert_model_parallel_size, args.num_experts, args.moe_router_topk) == (2, spec.num_experts, 2)
    results = run_mcore(spec, 2, _load_rank_files, (str(tmp_path / "mg"), tokens), ep=2)
    ref = hf_logits(hf, tokens)
    got = results[0][..., : spec.vocab_size]
    assert _close(got, ref), f"max abs {(got - ref).abs().max():.3g} vs max |logit| {ref.abs().max():.3g}"


# ---- round trips --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_hf_to_megatron_ep2_to_hf_is_byte_identical(family: str, tmp_path: Path) -> None:
    hf = _random_hf(family, tmp_path / "hf")
    _convert("hf-to-megatron", str(hf), str(tmp_path / "mg"), "--ep", "2", "--tp", "2")
    _convert("megatron-to-hf", str(tmp_path / "mg"), str(tmp_path / "hf2"))
    a, b = load_file(hf / "model.safetensors"), load_file(tmp_path / "hf2" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)
    specs = [spec_from_hf_config(json.loads((d / "config.json").read_text())) for d in (hf, tmp_path / "hf2")]
    assert specs[0] == specs[1] and specs[0].replace(bos_token_id=None, eos_token_id=None) == SPECS[family]


def test_reshard_ep2_tp2_to_ep1_tp1_and_back_is_byte_identical(tmp_path: Path) -> None:
    hf = _random_hf("mixtral", tmp_path / "hf")
    a, b, c, d = (tmp_path / n for n in "abcd")
    _convert("hf-to-megatron", str(hf), str(a), "--tp", "2", "--ep", "2")
    _convert("reshard", str(a), str(b), "--tp", "1", "--ep", "1")
    _convert("reshard", str(b), str(c), "--tp", "2", "--ep", "2")
    assert sorted(p.name for p in (b / "release").iterdir()) == ["mp_rank_00"]
    assert _digests(a) == _digests(c)
    _convert("reshard", str(b), str(d), "--tp", "1", "--ep", "4")  # one expert per EP rank
    names = sorted(p.name for p in (d / "release").iterdir())
    assert names == [f"mp_rank_00_{e:03d}" for e in range(4)]
    for e in range(4):  # each file holds exactly its one expert, as local expert 0
        model = safe_load(rank_file(d, "release", 0, 0, 1, e, 4))["model"]
        experts = sorted({k.split(".local_experts.")[1].split(".")[0] for k in model if ".local_experts." in k})
        assert experts == ["0"]
        full = safe_load(rank_file(b, "release", 0, 0, 1))["model"]
        key = "decoder.layers.1.mlp.experts.local_experts.{}.linear_fc2.weight"
        assert torch.equal(model[key.format(0)], full[key.format(e)])


# ---- refusals ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,value", [
    ("moe_router_score_function", "sigmoid"), ("moe_router_enable_expert_bias", True),
    ("moe_router_num_groups", 8), ("moe_shared_expert_intermediate_size", 256), ("moe_layer_freq", [0, 1]),
    ("moe_router_pre_softmax", True), ("moe_expert_capacity_factor", 1.0), ("moe_router_load_balancing_type",
                                                                            "sinkhorn"),
    ("moe_router_topk_scaling_factor", 2.5), ("multi_latent_attention", True),
])
def test_moe_args_that_change_the_function_are_refused_by_name(name: str, value) -> None:
    args = SPECS["mixtral"].to_megatron_args(1, 1, ep=2)
    setattr(args, name, value)
    with pytest.raises(MConvertError, match=f"x/model_optim_rng.pt: Megatron arg {name}="):
        spec_from_megatron_args(args, source="x/model_optim_rng.pt")


def test_deepseek_v3_style_args_are_refused_by_name() -> None:
    """DeepSeek-V3: MLA, sigmoid router with expert bias, shared experts, dense first layers — the first of
    them met is named (MLA)."""
    args = SPECS["mixtral"].to_megatron_args(1, 1)
    for k, v in dict(multi_latent_attention=True, moe_router_score_function="sigmoid",
                     moe_router_enable_expert_bias=True, moe_shared_expert_intermediate_size=2048,
                     moe_layer_freq=[0, 0, 0] + [1] * 58, q_lora_rank=1536).items():
        setattr(args, k, v)
    with pytest.raises(MConvertError, match="multi_latent_attention=True is not supported"):
        spec_from_megatron_args(args)


def test_moe_defaults_megatron_lm_stores_pass() -> None:
    """Megatron-LM stores every moe_* option; at their defaults (and the training-only ones at any value)
    they read as the same model."""
    args = SPECS["mixtral"].to_megatron_args(1, 1, ep=2)
    for k, v in dict(moe_router_score_function="softmax", moe_router_pre_softmax=False, moe_layer_freq=1,
                     moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.01, moe_z_loss_coeff=1e-3,
                     moe_router_dtype="fp32", moe_grouped_gemm=True, moe_token_dispatcher_type="alltoall",
                     moe_router_enable_expert_bias=False, moe_shared_expert_intermediate_size=None).items():
        setattr(args, k, v)
    assert spec_from_megatron_args(args) == SPECS["mixtral"]


def test_a_dense_family_with_experts_and_a_moe_family_without_are_refused() -> None:
    args = SPECS["mixtral"].to_megatron_args(1, 1)
    args.model_family = "llama"
    with pytest.raises(MConvertError, match="num_experts=4 is not supported for the dense family 'llama'"):
        spec_from_megatron_args(args)
    args = preset("tiny-llama").to_megatron_args(1, 1)
    args.model_family = "mixtral"
    with pytest.raises(MConvertError, match="MoE family 'mixtral', which needs num_experts"):
        spec_from_megatron_args(args)


def test_qwen3_moe_without_renormalised_top_k_is_refused() -> None:
    cfg = hf_config(SPECS["qwen3_moe"])
    for bad in (False, None):
        c = dict(cfg)
        if bad is None:
            del c["norm_topk_prob"]  # transformers' default is false
        else:
            c["norm_topk_prob"] = bad
        with pytest.raises(MConvertError, match=f"norm_topk_prob={bad} is not supported"):
            spec_from_hf_config(c)
    for name, value in (("mlp_only_layers", [0]), ("decoder_sparse_step", 2)):
        with pytest.raises(MConvertError, match=f"{name}="):
            spec_from_hf_config({**cfg, name: value})


@pytest.mark.parametrize("tp,ep,msg", [(1, 3, "EP=3 does not divide num_experts=4"),
                                       (1, 8, "EP=8 does not divide num_experts=4"),
                                       (1, 0, "must be >= 1")])
def test_an_ep_that_does_not_divide_the_experts_is_refused(tp: int, ep: int, msg: str) -> None:
    with pytest.raises(MConvertError, match=msg):
        SPECS["mixtral"].check_parallel(tp, 1, None, ep)


def test_ep_on_a_dense_model_is_refused(tmp_path: Path) -> None:
    with pytest.raises(MConvertError, match="EP=2 needs a mixture-of-experts model"):
        preset("tiny-llama").check_parallel(1, 1, None, 2)


@pytest.mark.parametrize("verb,source,expect", [
    ("megatron-to-ft", "mg", "num_experts=4 (mixture of experts) is not mapped to FasterTransformer"),
    ("megatron-to-trtllm", "mg", "num_experts=4 (mixture of experts) is not mapped to TensorRT-LLM"),
    ("to-onnx", "hf", "MixtralForCausalLM (mixture of experts) is not mapped to ONNX"),
    ("to-onnx", "mg", "MixtralForCausalLM (mixture of experts) is not mapped to ONNX"),
])
def test_deployment_formats_without_a_moe_layout_refuse_by_name(verb: str, source: str, expect: str,
                                                                tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    hf = _random_hf("mixtral", tmp_path / "hf")
    _convert("hf-to-megatron", str(hf), str(tmp_path / "mg"), "--ep", "2")
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        cli_main([verb, str(tmp_path / source), str(tmp_path / "out")])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert expect in " ".join(err.split()) and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_plan_estimates_a_671b_moe_from_shapes() -> None:
    """`moe-671b`: DeepSeek-V3's routed sizes in Mixtral's layout, estimated from shapes alone (no weights)."""
    from mconvert.layouts.estimate import estimate, unit_bytes

    spec = preset("moe-671b")
    assert 660e9 < spec.num_parameters() < 680e9
    est = estimate(spec, "hf", tp=8, pp=2, dtype="bf16").to_dict()
    assert (est["operation"], est["read_files"]) == ("megatron-to-hf", 16)
    assert est["write_bytes"] == 2 * spec.num_parameters()  # bf16 safetensors: every parameter once
    layer = sum(math.prod(d.shape) for d in spec.layer_params(0)) * 2
    expert = 3 * 7168 * 2048 * 2  # w1, w3 [2048, 7168] and w2 [7168, 2048] in bf16: 88 MB
    # the untied head: its TP=8 shards (padded vocab) and the final norm once per rank in, true vocab rows out
    head = (spec.padded_vocab_size(8) + spec.vocab_size) * 7168 * 2 + (8 + 1) * 7168 * 2
    # memory is bounded by one unit — an expert, a layer's dense part, the embedding, the head — never a
    # layer's 256 experts (23 GB): here the largest is the head
    assert est["largest_unit"] == "final" and est["largest_unit_bytes"] == head < layer / 5
    assert unit_bytes(spec, 8, 2)["expert"] == expert and "layer" not in unit_bytes(spec, 8, 2)


def test_reshard_with_optimizer_moves_adam_states_with_their_experts(tmp_path: Path) -> None:
    hf = _random_hf("mixtral", tmp_path / "hf")
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    _convert("hf-to-megatron", str(hf), str(a), "--tp", "2", "--ep", "2")
    add_adam_states(a)
    _convert("reshard", str(a), str(b), "--tp", "1", "--ep", "1", "--with-optimizer")
    _convert("reshard", str(b), str(c), "--tp", "2", "--ep", "2", "--with-optimizer")
    for root, files in ((b, 1), (c, 4)):
        got = sorted((root / "release").glob("mp_rank_*/model_optim_rng.pt"))
        assert len(got) == files
        for f in got:
            state = safe_load(f)
            opt = state["optimizer"]
            names = opt["param_groups"][0]["param_names"]
            assert sorted(names) == sorted(k for k, v in state["model"].items() if isinstance(v, torch.Tensor))
            for pid, name in zip(opt["param_groups"][0]["params"], names):
                p = state["model"][name]
                assert torch.equal(opt["state"][pid]["exp_avg"], p / 2), (f, name)
                assert torch.equal(opt["state"][pid]["exp_avg_sq"], p ** 2), (f, name)
    for e, t in ((0, 0), (1, 1)):  # and the round trip gives the first files' parameters and states back
        x, y = safe_load(rank_file(a, "release", t, 0, 1, e, 2)), safe_load(rank_file(c, "release", t, 0, 1, e, 2))
        assert x["model"].keys() == y["model"].keys()
        assert all(v is None and y["model"][k] is None or torch.equal(v, y["model"][k]) for k, v in x["model"].items())


@pytest.mark.parametrize("name,value,expect", [
    ("num_experts", 8, "num_experts=8 does not match the weights: tensor 'decoder.layers.0.mlp.router.weight' is "
                       "[4, 128], the config implies [8, 128]"),
    ("moe_ffn_hidden_size", 64, "moe_ffn_hidden_size=64 does not match the weights: tensor 'decoder.layers.0.mlp."
                                "experts.local_experts.0.linear_fc1.weight' is [256, 128]"),
    ("expert_model_parallel_size", 1, "unexpected rank directories mp_rank_00_001"),
])
def test_args_that_misdescribe_the_experts_are_refused_by_name(name: str, value, expect: str,
                                                               tmp_path: Path) -> None:
    hf = _random_hf("mixtral", tmp_path / "hf")
    _convert("hf-to-megatron", str(hf), str(tmp_path / "mg"), "--ep", "2")
    for e in range(2):
        f = rank_file(tmp_path / "mg", "release", 0, 0, 1, e, 2)
        state = safe_load(f)
        setattr(state["args"], name, value)
        save_rank_file(f, state)
    (tmp_path / "mg" / MANIFEST).unlink()
    with pytest.raises(MConvertError, match=re.escape(expect)):
        MegatronSource(tmp_path / "mg")


def test_inspect_shows_the_expert_layout(tmp_path: Path) -> None:
    from mconvert.convert.inspect import inspect_checkpoint

    hf = _random_hf("qwen3_moe", tmp_path / "hf")
    _convert("hf-to-megatron", str(hf), str(tmp_path / "mg"), "--tp", "2", "--ep", "2")
    info = inspect_checkpoint(tmp_path / "mg")
    assert (info["tp"], info["ep"], info["spec"]["num_experts"], info["spec"]["moe_ffn_hidden_size"]) == (2, 2, 4, 64)
    rows = {p["name"]: p for p in info["params"]}
    fc1 = rows["decoder.layers.*.mlp.experts.local_experts.*.linear_fc1.weight"]
    assert (fc1["kind"], fc1["full_shape"], fc1["rank_shapes"]["0"]) == ("gated", [128, 128], [64, 128])
    assert rows["decoder.layers.*.mlp.router.weight"]["kind"] == "replicated"
    assert len(info["params"]) == len(rows)  # one row per template, not one per expert


@pytest.mark.parametrize("damage,expect", [
    ("drop", "no mp_rank_* directories of EP rank 1; the checkpoint is incomplete"),
    ("extra", "unexpected rank directories mp_rank_00_002 (the args say TP=1, PP=1, EP=2)"),
])
def test_a_missing_or_stray_ep_rank_dir_is_refused_by_name(damage: str, expect: str, tmp_path: Path) -> None:
    hf = _random_hf("mixtral", tmp_path / "hf")
    _convert("hf-to-megatron", str(hf), str(tmp_path / "mg"), "--ep", "2")
    rel = tmp_path / "mg" / "release"
    if damage == "drop":
        shutil.rmtree(rel / "mp_rank_00_001")
    else:
        shutil.copytree(rel / "mp_rank_00_001", rel / "mp_rank_00_002")
    (tmp_path / "mg" / MANIFEST).unlink()
    with pytest.raises(MConvertError, match=re.escape(expect)):
        MegatronSource(tmp_path / "mg")
