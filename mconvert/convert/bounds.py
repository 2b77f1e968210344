"""Sizes from a config / args checked against the tensors actually present, before anything is allocated.

A config.json or args Namespace is just text: `num_hidden_layers: 1000000000` would make the converter loop a
billion times, `hidden_size: 2**40` would size buffers from it, and a `vocab_size` one short of the embedding
rows would drop a row silently. The sources call these checks when they open, from the tensor shapes in the
safetensors headers / rank files (no tensor data read), so every size the converter later trusts has been
seen in the weights. Each refusal is one line naming the field, its value and what the tensors say.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import psutil

from mconvert.errors import MConvertError
from mconvert.mappings.plugin import to_hf_shapes
from mconvert.spec import SPLIT_DIM, LayerPart, ModelSpec, Unit, comes_whole, expert_of

ExpectedOf = Callable[[ModelSpec], Mapping[str, tuple[int, ...]]]

# The spec fields a wrong tensor shape is blamed on, tried in this order (the first that explains it is named).
_SIZES = ("vocab_size", "hidden_size", "ffn_hidden_size", "num_query_groups", "num_attention_heads", "kv_channels",
          "max_position_embeddings", "moe_ffn_hidden_size", "num_experts")


def template(name: str) -> str:
    """`model.layers.7.mlp.up_proj.weight` -> `model.layers.*.mlp.up_proj.weight` (any layer index)."""
    return ".".join("*" if p.isdigit() else p for p in name.split("."))


def layer_of(name: str) -> int | None:
    """The layer index of a tensor name (its first all-digit component), None outside the layers."""
    return next((int(p) for p in name.split(".") if p.isdigit()), None)


def _current(spec: ModelSpec, field: str) -> int:
    return {"num_query_groups": spec.num_groups, "kv_channels": spec.head_dim,
            "moe_ffn_hidden_size": spec.expert_ffn_hidden_size if spec.is_moe else None}.get(field) or getattr(spec, field)


def _blame(spec: ModelSpec, key: str, got: tuple[int, ...], expected_of: ExpectedOf,
           names: Mapping[str, str]) -> str:
    """'field=value' for the one config size whose correction would give tensor `key` the shape `got`."""
    tpl = template(key)
    divisors = {1, 2, 3, spec.head_dim, 2 * spec.head_dim, spec.num_attention_heads, spec.num_groups}
    candidates = sorted({g // m for g in got for m in divisors if m and g % m == 0 and g // m > 0})
    for field in _SIZES:
        cur = _current(spec, field)
        for v in candidates:
            if v == cur:
                continue
            try:
                if expected_of(spec.replace(**{field: v})).get(tpl) == tuple(got):
                    return f"{names.get(field, field)}={cur}"
            except (MConvertError, RuntimeError, ValueError, ZeroDivisionError):
                continue  # not a valid model with that value
    sizes = ", ".join(f"{names.get(f, f)}={_current(spec, f)}" for f in _SIZES[1:6])
    return f"the sizes ({sizes})"


def check_layer_count(spec: ModelSpec, layers: set[int], source: str, names: Mapping[str, str]) -> None:
    """The weights hold exactly layers 0 .. num_layers-1 (refused before any per-layer loop)."""
    n = spec.num_layers
    if len(layers) != n or (layers and (min(layers) != 0 or max(layers) != n - 1)):
        held = f"{len(layers)} layers" + (f" ({min(layers)}..{max(layers)})" if layers else "")
        raise MConvertError(f"{source}: {names.get('num_layers', 'num_layers')}={n} but the weights hold {held}; "
                            "fix the config or re-copy the checkpoint")


def check_shapes(spec: ModelSpec, expected_of: ExpectedOf, actual: Mapping[str, tuple[int, ...]], source: str,
                 names: Mapping[str, str]) -> None:
    """Every tensor present has the shape the config implies (`expected_of(spec)`: shapes by `template` name).

    The tensors outside the layers go first, so a wrong hidden or vocab size is named on the embedding."""
    expected = expected_of(spec)
    for k in sorted(actual, key=lambda k: layer_of(k) is not None):
        got, want = tuple(actual[k]), expected.get(template(k))
        if want is None or got == tuple(want):
            continue  # a key the config does not declare is reported by the key tables, by name
        raise MConvertError(
            f"{source}: {_blame(spec, k, got, expected_of, names)} does not match the weights: tensor {k!r} is "
            f"{list(got)}, the config implies {list(want)}; fix the config or re-copy the checkpoint"
        )


def expected_hf_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """HF tensor shapes the spec implies (layer and expert index `*`), from the plugin's shape rules (no
    tensor); layer 0 and expert 0 stand for all, so the time does not grow with num_layers or num_experts."""
    out: dict[str, tuple[int, ...]] = {}
    for unit in ("embedding", 0, "final"):
        decls = (spec.embedding_params() if unit == "embedding" else
                 spec.final_params() if unit == "final" else spec.layer_template())
        for d in decls:  # one parameter at a time: the template list is not a whole unit
            out.update({template(n): s for n, s in to_hf_shapes(spec, d.name, d.shape).items()})
    return out


def expected_shard_shapes(spec: ModelSpec, tp: int, vocab_rows: int | None = None) -> dict[str, tuple[int, ...]]:
    """Canonical Megatron shapes on one TP rank (layer index `*`); `vocab_rows`: the padded rows the args
    declare, when they do (else Megatron's own padding of the true vocab)."""
    out: dict[str, tuple[int, ...]] = {}
    for d in spec.embedding_params(tp) + spec.layer_template() + spec.final_params(tp):
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


def held_together(spec: ModelSpec, unit: Unit, param: str) -> Any:
    """What a conversion holds at once that a tensor of `unit` (part of canonical parameter `param`) belongs to:
    an MoE layer's dense part or one expert (`LayerPart`), the final unit's one parameter where that unit moves
    parameter by parameter (`("final", param)`: an MoE MTP layer, `spec.comes_whole`), else the unit."""
    if isinstance(unit, int) and spec.is_moe:
        return LayerPart(unit, expert_of(param))
    if unit == "final" and not comes_whole(spec, unit):
        return ("final", param)
    return unit


def _describe(part: Any) -> str:
    if isinstance(part, LayerPart):
        return f"layer {part.layer}'s " + ("dense part" if part.expert is None else f"expert {part.expert}")
    if isinstance(part, tuple):
        return f"{part[1]} of the {part[0]} unit"
    return f"layer {part}" if isinstance(part, int) else f"the {part}"


def memory_needed(sizes: Mapping[Any, int]) -> tuple[Any, int]:
    """(the largest of what a conversion holds at once, the bytes converting it needs: its shards, the merged
    tensors and the output buffer, 3 × its bytes); `sizes`: bytes by `held_together` part."""
    part, size = max(sizes.items(), key=lambda kv: kv[1])
    return part, 3 * size


def held_by_writer(sizes: Mapping[Any, int], splits_experts: bool, takes_parts: bool) -> dict[Any, int]:
    """`sizes` (by `held_together` part) regrouped by what a writer is fed at once: an MoE layer whole where it
    takes no expert apart (`Writer.splits_experts`), the final unit whole where it takes no unit in parts."""
    out: dict[Any, int] = {}
    for part, n in sizes.items():
        if isinstance(part, LayerPart) and not splits_experts:
            part = part.layer
        elif isinstance(part, tuple) and not takes_parts:
            part = part[0]
        out[part] = out.get(part, 0) + n
    return out


def check_memory(unit_sizes: Mapping[Any, int], source: str, available: int | None = None) -> None:
    """The largest of what a conversion holds at once (`memory_needed`) must fit in the memory available;
    `unit_sizes`: bytes of every unit or part (`held_together`), from the tensor shapes."""
    if not unit_sizes:
        return
    if available is None:
        available = psutil.virtual_memory().available
    part, need = memory_needed(unit_sizes)
    if need > available:
        raise MConvertError(f"{source}: converting {_describe(part)} needs about {need / 2**30:.1f} GiB (3 × its "
                            f"{need / 3 / 2**30:.1f} GiB of weights) but {available / 2**30:.1f} GiB is available; "
                            "free memory or convert on a larger machine")
