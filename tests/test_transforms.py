"""Pure shard math: split/merge per kind, pinned against what megatron-core's layers hold on each rank."""

import pytest
import torch

from mconvert.errors import MConvertError
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
