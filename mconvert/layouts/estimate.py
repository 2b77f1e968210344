"""Spec-only conversion estimate: files, bytes, peak memory and time of a conversion, from shapes alone.

`plan.py` plans a conversion of a checkpoint on disk; this module answers the same questions for a model
nobody has on disk yet (a preset such as `llama3-405b` at TP=8 PP=16), in well under a second: every number
is a sum over `ModelSpec.params()` shapes. The time is the bytes moved at the copy bandwidth measured by
`make bench` (a small JSON, see `bandwidth_file()`), times the measured converter-to-`cp` ratio.
Layer counts that PP does not divide use Megatron's uneven first/last pipeline stage
(`--decoder-first-pipeline-num-layers` / `--decoder-last-pipeline-num-layers`).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from mconvert import dtypes
from mconvert.layouts import fp8, ft, trtllm
from mconvert.io.paths import load_json_object
from mconvert.layouts.megatron import RANK_FILE, PipelineSplit, parse_pipeline_layout, rank_dir_name
from rich.table import Table

from mconvert.errors import MConvertError, expect
from mconvert.spec import ModelSpec, ParamDecl, comes_whole, name_template

ITEMSIZE = {name: dtypes.lookup(name).itemsize for name in dtypes.PARAM_DTYPES}
DTYPE_ALIASES = {**{dtypes.lookup(name).aliases[0]: name for name in dtypes.PARAM_DTYPES}, "auto": None}
HF_MAX_SHARD_BYTES = 5 * 10**9  # transformers' save_pretrained default ("5GB")
GB = 10**9

# Used when `make bench` has not measured this machine yet: a modest SSD-backed copy rate, conservative
# converter ratios, and Python + torch resident set.
DEFAULT_BANDWIDTH: dict[str, Any] = {
    "copy_bytes_per_s": 0.5 * GB,
    "ratio_to_cp": {"megatron-to-hf": 2.0, "hf-to-megatron": 2.0, "reshard": 2.5, "megatron-to-ft": 2.0,
                    "megatron-to-trtllm": 2.0},
    "base_rss_bytes": int(0.5 * GB),
    "source": "built-in default (run `make bench` to measure this machine)",
}


def bandwidth_file() -> Path:
    """Where `make bench` leaves its measured copy bandwidth: $MCONVERT_BANDWIDTH_FILE or the user cache."""
    env = os.environ.get("MCONVERT_BANDWIDTH_FILE")
    if env:
        return Path(env)
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "mconvert" / "bandwidth.json"


def load_bandwidth(path: str | Path | None = None) -> dict[str, Any]:
    """The measured bandwidth JSON merged over the defaults; a missing default file means the defaults."""
    p = Path(path) if path is not None else bandwidth_file()
    out = json.loads(json.dumps(DEFAULT_BANDWIDTH))
    if not p.is_file():
        if path is not None:
            raise MConvertError(f"{p}: bandwidth file not found; run `make bench` or drop --bandwidth-file")
        return out
    fix = "re-run `make bench` or delete it"
    data = load_json_object(p, "bandwidth file", fix)
    if "copy_bytes_per_s" not in data:
        raise MConvertError(f"{p}: unreadable bandwidth file (no copy_bytes_per_s); {fix}")
    bw = float(expect(data["copy_bytes_per_s"], (int, float), f"{p}: copy_bytes_per_s", fix))
    if not bw > 0:
        raise MConvertError(f"{p}: copy_bytes_per_s must be positive, got {bw}; re-run `make bench`")
    out["copy_bytes_per_s"] = bw
    ratios = expect(data.get("ratio_to_cp") or {}, dict, f"{p}: ratio_to_cp", fix)
    out["ratio_to_cp"].update({k: float(expect(v, (int, float), f"{p}: ratio_to_cp.{k}", fix))
                               for k, v in ratios.items()})
    # the per-byte model (a bench run with the depth rows): start-up seconds plus bytes at the marginal rates
    if data.get("marginal_copy_bytes_per_s") is not None:
        mbw = float(expect(data["marginal_copy_bytes_per_s"], (int, float), f"{p}: marginal_copy_bytes_per_s", fix))
        if not mbw > 0:
            raise MConvertError(f"{p}: marginal_copy_bytes_per_s must be positive, got {mbw}; {fix}")
        out["marginal_copy_bytes_per_s"] = mbw
        for key in ("marginal_ratio_to_cp", "start_seconds"):
            table = expect(data.get(key) or {}, dict, f"{p}: {key}", fix)
            out[key] = {k: float(expect(v, (int, float), f"{p}: {key}.{k}", fix)) for k, v in table.items()}
            if any(not v >= 0 for v in out[key].values()):
                raise MConvertError(f"{p}: {key} holds a negative value; {fix}")
    if data.get("base_rss_bytes"):
        out["base_rss_bytes"] = int(expect(data["base_rss_bytes"], (int, float), f"{p}: base_rss_bytes", fix))
    out["source"] = str(p)
    return out


# ---- pipeline stages ----------------------------------------------------------------------------------
def suggested_first_last(num_layers: int, pp: int) -> tuple[int | None, int | None]:
    """The first and last stages' layer counts a Megatron user picks when PP does not divide the layers (Llama-3-405B,
    126 layers at PP=16: 7 + 14×8 + 7): middle stages get ceil(L/PP), first and last share the rest; (None, None)
    when PP divides them."""
    if pp < 1 or num_layers < 1:
        raise MConvertError(f"need PP >= 1 and layers >= 1 (got pp={pp}, layers={num_layers})")
    if num_layers % pp == 0:
        return None, None
    per = math.ceil(num_layers / pp)
    if pp == 2:
        return per, num_layers - per
    rest = num_layers - (pp - 2) * per
    if rest < 2:
        raise MConvertError(f"PP={pp} cannot hold {num_layers} layers with an uneven first/last stage; pass "
                            "--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers")
    return rest // 2, rest - rest // 2


def stage_split(spec: ModelSpec, pp: int, first: int | None = None, last: int | None = None,
                layout: str | None = None) -> PipelineSplit:
    """The pipeline split Megatron-LM builds from its split args (`PipelineSplit`); with none given and a PP that
    does not divide the layers, the uneven first/last stages of `suggested_first_last`."""
    if first is None and last is None and layout is None:
        first, last = suggested_first_last(spec.num_layers, pp)
    vpp = None
    if layout is not None:  # Megatron-LM sets the virtual stages from the layout's stage count
        chunks = len(parse_pipeline_layout(layout)) // pp
        vpp = chunks if chunks > 1 else None
    return PipelineSplit.make(spec.num_layers, pp, vpp, first, last, layout, mtp_num_layers=spec.mtp_num_layers)


def stage_layer_counts(num_layers: int, pp: int, first: int | None = None, last: int | None = None) -> list[int]:
    """Layers per pipeline stage (`stage_split` of a model of `num_layers` layers)."""
    if pp < 1 or num_layers < 1:
        raise MConvertError(f"need PP >= 1 and layers >= 1 (got pp={pp}, layers={num_layers})")
    if first is None and last is None:
        first, last = suggested_first_last(num_layers, pp)
    return PipelineSplit.make(num_layers, pp, None, first, last).layer_counts()


# ---- sizes ------------------------------------------------------------------------------------------
def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def _shard_numel(decl: ParamDecl, tp: int) -> int:
    n = _numel(decl.shape)
    return n if decl.kind == "replicated" else n // tp


def unit_bytes(spec: ModelSpec, tp: int, itemsize: int) -> dict[str, int]:
    """Bytes of every kind of unit summed over all TP shards (replicated params count once per rank): the
    embedding, a layer, the final unit; an MoE layer moves as its dense part and one unit per expert, a final
    unit with an MoE MTP layer one parameter at a time."""

    def total(decls: list[ParamDecl]) -> int:
        return sum(_shard_numel(d, tp) * tp for d in decls) * itemsize

    if spec.is_moe:
        layer = {"dense part": total(spec.layer_params(0, experts=False)), "expert": total(spec.expert_params(0, 0))}
    else:
        layer = {"layer": total(spec.layer_params(0))}
    final = spec.final_params(tp)
    # a final unit with an MoE MTP layer moves one parameter at a time (`spec.comes_whole`): its largest one
    held = max(total([d]) for d in final) if not comes_whole(spec, "final") else total(final)
    return {"embedding": total(spec.embedding_params(tp)), **layer, "final": held}


def megatron_files(spec: ModelSpec, tp: int, pp: int, itemsize: int, counts: list[int], ep: int = 1,
                   split: PipelineSplit | None = None) -> list[dict[str, Any]]:
    """One entry per `mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt`: tensor bytes and tensor count (pickle overhead
    not counted). At EP > 1 each (TP, PP) rank has EP files: each holds its E/EP experts and a copy of every dense
    weight and the router. Stage p holds `counts[p]` layers, consecutive (with `split`: its own layers, virtual
    chunks included), each a dense or an MoE layer as the model's layer pattern says."""
    per_ep = (spec.num_experts or ep) // ep
    kinds: dict[bool, tuple[list[int], list[list[int]]]] = {}  # MoE layer? -> (dense numels, per-EP-rank experts)
    first = {spec.is_moe_layer(i): i for i in reversed(range(spec.num_layers))}  # the first layer of each kind
    for moe, i in first.items():
        layer = spec.layer_params(i)
        kinds[moe] = ([_shard_numel(d, tp) for d in layer if d.expert is None],
                      [[_shard_numel(d, tp) for d in layer if d.expert is not None and d.expert // per_ep == e]
                       for e in range(ep)])
    emb = [_shard_numel(d, tp) for d in spec.embedding_params(tp)]
    final = spec.final_params(tp)
    fin = [_shard_numel(d, tp) for d in final if d.expert is None]
    if spec.tie_embeddings and pp > 1:  # the last stage's copy of the word embedding
        fin.append(_shard_numel(spec.embedding_params(tp)[0], tp))
    # the MTP layers' routed experts: each EP file holds its own, as for a decoder layer
    fin_experts = [[_shard_numel(d, tp) for d in final if d.expert is not None and d.expert // per_ep == e]
                   for e in range(ep)]
    starts = [sum(counts[:p]) for p in range(pp)]
    files = []
    for p, n_layers in enumerate(counts):
        layers = [i for r in split.stage_layers(p) for i in r] if split is not None else \
            range(starts[p], starts[p] + n_layers)
        moe_layers = sum(1 for i in layers if spec.is_moe_layer(i)) if len(kinds) > 1 else \
            (n_layers if next(iter(kinds)) else 0)
        for t in range(tp):
            for e in range(ep):
                numels = [x for moe, n in ((True, moe_layers), (False, n_layers - moe_layers)) if n
                          for x in (kinds[moe][0] + kinds[moe][1][e]) * n]
                numels += (emb if p == 0 else []) + (fin + fin_experts[e] if p == pp - 1 else [])
                files.append({"path": f"{rank_dir_name(t, p, pp, e, ep)}/{RANK_FILE}", "bytes": sum(numels) * itemsize,
                              "tensors": len(numels), "layers": n_layers})
    return files


def torch_dist_files(spec: ModelSpec, tp: int, itemsize: int, max_file_bytes: int = 5 * 10**9
                     ) -> list[dict[str, Any]]:
    """The torch_dist data files `__0_<i>.distcp`: every full tensor once (vocab padded for `tp`, a tied head
    not repeated) in chunks of one layer and one TP rank's shard, unit by unit in ModelSpec order, a new file
    when a chunk would take one past `max_file_bytes` (the writer's rule); per-chunk torch.save framing is
    not counted."""
    files: list[dict[str, Any]] = []

    def put(nbytes: int) -> None:
        if not files or (files[-1]["bytes"] and files[-1]["bytes"] + nbytes > max_file_bytes):
            files.append({"path": f"__0_{len(files)}.distcp", "bytes": 0, "tensors": 0})
        files[-1]["bytes"] += nbytes
        files[-1]["tensors"] += 1

    for d in spec.params(tp=tp):
        if spec.tie_embeddings and d.name == "output_layer.weight":
            continue
        split = d.kind != "replicated" and not (d.kind == "row" and len(d.shape) == 1)
        n = 2 * tp if d.kind == "gated" else tp if split else 1
        for _ in range(n):
            put(_numel(d.shape) * itemsize // n)
    return files


def hf_files(spec: ModelSpec, itemsize: int, max_shard: int = HF_MAX_SHARD_BYTES,
             fp8_block: tuple[int, int] | None = None) -> list[dict[str, Any]]:
    """safetensors shards packed greedily in parameter order at `max_shard` bytes (true vocab rows); with
    `fp8_block`, the projections block-scaled FP8 (one byte an element, a float32 scale per block beside each)."""
    if fp8_block is not None:  # a dry run's (`plan` itself imports no torch)
        import torch

        from mconvert.mappings.plugin import to_hf_one
    sizes: list[tuple[int, int]] = []  # (bytes, tensors) per parameter
    fp8_sizes: dict[str, tuple[int, int]] = {}  # by name template: every layer and expert has layer 0's
    for d in spec.params(tp=1):
        shape = d.shape
        if d.kind == "vocab":
            shape = (spec.vocab_size, *shape[1:])
        if fp8_block is None:
            sizes.append((_numel(shape) * itemsize, 1))
            continue
        tpl = name_template(d.name)
        if tpl not in fp8_sizes:
            hf = to_hf_one(spec, d.name, torch.empty(d.shape, device="meta"))
            stored = [fp8.stored_bytes(n, tuple(t.shape), itemsize, fp8_block) for n, t in hf.items()]
            fp8_sizes[tpl] = (sum(b for b, _ in stored), sum(k for _, k in stored))
        sizes.append(fp8_sizes[tpl])
    shards: list[list[tuple[int, int]]] = [[]]
    for s in sizes:
        if shards[-1] and sum(b for b, _ in shards[-1]) + s[0] > max_shard:
            shards.append([])
        shards[-1].append(s)
    n = len(shards)
    names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    return [{"path": nm, "bytes": sum(b for b, _ in sh), "tensors": sum(k for _, k in sh)}
            for nm, sh in zip(names, shards)]


def ft_files(spec: ModelSpec, ft_tp: int, dtype: str) -> list[dict[str, Any]]:
    """FasterTransformer `<t>-gpu/`: FT's own files with their bytes (`fastertransformer.prepare`, as the verb
    writes them) in unit order; `unit` is the unit (embedding, layer index, final) whose tensors a weight file
    holds (config.ini: none). A layout the verb refuses is refused here too; the approximate GELU and a sliding
    window are the verb's own flags (--allow-approx-gelu, --accept-window-as-full), so they are allowed, and bf16
    is counted as the fp16 FT's own tools write it."""
    prepared = ft.prepare(spec, ft_tp, "fp16" if dtype == "bfloat16" else dtype, allow_approx_gelu=True,
                          accept_window_as_full=True, option="--target-tp")
    order = {unit: i for i, unit in enumerate(spec.units())}
    files = [{**f, "tensors": int(f["path"] in prepared.units), "unit": prepared.units.get(f["path"])}
             for f in prepared.files]
    return sorted(files, key=lambda f: order.get(f["unit"], len(order)))


def trtllm_files(spec: ModelSpec, trt_tp: int, dtype: str) -> list[dict[str, Any]]:
    """TensorRT-LLM `rank{r}.safetensors` (tensor bytes: the shapes the checker derives from config.json; the
    header is not counted) and `config.json`, as `trtllm.prepare` works them out for the verb. A sliding window
    is the verb's own flag (--accept-window-as-full), so it is allowed."""
    prepared = trtllm.prepare(spec, trt_tp, dtype, accept_window_as_full=True)
    files = [{"path": f"rank{r}.safetensors", "bytes": prepared.rank_bytes, "tensors": len(prepared.shapes)}
             for r in range(trt_tp)]
    return files + [{"path": "config.json", "bytes": len(prepared.config_text.encode()), "tensors": 0}]


@dataclass
class Estimate:
    """What a conversion will read, write, hold and take; all from shapes."""

    model: str
    parameters: int
    operation: str
    source: str
    target: str
    dtype: str
    stage_layers: list[int]
    read_files: int
    read_bytes: int
    write_files: int
    write_bytes: int
    largest_unit: str
    largest_unit_bytes: int
    peak_memory_bytes: int
    copy_bytes_per_s: float
    seconds_at_copy_speed: float
    expected_seconds: float
    ratio_to_cp: float
    bandwidth_source: str
    start_seconds: float = 0.0  # the fixed part of `expected_seconds` (imports, opening the input)
    megatron_args: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    files: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    scaleout: dict[str, Any] | None = None  # set by `scaleout_estimate` (torchrun over nodes)

    def to_dict(self, with_files: bool = False) -> dict[str, Any]:
        d = asdict(self)
        if not with_files:
            d.pop("files")
        return d


def estimate(
    spec: ModelSpec,
    to: str,
    tp: int = 1,
    pp: int = 1,
    target_tp: int | None = None,
    target_pp: int | None = None,
    dtype: str | None = None,
    first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
    pipeline_layout: str | None = None,
    bandwidth: dict[str, Any] | None = None,
    model: str = "model",
    format: str = "torch",
    ep: int = 1,
    target_ep: int | None = None,
) -> Estimate:
    """Estimate one conversion of `spec`.

    `to`: `hf`, `ft` or `trtllm` (source: Megatron at tp/pp/ep; FT / TensorRT-LLM at target_tp, default 1),
    `megatron` (source: HF; written at tp/pp/ep, or a reshard from tp/pp/ep to target_tp/target_pp/target_ep
    when those are given) in `format` (torch or torch_dist)."""
    if to not in ("hf", "ft", "trtllm", "megatron"):
        raise MConvertError(f"--to must be hf, ft, trtllm or megatron (got {to!r})")
    if format not in ("torch", "torch_dist"):
        raise MConvertError(f"--format {format!r}: choose torch or torch_dist (the Megatron output format)")
    if format == "torch_dist" and to != "megatron":
        raise MConvertError(f"--format torch_dist describes a Megatron output; it needs --to megatron (got {to!r})")
    dtype = DTYPE_ALIASES.get(dtype, dtype) if dtype else None
    dtype = dtype or spec.params_dtype
    if dtype not in ITEMSIZE:
        raise MConvertError(f"unknown dtype {dtype!r}; use fp32, bf16 or fp16")
    src_item = ITEMSIZE[spec.params_dtype]
    out_item = ITEMSIZE[dtype]
    bw = bandwidth or load_bandwidth()
    notes: list[str] = []

    def layout(t: int, p: int, e: int = 1) -> tuple[list[int], dict[str, Any]]:
        for name, value in (("TP", t), ("PP", p), ("EP", e)):
            if value < 1:
                raise MConvertError(f"{name} must be >= 1 (got {value})")
        spec.check_parallel(tp=t, pp=1, ep=e)  # heads / groups / ffn / experts; layers are checked below
        split = stage_split(spec, p, first_stage_layers, last_stage_layers, pipeline_layout)
        counts = split.layer_counts()
        margs = {k: v for k, v in split.megatron_args().items() if v not in (None, False)}
        if margs and first_stage_layers is None and last_stage_layers is None and pipeline_layout is None:
            notes.append(
                f"PP={p} does not divide {spec.num_layers} layers evenly: uneven stages {counts[0]} + "
                f"{len(counts) - 2}×{counts[1] if len(counts) > 2 else 0} + {counts[-1]} "
                f"(Megatron --decoder-first-pipeline-num-layers {counts[0]} "
                f"--decoder-last-pipeline-num-layers {counts[-1]})"
            )
        return counts, margs

    def at(t: int, p: int, e: int) -> str:
        return f"TP={t} PP={p}" + (f" EP={e}" if spec.is_moe else "")

    if to == "megatron" and target_tp is None and target_pp is None and target_ep is None:
        operation = "hf-to-megatron"
        counts, margs = layout(tp, pp, ep)
        read = hf_files(spec, src_item)
        write = megatron_files(spec, tp, pp, out_item, counts, ep)
        units_in, units_out = unit_bytes(spec, 1, src_item), unit_bytes(spec, tp, out_item)
        source, target = "hf", f"megatron {at(tp, pp, ep)}"
        if format == "torch_dist":
            write, target = torch_dist_files(spec, tp, out_item), f"megatron torch_dist TP={tp} PP={pp}"
    elif to == "megatron":
        operation = "reshard"
        ttp, tpp, tep = target_tp or tp, target_pp or pp, target_ep or ep
        counts_in, _ = layout(tp, pp, ep)
        counts, margs = layout(ttp, tpp, tep)
        read = megatron_files(spec, tp, pp, src_item, counts_in, ep)
        write = megatron_files(spec, ttp, tpp, out_item, counts, tep)
        units_in, units_out = unit_bytes(spec, tp, src_item), unit_bytes(spec, ttp, out_item)
        source, target = f"megatron {at(tp, pp, ep)}", f"megatron {at(ttp, tpp, tep)}"
        if format == "torch_dist":
            write, target = torch_dist_files(spec, ttp, out_item), f"megatron torch_dist TP={ttp} PP={tpp}"
    else:
        operation = {"hf": "megatron-to-hf", "ft": "megatron-to-ft", "trtllm": "megatron-to-trtllm"}[to]
        counts, margs = layout(tp, pp, ep)
        read = megatron_files(spec, tp, pp, src_item, counts, ep)
        ft_tp = target_tp or 1
        if to == "ft":
            if out_item == 2 and dtype == "bfloat16":
                notes.append("FasterTransformer stores fp32 or fp16 weights; bf16 is written as fp16 by FT's own tools")
            write = ft_files(spec, ft_tp, dtype)
        elif to == "trtllm":
            write = trtllm_files(spec, ft_tp, dtype)
            notes.append("rank files hold the whole model (no pipeline split); every process that writes one "
                         "reads the whole input")
        else:
            write = hf_files(spec, out_item)
        units_in, units_out = unit_bytes(spec, tp, src_item), unit_bytes(spec, 1, out_item)
        source, target = f"megatron {at(tp, pp, ep)}", ("hf" if to == "hf" else f"{to} TP={ft_tp}")

    # Peak: one unit's input shards (all TP ranks) plus that unit's output, plus the interpreter; an MoE
    # layer's unit is its dense part or one expert, never all its experts.
    unit_total = {k: units_in[k] + units_out[k] for k in units_in}
    largest = max(unit_total, key=lambda k: unit_total[k])
    read_bytes = sum(f["bytes"] for f in read)
    write_bytes = sum(f["bytes"] for f in write)
    copy_bw = float(bw["copy_bytes_per_s"])
    ratio = float(bw["ratio_to_cp"].get(operation, DEFAULT_BANDWIDTH["ratio_to_cp"][operation]))
    start = 0.0
    marginal = bw.get("marginal_ratio_to_cp", {}).get(operation)
    if marginal is not None and bw.get("marginal_copy_bytes_per_s"):
        # measured at two depths: the start-up apart, and each byte at cp's marginal rate times this one's
        # ratio to it; a whole-run ratio from a 3 GB model would charge a large model's bytes its start-up too
        copy_bw, ratio = float(bw["marginal_copy_bytes_per_s"]), float(marginal)
        start = float(bw.get("start_seconds", {}).get(operation, 0.0))
    at_copy = max(read_bytes, write_bytes) / copy_bw
    if sum(counts) != spec.num_layers:  # internal consistency of the stage split
        raise MConvertError(f"stage split {counts} does not add up to {spec.num_layers} layers")
    return Estimate(
        model=model,
        parameters=spec.num_parameters(),
        operation=operation,
        source=source,
        target=target,
        dtype=dtype,
        stage_layers=counts,
        read_files=len(read),
        read_bytes=read_bytes,
        write_files=len(write),
        write_bytes=write_bytes,
        largest_unit=largest,
        largest_unit_bytes=unit_total[largest],
        peak_memory_bytes=unit_total[largest] + int(bw["base_rss_bytes"]),
        copy_bytes_per_s=copy_bw,
        seconds_at_copy_speed=at_copy,
        expected_seconds=start + at_copy * ratio,
        ratio_to_cp=ratio,
        bandwidth_source=str(bw.get("source", "")),
        start_seconds=start,
        megatron_args=margs,
        notes=notes,
        files={"read": read, "write": write},
    )


def _output_groups(est: Estimate) -> list[int]:
    """Bytes of each output file group a torchrun rank writes as a whole (`convert.scaleout`): a safetensors
    shard for HF output, a unit's files (embedding, a layer, final) for FT output, a pipeline stage's rank files
    for Megatron output."""
    write = est.files["write"]
    if est.operation == "megatron-to-hf":
        return [f["bytes"] for f in write]
    if est.operation == "megatron-to-trtllm":  # config.json is rank 0's shared file, not a group
        return [f["bytes"] for f in write if f["path"].startswith("rank")]
    if est.operation == "megatron-to-ft":
        units: dict[Any, int] = {}
        for f in write:  # in unit order: the order the conversion deals them out in; config.ini is rank 0's
            if f["unit"] is not None:
                units[f["unit"]] = units.get(f["unit"], 0) + f["bytes"]
        return list(units.values())
    stages: dict[str, int] = {}
    for f in write:
        rank_dir = f["path"].split("/")[0]
        stage = rank_dir.split("_")[3] if rank_dir.count("_") == 3 else "000"
        stages[stage] = stages.get(stage, 0) + f["bytes"]
    return [stages[k] for k in sorted(stages)]


# what one output file group is, and how to get more of them, per operation (else: Megatron output's stages)
_GROUPS_NOTE = {
    "megatron-to-hf": "safetensors shards; a smaller --max-shard-size makes more",
    "megatron-to-ft": "units of the model: the embedding, each layer, the final norm and head",
    "megatron-to-trtllm": "rank files, one per --target-tp rank",
}
# operations whose every file group needs the whole input (each TensorRT-LLM rank file takes from every unit)
_READS_ALL = {"megatron-to-trtllm"}


def scaleout_estimate(est: Estimate, nodes: int, procs_per_node: int, disk_bytes_per_s: float | None = None,
                      network_bytes_per_s: float | None = None, start_seconds: float = 30.0) -> Estimate:
    """`est` run under torchrun on `nodes` × `procs_per_node` processes over a shared file system.

    Output file groups go round robin to the ranks (rank = node × procs_per_node + local rank), as the
    conversion assigns them; a rank reads the input its groups need (taken in proportion to the bytes it
    writes). Per node the time is the longest of: its bytes read + written at `disk_bytes_per_s` (default: the
    measured copy bandwidth, or the rate one process moves bytes at in `est` where that is higher), the same
    bytes at `network_bytes_per_s` (the node's link to the shared file system; None: no such limit), and its
    busiest process at the one-process converter rate (TensorRT-LLM output: a process with a rank file reads
    the whole input). Plus the start of the processes (`start_seconds`)."""
    if nodes < 1 or procs_per_node < 1:
        raise MConvertError(f"--nodes {nodes} --procs-per-node {procs_per_node}: both must be >= 1")
    for name, v in (("--disk-gb-per-s", disk_bytes_per_s), ("--network-gb-per-s", network_bytes_per_s)):
        if v is not None and not v > 0:
            raise MConvertError(f"{name} must be positive")
    ranks = nodes * procs_per_node
    groups = _output_groups(est)
    total_out = sum(groups) or 1
    # ranks past the number of file groups get none: the work stays proportional to the groups, whatever
    # --nodes × --procs-per-node asks for
    per_rank = [0] * min(ranks, len(groups))
    for i, b in enumerate(groups):
        per_rank[i % ranks] += b
    if est.operation in _READS_ALL:
        read_share = [float(est.read_bytes) if b else 0.0 for b in per_rank]
    else:
        read_share = [est.read_bytes * b / total_out for b in per_rank]
    proc_rate = est.copy_bytes_per_s / est.ratio_to_cp  # bytes of max(read, write) per second, one process
    # a node's disk moves at least what one process moves in the one-process estimate: a converter faster than
    # `cp` (whose copy goes through the page cache) is not held to cp's rate once it has more processes
    one_process_io = (est.read_bytes + est.write_bytes) / max(est.expected_seconds - est.start_seconds, 1e-9)
    disk = disk_bytes_per_s or max(est.copy_bytes_per_s, one_process_io)
    worst, bottleneck, node_bytes_max = 0.0, "cpu", 0.0
    for n in range(-(-len(per_rank) // procs_per_node)):  # the nodes that hold a rank with output
        mine = range(n * procs_per_node, min((n + 1) * procs_per_node, len(per_rank)))
        io = sum(per_rank[r] + read_share[r] for r in mine)
        node_bytes_max = max(node_bytes_max, io)
        limits = {"disk": io / disk, "cpu": max(max(per_rank[r], read_share[r]) / proc_rate for r in mine)}
        if network_bytes_per_s:
            limits["network"] = io / network_bytes_per_s
        kind = max(limits, key=lambda k: limits[k])
        if limits[kind] > worst:
            worst, bottleneck = limits[kind], kind
    busy = sum(1 for b in per_rank if b)
    notes = list(est.notes)
    if busy < ranks:
        notes.append(f"only {busy} of {ranks} processes have output to write ({len(groups)} file groups: "
                     + _GROUPS_NOTE.get(est.operation, "pipeline stages of the target; a larger PP makes more")
                     + ")")
    est.scaleout = {
        "nodes": nodes, "procs_per_node": procs_per_node, "processes": ranks, "busy_processes": busy,
        "file_groups": len(groups), "largest_rank_write_bytes": max(per_rank, default=0), "largest_node_io_bytes": int(node_bytes_max),
        "disk_bytes_per_s_per_node": disk, "network_bytes_per_s_per_node": network_bytes_per_s,
        "bottleneck": bottleneck, "expected_seconds": worst + start_seconds,
        "speedup_vs_one_process": est.expected_seconds / (worst + start_seconds),
    }
    est.notes = notes
    return est


def _gb(n: float) -> str:
    return f"{n / GB:,.2f} GB"


def render_estimate(est: Estimate) -> Any:
    """A rich table of one estimate (the CLI prints it to stderr)."""
    t = Table(title=f"{est.operation}: {est.model} ({est.parameters / 1e9:,.1f} B params, {est.dtype})")
    t.add_column("quantity")
    t.add_column("estimate")
    t.add_row("source → target", f"{est.source} → {est.target}")
    t.add_row("layers per stage", " ".join(map(str, est.stage_layers)))
    t.add_row("read", f"{est.read_files} files, {_gb(est.read_bytes)}")
    t.add_row("write", f"{est.write_files} files, {_gb(est.write_bytes)}")
    t.add_row("largest unit (in + out)", f"{est.largest_unit}: {_gb(est.largest_unit_bytes)}")
    t.add_row("peak memory", _gb(est.peak_memory_bytes))
    t.add_row("copy bandwidth", f"{est.copy_bytes_per_s / GB:,.2f} GB/s ({est.bandwidth_source})")
    t.add_row("time at copy speed", f"{est.seconds_at_copy_speed / 60:,.1f} min")
    start = f"{est.start_seconds:,.0f} s start-up + " if est.start_seconds else ""
    t.add_row("expected time", f"{est.expected_seconds / 60:,.1f} min ({start}× {est.ratio_to_cp:.2f} cp)")
    so = est.scaleout
    if so:
        t.add_row("torchrun", f"{so['nodes']} node(s) × {so['procs_per_node']} processes "
                              f"({so['busy_processes']} with output; {so['file_groups']} file groups)")
        t.add_row("busiest node reads + writes", _gb(so["largest_node_io_bytes"]))
        t.add_row("expected time on torchrun", f"{so['expected_seconds'] / 60:,.1f} min (bound by {so['bottleneck']}; "
                                               f"× {so['speedup_vs_one_process']:.1f} vs one process)")
    for n in est.notes:
        t.add_row("note", n)
    return t
