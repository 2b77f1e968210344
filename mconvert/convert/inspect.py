"""`mconvert inspect`: what a checkpoint is — format, ModelSpec, and how the graph is cut: every parameter's
split kind, its shape on each TP rank and pipeline stage, and the collective its layer needs at run time."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Group
from rich.table import Table

from mconvert.convert.base import SourceBase
from mconvert.layouts.megatron import PipelineSplit
from mconvert.convert.sources import open_source
from mconvert.errors import rich_safe
from mconvert.mappings.transforms import split_dim
from mconvert.spec import SPLIT_COLLECTIVE, name_template


def _ranges(layers: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    out, start = [], None
    for i, x in enumerate(layers):
        if start is None:
            start = x
        if i + 1 == len(layers) or layers[i + 1] != x + 1:
            out.append(f"{start}" if start == x else f"{start}-{x}")
            start = None
    return ",".join(out)


def inspect_checkpoint(path: str | Path, iteration: int | str | None = None) -> dict[str, Any]:
    """Describe a checkpoint (Megatron torch / torch_dist / HF) without reading any tensor data."""
    src = open_source(path, iteration=iteration, verify=False)  # no tensor data read: no hashing either
    src.close()  # what follows reads only what opening it learned (spec, layout, shapes)
    spec, tp, pp, vpp = src.spec, src.tp, src.pp, src.vpp
    stored: dict[str, tuple[int, ...]] = src.shapes or {}
    stages: dict[str, list[int]] = {}
    split = src.split or PipelineSplit.make(spec.num_layers, pp, vpp)
    for p in range(pp):
        for chunk in split.stage_layers(p):
            for layer in chunk:
                stages.setdefault(str(p), []).append(layer)
    params = []
    layer0 = [d for d in spec.layer_params(0) if d.expert in (None, 0)]  # one row per expert template
    decls = spec.embedding_params(tp) + layer0 + spec.final_params(tp)
    if spec.tie_embeddings and "output_layer.weight" in stored:
        decls.append(type(decls[0])("output_layer.weight", "vocab", decls[0].shape))
    for d in decls:
        tpl = name_template(d.name)
        full = list(d.shape)
        if d.kind == "vocab" and src.format == "hf":
            full[0] = spec.vocab_size  # HF stores the true vocab; Megatron pads it
        sd = split_dim(d.kind, len(full))
        shard = list(full)
        if sd is not None:
            shard[sd] //= tp
        if d.name in stored:
            shard = list(stored[d.name])
        if d.layer is not None:
            where = {p: _ranges(ls) for p, ls in stages.items()}
        elif d.name.startswith("embedding."):
            where = {"0": "-"}
        else:
            where = {str(pp - 1): "-"}
        params.append({
            "name": tpl, "kind": d.kind, "full_shape": full, "split_dim": sd,
            "rank_shapes": {str(t): shard for t in range(tp)}, "stages": where,
            "collective": SPLIT_COLLECTIVE[d.kind] if tp > 1 or d.kind != "replicated" else "none",
        })
    files = src.listed_files()
    return {
        "writer": writer_of(src),
        "path": str(path), "format": src.format, "iteration": src.iteration,
        "tp": tp, "pp": pp, "vpp": vpp, "ep": src.ep, "spec": spec.to_dict(),
        "padded_vocab_size": spec.padded_vocab_size(tp), "parameters": spec.num_parameters(),
        "tokenizer": str(src.tokenizer_dir) if src.tokenizer_dir else None,
        "stage_layers": {p: _ranges(ls) for p, ls in stages.items()}, "params": params, "files": files,
        **({"bridge": src.writer} if src.writer else {}),  # Megatron-Bridge (convert/megatron/bridge.py)
    }


def writer_of(src: SourceBase) -> dict[str, Any] | None:
    """Which program wrote the checkpoint and which of its fields were read (None for an HF directory).

    A source whose configuration is not a Megatron `args` Namespace (a Megatron-Bridge `run_config.yaml`)
    answers for itself through its `writer` (`bridge.writer_info`), given here the same keys: `writer`,
    `summary`, `fields`, `read`, `counts`."""
    own = src.writer
    if isinstance(own, dict):
        read = list(own["fields_read"])
        return {**own, "summary": own["text"].removeprefix("written by "), "fields": len(src.bridge_config["model"]),
                "read": read, "counts": {"read": len(read)}}
    args = src.args
    if args is None:
        return None
    from mconvert.convert.megatron.checkpoint import args_dict

    return describe_megatron_args(args_dict(args, src.path))


def describe_megatron_args(args: dict[str, Any]) -> dict[str, Any]:
    """Which writer a Megatron `args` dict comes from, and how the guard judged each of its fields.

    `writer`: "Megatron-LM" with the `release` whose field set matches best (and the `similarity`, 1.0 for an
    exact match), or "mconvert" for the few fields mconvert's trainer / hf-to-megatron store (with
    `model_family`, its own name, and less than half of any release's field set). `read`: the fields read into
    the ModelSpec; `counts`: how many fields each rule of `fields.megatron_rule` judged."""
    from mconvert.mappings.fields import megatron_rule
    from mconvert.mappings.megatron_releases import closest_release

    counts = dict.fromkeys(("read", "checked", "neutral", "release default", "inert family", "unset"), 0)
    read = []
    for name, value in args.items():
        rule = megatron_rule(name, value, args)
        counts[rule] = counts.get(rule, 0) + 1
        if rule == "read":
            read.append(name)
    out: dict[str, Any] = {"fields": len(args), "read": sorted(read), "counts": counts}
    best = closest_release(args)
    if "model_family" in args and (best is None or best[2] < 0.5):
        what = "trainer" if "train_iters" in args else "hf-to-megatron / reshard"
        return {"writer": "mconvert", "summary": f"mconvert {what} args ({len(args)} fields)", **out}
    if best is None:
        return {"writer": "unknown", "summary": f"args of an unknown writer ({len(args)} fields)", **out}
    release, n, similarity = best
    era = release if release == "main" else release.rsplit(".", 1)[0]
    how = "" if similarity == 1.0 else f", {similarity:.1%} alike"
    return {"writer": "Megatron-LM", "release": release, "similarity": round(similarity, 3),
            "summary": f"Megatron-LM {era}-era args ({len(args)} fields; {release} stores {n}{how})", **out}


def render_inspect(info: dict[str, Any]) -> Any:
    """Rich renderables: a summary table and the per-parameter table."""
    s = info["spec"]
    head = Table(title=f"{rich_safe(info['path'])}: {info['format']}", show_header=False)
    head.add_column("field")
    head.add_column("value")
    head.add_row("parallel", f"TP={info['tp']} PP={info['pp']}" + (f" VPP={info['vpp']}" if info["vpp"] else "")
                 + (f" EP={info['ep']}" if info.get("ep", 1) > 1 else ""))
    head.add_row("iteration", str(info["iteration"]))
    w = info.get("writer")
    if w:
        head.add_row("written by", rich_safe(w["summary"]))
        judged = ", ".join(f"{n} {k}" for k, n in w["counts"].items() if n)
        head.add_row("fields read", rich_safe(f"{', '.join(w['read'])}  ({judged})"))
    head.add_row("family", s["family"])
    head.add_row("parameters", f"{info['parameters']:,}")
    for k in ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
              "ffn_hidden_size", "vocab_size", "max_position_embeddings", "normalization", "norm_epsilon",
              "activation", "position_embedding_type", "rotary_base", "tie_embeddings", "params_dtype"):
        head.add_row(k, str(s[k]))
    for k in ("qk_layernorm", "rope_scaling", "rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor",
              "rope_original_max_position_embeddings", "yarn_beta_fast", "yarn_beta_slow", "yarn_mscale",
              "yarn_mscale_all_dim", "yarn_correction_range_round_to_int", "num_experts", "moe_ffn_hidden_size",
              "moe_router_topk"):
        if k in s:  # present only when the model uses them
            head.add_row(k, str(s[k]))
    head.add_row("padded vocab", str(info["padded_vocab_size"]))
    head.add_row("stage layers", "  ".join(f"pp{p}: {r}" for p, r in info["stage_layers"].items()))
    head.add_row("tokenizer", rich_safe(info["tokenizer"]))
    if info.get("files"):  # torch_dist: the DCP data files and the small ones beside them
        head.add_row("files", "  ".join(f"{rich_safe(f['path'])} {f['bytes']:,} B" for f in info["files"]))
    t = Table(title="parameters (layer index *; shapes per TP rank)")
    for c in ("parameter", "split", "full shape", "shard shape × TP", "stages", "run-time collective"):
        t.add_column(c)
    for p in info["params"]:
        shard = next(iter(p["rank_shapes"].values()))
        t.add_row(p["name"], p["kind"], str(tuple(p["full_shape"])), f"{tuple(shard)} × {len(p['rank_shapes'])}",
                  " ".join(f"pp{k}:{v}" for k, v in p["stages"].items()), p["collective"])
    return Group(head, t)
