"""Trainer units that need no processes: rank order, groups, 1F1B plan, init independence of TP/PP,
tensor-parallel layers against plain torch, data order, tokenizer determinism, comm report rendering."""

from __future__ import annotations

import itertools

import pytest
import torch

from mconvert.layouts.megatron import stage_layers
from mconvert.errors import MConvertError
from mconvert.mappings.transforms import shard
from mconvert.mappings.families import preset
from mconvert.trainer.comm import COLLECTIVES, render_report
from mconvert.trainer.model import GPTModel, full_init
from mconvert.trainer.parallel import ParallelState, coords, global_rank, group_ranks
from mconvert.trainer.schedule import schedule_plan
from mconvert.trainer.train import TrainConfig, build_spec, sample_batch


def test_rank_order_is_megatron_tp_then_dp_then_pp():
    # Megatron: tp fastest, then dp, then pp. TP=2 DP=2 PP=2 -> rank 5 = tp 1, dp 0, pp 1.
    assert global_rank(1, 0, 1, tp=2, dp=2) == 5
    assert coords(5, tp=2, dp=2, pp=2) == (1, 0, 1)
    for tp, dp, pp in [(2, 2, 2), (4, 1, 2), (1, 3, 2), (2, 1, 1)]:
        ranks = [global_rank(t, d, p, tp, dp) for p in range(pp) for d in range(dp) for t in range(tp)]
        assert ranks == list(range(tp * dp * pp))  # enumerating pp, dp, tp (tp innermost) counts 0, 1, 2...
        for r in ranks:
            assert global_rank(*coords(r, tp, dp, pp)[:2], coords(r, tp, dp, pp)[2], tp, dp) == r


def test_groups_partition_the_world():
    g = group_ranks(tp=2, dp=2, pp=2)
    assert g["TP"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g["DP"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["PP"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g["embedding"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    for kind in ("TP", "DP", "PP"):
        assert sorted(itertools.chain(*g[kind])) == list(range(8))
    assert group_ranks(2, 1, 1)["embedding"] == []


def test_1f1b_plan():
    # PP=4, 6 micro-batches: stage 0 warms up with 3 forwards, the last stage alternates from the start.
    assert schedule_plan(4, 0, 6)[:5] == ["F0", "F1", "F2", "F3", "B0"]
    assert schedule_plan(4, 3, 6)[:4] == ["F0", "B0", "F1", "B1"]
    for r in range(4):
        plan = schedule_plan(4, r, 6)
        assert sorted(plan) == sorted([f"F{i}" for i in range(6)] + [f"B{i}" for i in range(6)])
        assert all(plan.index(f"F{i}") < plan.index(f"B{i}") for i in range(6))
        # at most PP - r activations in flight (the memory bound of 1F1B)
        live = peak = 0
        for step in plan:
            live += 1 if step[0] == "F" else -1
            peak = max(peak, live)
        assert peak == min(4 - r, 6)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2"])
def test_stage_shards_are_the_full_model_cut_by_the_spec(name):
    """A TP=2 PP=2 rank holds exactly transforms.shard of the TP=1 init for every declared parameter."""
    spec = preset(name)
    full = GPTModel(spec, ParallelState(), seed=3).state_dict()
    for pp_rank, tp_rank in itertools.product(range(2), range(2)):
        st = ParallelState(tp=2, pp=2, dp=1, rank=global_rank(tp_rank, 0, pp_rank, 2, 1))
        sd = GPTModel(spec, st, seed=3).state_dict()
        layers = stage_layers(spec.num_layers, 2, pp_rank)[0]
        for key, value in sd.items():
            if value is None:
                assert key.endswith("._extra_state")
                continue
            gname = key
            if key.startswith("decoder.layers."):
                local = int(key.split(".")[2])
                gname = key.replace(f"decoder.layers.{local}.", f"decoder.layers.{layers[local]}.", 1)
            if key == "output_layer.weight" and spec.tie_embeddings:
                gname = "embedding.word_embeddings.weight"
            expect = shard(full[gname], spec.split_kind(gname), 2, tp_rank)
            assert torch.equal(value, expect), key


def test_stage_keys_are_local_spec_names():
    spec = preset("tiny-gpt2")  # tied: PP=1 has no output_layer.weight, PP=2 last stage holds a copy
    keys1 = set(GPTModel(spec, ParallelState(), seed=1).state_dict())
    assert "output_layer.weight" not in keys1 and "output_layer._extra_state" in keys1
    assert "decoder.layers.1.self_attention.linear_qkv.weight" in keys1
    last = GPTModel(spec, ParallelState(tp=1, pp=2, rank=1), seed=1).state_dict()
    assert "output_layer.weight" in last and "embedding.word_embeddings.weight" not in last
    assert {k for k in last if k.startswith("decoder.layers.")} == {
        k for k in keys1 if k.startswith("decoder.layers.0.")}  # layer index local to the stage


def test_vocab_padding_rows_are_initialised_like_megatron():
    spec = preset("tiny-llama")
    decl = spec.embedding_params(2)[0]
    w = full_init(decl, spec, seed=5)
    assert w.shape == (spec.padded_vocab_size(2), spec.hidden_size) == (1024, 128)
    assert w[spec.vocab_size:].abs().sum() > 0  # random, part of the tensor
    assert torch.equal(full_init(spec.embedding_params(1)[0], spec, 5)[: spec.vocab_size], w[: spec.vocab_size])


def test_single_rank_model_matches_plain_attention():
    """Our TP=1 attention equals torch's scaled_dot_product_attention with is_causal on the same q/k/v."""
    spec = preset("tiny-gpt2")
    m = GPTModel(spec, ParallelState(), seed=2)
    attn = m.decoder.layers[0].self_attention
    x = torch.randn(2, 7, spec.hidden_size)
    qkv = attn.linear_qkv(x).view(2, 7, spec.num_attention_heads, 3, spec.head_dim)
    q, k, v = (qkv[:, :, :, i].transpose(1, 2) for i in range(3))
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    ref = attn.linear_proj(ref.transpose(1, 2).reshape(2, 7, -1))
    assert (attn(x, None) - ref).abs().max() < 1e-6


def test_sample_order_is_a_function_of_consumed_samples():
    tokens = torch.arange(1000)
    a = sample_batch(tokens, 16, 0, 40, seed=1)
    b = torch.cat([sample_batch(tokens, 16, 0, 25, seed=1), sample_batch(tokens, 16, 25, 15, seed=1)])
    assert torch.equal(a, b) and a.shape == (40, 17)
    assert torch.equal(a[:, 1:], a[:, :-1] + 1)  # contiguous windows of the stream


def test_tokenizer_is_deterministic_with_vocab_1000():
    from mconvert.data import build_tokenizer, tokenize_corpus

    a, b = build_tokenizer(), build_tokenizer()
    assert a.get_vocab_size() == 1000
    assert a._tokenizer.to_str() == b._tokenizer.to_str()
    ids = tokenize_corpus(a)
    assert 20_000 < ids.numel() and int(ids.max()) < 1000


def test_build_spec_overrides_and_errors():
    cfg = TrainConfig(preset="tiny-llama", num_layers=4, hidden_size=256, seq_length=32)
    spec = build_spec(cfg, 1000)
    assert (spec.num_layers, spec.hidden_size, spec.head_dim, spec.vocab_size) == (4, 256, 64, 1000)
    with pytest.raises(MConvertError, match="num_query_groups"):
        build_spec(TrainConfig(preset="tiny-llama", tp=4), 1000)  # 2 groups, TP 4
    with pytest.raises(MConvertError, match="global-batch-size"):
        TrainConfig(global_batch_size=10, micro_batch_size=4).validate()


def test_comm_report_lists_every_collective():
    from rich.console import Console

    table = render_report([("all-reduce", "TP", 10, 4096, 0.01, 4)])
    console = Console(record=True, width=120)
    console.print(table)
    text = console.export_text()
    for c in COLLECTIVES:
        assert c in text


def _fail_on_rank_one():
    import os

    if int(os.environ["RANK"]) == 1:
        raise ValueError("kaboom on rank one")
    return 0


@pytest.mark.slow
def test_a_failing_rank_is_one_line_naming_the_rank():
    from mconvert.trainer.train import launch

    with pytest.raises(MConvertError, match=r"^rank 1 failed: ValueError: kaboom on rank one$"):
        launch(_fail_on_rank_one, (), 2)
