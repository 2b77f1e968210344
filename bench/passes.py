"""The cost of each pass a conversion makes over its bytes, on this machine, against a plain memory copy.

Every pass runs over the same 64 MiB (fp32 and bf16 matrices of 4096 × 4096 / 4096 × 8192), into reused
destinations, single-threaded (BLAKE3 too: the writers hash on their own thread); the median of `--repeats`
timings. Two rows are disk writes of those bytes with O_DIRECT, one chunk (`io.hashing.CHUNK`) at a time,
from a chunk on 4 KiB pages and from the writers' own staging chunk (on huge pages where the kernel gives them):
the same bytes, in fewer and larger disk requests from the latter (a file beside this script, on the disk the
bench writes to; left out where the file system refuses O_DIRECT). A conversion's figure per GB is roughly the sum of the passes its bytes take plus the
disk's write time (cp's row in `make bench`). Called by `bench.py`; on its own:

    .venv/bin/python bench/passes.py            # a table
    .venv/bin/python bench/passes.py --json     # the figures
"""

from __future__ import annotations

import argparse
import hashlib
import json
import mmap
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

SIZE = 64 << 20


def timed(fn: Callable[[], Any], repeats: int) -> float:
    """Median seconds of `fn()` after one warm-up call."""
    fn()
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def measure(repeats: int = 5) -> list[dict[str, Any]]:
    import numpy
    import torch

    from mconvert.io.hashing import CHUNK, _give_chunk, _take_chunk, crc32, new_hasher
    from mconvert.io.casts import all_finite
    from mconvert.io.transpose import copy_transposed

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    f32 = torch.randn(4096, 4096, generator=gen)
    b16 = torch.randn(4096, 8192, generator=gen).to(torch.bfloat16)
    src = f32.reshape(-1).view(torch.uint8).numpy()
    dst = numpy.empty_like(src)
    t32, t16 = torch.empty(4096, 4096), torch.empty(8192, 4096, dtype=torch.bfloat16)
    mv = memoryview(src)

    def blake3() -> None:
        h = new_hasher("blake3", threads=False)
        h.update(mv)
        h.digest()

    def fresh() -> None:
        numpy.copyto(numpy.empty_like(src), src)

    kept: list[mmap.mmap] = []

    def first_touch() -> None:  # a new mapping each call, kept: its pages are new to the process, never reused
        m = mmap.mmap(-1, SIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        numpy.copyto(numpy.frombuffer(m, numpy.uint8), src)
        kept.append(m)

    small = mmap.mmap(-1, CHUNK, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # 4 KiB pages: no advice
    staging = _take_chunk(CHUNK)
    for b in (small, staging):
        b[:] = src[:CHUNK].tobytes()

    with tempfile.TemporaryDirectory(prefix="mconvert-passes-", dir=HERE) as d:
        path = os.path.join(d, "bytes")
        with open(path, "wb") as f:
            f.write(mv)
        fd = os.open(path, os.O_RDONLY)

        def direct_write(buf: Any) -> Callable[[], None]:
            def run() -> None:
                out = os.open(os.path.join(d, "direct"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT)
                try:
                    for at in range(0, SIZE, CHUNK):
                        os.pwrite(out, buf, at)
                finally:
                    os.close(out)
            return run

        try:
            direct = [("O_DIRECT write from 4 KiB pages (disk)", direct_write(small)),
                      ("O_DIRECT write from the writers' staging (disk)", direct_write(staging))]
            try:
                direct[0][1]()
            except (OSError, AttributeError):  # no O_DIRECT here (tmpfs, some FUSE; not Linux)
                direct = []
            passes = [
                ("memory copy into a reused buffer (baseline)", lambda: numpy.copyto(dst, src)),
                ("memory copy into fresh pages", fresh),
                ("memory copy into pages new to the process", first_touch),
                ("pread from the page cache into a reused buffer", lambda: os.preadv(fd, [memoryview(dst)], 0)),
                ("CRC-32 (zip records, input check)", lambda: crc32(mv)),
                ("finite check (NaN/Inf)", lambda: all_finite(f32)),
                ("BLAKE3 (manifest)", blake3),
                ("sha256 (manifest, --manifest-hash sha256)", lambda: hashlib.sha256(mv).digest()),
                ("transpose fp32 (Conv1D, FasterTransformer)", lambda: copy_transposed(f32, out=t32)),
                ("transpose bf16 (Conv1D, FasterTransformer)", lambda: copy_transposed(b16, out=t16)),
                *direct,
            ]
            rows = [(name, timed(fn, repeats)) for name, fn in passes]
        finally:
            os.close(fd)
            for m in kept:
                m.close()
            small.close()
            _give_chunk(staging)
    base = rows[0][1]
    return [{"pass": name, "s_per_gb": s / SIZE * 1e9, "x_copy": s / base} for name, s in rows]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5, help="timings per pass (median)")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    a = ap.parse_args(argv)
    rows = measure(a.repeats)
    if a.json:
        print(json.dumps(rows, indent=1))
        return 0
    for r in rows:
        print(f"{r['pass']:50s} {r['s_per_gb']:6.3f} s/GB {r['x_copy']:6.1f} × copy")
    return 0


if __name__ == "__main__":
    sys.exit(main())
