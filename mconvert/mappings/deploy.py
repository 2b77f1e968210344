"""Per-rank tensors of a deployment format from full Megatron tensors: split kinds + layout forms.

A family's FT or TensorRT-LLM layout is a table: canonical mcore template -> `DeployRule(names, form)`. The split
comes from the split kind `ModelSpec` declares for the parameter; the `form` says only how the engine stores the
rank's shard (see `FORMS`); the cutting itself is `transforms`. No family name or HF name appears here.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

import torch

from mconvert.errors import MConvertError
from mconvert.io.transpose import copy_transposed
from mconvert.mappings import transforms as T
from mconvert.mappings.record import DeployRule, Tensors
from mconvert.mappings.deploy_names import EMBEDDING, HEAD, registry as _registry, unit_names, unit_params
from mconvert.mappings.wildcards import fill
from mconvert.spec import ModelSpec

__all__ = ["EMBEDDING", "HEAD", "unit_names", "unit_params"]  # kept importable from here



def _qkv(spec: ModelSpec, full: torch.Tensor, name: str, empty: T.Empty | None = None) -> list[torch.Tensor]:
    """[q, k, v] of the fused Megatron tensor, rotary pairs in rotate_half order (what the engines compute)."""
    nq, ng, hd = spec.num_attention_heads, spec.num_groups, spec.head_dim
    q, k, v = T.qkv_to_separate(full, nq, ng, hd, name, empty)
    if spec.rotary_interleaved:
        q, k = T.interleaved_to_half(q, nq, hd, name), T.interleaved_to_half(k, ng, hd, name)
    return [q, k, v]


def _whole(spec: ModelSpec, full: torch.Tensor, kind: str, tp: int, name: str,
           empty: T.Empty | None = None) -> list[list[torch.Tensor]]:
    x = T.strip_vocab(full, spec.vocab_size, name) if kind == "vocab" else full
    return [[x]] * tp


def _split(spec: ModelSpec, full: torch.Tensor, kind: str, tp: int, name: str,
           empty: T.Empty | None = None) -> list[list[torch.Tensor]]:
    if kind == "vocab":
        full = T.strip_vocab(full, spec.vocab_size, name)
    return [[x] for x in T.split(full, kind, tp, name)]


def _split_t(spec: ModelSpec, full: torch.Tensor, kind: str, tp: int, name: str,
             empty: T.Empty | None = None) -> list[list[torch.Tensor]]:
    return [[x] for x in T.split_transposed(full, kind, tp, name)]


def _vocab_padded(spec: ModelSpec, full: torch.Tensor, kind: str, tp: int, name: str,
                  empty: T.Empty | None = None) -> list[list[torch.Tensor]]:
    return [[x] for x in T.split(T.pad_rows(T.strip_vocab(full, spec.vocab_size, name), tp), "vocab", tp, name)]


class _PerRank(Sequence):
    """The ranks' tensors of one form, each made when it is asked for: a caller that writes some ranks only
    (a torchrun process) skips the other ranks' copies."""

    def __init__(self, make: Callable[[int], list[torch.Tensor]], n: int) -> None:
        self._make, self._n = make, n

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, r: int) -> list[torch.Tensor]:  # type: ignore[override]
        if not 0 <= r < self._n:
            raise IndexError(r)
        return self._make(r)


def _cat(b: list[torch.Tensor], empty: T.Empty | None) -> torch.Tensor:
    """`torch.cat(b)` along rows, into `empty`'s memory when given."""
    if empty is None or len({(x.dtype, tuple(x.shape[1:])) for x in b}) != 1:
        return torch.cat(b)
    return torch.cat(b, out=empty((sum(x.shape[0] for x in b), *b[0].shape[1:]), b[0].dtype))


def _qkv_cat(spec: ModelSpec, full: torch.Tensor, kind: str, tp: int, name: str,
             empty: T.Empty | None = None) -> Sequence[list[torch.Tensor]]:
    blocks = T.qkv_rank_blocks(*_qkv(spec, full, name, empty), spec.num_groups, tp, name)
    return _PerRank(lambda r: [_cat(blocks[r], empty)], len(blocks))


def _stack_t(b: list[torch.Tensor], empty: T.Empty | None = None) -> list[torch.Tensor]:
    if b[0].dim() == 1:
        return [torch.stack(b)]  # [3, out/t]
    # [in, 3, out/t] filled by one transposing copy per part (a stack and then a permuted copy move it twice)
    shape = (b[0].shape[1], len(b), b[0].shape[0])
    s = empty(shape, b[0].dtype) if empty is not None else torch.empty(shape, dtype=b[0].dtype)
    for j, part in enumerate(b):
        copy_transposed(part, s[:, j])
    return [s]


def _qkv_stack_t(spec: ModelSpec, full: torch.Tensor, kind: str, tp: int, name: str,
                 empty: T.Empty | None = None) -> Sequence[list[torch.Tensor]]:
    blocks = T.qkv_rank_blocks(*_qkv(spec, full, name, empty), spec.num_groups, tp, name)
    return _PerRank(lambda r: _stack_t(blocks[r], empty), len(blocks))


def _gated(spec: ModelSpec, full: torch.Tensor, kind: str, tp: int, name: str,
           empty: T.Empty | None = None) -> list[list[torch.Tensor]]:
    return [list(s.chunk(2, dim=0)) for s in T.split(full, "gated", tp, name)]


def _gated_t(spec: ModelSpec, full: torch.Tensor, kind: str, tp: int, name: str,
             empty: T.Empty | None = None) -> list[list[torch.Tensor]]:
    return [[p.t() if p.dim() == 2 else p for p in parts] for parts in _gated(spec, full, kind, tp, name)]


# form -> per rank, one tensor per name of the rule; a form that copies takes an allocator (`empty`, see
# `transforms.Empty`) for the copies
FORMS: dict[str, Callable[..., Sequence[list[torch.Tensor]]]] = {
    "whole": _whole,  # the full tensor on every rank (vocab rows: the true vocab)
    "split": _split,  # the split kind's shard, Linear `[out, in]`
    "split_t": _split_t,  # the split kind's shard, stored `[in, out]`
    "vocab_padded": _vocab_padded,  # true vocab, zero rows up to a multiple of TP, split on rows
    "qkv_cat": _qkv_cat,  # cat(q_r, k_r, v_r) along rows, KV heads duplicated when fewer than ranks
    "qkv_stack_t": _qkv_stack_t,  # `[in, 3, out/t]` (weights) / `[3, out/t]` (biases)
    "gated": _gated,  # gate_r and up_r of the gated fc1, two names, `[out, in]`
    "gated_t": _gated_t,  # gate_r and up_r, stored `[in, out]`
}


def check_table(table: dict[str, DeployRule], what: str) -> None:
    """A layout table names only known forms and one name per produced tensor (checked at import)."""
    for tpl, rule in table.items():
        if rule is None:
            continue
        if rule.form not in FORMS:
            raise ValueError(f"{what}: {tpl}: unknown deployment form {rule.form!r}")
        if len(rule.names) != (2 if rule.form.startswith("gated") else 1):
            raise ValueError(f"{what}: {tpl}: form {rule.form!r} with {len(rule.names)} names")


def check_complete(spec: ModelSpec, unit: str | int, have: Collection[str], what: str, source: str = "checkpoint") -> None:
    """Refuse a unit that ended without one of its declared parameters (`have`: the names that came)."""
    for d in unit_params(spec, unit):
        if d.name not in have:
            raise _missing(source, d.name, unit, what)


def _missing(source: str, name: str, unit: str | int, what: str) -> MConvertError:
    return MConvertError(f"{source}: parameter {name!r} is missing (unit {unit!r}); cannot write {what}")


def rank_tensors(spec: ModelSpec, table: dict[str, DeployRule | None], unit: str | int, mcore: Tensors, tp: int,
                 what: str, tied_head: torch.Tensor | None = None, source: str = "checkpoint",
                 ranks: Collection[int] | None = None, part: bool = False,
                 empty: T.Empty | None = None) -> list[Tensors]:
    """One unit's full tensors -> per-rank target tensors under the table's names (`{r}`: the rank).

    Every parameter ModelSpec declares for the unit goes through its rule (a `None` rule drops it); `tied_head`
    (the embedding of a tied model) goes through the head's rule when the table writes a head. `ranks`: cut
    only these ranks' tensors (the others' dicts stay empty); None: every rank. `part`: `mcore` holds some of
    the unit's parameters (a writer given the unit in parts checks the rest came once it ends). `empty`: the
    allocator of the copies a form makes (`transforms.Empty`)."""
    reg = _registry(table)
    out: list[Tensors] = [{} for _ in range(tp)]
    decls = [(d.name, d.kind) for d in unit_params(spec, unit) if not part or d.name in mcore]
    if unit == "final" and tied_head is not None and HEAD in table and table[HEAD] is not None:
        decls.append((HEAD, "vocab"))
    for name, kind in decls:
        full = tied_head if name == HEAD and spec.tie_embeddings else mcore.get(name)
        if full is None:
            raise _missing(source, name, unit, what)
        m = reg.match(name)
        if m is None:
            raise MConvertError(f"{what} has no place for parameter {name!r} of this {spec.family} model")
        _, rule, layer = m
        if rule is None:
            continue
        per_rank = FORMS[rule.form](spec, full, kind, tp, name, empty)
        for r in range(len(per_rank)):
            if ranks is not None and r not in ranks:
                continue
            parts = per_rank[r]
            for tpl, x in zip(rule.names, parts, strict=True):
                out[r][fill(tpl, layer).replace("{r}", str(r))] = x
    return out


def files(per_rank: list[Tensors]) -> Tensors:
    """Per-rank tensors -> one dict of files (an engine with one file per tensor and rank): names repeated on
    every rank (the replicated tensors) are written once."""
    out: Tensors = {}
    for d in per_rank:
        for k, v in d.items():
            out.setdefault(k, v)
    return out
