"""The Megatron-Bridge section of `make bench`: Megatron-Bridge's own HF → Megatron import and Megatron → HF
export against `hf-to-megatron --format torch_dist` and `megatron-to-hf` of the same checkpoint, interleaved with
`cp -r` of the HF directory, on the bench's 1.3 GB Llama (gguf_peer.py).

Megatron-Bridge runs in its own venv (`make bridge-env`) through tests/helpers/bridge_helper.py, the driver the
Bridge tests use: its `AutoBridge` import saved as it saves every checkpoint (one torch_dist iteration, TP=1 PP=1,
with run_config.yaml), and its `export_ckpt` of that checkpoint. It targets GPUs; on CPU it runs with the
helper's stand-ins for the CUDA and Transformer Engine names it touches, which do no work of their own. Both
sides write the same kind of output from the same input: the import a torch_dist checkpoint of the HF model, the
export an HF directory of the Bridge checkpoint (ours reads that checkpoint through its run_config.yaml).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from procmon import row_figures

ROOT = Path(__file__).resolve().parent.parent
HELPER = ROOT / "tests" / "helpers" / "bridge_helper.py"
CKPT_SUFFIX = "-bridge"  # the Bridge checkpoint of HF dir X, built once (not timed): X-bridge beside it
GB = 10**9
# direction -> (its peer's op, our op, which input: the HF dir or the Bridge checkpoint)
DIRECTIONS = {"HF → Megatron": ("bridge:import", "hf-to-megatron-dist", "hf"),
              "Megatron → HF": ("bridge:export", "megatron-to-hf", "ckpt")}


def python(venv: Path | None = None) -> Path | None:
    """The Megatron-Bridge venv's interpreter, or None when `make bridge-env` has not built it."""
    venv = venv or Path(os.environ.get("BRIDGE_VENV", Path.home() / ".cache" / "mconvert" / "bridge-venv"))
    py = venv / "bin" / "python"
    return py if py.is_file() else None


def checkpoint_of(hf: Path) -> Path:
    return hf.with_name(hf.name + CKPT_SUFFIX)


def command(op: str, src: Path, out: Path, mconvert: list[str]) -> list[str]:
    """`bridge:import` of HF dir `src` or `bridge:export` of Bridge checkpoint `src` (its HF dir beside it) into
    `out`, in the Bridge venv without this process's Python variables and with no CUDA device; or ours,
    `hf-to-megatron-dist` (torch_dist at TP=1 PP=1, as the Bridge saves it)."""
    if op == "hf-to-megatron-dist":
        return [*mconvert, "hf-to-megatron", str(src), str(out), "--format", "torch_dist"]
    py = python()
    assert py is not None
    env = ["env", *(f"--unset={k}" for k in os.environ if k.startswith(("PYTHON", "VIRTUAL_ENV"))), "CUDA_VISIBLE_DEVICES="]
    if op == "bridge:import":
        return [*env, str(py), str(HELPER), "import", str(src), str(out)]
    if op == "bridge:export":
        hf = src.with_name(src.name.removesuffix(CKPT_SUFFIX))
        return [*env, str(py), str(HELPER), "export", str(hf), str(src), str(out)]
    raise ValueError(op)


def jobs(hf: Path) -> list[tuple[str, str, Path]]:
    """(label, op, src) rows of the section: cp of the HF directory, then each direction's peer and ours."""
    ckpt = checkpoint_of(hf)
    out = [("cp bridge hf", "cp", hf)]
    for direction, (peer, ours, src) in DIRECTIONS.items():
        s = hf if src == "hf" else ckpt
        out += [(f"Megatron-Bridge {direction}", peer, s), (f"mconvert {direction}", ours, s)]
    return out


def figures(rows: dict[str, dict[str, Any]], hf_bytes: int) -> dict[str, Any]:
    """Per direction: the peer's, ours and cp's wall and CPU seconds, per GB of the HF directory, and the peer's
    time over ours (wall and CPU)."""
    gbs = hf_bytes / GB
    cp = rows["cp bridge hf"]
    out: dict[str, Any] = {}
    for direction in DIRECTIONS:
        r: dict[str, Any] = {"bytes": hf_bytes}
        for side, label in (("peer", f"Megatron-Bridge {direction}"), ("ours", f"mconvert {direction}"),
                            ("cp", "cp bridge hf")):
            r[side] = row_figures(rows[label], gbs, cp["wall_s"])
        r["speedup"] = r["peer"]["wall_s"] / r["ours"]["wall_s"]
        r["cpu_speedup"] = r["peer"]["cpu_s"] / r["ours"]["cpu_s"]
        out[direction] = r
    return out
