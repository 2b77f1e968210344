"""megatron-core `dist_checkpointing` "torch_dist" checkpoints, read on CPU without importing megatron.

An iteration dir holds `common.pt` (args, checkpoint_version, iteration), `metadata.json` (the backend) and a
PyTorch DCP checkpoint (`.metadata` + `*.distcp`). Keys are global and unsharded, whatever TP/PP wrote them;
layers are stacked (`decoder.layers.<name>` has shape `[num_layers, ...]`), norms carry TE names, SwiGLU fc1 is
in TP=1 order (`[gate; up]`), `_extra_state/shard_*` entries are bytes. `torch.distributed.checkpoint` is used
only as a file reader (no process group): a unit reads just its own layer's slice of every stacked tensor.
With `read_unit(unit, with_optimizer=True)` the distributed optimizer's states of each parameter come along:
`fully_reshardable` ones read the same way, `dp_reshardable` ones (Megatron-LM's default) as the parameter's
slice of each source TP rank's DDP bucket (`dp_buckets.py`), merged. The writer is `torch_dist_writer.py`.
"""

from __future__ import annotations

import os
from dataclasses import replace
import re
import tempfile
from pathlib import Path
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from mconvert.convert.megatron import bridge
from mconvert.convert.megatron import dp_buckets
from mconvert.convert.megatron import optimizer as optim
from mconvert.convert.base import SourceBase, Unit
from mconvert.convert.megatron.checkpoint import args_dict, checkpoint_dict, megatron_spec, resolve_iteration_dir
from mconvert.io.atomic import listed_by_manifest
from mconvert.layouts.megatron import PipelineSplit, stored_iteration
from mconvert.io.integrity import INTEGRITY, check_integrity
from mconvert.io.paths import check_regular, contained, inside_file, load_json_object
from mconvert.io.safeload import safe_load, safe_load_dcp_metadata
from mconvert.io.crc import crc_checks_now
from mconvert.io.casts import all_finite
from mconvert.errors import MConvertError, expect, renamed
from mconvert.mappings.keys import canonical_key, unit_of
from mconvert.mappings.plugin import check_complete, hf_keys_for, hf_order, to_hf_one
from mconvert.mappings.transforms import merge
from mconvert.spec import LayerPart, comes_whole, expert_of, is_buffer, layer_of_unit, with_expert

STACKED_PREFIX = "decoder.layers."
MTP_PREFIX = "mtp.layers."
# Routed experts are stacked twice: `decoder.layers.mlp.experts.experts.<linear>` is [num_layers, num_experts, ...]
# (global expert order); read as `decoder.layers.*.mlp.experts.local_experts.*.<linear>`.
STACKED_EXPERTS, EXPERT_TEMPLATE = ".mlp.experts.experts.", ".mlp.experts.local_experts.*."
# Explicit drops: top-level entries of a Megatron-LM save that are not model weights.
DROP_PREFIXES: dict[str, None] = {"optimizer.": None, "rng_state": None, "rerun_state_machine_state": None}
# megatron-core's distributed optimizer, `fully_reshardable` layout: one tensor per parameter and state
# (`param` = fp32 main copy, `exp_avg`, `exp_avg_sq`) with the parameter's global shape and chunks, under
# `optimizer.state.<state>.<parameter key>`; the param groups (with `step`) live in common.pt's `optimizer`.
OPTIMIZER_STATE_PREFIX = "optimizer.state."
# Megatron-LM's torch_dist rng state: one ShardedObject per (pp_rank, tp_rank), `rng_state/shard_<p>.<t>_<P>.<T>`,
# whose bytes are `torch.save([list of per-DP-rank rng dicts])`
RNG_STATE = "rng_state"
RNG_SHARD = re.compile(r"rng_state/shard_(\d+)\.(\d+)_(\d+)\.(\d+)")
MAX_RNG_BYTES = 64 << 20  # one rank's rng states (python, numpy, torch, cuda, tracker) are kilobytes
RESHARDABLE_OPTIMIZER = "fully_reshardable"
# Megatron-LM's default layout: the states in megatron-core's DDP buckets, one flat tensor per TP×PP domain,
# buffer, bucket and state (`dp_buckets.py`), the param groups and bucket sizes as per-domain ShardedObjects
DP_RESHARDABLE = "dp_reshardable"
OPTIMIZER_LAYOUTS = dp_buckets.OPTIMIZER_LAYOUTS
DP_DOMAIN = re.compile(r"optimizer\.distributed\.dp_group_idx_(\d+)\.per_bucket_numel_unpadded/shard_0_1")
MAX_OBJECT_BYTES = 64 << 20  # param groups, bucket sizes: kilobytes
# newer megatron-core (0.19 here) writes no common.pt: its entries are this ShardedObject of the DCP files
COMMON_STATE = "common_state/shard_0_1"


def _layer_keyed(key: str) -> bool:
    """Whether a DCP key (or its optimizer state's) names one layer: `decoder.layers.<N>.…`."""
    if key.startswith(OPTIMIZER_STATE_PREFIX) and "." in key[len(OPTIMIZER_STATE_PREFIX):]:
        key = key[len(OPTIMIZER_STATE_PREFIX):].split(".", 1)[1]
    return key.startswith(STACKED_PREFIX) and key[len(STACKED_PREFIX):].split(".")[0].isdigit()


def _mtp_keyed(key: str) -> bool:
    """Whether a DCP key names a multi-token prediction layer's tensor (`mtp.layers.<K>.…`): megatron-core keys
    each MTP layer apart, its transformer layer as a per-layer decoder layer (routed experts stacked over
    experts only), whatever the decoder's keys."""
    return key.startswith(MTP_PREFIX) and key[len(MTP_PREFIX):].split(".")[0].isdigit()


def _expert_template(name: str) -> str:
    """`...local_experts.0.linear_fc1.weight` -> `...local_experts.*.linear_fc1.weight` (other names pass)."""
    return name.replace(EXPERT_TEMPLATE.replace("*", "0"), EXPERT_TEMPLATE, 1)


class _Checked(torch.Tensor):
    """A view of the destination that DCP's reader copies one saved chunk into (`resolve_tensor`, `detach`,
    `copy_`): the copy is refused when the chunk's own dtype (its `torch.save` blob) is not the one `.metadata`
    declares, since `copy_` would convert it silently (float32 bytes declared int64 read as zeros)."""

    planner: "_SlicePlanner"

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        with torch._C.DisableTorchFunctionSubclass():
            if func is torch.Tensor.copy_:
                dst, src = args[0], args[1]
                if src.dtype != dst.dtype:
                    raise MConvertError(dst.planner.lie(src.dtype))
                out = func(*args, **(kwargs or {}))
                dst.planner.copies += 1
                return out
            out = func(*args, **(kwargs or {}))
        if func is torch.Tensor.detach:  # the reader detaches the view first: it stays checked
            out = out.as_subclass(cls)
            out.planner = args[0].planner
        return out


class _SlicePlanner:
    """The three LoadPlanner calls `FileSystemReader.read_data` makes, writing into one destination tensor;
    every chunk copied into it is checked to carry the dtype `.metadata` declares (`_Checked`)."""

    def __init__(self, dest: torch.Tensor, key: str, md_file: Path) -> None:
        self.dest, self.key, self.md_file = dest, key, md_file
        self.copies = 0  # chunks copied through the check
        self.commits = 0

    def lie(self, saved: torch.dtype) -> str:
        return (f"{self.md_file}: {self.key!r} is declared {self.dest.dtype} but its saved chunk holds {saved}; "
                "reading would convert the values silently — the .metadata is damaged or from another save, "
                "re-copy the checkpoint")

    def resolve_tensor(self, req: Any) -> torch.Tensor:
        view = self.dest
        for dim, (off, n) in enumerate(zip(req.dest_offsets, req.lengths)):
            view = view.narrow(dim, off, n)
        checked = view.as_subclass(_Checked)
        checked.planner = self
        return checked

    def commit_tensor(self, req: Any, tensor: torch.Tensor) -> None:
        self.commits += 1
        if self.commits != self.copies:  # a reader that filled the view another way: its dtype went unchecked
            raise MConvertError(f"internal: torch's DCP reader filled {self.key!r} without the dtype check")

    def load_bytes(self, req: Any, value: Any) -> None:  # pragma: no cover - only tensors are requested
        raise MConvertError(f"unexpected bytes entry {req.dest_index.fqn!r} in a tensor read")


def _overlapping(items: list[Any]) -> list[int] | None:
    """The storage offset of a read item whose destination box overlaps another's, else None. Two boxes overlap
    when their ranges overlap in every dimension. Swept in the order of their first offsets, a box is compared
    only with the earlier ones whose first range reaches it (one, for the many 1-D chunks of flat buffers)."""
    boxes = sorted(((tuple(it.dest_offsets), tuple(it.lengths), it) for it in items), key=lambda b: b[0])
    active: list[tuple[tuple[int, ...], tuple[int, ...], Any]] = []
    for off, n, it in boxes:
        active = [b for b in active if not off or b[0][0] + b[1][0] > off[0]]
        for off2, n2, _ in active:
            if all(a < b + m and b < a + k for a, k, b, m in zip(off, n, off2, n2)):
                return list(it.storage_index.offset or ())
        active.append((off, n, it))
    return None


class TorchDistSource(SourceBase):
    """A torch_dist checkpoint read unit by unit; `read_mcore` gives full tensors under canonical names."""

    format = "megatron-torch_dist"
    splits_experts = True  # an MoE layer is read as its dense part and one unit per expert (memory: one expert)
    # a unit that does not `spec.comes_whole` (a dense layer; the final unit of an MoE model with an MoE MTP
    # layer) is read one parameter at a time, each its own box
    gives_mcore_parts = True

    def __init__(self, path: Path, iteration: int | str | None = None, tokenizer: str | Path | None = None,
                 verify: bool = True) -> None:
        self.path = Path(path)
        self.iter_dir, self.iteration = resolve_iteration_dir(self.path, iteration)
        self.root = self.iter_dir.parent if self.iter_dir != self.path else self.path.parent
        d = self.iter_dir
        # Megatron-LM's integrity manifest, before any file it lists is read: its shape and files now, the
        # digests (`verify`: a verb that reads tensor data) as the input's other checks, before the commit
        covered = listed_by_manifest(self.path) if verify else set()
        check_integrity(d, digests=verify, covered=lambda f: os.path.realpath(f) in covered)
        backend = self._backend(d / "metadata.json")
        if backend != "torch_dist":
            raise MConvertError(f"{d / 'metadata.json'}: sharded_backend {backend!r} is not supported (torch_dist); "
                                "re-save with --ckpt-format torch_dist or torch")
        common_file: Path | str = d / "common.pt"
        common = None
        if os.path.lexists(common_file) or not os.path.lexists(d / ".metadata"):
            common_file = inside_file(d, "common.pt", f"{d}: torch_dist common file")
            common = checkpoint_dict(safe_load(common_file, "common.pt"), common_file)
        # Megatron-Bridge: the model is its run_config.yaml's provider (its own loader reads nothing else)
        self.run_config = bridge.find_run_config(d, beside=common is None or "args" not in common)
        self.writer: dict[str, Any] | None = None
        self.bridge_config: dict[str, Any] | None = None  # the whole run_config.yaml, carried by a re-shard
        if self.run_config is not None:
            cfg = bridge.read_run_config(self.run_config)
            self.args, args_file = bridge.megatron_args(cfg, str(self.run_config)), self.run_config
            self.writer, self.bridge_config = bridge.writer_info(cfg), cfg
        elif common is not None and "args" in common:
            self.args, args_file = common["args"], common_file
        elif common is not None:
            raise MConvertError(f"{common_file}: no 'args' entry and no {bridge.RUN_CONFIG} beside it; cannot tell "
                                "the model's shape")
        if common is not None:
            self._counters(common, common_file)
        if not os.path.lexists(d / ".metadata"):
            raise MConvertError(f"{d / '.metadata'}: not found; the torch_dist checkpoint is incomplete")
        self.reader = FileSystemReader(str(d))
        # not reader.read_metadata(): that is a bare pickle.load (code execution from a foreign checkpoint)
        self.metadata = safe_load_dcp_metadata(inside_file(d, ".metadata", f"{d}: DCP metadata"))
        self._check_storage(d / ".metadata")
        self.reader.set_up_storage_reader(self.metadata, True)
        if common is None:  # newer megatron-core writes no common.pt: its entries are one ShardedObject
            if COMMON_STATE not in self.metadata.state_dict_metadata:
                inside_file(d, "common.pt", f"{d}: torch_dist common file")  # the one-line error of a missing file
            common_file = f"{d} ({COMMON_STATE})"
            common = checkpoint_dict(self._read_object(COMMON_STATE, MAX_OBJECT_BYTES), common_file)
            if self.run_config is None and "args" not in common:
                raise MConvertError(f"{common_file}: no 'args' entry and no {bridge.RUN_CONFIG} beside it; cannot "
                                    "tell the model's shape")
            if self.run_config is None:
                self.args, args_file = common["args"], common_file
            self._counters(common, common_file)
        a = args_dict(self.args, args_file)
        self._common = {k: v for k, v in common.items() if k != "args" or self.run_config is None}
        del common

        self.spec, self.tokenizer_dir, self.vocab_known = megatron_spec(
            a, str(args_file), tokenizer, self.root, self.path, d / bridge.TOKENIZER_DIR
        )
        self.tp = int(a.get("tensor_model_parallel_size") or 1)
        self.pp = int(a.get("pipeline_model_parallel_size") or 1)
        self.vpp = a.get("virtual_pipeline_model_parallel_size")
        self.split = PipelineSplit.from_args(a, self.spec.num_layers, self.pp, self.vpp, str(args_file))
        self.ep = int(a.get("expert_model_parallel_size") or 1)  # the layout it was saved at (plans, reports)
        self.padded_vocab = a.get("padded_vocab_size")
        # canonical template (layer '*') or canonical name -> (DCP key, stacked?)
        self.keys: dict[str, tuple[str, bool]] = {}
        # canonical template -> {optimizer state name: DCP key} (fully_reshardable distributed optimizer)
        self.state_keys: dict[str, dict[str, str]] = {}
        self.global_shapes: dict[str, tuple[int, ...]] = {}  # full shapes (no per-rank files in torch_dist)
        self._trainer_step: float | None = None  # set by trainer_optimizer(): states then in the trainer's form
        self._trainer_groups: list[dict[str, Any]] = []
        self._rng: dict[tuple[int, int], str] = {}  # (pp_rank, tp_rank) -> its `rng_state` ShardedObject key
        # the optimizer layout the checkpoint holds (set by check_optimizer) and, for dp_reshardable, each
        # parameter's place per source TP rank: (dp_group_idx, gbuf, bucket, start, local shape)
        self.optimizer_layout: str | None = None
        self._dp_slots: dict[str, list[tuple[int, int, int, int, tuple[int, ...]]]] = {}
        self._dp_dtype: Any = None
        self._index()

    def _counters(self, common: dict[str, Any], where: Path | str) -> None:
        """checkpoint_version and iteration of the common entries (common.pt or the DCP's common_state)."""
        self.checkpoint_version = float(expect(common.get("checkpoint_version", 0) or 0, (int, float),
                                               f"{where}: checkpoint_version", "re-copy the checkpoint"))
        self.iteration = stored_iteration(common, self.iteration, where)

    @staticmethod
    def _backend(path: Path) -> str:
        if not os.path.lexists(path):
            return "torch_dist"  # older saves: .metadata alone
        meta = load_json_object(inside_file(path.parent, path.name, f"{path.parent}: torch_dist metadata"),
                                "torch_dist metadata", "re-copy the checkpoint")
        return str(expect(meta.get("sharded_backend", "torch_dist"), str, f"{path}: sharded_backend",
                          "re-copy the checkpoint"))

    def _check_storage(self, md_file: Path) -> None:
        """Every data file `.metadata` names (`relative_path`) must be a regular file inside the iteration
        directory, and every entry's byte range must lie within that file."""
        storage = getattr(self.metadata, "storage_data", None)
        if not isinstance(storage, dict):
            raise MConvertError(f"{md_file}: no storage table (storage_data); the checkpoint is damaged")
        sizes: dict[str, int] = {}
        for index, info in storage.items():
            rel = getattr(info, "relative_path", None)
            fqn = getattr(index, "fqn", index)
            if rel not in sizes:
                path = contained(self.iter_dir, rel, f"{md_file}: relative_path of {fqn!r}")
                sizes[rel] = check_regular(path, f"named by {md_file}").st_size
            off, n = getattr(info, "offset", None), getattr(info, "length", None)
            if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in (off, n)) \
                    or off + n > sizes[rel]:
                raise MConvertError(f"{md_file}: entry {fqn!r} claims bytes {off!r}+{n!r} of {rel} "
                                    f"({sizes[rel]:,} bytes); a .distcp file is truncated or the metadata is damaged")

    def _index(self) -> None:
        """Map every DCP key to a canonical name (or an explicit drop); unknown keys are an error."""
        md_file = self.iter_dir / ".metadata"
        L = self.spec.num_layers
        # megatron-core keys non-homogeneous layers one by one (`decoder.layers.<N>.…`, a moe_layer_freq list):
        # then every name template holds its layer, and only a routed expert's stack over experts remains
        self.per_layer = any(_layer_keyed(k) for k in self.metadata.state_dict_metadata)
        if self.per_layer:
            layers = [d for g in range(L) for d in self.spec.layer_template(g)]
        else:
            layers = [replace(d, name=d.name.replace(f"{STACKED_PREFIX}0.", f"{STACKED_PREFIX}*.", 1))
                      for d in self.spec.layer_template()]
        final = [d for d in self.spec.final_params(self.tp) if expert_of(d.name) in (None, 0)]  # MTP: expert 0 stands for all
        decls = self.spec.embedding_params(self.tp) + layers + final
        self._declared = {_expert_template(d.name): d.shape for d in decls}
        self._declared.setdefault("output_layer.weight", self._declared["embedding.word_embeddings.weight"])
        for key, md in self.metadata.state_dict_metadata.items():
            rng = RNG_SHARD.fullmatch(key)
            if rng:
                p, t, pp, tp = map(int, rng.groups())
                if (pp, tp) == (self.pp, self.tp) and p < pp and t < tp:  # else saved by another layout: dropped
                    self._rng[(p, t)] = key
                continue
            if not isinstance(md, TensorStorageMetadata) or "_extra_state" in key:
                continue  # bytes: TE extra state, rng state, other pickled objects
            state = None
            if key.startswith(OPTIMIZER_STATE_PREFIX) and "." in key[len(OPTIMIZER_STATE_PREFIX):]:
                state, key = key[len(OPTIMIZER_STATE_PREFIX):].split(".", 1)
            elif any(key.startswith(p) for p in DROP_PREFIXES):
                continue
            keyed = _layer_keyed(key) or _mtp_keyed(key)
            stacked = key.startswith(STACKED_PREFIX) and not keyed
            if stacked and self.per_layer:
                raise MConvertError(f"{md_file}: key {key!r} is stacked over layers, other layer keys are per layer "
                                    "(decoder.layers.<N>.…); not one megatron-core save — re-copy the checkpoint")
            raw = f"{STACKED_PREFIX}0.{key[len(STACKED_PREFIX):]}" if stacked else key
            experts = (stacked or keyed) and STACKED_EXPERTS in raw
            if experts:
                raw = raw.replace(STACKED_EXPERTS, EXPERT_TEMPLATE.replace("*", "0"), 1)
            name = canonical_key(raw)
            if name is None:
                continue
            if name == "output_layer.weight" and self.spec.tie_embeddings:
                continue  # a copy of the embedding (tied); HF ties the head itself
            try:
                self.spec.split_kind(name)
            except MConvertError:
                raise MConvertError(f"{md_file}: unmapped key {key!r} (read as {name!r}) for a {self.spec.family} "
                                    "model; it is neither converted nor a known buffer") from None
            shape = tuple(md.size)
            if stacked:
                if not shape or shape[0] != L:
                    raise MConvertError(f"{md_file}: stacked key {key!r} has shape {list(shape)}, expected "
                                        f"[{L}, ...] for num_layers={L}; args and weights disagree")
                name = name.replace(f"{STACKED_PREFIX}0.", f"{STACKED_PREFIX}*.", 1)
                shape = shape[1:]
                if experts:
                    if not shape or shape[0] != self.spec.num_experts:
                        raise MConvertError(f"{md_file}: stacked expert key {key!r} has {list(shape[:1])} experts, "
                                            f"expected num_experts={self.spec.num_experts}; args and weights "
                                            "disagree")
                    name, shape = _expert_template(name), shape[1:]
            elif keyed and experts:
                if not shape or shape[0] != self.spec.num_experts:
                    raise MConvertError(f"{md_file}: expert key {key!r} has {list(shape[:1])} experts, expected "
                                        f"num_experts={self.spec.num_experts}; args and weights disagree")
                name, shape = _expert_template(name), shape[1:]
            if name not in self._declared:
                raise MConvertError(f"{md_file}: key {key!r} (read as {name!r}) is not a parameter the args "
                                    f"declare (num_layers={L}, moe_layer_freq={self.spec.moe_layer_freq}); the args "
                                    "and the weights disagree")
            self._check_shape(key, name, shape, md_file)
            if state is not None:
                self.state_keys.setdefault(name, {})[state] = f"{OPTIMIZER_STATE_PREFIX}{state}.{key}"
                continue
            self.keys[name] = (key, stacked)
            self.global_shapes[name] = shape
        tied = "output_layer.weight" if self.spec.tie_embeddings else None
        missing = next((n for n in self._declared if n not in self.keys and n != tied), None)
        if missing is not None:  # never a unit quietly short of a tensor (an MTP layer's, a layer's bias)
            raise MConvertError(f"{md_file}: no tensor for {missing!r}, which the args declare (num_layers={L}, "
                                f"mtp_num_layers={self.spec.mtp_num_layers or 0}); the checkpoint is incomplete or "
                                "its args describe another model — re-copy it")
        if self._rng and len(self._rng) != self.pp * self.tp:
            missing = next((p, t) for p in range(self.pp) for t in range(self.tp) if (p, t) not in self._rng)
            raise MConvertError(f"{md_file}: rng_state is saved for {len(self._rng)} of the {self.pp * self.tp} "
                                f"(pp, tp) ranks; rank {missing} has none — the checkpoint is incomplete")

    def _check_shape(self, key: str, name: str, shape: tuple[int, ...], md_file: Path) -> None:
        """The stored full shape must be the one the args declare (vocab rows: at least the true vocab)."""
        want = self._declared[name]
        if self.spec.split_kind(name.replace("*", "0")) == "vocab":
            ok = len(shape) == 2 and shape[1] == want[1] and shape[0] >= self.spec.vocab_size
        else:
            ok = tuple(shape) == tuple(want)
        if not ok:
            raise MConvertError(f"{md_file}: {key!r} has shape {list(shape)} but common.pt args declare "
                                f"{list(want)}; the args and the weights disagree")

    def check_optimizer(self) -> None:
        """Refuse `--with-optimizer` unless the checkpoint holds megatron-core distributed-optimizer states in
        the `fully_reshardable` layout for every parameter (the other layouts depend on the writer's DP/TP
        buffers and cannot be re-sharded from the files alone)."""
        if self.optimizer_layout == DP_RESHARDABLE:
            return  # indexed: common.pt's `optimizer` is held in the fully_reshardable form since
        opt = self._common.get("optimizer")
        kind = opt.get("param_state_sharding_type") if isinstance(opt, dict) else None
        where = self.iter_dir / "common.pt"
        if kind is None:
            raise MConvertError(f"{where}: no optimizer state in this torch_dist checkpoint; drop --with-optimizer")
        if kind not in OPTIMIZER_LAYOUTS:
            raise MConvertError(f"{where}: distributed optimizer states are saved as {kind!r}; only "
                                f"{' and '.join(map(repr, OPTIMIZER_LAYOUTS))} can be re-sharded — re-save with "
                                "one of those distributed-optimizer sharding types (metadata "
                                "distrib_optim_sharding_type), or drop --with-optimizer")
        if kind == DP_RESHARDABLE:
            self._index_dp_optimizer(where)
            return
        self.optimizer_layout = kind
        missing = [n for n in self.keys if n not in self.state_keys and not is_buffer(n)]  # a buffer: no state
        if missing:
            raise MConvertError(f"{self.iter_dir / '.metadata'}: no optimizer state for {missing[0]!r}; the "
                                "checkpoint is incomplete — drop --with-optimizer")

    def _index_dp_optimizer(self, where: Path) -> None:
        """Place every parameter's states in the `dp_reshardable` buckets: the buckets rebuilt from the args
        (`dp_buckets`) must have the saved sizes of every domain; the param groups of every domain must agree.
        common.pt's `optimizer` is then held in the `fully_reshardable` form (its param groups inline), the form
        every writer takes."""
        if self.spec.is_moe:
            raise MConvertError(f"{where}: a mixture-of-experts model's dp_reshardable optimizer keeps its experts in "
                                "expert-parallel buffers, which are not carried — drop --with-optimizer")
        md_file = self.iter_dir / ".metadata"
        a = args_dict(self.args, where)
        ddp = dp_buckets.ddp_settings(a)
        emb = self.global_shapes.get("embedding.word_embeddings.weight")
        rows = emb[0] if emb else self.spec.padded_vocab_size(self.tp)
        try:
            layout = dp_buckets.domain_layout(self.spec, self.tp, self.pp, self.vpp, ddp, rows, self.split)
        except MConvertError as e:
            raise MConvertError(f"{where}: {e}") from None
        domains = sorted(int(m.group(1)) for k in self.metadata.state_dict_metadata
                         if (m := DP_DOMAIN.fullmatch(k)))
        saved: dict[int, tuple[Any, Any]] = {}
        groups: list[Any] = []
        for idx in domains:
            obj = {n: self._read_object(dp_buckets.object_key(idx, n), MAX_OBJECT_BYTES)
                   for n in ("per_bucket_numel_unpadded", "per_bucket_numel", "optimizer")}
            saved[idx] = (obj["per_bucket_numel_unpadded"], obj["per_bucket_numel"])
            groups.append(obj["optimizer"])
        dp_buckets.check_saved(layout, saved, str(md_file))
        if any(g != groups[0] for g in groups):
            raise MConvertError(f"{md_file}: the dp_reshardable param groups differ between TP×PP domains; one set "
                                "of groups cannot serve every parameter — drop --with-optimizer")
        [dtype] = saved[0][0][0].keys()
        states: set[str] | None = None
        slots: dict[str, list[Any]] = {}
        for idx, buffers in layout.items():
            _, t = dp_buckets.stage_of(idx, self.tp)
            for g, buckets in enumerate(buffers):
                for b, bucket in enumerate(buckets):
                    base = dp_buckets.bucket_key(idx, g, dtype, b, "")
                    here = {k[len(base):] for k in self.metadata.state_dict_metadata if k.startswith(base)}
                    if states is None:
                        states = here
                    if not here or here != states:
                        raise MConvertError(f"{md_file}: bucket {base}* holds states {sorted(here)}, other buckets "
                                            f"{sorted(states)}; the checkpoint is incomplete — drop --with-optimizer")
                    for st in here:
                        size = tuple(self.metadata.state_dict_metadata[base + st].size)
                        if size != (bucket.numel_unpadded,):
                            raise MConvertError(f"{md_file}: {base + st!r} has shape {list(size)}, its bucket "
                                                f"holds {bucket.numel_unpadded} elements; the checkpoint is damaged "
                                                "— drop --with-optimizer")
                    for s in bucket.slots:
                        if s.name == "output_layer.weight" and self.spec.tie_embeddings:
                            continue  # the last stage's copy of the tied embedding: its first-stage states serve
                        slots.setdefault(s.name, [None] * self.tp)[t] = (idx, g, b, s.start, s.shape)
        self._dp_slots, self._dp_dtype, self._dp_states = slots, dtype, sorted(states or ())
        opt: dict[str, Any] = {"optimizer": groups[0]}
        scaler = dp_buckets.object_key(0, "grad_scaler")
        if scaler in self.metadata.state_dict_metadata:  # mixed-precision runs: the loss scaler's state
            opt["grad_scaler"] = self._read_object(scaler, MAX_OBJECT_BYTES)
        self._common["optimizer"] = {**opt, "param_state_sharding_type": RESHARDABLE_OPTIMIZER}
        self.optimizer_layout = DP_RESHARDABLE

    def _read_dp_states(self, name: str) -> dict[str, torch.Tensor]:
        """One parameter's states from the dp_reshardable buckets: its slice on every source TP rank, merged
        to the full shape as the parameter's shards merge."""
        places = self._dp_slots.get(name)
        if places is None or any(p is None for p in places):
            raise MConvertError(f"{self.iter_dir / '.metadata'}: no dp_reshardable optimizer state for {name!r}; "
                                "the checkpoint is incomplete — drop --with-optimizer")
        out = {}
        for state in self._dp_states:
            pieces = [self.read_slice(dp_buckets.bucket_key(idx, g, self._dp_dtype, b, state), (start,),
                                      (int(torch.Size(shape).numel()),)).view(shape)
                      for idx, g, b, start, shape in places]
            out[state] = pieces[0] if len(pieces) == 1 else merge(pieces, self.spec.split_kind(name), name)
        return out

    def trainer_optimizer(self) -> list[dict[str, Any]]:
        """Switch `read_unit`'s states to the trainer's Adam form (for torch rank-file output) and return the
        trainer's param groups (each parameter goes to its `wd_mult` group); refused when megatron-core's groups cannot be one (see `optimizer.py`)."""
        self.check_optimizer()
        if self.spec.is_moe:
            raise MConvertError(f"{self.iter_dir / 'common.pt'}: a mixture-of-experts model's expert parameters "
                                "have their own (chained) distributed optimizer, not carried into trainer Adam states "
                                "— drop --with-optimizer or keep --format torch_dist")
        groups, self._trainer_step = optim.to_trainer_optimizer(self._common.get("optimizer"),
                                                                str(self.iter_dir / "common.pt"))
        self._trainer_groups = groups
        return groups

    def read_unit(self, unit: Unit, with_optimizer: bool = False, only: list[str] | None = None
                  ) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
        """`read_mcore(unit)` and, when asked, each parameter's optimizer states as full tensors (the
        `fully_reshardable` states: `param`, `exp_avg`, `exp_avg_sq`; after `trainer_optimizer()` the
        trainer's Adam states; a buffer, the router's expert bias, has none); `only`: just these parameters."""
        tensors = self._read_names(self._unit_names(unit) if only is None else only)
        if not with_optimizer:
            return tensors, {}
        states: dict[str, dict] = {}
        for name in tensors:
            if is_buffer(name):  # moves outside the optimizer: megatron-core saves no state for it
                continue
            tpl, lead = self._place(name)
            if self.optimizer_layout == DP_RESHARDABLE:
                out = self._read_dp_states(name)
            else:
                out = {state: self._read_one(key, tpl, lead) for state, key in self.state_keys.get(tpl, {}).items()}
            for state in out:
                if not all_finite(out[state]):
                    raise MConvertError(f"{self.iter_dir}: optimizer state {state!r} of {name!r} holds NaN or Inf "
                                        "values; the run diverged or the file is corrupt — drop --with-optimizer")
            states[name] = out if self._trainer_step is None else optim.trainer_states(
                out, self._trainer_step, optim.trainer_group(self._trainer_groups, name, tensors[name].dim()))
        return tensors, states

    def _place(self, name: str) -> tuple[str, tuple[int, ...]]:
        """Canonical name -> (its template in `keys` / `state_keys`, its stacked indices): `(layer,)` for a
        layer's tensor, `(layer, expert)` for a routed expert's, `()` for embedding and final tensors; per-layer
        keys: `()` and `(expert,)`."""
        layer = unit_of(name)
        if not isinstance(layer, int):  # an MTP layer's routed expert: its box of the layer's expert stack
            expert = expert_of(name)
            return (name, ()) if expert is None else (_expert_template(with_expert(name, 0)), (expert,))
        lead: tuple[int, ...] = () if self.per_layer else (layer,)
        tpl = name if self.per_layer else name.replace(f"{STACKED_PREFIX}{layer}.", f"{STACKED_PREFIX}*.", 1)
        expert = expert_of(name)
        if expert is None:
            return tpl, lead
        return _expert_template(with_expert(tpl, 0)), (*lead, expert)

    def _read_one(self, key: str, tpl: str, lead: tuple[int, ...]) -> torch.Tensor:
        """The full tensor of `key` at stacked indices `lead` (a layer, or a layer and an expert): only that
        box of the stacked tensor is read."""
        shape = self.global_shapes[tpl]
        box = self.read_slice(key, (*lead, *(0,) * len(shape)), (*(1,) * len(lead), *shape))
        return box[(0,) * len(lead)] if lead else box

    def listed_files(self) -> list[dict[str, Any]]:
        """The iteration dir's files: each DCP data file with its bytes and entry count, then `.metadata`,
        `common.pt`, `metadata.json` and Megatron-LM's `integrity.json` (sizes from the opening checks' stat calls
        and the file system)."""
        counts: dict[str, int] = {}
        for info in self.metadata.storage_data.values():
            counts[info.relative_path] = counts.get(info.relative_path, 0) + 1
        out = [{"path": rel, "bytes": os.stat(self.iter_dir / rel).st_size, "entries": n}
               for rel, n in sorted(counts.items())]
        for name in (".metadata", "common.pt", "metadata.json", bridge.RUN_CONFIG, bridge.TRAIN_STATE, INTEGRITY):
            if os.path.isfile(self.iter_dir / name):
                out.append({"path": name, "bytes": os.stat(self.iter_dir / name).st_size})
        return out

    def train_state(self) -> dict[str, Any] | None:
        """Megatron-Bridge's `train_state.pt` of this iteration (counters, tensors only), if there is one."""
        if not os.path.lexists(self.iter_dir / bridge.TRAIN_STATE):
            return None
        path = inside_file(self.iter_dir, bridge.TRAIN_STATE, f"{self.iter_dir}: Megatron-Bridge train state")
        state = safe_load(path, bridge.TRAIN_STATE)
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise MConvertError(f"{path}: not Megatron-Bridge's train state (a dict of counter tensors); re-copy it")
        return {k: v.clone() for k, v in state.items()}

    def top_level(self, pp_rank: int = 0, tp_rank: int = 0) -> dict[str, Any]:
        """The entries of `common.pt` (args, checkpoint_version, iteration, scheduler, ...), what every rank
        shares, and that rank's `rng_state` when the checkpoint holds one for it."""
        out = dict(self._common)
        if (pp_rank, tp_rank) in self._rng:
            out["rng_state"] = self._read_object(self._rng[(pp_rank, tp_rank)])
        return out

    def _read_object(self, key: str, limit: int = MAX_RNG_BYTES) -> Any:
        """A ShardedObject's data: its `torch.save([data])` bytes, read from the data file and loaded by the
        safe loader like every other pickle of the checkpoint."""
        info = next((v for k, v in self.metadata.storage_data.items() if getattr(k, "fqn", None) == key), None)
        if info is None:
            raise MConvertError(f"{self.iter_dir / '.metadata'}: no entry {key!r}; the checkpoint is incomplete")
        if info.length > limit:
            raise MConvertError(f"{self.iter_dir}: {key!r} claims {info.length:,} bytes; such objects are kilobytes "
                                "— the metadata is damaged")
        with open(self.iter_dir / info.relative_path, "rb") as f:
            f.seek(info.offset)
            blob = f.read(info.length)
        # the safe loader reads files: the bytes go to a file that lives only for this call, so no source left
        # unclosed (an error on the way, a caller that only wanted the spec) leaves one behind
        with tempfile.TemporaryDirectory(prefix="mconvert-objects-") as tmp:
            path = Path(tmp) / "object.pt"
            path.write_bytes(blob)
            with crc_checks_now():  # the file is gone before a deferred check would run
                try:
                    data = safe_load(path, f"{key} of {self.iter_dir}")
                except MConvertError as e:  # named by where its bytes lie, never by the file gone after this call
                    where = f"{self.iter_dir / info.relative_path} (object {key!r}, {info.length:,} bytes at {info.offset:,})"
                    raise MConvertError(renamed(str(e), path, where)) from None
        if not isinstance(data, list) or len(data) != 1:
            raise MConvertError(f"{self.iter_dir}: {key!r} is not a saved ShardedObject (a one-item list); the "
                                "checkpoint is damaged")
        return data[0]

    # ---- reading --------------------------------------------------------------------------------------
    def read_slice(self, key: str, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
        """The box [offsets, offsets+sizes) of DCP tensor `key`, reading only the chunks that overlap it."""
        md = self.metadata.state_dict_metadata[key]
        dest = torch.empty(sizes, dtype=md.properties.dtype)
        box = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
        items = create_read_items_for_chunk_list(key, md, [box])
        covered = sum(int(torch.Size(it.lengths).numel()) for it in items)
        if covered != dest.numel():
            raise MConvertError(f"{self.iter_dir}: the saved chunks of {key!r} cover {covered} of {dest.numel()} "
                                "elements; the checkpoint is incomplete")
        # sizes that add up prove nothing when two chunks overlap and leave a gap of the same size elsewhere (the
        # gap would keep what torch.empty held): with no two boxes overlapping, the box is covered exactly once
        overlap = _overlapping(items)
        if overlap is not None:
            raise MConvertError(f"{self.iter_dir / '.metadata'}: the saved chunks of {key!r} overlap (the chunk at "
                                f"{overlap} writes elements another chunk wrote), so another part of the tensor is "
                                "missing; the checkpoint is damaged — re-copy it")
        try:
            self.reader.read_data(LoadPlan(items), _SlicePlanner(dest, key, self.iter_dir / '.metadata')).wait()
        except MConvertError:
            raise
        except Exception as e:  # noqa: BLE001 - truncated / missing .distcp -> one line
            raise MConvertError(f"{self.iter_dir}: cannot read {key!r} ({type(e).__name__}: {str(e)[:160]}); "
                                "a .distcp file is missing or truncated") from None
        return dest

    def _unit_names(self, unit: Unit) -> list[str]:
        """The canonical names of one unit, in ModelSpec's declared order: a whole MoE layer's experts
        parameter by parameter (all experts' fc1, then all fc2), a `LayerPart` only its dense part's or its
        one expert's."""
        layer = layer_of_unit(unit)
        if layer is not None and not 0 <= layer < self.spec.num_layers:
            raise MConvertError(f"{self.path}: layer {layer} out of range (num_layers={self.spec.num_layers})")
        part = unit.expert if isinstance(unit, LayerPart) else None
        if part is not None and not 0 <= part < (self.spec.num_experts or 0):
            raise MConvertError(f"{self.path}: expert {part} out of range (num_experts={self.spec.num_experts})")
        names: list[str] = []
        mtp_experts: list[str] = []  # an MTP layer's expert templates, given expert by expert as spec declares them

        def flush() -> None:
            names.extend(with_expert(t, e) for e in range(self.spec.num_experts or 0) for t in mtp_experts)
            mtp_experts.clear()

        for tpl in self._declared:
            if tpl not in self.keys:
                continue
            if self.per_layer and layer is not None and unit_of(tpl) == layer:
                name = tpl  # the layer is in the name; a routed expert's '*' is its expert
            elif not self.keys[tpl][1]:
                if unit_of(tpl) == unit and EXPERT_TEMPLATE in tpl:
                    mtp_experts.append(tpl)
                elif unit_of(tpl) == unit:
                    flush()
                    names.append(tpl)
                continue
            elif layer is None:
                continue
            else:
                name = tpl.replace("*", str(layer), 1)
            if EXPERT_TEMPLATE in tpl:
                if isinstance(unit, int):  # the whole layer: every expert, parameter by parameter
                    names += [with_expert(name, e) for e in range(self.spec.num_experts or 0)]
                elif part is not None:
                    names.append(with_expert(name, part))
            elif part is None:
                names.append(name)
        flush()
        return names

    def read_hf_parts(self, unit: Unit, only: set[str] | None = None) -> Iterator[dict[str, torch.Tensor]]:
        """`read_hf(unit)` one parameter's HF tensors at a time, each read as its own box (memory: one
        parameter, so one expert of an MoE MTP layer in the final unit); `only`: the HF names kept."""
        names = self._unit_names(unit)
        check_complete(self.spec, unit, names, str(self.path))
        for name in hf_order(self.spec, unit, names):
            if only is not None and not any(k in only for k in hf_keys_for(self.spec, name)):
                continue
            tpl, lead = self._place(name)
            yield to_hf_one(self.spec, name, self._read_one(self.keys[tpl][0], tpl, lead), str(self.path))

    def read_mcore(self, unit: Unit) -> dict[str, torch.Tensor]:
        """Full tensors of one unit under canonical global names, in ModelSpec's declared order; vocab rows as
        stored (padded). A routed expert is read as its own box of the stacked experts, never the layer's
        whole expert stack; a `LayerPart` reads only its dense part's or its expert's boxes."""
        return self._read_names(self._unit_names(unit))

    def read_mcore_parts(self, unit: Unit) -> Iterator[dict[str, torch.Tensor]]:
        """`read_mcore(unit)` in parts, same tensors, same order: one parameter per part where the unit does not
        `spec.comes_whole` (what is written is freed before the next is read), else the unit."""
        for tensors, _ in self.read_unit_parts(unit):
            yield tensors

    def read_unit_parts(self, unit: Unit, with_optimizer: bool = False
                        ) -> Iterator[tuple[dict[str, torch.Tensor], dict[str, dict]]]:
        """`read_unit(unit, with_optimizer)` one parameter (with its states) at a time where the unit does not
        `spec.comes_whole`, else the unit in one part."""
        if comes_whole(self.spec, unit):
            yield self.read_unit(unit, with_optimizer)
            return
        for name in self._unit_names(unit):
            yield self.read_unit(unit, with_optimizer, only=[name])

    def _read_names(self, names: list[str]) -> dict[str, torch.Tensor]:
        """These parameters' full tensors, in order, each read as its own box."""
        out: dict[str, torch.Tensor] = {}
        for name in names:
            tpl, lead = self._place(name)
            out[name] = self._read_one(self.keys[tpl][0], tpl, lead)
        return out
