"""Block-scaled FP8 HF checkpoints (DeepSeek-V3 / Kimi K2 release layout): read dequantized by every verb that reads
HF, written by `megatron-to-hf --fp8-blocks`.

The test's own block rule is written here from the published code, not from mconvert's: quantizing as
transformers 4.57.6's `FineGrainedFP8HfQuantizer.create_quantized_param` does (per block `scale = 448 / max|w|`,
`q = clamp(w · scale)` in e4m3, `weight_scale_inv = 1 / scale`, scales `[ceil(rows/128), ceil(cols/128)]` as
`FP8Linear` declares them), dequantizing as DeepSeek's `inference/kernel.py` `weight_dequant` does
(`q · s` per 128×128 block, partial blocks masked). Our `--fp8-blocks` output holds e4m3 weights exactly where
transformers' `replace_with_fp8_linear` puts FP8Linear modules (its loader and forward need triton, accelerate and
a GPU, absent here).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from deploy_common import make_hf
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from safety_common import run_cli

from mconvert.convert.verbs import hf_to_megatron, megatron_to_hf
from mconvert.mappings.families import preset

pytestmark = pytest.mark.slow
BLOCK = 128
SPEC = preset("tiny-deepseek-v3").replace(mtp_num_layers=None)
PROJ = ("_proj.weight", "_proj_with_mqa.weight")  # the linear projections DeepSeek's release stores in FP8


def _quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' block rule, with DeepSeek's partial blocks (padded with zeros, which change no maximum)."""
    rows, cols = w.shape
    br, bc = math.ceil(rows / BLOCK), math.ceil(cols / BLOCK)
    x = torch.zeros(br * BLOCK, bc * BLOCK)
    x[:rows, :cols] = w.float()
    blocks = x.reshape(br, BLOCK, bc, BLOCK).permute(0, 2, 1, 3)
    scale = 448.0 / blocks.abs().amax(dim=(-1, -2))
    q = torch.clamp(blocks * scale[..., None, None], -448.0, 448.0).to(torch.float8_e4m3fn)
    q = q.permute(0, 2, 1, 3).reshape(br * BLOCK, bc * BLOCK)[:rows, :cols].contiguous()
    return q, scale.reciprocal()


def _dequantize(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """DeepSeek's weight_dequant: each element times its block's scale (fp32)."""
    expanded = s.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[: q.shape[0], : q.shape[1]]
    return q.float() * expanded


def _round_off_ok(got: torch.Tensor, want: torch.Tensor, s: torch.Tensor) -> bool:
    """Within e4m3 round-off: half a unit in the 3-bit mantissa of the value (2^-4 relative), or half the
    smallest subnormal step of its block (2^-10 · scale_inv · 448 / 448 · ... = 2^-9 · scale_inv), plus bf16's."""
    scale = s.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[: want.shape[0], : want.shape[1]]
    bound = torch.maximum(want.abs().float() * 2**-4, scale * 2**-9) + want.abs().float() * 2**-8 + 1e-12
    return bool(((got.float() - want.float()).abs() <= bound).all())


@pytest.fixture(scope="module")
def bf16_hf(tmp_path_factory) -> Path:
    d = make_hf(SPEC, tmp_path_factory.mktemp("fp8") / "bf16")
    cfg = json.loads((d / "config.json").read_text())
    st = {k: v.to(torch.bfloat16) for k, v in load_file(d / "model.safetensors").items()}
    save_file(st, str(d / "model.safetensors"), metadata={"format": "pt"})
    cfg["torch_dtype"] = "bfloat16"
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.fixture(scope="module")
def fp8_hf(bf16_hf, tmp_path_factory) -> Path:
    """The bf16 model quantized by the published rule, in DeepSeek-V3's layout (scales in another file than
    some of their weights, as a release's shards may put them)."""
    d = tmp_path_factory.mktemp("fp8") / "fp8"
    d.mkdir()
    src = load_file(bf16_hf / "model.safetensors")
    a, b = {}, {}
    for i, (k, v) in enumerate(sorted(src.items())):
        if k.endswith(PROJ):
            a[k], b[k + "_scale_inv"] = _quantize(v)
        else:
            (a if i % 2 else b)[k] = v
    save_file(a, str(d / "model-00001-of-00002.safetensors"), metadata={"format": "pt"})
    save_file(b, str(d / "model-00002-of-00002.safetensors"), metadata={"format": "pt"})
    wmap = {**{k: "model-00001-of-00002.safetensors" for k in a}, **{k: "model-00002-of-00002.safetensors" for k in b}}
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wmap}))
    cfg = json.loads((bf16_hf / "config.json").read_text())
    cfg["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                  "weight_block_size": [BLOCK, BLOCK]}
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_fp8_checkpoint_imports_within_fp8_round_off(bf16_hf, fp8_hf, tmp_path):
    original = load_file(bf16_hf / "model.safetensors")
    q = {**load_file(fp8_hf / "model-00001-of-00002.safetensors"), **load_file(fp8_hf / "model-00002-of-00002.safetensors")}
    assert any(v.shape[0] % BLOCK or v.shape[1] % BLOCK for k, v in original.items() if k.endswith(PROJ))  # partial
    for dtype, cast in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        rep = hf_to_megatron(fp8_hf, tmp_path / f"m-{dtype}", tp=2, ep=2, dtype=dtype)
        assert rep["dtype"] == cast.__repr__().removeprefix("torch.")
        megatron_to_hf(tmp_path / f"m-{dtype}", tmp_path / f"hf-{dtype}")
        back = load_file(tmp_path / f"hf-{dtype}" / "model.safetensors")
        assert back.keys() == original.keys()
        for k, v in back.items():
            assert v.dtype == cast, k
            if k.endswith(PROJ):  # exactly the published dequantization, and within round-off of the original
                s = q[k + "_scale_inv"]
                assert torch.equal(v, _dequantize(q[k], s).to(cast)), k
                assert _round_off_ok(v, original[k], s), k
            else:  # norms, embeddings, lm_head, router, its bias: as stored
                assert torch.equal(v, original[k].to(cast)), k


def test_fp8_blocks_export_is_the_published_layout_transformers_expects(bf16_hf, tmp_path):
    """`--fp8-blocks` writes the published rule's bytes; the modules transformers' pre-quantized loader turns
    into FP8Linear (every nn.Linear of its DeepseekV3ForCausalLM not named in modules_to_not_convert, matched as
    `replace_with_fp8_linear` matches: a substring of the module path; lm_head always) are exactly those with an
    e4m3 weight and a scale of FP8Linear's declared shape, every other tensor keeps its dtype."""
    import torch.nn as nn
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_to_megatron(bf16_hf, tmp_path / "m", tp=2)
    megatron_to_hf(tmp_path / "m", tmp_path / "bf16")
    megatron_to_hf(tmp_path / "m", tmp_path / "fp8", fp8_blocks=True)
    plain = load_file(tmp_path / "bf16" / "model.safetensors")
    ours = load_file(tmp_path / "fp8" / "model.safetensors")
    cfg = json.loads((tmp_path / "fp8" / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert {k: qc[k] for k in ("quant_method", "fmt", "activation_scheme", "weight_block_size")} == {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    for k, v in plain.items():
        if k.endswith(PROJ):  # the published rule's bytes, exactly
            q, s = _quantize(v)
            assert ours[k].dtype == torch.float8_e4m3fn and torch.equal(ours[k].view(torch.uint8), q.view(torch.uint8))
            assert ours[k + "_scale_inv"].dtype == torch.float32 and torch.equal(ours[k + "_scale_inv"], s), k
            assert _round_off_ok(_dequantize(ours[k], s), v, s), k
        else:
            assert torch.equal(ours[k], v), k
    assert {k for k in ours if k.endswith("_scale_inv")} == {k + "_scale_inv" for k in plain if k.endswith(PROJ)}
    config = AutoConfig.from_pretrained(tmp_path / "fp8")
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config)
    skip = ["lm_head", *qc["modules_to_not_convert"]]
    fp8_linear = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear) and not any(s in n for s in skip)}
    assert set(fp8_linear) == {k[: -len(".weight")] for k in ours if ours[k].dtype == torch.float8_e4m3fn}
    for n, m in fp8_linear.items():  # FP8Linear's weight_scale_inv: ceil(out / 128) x ceil(in / 128)
        assert tuple(ours[n + ".weight_scale_inv"].shape) == (math.ceil(m.out_features / 128),
                                                             math.ceil(m.in_features / 128))
    assert all(ours[n + ".weight"].dtype == torch.bfloat16 for n, m in model.named_modules()
               if isinstance(m, nn.Linear) and n not in fp8_linear and n + ".weight" in ours)


@pytest.mark.parametrize("qc, words", [
    ({"quant_method": "awq", "bits": 4}, "'awq'"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "other than block-scaled FP8"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"}, "static"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "fmt": "e5m2"}, "fmt='e5m2'"),
])
def test_unknown_quantization_is_refused_by_name(fp8_hf, tmp_path, capsys, qc, words):
    import shutil

    d = tmp_path / "q"
    shutil.copytree(fp8_hf, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = qc
    (d / "config.json").write_text(json.dumps(cfg))
    code, _, err = run_cli(["hf-to-megatron", d, tmp_path / "out"], capsys)
    assert code == 1 and words in err and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


def test_damaged_fp8_checkpoints_are_refused_by_name(fp8_hf, tmp_path, capsys):
    import shutil

    cases = {}
    d = tmp_path / "no-config"  # e4m3 tensors, no quantization_config: their scales are unknown
    shutil.copytree(fp8_hf, d)
    cfg = json.loads((d / "config.json").read_text())
    del cfg["quantization_config"]
    (d / "config.json").write_text(json.dumps(cfg))
    cases[d] = "is float8_e4m3fn but config.json has no block-scaled FP8"
    d = tmp_path / "no-scale"  # a scale missing
    shutil.copytree(fp8_hf, d)
    idx = json.loads((d / "model.safetensors.index.json").read_text())
    gone = next(k for k in idx["weight_map"] if k.endswith("_scale_inv"))
    f = d / idx["weight_map"].pop(gone)
    with safe_open(str(f), "pt") as h:
        kept = {k: h.get_tensor(k) for k in h.keys() if k != gone}
    save_file(kept, str(f), metadata={"format": "pt"})
    (d / "model.safetensors.index.json").write_text(json.dumps(idx))
    cases[d] = f"without its {gone!r}"
    for d, words in cases.items():
        code, _, err = run_cli(["hf-to-megatron", d, tmp_path / "out"], capsys)
        assert code == 1 and words in err and err.count("\n") == 1, err


def test_fp8_blocks_refuses_conv1d_families(tmp_path, capsys):
    from mconvert.trainer.train import TrainConfig, train

    train(TrainConfig(preset="tiny-gpt2", steps=0, save=str(tmp_path / "g"), quiet=True))
    code, _, err = run_cli(["megatron-to-hf", tmp_path / "g", tmp_path / "out", "--fp8-blocks"], capsys)
    assert code == 1 and "Conv1D" in err and err.count("\n") == 1


MEM_PROBE = r"""
import json, sys, psutil
from mconvert.convert.driver import peak_rss_bytes
from mconvert.convert.verbs import hf_to_megatron
from mconvert.io import tuning
tuning.apply()
base = psutil.Process().memory_info().rss
hf_to_megatron(sys.argv[1], sys.argv[2])
print(json.dumps({"delta": peak_rss_bytes() - base}))
"""


def _fp8_llama(d: Path, layers: int, h: int) -> int:
    """A Llama HF checkpoint of `layers` layers quantized by the published rule; its bf16 bytes per layer."""
    from mconvert.mappings.llama import rope_preset

    spec = rope_preset("llama", num_layers=layers, hidden_size=h, num_attention_heads=4, num_query_groups=4,
                       ffn_hidden_size=3 * h, vocab_size=256, max_position_embeddings=64)
    g = torch.Generator().manual_seed(1)
    d.mkdir(parents=True)
    st: dict[str, torch.Tensor] = {"model.embed_tokens.weight": torch.randn(256, h, generator=g).bfloat16(),
                                   "model.norm.weight": torch.ones(h).bfloat16(),
                                   "lm_head.weight": torch.randn(256, h, generator=g).bfloat16()}
    for i in range(layers):
        p = f"model.layers.{i}."
        for name, shape in (("self_attn.q_proj", (h, h)), ("self_attn.k_proj", (h, h)), ("self_attn.v_proj", (h, h)),
                            ("self_attn.o_proj", (h, h)), ("mlp.gate_proj", (3 * h, h)), ("mlp.up_proj", (3 * h, h)),
                            ("mlp.down_proj", (h, 3 * h))):
            st[p + name + ".weight"], st[p + name + ".weight_scale_inv"] = _quantize(
                0.02 * torch.randn(shape, generator=g))
        st[p + "input_layernorm.weight"] = torch.ones(h).bfloat16()
        st[p + "post_attention_layernorm.weight"] = torch.ones(h).bfloat16()
    save_file(st, str(d / "model.safetensors"), metadata={"format": "pt"})
    from mconvert.mappings.families import hf_config

    cfg = hf_config(spec.replace(params_dtype="bfloat16"))
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [BLOCK, BLOCK]}
    (d / "config.json").write_text(json.dumps(cfg))
    return 13 * h * h * 2


def test_fp8_import_memory_does_not_grow_with_depth(tmp_path):
    """hf-to-megatron of a block-FP8 model dequantizes tensor by tensor while streaming: the peak over the
    baseline is a few layers' worth whatever the depth (dequantizing whole, or the whole model, would not be)."""
    import subprocess
    import sys

    out = {}
    for layers in (2, 8):
        layer = _fp8_llama(tmp_path / f"fp8-{layers}", layers, 1024)
        r = subprocess.run([sys.executable, "-c", MEM_PROBE, str(tmp_path / f"fp8-{layers}"),
                            str(tmp_path / f"m-{layers}")], capture_output=True, text=True, check=True)
        out[layers] = json.loads(r.stdout.strip().splitlines()[-1])["delta"]
    print(f"\npeak RSS over baseline: 2 layers {out[2] / 1e6:.1f} MB, 8 layers {out[8] / 1e6:.1f} MB "
          f"(a layer: {layer / 1e6:.1f} MB in bf16)")
    assert out[8] - out[2] < 2 * layer
    assert out[8] < 6 * layer


def test_fp8_blocks_keep_the_mtp_eh_proj_as_vllm_builds_it(trained_checkpoint, tmp_path):
    """vLLM's DeepSeek and GLM-4.5 MTP models build `eh_proj` as a plain torch Linear (read from vLLM's own
    source when its venv is here): `--fp8-blocks` keeps it in the model dtype, without a scale, and names it in
    modules_to_not_convert; the MTP layer's attention and expert projections are quantized like the main ones."""
    import os
    import re

    ckpt = trained_checkpoint(preset="tiny-deepseek-v3", tp=1, pp=1, dp=1, ep=1, steps=2, seq_length=32,
                              micro_batch_size=2, global_batch_size=8, lr=1e-2, seed=42, moe_aux_loss_coeff=0.0)
    megatron_to_hf(ckpt, tmp_path / "fp8", fp8_blocks=True)
    cfg = json.loads((tmp_path / "fp8" / "config.json").read_text())
    mtp = cfg["num_hidden_layers"]
    st = load_file(tmp_path / "fp8" / "model.safetensors")
    eh = f"model.layers.{mtp}.eh_proj"
    assert st[eh + ".weight"].dtype != torch.float8_e4m3fn and eh + ".weight_scale_inv" not in st
    assert eh in cfg["quantization_config"]["modules_to_not_convert"]
    assert st[f"model.layers.{mtp}.self_attn.kv_b_proj.weight"].dtype == torch.float8_e4m3fn
    assert f"model.layers.{mtp}.mlp.experts.0.down_proj.weight_scale_inv" in st
    venv = Path(os.environ.get("VLLM_VENV", Path.home() / ".cache/mconvert/vllm-venv"))
    for f in ("deepseek_mtp.py", "glm4_moe_mtp.py"):
        found = list(venv.glob(f"lib/python3*/site-packages/vllm/model_executor/models/{f}"))
        if found:
            assert re.search(r"self\.eh_proj = nn\.Linear\(", found[0].read_text()), f
