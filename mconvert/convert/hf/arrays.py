"""An HF directory of safetensors files read as numpy arrays, for a writer that takes arrays (`hf-to-gguf`):
no torch in the process. The opening and its refusals are `HFDirectory`'s, each tensor's checks `HFSource`'s
(`HFDirectory.check_values`); bfloat16 comes as its raw bits (`io.safetensors_arrays.BF16_BITS`). A directory
this does not read (pytorch_model*.bin, a quantization_config) is `HFSource`'s (`readable`)."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from mconvert.convert.base import Unit, pmap
from mconvert.convert.hf.directory import INDEX, HFDirectory, read_weight_map
from mconvert.io.paths import inside_file, load_json_object
from mconvert.io.safetensors_arrays import Meta, SafetensorsArrays
from mconvert.errors import MConvertError
from mconvert.spec import comes_whole

FINITE_SLICE = 1 << 20  # values checked at once: one slice's bit mask stays in the core's cache
# IEEE exponent bits of the 16-bit floats: all set is Inf or NaN
EXPONENT_BITS = {"float16": 0x7C00, "bfloat16": 0x7F80}
_MASK = threading.local()  # each reading thread's working mask of FINITE_SLICE values


def readable(path: Path) -> bool:
    """Whether `HFArrays` reads this HF directory: safetensors weight files only (as the index names them or as
    listed), a config.json without `quantization_config` (block-scaled FP8 is dequantized by `HFSource`). What
    is malformed is left to `HFSource`, whose refusals name it."""
    try:
        cfg = load_json_object(inside_file(path, "config.json", f"{path}: config"), "config", "")
        if "quantization_config" in cfg:
            return False
        if os.path.lexists(path / INDEX):
            files = set(read_weight_map(inside_file(path, INDEX, f"{path}: index")).values())
        else:
            files = {p.name for p in path.glob("*.safetensors")}
    except MConvertError:
        return False
    return bool(files) and all(f.endswith(".safetensors") for f in files)


def all_finite(a: np.ndarray, dtype: str) -> bool:
    """No NaN/Inf in `a`: a 16-bit float's exponent bits (its raw bits; bfloat16 comes as them) short of all
    set, a slice at a time; a wider float's min and max finite (a NaN propagates into both)."""
    if not a.size:
        return True
    top = EXPONENT_BITS.get(dtype)
    if top is None:
        return bool(np.isfinite(a.min()) and np.isfinite(a.max()))
    bits = a.reshape(-1).view(np.uint16)
    mask = getattr(_MASK, "buf", None)
    if mask is None or mask.size < FINITE_SLICE:  # kept per reading thread: a new one is fresh pages per tensor
        mask = _MASK.buf = np.empty(FINITE_SLICE, dtype=np.uint16)
    for i in range(0, bits.size, FINITE_SLICE):
        part = bits[i:i + FINITE_SLICE]
        m = mask[:part.size]
        np.bitwise_and(part, 0x7FFF, out=m)
        if m.max() >= top:
            return False
    return True


class HFArrays(HFDirectory):
    """An HF safetensors directory read one unit at a time as numpy arrays (see the module)."""

    splits_experts = True  # an MoE layer read as its dense part and one unit per expert (`HFDirectory._keys`)

    def __init__(self, path: Path, tokenizer: str | Path | None = None) -> None:
        cfg_path = self._open(path, tokenizer)
        self._files: dict[str, SafetensorsArrays] = {}
        self.key_file = self._index()
        for k, f in self.key_file.items():
            if not f.endswith(".safetensors"):
                raise MConvertError(f"{self.path / f}: not a safetensors file (tensor {k!r})")
            m = self._meta(k)
            if m is not None and m.dtype.name == "float8_e4m3fn":
                raise MConvertError(f"{self.path / f}: tensor {k!r} is float8_e4m3fn but config.json has no "
                                    "block-scaled FP8 quantization_config; its scales are unknown — fix config.json")
        self._check_layout(cfg_path)

    def _st(self, f: str) -> SafetensorsArrays:
        if f not in self._files:
            self._files[f] = SafetensorsArrays(self.path / f)
        return self._files[f]

    def _keys_of(self, f: str) -> list[str]:
        return self._st(f).keys()

    def _meta(self, k: str) -> Meta | None:
        st = self._st(self.key_file[k])
        return st.meta(k) if k in st.entries else None

    def can_preview(self) -> bool:
        return True

    def read_hf(self, unit: Unit, only: set[str] | None = None) -> dict[str, np.ndarray]:  # type: ignore[override]
        """HF tensors of one unit as stored (true vocab), each checked; several read at once on the readers'
        pool (pread and numpy's reductions release the GIL). `only`: just these keys of the unit."""
        keys = [k for k in self._keys(unit) if only is None or k in only]
        for k in keys:
            if self._meta(k) is None:
                raise MConvertError(f"{self.path / self.key_file[k]}: tensor {k!r} is missing (the index lists it "
                                    "there)")
        out = dict(zip(keys, pmap(self._checked, keys)))
        if unit == "final" and self.spec.tie_embeddings:
            out.pop("lm_head.weight", None)
        return out

    def read_hf_parts(self, unit: Unit, only: set[str] | None = None) -> Iterator[dict[str, np.ndarray]]:  # type: ignore[override]
        """`read_hf(unit)` in parts: a unit whole, but the final unit of a model whose MTP layers route over
        experts (`spec.comes_whole`) a parameter's HF tensors at a time, as the memory pre-check counts it
        (`HFDirectory._held_keys`; memory: one expert). `only`: the keys a writer keeps; the others are not
        read."""
        keys = [k for k in self._keys(unit) if only is None or k in only]
        if unit != "final" or comes_whole(self.spec, unit):
            yield self.read_hf(unit, set(keys))
            return
        for part in self._held_keys(unit, keys).values():
            if part:
                yield self.read_hf(unit, set(part))

    def _checked(self, k: str) -> np.ndarray:
        st = self._st(self.key_file[k])
        row = st.meta(k).dtype
        a = st.get(k)
        self.check_values(k, row.name, row.name == "float8_e4m3fn", row.floating, lambda: all_finite(a, row.name))
        return a

    def close(self) -> None:
        for st in self._files.values():
            st.close()
        self._files = {}
