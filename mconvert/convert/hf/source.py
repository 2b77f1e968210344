"""HuggingFace directories: a Source reading safetensors (or pytorch_model*.bin) one unit at a time."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from mconvert import dtypes as dtype_table
from mconvert.convert.hf import fp8
from mconvert.convert.hf.directory import HFDirectory
from mconvert.convert.base import LayerParts, PartTasks, Unit, param_elements, pmap
from mconvert.io import buffers
from mconvert.io.paths import open_regular
from mconvert.io.safeload import safe_load
from mconvert.io.casts import all_finite
from mconvert.io.safetensors import SafetensorsReader
from mconvert.io.torchsave import LazyModel, TensorIndex
from mconvert.errors import MConvertError
from mconvert.io.transpose import copy_transposed
from mconvert.mappings import from_hf
from mconvert.mappings.plugin import (from_hf_one, hf_keys_for, hf_registry, mcore_row_plan, plugin_for, registry,
                                      transposed_in_hf)
from mconvert.mappings.wildcards import fill

# A tensor read transposed goes through one reused block of about this size: big enough that each row of the
# transposed result takes a run of a few hundred bytes at once, small enough to stay in the cache
TRANSPOSE_BLOCK = 4 << 20
class HFSource(HFDirectory, LayerParts):
    """An HF model directory (config.json + safetensors / pytorch_model*.bin), read one unit at a time."""

    splits_experts = True

    def __init__(self, path: Path, tokenizer: str | Path | None = None) -> None:
        cfg_path = self._open(path, tokenizer)
        self._bin_cache: tuple[str, Any] | None = None
        # block-scaled FP8: its e4m3 weights are read dequantized into `dequant_dtype`, the scales beside them
        self.fp8_block = fp8.block_config(self.config, str(cfg_path))
        self.dequant_dtype = dtype_table.lookup(self.spec.params_dtype).torch  # type: ignore[union-attr]
        self.key_file = self._index()
        self.scale_file = {k: self.key_file.pop(k) for k in list(self.key_file)
                           if self.fp8_block and k.endswith(fp8.SCALE_SUFFIX)}
        self._check_fp8()
        self._check_layout(cfg_path)

    def _check_fp8(self) -> None:
        """Every e4m3 weight has its scale of the block layout's shape and every scale its e4m3 weight
        (headers only); an e4m3 tensor without a block-scaled `quantization_config` is refused: cast as it is,
        it would be garbage."""
        for k, f in self.key_file.items():
            m = self._raw_meta(k)
            if m is None or m.dtype != fp8.FP8:
                continue
            where = f"{self.path / f}: tensor {k!r}"
            if self.fp8_block is None:
                raise MConvertError(f"{where} is float8_e4m3fn but config.json has no block-scaled FP8 "
                                    "quantization_config; its scales are unknown — fix config.json")
            scale = self.scale_file.get(k + fp8.SCALE_SUFFIX)
            sm = self._raw_meta(k + fp8.SCALE_SUFFIX, scale) if scale is not None else None
            if sm is None:
                raise MConvertError(f"{where} is FP8 without its {k + fp8.SCALE_SUFFIX!r}; the checkpoint is incomplete")
            want = fp8.scale_shape(tuple(m.shape), self.fp8_block) if m.dim() == 2 else None
            if want is None or tuple(sm.shape) != want or not sm.dtype.is_floating_point:
                raise MConvertError(f"{where}: FP8 {list(m.shape)} with a {sm.dtype} scale of {list(sm.shape)}; "
                                    f"blocks of {list(self.fp8_block)} need a float scale of "
                                    f"{list(want) if want else '[2-D]'} — the checkpoint is damaged")
        for k, f in self.scale_file.items():
            w = k[: -len(fp8.SCALE_SUFFIX)]
            m = self._raw_meta(w) if w in self.key_file else None
            if m is None or m.dtype != fp8.FP8:
                raise MConvertError(f"{self.path / f}: scale {k!r} has no FP8 weight {w!r} beside it; the "
                                    "checkpoint is damaged or mixed — re-copy it")

    def _raw_meta(self, k: str, f: str | None = None) -> torch.Tensor | None:
        """Tensor `k` as stored (an e4m3 weight as e4m3), from its safetensors header; None otherwise."""
        f = f or self.key_file[k]
        if not f.endswith(".safetensors"):
            return None
        st = self._st(f)
        return SafetensorsReader.meta(st, k) if k in st.entries else None

    def dequantize_to(self, dtype: torch.dtype) -> None:
        """Dequantize block-scaled FP8 weights into `dtype` (bf16 or fp32 out), not the config's torch_dtype."""
        self.dequant_dtype = dtype

    def _scale(self, k: str) -> torch.Tensor:
        """The float32 scales of e4m3 weight `k` (from whichever file holds them)."""
        key = k + fp8.SCALE_SUFFIX
        return SafetensorsReader.get(self._st(self.scale_file[key]), key).float()

    def _keys_of(self, f: str) -> list[str]:
        if f.endswith(".safetensors"):
            return self._st(f).keys()
        reader = self._bin(f)
        return list(reader.keys() if isinstance(reader, LazyModel) else reader)

    def _bin(self, f: str) -> Any:
        """pytorch_model*.bin `f` read by offset (a `LazyModel`, kept open for the source's life, loaded once),
        or its loaded state when it has no offset index (a legacy pickle: only the latest such file is kept)."""
        cache = self.__dict__.setdefault("_bin_files", {})
        if f in cache:
            return cache[f]
        if self._bin_cache is not None and self._bin_cache[0] == f:
            return self._bin_cache[1]
        reader = _bin_reader(self.path / f)
        if isinstance(reader, LazyModel):
            cache[f] = reader
        else:
            self._bin_cache = (f, reader)
        return reader

    def _meta(self, k: str) -> torch.Tensor | None:
        """Tensor `k` as a meta tensor (shape, dtype) from its file's header or offset index; None when the
        file has neither (a legacy pickle .bin) or does not hold `k`."""
        f = self.key_file[k]
        reader = self._st(f) if f.endswith(".safetensors") else self._bin(f)
        if isinstance(reader, SafetensorsReader):
            return reader.meta(k) if k in reader.entries else None
        return reader.meta(k) if isinstance(reader, LazyModel) and k in reader else None

    def _st(self, f: str) -> SafetensorsReader:
        """The opened (header-checked) safetensors file `f`, kept open for the source's life."""
        cache = self.__dict__.setdefault("_st_files", {})
        if f not in cache:  # e4m3 weights read dequantized when the checkpoint is block-scaled FP8
            cache[f] = (SafetensorsReader(self.path / f) if self.fp8_block is None else
                        BlockFP8File(self.path / f, self.fp8_block, self._scale, lambda: self.dequant_dtype))
        return cache[f]

    def close(self) -> None:
        """Close the safetensors files kept open for reading (the source reads nothing after this)."""
        for st in self.__dict__.pop("_st_files", {}).values():
            st.close()
        for lazy in self.__dict__.pop("_bin_files", {}).values():
            lazy.close()
        self._bin_cache = None

    def read_hf(self, unit: Unit, column_major: bool = False,
                skip: set[str] | frozenset[str] = frozenset(),
                only: set[str] | None = None) -> dict[str, torch.Tensor]:
        """HF tensors of one unit, as stored (true vocab). `column_major`: the tensors HF stores transposed
        come laid out column-major (same values), so `from_hf`'s transpose of them is free; `skip`: keys a
        caller has read already; `only`: just these keys of the unit."""
        by_file: dict[str, list[str]] = {}
        for k in self._keys(unit):
            if k not in skip and (only is None or k in only):
                by_file.setdefault(self.key_file[k], []).append(k)
        out: dict[str, torch.Tensor] = {}
        for f, keys in by_file.items():
            if f.endswith(".safetensors"):
                st = self._st(f)
                for k in keys:
                    if k not in st.entries:
                        raise MConvertError(f"{self.path / f}: tensor {k!r} is missing (the index lists it there)")
                # several tensors at once on the readers' pool: pread and the finite check release the GIL
                out.update(zip(keys, pmap(self._checked, [(st, k, column_major) for k in keys])))
            else:
                reader = self._bin(f)
                for k in keys:
                    if not isinstance(reader, (dict, LazyModel)) or k not in reader:
                        raise MConvertError(f"{self.path / f}: tensor {k!r} is missing (the index lists it there)")
                    out[k] = reader[k]
                    if not isinstance(out[k], torch.Tensor):
                        raise MConvertError(f"{self.path / f}: {k!r} holds {type(out[k]).__name__}, not a tensor; "
                                            "the file is corrupt — re-copy it")
                    self._check(k, out[k])
        if unit == "final" and self.spec.tie_embeddings:
            out.pop("lm_head.weight", None)
        return out

    def _checked(self, st_key: tuple[Any, str, bool]) -> torch.Tensor:
        st, k, column_major = st_key
        if column_major and self._stored_transposed(k):
            got = self._read_transposed(st, k)
            if got is not None:
                return got
        t = st.get(k)
        self._check(k, t)
        return buffers.column_major(t) if column_major and self._stored_transposed(k) else t

    def _read_transposed(self, st: SafetensorsReader, k: str) -> torch.Tensor | None:
        """2-D tensor `k` laid out column-major (`buffers.column_major`), read in row blocks of about
        `TRANSPOSE_BLOCK` bytes into one reused block, each checked as `read_hf` checks a tensor and transposed
        into its columns of the result: the tensor and one block in memory, not the tensor and its transposed
        copy. None when the tensor is not 2-D (the caller reads it whole)."""
        meta = st.meta(k)
        if meta.dim() != 2 or not meta.numel():
            return None
        rows, cols = meta.shape
        out_t = buffers.empty((cols, rows), meta.dtype)
        row_bytes = cols * meta.element_size()
        step = max(1, min(rows, TRANSPOSE_BLOCK // row_bytes))
        block = buffers.empty((step, cols), meta.dtype)
        for r0 in range(0, rows, step):
            n = min(step, rows - r0)
            if not st.read_into(k, block[:n], start=r0 * row_bytes):
                return None
            self._check(k, block[:n])
            copy_transposed(block[:n], out_t[:, r0:r0 + n])
        return out_t.t()

    def _stored_transposed(self, k: str) -> bool:
        """Whether HF tensor `k` is the transpose of its canonical parameter (GPT-2's Conv1D weights): read
        column-major, the transpose `from_hf` makes is free."""
        m = hf_registry(plugin_for(self.spec)).match(k)
        return m is not None and m[1] is not None and transposed_in_hf(self.spec, fill(m[1][0], m[2]))

    def _check(self, k: str, t: torch.Tensor) -> None:
        """Safety: int bits would be converted as numbers, e4m3 bytes without their scales as garbage; NaN/Inf
        refused (`HFDirectory.check_values`)."""
        self.check_values(k, str(t.dtype), t.dtype == fp8.FP8, t.is_floating_point(), lambda: all_finite(t))

    def read_mcore(self, unit: Unit) -> dict[str, torch.Tensor]:
        """Canonical full tensors of one unit (vocab rows = the true vocab, unpadded); the parameters are built
        several at once on the readers' pool."""
        built = self._read_placed(unit)
        used = {k for names, _ in built.values() for k in names}
        return from_hf(self.spec, unit, self.read_hf(unit, column_major=True, skip=used), source=str(self.path), pmap=pmap,
                       built={name: full for name, (_, full) in built.items()}, empty=buffers.empty)

    def layer_part_tasks(self, unit: Unit) -> PartTasks:
        """`base.LayerParts`: a dense layer's parameters, each read from only its own HF tensors."""
        shapes, dtypes = self._unit_shapes(unit)
        reg = registry(plugin_for(self.spec))

        def one(name: str) -> dict[str, torch.Tensor]:
            placed = self._placed_one(name, shapes, dtypes)
            if placed is not None:
                return {name: placed[1]}
            hf = self.read_hf(unit, column_major=True, only=set(hf_keys_for(self.spec, name, reg)))
            return {name: from_hf_one(self.spec, name, hf, str(self.path), reg, buffers.empty)}

        return [d.name for d in self.spec.unit_params(unit)], one, param_elements(self.spec, unit)

    def _unit_shapes(self, unit: Unit) -> tuple[dict[str, tuple[int, ...]], dict[str, torch.dtype]]:
        """Shape and dtype of each HF tensor of `unit` whose file says them without reading data."""
        shapes, dtypes = {}, {}
        for k in self._keys(unit):
            m = self._meta(k)
            if m is not None:
                shapes[k], dtypes[k] = tuple(m.shape), m.dtype
        return shapes, dtypes

    def _placed_one(self, name: str, shapes: dict[str, tuple[int, ...]],
                    dtypes: dict[str, torch.dtype]) -> tuple[list[str], torch.Tensor] | None:
        """Parameter `name` with its HF tensors' rows pread straight into their place in it
        (`mappings.plugin.mcore_row_plan`), each checked as `read_hf` checks it: (its HF keys, the merged
        tensor); None when its files or shapes do not allow it."""
        plan = mcore_row_plan(self.spec, name, shapes)
        if plan is None:
            return None
        keys, full_shape, pieces = plan
        readers = [self._st(self.key_file[k]) if self.key_file[k].endswith(".safetensors")
                   else self._bin(self.key_file[k]) for k in keys]
        if len({dtypes[k] for k in keys}) != 1 or not all(isinstance(r, (SafetensorsReader, LazyModel))
                                                           for r in readers):
            return None
        full = buffers.empty(full_shape, dtypes[keys[0]])  # every row is placed before it is read
        row_bytes = full[:1].numel() * full.element_size()
        for part, at, row, n in sorted(pieces):  # each HF tensor's bytes in file order
            dst = full[row:row + n]
            if not readers[part].read_into(keys[part], dst, start=at * row_bytes):
                return None
            self._check(keys[part], dst)
        return keys, full

    def _read_placed(self, unit: Unit) -> dict[str, tuple[list[str], torch.Tensor]]:
        """The parameters whose HF tensors are whole row blocks of them (Llama's q/k/v, gate/up), read in
        place (`_placed_one`): name -> (its HF keys, the merged tensor). Parameters whose files or shapes do
        not allow it are left to `from_hf`."""
        shapes, dtypes = self._unit_shapes(unit)
        names = [d.name for d in self.spec.unit_params(unit)]
        got = pmap(lambda n: self._placed_one(n, shapes, dtypes), names)
        return {n: g for n, g in zip(names, got) if g is not None}

    def preview(self, unit: Unit) -> dict[str, torch.Tensor]:
        """`read_mcore(unit)` as meta tensors, from the safetensors headers or the offset index of `.bin`
        files (no data read); a legacy-pickle `.bin` has neither, so writers then take their general path."""
        meta: dict[str, torch.Tensor] = {}
        for k in self._keys(unit):
            m = self._meta(k)
            if m is None:
                raise MConvertError(f"{self.path / self.key_file[k]}: tensor {k!r} is missing (the index lists it "
                                    "there)")
            meta[k] = m
        if unit == "final" and self.spec.tie_embeddings:
            meta.pop("lm_head.weight", None)
        return from_hf(self.spec, unit, meta, source=str(self.path))

    def can_preview(self) -> bool:
        """Whether every weight file says its tensors' shapes without reading data: safetensors (the header) and
        zip `.bin` files (the offset index); a legacy-pickle `.bin` does not."""
        return all(f.endswith(".safetensors") or isinstance(self._bin(f), LazyModel)
                   for f in sorted(set(self.key_file.values())))


def _bin_reader(path: Path) -> Any:
    """A pytorch_model*.bin as a mapping read tensor by tensor with pread (one safe, weights-only load builds
    the offset index): its pages do not stay resident as a whole mmap'd file would."""
    st = safe_load(path, "weights")
    if not isinstance(st, dict):
        return st
    idx = TensorIndex.build(path, st, {k: v for k, v in st.items() if isinstance(v, torch.Tensor)})
    if idx is None:
        return st
    return LazyModel(idx, open_regular(path), "", owns_fd=True)


class BlockFP8File(SafetensorsReader):
    """A safetensors file of a block-scaled FP8 checkpoint: its e4m3 weights read dequantized block row by block
    row (`fp8.dequantize`) with their scales, the other tensors as stored."""

    def __init__(self, path: Path, block: tuple[int, int], scale_of: Any, dtype_of: Any) -> None:
        super().__init__(path)
        self.block, self.scale_of, self.dtype_of = block, scale_of, dtype_of

    def meta(self, key: str) -> torch.Tensor:
        m = super().meta(key)
        return torch.empty(m.shape, dtype=self.dtype_of(), device="meta") if m.dtype == fp8.FP8 else m

    def get(self, key: str) -> torch.Tensor:
        t = super().get(key)
        if t.dtype != fp8.FP8:
            return t
        return fp8.dequantize(t, self.scale_of(key), self.block, self.dtype_of(), f"{self.path}: {key!r}")

    def read_into(self, key: str, dst: torch.Tensor, start: int = 0) -> bool:
        return self.entries[key][1].torch != fp8.FP8 and super().read_into(key, dst, start)
