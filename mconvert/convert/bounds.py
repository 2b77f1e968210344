"""Sizes from a config / args checked against the tensors actually present, before anything is allocated.

A config.json or args Namespace is just text: `num_hidden_layers: 1000000000` would make the converter loop a
billion times, `hidden_size: 2**40` would size buffers from it, and a `vocab_size` one short of the embedding
rows would drop a row silently. The sources call these checks when they open, from the tensor shapes in the
safetensors headers / rank files (no tensor data read), so every size the converter later trusts has been
seen in the weights. Each refusal is one line naming the field, its value and what the tensors say.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from mconvert.errors import MConvertError
from mconvert.spec import SPLIT_DIM, ModelSpec

# The spec field whose value explains a dimension, tried in this order (first match is named).
_EXPLAINS = ("vocab_size", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
             "kv_channels", "max_position_embeddings")


def template(name: str) -> str:
    """`model.layers.7.mlp.up_proj.weight` -> `model.layers.*.mlp.up_proj.weight` (any layer index)."""
    return ".".join("*" if p.isdigit() else p for p in name.split("."))


def layer_of(name: str) -> int | None:
    """The layer index of a tensor name (its first all-digit component), None outside the layers."""
    return next((int(p) for p in name.split(".") if p.isdigit()), None)


def _dim_meanings(spec: ModelSpec) -> list[tuple[int, str]]:
    """(dimension size, 'field=value') pairs: which config field a tensor dimension of that size comes from."""
    hd, nh, ng = spec.head_dim, spec.num_attention_heads, spec.num_groups
    out: list[tuple[int, str]] = []
    for f in _EXPLAINS:
        v = {"num_query_groups": ng, "kv_channels": hd}.get(f, getattr(spec, f))
        sizes = {
            "vocab_size": [v, spec.padded_vocab_size()],
            "ffn_hidden_size": [v, 2 * v],
            "num_attention_heads": [nh * hd, spec.qkv_rows],
            "num_query_groups": [ng * hd, 2 * ng * hd, spec.qkv_rows],
            "kv_channels": [v, nh * hd, spec.qkv_rows],
        }.get(f, [v])
        out += [(s, f"{f}={v}") for s in sizes]
    return out


def _blame(spec: ModelSpec, want: tuple[int, ...], got: tuple[int, ...], names: Mapping[str, str]) -> str:
    """The config field (under the source's own key name) that a mismatching dimension comes from."""
    if len(want) != len(got):
        return "the model sizes"
    i = next(i for i, (w, g) in enumerate(zip(want, got)) if w != g)
    for size, what in _dim_meanings(spec):
        if size == want[i]:
            field, value = what.split("=", 1)
            return f"{names.get(field, field)}={value}"
    return "the model sizes"


def check_layer_count(spec: ModelSpec, layers: set[int], source: str, names: Mapping[str, str]) -> None:
    """The weights hold exactly layers 0 .. num_layers-1 (refused before any per-layer loop)."""
    n = spec.num_layers
    if len(layers) != n or (layers and (min(layers) != 0 or max(layers) != n - 1)):
        held = f"{len(layers)} layers" + (f" ({min(layers)}..{max(layers)})" if layers else "")
        raise MConvertError(f"{source}: {names.get('num_layers', 'num_layers')}={n} but the weights hold {held}; "
                            "fix the config or re-copy the checkpoint")


def check_shapes(spec: ModelSpec, expected: Mapping[str, tuple[int, ...]], actual: Mapping[str, tuple[int, ...]],
                 source: str, names: Mapping[str, str]) -> None:
    """Every tensor present has the shape the config implies (`expected` is keyed by `template` names)."""
    for k, got in actual.items():
        want = expected.get(template(k))
        if want is None or tuple(got) == tuple(want):
            continue  # a key the config does not declare is reported by the key tables, by name
        raise MConvertError(
            f"{source}: {_blame(spec, tuple(want), tuple(got), names)} does not match the weights: tensor {k!r} is "
            f"{list(got)}, the config implies {list(want)}; fix the config or re-copy the checkpoint"
        )


def expected_hf_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """HF tensor shapes the spec implies (layer index `*`), from the plugin on the meta device (no memory)."""
    from mconvert.mappings import to_hf

    out: dict[str, tuple[int, ...]] = {}
    for unit in ("embedding", 0, "final"):
        decls = (spec.embedding_params() if unit == "embedding" else
                 spec.final_params() if unit == "final" else spec.layer_params(0))
        meta = {d.name: torch.empty(d.shape, device="meta") for d in decls}
        out.update({template(n): tuple(t.shape) for n, t in to_hf(spec, unit, meta).items()})
    return out


def expected_shard_shapes(spec: ModelSpec, tp: int, vocab_rows: int | None = None) -> dict[str, tuple[int, ...]]:
    """Canonical Megatron shapes on one TP rank (layer index `*`); `vocab_rows`: the padded rows the args
    declare, when they do (else Megatron's own padding of the true vocab)."""
    out: dict[str, tuple[int, ...]] = {}
    for d in spec.embedding_params(tp) + spec.layer_params(0) + spec.final_params(tp):
        shape = list(d.shape)
        if d.kind == "vocab" and vocab_rows is not None:
            shape[0] = vocab_rows
        dim = SPLIT_DIM[d.kind]
        if dim is not None and len(shape) > dim:
            shape[dim] //= tp
        out[template(d.name)] = tuple(shape)
    if spec.tie_embeddings:  # the last stage's copy of the embedding, when PP > 1
        out["output_layer.weight"] = out["embedding.word_embeddings.weight"]
    return out


def check_memory(unit_sizes: Mapping[Any, int], source: str, available: int | None = None) -> None:
    """The largest unit (its shards, the merged tensors and the output buffer: 3 × its bytes) must fit in the
    memory available; `unit_sizes`: bytes of every unit, from the tensor shapes."""
    if not unit_sizes:
        return
    if available is None:
        import psutil

        available = psutil.virtual_memory().available
    unit, size = max(unit_sizes.items(), key=lambda kv: kv[1])
    if 3 * size > available:
        what = f"layer {unit}" if isinstance(unit, int) else f"the {unit}"
        raise MConvertError(f"{source}: converting {what} needs about {3 * size / 2**30:.1f} GiB (3 × its "
                            f"{size / 2**30:.1f} GiB of weights) but {available / 2**30:.1f} GiB is available; "
                            "free memory or convert on a larger machine")
