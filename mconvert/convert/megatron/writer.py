"""Megatron-LM legacy "torch" checkpoints: the stage-buffered writer.

It splits full tensors for the target TP, streams them into their stage's rank files (or spools them, Adam
states included, until the stage is complete), writes its rank files.
"""

from __future__ import annotations

import argparse
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from mconvert.convert.megatron import optimizer as optim
from mconvert.convert.base import Unit
from mconvert.convert.megatron.checkpoint import args_dict
from mconvert.io import buffers
from mconvert.io.atomic import record_digest
from mconvert.io.hashing import hash_file, manifest_hash
from mconvert.io.paths import make_dirs
from mconvert.io.casts import narrowed
from mconvert.io.torchsave import Spool, TorchSaveStream, save_spooled
from mconvert.convert.scaleout import world
from mconvert.layouts.megatron import (
    CHECKPOINT_VERSION,
    PipelineSplit,
    rank_file,
    save_rank_file,
    write_latest,
)
from mconvert.errors import MConvertError
from mconvert.mappings.keys import with_layer
from mconvert.mappings.transforms import (pad_vocab, split, split_padded)
from mconvert.spec import ModelSpec, expert_of, layer_of_unit, with_expert
from mconvert.convert.megatron.source import parkable
from mconvert.convert.writer import Writer

# megatron-core local-spec modules whose state_dict carries `<module>._extra_state` (None): strict loading
# into megatron-core's GPTModel and the trainer expects them.
EXTRA_STATE_MODULES = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "output_layer", "linear_q_proj",
                       "linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj", "eh_proj")


SHARED_EXPERTS = "mlp.shared_experts."


def shared_experts_last(entries: list[tuple[str, Any, Any]]) -> list[tuple[str, Any, Any]]:
    """A rank file's (local name, ...) entries with each MoE layer's shared experts after its routed experts, where
    megatron-core's MoELayer registers them (router, experts, shared experts): they arrive with the layer's dense
    part, before its experts. Every other entry keeps its place."""
    shared: dict[str, list[tuple[str, Any, Any]]] = {}
    rest = []
    for e in entries:
        head, sep, _ = e[0].partition(SHARED_EXPERTS)
        if sep:
            shared.setdefault(head, []).append(e)
        else:
            rest.append(e)
    if not shared:
        return entries
    last = {e[0].partition("mlp.")[0]: i for i, e in enumerate(rest) if "mlp." in e[0]}  # a layer's last MLP entry
    out = []
    for i, e in enumerate(rest):
        out.append(e)
        head = e[0].partition("mlp.")[0]
        if last.get(head) == i:
            out += shared.pop(head, [])
    return out + [e for group in shared.values() for e in group]


class MegatronWriter(Writer):
    """Writes full tensors, unit by unit, as a Megatron torch-format checkpoint at a target TP/PP(/VPP).

    Streams (or spools) one pipeline stage's shards (all TP ranks) and writes its rank files as soon as it is
    complete.
    A `Writer` (`convert/writer.py`) reading `read_mcore`; with `optimizer_groups` it `takes_states` (each
    parameter's Adam states come with it). The verb has checked the layout (`ModelSpec.check_parallel`)."""

    reads = "mcore"
    splits_experts = True  # takes an MoE layer as its dense part and one unit per expert
    shares_work = True  # a torchrun process writes the rank files of the stages it owns

    def __init__(self, out: Path, spec: ModelSpec, tp: int, pp: int, vpp: int | None = None,
                 iteration: int | str = "release", args: Any = None, top_level: dict[str, Any] | None = None,
                 optimizer_groups: list[dict[str, Any]] | None = None, dtype: torch.dtype | None = None,
                 rank_top_level: Any = None, extra_state: bool = True,
                 preview: Any = None, ep: int = 1, ep_rank: int = 0, split: PipelineSplit | None = None) -> None:
        self.split = checked_split(spec, pp, vpp, split)
        self.out, self.spec, self.tp, self.pp, self.vpp = Path(out), spec, tp, pp, vpp
        self.ep, self.ep_rank = ep, ep_rank  # this writer's EP rank: its experts and every dense weight
        self.iteration, self.dtype = iteration, dtype
        self.args = self._target_args(args)
        self.top_level = dict(top_level or {})
        self.optimizer_groups = optimizer_groups
        self.takes_states = optimizer_groups is not None
        self.rank_top_level = rank_top_level  # (tp_rank, pp_rank) -> per-rank top-level entries (rng_state)
        self.extra_state = extra_state
        self.rows = spec.padded_vocab_size(tp)
        self._stage_units = {p: self._units_of_stage(p) for p in range(pp)}
        self._buffer: dict[int, dict[int, list[tuple[str, torch.Tensor | None, list]]]] = {}
        self._received: dict[int, set] = {p: set() for p in range(pp)}
        self._in_parts: set[Unit] = set()  # units begun with `add(..., complete=False)`, not yet ended
        self._embedding: tuple[torch.Tensor, dict | None] | None = None
        self.files: list[Path] = []
        self._spools: dict[tuple[int, int], Any] = {}
        self._hasher: Any = None
        self._hashes: list[tuple[Path, tuple[int, int], str, Any]] = []
        # Streaming: with the source's `preview` (each unit's tensors as meta tensors: names, shapes,
        # dtypes, in the order `read_mcore` returns them) a stage's rank files are laid out when its first
        # unit arrives and written front to back as the shards come (`io.torchsave.TorchSaveStream`): no spool,
        # O_DIRECT, the manifest hash on the way. Without it (or with optimizer states, or VPP, whose stages interleave)
        # the spool path below is used.
        self.preview = preview if optimizer_groups is None and vpp is None else None
        self._streams: dict[int, dict[int, Any]] = {}  # pp rank -> tp rank -> TorchSaveStream
        self._placeholders: dict[tuple[int, int, int, str], torch.Tensor] = {}  # (p, t, chunk, local name)
        # Under torchrun (`scaleout`) each rank writes the rank files of the pipeline stages it owns.
        self.world = world()

    def _target_args(self, args: Any) -> argparse.Namespace:
        return target_args(self.spec, args, self.tp, self.pp, self.vpp, self.ep, self.split)

    def _units_of_stage(self, p: int) -> list[Unit]:
        """Stage p's units in arrival order, an MoE layer as its dense part and its experts."""
        units: list[Unit] = ["embedding"] if p == 0 else []
        for chunk in self.split.stage_layers(p):
            for layer in chunk:
                units += self.spec.layer_units(layer)
        if p == self.pp - 1:
            units.append("final")
        return units

    def _parts(self, unit: Unit) -> list[Unit]:
        """The units of `_units_of_stage` that `unit` delivers: an MoE layer given whole (by a source that
        does not split it) stands for its dense part and all its experts."""
        return self.spec.layer_units(unit) if isinstance(unit, int) else [unit]

    def _where(self, unit: Unit) -> tuple[int, int, int | None]:
        if unit == "embedding":
            return 0, 0, None
        if unit == "final":
            return self.pp - 1, (self.vpp or 1) - 1, None
        return self.split.layer_location(layer_of_unit(unit))  # type: ignore[arg-type]

    def _rank_file(self, t: int, p: int) -> Path:
        return rank_file(self.out, self.iteration, t, p, self.pp, self.ep_rank, self.ep)

    def _mine(self, tensors: dict[str, Any]) -> dict[str, Any]:
        """The entries this EP rank's files hold: every dense one, and its own experts renamed to their local
        index (global expert g = ep_rank · E/EP + local)."""
        if self.ep == 1:
            return tensors
        per = self.spec.num_experts // self.ep  # type: ignore[operator]
        first = self.ep_rank * per
        out: dict[str, Any] = {}
        for name, t in tensors.items():
            g = expert_of(name)
            if g is None:
                out[name] = t
            elif first <= g < first + per:
                out[with_expert(name, g - first)] = t
        return out

    def _tied_copy_needed(self, unit: Unit) -> bool:
        """Whether `unit` is the embedding whose tensor the last stage repeats as its output layer."""
        return unit == "embedding" and self.spec.tie_embeddings and self.pp > 1

    def needs(self, unit: Unit) -> bool:
        """Whether this rank must read `unit`: it belongs to a stage this rank writes (or is the embedding the
        last stage, written here, repeats); always, in one process."""
        return (self.world.owns(self._where(unit)[0])
                or (self._tied_copy_needed(unit) and self.world.owns(self.pp - 1)))

    def skip(self, unit: Unit) -> None:
        """Pass `unit` by unread (`needs` is False): another rank writes its stage."""
        self._received[self._where(unit)[0]].update(self._parts(unit))

    # `add` takes a unit in parts (`complete=False`, then `complete=True` after the last): streamed from the
    # preview, each part's shards go out as they come; else they are spooled as they come (Adam states with them)
    takes_parts = True

    def add(self, unit: Unit, tensors: dict[str, torch.Tensor], states: dict[str, dict] | None = None,
            complete: bool = True) -> None:
        """Take one unit's full tensors (canonical global names) and, optionally, their full Adam states.
        `complete=False` (`takes_parts`): more of the unit's tensors follow in later calls."""
        p, c, local = self._where(unit)
        if complete and unit in self._in_parts:  # the end of a unit given in parts: its tensors all came
            self._in_parts.discard(unit)
            if tensors or states:
                raise MConvertError(f"internal: unit {unit!r} ended with tensors")
            self._complete(unit, p)
            return
        if not complete:
            self._in_parts.add(unit)
        if not self.world.owns(p):  # read only for the tied output layer of the last stage
            if self._tied_copy_needed(unit):
                name = "embedding.word_embeddings.weight"
                self._embedding = (tensors[name], (states or {}).get(name))
            self._received[p].update(self._parts(unit))
            return
        if self.preview is not None and p not in self._streams:
            self._open_stage(p)
        new = self._entries(unit, tensors, states, real=True)
        if p in self._streams:
            for local_name, shards, _ in new:
                if shards is None:
                    continue
                for t, x in enumerate(shards):
                    ph = self._placeholders.pop((p, t, c, local_name), None)
                    if ph is None or tuple(ph.shape) != tuple(x.shape) or ph.dtype != x.dtype:
                        want = "nothing" if ph is None else f"{tuple(ph.shape)} {ph.dtype}"
                        raise MConvertError(f"internal: {local_name} arrived as {tuple(x.shape)} {x.dtype} where the "
                                            f"source's preview planned {want}")
                    self._streams[p][t].feed(ph, x)  # a view: its writer gathers the rows
        else:
            self._buffer.setdefault(p, {}).setdefault(c, []).extend(new)
        if complete:
            self._complete(unit, p)

    def _complete(self, unit: Unit, p: int) -> None:
        """`unit` has come whole: stage p's rank files are written once every unit of the stage has (by the
        process that owns the stage)."""
        self._received[p].update(self._parts(unit))
        if self.world.owns(p) and len(self._received[p]) == len(self._stage_units[p]):
            self._flush(p)

    def _entries(self, unit: Unit, tensors: dict[str, torch.Tensor], states: dict[str, dict] | None,
                 real: bool) -> list[tuple[str, Any, Any]]:
        """(local name, TP shards or None, Adam state shards) of one unit — on meta tensors when planning."""
        p, c, local = self._where(unit)
        tensors = dict(self._mine(tensors))
        states = dict(self._mine(states or {}))
        tied = self.spec.tie_embeddings
        if unit == "embedding" and tied and self.pp > 1:
            name = "embedding.word_embeddings.weight"
            self._embedding = (tensors[name], states.get(name))
        if unit == "final" and tied:
            if self.pp == 1:
                tensors.pop("output_layer.weight", None)
                states.pop("output_layer.weight", None)
            elif "output_layer.weight" not in tensors:
                assert self._embedding is not None
                tensors["output_layer.weight"] = self._embedding[0]
                if self._embedding[1] is not None:
                    states["output_layer.weight"] = self._embedding[1]
            self._embedding = None
        entries: list[tuple[str, Any, Any]] = []
        for name, full in tensors.items():
            kind = self.spec.split_kind(name)
            st = states.get(name)
            # streamed: a gated shard goes out as its gate and up row blocks, a vocab shard as its stored rows
            # and its padding, never concatenated in memory
            blocks = real and self.preview is not None
            if kind == "vocab" and st is not None:
                st = {k: pad_vocab(v, self.rows, self.spec.vocab_size, f"{name}.{k}")
                      if isinstance(v, torch.Tensor) and v.dim() > 0 and k != "step" else v
                      for k, v in st.items()}
            if self.dtype is not None and full.dtype != self.dtype:
                full = narrowed(full, self.dtype, name)
            local_name = name if local is None else with_layer(name, local)
            if kind == "vocab":
                shards = split_padded(full, self.rows, self.spec.vocab_size, self.tp, name, buffers.empty, blocks)
            else:
                shards = split(full, kind, self.tp, name, blocks=blocks)
            ost = optim.split_states(st, kind, self.tp, name) if st is not None else None
            if real and self.preview is None and full.dim() > 0 and full.numel():  # no stage in RAM
                shards = [self._spool(p, t).park(x) for t, x in enumerate(shards)]
                if ost is not None:  # the Adam moments wait in the same spool as their parameter
                    ost = [{k: self._spool(p, t).park(v) if parkable(v) else v for k, v in o.items()}
                           for t, o in enumerate(ost)]
            entries.append((local_name, shards, ost))
        if unit == "final" and tied and self.extra_state and not any(e[0] == "output_layer.weight" for e in entries):
            entries.append(("output_layer._extra_state", None, None))  # tied head at PP=1: module without weight
        return entries

    def _open_stage(self, p: int) -> None:
        """Lay out stage p's rank files from the source's preview and open their streams: each planned shard
        gets a placeholder (untouched memory) that the real shard's bytes replace as they arrive."""
        saved = self._embedding
        chunks: dict[int, list] = {}
        for unit in self._stage_units[p]:
            if unit == "final" and self.spec.tie_embeddings and self.pp > 1 and p > 0:
                self._entries("embedding", self.preview("embedding"), None, real=False)  # the tied copy
            meta = self.preview(unit)
            _, c, _ = self._where(unit)
            chunks.setdefault(c, []).extend(self._entries(unit, meta, None, real=False))
        self._embedding = saved
        streams: dict[int, Any] = {}
        try:
            for t in range(self.tp):
                placed: dict[int, list] = {}
                mine: list[torch.Tensor] = []
                for c, entries in chunks.items():
                    placed[c] = []
                    for local_name, shards, ost in entries:
                        if shards is None:
                            placed[c].append((local_name, None, ost))
                            continue
                        x = shards[t]
                        ph = torch.empty(tuple(x.shape), dtype=x.dtype)  # never written: no resident pages
                        self._placeholders[(p, t, c, local_name)] = ph
                        mine.append(ph)
                        placed[c].append((local_name, [ph] * self.tp, ost))
                state = self._state(t, p, placed)
                path = self._rank_file(t, p)
                make_dirs(path.parent)
                streams[t] = TorchSaveStream(state, path.with_name(path.name + ".tmp"), mine)
        except BaseException:
            for st in streams.values():
                st.abort()
            raise
        self._streams[p] = streams

    def abort(self) -> None:
        """Stop every open rank-file stream and spool (threads, staging memory, descriptors); the caller
        removes the output directory."""
        for streams in self._streams.values():
            for st in streams.values():
                st.abort()
        self._streams.clear()
        for spool in self._spools.values():
            spool.close()
        self._spools.clear()

    def _close_stage(self, p: int) -> None:
        for t, stream in sorted(self._streams.pop(p).items()):
            digest = stream.close()
            path = self._rank_file(t, p)
            os.replace(stream.path, path)
            record_digest(path, digest)
            self.files.append(path)

    def _state(self, t: int, p: int, chunks: dict[int, list]) -> dict[str, Any]:
        """Rank file (t, p)'s state dict in Megatron-LM's key order: args, checkpoint_version, iteration,
        model*, optimizer, the rest."""
        state: dict[str, Any] = {"args": self.args, "checkpoint_version": CHECKPOINT_VERSION,
                                 "iteration": 0 if self.iteration == "release" else int(self.iteration)}
        rest = {k: _interned(v) if k == "opt_param_scheduler" else v for k, v in self.top_level.items()}
        if self.rank_top_level is not None:
            rest.update(self.rank_top_level(t, p))
        params: list[tuple[str, dict]] = []
        for c in range(self.vpp or 1):
            model: dict[str, Any] = {}
            entries = shared_experts_last(chunks.get(c, []))
            for i, (local_name, shards, ost) in enumerate(entries):
                if shards is None:
                    model[local_name] = None
                    continue
                model[local_name] = _own(shards[t])
                module = local_name.rsplit(".", 1)[0]
                nxt = entries[i + 1][0].rsplit(".", 1)[0] if i + 1 < len(entries) else None
                if self.extra_state and module.endswith(EXTRA_STATE_MODULES) and nxt != module:
                    model[module + "._extra_state"] = None  # megatron-core local spec: one per linear
                if ost is not None:
                    pname = local_name if self.vpp is None else f"model{c}.{local_name}"
                    params.append((pname, {k: _own(v) if isinstance(v, torch.Tensor) else v
                                           for k, v in ost[t].items()}))
            state["model" if self.vpp is None else f"model{c}"] = model
        if self.optimizer_groups is not None:
            state["optimizer"] = optim.build_state_dict(params, self.optimizer_groups)
        for k in ("opt_param_scheduler", "rng_state", "num_floating_point_operations_so_far", *rest):
            if k in rest and k not in state:
                state[k] = rest[k]
        return state

    def _flush(self, p: int) -> None:
        if p in self._streams:
            self._close_stage(p)
            return
        chunks = self._buffer.pop(p, {})
        for t in range(self.tp):
            state = self._state(t, p, chunks)
            path = self._rank_file(t, p)
            spool = self._spools.pop((p, t), None)
            if spool is None:
                save_rank_file(path, state)
            else:  # byte-identical to save_rank_file, the parked shard bytes copied in by the kernel
                make_dirs(path.parent)
                tmp = path.with_name(path.name + ".tmp")
                save_spooled(state, tmp, spool)
                spool.close()
                os.replace(tmp, path)
            self.files.append(path)
            self._hash_in_background(path)
        del chunks

    def _hash_in_background(self, path: Path) -> None:
        """The manifest's hash of a finished rank file on a thread, overlapping the next stage's reads; `close`
        hands it to the manifest (`atomic.record_digest`), which uses it only if the file is unchanged since."""
        if self._hasher is None:
            self._hasher = ThreadPoolExecutor(1, thread_name_prefix="hash-rank-files")
        st = os.stat(path)
        algorithm = manifest_hash()
        self._hashes.append((path, (st.st_size, st.st_mtime_ns), algorithm,
                             self._hasher.submit(hash_file, path, algorithm)))

    def _spool(self, p: int, t: int) -> Any:
        """The spool of rank file (t, p): shard bytes wait there, not in memory, until the stage is complete."""
        if (p, t) not in self._spools:
            make_dirs(self.out)
            self._spools[(p, t)] = Spool(self.out / f".spool-{p:03d}-{t:02d}-{self.ep_rank:03d}")
        return self._spools[(p, t)]

    def close(self) -> list[Path]:
        """Check every stage was written and write the tracker file."""
        missing = [p for p in range(self.pp) if len(self._received[p]) != len(self._stage_units[p])]
        if missing:
            raise MConvertError(f"internal: pipeline stages {missing} did not receive all their units")
        if self.world.primary:
            write_latest(self.out, self.iteration)
        for path, (size, mtime), algorithm, fut in self._hashes:
            try:
                digest = fut.result()
                st = os.stat(path)
            except OSError:  # the manifest then hashes the file itself
                continue
            if (st.st_size, st.st_mtime_ns) == (size, mtime):
                record_digest(path, digest, algorithm)
        self._hashes.clear()
        if self._hasher is not None:
            self._hasher.shutdown()
            self._hasher = None
        return self.files


def checked_split(spec: ModelSpec, pp: int, vpp: int | None, split: PipelineSplit | None) -> PipelineSplit:
    """The pipeline split a writer at PP/VPP uses (None: the even one, which `PipelineSplit.make` refuses where
    the layers do not divide); the verb has checked heads, groups, ffn and experts at its TP/EP
    (`check_parallel`)."""
    if split is None:
        return PipelineSplit.make(spec.num_layers, pp, vpp)
    if (split.pp, split.vpp, split.num_layers) != (pp, vpp, spec.num_layers):
        raise MConvertError(f"internal: pipeline split {split!r} for PP={pp} VPP={vpp}, {spec.num_layers} layers")
    return split


def target_args(spec: ModelSpec, args: Any, tp: int, pp: int, vpp: int | None, ep: int = 1,
                split: PipelineSplit | None = None) -> argparse.Namespace:
    """The args a written checkpoint carries: the source's (or, without them, the spec's) with the target
    TP/PP/VPP/EP, pipeline split and padded vocab; shared by the torch and torch_dist writers so both say the
    same."""
    ns = _layout_args(spec, args, tp, pp, vpp, ep)
    split = split or PipelineSplit.make(spec.num_layers, pp, vpp)
    for k, v in split.megatron_args().items():
        if not split.even or hasattr(ns, k):  # an even split adds no args the source did not have
            setattr(ns, k, v)
    return ns


def _layout_args(spec: ModelSpec, args: Any, tp: int, pp: int, vpp: int | None, ep: int) -> argparse.Namespace:
    if args is None:  # bos/eos ride along as extra args (Megatron ignores unknown ones)
        return spec.to_megatron_args(tp, pp, vpp, ep=ep, bos_token_id=spec.bos_token_id,
                                     eos_token_id=spec.eos_token_id)
    ns = argparse.Namespace(**_interned(args_dict(args, "the source checkpoint")))
    ns.tensor_model_parallel_size = tp
    ns.pipeline_model_parallel_size = pp
    ns.virtual_pipeline_model_parallel_size = vpp
    ns.padded_vocab_size = spec.padded_vocab_size(tp)
    if spec.is_moe:
        ns.expert_model_parallel_size = ep
        if getattr(ns, "expert_tensor_parallel_size", None) is not None:  # expert TP follows TP
            ns.expert_tensor_parallel_size = tp
    # what Megatron-LM's validate_args derives from the layout follows it (readers refuse weight shards
    # other than one per TP rank)
    if getattr(ns, "tensor_parallel_num_weight_shards", None) is not None:
        ns.tensor_parallel_num_weight_shards = tp
    if getattr(ns, "expert_tensor_parallel_num_weight_shards", None) is not None:
        ns.expert_tensor_parallel_num_weight_shards = getattr(ns, "expert_tensor_parallel_size", None) or tp
    if getattr(ns, "transformer_pipeline_model_parallel_size", None) is not None:
        ns.transformer_pipeline_model_parallel_size = pp
    if getattr(ns, "vocab_size", None) is None:
        ns.vocab_size = spec.vocab_size
    return ns


class ExpertParallelWriter(Writer):
    """A Megatron checkpoint at EP > 1: one `MegatronWriter` per EP rank, each given every unit (it keeps the
    dense weights and its own experts), all writing into one output directory."""

    reads = "mcore"
    splits_experts = True
    shares_work = True

    def __init__(self, writers: list[MegatronWriter]) -> None:
        self.writers = writers
        self.takes_states = writers[0].takes_states
        self.takes_parts = all(w.takes_parts for w in writers)  # each EP rank's writer keeps its share of a part

    def add(self, unit: Unit, tensors: dict[str, torch.Tensor], states: dict[str, dict] | None = None,
            complete: bool = True) -> None:
        for w in self.writers:
            w.add(unit, tensors, states, complete)

    def needs(self, unit: Unit) -> bool:
        """Whether this torchrun rank reads `unit` (the EP ranks' writers own the same pipeline stages)."""
        return any(w.needs(unit) for w in self.writers)

    def skip(self, unit: Unit) -> None:
        for w in self.writers:
            w.skip(unit)

    def abort(self) -> None:
        for w in self.writers:
            w.abort()

    def close(self) -> list[Path]:
        return [f for w in self.writers for f in w.close()]


def megatron_writer(out: Path, spec: ModelSpec, tp: int, pp: int, vpp: int | None = None, ep: int = 1,
                    **kw: Any) -> MegatronWriter | ExpertParallelWriter:
    """The writer of a Megatron checkpoint at TP/PP(/VPP)/EP (`kw`: `MegatronWriter`'s options, `split` among
    them)."""
    checked_split(spec, pp, vpp, kw.get("split"))
    if ep == 1:
        return MegatronWriter(out, spec, tp, pp, vpp, **kw)
    return ExpertParallelWriter([MegatronWriter(out, spec, tp, pp, vpp, ep=ep, ep_rank=e, **kw) for e in range(ep)])


def _own(t: torch.Tensor) -> torch.Tensor:
    """A tensor that owns exactly its bytes: torch.save of a view would save the whole storage."""
    if t.dim() == 0:
        return t.clone()
    if not t.is_contiguous() or t.untyped_storage().nbytes() != t.numel() * t.element_size() or t.storage_offset():
        return t.clone(memory_format=torch.contiguous_format)
    return t


def _interned(obj: Any) -> Any:
    """Identifier-like str keys and values interned, as Python interns the literals of the code that wrote the
    source: pickle then shares them the same way, so a round trip is byte-identical, not just equal."""
    if isinstance(obj, str):
        return sys.intern(obj) if obj.isidentifier() else obj
    if isinstance(obj, dict):
        return {_interned(k): _interned(v) for k, v in obj.items()}
    return obj
