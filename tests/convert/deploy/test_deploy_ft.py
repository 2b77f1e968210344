"""FasterTransformer and TensorRT-LLM layouts: files/shapes as their loaders read them, logits vs transformers.

Truth we did not write: transformers' GPT2LMHeadModel / LlamaForCausalLM logits (of the HF export, for a
checkpoint trained by mconvert's TP=2 trainer), FT's loader file list (ParallelGptWeight.cc,
LlamaWeight.cc) and TensorRT-LLM's converter names, transcribed by hand below.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from mconvert.cli import main as cli_main
from mconvert.convert.verbs import hf_to_megatron, megatron_to_hf
from mconvert.convert.deploy.fastertransformer import check_ft_dir
from mconvert.convert.verbs import megatron_to_ft
from mconvert.convert.deploy.trtllm import check_trtllm_dir
from mconvert.convert.verbs import megatron_to_trtllm
from mconvert.errors import MConvertError
from mconvert.mappings.families import preset
from mconvert.validators.ft_runner import ft_logits
from mconvert.validators.trtllm_runner import trtllm_logits
from deploy_common import make_hf, rel


def hf_ref(hf_dir: Path, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()(tokens).logits


@pytest.fixture(scope="module")
def trained(tmp_path_factory, trained_checkpoint) -> dict:
    """GPT-2 style (4 heads of 32) trained 3 steps at TP=2 (the session's `trained_checkpoint`), and its HF
    export."""
    d = tmp_path_factory.mktemp("trained")
    ckpt = trained_checkpoint(preset="tiny-gpt2", tp=2, steps=3, num_attention_heads=4, hidden_size=128,
                              micro_batch_size=2, global_batch_size=4, seq_length=32)
    megatron_to_hf(ckpt, d / "hf")
    tokens = torch.randint(0, 1000, (2, 24), generator=torch.Generator().manual_seed(1))
    return {"ckpt": ckpt, "hf": d / "hf", "tokens": tokens, "ref": hf_ref(d / "hf", tokens), "dir": d}


@pytest.fixture(scope="module")
def llama_mha(tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("llama")
    spec = preset("tiny-llama").replace(num_query_groups=None, tie_embeddings=False)
    hf = make_hf(spec, d / "hf")
    tokens = torch.randint(0, 1000, (2, 20), generator=torch.Generator().manual_seed(2))
    return {"hf": hf, "tokens": tokens, "ref": hf_ref(hf, tokens), "dir": d, "spec": spec}


# ---- FT [gpt] from a checkpoint trained at TP=2 ----------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("infer_tp", [1, 2, 4])
def test_trained_tp2_gpt_to_ft_layout_and_logits(trained, infer_tp):
    out = trained["dir"] / f"ft{infer_tp}"
    res = megatron_to_ft(trained["ckpt"], out, infer_tp)
    ft = out / f"{infer_tp}-gpu"
    assert res.section == "gpt" and ft.is_dir()
    assert check_ft_dir(out) == []
    # the loader's file list, transcribed from ParallelGptWeight.cc / ParallelGptDecoderLayerWeight.cc
    H, F, L, V, P, t = 128, 256, 2, 1000, 128, infer_tp
    want = {"model.wpe.bin": P * H, "model.wte.bin": V * H, "model.final_layernorm.bias.bin": H,
            "model.final_layernorm.weight.bin": H}
    for i in range(L):
        for n in ("input_layernorm.bias", "input_layernorm.weight", "attention.dense.bias",
                  "post_attention_layernorm.bias", "post_attention_layernorm.weight", "mlp.dense_4h_to_h.bias"):
            want[f"model.layers.{i}.{n}.bin"] = H
        for r in range(t):
            want[f"model.layers.{i}.attention.query_key_value.bias.{r}.bin"] = 3 * H // t
            want[f"model.layers.{i}.attention.query_key_value.weight.{r}.bin"] = H * 3 * H // t
            want[f"model.layers.{i}.attention.dense.weight.{r}.bin"] = H // t * H
            want[f"model.layers.{i}.mlp.dense_h_to_4h.weight.{r}.bin"] = H * F // t
            want[f"model.layers.{i}.mlp.dense_h_to_4h.bias.{r}.bin"] = F // t
            want[f"model.layers.{i}.mlp.dense_4h_to_h.weight.{r}.bin"] = F // t * H
    have = {p.name: p.stat().st_size for p in ft.glob("*.bin")}
    assert have == {k: 4 * n for k, n in want.items()}  # tied: no model.lm_head.weight.bin
    import configparser

    cp = configparser.ConfigParser()
    cp.read(ft / "config.ini")
    g = cp["gpt"]
    assert (g["head_num"], g["size_per_head"], g["inter_size"], g["num_layer"], g["vocab_size"]) == (
        "4", "32", "256", "2", "1000")
    assert float(g["layernorm_eps"]) == 1e-5 and g["tensor_para_size"] == str(t) and g["weight_data_type"] == "fp32"
    assert rel(ft_logits(out, trained["tokens"]), trained["ref"]) <= 1e-5


@pytest.mark.slow
def test_trained_gpt_to_ft_fp16(trained):
    out = trained["dir"] / "ft16"
    megatron_to_ft(trained["ckpt"], out, 2, dtype="fp16")
    assert check_ft_dir(out) == []
    assert (out / "2-gpu" / "model.wte.bin").stat().st_size == 1000 * 128 * 2
    assert rel(ft_logits(out, trained["tokens"]), trained["ref"]) <= 2e-2


@pytest.mark.slow
def test_ft_check_fails_what_ft_would_only_warn_about(trained):
    out = trained["dir"] / "ft2b"
    megatron_to_ft(trained["ckpt"], out, 2)
    ft = out / "2-gpu"
    short = ft / "model.layers.1.attention.query_key_value.weight.1.bin"
    short.write_bytes(short.read_bytes()[:-4])
    (ft / "model.layers.0.mlp.dense_4h_to_h.weight.0.bin").unlink()
    (ft / "model.layers.0.mlp.dense_4h_to_h.weight.7.bin").write_bytes(b"\0" * 8)
    problems = check_ft_dir(out)
    assert any(short.name in p and "bytes" in p for p in problems)
    assert any("dense_4h_to_h.weight.0.bin" in p and "missing" in p for p in problems)
    assert any("weight.7.bin" in p and "stray" in p for p in problems)
    with pytest.raises(MConvertError, match="not a loadable FT directory"):
        ft_logits(out, trained["tokens"])
    ini = (ft / "config.ini").read_text()
    (ft / "config.ini").write_text("\n".join(ln for ln in ini.splitlines() if not ln.startswith("layernorm_eps")))
    assert any("layernorm_eps" in p for p in check_ft_dir(out))


def test_ft_head_file_unties_the_head(tmp_path):
    """FT semantics: a present model.lm_head.weight.bin is the head, absent = model.wte.bin."""
    spec = preset("tiny-gpt2")
    hf = make_hf(spec, tmp_path / "hf")
    megatron_to_ft(hf, tmp_path / "ft", 1)
    tokens = torch.randint(0, 1000, (1, 10), generator=torch.Generator().manual_seed(3))
    base = ft_logits(tmp_path / "ft", tokens)
    assert rel(base, hf_ref(hf, tokens)) <= 1e-5
    ft = tmp_path / "ft" / "1-gpu"
    wte = np.fromfile(ft / "model.wte.bin", dtype="<f4")
    (2 * wte).astype("<f4").tofile(ft / "model.lm_head.weight.bin")
    assert check_ft_dir(tmp_path / "ft") == []
    assert torch.equal(ft_logits(tmp_path / "ft", tokens), 2 * base)


def test_ft_refusals(tmp_path):
    gqa = make_hf(preset("tiny-llama"), tmp_path / "gqa")  # 4 heads, 2 KV groups
    with pytest.raises(MConvertError, match="grouped-query") as e:
        megatron_to_ft(gqa, tmp_path / "o1", 1)
    assert "\n" not in str(e.value)
    assert not (tmp_path / "o1").exists()
    erf = make_hf(preset("tiny-gpt2").replace(activation="gelu"), tmp_path / "erf")
    with pytest.raises(MConvertError, match="tanh GeLU"):
        megatron_to_ft(erf, tmp_path / "o2", 1)
    with pytest.raises(MConvertError, match="does not divide"):
        megatron_to_ft(erf, tmp_path / "o3", 3, allow_approx_gelu=True)
    # written on request, and the runner then computes what FT computes (tanh), not the erf model
    megatron_to_ft(erf, tmp_path / "o2", 2, allow_approx_gelu=True)
    tokens = torch.randint(0, 1000, (1, 12), generator=torch.Generator().manual_seed(4))
    d = rel(ft_logits(tmp_path / "o2", tokens), hf_ref(erf, tokens))
    assert 1e-6 < d < 1e-2
    theta = make_hf(preset("tiny-llama").replace(num_query_groups=None, rotary_base=500000.0), tmp_path / "th")
    with pytest.raises(MConvertError, match="rotary base"):
        megatron_to_ft(theta, tmp_path / "o4", 1)


def test_cli_refusal_is_one_line(tmp_path, capsys):
    gqa = make_hf(preset("tiny-llama"), tmp_path / "gqa")
    with pytest.raises(SystemExit) as e:
        cli_main(["megatron-to-ft", str(gqa), str(tmp_path / "out"), "--infer-tp", "2"])
    assert e.value.code == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "grouped-query" in err and "Traceback" not in err


# ---- FT [llama] -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("infer_tp", [1, 2, 4])
def test_llama_mha_to_ft_llama_layout_and_logits(llama_mha, infer_tp):
    out = llama_mha["dir"] / f"ft{infer_tp}"
    res = megatron_to_ft(llama_mha["hf"], out, infer_tp)
    assert res.section == "llama" and check_ft_dir(out) == []
    ft = out / f"{infer_tp}-gpu"
    H, F, t = 128, 256, infer_tp
    assert (ft / "model.wte.weight.bin").stat().st_size == 1000 * H * 4
    assert (ft / "model.lm_head.weight.bin").stat().st_size == 1000 * H * 4
    assert (ft / f"model.layers.1.attention.query_key_value.weight.{t - 1}.bin").stat().st_size == H * 3 * H // t * 4
    assert (ft / f"model.layers.0.mlp.up_proj.weight.{t - 1}.bin").stat().st_size == H * F // t * 4
    assert not list(ft.glob("*bias*"))
    text = (ft / "config.ini").read_text()
    assert "[llama]" in text and "rotary_embedding = 32" in text and "layernorm_eps = 1e-05" in text
    assert rel(ft_logits(out, llama_mha["tokens"]), llama_mha["ref"]) <= 1e-5


def test_llama_from_megatron_tp2_and_tied_head(llama_mha, tmp_path):
    ckpt = tmp_path / "ckpt"
    hf_to_megatron(llama_mha["hf"], ckpt, tp=2)
    megatron_to_ft(ckpt, tmp_path / "ft", 4)
    assert rel(ft_logits(tmp_path / "ft", llama_mha["tokens"]), llama_mha["ref"]) <= 1e-5
    tied = make_hf(llama_mha["spec"].replace(tie_embeddings=True), tmp_path / "tied")
    megatron_to_ft(tied, tmp_path / "ft_tied", 2)
    ft = tmp_path / "ft_tied" / "2-gpu"
    assert (ft / "model.lm_head.weight.bin").read_bytes() == (ft / "model.wte.weight.bin").read_bytes()
    assert rel(ft_logits(tmp_path / "ft_tied", llama_mha["tokens"]), hf_ref(tied, llama_mha["tokens"])) <= 1e-5


# ---- TensorRT-LLM ----------------------------------------------------------------------------------------
def _trt_layer_names(gpt: bool) -> set[str]:
    """One layer's tensors as TensorRT-LLM's gpt/convert.py and llama/convert.py name them."""
    if gpt:
        return {f"{m}.{s}" for m in ("input_layernorm", "post_layernorm", "attention.qkv", "attention.dense",
                                     "mlp.fc", "mlp.proj") for s in ("weight", "bias")}
    return {"input_layernorm.weight", "post_layernorm.weight", "attention.qkv.weight", "attention.dense.weight",
            "mlp.fc.weight", "mlp.gate.weight", "mlp.proj.weight"}


def _names(f: Path) -> dict[str, list[int]]:
    from safetensors import safe_open

    with safe_open(f, "pt") as h:
        return {k: list(h.get_slice(k).get_shape()) for k in h.keys()}


@pytest.mark.slow
def test_trtllm_from_trained_gpt(trained):
    out = trained["dir"] / "trt"
    megatron_to_trtllm(trained["ckpt"], out, tp=2)
    assert check_trtllm_dir(out) == []
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architecture"] == "GPT2LMHeadModel" and cfg["mapping"]["tp_size"] == 2
    assert cfg["position_embedding_type"] == "learned_absolute" and cfg["norm_epsilon"] == 1e-5
    names = _names(out / "rank1.safetensors")
    top = {"transformer.vocab_embedding.weight", "transformer.position_embedding.weight", "transformer.ln_f.weight",
           "transformer.ln_f.bias", "lm_head.weight"}
    want = top | {f"transformer.layers.{i}.{n}" for i in range(2) for n in _trt_layer_names(True)}
    assert set(names) == want
    assert names["transformer.layers.0.attention.qkv.weight"] == [3 * 128 // 2, 128]
    assert names["transformer.layers.0.attention.dense.weight"] == [128, 64]
    assert names["transformer.layers.0.mlp.fc.weight"] == [128, 128]
    assert names["lm_head.weight"] == [500, 128]
    assert rel(trtllm_logits(out, trained["tokens"]), trained["ref"]) <= 1e-5


def test_trtllm_rank_files_written_with_o_direct_are_the_buffered_bytes(tmp_path, monkeypatch):
    """Large rank files go out with O_DIRECT at any offset in any order (`io.hashing.RandomDirectFile`): the
    same tiny model written that way holds the bytes of the buffered write (whose logits TensorRT-LLM's
    reader checks below), its manifest re-hashed from disk agrees, and TensorRT-LLM's reader gets the logits."""
    import mconvert.io.safetensors as st
    from mconvert.io.atomic import check_manifest

    hf = make_hf(preset("tiny-llama"), tmp_path / "hf")
    megatron_to_trtllm(hf, tmp_path / "buffered", tp=2)
    opened = []

    class Spy(st.RandomDirectFile):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            opened.append(self.direct)

    monkeypatch.setattr(st, "DIRECT_MIN_BYTES", 0)
    monkeypatch.setattr(st, "RandomDirectFile", Spy)
    megatron_to_trtllm(hf, tmp_path / "direct", tp=2)
    if not all(opened):
        pytest.skip("this file system refuses O_DIRECT")
    assert len(opened) == 2
    for name in ("rank0.safetensors", "rank1.safetensors", "config.json"):
        assert (tmp_path / "direct" / name).read_bytes() == (tmp_path / "buffered" / name).read_bytes(), name
    assert check_manifest(tmp_path / "direct") == []
    tokens = torch.randint(0, 1000, (2, 12), generator=torch.Generator().manual_seed(5))
    assert rel(trtllm_logits(tmp_path / "direct", tokens), hf_ref(hf, tokens)) <= 1e-5


def test_trtllm_llama_gqa_shapes_and_logits(tmp_path):
    spec = preset("tiny-llama")  # 4 heads of 32, 2 KV heads, untied
    hf = make_hf(spec, tmp_path / "hf")
    tokens = torch.randint(0, 1000, (2, 12), generator=torch.Generator().manual_seed(5))
    ref = hf_ref(hf, tokens)
    for tp, qkv_rows in ((2, (2 + 2 * 1) * 32), (4, (1 + 2 * 1) * 32)):  # tp=4: KV heads duplicated
        out = tmp_path / f"trt{tp}"
        megatron_to_trtllm(hf, out, tp=tp)
        assert check_trtllm_dir(out) == []
        cfg = json.loads((out / "config.json").read_text())
        assert (cfg["architecture"], cfg["num_key_value_heads"], cfg["position_embedding_type"]) == (
            "LlamaForCausalLM", 2, "rope_gpt_neox")
        names = _names(out / f"rank{tp - 1}.safetensors")
        want = {"transformer.vocab_embedding.weight", "transformer.ln_f.weight", "lm_head.weight"}
        want |= {f"transformer.layers.{i}.{n}" for i in range(2) for n in _trt_layer_names(False)}
        assert set(names) == want
        assert names["transformer.layers.1.attention.qkv.weight"] == [qkv_rows, 128]
        assert names["transformer.layers.1.mlp.gate.weight"] == [256 // tp, 128]
        assert names["lm_head.weight"] == [-(-1000 // tp), 128]
        assert rel(trtllm_logits(out, tokens), ref) <= 1e-5
    # the checker catches a wrong shape and a missing tensor
    from safetensors.torch import load_file, save_file

    f = tmp_path / "trt2" / "rank0.safetensors"
    t = load_file(f)
    t["transformer.layers.0.mlp.fc.weight"] = t["transformer.layers.0.mlp.fc.weight"][:-1].clone()
    del t["transformer.layers.1.post_layernorm.weight"]
    save_file(t, f)
    problems = check_trtllm_dir(tmp_path / "trt2")
    assert any("mlp.fc.weight has shape [127, 128]" in p for p in problems)
    assert any("missing tensor transformer.layers.1.post_layernorm.weight" in p for p in problems)
