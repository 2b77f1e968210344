"""Atomic output under SIGKILL, with real processes.

A small fork server imports mconvert once (torch's import dominates on a busy 2-core box) and forks one child
process per conversion; the test watches the child's temporary output directory and SIGKILLs the child when
it reaches a chosen point: early (temp dir created), mid (first weight files written), late (everything
written, manifest being hashed). No kill may leave an OUT; a killed `--force` run leaves the old OUT whole;
the next run into the same OUT removes the dead run's temporary directory.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from safety_common import big_llama_hf, PY, ROOT

from mconvert.io.atomic import MANIFEST, check_manifest

pytestmark = pytest.mark.slow

SERVER = r"""
import json, os, sys
import mconvert.cli, mconvert.convert.driver  # imported once; children start converting at once
print("ready", flush=True)
for line in sys.stdin:
    job = json.loads(line)
    if "wait" in job:
        _, status = os.waitpid(job["wait"], 0)
        print(json.dumps({"signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else 0,
                          "code": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None}), flush=True)
        continue
    pid = os.fork()
    if pid == 0:
        fd = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        code = 0
        try:
            mconvert.cli.main(job["argv"])
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        os._exit(code)
    print(pid, flush=True)
"""


class ForkServer:
    def __init__(self) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        env.pop("MCONVERT_DEBUG", None)
        self.proc = subprocess.Popen([PY, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=env)
        self.ready = False  # the import runs while the test builds its inputs

    def _ask(self, msg: dict) -> str:
        if not self.ready:
            assert self.proc.stdout.readline().strip() == "ready"
            self.ready = True
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def start(self, argv: list, log: Path) -> int:
        return int(self._ask({"argv": [str(a) for a in argv], "log": str(log)}))

    def wait(self, pid: int) -> dict:
        return json.loads(self._ask({"wait": pid}))

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def server():
    s = ForkServer()
    yield s
    s.close()


@pytest.fixture(scope="module")
def big_hf() -> Path:
    """A ~7M-parameter (29 MB) Llama HF dir (config by transformers, shapes from its meta-device model, random data)."""
    return big_llama_hf()


def _tmp_dirs(out: Path) -> list[Path]:
    return sorted(out.parent.glob(f".{out.name}.mconvert-tmp-*"))


def run_and_kill(server: ForkServer, argv: list, out: Path, point: str, log: Path, timeout: float = 120) -> dict:
    """Start the conversion and SIGKILL it when its temp dir reaches `point`; returns the wait status."""
    marks = {
        "early": lambda d: True,
        "mid": lambda d: any(d.glob(".shard-00001.safetensors")) or any(d.glob("*/mp_rank_*/model_optim_rng.pt")),
        "late": lambda d: (d / "config.json").exists() or (d / "latest_checkpointed_iteration.txt").exists(),
    }
    pid = server.start(argv, log)
    tmp = out.parent / f".{out.name}.mconvert-tmp-{pid}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if tmp.is_dir() and marks[point](tmp):
                break
        except OSError:  # the tree changes under the glob
            pass
        time.sleep(0.001)
    else:
        os.kill(pid, signal.SIGKILL)
        server.wait(pid)
        pytest.fail(f"{point}: the conversion never reached that point; log: {log.read_text()[-2000:]}")
    os.kill(pid, signal.SIGKILL)
    status = server.wait(pid)
    assert status["signal"] == signal.SIGKILL, f"finished before the kill ({status}); log: {log.read_text()[-500:]}"
    assert tmp.is_dir(), "SIGKILL leaves the temp dir for the next run to clean"
    return status


def run_to_end(server: ForkServer, argv: list, log: Path) -> None:
    status = server.wait(server.start(argv, log))
    assert status == {"signal": 0, "code": 0}, log.read_text()[-3000:]


def _snapshot(d: Path) -> dict[str, int]:
    return {str(p.relative_to(d)): p.stat().st_mtime_ns for p in sorted(d.rglob("*")) if p.is_file()}


def test_sigkill_at_any_point_leaves_no_output_and_the_next_run_cleans_up(server, big_hf, tmp_path):
    out = tmp_path / "ckpt"
    argv = ["hf-to-megatron", big_hf, out, "--tp", "2", "--pp", "4"]
    for point in ("early", "mid", "late"):
        run_and_kill(server, argv, out, point, tmp_path / f"{point}.log")
        assert not out.exists(), f"SIGKILL at {point} left {out}"
        assert len(_tmp_dirs(out)) == 1, "each run removes the temp dir of the run killed before it"
    run_to_end(server, argv, tmp_path / "done.log")
    assert _tmp_dirs(out) == [], "stale temp dirs of killed runs were not removed"
    assert check_manifest(out) == []
    assert len(list(out.glob("release/mp_rank_*/model_optim_rng.pt"))) == 8


def test_sigkill_during_force_keeps_the_old_output_whole(server, big_hf, tmp_path):
    out = tmp_path / "hf"
    run_to_end(server, ["hf-to-megatron", big_hf, tmp_path / "ckpt"], tmp_path / "a.log")
    argv = ["megatron-to-hf", tmp_path / "ckpt", out, "--max-shard-size", "4MB"]
    run_to_end(server, argv, tmp_path / "b.log")
    before = _snapshot(out)
    manifest = (out / MANIFEST).read_text()
    assert len(before) > 5
    for point in ("early", "mid", "late"):
        run_and_kill(server, [*argv, "--force", "--dtype", "bf16"], out, point, tmp_path / f"{point}.log")
        assert _snapshot(out) == before, f"SIGKILL at {point} touched the old OUT"
        assert (out / MANIFEST).read_text() == manifest and check_manifest(out) == []
    run_to_end(server, [*argv, "--force", "--dtype", "bf16"], tmp_path / "c.log")
    assert _tmp_dirs(out) == []
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert check_manifest(out) == []


def _fill(root: Path, failures: list) -> None:
    """Create directories and files under `root` (as another torchrun rank does) until a creation fails."""
    from mconvert.io.paths import make_dirs

    for i in range(100_000):
        try:
            make_dirs(root / f"stage-{i % 7}" / f"rank-{i % 3}")
            (root / f"stage-{i % 7}" / f"rank-{i % 3}" / f"f{i}").write_bytes(b"x")
        except OSError as e:
            failures.append(e)
            return


def test_a_failed_run_removes_its_directory_while_another_writer_fills_it(tmp_path):
    """A writer (another torchrun rank) keeps creating directories and files in the temporary directory while
    the run fails and removes it: nothing is left, and the writer's next file fails; a `gone` directory of a
    SIGKILLed removal is cleaned by the next run."""
    from mconvert.io.atomic import atomic_output_dir, tmp_name

    out = tmp_path / "out"
    for attempt in range(20):
        failures: list[OSError] = []
        with pytest.raises(RuntimeError, match="failed"):
            with atomic_output_dir(out) as tmp:
                t = threading.Thread(target=_fill, args=(tmp, failures))
                t.start()
                time.sleep(0.01 * (attempt % 5))
                raise RuntimeError("failed")
        t.join()
        assert os.listdir(tmp_path) == [], attempt
        assert failures, "the writer went on writing after the removal"
        assert isinstance(failures[0], FileNotFoundError), failures[0]

    done = subprocess.run([PY, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / tmp_name(out.name, pid=int(done.stdout), gone=True)
    (stale / "release").mkdir(parents=True)
    with atomic_output_dir(out) as tmp:
        (tmp / "config.json").write_text("{}")
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_sigterm_inside_a_finalizer_is_handled_after_it_not_dropped():
    """A SIGTERM handled while a weakref finalizer runs (a pool buffer returned, a descriptor closed) would raise
    inside it, where Python prints "Exception ignored" and drops the exception: it is handled once the finalizer
    has returned, as `_Terminated`, and nothing is printed. Run in a child so the signal stays there."""
    code = r"""
import signal, sys, time, weakref
from mconvert.io.atomic import _Terminated, terminating
class Owner: pass
ran = []
def finalizer():
    signal.raise_signal(signal.SIGTERM)  # handled at the next bytecode: inside this finalizer
    ran.extend([1, 2, 3])
try:
    with terminating():
        o = Owner(); weakref.finalize(o, finalizer); del o
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # the signal comes back within a moment of the finalizer's return
            pass
    print("not terminated")
except _Terminated as e:
    print("terminated", e.code, ran)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.stdout.strip() == f"terminated {128 + signal.SIGTERM} [1, 2, 3]", (r.stdout, r.stderr)
    assert r.stderr == "", r.stderr
