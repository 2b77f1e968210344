"""Multi-process runners (validate, verify --against, train) fail fast and leave no orphans: a damaged rank file
other than rank 0 ends the run at once with one line naming the rank and the file; a parent killed by SIGKILL
or stopped by SIGTERM takes every rank process (and the forkserver) with it. Truth is the process table
(psutil), not our own bookkeeping."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from mconvert.trainer.procs import RankGroup
from validate_common import hf_export, trained_ckpt

ROOT = Path(__file__).resolve().parents[2]
DAMAGED = "mp_rank_01_001"  # TP rank 1, PP rank 1 of the TP=2 PP=2 checkpoint: global rank 3
# A hang guard, not a speed goal: the error line names the failed rank whether its peers were ended by the
# failure path or gave up in their collective (the earliest record wins), so the time is what tells the two
# apart. A peer left waiting in a collective for a dead rank gives up only after init_distributed's 600 s
# timeout, an order of magnitude above this bound, and a normal run stays far below it.
BOUND_S = 60


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), COLUMNS="400")
    env.pop("MCONVERT_DEBUG", None)
    return env


def _cli(capsys, *args: str) -> tuple[int, str, str, float]:
    """The CLI in this process (its forkserver is warm from building the fixtures): exit code, out, err, seconds."""
    from mconvert.cli import main

    t0 = time.monotonic()
    with pytest.raises(SystemExit) as e:
        main([*map(str, args)])
        raise SystemExit(0)
    out = capsys.readouterr()
    return e.value.code or 0, out.out, out.err, time.monotonic() - t0


def _damaged_ckpt(tmp_path: Path) -> Path:
    """A copy of the trained TP=2 PP=2 checkpoint whose rank (tp=1, pp=1) file is cut in half."""
    ck = tmp_path / "ckpt"
    shutil.copytree(trained_ckpt("llama"), ck)
    (f,) = ck.glob(f"iter_*/{DAMAGED}/model_optim_rng.pt")
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    return ck


def _error_lines(text: str) -> list[str]:
    return [ln for ln in " ".join(text.split()).replace(" error:", "\nerror:").splitlines()
            if ln.startswith("error:")]  # rich wraps long lines at the terminal width


def _assert_one_line_naming_rank_3(rc: int, out: str, err: str, secs: float) -> None:
    """Exit 1 within the bound, one `error:` line naming rank 3 and its damaged file, no traceback."""
    assert rc == 1
    assert secs < BOUND_S, f"took {secs:.0f} s: a collective waited for the failed rank"
    lines = _error_lines(out + err)
    assert len(lines) == 1, out + err
    assert lines[0].startswith("error: rank 3 failed: ") and f"{DAMAGED}/model_optim_rng.pt" in lines[0]
    assert "Traceback" not in out + err


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_validate_with_a_damaged_rank_file_fails_at_once_naming_rank_and_file(tmp_path, capsys, monkeypatch):
    ck, hf = _damaged_ckpt(tmp_path), hf_export("llama")
    monkeypatch.delenv("MCONVERT_DEBUG", raising=False)
    rc, out, err, secs = _cli(capsys, "validate", ck, hf)
    _assert_one_line_naming_rank_3(rc, out, err, secs)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_verify_against_a_damaged_rank_file_fails_at_once_naming_rank_and_file(tmp_path, capsys, monkeypatch):
    ck, hf = _damaged_ckpt(tmp_path), hf_export("llama")
    monkeypatch.delenv("MCONVERT_DEBUG", raising=False)
    rc, out, err, secs = _cli(capsys, "verify", hf, "--against", ck, "--json")
    assert rc == 1
    assert secs < BOUND_S, f"took {secs:.0f} s: a collective waited for the failed rank"
    checks = {c["name"]: c for c in json.loads(out)["checks"]}
    assert checks["logits"]["status"] == "error"
    assert "rank 3 failed: " in checks["logits"]["message"]
    assert f"{DAMAGED}/model_optim_rng.pt" in checks["logits"]["message"]
    assert "Traceback" not in err


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_train_resume_with_a_damaged_rank_file_fails_at_once_naming_rank_and_file(tmp_path, capsys, monkeypatch):
    ck = _damaged_ckpt(tmp_path)
    monkeypatch.delenv("MCONVERT_DEBUG", raising=False)
    rc, out, err, secs = _cli(capsys, "train", "--preset", "tiny-llama", "--tp", "2", "--pp", "2", "--steps", "8",
                                   "--save", ck, "--resume", "--device", "cpu", "--global-batch-size", "8",
                                   "--seq-length", "32")
    _assert_one_line_naming_rank_3(rc, out, err, secs)


def _fail_while_peer_waits() -> int:
    """Rank 1 raises after joining the group; rank 0 is then inside an all-reduce that rank 1 never enters."""
    import torch
    import torch.distributed as dist

    from mconvert.trainer.parallel import init_distributed

    st = init_distributed(1, 2, 1, "cpu")
    if st.rank == 1:
        time.sleep(1)  # rank 0 is inside the collective by now
        raise ValueError("rank one breaks mid-run")
    dist.all_reduce(torch.ones(1))
    return 0


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_rank_failing_while_its_peer_waits_in_a_collective_ends_the_launch_at_once():
    from mconvert.errors import MConvertError
    from mconvert.trainer.train import launch

    trained_ckpt("llama")  # the forkserver is warm, as in every other test here
    t0 = time.monotonic()
    with pytest.raises(MConvertError, match=r"^rank 1 failed: ValueError: rank one breaks mid-run$"):
        launch(_fail_while_peer_waits, (), 2, "cpu")
    assert time.monotonic() - t0 < BOUND_S


def _tree_while_running(proc: subprocess.Popen, ranks: int, ready, deadline: float = 120) -> list[psutil.Process]:
    """Poll the parent's process tree until `ready(tree)`; returns the tree with `ranks` live grandchildren
    (ranks fork from multiprocessing's forkserver, a child of the parent)."""
    parent = psutil.Process(proc.pid)
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        assert proc.poll() is None, "the run ended before its ranks were seen"
        try:
            tree = parent.children(recursive=True)
        except psutil.NoSuchProcess:
            tree = []
        grandchildren = [p for p in tree if _ppid(p) != proc.pid]
        if len(grandchildren) >= ranks and ready(tree):
            return tree
        time.sleep(0.02)
    raise AssertionError(f"no {ranks} rank processes within {deadline} s")


def _ppid(p: psutil.Process) -> int | None:
    try:
        return p.ppid()
    except psutil.NoSuchProcess:
        return None


def _running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _assert_all_gone(tree: list[psutil.Process], within: float = 15) -> None:
    end = time.monotonic() + within
    while time.monotonic() < end and any(_running(p) for p in tree):
        time.sleep(0.1)
    left = [p.pid for p in tree if _running(p)]
    for p in tree:  # never leave them to the next test
        if _running(p):
            p.kill()
    assert not left, f"processes of the killed run still alive: {left}"


def _start(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "mconvert.cli", *map(str, args)], env=_env(), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_validate_parent_killed_by_sigkill_leaves_no_rank_process(tmp_path):
    ck, hf = trained_ckpt("llama"), hf_export("llama")
    proc = _start("validate", ck, hf, "--tokens", "64")
    try:
        tree = _tree_while_running(proc, 4, lambda t: sum(_running(p) for p in t) >= 5)
        alive_ranks = [p for p in tree if _ppid(p) != proc.pid and _running(p)]
        proc.send_signal(signal.SIGKILL)
        assert len(alive_ranks) >= 4  # the ranks were running when the parent died
        proc.wait(10)
        assert proc.returncode == -signal.SIGKILL
        _assert_all_gone(tree)
    finally:
        if proc.poll() is None:
            proc.kill()


TRAIN_LONG = ("train", "--preset", "tiny-llama", "--tp", "2", "--pp", "2", "--steps", "100000", "--device", "cpu",
              "--global-batch-size", "8", "--seq-length", "32")


def _wait_for_training(proc: subprocess.Popen) -> list[psutil.Process]:
    """Block until the first loss line (every rank is inside the training loop), then return the tree."""
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("iteration"):
            break
    else:
        raise AssertionError(f"train ended without a loss line: {proc.stderr.read() if proc.stderr else ''}")
    return _tree_while_running(proc, 4, lambda t: True, deadline=10)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_train_parent_killed_by_sigkill_leaves_no_rank_process():
    proc = _start(*TRAIN_LONG)
    try:
        tree = _wait_for_training(proc)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        assert proc.returncode == -signal.SIGKILL
        _assert_all_gone(tree)
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name)
def test_train_parent_stopped_by_a_signal_ends_its_ranks_without_a_traceback(sig):
    proc = _start(*TRAIN_LONG)
    try:
        tree = _wait_for_training(proc)
        t0 = time.monotonic()
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
        # a hang guard below the elastic agent's shutdown grace (TORCH_ELASTIC_SHUTDOWN_TIMEOUT, 30 s by
        # default, then SIGKILL): the ranks are gone either way by the time the parent exits, so only the time
        # tells the launcher's own teardown of the rank groups apart from waiting out that grace
        assert time.monotonic() - t0 < 15, "the ranks outlived the signal until the agent's shutdown grace"
        assert proc.returncode != 0
        assert "Traceback" not in err and len(err.strip().splitlines()) <= 1, err
        _assert_all_gone(tree, within=5)
    finally:
        if proc.poll() is None:
            proc.kill()


# ---- the mechanism, without torch ------------------------------------------------------------------
_GRANDCHILD = """
import os, sys, time
from mconvert.trainer.procs import set_parent_death_signal
if sys.argv[1] == "arm":
    assert set_parent_death_signal()
print("ready", flush=True)
time.sleep(60)
"""

_MIDDLE = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], stdout=subprocess.PIPE, text=True)
assert child.stdout.readline().strip() == "ready"
print(child.pid, flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("arm", [True, False])
def test_parent_death_signal_kills_the_child_when_its_parent_is_sigkilled(arm):
    """With the signal armed the grandchild dies with its parent; without it, it survives (the control)."""
    mid = subprocess.Popen([sys.executable, "-c", _MIDDLE, _GRANDCHILD, "arm" if arm else "plain"],
                           stdout=subprocess.PIPE, text=True, env=_env())
    assert mid.stdout is not None
    grandchild = psutil.Process(int(mid.stdout.readline()))
    try:
        mid.kill()
        mid.wait(10)
        end = time.monotonic() + 3
        while time.monotonic() < end and _running(grandchild):
            time.sleep(0.05)
        assert _running(grandchild) is (not arm)
    finally:
        if _running(grandchild):
            grandchild.kill()


def test_rank_group_names_the_earliest_error_and_kills_registered_groups(tmp_path):
    """The first error in time is reported (a user error wins a tie); kill() ends a registered rank's group."""
    from mconvert.errors import MConvertError

    with RankGroup() as group:
        ctl = group.control
        ctl.fail(2, RuntimeError("Connection closed by peer\nmore"))
        rec = json.loads((group.directory / "2.error").read_text())
        (group.directory / "2.error").write_text(json.dumps({**rec, "time": rec["time"] + 1}))
        ctl.fail(3, MConvertError("/x/mp_rank_01_001/model_optim_rng.pt: truncated"))
        assert group.first_failure() == (3, "/x/mp_rank_01_001/model_optim_rng.pt: truncated")
        (group.directory / "3.error").unlink()
        assert group.first_failure() == (2, "RuntimeError: Connection closed by peer")

        child = subprocess.Popen([sys.executable, "-c", _RANK, str(group.directory), str(os.getpid())], env=_env(),
                                 stdout=subprocess.PIPE, text=True)
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        grandchild = psutil.Process(int(child.stdout.readline()))
        assert set(group.pids()) == {5} and os.getpgid(child.pid) == child.pid
        group.kill()
        assert child.wait(10) == -signal.SIGKILL
        end = time.monotonic() + 5
        while time.monotonic() < end and _running(grandchild):
            time.sleep(0.05)
        assert not _running(grandchild)  # the whole process group, not only the registered pid


_RANK = """
import subprocess, sys, time
from mconvert.trainer.procs import RankControl
RankControl(sys.argv[1], int(sys.argv[2])).enter(5)
g = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
print("ready", flush=True)
print(g.pid, flush=True)
time.sleep(60)
"""

