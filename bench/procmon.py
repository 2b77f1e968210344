"""Measure one command: wall time and peak resident memory of its whole process tree; page-cache residency.

Peak RSS is taken two ways and the larger is kept: psutil polling of the sum over the process tree (catches
`--workers N` children living at once) and the sum of each process's own high-water mark (VmHWM, exact for a
single process between polls). The kernel's `ru_maxrss` from `wait4` is recorded but not used: after
fork + exec it still counts the parent's resident pages at fork time. `anon` is RSS minus file-backed pages (mmap'd inputs count in RSS but are
page cache the kernel can drop at any time).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil


@dataclass
class Measurement:
    """One run of one command."""

    wall_s: float
    peak_rss: int  # bytes, max(tree-sum polling, sum of each process's VmHWM)
    peak_rss_tree: int  # bytes, polled sum over the process tree
    peak_anon_tree: int  # bytes, polled (rss - file-backed) summed over the tree
    maxrss_kernel: int  # bytes, ru_maxrss from wait4 (includes the parent's RSS at fork: not used)
    cpu_s: float  # user + system CPU seconds of the command and its reaped children (load-independent)
    returncode: int
    output_tail: str


def _vm_hwm(pid: int) -> int:
    """VmHWM of a process: the peak RSS of its current address space (fresh at exec, unlike ru_maxrss)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _tree_rss(proc: psutil.Process, hwm: dict[int, int] | None = None) -> tuple[int, int]:
    rss = anon = 0
    try:
        procs = [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return 0, 0
    for p in procs:
        try:
            mi = p.memory_info()
        except psutil.Error:
            continue
        rss += mi.rss
        anon += max(0, mi.rss - getattr(mi, "shared", 0))
        if hwm is not None:
            hwm[p.pid] = max(hwm.get(p.pid, 0), _vm_hwm(p.pid))
    return rss, anon


def run_measured(cmd: list[str], cwd: str | Path | None = None, env: dict[str, str] | None = None,
                 poll_s: float = 0.02, timeout_s: float = 3600.0) -> Measurement:
    """Run `cmd`, polling its process tree's RSS every `poll_s`; stdout+stderr go to a temp file (tail kept)."""
    import tempfile

    with tempfile.TemporaryFile() as log:
        t0 = time.perf_counter()
        p = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT)
        ps = psutil.Process(p.pid)
        peak = peak_anon = 0
        hwm: dict[int, int] = {}
        status = None
        rusage = None
        while True:
            pid, st, ru = os.wait4(p.pid, os.WNOHANG)
            if pid:
                status, rusage = st, ru
                break
            rss, anon = _tree_rss(ps, hwm)
            peak, peak_anon = max(peak, rss), max(peak_anon, anon)
            if time.perf_counter() - t0 > timeout_s:
                p.kill()
            time.sleep(poll_s)
        wall = time.perf_counter() - t0
        p.returncode = os.waitstatus_to_exitcode(status)
        log.seek(0)
        tail = log.read()[-4000:].decode(errors="replace")
    maxrss = int(rusage.ru_maxrss) * 1024  # KiB on Linux
    cpu = float(rusage.ru_utime + rusage.ru_stime)
    # ru_maxrss of a fork+exec'd child also counts the parent's pages at fork time: recorded, not used
    return Measurement(wall, max(peak, sum(hwm.values())), peak, peak_anon, maxrss, cpu, p.returncode, tail)


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    return libc


def resident_bytes(paths: list[Path]) -> tuple[int, int]:
    """(bytes in the page cache, total bytes) over `paths`, by mincore(2) on a read-only mapping."""
    libc = _libc()
    page = mmap.PAGESIZE
    resident = total = 0
    for path in paths:
        size = path.stat().st_size
        if size == 0:
            continue
        total += size
        fd = os.open(path, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                continue
            try:
                n = (size + page - 1) // page
                vec = (ctypes.c_ubyte * n)()
                if libc.mincore(addr, size, vec) == 0:
                    resident += min(size, sum(b & 1 for b in bytes(vec)) * page)
            finally:
                libc.munmap(addr, size)
        finally:
            os.close(fd)
    return resident, total


def files_under(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def dir_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in files_under(root))


def row_figures(row: dict[str, Any], gbs: float, cp_wall_s: float) -> dict[str, Any]:
    """One measured row (`bench.measure_rounds`' medians) as a peer section prints it: wall and CPU seconds, both
    per GB of the input (`gbs` GB), the wall time as a multiple of cp's in the same rounds, peak RSS, each run."""
    return {"wall_s": row["wall_s"], "cpu_s": row["cpu_s"], "wall_s_per_gb": row["wall_s"] / gbs,
            "cpu_s_per_gb": row["cpu_s"] / gbs, "x_cp": row["wall_s"] / cp_wall_s, "peak_rss": row["peak_rss"],
            "runs": [(m["wall_s"], m["cpu_s"]) for m in row["runs"]]}
