"""Property tests (hypothesis) over random shapes: a checkpoint written by transformers itself goes HF ->
Megatron(TP, PP) -> HF identical, and resharded to another TP/PP it converts to the same HF tensors again and
reshards back to the same rank files. Small and few examples: the suite must stay fast."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from mconvert.convert.verbs import hf_to_megatron, megatron_to_hf, reshard
from mconvert.io.safeload import safe_load

_CONFIGS = {"gpt2": "GPT2Config", "llama": "LlamaConfig", "qwen2": "Qwen2Config"}


@st.composite
def cases(draw):
    """A transformers config (family, its kwargs as a hashable tuple), the TP/PP to convert to and the TP/PP
    to reshard to."""
    family = draw(st.sampled_from(sorted(_CONFIGS)))
    heads = draw(st.sampled_from([1, 2, 4, 8]))
    groups = heads if family == "gpt2" else draw(st.sampled_from([g for g in (1, 2, 4, 8) if heads % g == 0]))
    hd = draw(st.sampled_from([2, 4, 6]))
    tp = draw(st.sampled_from([t for t in (1, 2, 4) if heads % t == 0 and (groups % t == 0 or t % groups == 0)]))
    pp = draw(st.sampled_from([1, 2]))
    layers = pp * draw(st.integers(1, 2))
    ffn = tp * draw(st.integers(1, 6))
    vocab, positions = draw(st.integers(3, 300)), draw(st.integers(4, 16))
    if family == "gpt2":
        cfg = dict(n_embd=heads * hd, n_layer=layers, n_head=heads, n_inner=ffn, vocab_size=vocab,
                   n_positions=positions, activation_function="gelu_new")
    else:
        cfg = dict(hidden_size=heads * hd, num_hidden_layers=layers, num_attention_heads=heads,
                   num_key_value_heads=groups, intermediate_size=ffn, vocab_size=vocab,
                   max_position_embeddings=positions, tie_word_embeddings=draw(st.booleans()))
        if family == "llama":
            cfg.update(attention_bias=False, mlp_bias=False)
    tp2 = draw(st.sampled_from([t for t in (1, 2, 4) if heads % t == 0 and (groups % t == 0 or t % groups == 0)
                                and ffn % t == 0]))
    return (family, tuple(sorted(cfg.items()))), tp, pp, tp2, draw(st.sampled_from([p for p in (1, 2) if layers % p == 0]))


@pytest.fixture(scope="module")
def hf_dirs():
    """`key -> directory`: transformers-written checkpoints, each distinct config built once (hypothesis
    replays and shrinks reuse them)."""
    cache: dict[tuple, Path] = {}
    with tempfile.TemporaryDirectory(prefix="props_hf_") as tmp:
        def get(key: tuple) -> Path:
            if key not in cache:
                cache[key] = _save_hf(key, Path(tmp) / str(len(cache)))
            return cache[key]
        yield get


def _save_hf(key: tuple, out: Path) -> Path:
    """transformers' own model for the config, every parameter (norms and biases too) drawn from a fixed seed
    so that a swapped or misplaced tensor cannot hide behind equal inits, saved by `save_pretrained`."""
    import transformers

    family, items = key
    model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, _CONFIGS[family])(**dict(items)))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    model.save_pretrained(out, safe_serialization=True, max_shard_size="2KB")  # tiny shards: the index path too
    return out


def _all_hf(d: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in d.glob("*.safetensors"):
        out.update(load_file(f))
    return out


def _assert_same_hf(want: dict[str, torch.Tensor], d: Path) -> None:
    got = _all_hf(d)
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_round_trips_are_identical(hf_dirs, case):
    key, tp, pp, tp2, pp2 = case
    hf = hf_dirs(key)
    want = _all_hf(hf)
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        hf_to_megatron(hf, d / "mg", tp=tp, pp=pp)
        megatron_to_hf(d / "mg", d / "back", max_shard_size=3000)
        _assert_same_hf(want, d / "back")
        reshard(d / "mg", d / "r1", tp=tp2, pp=pp2)
        megatron_to_hf(d / "r1", d / "back1")  # r1 itself, at the other layout, is the same model
        _assert_same_hf(want, d / "back1")
        reshard(d / "r1", d / "r2", tp=tp, pp=pp)
        for f in sorted((d / "mg").rglob("*.pt")):  # same layout again: every rank file's tensors are equal
            x, y = safe_load(f)["model"], safe_load(d / "r2" / f.relative_to(d / "mg"))["model"]
            assert list(x) == list(y)
            assert all(torch.equal(x[k], y[k]) if isinstance(x[k], torch.Tensor) else x[k] == y[k] for k in x), f
