"""HuggingFace directories: a writer that streams units into safetensors shards of at most `max_shard_size`
bytes.

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

from mconvert.convert.base import Unit, units_of
from mconvert.convert.hf import fp8
from mconvert.io.atomic import record_digest
from mconvert.io.hashing import numel
from mconvert.io.paths import copy_contained, inside_file, load_json_object
from mconvert.io.casts import narrowed
from mconvert.io.safetensors import Entry, SafetensorsStream
from mconvert.convert.scaleout import world
from mconvert.convert.hf.tokenizer import (
    GENERATION_CONFIG,
    TOKEN_ID_KEYS,
    TOKEN_IDS_FILE,
    TokenizerCodeRefused,
    copy_tokenizer,
    ids_outside_vocab,
    read_token_ids,
)
from mconvert.convert.hf.tokenizer_files import read_tokenizer
from mconvert.errors import MConvertError
from mconvert.mappings import families, hf_names, to_hf
from mconvert.mappings.plugin import mtp_copies
from mconvert.spec import ModelSpec
from mconvert.convert.hf.directory import INDEX
from mconvert.convert.writer import Writer

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


class HFWriter(Writer):
    """Streams HF tensors into safetensors shards of at most `max_shard_size` bytes, then writes the configs and
    the tokenizer of `tokenizer_dir`. A `Writer` (`convert/writer.py`) reading `read_hf`, a unit in one or more
    `add` calls (`takes_parts`: each tensor is written as it arrives)."""

    reads = "hf"
    takes_parts = True
    shares_work = True
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
        self._written: set[str] = set()  # every HF name added (`tally`)
        self.bytes_out = 0

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
        for name, t in tensors.items():
            if name in self._written:
                raise MConvertError(f"internal: HF tensor {name!r} was written twice")
            self._written.add(name)
            self.bytes_out += t.numel() * t.element_size()
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

    def tally(self, in_dtype: torch.dtype) -> dict[str, int]:
        """The completeness guard of one process's export: every HF tensor the spec implies (`hf_names` of every
        unit, an MTP layer's copies of the embedding and head included) was written exactly once and nothing
        else, else one error naming the first missing or extra one. Returns the report's counts: the canonical
        tensors in (full shapes, `in_dtype`) and the HF tensors out."""
        spec = self.spec
        units = units_of(spec, split_experts=True)
        expected = {n for u in units for n in hf_names(spec, u)}
        if self.fp8_block:  # each projection weight is followed by its block scales
            expected |= {n + fp8.SCALE_SUFFIX for n in expected if fp8.quantized_name(n)}
        missing, extra = sorted(expected - self._written), sorted(self._written - expected)
        if missing or extra:
            raise MConvertError(f"internal: the HF export lacks {len(missing)} tensor(s) its config implies "
                                f"{missing[:3]} and holds {len(extra)} it does not {extra[:3]}; nothing was written")
        decls = [d for u in units for d in spec.unit_params(u)]
        copies = sum(len(mtp_copies(spec, d.name)) for d in decls)
        return {"in": len(decls), "in_bytes": sum(math.prod(d.shape) for d in decls) * in_dtype.itemsize,
                "out": len(self._written), "out_bytes": self.bytes_out, "mtp_copies": copies}

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
        tok = read_tokenizer(Path(tok_dir))  # transformers' only where the files do not settle it
        return tok.bos_token_id, tok.eos_token_id
    except TokenizerCodeRefused:
        raise
    except MConvertError:  # optional information only (e.g. a sentencepiece model without sentencepiece)
        return None, None
