"""The `mconvert` command: a thin typer layer, one function per verb, each calling one library function.

Every failure becomes one line `error: ...` on stderr and exit 1: MConvertError as it is, OS errors with
their cause, anything else (a bug) as "internal error" with its type; a refusal naming several fields adds one
indented line per field under it. What the lines show from files and keys is escaped (markup, control
characters) in one place, `errors.rich_safe`. MCONVERT_DEBUG=1 re-raises instead.
Library code never imports typer.
"""

from __future__ import annotations

import atexit
import errno
import json
import math
import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from mconvert import dtypes
from mconvert.io import tuning
from mconvert.errors import MConvertError, at_least_one
from mconvert.errors import rich_safe as plain

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Move Megatron-LM checkpoints to HuggingFace / FasterTransformer / TensorRT-LLM / ONNX, "
    "re-shard them, and prove every result by comparing logits.",
)
console = Console(stderr=True)


def error_line(message: object) -> None:
    """Print `error: MESSAGE` as exactly one line on stderr, whatever MESSAGE holds; an MConvertError that names
    several items (`details`) follows it with one indented line per item, each escaped on its own."""
    summary, details = (message.summary, message.details) if isinstance(message, MConvertError) else (message, ())
    console.print(f"[bold red]error:[/] {plain(summary)}", highlight=False, soft_wrap=True, emoji=False)
    for line in details:
        console.print(f"  {plain(line)}", highlight=False, soft_wrap=True, emoji=False)


# ---- shared option types ----------------------------------------------------------------------------
Force = Annotated[bool, typer.Option("--force", help="Replace OUT if it exists (only at the final rename).")]
DryRun = Annotated[bool, typer.Option("--dry-run", help="Print files, sizes and peak memory; write nothing.")]
Json = Annotated[bool, typer.Option("--json", help="Print the report as JSON on stdout.")]


def dtype_option(allowed: tuple[str, ...] = dtypes.PARAM_DTYPES, auto: bool = True, what: str = "") -> object:
    """THE `--dtype` option type: its help lists the verb's choices from `dtypes.choices`; the library parses
    the word with `dtypes.choose`, which refuses the dtypes a verb does not write by name."""
    words = "|".join(dtypes.choices(allowed, auto))
    more = " (auto keeps the source dtype)" if auto else ""
    return Annotated[str, typer.Option("--dtype", help=f"{words}{more}{'; ' + what if what else ''}.")]


Dtype = dtype_option()
Iteration = Annotated[Optional[str], typer.Option("--iteration", help="Iteration number or 'release' (default: latest).")]
Workers = Annotated[int, typer.Option("--workers", help="Parameters read and re-laid at once, on threads "
                                      "(0: one per core; 1: one after another).")]


ManifestHash = Annotated[str, typer.Option("--manifest-hash", help="Digest in OUT's manifest: blake3 (fast, "
                                          "multi-threaded) or sha256 (what sha256sum and the Hub's LFS ids show).")]


def _manifest_hash(name: str, one_process: str | None = None) -> None:
    """Set the manifest's hash; `one_process`: the verb, refused under torchrun (it cannot share its work)."""
    from mconvert.io.hashing import set_manifest_hash

    set_manifest_hash(name)
    if one_process is not None:
        from mconvert.convert.scaleout import refuse_torchrun

        refuse_torchrun(one_process)


def _workers(n: int) -> None:
    # the verb's engine (torch and up) loads only when the verb runs: --help and usage errors stay instant
    from mconvert.convert.base import set_workers

    set_workers(n)


_NO_SPLIT = {"--tp": "1 means no tensor parallelism", "--pp": "1 means no pipeline parallelism",
             "--ep": "1 means no expert parallelism", "--vpp": "omit --vpp for no virtual pipeline"}


def _at_least_one(*options: tuple[str, Optional[int]]) -> None:
    """Refuse a size or count option below 1 (None: not given) before the verb starts: one line naming it."""
    for flag, value in options:
        at_least_one(flag, value, _NO_SPLIT.get(flag.split("/")[0].replace("target-", ""), "pass a whole number >= 1"))


def _positive_rate(*options: tuple[str, Optional[float]]) -> None:
    """Refuse a bandwidth or tolerance that is not a finite number > 0 (None: not given)."""
    for flag, value in options:
        if value is not None and not (math.isfinite(value) and value > 0):
            raise MConvertError(f"{flag} must be > 0 and finite, got {value}; or omit it")

# ==== train (trainer/) ===============================================================================
TrainInt = Optional[int]


@app.command("train", epilog="""Examples:\n
  mconvert train --preset tiny-llama --tp 2 --pp 2 --dp 1 --steps 50 --save ckpt/\n
  mconvert train --preset tiny-llama --tp 2 --pp 2 --steps 100 --save ckpt/ --resume\n
  mconvert train --preset gpt2-1b --tp 4 --pp 2 --steps 0 --save big/   (initialised model only)\n
  mconvert train --preset tiny-gpt2 --tp 2 --dp 2 --steps 20 --comm-report --json\n
  mconvert train --preset tiny-mixtral --tp 2 --dp 2 --ep 2 --steps 20 --save moe/ --comm-report\n
  mconvert train --preset tiny-mistral --window-size 31 --seq-length 64 --save swa/   (a 32-key sliding window)\n
  mconvert train --preset tiny-llama --num-layers 5 --pp 3 --decoder-first-pipeline-num-layers 1 --save uneven/""")
def train_cmd(
    preset_name: Annotated[str, typer.Option("--preset", help="Model preset (tiny-llama, tiny-gpt2, ...).")] = "tiny-llama",
    tp: Annotated[int, typer.Option("--tp", help="Tensor-parallel size.")] = 1,
    pp: Annotated[int, typer.Option("--pp", help="Pipeline-parallel size.")] = 1,
    dp: Annotated[int, typer.Option("--dp", help="Data-parallel size.")] = 1,
    ep: Annotated[int, typer.Option("--ep", help="Expert-parallel size (MoE): experts split over EP data-parallel ranks; divides --dp.")] = 1,
    steps: Annotated[int, typer.Option("--steps", help="Iteration to train to (Megatron train_iters); 0 = save the init.")] = 50,
    save: Annotated[Optional[Path], typer.Option("--save", help="Checkpoint directory (Megatron legacy torch format).")] = None,
    save_interval: Annotated[TrainInt, typer.Option("--save-interval", help="Also save every N iterations.")] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue from the latest iteration in --save.")] = False,
    force: Annotated[bool, typer.Option("--force", help="Replace a checkpoint already in --save.")] = False,
    seed: Annotated[int, typer.Option("--seed", help="Init and data-order seed.")] = 1234,
    lr: Annotated[float, typer.Option("--lr", help="Adam learning rate (constant).")] = 1e-3,
    weight_decay: Annotated[float, typer.Option("--weight-decay", help="AdamW weight decay of the weights (biases, norms: none).")] = 0.0,
    micro_batch_size: Annotated[int, typer.Option("--micro-batch-size")] = 4,
    global_batch_size: Annotated[int, typer.Option("--global-batch-size", help="Multiple of micro-batch × DP.")] = 16,
    seq_length: Annotated[int, typer.Option("--seq-length")] = 64,
    dtype: dtype_option(("float32", "bfloat16"), auto=False, what="bf16: every saved tensor bf16, fp32 Adam") = "fp32",  # type: ignore[valid-type]
    sequence_parallel: Annotated[bool, typer.Option("--sequence-parallel", help="Megatron sequence parallelism (TP > 1).")] = False,
    comm_report: Annotated[bool, typer.Option("--comm-report", help="Table of collectives per group.")] = False,
    device: Annotated[Optional[str], typer.Option("--device", help="cpu | cuda (default: cuda if available).")] = None,
    num_layers: Annotated[TrainInt, typer.Option("--num-layers")] = None,
    hidden_size: Annotated[TrainInt, typer.Option("--hidden-size")] = None,
    num_attention_heads: Annotated[TrainInt, typer.Option("--num-attention-heads")] = None,
    num_query_groups: Annotated[TrainInt, typer.Option("--num-query-groups")] = None,
    ffn_hidden_size: Annotated[TrainInt, typer.Option("--ffn-hidden-size")] = None,
    max_position_embeddings: Annotated[TrainInt, typer.Option("--max-position-embeddings")] = None,
    kv_channels: Annotated[TrainInt, typer.Option("--kv-channels")] = None,
    num_experts: Annotated[TrainInt, typer.Option("--num-experts", help="MoE: experts per layer (overrides the preset).")] = None,
    moe_topk: Annotated[TrainInt, typer.Option("--moe-topk", help="MoE: experts each token is routed to (>= 2).")] = None,
    moe_ffn_hidden_size: Annotated[TrainInt, typer.Option("--moe-ffn-hidden-size", help="MoE: each expert's ffn width.")] = None,
    moe_aux_loss_coeff: Annotated[float, typer.Option("--moe-aux-loss-coeff", help="MoE: load-balancing loss coefficient.")] = 1e-2,
    window_size: Annotated[TrainInt, typer.Option("--window-size", help="Sliding window on every layer: the keys before each query (Megatron's --window-size W,0; HF sliding_window W+1).")] = None,
    first_layers: Annotated[TrainInt, typer.Option("--decoder-first-pipeline-num-layers", help="Uneven PP: decoder layers of the first stage.")] = None,
    last_layers: Annotated[TrainInt, typer.Option("--decoder-last-pipeline-num-layers", help="Uneven PP: decoder layers of the last stage.")] = None,
    pp_layout: Annotated[Optional[str], typer.Option("--pipeline-model-parallel-layout", help="Uneven PP: Megatron-LM's layout string, one stage per rank ('Et|ttt|tL').")] = None,
    json_out: Json = False,
) -> None:
    """Train a GPT (dense or MoE) on the shipped corpus with TP×PP×DP processes (EP inside DP); write Megatron checkpoints."""
    # the verb's engine (torch and up) loads only when the verb runs: --help and usage errors stay instant
    from mconvert.trainer.comm import render_report
    from mconvert.trainer.train import TrainConfig, train
    tuning.quiet_gc()  # the imports out of the collector's reach; the collector back on

    cfg = TrainConfig(
        preset=preset_name, tp=tp, pp=pp, dp=dp, ep=ep, steps=steps, save=str(save) if save else None,
        save_interval=save_interval, resume=resume, force=force, seed=seed, lr=lr, weight_decay=weight_decay,
        micro_batch_size=micro_batch_size, global_batch_size=global_batch_size, seq_length=seq_length,
        dtype=dtype, sequence_parallel=sequence_parallel, comm_report=comm_report, device=device, log_stderr=json_out, num_layers=num_layers,
        hidden_size=hidden_size, num_attention_heads=num_attention_heads, num_query_groups=num_query_groups,
        ffn_hidden_size=ffn_hidden_size, max_position_embeddings=max_position_embeddings, kv_channels=kv_channels,
        num_experts=num_experts, moe_topk=moe_topk, moe_ffn_hidden_size=moe_ffn_hidden_size,
        moe_aux_loss_coeff=moe_aux_loss_coeff, window_size=window_size, decoder_first_pipeline_num_layers=first_layers,
        decoder_last_pipeline_num_layers=last_layers, pipeline_model_parallel_layout=pp_layout,
    )
    result = train(cfg)
    if json_out:
        keys = ("collective", "group", "ranks_reporting", "calls", "bytes", "seconds")
        comm = [dict(zip(keys, (r[0], r[1], r[5], r[2], r[3], r[4]))) for r in result.get("comm", [])]
        moe = {"load_balancing_losses": result["load_balancing_losses"]} if "load_balancing_losses" in result else {}
        print(json.dumps({"losses": result.get("losses", []), **moe, "comm": comm, "save": cfg.save}))
    elif comm_report:
        Console().print(render_report(result.get("comm", [])))


# ==== end train ======================================================================================

# ==== conversion verbs (convert/, mappings/) ========================================================
@app.command("plan")
def plan_cmd(
    preset_name: Annotated[str, typer.Option("--preset", help="Model preset (mconvert.mappings.families.PRESETS), e.g. llama3-405b.")],
    to: Annotated[str, typer.Option("--to", help="hf | ft | trtllm (from Megatron at --tp/--pp) | megatron (from "
                                    "HF, or reshard).")],
    tp: Annotated[int, typer.Option("--tp", help="Megatron TP of the source (hf/ft) or of the output (megatron).")] = 1,
    pp: Annotated[int, typer.Option("--pp", help="Megatron PP, as --tp.")] = 1,
    target_tp: Annotated[Optional[int], typer.Option("--target-tp", help="Reshard (--to megatron) / FT / "
                                                     "TensorRT-LLM TP.")] = None,
    target_pp: Annotated[Optional[int], typer.Option("--target-pp", help="Reshard target PP (--to megatron).")] = None,
    ep: Annotated[int, typer.Option("--ep", help="Megatron expert-parallel size, as --tp (MoE presets).")] = 1,
    target_ep: Annotated[Optional[int], typer.Option("--target-ep", help="Reshard target EP (--to megatron).")] = None,
    first: Annotated[Optional[int], typer.Option(
        "--decoder-first-pipeline-num-layers", "--first-stage-layers",
        help="Uneven PP: decoder layers of the first stage (Megatron-LM's arg; --first-stage-layers: its former "
             "name here).")] = None,
    last: Annotated[Optional[int], typer.Option(
        "--decoder-last-pipeline-num-layers", "--last-stage-layers",
        help="Uneven PP: decoder layers of the last stage (Megatron-LM's arg; --last-stage-layers: its former "
             "name here).")] = None,
    pp_layout: Annotated[Optional[str], typer.Option(
        "--pipeline-model-parallel-layout", help="Layers per (virtual) stage, Megatron-LM's string: "
        "'Ett|tt|ttL'.")] = None,
    dtype: Dtype = "auto",
    format: Annotated[str, typer.Option("--format", help="Megatron output format (--to megatron): torch or "
                                        "torch_dist.")] = "torch",
    bandwidth_file: Annotated[
        Optional[Path], typer.Option("--bandwidth-file", help="Measured bandwidth JSON (default: `make bench`'s).")
    ] = None,
    files: Annotated[bool, typer.Option("--files", help="With --json: list every file and its bytes.")] = False,
    nodes: Annotated[Optional[int], typer.Option("--nodes", help="Also estimate on torchrun: machines.")] = None,
    procs_per_node: Annotated[int, typer.Option("--procs-per-node", help="torchrun processes per machine.")] = 1,
    disk_gb: Annotated[Optional[float], typer.Option("--disk-gb-per-s", help="Disk bandwidth per machine, GB/s "
                                                     "(default: the measured copy bandwidth, or what one process "
                                                     "moves where that is more).")] = None,
    net_gb: Annotated[Optional[float], typer.Option("--network-gb-per-s", help="Each machine's link to the "
                                                    "shared file system, GB/s (default: no limit).")] = None,
    json_out: Json = False,
) -> None:
    """Estimate a conversion from shapes alone: files, bytes, peak memory, time at the measured bandwidth.

    Examples:
      mconvert plan --preset llama3-405b --tp 8 --pp 16 --to hf
      mconvert plan --preset llama3-405b --tp 8 --pp 16 --to megatron --target-tp 8 --target-pp 8 --json
      mconvert plan --preset llama3-405b --tp 8 --to megatron --format torch_dist
      mconvert plan --preset llama3-405b --tp 8 --pp 16 --to hf --nodes 4 --procs-per-node 8 --network-gb-per-s 3
      mconvert plan --preset moe-671b --tp 8 --ep 8 --to megatron --target-ep 16
      mconvert plan --preset llama3-405b --tp 8 --pp 16 --to trtllm --target-tp 8 --nodes 2 --procs-per-node 4
    """
    _at_least_one(("--tp", tp), ("--pp", pp), ("--ep", ep), ("--target-tp", target_tp), ("--target-pp", target_pp),
                  ("--target-ep", target_ep), ("--decoder-first-pipeline-num-layers/--first-stage-layers", first),
                  ("--decoder-last-pipeline-num-layers/--last-stage-layers", last),
                  ("--nodes", nodes), ("--procs-per-node", procs_per_node))
    _positive_rate(("--disk-gb-per-s", disk_gb), ("--network-gb-per-s", net_gb))
    # the verb's engine (torch and up) loads only when the verb runs: --help and usage errors stay instant
    from mconvert.layouts.estimate import estimate, load_bandwidth, render_estimate, scaleout_estimate
    from mconvert.mappings.families import preset

    est = estimate(
        preset(preset_name), to, tp=tp, pp=pp, target_tp=target_tp, target_pp=target_pp, dtype=dtype,
        first_stage_layers=first, last_stage_layers=last, pipeline_layout=pp_layout,
        bandwidth=load_bandwidth(bandwidth_file),
        model=preset_name, format=format, ep=ep, target_ep=target_ep,
    )
    if nodes is not None:
        est = scaleout_estimate(est, nodes, procs_per_node, disk_gb and disk_gb * 1e9, net_gb and net_gb * 1e9)
    if json_out:
        print(json.dumps(est.to_dict(with_files=files), indent=1))
    else:
        console.print(render_estimate(est))


Tp = Annotated[int, typer.Option("--tp", help="Target tensor-parallel size.")]
Pp = Annotated[int, typer.Option("--pp", help="Target pipeline-parallel size.")]
Vpp = Annotated[Optional[int], typer.Option("--vpp", help="Virtual pipeline chunks per stage (model0, model1, ...).")]
Ep = Annotated[int, typer.Option("--ep", help="Target expert-parallel size (MoE models: divides the experts; "
                                 "rank dirs get the _EEE suffix when > 1).")]
FirstLayers = Annotated[Optional[int], typer.Option(
    "--decoder-first-pipeline-num-layers", help="Uneven PP: decoder layers of the first stage (Megatron-LM's arg).")]
LastLayers = Annotated[Optional[int], typer.Option(
    "--decoder-last-pipeline-num-layers", help="Uneven PP: decoder layers of the last stage (Megatron-LM's arg).")]
PpLayout = Annotated[Optional[str], typer.Option(
    "--pipeline-model-parallel-layout", help="Layers per (virtual) stage, Megatron-LM's string: 'Ett|tt|ttL'.")]


def _pipeline(first: Optional[int], last: Optional[int], layout: Optional[str]) -> dict:
    """The uneven-split options under Megatron-LM's arg names (None: not given)."""
    return {"decoder_first_pipeline_num_layers": first, "decoder_last_pipeline_num_layers": last,
            "pipeline_model_parallel_layout": layout}


def _print_report(report: dict, json_out: bool) -> None:
    """A writing verb's report (`convert/writer.py`: the same keys for every verb): JSON on stdout, or a rich
    table of files plus every other key on stderr. Under torchrun rank 0 alone prints it: its report lists
    every rank's files (a `rank` column)."""
    if report.get("processes") and os.environ.get("RANK", "0") != "0":
        return
    if json_out:
        print(json.dumps(report, indent=1, default=str))
        return
    title = ("DRY RUN (nothing written): " if report.get("dry_run") else "") + f"{report['verb']} → {report['output']}"
    t = Table(title=plain(title))
    t.add_column("file")
    t.add_column("bytes", justify="right")
    by_rank = any("rank" in f for f in report["files"])
    if by_rank:
        t.add_column("rank", justify="right")
    for f in report["files"]:
        t.add_row(plain(f["path"]), "?" if f["bytes"] is None else f"{f['bytes']:,}",
                  *([str(f.get("rank", ""))] if by_rank else []))
    console.print(t)
    for k, v in report.items():
        if k in ("verb", "output", "files", "warnings", "notes", "dry_run") or v in (None, [], ""):
            continue
        console.print(f"  {k}: {_report_value(k, v)}", highlight=False)
    for n in report.get("notes", []):
        console.print(f"  note: {plain(n)}", highlight=False, soft_wrap=True)
    for w in report.get("warnings", []):
        console.print(f"[bold yellow]WARNING:[/] {plain(w)}", highlight=False, soft_wrap=True)


def _report_value(key: str, v: object) -> str:
    """One report value as the table prints it: byte counts with thousands separators, a flat dict of figures
    (`input_manifest`) as `name value` pairs with its counts separated the same way."""
    if isinstance(v, dict) and v and all(isinstance(x, (int, float, str)) for x in v.values()):
        return ", ".join(f"{k} {x:,}" if type(x) is int else f"{k} {plain(x)}" for k, x in v.items())
    if type(v) is int and "bytes" in key:
        return f"{v:,}"
    return plain(v)


@app.command("megatron-to-hf")
def megatron_to_hf_cmd(
    ckpt: Annotated[Path, typer.Argument(help="Megatron checkpoint dir (torch or torch_dist, any TP/PP/VPP).")],
    out: Annotated[Path, typer.Argument(help="HF output dir (safetensors, config.json, tokenizer).")],
    iteration: Iteration = None,
    dtype: Dtype = "auto",
    tokenizer: Annotated[Optional[Path], typer.Option("--tokenizer", help="HF tokenizer dir to carry (default: "
                                                      "tokenizer files beside the checkpoint).")] = None,
    max_shard_size: Annotated[str, typer.Option("--max-shard-size", help="Largest safetensors shard.")] = "5GB",
    fp8_blocks: Annotated[bool, typer.Option("--fp8-blocks", help="Write the projection weights block-scaled FP8 "
                                             "(e4m3, a float32 scale per 128x128 block: DeepSeek-V3's release "
                                             "layout, which transformers and vLLM load).")] = False,
    fp8_tp: Annotated[Optional[int], typer.Option("--fp8-tp", help="With --fp8-blocks: the vLLM tensor-parallel "
                                                  "size to serve at; refuses a projection whose TP slice is not "
                                                  "whole 128x128 blocks, as vLLM's loader does.")] = None,
    force: Force = False,
    manifest_hash: ManifestHash = "blake3",
    dry_run: DryRun = False,
    workers: Workers = 0,
    json_out: Json = False,
) -> None:
    """Convert a Megatron checkpoint to a HuggingFace directory, one layer at a time.

    Examples:
      mconvert megatron-to-hf ckpt/ hf-out/
      mconvert megatron-to-hf ckpt/ hf-out/ --iteration 2000 --dtype bf16 --tokenizer tok/ --max-shard-size 2GB
      mconvert megatron-to-hf ckpt/ hf-out/ --dry-run
      mconvert megatron-to-hf ds-ckpt/ ds-fp8/ --fp8-blocks --fp8-tp 8
    """
    # the verb's engine (torch and up) loads only when the verb runs: --help and usage errors stay instant
    from mconvert.convert.verbs import megatron_to_hf

    _manifest_hash(manifest_hash)
    _workers(workers)
    tuning.apply()
    _print_report(megatron_to_hf(ckpt, out, iteration=iteration, dtype=dtype, tokenizer=tokenizer,
                                 max_shard_size=max_shard_size, force=force, progress=True, dry_run=dry_run,
                                 fp8_blocks=fp8_blocks, fp8_tp=fp8_tp), json_out)


@app.command("hf-to-megatron")
def hf_to_megatron_cmd(
    hf_dir: Annotated[Path, typer.Argument(help="HF model dir (GPT-2, Llama, Mistral, Qwen2).")],
    out: Annotated[Path, typer.Argument(help="Megatron checkpoint output dir.")],
    tp: Tp = 1,
    pp: Pp = 1,
    vpp: Vpp = None,
    ep: Ep = 1,
    first_layers: FirstLayers = None,
    last_layers: LastLayers = None,
    pp_layout: PpLayout = None,
    dtype: Dtype = "auto",
    format: Annotated[str, typer.Option("--format", help="torch (mp_rank_* rank files) or torch_dist "
                                        "(megatron-core dist_checkpointing, Megatron-LM's default).")] = "torch",
    bridge: Annotated[bool, typer.Option("--bridge", help="torch_dist only: also write what Megatron-Bridge loads "
                                         "it from (run_config.yaml, train_state.pt; iter_0000000/).")] = False,
    force: Force = False,
    manifest_hash: ManifestHash = "blake3",
    dry_run: DryRun = False,
    workers: Workers = 0,
    json_out: Json = False,
) -> None:
    """Convert a HuggingFace model to a Megatron checkpoint (torch or torch_dist) at TP/PP/EP (vocab padded with zeros).

    Examples:
      mconvert hf-to-megatron hf-model/ ckpt/ --tp 2 --pp 2
      mconvert hf-to-megatron hf-model/ ckpt/ --tp 4 --pp 2 --vpp 2 --dtype bf16 --force
      mconvert hf-to-megatron hf-model/ ckpt-dist/ --tp 2 --format torch_dist
      mconvert hf-to-megatron mixtral-hf/ ckpt/ --tp 2 --ep 4
      mconvert hf-to-megatron hf-model/ ckpt-bridge/ --format torch_dist --bridge
      mconvert hf-to-megatron hf-model/ ckpt/ --pp 4 --decoder-first-pipeline-num-layers 1
    """
    _at_least_one(("--tp", tp), ("--pp", pp), ("--vpp", vpp), ("--ep", ep))
    # the verb's engine (torch and up) loads only when the verb runs: --help and usage errors stay instant
    from mconvert.convert.verbs import hf_to_megatron

    _manifest_hash(manifest_hash)
    _workers(workers)
    tuning.apply()
    _print_report(hf_to_megatron(hf_dir, out, tp=tp, pp=pp, vpp=vpp, dtype=dtype, force=force, progress=True,
                                 dry_run=dry_run, format=format, ep=ep, bridge=bridge,
                                 pipeline=_pipeline(first_layers, last_layers, pp_layout)), json_out)


@app.command("reshard")
def reshard_cmd(
    ckpt: Annotated[Path, typer.Argument(help="Megatron checkpoint dir.")],
    out: Annotated[Path, typer.Argument(help="Output checkpoint dir at the new layout.")],
    tp: Tp = 1,
    pp: Pp = 1,
    vpp: Vpp = None,
    ep: Ep = 1,
    first_layers: FirstLayers = None,
    last_layers: LastLayers = None,
    pp_layout: PpLayout = None,
    with_optimizer: Annotated[bool, typer.Option("--with-optimizer", help="Re-shard the Adam states too, so "
                                                 "`mconvert train --resume` continues at the new layout.")] = False,
    iteration: Iteration = None,
    format: Annotated[Optional[str], typer.Option("--format", help="Output format: torch or torch_dist "
                                                  "(default: the source's).")] = None,
    optimizer_layout: Annotated[Optional[str], typer.Option(
        "--optimizer-layout", help="torch_dist --with-optimizer: fully_reshardable or dp_reshardable (Megatron-LM's "
        "default) distributed-optimizer states (default: the source's, else fully_reshardable).")] = None,
    bridge: Annotated[Optional[bool], typer.Option("--bridge/--no-bridge", help="torch_dist: also write what "
                      "Megatron-Bridge loads it from (default: when the source is a Megatron-Bridge checkpoint).")] = None,
    force: Force = False,
    manifest_hash: ManifestHash = "blake3",
    dry_run: DryRun = False,
    workers: Workers = 0,
    json_out: Json = False,
) -> None:
    """Re-shard a Megatron checkpoint to a new TP/PP/EP (merge to full tensors, split again; no HF detour),
    optionally into the other Megatron format (torch <-> torch_dist).

    Examples:
      mconvert reshard ckpt/ ckpt-tp4/ --tp 4 --pp 1
      mconvert reshard ckpt/ ckpt-tp2pp2/ --tp 2 --pp 2 --with-optimizer
      mconvert reshard ckpt/ ckpt-dist/ --tp 2 --pp 1 --format torch_dist
      mconvert reshard moe-ckpt/ moe-ep4/ --tp 1 --ep 4
      mconvert reshard ckpt/ ckpt-dp/ --tp 2 --format torch_dist --with-optimizer --optimizer-layout dp_reshardable
      mconvert reshard ckpt/ ckpt-pp4/ --pp 4 --pipeline-model-parallel-layout 'Ett|tt|tt|tL'
    """
    _at_least_one(("--tp", tp), ("--pp", pp), ("--vpp", vpp), ("--ep", ep))
    # the verb's engine (torch and up) loads only when the verb runs: --help and usage errors stay instant
    from mconvert.convert.verbs import reshard

    _manifest_hash(manifest_hash)
    _workers(workers)
    tuning.apply()
    _print_report(reshard(ckpt, out, tp=tp, pp=pp, vpp=vpp, with_optimizer=with_optimizer, iteration=iteration,
                          force=force, progress=True, dry_run=dry_run, format=format, ep=ep,
                          optimizer_layout=optimizer_layout, bridge=bridge,
                          pipeline=_pipeline(first_layers, last_layers, pp_layout)), json_out)


@app.command("inspect")
def inspect_cmd(
    ckpt: Annotated[Path, typer.Argument(help="Megatron (torch / torch_dist) or HF checkpoint dir.")],
    iteration: Iteration = None,
    json_out: Json = False,
) -> None:
    """Show the format, ModelSpec, every parameter's split kind and shape per rank, and its run-time collective.

    Examples:
      mconvert inspect ckpt/
      mconvert inspect ckpt/ --iteration 100 --json
    """
    # the verb's engine (torch and up) loads only when the verb runs: --help and usage errors stay instant
    from mconvert.convert.inspect import inspect_checkpoint, render_inspect
    tuning.quiet_gc()  # the imports out of the collector's reach; the collector back on

    info = inspect_checkpoint(ckpt, iteration=iteration)
    if json_out:
        print(json.dumps(info, indent=1, default=str))
    else:
        Console().print(render_inspect(info))


# ==== end conversion verbs ===========================================================================

# ==== deployment verbs (FT, TensorRT-LLM, ONNX) ======================================================
AcceptWindowAsFull = Annotated[bool, typer.Option(
    "--accept-window-as-full", help="Write a sliding-window model for this format's full attention anyway: it then "
    "agrees with the model only on sequences up to the window's length (the report says so).")]


@app.command("megatron-to-ft")
def megatron_to_ft_cmd(
    src: Annotated[Path, typer.Argument(help="Megatron checkpoint dir (torch or torch_dist) or HF model dir.")],
    out: Annotated[Path, typer.Argument(help="Output dir; the FT layout goes to OUT/<N>-gpu/.")],
    tp: Annotated[int, typer.Option("--tp", "--infer-tp", help="Inference tensor parallelism (divides the heads); "
                                    "--infer-tp is the same option.")] = 1,
    # FT's weight_data_type choices (`fastertransformer.FT_PARAM_DTYPES`; the CLI does not import the engine)
    dtype: dtype_option(("float32", "float16"), auto=False, what="FT's weight_data_type") = "fp32",  # type: ignore[valid-type]
    allow_approx_gelu: Annotated[
        bool, typer.Option("--allow-approx-gelu", help="Write an exact-GeLU model for FT's tanh GeLU anyway.")
    ] = False,
    accept_window_as_full: AcceptWindowAsFull = False,
    iteration: Iteration = None,
    force: Force = False,
    dry_run: DryRun = False,
    manifest_hash: ManifestHash = "blake3",
    workers: Workers = 0,
    as_json: Json = False,
) -> None:
    """Write FasterTransformer's layout (config.ini + raw per-rank .bin files), then check it as FT's loader would.

    GPT-2 style models get FT's [gpt] layout, LLaMA-style MHA models its [llama] layout; what FT cannot
    represent (GQA in its LLaMA loader, erf GeLU, biases in LLaMA, a rotary base other than 10000) is refused.

    Examples:
      mconvert megatron-to-ft ckpt/ ft/ --tp 2
      mconvert megatron-to-ft ckpt/ ft/ --infer-tp 2 --dry-run
      mconvert megatron-to-ft hf-gpt2/ ft/ --tp 4 --dtype fp16 --force --json
    """
    _at_least_one(("--tp/--infer-tp", tp))
    # the verb's engine (torch and up) loads only when the verb runs: --help and usage errors stay instant
    from mconvert.convert.verbs import megatron_to_ft

    _manifest_hash(manifest_hash)
    _workers(workers)
    tuning.apply()
    _print_report(megatron_to_ft(src, out, tp, dtype, force, allow_approx_gelu, iteration, progress=True,
                                 dry_run=dry_run, accept_window_as_full=accept_window_as_full), as_json)


@app.command("megatron-to-trtllm")
def megatron_to_trtllm_cmd(
    src: Annotated[Path, typer.Argument(help="Megatron checkpoint dir (torch or torch_dist) or HF model dir.")],
    out: Annotated[Path, typer.Argument(help="Output dir: config.json + rank{i}.safetensors.")],
    tp: Annotated[int, typer.Option("--tp", help="TensorRT-LLM tensor parallelism (rank files).")] = 1,
    dtype: Dtype = "auto",
    accept_window_as_full: AcceptWindowAsFull = False,
    iteration: Iteration = None,
    force: Force = False,
    dry_run: DryRun = False,
    manifest_hash: ManifestHash = "blake3",
    workers: Workers = 0,
    as_json: Json = False,
) -> None:
    """Write a TensorRT-LLM checkpoint (names/shapes as its gpt/llama converters), then check every rank file.

    Feed OUT to `trtllm-build --checkpoint_dir OUT`. GQA is supported (KV heads duplicated when fewer than --tp).

    Examples:
      mconvert megatron-to-trtllm ckpt/ trtllm/ --tp 2
      mconvert megatron-to-trtllm ckpt/ trtllm/ --tp 2 --dry-run
      mconvert megatron-to-trtllm hf-llama/ trtllm/ --tp 4 --dtype fp16 --force
    """
    _at_least_one(("--tp", tp))
    # the verb's engine (torch and up) loads only when the verb runs: --help and usage errors stay instant
    from mconvert.convert.verbs import megatron_to_trtllm

    _manifest_hash(manifest_hash)
    _workers(workers)
    tuning.apply()
    _print_report(megatron_to_trtllm(src, out, tp, dtype, force, iteration, progress=True, dry_run=dry_run,
                                     accept_window_as_full=accept_window_as_full), as_json)


OutType = Annotated[str, typer.Option("--outtype", help="f32|f16|bf16|q8_0: the type of the 2-D weights "
                                       "(norms and biases stay f32, as llama.cpp's converter writes them).")]
GgufTokenizer = Annotated[Optional[Path], typer.Option("--tokenizer", help="HF tokenizer dir to embed (default: "
                                                       "the tokenizer files beside the model).")]


@app.command("megatron-to-gguf")
def megatron_to_gguf_cmd(
    ckpt: Annotated[Path, typer.Argument(help="Megatron checkpoint dir (torch or torch_dist, any TP/PP).")],
    out: Annotated[Path, typer.Argument(help="Output file, e.g. model.gguf (its manifest goes beside it).")],
    outtype: OutType = "f16",
    tokenizer: GgufTokenizer = None,
    accept_window_as_full: AcceptWindowAsFull = False,
    iteration: Iteration = None,
    force: Force = False,
    dry_run: DryRun = False,
    manifest_hash: ManifestHash = "blake3",
    json_out: Json = False,
) -> None:
    """Write one GGUF file for llama.cpp straight from a Megatron checkpoint, one layer at a time.

    Examples:
      mconvert megatron-to-gguf ckpt/ model.gguf
      mconvert megatron-to-gguf ckpt/ model-q8.gguf --outtype q8_0 --iteration 2000 --tokenizer tok/
      mconvert megatron-to-gguf ckpt/ model.gguf --dry-run
    """
    # the verb's engine (torch and up) loads only when the verb runs: --help and usage errors stay instant
    from mconvert.convert.verbs import to_gguf

    _manifest_hash(manifest_hash, one_process="megatron-to-gguf")
    tuning.apply()
    _print_report(to_gguf(ckpt, out, outtype, tokenizer, iteration, force, verb="megatron-to-gguf", progress=True,
                          dry_run=dry_run, accept_window_as_full=accept_window_as_full), json_out)


@app.command("hf-to-gguf")
def hf_to_gguf_cmd(
    hf_dir: Annotated[Path, typer.Argument(help="HF model dir (safetensors or pytorch_model.bin).")],
    out: Annotated[Path, typer.Argument(help="Output file, e.g. model.gguf (its manifest goes beside it).")],
    outtype: OutType = "f16",
    tokenizer: GgufTokenizer = None,
    accept_window_as_full: AcceptWindowAsFull = False,
    force: Force = False,
    dry_run: DryRun = False,
    manifest_hash: ManifestHash = "blake3",
    json_out: Json = False,
) -> None:
    """Write one GGUF file for llama.cpp from a HuggingFace directory, one layer at a time.

    Examples:
      mconvert hf-to-gguf hf/ model.gguf --outtype f32
      mconvert hf-to-gguf hf/ model-bf16.gguf --outtype bf16 --force --json
      mconvert hf-to-gguf hf/ model.gguf --dry-run
    """
    # the verb's engine (torch and up) loads only when the verb runs: --help and usage errors stay instant
    tuning.one_blas_thread()  # before numpy's import
    from mconvert.convert.verbs import to_gguf

    _manifest_hash(manifest_hash, one_process="hf-to-gguf")
    tuning.apply(with_torch=False)  # a safetensors directory is read as numpy arrays (`convert/hf/arrays.py`)
    _print_report(to_gguf(hf_dir, out, outtype, tokenizer, None, force, verb="hf-to-gguf", progress=True,
                          dry_run=dry_run, accept_window_as_full=accept_window_as_full), json_out)


@app.command("to-onnx")
def to_onnx_cmd(
    src: Annotated[Path, typer.Argument(help="HF model dir or Megatron checkpoint (exported to HF first).")],
    out: Annotated[Path, typer.Argument(help="Output dir: model.onnx (+ model.onnx_data when large).")],
    with_past: Annotated[
        bool, typer.Option("--with-past/--no-past", help="Export the KV-cache graph (text-generation-with-past).")
    ] = True,
    opset: Annotated[Optional[int], typer.Option("--opset", help="ONNX opset (default: optimum's choice).")] = None,
    rtol: Annotated[float, typer.Option("--rtol", help="Max relative logits difference vs transformers.")] = 1e-4,
    exporter: Annotated[
        str, typer.Option("--exporter", help="optimum (default) or torch (plain torch.onnx.export, no cache).")
    ] = "optimum",
    iteration: Iteration = None,
    force: Force = False,
    dry_run: DryRun = False,
    manifest_hash: ManifestHash = "blake3",
    as_json: Json = False,
) -> None:
    """Export to ONNX with optimum, then refuse unless onnxruntime's logits match transformers' within --rtol.

    The check covers a prefill pass and, with the cache, one cached decode step.

    Examples:
      mconvert to-onnx hf-model/ onnx/
      mconvert to-onnx ckpt/ onnx/ --no-past --opset 17 --force
      mconvert to-onnx hf-model/ onnx/ --dry-run --json
    """
    _positive_rate(("--rtol", rtol))
    if rtol >= 1:  # a difference as large as the largest logit passes: the check would accept any export
        raise MConvertError(f"--rtol {rtol:g}: a relative difference of 1 or more accepts any logits; give a value "
                            "below 1 (default 1e-4), or omit it")
    _at_least_one(("--opset", opset))
    # the verb's engine (torch and up) loads only when the verb runs: --help and usage errors stay instant
    from mconvert.convert.verbs import to_onnx
    from mconvert.validators.onnx_runner import check_onnx_against_hf
    tuning.quiet_gc()  # the imports out of the collector's reach; the collector back on

    _manifest_hash(manifest_hash, one_process="to-onnx")
    res = to_onnx(src, out, with_past, opset, force, rtol, exporter, iteration, check=check_onnx_against_hf,
                  dry_run=dry_run)
    _print_report(res if dry_run else res.report(), as_json)


# ==== end deployment verbs ===========================================================================

# ==== validators (validate, verify) ==================================================================
Device = Annotated[str, typer.Option("--device", help="auto (GPU when present) | cpu | cuda.")]
Tokens = Annotated[int, typer.Option("--tokens", help="Tokens per sequence (batch of 2 sequences).")]


@app.command("validate")
def validate_cmd(
    ref: Annotated[Path, typer.Argument(help="Reference model: Megatron checkpoint, HF dir, FT dir, ONNX dir or .gguf.")],
    others: Annotated[list[Path], typer.Argument(help="Models to compare with REF (any of the same formats).")],
    device: Device = "auto",
    tokens: Tokens = 32,
    text: Annotated[Optional[Path], typer.Option("--text", help="Text file to tokenize (default: built-in).")] = None,
    json_out: Json = False,
    plot: Annotated[Optional[Path], typer.Option("--plot", help="Write a PNG of the error per position/layer.")] = None,
) -> None:
    """Run every model in its own format on the same tokens; compare logits with REF. Exit 0 only if all pass.

    A Megatron checkpoint runs natively at its own TP/PP (processes, gloo/NCCL); HF through transformers,
    FT through the reference runner, ONNX through onnxruntime. Tolerances depend on the dtype pair.

    Examples:
      mconvert validate ckpt/ hf/ onnx/ ft/x
      mconvert validate ckpt/ ckpt-tp1pp2/ --device cpu --tokens 64 --plot err.png
      mconvert validate hf/ onnx/ --text prompt.txt --json
      mconvert validate hf/ model.gguf model-q8.gguf
    """
    # the verb's engine (torch and up) loads only when the verb runs: --help and usage errors stay instant
    from mconvert.validators.validate import render, validate
    tuning.quiet_gc()  # the imports out of the collector's reach; the collector back on

    report = validate(ref, list(others), device=device, n_tokens=tokens, text_file=text, plot=plot)
    if json_out:
        print(json.dumps(report.to_json(), indent=1))
    else:
        render(report, console)
        if plot:
            console.print(f"plot: {plain(plot)}", highlight=False)
    if not report.passed:
        raise typer.Exit(1)


@app.command("verify")
def verify_cmd(
    hf_dir: Annotated[Path, typer.Argument(help="HF export dir to check before serving it with vLLM, or a .gguf "
                                           "file to check in llama.cpp.")],
    against: Annotated[
        Optional[Path], typer.Option("--against", help="Checkpoint it came from: adds the logits check.")
    ] = None,
    vllm_python: Annotated[
        Optional[Path], typer.Option("--vllm-python", help="Interpreter of a vLLM venv (`make vllm-env`): serve it "
                                     "in a real vLLM engine and compare with transformers.")
    ] = None,
    device: Device = "auto",
    json_out: Json = False,
) -> None:
    """vLLM readiness: registry architecture, strict weights, index/shards, dtypes, NaN/Inf, tied head, config,
    tokenizer, generation config, manifest; exit 1 on any error.

    Examples:
      mconvert verify hf/
      mconvert verify hf/ --against ckpt/ --json
      mconvert verify hf/ --against ckpt/ --vllm-python ~/.cache/mconvert/vllm-venv/bin/python
      mconvert verify model.gguf --against ckpt/
    """
    # the verb's engine (torch and up) loads only when the verb runs: --help and usage errors stay instant
    from mconvert.validators.verify import render_verify, verify
    from mconvert.validators.verify_gguf import verify_gguf
    tuning.quiet_gc()  # the imports out of the collector's reach; the collector back on

    if hf_dir.suffix == ".gguf" and hf_dir.is_file():  # llama.cpp's checks (--vllm-python does not apply)
        report = verify_gguf(hf_dir, against=against, device=device)
    else:
        report = verify(hf_dir, against=against, vllm_python=vllm_python, device=device)
    if json_out:
        print(json.dumps(report.to_json(), indent=1))
    else:
        render_verify(report, console)
    if not report.passed:
        raise typer.Exit(1)
# ==== end validators =================================================================================


try:  # typer >= 0.26 vendors click (no top-level `click` module)
    from typer._click.exceptions import ClickException as _ClickException
except ImportError:  # pragma: no cover - older typer
    from click.exceptions import ClickException as _ClickException


def _os_error_message(e: OSError) -> str:
    """An OSError a user can act on: the OS's words, the path(s) and the errno name kept together."""
    where = ": ".join(str(f) for f in (e.filename, e.filename2) if f is not None)
    code = f" [{errno.errorcode.get(e.errno, e.errno)}]" if e.errno else ""
    what = e.strerror or str(e) or type(e).__name__
    return f"{where + ': ' if where else ''}{what}{code}; check the path and its permissions or free space, then run again"


def main(argv: list[str] | None = None) -> None:
    """Console-script entry: every failure ends in one `error:` line and exit 1 (MCONVERT_DEBUG=1 re-raises)."""
    debug = bool(os.environ.get("MCONVERT_DEBUG"))
    tuning.huge_pages()  # before the first tensor: torch reads it once
    try:
        with tuning.start_up():  # the collector paused until the verb's engine is imported (tuning.apply)
            rc = app(args=argv, standalone_mode=False)
        if isinstance(rc, int) and rc:  # click returns a verb's typer.Exit code instead of raising it
            sys.exit(rc)
    except MConvertError as e:
        if debug:
            raise
        error_line(e)
        sys.exit(1)
    except (typer.Abort, KeyboardInterrupt):
        console.print("[bold red]aborted[/]")
        sys.exit(130)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except _ClickException as e:  # usage errors: click's own one-line message
        e.show()
        sys.exit(e.exit_code)
    except OSError as e:
        if debug:
            raise
        error_line(_os_error_message(e))
        sys.exit(1)
    except MemoryError:
        if debug:
            raise
        error_line("out of memory; free memory (or convert on a larger machine) and run again")
        sys.exit(1)
    except Exception as e:  # noqa: BLE001 - a bug: still one line, the traceback on request
        if debug:
            raise
        text = str(e).split("\n", 1)[0][:300]
        error_line(f"internal error ({type(e).__name__}{': ' + text if text else ''}); "
                   "set MCONVERT_DEBUG=1 for the traceback and report it")
        sys.exit(1)


def run() -> None:
    """The process entry (the `mconvert` command, `python -m mconvert.cli`, torchrun's workers): `main`, then the
    process ends at once with its exit code, once its exit handlers ran. By then the report is printed and the
    output committed or removed; the interpreter's teardown of torch (its modules, thread pools, allocator) would
    only add to the wall time.
    A traceback that `MCONVERT_DEBUG=1` asks for ends the process as usual. Programs that run the CLI
    in-process call `main`."""
    try:
        main()
        code = 0
    except SystemExit as e:
        code = e.code
    if code is not None and not isinstance(code, int):  # sys.exit("message"): the message, exit status 1
        print(code, file=sys.stderr)
        code = 1
    # what the process registered to run at exit still runs (multiprocessing removes its forkserver's directory
    # from the temporary directory, weakref finalizers remove theirs); only the module teardown is skipped
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


_ = (Path,)  # Path is used by verbs below

if __name__ == "__main__":
    run()
