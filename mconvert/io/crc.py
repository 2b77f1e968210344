"""The CRC-32 check of input zips (torch.save files): each stored entry checked against the CRC torch.save
wrote, on the bytes the conversion reads anyway where it can (`ZipRecords`), the rest deferred to one
background thread during a conversion (`deferred_crc_checks`) and finished before its output commits."""

from __future__ import annotations

import functools
import os
import struct
import sys
import threading
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


from mconvert.io.hashing import FollowedDigest, crc32
from mconvert.io.world import world_from_env
from mconvert.errors import MConvertError


_CRC_CHECKED: set[tuple[str, int, int]] = set()


class ZipRecords:
    """The stored entries of one input zip, each checked against the CRC-32 torch.save stored for it — on the
    bytes the conversion reads anyway where it can, so no byte is read twice.

    A reader that indexes the file (`TensorIndex`) `claim`s the records it will read whole; `saw` takes the
    CRC-32 of each read as it lands in memory, chained over consecutive reads of one record, and compares at
    the record's end. The background thread checks every record nobody claimed (optimizer states, rng, the
    pickle) once the file is claimed or released; `check_claimed` checks, before the commit, the claimed
    records the conversion did not read whole (units another torchrun rank converts, strided reads)."""

    def __init__(self, path: Path, key: tuple[str, int, int], entries: dict[int, tuple[int, int, str]]) -> None:
        self.path, self.key = path, key
        self.entries = entries  # data offset -> (bytes, stored CRC-32, entry name)
        self.claimed: set[int] = set()
        self.done: set[int] = set()
        self._next: dict[int, tuple[int, int]] = {}  # file offset a record's next read starts at -> (record, crc)
        self._lock = threading.Lock()
        self.released = threading.Event()
        # which unclaimed records the background check still takes, read before each record and block:
        # "all"; "read" once a conversion failed on its input (`DeferredCRC.cancel`); "none" once it is dropped
        self.scope = "all"

    @classmethod
    def parse(cls, path: Path) -> "ZipRecords | None":
        """The stored, CRC-carrying entries of `path` with their data offsets; None when there is nothing to
        check (MCONVERT_SKIP_CRC, already checked, empty) or the structure is in doubt (the whole-file check
        then reports it, as before)."""
        if os.environ.get("MCONVERT_SKIP_CRC"):
            return None
        try:
            st = path.stat()
            key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
            if key in _CRC_CHECKED or st.st_size == 0:
                return None
            entries: dict[int, tuple[int, int, str]] = {}
            with open(path, "rb") as f:
                fd = f.fileno()
                for info in zipfile.ZipFile(f).infolist():
                    if not info.CRC or info.compress_type != zipfile.ZIP_STORED:
                        continue
                    head = os.pread(fd, 30, info.header_offset)
                    if len(head) < 30 or head[:4] != b"PK\x03\x04":
                        return None
                    n, m = struct.unpack("<HH", head[26:30])
                    start = info.header_offset + 30 + n + m
                    if start + info.compress_size > st.st_size or start in entries:
                        return None
                    entries[start] = (info.compress_size, info.CRC, info.filename)
        except (OSError, zipfile.BadZipFile, ValueError, struct.error):
            return None
        return cls(path, key, entries)

    def claim(self, offsets: Any) -> None:
        """The records at these data offsets will be read whole by the conversion: their CRC-32 is taken
        then (`saw`), not by a second pass. Releases the background check of the rest."""
        with self._lock:
            self.claimed.update(o for o in offsets if o in self.entries)
        self.released.set()

    def saw(self, pos: int, data: memoryview) -> None:
        """Bytes [pos, pos + len(data)) of the file were just read: extend the CRC-32 of the record they
        continue (or start); at its end compare with the stored one — a mismatch is the CRC refusal."""
        with self._lock:
            if pos in self._next:
                start, crc = self._next.pop(pos)
            elif pos in self.claimed and pos not in self.done:
                start, crc = pos, 0
            else:
                return
        size, want, name = self.entries[start]
        n = min(len(data), start + size - pos)
        crc = crc32(data[:n], crc)
        with self._lock:
            if pos + n < start + size:
                self._next[pos + n] = (start, crc)
                return
            if crc == want:
                self.done.add(start)
                return
        raise _crc_refusal(self.path, name)

    def _check(self, starts: list[int]) -> None:
        if starts:
            self._check_records(starts)
        if len(self.done) == len(self.entries):
            _CRC_CHECKED.add(self.key)

    def _check_records(self, starts: list[int]) -> None:
        # one buffer, no larger than the largest record, and not a mapping: mapped pages would stay resident
        chunk = memoryview(bytearray(min(8 << 20, max(self.entries[s][0] for s in starts))))
        with open(self.path, "rb", buffering=0) as f:
            for start in starts:
                size, want, name = self.entries[start]
                crc, pos, left = 0, start, size
                while left:
                    if not self.wanted(start):
                        break  # cancelled meanwhile: the record is not this check's any more
                    k = os.preadv(f.fileno(), [chunk[: min(left, len(chunk))]], pos)
                    if k <= 0:
                        raise MConvertError(f"{self.path}: damaged zip structure ({name} runs past the end of the "
                                            "file); the file is corrupt — re-copy it")
                    crc = crc32(chunk[:k], crc)
                    pos, left = pos + k, left - k
                if left:
                    continue
                if crc != want:
                    raise _crc_refusal(self.path, name)
                with self._lock:
                    self.done.add(start)

    def wanted(self, start: int) -> bool:
        """Whether the record at data offset `start` is still to be checked in the current `scope`. "read": the
        records the failed conversion can have read — every record of a file no reader indexed (loaded whole),
        only the non-tensor records (the pickle) of one it did: a reader takes the tensors it reads by claim,
        checked as they are read, so an unclaimed tensor record there was never read."""
        if self.scope == "all":
            return True
        if self.scope == "none":
            return False
        return not self.claimed or not _tensor_record(self.entries[start][2])

    def check_unclaimed(self, _path: Any = None) -> None:
        """(background thread) Once the file is claimed or released, check every record nobody claimed."""
        self.released.wait()
        with self._lock:
            todo = sorted(o for o in self.entries if o not in self.claimed and o not in self.done)
        self._check(todo)

    def check_claimed(self) -> None:
        """Check the claimed records the conversion did not read whole (before the commit)."""
        with self._lock:
            todo = sorted(o for o in self.claimed if o not in self.done)
        self._check(todo)


def _tensor_record(name: str) -> bool:
    """Whether zip entry `name` of a torch.save file holds a storage's bytes (`<archive>/data/<key>`)."""
    parts = name.split("/")
    return len(parts) == 3 and parts[1] == "data"


def _crc_refusal(path: Path, name: str) -> MConvertError:
    return MConvertError(f"{path}: entry {name} fails the CRC-32 check torch.save stored for it; the file is "
                         "corrupt — re-copy it")


class DeferredCRC:
    """While active (`deferred_crc_checks()`), `verify_zip_crc` runs on one background thread instead of the
    caller's: a conversion reads and converts while the CRC-32 pass over its input runs on another core, and
    records the conversion reads anyway are checked on those bytes (`ZipRecords`).
    `wait()` — called before the output is committed — raises the first failure; a conversion that failed
    meanwhile reports the CRC failure instead of its own error, since corrupt bytes explain the rest."""

    def __init__(self) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self._pool = ThreadPoolExecutor(1, thread_name_prefix="crc32")
        self._futures: list[Any] = []
        self.records: dict[tuple[str, int, int], ZipRecords] = {}
        self.followed: dict[str, tuple[FollowedDigest, Callable[[str], MConvertError]]] = {}
        self._queued: set[str] = set()  # followed files handed to the background thread whole
        self._dropped = False  # cancelled: a followed file's whole pass not started yet is not started

    def follow(self, digest: FollowedDigest, refuse: Callable[[str], MConvertError]) -> bool:
        """Take input file `digest.path`'s manifest digest on the bytes the conversion reads (`followed_digest`);
        `refuse(problem)` is the error when it does not match. False when that file is followed already (the
        caller then checks it whole on the background thread)."""
        key = os.path.realpath(digest.path)
        if key in self.followed:
            return False
        self.followed[key] = (digest, refuse)
        return True

    def _finish(self, key: str) -> None:
        """(background thread) A followed file no reader feeds: its whole digest, unless a reader took it meanwhile."""
        digest, refuse = self.followed[key]
        if not digest.attached and not self._dropped:
            problem = digest.finish()
            if problem is not None:
                raise refuse(problem)

    def finish_followed(self) -> None:
        """Finish every followed digest (the rest of each file from its cursor, two files at a time) and raise
        the first problem."""
        from concurrent.futures import ThreadPoolExecutor

        todo = [(d, refuse) for d, refuse in self.followed.values() if not d.done]
        if not todo:
            return
        with ThreadPoolExecutor(min(2, len(todo)), thread_name_prefix="manifest") as ex:
            problems = list(ex.map(lambda dr: dr[0].finish(), todo))
        for (_, refuse), problem in zip(todo, problems):
            if problem is not None:
                raise refuse(problem)

    def figures(self) -> dict[str, int] | None:
        """How the followed input files were checked: files, bytes, bytes hashed on the conversion's own reads,
        bytes read a second time for the check; None when no input file was followed."""
        if not self.followed:
            return None
        ds = [d for d, _ in self.followed.values()]
        return {"files": len(ds), "bytes": sum(d.size for d in ds), "hashed_as_read": sum(d.on_read for d in ds),
                "read_again": sum(d.again for d in ds)}

    def submit(self, path: Path, check: Any) -> None:
        """Run `check(path)` on the background thread."""
        self._futures.append(self._pool.submit(check, path))

    def add_zip(self, path: Path, unclaimed: bool = True) -> bool:
        """Register input zip `path` for record-wise checks (its unclaimed records on the background thread,
        unless `unclaimed` is False: another torchrun rank checks those); False when it cannot be (the caller
        then checks the whole file)."""
        recs = ZipRecords.parse(path)
        if recs is None:
            return False
        if recs.key not in self.records:
            self.records[recs.key] = recs
            if unclaimed:
                self.submit(path, recs.check_unclaimed)
        return True

    def release(self) -> None:
        """Let every waiting background check run (no more claims are coming); followed input files that no
        reader feeds are hashed whole on the background thread."""
        for recs in self.records.values():
            recs.released.set()
        for key, (digest, _) in list(self.followed.items()):
            if not digest.attached and key not in self._queued:
                self._queued.add(key)
                self._futures.append(self._pool.submit(self._finish, key))

    def wait(self) -> None:
        self.release()
        for f in self._futures:
            f.result()  # re-raises the MConvertError of a failed check
        self._futures.clear()
        self.finish_followed()
        if world_from_env().size > 1:
            return  # the claimed records no rank read whole are checked by rank 0 (`check_unread`)
        for recs in self.records.values():
            recs.check_claimed()

    def tally(self) -> dict[str, dict[str, list[int]]]:
        """Per input zip: the claimed records this process checked on the bytes it read (`done`) and those it
        did not read whole (`left`): what a torchrun rank hands to rank 0."""
        out = {}
        for recs in self.records.values():
            with recs._lock:
                done = sorted(recs.done & recs.claimed)
                left = sorted(o for o in recs.claimed if o not in recs.done)
            out[str(recs.path)] = {"done": done, "left": left}
        return out

    def cancel(self, explain: bool = False) -> None:
        """Nothing will be committed (a dry run, or a conversion that failed): the background checks stop taking
        records — a check still queued or waiting for its release finds nothing to do, a running one stops at
        its next block — and every check is awaited; the first failure among those that ran is raised, since
        corrupt bytes explain the rest. `explain` (the conversion failed on its input): the records it can have
        read are still checked (`ZipRecords.wanted`), and the followed manifest digests finished, so a changed
        input is reported as changed, not as whatever its changed bytes broke.
        Which records are checked depends on what the conversion claimed, never on how far the background
        thread got: every check is released and awaited the same way, whether it had started or not."""
        self._queued.update(self.followed)  # no background pass is started for them now
        self._dropped = True
        for recs in self.records.values():
            recs.scope = "read" if explain else "none"
        self.release()
        futures, self._futures = self._futures, []
        for f in futures:
            f.result()
        if explain:
            self.finish_followed()

    def close(self) -> None:
        self.release()
        self._pool.shutdown(wait=True, cancel_futures=False)


_DEFERRED: DeferredCRC | None = None


@contextmanager
def deferred_crc_checks() -> Iterator[DeferredCRC]:
    """Run the input CRC-32 checks of `safe_load` in the background; the caller must `wait()` before it
    commits anything derived from the input (the driver does, before its output directory is renamed)."""
    global _DEFERRED
    outer, _DEFERRED = _DEFERRED, DeferredCRC()
    d = _DEFERRED
    try:
        yield d
        d.wait()
    except BaseException as e:
        try:
            d.cancel(explain=isinstance(e, MConvertError))  # no wait for the whole input's CRC pass
        except MConvertError as crc:
            raise crc from None
        raise
    finally:
        _DEFERRED = outer
        d.close()
        if outer is None:  # the conversion is over: its idle read buffers go back to the system
            _trim_read_buffers()


def _trim_read_buffers() -> None:
    """The pooled read buffers go back to the system (`buffers.POOL.trim`); a process that never loaded the
    pool (a reader of numpy arrays) holds none."""
    buffers = sys.modules.get("mconvert.io.buffers")
    if buffers is not None:
        buffers.POOL.trim()


@contextmanager
def crc_checks_now() -> Iterator[None]:
    """Inside, `safe_load` checks a file's CRC-32 before it returns instead of deferring it: for a temporary
    file its reader deletes before the conversion commits."""
    global _DEFERRED
    outer, _DEFERRED = _DEFERRED, None
    try:
        yield
    finally:
        _DEFERRED = outer


def start_crc_checks() -> None:
    """The sources are open and have claimed what they read: let the background check of every other record
    start now (a file no reader indexed, e.g. torch_dist's common.pt, would otherwise wait for the commit)."""
    if _DEFERRED is not None:
        _DEFERRED.release()


def wait_crc_checks() -> None:
    """Raise the first failed background CRC-32 check (no-op outside `deferred_crc_checks()`). The units are
    converted by now: the idle read buffers go back to the system before the checks and the commit run."""
    _trim_read_buffers()
    if _DEFERRED is not None:
        _DEFERRED.wait()


def skip_crc_checks() -> None:
    """Nothing derived from the input will be committed (a dry run): drop the checks not started yet."""
    if _DEFERRED is not None:
        _DEFERRED.cancel()


def crc_in_background(fn: Any) -> Any:
    """Decorator: run `fn` inside `deferred_crc_checks()`; `fn` calls `wait_crc_checks()` before it commits."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with deferred_crc_checks():
            return fn(*args, **kwargs)

    return wrapper


def in_conversion() -> bool:
    """Whether input checks can wait for the conversion's background thread: inside `deferred_crc_checks()`,
    on the main thread."""
    return _DEFERRED is not None and threading.current_thread() is threading.main_thread()


def deferred(path: str | Path, check: Any) -> bool:
    """Inside `deferred_crc_checks()` (and on the main thread): queue `check(path)` on its background thread
    and return True; else False (the caller checks now). Under torchrun only the rank that `owns_path` runs
    it: a failure there fails the whole job before anything is committed."""
    if in_conversion():
        w = world_from_env()
        if w.size == 1 or w.owns_path(path):  # under torchrun each input file is checked by one rank
            _DEFERRED.submit(Path(path), check)
        return True
    return False


def verify_zip_crc(path: str | Path) -> None:
    """Check the CRC-32 of every entry now or, inside `deferred_crc_checks()`, record by record: on the bytes
    the conversion reads (`zip_records`) and on the background thread for the rest. Under torchrun every rank
    checks the records it reads, the rank that `owns_path` the records no reader claims, and rank 0 those
    claimed records no rank read whole (`check_unread`): each record is read for its check at most once."""
    if in_conversion():
        w = world_from_env()
        if _DEFERRED.add_zip(Path(path), unclaimed=w.size == 1 or w.owns_path(path)):
            return
        if w.size > 1 and not w.owns_path(path):
            return  # another torchrun rank checks this file whole
    if not deferred(path, _verify_zip_crc_now):
        _verify_zip_crc_now(path)


def crc_tally() -> dict[str, dict[str, list[int]]]:
    """The running conversion's record-wise checks (`DeferredCRC.tally`); {} outside `deferred_crc_checks()`."""
    return _DEFERRED.tally() if _DEFERRED is not None else {}


def check_unread(tallies: list[dict[str, dict[str, list[int]]]]) -> None:
    """(torchrun rank 0, every rank finished) Check the claimed records of each input zip that no rank read
    whole, from every rank's `crc_tally`: a unit's records are checked by the rank that converts it, and only
    strided reads are left."""
    done: dict[str, set[int]] = {}
    left: dict[str, set[int]] = {}
    for tally in tallies:
        for path, t in tally.items():
            done.setdefault(path, set()).update(int(o) for o in t.get("done", []))
            left.setdefault(path, set()).update(int(o) for o in t.get("left", []))
    for path, offsets in sorted(left.items()):
        todo = offsets - done.get(path, set())
        if not todo:
            continue
        recs = ZipRecords.parse(Path(path))
        if recs is None:  # parsed by the ranks that claimed it: changed since, or MCONVERT_SKIP_CRC
            _verify_zip_crc_now(path)
            continue
        recs._check(sorted(o for o in todo if o in recs.entries))


def can_follow() -> bool:
    """Whether input manifests can be checked on the conversion's reads here: inside `deferred_crc_checks()`,
    on the main thread of a single process (torchrun ranks read disjoint parts: none sees a file whole)."""
    return in_conversion() and world_from_env().size == 1


def follow_input(digest: FollowedDigest, refuse: Callable[[str], MConvertError]) -> bool:
    """Where `can_follow()`: check input file `digest.path` against its manifest entry on the bytes the
    conversion reads (`followed_digest`), the rest before the commit; True. False otherwise, or when the file
    is followed already under another name (the caller checks it another way)."""
    return can_follow() and _DEFERRED.follow(digest, refuse)  # type: ignore[union-attr]


def followed_digest(path: str | Path) -> FollowedDigest | None:
    """The manifest digest a reader of input file `path` feeds with the blocks it reads (`FollowedDigest.saw`),
    or None when the file is not followed."""
    if _DEFERRED is None or not _DEFERRED.followed:
        return None
    entry = _DEFERRED.followed.get(os.path.realpath(path))
    if entry is None:
        return None
    entry[0].attached = True
    return entry[0]


def input_check_figures() -> dict[str, int] | None:
    """The running conversion's followed manifest checks (`DeferredCRC.figures`)."""
    return _DEFERRED.figures() if _DEFERRED is not None else None


def zip_records(path: str | Path) -> ZipRecords | None:
    """The record-wise CRC check of input zip `path` in the running conversion (None: none, or it is not
    this process's to check)."""
    if _DEFERRED is None or not _DEFERRED.records:
        return None
    try:
        st = os.stat(path)
        key = (str(Path(path).resolve()), st.st_size, st.st_mtime_ns)
    except OSError:
        return None
    return _DEFERRED.records.get(key)


def _verify_zip_crc_now(path: str | Path) -> None:
    """Check the CRC-32 that torch.save stores for every entry of its zip (torch.load never checks it), so a
    flipped bit inside a tensor's bytes is refused instead of converted. Once per file version per process;
    entries with CRC 0 (saved with torch's crc32 option off) are skipped; MCONVERT_SKIP_CRC=1 skips it all."""
    if os.environ.get("MCONVERT_SKIP_CRC"):
        return
    path = Path(path)
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key in _CRC_CHECKED or st.st_size == 0:
        return
    try:
        with open(path, "rb") as f:
            # read through one 8 MiB buffer, not a mapping of the whole file: mapped pages stay resident
            # until unmapped, and a rank file can be larger than one layer (RSS stays flat in depth)
            fd, size = f.fileno(), os.fstat(f.fileno()).st_size
            chunk = memoryview(bytearray(8 << 20))
            for info in zipfile.ZipFile(f).infolist():
                if not info.CRC or info.compress_type != zipfile.ZIP_STORED:
                    continue
                off = info.header_offset
                head = os.pread(fd, 30, off)
                if head[:4] != b"PK\x03\x04" or len(head) < 30:
                    raise zipfile.BadZipFile(f"no local header for {info.filename}")
                n, m = struct.unpack("<HH", head[26:30])
                start = off + 30 + n + m
                if start + info.compress_size > size:
                    raise zipfile.BadZipFile(f"{info.filename} runs past the end of the file")
                crc, pos, left = 0, start, info.compress_size
                while left:
                    k = os.preadv(fd, [chunk[: min(left, len(chunk))]], pos)
                    if k <= 0:
                        raise zipfile.BadZipFile(f"{info.filename} runs past the end of the file")
                    crc = crc32(chunk[:k], crc)
                    pos, left = pos + k, left - k
                if crc != info.CRC:
                    raise MConvertError(
                        f"{path}: entry {info.filename} fails the CRC-32 check torch.save stored for it; "
                        "the file is corrupt — re-copy it"
                    )
    except (zipfile.BadZipFile, ValueError, struct.error) as e:
        raise MConvertError(f"{path}: damaged zip structure ({short_error(e)}); the file is corrupt — re-copy it") from None
    _CRC_CHECKED.add(key)


def short_error(e: BaseException) -> str:
    """`Type: first sentence of the message` — enough to tell truncation from corruption, on one line."""
    msg = " ".join(str(e).split())
    first = msg.split(". ", 1)[0]
    return f"{type(e).__name__}: {first[:160]}" if first else type(e).__name__
