"""Pure shard math: split/merge per kind, pinned against what megatron-core's layers hold on each rank."""

import pytest
import torch

from mconvert.errors import MConvertError
from mconvert.mappings import transforms as T
from mconvert.mappings.transforms import merge, merge_rows, split


@pytest.mark.parametrize("kind", ["column", "row", "vocab", "qkv", "gated", "replicated"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_split_then_merge_is_identity(kind, tp):
    full = torch.randn(16, 8)
    assert torch.equal(merge(split(full, kind, tp), kind), full)


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
from hypothesis import given, settings  # noqa: E402
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
    if nq % tp:
        return
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
