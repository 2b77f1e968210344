"""The restricted unpickler every pickle mconvert reads goes through first (`safeload` is its one caller).

An allow-list of globals alone does not stop a pickle from changing the process: BUILD on a shared object
(the `signal.SIGINT` member an allowed constructor returns, an allowed class itself) rebinds it for
everyone. So every pickle is first run by `_RestrictedUnpickler`: state reaches only objects this load
created and nothing else holds, calls reach only allow-listed constructors with the arguments a real save
writes, and sizes are bounded. Here too: the allow-list (`ALLOW_LIST`: the globals Megatron-LM checkpoints
carry), the stand-ins for classes whose modules are not installed (`StandIn`), the policies of torch files
and of DCP metadata, and the check pass over a torch file's pickles (`check_torch_pickle`).
"""

from __future__ import annotations

import argparse
import copyreg
import dataclasses
import functools
import io
import pathlib
import pickle
import re
import signal
import sys
import types
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mconvert.errors import MConvertError
from mconvert.io.crc import short_error


class StandIn:
    """Stand-in for a class from a module that is not installed (Megatron's enums, configs): keeps the data.

    An enum member `E.x` pickles as `E(value)`: `.value` gives it back. A dataclass pickles as its
    `__dict__`: the fields become attributes. It remembers how the pickle made it (a call or `__new__`, with
    which arguments, and the state it was given), so `__reduce_ex__` gives the same back and
    `io.repickle` writes it under the original class name: a re-saved checkpoint holds what it held."""

    # slots, not attributes: pickled state (which only ever updates `__dict__`) cannot forge them
    __slots__ = ("__dict__", "_made", "_state")

    def __new__(cls, *args: Any, **kwargs: Any) -> "StandIn":
        obj = super().__new__(cls)
        obj._made = ("new", args)  # NEWOBJ: `cls.__new__(cls, *args)`, no `__init__`
        return obj

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._made = ("call", args)  # REDUCE: `cls(*args)`
        self.args = args
        self.kwargs = kwargs

    @property
    def value(self) -> Any:
        args = self.__dict__.get("args") or (None,)
        return args[0]

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, dict):
            bad = [k for k in state if type(k) is not str or (k.startswith("__") and k.endswith("__"))]
            if bad:  # attribute data only: never a dunder, which would change what the object is
                raise pickle.UnpicklingError(f"stand-in state key {bad[0]!r}")
            self.__dict__.update(state)
        else:
            self.state = state
        self._state = state

    def __reduce_ex__(self, protocol: Any) -> tuple:
        """How the original object pickled: `cls(*args)` (an enum member) or `cls.__new__(cls, *args)` and
        then its state (a plain object, a dataclass)."""
        how, args = getattr(self, "_made", ("new", ()))
        cls = type(self)
        rv: tuple = (cls, args) if how == "call" else (copyreg.__newobj__, (cls, *args))
        state = getattr(self, "_state", None)
        return rv if state is None else (*rv, state)

    def inert_value(self) -> tuple[str, Any]:
        """What it holds, as data: ("enum", value) for an enum member (made as `E(value)`), else ("object",
        its attributes) for a data object."""
        how, args = getattr(self, "_made", ("new", ()))
        if how == "call" and len(args) == 1 and not self.__dict__.get("kwargs"):
            return "enum", args[0]
        return "object", {k: v for k, v in self.__dict__.items() if k not in ("args", "kwargs")}

    def __repr__(self) -> str:
        if "args" in self.__dict__:
            return f"{type(self).__name__}{self.args}"
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self.__dict__.items())})"


def _stand_in(qualname: str, module: str | None = None, name: str | None = None) -> tuple[type, str]:
    """A StandIn subclass for the global `module`.`name` (default: `qualname` split at its last dot), named
    exactly so: `io.repickle` writes its instances back under that name."""
    if module is None or name is None:
        module, name = qualname.rsplit(".", 1)
    cls = type(name.rsplit(".", 1)[-1], (StandIn,), {"__module__": module, "__qualname__": name,
                                                     "__slots__": ()})
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
MAX_DEPTH = 64  # nesting levels in one loaded object (Megatron files nest about 6 deep)
MAX_OBJECTS = 1_000_000  # entries of one loaded object, counted along every path (shared ones each time)


class _Refused(pickle.UnpicklingError):
    """A pickle program that would reach outside itself; the message is the reason, without the file."""


@dataclass(frozen=True)
class _Global:
    """One allow-listed global: what GLOBAL pushes and what REDUCE / NEWOBJ may run with it (None: a value
    that is never called). `check` refuses arguments a real save never writes (returns the reason)."""

    obj: Any
    call: Callable[..., Any] | None = None
    check: Callable[[tuple], str | None] | None = None


def _count_refs(obj: Any) -> int:
    return sys.getrefcount(obj)


def _refs_of_new() -> int:
    """What `_count_refs` reports for an object that only one local variable holds (interpreter-specific)."""
    obj = object()
    return _count_refs(obj)


_NEW_REFS = _refs_of_new() + 1  # + the parameter of `_is_new`


def _is_new(obj: Any) -> bool:
    """True when only the caller's local variable holds `obj`: a constructor made it just now (an enum member,
    a cached numpy dtype or any other shared object is held by its module as well)."""
    return _count_refs(obj) <= _NEW_REFS


def _state_keys_ok(state: Any) -> str | None:
    if not isinstance(state, dict):
        return f"state {type(state).__name__}, not a dict"
    for k in state:
        if type(k) is not str or (k.startswith("__") and k.endswith("__")):
            return f"state key {k!r}"
    return None


def _describe(obj: Any) -> str:
    """Name what an opcode targets, for the refusal line."""
    if isinstance(obj, type):
        return f"class {obj.__module__}.{obj.__qualname__}"
    if isinstance(obj, types.ModuleType):
        return f"module {obj.__name__}"
    if callable(obj) and hasattr(obj, "__qualname__"):
        return f"function {getattr(obj, '__module__', '?')}.{obj.__qualname__}"
    t = type(obj)
    return f"a {t.__module__}.{t.__qualname__} this file did not create"


def _ints(x: Any) -> bool:
    return isinstance(x, tuple) and all(type(i) is int for i in x)


_DTYPE_CODE = re.compile(r"[<>|=]?[a-zA-Z]\d{0,2}")


def _check_np_dtype(args: tuple) -> str | None:
    if not args or type(args[0]) is not str or not _DTYPE_CODE.fullmatch(args[0]) or "O" in args[0]:
        return f"numpy.dtype{args!r:.60} (only plain numeric dtypes load)"
    return None


def _check_reconstruct(args: tuple) -> str | None:
    import numpy as np

    if len(args) != 3 or args[0] is not np.ndarray or not _ints(args[1]) or type(args[2]) is not bytes:
        return "numpy _reconstruct with unusual arguments"
    return None


def _check_scalar(args: tuple) -> str | None:
    import numpy as np

    if len(args) != 2 or not isinstance(args[0], np.dtype) or args[0].hasobject or type(args[1]) is not bytes:
        return "numpy scalar of an object dtype"
    return None


def _check_all(kinds: tuple[type, ...]) -> Callable[[tuple], str | None]:
    def check(args: tuple) -> str | None:
        bad = [a for a in args if not isinstance(a, kinds)]
        return f"argument {type(bad[0]).__name__}" if bad else None

    return check


_INERT_LEAVES = (type(None), bool, int, float, str, bytes)


def _check_inert_args(args: tuple) -> str | None:
    """A class the unpickler knows only by name is made as an enum member (`E(value)`, one plain value) or a
    data object (`cls.__new__(cls)`, then its state): nothing else a save of megatron-core's enums and
    dataclasses writes."""
    if not args or (len(args) == 1 and (type(args[0]) in _INERT_LEAVES
                                        or (type(args[0]) is tuple and all(type(x) in _INERT_LEAVES
                                                                           for x in args[0])))):
        return None
    return "an unknown class called with arguments other than an enum value"


def _first_class(obj: Any, classes: set[int]) -> type | None:
    """The first of `classes` (by id) found as a value inside `obj` (each object visited once)."""
    seen: set[int] = set()
    todo = [obj]
    while todo:
        o = todo.pop()
        if id(o) in seen or type(o) in _INERT_LEAVES:
            continue
        seen.add(id(o))
        if isinstance(o, type):
            if id(o) in classes:
                return o
            continue
        if isinstance(o, dict):
            todo.extend(o.keys())
            todo.extend(o.values())
        elif isinstance(o, (list, tuple, set, frozenset)):
            todo.extend(o)
        d = getattr(o, "__dict__", None)
        if isinstance(d, dict):
            todo.extend(d.values())
        if isinstance(o, StandIn):
            todo.append(getattr(o, "_state", None))
    return None


def _no_args(args: tuple) -> str | None:
    return f"{len(args)} arguments" if args else None


def _check_bytearray(args: tuple) -> str | None:
    # bytes or (str, encoding) as pickle writes it; never a size, which would allocate that much
    return None if all(isinstance(a, (bytes, str)) for a in args) else "bytearray of a size"


def _check_encode(args: tuple) -> str | None:
    return None if len(args) == 2 and type(args[0]) is str and args[1] in ("latin1", "latin-1") else "codec"


def _check_reconstructor(args: tuple) -> str | None:
    if len(args) != 3 or args[1] is not object or args[2] is not None or not isinstance(args[0], type):
        return "copyreg._reconstructor of anything but a plain object"
    return None


class _TensorStub:
    """What a tensor rebuild function returns during the check pass (the data is not read)."""


def _stub_storage(pid: Any) -> Any:
    if type(pid) is not tuple or not pid or pid[0] not in ("storage", b"storage"):
        raise _Refused(f"persistent id {pid!r:.60} (only tensor storages load)")
    return _TensorStub()


def _hooks_ok(hooks: Any) -> bool:
    return isinstance(hooks, dict) and not hooks  # torch.save never writes backward hooks


def _tensor_stubs() -> dict[str, _Global]:
    """torch's tensor rebuild functions as checked stand-ins: right argument kinds, no hooks, state only as
    attribute dicts, `_rebuild_from_type_v2` only around another rebuild function and a tensor class."""
    T = _TensorStub

    def state_ok(state: Any) -> bool:
        if state is None:
            return True
        if isinstance(state, tuple) and len(state) == 2:
            return all(s is None or _state_keys_ok(s) is None for s in state)
        return _state_keys_ok(state) is None

    def v2(storage, offset, size, stride, requires_grad, hooks, *rest):  # noqa: ANN001, ANN002
        if not (isinstance(storage, T) and type(offset) is int and _ints(tuple(size)) and _ints(tuple(stride))
                and _hooks_ok(hooks) and len(rest) <= 2):
            raise _Refused("tensor rebuild with unusual arguments")
        return T()

    def v1(storage, offset, size, stride):  # noqa: ANN001
        return v2(storage, offset, size, stride, False, {})

    def param(data, requires_grad, hooks, state=None):  # noqa: ANN001
        if not isinstance(data, T) or not _hooks_ok(hooks) or not state_ok(state):
            raise _Refused("parameter rebuild with unusual arguments")
        return T()

    def from_numpy(data, dtype, device, requires_grad):  # noqa: ANN001
        return T()

    tensor_fns = {"_rebuild_tensor": v1, "_rebuild_tensor_v2": v2, "_rebuild_tensor_v3": v2,
                  "_rebuild_parameter": param, "_rebuild_parameter_with_state": param,
                  "_rebuild_device_tensor_from_numpy": from_numpy,
                  "_rebuild_device_tensor_from_cpu_tensor": from_numpy}
    out = {f"torch._utils.{n}": _Global(getattr(torch._utils, n), fn) for n, fn in tensor_fns.items()}
    inner = {id(g.obj): g.call for g in out.values()}

    def from_type(func, new_type, args, state):  # noqa: ANN001
        fn = inner.get(id(func))
        if fn is None or new_type not in (torch.Tensor, torch.nn.Parameter) or type(args) is not tuple \
                or not state_ok(state):
            raise _Refused(f"_rebuild_from_type_v2 around {_describe(func)}")
        return fn(*args)

    out["torch._tensor._rebuild_from_type_v2"] = _Global(torch._tensor._rebuild_from_type_v2, from_type)
    return out


@functools.lru_cache(maxsize=1)
def _torch_check_policy() -> dict[str, _Global]:
    """The globals the check pass of a torch file accepts: ALLOW_LIST plus torch's own defaults, with tensor
    rebuilding replaced by stubs. Broader than what a weights-only load allows is impossible: torch then
    loads the same file with its own (larger) list and ALLOW_LIST, so this list only narrows it."""
    from torch._weights_only_unpickler import _get_allowed_globals

    pol: dict[str, _Global] = {}
    for name, obj in _get_allowed_globals().items():
        if not name.startswith("torch._utils._rebuild") and name != "torch._tensor._rebuild_from_type_v2":
            pol[name] = _Global(obj)  # dtypes, storage types, tensor classes: values
    calls: dict[str, Callable[[tuple], str | None] | None] = {
        "collections.OrderedDict": _no_args, "collections.Counter": _check_all((dict,)),
        "torch.Size": lambda a: None if len(a) == 1 and _ints(tuple(a[0])) else "torch.Size of non-integers",
        "torch.device": _check_all((str, int)), "torch.serialization._get_layout": _check_all((str,)),
        "_codecs.encode": _check_encode, "builtins.bytearray": _check_bytearray,
        "builtins.complex": _check_all((int, float)), "builtins.set": None, "builtins.frozenset": None,
        "argparse.Namespace": _no_args, "types.SimpleNamespace": _no_args,
        "_io.BytesIO": _check_all((bytes,)), "io.BytesIO": _check_all((bytes,)),
        "pathlib.PosixPath": _check_all((str,)), "signal.Signals": _check_all((int,)),
        "numpy.dtype": _check_np_dtype,
    }
    for name, entry in ALLOW_LIST.items():
        obj = entry[0] if isinstance(entry, tuple) else entry
        if name.endswith("multiarray._reconstruct"):
            pol[name] = _Global(obj, obj, _check_reconstruct)
        elif name.endswith("multiarray.scalar"):
            pol[name] = _Global(obj, obj, _check_scalar)
        elif isinstance(obj, type) and issubclass(obj, StandIn):
            pol[name] = _Global(obj, obj)
        else:
            pol[name] = _Global(obj)
    for name, check in calls.items():
        pol[name] = _Global(pol[name].obj, pol[name].obj, check)
    pol.update(_tensor_stubs())
    return pol


def _state_rule(cls: type) -> str | None:
    """How BUILD gives state to a fresh instance of `cls`: 'dict' (attributes), 'setstate' (the class's own,
    data-only `__setstate__`), or None (never)."""
    import numpy as np

    if cls in (argparse.Namespace, types.SimpleNamespace, OrderedDict, Counter):
        return "dict"
    if issubclass(cls, StandIn) or cls in (io.BytesIO, np.ndarray) or issubclass(cls, np.dtype):
        return "setstate"
    if dataclasses.is_dataclass(cls) and cls.__module__.startswith("torch.distributed.checkpoint."):
        return "setstate" if "__setstate__" in vars(cls) else "dict"  # DCP's TensorProperties has its own
    return None


def _check_setstate(inst: Any, state: Any) -> str | None:
    """Arguments of the data-only `__setstate__`s: an ndarray's raw bytes (never a list of objects), a
    plain dtype, a BytesIO's bytes."""
    import numpy as np

    if isinstance(inst, np.ndarray):
        ok = (isinstance(state, tuple) and len(state) == 5 and _ints(state[1]) and isinstance(state[2], np.dtype)
              and not state[2].hasobject and type(state[4]) is bytes)
        return None if ok else "ndarray state that is not raw bytes"
    if isinstance(inst, np.dtype):
        ok = isinstance(state, tuple) and len(state) == 8 and state[2:5] == (None, None, None)
        return None if ok else "structured or object dtype state"
    if isinstance(inst, io.BytesIO):
        ok = isinstance(state, tuple) and len(state) == 3 and type(state[0]) is bytes and \
            (state[2] is None or _state_keys_ok(state[2]) is None)
        return None if ok else "BytesIO state"
    if isinstance(inst, StandIn) and isinstance(state, dict):
        return _state_keys_ok(state)
    return None


_ITEMS = {"SETITEM": (dict, OrderedDict, Counter), "SETITEMS": (dict, OrderedDict, Counter),
          "APPEND": (list,), "APPENDS": (list,), "ADDITEMS": (set,)}


class _RestrictedUnpickler(pickle._Unpickler):  # type: ignore[name-defined]
    """Python's own unpickler with every opcode that calls or mutates replaced: GLOBAL only from `policy`,
    REDUCE / NEWOBJ only of its constructors, BUILD / SETITEM(S) / APPEND(S) / ADDITEMS only into objects
    this load created and nothing else holds (each BUILD once, last), no INST / OBJ / EXT / persistent ids
    (unless `persistent` is given). Tuples are bounded in depth and size as they are made, since hashing
    one as a dict key walks all of it."""

    def __init__(self, file: Any, policy: dict[str, _Global], persistent: Callable[[Any], Any] | None = None,
                 stand_ins: str | None = None) -> None:
        super().__init__(file)
        self._policy = policy
        self._by_id = {id(g.obj): g for g in policy.values()}
        self._persistent = persistent
        self._stand_ins = stand_ins
        self.inert: dict[str, type] = {}  # stand-ins made for globals under `stand_ins`, by name
        self._fresh: dict[int, Any] = {}  # id -> object: created by this load, nothing else holds it
        self._size: dict[int, tuple[int, int]] = {}  # id -> (entries, depth) of tuples / built objects

    def load(self) -> Any:
        obj = super().load()
        if self.inert:
            bare = _first_class(obj, set(map(id, self.inert.values())))
            if bare is not None:  # named, not made: a callable in the data, never an enum or data object
                raise _Refused(f"{_describe(bare)} as a value (only its enum members or data objects load)")
        return obj

    # -- bookkeeping
    def _made(self, obj: Any) -> Any:
        self._fresh[id(obj)] = obj
        return obj

    def _target(self, op: str, kinds: tuple[type, ...] | None = None) -> Any:
        obj = self.stack[-1]
        if self._fresh.get(id(obj)) is not obj or (kinds is not None and type(obj) not in kinds):
            raise _Refused(f"{op} into {_describe(obj)}")
        return obj

    def _measure(self, obj: Any, items: Any) -> None:
        n, d = 1, 1
        for x in items:
            xn, xd = self._size.get(id(x), (1, 0))
            n, d = n + xn, max(d, xd + 1)
        if d > MAX_DEPTH:
            raise _Refused(f"nesting deeper than {MAX_DEPTH}")
        if n > MAX_OBJECTS:
            raise _Refused(f"more than {MAX_OBJECTS} objects")
        self._size[id(obj)] = (n, d)

    def _global(self, module: str, name: str) -> Any:
        qual = f"{module}.{name}"
        g = self._policy.get(qual)
        if g is None and self._stand_ins and module.startswith(self._stand_ins) \
                and all(p.isidentifier() for p in qual.split(".")):
            cls = _stand_in(qual, module, name)[0]
            g = self._policy[qual] = _Global(cls, cls, _check_inert_args)
            self._by_id[id(cls)] = g
        if g is not None and g.check is _check_inert_args:
            self.inert[qual] = g.obj
        if g is None:
            raise _Refused(f"GLOBAL {qual}")
        return g.obj

    def _call(self, op: str, func: Any, args: Any, new: bool) -> Any:
        g = self._by_id.get(id(func))
        if g is None or g.obj is not func or g.call is None or (new and g.call is not func):
            raise _Refused(f"{op} of {_describe(func)}")
        if type(args) is not tuple:
            raise _Refused(f"{op} with arguments {type(args).__name__}")
        why = g.check(args) if g.check else None
        if why:
            raise _Refused(f"{op}: {why}")
        obj = func.__new__(func, *args) if new else g.call(*args)
        if _is_new(obj):
            self._fresh[id(obj)] = obj
        return obj

    # -- opcodes
    def load_global(self) -> None:
        module = self.readline()[:-1].decode("utf-8")
        name = self.readline()[:-1].decode("utf-8")
        self.append(self._global(module, name))

    def load_stack_global(self) -> None:
        name, module = self.stack.pop(), self.stack.pop()
        if type(name) is not str or type(module) is not str:
            raise _Refused("STACK_GLOBAL of a non-string")
        self.append(self._global(module, name))

    def load_reduce(self) -> None:
        args = self.stack.pop()
        self.stack[-1] = self._call("REDUCE", self.stack[-1], args, new=False)

    def load_newobj(self) -> None:
        args = self.stack.pop()
        self.stack[-1] = self._call("NEWOBJ", self.stack[-1], args, new=True)

    def load_newobj_ex(self) -> None:
        kwargs, args = self.stack.pop(), self.stack.pop()
        if kwargs:
            raise _Refused("NEWOBJ_EX with keyword arguments")
        self.stack[-1] = self._call("NEWOBJ_EX", self.stack[-1], args, new=True)

    def load_build(self) -> None:
        state = self.stack.pop()
        inst = self._target("BUILD")
        rule = _state_rule(type(inst))
        why = None if rule else "a type that takes no state"
        if rule == "dict":
            why = _state_keys_ok(state)
        elif rule == "setstate":
            why = _check_setstate(inst, state)
        if why:
            raise _Refused(f"BUILD of {type(inst).__module__}.{type(inst).__qualname__} ({why})")
        if rule == "dict":
            inst.__dict__.update(state)
            self._measure(inst, state.values())
        else:
            type(inst).__setstate__(inst, state)
            self._measure(inst, state if isinstance(state, tuple) else ())
        del self._fresh[id(inst)]  # state comes once, last: the object is sealed

    def load_setitem(self) -> None:
        value, key = self.stack.pop(), self.stack.pop()
        self._target("SETITEM", _ITEMS["SETITEM"])[key] = value

    def load_setitems(self) -> None:
        items = self.pop_mark()
        d = self._target("SETITEMS", _ITEMS["SETITEMS"])
        for i in range(0, len(items), 2):
            d[items[i]] = items[i + 1]

    def load_append(self) -> None:
        value = self.stack.pop()
        self._target("APPEND", _ITEMS["APPEND"]).append(value)

    def load_appends(self) -> None:
        items = self.pop_mark()
        self._target("APPENDS", _ITEMS["APPENDS"]).extend(items)

    def load_additems(self) -> None:
        items = self.pop_mark()
        s = self._target("ADDITEMS", _ITEMS["ADDITEMS"])
        for x in items:
            s.add(x)

    def load_empty_dictionary(self) -> None:
        self.append(self._made({}))

    def load_empty_list(self) -> None:
        self.append(self._made([]))

    def load_empty_set(self) -> None:
        self.append(self._made(set()))

    def load_dict(self) -> None:
        items = self.pop_mark()
        d = self._made({})
        for i in range(0, len(items), 2):
            d[items[i]] = items[i + 1]
        self.append(d)

    def load_list(self) -> None:
        items = self.pop_mark()  # before `self.append` is looked up: pop_mark rebinds it
        self.append(self._made(items))

    def _tuple(self, items: list) -> tuple:
        t = tuple(items)
        self._measure(t, t)
        return t

    def load_tuple(self) -> None:
        t = self._tuple(self.pop_mark())
        self.append(t)

    def load_empty_tuple(self) -> None:
        self.append(())

    def load_tuple1(self) -> None:
        self.stack[-1] = self._tuple([self.stack[-1]])

    def load_tuple2(self) -> None:
        self.stack[-2:] = [self._tuple(self.stack[-2:])]

    def load_tuple3(self) -> None:
        self.stack[-3:] = [self._tuple(self.stack[-3:])]

    def load_frozenset(self) -> None:
        items = self.pop_mark()
        f = frozenset(items)
        self._measure(f, items)
        self.append(f)

    def load_binpersid(self) -> None:
        pid = self.stack.pop()
        if self._persistent is None:
            raise _Refused("persistent id")
        self.append(self._persistent(pid))

    dispatch: dict[int, Any] = {}


def _refuse_op(op: str) -> Callable[[_RestrictedUnpickler], None]:
    def refuse(_self: _RestrictedUnpickler) -> None:
        raise _Refused(f"opcode {op}")

    return refuse


def _build_dispatch() -> dict[int, Any]:
    base = dict(pickle._Unpickler.dispatch)  # type: ignore[attr-defined]
    U = _RestrictedUnpickler
    table: dict[int, Any] = {}
    for code in range(256):
        table[code] = base.get(code)
    names = {
        pickle.GLOBAL: U.load_global, pickle.STACK_GLOBAL: U.load_stack_global, pickle.REDUCE: U.load_reduce,
        pickle.NEWOBJ: U.load_newobj, pickle.NEWOBJ_EX: U.load_newobj_ex, pickle.BUILD: U.load_build,
        pickle.SETITEM: U.load_setitem, pickle.SETITEMS: U.load_setitems, pickle.APPEND: U.load_append,
        pickle.APPENDS: U.load_appends, pickle.ADDITEMS: U.load_additems,
        pickle.EMPTY_DICT: U.load_empty_dictionary, pickle.EMPTY_LIST: U.load_empty_list,
        pickle.EMPTY_SET: U.load_empty_set, pickle.DICT: U.load_dict, pickle.LIST: U.load_list,
        pickle.TUPLE: U.load_tuple, pickle.EMPTY_TUPLE: U.load_empty_tuple, pickle.TUPLE1: U.load_tuple1,
        pickle.TUPLE2: U.load_tuple2, pickle.TUPLE3: U.load_tuple3, pickle.FROZENSET: U.load_frozenset,
        pickle.BINPERSID: U.load_binpersid,
    }
    for op, fn in names.items():
        table[op[0]] = fn
    refused = {"INST": pickle.INST, "OBJ": pickle.OBJ, "PERSID": pickle.PERSID, "EXT1": pickle.EXT1,
               "EXT2": pickle.EXT2, "EXT4": pickle.EXT4}
    for name, op in refused.items():
        table[op[0]] = _refuse_op(name)
    for code, fn in table.items():
        if fn is None:
            table[code] = _refuse_op(f"0x{code:02x}")
    return table


_RestrictedUnpickler.dispatch = _build_dispatch()


# ---- torch.distributed.checkpoint `.metadata` ------------------------------------------------------------
# torch's FileSystemReader.read_metadata() is a bare pickle.load: a torch_dist checkpoint's `.metadata` could
# run code. It is read by the restricted unpickler instead, with globals limited to DCP's own dataclasses,
# torch.Size and dtypes (megatron's planner classes get data-only stand-ins).
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


@functools.lru_cache(maxsize=1)
def dcp_policy() -> dict[str, _Global]:
    """`_DCP_ALLOWED` resolved: DCP's dataclasses and enums, torch.Size, dtypes and paths are constructors;
    `builtins.object` only ever the base argument of `copyreg._reconstructor`."""
    import importlib

    checks: dict[str, Callable[[tuple], str | None]] = {
        "torch.Size": lambda a: None if len(a) == 1 and _ints(tuple(a[0])) else "torch.Size of non-integers",
        "copyreg._reconstructor": _check_reconstructor, "torch.serialization._get_layout": _check_all((str,)),
        "collections.OrderedDict": _no_args,
    }
    pol: dict[str, _Global] = {}
    for module, names in _DCP_ALLOWED.items():
        mod = importlib.import_module(module)
        for name in names:
            obj, qual = getattr(mod, name), f"{module}.{name}"
            if isinstance(obj, torch.dtype) or qual == "builtins.object":
                pol[qual] = _Global(obj)
            elif qual.startswith("pathlib."):
                pol[qual] = _Global(obj, obj, _check_all((str,)))
            else:
                pol[qual] = _Global(obj, obj, checks.get(qual))
    return pol


LEGACY_PICKLES = 5  # legacy torch.save: magic number, protocol, sys info, the object, its storage keys


def zip_record(path: Path, name: str) -> bytes:
    """One record of a torch zip, read by the reader torch.load itself uses (same entry, same prefix rules)."""
    try:
        return bytes(torch._C.PyTorchFileReader(str(path)).get_record(name))
    except Exception as e:  # truncated central directory, no data.pkl, ...
        raise MConvertError(
            f"{path}: not a readable torch checkpoint ({short_error(e)}); the file is truncated or corrupt — re-copy it"
        ) from None


def check_torch_pickle(path: str | Path, blobs: list[bytes], pickles: int = 1) -> dict[str, type]:
    """Run the pickle program(s) of a torch file through the restricted unpickler with tensors stubbed, before
    torch's weights-only unpickler runs them for real: only `_torch_check_policy` globals and constructors,
    state only into fresh objects of allowed types, tuples bounded. Each blob holds `pickles` pickles.

    A class under `megatron.` that ALLOW_LIST does not name (a newer megatron-core's enum or dataclass in
    `args`) gets an inert stand-in (`StandIn`: its name, value and state; the class is never imported) when
    it is only made as an enum member or a data object; returns those stand-ins by name, for the load pass."""
    path = Path(path)
    policy = _torch_check_policy()
    inert: dict[str, type] = {}
    for blob in blobs:
        f = io.BytesIO(blob)
        for _ in range(pickles):
            inert.update(restricted_unpickle(path, f, policy, persistent=_stub_storage, stand_ins="megatron.",
                                   inert=True)[1])
    return inert


def _refusal(path: Path, reason: str) -> MConvertError:
    """The one line for a refused pickle program: a global by name, a limit, or the opcode and its target."""
    if reason.startswith("GLOBAL "):
        return MConvertError(
            f"{path}: refuses to unpickle global {reason[7:]!r} (not on mconvert's allow-list); "
            "this file may run code when loaded — do not load it with weights_only=False"
        )
    if reason.startswith(("nesting deeper", "more than")):
        return MConvertError(f"{path}: {reason} in one pickled object; no checkpoint has that — "
                             "the file is crafted or corrupt, re-copy it")
    return MConvertError(f"{path}: refuses to unpickle {reason}; a checkpoint never needs it — the file is "
                         "crafted or corrupt (do not load it with weights_only=False)")


def restricted_unpickle(path: Path, f: Any, policy: dict[str, _Global], persistent: Callable[[Any], Any] | None = None,
              stand_ins: str | None = None, inert: bool = False) -> Any:
    """The object `f` pickles (with, when `inert`, the stand-ins made for it by name)."""
    try:
        u = _RestrictedUnpickler(f, policy, persistent, stand_ins)
        obj = u.load()
        return (obj, u.inert) if inert else obj
    except _Refused as e:
        raise _refusal(path, str(e)) from None
    except MConvertError:
        raise
    except Exception as e:  # EOFError, ValueError, TypeError, ... from a damaged pickle
        raise MConvertError(f"{path}: unreadable ({short_error(e)}); the file is truncated or corrupt — re-copy it") from None
