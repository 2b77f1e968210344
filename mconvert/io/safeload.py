"""The only way mconvert opens a pickle-based checkpoint: weights-only, memory-mapped, one allow-list.

`torch.load(weights_only=True)` refuses every global not on the list (`unpickler.ALLOW_LIST`: exactly the
ones Megatron-LM checkpoints carry, args Namespace, enums, numpy RNG state, io.BytesIO in TE extra state; stand-ins
for classes whose modules are not installed). Anything else is refused by name. Never `weights_only=False`.

Every pickle is first run by the restricted unpickler (`io/unpickler.py`), which an allow-list alone cannot
replace; `check_tree` then bounds what was loaded, so every later walk over it ends.
"""

from __future__ import annotations

import io
import pickle
import re
import struct
import threading
import types
import warnings
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from mconvert.errors import MConvertError
from mconvert.io.crc import verify_zip_crc, short_error
from mconvert.io.unpickler import (
    LEGACY_PICKLES,
    ALLOW_LIST,
    MAX_DEPTH,
    MAX_OBJECTS,
    dcp_policy,
    restricted_unpickle,
    zip_record,
    check_torch_pickle,
)


_LOCK = threading.Lock()


@contextmanager
def _exactly_our_allow_list(inert: dict[str, type] | None = None) -> Iterator[None]:
    """Make ALLOW_LIST (and the `inert` stand-ins the check pass made for this file) the only user allow-list
    while loading: importing megatron-core registers its own classes process-wide
    (megatron/core/safe_globals.py); mconvert's answer must not depend on imports."""
    with _LOCK:
        saved = torch.serialization.get_safe_globals()
        torch.serialization.clear_safe_globals()
        # the whole list, not just what the scan reported: classes built inside a REDUCE (numpy dtypes)
        # are not reported by it
        torch.serialization.add_safe_globals([*ALLOW_LIST.values(), *((c, q) for q, c in (inert or {}).items())])
        try:
            yield
        finally:
            torch.serialization.clear_safe_globals()
            torch.serialization.add_safe_globals(saved)


_ZIP_MAGIC = b"PK\x03\x04"
_GLOBAL_RE = re.compile(r"GLOBAL ([\w.]+)")


def safe_load(path: str | Path, what: str = "checkpoint") -> Any:
    """Load a torch pickle weights-only (mmap when possible). One-line MConvertError on anything unsafe or broken.

    The pickle is first run by `check_torch_pickle` (allow-listed globals and constructors only, state only
    into fresh objects, bounded size), then loaded by torch's weights-only unpickler with the same allow-list,
    then `check_tree` bounds the result, so every later walk over it ends."""
    path = Path(path)
    if not path.is_file():
        raise MConvertError(f"{path}: {what} file not found")
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError as e:
        raise MConvertError(f"{path}: cannot read {what} ({e.strerror}); check its permissions") from None
    if not head:
        raise MConvertError(f"{path}: {what} file is empty (truncated copy?); re-copy it")
    if head == _ZIP_MAGIC:
        refuse_duplicate_entries(path)
        inert = check_torch_pickle(path, [zip_record(path, "data.pkl")])
        verify_zip_crc(path)
        with _exactly_our_allow_list(inert):
            return check_tree(path, _load(path, what, mmap=True))
    if head[:1] == b"\x80":  # a bare pickle: the legacy torch.save format (or not torch at all)
        # read once: the bytes checked are the bytes loaded (and a file object keeps torch off its tar path)
        data = path.read_bytes()
        inert = check_torch_pickle(path, [data], pickles=LEGACY_PICKLES)
        with _exactly_our_allow_list(inert):
            return check_tree(path, _load(path, what, mmap=False, data=data))
    raise MConvertError(
        f"{path}: not a torch checkpoint (starts with {head!r}, expected a zip or pickle); "
        "check the file name or re-copy it"
    )


def refuse_duplicate_entries(path: Path) -> None:
    """Refuse a zip that names one entry twice: torch's reader takes the first, Python's zipfile the last, so
    two readers of one file would see different bytes. A zip Python cannot parse is left to the other checks."""
    try:
        with zipfile.ZipFile(path) as z:
            names = z.namelist()
    except (OSError, zipfile.BadZipFile, ValueError, struct.error):
        return
    if len(set(names)) != len(names):
        seen: set[str] = set()
        twice = next(n for n in names if n in seen or seen.add(n))
        raise MConvertError(f"{path}: the zip holds two entries named {twice!r} (torch.save writes each once); the "
                            "file is corrupt or crafted — re-copy it")


_LEAVE = object()  # marks, on check_tree's work list, the end of a container's children


def check_tree(source: str | Path, obj: Any, max_depth: int = MAX_DEPTH, max_objects: int = MAX_OBJECTS) -> Any:
    """Refuse a loaded object that a walk over it could not finish, and return it: a container that contains
    itself, nesting deeper than `max_depth`, or more than `max_objects` entries counted along every path (a
    small pickle whose shared sub-lists expand exponentially). After it, any walk over `obj` ends.

    Also refuses a tensor whose elements overlap in its storage (a zero or shrunken stride): torch.save never
    writes one for a parameter, and a damaged stride would otherwise make a wrong tensor silently."""
    count = 0
    on_path: set[int] = set()
    tensors: set[int] = set()
    leaf = _LEAF_TYPES
    todo: list[tuple[Any, int, Any]] = [(obj, 1, None)]  # (object, depth, key chain (parent chain, key))
    pop, push = todo.pop, todo.append
    while todo:
        o, depth, key = pop()
        if o is _LEAVE:
            on_path.discard(depth)
            continue
        if isinstance(o, torch.Tensor):
            if id(o) not in tensors:
                tensors.add(id(o))
                if _overlaps(o):
                    raise MConvertError(
                        f"{source}: tensor {_key(key)} has shape {tuple(o.shape)} but strides {o.stride()} "
                        "that make its elements overlap; the file is corrupt — re-copy it"
                    )
            continue
        items = _items(o)
        if items is None:
            continue
        if id(o) in on_path:
            raise MConvertError(f"{source}: {_key(key)} contains itself (a cycle); no checkpoint does — "
                                "the file is crafted or corrupt, re-copy it")
        if depth > max_depth:
            raise MConvertError(f"{source}: nesting deeper than {max_depth} levels at {_key(key)}; no checkpoint "
                                "does — the file is crafted or corrupt, re-copy it")
        on_path.add(id(o))
        push((_LEAVE, id(o), None))
        depth += 1
        n = len(todo)
        for k, c in items:
            if type(c) not in leaf:
                push((c, depth, (key, k)))
        count += len(o) if type(o) in (dict, list, tuple) else len(todo) - n
        if count > max_objects:
            raise MConvertError(
                f"{source}: more than {max_objects} objects (shared ones counted each time they are reached); "
                "no checkpoint has that many — the file is crafted or corrupt, re-copy it")
    return obj


_LEAF_TYPES = frozenset({str, bytes, int, float, bool, type(None), complex, torch.dtype, torch.device})


def _key(chain: Any) -> str:
    """`a.b[3]` from check_tree's (parent chain, key) pairs."""
    parts: list[str] = []
    while chain is not None:
        chain, k = chain
        parts.append(f"[{k}]" if type(k) is int else f".{k}")
    return "".join(reversed(parts)).lstrip(".") or "the top-level object"


def _items(o: Any) -> Any:
    """(key, child) pairs of a container or data object (dict keys that are not plain values included), or
    None for a leaf."""
    t = type(o)
    if t is dict:
        return [*o.items(), *((f"<key {i}>", k) for i, k in enumerate(o) if type(k) not in _LEAF_TYPES)]
    if t is list or t is tuple:
        return enumerate(o)
    if isinstance(o, dict):  # OrderedDict, Counter: items and attributes (OrderedDict `_metadata`)
        return [*o.items(), *((f"<key {i}>", k) for i, k in enumerate(o)), *getattr(o, "__dict__", {}).items()]
    if isinstance(o, (list, tuple, set, frozenset)):
        return enumerate(o)
    if isinstance(o, (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType)):
        return None
    d = getattr(o, "__dict__", None)
    return d.items() if isinstance(d, dict) and d else None


def _overlaps(t: torch.Tensor) -> bool:
    """True when two indices of `t` address the same storage element (sufficient test, stride-sorted)."""
    if t.layout != torch.strided or t.numel() <= 1:
        return False
    extent = 1  # elements spanned by the dims seen so far
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz > 1):
        if stride < extent:
            return True
        extent = stride * (size - 1) + extent
    return False


def _refuse(path: Path, refused: list[str]) -> None:
    if refused:
        raise MConvertError(
            f"{path}: refuses to unpickle global {refused[0]!r} (not on mconvert's allow-list); "
            "this file may run code when loaded — do not load it with weights_only=False"
        )


def _load(path: Path, what: str, mmap: bool, data: bytes | None = None) -> Any:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # pickle-protocol notes would be a second line on stderr
            if data is not None:
                return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
            if mmap:
                try:
                    return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
                except RuntimeError as e:
                    if "mmap" not in str(e):
                        raise
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        m = _GLOBAL_RE.search(str(e))
        if m:
            _refuse(path, [m.group(1)])
        raise MConvertError(
            f"{path}: the weights-only unpickler refuses this {what} ({_first_reason(e)}); "
            "it is corrupt or not a torch.save file — re-copy it"
        ) from None
    except MConvertError:
        raise
    except Exception as e:
        raise MConvertError(
            f"{path}: cannot load {what} ({short_error(e)}); the file is truncated or corrupt — re-copy it"
        ) from None


def _first_reason(e: BaseException) -> str:
    """The useful line of torch's multi-paragraph weights-only error."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    for i, line in enumerate(lines):
        if "WeightsUnpickler error:" in line:
            rest = line.split("WeightsUnpickler error:", 1)[1].strip()
            if not rest and i + 1 < len(lines):
                rest = lines[i + 1]
            if rest:
                return rest[:160]
    return short_error(e)


# ---- restricted unpickling: state reaches only fresh instances, calls only allow-listed constructors -------




def safe_load_dcp_metadata(path: str | Path) -> Any:
    """A torch_dist checkpoint's `.metadata` (DCP Metadata) through the restricted unpickler — never pickle.load."""
    from torch.distributed.checkpoint.metadata import Metadata

    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise MConvertError(f"{path}: cannot read ({e.strerror}); check it exists and is readable") from None
    md = restricted_unpickle(path, io.BytesIO(data), dcp_policy(), stand_ins="megatron.")
    if not isinstance(md, Metadata):
        raise MConvertError(f"{path}: holds a {type(md).__name__}, not DCP Metadata; the torch_dist checkpoint "
                            "is corrupt — re-copy it")
    return check_tree(path, md)
