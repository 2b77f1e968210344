"""The only way mconvert opens a pickle-based checkpoint: weights-only, memory-mapped, one allow-list.

`torch.load(weights_only=True)` refuses every global not on the list; this module lists exactly the
ones Megatron-LM checkpoints carry (args Namespace, enums, numpy RNG state, io.BytesIO in TE extra
state) and stands in for classes whose modules are not installed. Anything else is refused by name.
Never `weights_only=False`.
"""

from __future__ import annotations

import argparse
import io
import os
import pathlib
import pickle
import re
import signal
import struct
import threading
import types
import warnings
import zipfile
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from mconvert.errors import MConvertError


class StandIn:
    """Stand-in for a class from a module that is not installed (Megatron's enums, configs): keeps the data.

    An enum member `E.x` pickles as `E(value)`: `.value` gives it back. A dataclass pickles as its
    `__dict__`: the fields become attributes."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args
        self.kwargs = kwargs

    @property
    def value(self) -> Any:
        args = self.__dict__.get("args") or (None,)
        return args[0]

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, dict):
            self.__dict__.update(state)
        else:
            self.state = state

    def __repr__(self) -> str:
        if "args" in self.__dict__:
            return f"{type(self).__name__}{self.args}"
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self.__dict__.items())})"


def _stand_in(qualname: str) -> tuple[type, str]:
    cls = type(qualname.rsplit(".", 1)[1], (StandIn,), {"__module__": qualname.rsplit(".", 1)[0]})
    return (cls, qualname)


def _numpy_globals() -> dict[str, Any]:
    import numpy as np

    out: dict[str, Any] = {"numpy.ndarray": np.ndarray, "numpy.dtype": np.dtype}
    for mod in ("numpy.core.multiarray", "numpy._core.multiarray"):
        out[f"{mod}._reconstruct"] = (np._core.multiarray._reconstruct, f"{mod}._reconstruct")
        out[f"{mod}.scalar"] = (np._core.multiarray.scalar, f"{mod}.scalar")
    for name in dir(np.dtypes):
        if name.endswith("DType"):
            out[f"numpy.dtypes.{name}"] = getattr(np.dtypes, name)
    return out


# Megatron-LM / megatron-core enums seen in `args` and in saved state.
_MEGATRON_STAND_INS = (
    "megatron.core.enums.ModelType",
    "megatron.core.transformer.enums.AttnBackend",
    "megatron.core.transformer.enums.AttnMaskType",
    "megatron.core.transformer.enums.AttnType",
    "megatron.core.transformer.enums.LayerType",
    "megatron.core.enums.Fp8Recipe",
    "megatron.core.transformer.enums.CudaGraphScope",
    "megatron.model.enums.AttnMaskType",
    "megatron.model.enums.LayerType",
    "megatron.model.enums.AttnType",
    "megatron.model.enums.PositionEmbeddingType",
    "megatron.core.enums.Fp4Recipe",
    # megatron-core's own safe list (megatron/core/safe_globals.py): rerun state machine, optimizer config
    "megatron.core.rerun_state_machine.RerunDiagnostic",
    "megatron.core.rerun_state_machine.RerunMode",
    "megatron.core.rerun_state_machine.RerunState",
    "megatron.core.optimizer.optimizer_config.OptimizerConfig",
)


def _allow_list() -> dict[str, Any]:
    allow: dict[str, Any] = {
        "argparse.Namespace": argparse.Namespace,
        "types.SimpleNamespace": types.SimpleNamespace,
        "_io.BytesIO": io.BytesIO,
        "io.BytesIO": io.BytesIO,
        "builtins.set": set,
        "builtins.frozenset": frozenset,
        # in args (save/load dirs, exit_signal); constructing them runs no user code
        "pathlib.PosixPath": pathlib.PosixPath,
        "pathlib.WindowsPath": _stand_in("pathlib.WindowsPath"),
        "signal.Signals": signal.Signals,
    }
    allow.update(_numpy_globals())
    for q in _MEGATRON_STAND_INS:
        allow[q] = _stand_in(q)
    return allow


ALLOW_LIST = _allow_list()
_LOCK = threading.Lock()


@contextmanager
def _exactly_our_allow_list() -> Iterator[None]:
    """Make ALLOW_LIST the only user allow-list while loading: importing megatron-core registers its own
    classes process-wide (megatron/core/safe_globals.py); mconvert's answer must not depend on imports."""
    with _LOCK:
        saved = torch.serialization.get_safe_globals()
        torch.serialization.clear_safe_globals()
        # the whole list, not just what the scan reported: classes built inside a REDUCE (numpy dtypes)
        # are not reported by it
        torch.serialization.add_safe_globals(list(ALLOW_LIST.values()))
        try:
            yield
        finally:
            torch.serialization.clear_safe_globals()
            torch.serialization.add_safe_globals(saved)


_ZIP_MAGIC = b"PK\x03\x04"
_GLOBAL_RE = re.compile(r"GLOBAL ([\w.]+)")


def safe_load(path: str | Path, what: str = "checkpoint") -> Any:
    """Load a torch pickle weights-only (mmap when possible). One-line MConvertError on anything unsafe or broken.

    Zip files (torch >= 1.6) are scanned for the globals they need before any unpickling; legacy
    (pre-zip) files go straight to the weights-only unpickler, whose refusal is reported by global name."""
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
        with _exactly_our_allow_list():
            try:
                needed = torch.serialization.get_unsafe_globals_in_checkpoint(str(path))
            except Exception as e:  # truncated central directory, no data.pkl, ...
                raise MConvertError(
                    f"{path}: not a readable torch checkpoint ({_short(e)}); "
                    "the file is truncated or corrupt — re-copy it"
                ) from None
            _refuse(path, [g for g in needed if g not in ALLOW_LIST])
            verify_zip_crc(path)
            return _check_layouts(path, _load(path, what, mmap=True))
    if head[:1] == b"\x80":  # a bare pickle: the legacy torch.save format (or not torch at all)
        with _exactly_our_allow_list():
            return _check_layouts(path, _load(path, what, mmap=False))
    raise MConvertError(
        f"{path}: not a torch checkpoint (starts with {head!r}, expected a zip or pickle); "
        "check the file name or re-copy it"
    )


_CRC_CHECKED: set[tuple[str, int, int]] = set()


class DeferredCRC:
    """While active (`deferred_crc_checks()`), `verify_zip_crc` runs on one background thread instead of the
    caller's: a conversion reads and converts while the CRC-32 pass over its input runs on the other core
    (issue 7: ~0.65 s of the main thread's 5.6 s for megatron-to-hf of the 1B bench model at 8 layers).
    `wait()` — called before the output is committed — raises the first failure; a conversion that failed
    meanwhile reports the CRC failure instead of its own error, since corrupt bytes explain the rest."""

    def __init__(self) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self._pool = ThreadPoolExecutor(1, thread_name_prefix="crc32")
        self._futures: list[Any] = []

    def submit(self, path: Path, check: Any) -> None:
        """Run `check(path)` on the background thread."""
        self._futures.append(self._pool.submit(check, path))

    def wait(self) -> None:
        for f in self._futures:
            f.result()  # re-raises the MConvertError of a failed check
        self._futures.clear()

    def cancel(self) -> None:
        """Drop the checks not started yet (nothing will be committed: a dry run, or a conversion that
        failed); raise the first failure among those that ran, since corrupt bytes explain the rest."""
        for f in self._futures:
            f.cancel()
        done = [f for f in self._futures if not f.cancelled()]
        self._futures.clear()
        for f in done:
            f.result()

    def close(self) -> None:
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
    except BaseException:
        try:
            d.cancel()  # a failed conversion does not wait for the whole input's CRC pass
        except MConvertError as crc:
            raise crc from None
        raise
    finally:
        _DEFERRED = outer
        d.close()


def wait_crc_checks() -> None:
    """Raise the first failed background CRC-32 check (no-op outside `deferred_crc_checks()`)."""
    if _DEFERRED is not None:
        _DEFERRED.wait()


def skip_crc_checks() -> None:
    """Nothing derived from the input will be committed (a dry run): drop the checks not started yet."""
    if _DEFERRED is not None:
        _DEFERRED.cancel()


def crc_in_background(fn: Any) -> Any:
    """Decorator: run `fn` inside `deferred_crc_checks()`; `fn` calls `wait_crc_checks()` before it commits."""
    import functools

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with deferred_crc_checks():
            return fn(*args, **kwargs)

    return wrapper


def deferred(path: str | Path, check: Any) -> bool:
    """Inside `deferred_crc_checks()` (and on the main thread): queue `check(path)` on its background thread
    and return True; else False (the caller checks now)."""
    if _DEFERRED is not None and threading.current_thread() is threading.main_thread():
        _DEFERRED.submit(Path(path), check)
        return True
    return False


def verify_zip_crc(path: str | Path) -> None:
    """Check the CRC-32 of every entry now, or on the background thread of `deferred_crc_checks()`."""
    if not deferred(path, _verify_zip_crc_now):
        _verify_zip_crc_now(path)


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
            # until unmapped, and a rank file can be larger than one layer (bench/, issue 7: RSS flat in depth)
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
                    crc = zlib.crc32(chunk[:k], crc)
                    pos, left = pos + k, left - k
                if crc != info.CRC:
                    raise MConvertError(
                        f"{path}: entry {info.filename} fails the CRC-32 check torch.save stored for it; "
                        "the file is corrupt — re-copy it"
                    )
    except (zipfile.BadZipFile, ValueError, struct.error) as e:
        raise MConvertError(f"{path}: damaged zip structure ({_short(e)}); the file is corrupt — re-copy it") from None
    _CRC_CHECKED.add(key)


def _check_layouts(path: Path, obj: Any) -> Any:
    """Refuse a tensor whose elements overlap in its storage (a zero or shrunken stride): torch.save never
    writes one for a parameter, and a damaged stride in the pickle would otherwise make a wrong tensor
    silently (a grown stride runs out of its storage and torch refuses it already)."""
    todo: list[tuple[str, Any]] = [("", obj)]
    while todo:
        key, o = todo.pop()
        if isinstance(o, torch.Tensor):
            if _overlaps(o):
                raise MConvertError(
                    f"{path}: tensor {key or '(top level)'} has shape {tuple(o.shape)} but strides {o.stride()} "
                    "that make its elements overlap; the file is corrupt — re-copy it"
                )
        elif isinstance(o, dict):
            todo.extend((f"{key}.{k}" if key else str(k), v) for k, v in o.items())
        elif isinstance(o, (list, tuple)):
            todo.extend((f"{key}[{i}]", v) for i, v in enumerate(o))
    return obj


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


def _load(path: Path, what: str, mmap: bool) -> Any:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # pickle-protocol notes would be a second line on stderr
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
            f"{path}: cannot load {what} ({_short(e)}); the file is truncated or corrupt — re-copy it"
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
    return _short(e)


def _short(e: BaseException) -> str:
    """`Type: first sentence of the message` — enough to tell truncation from corruption, on one line."""
    msg = " ".join(str(e).split())
    first = msg.split(". ", 1)[0]
    return f"{type(e).__name__}: {first[:160]}" if first else type(e).__name__


def all_finite(t: torch.Tensor, chunk: int = 1 << 24) -> bool:
    """No NaN/Inf in `t`. One reduction pass, no temporary mask: min and max are both finite exactly when
    every element is (a NaN propagates into both, +Inf is the max, -Inf the min); ~20x faster than
    `isfinite().all()` (bench/, issue 7). `chunk` is kept for callers that pass it."""
    if t.numel() == 0:
        return True
    if not t.is_floating_point():  # integers are finite; complex keeps the elementwise check
        return bool(torch.isfinite(t).all())
    lo, hi = torch.aminmax(t.reshape(-1))
    return bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))


# ---- torch.distributed.checkpoint `.metadata` ------------------------------------------------------------
# torch's FileSystemReader.read_metadata() is a bare pickle.load: a torch_dist checkpoint's `.metadata` could
# run code. It is read here instead, with find_class limited to DCP's own dataclasses, torch.Size and dtypes
# (megatron's planner classes get data-only stand-ins).
_DCP_ALLOWED: dict[str, set[str]] = {
    "torch": {"Size"} | {n for n, v in vars(torch).items() if isinstance(v, torch.dtype)},
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "BytesStorageMetadata", "ChunkStorageMetadata", "MetadataIndex", "StorageMeta",
        "TensorProperties", "TensorStorageMetadata", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.distributed.checkpoint.planner": {
        "SavePlan", "LoadPlan", "WriteItem", "ReadItem", "WriteItemType", "LoadItemType", "TensorWriteData",
    },
    "torch.serialization": {"_get_layout"},
    "collections": {"OrderedDict"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},  # StorageMeta.checkpoint_id
    "builtins": {"set", "frozenset", "object"},
    "copyreg": {"_reconstructor"},
}


class _DCPMetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _DCP_ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module.startswith("megatron.") and name.isidentifier():
            return _stand_in(f"{module}.{name}")[0]
        raise pickle.UnpicklingError(f"GLOBAL {module}.{name}")


def safe_load_dcp_metadata(path: str | Path) -> Any:
    """A torch_dist checkpoint's `.metadata` (DCP Metadata), unpickled with an allow-list — never pickle.load."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            return _DCPMetadataUnpickler(f).load()
    except pickle.UnpicklingError as e:
        m = _GLOBAL_RE.search(str(e))
        if m:
            _refuse(path, [m.group(1)])
        raise MConvertError(f"{path}: unreadable ({_short(e)}); the file is truncated or corrupt — re-copy it") from None
    except OSError as e:
        raise MConvertError(f"{path}: cannot read ({e.strerror}); check it exists and is readable") from None
    except Exception as e:  # EOFError, ValueError, ... from a damaged pickle
        raise MConvertError(f"{path}: unreadable ({_short(e)}); the file is truncated or corrupt — re-copy it") from None
