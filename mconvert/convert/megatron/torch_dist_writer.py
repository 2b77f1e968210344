"""Writes megatron-core `dist_checkpointing` "torch_dist" checkpoints from full tensors, on CPU, without
megatron-core and without a process group.

The iteration dir is what megatron-core 0.16.1's `dist_checkpointing.save` (torch_dist strategy) writes:
`metadata.json` (the backends), `common.pt` (args, checkpoint_version, iteration and the other non-sharded
entries), `__0_<i>.distcp` data files (each chunk a `torch.save` blob, as DCP's FileSystemWriter writes
them; a new file starts when the next chunk would take a file past `MAX_FILE_BYTES` of tensor data) and
`.metadata` (pickled `torch.distributed.checkpoint.metadata.Metadata` built from DCP's own classes), and last
Megatron-LM's `integrity.json` (the sha256 of each of those, as `--verify-integrity` writes it). Keys are
global: layers stacked (`decoder.layers.<name>` is `[num_layers, ...]`), norms under the names megatron-core's
layer spec maps them to (`linear_qkv.layer_norm_weight`), one chunk per layer and target TP rank laid out as
megatron-core lays out that rank's shard (SwiGLU fc1: the rank's gate rows and its up rows are two chunks),
and one `_extra_state/shard_<layer>_<num_layers>` bytes entry per linear module and layer. Routed experts are
stacked twice (`decoder.layers.mlp.experts.experts.<linear>` is `[num_layers, num_experts, ...]`, one chunk per
layer, expert and TP shard, an `_extra_state/shard_<layer>.<expert>_<L>.<E>` per expert linear), as
megatron-core's SequentialMLP saves them. With the source's `rng_state`, one `rng_state/shard_<pp>.<tp>_<PP>.<TP>`
bytes entry per target rank; with optimizer states, megatron-core's `fully_reshardable` distributed-optimizer
layout, or its `dp_reshardable` DDP buckets for the target layout (`dp_buckets.py`). Units stream: each arrives, its chunks are serialized straight into the data file, only the metadata
stays in memory.
"""

from __future__ import annotations

import functools
import io
import json
import pickle
import re
from pathlib import Path
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from mconvert.convert.megatron import bridge as bridge_files
from mconvert.convert.megatron import dp_buckets
from mconvert.convert.megatron import optimizer as optim
from mconvert.convert.megatron.checkpoint import args_dict
from mconvert.convert.base import Unit, units_of
from mconvert.io import repickle
from mconvert.io.atomic import record_digest
from mconvert.io.hashing import HashingFile
from mconvert.io.integrity import ALGORITHM, INTEGRITY, write_integrity
from mconvert.io.paths import make_dirs
from mconvert.io.casts import narrowed
from mconvert.layouts.megatron import CHECKPOINT_VERSION, PipelineSplit, iteration_dir_name, write_latest
from mconvert.convert.megatron.writer import checked_split, target_args
from mconvert.convert.megatron.torch_dist import (
    DP_RESHARDABLE,
    OPTIMIZER_STATE_PREFIX,
    RESHARDABLE_OPTIMIZER,
    RNG_STATE,
    STACKED_EXPERTS,
)
from mconvert.errors import MConvertError
from mconvert.mappings.keys import unit_of
from mconvert.mappings.transforms import pad_vocab, split, split_dim
from mconvert.spec import LayerPart, ModelSpec, expert_of
from mconvert.convert.writer import Writer

STACKED_PREFIX = "decoder.layers."
MAX_FILE_BYTES = 5 * 10**9  # tensor bytes per data file before the next one starts (as HF's default shard size)
# metadata.json exactly as megatron-core's `save_config` writes it for the torch_dist strategy
BACKENDS = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
            "common_backend_version": 1}
DCP_VERSION = "1.0.0"  # torch.distributed.checkpoint's metadata version
# megatron-core local layer spec's `sharded_state_dict_keys_map`: norms saved under the TE spec's names
KEY_MAP: dict[str, str] = {
    "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
    "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
}
# a layer's modules whose `_extra_state` megatron-core saves as a ShardedObject: its linears (`linear_qkv`, MLA's
# projections, `linear_fc1/fc2` of the MLP, the shared and each routed expert; not the router)
EXTRA_STATE_MODULE = re.compile(r"(.+\.)?linear_[a-z0-9_]+")


# a routed expert's key before stacking: `decoder.layers.[N.]mlp.experts.local_experts.<global expert>.<rest>`
LOCAL_EXPERT = re.compile(re.escape(STACKED_PREFIX) + r"(\d+\.)?mlp\.experts\.local_experts\.(\d+)\.(.+)")
# a multi-token prediction layer's module: `mtp.layers.<K>.<rest>`; its transformer layer is keyed as a per-layer
# decoder layer under `mtp.layers.<K>.transformer_layer.` (MultiTokenPredictionBlock.sharded_state_dict)
MTP_MODULE = re.compile(r"(mtp\.layers\.\d+\.)(.+)")
MTP_LAYER = "transformer_layer."
MTP_EXTRA_STATE_MODULE = re.compile(r"eh_proj|" + MTP_LAYER.replace(".", r"\.") + EXTRA_STATE_MODULE.pattern)


def dist_key(name: str, per_layer: bool = False, mla: bool = False) -> tuple[str, int | None]:
    """Canonical name (global layer index) -> (torch_dist key, layer index or None when not stacked). Stacked
    keys drop the layer index; `per_layer` keys keep it (megatron-core's non-homogeneous layers). The local
    spec saves norms under the TE spec's names, except under multi-latent attention (no key map there)."""
    mtp = MTP_MODULE.fullmatch(name)
    if mtp and mtp.group(2).startswith(MTP_LAYER):
        return mtp.group(1) + MTP_LAYER + _layer_key(mtp.group(2)[len(MTP_LAYER):], mla), None
    if not name.startswith(STACKED_PREFIX):
        return name, None
    layer, rest = name[len(STACKED_PREFIX):].split(".", 1)
    return STACKED_PREFIX + (f"{layer}." if per_layer else "") + _layer_key(rest, mla), int(layer)


def _layer_key(rest: str, mla: bool) -> str:
    """A layer's parameter name (after its layer prefix) under the name megatron-core's local spec saves it."""
    for old, new in ({} if mla else KEY_MAP).items():
        if rest.startswith(old):
            return new + rest[len(old):]
    return rest


def per_layer_keys(spec: ModelSpec) -> bool:
    """Whether megatron-core keys this model's layers one by one (`decoder.layers.<N>.…`) instead of stacking
    them: its `TransformerBlock.sharded_state_dict` does for non-homogeneous layers, a `moe_layer_freq` list or
    an every-N-th > 1."""
    freq = spec.moe_layer_freq
    return spec.is_moe and (isinstance(freq, tuple) or freq > 1)


def dist_place(name: str, per_layer: bool = False, mla: bool = False) -> tuple[str, tuple[int, ...]]:
    """Canonical name -> (torch_dist key, its stacked leading indices): `(layer,)` for a layer's tensor,
    `(layer, expert)` for a routed expert's (SequentialMLP's `mlp.experts.experts.<linear>`, global expert
    order), `()` for embedding and final tensors; with `per_layer` keys the layer is in the key, not an index."""
    key, layer = dist_key(name, per_layer, mla)
    if layer is None:
        expert = expert_of(key)  # an MTP layer's routed expert: stacked over experts, as a per-layer key is
        if expert is not None:
            head, rest = key.split(f"mlp.experts.local_experts.{expert}.", 1)
            return f"{head}{STACKED_EXPERTS.lstrip('.')}{rest}", (expert,)
        return key, ()
    m = LOCAL_EXPERT.fullmatch(key)
    if m:
        return (f"{STACKED_PREFIX}{m.group(1) or ''}{STACKED_EXPERTS.strip('.')}.{m.group(3)}",
                (int(m.group(2)),) if per_layer else (layer, int(m.group(2))))
    return key, () if per_layer else (layer,)


def chunk_boxes(kind: str, shape: tuple[int, ...], tp: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(offsets, sizes) of the chunks megatron-core writes for one full tensor at `tp`, TP rank by rank:
    the rank's shard along the split dim; SwiGLU fc1 (`gated`) as the rank's gate rows then its up rows."""
    d = split_dim(kind, len(shape))
    if d is None:
        return [((0,) * len(shape), tuple(shape))]
    if shape[d] % (2 * tp if kind == "gated" else tp):
        raise MConvertError(f"dim {d} of shape {list(shape)} does not divide into TP={tp} shards")
    zeros = [0] * len(shape)
    boxes = []
    if kind == "gated":
        half = shape[0] // 2
        n = half // tp
        for r in range(tp):
            for base in (0, half):
                boxes.append((tuple([base + r * n, *zeros[1:]]), (n, *shape[1:])))
        return boxes
    n = shape[d] // tp
    for r in range(tp):
        off, size = list(zeros), list(shape)
        off[d], size[d] = r * n, n
        boxes.append((tuple(off), tuple(size)))
    return boxes


def data_file_name(i: int) -> str:
    """The i-th data file, named as DCP names rank 0's files."""
    return f"__0_{i}.distcp"


def _blob(obj: Any) -> memoryview:
    """What DCP's FileSystemWriter writes for one item: `torch.save(obj)` into the data file."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getbuffer()


class _BlobSink:
    """`torch.save` of one chunk straight into the data file, with no serialized copy of the chunk: torch's
    small records (zip headers, the pickle) are copied, their buffers living only during the call, and the
    tensor's bytes, which torch writes in one call from the storage itself, are queued as that memory, kept
    alive by the queue's reference to the tensor until written."""

    def __init__(self, out: HashingFile, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        self.out, self.tensor, self.span = out, tensor, (storage.data_ptr(), storage.nbytes())
        self.small = bytearray()
        self.n = 0  # bytes written: the item's length in the data file

    def write(self, data: Any) -> int:
        mv = memoryview(data).cast("B")
        n = len(mv)
        if n and n == self.span[1] and np.frombuffer(mv, np.uint8).ctypes.data == self.span[0]:
            self.finish()
            self.out.write(mv, keep=self.tensor)
        else:
            self.small += mv
        self.n += n
        return n

    def flush(self) -> None:
        pass

    def finish(self) -> None:
        """Queue the small records gathered so far."""
        if self.small:
            self.out.write(bytes(self.small))
            self.small = bytearray()


def _owned(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor that owns exactly its bytes (torch.save of a view saves its whole storage)."""
    if t.is_contiguous() and not t.storage_offset() and t.untyped_storage().nbytes() == t.numel() * t.element_size():
        return t
    return t.clone(memory_format=torch.contiguous_format)


@functools.lru_cache(maxsize=1)
def extra_state_blob() -> memoryview:
    """The bytes megatron-core saves for a local-spec module's `_extra_state` shard: `torch.save([None])`
    (a ShardedObject's bytes are `torch.save` of the list of its data)."""
    return _blob([None])


class TorchDistWriter(Writer):
    """Full tensors, unit by unit -> a torch_dist checkpoint for a target TP/PP(/VPP) (args and vocab padding
    follow the target; the keys are global, so any TP/PP loads it). The verb has checked the layout
    (`ModelSpec.check_parallel`)."""

    reads = "mcore"
    # an MoE layer may arrive as its dense part and one unit per expert: the chunks stream as they come, and
    # only the layer's extra-state keys wait for its last part (same file bytes as the whole layer)
    splits_experts = True
    # a unit may arrive in parts (`add(unit, part, states, complete=False)`, then `complete=True`): a dense
    # layer, the final unit of an MoE model with an MoE MTP layer parameter by parameter; the same file bytes
    takes_parts = True

    def __init__(self, out: Path, spec: ModelSpec, tp: int, pp: int, vpp: int | None = None,
                 iteration: int | str = "release", args: Any = None, top_level: dict[str, Any] | None = None,
                 dtype: torch.dtype | None = None, max_file_bytes: int = MAX_FILE_BYTES,
                 with_states: bool = False, optimizer_groups: list[dict[str, Any]] | None = None,
                 source: str = "", rng_state: Callable[[int, int], Any] | None = None, ep: int = 1,
                 optimizer_layout: str = RESHARDABLE_OPTIMIZER, bridge: bool = False,
                 bridge_source: tuple[dict[str, Any] | None, dict[str, Any] | None] = (None, None),
                 split: PipelineSplit | None = None) -> None:
        self.split = checked_split(spec, pp, vpp, split)
        self.per_layer, self.mla = per_layer_keys(spec), spec.is_mla
        if bridge and not self.split.even:  # its run config states the split in other words, not written here
            raise MConvertError(f"--bridge with an uneven pipeline split ({self.split.describe()}) is not written; "
                                "drop --bridge, or use an even split")
        self.bridge = bridge  # also write what Megatron-Bridge loads the checkpoint from (convert/megatron/bridge.py)
        self.bridge_source = bridge_source  # a Bridge source's (run config, train state), carried
        if bridge:  # its loader pads no vocab: the stored rows are the vocab itself
            bridge_files.check_writable(spec, tp, carried=bridge_source[0] is not None)
            spec = spec.replace(make_vocab_size_divisible_by=bridge_files.bridge_divisor(spec.vocab_size // tp))
        dp_buckets.check_optimizer_layout(optimizer_layout)
        # the driver then hands each parameter's optimizer states to `add`: megatron-core's own, or with
        # `optimizer_groups` the trainer's Adam states, turned into megatron-core's here
        self.takes_states = with_states or optimizer_groups is not None
        self.optimizer_groups, self.source = optimizer_groups, source or str(out)
        self._steps: set[float] = set()
        self.rng_state = rng_state  # (tp_rank, pp_rank) -> that target rank's rng_state list, as Megatron-LM saves it
        if optimizer_groups is not None:  # refused before anything is written when the groups cannot map
            optim.to_mcore_optimizer(optimizer_groups, 0.0, self.source, spec.is_moe)
        self.out, self.spec, self.tp, self.pp, self.vpp = Path(out), spec, tp, pp, vpp
        self.iteration, self.dtype = iteration, dtype
        self.args = target_args(spec, args, tp, pp, vpp, ep, self.split)
        self._ep = ep
        # `optimizer` (the distributed optimizer's param groups) is kept when the caller passes it: with states
        self.top_level = {k: v for k, v in (top_level or {}).items()
                          if k not in ("args", "checkpoint_version", "iteration", "model", "rng_state")}
        self.rows = spec.padded_vocab_size(tp)
        self.dir = self.out / iteration_dir_name(iteration)
        make_dirs(self.dir)
        self.max_file_bytes = max_file_bytes
        self._names: list[str] = []
        self._sha256: dict[str, str] = {}  # data file -> its sha256, for the integrity manifest
        self._file: Any = None
        self._open_next()
        self._tensors: dict[str, TensorStorageMetadata] = {}
        self._md: dict[str, Any] = {}  # key -> storage metadata, in the order keys first appear
        self._storage: dict[MetadataIndex, _StorageInfo] = {}
        self._pending: list[Unit] = list(units_of(spec))
        self._parts: dict[int, list[Unit]] = {}  # MoE layer -> its parts still to come, once one has arrived
        # (module key, stacked indices) of a layer's linears, in arrival order, until the layer is complete
        self._modules: dict[int, dict[tuple[str, tuple[int, ...]], None]] = {}
        # units begun with `add(..., complete=False)`: their layer (None: embedding, final) and modules so far
        self._open: dict[Unit, tuple[int | None, dict[tuple[str, tuple[int, ...]], None]]] = {}
        self.files: list[Path] = []
        self.optimizer_layout = optimizer_layout
        # dp_reshardable: canonical name -> its slots [(dp_group_idx, gbuf, bucket, tp_rank, Slot)], the buckets
        self._dp: dict[str, list[tuple[int, int, int, int, dp_buckets.Slot]]] = {}
        self._dp_layout: dict[int, list[list[dp_buckets.Bucket]]] = {}
        if self.takes_states and optimizer_layout == DP_RESHARDABLE:
            self._plan_dp_buckets()

    def _plan_dp_buckets(self) -> None:
        """The target's buckets, rebuilt from the args written (DP size, bucket size: what a run with these args
        builds), and the (param, grad) dtype of its one buffer per chunk."""
        a = args_dict(self.args, self.source)
        try:
            self._dp_layout = dp_buckets.domain_layout(self.spec, self.tp, self.pp, self.vpp,
                                                       dp_buckets.ddp_settings(a), self.rows, self.split)
        except MConvertError as e:
            raise MConvertError(f"{self.source}: {e}") from None
        param = a.get("params_dtype")
        param = param if isinstance(param, torch.dtype) else (self.dtype or torch.float32)
        grad = torch.float32 if a.get("accumulate_allreduce_grads_in_fp32", True) else param
        self._dp_dtype = (param, grad)
        for idx, buffers in self._dp_layout.items():
            _, t = dp_buckets.stage_of(idx, self.tp)
            for g, buckets in enumerate(buffers):
                for b, bucket in enumerate(buckets):
                    for s in bucket.slots:
                        # a tied output weight at PP > 1 is the embedding's copy: the embedding's states fill it
                        name = "embedding.word_embeddings.weight" if s.name == "output_layer.weight" \
                            and self.spec.tie_embeddings else s.name
                        self._dp.setdefault(name, []).append((idx, g, b, t, s))

    def _add_dp_state(self, name: str, full: torch.Tensor, state: str) -> None:
        """One state of one parameter into the dp_reshardable buckets: each TP rank's shard, flat, at its slot."""
        kind = self.spec.split_kind(name)
        if kind == "vocab":
            full = pad_vocab(full, self.rows, self.spec.vocab_size, name)
        places = self._dp.get(name)
        if not places:
            raise MConvertError(f"internal: {name} has no slot in the dp_reshardable buckets")
        shards = split(full, kind, self.tp, f"{name}.{state}") if self.tp > 1 else [full]
        for idx, g, b, t, s in places:
            piece = shards[t]
            if tuple(piece.shape) != s.shape:
                raise MConvertError(f"internal: {name}.{state} shard {list(piece.shape)} vs bucket slot {list(s.shape)}")
            self._add_flat(dp_buckets.bucket_key(idx, g, self._dp_dtype, b, state), piece.reshape(-1),
                           s.start, self._dp_layout[idx][g][b].numel_unpadded)

    def _add_flat(self, key: str, flat: torch.Tensor, start: int, size: int) -> None:
        """One chunk [start, start + numel) of the 1-d tensor `key` of `size` elements."""
        md = self._tensors.get(key)
        if md is None:
            md = TensorStorageMetadata(properties=TensorProperties(dtype=flat.dtype), size=torch.Size((size,)),
                                       chunks=[])
            self._tensors[key] = self._md[key] = md
        md.chunks.append(ChunkStorageMetadata(offsets=torch.Size((start,)), sizes=torch.Size((flat.numel(),))))
        self._append_tensor(_owned(flat), MetadataIndex(key, torch.Size((start,))))

    def _finish_dp_buckets(self, opt: dict[str, Any]) -> None:
        """Zeros in every gap of every bucket tensor (megatron-core's loader wants each tensor covered, as its own
        padding chunks cover it), then each domain's ShardedObjects: param groups, bucket sizes."""
        states = sorted({k.rsplit(".", 1)[1] for k in self._tensors if k.startswith("optimizer.distributed.")})
        if not states:
            raise MConvertError(f"{self.source}: no optimizer states arrived for the dp_reshardable layout; "
                                "drop --with-optimizer")
        for idx, buffers in self._dp_layout.items():
            for g, buckets in enumerate(buffers):
                for b, bucket in enumerate(buckets):
                    for state in states:
                        key = dp_buckets.bucket_key(idx, g, self._dp_dtype, b, state)
                        md = self._tensors.get(key)
                        got = sorted((c.offsets[0], c.sizes[0]) for c in md.chunks) if md else []
                        if len(got) != len(bucket.slots):
                            raise MConvertError(f"internal: {key} got {len(got)} of {len(bucket.slots)} parameters")
                        pos = 0
                        for off, n in [*got, (bucket.numel_unpadded, 0)]:
                            if off > pos:
                                self._add_flat(key, torch.zeros(off - pos, dtype=md.properties.dtype), pos,
                                               bucket.numel_unpadded)
                            pos = off + n
            objects = {"optimizer": opt["optimizer"],
                       "per_bucket_numel": [{self._dp_dtype: [bk.numel for bk in buf]} for buf in buffers],
                       "per_bucket_numel_unpadded": [{self._dp_dtype: [bk.numel_unpadded for bk in buf]}
                                                     for buf in buffers]}
            if "grad_scaler" in opt:
                objects["grad_scaler"] = opt["grad_scaler"]
            for name, value in objects.items():
                key = dp_buckets.object_key(idx, name)
                self._md[key] = BytesStorageMetadata()
                self._append(_blob([value]), MetadataIndex(key))

    # ---- writing ------------------------------------------------------------------------------------------
    def _open_next(self) -> None:
        """Finish the current data file (its sha256 to the manifest) and start the next one."""
        if self._file is not None:
            self._close_file()
        self._names.append(data_file_name(len(self._names)))
        # Megatron-LM's integrity manifest takes each file's sha256: on the bytes as they are written
        self._file = HashingFile(self.dir / self._names[-1], direct=True, also=ALGORITHM)
        self._pos = 0
        self._tensor_bytes = 0

    def _close_file(self) -> None:
        record_digest(self.dir / self._names[-1], self._file.close())
        self._sha256[self._names[-1]] = self._file.digests[ALGORITHM]
        self._file = None

    def _append(self, data: memoryview, index: MetadataIndex, tensor_bytes: int = 0) -> None:
        if self._tensor_bytes and self._tensor_bytes + tensor_bytes > self.max_file_bytes:
            self._open_next()
        self._file.write(data, keep=data)
        self._storage[index] = _StorageInfo(self._names[-1], self._pos, len(data))
        self._pos += len(data)
        self._tensor_bytes += tensor_bytes

    def _append_tensor(self, part: torch.Tensor, index: MetadataIndex) -> None:
        """One chunk as DCP writes it (`torch.save(chunk)`), streamed into the data file."""
        nbytes = part.numel() * part.element_size()
        if self._tensor_bytes and self._tensor_bytes + nbytes > self.max_file_bytes:
            self._open_next()
        sink = _BlobSink(self._file, part)
        torch.save(part, sink)
        sink.finish()
        self._storage[index] = _StorageInfo(self._names[-1], self._pos, sink.n)
        self._pos += sink.n
        self._tensor_bytes += nbytes

    def _add_tensor(self, name: str, full: torch.Tensor, state: str | None = None) -> None:
        """One full tensor, or with `state` one of its optimizer states (same chunks, its own dtype)."""
        key, lead = dist_place(name, self.per_layer, self.mla)
        kind = self.spec.split_kind(name)
        if kind == "vocab":
            full = pad_vocab(full, self.rows, self.spec.vocab_size, name)
        if state is not None:
            key = f"{OPTIMIZER_STATE_PREFIX}{state}.{key}"
        elif self.dtype is not None and full.dtype != self.dtype:
            full = narrowed(full, self.dtype, name)
        shape = tuple(full.shape)
        stacked = (*self._stack_dims(key, lead), *shape)
        md = self._tensors.get(key)
        if md is None:
            md = TensorStorageMetadata(properties=TensorProperties(dtype=full.dtype), size=torch.Size(stacked),
                                       chunks=[])
            self._tensors[key] = self._md[key] = md
        elif tuple(md.size) != stacked or md.properties.dtype != full.dtype:
            raise MConvertError(f"internal: {name} is {list(shape)} {full.dtype}, earlier layers were "
                                f"{list(md.size)[len(lead):]} {md.properties.dtype}")
        try:
            boxes = chunk_boxes(kind, shape, self.tp)
        except MConvertError as e:
            raise MConvertError(f"{name}: {e}") from None
        for off, size in boxes:
            part = full
            for dim, (o, n) in enumerate(zip(off, size)):
                part = part.narrow(dim, o, n)
            if lead:
                part = part[(None,) * len(lead)]  # a view: one size-1 dim per stacked index
                off, size = (*lead, *off), (*(1,) * len(lead), *size)
            md.chunks.append(ChunkStorageMetadata(offsets=torch.Size(off), sizes=torch.Size(size)))
            self._append_tensor(_owned(part), MetadataIndex(key, torch.Size(off)))
            del part

    def _stack_dims(self, key: str, lead: tuple[int, ...]) -> tuple[int, ...]:
        """The stacked dimensions of a key placed at `lead`: (num_layers[, num_experts]), or (num_experts,) for a
        routed expert's per-layer or MTP-layer key."""
        per_layer = self.per_layer or MTP_MODULE.fullmatch(key) is not None
        dims = (self.spec.num_experts or 0,) if per_layer else (self.spec.num_layers, self.spec.num_experts or 0)
        return dims[: len(lead)]

    def _add_extra_state(self, key: str, lead: tuple[int, ...]) -> None:
        """A linear module's `_extra_state` ShardedObject at its layer (and expert): megatron-core's
        `shard_<offsets>_<shape>` key, offsets and shape joined by dots."""
        dims = self._stack_dims(key, lead)
        if not lead:  # a per-layer module: megatron-core's ShardedObject of global shape (1,)
            lead, dims = (0,), (1,)
        key = f"{key}._extra_state/shard_{'.'.join(map(str, lead))}_{'.'.join(map(str, dims))}"
        self._md[key] = BytesStorageMetadata()
        self._append(extra_state_blob(), MetadataIndex(key))

    def _add_rng_state(self) -> None:
        """One `rng_state` ShardedObject per target (pp_rank, tp_rank), as Megatron-LM's `get_rng_state` makes it
        for torch_dist (global shape (PP, TP), the rank's list of per-DP-rank states as its data)."""
        for p in range(self.pp):
            for t in range(self.tp):
                key = f"{RNG_STATE}/shard_{p}.{t}_{self.pp}.{self.tp}"
                self._md[key] = BytesStorageMetadata()
                self._append(_blob([self.rng_state(t, p)]), MetadataIndex(key))  # type: ignore[misc]

    def add(self, unit: Unit, tensors: dict[str, torch.Tensor], states: dict[str, dict] | None = None,
            complete: bool = True) -> None:
        """Append one unit's full tensors (canonical global names) to the data file, and with `states` each
        parameter's distributed-optimizer states ({name: {'param', 'exp_avg', 'exp_avg_sq'}}, full shapes)
        in megatron-core's `fully_reshardable` layout. `complete=False`: more of the unit follows; its linears'
        extra states are written once it is complete."""
        if unit in self._open:
            layer, modules = self._open[unit]
        else:
            layer = self._arrive(unit)
            modules = self._modules.setdefault(layer, {}) if layer is not None else {}
            if not complete:
                self._open[unit] = (layer, modules)
        for name, full in tensors.items():
            if unit_of(name) != (unit if layer is None else layer) or \
                    isinstance(unit, LayerPart) and expert_of(name) != unit.expert:
                raise MConvertError(f"internal: {name} arrived with unit {unit!r}")
            if name == "output_layer.weight" and self.spec.tie_embeddings:
                continue  # megatron-core saves a tied head under the embedding's key only
            self._add_tensor(name, full)
            st = (states or {}).get(name, {})
            if self.optimizer_groups is not None and st:
                self._steps.add(optim.shared_step([st.get("step", 0.0)], f"{self.source}: {name}"))
                st = optim.mcore_states(full, st)
            for state, value in st.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    if self.optimizer_layout == DP_RESHARDABLE:
                        self._add_dp_state(name, value, state)
                    else:
                        self._add_tensor(name, value, state)
            mtp = MTP_MODULE.fullmatch(name)
            if layer is not None:
                module = name[len(STACKED_PREFIX):].split(".", 1)[1].rsplit(".", 1)[0]
            else:
                module = mtp.group(2).rsplit(".", 1)[0] if mtp else ""
            if (EXTRA_STATE_MODULE if layer is not None else MTP_EXTRA_STATE_MODULE).fullmatch(module):
                key, lead = dist_place(name, self.per_layer, self.mla)
                modules[(key.rsplit(".", 1)[0], lead)] = None
        if not complete:
            return
        self._open.pop(unit, None)
        if layer is None or layer not in self._parts:  # the unit or layer is complete: its modules' extra states
            for key, lead in (self._modules.pop(layer) if layer is not None else modules):
                self._add_extra_state(key, lead)

    def _arrive(self, unit: Unit) -> int | None:
        """Mark `unit` (a whole unit or a `LayerPart` of an MoE layer) arrived; its layer, None for the
        embedding and final units. A layer leaves `_pending` when its last part has come."""
        if isinstance(unit, LayerPart):
            if unit.layer not in self._parts:
                if unit.layer not in self._pending or not self.spec.is_moe:
                    raise MConvertError(f"internal: unit {unit!r} arrived twice or is not a unit of this model")
                self._parts[unit.layer] = list(self.spec.layer_units(unit.layer))
            if unit not in self._parts[unit.layer]:
                raise MConvertError(f"internal: unit {unit!r} arrived twice or is not a unit of this model")
            self._parts[unit.layer].remove(unit)
            if not self._parts[unit.layer]:
                del self._parts[unit.layer]
                self._pending.remove(unit.layer)
            return unit.layer
        if unit not in self._pending or unit in self._parts:
            raise MConvertError(f"internal: unit {unit!r} arrived twice or is not a unit of this model")
        self._pending.remove(unit)
        return unit if isinstance(unit, int) else None

    def close(self) -> list[Path]:
        """Finish the data file, write `.metadata`, `common.pt`, `metadata.json` and the tracker file."""
        if self._pending or self._open:
            raise MConvertError(f"internal: units {(self._pending or list(self._open))[:3]} never arrived whole")
        if self.rng_state is not None:
            self._add_rng_state()
        opt = self._optimizer_entry()
        if opt is not None and self.optimizer_layout == DP_RESHARDABLE:
            self._finish_dp_buckets(opt)
            opt = {"param_state_sharding_type": DP_RESHARDABLE}
        self._close_file()
        metadata = Metadata(state_dict_metadata=self._md, planner_data=None, storage_data=self._storage,
                            storage_meta=StorageMeta(), version=DCP_VERSION)
        with open(self.dir / ".metadata", "wb") as f:
            pickle.dump(metadata, f)  # as DCP's FileSystemWriter.finish does
        common = {"args": self.args, "checkpoint_version": CHECKPOINT_VERSION,
                  "iteration": 0 if self.iteration == "release" else int(self.iteration), **self.top_level}
        if opt is not None:
            common["optimizer"] = opt
        repickle.save(common, self.dir / "common.pt")  # args as read: enums under their own names
        (self.dir / "metadata.json").write_text(json.dumps(BACKENDS))
        self.files = [self.dir / n for n in (".metadata", *self._names, "common.pt", "metadata.json")]
        if self.bridge:
            self.files += bridge_files.write_bridge_files(
                self.dir, self.out, self.spec, self.tp, self.pp, self.vpp, self._ep,
                0 if self.iteration == "release" else int(self.iteration), *self.bridge_source)
        write_integrity(self.dir, self._sha256)  # last in the directory: it lists every file there
        self.files.append(self.dir / INTEGRITY)
        write_latest(self.out, self.iteration)
        return self.files

    def _optimizer_entry(self) -> dict[str, Any] | None:
        """common.pt's `optimizer` in the `fully_reshardable` form (param groups inline): the source's, or made
        from the trainer's groups; None without optimizer states."""
        if self.optimizer_groups is not None:
            sched = self.top_level.get("opt_param_scheduler")
            min_lr = sched.get("min_lr") if isinstance(sched, dict) else None
            return optim.to_mcore_optimizer(self.optimizer_groups, optim.shared_step(sorted(self._steps), self.source),
                                            self.source, self.spec.is_moe, min_lr)
        opt = self.top_level.get("optimizer")
        return opt if self.takes_states and isinstance(opt, dict) else None

    def abort(self) -> None:
        """Stop the data file's writer thread; the caller removes the output directory."""
        if self._file is not None:
            self._file.abort()
            self._file = None
