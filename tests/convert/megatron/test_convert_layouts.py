"""Megatron layouts built by hand from the format facts (not by mconvert's writer), read by mconvert and
checked against transformers' logits: GQA group order, SwiGLU halves per TP rank, legacy nested GPT-2
files as transformers' own script writes them, TE spellings, VPP interleaving, and one-line errors."""

from __future__ import annotations

import argparse
import io
import json
import shutil
import types
from pathlib import Path

import pytest
import torch
from hf_ref import hf_logits
from safetensors.torch import load_file
import transformers

from mconvert.convert.verbs import hf_to_megatron, megatron_to_hf
from mconvert.io.safeload import safe_load
from mconvert.errors import MConvertError
TOKENS = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6, 5, 35, 89, 79]])


def _rand(model):
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return model.eval()


def _save(root: Path, it: str, tp_rank: int, pp_rank: int, pp: int, state: dict) -> None:
    name = f"mp_rank_{tp_rank:02d}" if pp == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
    d = root / it / name
    d.mkdir(parents=True, exist_ok=True)
    torch.save(state, d / "model_optim_rng.pt")


# ---- Llama GQA + SwiGLU, TP=2, written by hand -----------------------------------------------------------
NQ, NG, HD, H, F, V, L = 4, 2, 8, 32, 48, 100, 2


@pytest.fixture(scope="module")
def llama():
    cfg = transformers.LlamaConfig(hidden_size=H, intermediate_size=F, num_hidden_layers=L, num_attention_heads=NQ,
                                   num_key_value_heads=NG, vocab_size=V, max_position_embeddings=32, rms_norm_eps=1e-5)
    return _rand(transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager"))


def _hand_llama(model, root: Path, tp: int, wrong: str | None = None) -> None:
    """Megatron mcore-local files from HF weights, following DESIGN.md's layout facts literally."""
    sd = model.state_dict()
    pad = 128 * tp
    padded = -(-V // pad) * pad
    args = argparse.Namespace(
        num_layers=L, hidden_size=H, ffn_hidden_size=F, num_attention_heads=NQ, group_query_attention=True,
        num_query_groups=NG, kv_channels=HD, max_position_embeddings=32, padded_vocab_size=padded, vocab_size=V,
        make_vocab_size_divisible_by=128, normalization="RMSNorm", norm_epsilon=1e-5, swiglu=True,
        position_embedding_type="rope", rotary_base=10000, untie_embeddings_and_output_weights=True,
        add_bias_linear=False, tensor_model_parallel_size=tp, pipeline_model_parallel_size=1)

    def vocab(t):
        return torch.cat([t, torch.zeros(padded - V, H)]).chunk(tp)

    for r in range(tp):
        m = {"embedding.word_embeddings.weight": vocab(sd["model.embed_tokens.weight"])[r].clone()}
        for i in range(L):
            p, q = f"decoder.layers.{i}.", f"model.layers.{i}."
            qw = sd[q + "self_attn.q_proj.weight"].view(NG, NQ // NG, HD, H)
            kw = sd[q + "self_attn.k_proj.weight"].view(NG, 1, HD, H)
            vw = sd[q + "self_attn.v_proj.weight"].view(NG, 1, HD, H)
            if wrong == "qkv-blocks":  # q | k | v blocks instead of per-group interleaving
                fused = torch.cat([qw.reshape(-1, H), kw.reshape(-1, H), vw.reshape(-1, H)])
            else:
                fused = torch.cat([qw, kw, vw], dim=1).reshape(-1, H)
            gate, up = sd[q + "mlp.gate_proj.weight"], sd[q + "mlp.up_proj.weight"]
            if wrong == "swiglu-cat-then-chunk":
                fc1 = torch.cat([gate, up]).chunk(tp)[r]
            else:
                fc1 = torch.cat([gate.chunk(tp)[r], up.chunk(tp)[r]])
            m.update({
                p + "input_layernorm.weight": sd[q + "input_layernorm.weight"].clone(),
                p + "self_attention.linear_qkv.weight": fused.chunk(tp)[r].clone(),
                p + "self_attention.linear_qkv._extra_state": None,
                p + "self_attention.linear_proj.weight": sd[q + "self_attn.o_proj.weight"].chunk(tp, 1)[r].clone(),
                p + "pre_mlp_layernorm.weight": sd[q + "post_attention_layernorm.weight"].clone(),
                p + "mlp.linear_fc1.weight": fc1.clone(),
                p + "mlp.linear_fc2.weight": sd[q + "mlp.down_proj.weight"].chunk(tp, 1)[r].clone(),
            })
        m["decoder.final_layernorm.weight"] = sd["model.norm.weight"].clone()
        m["output_layer.weight"] = vocab(sd["lm_head.weight"])[r].clone()
        _save(root, "iter_0000007", r, 0, 1, {"args": args, "checkpoint_version": 3.0, "iteration": 7, "model": m})
    (root / "latest_checkpointed_iteration.txt").write_text("7")


def test_gqa_and_swiglu_layout_match_transformers_logits(llama, tmp_path):
    with torch.no_grad():
        want = llama(TOKENS).logits
    _hand_llama(llama, tmp_path / "mg", tp=2)
    megatron_to_hf(tmp_path / "mg", tmp_path / "hf")
    assert torch.equal(hf_logits(tmp_path / "hf", TOKENS, "eager"), want)
    back = load_file(tmp_path / "hf" / "model.safetensors")
    for k, v in llama.state_dict().items():
        assert torch.equal(back[k], v), k


@pytest.mark.parametrize("wrong", ["qkv-blocks", "swiglu-cat-then-chunk"])
def test_a_wrong_layout_changes_the_logits(llama, tmp_path, wrong):
    """The pinned test above can fail: the same files with a wrong order give other logits."""
    with torch.no_grad():
        want = llama(TOKENS).logits
    _hand_llama(llama, tmp_path / "mg", tp=2, wrong=wrong)
    megatron_to_hf(tmp_path / "mg", tmp_path / "hf")
    assert (hf_logits(tmp_path / "hf", TOKENS, "eager") - want).abs().max() > 1e-3


# ---- GPT-2 legacy nested files, as transformers' checkpoint_reshaping_and_interoperability.py writes ------
@pytest.fixture(scope="module")
def gpt2():
    cfg = transformers.GPT2Config(n_embd=32, n_layer=4, n_head=4, vocab_size=100, n_positions=32,
                                  activation_function="gelu_new")
    return _rand(transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager"))


def _old_qkv(shard: torch.Tensor, version: float, hd: int) -> torch.Tensor:
    """One rank's qkv rows [np, 3, hd] (version >= 2) in the order older Megatron wrote: 0 = [3, np, hd],
    1 = [np, hd, 3]."""
    rest = tuple(shard.shape[1:])
    g = shard.reshape(-1, 3, hd, *rest)
    if version == 0:
        return g.transpose(0, 1).reshape(shard.shape).clone()
    if version == 1:
        return g.transpose(1, 2).reshape(shard.shape).clone()
    return shard


def _legacy_gpt2(model, root: Path, tp: int, pp: int, version: float = 3.0) -> None:
    sd = model.state_dict()
    nh, hd, n_layer = 4, 8, 4
    padded = -(-V // (128 * tp)) * 128 * tp
    wte = sd["transformer.wte.weight"]
    wte_pad = torch.cat([wte, wte[-1:].expand(padded - V, -1)])  # padded rows copy the last real row
    margs = types.SimpleNamespace(orig_vocab_size=V, max_position_embeddings=32, hidden_size=32, num_layers=n_layer,
                                  num_attention_heads=nh, ffn_hidden_size=None, tensor_model_parallel_size=tp,
                                  pipeline_model_parallel_size=pp, make_vocab_size_divisible_by=128,
                                  tokenizer_type="GPT2BPETokenizer", bias_gelu_fusion=False, openai_gelu=True,
                                  params_dtype=torch.float32, padded_vocab_size=padded)
    per = n_layer // pp
    for p in range(pp):
        for r in range(tp):
            enc = {}
            for local in range(per):
                h = f"transformer.h.{p * per + local}."
                e = f"layers.{local}."

                def qkv(t):  # [3, nh, hd] -> [nh, 3, hd] (checkpoint_version 3.0)
                    return t.reshape(3, nh, hd, *t.shape[1:]).transpose(0, 1).reshape(t.shape)

                enc.update({
                    e + "input_layernorm.weight": sd[h + "ln_1.weight"], e + "input_layernorm.bias": sd[h + "ln_1.bias"],
                    e + "self_attention.query_key_value.weight":
                        _old_qkv(qkv(sd[h + "attn.c_attn.weight"].t()).chunk(tp)[r], version, hd),
                    e + "self_attention.query_key_value.bias":
                        _old_qkv(qkv(sd[h + "attn.c_attn.bias"]).chunk(tp)[r], version, hd),
                    e + "self_attention.dense.weight": sd[h + "attn.c_proj.weight"].t().chunk(tp, 1)[r].clone(),
                    e + "self_attention.dense.bias": sd[h + "attn.c_proj.bias"],
                    e + "post_attention_layernorm.weight": sd[h + "ln_2.weight"],
                    e + "post_attention_layernorm.bias": sd[h + "ln_2.bias"],
                    e + "mlp.dense_h_to_4h.weight": sd[h + "mlp.c_fc.weight"].t().chunk(tp)[r].clone(),
                    e + "mlp.dense_h_to_4h.bias": sd[h + "mlp.c_fc.bias"].chunk(tp)[r].clone(),
                    e + "mlp.dense_4h_to_h.weight": sd[h + "mlp.c_proj.weight"].t().chunk(tp, 1)[r].clone(),
                    e + "mlp.dense_4h_to_h.bias": sd[h + "mlp.c_proj.bias"],
                })
            model_d: dict = {"language_model": {"encoder": enc}}
            if p == 0:
                model_d["language_model"]["embedding"] = {
                    "word_embeddings": {"weight": wte_pad.chunk(tp)[r].clone()},
                    "position_embeddings": {"weight": sd["transformer.wpe.weight"]},
                }
            if p == pp - 1:
                enc["final_layernorm.weight"] = sd["transformer.ln_f.weight"]
                enc["final_layernorm.bias"] = sd["transformer.ln_f.bias"]
                model_d["word_embeddings_for_head"] = {"weight": wte_pad.chunk(tp)[r].clone()}
            opt = {"step": 0, "param_groups": [{"lr": 0.0, "params": []}]}
            _save(root, "release", r, p, pp, {"model": model_d, "checkpoint_version": version, "args": margs,
                                              "optimizer": opt})
    (root / "latest_checkpointed_iteration.txt").write_text("release")


@pytest.mark.parametrize("tp,pp,version", [(1, 1, 3.0), (2, 2, 3.0), (2, 1, 0), (2, 2, 1.0)])
def test_legacy_nested_gpt2_converts_back_equal(gpt2, tmp_path, tp, pp, version):
    _legacy_gpt2(gpt2, tmp_path / "mg", tp, pp, version)
    rep = megatron_to_hf(tmp_path / "mg", tmp_path / "hf")
    assert rep["warnings"] == []
    back = load_file(tmp_path / "hf" / "model.safetensors")
    want = {k: v for k, v in gpt2.state_dict().items() if k != "lm_head.weight" and not k.endswith((".attn.bias", ".attn.masked_bias"))}
    assert sorted(back) == sorted(want)
    for k, v in want.items():
        assert torch.equal(back[k], v), k
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["n_inner"] == 128 and cfg["activation_function"] == "gelu_new" and cfg["vocab_size"] == V
    with torch.no_grad():
        assert torch.equal(hf_logits(tmp_path / "hf", TOKENS, "eager"), gpt2(TOKENS).logits)


def test_te_spelling_extra_state_and_vpp_interleaving(gpt2, tmp_path):
    """mconvert's VPP files, rewritten with TE names and extra states, read back identical; the rank/chunk
    that holds each global layer follows Megatron's interleaving (PP=2, VPP=2: rank 0 holds layers 0 and 2)."""
    gpt2.save_pretrained(tmp_path / "src")
    hf_to_megatron(tmp_path / "src", tmp_path / "mg", tp=2, pp=2, vpp=2)
    sd = gpt2.state_dict()
    for f in (tmp_path / "mg" / "release").glob("mp_rank_*/model_optim_rng.pt"):
        st = safe_load(f)
        assert "model" not in st and set(k for k in st if k.startswith("model")) == {"model0", "model1"}
        pp_rank = int(f.parent.name[-3:])
        for c in (0, 1):
            m = dict(st[f"model{c}"])
            glob = c * 2 + pp_rank
            assert torch.equal(m["decoder.layers.0.input_layernorm.weight"], sd[f"transformer.h.{glob}.ln_1.weight"])
            te = {}
            for k, v in m.items():
                k = k.replace("input_layernorm.", "self_attention.linear_qkv.layer_norm_")
                k = k.replace("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_")
                te[k] = v
                if k.endswith("linear_qkv.weight"):
                    te[k.replace("weight", "_extra_state")] = io.BytesIO(b"fp8-meta")
                    te[k.replace("linear_qkv.weight", "core_attention._extra_state")] = torch.zeros(3, dtype=torch.uint8)
            st[f"model{c}"] = te
        torch.save(st, f.with_suffix(".tmp"))  # st is memory-mapped from f: never truncate it in place
        f.with_suffix(".tmp").replace(f)
    (tmp_path / "mg" / "mconvert-manifest.json").unlink(missing_ok=True)  # the files changed on purpose
    megatron_to_hf(tmp_path / "mg", tmp_path / "hf")
    back = load_file(tmp_path / "hf" / "model.safetensors")
    for k, v in load_file(tmp_path / "src" / "model.safetensors").items():
        assert torch.equal(back[k], v), k


# ---- errors: one line, naming the key and the file ---------------------------------------------------------
def test_unmapped_key_names_key_and_file(llama, tmp_path):
    _hand_llama(llama, tmp_path / "mg", tp=1)
    f = tmp_path / "mg" / "iter_0000007" / "mp_rank_00" / "model_optim_rng.pt"
    st = torch.load(f, weights_only=False)
    st["model"]["decoder.layers.0.self_attention.q_layernorm.weight"] = torch.zeros(8)
    torch.save(st, f)
    with pytest.raises(MConvertError) as e:
        megatron_to_hf(tmp_path / "mg", tmp_path / "hf")
    msg = str(e.value)
    assert "decoder.layers.0.self_attention.q_layernorm.weight" in msg and str(f) in msg and "\n" not in msg
    assert not (tmp_path / "hf").exists()


def test_iteration_choice_and_broken_inputs(llama, tmp_path):
    root = tmp_path / "mg"
    _hand_llama(llama, root, tp=1)
    shutil.copytree(root / "iter_0000007", root / "iter_0000009")
    st = torch.load(root / "iter_0000009/mp_rank_00/model_optim_rng.pt", weights_only=False)
    st["model"]["decoder.final_layernorm.weight"] = torch.full((H,), 9.0)
    st["iteration"] = 9  # as Megatron-LM saves iteration 9 (a copy still saying 7 is refused: its directory is 9)
    torch.save(st, root / "iter_0000009/mp_rank_00/model_optim_rng.pt")
    megatron_to_hf(root, tmp_path / "h7")  # tracker says 7
    megatron_to_hf(root, tmp_path / "h9", iteration="9")
    assert load_file(tmp_path / "h9" / "model.safetensors")["model.norm.weight"].eq(9).all()
    assert not load_file(tmp_path / "h7" / "model.safetensors")["model.norm.weight"].eq(9).all()
    with pytest.raises(MConvertError, match="iter_0000008: no such iteration directory; available: iter_0000007"):
        megatron_to_hf(root, tmp_path / "x", iteration="8")
    (root / "latest_checkpointed_iteration.txt").write_text("garbage")
    with pytest.raises(MConvertError, match="expected an iteration number"):
        megatron_to_hf(root, tmp_path / "x")
    (root / "latest_checkpointed_iteration.txt").write_text("7")
    (root / "iter_0000007/mp_rank_00/model_optim_rng.pt").write_bytes(b"PK\x03\x04truncated")
    with pytest.raises(MConvertError, match="truncated or corrupt"):
        megatron_to_hf(root, tmp_path / "x")
    with pytest.raises(MConvertError, match="no such file"):
        megatron_to_hf(tmp_path / "nope", tmp_path / "x")
