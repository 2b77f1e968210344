"""Containment of paths that come from inside an input, and opening of input files that cannot block or balloon.

A file name written inside an input (an index `weight_map`, a DCP `relative_path`, an FT/TensorRT-LLM name, a
tokenizer file, a rank or iteration directory) is data an attacker may choose: `contained` admits it only when
it names a path that, with every symlink resolved, stays inside the input directory. Only regular files are
opened (a FIFO or device is refused by `stat` before any `open`, which could block forever), and small metadata
files have their size checked before they are read.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
import weakref
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import Any

from mconvert.errors import MConvertError, type_name

# The most bytes each kind of small metadata file may hold; anything larger is not one mconvert reads whole.
LIMITS: dict[str, int] = {
    "json": 64 << 20,  # config.json, indexes, metadata.json, tokenizer JSON
    "tokenizer": 256 << 20,  # any tokenizer file (tokenizer.json of large vocabularies, sentencepiece models)
    "tracker": 64,  # latest_checkpointed_iteration.txt: "release" or an iteration number
    "ini": 1 << 20,  # FasterTransformer config.ini
    "yaml": 4 << 20,  # Megatron-Bridge run_config.yaml (its whole ConfigContainer: tens of kilobytes)
}


def _inside(real: str, root_real: str) -> bool:
    return real == root_real or real.startswith(root_real.rstrip(os.sep) + os.sep)


def contained(root: str | Path, relative: Any, what: str) -> Path:
    """`root / relative`, refused unless `relative` is a relative name without `..` whose resolved path (every
    symlink followed) stays inside `root`. `what` names where the name came from, for the error line."""
    root = Path(root)
    if not isinstance(relative, (str, os.PathLike)) or not str(relative) or "\0" in str(relative):
        raise MConvertError(f"{what}: {relative!r} is not a file name; the input is damaged or crafted — re-copy it")
    rel = PurePosixPath(str(relative))
    if rel.is_absolute() or ".." in rel.parts:
        raise MConvertError(f"{what}: {str(relative)!r} points outside {root} (absolute or '..'); only files inside "
                            "the input directory are read — the input is damaged or crafted")
    path = root / rel
    if not _inside(os.path.realpath(path), os.path.realpath(root)):
        raise MConvertError(f"{what}: {path} is a symlink leading outside {root}; only files inside the input "
                            "directory are read — copy the file in instead of linking it")
    return path


def check_tree_contained(root: str | Path, what: str, depth: int = 1) -> None:
    """Refuse a directory handed by path to a library that opens files in it by name (transformers'
    `from_pretrained`, optimum, vLLM): every entry of `root`, and of its folders `depth` levels down, must
    resolve inside `root` and be a directory or a regular file, as `contained` and `check_regular` admit a
    file mconvert opens itself."""
    root = Path(root)
    try:
        entries = sorted(os.scandir(root), key=lambda e: e.name)
    except OSError as e:
        raise MConvertError(f"{root}: cannot list ({e.strerror}); check it exists and is readable") from None
    for e in entries:
        path = contained(root, e.name, f"{what}: {e.name}")
        if os.path.isdir(path):
            if depth > 0:
                check_tree_contained(path, what, depth - 1)
            continue
        check_regular(path, what)


def check_regular(path: str | Path, what: str = "") -> os.stat_result:
    """`stat` of `path`, refused unless it is a regular file: opening a FIFO blocks forever, a device has no end."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise MConvertError(f"{path}: missing{f' ({what})' if what else ''}; the input is incomplete") from None
    except OSError as e:
        raise MConvertError(f"{path}: cannot read ({e.strerror}); check it exists and is readable") from None
    if not stat.S_ISREG(st.st_mode):
        kind = ("a FIFO" if stat.S_ISFIFO(st.st_mode) else "a directory" if stat.S_ISDIR(st.st_mode)
                else "a socket" if stat.S_ISSOCK(st.st_mode) else "a device")
        raise MConvertError(f"{path}: {kind}, not a regular file; only regular files are read — replace it with the "
                            "real file")
    return st


def inside_file(root: str | Path, relative: Any, what: str) -> Path:
    """`contained` + `check_regular`: the regular file `relative` inside `root`."""
    path = contained(root, relative, what)
    check_regular(path, what)
    return path


def owned_fd(owner: object, fd: int) -> Callable[[], Any]:
    """Tie `fd` to `owner`: closed when `owner` is garbage-collected, or earlier by calling the returned
    function (which closes it once, however often it is called). A reader left unclosed holds no descriptor."""
    return weakref.finalize(owner, os.close, fd)


def open_regular(path: str | Path, max_size: int | None = None, kind: str = "") -> int:
    """A read-only descriptor of the regular file `path` (never blocks: O_NONBLOCK, checked with fstat after the
    open as well), refused when larger than `max_size` bytes. The caller closes it."""
    check_regular(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise MConvertError(f"{path}: cannot read ({e.strerror}); check it exists and is readable") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):  # swapped for something else since the stat
            raise MConvertError(f"{path}: not a regular file; only regular files are read")
        if max_size is not None and st.st_size > max_size:
            raise MConvertError(f"{path}: {st.st_size:,} bytes, more than a {kind or 'metadata'} file holds "
                                f"(limit {max_size:,}); it is not the file mconvert expects — check the input")
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_small(path: str | Path, kind: str) -> bytes:
    """The whole of a small metadata file of `kind` (a key of LIMITS), size-checked before reading."""
    limit = LIMITS[kind]
    fd = open_regular(path, limit, kind)
    try:
        chunks, total = [], 0
        while total <= limit:
            b = os.read(fd, min(1 << 20, limit + 1 - total))
            if not b:
                break
            chunks.append(b)
            total += len(b)
    except OSError as e:
        raise MConvertError(f"{path}: cannot read ({e.strerror})") from None
    finally:
        os.close(fd)
    if total > limit:  # grew while read
        raise MConvertError(f"{path}: more than {limit:,} bytes, more than a {kind} file holds; check the input")
    return b"".join(chunks)


def read_json(path: str | Path, kind: str = "json", what: str = "JSON file") -> Any:
    """A small JSON file, size-checked first; undecodable JSON is one line naming the file (`what` it is)."""
    try:
        return json.loads(read_small(path, kind))
    except RecursionError:
        raise MConvertError(f"{path}: unreadable {what} (JSON nested too deeply); re-copy or re-export it") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise MConvertError(f"{path}: unreadable {what}, not valid JSON ({str(e)[:120]}); re-copy or re-export "
                            "it") from None


def load_json_object(path: str | Path, what: str, fix: str = "fix or re-create it", kind: str = "json") -> dict[str, Any]:
    """The small JSON file `path` (a regular file, size-checked before reading) whose top level must be an object;
    a missing, unreadable, invalid or wrong-shaped file is one MConvertError naming the file and `what` it is."""
    p = Path(path)
    data = read_small(p, kind)
    try:
        obj = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise MConvertError(f"{p}: unreadable {what} (not UTF-8 text: {e.reason} at byte {e.start}); {fix}") from None
    except RecursionError:
        raise MConvertError(f"{p}: unreadable {what} (JSON nested too deeply); {fix}") from None
    except ValueError as e:
        raise MConvertError(f"{p}: unreadable {what} (not valid JSON: {e}); {fix}") from None
    if not isinstance(obj, dict):
        raise MConvertError(f"{p}: unreadable {what} (expected a JSON object, found {type_name(obj)}); {fix}")
    return obj


def copy_contained(src_dir: Path, name: str, dst_dir: Path, kind: str = "tokenizer") -> Path:
    """Copy the regular file `name` from inside `src_dir` (contained, size-bounded) to `dst_dir / name`."""
    src = contained(src_dir, name, f"{src_dir}: file {name}")
    fd = open_regular(src, LIMITS[kind], kind)
    dst = dst_dir / name
    try:
        with os.fdopen(fd, "rb") as fi, open(dst, "xb") as fo:
            shutil.copyfileobj(fi, fo, 1 << 20)
    except FileExistsError:
        raise MConvertError(f"{dst}: already written; {name} is listed twice") from None
    return dst


def overlap(out: str | Path, inp: str | Path) -> str | None:
    """How OUT and an input overlap once resolved ('is', 'contains', 'lies inside'), or None when apart."""
    o, i = os.path.realpath(out), os.path.realpath(inp)
    if o == i:
        return "is"
    if _inside(i, o):
        return "contains"
    if _inside(o, i):
        return "lies inside"
    return None


TMP_TAG = ".mconvert-tmp-"  # in the name of every temporary output directory (`atomic.tmp_name`)


def make_dirs(path: str | Path) -> None:
    """`mkdir -p path`, except that a temporary output directory (a name with TMP_TAG) is never created: once
    a failed run removed it, a thread or process still writing into it (another torchrun rank) fails on
    FileNotFoundError instead of leaving a second copy behind. The missing directories are created one at a
    time, so one removed meanwhile is never created again."""
    path = Path(path).absolute()
    missing = []
    probe = path
    while not probe.is_dir():
        missing.append(probe)
        probe = probe.parent
    for cur in reversed(missing):
        if TMP_TAG in cur.name:
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(cur))
        try:
            os.mkdir(cur)
        except FileExistsError:
            if cur.is_dir():
                continue
            if not os.path.lexists(cur):  # removed right after the mkdir found it: its parent is being removed
                raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(cur)) from None
            raise
