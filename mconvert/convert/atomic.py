"""Atomic output directories and the integrity manifest.

Every verb writes into a hidden temporary sibling of OUT and renames it into place at the very end,
so a run killed at any point (SIGKILL included) leaves no OUT, and `--force` replaces an existing OUT
only at that final rename. The manifest lists the sha256 of every file written.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from mconvert.errors import MConvertError

MANIFEST = "mconvert-manifest.json"
_TMP_TAG = ".mconvert-tmp-"


def check_output(out: str | Path, force: bool) -> Path:
    """Refuse an existing OUT without --force and an unwritable parent, before any work is done."""
    out = Path(out)
    if out.exists() and not force:
        raise MConvertError(f"{out}: output already exists; pass --force to replace it")
    parent = out.absolute().parent
    probe = parent
    while not probe.exists():
        probe = probe.parent
    if not os.access(probe, os.W_OK):
        raise MConvertError(f"{out}: cannot write to {probe} (permission denied); choose another output path")
    return out


def _clean_stale(parent: Path, name: str) -> None:
    """Remove temporary siblings left by killed runs whose process is gone."""
    for p in parent.glob(f".{name}{_TMP_TAG}*"):
        try:
            pid = int(p.name.rsplit("-", 1)[1])
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(p, ignore_errors=True)
        except (ValueError, PermissionError, IndexError):
            pass


@contextmanager
def atomic_output_dir(out: str | Path, force: bool = False, manifest: bool = True) -> Iterator[Path]:
    """Yield a temporary directory; on success write the manifest and rename it to `out`."""
    out = check_output(out, force)
    parent = out.absolute().parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        _clean_stale(parent, out.name)
        tmp = parent / f".{out.name}{_TMP_TAG}{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    except OSError as e:
        raise _os_error(e, out) from None
    try:
        yield tmp
        if manifest:
            write_manifest(tmp)
        if out.exists():
            old = parent / f".{out.name}{_TMP_TAG}old-{os.getpid()}"
            os.rename(out, old)
            os.rename(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, out)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise _os_error(e, out) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _os_error(e: OSError, out: Path) -> MConvertError:
    if e.errno == errno.ENOSPC:
        return MConvertError(
            f"{out}: disk full while writing ({e.filename or out}); free space and run again"
        )
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return MConvertError(
            f"{out}: cannot write {e.filename or out} ({e.strerror}); choose another output path"
        )
    return MConvertError(f"{out}: {e.strerror or e} ({e.filename or out})")


def sha256_file(path: Path, chunk: int = 16 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def write_manifest(root: Path, workers: int = 4) -> Path:
    """Write MANIFEST with {relative path: {sha256, bytes}} of every file under `root`."""
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST)
    with ThreadPoolExecutor(workers) as ex:  # hashlib releases the GIL
        digests = list(ex.map(sha256_file, files))
    entries = {
        str(p.relative_to(root)): {"sha256": d, "bytes": p.stat().st_size} for p, d in zip(files, digests)
    }
    path = root / MANIFEST
    path.write_text(json.dumps({"version": 1, "files": entries}, indent=1, sort_keys=True) + "\n")
    return path


def check_manifest(root: str | Path) -> list[str]:
    """Problems found comparing `root` with its manifest (empty list: intact). Missing manifest is one problem."""
    root = Path(root)
    path = root / MANIFEST
    if not path.is_file():
        return [f"{root}: no {MANIFEST} (not written by mconvert, or copied without it)"]
    try:
        entries = json.loads(path.read_text())["files"]
    except (ValueError, KeyError) as e:
        return [f"{path}: unreadable manifest ({e})"]
    problems = []
    for rel, meta in sorted(entries.items()):
        p = root / rel
        if not p.is_file():
            problems.append(f"{p}: listed in the manifest but missing")
        elif p.stat().st_size != meta["bytes"]:
            problems.append(f"{p}: size {p.stat().st_size} != manifest {meta['bytes']}")
        elif sha256_file(p) != meta["sha256"]:
            problems.append(f"{p}: sha256 differs from the manifest (file changed or corrupt)")
    return problems
