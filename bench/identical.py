"""Byte-identity check for a restructuring: run every verb on small fixtures, write a sha256 manifest.

    PYTHONPATH=$PWD python bench/identical.py WORKDIR MANIFEST.json [--compare OTHER.json]

Trains tiny-llama (TP=2 PP=2), tiny-mixtral (EP=2 DP=2) and tiny-gpt2 (TP=2) on CPU, then runs megatron-to-hf, hf-to-megatron
(torch, torch_dist, torch_dist --bridge), reshard with the optimizer (torch and torch_dist), megatron-to-ft,
megatron-to-trtllm, megatron-to-gguf and hf-to-gguf (f16, q8_0) and to-onnx (torch exporter) into
WORKDIR, and records the sha256 of every file each step wrote; then every verb's `--dry-run --json` report and
`plan --json --files` (every key but `seconds`), or the one `error:` line of a refusal. Run it on the tree
before a move and after it: the two manifests must be equal. Every verb runs as its own process, as a user runs it.

The manifest leaves out nothing: every output file's bytes are recorded. Some outputs hold the absolute
path of their source (FasterTransformer's config.ini `source =`, the Megatron args' `load` in rank files and
common.pt, and so the manifests and integrity files over them), so both runs must use the same WORKDIR;
no output holds a wall-clock time.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

CLI = [sys.executable, "-c", "from mconvert.cli import run; run()"]


def _steps(w: Path) -> list[tuple[str, list[str]]]:
    llama, mix = w / "llama", w / "mixtral"
    hf, mhf = w / "llama-hf", w / "mixtral-hf"
    return [
        ("train-llama", ["train", "--preset", "tiny-llama", "--tp", "2", "--pp", "2", "--steps", "2",
                         "--device", "cpu", "--save", str(llama)]),
        ("train-mixtral", ["train", "--preset", "tiny-mixtral", "--ep", "2", "--dp", "2", "--steps", "2",
                           "--device", "cpu", "--save", str(mix)]),
        ("train-gpt2", ["train", "--preset", "tiny-gpt2", "--tp", "2", "--steps", "2", "--device", "cpu",
                        "--save", str(w / "gpt2")]),
        ("llama-hf", ["megatron-to-hf", str(llama), str(hf)]),
        ("mixtral-hf", ["megatron-to-hf", str(mix), str(mhf)]),
        ("llama-meg-torch", ["hf-to-megatron", str(hf), str(w / "llama-meg-torch"), "--tp", "2", "--pp", "2"]),
        ("llama-meg-dist", ["hf-to-megatron", str(hf), str(w / "llama-meg-dist"), "--tp", "2",
                            "--format", "torch_dist"]),
        ("llama-meg-bridge", ["hf-to-megatron", str(hf), str(w / "llama-meg-bridge"), "--tp", "2",
                              "--format", "torch_dist", "--bridge"]),
        ("mixtral-meg-dist", ["hf-to-megatron", str(mhf), str(w / "mixtral-meg-dist"), "--ep", "2",
                              "--format", "torch_dist"]),
        ("llama-reshard-opt", ["reshard", str(llama), str(w / "llama-reshard-opt"), "--tp", "1", "--pp", "2",
                               "--with-optimizer"]),
        ("llama-reshard-dist-opt", ["reshard", str(llama), str(w / "llama-reshard-dist-opt"), "--tp", "2",
                                    "--pp", "1", "--with-optimizer", "--format", "torch_dist"]),
        ("mixtral-reshard-opt", ["reshard", str(mix), str(w / "mixtral-reshard-opt"), "--ep", "1",
                                 "--with-optimizer"]),
        ("dist-to-hf", ["megatron-to-hf", str(w / "llama-meg-dist"), str(w / "dist-hf")]),
        ("gpt2-ft", ["megatron-to-ft", str(w / "gpt2"), str(w / "gpt2-ft"), "--tp", "2"]),
        ("gpt2-ft-fp16", ["megatron-to-ft", str(w / "gpt2"), str(w / "gpt2-ft-fp16"), "--tp", "1", "--dtype", "fp16"]),
        ("gpt2-trtllm", ["megatron-to-trtllm", str(w / "gpt2"), str(w / "gpt2-trtllm"), "--tp", "2"]),
        ("llama-trtllm", ["megatron-to-trtllm", str(llama), str(w / "llama-trtllm"), "--tp", "2"]),
        ("llama-gguf-f16", ["hf-to-gguf", str(hf), str(w / "llama-f16.gguf"), "--outtype", "f16"]),
        ("llama-gguf-q8", ["hf-to-gguf", str(hf), str(w / "llama-q8.gguf"), "--outtype", "q8_0"]),
        ("meg-gguf-f16", ["megatron-to-gguf", str(llama), str(w / "meg-f16.gguf"), "--outtype", "f16"]),
        ("llama-onnx", ["to-onnx", str(hf), str(w / "llama-onnx"), "--exporter", "torch", "--no-past"]),
        # the plans and refusals every verb shares with `--dry-run` and `plan`: their reports, or their one line
        *[(f"dry-{name}", [*argv, "--dry-run", "--json"]) for name, argv in (
            ("llama-hf", ["megatron-to-hf", str(llama), str(w / "dry")]),
            ("llama-meg", ["hf-to-megatron", str(hf), str(w / "dry"), "--tp", "2", "--pp", "2"]),
            ("llama-reshard-opt", ["reshard", str(llama), str(w / "dry"), "--tp", "1", "--pp", "2", "--with-optimizer"]),
            ("gpt2-ft", ["megatron-to-ft", str(w / "gpt2"), str(w / "dry"), "--tp", "2"]),
            ("gpt2-ft-fp16", ["megatron-to-ft", str(w / "gpt2"), str(w / "dry"), "--dtype", "fp16"]),
            ("llama-ft", ["megatron-to-ft", str(llama), str(w / "dry"), "--tp", "2"]),
            ("gpt2-ft-tp3", ["megatron-to-ft", str(w / "gpt2"), str(w / "dry"), "--tp", "3"]),
            ("mixtral-ft", ["megatron-to-ft", str(mix), str(w / "dry")]),
            ("gpt2-trtllm", ["megatron-to-trtllm", str(w / "gpt2"), str(w / "dry"), "--tp", "2"]),
            ("llama-trtllm", ["megatron-to-trtllm", str(llama), str(w / "dry"), "--tp", "2", "--dtype", "fp16"]),
            ("llama-trtllm-tp3", ["megatron-to-trtllm", str(llama), str(w / "dry"), "--tp", "3"]),
            ("mixtral-trtllm", ["megatron-to-trtllm", str(mix), str(w / "dry")]),
            ("llama-gguf", ["hf-to-gguf", str(hf), str(w / "dry.gguf"), "--outtype", "q8_0"]),
            ("meg-gguf", ["megatron-to-gguf", str(llama), str(w / "dry.gguf")]),
            ("mixtral-gguf", ["hf-to-gguf", str(mhf), str(w / "dry.gguf")]),
            ("gpt2-gguf", ["megatron-to-gguf", str(w / "gpt2"), str(w / "dry.gguf")]),
            ("llama-onnx", ["to-onnx", str(hf), str(w / "dry"), "--exporter", "torch", "--no-past"]),
            ("meg-onnx", ["to-onnx", str(llama), str(w / "dry")]),
            ("mixtral-onnx", ["to-onnx", str(mhf), str(w / "dry")]))],
        *[(f"plan-{preset}-{to}", ["plan", "--preset", preset, "--to", to, *more, "--json", "--files"])
          for preset, to, more in (("tiny-gpt2", "ft", ["--tp", "2", "--target-tp", "2"]),
                                   ("tiny-llama", "ft", ["--target-tp", "2"]),
                                   ("tiny-gpt2", "trtllm", ["--target-tp", "2"]),
                                   ("tiny-llama", "trtllm", ["--tp", "2", "--target-tp", "2", "--dtype", "fp16"]),
                                   ("tiny-mixtral", "trtllm", []),
                                   ("tiny-llama", "hf", ["--tp", "2", "--pp", "2"]),
                                   ("tiny-mixtral", "megatron", ["--ep", "2", "--format", "torch_dist"]))],
    ]


def _sha(p: Path) -> str:
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _tree(root: Path) -> dict[str, str]:
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    return {str(p.relative_to(root.parent)): _sha(p) for p in files}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workdir", type=Path)
    ap.add_argument("manifest", type=Path)
    ap.add_argument("--compare", type=Path, help="another manifest: exit 1 unless equal")
    ap.add_argument("--only", nargs="*", help="step names to run (default: all)")
    a = ap.parse_args()
    w = a.workdir.resolve()
    shutil.rmtree(w, ignore_errors=True)
    w.mkdir(parents=True)
    env = dict(os.environ, PYTHONHASHSEED="0")
    manifest: dict[str, dict[str, str]] = {}
    for name, argv in _steps(w):
        if a.only and name not in a.only:
            continue
        t = time.perf_counter()
        r = subprocess.run(CLI + argv, env=env, capture_output=True, text=True)
        out = Path(argv[2])
        print(f"{name}: rc={r.returncode} {time.perf_counter() - t:.1f}s", flush=True)
        if r.returncode != 0:
            manifest[name] = {"error": (r.stderr.strip().splitlines() or ["?"])[-1]}
            continue
        if "--json" in argv:  # a report or a plan: every key but the clock's
            report = json.loads(r.stdout)
            manifest[name] = {k: json.dumps(v, sort_keys=True) for k, v in report.items() if k != "seconds"}
            continue
        manifest[name] = _tree(out)
    a.manifest.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    if a.compare:
        other = json.loads(a.compare.read_text())
        diff = sorted(k for k in set(manifest) | set(other) if manifest.get(k) != other.get(k))
        for k in diff:
            mine, theirs = manifest.get(k, {}), other.get(k, {})
            files = sorted(f for f in set(mine) | set(theirs) if mine.get(f) != theirs.get(f))
            print(f"DIFFERS {k}: {files[:8]}")
        print("identical" if not diff else f"{len(diff)} steps differ")
        return 1 if diff else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
