"""Megatron-LM legacy "torch" checkpoints: the streaming reader (Source).

One unit at a time, it opens (mmap, weights-only) only the TP files of the pipeline stage that holds
the unit, normalizes every key spelling (mcore local / TE / legacy flat / legacy nested) to canonical names,
makes the layer index global and merges the TP shards by the split kind ModelSpec declares.
"""

from __future__ import annotations

import copy
import math
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from mconvert.convert import bounds
from mconvert.convert.megatron import optimizer as optim
from mconvert.convert.base import LayerParts, PartTasks, Unit, param_elements, pmap, pmap_iter
from mconvert.convert.megatron.checkpoint import args_dict, checkpoint_dict, megatron_spec, resolve_iteration_dir
from mconvert.io import buffers
from mconvert.io.paths import inside_file, owned_fd
from mconvert.io.safeload import safe_load
from mconvert.io.casts import all_finite
from mconvert.io.torchsave import LazyModel, TensorIndex
from mconvert.layouts.megatron import (
    SPLIT_ARGS,
    PipelineSplit,
    rank_dir_parts,
    rank_of_parts,
    stored_iteration,
)
from mconvert.errors import MConvertError, type_name
from mconvert.io.transpose import copy_transposed
from mconvert.mappings import families
from mconvert.mappings.fields import MEGATRON_ARGS, key_names
from mconvert.mappings.keys import canonical_key, flatten, unit_of, with_layer
from mconvert.mappings.plugin import check_complete, hf_keys_for, hf_order, hf_row_plan, to_hf_one, transposed_in_hf
from mconvert.mappings.transforms import (merge, merge_rows, merge_transposed, place_rows,
                                          split_dim)
from mconvert.spec import LayerPart, expert_of, is_buffer, layer_of_unit, with_expert

RANK_FILES = ("model_optim_rng.pt", "model_rng.pt")


def _checkpoint_version(state: dict, file: Path) -> float:
    """Megatron's checkpoint_version (0 when absent): one of 0, 1, 2, 3 — anything else is a damaged file."""
    v = state.get("checkpoint_version", 0) or 0
    if isinstance(v, bool) or not isinstance(v, (int, float)) or float(v) not in (0.0, 1.0, 2.0, 3.0):
        raise MConvertError(f"{file}: unknown checkpoint_version {v!r} (Megatron writes 0 to 3); the file is "
                            "corrupt — re-copy it")
    return float(v)


def _size(args: dict[str, Any], key: str) -> int:
    """A parallel size from the args (1 when absent or not a positive whole number: the other checks name it)."""
    v = args.get(key)
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 1 else 1


def _fix_legacy_qkv(t: torch.Tensor, version: float, nh: int, hd: int) -> torch.Tensor:
    """checkpoint_version 0 ([3, np, hn]) and 1 ([np, hn, 3]) -> the >= 2 layout [np, 3, hn] (one TP shard)."""
    rest = tuple(t.shape[1:])
    np_ = t.shape[0] // (3 * hd)
    if version == 0:
        return t.reshape(3, np_, hd, *rest).transpose(0, 1).reshape(t.shape).contiguous()
    return t.reshape(np_, hd, 3, *rest).transpose(1, 2).reshape(t.shape).contiguous()


# bytes of a shard's rows read and transposed at a time (`merge_transposed_into`): a block that stays in L2
# while it is checked and transposed
TRANSPOSE_BLOCK = 1 << 20


class MegatronSource(LayerParts):
    """A Megatron torch-format checkpoint (`iter_*/mp_rank_TT[_PPP]/model_optim_rng.pt`) read unit by unit."""

    format = "megatron"
    splits_experts = True
    gives_hf_tasks = True  # `hf_part_tasks`: a layer's HF parameters read as tasks on the readers' pool

    def __init__(self, path: Path, iteration: int | str | None = None, tokenizer: str | Path | None = None,
                 ep_rank: int | None = None) -> None:
        """Open and check every rank file. With expert parallelism (args `expert_model_parallel_size` > 1) the
        source reads every EP rank's files, each through its own source (`ep_rank`: that EP rank only)."""
        self.path = Path(path)
        self.iter_dir, self.iteration = resolve_iteration_dir(self.path, iteration)
        self.root = self.iter_dir.parent if self.iter_dir != self.path else self.path.parent
        dirs = self._rank_dirs()
        zero = next((f for parts, f in dirs.items() if not any(parts)), None)
        first = checkpoint_dict(safe_load(zero), zero) if zero is not None else None
        sizes = args_dict(first["args"], zero) if first is not None and "args" in first else {}
        self.ep, self.ep_rank = _size(sizes, "expert_model_parallel_size"), ep_rank or 0
        self._subs: list[MegatronSource] | None = None
        self.files = self._rank_files(dirs, _size(sizes, "pipeline_model_parallel_size"))
        self.tp = 1 + max(t for t, _ in self.files)
        self.pp = 1 + max(p for _, p in self.files)
        if (0, 0) not in self.files:
            self._check_holes()
        first_file = self.files[(0, 0)]
        if first is None or first_file != zero:
            first = checkpoint_dict(safe_load(first_file), first_file)
        if "args" not in first:
            raise MConvertError(f"{first_file}: no 'args' entry; not a Megatron-LM checkpoint (or written without args)")
        self.args = first["args"]
        self._check_layout(args_dict(self.args, first_file))  # safety: extra rank dirs are named against the args
        self._check_holes()
        self.checkpoint_version = _checkpoint_version(first, first_file)
        self.iteration = stored_iteration(first, self.iteration, first_file)
        self.top_keys = [k for k in first if not k.startswith("model")]
        chunks = sorted(int(k[5:]) for k in first if k.startswith("model") and k[5:].isdigit())
        self.vpp = len(chunks) if chunks else None
        if "model" not in first and not chunks:
            raise MConvertError(f"{first_file}: no 'model' (or 'model0'...) entry; nothing to convert")
        a = args_dict(self.args, first_file)
        spec, self.tokenizer_dir, self.vocab_known = megatron_spec(a, str(first_file), tokenizer, self.root, self.path)
        if a.get("bos_token_id") is not None or a.get("eos_token_id") is not None:
            spec = spec.replace(bos_token_id=a.get("bos_token_id"), eos_token_id=a.get("eos_token_id"))
        self.spec = spec
        if self.checkpoint_version < 2 and spec.num_query_groups is not None:  # _fix_legacy_qkv assumes MHA
            raise MConvertError(
                f"{first_file}: checkpoint_version {self.checkpoint_version:g} (a legacy QKV layout, older than "
                f"grouped-query attention) with num_query_groups={spec.num_query_groups} < num_attention_heads="
                f"{spec.num_attention_heads}; Megatron-LM never writes both — re-copy the file, or fix "
                "checkpoint_version or num_query_groups in its args")
        self.padded_vocab = a.get("padded_vocab_size")
        spec.check_parallel(1, self.pp, self.vpp, layers=False)
        self.split = PipelineSplit.from_args(a, spec.num_layers, self.pp, self.vpp, str(first_file))
        self._keymaps: dict[tuple[int, int], dict[str, str]] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}  # canonical name -> shape on TP rank 0 (as stored)
        spec0 = families.spec_from_megatron_args(a).to_dict()
        for p in range(self.pp):  # validate every key of every stage before any work is done
            st = first if p == 0 else checkpoint_dict(safe_load(self.files[(0, p)]), self.files[(0, p)])
            if p:
                self._check_same_run(st, self.files[(0, p)], a, spec0)
            for c in range(self.vpp or 1):
                self._keymaps[(p, c)] = self._keymap(st, p, c, self.files[(0, p)])
            self._remember(0, p, st)
            del st
        del first
        self._check_sizes(a, str(first_file))
        self._check_ranks(a, spec0)  # safety: every other rank file agrees with TP rank 0 (args, keys, shapes)
        if self.ep > 1 and ep_rank is None:
            self._open_expert_ranks(iteration, tokenizer)

    def _open_expert_ranks(self, iteration: int | str | None, tokenizer: str | Path | None) -> None:
        """Open EP ranks 1.. as sources of their own (this one reads EP rank 0) and check that they hold one
        model: the same args, the same dense weights' keys and shapes, and every expert exactly once."""
        sub0 = copy.copy(self)
        self._subs = [sub0] + [MegatronSource(self.path, iteration, tokenizer, ep_rank=e) for e in range(1, self.ep)]
        self.shapes, self._dtypes = {}, {}
        for sub in self._subs:
            if sub.spec != sub0.spec or (sub.tp, sub.pp, sub.vpp) != (sub0.tp, sub0.pp, sub0.vpp):
                raise MConvertError(f"{sub.files[(0, 0)]}: args or layout differ from {sub0.files[(0, 0)]}; the EP "
                                    "rank files come from different runs — re-copy the checkpoint")
            for name, shape in sub.shapes.items():
                if expert_of(name) is None and sub0.shapes.get(name) != shape:
                    raise MConvertError(f"{sub.files[(0, 0)]}: dense weight {name!r} is "
                                        f"{list(shape)} but {sub0.files[(0, 0)]} has {sub0.shapes.get(name)}; every "
                                        "EP rank holds the same dense weights — re-copy the checkpoint")
                self.shapes[name] = shape
                self._dtypes[name] = sub.__dict__["_dtypes"][name]
        for unit in self.units():
            check_complete(self.spec, unit, self._unit_names(unit), str(self.path))

    def _check_sizes(self, args: dict[str, Any], source: str) -> None:
        """The args' sizes against the tensors of the TP-rank-0 files and the memory available, before any
        per-layer loop or allocation."""
        names = key_names(MEGATRON_ARGS)
        bounds.check_layer_count(self.spec, {u for u in map(unit_of, self.shapes) if isinstance(u, int)}, source,
                                 names)
        padded = args.get("padded_vocab_size")
        rows = padded if isinstance(padded, int) and padded >= self.spec.vocab_size else None
        bounds.check_shapes(self.spec, lambda s: bounds.expected_shard_shapes(s, self.tp, rows), self.shapes, source,
                            names)
        sizes: dict[Any, int] = {}
        for name, shape in self.shapes.items():  # an MoE layer moves one expert at a time, an MoE MTP layer one
            u = bounds.held_together(self.spec, unit_of(name), name)  # parameter at a time
            sizes[u] = sizes.get(u, 0) + math.prod(shape) * self.__dict__["_dtypes"][name].itemsize * self.tp
        self.held_sizes, self.held_source = sizes, source
        bounds.check_memory(sizes, source)

    # ---- discovery ------------------------------------------------------------------------------------
    def _check_holes(self) -> None:
        for t in range(self.tp):
            for p in range(self.pp):
                if (t, p) not in self.files:
                    raise MConvertError(f"{self.iter_dir}: rank file for TP rank {t}, PP rank {p} is missing "
                                        f"(found TP={self.tp}, PP={self.pp}); the checkpoint is incomplete")

    def _check_layout(self, args: dict[str, Any]) -> None:
        """Rank dirs beyond the args' TP/PP are named (a stray copy must not be merged in or silently skipped)."""
        want_tp, want_pp = args.get("tensor_model_parallel_size"), args.get("pipeline_model_parallel_size")
        ep = f", EP={self.ep}" if self.ep > 1 else ""
        if not want_tp or not want_pp:
            if self._unfit:
                raise MConvertError(f"{self.iter_dir}: unexpected rank directories {', '.join(sorted(self._unfit))} "
                                    "(the args state no TP/PP sizes); remove them — a stray copy from another run?")
            return
        extra = sorted(self.files[k].parent.name for k in self.files if k[0] >= want_tp or k[1] >= want_pp)
        extra = sorted(extra + self._unfit)
        if extra:
            raise MConvertError(f"{self.iter_dir}: unexpected rank directories {', '.join(extra)} (the args say "
                                f"TP={want_tp}, PP={want_pp}{ep}); remove them — a stray copy from another run?")

    def _check_same_run(self, st: dict, f: Path, args0: dict[str, Any], spec0: dict[str, Any]) -> None:
        """Rank file `f` (loaded as `st`) carries rank 0's checkpoint_version and model args."""
        if _checkpoint_version(st, f) != self.checkpoint_version:  # it decides the legacy QKV layout
            raise MConvertError(f"{f}: checkpoint_version {_checkpoint_version(st, f)} but "
                                f"{self.files[(0, 0)]} has {self.checkpoint_version}; the rank files come from "
                                "different runs or one is corrupt — re-copy the checkpoint")
        if "args" in st:
            fields = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "padded_vocab_size", *SPLIT_ARGS)
            a = args_dict(st["args"], f)
            spec = families.spec_from_megatron_args(a, source=str(f)).to_dict()
            diff = [(k, spec[k], spec0[k]) for k in spec0 if spec[k] != spec0[k]]
            diff += [(k, a.get(k), args0.get(k)) for k in fields if a.get(k) != args0.get(k)]
            if diff:
                k, here, there = diff[0]
                raise MConvertError(f"{f}: args differ from {self.files[(0, 0)]}: {k}={here!r} here, {there!r} "
                                    "there; the rank files come from different runs — re-copy the checkpoint")

    def _check_ranks(self, args0: dict[str, Any], spec0: dict[str, Any]) -> None:
        """Every rank file of TP rank > 0 must carry rank 0's model args and, per stage, exactly TP rank 0's keys
        and shapes (TP rank 0's files were checked as they were opened)."""
        for (t, p), f in sorted(self.files.items()):
            if t == 0:
                continue
            st = checkpoint_dict(safe_load(f), f)
            self._check_same_run(st, f, args0, spec0)
            for c in range(self.vpp or 1):
                model = self._model_dict(st, c, f)
                ref = self._keymaps[(p, c)]
                ref_file = self.files[(0, p)]
                for raw, val in model.items():
                    if canonical_key(raw) is None:
                        continue
                    if raw not in ref:
                        raise MConvertError(f"{f}: unexpected key {raw!r} ({ref_file} does not have it); the rank "
                                            "files do not belong to one checkpoint — re-copy it")
                    want = self.shapes[ref[raw]]
                    if not isinstance(val, torch.Tensor) or tuple(val.shape) != want:
                        got = tuple(val.shape) if isinstance(val, torch.Tensor) else type(val).__name__
                        raise MConvertError(f"{f}: key {raw!r} has shape {got} but {ref_file} has {want}; TP shards "
                                            "of one parameter must agree — re-copy the rank files from one checkpoint")
                    if val.dtype != self._dtypes[ref[raw]]:
                        raise MConvertError(f"{f}: key {raw!r} is {val.dtype} but {ref_file} has "
                                            f"{self._dtypes[ref[raw]]}; TP shards of one parameter must agree — "
                                            "re-copy the rank files from one checkpoint")
                missing = [raw for raw in ref if raw not in model]
                if missing:
                    raise MConvertError(f"{f}: key {missing[0]!r} is missing ({ref_file} has it); the checkpoint "
                                        "is incomplete or mixed — re-copy it")
            self._remember(t, p, st)
            del st

    def _rank_dirs(self) -> dict[tuple[int, ...], Path]:
        """Every `mp_rank_*` directory's numbers -> its rank file."""
        found: dict[tuple[int, ...], Path] = {}
        for d in sorted(self.iter_dir.iterdir()):
            parts = rank_dir_parts(d.name) if d.is_dir() else None
            if parts is None:
                continue
            name = next((n for n in RANK_FILES if os.path.lexists(d / n)), None)
            if name is None:
                raise MConvertError(f"{d}: no {RANK_FILES[0]} inside; the checkpoint is incomplete")
            found[parts] = inside_file(self.iter_dir, f"{d.name}/{name}", f"{self.iter_dir}: rank file")
        if not found:
            raise MConvertError(f"{self.iter_dir}: no mp_rank_* directories; not a Megatron torch checkpoint")
        return found

    def _rank_files(self, dirs: dict[tuple[int, ...], Path], pp_size: int) -> dict[tuple[int, int], Path]:
        """(TP rank, PP rank) -> rank file of this source's EP rank; the dir names are read with the args' PP and
        EP sizes. Names that fit no rank of those sizes are kept for `_check_layout` to name."""
        files: dict[tuple[int, int], Path] = {}
        self._unfit: list[str] = []
        for parts, f in dirs.items():
            rank = rank_of_parts(parts, pp_size, self.ep)
            if rank is None or rank[2] >= self.ep:
                self._unfit.append(f.parent.name)
                continue
            t, p, e = rank
            if e != self.ep_rank:
                continue
            if (t, p) in files:  # mp_rank_01 beside mp_rank_01_000
                raise MConvertError(f"{f.parent}: same TP/PP rank as {files[(t, p)].parent.name}; a checkpoint uses "
                                    "either mp_rank_TT or mp_rank_TT_PPP directories — remove the stray one")
            files[(t, p)] = f
        if not files:
            raise MConvertError(f"{self.iter_dir}: no mp_rank_* directories of EP rank {self.ep_rank}; the checkpoint "
                                "is incomplete")
        return files

    def _model_dict(self, state: dict, chunk: int, file: Path) -> dict[str, Any]:
        key = "model" if self.vpp is None else f"model{chunk}"
        if key not in state:
            raise MConvertError(f"{file}: no {key!r} entry (other rank files have it); the checkpoint is inconsistent")
        if not isinstance(state[key], dict):
            raise MConvertError(f"{file}: {key!r} is {type_name(state[key])}, not the dict of named tensors "
                                "Megatron saves; the file is damaged — re-copy it")
        return flatten(state[key])

    def _keymap(self, state: dict, pp_rank: int, chunk: int, file: Path) -> dict[str, str]:
        """raw key -> canonical global name for one stage chunk; drops omitted; unknown keys are an error."""
        layers = self.split.stage_layers(pp_rank)[chunk]
        out: dict[str, str] = {}
        for raw, val in self._model_dict(state, chunk, file).items():
            name = canonical_key(raw)
            if name is None:
                continue
            if not isinstance(val, torch.Tensor):
                raise MConvertError(f"{file}: key {raw!r} holds a {type(val).__name__}, not a tensor")
            if not val.is_floating_point():  # safety: an int view of float bits would be converted as numbers
                raise MConvertError(f"{file}: key {raw!r} holds {val.dtype} values, not floating-point weights; "
                                    "the file is corrupt — re-copy it")
            unit = unit_of(name)
            if isinstance(unit, int):
                if unit >= len(layers):
                    raise MConvertError(f"{file}: key {raw!r} has local layer {unit} but this stage holds "
                                        f"{len(layers)} layers (num_layers={self.spec.num_layers}, PP={self.pp}, "
                                        f"split: {self.split.describe()})")
                name = with_layer(name, layers[unit])
            try:
                self.spec.split_kind(name)
            except MConvertError:
                raise MConvertError(f"{file}: unmapped key {raw!r} (read as {name!r}) for a {self.spec.family} "
                                    "model; it is neither converted nor a known buffer") from None
            name = self._global_expert(name, raw, file)
            out[raw] = name
            self.shapes[name] = tuple(val.shape)
            self.__dict__.setdefault("_dtypes", {})[name] = val.dtype
        return out

    def _global_expert(self, name: str, raw: str, file: Path) -> str:
        """A routed expert's name with its global index: EP rank r holds experts r·E/EP .. (r+1)·E/EP - 1 as
        local indices 0 .. E/EP - 1."""
        local = expert_of(name)
        if local is None:
            return name
        per = self.spec.num_experts // self.ep  # type: ignore[operator]
        if local >= per:
            raise MConvertError(f"{file}: key {raw!r} is local expert {local} but each of the EP={self.ep} ranks "
                                f"holds {per} of the {self.spec.num_experts} experts; the args do not describe "
                                "these files — fix num_experts / expert_model_parallel_size")
        return with_expert(name, self.ep_rank * per + local)

    def location(self, unit: Unit) -> tuple[int, int]:
        """(pp_rank, chunk) of the stage that holds `unit`."""
        if unit == "embedding":
            return 0, 0
        if unit == "final":
            return self.pp - 1, (self.vpp or 1) - 1
        p, c, _ = self.split.layer_location(layer_of_unit(unit))  # type: ignore[arg-type]
        return p, c

    # ---- reading ------------------------------------------------------------------------------------
    def _lazy_model(self, t: int, p: int, c: int) -> Any:
        """Rank file (t, p)'s chunk c read tensor by tensor with pread at indexed offsets (built from one safe,
        weights-only load per file): no unpickling per unit, no mmap pages left in RSS. None: use safe_load."""
        cache = self.__dict__.setdefault("_tensor_index", {})
        if (t, p) not in cache:
            with _INDEX_LOCK:  # the readers' threads: one load per file
                if (t, p) not in cache:
                    f = self.files[(t, p)]
                    st = checkpoint_dict(safe_load(f), f)
                    self._remember(t, p, st)
                    del st
        entry = cache.get((t, p))
        return None if entry is None else LazyModel(entry[0], entry[1], f"{c}\0")

    def _remember(self, t: int, p: int, st: dict) -> None:
        """While rank file (t, p) is loaded anyway (opening checks): build its offset index and keep its small
        top-level entries, so reading units and `top_level` need no second unpickling of it."""
        cache = self.__dict__.setdefault("_tensor_index", {})
        tops = self.__dict__.setdefault("_top_level", {})
        f = self.files[(t, p)]
        if (t, p) not in cache:
            try:
                tensors = {f"{cc}\0{k}": v for cc in range(self.vpp or 1)
                           for k, v in self._model_dict(st, cc, f).items() if isinstance(v, torch.Tensor)}
            except MConvertError:
                return  # reported by the caller's own checks / at read time
            idx = TensorIndex.build(f, st, tensors)
            if idx is None:
                cache[(t, p)] = None
            else:
                fd = os.open(f, os.O_RDONLY)
                self.__dict__.setdefault("_fd_closers", []).append(owned_fd(self, fd))
                cache[(t, p)] = (idx, fd)
        tops[(t, p)] = {k: v for k, v in st.items() if not k.startswith("model") and k != "optimizer"}

    def _rank_models(self, p: int, c: int) -> list[LazyModel] | None:
        """Every TP rank's model of stage p, chunk c, read by offset — what the in-place merges need; None at
        TP=1 (nothing to merge), for a legacy checkpoint version, or when a rank file has no offset index."""
        if self.tp == 1 or self.checkpoint_version < 2:
            return None
        lazies = [self._lazy_model(t, p, c) for t in range(self.tp)]
        return None if any(lz is None for lz in lazies) else lazies

    def _read_dim0_direct(self, p: int, c: int, wanted: list[tuple[str, str]]) -> dict[str, torch.Tensor]:
        """Dim-0 split parameters (column / qkv / vocab / gated) of one unit, each rank's shard pread straight
        into the merged tensor (= `merge`, without shard copies and torch.cat); each rank's rows are checked
        finite as the shard loop would. Parameters it cannot read in place are left to that loop."""
        lazies = self._rank_models(p, c)
        if lazies is None:
            return {}
        out: dict[str, torch.Tensor] = {}
        for raw, name in wanted:
            kind = self.spec.split_kind(name)
            shape = self.shapes.get(name)
            if kind not in ("column", "qkv", "vocab", "gated") or not shape or not all(raw in lz for lz in lazies):
                continue
            got = merge_dim0_into(lazies, raw, kind, shape)
            if got is None:
                continue
            full, parts = got
            for t, rank_parts in enumerate(parts):
                if full.is_floating_point() and not all(all_finite(x) for x in rank_parts):
                    raise MConvertError(f"{self.files[(t, p)]}: key {raw!r} holds NaN or Inf values; the run "
                                        "diverged or the file is corrupt — convert an earlier iteration (--iteration N)")
            out[name] = full
        return out

    def _read_transposed_direct(self, p: int, c: int, wanted: list[tuple[str, str]]) -> dict[str, torch.Tensor]:
        """2-D parameters their consumer takes transposed (GPT-2's Conv1D), each rank's shard read whole (its
        record's CRC-32 checked), checked finite, and transposed straight into its place in the merged tensor,
        laid out column-major (`merge_transposed_into`): one shard in memory at a time beside the merged tensor,
        instead of every shard, or the merged tensor and its transposed copy. Parameters it cannot read so are
        left to the shard loop."""
        lazies = self._rank_models(p, c) if wanted else None
        if lazies is None:
            return {}
        out: dict[str, torch.Tensor] = {}
        for raw, name in wanted:
            shape = self.shapes.get(name)
            if not shape or not all(raw in lz for lz in lazies):
                continue

            def finite(t: int, x: torch.Tensor, raw: str = raw) -> None:
                if x.is_floating_point() and not all_finite(x):
                    raise MConvertError(f"{self.files[(t, p)]}: key {raw!r} holds NaN or Inf values; the run "
                                        "diverged or the file is corrupt — convert an earlier iteration (--iteration N)")

            got = merge_transposed_into(lazies, raw, self.spec.split_kind(name), shape, finite)
            if got is not None:
                out[name] = got
        return out

    def _unit_names(self, unit: Unit) -> list[str]:
        """The canonical names of one unit, in the order its stage's rank files hold them (with expert
        parallelism: EP rank 0's, then each other EP rank's experts; one expert's: the EP rank holding it)."""
        if self._subs is not None:
            if isinstance(unit, LayerPart) and unit.expert is not None:
                return self._expert_rank(unit.expert)._unit_names(unit)
            names = self._subs[0]._unit_names(unit)
            for sub in self._subs[1:]:
                names += [n for n in sub._unit_names(unit) if expert_of(n) is not None]
            return names
        p, c = self.location(unit)
        return [name for _, name in self._keys_of(p, c).get(unit, [])]

    def _keys_of(self, p: int, c: int) -> dict[Unit, list[tuple[str, str]]]:
        """Stage chunk (p, c)'s (raw key, canonical name) pairs by unit — and, for an MoE layer, by `LayerPart`
        too — in file order: a unit's keys without a walk over the whole stage."""
        cache = self.__dict__.setdefault("_keys_by_unit", {})
        if (p, c) not in cache:  # the readers' threads may build it twice: the same answer
            by: dict[Unit, list[tuple[str, str]]] = {}
            for raw, name in self._keymaps[(p, c)].items():
                u = unit_of(name)
                by.setdefault(u, []).append((raw, name))
                if isinstance(u, int) and self.spec.is_moe:
                    by.setdefault(LayerPart(u, expert_of(name)), []).append((raw, name))
            cache[(p, c)] = by
        return cache[(p, c)]

    def _expert_rank(self, expert: int) -> "MegatronSource":
        """The source of the EP rank whose files hold global expert `expert`."""
        assert self._subs is not None
        return self._subs[expert // (self.spec.num_experts // self.ep)]  # type: ignore[operator]

    def read_hf(self, unit: Unit) -> dict[str, torch.Tensor]:
        """`SourceBase.read_hf` (= `to_hf` over `read_mcore`): the parts of `read_hf_parts` joined."""
        out: dict[str, torch.Tensor] = {}
        for part in self.read_hf_parts(unit):
            out.update(part)
        return out

    def read_hf_parts(self, unit: Unit, only: set[str] | None = None) -> Iterator[dict[str, torch.Tensor]]:
        """`to_hf` over `read_mcore`, one parameter's HF tensors per part, one parameter per task on a small
        thread pool: pread and torch's ops release the GIL, so two parameters are read, merged and re-laid at
        once (the main thread alone would leave a core idle), and only the parameters in progress or not yet
        taken hold their merged form. Parameters HF stores transposed are merged column-major, so the plugin's
        transpose is free (`transforms.merge_transposed`). Same tensors, same order as `to_hf`; with `only`, the
        parameters none of whose HF tensors it names are left unread (their records are checked by whichever
        torchrun process reads them, or by the committing process)."""
        order, one, elements = self.hf_part_tasks(unit, only)
        yield from pmap_iter(one, order, elements)

    def hf_part_tasks(self, unit: Unit, only: set[str] | None = None) -> PartTasks:
        """What `read_hf_parts(unit, only)` reads, for a caller that runs several units on one pool
        (`base.parts_ahead`): the parameter names in order, the call that reads one (its HF tensors) and
        each one's element count. The unit's checks run here, before any of its tensors is read."""
        names = self._unit_names(unit)
        check_complete(self.spec, unit, names, str(self.path))
        if unit == "final":
            self._check_tied_copy()
        order = hf_order(self.spec, unit, names)
        if only is not None:
            order = [n for n in order if _keeps(only, hf_keys_for(self.spec, n))]

        def one(name: str) -> dict[str, torch.Tensor]:
            placed = self._read_placed(unit, name)
            if placed is not None:
                return placed
            lay = {name} if transposed_in_hf(self.spec, name) else frozenset()
            t = self.read_unit(unit, only={name}, transposed=lay)[0][name]
            return to_hf_one(self.spec, name, t, str(self.path), empty=buffers.empty)

        return order, one, param_elements(self.spec, unit)

    def _check_tied_copy(self) -> None:
        """A tied model's last stage holds its own copy of the embedding (`output_layer.weight`), and
        megatron-core computes the logits with that copy; the HF export (tied) and a re-shard (which rebuilds the
        copy from the embedding) keep the embedding. Refuse unless every TP rank's copy equals its embedding
        shard bit for bit: Megatron keeps them equal (the embedding group all-reduces their gradients), so a
        difference means the rank files disagree. One shard pair in memory at a time; once per conversion."""
        if self._subs is not None:
            self._subs[0]._check_tied_copy()
            return
        if not self.spec.tie_embeddings or self.__dict__.get("_tied_checked"):
            return
        p, c = self.location("final")
        copy = next((r for r, n in self._keys_of(p, c).get("final", []) if n == "output_layer.weight"), None)
        emb = next((r for r, n in self._keys_of(0, 0).get("embedding", [])
                    if n == "embedding.word_embeddings.weight"), None)
        if copy is None or emb is None:
            self._tied_checked = True
            return
        for t in range(self.tp):
            a = self._raw_tensor(t, p, c, copy)
            b = self._raw_tensor(t, 0, 0, emb)
            if a.shape != b.shape or a.dtype != b.dtype or not torch.equal(a, b):
                raise MConvertError(
                    f"{self.files[(t, p)]}: {copy!r} (the last stage's copy of the tied embedding, which Megatron "
                    f"computes the logits with) differs from {emb!r} in {self.files[(t, 0)]}; the rank files "
                    "disagree (from different runs, or one is corrupt) — re-copy the checkpoint, or convert an "
                    "earlier iteration (--iteration N)")
            del a, b
        self._tied_checked = True

    def _raw_tensor(self, t: int, p: int, c: int, raw: str) -> torch.Tensor:
        """Rank file (t, p)'s tensor `raw` of chunk c, as stored (pread by offset where the file is indexed)."""
        lazy = self._lazy_model(t, p, c)
        f = self.files[(t, p)]
        model = lazy if lazy is not None else self._model_dict(safe_load(f), c, f)
        if raw not in model:
            raise MConvertError(f"{f}: key {raw!r} is missing (TP rank 0 has it)")
        return model[raw]

    def _read_placed(self, unit: Unit, name: str) -> dict[str, torch.Tensor] | None:
        """`to_hf_one` of a parameter whose HF parts are whole row blocks of the merged tensor (Llama's q/k/v):
        each rank's rows pread straight into their place in the parts (`transforms.place_rows`), each checked
        finite as read; None when the layout or the file does not allow it (the caller merges, then maps)."""
        if self._subs is not None or self.checkpoint_version < 2:
            return None
        shape = self.shapes.get(name)
        if not shape or self.spec.split_kind(name) not in ("column", "qkv", "gated"):
            return None
        plan = hf_row_plan(self.spec, name, shape[0] * self.tp)
        if plan is None:
            return None
        p, c = self.location(unit)
        raw = next((r for r, n in self._keys_of(p, c).get(unit, []) if n == name), None)
        lazies = [self._lazy_model(t, p, c) for t in range(self.tp)]
        if raw is None or any(lz is None or raw not in lz for lz in lazies):
            return None
        names, part_rows, pieces = plan
        per_rank = place_rows(merge_rows(self.spec.split_kind(name), self.tp, shape[0], raw), pieces, name)
        # `place_rows` covers every row of every part, so pooled memory is written before it is read
        parts = [buffers.empty((n, *shape[1:]), lazies[0].dtype(raw)) for n in part_rows]
        row_bytes = parts[0][:1].numel() * parts[0].element_size()
        for t, (lz, mine) in enumerate(zip(lazies, per_rank)):
            for part, at, start, n in mine:
                dst = parts[part][at:at + n]
                if not lz.read_into(raw, dst, start=start * row_bytes):
                    return None
                if dst.is_floating_point() and not all_finite(dst):
                    raise MConvertError(f"{self.files[(t, p)]}: key {raw!r} holds NaN or Inf values; the run "
                                        "diverged or the file is corrupt — convert an earlier iteration (--iteration N)")
        return dict(zip(names, parts, strict=True))

    def read_unit(self, unit: Unit, with_optimizer: bool = False, transposed: set[str] | frozenset[str] = frozenset(),
                  only: set[str] | None = None) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
        """Full tensors of one unit (canonical global names, source key order) and, when asked, their Adam states.

        `only`: just these parameters. Names in `transposed` may come back column-major (same values; see
        `transforms.merge_transposed`)."""
        if self._subs is not None:
            return self._read_expert_ranks(unit, with_optimizer, transposed, only)
        p, c = self.location(unit)
        wanted = [(raw, name) for raw, name in self._keys_of(p, c).get(unit, []) if only is None or name in only]
        if any(name == "output_layer.weight" for _, name in wanted):
            self._check_tied_copy()
        shards: dict[str, list[torch.Tensor]] = {name: [] for _, name in wanted}
        ostates: dict[str, list[dict]] = {name: [] for _, name in wanted if not is_buffer(name)}
        direct = {} if with_optimizer else self._read_transposed_direct(p, c, [w for w in wanted if w[1] in transposed])
        if not with_optimizer:
            direct.update(self._read_dim0_direct(p, c, [w for w in wanted if w[1] not in direct]))
        for t in range(self.tp):
            f = self.files[(t, p)]
            lazy = self._lazy_model(t, p, c)  # pread by offset
            opt_by_name = None
            if with_optimizer:
                st, opt_by_name, self.optimizer_groups = self._with_states(t, p, unit)
            else:
                st = {} if lazy is not None else safe_load(f)
            model = lazy if lazy is not None else self._model_dict(st, c, f)
            for raw, name in wanted:
                if raw not in model:
                    raise MConvertError(f"{f}: key {raw!r} is missing (TP rank 0 has it)")
                if name in direct:  # already read into the merged tensor (and checked finite)
                    continue
                ten = model[raw]
                if ten.is_floating_point() and not all_finite(ten):
                    raise MConvertError(f"{f}: key {raw!r} holds NaN or Inf values; the run diverged or the file is "
                                        "corrupt — convert an earlier iteration (--iteration N)")
                if self.checkpoint_version < 2 and name.endswith("linear_qkv.weight") or (
                    self.checkpoint_version < 2 and name.endswith("linear_qkv.bias")
                ):
                    ten = _fix_legacy_qkv(ten, self.checkpoint_version, self.spec.num_attention_heads, self.spec.head_dim)
                shards[name].append(ten)
                if opt_by_name is not None and not is_buffer(name):  # a buffer (expert bias) has no Adam state
                    key = raw if self.vpp is None else f"model{c}.{raw}"
                    found = key
                    if opt_by_name.get(key) is None and self.vpp is None:
                        found = next((k for k in (f"model0.{raw}", f"module.{raw}") if opt_by_name.get(k)), key)
                    s = opt_by_name.get(found)
                    if s is None:
                        raise MConvertError(f"{f}: optimizer has no state for parameter {key!r}")
                    s = self._read_states(t, p, found, s)
                    optim.check_finite(s, key, str(f))
                    ostates[name].append(s)
            del st, model
        out = {name: direct[name] if name in direct else
               (_merge_transposed if name in transposed else _merge)(sh, self.spec.split_kind(name), name)
               for name, sh in shards.items()}
        for name in transposed & out.keys():
            out[name] = buffers.column_major(out[name])
        states = {}
        if with_optimizer:
            states = {n: optim.merge_states(s, self.spec.split_kind(n), n) for n, s in ostates.items()}
        return out, states

    def _with_states(self, t: int, p: int, unit: Unit) -> tuple[dict, dict, Any]:
        """Rank file (t, p) loaded whole, with its optimizer states by parameter name and its param groups, once
        per file (an MoE layer's dense part and experts would otherwise unpickle it once per expert). The state
        tensors are then read by `_read_states` with pread at indexed offsets, so the mapping's pages do not
        stay resident; without an index the mapped file is kept for one layer's units only."""
        layer = layer_of_unit(unit)
        cache = self.__dict__.setdefault("_states_cache", {})
        held = cache.get((t, p))
        if held is None or (held[3] is None and (layer is None or held[0] != layer)):
            cache.pop((t, p), None)  # the previous layer's mapping goes before the next file is loaded
            f = self.files[(t, p)]
            st = safe_load(f)
            by_name, groups = optim.index_states(st.get("optimizer"), str(f))
            lazy = None
            idx = TensorIndex.build(f, st, {f"{n}\0{k}": v for n, sts in by_name.items()
                                            for k, v in sts.items() if parkable(v)})
            if idx is not None:
                fd = os.open(f, os.O_RDONLY)
                self.__dict__.setdefault("_fd_closers", []).append(owned_fd(self, fd))
                lazy = LazyModel(idx, fd, "")
            held = (layer, st, by_name, lazy, groups)
            if lazy is not None or layer is not None:
                cache[(t, p)] = held
        return held[1], held[2], held[4]

    def _read_states(self, t: int, p: int, key: str, states: dict[str, Any]) -> dict[str, Any]:
        """Parameter `key`'s optimizer states of rank file (t, p), each tensor read into fresh memory when the
        file is indexed (`_with_states`), in the file's order."""
        held = self.__dict__.get("_states_cache", {}).get((t, p))
        lazy = held[3] if held is not None else None
        if lazy is None:
            return states
        return {k: lazy[f"{key}\0{k}"] if parkable(v) and f"{key}\0{k}" in lazy else v for k, v in states.items()}

    def _read_expert_ranks(self, unit: Unit, with_optimizer: bool, transposed: set[str] | frozenset[str],
                           only: set[str] | None) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
        """`read_unit` over every EP rank: the experts from the rank that holds each, the dense weights from EP
        rank 0 — and from every other EP rank, which must hold the same values (else a refusal naming both)."""
        assert self._subs is not None
        if isinstance(unit, LayerPart) and unit.expert is not None:  # one expert: only its EP rank's files
            return self._expert_rank(unit.expert).read_unit(unit, with_optimizer, transposed, only)
        sub0 = self._subs[0]
        p, _ = self.location(unit)
        out, states = sub0.read_unit(unit, with_optimizer, transposed, only)
        for sub in self._subs[1:]:
            mine = {n for n in sub._unit_names(unit) if only is None or n in only}
            if not mine:
                continue
            got, st = sub.read_unit(unit, with_optimizer, transposed, mine)
            for name, t in got.items():
                if expert_of(name) is not None:
                    out[name] = t
                    if name in st:
                        states[name] = st[name]
                elif not torch.equal(t, out[name]):
                    raise MConvertError(f"{sub.files[(0, p)]}: dense weight {name!r} differs from "
                                        f"{sub0.files[(0, p)]}; every EP rank holds the same copy — the rank files "
                                        "come from different runs or one is corrupt; re-copy the checkpoint")
        order = self._unit_names(unit)
        return {n: out[n] for n in order if n in out}, states

    def read_mcore(self, unit: Unit) -> dict[str, torch.Tensor]:
        """Full tensors of one unit under canonical global names; vocab rows as stored (padded). One parameter
        per task on the readers' pool (see `read_hf`); same tensors, same order as `read_unit`."""
        out: dict[str, torch.Tensor] = {}
        for part in pmap(lambda n: self.read_unit(unit, only={n})[0], self._unit_names(unit)):
            out.update(part)
        return out

    def layer_part_tasks(self, unit: Unit) -> PartTasks:
        """`base.LayerParts`: a dense layer's parameters, each read (merged over TP) alone."""
        return self._unit_names(unit), lambda n: self.read_unit(unit, only={n})[0], param_elements(self.spec, unit)

    def read_unit_parts(self, unit: Unit, with_optimizer: bool = False
                        ) -> Iterator[tuple[dict[str, torch.Tensor], dict[str, dict]]]:
        """`read_unit(unit, with_optimizer)` one parameter (with its Adam states) at a time where the unit does not
        `comes_whole` (a dense layer; the final unit of an MoE model with an MoE MTP layer: memory one expert)."""
        if self.comes_whole(unit):
            yield self.read_unit(unit, with_optimizer)
            return
        for name in self._unit_names(unit):
            yield self.read_unit(unit, with_optimizer, only={name})

    def preview(self, unit: Unit) -> dict[str, torch.Tensor]:
        """What `read_mcore(unit)` returns, as meta tensors (names in its order, full shapes, dtypes): from the
        key maps of the opening checks, no tensor data read. Writers lay out their files from it."""
        out: dict[str, torch.Tensor] = {}
        for name in self._unit_names(unit):
            shape = list(self.shapes[name])
            d = split_dim(self.spec.split_kind(name), len(shape))
            if d is not None:
                shape[d] *= self.tp
            out[name] = torch.empty(shape, dtype=self.__dict__["_dtypes"][name], device="meta")
        return out

    def close(self) -> None:
        """Close the rank files kept open for reading (the source reads nothing after this)."""
        self.__dict__.pop("_tensor_index", None)
        self.__dict__.pop("_states_cache", None)
        for close in self.__dict__.pop("_fd_closers", []):
            close()

    def top_level(self, pp_rank: int = 0, tp_rank: int = 0) -> dict[str, Any]:
        """Top-level entries other than the model and optimizer (args, iteration, scheduler, rng, ...)."""
        known = self.__dict__.get("_top_level", {}).get((tp_rank, pp_rank))
        if known is not None:
            return dict(known)
        st = checkpoint_dict(safe_load(self.files[(tp_rank, pp_rank)]), self.files[(tp_rank, pp_rank)])
        return {k: v for k, v in st.items() if not k.startswith("model") and k != "optimizer"}


_INDEX_LOCK = threading.Lock()  # the readers' threads: one index load per rank file


def parkable(v: Any) -> bool:
    """Whether an optimizer state entry can wait in a spool: a tensor with data (a 0-dim `step` stays)."""
    return isinstance(v, torch.Tensor) and v.dim() > 0 and v.numel() > 0






def _keeps(only: set[str], keys: list[str]) -> bool:
    """Whether a parameter made into HF tensors `keys` is wanted: one of them is in `only`, or its HF names are
    unknown here (then it is read, and the writer sorts its tensors out)."""
    return not keys or any(k in only for k in keys)


def _merge(shards: list[torch.Tensor], kind: str, name: str) -> torch.Tensor:
    """`transforms.merge` into pooled memory (`buffers.empty`) where it concatenates."""
    d = split_dim(kind, shards[0].dim()) if shards else None
    if d is None or len(shards) < 2 or any(s.shape != shards[0].shape or s.dtype != shards[0].dtype for s in shards):
        return merge(shards, kind, name)  # nothing to concatenate, or merge's own refusal
    shape = list(shards[0].shape)
    shape[d] *= len(shards)
    return merge(shards, kind, name, out=buffers.empty(shape, shards[0].dtype))


def _merge_transposed(shards: list[torch.Tensor], kind: str, name: str) -> torch.Tensor:
    """`transforms.merge_transposed` into pooled memory (`buffers.empty`) where it transposes into place."""
    if kind == "row" and len(shards) > 1 and shards[0].dim() == 2:
        rows, k = shards[0].shape
        out = buffers.empty((k * len(shards), rows), shards[0].dtype).t()
        return merge_transposed(shards, kind, name, out=out)
    return merge_transposed(shards, kind, name)


def merge_transposed_into(lazies: list[LazyModel], raw: str, kind: str, shard_shape: tuple[int, ...],
                          check: Any) -> torch.Tensor | None:
    """`merge` of a 2-D parameter's TP shards, laid out column-major (its `.t()` contiguous, as
    `buffers.column_major` lays it): each rank's shard is read TRANSPOSE_BLOCK bytes of rows at a time (whole
    when stored as a strided view), each block passed to `check(rank, block)` and transposed into its place in
    the transposed tensor before the next is read. A row-split shard [R, K] is
    columns t·K.. of the merge; a dim-0 split shard's rows go where `transforms.merge_rows` places them.
    None when a shard's shape or dtype differs from rank 0's (the caller's general path then reports it) or
    the kind is not split on one of the two dims."""
    if len(shard_shape) != 2 or kind not in ("row", "column", "qkv", "vocab", "gated"):
        return None
    rows, cols = shard_shape
    metas = [lz.meta(raw) for lz in lazies]
    if any(tuple(m.shape) != (rows, cols) or m.dtype != metas[0].dtype for m in metas):
        return None
    tp = len(lazies)
    if kind == "row":
        out_t = buffers.empty((cols * tp, rows), metas[0].dtype)
        places = [[(out_t[t * cols:(t + 1) * cols], 0, rows)] for t in range(tp)]
    else:
        try:
            pieces = merge_rows(kind, tp, rows, raw)
        except MConvertError:
            return None  # the shard loop's `merge` reports it
        out_t = buffers.empty((cols, rows * tp), metas[0].dtype)
        places = [[(out_t[:, at:at + n], start, n) for at, start, n in mine] for mine in pieces]
    step = max(1, min(rows, TRANSPOSE_BLOCK // max(1, cols * metas[0].dtype.itemsize)))
    block = torch.empty((step, cols), dtype=metas[0].dtype)  # reused for every rank's shard
    for t, (lz, mine) in enumerate(zip(lazies, places)):
        if _transposed_in_blocks(lz, raw, block, mine, lambda x, t=t: check(t, x)):
            continue
        shard = lz[raw]
        check(t, shard)
        for dst, start, n in mine:
            copy_transposed(shard[start:start + n], dst)
        del shard  # its pooled slot serves the next rank's shard
    return out_t.t()


def _transposed_in_blocks(lz: LazyModel, raw: str, block: torch.Tensor,
                          places: list[tuple[torch.Tensor, int, int]], check: Any) -> bool:
    """Shard `raw` read `len(block)` rows at a time into `block`, each block checked and transposed into the
    columns of `places` (dst [cols, n], first row, n) it covers while it is still in cache: a transpose whose
    source is in cache writes its scattered columns faster than one that reads a whole shard back from
    memory. False when the stored tensor cannot be read by rows (a strided view: the caller reads it whole)."""
    rows, step = lz.meta(raw).shape[0], block.shape[0]
    row_bytes = block[0].numel() * block.element_size()
    for r0 in range(0, rows, step):
        n = min(step, rows - r0)
        if not lz.read_into(raw, block[:n], start=r0 * row_bytes):
            if r0:  # every block of one tensor reads alike
                raise MConvertError(f"internal: {raw!r} read by rows stopped at row {r0}")
            return False
        check(block[:n])
        for dst, start, m in places:
            a, b = max(start, r0), min(start + m, r0 + n)
            if a < b:
                copy_transposed(block[a - r0:b - r0], dst[:, a - start:b - start])
    return True


def merge_dim0_into(lazies: list[LazyModel], raw: str, kind: str, shard_shape: tuple[int, ...]
                    ) -> tuple[torch.Tensor, list[list[torch.Tensor]]] | None:
    """Merge the TP shards of a dim-0 split parameter (column / qkv / vocab / gated) by reading each rank's
    rows straight into the full tensor where `transforms.merge_rows` places them — what `transforms.merge`
    computes, without the shard copies and the concatenation. Returns (full, each rank's slices of it) or None
    when a shard cannot be read in place (the caller then merges the loaded shards)."""
    try:
        pieces = merge_rows(kind, len(lazies), shard_shape[0], raw)
    except MConvertError:
        return None  # the shard loop's `merge` reports it
    full = buffers.empty((shard_shape[0] * len(lazies), *shard_shape[1:]), lazies[0].dtype(raw))
    row_bytes = full[0].numel() * full.element_size() if full.dim() > 1 else full.element_size()
    parts: list[list[torch.Tensor]] = []
    for lz, mine in zip(lazies, pieces):
        got = []
        for at, start, n in mine:
            dst = full[at:at + n]
            if not lz.read_into(raw, dst, start=start * row_bytes):
                return None
            got.append(dst)
        parts.append(got)
    return full, parts
