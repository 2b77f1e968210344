"""`make demo`: the main job end to end on a built-in default, printing each command as it runs it.

train TP=2 PP=2 → megatron-to-hf → reshard → inspect → FasterTransformer, TensorRT-LLM, ONNX →
validate every format against the checkpoint run natively → verify the HF dir (in vLLM too when a
vLLM interpreter is available: `make vllm-env`). Four presets: GPT-2 and Llama, and the Llama-3.x (rope
scaling) and Qwen3 (qk-norm, head_dim independent of hidden/heads) shapes; a format that cannot state a
model's features refuses it by name, and the demo shows the refusal and goes on.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.rule import Rule

from mconvert.errors import MConvertError
from mconvert.mappings.families import preset as get_preset
from mconvert.spec import ModelSpec

console = Console(width=int(os.environ.get("COLUMNS", "120")))


def run(*args: str, expect_refusal: bool = False) -> bool:
    """Run one mconvert command as a user would, echoing it; stop the demo on an unexpected failure."""
    cmd = [sys.executable, "-m", "mconvert.cli", *args]
    console.print(Rule(style="dim"))
    console.print(f"[bold cyan]$ mconvert {shlex.join(args)}[/]")
    t0 = time.perf_counter()
    env = {**os.environ, "COLUMNS": os.environ.get("COLUMNS", "120")}  # readable tables when piped
    rc = subprocess.call(cmd, env=env)
    dt = time.perf_counter() - t0
    if rc != 0 and expect_refusal:
        console.print(f"[yellow]refused as expected[/] (exit {rc}): this format cannot hold this model")
        return False
    if rc != 0:
        console.print(f"[bold red]demo step failed (exit {rc}) after {dt:.1f} s[/]")
        sys.exit(rc)
    console.print(f"[green]ok[/] ({dt:.1f} s)")
    return True


def states(spec: ModelSpec, target: str) -> bool:
    """Whether `target` can state every feature of `spec` (rope scaling, qk-norm), by the spec's own table."""
    try:
        spec.refuse_unmapped(target)
    except MConvertError:
        return False
    return True


def default_vllm_python() -> str | None:
    venv = Path(os.environ.get("VLLM_VENV", Path.home() / ".cache" / "mconvert" / "vllm-venv"))
    py = venv / "bin" / "python"
    return str(py) if py.exists() else None


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="demo-out", help="working directory (replaced)")
    ap.add_argument(
        "--presets", default="tiny-llama,tiny-gpt2,tiny-llama3,tiny-qwen3",
        help="comma-separated presets to take through"
    )
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--vllm-python", default=default_vllm_python())
    a = ap.parse_args(argv)

    root = Path(a.out)
    shutil.rmtree(root, ignore_errors=True)
    for name in a.presets.split(","):
        demo_one(name, root / name, a.steps, a.vllm_python)
    console.print(Rule(style="dim"))
    console.print(f"[bold green]demo complete[/]: outputs under {root}/")


def demo_one(preset: str, out: Path, steps: int, vllm_python: str | None) -> None:
    """Train one preset at TP=2 PP=2 and take it through every format, then prove the results."""
    spec = get_preset(preset)
    out.mkdir(parents=True)
    ckpt, hf, resharded = out / "ckpt", out / "hf", out / "ckpt-tp1pp2"
    ft, trt, onnx = out / "ft", out / "trtllm", out / "onnx"
    console.print(Rule(f"[bold]{preset}[/]: TP=2 PP=2, {steps} steps → every format, then proof"))

    run(
        "train",
        "--preset",
        preset,
        "--tp",
        "2",
        "--pp",
        "2",
        "--dp",
        "1",
        "--steps",
        str(steps),
        "--save",
        str(ckpt),
        "--comm-report",
    )
    run("megatron-to-hf", str(ckpt), str(hf))
    run("reshard", str(ckpt), str(resharded), "--tp", "1", "--pp", "2", "--with-optimizer")
    run("inspect", str(resharded))
    gqa = spec.num_groups != spec.num_attention_heads
    wrote_ft = run("megatron-to-ft", str(ckpt), str(ft), "--infer-tp", "2",
                   expect_refusal=gqa or not states(spec, "FasterTransformer"))
    wrote_trt = run("megatron-to-trtllm", str(ckpt), str(trt), "--tp", "2",
                    expect_refusal=not states(spec, "TensorRT-LLM"))
    run("to-onnx", str(hf), str(onnx))
    others = [str(resharded), str(hf), str(onnx)] + ([str(trt)] if wrote_trt else []) + ([str(ft)] if wrote_ft else [])
    run("validate", str(ckpt), *others)
    verify = ["verify", str(hf), "--against", str(ckpt)]
    if vllm_python:
        verify += ["--vllm-python", vllm_python]
    else:
        console.print(
            "[yellow]no vLLM interpreter found (run `make vllm-env`); verifying without a real engine[/]"
        )
    run(*verify)


if __name__ == "__main__":
    main()
