"""Pure shard math: split/merge per kind. What each rank's shard holds is pinned against megatron-core's own
code, run in this process: its parallel layers' constructors (ColumnParallelLinear, RowParallelLinear,
VocabParallelEmbedding) partition a full weight given as their init, its attention's
`get_query_key_value_tensors` decodes a rank's linear_qkv rows into q/k/v heads, and its MLP's `forward` reads a
rank's fc1 rows as [gate; up]."""

from types import SimpleNamespace
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from mconvert.errors import MConvertError
from mconvert.mappings import transforms as T
from mconvert.mappings.transforms import merge, merge_rows, split


@pytest.mark.parametrize("kind", ["column", "row", "vocab", "qkv", "gated", "replicated"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_split_then_merge_is_identity(kind, tp):
    full = torch.randn(16, 8)
    assert torch.equal(merge(split(full, kind, tp), kind), full)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_gated_split_as_row_blocks_is_the_split_without_a_copy(tp):
    """`blocks=True`: each rank's gated shard as (gate_r, up_r), views of the full tensor whose concatenation
    is the shard `split` makes; shape and dtype are the shard's."""
    full = torch.randn(8 * tp, 6, dtype=torch.float16)
    for blocks, shard in zip(split(full, "gated", tp, blocks=True), split(full, "gated", tp), strict=True):
        assert isinstance(blocks, T.RowBlocks) and len(blocks) == 2
        assert all(b.untyped_storage().data_ptr() == full.untyped_storage().data_ptr() for b in blocks)
        assert torch.equal(torch.cat(list(blocks)), shard)
        assert (blocks.shape, blocks.dtype, blocks.numel(), blocks.element_size()) == \
            (shard.shape, shard.dtype, shard.numel(), shard.element_size())


@pytest.fixture(scope="module")
def mcore():
    """megatron-core's tensor-parallel layers, attention and MLP modules, imported once for this file."""
    from megatron.core import ModelParallelConfig
    from megatron.core.tensor_parallel import layers
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.mlp import MLP

    return SimpleNamespace(config=ModelParallelConfig, layers=layers, SelfAttention=SelfAttention, MLP=MLP)


def _mcore_rank_weight(mcore, layer: str, full: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """The weight megatron-core's `layer` holds on TP rank `rank` when the full weight is `full` [out, in]
    (its CPU init builds the full master weight and keeps the rank's part). Only the layer's view of its TP
    group is patched: what part that is stays megatron-core's choice."""
    L = mcore.layers
    cfg = mcore.config(use_cpu_initialization=True, tensor_model_parallel_size=tp)
    init = lambda w: w.copy_(full)  # noqa: E731
    with mock.patch.object(L, "get_pg_rank", lambda group=None: rank), \
            mock.patch.object(L, "get_pg_size", lambda group=None: tp):
        if layer == "vocab":
            m = L.VocabParallelEmbedding(full.shape[0], full.shape[1], init_method=init, config=cfg)
        elif layer == "column":
            m = L.ColumnParallelLinear(full.shape[1], full.shape[0], config=cfg, init_method=init, bias=False,
                                       gather_output=False, skip_bias_add=True)
        else:
            m = L.RowParallelLinear(full.shape[1], full.shape[0], config=cfg, init_method=init, bias=True,
                                    input_is_parallel=True, skip_bias_add=True)
            assert tuple(m.bias.shape) == (full.shape[0],)  # the row-parallel bias is whole on every rank
    return m.weight.detach()


class _Linear(torch.nn.Module):
    """A rank's linear layer as megatron-core's modules call it: `y, bias = layer(x)`."""

    def __init__(self, w: torch.Tensor | None = None):
        super().__init__()
        self.w = w

    def forward(self, x):
        return (x if self.w is None else x @ self.w.t()), None


@pytest.mark.parametrize("kind", ["column", "row", "vocab"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_split_holds_what_megatron_core_layers_hold_per_rank(mcore, kind, tp):
    full = torch.arange(16 * 8, dtype=torch.float32).reshape(16, 8)
    shards = split(full, kind, tp)
    for rank in range(tp):
        assert torch.equal(shards[rank], _mcore_rank_weight(mcore, kind, full, tp, rank)), rank


def _mcore_qkv(mcore, w: torch.Tensor, nq: int, ng: int, hd: int, tp: int):
    """megatron-core's `SelfAttention.get_query_key_value_tensors` on a rank whose linear_qkv weight is `w`,
    fed the identity: query [nq/tp, hd, H], key and value [ng/tp, hd, H], each head's weight rows."""
    H = w.shape[1]
    me = SimpleNamespace(linear_qkv=_Linear(w), num_attention_heads_per_partition=nq // tp,
                         num_query_groups_per_partition=ng // tp, hidden_size_per_attention_head=hd, world_size=tp,
                         config=SimpleNamespace(num_query_groups=ng, test_mode=False), q_layernorm=None,
                         k_layernorm=None)
    q, k, v = mcore.SelfAttention.get_query_key_value_tensors(me, torch.eye(H)[:, None, :])  # [sq=H, b=1, heads, hd]
    return tuple(t[:, 0].permute(1, 2, 0) for t in (q, k, v))


# MHA, GQA, MQA; KV heads divisible by TP (above that, megatron-core all-gathers linear_qkv, whose rows are then
# the column split's, pinned above)
@pytest.mark.parametrize("nq, ng, tp", [(4, 4, 1), (4, 4, 2), (4, 4, 4), (8, 2, 1), (8, 2, 2), (4, 1, 1)])
def test_qkv_split_gives_each_rank_its_heads_as_megatron_core_reads_them(mcore, nq, ng, tp):
    """Full linear_qkv rows in megatron-core's layout ([ng, nq/ng + 2, hd]: a group's query heads, its key
    head, its value head; megatron-core's TP=1 attention must read q, k, v back from it), split for TP: rank r's
    attention finds query heads [r·nq/tp, (r+1)·nq/tp) and KV heads [r·ng/tp, (r+1)·ng/tp)."""
    hd, H = 3, 5
    q, k, v = (torch.randint(-9, 9, (n, hd, H)).float() for n in (nq, ng, ng))  # [heads, hd, H]
    per = nq // ng
    full = torch.cat([q.view(ng, per, hd, H), k[:, None], v[:, None]], dim=1).reshape(-1, H)
    assert all(torch.equal(a, b) for a, b in zip(_mcore_qkv(mcore, full, nq, ng, hd, 1), (q, k, v)))
    for r, w in enumerate(split(full, "qkv", tp)):
        got_q, got_k, got_v = _mcore_qkv(mcore, w, nq, ng, hd, tp)
        assert torch.equal(got_q, q[r * nq // tp:(r + 1) * nq // tp]), r
        assert torch.equal(got_k, k[r * ng // tp:(r + 1) * ng // tp]), r
        assert torch.equal(got_v, v[r * ng // tp:(r + 1) * ng // tp]), r


def _mcore_mlp_activation(mcore, w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """megatron-core's `MLP.forward` (SwiGLU, unfused) on a rank whose linear_fc1 weight is `w`, linear_fc2
    the identity: the rank's activations."""
    cfg = SimpleNamespace(use_te_activation_func=False, bias_activation_fusion=False, gated_linear_unit=True,
                          activation_func=F.silu, activation_func_clamp_value=None, glu_linear_offset=0.0)
    me = SimpleNamespace(config=cfg, activation_func=F.silu, linear_fc1=_Linear(w), linear_fc2=_Linear())
    return mcore.MLP.forward(me, x)[0]


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_gated_split_gives_each_rank_its_swiglu_columns_as_megatron_core_computes_them(mcore, tp):
    """fc1 full = [gate; up] (HF's gate_proj, up_proj): megatron-core's MLP on rank r computes
    silu(x·gate_rᵀ)·(x·up_rᵀ) for the rank's ffn columns [r·F/tp, (r+1)·F/tp)."""
    ffn, H = 8, 3
    gate, up = torch.randint(-4, 4, (ffn, H)).float(), torch.randint(-4, 4, (ffn, H)).float()
    x = torch.randint(-3, 3, (5, 1, H)).float()
    want = F.silu(x @ gate.t()) * (x @ up.t())
    cols = ffn // tp
    for r, w in enumerate(split(torch.cat([gate, up]), "gated", tp)):
        # silu's vectorised and scalar paths may differ in the last bit; a wrong half or rank is far off
        torch.testing.assert_close(_mcore_mlp_activation(mcore, w, x), want[..., r * cols:(r + 1) * cols],
                                   rtol=1e-6, atol=1e-6, msg=f"rank {r}")


def test_gated_rank_holds_its_gate_then_its_up():
    """SwiGLU fc1: each rank stores [gate_r; up_r] — concatenating ranks then chunking would be wrong."""
    gate = torch.arange(8.0).reshape(8, 1)
    up = 100 + torch.arange(8.0).reshape(8, 1)
    shards = split(torch.cat([gate, up]), "gated", 2)
    assert torch.equal(shards[0], torch.cat([gate[:4], up[:4]]))
    assert torch.equal(shards[1], torch.cat([gate[4:], up[4:]]))
    naive = torch.cat(shards).chunk(2)
    assert not torch.equal(naive[0], gate)


def test_row_split_is_on_input_features_and_bias_is_replicated():
    w = torch.randn(4, 8)
    assert split(w, "row", 2)[1].shape == (4, 4)
    b = torch.randn(4)
    assert all(s is b for s in split(b, "row", 2))


def test_mismatched_shard_shapes_are_refused():
    with pytest.raises(MConvertError, match="rank 1 has shape"):
        merge([torch.zeros(4, 2), torch.zeros(3, 2)], "column", name="decoder.layers.0.mlp.linear_fc1.weight")


def test_indivisible_split_is_refused():
    with pytest.raises(MConvertError, match="not divisible"):
        split(torch.zeros(6, 2), "column", 4)


@pytest.mark.parametrize("kind", ["column", "qkv", "vocab", "gated"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_merge_rows_places_shards_as_merge_does(kind, tp):
    """Rows copied where `merge_rows` says reproduce `merge` (the readers that pread shards in place use it)."""
    shards = [torch.randn(6, 3) for _ in range(tp)]
    full = torch.full((6 * tp, 3), float("nan"))
    for shard, pieces in zip(shards, merge_rows(kind, tp, 6)):
        for at, start, n in pieces:
            full[at:at + n] = shard[start:start + n]
    assert torch.equal(full, merge(shards, kind))


def test_merge_rows_refuses_odd_gated_and_row_kinds():
    with pytest.raises(MConvertError, match="odd row count 5"):
        merge_rows("gated", 2, 5)
    with pytest.raises(MConvertError, match="not split on dim 0"):
        merge_rows("row", 2, 4)


# ---- deployment transforms ----------------------------------------------------------------------------
from hypothesis import assume, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from mconvert.mappings.transforms import kv_dup, pad_rows, qkv_rank_blocks, split_transposed  # noqa: E402


def _trtllm_dup_kv_weight(v, num_head, tp_size):
    """TensorRT-LLM's own `dup_kv_weight` (tensorrt_llm/models/llama/convert.py), copied as the reference."""
    reps = tp_size // num_head
    head_size = v.shape[0] // num_head
    v = v.reshape(num_head, head_size, -1)[:, None, :, :].expand(num_head, reps, head_size, v.shape[1])
    return v.reshape(num_head * reps * head_size, -1)


@settings(max_examples=40, deadline=None)
@given(heads=st.sampled_from([1, 2, 4]), mult=st.sampled_from([1, 2, 4]), hd=st.integers(1, 4), cols=st.integers(1, 3))
def test_kv_dup_repeats_heads_as_tensorrt_llm_does(heads, mult, hd, cols):
    tp = heads * mult
    k = torch.randn(heads * hd, cols)
    got = kv_dup(k, heads, tp)
    assert torch.equal(got, _trtllm_dup_kv_weight(k, heads, tp))
    for j in range(max(heads, tp)):  # by index: slot j holds head j // (tp / heads)
        src = j // (tp // heads) if tp > heads else j
        assert torch.equal(got[j * hd:(j + 1) * hd], k[src * hd:(src + 1) * hd])


def test_kv_dup_refuses_heads_that_do_not_divide_ranks():
    with pytest.raises(MConvertError, match="one must divide the other"):
        kv_dup(torch.zeros(3 * 2, 4), 3, 4)


@settings(max_examples=40, deadline=None)
@given(ng=st.sampled_from([1, 2, 4]), per_group=st.sampled_from([1, 2]), tp=st.sampled_from([1, 2, 4]),
       hd=st.integers(1, 3))
def test_qkv_rank_blocks_then_merge_is_identity(ng, per_group, tp, hd):
    """Rank r holds query heads [r·nq/tp, (r+1)·nq/tp) and KV head r·ng/tp (duplicated below TP); taking the
    ranks' q back in order and each distinct KV head once gives q, k, v again."""
    nq = ng * per_group
    assume(nq % tp == 0)
    q, k, v = (torch.randn(n * hd, 5) for n in (nq, ng, ng))
    blocks = qkv_rank_blocks(q, k, v, ng, tp)
    assert torch.equal(torch.cat([b[0] for b in blocks]), q)
    step = max(tp // ng, 1)
    assert torch.equal(torch.cat([b[1] for b in blocks[::step]]), k)
    assert torch.equal(torch.cat([b[2] for b in blocks[::step]]), v)
    for r, (_qr, kr, _vr) in enumerate(blocks):
        kv_heads = max(ng // tp, 1)
        first = r * ng // tp if ng >= tp else r // step
        assert torch.equal(kr, k[first * hd:(first + kv_heads) * hd])


@pytest.mark.parametrize("kind", ["column", "row", "gated", "replicated"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_split_transposed_cuts_the_stored_axis_and_merges_back(kind, tp):
    """`[in, out]` storage: a column split cuts the last axis, a row split the first; transposing back and
    merging gives the full tensor."""
    full = torch.randn(16, 8)
    shards = split_transposed(full, kind, tp)
    if kind == "column":
        assert all(torch.equal(s, c) for s, c in zip(shards, full.t().chunk(tp, dim=-1)))
    if kind == "row":
        assert all(torch.equal(s, c) for s, c in zip(shards, full.t().chunk(tp, dim=0)))
    assert torch.equal(merge([s.t() for s in shards], kind), full)


def test_split_transposed_leaves_biases_1d():
    b = torch.randn(8)
    assert [tuple(s.shape) for s in split_transposed(b, "column", 2)] == [(4,), (4,)]


@pytest.mark.parametrize("rows, multiple, want", [(10, 4, 12), (12, 4, 12), (1, 3, 3)])
def test_pad_rows_appends_zero_rows(rows, multiple, want):
    x = torch.randn(rows, 2)
    y = pad_rows(x, multiple)
    assert y.shape == (want, 2) and torch.equal(y[:rows], x) and not y[rows:].any()


def test_the_copying_transforms_write_into_the_memory_they_are_given():
    """GPT-2's transposes and c_attn regroupings with an allocator (`empty`): the result lies in the memory it
    handed out, with the values of the result without it."""
    given: list[torch.Tensor] = []

    def empty(shape, dtype):
        given.append(torch.full(shape, float("nan"), dtype=dtype))
        return given[-1]

    nh, hd = 4, 8
    w = torch.randn(3 * nh * hd, nh * hd)
    b = w.to(torch.bfloat16)
    cases = [
        (lambda e: T.qkv_to_conv1d(w, nh, hd, empty=e)),
        (lambda e: T.conv1d_to_qkv(w.t().contiguous(), nh, hd, empty=e)),
        (lambda e: T.conv1d_to_qkv(b.t().contiguous(), nh, hd, empty=e)),  # torch's strided copy
        (lambda e: T.transpose(w, empty=e)),
        (lambda e: T.transpose(b, empty=e)),
    ]
    for make in cases:
        want = make(None)
        got = make(empty)
        assert got.data_ptr() == given[-1].data_ptr() and torch.equal(got, want)
    n = len(given)
    T.transpose(w.t().contiguous().t(), empty=empty)  # column-major already: a view, nothing allocated
    assert len(given) == n == 5


@pytest.mark.parametrize("vocab,rows,tp", [(1000, 1024, 4), (1000, 1000, 4), (1000, 1536, 2), (1000, 1280, 5),
                                           (100, 1024, 8)])
def test_split_padded_blocks_are_megatrons_padded_shards(vocab, rows, tp) -> None:
    """Each rank's shard of the padded vocabulary, given as views of the stored rows and a zero block, holds the
    bytes of the padded tensor's shard (Megatron's layout: the true rows, then zeros) — every rank, including
    those holding only padding — and copies none of the stored rows."""
    t = torch.randn(vocab, 8).to(torch.bfloat16)
    want = split(T.pad_vocab(t, rows, vocab), "vocab", tp)
    got = T.split_padded(t, rows, vocab, tp, blocks=True)
    assert len(got) == tp
    per = rows // tp
    for r, (w, g) in enumerate(zip(want, got)):
        parts = tuple(g) if isinstance(g, T.RowBlocks) else (g,)
        assert tuple(g.shape) == tuple(w.shape) and g.dtype == w.dtype
        assert torch.equal(torch.cat(parts).view(torch.int16), w.view(torch.int16))
        # the rank's stored rows are views of `t` (no copy); only its padding is new memory
        views = [p for p in parts if t.data_ptr() <= p.data_ptr() < t.data_ptr() + t.nbytes]
        assert sum(p.shape[0] for p in views) == max(0, min((r + 1) * per, vocab) - r * per)
    assert T.split_padded(t, rows, vocab, tp)[0].data_ptr() != t.data_ptr() or rows == vocab  # no blocks: a copy
    with pytest.raises(MConvertError, match="cannot fit"):
        T.split_padded(t, vocab - 1, vocab, tp, blocks=True)
