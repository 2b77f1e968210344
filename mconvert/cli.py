"""The `mconvert` command: a thin typer layer, one function per verb, each calling one library function.

Known errors (MConvertError, and OS errors a user can fix) become one line on stderr and exit 1;
MCONVERT_DEBUG=1 shows the traceback instead. Library code never imports typer.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from mconvert.errors import MConvertError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Move Megatron-LM checkpoints to HuggingFace / FasterTransformer / TensorRT-LLM / ONNX, "
    "re-shard them, and prove every result by comparing logits.",
)
console = Console(stderr=True)

# ---- shared option types ----------------------------------------------------------------------------
Force = Annotated[bool, typer.Option("--force", help="Replace OUT if it exists (only at the final rename).")]
DryRun = Annotated[bool, typer.Option("--dry-run", help="Print files, sizes and peak memory; write nothing.")]
Json = Annotated[bool, typer.Option("--json", help="Print the report as JSON on stdout.")]
Dtype = Annotated[str, typer.Option("--dtype", help="auto|fp32|bf16|fp16 (auto keeps the source dtype).")]
Iteration = Annotated[Optional[str], typer.Option("--iteration", help="Iteration number or 'release' (default: latest).")]

# ==== train (trainer/) ===============================================================================
# ==== end train ======================================================================================

# ==== conversion verbs (convert/, mappings/) ========================================================
@app.command("plan")
def plan_cmd(
    preset_name: Annotated[str, typer.Option("--preset", help="Model preset (mconvert.spec.PRESETS), e.g. llama3-405b.")],
    to: Annotated[str, typer.Option("--to", help="hf | ft (from Megatron at --tp/--pp) | megatron (from HF, or reshard).")],
    tp: Annotated[int, typer.Option("--tp", help="Megatron TP of the source (hf/ft) or of the output (megatron).")] = 1,
    pp: Annotated[int, typer.Option("--pp", help="Megatron PP, as --tp.")] = 1,
    target_tp: Annotated[Optional[int], typer.Option("--target-tp", help="Reshard (--to megatron) / FT TP.")] = None,
    target_pp: Annotated[Optional[int], typer.Option("--target-pp", help="Reshard target PP (--to megatron).")] = None,
    first: Annotated[Optional[int], typer.Option("--first-stage-layers", help="Uneven PP: layers of stage 0.")] = None,
    last: Annotated[Optional[int], typer.Option("--last-stage-layers", help="Uneven PP: layers of the last stage.")] = None,
    dtype: Dtype = "auto",
    bandwidth_file: Annotated[
        Optional[Path], typer.Option("--bandwidth-file", help="Measured bandwidth JSON (default: `make bench`'s).")
    ] = None,
    files: Annotated[bool, typer.Option("--files", help="With --json: list every file and its bytes.")] = False,
    json_out: Json = False,
) -> None:
    """Estimate a conversion from shapes alone: files, bytes, peak memory, time at the measured bandwidth.

    Examples:
      mconvert plan --preset llama3-405b --tp 8 --pp 16 --to hf
      mconvert plan --preset llama3-405b --tp 8 --pp 16 --to megatron --target-tp 8 --target-pp 8 --json
    """
    import json as _json

    from mconvert.convert.estimate import estimate, load_bandwidth, render_estimate
    from mconvert.spec import preset

    est = estimate(
        preset(preset_name), to, tp=tp, pp=pp, target_tp=target_tp, target_pp=target_pp, dtype=dtype,
        first_stage_layers=first, last_stage_layers=last, bandwidth=load_bandwidth(bandwidth_file),
        model=preset_name,
    )
    if json_out:
        print(_json.dumps(est.to_dict(with_files=files), indent=1))
    else:
        console.print(render_estimate(est))


# ==== end conversion verbs ===========================================================================

# ==== deployment verbs (FT, TensorRT-LLM, ONNX) ======================================================
def _deploy_report(title: str, rows: list[tuple[str, str]], data: dict, as_json: bool) -> None:
    """Print a deployment verb's result as a rich table (stderr) or JSON (stdout)."""
    if as_json:
        import json as _json

        print(_json.dumps(data, indent=1))
        return
    from rich.table import Table

    table = Table(title=title, show_header=False)
    for k, v in rows:
        table.add_row(k, v)
    console.print(table)


@app.command("megatron-to-ft")
def megatron_to_ft_cmd(
    src: Annotated[Path, typer.Argument(help="Megatron checkpoint dir (torch or torch_dist) or HF model dir.")],
    out: Annotated[Path, typer.Argument(help="Output dir; the FT layout goes to OUT/<N>-gpu/.")],
    infer_tp: Annotated[int, typer.Option("--infer-tp", help="Inference tensor parallelism (divides the heads).")] = 1,
    dtype: Annotated[str, typer.Option("--dtype", help="fp32|fp16 (FT's weight_data_type).")] = "fp32",
    allow_approx_gelu: Annotated[
        bool, typer.Option("--allow-approx-gelu", help="Write an exact-GeLU model for FT's tanh GeLU anyway.")
    ] = False,
    iteration: Iteration = None,
    force: Force = False,
    as_json: Json = False,
) -> None:
    """Write FasterTransformer's layout (config.ini + raw per-rank .bin files), then check it as FT's loader would.

    GPT-2 style models get FT's [gpt] layout, LLaMA-style MHA models its [llama] layout; what FT cannot
    represent (GQA in its LLaMA loader, erf GeLU, biases in LLaMA, a rotary base other than 10000) is refused.

    Examples:
      mconvert megatron-to-ft ckpt/ ft/ --infer-tp 2
      mconvert megatron-to-ft hf-gpt2/ ft/ --infer-tp 4 --dtype fp16 --force
    """
    from mconvert.convert.fastertransformer import describe, megatron_to_ft

    res = megatron_to_ft(src, out, infer_tp, dtype, force, allow_approx_gelu, iteration)
    _deploy_report("FasterTransformer", list(describe(res)), res.to_dict(), as_json)


# ==== end deployment verbs ===========================================================================

# ==== validators (validate, verify) ==================================================================
# ==== end validators =================================================================================


def main(argv: list[str] | None = None) -> None:
    """Console-script entry: map known errors to one line and exit 1."""
    try:
        app(args=argv, standalone_mode=False)
    except MConvertError as e:
        if os.environ.get("MCONVERT_DEBUG"):
            raise
        console.print(f"[bold red]error:[/] {e}", highlight=False, soft_wrap=True)
        sys.exit(1)
    except (typer.Abort, KeyboardInterrupt):
        console.print("[bold red]aborted[/]")
        sys.exit(130)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except __import__("click").exceptions.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except OSError as e:
        if os.environ.get("MCONVERT_DEBUG"):
            raise
        console.print(f"[bold red]error:[/] {e.strerror or e}: {e.filename or ''}", highlight=False, soft_wrap=True)
        sys.exit(1)


_ = (Path,)  # Path is used by verbs below

if __name__ == "__main__":
    main()
