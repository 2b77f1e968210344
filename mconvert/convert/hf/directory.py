"""An HF model directory as it is opened, before any tensor is read: config.json -> ModelSpec, the tokenizer
directory, which file holds each tensor (the index or the weight files' own key lists), each unit's keys, and the
refusals made from names and shapes alone (a tensor the config leaves out, wrong sizes, a layer count that
disagrees, a missing tensor, a unit too large for memory). `HFSource` (torch tensors) and `HFArrays` (numpy
arrays, `convert/hf/arrays.py`) read the tensors; this part imports no torch."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mconvert.convert import bounds
from mconvert.convert.base import SourceBase, Unit
from mconvert.convert.hf.tokenizer import find_tokenizer_dir
from mconvert.errors import MConvertError, expect
from mconvert.io.paths import contained, inside_file, load_json_object
from mconvert.mappings import families
from mconvert.mappings.fields import key_names
from mconvert.mappings.plugin import check_hf_present, hf_keys_for, hf_names, hf_unit
from mconvert.spec import LayerPart

INDEX = "model.safetensors.index.json"


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


class HFDirectory(SourceBase):
    """The opening of an HF directory (see the module): a reader subclass sets `key_file` through `_index` and
    answers `_keys_of(file)`, `_meta(key)` (an object with `.shape` and `.dtype.itemsize`, or None) and
    `can_preview()`."""

    format = "hf"
    key_file: dict[str, str]

    def _open(self, path: Path, tokenizer: str | Path | None) -> Path:
        """config.json, the spec and the tokenizer directory; returns config.json's path."""
        self.path = Path(path)
        cfg_path = inside_file(self.path, "config.json", f"{self.path}: config")
        self.config = load_json_object(cfg_path, "config", "fix it or re-copy the model directory")
        self.spec = families.spec_from_hf_config(self.config, source=str(cfg_path))
        self.tokenizer_dir = find_tokenizer_dir(Path(tokenizer) if tokenizer else None, self.path)
        return cfg_path

    def _check_layout(self, cfg_path: Path) -> None:
        """Each unit's keys, then every refusal made from names and shapes (at opening: a --dry-run refuses
        what the conversion would)."""
        self.unit_keys: dict[Unit, list[str]] = {}
        for k, f in self.key_file.items():
            u = hf_unit(self.spec, k, source=str(self.path / f))
            if u is not None:
                self.unit_keys.setdefault(u, []).append(k)
        self.part_keys: dict[Unit, list[str]] = {}  # an MoE layer's keys by LayerPart (`_check_sizes` fills it)
        self._check_unused(str(cfg_path))
        self._check_sizes(str(cfg_path))
        check_hf_present(self.spec, self.key_file, str(self.path))

    def check_values(self, k: str, dtype: str, fp8: bool, floating: bool, finite: Callable[[], bool]) -> None:
        """Safety of tensor `k` as read (`dtype` its name): int bits would be converted as numbers, e4m3 bytes
        without their scales as garbage; NaN/Inf (`finite()`, asked last) refused."""
        where = f"{self.path / self.key_file[k]}: tensor {k!r}"
        if fp8:
            raise MConvertError(f"{where} is float8_e4m3fn outside a block-scaled FP8 safetensors checkpoint; its "
                                "scales are unknown — fix config.json")
        if not floating:
            raise MConvertError(f"{where} holds {dtype} values, not floating-point weights; the file is corrupt — "
                                "re-copy it")
        if not finite():
            raise MConvertError(f"{where} holds NaN or Inf values; the model is corrupt — re-copy or re-export it")

    def _keys_of(self, f: str) -> list[str]:  # pragma: no cover - abstract
        raise NotImplementedError

    def _meta(self, k: str) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    def can_preview(self) -> bool:  # pragma: no cover - abstract
        raise NotImplementedError

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
        sizes: dict[Any, int] = {}
        by_unit = {u: ks for u, ks in self.unit_keys.items() if not (isinstance(u, int) and self.spec.is_moe)}
        for unit, keys in {**by_unit, **self.part_keys}.items():  # an MoE layer moves one expert at a time
            for part, ks in self._held_keys(unit, keys).items():
                for k in ks:
                    m = self._meta(k)
                    if m is not None:
                        sizes[part] = sizes.get(part, 0) + math.prod(m.shape) * m.dtype.itemsize
        self.held_sizes, self.held_source = sizes, source
        bounds.check_memory(sizes, source)

    def _held_keys(self, unit: Unit, keys: list[str]) -> dict[Any, list[str]]:
        """A unit's HF keys by what a conversion holds at once (`bounds.held_together`): a final unit that moves
        parameter by parameter as each parameter's HF tensors (an MTP layer's copy of the head with the head);
        a key no parameter reads, alone."""
        whole = bounds.held_together(self.spec, unit, "")
        if whole == unit:
            return {unit: keys}
        out: dict[Any, list[str]] = {}
        left = dict.fromkeys(keys)
        for d in self.spec.unit_params(unit):
            mine = [k for k in hf_keys_for(self.spec, d.name) if k in left]
            for k in mine:
                del left[k]
            out[bounds.held_together(self.spec, unit, d.name)] = mine
        out.update({(unit, k): [k] for k in left})
        return out

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
