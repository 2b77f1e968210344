"""Property tests (hypothesis) over random shapes: HF -> Megatron(TP, PP) -> HF is identical, and a reshard
to another TP/PP and back gives the same tensors. Small and few examples: the suite must stay fast."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from mconvert.convert.driver import hf_to_megatron, megatron_to_hf, reshard
from mconvert.convert.hf import HFWriter
from mconvert.convert.io.safeload import safe_load
from mconvert.convert.base import units_of
from mconvert.mappings import to_hf
from mconvert.spec import ModelSpec


@st.composite
def cases(draw):
    family = draw(st.sampled_from(["gpt2", "llama", "qwen2"]))
    heads = draw(st.sampled_from([1, 2, 4, 8]))
    groups = heads if family == "gpt2" else draw(st.sampled_from([g for g in (1, 2, 4, 8) if heads % g == 0]))
    hd = draw(st.sampled_from([2, 4, 6]))
    tp = draw(st.sampled_from([t for t in (1, 2, 4) if heads % t == 0 and (groups % t == 0 or t % groups == 0)]))
    pp = draw(st.sampled_from([1, 2]))
    layers = pp * draw(st.integers(1, 2))
    ffn = tp * draw(st.integers(1, 6))
    common = dict(num_layers=layers, hidden_size=heads * hd, num_attention_heads=heads, ffn_hidden_size=ffn,
                  vocab_size=draw(st.integers(3, 300)), max_position_embeddings=draw(st.integers(4, 16)),
                  make_vocab_size_divisible_by=draw(st.sampled_from([1, 8, 128])))
    if family == "gpt2":
        spec = ModelSpec(family="gpt2", activation="gelu_new", **common)
    else:
        spec = ModelSpec(family=family, num_query_groups=groups, normalization="RMSNorm", activation="swiglu",
                         position_embedding_type="rope", add_bias_linear=False, add_qkv_bias=family == "qwen2",
                         tie_embeddings=draw(st.booleans()), **common)
    tp2 = draw(st.sampled_from([t for t in (1, 2, 4) if heads % t == 0 and (groups % t == 0 or t % groups == 0)
                                and ffn % t == 0]))
    return spec, tp, pp, tp2, draw(st.sampled_from([p for p in (1, 2) if layers % p == 0]))


def _write_hf(spec: ModelSpec, out: Path, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    w = HFWriter(out, spec, max_shard_size=2000)  # tiny shards: the index path is exercised too
    for unit in units_of(spec):
        decls = {"embedding": spec.embedding_params(), "final": spec.final_params()}.get(unit) or spec.layer_params(unit)
        w.add(unit, to_hf(spec, unit, {d.name: torch.randn(d.shape, generator=g) for d in decls}))
    w.close()


def _all_hf(d: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in d.glob("*.safetensors"):
        out.update(load_file(f))
    return out


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases(), st.integers(0, 1000))
def test_round_trips_are_identical(case, seed):
    spec, tp, pp, tp2, pp2 = case
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        d.joinpath("hf").mkdir()
        _write_hf(spec, d / "hf", seed)
        hf_to_megatron(d / "hf", d / "mg", tp=tp, pp=pp)
        megatron_to_hf(d / "mg", d / "back", max_shard_size=3000)
        a, b = _all_hf(d / "hf"), _all_hf(d / "back")
        assert sorted(a) == sorted(b)
        assert all(torch.equal(a[k], b[k]) for k in a)
        reshard(d / "mg", d / "r1", tp=tp2, pp=pp2)
        reshard(d / "r1", d / "r2", tp=tp, pp=pp)
        for f in sorted((d / "mg").rglob("*.pt")):  # same layout again: every rank file's tensors are equal
            x, y = safe_load(f)["model"], safe_load(d / "r2" / f.relative_to(d / "mg"))["model"]
            assert list(x) == list(y)
            assert all(torch.equal(x[k], y[k]) if isinstance(x[k], torch.Tensor) else x[k] == y[k] for k in x), f
