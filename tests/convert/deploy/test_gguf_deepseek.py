"""GGUF of the DeepSeek MoE families proven in llama.cpp itself: tiny-deepseek-v3 (architecture `deepseek2`: MLA
with q LoRA, `kv_b_proj` split into `attn_k_b` / `attn_v_b`, MTP left out) and tiny-glm45 (`glm4moe`: q/k/v bias,
q/k norm, half the head rotated, the MTP layer as a `nextn` block), both with a dense first layer, shared experts,
a sigmoid router with a non-zero expert bias and group-limited top-k.

The trainer's model with every weight moved off its init, resharded to TP=2 EP=2, goes through
`megatron-to-gguf`, and its `megatron-to-hf` export through `hf-to-gguf`: llama.cpp's logits at every position
must match transformers' on the export (f32 within 1e-4 of the largest logit, f16 within its row), both
routes must write the same tensors, and `verify` must pass every check. Controls: `attn_k_b` written without its per-head transpose (same shape) and
the expert bias written as zeros fail the comparison. The tiny presets' MLA sizes (kv latent 512 + 64 rope rows)
are DeepSeek-V3's; llama.cpp 0.3.36's CPU path runs them as they are. Its deepseek2 reads a 26- or 27-layer model
as without q LoRA (DeepSeek-V2-Lite) and any other as with it: the case without q LoRA has 27 layers, and a
model against that rule is refused by name (written anyway, llama.cpp cannot load it).
DeepSeek-V2-Lite's router (tiny-deepseek-v2-lite at 27 layers, with and without expert groups of topk_group = k):
softmax gating, the top-k weights not renormalised; a control that renormalises them fails.

DeepSeek-V3's YaRN (tiny-deepseek-v3-yarn: factor 4 over 32 original positions, 64 positions run): llama.cpp's
logits match transformers' for DeepSeek-V3's mscale pair (`yarn_log_multiplier` alone), for mscale 0.5 and for no
pair (`attn_factor` too); each key dropped fails (the controls); the betas llama.cpp does not read (Kimi K2's) and
a cos/sin factor of 0 are refused in one line.
"""

from __future__ import annotations

import dataclasses
import inspect
import math

import gguf
import numpy as np
import pytest
from validate_common import WORK, glm_tokenizer, moved_off_init_ckpt

from mconvert.convert.deploy import gguf as gguf_mod
from mconvert.convert.verbs import to_gguf
from mconvert.errors import MConvertError
from mconvert.mappings.families import preset
from mconvert.validators.gguf_runner import read_gguf_metadata
from mconvert.validators.validate import validate
from mconvert.validators.verify_gguf import verify_gguf as verify

G = WORK / "gguf-deepseek"
G.mkdir(parents=True, exist_ok=True)
REL_F32 = 1e-4  # llama.cpp f32 logits vs transformers', relative to the largest logit
# llama.cpp's deepseek2 reads 26- and 27-layer models as without q LoRA (DeepSeek-V2-Lite) and others as with it
NO_Q_LORA = {"num_layers": 27, "q_lora_rank": None, "moe_layer_freq": (0,) + (1,) * 26}
# case -> (trainer preset, changes to its spec, llama.cpp architecture)
CASES = {"deepseek_v3": ("tiny-deepseek-v3", {}, "deepseek2"), "glm4_moe": ("tiny-glm45", {}, "glm4moe"),
         "deepseek_v3 without q LoRA": ("tiny-deepseek-v3", NO_Q_LORA, "deepseek2"),
         "deepseek_v2 lite": ("tiny-deepseek-v2-lite", NO_Q_LORA, "deepseek2"),
         # 8 groups, k = topk_group = 4: the greedy top-k, which llama.cpp computes without groups
         "deepseek_v2 lite grouped": ("tiny-deepseek-v2-lite", {**NO_Q_LORA, "moe_router_num_groups": 8,
                                                               "moe_router_group_topk": 4}, "deepseek2")}
GATING = {"sigmoid": 2, "softmax": 1}  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_*


def _sources(case: str):
    """(the TP=2 EP=2 Megatron checkpoint, its megatron-to-hf export)."""
    from mconvert.convert.verbs import megatron_to_hf, reshard

    name, changes = CASES[case][:2]
    ckpt, hf = G / f"ckpt-{case.replace(' ', '-')}-tp2ep2", G / f"hf-{case.replace(' ', '-')}"
    if not (ckpt / "latest_checkpointed_iteration.txt").is_file():
        reshard(moved_off_init_ckpt(name, **changes), ckpt, tp=2, pp=1, ep=2)
    if not (hf / "config.json").is_file():
        megatron_to_hf(ckpt, hf, tokenizer=glm_tokenizer())
    return ckpt, hf


def _gguf(src, name: str, outtype: str, **kw):
    out = G / f"{name}-{outtype}.gguf"
    if not out.is_file():
        verb = "hf-to-gguf" if (src / "config.json").is_file() else "megatron-to-gguf"
        to_gguf(src, out, outtype, verb=verb, tokenizer=None if verb == "hf-to-gguf" else glm_tokenizer(), **kw)
    return out


def _rel(result) -> float:
    return result.metrics["max_abs"] / result.metrics["ref_scale"]


def _tensors(path) -> dict[str, bytes]:
    return {t.name: np.asarray(t.data).tobytes() for t in gguf.GGUFReader(str(path)).tensors}


@pytest.mark.gguf
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("case", sorted(CASES))
def test_deepseek_style_gguf_matches_transformers_in_llama_cpp(llama_cpp, case):
    name, changes, arch = CASES[case]
    spec, tag = preset(name).replace(**changes), case.replace(" ", "-")
    ckpt, hf = _sources(case)
    mg32 = _gguf(ckpt, f"mg-{tag}", "f32")
    hf32, hf16 = _gguf(hf, f"hf-{tag}", "f32"), _gguf(hf, f"hf-{tag}", "f16")
    assert _tensors(mg32) == _tensors(hf32)  # megatron-to-gguf and hf-to-gguf write the same tensors
    meta = read_gguf_metadata(hf32)
    L, mtp = spec.num_layers, spec.mtp_num_layers
    assert meta["general.architecture"] == arch
    shared = spec.moe_shared_expert_intermediate_size // spec.expert_ffn_hidden_size
    assert meta[f"{arch}.leading_dense_block_count"] == 1 and meta[f"{arch}.expert_shared_count"] == shared
    # the router: DeepSeek-V3's sigmoid with the expert bias and renormalised weights, V2's softmax without either
    assert meta[f"{arch}.expert_gating_func"] == GATING[spec.moe_router_score_function]
    assert meta[f"{arch}.expert_weights_norm"] == (not spec.moe_router_pre_softmax)
    assert meta[f"{arch}.expert_weights_scale"] == pytest.approx(spec.moe_router_topk_scaling_factor or 1.0)
    if spec.moe_router_pre_softmax:
        assert meta[f"{arch}.expert_group_count"] == 1
    bias = meta["tensors"].get("blk.1.exp_probs_b.bias")
    assert bias == (((spec.num_experts,), "F32") if spec.moe_router_enable_expert_bias else None)
    if arch == "deepseek2":  # no MTP block; k_b [heads, kv latent, nope], v_b [heads, v, kv latent]
        assert meta[f"{arch}.block_count"] == L and not any(t.startswith(f"blk.{L}.") for t in meta["tensors"])
        assert meta["tensors"]["blk.0.attn_k_b.weight"][0] == (8, spec.kv_lora_rank, spec.qk_nope_head_dim)
        assert meta["tensors"]["blk.0.attn_v_b.weight"][0] == (8, spec.v_head_dim, spec.kv_lora_rank)
        assert ("blk.0.attn_q.weight" in meta["tensors"]) == (spec.q_lora_rank is None)
    else:  # the MTP layer is block L, which llama.cpp's main graph does not run
        assert (meta[f"{arch}.block_count"], meta[f"{arch}.nextn_predict_layers"]) == (L + mtp, mtp)
        assert f"blk.{L}.nextn.eh_proj.weight" in meta["tensors"]
        assert meta[f"{arch}.rope.dimension_count"] == 16
    # f16 on the 27-layer model flips near-tied expert choices, which moves logits past the f16 row (as q8_0 does
    # on the smaller MoE models, see docs/deployment/gguf.md): its layout is proven by the f32 files
    rep = validate(hf, [mg32, hf32] + ([] if changes else [hf16]), device="cpu", n_tokens=32)
    print(f"[figures] {case} llama.cpp vs transformers: " + ", ".join(
        f"{r.path.rsplit('/', 1)[-1]} {_rel(r):.1e} top1 {r.metrics['top1']}" for r in rep.results))
    assert rep.passed, [r.failures for r in rep.results]
    assert all(_rel(r) < REL_F32 and r.metrics["top1"] == 1.0 for r in rep.results[:2]), \
        [r.metrics for r in rep.results]
    # verify: the file's tensors are the plan's, llama.cpp tokenizes as transformers does (GLM's special tokens
    # included) and its greedy tokens and logits equal transformers'
    checks = {c.name: c for c in verify(mg32, against=hf, device="cpu").checks}
    for check in ("manifest", "metadata", "tensors", "load", "tokenizer", "greedy", "logits"):
        assert checks[check].status == "ok", (check, checks[check].message)


def test_deepseek_mtp_layers_are_left_out_with_a_line_in_the_report():
    ckpt, _ = _sources("deepseek_v3")
    rep = to_gguf(ckpt, G / "mtp-dry.gguf", "f32", tokenizer=glm_tokenizer(), dry_run=True)
    assert any("1 multi-token prediction layer(s) are not written: llama.cpp's deepseek2" in w
               for w in rep.warnings), rep.warnings
    glm = to_gguf(_sources("glm4_moe")[0], G / "mtp-dry-glm.gguf", "f32", tokenizer=glm_tokenizer(), dry_run=True)
    assert not any("multi-token" in w for w in glm.warnings)


def test_deepseek_mtp_tensors_the_gguf_leaves_out_are_not_read(monkeypatch):
    """deepseek2 has no MTP block: neither hf-to-gguf nor megatron-to-gguf (TP=2 EP=2) reads the MTP layer's
    tensors (its experts included), and both write the same tensors."""
    from mconvert.convert.hf.arrays import HFArrays
    from mconvert.convert.megatron.source import MegatronSource

    ckpt, hf = _sources("deepseek_v3")
    layers = preset("tiny-deepseek-v3").num_layers
    read: list[str] = []
    hf_read, mg_read = HFArrays._checked, MegatronSource.read_unit

    def hf_checked(self, k):
        read.append(k)
        return hf_read(self, k)

    def mg_unit(self, unit, *a, **kw):
        only = inspect.signature(mg_read).bind(self, unit, *a, **kw).arguments.get("only")
        read.extend(only or self._unit_names(unit))
        return mg_read(self, unit, *a, **kw)

    monkeypatch.setattr(HFArrays, "_checked", hf_checked)
    monkeypatch.setattr(MegatronSource, "read_unit", mg_unit)
    out = {}
    for src in (hf, ckpt):
        read.clear()
        out[src] = G / f"mtp-unread-{src.name}.gguf"
        to_gguf(src, out[src], "f32", verb="hf-to-gguf" if src == hf else "megatron-to-gguf",
                tokenizer=None if src == hf else glm_tokenizer(), force=True)
        assert any(".experts." in k for k in read), src  # the decoder's experts were read here
        mtp = [k for k in read if k.startswith("mtp.") or k.startswith(f"model.layers.{layers}.")]
        assert not mtp, (src, mtp[:3])
    assert _tensors(out[hf]) == _tensors(out[ckpt])


@pytest.mark.parametrize("layers,q_lora_rank", [(3, None), (27, 64)])
def test_deepseek_q_lora_against_llama_cpps_layer_count_rule_is_refused_by_name(layers, q_lora_rank):
    spec = preset("tiny-deepseek-v3").replace(num_layers=layers, q_lora_rank=q_lora_rank,
                                              moe_layer_freq=(0,) + (1,) * (layers - 1))
    with pytest.raises(MConvertError, match=f"{layers} layers and q_lora_rank={q_lora_rank}; llama.cpp's deepseek2 "
                                            "takes a model of 26 or 27 layers to be without q LoRA"):
        gguf_mod.gguf_layout(spec)


@pytest.mark.gguf
@pytest.mark.timeout(1800)
def test_the_refused_q_lora_case_is_one_llama_cpp_cannot_load(llama_cpp, monkeypatch):
    """Why the refusal above: the same file written without it (3 layers, no q LoRA) does not load in llama.cpp."""
    from mconvert.mappings import families

    monkeypatch.setattr(gguf_mod, "gguf_layout", lambda spec: families.of(spec).gguf)
    ckpt = moved_off_init_ckpt("tiny-deepseek-v3", q_lora_rank=None)
    bad = G / "refused-no-q-lora.gguf"
    bad.unlink(missing_ok=True)
    to_gguf(ckpt, bad, "f32", tokenizer=glm_tokenizer())
    from mconvert.validators.gguf_runner import run_llama_cpp

    with pytest.raises(MConvertError, match="llama.cpp cannot run this file"):
        run_llama_cpp(bad, {"generate": {"prompt": [5, 17], "max_tokens": 1}})


def _k_b_untransposed(spec, x):
    """The control's k_b: the per-head [nope, kv latent] block reshaped, not transposed, to the planned shape."""
    kv = x.reshape(spec.num_attention_heads, spec.qk_nope_head_dim + spec.v_head_dim, x.shape[-1])
    return kv[:, :spec.qk_nope_head_dim].reshape(spec.num_attention_heads, x.shape[-1], spec.qk_nope_head_dim)


@pytest.mark.gguf
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("control", ["k_b untransposed", "expert bias dropped", "V2 weights renormalised"])
def test_deepseek_gguf_controls_fail_the_comparison(llama_cpp, monkeypatch, control):
    """The controls of the comparison above: each changes one rule of the layout and llama.cpp's logits leave
    the f32 row."""
    real_layout, real_data = gguf_mod.gguf_layout, gguf_mod.gguf_data
    case = "deepseek_v3"
    if control == "V2 weights renormalised":  # DeepSeek-V2's router with V3's renormalisation of the top-k
        def layout(spec):
            out = real_layout(spec)
            return dataclasses.replace(out, metadata=lambda s: {**out.metadata(s), "expert_weights_norm": True})

        monkeypatch.setattr(gguf_mod, "gguf_layout", layout)
        case = "deepseek_v2 lite"
    elif control == "k_b untransposed":
        def layout(spec):
            out = real_layout(spec)
            (kb, _), vb = next(iter(out.pieces.values()))
            return dataclasses.replace(out, pieces={k: ((kb, _k_b_untransposed), vb) for k in out.pieces})

        monkeypatch.setattr(gguf_mod, "gguf_layout", layout)
    else:
        def data(spec, layout, hf_name, x, permute=True):
            x = real_data(spec, layout, hf_name, x, permute)
            return np.zeros_like(x) if hf_name.endswith("e_score_correction_bias") else x

        monkeypatch.setattr(gguf_mod, "gguf_data", data)
    _, hf = _sources(case)
    bad = G / f"control-{control.replace(' ', '-')}.gguf"
    bad.unlink(missing_ok=True)
    to_gguf(hf, bad, "f32", verb="hf-to-gguf")
    rep = validate(hf, [bad], device="cpu", n_tokens=32)
    print(f"[figures] control {control}: {_rel(rep.results[0]):.1e}")
    assert not rep.passed and any(f.startswith("max abs") for f in rep.results[0].failures), rep.results[0].metrics


# ---- YaRN (DeepSeek-V3's rope) --------------------------------------------------------------------------
YARN_TOKENS = 64  # twice tiny-deepseek-v3-yarn's original_max_position_embeddings (32): YaRN's stretch matters
# variant -> the rope_scaling keys changed in the export's config.json (None drops one; the weights stay the same):
# DeepSeek-V3's own pair (mscale = mscale_all_dim: `yarn_log_multiplier` alone), a cos/sin factor other than 1
# (mscale 0.5: `attn_factor` too, and a log multiplier other than 0.1·mscale_all_dim), and no pair (transformers
# then scales cos/sin by get_mscale(factor) and leaves the softmax: a negative log multiplier)
YARN_VARIANTS = {"v3": {}, "mscale-0.5": {"mscale": 0.5}, "no-mscale-pair": {"mscale": None, "mscale_all_dim": None}}


def _yarn_ckpt():
    return moved_off_init_ckpt("tiny-deepseek-v3-yarn")


def _yarn_hf(variant: str):
    """The megatron-to-hf export of tiny-deepseek-v3-yarn (every weight off its init), its rope_scaling changed
    as YARN_VARIANTS says."""
    import json
    import shutil

    from mconvert.convert.verbs import megatron_to_hf

    base = G / "hf-yarn-v3"
    if not (base / "config.json").is_file():
        megatron_to_hf(_yarn_ckpt(), base, tokenizer=glm_tokenizer())
    if not YARN_VARIANTS[variant]:
        return base
    out = G / f"hf-yarn-{variant}"
    if not (out / "config.json").is_file():
        # not its manifest: the changed config.json is a new input, not the export changed behind its back
        shutil.copytree(base, out, dirs_exist_ok=True, ignore=shutil.ignore_patterns("mconvert-manifest.json"))
        cfg = json.loads((base / "config.json").read_text())
        rs = {**cfg["rope_scaling"], **YARN_VARIANTS[variant]}
        cfg["rope_scaling"] = {k: v for k, v in rs.items() if v is not None}
        (out / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.mark.gguf
@pytest.mark.timeout(1800)
def test_deepseek_yarn_gguf_matches_transformers_in_llama_cpp(llama_cpp):
    """DeepSeek-V3's YaRN (factor 4 over 32 original positions here, 64 positions run) in llama.cpp's deepseek2:
    its logits at every position match transformers' DeepseekV3 for each mscale pair, and megatron-to-gguf
    writes what hf-to-gguf writes."""
    mg32, hf32 = _gguf(_yarn_ckpt(), "mg-yarn-v3", "f32"), _gguf(_yarn_hf("v3"), "hf-yarn-v3", "f32")
    assert _tensors(mg32) == _tensors(hf32)
    meta, mg_meta = read_gguf_metadata(hf32), read_gguf_metadata(mg32)
    rope = {k: v for k, v in meta.items() if k.startswith("deepseek2.rope.")}
    assert rope == {k: v for k, v in mg_meta.items() if k.startswith("deepseek2.rope.")}
    assert rope["deepseek2.rope.scaling.type"] == "yarn" and rope["deepseek2.rope.scaling.factor"] == 4.0
    assert rope["deepseek2.rope.scaling.original_context_length"] == 32
    # llama.cpp's own converter writes 0.1·mscale_all_dim here (test_gguf_peer compares the files)
    assert rope["deepseek2.rope.scaling.yarn_log_multiplier"] == pytest.approx(0.1)
    assert "deepseek2.rope.scaling.attn_factor" not in rope
    figures = []
    for variant in YARN_VARIANTS:
        hf = _yarn_hf(variant)
        path = hf32 if variant == "v3" else _gguf(hf, f"hf-yarn-{variant}", "f32")
        rep = validate(hf, [path], device="cpu", n_tokens=YARN_TOKENS)
        r = rep.results[0]
        keys = {k.rsplit(".", 1)[-1]: v for k, v in read_gguf_metadata(path).items()
                if k.startswith("deepseek2.rope.scaling.") and k.endswith(("yarn_log_multiplier", "attn_factor"))}
        figures.append(f"{variant} {keys} {_rel(r):.1e} top1 {r.metrics['top1']}")
        assert rep.passed and _rel(r) < REL_F32 and r.metrics["top1"] == 1.0, (variant, r.failures, r.metrics)
    print("[figures] YaRN deepseek2 llama.cpp vs transformers, 64 positions: " + "; ".join(figures))


def _spec_of(hf):
    import json

    from mconvert.mappings.families import spec_from_hf_config

    return spec_from_hf_config(json.loads((hf / "config.json").read_text()))


@pytest.mark.gguf
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("control", ["yarn_log_multiplier dropped", "attn_factor dropped"])
def test_deepseek_yarn_gguf_controls_fail_the_comparison(llama_cpp, monkeypatch, control):
    """Each key left out, llama.cpp's logits leave the f32 row: without `yarn_log_multiplier` deepseek2 takes the
    plain YaRN rule (cos and sin times get_mscale(factor)); without `attn_factor` it scales cos and sin by 1."""
    key = control.split()[0]
    real = gguf_mod.yarn_keys
    monkeypatch.setattr(gguf_mod, "yarn_keys", lambda spec, layout: {
        k: v for k, v in real(spec, layout).items() if k != key})
    hf = _yarn_hf("v3" if key == "yarn_log_multiplier" else "mscale-0.5")
    assert key in real(_spec_of(hf), gguf_mod.gguf_layout(_spec_of(hf)))  # the key the control drops is written
    bad = G / f"control-yarn-{key}.gguf"
    bad.unlink(missing_ok=True)
    to_gguf(hf, bad, "f32", verb="hf-to-gguf")
    rep = validate(hf, [bad], device="cpu", n_tokens=YARN_TOKENS)
    print(f"[figures] YaRN control {control}: {_rel(rep.results[0]):.1e}")
    assert not rep.passed and any(f.startswith("max abs") for f in rep.results[0].failures), rep.results[0].metrics


@pytest.mark.parametrize("changes,says", [
    ({"yarn_beta_fast": 1.0}, "YaRN with yarn_beta_fast=1.0 has no GGUF form: llama.cpp's deepseek2 architecture "
                              "fixes beta_fast 32 and beta_slow 1"),
    ({"yarn_mscale": -10 / math.log(4)}, "multiplies cos and sin by 0 and the softmax by 1.29648, and llama.cpp's "
                                         "deepseek2 multiplies the softmax by the square of its cos/sin factor"),
])
def test_deepseek_yarn_llama_cpp_computes_otherwise_is_refused_in_one_line(capsys, changes, says):
    """Kimi K2's betas (llama.cpp's deepseek2 reads none and uses 32 and 1), and a cos/sin factor of 0 (its softmax
    factor is that factor squared times a number, so it cannot keep the model's): one `error:` line, no file."""
    from safety_common import assert_one_line_error, run_cli

    out = G / "refused-yarn.gguf"
    out.unlink(missing_ok=True)
    code, _, err = run_cli(["megatron-to-gguf", moved_off_init_ckpt("tiny-deepseek-v3-yarn", **changes), out,
                            "--outtype", "f32", "--tokenizer", glm_tokenizer()], capsys)
    assert_one_line_error(code, err, says, "conversion refused")
    assert not out.exists()


# ---- Qwen2-MoE (llama.cpp's qwen2moe): the pre-softmax router and a sigmoid-gated shared expert ----------------
def _qwen2_moe_sources():
    """(the trainer's tiny-qwen2-moe moved off its init at TP=2 EP=2, its megatron-to-hf export)."""
    from mconvert.convert.verbs import megatron_to_hf, reshard

    ckpt, hf = G / "ckpt-qwen2-moe-tp2ep2", G / "hf-qwen2-moe"
    if not (ckpt / "latest_checkpointed_iteration.txt").is_file():
        reshard(moved_off_init_ckpt("tiny-qwen2-moe"), ckpt, tp=2, pp=1, ep=2)
    if not (hf / "config.json").is_file():
        megatron_to_hf(ckpt, hf, tokenizer=glm_tokenizer())
    return ckpt, hf


@pytest.mark.gguf
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("control", [None, "shared expert gate negated"])
def test_qwen2_moe_gguf_matches_transformers_in_llama_cpp(llama_cpp, monkeypatch, control):
    """tiny-qwen2-moe through megatron-to-gguf and hf-to-gguf: llama.cpp's f32 logits match transformers'
    Qwen2MoeForCausalLM on the export (whose top-k weights are not renormalised: llama.cpp's qwen2moe never does);
    the control, the shared expert's gate written negated (sigmoid(-x) = 1 - sigmoid(x)), leaves the f32 row."""
    ckpt, hf = _qwen2_moe_sources()
    spec = preset("tiny-qwen2-moe")
    if control is None:
        mg, hf32 = _gguf(ckpt, "mg-qwen2-moe", "f32"), _gguf(hf, "hf-qwen2-moe", "f32")
        assert _tensors(mg) == _tensors(hf32)
        meta = read_gguf_metadata(hf32)
        assert meta["general.architecture"] == "qwen2moe"
        assert meta["qwen2moe.expert_shared_feed_forward_length"] == spec.moe_shared_expert_intermediate_size
        assert meta["tensors"]["blk.0.ffn_gate_inp_shexp.weight"][0] == (1, spec.hidden_size)  # HF's [1, hidden]
        rep = validate(hf, [mg, hf32], device="cpu", n_tokens=32)
        print(f"[figures] qwen2_moe llama.cpp vs transformers: {_rel(rep.results[0]):.1e}")
        assert rep.passed and all(_rel(r) < REL_F32 and r.metrics["top1"] == 1.0 for r in rep.results), \
            [r.metrics for r in rep.results]
        checks = {c.name: c for c in verify(hf32, against=hf, device="cpu").checks}
        assert all(checks[c].status == "ok" for c in ("tensors", "load", "greedy", "logits")), checks
        return
    real_data = gguf_mod.gguf_data

    def data(spec, layout, hf_name, x, permute=True):
        x = real_data(spec, layout, hf_name, x, permute)
        return -x if hf_name.endswith("shared_expert_gate.weight") else x

    monkeypatch.setattr(gguf_mod, "gguf_data", data)
    bad = G / "control-qwen2-moe-gate.gguf"
    bad.unlink(missing_ok=True)
    to_gguf(hf, bad, "f32", verb="hf-to-gguf")
    rep = validate(hf, [bad], device="cpu", n_tokens=32)
    print(f"[figures] control {control}: {_rel(rep.results[0]):.1e}")
    assert not rep.passed and any(f.startswith("max abs") for f in rep.results[0].failures), rep.results[0].metrics


def test_qwen2_moe_renormalising_router_has_no_gguf_form(tmp_path):
    """norm_topk_prob true (megatron-core's default router): llama.cpp's qwen2moe never renormalises; refused in one
    line before anything is written."""
    from mconvert.convert.deploy import gguf as deploy_gguf

    with pytest.raises(MConvertError, match="qwen2moe never renormalises the top-k expert weights"):
        deploy_gguf.prepare(preset("tiny-qwen2-moe").replace(moe_router_pre_softmax=False), "f32", False)
