"""Pickling what `safeload` read: its stand-ins go back under their original class names.

`safe_load` reads classes it may not import (Megatron's enums in `args`, its config dataclasses) as
`unpickler.StandIn` objects. Python's pickler cannot write those: it checks every class it names by importing
its module, which is not installed (or is, and holds a different class), and importing it would run foreign
code. This module is a `pickle_module` for `torch.save` whose pickler writes each stand-in class as the global
it was read from, without importing anything, and each instance as the original pickled it (`StandIn.__reduce_ex__`):
`E(value)` for an enum member, NEWOBJ and its state for an object. A re-saved checkpoint so holds exactly the
globals and values the source held — Megatron-LM reads its args back, `safe_load` reads them as before.

Objects without stand-ins go through Python's C pickler untouched (the same bytes as `torch.save`); only a
pickle that meets a stand-in is written again by the pure-Python pickler, whose `save_global` can be taught.
"""

from __future__ import annotations

import io
import pickle
import sys
from pathlib import Path
from typing import IO, Any

import torch

from mconvert.io.unpickler import StandIn


def _is_stand_in(obj: Any) -> bool:
    return isinstance(obj, StandIn) or (isinstance(obj, type) and issubclass(obj, StandIn))


class _MetStandIn(Exception):
    """The C pickler reached a stand-in: the pure-Python pickler writes this object instead."""


class Pickler:
    """`pickle.Pickler`'s interface (`torch.save` subclasses it and overrides `persistent_id`, callers may
    override `reducer_override`): the C pickler, or the pure-Python one with stand-ins named as read."""

    def __init__(self, file: IO[bytes], protocol: int | None = None) -> None:
        self._file = file
        self._protocol = protocol

    def persistent_id(self, obj: Any) -> Any:
        return None

    def reducer_override(self, obj: Any) -> Any:
        return NotImplemented

    def dump(self, obj: Any) -> None:
        """Pickle `obj` into the file; the output goes to the file only once complete, so the second try
        (after the C pickler met a stand-in) starts from nothing. torch's `persistent_id` gives each storage
        the same key on both tries."""
        buf = io.BytesIO()
        try:
            _CPickler(buf, self._protocol, self).dump(obj)
        except _MetStandIn:
            buf = io.BytesIO()
            _StandInPickler(buf, self._protocol, self).dump(obj)
        self._file.write(buf.getbuffer())


class _CPickler(pickle.Pickler):
    def __init__(self, file: IO[bytes], protocol: int | None, outer: Pickler) -> None:
        super().__init__(file, protocol)
        self._outer = outer

    def persistent_id(self, obj: Any) -> Any:
        return self._outer.persistent_id(obj)

    def reducer_override(self, obj: Any) -> Any:
        if _is_stand_in(obj):
            raise _MetStandIn
        return self._outer.reducer_override(obj)


class _StandInPickler(pickle._Pickler):  # type: ignore[name-defined,misc]
    """Python's own pickler, writing a StandIn class as the global `module.qualname` it stands for."""

    def __init__(self, file: IO[bytes], protocol: int | None, outer: Pickler) -> None:
        super().__init__(file, protocol)
        self._outer = outer

    def persistent_id(self, obj: Any) -> Any:
        return self._outer.persistent_id(obj)

    def reducer_override(self, obj: Any) -> Any:
        return self._outer.reducer_override(obj)

    def save_global(self, obj: Any, name: str | None = None) -> None:
        if not (isinstance(obj, type) and issubclass(obj, StandIn)):
            return super().save_global(obj, name)
        module, qual = obj.__module__, name or obj.__qualname__
        if self.proto >= 4:  # as pickle writes any global: STACK_GLOBAL from 4 on, GLOBAL before
            self.save(module)
            self.save(qual)
            self.write(pickle.STACK_GLOBAL)
        else:
            self.write(pickle.GLOBAL + module.encode("utf-8") + b"\n" + qual.encode("utf-8") + b"\n")
        self.memoize(obj)
        return None


def dump(obj: Any, file: IO[bytes], protocol: int | None = None) -> None:
    """`pickle.dump` with stand-ins written under their original names (torch's legacy format calls it)."""
    Pickler(file, protocol).dump(obj)


def save(obj: Any, f: str | Path | IO[bytes]) -> None:
    """`torch.save(obj, f)`, also when `obj` holds stand-ins that `safe_load` read (args enums, configs)."""
    torch.save(obj, f, pickle_module=sys.modules[__name__])
