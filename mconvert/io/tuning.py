"""Process-wide tuning for a conversion run: huge pages, a heap that returns freed buffers, a core left to the
writer thread, a quiet cyclic collector.

These change the whole process, so the library never applies them itself: importing mconvert or calling a
library function leaves threads, the heap, the collector and the environment as they were. The CLI entry
point (`cli.main` and its conversion verbs) and `bench/` (through the CLI) apply them; an embedding program
may call `apply()` when it wants the same behaviour.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import mmap
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

THP_ENV = "THP_MEM_ALLOC_ENABLE"
M_MMAP_THRESHOLD = -3  # glibc mallopt parameter
_resume_gc = False  # the collector was on when `start_up` paused it: `quiet_gc` turns it back on


@contextmanager
def start_up() -> Iterator[None]:
    """The cyclic collector paused while a CLI verb starts: importing torch and the engine creates a few hundred
    thousand objects, and the collections that triggers would walk the growing import graph over and over, a
    sizeable part of the start-up. `quiet_gc` (run once the engine is imported) resumes it; leaving the block
    resumes it in any case, as it was."""
    global _resume_gc
    was = _resume_gc = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        _resume_gc = False
        if was:
            gc.enable()


_huge_by_default = False  # `huge_pages` set the variable (the user had not)


def host_takes_back_huge_pages(sys_root: Path = Path("/sys")) -> bool:
    """Whether this machine is a VM whose balloon reports the guest's free memory to the host (virtio-balloon
    free page reporting: feature bit 5 of the balloon device, id 5) in blocks no larger than a transparent huge
    page (`page_reporting_order`). Then every free block a huge page could take has gone back to the host, and
    a fresh huge page's first touch costs a host-side fault for each 4 KiB page it spans, where 4 KiB pages
    come mostly from blocks the guest still holds. False where any of it cannot be read."""
    try:
        order = int((sys_root / "module/page_reporting/parameters/page_reporting_order").read_text())
        huge = int((sys_root / "kernel/mm/transparent_hugepage/hpage_pmd_size").read_text())
    except (OSError, ValueError):
        return False
    if (mmap.PAGESIZE << order) > huge:  # only blocks larger than a huge page go back to the host
        return False
    for dev in sorted((sys_root / "bus/virtio/devices").glob("*")):
        try:
            if int((dev / "device").read_text(), 16) == 5 and (dev / "features").read_text()[5:6] == "1":
                return True
        except (OSError, ValueError):
            continue
    return False


def huge_pages() -> None:
    """Have torch place tensors of 2 MB and more on transparent huge pages: a conversion allocates and frees
    buffers of the size of a layer's shards, and with 4 KiB pages every fresh buffer costs a page fault per
    4 KiB (on a VM a host-side fault too). Not on a VM whose host takes back free huge-page blocks
    (`host_takes_back_huge_pages`), where a fresh huge page costs more than its 4 KiB pages do. torch reads
    the variable at its first allocation, so this runs before any tensor is made; a user's own setting wins."""
    global _huge_by_default
    if THP_ENV not in os.environ and not host_takes_back_huge_pages():
        os.environ[THP_ENV] = "1"
        _huge_by_default = True


def no_huge_pages() -> None:
    """Take back `huge_pages`' default (a user's own setting stays): for a verb that runs without torch, whose
    only large buffers are the pool's (`io.buffers`), which follow the variable. A huge page's first touch
    zeroes 2 MB at once, and on a VM whose balloon has returned the guest's free huge pages to the host
    (free page reporting) it costs 512 host-side faults: an order of magnitude more than the same fresh memory
    on 4 KiB pages. Reused memory costs neither, and the pool reuses most of it."""
    global _huge_by_default
    if _huge_by_default:
        os.environ.pop(THP_ENV, None)
        _huge_by_default = False


BLAS_THREADS_ENV = "OPENBLAS_NUM_THREADS"


def one_blas_thread() -> None:
    """Have numpy's OpenBLAS start no threads of its own: at import it starts one per core, which spin-wait for
    work for a while before they sleep, CPU a verb that makes no BLAS call (HF to GGUF: casts, permutes and
    quantizes elementwise) pays for nothing. OpenBLAS reads the variable when numpy is first imported, so this
    runs before the verb's engine is; a user's own setting wins."""
    os.environ.setdefault(BLAS_THREADS_ENV, "1")


def bound_heap(threshold: int = 128 << 10) -> None:
    """Have glibc serve every allocation above `threshold` with its own mmap and give it back on free, so the
    resident set follows the live tensors (one unit) instead of the heap's high-water mark (glibc's adaptive
    threshold keeps freed blocks up to 32 MB in the heap). No-op off glibc."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(M_MMAP_THRESHOLD, int(threshold))
    except (OSError, AttributeError):
        pass


def process_cores() -> int:
    """The cores this process may use: those it is allowed to run on, shared evenly among the processes of
    one torchrun job on this machine (LOCAL_WORLD_SIZE), at least 1."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    try:
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local = 1
    return max(1, cores // local)


def reserve_writer_core() -> None:
    """Leave one core to the writer/hash thread: torch's intra-op pool at (cores - 1), at least 1. With as many
    OpenMP threads as cores, every parallel op (aminmax, cat, transposes) stalls at its barrier while the
    writer thread holds a core. A verb whose engine runs without torch (HF to GGUF) has no pool to size."""
    torch = sys.modules.get("torch")  # the verb's engine has loaded it by now, where it uses it
    if torch is None:
        return
    want = max(1, process_cores() - 1)
    if torch.get_num_threads() > want:
        torch.set_num_threads(want)


def quiet_gc() -> None:
    """Move everything alive now (imported modules, torch's objects) out of the cyclic collector's reach and
    collect young objects less often: a conversion creates few cycles but many objects (unpickled args, key
    maps), and each full collection would re-walk the whole import graph. The process's first freeze runs no
    collection first: in the command's process it comes right after the imports, where a collection would walk
    that graph once more for the few cycles an import leaves; a later freeze (a program that runs verbs
    in-process) collects first, so its garbage since then is not frozen. Memory is unaffected: reference
    counting frees tensors as before. Resumes the collector `start_up` paused."""
    global _resume_gc
    if gc.get_freeze_count():
        gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 50, 1000)
    if _resume_gc:
        _resume_gc = False
        gc.enable()


def apply(with_torch: bool = True) -> None:
    """Everything a conversion verb wants: called once, after the verb's modules are imported (so `quiet_gc`
    freezes them too) and before its first tensor. `with_torch`: the verb's engine computes in torch, imported
    here where the verbs' module left it to first use; False for a verb that runs without it (HF to GGUF)."""
    if with_torch:
        import torch  # noqa: F401 - imported before the freeze, its thread pool sized below
        huge_pages()
    else:
        no_huge_pages()
    bound_heap()
    reserve_writer_core()
    quiet_gc()
