"""A/B: the same conversions by two versions of mconvert, interleaved in one run on the same inputs.

    .venv/bin/python bench/ab.py --a 0434fb0^1               # that commit (A) against this tree (B)
    .venv/bin/python bench/ab.py --a main --b ../wt/branch   # a ref against another checkout
    .venv/bin/python bench/ab.py --a HEAD~3 --layers 4 --repeats 5 --json

A is `git worktree add --detach` of a ref (removed at the end); B is this tree unless `--b` names a ref or a
directory. Each tree runs through `python -m mconvert.cli` with itself first on PYTHONPATH, so both share this
interpreter's packages. The inputs (a GPT-2 checkpoint at TP=4 PP=2 from the trainer, its HF export, a Llama HF
model for hf-to-gguf) are built once by B. Every round runs each operation under A then B, alternating which
goes first, so load from other processes on the machine hits both alike; the table gives medians and B / A for
wall and CPU seconds and for peak RSS. Outputs of A and B are compared file by file (every output of every verb
must be byte-identical between versions, manifests included).
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import gguf_peer  # noqa: E402
from procmon import dir_bytes, run_measured  # noqa: E402

console = Console(stderr=True, width=None if sys.stderr.isatty() else 150)
GB = 10**9
TP, PP = 4, 2

# (label, verb arguments after SRC OUT, which input): the conversions of `make bench`, each on the input it reads
OPS: list[tuple[str, list[str], str]] = [
    ("megatron-to-hf", ["megatron-to-hf"], "ckpt"),
    ("reshard TP2 PP1", ["reshard", "--tp", "2", "--pp", "1"], "ckpt"),
    ("reshard torch_dist", ["reshard", "--tp", "2", "--pp", "1", "--format", "torch_dist"], "ckpt"),
    ("megatron-to-ft", ["megatron-to-ft"], "ckpt"),
    ("megatron-to-trtllm", ["megatron-to-trtllm", "--tp", "2"], "ckpt"),
    ("hf-to-megatron", ["hf-to-megatron", "--tp", str(TP), "--pp", str(PP)], "hf"),
    ("hf-to-gguf f16", ["hf-to-gguf", "--outtype", "f16"], "llama"),
    ("hf-to-gguf q8_0", ["hf-to-gguf", "--outtype", "q8_0"], "llama"),
]
STARTUP = ("start-up: import the engine", "import mconvert.convert.verbs")


def tree_of(ref: str, work: Path, name: str) -> tuple[Path, bool]:
    """(the tree's root, whether it is a worktree made here): a directory as it is, else a detached worktree."""
    if Path(ref).is_dir():
        return Path(ref).resolve(), False
    dest = work / f"tree-{name}"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(dest), ref], check=True)
    return dest, True


def env_for(tree: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(tree)}


def run_in(tree: Path, argv: list[str]) -> None:
    r = subprocess.run([sys.executable, *argv], env=env_for(tree), capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"ab: {' '.join(argv[:4])} failed in {tree}:\n{r.stdout[-2000:]}{r.stderr[-2000:]}")


def build_inputs(tree: Path, work: Path, preset: str, layers: int | None, llama: str) -> dict[str, Path]:
    """The checkpoint (trainer, `--steps 0`), its HF export and a Llama HF model, all written by `tree`."""
    ckpt, hf, gguf_src = work / "ckpt", work / "hf", work / "llama"
    code = ("import sys; from mconvert.trainer.train import TrainConfig, train; "
            "train(TrainConfig(preset=sys.argv[1], tp=int(sys.argv[2]), pp=int(sys.argv[3]), steps=0, "
            "save=sys.argv[4], num_layers=int(sys.argv[5]) or None, force=True, quiet=True, device='cpu'))")
    console.print(f"[bold]building[/] {preset} TP={TP} PP={PP}, its HF export, and {llama}")
    run_in(tree, ["-c", code, preset, str(TP), str(PP), str(ckpt), str(layers or 0)])
    run_in(tree, ["-m", "mconvert.cli", "megatron-to-hf", str(ckpt), str(hf)])
    (hf / "mconvert-manifest.json").unlink(missing_ok=True)  # read as a user has it from the Hub
    gguf_peer.build_model(llama, gguf_src)
    return {"ckpt": ckpt, "hf": hf, "llama": gguf_src}


def differing_files(a: Path, b: Path) -> list[str]:
    """Paths (relative) whose bytes differ between two outputs, or that only one has."""
    def files(root: Path) -> set[str]:
        return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}

    fa, fb = files(a), files(b)
    return sorted((fa ^ fb) | {rel for rel in fa & fb if not filecmp.cmp(a / rel, b / rel, shallow=False)})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", required=True, help="version A: a git ref (checked out as a worktree) or a directory")
    ap.add_argument("--b", default=str(ROOT), help="version B (default: this tree)")
    ap.add_argument("--preset", default="gpt2-1b")
    ap.add_argument("--layers", type=int, default=8, help="depth of the GPT-2 checkpoint (default 8: ~1.7 GB fp32)")
    ap.add_argument("--llama", default="llama-0.3gb", choices=sorted(gguf_peer.MODELS), help="hf-to-gguf's input")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--only", default="", help="comma list of labels (prefixes) to run")
    ap.add_argument("--work", type=Path, default=HERE / "work-ab")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)

    shutil.rmtree(a.work, ignore_errors=True)
    a.work.mkdir(parents=True)
    made: list[Path] = []
    try:
        trees = {}
        for name, ref in (("A", a.a), ("B", a.b)):
            trees[name], new = tree_of(ref, a.work, name)
            if new:
                made.append(trees[name])
        inputs = build_inputs(trees["B"], a.work, a.preset, a.layers, a.llama)
        ops = [o for o in OPS if not a.only or any(o[0].startswith(p) for p in a.only.split(","))]
        rows: dict[str, dict[str, list[Any]]] = {o[0]: {"A": [], "B": []} for o in ops}
        rows[STARTUP[0]] = {"A": [], "B": []}
        differ: dict[str, list[str]] = {}
        for i in range(a.repeats):
            order = ("A", "B") if i % 2 == 0 else ("B", "A")
            for label, args, which in ops:
                for name in order:
                    out = a.work / f"out-{name}"
                    shutil.rmtree(out, ignore_errors=True)
                    os.sync()
                    dest = out / "model.gguf" if args[0] == "hf-to-gguf" else out
                    out.mkdir(exist_ok=True) if args[0] == "hf-to-gguf" else None
                    cmd = ["sh", "-c", '"$@" && sync -f "$0"', str(out), sys.executable, "-m", "mconvert.cli",
                           args[0], str(inputs[which]), str(dest), *args[1:]]
                    m = run_measured(cmd, env=env_for(trees[name]))
                    if m.returncode != 0:
                        raise SystemExit(f"ab: {label} failed under {name} (exit {m.returncode}):\n{m.output_tail}")
                    rows[label][name].append(m)
                    console.print(f"  round {i + 1}/{a.repeats} {label} [{name}]: {m.wall_s:.2f} s wall, "
                                  f"{m.cpu_s:.2f} s CPU, peak RSS {m.peak_rss / GB:.2f} GB")
                if i == 0:
                    differ[label] = differing_files(a.work / "out-A", a.work / "out-B")
                    rows[label]["bytes"] = [dir_bytes(a.work / "out-B")]
            for name in order:
                rows[STARTUP[0]][name].append(run_measured([sys.executable, "-c", STARTUP[1]], env=env_for(trees[name])))
        report: dict[str, Any] = {"a": a.a, "b": a.b, "repeats": a.repeats, "rows": {}}
        for label, r in rows.items():
            med = {n: {k: statistics.median(getattr(m, k) for m in r[n]) for k in ("wall_s", "cpu_s", "peak_rss")}
                   for n in ("A", "B")}
            report["rows"][label] = {**{n: med[n] for n in med},
                                     "ratio": {k: med["B"][k] / med["A"][k] for k in med["A"] if med["A"][k]},
                                     "differing_files": differ.get(label, [])}
        print_table(report)
        if a.json:
            print(json.dumps(report, indent=1))
        return 1 if any(r["differing_files"] for r in report["rows"].values()) else 0
    finally:
        for t in made:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(t)], check=False)
        shutil.rmtree(a.work, ignore_errors=True)


def print_table(report: dict[str, Any]) -> None:
    t = Table(title=f"A = {report['a']}, B = {report['b']}: medians of {report['repeats']} interleaved rounds")
    for c in ("operation", "A wall s", "B wall s", "B/A wall", "A CPU s", "B CPU s", "B/A CPU", "B/A RSS", "bytes"):
        t.add_column(c, justify="left" if c in ("operation", "bytes") else "right")
    for label, r in report["rows"].items():
        same = "identical" if not r["differing_files"] else f"DIFFER: {', '.join(r['differing_files'][:3])}"
        t.add_row(label, f"{r['A']['wall_s']:.2f}", f"{r['B']['wall_s']:.2f}", f"{r['ratio']['wall_s']:.2f}",
                  f"{r['A']['cpu_s']:.2f}", f"{r['B']['cpu_s']:.2f}", f"{r['ratio']['cpu_s']:.2f}",
                  f"{r['ratio']['peak_rss']:.2f}", "" if label.startswith("start-up") else same)
    console.print(t)


if __name__ == "__main__":
    raise SystemExit(main())
