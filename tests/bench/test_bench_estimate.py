"""Spec-only estimates (`mconvert plan`) and the bench's measuring tools: quick, no timing goals here."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mconvert.layouts.estimate import ITEMSIZE, estimate, load_bandwidth, stage_layer_counts
from mconvert.errors import MConvertError
from mconvert.mappings.families import hf_config, preset

BENCH = Path(__file__).resolve().parents[2] / "bench"
BW = {"copy_bytes_per_s": 1e9, "ratio_to_cp": {"megatron-to-hf": 2.0, "hf-to-megatron": 2.0, "reshard": 2.5,
                                                 "megatron-to-ft": 2.0}, "base_rss_bytes": 0, "source": "test"}


def _shape_sum(spec, tp: int, pp: int) -> int:
    """Bytes of every Megatron rank file, summed from the declarations: split params once, replicated per TP rank."""
    total = 0
    for d in spec.params(tp):
        n = math.prod(d.shape)
        total += n * tp if d.kind == "replicated" else n
    if spec.tie_embeddings and pp > 1:
        total += math.prod(spec.embedding_params(tp)[0].shape)
    return total * ITEMSIZE[spec.params_dtype]


class _TensorsMade(TorchDispatchMode):
    """Counts the aten ops that make a tensor off the meta device (a shape on meta costs no memory)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if any(isinstance(t, torch.Tensor) and t.device.type != "meta"
               for t in (out if isinstance(out, (tuple, list)) else [out])):
            self.ops.append(str(func))
        return out


@pytest.mark.timeout(60)  # a loop over parameters' elements instead of their shapes does not end: reported here
def test_405b_estimate_is_arithmetic_on_the_declarations_and_sums_the_shapes() -> None:
    spec = preset("llama3-405b")
    with _TensorsMade() as made:  # 405B parameters are never materialized: the estimate multiplies shapes
        ests = {to: estimate(spec, to, tp=8, pp=16, bandwidth=BW) for to in ("hf", "megatron")}
        # FasterTransformer's LLaMA loader has no GQA and a fixed rotary base (megatron-to-ft refuses 405B): the
        # FT arithmetic is checked on the twin it can hold
        mha = dataclasses.replace(spec, num_query_groups=None, rotary_base=10000.0, rope_scaling=None)
        ests["ft"] = estimate(mha, "ft", tp=8, pp=16, bandwidth=BW)
        with pytest.raises(MConvertError, match="grouped-query"):
            estimate(spec, "ft", tp=8, pp=16, bandwidth=BW)
        ests["reshard"] = estimate(spec, "megatron", tp=8, pp=16, target_tp=8, target_pp=8, bandwidth=BW)
    assert made.ops == [], f"the estimate made tensors: {sorted(set(made.ops))}"
    true_bytes = (spec.num_parameters() - (spec.padded_vocab_size(1) - spec.vocab_size) * spec.hidden_size * 2) * 2
    meg = _shape_sum(spec, 8, 16)
    hf = ests["hf"]
    assert hf.parameters > 400e9 and hf.read_files == 128 and hf.read_bytes == meg
    assert hf.write_bytes == true_bytes  # HF holds the true vocab rows (embedding and untied head)
    ft_weights = [f for f in ests["ft"].files["write"] if f["unit"] is not None]  # and config.ini, as written
    assert [f["path"] for f in ests["ft"].files["write"] if f["unit"] is None] == ["1-gpu/config.ini"]
    assert sum(f["bytes"] for f in ft_weights) == (mha.num_parameters() - (mha.padded_vocab_size(1) - mha.vocab_size) * mha.hidden_size * 2) * 2
    assert ests["megatron"].read_bytes == true_bytes and ests["megatron"].write_bytes == meg
    assert ests["reshard"].read_bytes == meg and ests["reshard"].write_files == 64
    assert hf.stage_layers == [7] + [8] * 14 + [7]
    assert hf.megatron_args == {"decoder_first_pipeline_num_layers": 7, "decoder_last_pipeline_num_layers": 7}
    # one layer's 8 TP shards in (norms on every rank) and the same layer out, in bf16: ~2 x 3.19 B params x 2 B
    layer = sum(math.prod(d.shape) for d in spec.layer_params(0)) * 2
    norms = sum(math.prod(d.shape) for d in spec.layer_params(0) if d.kind == "replicated") * 2
    assert hf.largest_unit == "layer" and hf.largest_unit_bytes == 2 * layer + 7 * norms
    assert hf.expected_seconds == pytest.approx(max(hf.read_bytes, hf.write_bytes) / 1e9 * 2.0)


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-llama", "tiny-qwen2", "gpt2-100m"])
def test_hf_bytes_equal_transformers_parameter_bytes(name: str) -> None:
    """The HF side of the estimate against transformers' own model of the same config (meta device)."""
    import transformers

    spec = preset(name)
    cfg = transformers.AutoConfig.for_model(**hf_config(spec))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    sd = model.state_dict()
    seen, nbytes = set(), 0
    for k, t in sd.items():  # tied head: count the shared tensor once, as a safetensors file does
        if k == "lm_head.weight" and spec.tie_embeddings:
            continue
        if k.endswith((".attn.bias", ".attn.masked_bias")) or k in seen:
            continue
        seen.add(k)
        nbytes += t.numel() * ITEMSIZE[spec.params_dtype]
    assert estimate(spec, "hf", tp=2, pp=2, bandwidth=BW).write_bytes == nbytes


def test_405b_layer_bytes_equal_transformers_layer() -> None:
    """One Llama-3-405B layer (and the embedding/head) as transformers builds it, on the meta device."""
    import transformers

    spec = preset("llama3-405b").replace(num_layers=2)
    cfg = transformers.AutoConfig.for_model(**hf_config(spec))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    nbytes = sum(t.numel() for t in model.state_dict().values()) * 2
    assert estimate(spec, "hf", tp=8, pp=2, bandwidth=BW).write_bytes == nbytes


def test_stage_layer_counts() -> None:
    assert stage_layer_counts(16, 2) == [8, 8]
    assert stage_layer_counts(126, 16) == [7] + [8] * 14 + [7]
    assert stage_layer_counts(126, 16, first=6, last=8) == [6] + [8] * 14 + [8]
    assert stage_layer_counts(10, 2, first=4) == [4, 6]
    with pytest.raises(MConvertError, match="do not divide evenly"):
        stage_layer_counts(126, 16, first=6, last=6)
    with pytest.raises(MConvertError):
        stage_layer_counts(3, 16)


@pytest.mark.slow
def test_uneven_stages_match_megatron_core() -> None:
    """Our uneven split is megatron-core's own `get_num_layers_to_build` for the same first/last stage sizes."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_config import TransformerConfig

    for layers, pp in ((126, 16), (30, 4), (7, 3)):
        counts = stage_layer_counts(layers, pp)
        cfg = TransformerConfig(
            num_layers=layers, hidden_size=64, num_attention_heads=4, pipeline_model_parallel_size=pp,
            num_layers_in_first_pipeline_stage=counts[0], num_layers_in_last_pipeline_stage=counts[-1],
            pipeline_dtype=torch.float32,
        )
        assert [get_num_layers_to_build(cfg, pp_rank=r) for r in range(pp)] == counts


def test_bandwidth_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MCONVERT_BANDWIDTH_FILE", str(tmp_path / "none.json"))
    assert "default" in load_bandwidth()["source"]
    p = tmp_path / "bw.json"
    p.write_text(json.dumps({"copy_bytes_per_s": 2e9, "ratio_to_cp": {"reshard": 1.5}}))
    monkeypatch.setenv("MCONVERT_BANDWIDTH_FILE", str(p))
    bw = load_bandwidth()
    assert bw["copy_bytes_per_s"] == 2e9 and bw["ratio_to_cp"]["reshard"] == 1.5
    p.write_text("{not json")
    with pytest.raises(MConvertError, match="bw.json: unreadable bandwidth file"):
        load_bandwidth()
    with pytest.raises(MConvertError, match="not found"):
        load_bandwidth(tmp_path / "missing.json")


def test_per_byte_model_from_the_depth_rows(tmp_path: Path) -> None:
    """The bench turns its depth rows into start-up + marginal rates, and plan charges a model's bytes those
    rates (not the whole-run ratio, which carries the small model's start-up into every byte)."""
    sys.path.insert(0, str(BENCH))
    import bench

    def row(wall: float) -> dict:
        return {"wall_s": wall, "cpu_s": wall}

    # cp: 2 s/GB; megatron-to-hf: 5 s of start-up, then 3 s/GB (1.5 × cp per byte)
    depth = {"8": {"layers": 8, "bytes": 2e9, "cp": row(4.0), "megatron-to-hf": row(5 + 6.0)},
             "32": {"layers": 32, "bytes": 6e9, "cp": row(12.0), "megatron-to-hf": row(5 + 18.0)}}
    report = {"depth": depth, "marginal_s_per_gb": bench.marginal(depth)}
    model = bench.per_byte_model(report)
    assert model["marginal_copy_bytes_per_s"] == pytest.approx(0.5e9)
    assert model["marginal_ratio_to_cp"] == {"megatron-to-hf": pytest.approx(1.5)}
    assert model["start_seconds"] == {"megatron-to-hf": pytest.approx(5.0)}
    assert bench.per_byte_model({"depth": {}, "marginal_s_per_gb": {}}) == {}

    p = tmp_path / "bw.json"
    p.write_text(json.dumps({"copy_bytes_per_s": 1e9, "ratio_to_cp": {"megatron-to-hf": 4.0}, **model}))
    bw = load_bandwidth(p)
    spec = preset("llama3-405b")
    est = estimate(spec, "hf", tp=8, pp=16, bandwidth=bw)
    nbytes = max(est.read_bytes, est.write_bytes)
    assert est.start_seconds == pytest.approx(5.0) and est.ratio_to_cp == pytest.approx(1.5)
    assert est.expected_seconds == pytest.approx(5.0 + nbytes / 0.5e9 * 1.5)
    other = estimate(spec, "megatron", tp=8, pp=16, target_tp=8, target_pp=8, bandwidth=bw)  # no marginal row
    assert other.start_seconds == 0 and other.expected_seconds == pytest.approx(
        max(other.read_bytes, other.write_bytes) / 1e9 * 2.5)
    p.write_text(json.dumps({"copy_bytes_per_s": 1e9, **model, "start_seconds": {"megatron-to-hf": -1}}))
    with pytest.raises(MConvertError, match="start_seconds holds a negative value"):
        load_bandwidth(p)
    p.write_text(json.dumps({"copy_bytes_per_s": 1e9, **model, "marginal_copy_bytes_per_s": 0}))
    with pytest.raises(MConvertError, match="marginal_copy_bytes_per_s must be positive"):
        load_bandwidth(p)


def test_plan_verb_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from mconvert.cli import app

    monkeypatch.setenv("MCONVERT_BANDWIDTH_FILE", str(tmp_path / "none.json"))
    r = CliRunner().invoke(app, ["plan", "--preset", "llama3-405b", "--tp", "8", "--pp", "16", "--to", "hf", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["read_files"] == 128 and d["stage_layers"][0] == 7 and d["peak_memory_bytes"] > d["largest_unit_bytes"]


@pytest.mark.slow
def test_procmon_measures_peak_rss_and_page_cache(tmp_path: Path) -> None:
    sys.path.insert(0, str(BENCH))
    from procmon import resident_bytes, run_measured

    m = run_measured([sys.executable, "-c", "import time; x = bytearray(300_000_000); time.sleep(0.3)"])
    assert m.returncode == 0 and m.peak_rss >= 300_000_000 and m.wall_s > 0.3
    f = tmp_path / "blob"
    f.write_bytes(b"\1" * (8 << 20))
    f.read_bytes()
    resident, total = resident_bytes([f])
    assert total == 8 << 20 and resident > 0.9 * total


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_all_finite_agrees_with_isfinite(dtype: torch.dtype) -> None:
    """The one-pass NaN/Inf check answers exactly as torch.isfinite().all()."""
    from mconvert.io.casts import all_finite

    g = torch.Generator().manual_seed(0)
    for n in (1, 2, 31, 4097, 100_003):
        clean = torch.randn(n, generator=g).to(dtype)
        assert all_finite(clean) and all_finite(clean.reshape(-1, 1).t())
        for bad in (float("nan"), float("inf"), -float("inf")):
            for pos in {0, n // 2, n - 1}:
                x = clean.clone()
                x[pos] = bad
                assert all_finite(x) == bool(torch.isfinite(x).all()) is False
    assert all_finite(torch.empty(0, dtype=dtype)) and all_finite(torch.arange(5))


def test_bench_report_targets_and_markdown() -> None:
    """The bench's target logic and tables on a synthetic report (no timing: numbers are made up)."""
    sys.path.insert(0, str(BENCH))
    import bench

    def op(wall: float, rss: float) -> dict:
        return {"wall_s": wall, "cpu_s": wall, "peak_rss": int(rss * 1e9), "peak_anon": 0, "ratio_to_cp": wall,
                "cpu_ratio_to_cp": wall, "rss_ratio_to_cp": 1.0}

    rep = {"preset": "gpt2-1b", "repeats": 3, "machine": {"cpus": 2, "date": "now"},
           "model": {"layers": 16, "parameters": 8e8, "largest_layer_bytes": 2e8, "largest_unit_bytes": 2e8},
           "build": {"files": 12, "bytes": 3.3e9}, "cache": {"warm": True},
           "ops": {"cp": op(1.0, 0.01), "megatron-to-hf": op(1.9, 0.8), "reshard": op(3.0, 0.8)},
           "peer": {"transformers-script": op(10, 4), "hf-to-megatron": op(1.5, 0.8), "hf-to-megatron-bin": None,
                    "speedup": 10 / 1.5, "cpu_speedup": 10 / 1.5, "rss_fraction": 0.2},
           "depth": {"8": {"layers": 8, "bytes": 1.6e9, "megatron-to-hf": op(1.0, 0.8), "reshard": op(1.5, 0.8)},
                     "32": {"layers": 32, "bytes": 6.4e9, "megatron-to-hf": op(4.0, 0.8), "reshard": op(6.0, 0.8)}}}
    rep["targets"] = bench.targets(rep)
    verdict = {t["target"]: t["pass"] for t in rep["targets"]}
    assert verdict["megatron-to-hf wall ≤ 2.0 × cp"] and not verdict["reshard wall ≤ 2.5 × cp"]
    assert verdict["hf-to-megatron ≥ 5 × faster than transformers' script"]
    assert all(v for k, v in verdict.items() if "flat" in k or "linear" in k)
    md = bench.markdown(rep)
    assert "| reshard | 3.00 | 3.00 |" in md and "**FAIL**" in md
