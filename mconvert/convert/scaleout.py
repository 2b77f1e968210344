"""Conversion on torchrun: each process converts a disjoint set of output files into one shared temporary
directory; rank 0 writes the shared files (index, config, tracker, tokenizer, manifest) and commits.

Under `torchrun` (WORLD_SIZE > 1 in the environment) the conversion verbs split their work by output file:
`owner(i)` is the rank that writes file group `i` (a pipeline stage's rank files for Megatron output, a
safetensors shard for HF output); a rank reads only the units its files need. Outputs are byte-identical to a
one-process run because every rank lays its files out from the same plan, and only the process that owns a
file writes it.

Protocol (shared file system, gloo only to meet and to learn the temporary directory):
1. rank 0 checks OUT and creates the temporary directory (`atomic.atomic_output_dir`), then broadcasts its
   path (or its refusal, which every rank then raises);
2. every rank converts its part into it and leaves a status file there (`.rank-R.status`: ok + the digests it
   computed, the files it wrote and the input records it checked, or its error line); a failing rank exits
   non-zero at once, so torchrun stops the others;
3. rank 0 waits for every status (polling, so SIGTERM from torchrun still removes the directory), checks the
   input records no rank read whole, takes the digests into the manifest, writes the shared files and
   renames the directory to OUT. Any failure leaves no OUT. The waits poll with sleeps, never block in a collective: a signal must interrupt them.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from mconvert.io.atomic import adopt_digests, atomic_output_dir, digests_under, record_digest
from mconvert.io.hashing import hash_file, manifest_hash
from mconvert.io.crc import check_unread, crc_tally
from mconvert.io.world import World, active_world, refuse_torchrun, world, world_from_env
from mconvert.errors import MConvertError

__all__ = ["World", "claim_files", "refuse_torchrun", "shared_atomic_output_dir", "world", "world_from_env"]

_STATUS = ".rank-{}.status"
WAIT_SECONDS = float(os.environ.get("MCONVERT_RANK_WAIT", "86400"))  # the longest a rank's part may take


_CLAIMED: set[str] = set()  # files this process wrote in the conversion in progress (resolved paths)


def claim_files(paths: list[Path]) -> None:
    """Record the files this process wrote (a writer's `close()`): a torchrun rank names them to the committing
    process, which lists every rank's files in the report."""
    _CLAIMED.update(str(Path(p).resolve()) for p in paths)


def _init_group() -> Any:
    """The gloo process group of this torchrun job (created once; MASTER_ADDR/PORT come from torchrun)."""
    import datetime

    import torch.distributed as dist

    if not dist.is_initialized():
        try:
            dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
        except (ValueError, RuntimeError) as e:  # WORLD_SIZE set by hand, without torchrun's other variables
            raise MConvertError(f"WORLD_SIZE={os.environ.get('WORLD_SIZE')}: the processes could not meet "
                                f"({str(e).splitlines()[0][:160]}); start the job with torchrun, or unset "
                                "WORLD_SIZE and RANK") from None
    return dist


def _status_path(tmp: Path, rank: int) -> Path:
    return tmp / _STATUS.format(rank)


def _write_status(tmp: Path, rank: int, status: dict[str, Any]) -> None:
    path = _status_path(tmp, rank)
    part = path.with_name(path.name + ".part")
    part.write_text(json.dumps(status))
    os.replace(part, path)  # rank 0 never reads half a status


def _wait_for_ranks(tmp: Path, w: World, timeout: float) -> tuple[dict[str, int], list[dict[str, Any]]]:
    """Poll until every other rank left its status; raise the first failure; take their digests. Returns the
    files the other ranks wrote (path relative to `tmp` -> rank) and their input checks (`crc_tally`)."""
    deadline = time.monotonic() + timeout
    pending = set(range(1, w.size))
    writers: dict[str, int] = {}
    tallies: list[dict[str, Any]] = []
    while pending:
        for r in sorted(pending):
            p = _status_path(tmp, r)
            if not p.is_file():
                continue
            status = json.loads(p.read_text())
            if not status.get("ok"):
                raise MConvertError(f"torchrun rank {r} failed: {status.get('error', 'no reason given')}")
            adopt_digests(status.get("digests", {}))
            writers.update({str(f): r for f in status.get("files", [])})
            tallies.append(status.get("crc", {}))
            p.unlink()
            pending.discard(r)
        if pending:
            if time.monotonic() > deadline:
                raise MConvertError(f"torchrun ranks {sorted(pending)} did not finish within {timeout:.0f} s; "
                                    "nothing was written (raise MCONVERT_RANK_WAIT for longer parts)")
            time.sleep(0.05)
    return writers, tallies


@contextmanager
def shared_atomic_output_dir(out: str | Path, force: bool = False,
                             inputs: tuple[str | Path | None, ...] = (),
                             check: Callable[[Path], None] | None = None,
                             written: Callable[[Path, dict[str, int]], None] | None = None) -> Iterator[Path]:
    """`atomic.atomic_output_dir` for one process, or shared by every torchrun process of the job: yields the
    temporary directory all ranks write into; only rank 0 commits it, after every rank reported success.
    `check(tmp)`: run by the committing process on the whole output once every part is written, before the
    commit (a check of what was written that needs every rank's files); raising it leaves no output.
    `written(tmp, ranks)`: run by the committing process after `check`, with the rank that wrote each file
    (path relative to `tmp`; files of no other rank are rank 0's; {} in one process), to list the output."""
    w = world_from_env()
    if w.size == 1:
        with atomic_output_dir(out, force, inputs=inputs) as tmp:
            yield tmp
            if check is not None:
                check(tmp)
            if written is not None:
                written(tmp, {})
        return
    dist = _init_group()
    with active_world(w):
        if w.primary:
            yield from _primary(out, force, inputs, w, dist, check, written)
        else:
            yield from _secondary(w, dist)


def _primary(out: str | Path, force: bool, inputs: tuple, w: World, dist: Any,
             check: Callable[[Path], None] | None = None,
             written: Callable[[Path, dict[str, int]], None] | None = None) -> Iterator[Path]:
    try:
        ctx = atomic_output_dir(out, force, inputs=inputs)
        tmp = ctx.__enter__()
    except BaseException as e:
        dist.broadcast_object_list([str(e) or type(e).__name__, False])
        raise
    dist.broadcast_object_list([str(tmp), True])
    try:
        yield tmp
        _CLAIMED.clear()  # rank 0's own files need no naming: every file no other rank names is its
        ranks, tallies = _wait_for_ranks(tmp, w, WAIT_SECONDS)
        check_unread([crc_tally(), *tallies])  # input records no rank read whole, before anything commits
        if check is not None:
            check(tmp)
        if written is not None:
            written(tmp, ranks)
    except BaseException as e:
        if not ctx.__exit__(type(e), e, e.__traceback__):
            raise
    else:
        ctx.__exit__(None, None, None)


def _secondary(w: World, dist: Any) -> Iterator[Path]:
    got: list[Any] = [None, None]
    dist.broadcast_object_list(got)
    if not got[1]:
        raise MConvertError(f"rank 0 refused the output: {got[0]}")
    tmp = Path(got[0])
    try:
        yield tmp
        _finish_secondary(tmp, w)
    except BaseException as e:
        if not tmp.is_dir():  # rank 0 failed first and removed it: its error is the one to read
            raise MConvertError(f"torchrun rank {w.rank}: rank 0 stopped the job and removed its temporary "
                                "directory; rank 0's error says why") from None
        try:
            _write_status(tmp, w.rank, {"ok": False, "error": str(e) or type(e).__name__})
        except OSError:  # removed meanwhile
            pass
        raise


def _finish_secondary(tmp: Path, w: World) -> None:
    """Hash this rank's out-of-order files and leave its success status for rank 0."""
    top = Path(tmp).resolve()
    mine = {p for p in _CLAIMED if p.startswith(str(top) + os.sep)}
    _CLAIMED.difference_update(mine)
    known = digests_under(tmp)
    for p in sorted(mine - set(known)):  # a file written out of order has no streamed digest: hashed here, in
        if os.path.isfile(p):  # parallel with the other ranks, not by rank 0 alone
            record_digest(p, hash_file(p, manifest_hash(), mapped=True))
    digests = digests_under(tmp)
    files = sorted(str(Path(p).relative_to(top)) for p in mine | set(digests))
    _write_status(tmp, w.rank, {"ok": True, "digests": digests, "files": files, "crc": crc_tally()})
