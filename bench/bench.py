"""`make bench`: mconvert against the copy limit, against transformers' converter, and across depth.

One run: the start-up of whole commands (`--help`, `plan`, the smallest conversions of the tiny-llama preset);
then build a ~4 GB fp32 GPT-2 checkpoint with the trainer (`--steps 0`, TP=4 PP=2, preset gpt2-1b) and
measure, each `--repeats` times (median): `cp -r` of it (the copy limit; warmed once first, the page cache is
left as it is and its residency reported), `megatron-to-hf`, `reshard` to TP=2 PP=1, `megatron-to-ft`,
`megatron-to-trtllm` at TP=2; then transformers' `checkpoint_reshaping_and_interoperability.py` HF → Megatron
against our `hf-to-megatron` on the same model; then the same model at 8 and 32 layers; then `hf-to-gguf`
against llama.cpp's `convert_hf_to_gguf.py` on a 1.3 GB and a 0.3 GB Llama (gguf_peer.py), and the 1.3 GB Llama
and its 4-layer twin at TP4 PP2 per byte and per extra GB against cp; then Megatron-Bridge's own import and export
of the 1.3 GB Llama against ours (bridge_peer.py, where `make bridge-env` built its venv). Wall time, CPU time and peak RSS of every
command's process tree; ratios to `cp` and to each peer in the same run; the targets marked pass/fail.
Prints a rich table (stderr) and `--json` (stdout); leaves the measured bandwidth where `mconvert plan`
reads it. Work dirs under bench/work/ are deleted at the end (`--keep` keeps them).

    .venv/bin/python bench/bench.py                      # the full run (~10 min on 2 cores)
    .venv/bin/python bench/bench.py --quick              # small smoke run (~1 min)
    .venv/bin/python bench/bench.py --layers 8 --repeats 1 --skip peer,depth --json
    .venv/bin/python bench/bench.py --only gguf          # hf-to-gguf against llama.cpp's converter alone
    .venv/bin/python bench/bench.py --only bridge        # Megatron-Bridge's import and export against ours
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

import bridge_peer  # noqa: E402
import gguf_peer  # noqa: E402
from procmon import Measurement, dir_bytes, files_under, resident_bytes, run_measured  # noqa: E402

from mconvert.layouts.estimate import bandwidth_file, estimate, unit_bytes  # noqa: E402
from mconvert.mappings.families import preset as get_preset  # noqa: E402

console = Console(stderr=True)
GB = 10**9
# `cp-cold`: the same cp started COLD_S seconds after the previous output was deleted. On VMs that report
# freed memory back to the host (this one: virtio-balloon free page reporting, page_reporting_order=11) a
# page freed a few seconds ago is new to the host again, and the first write to it costs a host-side fault:
# writing 1.7 GB into fresh page cache took 0.6 s right after deleting a file of that size, 2.9 s 3 s later,
# 4.4 s 10 s later. `cp` right after deleting its previous output reuses those pages hot; a converter, which
# starts writing seconds into its run, cannot. Both rows are printed; the targets use plain `cp`.
COLD_S = 6.0
PEER_SCRIPT = "transformers/models/megatron_gpt2/checkpoint_reshaping_and_interoperability.py"
SRC_TP, SRC_PP = 4, 2
TORCHRUN_SHARD = "1GB"


def mconvert_cmd() -> list[str]:
    exe = Path(sys.executable).parent / "mconvert"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "mconvert.cli"]


def train_verb_available() -> bool:
    import subprocess

    r = subprocess.run([*mconvert_cmd(), "train", "--help"], capture_output=True, text=True)
    return r.returncode == 0 and "--steps" in r.stdout


def peer_script() -> Path:
    import transformers

    return Path(transformers.__file__).parent.parent / PEER_SCRIPT


# ---- the commands measured --------------------------------------------------------------------------
# the fixed cost a conversion process pays before its first byte: the interpreter with torch (every verb but
# hf-to-gguf of safetensors computes in it), and the engine's modules (the CLI imports them only for a
# conversion verb; they load torch on first use)
STARTUP = {"import-torch": "import torch", "import-engine": "import mconvert.convert.verbs"}
# commands a user runs that write nothing: `mconvert --help` and a `plan` (shapes only), timed whole
QUICK = {"help": ["--help"], "plan": ["plan", "--preset", "llama3-405b", "--tp", "8", "--pp", "16", "--to", "hf"]}
# the issue's start-up targets: a `--help` or `plan` within QUICK_S, the smallest conversion within TINY_S (wall)
QUICK_S, TINY_S = 0.5, 2.0
MARGINAL_X = 1.1  # the issue's limit on a verb's marginal wall cost (s/GB) as a multiple of cp's
TINY_PRESET = "tiny-llama"


def converts(label: str) -> bool:
    """Whether the row `label` is a conversion (not cp, not a start-up row)."""
    return not label.startswith(("cp", "start-up"))


def op_command(op: str, src: Path, out: Path, workers: int = 0) -> list[str]:
    """The command line of one measured operation, ended by `sync -f OUT`: every row pays for getting its
    bytes to the disk (cp's sit dirty in the page cache when cp exits; ours go out with O_DIRECT). The
    start-up rows write nothing."""
    if op in STARTUP:
        return [sys.executable, "-c", STARTUP[op]]
    if op in QUICK:
        return [*mconvert_cmd(), *QUICK[op]]
    if op == "torchrun-agent":  # what torchrun adds before a worker's first byte: its agent, two idle workers
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                "--no-python", "true"]
    return ["sh", "-c", '"$@" && sync -f "$0"', str(out), *_bare_command(op, src, out, workers)]


def _bare_command(op: str, src: Path, out: Path, workers: int = 0) -> list[str]:
    """The command line of one measured operation (our verbs take SRC OUT positionally)."""
    mc = mconvert_cmd()
    w = ["--workers", str(workers)] if workers else []
    if op in ("cp", "cp-cold"):
        return ["cp", "-r", str(src), str(out)]
    if op.startswith(("hf-to-gguf:", "llama.cpp:")):
        return gguf_peer.command(op, src, out, mc)
    if op.startswith("bridge:") or op == "hf-to-megatron-dist":
        return bridge_peer.command(op, src, out, mc)
    if op == "megatron-to-hf-shards":  # 1 GB shards: the file groups the torchrun row shares out
        return [*mc, "megatron-to-hf", str(src), str(out), "--max-shard-size", TORCHRUN_SHARD, *w]
    if op in ("megatron-to-hf-torchrun1", "megatron-to-hf-torchrun2"):  # the same launcher, 1 or 2 processes
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", op[-1],
                "-m", "mconvert.cli", "megatron-to-hf", str(src), str(out), "--max-shard-size", TORCHRUN_SHARD, *w]
    if op == "megatron-to-hf":
        return [*mc, "megatron-to-hf", str(src), str(out), *w]
    if op == "megatron-to-hf-w1":  # one parameter at a time: what the readers' threads buy
        return [*mc, "megatron-to-hf", str(src), str(out), "--workers", "1"]
    if op == "reshard":
        return [*mc, "reshard", str(src), str(out), "--tp", "2", "--pp", "1", *w]
    if op == "megatron-to-ft":
        return [*mc, "megatron-to-ft", str(src), str(out), *w]
    if op == "megatron-to-trtllm":
        return [*mc, "megatron-to-trtllm", str(src), str(out), "--tp", "2", *w]
    if op == "hf-to-megatron":
        return [*mc, "hf-to-megatron", str(src), str(out), "--tp", str(SRC_TP), "--pp", str(SRC_PP), *w]
    if op == "transformers-script":
        return [
            sys.executable, str(peer_script()),
            "--load_path", str(src), "--save_path", str(out),
            "--target_tensor_model_parallel_size", str(SRC_TP),
            "--target_pipeline_model_parallel_size", str(SRC_PP),
            "--megatron-path", str(ROOT / "tests" / "helpers" / "megatron_standin"),
        ]
    raise ValueError(op)


def _summary(op: str, runs: list[Measurement], cmd: list[str], out: Path) -> dict[str, Any]:
    return {
        "op": op,
        "command": " ".join(cmd),
        "wall_s": statistics.median(r.wall_s for r in runs),
        "cpu_s": statistics.median(r.cpu_s for r in runs),
        "peak_rss": int(statistics.median(r.peak_rss for r in runs)),
        "peak_anon": int(statistics.median(r.peak_anon_tree for r in runs)),
        "runs": [{k: v for k, v in asdict(r).items() if k != "output_tail"} for r in runs],
        "out_bytes": dir_bytes(out) if out.exists() else 0,
        "out_dir": str(out),
    }


def measure_rounds(jobs: list[tuple[str, str, Path]], work: Path, repeats: int, workers: int = 0,
                   keep: tuple[str, ...] = ()) -> dict[str, dict[str, Any]]:
    """Run every (label, op, src) once per round, `repeats` rounds, interleaved so that load from other
    processes on the machine hits every operation alike; median figures per label. Outputs are removed
    between runs (not timed), except the last run of the labels in `keep`."""
    runs: dict[str, list[Measurement]] = {label: [] for label, _, _ in jobs}
    for i in range(repeats):
        for label, op, src in jobs:
            out = work / f"out-{label}"
            shutil.rmtree(out, ignore_errors=True)
            os.sync()  # not timed: no row pays for writing back what an earlier step left dirty (an input just built)
            if op == "cp-cold":
                time.sleep(COLD_S)
            m = run_measured(op_command(op, src, out, 0 if op in ("cp", "cp-cold", "transformers-script") else workers))
            if m.returncode != 0:
                raise SystemExit(f"bench: {label} failed (exit {m.returncode}):\n{m.output_tail}")
            runs[label].append(m)
            console.print(f"  round {i + 1}/{repeats} {label}: {m.wall_s:.2f} s wall, {m.cpu_s:.2f} s CPU, "
                          f"peak RSS {m.peak_rss / GB:.2f} GB")
    out_all = {}
    for label, op, src in jobs:
        out = work / f"out-{label}"
        out_all[label] = _summary(label, runs[label], op_command(op, src, out, workers), out)
        if label not in keep:
            shutil.rmtree(out, ignore_errors=True)
    return out_all


def measure(op: str, src: Path, work: Path, repeats: int, workers: int = 0, keep_last: bool = False) -> dict[str, Any]:
    """`repeats` runs of one operation (see measure_rounds)."""
    return measure_rounds([(op, op, src)], work, repeats, workers, keep=(op,) if keep_last else ())[op]


# ---- inputs -----------------------------------------------------------------------------------------
def build_checkpoint(preset: str, layers: int | None, dest: Path, tp: int = SRC_TP, pp: int = SRC_PP) -> dict[str, Any]:
    """The trainer writes an initialised checkpoint (`--steps 0`); timed for the record, not compared."""
    if dest.exists():
        shutil.rmtree(dest)
    if train_verb_available():
        cmd = [*mconvert_cmd(), "train", "--preset", preset, "--tp", str(tp), "--pp", str(pp),
               "--steps", "0", "--save", str(dest)]
        if layers:
            cmd += ["--num-layers", str(layers)]
    else:  # the same trainer through its library entry point
        code = ("import sys; from mconvert.trainer.train import TrainConfig, train; "
                "train(TrainConfig(preset=sys.argv[1], tp=int(sys.argv[2]), pp=int(sys.argv[3]), steps=0, "
                "save=sys.argv[4], num_layers=int(sys.argv[5]) or None, force=True, quiet=True, device='cpu'))")
        cmd = [sys.executable, "-c", code, preset, str(tp), str(pp), str(dest), str(layers or 0)]
    console.print(f"[bold]building[/] {preset} ({layers or 'preset'} layers) TP={tp} PP={pp} → {dest}")
    m = run_measured(cmd)
    if m.returncode != 0:  # one retry: a rendezvous timeout on a loaded machine is not the bench's subject
        console.print(f"  trainer failed (exit {m.returncode}); retrying once")
        shutil.rmtree(dest, ignore_errors=True)
        m = run_measured(cmd)
    if m.returncode != 0:
        raise SystemExit(f"bench: the trainer failed (exit {m.returncode}):\n{m.output_tail}")
    return {"command": " ".join(cmd), "wall_s": m.wall_s, "bytes": dir_bytes(dest), "files": len(files_under(dest))}


def export_bin(hf_dir: Path, dest: Path) -> None:
    """The peer reads only `pytorch_model*.bin`: re-save our HF output with transformers itself."""
    code = (
        "import sys, transformers as t; m = t.GPT2LMHeadModel.from_pretrained(sys.argv[1]); "
        "m.save_pretrained(sys.argv[2], safe_serialization=False, max_shard_size='1000GB')"
    )
    shutil.rmtree(dest, ignore_errors=True)
    m = run_measured([sys.executable, "-c", code, str(hf_dir), str(dest)])
    if m.returncode != 0:
        raise SystemExit(f"bench: exporting {hf_dir} as pytorch_model.bin failed:\n{m.output_tail}")


# ---- figures ------------------------------------------------------------------------------------------
def layer_figures(ckpt: Path) -> dict[str, Any]:
    """Largest transformer layer and largest unit (embedding / final) of the built checkpoint, all TP shards
    (its spec from its own args: the trainer's tokenizer sets the vocabulary, not the preset)."""
    import subprocess

    from mconvert.spec import ModelSpec

    # in a child process: importing torch here would grow this process, whose pages every child measured
    # after it would otherwise carry in its ru_maxrss
    code = ("import json, sys; from mconvert.convert.megatron.source import MegatronSource; "
            "print(json.dumps(MegatronSource(sys.argv[1]).spec.to_dict()))")
    out = subprocess.run([sys.executable, "-c", code, str(ckpt)], capture_output=True, text=True, check=True)
    spec = ModelSpec(**json.loads(out.stdout.strip().splitlines()[-1]))
    u = unit_bytes(spec, SRC_TP, 4 if spec.params_dtype == "float32" else 2)
    return {"parameters": spec.num_parameters(), "layers": spec.num_layers, "vocab_size": spec.vocab_size,
            "largest_layer_bytes": u["layer"], "largest_unit_bytes": max(u.values()), "units": u}


def target(name: str, value: float, limit: float, ok: bool, unit: str = "") -> dict[str, Any]:
    return {"target": name, "value": value, "limit": limit, "pass": bool(ok), "unit": unit}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="gpt2-1b", help="GPT-2 preset of mconvert.spec (default gpt2-1b)")
    ap.add_argument("--layers", type=int, default=None, help="override the preset's depth")
    ap.add_argument("--repeats", type=int, default=3, help="runs per measurement (median)")
    ap.add_argument("--depth", default="8,32", help="layer counts for the depth-scaling runs")
    ap.add_argument("--depth-repeats", type=int, default=2, help="runs per depth-scaling measurement (median)")
    ap.add_argument("--skip", default="", help="comma list of: startup, ft, trtllm, workers, peer, depth, torchrun, "
                    "passes, gguf, bridge")
    ap.add_argument("--only", choices=("gguf", "bridge"), default=None, help="run one section alone")
    ap.add_argument("--workers", type=int, default=0, help="pass --workers N to our verbs (0: their default)")
    ap.add_argument("--quick", action="store_true", help="smoke run: gpt2-100m at 4 layers, 1 repeat, depth 2,4")
    ap.add_argument("--work", type=Path, default=HERE / "work", help="scratch dir (deleted at the end)")
    ap.add_argument("--keep", action="store_true", help="keep the work dir")
    ap.add_argument("--json", action="store_true", help="print the full report as JSON on stdout")
    ap.add_argument("--no-save", action="store_true", help="do not write the bandwidth file / bench/last-run.json")
    ap.add_argument("--render", type=Path, default=None, help="print a saved report (last-run.json) as markdown")
    a = ap.parse_args(argv)
    if a.render is not None:
        print(markdown(json.loads(a.render.read_text())), end="")
        return 0
    if a.quick:
        a.preset, a.layers, a.repeats, a.depth, a.depth_repeats = "gpt2-100m", a.layers or 4, 1, "2,8", 1
    skip = {s.strip() for s in a.skip.split(",") if s.strip()}
    work: Path = a.work
    work.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(),
                    "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())},
        "preset": a.preset, "repeats": a.repeats, "workers": a.workers,
    }
    try:
        if a.only is None and "startup" not in skip:
            run_startup(a, work, report)
        if a.only is None:
            run(a, skip, work, report)
        if "gguf" not in skip and a.only in (None, "gguf"):
            run_gguf(a, work, report)
        if "bridge" not in skip and a.only in (None, "bridge"):
            run_bridge(a, work, report)
        report["targets"] = targets(report)
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    print_report(report)
    if a.json:
        print(json.dumps(report, indent=1))
    if not a.no_save:
        save(report)
    return 0 if all(t["pass"] for t in report["targets"]) else 1


def run(a: argparse.Namespace, skip: set[str], work: Path, report: dict[str, Any]) -> None:
    ckpt = work / "ckpt"
    report["build"] = build_checkpoint(a.preset, a.layers, ckpt)
    report["model"] = layer_figures(ckpt)
    ckpt_bytes = report["build"]["bytes"]
    console.print(f"checkpoint: {report['build']['files']} files, {ckpt_bytes / GB:.2f} GB "
                  f"(built in {report['build']['wall_s']:.1f} s)")

    # the copy limit: warm once, then measure; page cache left as it is, residency reported
    before, total = resident_bytes(files_under(ckpt))
    warm = run_measured(["cp", "-r", str(ckpt), str(work / "warm")])
    shutil.rmtree(work / "warm", ignore_errors=True)
    after, _ = resident_bytes(files_under(ckpt))
    report["cache"] = {"resident_before_warmup": before / total, "resident_after_warmup": after / total,
                       "warmup_cp_s": warm.wall_s, "warm": after / total > 0.95}
    console.print(f"page cache: {100 * before / total:.0f}% of the checkpoint resident before the warm-up cp, "
                  f"{100 * after / total:.0f}% after")

    jobs = [("cp", "cp", ckpt), ("cp-cold", "cp-cold", ckpt), ("megatron-to-hf", "megatron-to-hf", ckpt),
            ("reshard", "reshard", ckpt)]
    if "ft" not in skip:
        jobs.append(("megatron-to-ft", "megatron-to-ft", ckpt))
    if "trtllm" not in skip:
        jobs.append(("megatron-to-trtllm", "megatron-to-trtllm", ckpt))
    if "workers" not in skip:
        jobs.append(("megatron-to-hf --workers 1", "megatron-to-hf-w1", ckpt))
    if "torchrun" not in skip:
        jobs += [(f"megatron-to-hf {TORCHRUN_SHARD} shards", "megatron-to-hf-shards", ckpt),
                 (f"megatron-to-hf {TORCHRUN_SHARD} shards, torchrun 1 process", "megatron-to-hf-torchrun1", ckpt),
                 (f"megatron-to-hf {TORCHRUN_SHARD} shards, torchrun 2 processes", "megatron-to-hf-torchrun2", ckpt)]
    jobs += [("start-up: import torch", "import-torch", ckpt), ("start-up: import the engine", "import-engine", ckpt)]
    if "torchrun" not in skip:
        jobs.append(("start-up: torchrun's agent, 2 workers that do nothing", "torchrun-agent", ckpt))
    ops = measure_rounds(jobs, work, a.repeats, a.workers, keep=("megatron-to-hf",))
    cp, cp_cpu = ops["cp"]["wall_s"], ops["cp"]["cpu_s"]
    for r in ops.values():
        r["ratio_to_cp"] = r["wall_s"] / cp
        r["ratio_to_cp_cold"] = r["wall_s"] / ops["cp-cold"]["wall_s"]
        r["cpu_ratio_to_cp"] = r["cpu_s"] / cp_cpu if cp_cpu else float("nan")
        r["rss_ratio_to_cp"] = r["peak_rss"] / ops["cp"]["peak_rss"]
        r["cpu_s_per_gb"] = r["cpu_s"] / (ckpt_bytes / GB)
    report["ops"] = ops
    report["copy_bytes_per_s"] = ckpt_bytes / cp
    if "passes" not in skip:
        report["passes"] = pass_costs()

    hf_dir = Path(ops["megatron-to-hf"]["out_dir"])
    if "peer" not in skip:
        bin_dir = work / "hf-bin"
        console.print("[bold]peer[/]: exporting the HF model as pytorch_model.bin with transformers")
        export_bin(hf_dir, bin_dir)
        # ours reads the safetensors dir as a user has it from the Hub: without mconvert's manifest; the same
        # dir with its manifest (every input byte then checked against it) is a row of its own
        hub_dir = work / "hf-hub"
        shutil.rmtree(hub_dir, ignore_errors=True)
        shutil.copytree(hf_dir, hub_dir, ignore=shutil.ignore_patterns("mconvert-manifest.json"))
        both = measure_rounds([("transformers-script", "transformers-script", bin_dir),
                               ("hf-to-megatron", "hf-to-megatron", hub_dir),
                               ("hf-to-megatron-manifest", "hf-to-megatron", hf_dir)], work, a.repeats, a.workers)
        peer, ours = both["transformers-script"], both["hf-to-megatron"]
        ours_bin = None
        try:
            ours_bin = measure_rounds([("hf-to-megatron-bin", "hf-to-megatron", bin_dir)], work, 1, a.workers)[
                "hf-to-megatron-bin"]
        except SystemExit as e:  # our reader may not take .bin; the safetensors figure stands
            console.print(f"  hf-to-megatron on pytorch_model.bin: not measured ({str(e).splitlines()[0]})")
        shutil.rmtree(hub_dir, ignore_errors=True)
        report["peer"] = {
            "transformers-script": peer, "hf-to-megatron": ours, "hf-to-megatron-bin": ours_bin,
            "hf-to-megatron-manifest": both["hf-to-megatron-manifest"],
            "speedup": peer["wall_s"] / ours["wall_s"], "rss_fraction": ours["peak_rss"] / peer["peak_rss"],
            "cpu_speedup": peer["cpu_s"] / ours["cpu_s"],
        }
        shutil.rmtree(bin_dir, ignore_errors=True)
    shutil.rmtree(hf_dir, ignore_errors=True)

    if "depth" not in skip:
        depth: dict[str, Any] = {}
        for n in [int(x) for x in a.depth.split(",") if x]:
            d_ckpt = work / f"ckpt-{n}"
            b = build_checkpoint(a.preset, n, d_ckpt)
            d = measure_rounds([("cp", "cp", d_ckpt), ("megatron-to-hf", "megatron-to-hf", d_ckpt),
                                ("reshard", "reshard", d_ckpt)], work, a.depth_repeats, a.workers,
                               keep=("megatron-to-hf",))
            d_hf = work / f"hf-{n}"
            shutil.rmtree(d_hf, ignore_errors=True)
            shutil.copytree(work / "out-megatron-to-hf", d_hf, ignore=shutil.ignore_patterns("mconvert-manifest.json"))
            shutil.rmtree(work / "out-megatron-to-hf", ignore_errors=True)
            shutil.rmtree(d_ckpt, ignore_errors=True)  # measured: its pages leave the page cache to the HF input's
            d.update(measure_rounds([("cp-hf", "cp", d_hf), ("hf-to-megatron", "hf-to-megatron", d_hf),
                                     ("hf-to-gguf", "hf-to-gguf:f16", d_hf)], work, a.depth_repeats, a.workers))
            depth[str(n)] = {"layers": n, "bytes": b["bytes"], "hf_bytes": dir_bytes(d_hf), **d}
            shutil.rmtree(d_ckpt, ignore_errors=True)
            shutil.rmtree(d_hf, ignore_errors=True)
        report["depth"] = dict(sorted(depth.items(), key=lambda kv: kv[1]["layers"]))
        report["marginal_s_per_gb"] = marginal(report["depth"])
        report["marginal_cpu_s_per_gb"] = marginal(report["depth"], "cpu_s")


def run_startup(a: argparse.Namespace, work: Path, report: dict[str, Any]) -> None:
    """What a user waits for before any byte moves: `mconvert --help`, a `plan` (shapes only), and the smallest
    conversions, megatron-to-hf of the `TINY_PRESET` checkpoint (TP=1 PP=1) and hf-to-gguf of its HF output,
    interleaved; each whole command's wall time, against the issue's limits (QUICK_S, TINY_S)."""
    tiny = work / "tiny"
    build_checkpoint(TINY_PRESET, None, tiny, tp=1, pp=1)
    hf = work / "tiny-hf"
    m = run_measured([*mconvert_cmd(), "megatron-to-hf", str(tiny), str(hf)])
    if m.returncode != 0:
        raise SystemExit(f"bench: megatron-to-hf of {TINY_PRESET} failed:\n{m.output_tail}")
    rows = measure_rounds([("mconvert --help", "help", tiny), ("mconvert plan", "plan", tiny),
                           (f"megatron-to-hf {TINY_PRESET}", "megatron-to-hf", tiny),
                           (f"hf-to-gguf {TINY_PRESET}", "hf-to-gguf:f16", hf)], work, max(3, a.repeats))
    report["startup"] = {label: {k: r[k] for k in ("wall_s", "cpu_s", "peak_rss")} for label, r in rows.items()}
    shutil.rmtree(tiny, ignore_errors=True)
    shutil.rmtree(hf, ignore_errors=True)


def startup_targets(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's start-up limits on wall time: `--help` and `plan` within QUICK_S, a tiny conversion within
    TINY_S."""
    out = []
    for label, r in report.get("startup", {}).items():
        limit = QUICK_S if label in ("mconvert --help", "mconvert plan") else TINY_S
        out.append(target(f"{label} ≤ {limit:g} s wall", r["wall_s"], limit, r["wall_s"] <= limit, "s"))
    return out


def llama_models(work: Path) -> dict[str, Path]:
    """The Llama-style HF models of `gguf_peer.MODELS` under `work` (built once), warm in the page cache."""
    srcs = {}
    for name in gguf_peer.MODELS:
        srcs[name] = work / name
        if not (srcs[name] / "model.safetensors").is_file():
            console.print(f"[bold]building[/] {name} (random float16 Llama, SentencePiece tokenizer)")
            gguf_peer.build_model(name, srcs[name])
        run_measured(["cp", "-r", str(srcs[name]), str(work / "warm")])  # the inputs warm in the page cache
        shutil.rmtree(work / "warm", ignore_errors=True)
    return srcs


def run_gguf(a: argparse.Namespace, work: Path, report: dict[str, Any]) -> None:
    """`hf-to-gguf` against llama.cpp's converter and `cp`, interleaved round by round (gguf_peer.py), then the
    Llama per-byte section (`run_llama_per_byte`), which needs no peer."""
    srcs = llama_models(work)
    if gguf_peer.converter() is None:
        console.print("[yellow]gguf[/]: llama.cpp's converter is not in the llama.cpp venv (`make gguf-env`); "
                      "the comparison with it is skipped")
    else:
        src_bytes = {name: dir_bytes(d) for name, d in srcs.items()}
        jobs = []
        for name in gguf_peer.MODELS:
            jobs.append((f"cp {name}", "cp", srcs[name]))
            for model, outtype in gguf_peer.RUNS:
                if model == name:
                    jobs += [(f"hf-to-gguf {name} {outtype}", f"hf-to-gguf:{outtype}", srcs[name]),
                             (f"llama.cpp {name} {outtype}", f"llama.cpp:{outtype}", srcs[name])]
        rows = measure_rounds(jobs, work, max(3, a.repeats))
        report["gguf"] = {"rows": gguf_peer.figures(rows, src_bytes), "load": os.getloadavg(), "cpus": os.cpu_count()}
    run_llama_per_byte(a, work, report, srcs)


def run_llama_per_byte(a: argparse.Namespace, work: Path, report: dict[str, Any], srcs: dict[str, Path]) -> None:
    # per byte on the larger Llama at TP4 PP2: megatron-to-hf and reshard of its rank files, hf-to-megatron and
    # hf-to-gguf of the HF directory, each beside cp of the same input; the same at SHALLOW_LAYERS layers in the
    # same rounds, for the marginal cost per extra GB
    name = gguf_peer.PER_BYTE_MODEL
    shallow = work / f"{name}-{gguf_peer.SHALLOW_LAYERS}l"
    if not (shallow / "model.safetensors").is_file():
        console.print(f"[bold]building[/] {name} at {gguf_peer.SHALLOW_LAYERS} layers")
        gguf_peer.build_model(name, shallow, gguf_peer.SHALLOW_LAYERS)
    pairs = {"": srcs[name], " shallow": shallow}
    ckpts = {}
    for tag, hf in pairs.items():
        ckpts[tag] = ckpt = work / f"{hf.name}-tp{gguf_peer.LLAMA_TP}pp{gguf_peer.LLAMA_PP}"
        if not (ckpt / "latest_checkpointed_iteration.txt").is_file():
            m = run_measured([*mconvert_cmd(), "hf-to-megatron", str(hf), str(ckpt), "--tp", str(gguf_peer.LLAMA_TP),
                              "--pp", str(gguf_peer.LLAMA_PP)])
            if m.returncode != 0:
                raise SystemExit(f"bench: building the Llama TP4 PP2 checkpoint failed:\n{m.output_tail}")
    jobs = [j for tag, hf in pairs.items() for j in gguf_peer.per_byte_jobs(hf, ckpts[tag], tag)]
    rows = measure_rounds(jobs, work, max(3, a.repeats))
    figs = {tag: gguf_peer.per_byte_figures(rows, {"hf": dir_bytes(hf), "megatron": dir_bytes(ckpts[tag])}, tag)
            for tag, hf in pairs.items()}
    report["llama_per_byte"] = {"rows": figs[""], "shallow": figs[" shallow"],
                                "marginal": gguf_peer.marginal_figures(figs[" shallow"], figs[""]),
                                "layers": (gguf_peer.SHALLOW_LAYERS, gguf_peer.MODELS[name][2]),
                                "tp": gguf_peer.LLAMA_TP, "pp": gguf_peer.LLAMA_PP, "load": os.getloadavg()}


def run_bridge(a: argparse.Namespace, work: Path, report: dict[str, Any]) -> None:
    """Megatron-Bridge's HF → Megatron import and Megatron → HF export against ours, and cp of the HF directory,
    interleaved round by round (bridge_peer.py), on the 1.3 GB Llama; left out, and said so, without its venv."""
    if bridge_peer.python() is None:
        console.print("[yellow]Megatron-Bridge section left out[/]: no venv (make bridge-env, or BRIDGE_VENV=...)")
        report["bridge"] = {"left_out": "no Megatron-Bridge venv (make bridge-env)"}
        return
    hf = llama_models(work)[gguf_peer.PER_BYTE_MODEL]
    ckpt = bridge_peer.checkpoint_of(hf)
    if not (ckpt / "latest_checkpointed_iteration.txt").is_file():  # the export's input, written once by Bridge
        console.print(f"[bold]building[/] the Megatron-Bridge checkpoint of {hf.name}")
        shutil.rmtree(ckpt, ignore_errors=True)
        m = run_measured(bridge_peer.command("bridge:import", hf, ckpt, mconvert_cmd()))
        if m.returncode != 0:
            raise SystemExit(f"bench: Megatron-Bridge's import failed:\n{m.output_tail}")
    rows = measure_rounds(bridge_peer.jobs(hf), work, max(3, a.repeats))
    report["bridge"] = {"rows": bridge_peer.figures(rows, dir_bytes(hf)), "model": hf.name,
                        "load": os.getloadavg(), "cpus": os.cpu_count()}


def pass_costs() -> list[dict[str, Any]]:
    """`passes.py` in its own process: the seconds per GB of each pass over the bytes, against a memory copy."""
    import subprocess

    r = subprocess.run([sys.executable, str(HERE / "passes.py"), "--json"], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"bench: passes.py failed (exit {r.returncode}):\n{r.stderr[-2000:]}")
    return json.loads(r.stdout)


# the verbs that read the HF directory: their marginal cost is per GB of it, against `cp-hf` (cp of that directory)
HF_SIDE = ("hf-to-megatron", "hf-to-gguf")


def marginal(depth: dict[str, Any], figure: str = "wall_s") -> dict[str, float]:
    """Seconds (wall, or CPU with `figure="cpu_s"`) per extra GB of input, from the smallest and largest depth:
    the start-up cost cancels. The Megatron-side rows per GB of checkpoint, the HF-side ones (`HF_SIDE`, `cp-hf`)
    per GB of the HF directory when its size is known. cp's own is what a copy takes per GB in the same run."""
    rows = list(depth.values())
    lo, hi = rows[0], rows[-1]
    out = {}
    for op in ("cp", "megatron-to-hf", "reshard", "cp-hf", *HF_SIDE):
        key = "hf_bytes" if (op in HF_SIDE or op == "cp-hf") and "hf_bytes" in lo and "hf_bytes" in hi else "bytes"
        extra = (hi[key] - lo[key]) / GB
        if op in lo and op in hi and extra > 0:
            out[op] = (hi[op][figure] - lo[op][figure]) / extra
    return out


def marginal_ratios(marg: dict[str, float]) -> dict[str, float]:
    """Each verb's marginal cost (`marginal`) as a multiple of cp's of the same input (`cp-hf` for `HF_SIDE`
    when measured); a verb whose cp figure is not positive is left out."""
    out = {}
    for op, v in marg.items():
        if op in ("cp", "cp-hf"):
            continue
        cp = marg.get("cp-hf", 0.0) if op in HF_SIDE and "cp-hf" in marg else marg.get("cp", 0.0)
        if cp > 0:
            out[op] = v / cp
    return out


def targets(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 7's and issue 39's targets, each with its figure and pass/fail."""
    out = startup_targets(report) + gguf_targets(report) + llama_marginal_targets(report)
    if "ops" not in report:
        return out
    ops, model = report["ops"], report["model"]
    out += [
        target("megatron-to-hf wall ≤ 2.0 × cp", ops["megatron-to-hf"]["ratio_to_cp"], 2.0,
               ops["megatron-to-hf"]["ratio_to_cp"] <= 2.0, "× cp"),
        target("reshard wall ≤ 2.5 × cp", ops["reshard"]["ratio_to_cp"], 2.5, ops["reshard"]["ratio_to_cp"] <= 2.5, "× cp"),
    ]
    limit = 2 * model["largest_unit_bytes"] + 0.5 * GB
    strict = 2 * model["largest_layer_bytes"] + 0.5 * GB
    # a torchrun row's RSS is its process tree (the agent and every worker): the per-process limits do not apply
    conv = {k: v for k, v in ops.items() if converts(k) and "torchrun" not in k}
    if "peer" in report:
        conv["hf-to-megatron"] = report["peer"]["hf-to-megatron"]
    for k, v in conv.items():
        out.append(target(f"{k} peak RSS ≤ 2 × largest unit + 0.5 GB", v["peak_rss"] / GB, limit / GB,
                          v["peak_rss"] <= limit, "GB"))
        out.append(target(f"{k} peak RSS ≤ 2 × largest transformer layer + 0.5 GB (strict reading)",
                          v["peak_rss"] / GB, strict / GB, v["peak_rss"] <= strict, "GB"))
    if "depth" in report:
        d = list(report["depth"].values())
        lo, hi = d[0], d[-1]
        for op in ("megatron-to-hf", "reshard"):
            growth = hi[op]["peak_rss"] / lo[op]["peak_rss"]
            out.append(target(f"{op} peak RSS flat {lo['layers']} → {hi['layers']} layers (ratio ≤ 1.15)",
                              growth, 1.15, growth <= 1.15, "×"))
            # at most linear in bytes (a fixed start-up cost makes shallow runs dearer per byte, never cheaper)
            lin = (hi[op]["wall_s"] / lo[op]["wall_s"]) / (hi["bytes"] / lo["bytes"])
            out.append(target(f"{op} time at most linear in depth (time ratio {hi['layers']}/{lo['layers']} layers "
                              "÷ bytes ratio ≤ 1.3)", lin, 1.3, lin <= 1.3, "×"))
    for op, v in report.get("marginal_s_per_gb", {}).items():
        if op in ("megatron-to-hf", "hf-to-megatron"):
            out.append(target(f"{op} marginal cost ≤ 1.0 s/GB", v, 1.0, v <= 1.0, "s/GB"))
    # each verb's marginal wall cost (s/GB) against cp's of the same input in the same run; the CPU
    # figures are printed beside it (`marginal_line`)
    for op, x in marginal_ratios(report.get("marginal_s_per_gb", {})).items():
        out.append(target(f"{op} marginal wall cost ≤ {MARGINAL_X:g} × cp's ({report['preset']})", x, MARGINAL_X,
                          x <= MARGINAL_X, "× cp"))
    one, two = (ops.get(f"megatron-to-hf {TORCHRUN_SHARD} shards"),
                ops.get(f"megatron-to-hf {TORCHRUN_SHARD} shards, torchrun 2 processes"))
    if one and two:
        out.append(target("torchrun with 2 processes no slower than 1 process", two["wall_s"] / one["wall_s"], 1.0,
                          two["wall_s"] <= one["wall_s"], "× 1 process"))
    # the same question with the launcher on both sides: what a second process adds, torchrun's agent aside
    one_tr = ops.get(f"megatron-to-hf {TORCHRUN_SHARD} shards, torchrun 1 process")
    if one_tr and two:
        out.append(target("torchrun with 2 processes no slower than torchrun with 1 process (launcher on both sides)",
                          two["wall_s"] / one_tr["wall_s"], 1.0, two["wall_s"] <= one_tr["wall_s"],
                          "× torchrun 1 process"))
    if "peer" in report:
        p = report["peer"]
        out.append(target("hf-to-megatron ≥ 5 × faster than transformers' script", p["speedup"], 5.0,
                          p["speedup"] >= 5.0, "×"))
        out.append(target("hf-to-megatron peak RSS ≤ ¼ of transformers' script", p["rss_fraction"], 0.25,
                          p["rss_fraction"] <= 0.25, "×"))
    return out


def llama_marginal_targets(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 39's marginal cost on the Llama at TP4 PP2: each verb's wall seconds per extra GB within MARGINAL_X
    of cp's of the same input, measured in the same rounds."""
    g = report.get("llama_per_byte", {})
    return [target(f"{verb} marginal wall cost ≤ {MARGINAL_X:g} × cp's (Llama TP{g['tp']} PP{g['pp']})", r["x_cp_wall"],
                   MARGINAL_X, r["x_cp_wall"] <= MARGINAL_X, "× cp") for verb, r in g.get("marginal", {}).items()]


def gguf_targets(report: dict[str, Any]) -> list[dict[str, Any]]:
    """hf-to-gguf against llama.cpp's converter in the same run: wall and CPU time ratios."""
    out = []
    for key, r in report.get("gguf", {}).get("rows", {}).items():
        out.append(target(f"hf-to-gguf {key} ≥ {r['target']:.0f} × faster than llama.cpp's converter (wall)",
                          r["speedup"], r["target"], r["speedup"] >= r["target"], "×"))
        out.append(target(f"hf-to-gguf {key} ≥ {r['target']:.0f} × less CPU than llama.cpp's converter",
                          r["cpu_speedup"], r["target"], r["cpu_speedup"] >= r["target"], "×"))
    return out


def print_gguf(report: dict[str, Any]) -> None:
    g = report.get("gguf")
    if not g:
        return
    load = ", ".join(f"{x:.1f}" for x in g["load"])
    t = Table(title=f"hf-to-gguf vs llama.cpp's convert_hf_to_gguf.py, interleaved, median of ≥ 3; load average "
                    f"at the end {load} on {g['cpus']} CPUs (CPU s is the figure that holds on a loaded host)")
    for c in ("model / outtype", "converter", "wall s", "CPU s", "wall s/GB", "CPU s/GB", "× cp (wall)",
              "peer ÷ ours wall", "peer ÷ ours CPU"):
        t.add_column(c, justify="left" if c in ("model / outtype", "converter") else "right")
    for key, r in g["rows"].items():
        for side, name in (("ours", "mconvert hf-to-gguf"), ("peer", "llama.cpp convert_hf_to_gguf.py"),
                           ("cp", "cp -r")):
            x = r[side]
            t.add_row(f"{key} ({r['bytes'] / GB:.2f} GB)", name, f"{x['wall_s']:.2f}", f"{x['cpu_s']:.2f}",
                      f"{x['wall_s_per_gb']:.2f}", f"{x['cpu_s_per_gb']:.2f}", f"{x['x_cp']:.2f}",
                      f"{r['speedup']:.2f}" if side == "ours" else "",
                      f"{r['cpu_speedup']:.2f}" if side == "ours" else "")
    console.print(t)


def print_bridge(report: dict[str, Any]) -> None:
    g = report.get("bridge")
    if not g or "rows" not in g:
        return
    load = ", ".join(f"{x:.1f}" for x in g["load"])
    t = Table(title=f"Megatron-Bridge's import and export vs ours, {g['model']}, interleaved, median of ≥ 3; load "
                    f"average at the end {load} on {g['cpus']} CPUs")
    for c in ("direction", "converter", "wall s", "CPU s", "wall s/GB", "CPU s/GB", "× cp (wall)", "peak RSS GB",
              "peer ÷ ours wall", "peer ÷ ours CPU"):
        t.add_column(c, justify="left" if c in ("direction", "converter") else "right")
    for direction, r in g["rows"].items():
        for side, name in bridge_sides(direction):
            x = r[side]
            t.add_row(direction, name, f"{x['wall_s']:.2f}", f"{x['cpu_s']:.2f}", f"{x['wall_s_per_gb']:.2f}",
                      f"{x['cpu_s_per_gb']:.2f}", f"{x['x_cp']:.2f}", f"{x['peak_rss'] / GB:.2f}",
                      f"{r['speedup']:.2f}" if side == "ours" else "",
                      f"{r['cpu_speedup']:.2f}" if side == "ours" else "")
    console.print(t)


def bridge_sides(direction: str) -> list[tuple[str, str]]:
    """(side, the converter's name) rows of one direction of the Megatron-Bridge section."""
    ours = ("mconvert hf-to-megatron --format torch_dist" if direction.startswith("HF")
            else "mconvert megatron-to-hf (of the Bridge checkpoint)")
    peer = "Megatron-Bridge import (AutoBridge)" if direction.startswith("HF") else "Megatron-Bridge export_ckpt"
    return [("ours", ours), ("peer", peer), ("cp", "cp -r (the HF directory)")]


def bridge_markdown(report: dict[str, Any]) -> list[str]:
    """The Megatron-Bridge rows as a markdown table (a line saying why when left out; nothing when not run)."""
    g = report.get("bridge")
    if not g:
        return []
    if "rows" not in g:
        return ["", f"Megatron-Bridge section left out: {g['left_out']}."]
    load = ", ".join(f"{x:.1f}" for x in g["load"])
    lines = ["", f"Megatron-Bridge's own HF → Megatron import and export (its venv, on CPU) against ours on "
             f"{g['model']} (TP=1 PP=1 torch_dist, as Bridge saves), and `cp -r` of the HF directory, interleaved, "
             f"median of ≥ 3 rounds; load average {load} on {g['cpus']} CPUs at the end of the section:", "",
             "| direction | converter | wall s | CPU s | wall s/GB | CPU s/GB | × cp (wall) | peak RSS GB | "
             "peer ÷ ours, wall | peer ÷ ours, CPU |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for direction, r in g["rows"].items():
        for side, name in bridge_sides(direction):
            x = r[side]
            lines.append(f"| {direction} | {name} | {x['wall_s']:.2f} | {x['cpu_s']:.2f} | {x['wall_s_per_gb']:.2f} | "
                         f"{x['cpu_s_per_gb']:.2f} | {x['x_cp']:.2f} | {x['peak_rss'] / GB:.2f} | "
                         + (f"{r['speedup']:.2f} | {r['cpu_speedup']:.2f} |" if side == "ours" else " | |"))
    return lines


def print_per_byte(report: dict[str, Any]) -> None:
    g = report.get("llama_per_byte")
    if not g:
        return
    load = ", ".join(f"{x:.1f}" for x in g["load"])
    t = Table(title=f"Llama {gguf_peer.PER_BYTE_MODEL} at TP{g['tp']} PP{g['pp']}, per byte against cp of the same "
                    f"input, interleaved, median of ≥ 3; load average at the end {load}")
    for c in ("verb", "input GB", "wall s", "CPU s", "wall s/GB", "CPU s/GB", "cp wall s/GB", "cp CPU s/GB",
              "× cp wall", "× cp CPU", "peak RSS GB"):
        t.add_column(c, justify="left" if c == "verb" else "right")
    for verb, r in g["rows"].items():
        t.add_row(verb, f"{r['bytes'] / GB:.2f}", f"{r['ours_wall_s']:.2f}", f"{r['ours_cpu_s']:.2f}",
                  f"{r['ours_wall_s_per_gb']:.2f}", f"{r['ours_cpu_s_per_gb']:.2f}", f"{r['cp_wall_s_per_gb']:.2f}",
                  f"{r['cp_cpu_s_per_gb']:.2f}", f"{r['x_cp_wall']:.2f}", f"{r['x_cp_cpu']:.2f}",
                  f"{r['peak_rss'] / GB:.2f}")
    console.print(t)
    if g.get("marginal"):
        lo, hi = g["layers"]
        t = Table(title=f"Llama TP{g['tp']} PP{g['pp']}, marginal cost: seconds per extra GB of input from {lo} to {hi} "
                        "layers, against cp's of the same input in the same rounds")
        for c in ("verb", "wall s/GB", "CPU s/GB", "cp wall s/GB", "cp CPU s/GB", "× cp wall", "× cp CPU"):
            t.add_column(c, justify="left" if c == "verb" else "right")
        for verb, r in g["marginal"].items():
            t.add_row(verb, *(f"{r[k]:.2f}" for k in MARGINAL_KEYS))
        console.print(t)


MARGINAL_KEYS = ("ours_wall_s_per_gb", "ours_cpu_s_per_gb", "cp_wall_s_per_gb", "cp_cpu_s_per_gb", "x_cp_wall",
                 "x_cp_cpu")


def print_startup(report: dict[str, Any]) -> None:
    if not report.get("startup"):
        return
    t = Table(title="start-up: whole commands, interleaved, median of ≥ 3")
    for c in ("command", "wall s", "CPU s", "peak RSS GB"):
        t.add_column(c, justify="left" if c == "command" else "right")
    for label, r in report["startup"].items():
        t.add_row(label, f"{r['wall_s']:.2f}", f"{r['cpu_s']:.2f}", f"{r['peak_rss'] / GB:.2f}")
    console.print(t)


def startup_markdown(report: dict[str, Any]) -> list[str]:
    if not report.get("startup"):
        return []
    lines = ["", "Start-up: whole commands, interleaved, median of ≥ 3 rounds:", "",
             "| command | wall s | CPU s | peak RSS GB |", "|---|---:|---:|---:|"]
    lines += [f"| {label} | {r['wall_s']:.2f} | {r['cpu_s']:.2f} | {r['peak_rss'] / GB:.2f} |"
              for label, r in report["startup"].items()]
    return lines


def per_byte_markdown(report: dict[str, Any]) -> list[str]:
    g = report.get("llama_per_byte")
    if not g:
        return []
    lines = ["", f"{gguf_peer.PER_BYTE_MODEL} at TP{g['tp']} PP{g['pp']}, against `cp -r` of the same input in the "
             "same rounds:", "", "| verb | input GB | wall s | CPU s | wall s/GB | CPU s/GB | cp wall s/GB | "
             "cp CPU s/GB | × cp wall | × cp CPU | peak RSS GB |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for verb, r in g["rows"].items():
        lines.append(f"| {verb} | {r['bytes'] / GB:.2f} | {r['ours_wall_s']:.2f} | {r['ours_cpu_s']:.2f} | "
                     f"{r['ours_wall_s_per_gb']:.2f} | {r['ours_cpu_s_per_gb']:.2f} | {r['cp_wall_s_per_gb']:.2f} | "
                     f"{r['cp_cpu_s_per_gb']:.2f} | {r['x_cp_wall']:.2f} | {r['x_cp_cpu']:.2f} | "
                     f"{r['peak_rss'] / GB:.2f} |")
    if g.get("marginal"):
        lo, hi = g["layers"]
        lines += ["", f"Marginal cost on the same Llama from {lo} to {hi} layers (seconds per extra GB of input, cp of "
                  "the same input in the same rounds):", "",
                  "| verb | wall s/GB | CPU s/GB | cp wall s/GB | cp CPU s/GB | × cp wall | × cp CPU |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        lines += [f"| {verb} | " + " | ".join(f"{r[k]:.2f}" for k in MARGINAL_KEYS) + " |"
                  for verb, r in g["marginal"].items()]
    return lines


def print_report(report: dict[str, Any]) -> None:
    """Rich tables: start-up, operations vs cp, peer, depth, GGUF peer, Llama per byte, targets."""
    print_startup(report)
    print_gguf(report)
    print_per_byte(report)
    print_bridge(report)
    if "ops" not in report:
        print_targets(report)
        return
    m = report["model"]
    t = Table(title=f"{report['preset']} ({m['parameters'] / 1e9:.2f} B params, {m['layers']} layers, fp32) "
                    f"TP={SRC_TP} PP={SRC_PP}: {report['build']['bytes'] / GB:.2f} GB, median of {report['repeats']}"
                    f"; page cache {'warm' if report['cache']['warm'] else 'NOT warm'}")
    gbs = report["build"]["bytes"] / GB
    for c in ("operation", "wall s", "× cp", "× cp-cold", "CPU s", "wall s/GB", "CPU s/GB", "CPU × cp", "peak RSS GB",
              "anon GB"):
        t.add_column(c, justify="left" if c == "operation" else "right")
    for op, r in report["ops"].items():
        t.add_row(op, f"{r['wall_s']:.2f}", f"{r['ratio_to_cp']:.2f}", f"{r.get('ratio_to_cp_cold', float('nan')):.2f}",
                  f"{r['cpu_s']:.2f}", f"{r['wall_s'] / gbs:.2f}", f"{r.get('cpu_s_per_gb', float('nan')):.2f}",
                  f"{r['cpu_ratio_to_cp']:.1f}", f"{r['peak_rss'] / GB:.2f}", f"{r['peak_anon'] / GB:.2f}")
    console.print(t)
    if "peer" in report:
        p = report["peer"]
        t = Table(title=f"HF → Megatron TP={SRC_TP} PP={SRC_PP}, same model: ours vs transformers' script")
        for c in ("converter", "wall s", "CPU s", "peak RSS GB", "anon GB"):
            t.add_column(c, justify="left" if c == "converter" else "right")
        rows = [("transformers script (.bin)", p["transformers-script"]), ("mconvert hf-to-megatron (safetensors)",
                                                                           p["hf-to-megatron"])]
        if p.get("hf-to-megatron-manifest"):
            rows.append(("mconvert hf-to-megatron (safetensors + manifest, checked)", p["hf-to-megatron-manifest"]))
        if p.get("hf-to-megatron-bin"):
            rows.append(("mconvert hf-to-megatron (.bin, 1 run)", p["hf-to-megatron-bin"]))
        for name, r in rows:
            t.add_row(name, f"{r['wall_s']:.2f}", f"{r['cpu_s']:.2f}", f"{r['peak_rss'] / GB:.2f}",
                      f"{r['peak_anon'] / GB:.2f}")
        t.add_row("ours vs script", f"{p['speedup']:.1f}× faster", f"{p['cpu_speedup']:.1f}× less CPU",
                  f"{p['rss_fraction']:.2f}× the RSS", "")
        console.print(t)
    if "depth" in report:
        if report.get("marginal_s_per_gb"):
            console.print(marginal_line(report))
        t = Table(title="depth scaling (same width)")
        for c in ("layers", "ckpt GB", "cp s", "m2h s", "m2h s/GB", "m2h RSS GB", "reshard s", "reshard s/GB",
                  "reshard RSS GB"):
            t.add_column(c, justify="right")
        for d in report["depth"].values():
            gbs = d["bytes"] / GB
            t.add_row(str(d["layers"]), f"{gbs:.2f}", f"{d['cp']['wall_s']:.2f}" if "cp" in d else "",
                      f"{d['megatron-to-hf']['wall_s']:.2f}", f"{d['megatron-to-hf']['wall_s'] / gbs:.2f}",
                      f"{d['megatron-to-hf']['peak_rss'] / GB:.2f}",
                      f"{d['reshard']['wall_s']:.2f}", f"{d['reshard']['wall_s'] / gbs:.2f}",
                      f"{d['reshard']['peak_rss'] / GB:.2f}")
        console.print(t)
    if report.get("passes"):
        t = Table(title="each pass over the bytes (64 MiB, one core)")
        for c in ("pass", "s/GB", "× memory copy"):
            t.add_column(c, justify="left" if c == "pass" else "right")
        for r in report["passes"]:
            t.add_row(r["pass"], f"{r['s_per_gb']:.3f}", f"{r['x_copy']:.1f}")
        console.print(t)
    print_targets(report)


def print_targets(report: dict[str, Any]) -> None:
    t = Table(title="targets")
    for c in ("target", "measured", "limit", ""):
        t.add_column(c)
    for x in report["targets"]:
        t.add_row(x["target"], f"{x['value']:.2f} {x['unit']}", f"{x['limit']:.2f}",
                  "[green]pass[/]" if x["pass"] else "[red]FAIL[/]")
    console.print(t)


def marginal_line(report: dict[str, Any]) -> str:
    """The marginal costs in one sentence: wall per extra GB (cp's is the disk's), and CPU per extra GB."""
    wall, cpu = report["marginal_s_per_gb"], report.get("marginal_cpu_s_per_gb", {})
    xw, xc = marginal_ratios(wall), marginal_ratios(cpu)
    parts = [f"{op} {v:.2f} s/GB" + (f" ({cpu[op]:.2f} CPU s/GB)" if op in cpu else "")
             + (f" = {xw[op]:.2f} × cp's wall" if op in xw else "") + (f", {xc[op]:.2f} × cp's CPU" if op in xc else "")
             for op, v in wall.items()]
    return "Marginal cost (seconds per extra GB, smallest to largest depth; cp's is a copy through the page cache): " + \
        ", ".join(parts) + "."


def gguf_markdown(report: dict[str, Any]) -> list[str]:
    """The GGUF peer rows as a markdown table (empty when the section did not run)."""
    g = report.get("gguf")
    if not g:
        return []
    load = ", ".join(f"{x:.1f}" for x in g["load"])
    lines = ["", f"`hf-to-gguf` against llama.cpp's `convert_hf_to_gguf.py` and `cp -r` of the same HF directory, "
             f"interleaved, median of ≥ 3 rounds; load average {load} on {g['cpus']} CPUs at the end of the section "
             "(on a loaded host, read the CPU columns):", "",
             "| model, outtype | converter | wall s | CPU s | wall s/GB | CPU s/GB | × cp (wall) | peer ÷ ours, wall | "
             "peer ÷ ours, CPU |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for key, r in g["rows"].items():
        for side, name in (("ours", "mconvert hf-to-gguf"), ("peer", "llama.cpp convert_hf_to_gguf.py"),
                           ("cp", "cp -r")):
            x = r[side]
            lines.append(f"| {key} ({r['bytes'] / GB:.2f} GB) | {name} | {x['wall_s']:.2f} | {x['cpu_s']:.2f} | "
                         f"{x['wall_s_per_gb']:.2f} | {x['cpu_s_per_gb']:.2f} | {x['x_cp']:.2f} | "
                         + (f"{r['speedup']:.2f} | {r['cpu_speedup']:.2f} |" if side == "ours" else " | |"))
    return lines


def markdown(report: dict[str, Any]) -> str:
    """The figures as markdown tables (README / notes), from a report dict (`--render last-run.json`)."""
    if "ops" not in report:
        return "\n".join([*startup_markdown(report), *gguf_markdown(report), *per_byte_markdown(report),
                          *bridge_markdown(report), "",
                          *target_markdown(report)]) + "\n"
    m, ops = report["model"], report["ops"]
    lines = [f"Model: {report['preset']}, {m['layers']} layers, {m['parameters'] / 1e9:.2f} B parameters, fp32, "
             f"TP={SRC_TP} PP={SRC_PP}: {report['build']['files']} files, {report['build']['bytes'] / GB:.2f} GB; "
             f"median of {report['repeats']} interleaved rounds; page cache "
             f"{'warm' if report['cache']['warm'] else 'NOT warm'}; {report['machine']['cpus']} CPUs; "
             f"{report['machine']['date']}.", "",
             "Every row ends with `sync -f` on its output (cp's bytes are on disk only then), and starts after a "
             "`sync` (not timed) of what earlier steps left dirty.", "",
             "| operation | wall s | × cp | × cp-cold | CPU s | wall s/GB | CPU s/GB | CPU × cp | peak RSS GB |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    gbs = report["build"]["bytes"] / GB
    for op, r in ops.items():
        lines.append(f"| {op} | {r['wall_s']:.2f} | {r['ratio_to_cp']:.2f} | "
                     f"{r.get('ratio_to_cp_cold', float('nan')):.2f} | {r['cpu_s']:.2f} | {r['wall_s'] / gbs:.2f} | "
                     f"{r.get('cpu_s_per_gb', float('nan')):.2f} | "
                     f"{r['cpu_ratio_to_cp']:.1f} | {r['peak_rss'] / GB:.2f} |")
    if "peer" in report:
        p = report["peer"]
        lines += ["", f"HF → Megatron TP={SRC_TP} PP={SRC_PP}, same model:", "",
                  "| converter | wall s | CPU s | peak RSS GB |", "|---|---:|---:|---:|"]
        rows = [("transformers' checkpoint_reshaping_and_interoperability.py (pytorch_model.bin)",
                 p["transformers-script"]), ("mconvert hf-to-megatron (safetensors)", p["hf-to-megatron"])]
        if p.get("hf-to-megatron-manifest"):
            rows.append(("mconvert hf-to-megatron (the same safetensors with mconvert's manifest, every byte checked)",
                         p["hf-to-megatron-manifest"]))
        if p.get("hf-to-megatron-bin"):
            rows.append(("mconvert hf-to-megatron (the same pytorch_model.bin, 1 run)", p["hf-to-megatron-bin"]))
        for name, r in rows:
            lines.append(f"| {name} | {r['wall_s']:.2f} | {r['cpu_s']:.2f} | {r['peak_rss'] / GB:.2f} |")
        lines.append(f"| **ours vs script** | **{p['speedup']:.1f}× faster** | {p['cpu_speedup']:.1f}× less CPU | "
                     f"**{p['rss_fraction']:.2f}× the RSS** |")
    if "depth" in report:
        lines += ["", "Depth scaling (same width):", "",
                  "| layers | ckpt GB | cp s | megatron-to-hf s | s/GB | RSS GB | reshard s | s/GB | RSS GB |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for d in report["depth"].values():
            gbs = d["bytes"] / GB
            h, r = d["megatron-to-hf"], d["reshard"]
            cp_s = f"{d['cp']['wall_s']:.2f}" if "cp" in d else ""
            lines.append(f"| {d['layers']} | {gbs:.2f} | {cp_s} | {h['wall_s']:.2f} | {h['wall_s'] / gbs:.2f} | "
                         f"{h['peak_rss'] / GB:.2f} | {r['wall_s']:.2f} | {r['wall_s'] / gbs:.2f} | "
                         f"{r['peak_rss'] / GB:.2f} |")
    if report.get("marginal_s_per_gb"):
        lines += ["", marginal_line(report)]
    if report.get("passes"):
        lines += ["", "Each pass over the bytes (64 MiB in memory, one core), against a memory "
                  "copy:", "", "| pass | s/GB | × memory copy |", "|---|---:|---:|"]
        lines += [f"| {r['pass']} | {r['s_per_gb']:.3f} | {r['x_copy']:.1f} |" for r in report["passes"]]
    lines += startup_markdown(report)
    lines += gguf_markdown(report)
    lines += per_byte_markdown(report)
    lines += bridge_markdown(report)
    lines += ["", *target_markdown(report)]
    return "\n".join(lines) + "\n"


def target_markdown(report: dict[str, Any]) -> list[str]:
    lines = ["| target | measured | limit | |", "|---|---:|---:|---|"]
    for x in report["targets"]:
        lines.append(f"| {x['target']} | {x['value']:.2f} {x['unit']} | {x['limit']:.2f} | "
                     f"{'pass' if x['pass'] else '**FAIL**'} |")
    return lines


def per_byte_model(report: dict[str, Any]) -> dict[str, Any]:
    """What `mconvert plan` needs to estimate a model of any size (empty without the depth rows): cp's
    marginal bandwidth, each verb's marginal cost as a ratio to it, and each verb's start-up (its time at the
    smallest depth less that depth's bytes at its marginal cost)."""
    marg = report.get("marginal_s_per_gb") or {}
    if not marg.get("cp", 0) > 0:
        return {}
    lo = next(iter(report["depth"].values()))
    ops = [op for op in marg if op not in ("cp", "cp-hf") and marg[op] > 0]
    return {
        "marginal_copy_bytes_per_s": GB / marg["cp"],
        "marginal_ratio_to_cp": {op: marg[op] / marg["cp"] for op in ops},
        "start_seconds": {op: max(0.0, lo[op]["wall_s"] - lo["bytes"] / GB * marg[op]) for op in ops},
    }


def save(report: dict[str, Any]) -> None:
    """The small bandwidth JSON `mconvert plan` reads, and the whole report beside this script."""
    if "ops" not in report:
        return
    ops = report["ops"]
    conv = {k: v for k, v in ops.items() if converts(k)}
    if "peer" in report:
        conv["hf-to-megatron"] = report["peer"]["hf-to-megatron"]
    spec = get_preset(report["preset"]).replace(num_layers=report["model"]["layers"],
                                                vocab_size=report["model"]["vocab_size"])
    in_out = estimate(spec, "hf", tp=SRC_TP, pp=SRC_PP).largest_unit_bytes  # one unit's input + output
    overhead = ops["megatron-to-hf"]["peak_rss"] - in_out
    bw = {
        "copy_bytes_per_s": report["copy_bytes_per_s"],
        "ratio_to_cp": {k: v["wall_s"] / ops["cp"]["wall_s"] for k, v in conv.items()},
        "base_rss_bytes": max(overhead, 0),
        "measured": report["machine"]["date"],
        "preset": report["preset"],
    }
    bw.update(per_byte_model(report))
    path = bandwidth_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(bw, indent=1) + "\n")
    (HERE / "last-run.json").write_text(json.dumps(report, indent=1) + "\n")
    (HERE / "last-run.md").write_text(markdown(report))
    console.print(f"wrote {path}, {HERE / 'last-run.json'} and {HERE / 'last-run.md'}")


if __name__ == "__main__":
    sys.exit(main())
