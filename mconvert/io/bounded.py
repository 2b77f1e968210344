"""Third-party work on untrusted text, bounded: a chat template rendered by jinja, a config instantiated by
transformers, a generation config validated by it. Each runs in a child process with an address-space and a
CPU-time limit (`RLIMIT_AS`, `RLIMIT_CPU`) and a wall-clock timeout, so a template of nested loops or a config
that asks for a million modules ends in one line naming the part, never in a hang or a `MemoryError` of
mconvert's own process.

The child runs `python -m mconvert.io.bounded`: it reads `{"target": "module:function", "args": {...}}`
as JSON on stdin, calls the function (which must be an mconvert function taking and returning JSON values) and
writes `{"ok": result}` or `{"error": message}` as one JSON line on stdout. Before each part of the work the
function may call `part(name)`, which the parent uses to name what ran past a bound.
"""

from __future__ import annotations

import importlib
import json
import os
import resource
import subprocess
import sys
from pathlib import Path
from typing import Any

from mconvert.errors import MConvertError

SECONDS = 45  # wall clock for one child, its interpreter start and imports included (and its CPU time)
MEMORY = 3 << 30  # address space of one child: transformers and torch imported, a small model on meta
_PART = "mconvert-bounded-part: "


def part(name: str, cpu_seconds: float | None = None) -> None:
    """In the child: say which part of the work starts (named by the parent when a bound is hit); with
    `cpu_seconds`, the part gets that much CPU time from now on (the imports before it do not count)."""
    print(_PART + name + (f" (given {cpu_seconds:g} s of CPU)" if cpu_seconds else ""), file=sys.stderr,
          flush=True)
    if cpu_seconds is not None:
        used = resource.getrusage(resource.RUSAGE_SELF)
        limit = int(used.ru_utime + used.ru_stime + cpu_seconds) + 1
        hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
        resource.setrlimit(resource.RLIMIT_CPU, (min(limit, hard), hard))


def run_bounded(target: str, args: dict[str, Any], what: str, fix: str, seconds: float = SECONDS,
                memory: int = MEMORY) -> Any:
    """`target(**args)` in a bounded child (see the module docstring); its JSON result. A child past a bound
    is one MConvertError naming `what` and the part that was running, with `fix`; an error the function
    raised comes back as its message."""
    pkg_root = str(Path(__file__).resolve().parents[3])  # the directory holding this mconvert package
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (pkg_root, os.environ.get("PYTHONPATH")) if p),
               TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.pop("MCONVERT_DEBUG", None)
    cpu = max(1, int(seconds))
    # its own session (process group): a timeout kills whatever it started too
    p = subprocess.Popen([sys.executable, "-m", "mconvert.io.bounded"], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True, start_new_session=True)
    request = {"target": target, "args": args, "memory": memory, "cpu": cpu}
    try:
        out, err = p.communicate(json.dumps(request), timeout=seconds)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, 9)
        out, err = p.communicate()
        raise MConvertError(f"{what}: {_running(err)} did not finish within {seconds:g} s; {fix}") from None
    line = next((ln for ln in reversed(out.splitlines()) if ln.startswith("{")), None)
    result = json.loads(line) if line else None
    if isinstance(result, dict) and "ok" in result:
        return result["ok"]
    if isinstance(result, dict) and "error" in result:
        raise MConvertError(str(result["error"]))
    if p.returncode in (-9, -24) or "MemoryError" in err or "Cannot allocate memory" in err:
        # SIGXCPU (-24), the kernel's kill, or an allocation the address-space limit refused
        limit = f"{memory / (1 << 30):g} GiB of memory" if p.returncode != -24 else "its CPU time"
        raise MConvertError(f"{what}: {_running(err)} needs more than {limit}; {fix}")
    last = next((ln for ln in reversed(err.splitlines()) if ln.strip() and not ln.startswith(_PART)), "no output")
    raise MConvertError(f"{what}: {_running(err)} failed in its bounded process (exit {p.returncode}: "
                        f"{last[:200]}); {fix}")


def _running(err: str) -> str:
    parts = [ln[len(_PART):] for ln in err.splitlines() if ln.startswith(_PART)]
    return parts[-1] if parts else "the bounded process"


def _child() -> None:
    req = json.loads(sys.stdin.read())
    # the limits hold before anything of the target is imported
    resource.setrlimit(resource.RLIMIT_AS, (req["memory"], req["memory"]))
    resource.setrlimit(resource.RLIMIT_CPU, (req["cpu"], req["cpu"] + 1))
    module, _, name = req["target"].partition(":")
    if not module.startswith("mconvert."):
        raise SystemExit(f"not an mconvert function: {req['target']}")
    fn = getattr(importlib.import_module(module), name)
    try:
        result = {"ok": fn(**req["args"])}
    except MConvertError as e:
        result = {"error": str(e)}
    except MemoryError:
        sys.stderr.write("MemoryError\n")
        raise SystemExit(3) from None
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    _child()
