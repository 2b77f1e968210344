"""Megatron-LM's integrity manifest: `integrity.json` beside a torch_dist checkpoint's files.

megatron-core's `dist_checkpointing.save(..., verify_integrity=True)` (Megatron-LM's `--verify-integrity`)
writes, once every file of the iteration directory is final, `{"algorithm": "sha256", "files": {name: hex}}`:
the sha256 of every regular file directly in that directory but the manifest itself, under its bare name.
`load(..., verify_integrity=True)` re-hashes every listed file before loading and refuses a missing file or a
digest that differs; files it does not list are not checked, and a manifest without `algorithm` is read as a
sha256 one.

mconvert reads it the same way wherever a torch_dist checkpoint is read (`check_integrity`), and writes it
for every torch_dist output (`write_integrity`), so Megatron-LM's own check passes on what mconvert wrote.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path

from mconvert.io.hashing import FollowedDigest, hash_file
from mconvert.io.paths import check_regular, contained, read_small
from mconvert.errors import MConvertError

INTEGRITY = "integrity.json"  # megatron-core's `INTEGRITY_FNAME`
ALGORITHM = "sha256"  # the only algorithm megatron-core writes and accepts
_HEX = re.compile(r"[0-9a-f]{64}")  # hashlib's hexdigest: megatron-core compares the strings as they are
SHAPE = '{"algorithm": "sha256", "files": {file name: sha256 hex}}'


def integrity_entries(iter_dir: Path) -> dict[Path, str] | None:
    """{file inside `iter_dir`: its sha256 hex} from `iter_dir`'s integrity manifest, None when it has none.
    A manifest that is not megatron-core's shape, that names a file outside `iter_dir` (absolute, `..`, a
    symlink leading out) or a file that is missing is one MConvertError naming the manifest and the entry."""
    if not os.path.lexists(iter_dir / INTEGRITY):
        return None
    path = contained(iter_dir, INTEGRITY, f"{iter_dir}: Megatron-LM integrity manifest")

    def refuse(why: str) -> MConvertError:
        return MConvertError(f"{path}: not a Megatron-LM integrity manifest ({why}); megatron-core writes {SHAPE} — "
                             "re-copy the checkpoint, or delete the file to read the checkpoint unchecked")

    try:
        doc = json.loads(read_small(path, "json"))
    except RecursionError:
        raise refuse("JSON nested too deeply") from None
    except ValueError as e:  # invalid JSON or UTF-8
        raise refuse(f"not valid JSON: {str(e)[:120]}") from None
    if not isinstance(doc, dict):
        raise refuse(f"a JSON {type(doc).__name__}, not an object")
    algorithm = doc.get("algorithm", ALGORITHM)  # megatron-core reads a manifest without it as sha256
    if algorithm != ALGORITHM:
        raise refuse(f"algorithm {json.dumps(algorithm)[:40]}; megatron-core writes and accepts only {ALGORITHM!r}")
    files = doc.get("files")
    if not isinstance(files, dict):
        raise refuse("no 'files' object" if files is None else f"'files' is a JSON {type(files).__name__}")
    out: dict[Path, str] = {}
    for name, digest in files.items():
        if not isinstance(digest, str) or not _HEX.fullmatch(digest):
            raise refuse(f"entry {name[:80]!r}: {json.dumps(digest)[:80]} is not a lowercase sha256 hex digest")
        if name == INTEGRITY:
            raise refuse(f"it lists itself ({name!r})")
        p = contained(iter_dir, name, f"{path}: entry")
        if not os.path.lexists(p):
            raise MConvertError(f"{p}: listed in {path} but missing; the checkpoint is incomplete — re-copy it")
        check_regular(p, f"listed in {path}")
        out[p] = digest
    return out


def check_integrity(iter_dir: Path, digests: bool = True, covered: Callable[[Path], bool] = lambda p: False) -> None:
    """Refuse a torch_dist iteration directory that its integrity manifest (if any) contradicts. Its shape and
    every listed file's presence are checked now; with `digests`, each listed file's sha256 too — inside a
    conversion on the conversion's own reads or on its background thread, awaited before the output is
    committed (`crc.follow_input`), else now. `covered(path)`: the file is checked byte for byte by
    another manifest already (mconvert's own), so it is not hashed a second time."""
    listed = integrity_entries(iter_dir)
    if not listed or not digests:
        return
    from mconvert.io.crc import deferred, follow_input

    manifest = iter_dir / INTEGRITY
    for p, want in sorted(listed.items()):
        if covered(p):
            continue

        def refuse(problem: str, p: Path = p) -> MConvertError:
            if problem.endswith("differs from the manifest (file changed or corrupt)"):
                problem = f"{p}: {ALGORITHM} differs from Megatron-LM's integrity manifest {manifest}"
            else:  # unreadable, or changed size while read
                problem = f"{problem} (a file Megatron-LM's integrity manifest {manifest} lists)"
            return MConvertError(f"{problem}; the file changed after it was saved — re-copy the checkpoint")

        digest = FollowedDigest(p, ALGORITHM, want, os.stat(p).st_size)
        if follow_input(digest, refuse):
            continue
        if not deferred(p, lambda f, d=digest, r=refuse: _check_whole(d, r)):
            _check_whole(digest, refuse)


def _check_whole(digest: FollowedDigest, refuse: Callable[[str], MConvertError]) -> None:
    problem = digest.finish()  # streams the file through one block; a FIFO swapped in is refused, not waited on
    if problem is not None:
        raise refuse(problem)


def write_integrity(iter_dir: Path, known: dict[str, str] | None = None) -> Path:
    """Write `iter_dir`'s integrity manifest as megatron-core's `save_integrity_manifest` does: every regular
    file directly in `iter_dir` but the manifest, by bare name, with its sha256 (`known[name]` where the writer
    took it on the bytes it wrote, else read back). Called once every other file there is final."""
    known = known or {}
    files = {}
    for entry in sorted(iter_dir.iterdir(), key=str):
        if entry.is_file() and entry.name != INTEGRITY:
            files[entry.name] = known.get(entry.name) or hash_file(entry, ALGORITHM, mapped=True)
    path = iter_dir / INTEGRITY
    path.write_text(json.dumps({"algorithm": ALGORITHM, "files": files}, indent=2))
    return path
