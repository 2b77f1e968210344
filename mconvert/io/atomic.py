"""Atomic output directories and the integrity manifest.

Every verb writes into a hidden temporary sibling of OUT and renames it into place at the very end,
so a run killed at any point (SIGKILL included) leaves no OUT, and `--force` replaces an existing OUT
only at that final rename; without `--force` that rename never replaces anything (RENAME_NOREPLACE).
SIGTERM and SIGHUP remove the temporary directory as SIGINT does. An OUT that is, contains or lies inside
an input is refused before anything is read. The manifest lists the digest of every file written
(BLAKE3 by default, sha256 with --manifest-hash sha256) and names its algorithm.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import re
import shutil
import signal
import stat
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from mconvert.io.hashing import (MANIFEST_HASHES, FollowedDigest, check_hash_name, hash_file,
                                         manifest_hash)
from mconvert.io.paths import TMP_TAG
from mconvert.errors import MConvertError

MANIFEST = "mconvert-manifest.json"


def check_output(out: str | Path, force: bool, inputs: tuple[str | Path | None, ...] = ()) -> Path:
    """Refuse an OUT that is, contains or lies inside one of `inputs` (with or without --force: the rename or
    the removal of the old OUT would destroy the input), an existing OUT without --force and an unwritable
    parent, before any work is done."""
    from mconvert.io.paths import overlap

    out = Path(out)
    for inp in inputs:
        how = overlap(out, inp) if inp is not None else None
        if how is not None:
            raise MConvertError(f"{out}: the output {how} the input {inp}; choose an output path outside every "
                                "input (--force never replaces an input)")
    # lexists: a dangling symlink at OUT is an existing entry too; the final rename refuses it, after the work
    if os.path.lexists(out) and not force:
        raise MConvertError(f"{out}: output already exists; pass --force to replace it")
    parent = out.absolute().parent
    probe = parent
    while not probe.exists():
        probe = probe.parent
    if not os.access(probe, os.W_OK):  # the OS's reason is kept: a read-only mount is fixed differently
        code = errno.EROFS if os.statvfs(probe).f_flag & os.ST_RDONLY else errno.EACCES
        raise MConvertError(f"{out}: cannot write to {probe} ({os.strerror(code)}); choose another output path")
    return out


def tmp_name(name: str, pid: int | None = None, old: bool = False, gone: bool = False) -> str:
    """The hidden sibling a run with `pid` writes OUT `name` into (`old`: where --force parks the previous OUT;
    `gone`: where a failed run moves its temporary directory to remove it)."""
    kind = "old-" if old else "gone-" if gone else ""
    return f".{name}{TMP_TAG}{kind}{os.getpid() if pid is None else pid}"


def _leftovers(parent: Path, name: str) -> list[tuple[Path, int, bool]]:
    """(path, pid, old?) of every entry in `parent` named exactly as `tmp_name(name, pid[, old|gone])` names it:
    a directory, or a file or symlink that `--force` swapped out of OUT (a link is never followed)."""
    pat = re.compile(re.escape(f".{name}{TMP_TAG}") + r"(old-|gone-)?([1-9][0-9]{0,9})")
    found = []
    try:
        entries = sorted(os.listdir(parent))
    except OSError:
        return []
    for entry in entries:
        m = pat.fullmatch(entry)
        if m:
            found.append((parent / entry, int(m.group(2)), m.group(1) == "old-"))
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def _clean_stale(parent: Path, name: str) -> None:
    """Remove temporary siblings left by killed runs whose process is gone.

    A run killed between the two renames of a non-atomic replace leaves OUT missing and the previous
    OUT parked as `.OUT.mconvert-tmp-old-PID`: that one is put back, not deleted."""
    out = parent / name
    for p, pid, old in _leftovers(parent, name):
        if _alive(pid):
            continue
        if old and not os.path.lexists(out):
            os.rename(p, out)
        else:
            remove_entry(p)


def remove_entry(p: Path | None) -> None:
    """Remove `p` whatever it is, never following a link: a symlink or a file is unlinked, a real directory is
    removed with everything in it (None: nothing to remove)."""
    if p is None:
        return
    try:
        if stat.S_ISDIR(os.lstat(p).st_mode):
            shutil.rmtree(p, ignore_errors=True)
        else:
            os.unlink(p)
    except OSError:  # gone already, or not ours to remove
        pass


_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2


def _renameat2(a: Path, b: Path, flags: int) -> bool:
    """Linux renameat2(a, b, flags); False where the call or the flag is unsupported (other OS, old kernel,
    file system without it); OSError when it ran and failed."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd = -100
    if fn(at_fdcwd, os.fsencode(str(a)), at_fdcwd, os.fsencode(str(b)), flags) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (RENAME_EXCHANGE); False where unsupported."""
    return _renameat2(a, b, _RENAME_EXCHANGE)


def _appeared(out: Path) -> MConvertError:
    return MConvertError(f"{out}: appeared while this run was in progress and was left untouched; nothing was "
                         "written — remove it or pass --force, then run again")


def rename_noreplace(tmp: Path, out: Path) -> None:
    """Rename `tmp` to `out` only if nothing is at `out`: RENAME_NOREPLACE, else claim `out` with an exclusive
    mkdir and rename over that empty directory (a rename onto a directory someone filled meanwhile fails)."""
    try:
        if _renameat2(tmp, out, _RENAME_NOREPLACE):
            return
    except FileExistsError:
        raise _appeared(out) from None
    if not os.path.isdir(tmp):  # a file: a hard link never replaces anything either
        try:
            os.link(tmp, out)
        except FileExistsError:
            raise _appeared(out) from None
        os.unlink(tmp)
        return
    try:
        os.mkdir(out, 0o700)
    except FileExistsError:
        raise _appeared(out) from None
    try:
        os.rename(tmp, out)
    except OSError as e:
        if e.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
            raise _appeared(out) from None  # filled by someone else meanwhile: theirs now
        try:
            os.rmdir(out)  # the empty directory claimed above, unless someone filled it
        except OSError:
            pass
        raise


def _replace(tmp: Path, out: Path) -> None:
    """Move the finished `tmp` to `out`; an existing `out` is replaced in one atomic step where the OS allows and
    removed whatever it is (a symlink is removed, never followed)."""
    remove_entry(_swap_in(tmp, out))


def _swap_in(new: Path, dst: Path, park: Path | None = None) -> Path | None:
    """Put `new` at `dst`; an existing `dst` is swapped out in one atomic step where the OS allows, else first
    moved to `park` (default: the hidden sibling `_clean_stale` puts back). Returns where the previous `dst`
    now lies (None when there was none), for `remove_entry` or `_swap_back`."""
    if not os.path.lexists(dst):
        os.rename(new, dst)
        return None
    if _exchange(new, dst):  # dst is now the new entry, `new` holds the old one
        return new
    old = park or dst.parent / tmp_name(dst.name, old=True)
    os.rename(dst, old)  # a kill right here is repaired by _clean_stale on the next run
    os.rename(new, dst)
    return old


def _swap_back(new: Path, dst: Path, old: Path | None) -> None:
    """Undo `_swap_in(new, dst)`: the entry goes back to `new` and the previous `dst` (if any) returns."""
    if old == new:
        if _exchange(new, dst):
            return
        parked = new.with_name(f"old-{new.name}")
        os.rename(new, parked)
        old = parked
    os.rename(dst, new)
    if old is not None:
        os.rename(old, dst)


class _Terminated(SystemExit):
    """SIGTERM / SIGHUP as an exception, so the temporary directory is removed as for Ctrl-C; its code is
    128 + the signal number, the exit status a shell reports for a process the signal ended."""


_FINALIZER_CODE = weakref.finalize.__call__.__code__


def _raise_terminated(signum: int, frame: Any) -> None:
    """The handler: raise `_Terminated` where the main thread is, except inside a weakref finalizer (a pool
    buffer returned, a file descriptor closed), where Python prints and drops any exception: there the signal is
    sent again a moment later from another thread, to be handled once the finalizer has returned (raising it from
    here would run this handler again at once, still inside the finalizer)."""
    f = frame
    while f is not None:
        if f.f_code is _FINALIZER_CODE:
            threading.Timer(0.01, os.kill, (os.getpid(), signum)).start()
            return
        f = f.f_back
    raise _Terminated(128 + signum)


@contextmanager
def terminating() -> Iterator[None]:
    """SIGTERM and SIGHUP raise `_Terminated` inside the block (main thread only: elsewhere Python cannot set
    handlers); the previous handlers are restored after it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    sigs = [s for s in (getattr(signal, "SIGTERM", None), getattr(signal, "SIGHUP", None)) if s is not None]
    before = {s: signal.getsignal(s) for s in sigs}
    for s in sigs:
        if before[s] in (signal.SIG_DFL, None):  # an ignored signal (nohup) or the caller's own handler stays
            signal.signal(s, _raise_terminated)
    try:
        yield
    finally:
        for s, h in before.items():
            if h is not None:
                signal.signal(s, h)


@contextmanager
def atomic_output_dir(out: str | Path, force: bool = False, manifest: bool = True,
                      inputs: tuple[str | Path | None, ...] = ()) -> Iterator[Path]:
    """Yield a temporary directory; on success write the manifest and rename it to `out`.

    Killed at any point, no OUT appears (or, with --force, the old OUT stays whole); SIGTERM, SIGHUP and
    SIGINT remove the temporary directory; the next run into the same OUT removes a SIGKILLed run's. Without
    `force` an OUT that appears meanwhile is never replaced. Write failures (disk full, file-size limit,
    read-only or permission) become one MConvertError line."""
    out = check_output(out, force, inputs)
    with terminating():
        parent, tmp, created = _fresh_tmp(out)
        yield from _commit(tmp, out, parent, force, manifest, created)


def _make_tmp(tmp: Path, out: Path) -> None:
    """Create the temporary directory. Called first inside the block that removes it on any exception, so a
    signal that lands right after the mkdir (before any later line) still removes it."""
    try:
        tmp.mkdir()
    except OSError as e:
        raise _os_error(e, out) from None


def _fresh_tmp(out: Path) -> tuple[Path, Path, list[Path]]:
    """OUT's parent, the name of its temporary sibling directory (a SIGKILLed earlier run's leftovers removed;
    the caller makes it with `_make_tmp` inside the block that removes it) and the directories above OUT that
    this call created (deepest first, for `_remove_parents` after a failure)."""
    parent = out.absolute().parent
    created: list[Path] = []
    try:
        _make_parents(parent, created)
        _clean_stale(parent, out.name)
        tmp = parent / tmp_name(out.name)
        remove_entry(tmp)
    except OSError as e:
        _remove_parents(created)
        raise _os_error(e, out) from None
    return parent, tmp, created


def _make_parents(parent: Path, created: list[Path]) -> None:
    """`mkdir -p parent`, recording in `created` (deepest first) each directory this call made; one that someone
    else made meanwhile is not recorded."""
    missing = []
    probe = parent
    while not os.path.isdir(probe):
        missing.append(probe)
        probe = probe.parent
    for d in reversed(missing):
        try:
            os.mkdir(d)
        except FileExistsError:
            if os.path.isdir(d):
                continue
            raise
        created.insert(0, d)


def _remove_parents(created: list[Path]) -> None:
    """Remove the directories `_make_parents` created (deepest first), each only while it is still empty."""
    for d in created:
        try:
            os.rmdir(d)
        except FileNotFoundError:
            continue
        except OSError:  # someone else's files arrived meanwhile: it and the directories above it stay
            return


def _commit(tmp: Path, out: Path, parent: Path, force: bool, manifest: bool,
            created: list[Path] | None = None) -> Iterator[Path]:
    """The body of `atomic_output_dir` after the temporary directory exists (`created`: the parents it made)."""
    try:
        _make_tmp(tmp, out)
        yield tmp
        if manifest:
            write_manifest(tmp)
        if force:
            _replace(tmp, out.absolute())
        else:
            rename_noreplace(tmp, out.absolute())
    except BaseException as e:
        discard(tmp, out.name)
        mapped = write_failure(e, out, parent, tmp)
        _remove_parents(created or [])
        if mapped is not None:
            raise mapped from None
        raise


_DISCARD_TRIES = 40  # removals of a failed run's directory, 50 ms apart, while creations under way finish


def discard(tmp: Path, name: str) -> None:
    """Remove a failed run's temporary directory (of OUT `name`). It is renamed away first, so that another
    process still writing into it (a torchrun rank) fails on its next file instead of filling a directory
    being removed; the removal is retried for the few files whose creation was already under way."""
    gone = tmp.with_name(tmp_name(name, gone=True))
    try:
        os.rename(tmp, gone)
    except OSError:
        gone = tmp  # already gone, or the rename is refused: removed where it is
    for _ in range(_DISCARD_TRIES):
        shutil.rmtree(gone, ignore_errors=True)
        if not os.path.lexists(gone):
            return
        time.sleep(0.05)


_WRITE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EACCES, errno.EPERM, errno.EROFS)
_TEXT_ERRNOS = (  # how torch / safetensors / numpy word the same failures without an errno attribute
    ("No space left on device", errno.ENOSPC),
    ("os error 28", errno.ENOSPC),
    ("Disk quota exceeded", errno.EDQUOT),
    ("os error 122", errno.EDQUOT),
    ("File too large", errno.EFBIG),
    ("os error 27", errno.EFBIG),
)
_SHORT_WRITE = ("PytorchStreamWriter", "inline_container", "unexpected pos", "file write failed", "requested and")


def write_failure(e: BaseException, out: Path, where: Path, tmp: Path | None = None) -> MConvertError | None:
    """The one-line error for a failed write of OUT, or None when `e` is not a write failure (a bug: re-raise).

    A file inside the hidden temporary directory is named as it would have been inside OUT."""
    if isinstance(e, MConvertError):
        return None
    if isinstance(e, OSError) and e.errno in _WRITE_ERRNOS:
        name = e.filename
        if tmp is not None and isinstance(name, str) and name.startswith(str(tmp)):
            name = str(out) + name[len(str(tmp)):]
        return _os_error(OSError(e.errno, e.strerror, name), out)
    text = str(e)
    for needle, code in _TEXT_ERRNOS:
        if needle in text:
            return _os_error(OSError(code, os.strerror(code)), out)
    if isinstance(e, (OSError, RuntimeError)) and any(n in text for n in _SHORT_WRITE):
        try:
            free = shutil.disk_usage(where).free
        except OSError:
            free = -1
        if 0 <= free < 1 << 20:
            return _os_error(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), out)
        return MConvertError(
            f"{out}: a write came up short ({text.split(chr(10))[0][:120]}); {free:,} bytes are free there — "
            "check free space and the file-size limit (ulimit -f), then run again"
        )
    return None


def _os_error(e: OSError, out: Path) -> MConvertError:
    where = f" ({e.filename})" if e.filename else ""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return MConvertError(f"{out}: disk full while writing{where}; free space (or choose another output path) "
                             "and run again — nothing was written")
    if e.errno == errno.EFBIG:
        return MConvertError(f"{out}: file too large for this system's file-size limit{where}; raise `ulimit -f` "
                             "or write elsewhere — nothing was written")
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return MConvertError(f"{out}: cannot write{where} ({e.strerror}); choose another output path")
    return MConvertError(f"{out}: {e.strerror or e}{where}")


def sha256_file(path: Path, chunk: int = 16 << 20) -> str:
    """The sha256 hex digest of the file at `path`."""
    return hash_file(path, "sha256", chunk)


# Digests computed by writers while writing (io.hashing.HashingFile): path -> (size, mtime_ns, algorithm, digest).
_KNOWN_DIGESTS: dict[str, tuple[int, int, str, str]] = {}


def record_digest(path: str | Path, digest: str, algorithm: str | None = None) -> None:
    """Register the digest (of `algorithm`, default the manifest's) a writer computed over the bytes it wrote,
    so the manifest need not read the file back; it is used only while the file keeps the size and mtime it
    has now, and only by a manifest of the same algorithm."""
    st = os.stat(path)
    _KNOWN_DIGESTS[str(Path(path).resolve())] = (st.st_size, st.st_mtime_ns, algorithm or manifest_hash(), digest)


def digests_under(root: Path) -> dict[str, tuple[int, int, str, str]]:
    """The digests recorded for files under `root` (path -> size, mtime_ns, algorithm, digest): what one
    torchrun process hands to the process that writes the manifest."""
    top = str(Path(root).resolve()) + os.sep
    return {p: v for p, v in _KNOWN_DIGESTS.items() if p.startswith(top)}


def adopt_digests(entries: dict[str, Any]) -> None:
    """Take digests another process recorded (`digests_under`); each is used only while its file keeps the
    recorded size and mtime."""
    for path, (size, mtime, algorithm, digest) in entries.items():
        _KNOWN_DIGESTS[str(path)] = (int(size), int(mtime), check_hash_name(str(algorithm)), str(digest))


def _digest(path: Path, algorithm: str) -> str:
    known = _KNOWN_DIGESTS.pop(str(path.resolve()), None)
    if known is not None:
        st = path.stat()
        if (st.st_size, st.st_mtime_ns, algorithm) == known[:3]:
            return known[3]
    return hash_file(path, algorithm, mapped=True)  # a file of the output being written (see hash_file)


def write_manifest(root: Path, workers: int = 4, algorithm: str | None = None) -> Path:
    """Write MANIFEST with {relative path: {ALGORITHM: digest, bytes}} of every file under `root`; the manifest
    names its algorithm in `hash`. A sha256 manifest keeps version 1 (readers before BLAKE3 accept it), a BLAKE3
    one is version 2, which such readers refuse as unreadable rather than misreading it."""
    algorithm = check_hash_name(algorithm or manifest_hash())
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST)
    with ThreadPoolExecutor(workers) as ex:  # both hashes release the GIL
        digests = list(ex.map(_digest, files, [algorithm] * len(files)))
    entries = {
        str(p.relative_to(root)): {algorithm: d, "bytes": p.stat().st_size} for p, d in zip(files, digests)
    }
    version = 1 if algorithm == "sha256" else 2
    path = root / MANIFEST
    path.write_text(json.dumps({"version": version, "hash": algorithm, "files": entries}, indent=1,
                               sort_keys=True) + "\n")
    return path


def manifest_entries(raw: bytes | str) -> tuple[str, dict[str, tuple[int, Any]]]:
    """(algorithm, {relative path: (bytes, digest or None)}) of a manifest's text; a manifest without `hash` is
    a sha256 one (as every manifest before BLAKE3). A ValueError/KeyError/TypeError for a malformed one."""
    try:
        doc = json.loads(raw)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None
    algorithm = doc.get("hash", "sha256")
    if algorithm not in MANIFEST_HASHES:
        raise ValueError(f"unknown hash {str(algorithm)[:40]!r} (this mconvert knows {', '.join(MANIFEST_HASHES)})")
    listed = {}
    for rel, meta in doc["files"].items():
        size = meta["bytes"]
        if type(size) is not int or size < 0:  # a JSON integer, not 1e400, 12.5, true or "12"
            shown = json.dumps(size)[:40] if not isinstance(size, (list, dict)) else type(size).__name__
            raise ValueError(f"entry {str(rel)[:80]!r}: bytes {shown} is not a file size")
        listed[str(rel)] = (size, meta.get(algorithm))
    return algorithm, listed


def check_manifest(root: str | Path, unlisted: bool = True, workers: int = 4) -> list[str]:
    """Problems found comparing `root` with its manifest (empty list: intact): a missing, resized, changed or
    (with `unlisted`) unlisted file — a stray `*.safetensors` would be loaded by vLLM. A missing manifest is
    one problem. Either algorithm the manifest names (`hash`: blake3 or sha256) is checked."""
    root = Path(root)
    if not (root / MANIFEST).is_file():
        return [f"{root}: no {MANIFEST} (not written by mconvert, or copied without it)"]
    algorithm, problems, to_hash = _manifest_plan(root, unlisted)
    with ThreadPoolExecutor(workers) as ex:  # both hashes release the GIL
        digests = list(ex.map(hash_file, [p for p, _, _ in to_hash], [algorithm] * len(to_hash)))
    for (p, want, _), got in zip(to_hash, digests):
        if got != want:
            problems.append(f"{p}: {algorithm} differs from the manifest (file changed or corrupt)")
    return problems


def _manifest_plan(root: Path, unlisted: bool) -> tuple[str, list[str], list[tuple[Path, str, int]]]:
    """(algorithm, the problems found without hashing, the files left to hash as (path, digest, bytes)) of
    `root`'s manifest: entries outside `root` or without a digest, missing or resized files, and (with
    `unlisted`) files the manifest does not list."""
    path = root / MANIFEST
    from mconvert.io.paths import read_small

    try:
        algorithm, listed = manifest_entries(read_small(_contained_manifest(root), "json"))
    except MConvertError as e:
        return "", [str(e)], []
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as e:
        return "", [f"{path}: unreadable manifest ({type(e).__name__}: {e}); re-run the conversion"], []
    problems = []
    # os.path.realpath, not Path.resolve: a symlink loop is a problem of the entry, never a RuntimeError
    top = os.path.realpath(root)
    to_hash = []
    for rel, (size, digest) in sorted(listed.items()):
        p = root / rel
        real = os.path.realpath(p)
        if not real.startswith(top.rstrip(os.sep) + os.sep):
            problems.append(f"{path}: entry {rel!r} points outside {root}; the manifest was tampered with")
            continue
        if not isinstance(digest, str):
            problems.append(f"{path}: entry {rel!r} has no {algorithm} digest; the manifest was tampered with")
            continue
        try:
            st = os.stat(p)
        except FileNotFoundError:
            problems.append(f"{p}: listed in the manifest but missing")
            continue
        except OSError as e:  # ELOOP (a symlink loop), EACCES, ...
            problems.append(f"{p}: listed in the manifest but unreadable ({e.strerror})")
            continue
        if not stat.S_ISREG(st.st_mode):
            problems.append(f"{p}: listed in the manifest but not a regular file")
        elif st.st_size != size:
            problems.append(f"{p}: size {st.st_size} != manifest {size}")
        else:
            to_hash.append((p, digest, size))
    if unlisted:
        for p in sorted(root.rglob("*")):
            if p.is_file() and p.name != MANIFEST and str(p.relative_to(root)) not in listed:
                problems.append(f"{p}: not in the manifest (added after the conversion)")
    return algorithm, problems, to_hash


def verify_input(path: str | Path) -> None:
    """Refuse an input that mconvert wrote (it has a manifest) whose listed files changed since: without this
    a flipped bit inside a tensor is undetectable (neither torch nor safetensors files carry checksums).
    Inputs without a manifest (Megatron-LM's own checkpoints) pass unchecked.

    Inside a conversion (`crc.deferred_crc_checks()`) a missing or resized file is refused at once, and
    each file's digest is taken on the bytes the conversion reads anyway (`FollowedDigest`; a file no reader
    reads is hashed on a background thread); the output waits for the verdict before it is committed, and a
    mismatch then wins over any error the changed bytes caused. Under torchrun the ranks read disjoint parts
    of each file, so each file is hashed whole, on the background thread of the rank that `owns_path` it."""
    from mconvert.io.crc import in_conversion

    root = _manifest_root(Path(path))
    if root is None:
        return
    _contained_manifest(root)  # its own line: a manifest linked from elsewhere is not the input's
    if not in_conversion():
        problems = check_manifest(root, unlisted=False)
        if problems:
            raise _input_changed(root, problems)
        return
    algorithm, problems, to_hash = _manifest_plan(root, unlisted=False)
    if problems:
        raise _input_changed(root, problems)
    _check_on_reads(root, algorithm, to_hash)


def listed_by_manifest(path: str | Path) -> set[str]:
    """The real paths of the files the manifest covering input `path` lists (empty: no manifest, or one
    `verify_input` refuses): what `verify_input` checks byte for byte, so another check need not hash them."""
    from mconvert.io.paths import read_small

    root = _manifest_root(Path(path))
    if root is None:
        return set()
    try:
        _, listed = manifest_entries(read_small(_contained_manifest(root), "json"))
    except (MConvertError, ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError):
        return set()
    return {os.path.realpath(root / rel) for rel in listed}


def _manifest_root(path: Path) -> Path | None:
    """The directory whose manifest covers input `path` (itself, or the checkpoint root above an iteration
    directory), or None when there is none."""
    roots = [path] + ([path.parent] if path.name == "release" or path.name.startswith("iter_") else [])
    return next((r for r in roots if (r / MANIFEST).is_file()), None)


def _contained_manifest(root: Path) -> Path:
    """`root`'s manifest, refused (as every other input file) when it is a symlink leading outside `root`."""
    from mconvert.io.paths import contained

    return contained(root, MANIFEST, f"{root}: manifest")


def _input_changed(root: Path, problems: list[str]) -> MConvertError:
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    return MConvertError(f"{problems[0]}{more}; the input changed after mconvert wrote it — re-copy it "
                         f"(or delete {root / MANIFEST} to convert it as it is)")


def _check_on_reads(root: Path, algorithm: str, to_hash: list[tuple[Path, str, int]]) -> None:
    """Check each file of `root`'s manifest on the conversion's reads where this process reads it whole
    (`crc.follow_input`), else whole on the background thread (a second name of a followed file; under
    torchrun, by the rank that owns the file)."""
    from mconvert.io.crc import deferred, follow_input

    def refuse(problem: str) -> MConvertError:
        return _input_changed(root, [problem])

    for p, digest, size in to_hash:
        if not follow_input(FollowedDigest(p, algorithm, digest, size), refuse):
            deferred(p, lambda f, d=digest, n=size: _check_whole(Path(f), algorithm, d, n, refuse))


def _check_whole(p: Path, algorithm: str, want: str, size: int, refuse: Callable[[str], MConvertError]) -> None:
    problem = FollowedDigest(p, algorithm, want, size).finish()
    if problem is not None:
        raise refuse(problem)


def file_manifest_path(out: str | Path) -> Path:
    """Where the manifest of a single-file output (`OUT.gguf`) lives: `OUT.gguf.mconvert-manifest.json`."""
    out = Path(out)
    return out.with_name(f"{out.name}.{MANIFEST}")


def check_output_file(out: str | Path, force: bool, inputs: tuple[str | Path | None, ...] = (),
                      manifest: bool = True) -> Path:
    """`check_output` for a single-file OUT and, with `manifest`, for the manifest beside it
    (`file_manifest_path`): a directory at either path is refused, with or without --force; an existing
    manifest without --force is refused as an existing OUT is."""
    out = check_output(out, force, inputs)
    if out.is_dir():
        raise MConvertError(f"{out}: is a directory; the output is one file — choose a file name (e.g. model.gguf)")
    if manifest:
        side = file_manifest_path(out)
        if os.path.isdir(side) and not os.path.islink(side):
            raise MConvertError(f"{side}: is a directory where the manifest of {out.name} belongs; remove or "
                                "rename it, or choose another output name")
        if os.path.lexists(side) and not force:
            raise MConvertError(f"{side}: the manifest of {out.name} already exists; pass --force to replace it "
                                "(or remove it)")
    return out


@contextmanager
def atomic_output_file(out: str | Path, force: bool = False, manifest: bool = True,
                       inputs: tuple[str | Path | None, ...] = ()) -> Iterator[Path]:
    """Yield a path to write the single file `out` to; on success put it at `out` and its manifest beside it
    (`file_manifest_path`): both or neither. The file is written inside a temporary sibling directory, so a
    killed run leaves no OUT and the next run removes the leftover, exactly as `atomic_output_dir` does; a
    failed run also removes the directories above OUT it created."""
    out = check_output_file(out, force, inputs, manifest)
    with terminating():
        parent, tmp, created = _fresh_tmp(out)
        placed = False
        try:
            _make_tmp(tmp, out)
            yield tmp / out.name
            if manifest:
                write_manifest(tmp)
            _place_file(tmp, out, force, manifest)
            placed = True
        except BaseException as e:
            mapped = write_failure(e, out, parent, tmp)
            if mapped is not None:
                raise mapped from None
            raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
            if not placed:
                _remove_parents(created)


def _place_file(tmp: Path, out: Path, force: bool, manifest: bool) -> None:
    """Move the finished file in `tmp` to `out` and (with `manifest`) its manifest beside it: when the manifest
    cannot be placed, the file is taken back and a previous OUT returns. Errors name the user's paths."""
    new, dst = tmp / out.name, out.absolute()
    old = _put(new, dst, force, shown=out)
    old_side = None
    if manifest:
        side = file_manifest_path(dst)
        try:
            if os.path.isdir(side) and not os.path.islink(side):  # made during the run: never replaced
                raise MConvertError(f"{file_manifest_path(out)}: appeared as a directory while this run was in "
                                    "progress and was left untouched; nothing was written — remove it, then run "
                                    "again")
            old_side = _put(tmp / MANIFEST, side, force, shown=file_manifest_path(out),
                            park=tmp / f"old-{MANIFEST}")
        except BaseException:
            _swap_back(new, dst, old)
            raise
    remove_entry(old)
    remove_entry(old_side)


def _put(new: Path, dst: Path, force: bool, shown: Path | None = None, park: Path | None = None) -> Path | None:
    """`_swap_in` (with `force`; `park` as there) or `rename_noreplace` of `new` to `dst`; where the previous `dst`
    lies now. An OS error is one line naming `shown` (default `dst`)."""
    try:
        if force:
            return _swap_in(new, dst, park)
        rename_noreplace(new, dst)
        return None
    except OSError as e:
        raise _placing_error(e, shown or dst) from None


def _placing_error(e: OSError, dst: Path) -> MConvertError:
    if e.errno in _WRITE_ERRNOS:
        return _os_error(OSError(e.errno, e.strerror), dst)
    return MConvertError(f"{dst}: cannot be put in place ({e.strerror or e}); nothing was written — remove or "
                         "rename what is there (or choose another output path), then run again")


def check_file_manifest(path: str | Path) -> list[str]:
    """Problems found comparing a single-file output with the manifest beside it (`file_manifest_path`);
    a missing manifest is one problem."""
    path = Path(path)
    side = file_manifest_path(path)
    if not side.is_file():
        return [f"{path}: no {side.name} beside it (not written by mconvert, or copied without it)"]
    from mconvert.io.paths import read_small

    try:
        algorithm, listed = manifest_entries(read_small(side, "json"))
        size, digest = listed[path.name]
    except MConvertError as e:
        return [str(e)]
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as e:
        return [f"{side}: unreadable manifest or no entry for {path.name} ({type(e).__name__}); re-run the conversion"]
    if not isinstance(digest, str):
        return [f"{side}: entry {path.name!r} has no {algorithm} digest; the manifest was tampered with"]
    if path.stat().st_size != size:
        return [f"{path}: size {path.stat().st_size} != manifest {size}"]
    if hash_file(path, algorithm) != digest:
        return [f"{path}: {algorithm} differs from the manifest (file changed or corrupt)"]
    return []
