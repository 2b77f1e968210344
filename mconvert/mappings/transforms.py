"""Pure shard math: split a full tensor into TP shards and merge them back, per split kind.

No I/O, no torch.distributed. Every function checks element counts so a wrong layout fails loudly
instead of producing a model with wrong outputs. Split kinds are declared in `mconvert.spec`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from mconvert.errors import MConvertError
from mconvert.io.transpose import copy_transposed, transposed, vectorised
from mconvert.spec import SPLIT_DIM, SPLIT_KINDS


def cat(tensors: Sequence[torch.Tensor], dim: int = 0, out: torch.Tensor | None = None) -> torch.Tensor:
    """torch.cat; on meta tensors (shape planning) only the result's shape is made: torch's meta kernel for cat is
    a Python decomposition whose first use imports torch._dynamo and sympy, about a second of a small conversion."""
    if out is None and tensors and all(t.is_meta for t in tensors):
        first = tensors[0]
        d = dim % first.dim()
        if any(t.dim() != first.dim() or t.dtype != first.dtype
               or [n for i, n in enumerate(t.shape) if i != d] != [n for i, n in enumerate(first.shape) if i != d]
               for t in tensors):
            return torch.cat(list(tensors), dim=dim)  # torch's own error for what does not fit
        shape = list(first.shape)
        shape[d] = sum(t.shape[d] for t in tensors)
        return torch.empty(shape, dtype=first.dtype, device="meta")
    return torch.cat(list(tensors), dim=dim, out=out)


def _check_kind(kind: str) -> None:
    if kind not in SPLIT_KINDS:
        raise MConvertError(f"unknown split kind {kind!r}")


def split_dim(kind: str, ndim: int) -> int | None:
    """The dim a `kind` parameter of `ndim` dims is split on (row-parallel biases are replicated)."""
    _check_kind(kind)
    d = SPLIT_DIM[kind]
    if d is not None and d >= ndim:
        return None
    return d


class RowBlocks(tuple):
    """One TP shard as consecutive blocks of rows of one dtype, left unconcatenated (`split(..., blocks=True)`):
    a writer that streams bytes writes the blocks one after the other — the bytes of their `torch.cat` —
    without the copy into new memory that the concatenation makes. `shape`, `dtype`, `numel()` and
    `element_size()` are those of the concatenation."""

    @property
    def shape(self) -> torch.Size:
        return torch.Size((sum(t.shape[0] for t in self), *self[0].shape[1:]))

    @property
    def dtype(self) -> torch.dtype:
        return self[0].dtype

    def numel(self) -> int:
        return sum(t.numel() for t in self)

    def element_size(self) -> int:
        return self[0].element_size()


def split(full: torch.Tensor, kind: str, tp: int, name: str = "tensor", blocks: bool = False) -> list[torch.Tensor]:
    """Full tensor -> `tp` shards (views where possible; `gated` builds [gate_r; up_r] per rank, or with
    `blocks` gives it as the `RowBlocks` (gate_r, up_r), two views, for a caller that writes its bytes)."""
    d = split_dim(kind, full.dim())
    if d is None:
        return [full] * tp
    if full.shape[d] % tp:
        raise MConvertError(f"{name}: dim {d} of shape {tuple(full.shape)} is not divisible by TP={tp}")
    if kind == "gated":
        if full.shape[0] % (2 * tp):
            raise MConvertError(f"{name}: gated rows {full.shape[0]} not divisible by 2·TP={2 * tp}")
        gate, up = full.chunk(2, dim=0)
        if blocks and not full.is_meta:
            return [RowBlocks((g, u)) for g, u in zip(gate.chunk(tp, 0), up.chunk(tp, 0))]  # type: ignore[misc]
        return [cat([g, u], dim=0) for g, u in zip(gate.chunk(tp, 0), up.chunk(tp, 0))]
    return list(full.chunk(tp, dim=d))


def shard(full: torch.Tensor, kind: str, tp: int, rank: int, name: str = "tensor") -> torch.Tensor:
    """One rank's shard of `full` (what the trainer's layer on that rank holds)."""
    return split(full, kind, tp, name)[rank]


def merge(shards: list[torch.Tensor], kind: str, name: str = "tensor", out: torch.Tensor | None = None) -> torch.Tensor:
    """TP shards -> full tensor. Shapes must agree across ranks; element counts are checked. `out`: the
    destination of the concatenation (the merged shape and dtype), where the shards are concatenated."""
    if not shards:
        raise MConvertError(f"{name}: no shards to merge")
    shape0 = tuple(shards[0].shape)
    for r, s in enumerate(shards):
        if tuple(s.shape) != shape0:
            raise MConvertError(
                f"{name}: TP rank {r} has shape {tuple(s.shape)} but rank 0 has {shape0}; "
                "the shards do not belong to one checkpoint"
            )
    d = split_dim(kind, shards[0].dim())
    if d is None or len(shards) == 1:
        return shards[0]
    if kind == "gated":
        if shape0[0] % 2:
            raise MConvertError(f"{name}: gated shard has an odd row count {shape0[0]}")
        halves = [s.chunk(2, dim=0) for s in shards]
        full = cat([h[0] for h in halves] + [h[1] for h in halves], dim=0, out=out)
    else:
        full = cat(shards, dim=d, out=out)
    total = sum(s.numel() for s in shards)
    assert full.numel() == total, f"{name}: merged {full.numel()} elements from {total}"
    return full


def merge_transposed(shards: list[torch.Tensor], kind: str, name: str = "tensor",
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """`merge(shards, kind)` for 2-D row-split shards, laid out column-major: equal values, but its `.t()` is
    contiguous — each rank's shard is transposed straight into its block of rows of the transposed tensor.
    For a consumer that transposes next (GPT-2's Conv1D), this is merge + transpose in one copy instead of
    a concatenation and a transpose. `out`: the destination (the merged shape, its `.t()` contiguous), used
    only where the shards are transposed into place."""
    if kind != "row" or len(shards) == 1 or shards[0].dim() != 2:
        return merge(shards, kind, name)
    merge(shards[:1], kind, name)  # same shape checks as merge
    rows, k = shards[0].shape[0], shards[0].shape[1]
    for r, s in enumerate(shards):
        if tuple(s.shape) != (rows, k):
            raise MConvertError(f"{name}: TP rank {r} has shape {tuple(s.shape)} but rank 0 has {(rows, k)}; "
                                "the shards do not belong to one checkpoint")
    out_t = torch.empty((k * len(shards), rows), dtype=shards[0].dtype) if out is None else out.t()
    if tuple(out_t.shape) != (k * len(shards), rows) or out_t.dtype != shards[0].dtype or not out_t.is_contiguous():
        raise MConvertError(f"internal: {name}: merge into {tuple(out_t.t().shape)} {out_t.dtype}, column-major")
    for r, s in enumerate(shards):
        copy_transposed(s, out_t[r * k:(r + 1) * k])
    return out_t.t()


# An allocator for a result every byte of which is written before it is read: `empty(shape, dtype)`. The
# transforms that allocate take one, so that a caller can hand them reused memory (`io.buffers.empty`).
Empty = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]


def _torch_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype)


# ---- full-tensor layout transforms (Megatron full tensor ⇄ HF tensors), both directions --------------
# Pure functions over full (unsharded) tensors. Each checks element counts: a wrong layout must fail.


def _check_numel(name: str, parts: list[torch.Tensor], whole: torch.Tensor) -> None:
    total = sum(p.numel() for p in parts)
    if total != whole.numel():
        shapes = [tuple(p.shape) for p in parts]
        raise MConvertError(f"{name}: parts {shapes} hold {total} elements but the fused tensor {tuple(whole.shape)} "
                            f"holds {whole.numel()}; the model config does not match the tensors")


def qkv_to_separate(qkv: torch.Tensor, nq: int, ng: int, hd: int, name: str = "linear_qkv",
                    empty: Empty | None = None) -> list[torch.Tensor]:
    """Fused `[ng·(nq/ng+2)·hd, ...]` (per group: nq/ng query heads, 1 key, 1 value) -> [q, k, v]; `empty`:
    the allocator of the copies (a part whose rows are not one block of the fused tensor)."""
    rows = (nq + 2 * ng) * hd
    if qkv.shape[0] != rows or nq % ng:
        raise MConvertError(f"{name}: shape {tuple(qkv.shape)} does not fit heads={nq}, groups={ng}, head_dim={hd} "
                            f"(expected {rows} rows)")
    rest = tuple(qkv.shape[1:])
    g = qkv.reshape(ng, nq // ng + 2, hd, *rest)

    def rows_of(x: torch.Tensor, n: int) -> torch.Tensor:
        if empty is None or x.is_contiguous():
            return x.reshape(n * hd, *rest)
        out = empty((n * hd, *rest), x.dtype)
        out.view(x.shape).copy_(x)
        return out

    q = rows_of(g[:, : nq // ng], nq)
    k = rows_of(g[:, nq // ng], ng)
    v = rows_of(g[:, nq // ng + 1], ng)
    _check_numel(name, [q, k, v], qkv)
    return [q, k, v]


def separate_to_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, nq: int, ng: int, hd: int,
                    name: str = "q/k/v") -> torch.Tensor:
    """[q, k, v] (HF q_proj/k_proj/v_proj) -> Megatron's fused per-group layout."""
    rest = tuple(q.shape[1:])
    if q.shape[0] != nq * hd or k.shape[0] != ng * hd or v.shape[0] != ng * hd or nq % ng:
        raise MConvertError(f"{name}: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit "
                            f"heads={nq}, groups={ng}, head_dim={hd}")
    qg = q.reshape(ng, nq // ng, hd, *rest)
    kg = k.reshape(ng, 1, hd, *rest)
    vg = v.reshape(ng, 1, hd, *rest)
    fused = cat([qg, kg, vg], dim=1).reshape((nq + 2 * ng) * hd, *rest)
    _check_numel(name, [q, k, v], fused)
    return fused


def qkv_to_conv1d(qkv: torch.Tensor, nh: int, hd: int, name: str = "linear_qkv",
                  empty: Empty | None = None) -> torch.Tensor:
    """Megatron MHA qkv `[nh, 3, hd] (× H)` -> GPT-2 `c_attn` (Conv1D): `[3, nh, hd]` rows, transposed to [H, 3H].

    A 1-D bias becomes `[3·nh·hd]` without the transpose. `empty(shape, dtype)`: where an fp32 weight's result
    goes (reused memory), instead of a fresh tensor; other dtypes take torch's regroup and transpose (torch's
    one permuted copy into a transposed destination is much slower than both)."""
    rest = tuple(qkv.shape[1:])
    if qkv.shape[0] != 3 * nh * hd:
        raise MConvertError(f"{name}: shape {tuple(qkv.shape)} does not fit heads={nh}, head_dim={hd}")
    if qkv.dim() == 2 and qkv.dtype == torch.float32 and qkv.device.type == "cpu" and qkv.is_contiguous() \
            and vectorised():
        # regroup and transpose in one pass: each head's q, k or v rows become its columns of c_attn (torch's
        # strided copy of a head block into a column band is no faster than regroup + transpose: fp32 only)
        out = (empty or _torch_empty)((qkv.shape[1], qkv.shape[0]), qkv.dtype)
        for j in range(3):
            for h in range(nh):
                copy_transposed(qkv[(h * 3 + j) * hd:(h * 3 + j + 1) * hd], out[:, (j * nh + h) * hd:(j * nh + h + 1) * hd])
        return out
    out = qkv.reshape(nh, 3, hd, *rest).transpose(0, 1).reshape(3 * nh * hd, *rest)
    _check_numel(name, [qkv], out)
    return out.t().contiguous() if out.dim() == 2 else out.contiguous()


def conv1d_to_qkv(c_attn: torch.Tensor, nh: int, hd: int, name: str = "c_attn",
                  empty: Empty | None = None) -> torch.Tensor:
    """GPT-2 `c_attn` `[H, 3H]` (or bias `[3H]`) -> Megatron MHA qkv `[nh, 3, hd]` rows (the weight's result in
    `empty(shape, dtype)` when given)."""
    t = c_attn.t() if c_attn.dim() == 2 else c_attn
    if t.shape[0] != 3 * nh * hd:
        raise MConvertError(f"{name}: shape {tuple(c_attn.shape)} does not fit heads={nh}, head_dim={hd}")
    if c_attn.dim() == 2 and c_attn.dtype == torch.float32 and c_attn.device.type == "cpu" \
            and c_attn.is_contiguous() and vectorised():
        # transpose and regroup in one pass: each head's columns of c_attn become its q, k or v rows
        out = (empty or _torch_empty)(tuple(t.shape), t.dtype)
        for j in range(3):
            for h in range(nh):
                copy_transposed(c_attn[:, (j * nh + h) * hd:(j * nh + h + 1) * hd], out[(h * 3 + j) * hd:(h * 3 + j + 1) * hd])
        return out
    if c_attn.dim() == 2 and c_attn.device.type == "cpu":  # one strided copy into `empty`'s memory (a
        # plan's meta tensors take the views below): out[(h·3 + j)·hd + d, c] = c_attn[c, (j·nh + h)·hd + d]
        h_in = c_attn.shape[0]
        out = (empty or _torch_empty)((3 * nh * hd, h_in), c_attn.dtype)
        out.view(nh, 3, hd, h_in).copy_(c_attn.reshape(h_in, 3, nh, hd).permute(2, 1, 3, 0))
        return out
    rest = tuple(t.shape[1:])
    out = t.reshape(3, nh, hd, *rest).transpose(0, 1).reshape(3 * nh * hd, *rest).contiguous()
    _check_numel(name, [c_attn], out)
    return out


def gated_to_halves(fc1: torch.Tensor, name: str = "linear_fc1") -> list[torch.Tensor]:
    """Full (TP=1 order) SwiGLU fc1 `[gate; up]` -> [gate, up]."""
    if fc1.shape[0] % 2:
        raise MConvertError(f"{name}: gated fc1 has an odd row count {fc1.shape[0]}")
    gate, up = fc1.chunk(2, dim=0)
    _check_numel(name, [gate, up], fc1)
    return [gate, up]


def halves_to_gated(gate: torch.Tensor, up: torch.Tensor, name: str = "gate/up") -> torch.Tensor:
    """[gate, up] -> full SwiGLU fc1 `[gate; up]` (TP=1 order; `split(kind='gated')` re-cuts it per rank)."""
    if gate.shape != up.shape:
        raise MConvertError(f"{name}: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ in shape")
    fc1 = cat([gate, up], dim=0)
    _check_numel(name, [gate, up], fc1)
    return fc1


def transpose(t: torch.Tensor, name: str = "tensor", empty: Empty | None = None) -> torch.Tensor:
    """Linear `[out, in]` ⇄ Conv1D `[in, out]` (GPT-2). 1-D tensors (biases) pass through."""
    if t.dim() != 2:
        return t
    return t.t() if t.t().is_contiguous() else transposed(t, empty)  # laid out column-major already: no copy


def strip_vocab(t: torch.Tensor, vocab: int, name: str = "embedding") -> torch.Tensor:
    """Padded vocab rows -> the true vocab (HF export)."""
    if t.shape[0] < vocab:
        raise MConvertError(f"{name}: {t.shape[0]} rows but the vocabulary has {vocab}; wrong vocab_size/tokenizer")
    return t[:vocab]


def pad_vocab(t: torch.Tensor, rows: int, vocab: int | None = None, name: str = "embedding",
              empty: Empty | None = None) -> torch.Tensor:
    """Vocab rows -> exactly `rows` rows: kept as stored when already `rows` long; otherwise the first
    `vocab` (true vocab) rows followed by zeros (Megatron's padding for the target TP). Only the padding rows
    are zeroed (`empty`: where the result is allocated)."""
    if t.shape[0] == rows:
        return t
    vocab = t.shape[0] if vocab is None else vocab
    if vocab > rows or t.shape[0] < vocab:
        raise MConvertError(f"{name}: cannot fit {t.shape[0]} rows (vocab {vocab}) into {rows} padded rows")
    shape = (rows, *t.shape[1:])
    out = t.new_empty(shape) if empty is None or t.is_meta else empty(shape, t.dtype)  # meta: the plan's pass
    out[:vocab] = t[:vocab]
    out[vocab:].zero_()
    return out


def split_padded(t: torch.Tensor, rows: int, vocab: int | None, tp: int, name: str = "embedding",
                 empty: Empty | None = None, blocks: bool = False) -> list[torch.Tensor]:
    """`split(pad_vocab(t, rows, vocab), "vocab", tp)`: each TP rank's rows of the padded vocab. With `blocks`
    (a caller that writes the shards' bytes), nothing is copied: a rank's stored rows are a view of `t` and its
    padding rows a zero block after them (`RowBlocks`), where the padded tensor would be a copy of the whole
    embedding."""
    if not blocks or t.is_meta or t.shape[0] == rows:
        return split(pad_vocab(t, rows, vocab, name, empty), "vocab", tp, name)
    vocab = t.shape[0] if vocab is None else vocab
    if vocab > rows or t.shape[0] < vocab:
        raise MConvertError(f"{name}: cannot fit {t.shape[0]} rows (vocab {vocab}) into {rows} padded rows")
    if rows % tp:
        raise MConvertError(f"{name}: dim 0 of shape {(rows, *t.shape[1:])} is not divisible by TP={tp}")
    per = rows // tp
    shards: list[torch.Tensor] = []
    for r in range(tp):
        a, b = r * per, (r + 1) * per
        parts = [t[a:min(b, vocab)]] if a < vocab else []
        if b > vocab:
            parts.append(t.new_zeros((b - max(a, vocab), *t.shape[1:])))
        shards.append(parts[0] if len(parts) == 1 else RowBlocks(tuple(parts)))  # type: ignore[arg-type]
    return shards


def interleaved_to_half(t: torch.Tensor, heads: int, hd: int, name: str = "q/k") -> torch.Tensor:
    """Rows of q or k per head from Megatron's `rotary_interleaved=True` order (pairs 2i, 2i+1) to HF's
    rotate_half order (pairs i, i + hd/2): [r0, r2, r4, ..., r1, r3, ...] in each head."""
    if t.shape[0] != heads * hd or hd % 2:
        raise MConvertError(f"{name}: shape {tuple(t.shape)} does not fit heads={heads}, head_dim={hd}")
    rest = tuple(t.shape[1:])
    return t.reshape(heads, hd // 2, 2, *rest).transpose(1, 2).reshape(t.shape).contiguous()


def half_to_interleaved(t: torch.Tensor, heads: int, hd: int, name: str = "q/k") -> torch.Tensor:
    """Inverse of `interleaved_to_half`."""
    if t.shape[0] != heads * hd or hd % 2:
        raise MConvertError(f"{name}: shape {tuple(t.shape)} does not fit heads={heads}, head_dim={hd}")
    rest = tuple(t.shape[1:])
    return t.reshape(heads, 2, hd // 2, *rest).transpose(1, 2).reshape(t.shape).contiguous()


def merge_rows(kind: str, tp: int, shard_rows: int, name: str = "tensor") -> list[list[tuple[int, int, int]]]:
    """Where `merge` puts each rank's rows of a dim-0 split parameter (column / qkv / vocab / gated): for each TP
    rank, (row in the merged tensor, row in the shard, row count) pieces. Lets a reader place every shard's
    rows straight into the merged tensor with the same layout rule as `merge` (gated: `[gate_r; up_r]` per
    rank, all gates first)."""
    _check_kind(kind)
    if SPLIT_DIM[kind] != 0:
        raise MConvertError(f"{name}: split kind {kind!r} is not split on dim 0")
    if kind == "gated":
        if shard_rows % 2:
            raise MConvertError(f"{name}: gated shard has an odd row count {shard_rows}")
        half = shard_rows // 2
        return [[(r * half, 0, half), (tp * half + r * half, half, half)] for r in range(tp)]
    return [[(r * shard_rows, 0, shard_rows)] for r in range(tp)]


def qkv_separate_rows(nq: int, ng: int, hd: int) -> list[tuple[int, int, int, int]]:
    """Where `qkv_to_separate` puts each row block of the fused tensor: (part 0/1/2 = q/k/v, row in the part,
    row in the fused tensor, row count) pieces in fused-row order — per group its query heads, key and value."""
    if nq % ng:
        raise MConvertError(f"linear_qkv: heads={nq} are not divisible by groups={ng}")
    per = nq // ng
    pieces = []
    for g in range(ng):
        at = g * (per + 2) * hd
        pieces += [(0, g * per * hd, at, per * hd), (1, g * hd, at + per * hd, hd), (2, g * hd, at + (per + 1) * hd, hd)]
    return pieces


def place_rows(rank_pieces: list[list[tuple[int, int, int]]], plan: list[tuple[int, int, int, int]],
               name: str = "tensor") -> list[list[tuple[int, int, int, int]]]:
    """Compose where each TP rank's rows go in the merged tensor (`merge_rows`) with where the merged tensor's
    rows go in a layout's parts (e.g. `qkv_separate_rows`): per rank, (part, row in the part, row in the shard,
    row count) pieces in shard-row order, so a reader copies every row once, straight from its rank's shard
    into its part. Every merged row must land in exactly one part, else the layouts disagree (an error)."""
    merged = sum(n for pieces in rank_pieces for _, _, n in pieces)
    covered = sorted((full, n) for _, _, full, n in plan)
    at = 0
    for full, n in covered:
        if full != at or n <= 0:
            break
        at += n
    if at != merged or sum(n for _, n in covered) != merged:
        raise MConvertError(f"internal: {name}: the layout's row plan does not cover the {merged} merged rows once")
    out: list[list[tuple[int, int, int, int]]] = []
    for pieces in rank_pieces:
        mine = []
        for r_at, r_start, r_n in pieces:
            for part, p_at, full, n in plan:
                lo, hi = max(r_at, full), min(r_at + r_n, full + n)
                if lo < hi:
                    mine.append((part, p_at + lo - full, r_start + lo - r_at, hi - lo))
        out.append(sorted(mine, key=lambda x: x[2]))
    return out


# ---- deployment layouts: per-rank tensors of the inference engines (FasterTransformer, TensorRT-LLM) -------
# The engines cut the same split kinds as Megatron, but store some weights transposed (`[in, out]`), keep q, k
# and v of a rank side by side, and repeat KV heads when there are more ranks than KV heads.


def split_transposed(full: torch.Tensor, kind: str, tp: int, name: str = "tensor") -> list[torch.Tensor]:
    """`split(full, kind, tp)` with every 2-D shard transposed: the rank shards of an engine that stores Linear
    weights `[in, out]`, so a column split cuts its last axis and a row split its first. 1-D tensors pass as split."""
    return [s.t() if s.dim() == 2 else s for s in split(full, kind, tp, name)]


def kv_dup(x: torch.Tensor, heads: int, tp: int, name: str = "k/v") -> torch.Tensor:
    """K or V rows of `heads` heads `[heads·hd, ...]` with each head repeated tp/heads times when there are fewer
    heads than ranks, so each rank's contiguous slice holds the one head it attends with."""
    if heads >= tp:
        return x
    if tp % heads or x.shape[0] % heads:
        raise MConvertError(f"{name}: TP={tp} and {heads} KV heads: one must divide the other")
    return x.reshape(heads, -1, *x.shape[1:]).repeat_interleave(tp // heads, dim=0).reshape(-1, *x.shape[1:])


def qkv_rank_blocks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, nkv: int, tp: int,
                    name: str = "q/k/v") -> list[list[torch.Tensor]]:
    """Per rank `[q_r, k_r, v_r]`: the rank's query heads and its KV heads (duplicated when `nkv < tp`)."""
    if q.shape[0] % tp:
        raise MConvertError(f"{name}: {q.shape[0]} query rows are not divisible by TP={tp}")
    k, v = kv_dup(k, nkv, tp, name), kv_dup(v, nkv, tp, name)
    if k.shape[0] % tp:
        raise MConvertError(f"{name}: {k.shape[0]} key rows are not divisible by TP={tp}")
    return [list(parts) for parts in zip(q.chunk(tp), k.chunk(tp), v.chunk(tp))]


def pad_rows(x: torch.Tensor, multiple: int) -> torch.Tensor:
    """Zero rows appended up to a multiple of `multiple` (an engine that pads the vocab itself per rank)."""
    pad = -x.shape[0] % multiple
    return cat([x, x.new_zeros(pad, *x.shape[1:])]) if pad else x
