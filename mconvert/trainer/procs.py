"""Rank processes that cannot outlive their launcher, and whose first failure ends the whole group.

Each launched rank (`run_rank`) moves into its own process group, asks the kernel for SIGKILL when its
parent dies (PR_SET_PDEATHSIG) and registers its pid in the launch's directory. A rank that fails writes its
error there and exits at once, so no peer waits for it in a collective. The launcher's side (`RankGroup`)
reads that directory: it names the rank whose error came first, and SIGKILLs every rank's process group on
any exit path (normal, exception, signal). A SIGKILLed launcher cannot run code; its ranks die through the
parent-death signal (CPU ranks are children of multiprocessing's forkserver, which exits when its launcher
does, and takes them along the same way).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, NoReturn

from mconvert.errors import MConvertError

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Ask Linux to send `sig` to this process when its parent exits; False where that is not available."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def guard_forkserver() -> None:
    """Inside multiprocessing's forkserver only: arm the parent-death signal, so that the server and the ranks
    it forked cannot outlive the launcher; exit at once when the launcher is already gone."""
    if sys.argv != ["-c"] or "multiprocessing.forkserver" not in sys.modules:
        return  # imported somewhere else: not the forkserver
    if set_parent_death_signal() and os.getppid() == 1:
        os._exit(0)


def process_start_time(pid: int) -> str:
    """The kernel's start time of `pid` (/proc/PID/stat field 22), or '' when unknown: with the pid it names
    one process, so a recycled pid is never signalled."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    fields = stat.rsplit(")", 1)[-1].split()
    return fields[19] if len(fields) > 19 else ""


def alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[-1].split()[:1] != ["Z"]


@dataclass(frozen=True)
class RankControl:
    """What each rank receives from its launcher (picklable): the registration directory and the launcher pid."""

    directory: str
    launcher_pid: int

    def enter(self, rank: int) -> None:
        """First thing in a rank: own process group, die with the parent, pid registered for the launcher."""
        with contextlib.suppress(OSError):
            os.setpgid(0, 0)  # the launcher ends the group; a terminal's Ctrl-C reaches the launcher only
        set_parent_death_signal()
        if not alive(self.launcher_pid):  # the launcher died before the death signal was armed
            os._exit(1)
        _write(Path(self.directory, f"{rank}.pid"), f"{os.getpid()} {process_start_time(os.getpid())}")

    def fail(self, rank: int, exc: BaseException) -> None:
        """Record this rank's error (one line, time-stamped) for the launcher to report."""
        user = isinstance(exc, MConvertError)
        if user:
            message = str(exc)
        else:
            first = (str(exc).strip().splitlines() or [""])[0][:300]
            message = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
        if os.environ.get("MCONVERT_DEBUG"):
            traceback.print_exception(exc, file=sys.stderr)
        record = {"rank": rank, "time": time.time(), "user": user, "message": message}
        _write(Path(self.directory, f"{rank}.error"), json.dumps(record))


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)  # the launcher never reads half a record


def run_rank(control: RankControl, fn: Callable[..., Any], args: tuple) -> Any:
    """What every launched rank runs: `fn(*args)` inside the launch's process hygiene. Any failure is
    recorded and ends the process at once, without unwinding into a barrier or a collective."""
    rank = int(os.environ.get("RANK", "0"))
    control.enter(rank)
    try:
        return fn(*args)
    except BaseException as e:  # KeyboardInterrupt and SystemExit too: a rank never lingers after failing
        control.fail(rank, e)
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(1)


class RankGroup:
    """The launcher's side of one launch: the directory ranks register in, their errors, and their teardown."""

    def __init__(self) -> None:
        self.directory = Path(tempfile.mkdtemp(prefix="mconvert-ranks-"))
        self.control = RankControl(str(self.directory), os.getpid())

    def pids(self) -> dict[int, tuple[int, str]]:
        """{rank: (pid, start time)} of every rank that has registered."""
        out: dict[int, tuple[int, str]] = {}
        for f in self.directory.glob("*.pid"):
            with contextlib.suppress(OSError, ValueError):
                pid, _, start = f.read_text().partition(" ")
                out[int(f.stem)] = (int(pid), start.strip())
        return out

    def kill(self) -> None:
        """SIGKILL the process group of every registered rank that is still the process it registered."""
        for pid, start in self.pids().values():
            if not alive(pid) or (start and process_start_time(pid) != start):
                continue
            try:
                os.killpg(pid, signal.SIGKILL)  # each rank leads its own group
            except (ProcessLookupError, PermissionError):
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)

    def first_failure(self) -> tuple[int, str] | None:
        """(rank, message) of the earliest recorded error (a user error wins a tie), or None."""
        records = []
        for f in self.directory.glob("*.error"):
            with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                r = json.loads(f.read_text())
                records.append((float(r["time"]), not r["user"], int(r["rank"]), str(r["message"])))
        if not records:
            return None
        _, _, rank, message = min(records)
        return rank, message

    def close(self) -> None:
        self.kill()
        shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> "RankGroup":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


HANDLED_SIGNALS = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT") if hasattr(signal, n))


@contextlib.contextmanager
def kept_signal_handlers():
    """Restore this process's handlers of the termination signals afterwards (the elastic agent replaces them)."""
    saved = {s: signal.getsignal(s) for s in HANDLED_SIGNALS}
    try:
        yield
    finally:
        for s, h in saved.items():
            with contextlib.suppress(ValueError, TypeError, OSError):  # not the main thread / not settable
                signal.signal(s, h if h is not None else signal.SIG_DFL)


def redeliver(sig: int) -> NoReturn:
    """Hand a signal the elastic agent intercepted to this process's own handler (after the ranks are gone):
    SIGINT becomes KeyboardInterrupt, SIGTERM/SIGHUP reach the caller's cleanup or end the process."""
    signal.raise_signal(sig)
    name = signal.Signals(sig).name
    raise MConvertError(f"stopped by {name}; every rank process was ended")
