"""HuggingFace directories: a Source reading safetensors (or pytorch_model*.bin) one unit at a time, and a
writer that streams units into safetensors shards of at most `max_shard_size` bytes.

Writer output: `model.safetensors` (or `model-0000X-of-0000N.safetensors` + `model.safetensors.index.json`),
`config.json` from `families.hf_config(spec)`, `generation_config.json` with bos/eos ids, tokenizer files.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from mconvert import dtypes as dtype_table
from mconvert.convert import bounds, fp8
from mconvert.convert.base import LayerParts, PartTasks, Unit, param_elements, pmap, units_of
from mconvert.convert.io import buffers
from mconvert.convert.io.atomic import record_digest
from mconvert.convert.io.hashing import numel
from mconvert.convert.io.paths import contained, copy_contained, inside_file, load_json_object, open_regular
from mconvert.convert.io.safeload import all_finite, narrowed, safe_load
from mconvert.convert.io.safetensors import Entry, SafetensorsReader, SafetensorsStream
from mconvert.convert.io.torchsave import LazyModel, TensorIndex
from mconvert.convert.scaleout import world
from mconvert.convert.tokenizer import (
    GENERATION_CONFIG,
    TOKEN_ID_KEYS,
    TOKEN_IDS_FILE,
    TokenizerCodeRefused,
    copy_tokenizer,
    find_tokenizer_dir,
    ids_outside_vocab,
    load_tokenizer,
    read_token_ids,
)
from mconvert.errors import MConvertError, expect
from mconvert.mappings import families, from_hf, hf_names, hf_unit, to_hf
from mconvert.mappings.plugin import (from_hf_one, hf_keys_for, hf_registry, mcore_row_plan, plugin_for, registry,
                                      transposed_in_hf)
from mconvert.mappings.registry import fill
from mconvert.mappings.transforms import copy_transposed
from mconvert.mappings.fields import key_names
from mconvert.spec import LayerPart, ModelSpec

INDEX = "model.safetensors.index.json"
# A tensor read transposed goes through one reused block of about this size: big enough that each row of the
# transposed result takes a run of a few hundred bytes at once, small enough to stay in the cache
TRANSPOSE_BLOCK = 4 << 20
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)?\s*$", re.I)
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


def parse_size(text: str | int) -> int:
    """'5GB' -> 5·10⁹ bytes (transformers' convention); '500MiB', '1000' accepted."""
    if isinstance(text, int):
        return text
    m = _SIZE_RE.match(str(text))
    if not m or (m.group(2) or "").upper() not in _UNITS:
        raise MConvertError(f"--max-shard-size {text!r}: expected a size like 5GB, 500MB or 2GiB")
    size = int(float(m.group(1)) * _UNITS[(m.group(2) or "").upper()])
    if size <= 0:
        raise MConvertError(f"--max-shard-size {text!r} must be positive")
    return size


def read_weight_map(index: Path) -> dict[str, str]:
    """The `weight_map` of a `*.index.json` (tensor name -> file name); any other shape is one MConvertError
    naming the file and the key."""
    fix = "re-export the model (or delete the index to list the weight files instead)"
    obj = load_json_object(index, "index", fix)
    if "weight_map" not in obj:
        raise MConvertError(f"{index}: unreadable index (no 'weight_map'); {fix}")
    wmap = expect(obj["weight_map"], dict, f"{index}: weight_map", fix)
    for name, file in wmap.items():
        expect(file, str, f"{index}: weight_map[{name!r}]", fix)
    return dict(wmap)


class HFSource(LayerParts):
    """An HF model directory (config.json + safetensors / pytorch_model*.bin), read one unit at a time."""

    format = "hf"
    splits_experts = True

    def __init__(self, path: Path, tokenizer: str | Path | None = None) -> None:
        self.path = Path(path)
        cfg_path = inside_file(self.path, "config.json", f"{self.path}: config")
        self.config = load_json_object(cfg_path, "config", "fix it or re-copy the model directory")
        self.spec = families.spec_from_hf_config(self.config, source=str(cfg_path))
        self.tokenizer_dir = find_tokenizer_dir(Path(tokenizer) if tokenizer else None, self.path)
        self._bin_cache: tuple[str, Any] | None = None
        # block-scaled FP8: its e4m3 weights are read dequantized into `dequant_dtype`, the scales beside them
        self.fp8_block = fp8.block_config(self.config, str(cfg_path))
        self.dequant_dtype = dtype_table.lookup(self.spec.params_dtype).torch  # type: ignore[union-attr]
        self.key_file = self._index()
        self.scale_file = {k: self.key_file.pop(k) for k in list(self.key_file)
                           if self.fp8_block and k.endswith(fp8.SCALE_SUFFIX)}
        self._check_fp8()
        self.unit_keys: dict[Unit, list[str]] = {}
        for k, f in self.key_file.items():
            u = hf_unit(self.spec, k, source=str(self.path / f))
            if u is not None:
                self.unit_keys.setdefault(u, []).append(k)
        self.part_keys: dict[Unit, list[str]] = {}  # an MoE layer's keys by LayerPart (`_check_sizes` fills it)
        self._check_unused(str(cfg_path))
        self._check_sizes(str(cfg_path))

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

    def _check_unused(self, source: str) -> None:
        """Refuse a tensor of a known kind that config.json leaves out of the model (a q_proj.bias with
        attention_bias false): transformers would skip it with a warning and compute another model than the
        weights describe. A tied model's lm_head.weight is the one tensor the model may carry unused (transformers
        ties it to the embedding, as the conversion does). MoE layers are checked part by part (`_part_keys`)."""
        for unit, keys in self.unit_keys.items():
            if isinstance(unit, int) and self.spec.is_moe:
                continue
            declared = set(hf_names(self.spec, unit))
            for k in keys:
                if k not in declared and not (k == "lm_head.weight" and self.spec.tie_embeddings):
                    raise MConvertError(f"{self.path / self.key_file[k]}: tensor {k!r} is not a parameter of this "
                                        f"{self.spec.family} model as {source} describes it (a flag such as "
                                        "attention_bias or tie_word_embeddings says otherwise); fix the config or "
                                        "remove the tensor")

    def _check_sizes(self, source: str) -> None:
        """config.json's sizes against the tensors present (safetensors headers, the offset index of .bin
        files) and the memory available, before any per-layer loop or allocation."""
        names = key_names(families.hf_table(families.of(self.spec).model_type))
        bounds.check_layer_count(self.spec, {u for u in self.unit_keys if isinstance(u, int)}, source, names)
        if not self.can_preview():  # a legacy-pickle .bin has no index: its shapes are checked as each unit is read
            self.part_keys = self._part_keys(source)
            return
        shapes: dict[str, tuple[int, ...]] = {}
        for keys in self.unit_keys.values():
            for k in keys:
                m = self._meta(k)
                if m is not None:
                    shapes[k] = tuple(m.shape)
        bounds.check_shapes(self.spec, bounds.expected_hf_shapes, shapes, source, names)
        self.part_keys = self._part_keys(source)
        sizes: dict[Unit, int] = {}
        by_unit = {u: ks for u, ks in self.unit_keys.items() if not (isinstance(u, int) and self.spec.is_moe)}
        for unit, keys in {**by_unit, **self.part_keys}.items():  # an MoE layer moves one expert at a time
            for k in keys:
                m = self._meta(k)
                if m is not None:
                    sizes[unit] = sizes.get(unit, 0) + math.prod(m.shape) * m.dtype.itemsize
        bounds.check_memory(sizes, source)

    def _part_keys(self, source: str) -> dict[Unit, list[str]]:
        """An MoE layer's keys by `LayerPart` (its dense part, each expert), in the layer's key order; {} for a
        dense model. A layer key that no part declares (an expert beyond num_experts) is refused by name."""
        if not self.spec.is_moe:
            return {}
        out: dict[Unit, list[str]] = {}
        for layer in range(self.spec.num_layers):
            part_of = {k: part for part in self.spec.layer_units(layer) for k in hf_names(self.spec, part)}
            for k in self.unit_keys.get(layer, []):
                if k not in part_of:
                    raise MConvertError(f"{self.path / self.key_file[k]}: tensor {k!r} is not a parameter of this "
                                        f"{self.spec.family} model ({self.spec.num_experts} experts, {source}); "
                                        "remove it or fix the config")
                out.setdefault(part_of[k], []).append(k)
        return out

    def _keys(self, unit: Unit) -> list[str]:
        """The HF keys of one unit (of an MoE layer's part when `unit` is a `LayerPart`)."""
        return (self.part_keys if isinstance(unit, LayerPart) else self.unit_keys).get(unit, [])

    def _index(self) -> dict[str, str]:
        """tensor name -> file name, from the index json or by listing the weight files."""
        idx = self.path / INDEX
        if os.path.lexists(idx):
            return self._weight_map(idx)
        files = sorted(p.name for p in self.path.glob("*.safetensors"))
        if not files:
            bin_idx = self.path / "pytorch_model.bin.index.json"
            if os.path.lexists(bin_idx):
                return self._weight_map(bin_idx)
            files = sorted(p.name for p in self.path.glob("pytorch_model*.bin"))
        if not files:
            raise MConvertError(f"{self.path}: no *.safetensors or pytorch_model*.bin weight files")
        out: dict[str, str] = {}
        for f in files:
            inside_file(self.path, f, f"{self.path}: weight file")
            for k in self._keys_of(f):
                out[k] = f
        return out

    def _weight_map(self, idx: Path) -> dict[str, str]:
        """An index's `weight_map`; every file it names must be a regular file inside the model directory."""
        weight_map = read_weight_map(inside_file(self.path, idx.name, f"{self.path}: index"))
        for f in sorted(set(weight_map.values())):
            path = contained(self.path, f, f"{idx}: weight_map file")
            if not os.path.lexists(path):
                raise MConvertError(f"{idx}: lists {f} but that file is missing")
            inside_file(self.path, f, f"{idx}: weight_map file")
        return dict(weight_map)

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
        """The opened (header-checked) safetensors file `f`, kept open for the source's life (e4m3 weights read
        dequantized when the checkpoint is block-scaled FP8)."""
        cache = self.__dict__.setdefault("_st_files", {})
        if f not in cache:
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
        refused."""
        if t.dtype == fp8.FP8:
            raise MConvertError(f"{self.path / self.key_file[k]}: tensor {k!r} is float8_e4m3fn outside a block-scaled "
                                "FP8 safetensors checkpoint; its scales are unknown — fix config.json")
        if not t.is_floating_point():
            raise MConvertError(f"{self.path / self.key_file[k]}: tensor {k!r} holds {t.dtype} values, not "
                                "floating-point weights; the file is corrupt — re-copy it")
        if not all_finite(t):
            raise MConvertError(f"{self.path / self.key_file[k]}: tensor {k!r} holds NaN or Inf values; the "
                                "model is corrupt — re-copy or re-export it")

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
        return self.entries[key][1] != fp8.FP8 and super().read_into(key, dst, start)


class HFWriter:
    """Streams HF tensors into safetensors shards of at most `max_shard_size` bytes, then writes the configs and
    the tokenizer of `tokenizer_dir`. A `Writer` (`convert/writer.py`) reading `read_hf`, a unit in one or more
    `add` calls (`takes_parts`: each tensor is written as it arrives)."""

    reads = "hf"
    takes_parts = True
    splits_experts = True  # takes an MoE layer as its dense part and one unit per expert

    def __init__(self, out: Path, spec: ModelSpec, max_shard_size: int = 5 * 10**9,
                 dtype: torch.dtype | None = None, tokenizer_dir: Path | None = None,
                 carried: Path | None = None, fp8_block: tuple[int, int] | None = None) -> None:
        self.out, self.spec, self.max_shard_size, self.dtype = Path(out), spec, max_shard_size, dtype
        self.fp8_block = fp8_block  # projections written block-scaled FP8 (`fp8.quantize_tensors`)
        self._unquantized: dict[str, None] = {}  # linear modules kept in `dtype`: modules_to_not_convert
        self.tokenizer_dir = tokenizer_dir
        self.carried = carried  # a Megatron root holding HF metadata carried through it (generation config, ids)
        self.warnings: list[str] = []  # said in the report: kept token ids the args overrule
        self.prefetch_tokenizer(tokenizer_dir)
        self._buf: dict[str, torch.Tensor] = {}
        self._buf_bytes = 0
        self._tmp_files: list[tuple[Path, list[str]]] = []
        self.total_size = 0
        self.peak_buffer_bytes = 0
        # Streaming: shards planned from the spec on the first add, each tensor written as it
        # arrives (memory: one unit, not one 5 GB shard); the buffered path below stays for other callers.
        self._shards: list | None = None  # planned shards, or [] when the arrivals do not follow the plan
        self._stream: Any = None
        self._digests: dict[Path, str] = {}
        self._streaming = False
        # Under torchrun (`scaleout`) each rank writes the shards it owns; the others pass through as names
        # and sizes only, so the index, the shard names and the bytes are those of one process.
        self.world = world()
        self._unit_entries: dict[Unit, list[Entry]] = {}
        self._shard_of: dict[str, int] = {}
        self._owned = True  # False: this rank writes nothing (no plan to share out: rank 0 writes it all)
        self._left: tuple[Unit, deque[Entry]] | None = None  # the unit in progress: its planned tensors to come

    def _entries_of(self, dtype: torch.dtype) -> dict[Unit, list[Entry]]:
        """Every tensor this model will produce, unit by unit in arrival order (units of the spec, MoE layers
        split into their dense part and experts, through the plugin on the meta device); {} when the plugin
        cannot say."""
        spec = self.spec
        out: dict[Unit, list[Entry]] = {}
        try:
            for unit in units_of(spec, split_experts=True):
                meta = {d.name: torch.empty(d.shape, dtype=dtype, device="meta") for d in spec.unit_params(unit)}
                out[unit] = [(n, dtype, tuple(t.shape)) for n, t in to_hf(spec, unit, meta).items()]
                if self.fp8_block:
                    out[unit] = fp8.quantized_entries(out[unit], self.fp8_block)
        except Exception:  # noqa: BLE001 - no plan: fall back to buffering
            return {}
        return out

    def _plan(self, first: dict[str, torch.Tensor]) -> list:
        """Every tensor this model will produce, in arrival order, cut into shards; [] when `first` is not the
        start of that sequence."""
        dtype = self.dtype or next(iter(first.values())).dtype
        entries = [e for es in self._entries_of(dtype).values() for e in es]
        head = [(n, t.dtype, tuple(t.shape)) for n, t in first.items()]  # `first` as `add` turned it
        return plan_shards(entries, self.max_shard_size) if entries and entries[: len(head)] == head else []

    def plan_ahead(self, dtype: torch.dtype) -> None:
        """Plan the shards before any tensor arrives (tensors of `dtype` unless the writer converts), so that
        `needs` can say which units this torchrun rank must read. Without a plan rank 0 writes everything."""
        per_unit = self._entries_of(self.dtype or dtype)
        if not per_unit:
            self._owned = self.world.primary
            return
        self._unit_entries = per_unit
        self._shards = plan_shards([e for es in per_unit.values() for e in es], self.max_shard_size)
        self._streaming = True
        self._shard_of = {e[0]: i for i, shard in enumerate(self._shards) for e in shard}

    def needs(self, unit: Unit) -> bool:
        """Whether this rank must read `unit` (it feeds a shard this rank writes); always, in one process."""
        if self.world.size == 1:
            return True
        if not self._unit_entries:
            return self._owned
        return any(self.world.owns(self._shard_of[e[0]]) for e in self._planned(unit))

    def wants(self, unit: Unit) -> set[str] | None:
        """The HF names of `unit` that go to shards this process writes: a source may leave the others unread
        (their places pass by as names and sizes); None: every name (one process, or no plan)."""
        if self.world.size == 1 or not self._unit_entries:
            return None
        return {e[0] for e in self._planned(unit) if self.world.owns(self._shard_of[e[0]])}

    def _with_unread(self, unit: Unit, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`tensors` of `unit` with the planned tensors the source left unread before them (`wants`: another
        process writes them) put back in plan order as meta tensors; a unit that ends is completed the
        same way when the next one starts, or at `close`."""
        if self._left is None or self._left[0] != unit:
            self._pass_unread()
            self._left = (unit, deque(self._planned(unit)))
        left = self._left[1]
        out: dict[str, torch.Tensor] = {}
        for name, t in tensors.items():
            while left and left[0][0] != name:
                self._unread(left.popleft(), out)
            if left:
                left.popleft()
            out[name] = t
        return out

    def _unread(self, entry: Entry, into: dict[str, torch.Tensor]) -> None:
        name, dtype, shape = entry
        if self.world.owns(self._shard_of[name]):
            raise MConvertError(f"internal: {name!r}, which this process writes, was not read")
        into[name] = torch.empty(shape, dtype=dtype, device="meta")

    def _pass_unread(self) -> None:
        """The unit in progress ends: its planned tensors still to come pass by unread."""
        if self._left is None:
            return
        rest: dict[str, torch.Tensor] = {}
        for e in self._left[1]:
            self._unread(e, rest)
        self._left = None
        for name, t in rest.items():
            self._add_streamed(name, t)

    def _planned(self, unit: Unit) -> list[Entry]:
        """The planned tensors of `unit`; an MoE layer given whole (by a source that does not split it) has
        those of its dense part and all its experts."""
        if isinstance(unit, int):
            return [e for u in self.spec.layer_units(unit) for e in self._unit_entries[u]]
        return self._unit_entries[unit]

    def skip(self, unit: Unit) -> None:
        """Pass `unit` by unread (`needs` is False): its planned names and sizes go to the shards of other ranks."""
        if not self._unit_entries:
            return
        self.add(unit, {n: torch.empty(shape, dtype=dtype, device="meta")
                        for n, dtype, shape in self._planned(unit)})

    def prefetch_tokenizer(self, tokenizer_dir: Path | None) -> None:
        """Start reading the tokenizer's bos/eos ids now, on a thread: importing transformers costs seconds of
        CPU that then overlap the conversion instead of following it. Same answer."""
        if tokenizer_dir is None:
            return

        ex = ThreadPoolExecutor(1)
        self._special_ids = ex.submit(_tokenizer_special_ids, tokenizer_dir)
        self._special_ids.tok_dir = tokenizer_dir  # type: ignore[attr-defined]
        ex.shutdown(wait=False)

    def _add_streamed(self, name: str, t: torch.Tensor) -> None:
        if self._stream is None:
            if not self._shards:
                raise MConvertError(f"{self.out}: tensor {name!r} arrived after every planned tensor was written")
            entries = self._shards.pop(0)
            index = len(self._tmp_files)
            path = self.out / f".shard-{index:05d}.safetensors"
            if self.world.owns(index):
                self._stream = SafetensorsStream(path, entries, {"format": "pt"})
            else:
                self._stream = _OtherRanksShard(path, entries)
            self._tmp_files.append((path, [e[0] for e in entries]))
        self._stream.add(name, t)
        self.total_size += t.numel() * t.element_size()
        if self._stream.complete:
            digest = self._stream.close()
            if digest is not None:
                self._digests[self._stream.path] = digest
            self._stream = None

    def add(self, unit: Unit, tensors: dict[str, torch.Tensor]) -> None:
        """One unit's tensors under HF names, written as they arrive (shards planned from the spec)."""
        if self.dtype is not None:
            tensors = {n: narrowed(t, self.dtype, n) if t.dtype != self.dtype else t for n, t in tensors.items()}
        if self.fp8_block:
            self._unquantized.update({n[: -len(".weight")]: None for n, t in tensors.items()
                                      if n.endswith(".weight") and t.dim() == 2 and not fp8.quantized_name(n)
                                      and "embed" not in n and n != "lm_head.weight"})
            tensors = fp8.quantize_tensors(tensors, self.fp8_block)
        if not self._owned:
            return
        if self._shards is None and tensors:
            self._shards = self._plan(tensors)
            self._streaming = bool(self._shards)
        if self._streaming:
            self.peak_buffer_bytes = max(self.peak_buffer_bytes, sum(t.numel() * t.element_size()
                                                                     for t in tensors.values()))
            if self._unit_entries and self.world.size > 1:
                tensors = self._with_unread(unit, tensors)
            for name, t in tensors.items():
                self._add_streamed(name, t)
            return
        for name, t in tensors.items():  # already in self.dtype (the cast above)
            t = t.contiguous()
            if t.untyped_storage().nbytes() != t.numel() * t.element_size() or t.storage_offset():
                t = t.clone()
            nbytes = t.numel() * t.element_size()
            if self._buf and self._buf_bytes + nbytes > self.max_shard_size:
                self._flush()
            self._buf[name] = t
            self._buf_bytes += nbytes
            self.total_size += nbytes
            self.peak_buffer_bytes = max(self.peak_buffer_bytes, self._buf_bytes)

    def _flush(self) -> None:
        if not self._buf:
            return
        path = self.out / f".shard-{len(self._tmp_files):05d}.safetensors"
        save_file(self._buf, str(path), metadata={"format": "pt"})
        self._tmp_files.append((path, list(self._buf)))
        self._buf, self._buf_bytes = {}, 0

    def abort(self) -> None:
        """Stop the file being streamed (its threads, its staging memory); the caller removes the directory."""
        if self._stream is not None:
            self._stream.abort()
            self._stream = None

    def close(self) -> list[Path]:
        """Name the shards, write the index (when > 1 shard), config.json, generation_config.json, tokenizer.
        Under torchrun a rank names only its own shards, and rank 0 alone writes the rest."""
        if not self._owned:
            return []
        tokenizer_dir, carried = self.tokenizer_dir, self.carried
        if self._streaming:
            self._pass_unread()
        if self._streaming and (self._stream is not None or self._shards):
            missing = self._stream.next_name if self._stream else self._shards[0][0][0]
            if self._stream is not None:
                self._stream.abort()
            raise MConvertError(f"internal: HF writer closed before all tensors arrived (e.g. {missing!r})")
        self._flush()
        n = len(self._tmp_files)
        files: list[Path] = []
        weight_map: dict[str, str] = {}
        for i, (tmp, names) in enumerate(self._tmp_files):
            final = self.out / ("model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors")
            weight_map.update({k: final.name for k in names})
            if not self.world.owns(i):
                continue
            os.replace(tmp, final)
            if tmp in self._digests:  # hashed while written: the manifest need not read it back
                record_digest(final, self._digests[tmp])
            files.append(final)
        if not self.world.primary:
            return files
        if n > 1:
            idx = {"metadata": {"total_size": self.total_size}, "weight_map": dict(sorted(weight_map.items()))}
            (self.out / INDEX).write_text(json.dumps(idx, indent=2) + "\n")
            files.append(self.out / INDEX)
        spec = self.spec
        bos, eos = spec.bos_token_id, spec.eos_token_id
        if tokenizer_dir is not None:
            files += [self.out / f for f in copy_tokenizer(tokenizer_dir, self.out)]
            pre = getattr(self, "_special_ids", None)
            tb, te = pre.result() if pre is not None and pre.tok_dir == tokenizer_dir else _tokenizer_special_ids(
                tokenizer_dir)
            bos = bos if bos is not None else tb
            eos = eos if eos is not None else te
        cfg = families.hf_config(spec.replace(bos_token_id=bos, eos_token_id=eos))
        if self.fp8_block:
            cfg["quantization_config"] = fp8.hf_quantization_config(self.fp8_block, ["lm_head", *self._unquantized])
        kept = self._kept_ids(carried, spec)
        cfg.update(kept)
        for k in TOKEN_ID_KEYS:  # as the checkpoint states them; one it cannot produce is said in the report
            where = (f"{carried / TOKEN_IDS_FILE}" if k in kept and carried is not None else
                     "the checkpoint's args" if getattr(spec, k, None) is not None else str(tokenizer_dir))
            self.warnings += ids_outside_vocab({k: cfg.get(k)}, spec.vocab_size, where)
        (self.out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        if carried is not None and os.path.lexists(carried / GENERATION_CONFIG):
            path = inside_file(carried, GENERATION_CONFIG, f"{carried}: generation config")
            load_json_object(path, "generation config", "fix or delete it")
            copy_contained(carried, GENERATION_CONFIG, self.out, kind="json")
        else:
            gen: dict = {"_from_model_config": True}
            if bos is not None:
                gen["bos_token_id"] = bos
            if eos is not None:
                gen["eos_token_id"] = eos
            (self.out / GENERATION_CONFIG).write_text(json.dumps(gen, indent=2) + "\n")
        files += [self.out / "config.json", self.out / GENERATION_CONFIG]
        return files

    def _kept_ids(self, carried: Path | None, spec: ModelSpec) -> dict[str, Any]:
        """The special-token ids kept beside the checkpoint (pad, eos lists), those the args agree with: the
        args hold bos/eos as one int (the first of a list) and win where they say otherwise."""
        kept = read_token_ids(carried) or {}
        out = {}
        for k, v in kept.items():
            held = getattr(spec, k, None)
            first = v[0] if isinstance(v, list) else v
            if held is None or held == first:
                out[k] = v
            else:
                self.warnings.append(f"{carried / TOKEN_IDS_FILE}: {k} {v} differs from the args' {held}; "
                                     f"config.json takes the args' {held}")
        return out


class _OtherRanksShard:
    """A shard another torchrun rank writes: the planned tensors pass by in order (names checked), no bytes."""

    def __init__(self, path: Path, entries: list[Entry]) -> None:
        self.path, self.names, self._next = path, [e[0] for e in entries], 0

    def add(self, name: str, t: torch.Tensor) -> None:
        if self._next >= len(self.names) or name != self.names[self._next]:
            raise MConvertError(f"internal: {self.path}: {name!r} arrived out of the planned order")
        self._next += 1

    @property
    def next_name(self) -> str | None:
        return self.names[self._next] if self._next < len(self.names) else None

    @property
    def complete(self) -> bool:
        return self._next == len(self.names)

    def close(self) -> None:
        return None

    def abort(self) -> None:
        return None


def plan_shards(entries: list[Entry], max_shard_size: int) -> list[list[Entry]]:
    """Greedy shards in arrival order: a new shard when the next tensor would pass `max_shard_size`."""
    shards: list[list[Entry]] = [[]]
    size = 0
    for e in entries:
        n = numel(e[2]) * torch.empty((), dtype=e[1]).element_size()
        if shards[-1] and size + n > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += n
    return [s for s in shards if s]


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


def _special_ids_from_json(tok_dir: Path) -> tuple[int | None, int | None] | None:
    """bos/eos ids read from a fast tokenizer's own JSON files, without importing transformers (seconds of
    CPU). Answers only when unambiguous: a `*Fast` tokenizer_class, both tokens named in
    tokenizer_config.json (so no class default applies), special_tokens_map.json agreeing, and each token one
    of tokenizer.json's added tokens (tokenizer_config's added_tokens_decoder agreeing). Else None."""
    fix = "re-save the tokenizer (or pass --tokenizer DIR)"
    if not (tok_dir / "tokenizer_config.json").is_file() or not (tok_dir / "tokenizer.json").is_file():
        return None

    def load(name: str) -> dict[str, Any]:
        path = inside_file(tok_dir, name, f"{tok_dir}: tokenizer file {name}")
        return load_json_object(path, "tokenizer file", fix, kind="tokenizer")

    cfg = load("tokenizer_config.json")
    tj = load("tokenizer.json")
    smap = load("special_tokens_map.json") if (tok_dir / "special_tokens_map.json").is_file() else {}
    if not str(cfg.get("tokenizer_class") or "").endswith("Fast"):
        return None

    def content(v: Any) -> Any:
        return v.get("content") if isinstance(v, dict) else v

    ids: dict[str, list[int]] = {}
    for a in tj.get("added_tokens") or []:
        if isinstance(a, dict) and isinstance(a.get("content"), str) and isinstance(a.get("id"), int):
            ids.setdefault(a["content"], []).append(a["id"])
    decoder = cfg.get("added_tokens_decoder") or {}
    out: list[int | None] = []
    for key in ("bos_token", "eos_token"):
        if key not in cfg:
            return None
        tok = content(cfg[key])
        if key in smap and content(smap[key]) != tok:
            return None
        if tok is None:
            out.append(None)
            continue
        if not isinstance(tok, str) or len(ids.get(tok, [])) != 1:
            return None
        i = ids[tok][0]
        if not isinstance(decoder, dict) or any(content(v) == tok and k != str(i) for k, v in decoder.items()):
            return None
        out.append(i)
    return out[0], out[1]


def _tokenizer_special_ids(tok_dir: Path) -> tuple[int | None, int | None]:
    """bos/eos ids of an HF tokenizer (None when it has none or cannot be loaded)."""
    fast = _special_ids_from_json(Path(tok_dir))
    if fast is not None:
        return fast
    try:
        tok = load_tokenizer(Path(tok_dir))
        return tok.bos_token_id, tok.eos_token_id
    except TokenizerCodeRefused:
        raise
    except MConvertError:  # optional information only (e.g. a sentencepiece model without sentencepiece)
        return None, None
