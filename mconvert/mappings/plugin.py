"""Plugin tables and the two adapter functions `to_hf` / `from_hf` over one unit of full tensors.

A plugin is a table: canonical mcore name (with `*` for the layer index) -> `Rule(hf names, op)`, plus a
table of HF names that are explicit drops (`None`). `op` names one layout transform of `transforms.py`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from mconvert.errors import MConvertError
from mconvert.mappings import families
from mconvert.mappings.record import Plugin, Rule
from mconvert.mappings.wildcards import Registry, fill, layer_of
from mconvert.spec import ModelSpec, Unit

if TYPE_CHECKING:
    import torch

    from mconvert.mappings import transforms as T
else:  # the tensor ops load with torch on first use: the tables, names and shapes serve without it
    class _Transforms:
        def __getattr__(self, name: str) -> Any:
            return getattr(importlib.import_module("mconvert.mappings.transforms"), name)

    T = _Transforms()


_REG_CACHE: dict[str, Registry] = {}


def registry(p: Plugin) -> Registry[Rule]:
    """The compiled canonical-name templates of a plugin table (compiled once per table)."""
    key = f"mc:{p.family}"
    if key not in _REG_CACHE:
        _REG_CACHE[key] = Registry(p.table)
    return _REG_CACHE[key]


def hf_registry(p: Plugin) -> Registry:
    """HF template -> (mcore template, position in the rule's hf tuple), or None for a drop."""
    key = f"hf:{p.family}"
    if key not in _REG_CACHE:
        table: dict[str, tuple[str, int] | None] = {}
        for mc, rule in p.table.items():
            for i, h in enumerate(rule.hf):
                table[h] = (mc, i)
        for mc, copy in p.mtp_copies.items():  # after the rule's own HF names
            table[copy] = (mc, len(p.table[mc].hf))
        table.update(p.hf_drops)
        _REG_CACHE[key] = Registry(table)
    return _REG_CACHE[key]


# ---- multi-token prediction layers ---------------------------------------------------------------------
MTP_PREFIX, MTP_LAYER = "mtp.layers.", "transformer_layer."


def mtp_view(spec: ModelSpec, name: str) -> str:
    """The canonical name as the HF table reads it. HF numbers the multi-token prediction layers after the decoder's
    (`model.layers.{num_layers + K}`): `mtp.layers.K.transformer_layer.X` -> `decoder.layers.{num_layers + K}.X`,
    and an MTP layer's own tensors `mtp.layers.K.X` (enorm, hnorm, eh_proj, final_layernorm) ->
    `decoder.layers.{num_layers + K}.mtp.X`; every other name passes unchanged."""
    if not name.startswith(MTP_PREFIX):
        return name
    k, _, rest = name[len(MTP_PREFIX):].partition(".")
    if not k.isdigit():
        return name
    at = spec.num_layers + int(k)
    if rest.startswith(MTP_LAYER):
        return f"decoder.layers.{at}.{rest[len(MTP_LAYER):]}"
    return f"decoder.layers.{at}.mtp.{rest}"


def match(spec: ModelSpec, name: str, reg: Registry | None = None) -> tuple[str, Rule, Any] | None:
    """The plugin table's (template, rule, index) for canonical parameter `name` (an MTP layer's by `mtp_view`)."""
    return (reg or registry(plugin_for(spec))).match(mtp_view(spec, name))


def mtp_copies(spec: ModelSpec, name: str) -> list[str]:
    """The HF names of the copies each MTP layer carries of canonical parameter `name` (the family's
    `Plugin.mtp_copies`): what vLLM's MTP loader reads at `model.layers.{num_layers + K}`, and what DeepSeek
    publishes there."""
    tpl = plugin_for(spec).mtp_copies.get(name)
    if tpl is None or not spec.mtp_num_layers:
        return []
    return [fill(tpl, spec.num_layers + k) for k in range(spec.mtp_num_layers)]


# ---- ops: (to_hf, from_hf) over full tensors -------------------------------------------------------------
def _qkv_to(spec: ModelSpec, t: torch.Tensor, name: str, empty: T.Empty | None = None) -> list[torch.Tensor]:
    q, k, v = T.qkv_to_separate(t, spec.num_attention_heads, spec.num_groups, spec.head_dim, name)
    if spec.rotary_interleaved:  # HF only knows rotate_half: reorder the rotary pairs of q and k
        q = T.interleaved_to_half(q, spec.num_attention_heads, spec.head_dim, name)
        k = T.interleaved_to_half(k, spec.num_groups, spec.head_dim, name)
    return [q, k, v]


def _qkv_from(spec: ModelSpec, ts: list[torch.Tensor], name: str, empty: T.Empty | None = None) -> torch.Tensor:
    q, k, v = ts
    if spec.rotary_interleaved:
        q = T.half_to_interleaved(q, spec.num_attention_heads, spec.head_dim, name)
        k = T.half_to_interleaved(k, spec.num_groups, spec.head_dim, name)
    return T.separate_to_qkv(q, k, v, spec.num_attention_heads, spec.num_groups, spec.head_dim, name)


# Each op is called (spec, tensor(s), name, empty): `empty` (`transforms.Empty` or None) allocates the results
# the op copies into (GPT-2's transposes), so that a caller can hand it reused memory.
OPS: dict[str, tuple[Callable[..., list[torch.Tensor]], Callable[..., torch.Tensor]]] = {
    "identity": (lambda spec, t, n, e: [t], lambda spec, ts, n, e: ts[0]),
    "vocab": (lambda spec, t, n, e: [T.strip_vocab(t, spec.vocab_size, n)], lambda spec, ts, n, e: ts[0]),
    "transpose": (lambda spec, t, n, e: [T.transpose(t, n, e)], lambda spec, ts, n, e: T.transpose(ts[0], n, e)),
    "gated": (lambda spec, t, n, e: T.gated_to_halves(t, n), lambda spec, ts, n, e: T.halves_to_gated(*ts, name=n)),
    "qkv": (_qkv_to, _qkv_from),
    "qkv_conv1d": (
        lambda spec, t, n, e: [T.qkv_to_conv1d(t, spec.num_attention_heads, spec.head_dim, n, e)],
        lambda spec, ts, n, e: T.conv1d_to_qkv(ts[0], spec.num_attention_heads, spec.head_dim, n, e),
    ),
}


def _qkv_shapes(spec: ModelSpec, s: tuple[int, ...]) -> list[tuple[int, ...]]:
    nq, ng, hd = spec.num_attention_heads, spec.num_groups, spec.head_dim
    return [(nq * hd, *s[1:]), (ng * hd, *s[1:]), (ng * hd, *s[1:])]


# op -> (spec, canonical shape) -> the shapes of its HF tensors in the rule's order: what `OPS`' to_hf makes of a
# tensor of that shape, without one (planning: a writer's header, a source's expected shapes)
SHAPES: dict[str, Callable[[ModelSpec, tuple[int, ...]], list[tuple[int, ...]]]] = {
    "identity": lambda spec, s: [s],
    "vocab": lambda spec, s: [(spec.vocab_size, *s[1:])],
    "transpose": lambda spec, s: [s[::-1] if len(s) == 2 else s],
    "gated": lambda spec, s: [(s[0] // 2, *s[1:])] * 2,
    "qkv": _qkv_shapes,
    "qkv_conv1d": lambda spec, s: [s[::-1] if len(s) == 2 else s],
}


def _qkv_rows(spec: ModelSpec, rows: int) -> tuple[list[int], list[tuple[int, int, int, int]]] | None:
    if spec.rotary_interleaved:  # q and k rows are reordered within each head: not a block placement
        return None
    nq, ng, hd = spec.num_attention_heads, spec.num_groups, spec.head_dim
    if rows != (nq + 2 * ng) * hd or nq % ng:
        return None  # the op itself reports the mismatch
    return [nq * hd, ng * hd, ng * hd], T.qkv_separate_rows(nq, ng, hd)


# op -> (spec, merged rows) -> (row count of each HF part, `transforms.place_rows` plan) or None: the ops whose
# `to_hf` only moves whole rows of the merged tensor into its parts, so a reader can place each rank's rows there
ROW_PLANS: dict[str, Callable[[ModelSpec, int], tuple[list[int], list[tuple[int, int, int, int]]] | None]] = {
    "qkv": _qkv_rows,
    "gated": lambda spec, rows: None if rows % 2 else ([rows // 2] * 2, [(0, 0, 0, rows // 2), (1, 0, rows // 2, rows // 2)]),
}


def hf_row_plan(spec: ModelSpec, name: str, rows: int) -> tuple[list[str], list[int],
                                                                  list[tuple[int, int, int, int]]] | None:
    """For canonical parameter `name` with `rows` merged rows: its HF names, each one's row count and where each
    merged row goes (see `ROW_PLANS`); None when `to_hf_one` does more than place rows."""
    m = match(spec, name)
    if m is None or m[1].op not in ROW_PLANS:
        return None
    _, rule, layer = m
    got = ROW_PLANS[rule.op](spec, rows)
    if got is None:
        return None
    return [fill(h, layer) for h in rule.hf], got[0], got[1]


def mcore_row_plan(spec: ModelSpec, name: str, hf_shapes: dict[str, tuple[int, ...]]
                   ) -> tuple[list[str], tuple[int, ...], list[tuple[int, int, int, int]]] | None:
    """`hf_row_plan` the other way: for canonical `name` built from HF tensors of shapes `hf_shapes`, its HF
    names, the merged shape and where each HF row goes in it; None when the shapes do not fit a row plan (then
    `from_hf_one` builds it, and reports a mismatch)."""
    m = match(spec, name)
    if m is None or m[1].op not in ROW_PLANS:
        return None
    _, rule, layer = m
    names = [fill(h, layer) for h in rule.hf]
    if any(n not in hf_shapes for n in names):
        return None
    shapes = [hf_shapes[n] for n in names]
    rows = sum(s[0] for s in shapes if s)
    got = ROW_PLANS[rule.op](spec, rows)
    if got is None or any(len(s) < 1 or s[0] != r or s[1:] != shapes[0][1:] for s, r in zip(shapes, got[0])):
        return None
    return names, (rows, *shapes[0][1:]), got[1]


def transposed_in_hf(spec: ModelSpec, name: str) -> bool:
    """Whether HF stores canonical parameter `name` as its transpose (GPT-2's Conv1D weights)."""
    m = match(spec, name)
    return m is not None and m[1].op == "transpose"


def plugin_for(spec: ModelSpec) -> Plugin:
    """The HF⇄Megatron name table of the spec's family."""
    return families.of(spec).plugin


def _expected_mcore(spec: ModelSpec, unit: Unit) -> list[str]:
    return [d.name for d in spec.unit_params(unit)]


def to_hf(spec: ModelSpec, unit: Unit, mcore: dict[str, torch.Tensor], source: str = "checkpoint") -> dict[str, torch.Tensor]:
    """Full tensors of one unit under canonical mcore names -> HF names (vocab stripped to the true vocab).

    A tied `output_layer.weight` (the last stage's copy) is dropped: HF ties the head to the embedding."""
    reg = registry(plugin_for(spec))
    out: dict[str, torch.Tensor] = {}
    check_complete(spec, unit, mcore, source)
    for name in hf_order(spec, unit, mcore):
        out.update(to_hf_one(spec, name, mcore[name], source, reg))
    return out


def hf_order(spec: ModelSpec, unit: Unit, names: Any) -> list[str]:
    """The canonical names of one unit in the order `to_hf` emits them: ModelSpec's declared order whatever
    order the source's keys had (megatron-core's own files list linear_proj before linear_qkv; the streaming
    HF writer plans its shards by this order), then any others; the tied head (dropped) left out."""
    declared = _expected_mcore(spec, unit)
    have = list(names)
    order = [n for n in declared if n in set(have)] + [n for n in have if n not in set(declared)]
    return [n for n in order if not (n == "output_layer.weight" and spec.tie_embeddings)]


def to_hf_one(spec: ModelSpec, name: str, t: torch.Tensor, source: str = "checkpoint",
              reg: Registry | None = None, empty: T.Empty | None = None) -> dict[str, torch.Tensor]:
    """One full canonical parameter -> its HF tensor(s) (what `to_hf` does for each name); `empty`: the
    allocator of the results an op copies into (see OPS)."""
    m = match(spec, name, reg)
    if m is None:
        raise MConvertError(f"{source}: no {spec.family} mapping for parameter {name!r}")
    _, rule, layer = m
    parts = OPS[rule.op][0](spec, t, name, empty)
    out = {fill(h, layer): p for h, p in zip(rule.hf, parts, strict=True)}
    for copy in mtp_copies(spec, name):  # its own storage: a safetensors file holds no tensor twice
        out[copy] = parts[0].clone()
    return out


def to_hf_shapes(spec: ModelSpec, name: str, shape: tuple[int, ...], reg: Registry | None = None
                 ) -> dict[str, tuple[int, ...]]:
    """`to_hf_one` on shapes: the HF names canonical parameter `name` of `shape` becomes, with their shapes."""
    m = match(spec, name, reg)
    if m is None:
        raise MConvertError(f"no {spec.family} mapping for parameter {name!r}")
    _, rule, layer = m
    shapes = [tuple(int(d) for d in s) for s in SHAPES[rule.op](spec, tuple(shape))]
    out = {fill(h, layer): s for h, s in zip(rule.hf, shapes, strict=True)}
    out.update({copy: shapes[0] for copy in mtp_copies(spec, name)})
    return out


def unit_hf_shapes(spec: ModelSpec, unit: Unit) -> dict[str, tuple[int, ...]]:
    """`to_hf` on shapes: the HF tensors of one unit, in the order `to_hf` emits them, with their shapes, from
    the spec alone."""
    reg = registry(plugin_for(spec))
    decls = {d.name: d.shape for d in spec.unit_params(unit)}
    out: dict[str, tuple[int, ...]] = {}
    for name in hf_order(spec, unit, decls):
        out.update(to_hf_shapes(spec, name, decls[name], reg))
    return out


def check_complete(spec: ModelSpec, unit: Unit, names: Any, source: str = "checkpoint") -> None:
    """Every parameter ModelSpec declares for the unit is among `names` (else one clear error)."""
    have = set(names)
    missing = [n for n in _expected_mcore(spec, unit) if n not in have]
    if missing:
        raise MConvertError(f"{source}: parameter {missing[0]!r} is missing (unit {unit!r}); the checkpoint is "
                            "incomplete or its config describes another model — re-copy it")


def from_hf(spec: ModelSpec, unit: Unit, hf: dict[str, torch.Tensor], source: str = "checkpoint",
            pmap: Any = None, built: dict[str, torch.Tensor] | None = None,
            empty: T.Empty | None = None) -> dict[str, torch.Tensor]:
    """HF tensors of one unit -> full tensors under canonical mcore names (vocab rows as in HF: unpadded).

    Every HF key is consumed by a rule or an explicit drop; anything else is an error naming the key.
    `pmap` (a map over a thread pool): the parameters are built several at once (torch's ops release the GIL).
    `built`: parameters a reader already assembled from their HF tensors (`mcore_row_plan`), taken as they are.
    `empty`: the allocator of the results an op copies into (see OPS)."""
    plugin = plugin_for(spec)
    reg = registry(plugin)
    hreg = hf_registry(plugin)
    for k in hf:
        m = hreg.match(k)
        if m is None:
            raise MConvertError(f"{source}: unmapped tensor {k!r} for a {spec.family} model; "
                                "this key is neither converted nor a known buffer")
    names = _expected_mcore(spec, unit)
    done = built or {}
    parts = (pmap or _serial_map)(lambda n: done[n] if n in done else from_hf_one(spec, n, hf, source, reg, empty), names)
    return dict(zip(names, parts, strict=True))


def _serial_map(fn: Any, items: Any) -> list[Any]:
    return [fn(x) for x in items]


def from_hf_one(spec: ModelSpec, name: str, hf: dict[str, torch.Tensor], source: str = "checkpoint",
                reg: Registry | None = None, empty: T.Empty | None = None) -> torch.Tensor:
    """One canonical parameter from the HF tensors it is made of (what `from_hf` does for each name); `empty`:
    as for `to_hf_one`."""
    found = _hf_rule(spec, name, reg)
    if found is None:
        raise MConvertError(f"no {spec.family} mapping for parameter {name!r}")
    rule, names = found
    own, copies = names[: len(rule.hf)], names[len(rule.hf):]
    absent = [n for n in own if n not in hf]
    if absent:
        raise MConvertError(f"{source}: tensor {absent[0]!r} is missing (needed for {name})")
    for copy in copies:  # megatron-core has one tensor where HF has the MTP layer's copy too: it must be the same
        _check_copy(hf, copy, own[0], source)
    return OPS[rule.op][1](spec, [hf[n] for n in own], name, empty)


def _check_copy(hf: dict[str, torch.Tensor], copy: str, main: str, source: str) -> None:
    """An MTP layer's copy of a shared tensor (`mtp_copies`) equals the main one, when the checkpoint has it
    (vLLM reads the top-level one when it does not); else one error naming both."""
    t, want = hf.get(copy), hf[main]
    if t is None:
        return
    same = t.shape == want.shape and t.dtype == want.dtype
    if same and t.device.type != "meta" and want.device.type != "meta":
        import torch

        same = torch.equal(t, want)
    if not same:
        raise MConvertError(f"{source}: tensor {copy!r} differs from {main!r}; Megatron's multi-token prediction "
                            "layers share the main model's embedding and head, so this checkpoint's separate copy "
                            "cannot be converted; make the two equal or drop the MTP layers")


def hf_keys_for(spec: ModelSpec, name: str, reg: Registry | None = None) -> list[str]:
    """The HF tensors canonical parameter `name` is made of (what `from_hf_one` reads); [] when no rule
    maps it (`from_hf_one` then reports it)."""
    found = _hf_rule(spec, name, reg)
    return [] if found is None else found[1]


def check_hf_present(spec: ModelSpec, have: Any, source: str = "checkpoint") -> None:
    """Every HF tensor the config implies (each parameter's own tensors, what `from_hf_one` reads) is among
    `have`, else the error `from_hf_one` gives on reading it: the whole model is checked from names alone, so a
    `--dry-run` refuses what the conversion would (an MTP layer the config declares, a layer's bias)."""
    reg = registry(plugin_for(spec))
    for d in spec.params():
        if d.name == "output_layer.weight" and spec.tie_embeddings:
            continue
        found = _hf_rule(spec, d.name, reg)
        if found is None:
            raise MConvertError(f"no {spec.family} mapping for parameter {d.name!r}")
        rule, names = found
        absent = [n for n in names[: len(rule.hf)] if n not in have]
        if absent:
            raise MConvertError(f"{source}: tensor {absent[0]!r} is missing (needed for {d.name})")


def _hf_rule(spec: ModelSpec, name: str, reg: Registry | None = None) -> tuple[Rule, list[str]] | None:
    """The rule mapping canonical parameter `name` and the HF tensor names it reads (None: no rule)."""
    m = match(spec, name, reg)
    if m is None:
        return None
    _, rule, layer = m
    return rule, [fill(h, layer) for h in rule.hf] + mtp_copies(spec, name)


def hf_unit(spec: ModelSpec, hf_name: str, source: str = "checkpoint") -> Unit | None:
    """Which unit an HF tensor belongs to (None: an explicit drop). Unknown names are an error."""
    m = hf_registry(plugin_for(spec)).match(hf_name)
    if m is None:
        raise MConvertError(f"{source}: unmapped tensor {hf_name!r} for a {spec.family} model; "
                            "this key is neither converted nor a known buffer")
    tpl, val, layer = m
    if val is None:
        if hf_name in ("lm_head.weight",):
            return "final"
        return None
    at = layer_of(layer)
    if at is not None and not (spec.mtp_num_layers and at >= spec.num_layers):
        return at
    # an MTP layer's tensors (HF index num_layers + K) go with the final unit, its copy of the embedding with that
    return "embedding" if val[0].startswith("embedding.") else "final"


def hf_names(spec: ModelSpec, unit: Unit) -> list[str]:
    """The HF tensor names one unit produces (what an HF writer will receive)."""
    reg = registry(plugin_for(spec))
    out: list[str] = []
    for name in _expected_mcore(spec, unit):
        if name == "output_layer.weight" and spec.tie_embeddings:
            continue
        found = _hf_rule(spec, name, reg)
        if found is None:
            raise MConvertError(f"no {spec.family} mapping for parameter {name!r}")
        out += found[1]
    return out
