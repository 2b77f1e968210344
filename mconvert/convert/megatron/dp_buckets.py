"""megatron-core's distributed-optimizer buckets (`dp_reshardable` layout), rebuilt from the model spec.

Pure layout math, no torch state. megatron-core 0.16.1 keeps one flat buffer per (param dtype, grad dtype) and
model chunk: DDP registers the chunk's parameters in `named_parameters()` order and lays them out in REVERSE order
(`_ParamAndGradBuffer`), each parameter starting on a 64-element boundary (`_pad_start_of_param_if_needed`); a
bucket closes once it holds `bucket_size` elements, and a tied embedding / output weight at PP > 1
(`shared_embedding`) gets a bucket of its own. A bucket is padded at its end to a multiple of lcm(DP, 128)
(lcm(DP, 128, 2^16) with `pad_buckets_for_high_nccl_busbw`). The `dp_reshardable` checkpoint stores, per TP×PP
domain (`dp_group_idx` = the rank in the model-parallel group: pp_rank·TP + tp_rank), one tensor per bucket and
state of the bucket's unpadded size, each parameter at its offset inside the bucket. Offsets inside a bucket do
not depend on DP (bucket starts are multiples of 128), so only the padded size (`per_bucket_numel`) does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from mconvert.layouts.megatron import PipelineSplit
from mconvert.errors import MConvertError
from mconvert.mappings.transforms import split_dim
from mconvert.spec import ModelSpec

# megatron-core's local layer spec registers a layer's modules in this order (`TransformerLayer`, `SelfAttention`:
# linear_proj is made by `Attention.__init__` before `SelfAttention` adds linear_qkv and the q/k norms)
LAYER_MODULE_ORDER = ("input_layernorm.", "self_attention.linear_proj.", "self_attention.linear_qkv.",
                      "self_attention.q_layernorm.", "self_attention.k_layernorm.", "pre_mlp_layernorm.",
                      "mlp.linear_fc1.", "mlp.linear_fc2.")
PARAM_ALIGN = 64  # elements: parameters start 128-byte aligned in a 16-bit buffer
BUCKET_ALIGN = 128
BUSBW_ALIGN = 2 ** 16
DEFAULT_MIN_BUCKET = 40_000_000  # DDP's bucket_size when overlap_grad_reduce is on and none is given
# the distributed-optimizer layouts read and written: one tensor per parameter and state, or the DDP buckets
OPTIMIZER_LAYOUTS = ("fully_reshardable", "dp_reshardable")


def check_optimizer_layout(layout: str) -> None:
    """`--optimizer-layout`: one of the layouts written."""
    if layout not in OPTIMIZER_LAYOUTS:
        raise MConvertError(f"--optimizer-layout {layout!r}: choose {' or '.join(OPTIMIZER_LAYOUTS)}")


@dataclass(frozen=True)
class Slot:
    """One parameter's TP shard in a bucket: its canonical (global) name, its local shape at the layout's TP,
    and its [start, end) in the bucket's flat space."""

    name: str
    shape: tuple[int, ...]
    start: int
    end: int


@dataclass(frozen=True)
class Bucket:
    slots: tuple[Slot, ...]
    numel_unpadded: int
    numel: int


@dataclass(frozen=True)
class DdpSettings:
    """The DDP settings that change the buckets: the data-parallel size (only the padded sizes), the bucket size
    (None: one bucket per buffer), the NCCL bus-bandwidth padding, and `--ddp-num-buckets` (the bucket size is
    then the first stage's parameter count on one rank divided by it)."""

    dp: int = 1
    bucket_size: int | None = None
    pad_for_busbw: bool = False
    num_buckets: int | None = None


def ddp_settings(args: dict[str, Any]) -> DdpSettings:
    """Megatron-LM's args -> the DDP settings it built its buffers with: `bucket_size` only with
    `overlap_grad_reduce` (`--ddp-bucket-size`, else max(40M, 1M·DP)), as megatron-core's DDP decides; the
    buffers are sharded over the data- and context-parallel ranks of one distributed-optimizer instance."""
    dp = int(args.get("data_parallel_size") or 1)
    shards = dp * int(args.get("context_parallel_size") or 1) // int(args.get("num_distributed_optimizer_instances")
                                                                     or 1)
    bucket = num_buckets = None
    if args.get("overlap_grad_reduce") and not args.get("overlap_param_gather_with_optimizer_step"):
        if args.get("ddp_num_buckets"):
            num_buckets = int(args["ddp_num_buckets"])
        else:
            bucket = int(args.get("ddp_bucket_size") or max(DEFAULT_MIN_BUCKET, 1_000_000 * dp))
    return DdpSettings(max(shards, 1), bucket, bool(args.get("ddp_pad_buckets_for_high_nccl_busbw")), num_buckets)


def _pad(n: int, divisor: int) -> int:
    return -(-n // divisor) * divisor


def local_shape(spec: ModelSpec, name: str, shape: tuple[int, ...], tp: int) -> tuple[int, ...]:
    """A parameter's shape on one TP rank: the full shape with its split dimension divided by TP."""
    d = split_dim(spec.split_kind(name), len(shape))
    if d is None:
        return tuple(shape)
    out = list(shape)
    out[d] //= tp
    return tuple(out)


def chunk_params(spec: ModelSpec, tp: int, pp: int, vpp: int | None, pp_rank: int, chunk: int,
                 vocab_rows: int, split: PipelineSplit | None = None) -> list[tuple[str, tuple[int, ...], bool]]:
    """One model chunk's parameters in megatron-core's `named_parameters()` order: (canonical global name, local
    shape at TP, shared_embedding?). A tied output weight at PP > 1 is named `output_layer.weight`."""
    if spec.is_moe:
        raise MConvertError("a mixture-of-experts model keeps its experts in expert-parallel buffers of a second "
                            "distributed optimizer, which the dp_reshardable layout here does not carry — use "
                            "--optimizer-layout fully_reshardable or drop --with-optimizer")
    n_chunks = pp * (vpp or 1)
    model_chunk = chunk * pp + pp_rank
    layers = (split or PipelineSplit.make(spec.num_layers, pp, vpp)).stage_layers(pp_rank)[chunk]
    pre, post = model_chunk == 0, model_chunk == n_chunks - 1
    out: list[tuple[str, tuple[int, ...], bool]] = []
    tied_shared = spec.tie_embeddings and pp > 1

    def shape_of(name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        if spec.split_kind(name) == "vocab":
            shape = (vocab_rows, *shape[1:])
        return local_shape(spec, name, shape, tp)

    if pre:
        for d in spec.embedding_params(tp):
            out.append((d.name, shape_of(d.name, d.shape), d.name == "embedding.word_embeddings.weight"
                        and tied_shared))
    for layer in layers:
        # stable: weight before bias, as each module registers them
        for d in sorted(spec.layer_params(layer), key=_registration_rank):
            out.append((d.name, shape_of(d.name, d.shape), False))
    if post:
        for d in spec.final_params(tp):
            out.append((d.name, shape_of(d.name, d.shape), False))
        if tied_shared:
            emb = spec.embedding_params(tp)[0]
            out.append(("output_layer.weight", shape_of(emb.name, emb.shape), True))
    return out


def _registration_rank(d: Any) -> int:
    """A layer parameter's module's place in `LAYER_MODULE_ORDER`; a module without one is refused."""
    rest = d.name.split(".", 3)[3]
    for i, module in enumerate(LAYER_MODULE_ORDER):
        if rest.startswith(module):
            return i
    raise MConvertError(f"{d.name}: no known place in megatron-core's layer registration order; the dp_reshardable "
                        "buckets cannot be rebuilt — use --optimizer-layout fully_reshardable")


def buffer_buckets(params: list[tuple[str, tuple[int, ...], bool]], bucket_size: int | None, dp: int,
                   pad_for_busbw: bool) -> list[Bucket]:
    """`_ParamAndGradBuffer`'s bucketing of one buffer (params in registration order), offsets bucket-relative."""
    divisor = math.lcm(dp, BUCKET_ALIGN, BUSBW_ALIGN) if pad_for_busbw else math.lcm(dp, BUCKET_ALIGN)
    buckets: list[Bucket] = []
    slots: list[Slot] = []
    bucket_start = pos = 0

    def close(end: int) -> int:
        nonlocal slots, bucket_start
        padded = _pad(end, divisor)
        buckets.append(Bucket(tuple(Slot(s.name, s.shape, s.start - bucket_start, s.end - bucket_start)
                                    for s in slots), end - bucket_start, padded - bucket_start))
        slots, bucket_start = [], padded
        return padded

    end = 0
    for name, shape, shared in reversed(params):
        pos = _pad(pos, PARAM_ALIGN)
        if shared and slots:
            pos = close(pos)
        end = pos + math.prod(shape)
        slots.append(Slot(name, shape, pos, end))
        if (bucket_size is not None and end - bucket_start >= bucket_size) or shared:
            pos = close(end)
        else:
            pos = end
    if slots:
        close(end)
    return buckets


def domain_layout(spec: ModelSpec, tp: int, pp: int, vpp: int | None, ddp: DdpSettings,
                  vocab_rows: int | None = None, split: PipelineSplit | None = None) -> dict[int, list[list[Bucket]]]:
    """{dp_group_idx: [buckets of each buffer]} for a TP×PP(×VPP) layout: one buffer per model chunk (one dtype),
    bucketed only in the first chunk of the first stage (DDP gives later stages and chunks no bucket_size)."""
    rows = vocab_rows if vocab_rows is not None else spec.padded_vocab_size(tp)
    first = ddp.bucket_size
    if ddp.num_buckets:  # Megatron-LM: the parameters of every chunk on one first-stage rank, divided
        first = sum(math.prod(shape) for c in range(vpp or 1)
                    for _, shape, _ in chunk_params(spec, tp, pp, vpp, 0, c, rows, split)) // ddp.num_buckets
    out: dict[int, list[list[Bucket]]] = {}
    for p in range(pp):
        buffers = []
        for c in range(vpp or 1):
            size = first if p == 0 and c == 0 else None
            params = chunk_params(spec, tp, pp, vpp, p, c, rows, split)
            buffers.append(buffer_buckets(params, size, ddp.dp, ddp.pad_for_busbw))
        for t in range(tp):
            out[p * tp + t] = buffers
    return out


def stage_of(idx: int, tp: int) -> tuple[int, int]:
    """dp_group_idx -> (pp_rank, tp_rank)."""
    return idx // tp, idx % tp


def check_saved(layout: dict[int, list[list[Bucket]]], saved: dict[int, tuple[Any, Any]], where: str) -> None:
    """The rebuilt buckets must have the saved `per_bucket_numel_unpadded` of every domain (and its
    `per_bucket_numel`, the padded sizes, for the DP size the args name); any difference is refused by name:
    another bucket size or an unknown DDP option would put states on the wrong parameters."""
    if sorted(saved) != sorted(layout):
        raise MConvertError(f"{where}: the dp_reshardable states are saved for dp_group_idx {sorted(saved)}, the "
                            f"args' TP×PP layout has {sorted(layout)}; the checkpoint is incomplete or its args "
                            "are not the run's — drop --with-optimizer")
    for idx, buffers in layout.items():
        unpadded, padded = saved[idx]
        want_u = [[b.numel_unpadded for b in buf] for buf in buffers]
        want_p = [[b.numel for b in buf] for buf in buffers]
        got_u, got_p = _numels(unpadded, where, idx), _numels(padded, where, idx)
        if got_u != want_u:
            raise MConvertError(f"{where}: dp_group_idx_{idx}.per_bucket_numel_unpadded is {got_u}, the model's "
                                f"buckets rebuilt from the args are {want_u}; another DDP bucket size or option "
                                "(--ddp-bucket-size, --overlap-grad-reduce) or another model — re-save with "
                                "--dist-ckpt-optim-fully-reshardable, or drop --with-optimizer")
        if got_p != want_p:
            raise MConvertError(f"{where}: dp_group_idx_{idx}.per_bucket_numel is {got_p}, the buckets padded for "
                                f"the args' data-parallel size are {want_p}; the args do not name the DP size "
                                "or padding the run used — drop --with-optimizer")


def _numels(value: Any, where: str, idx: int) -> list[list[int]]:
    """A saved per_bucket_numel(_unpadded): [{(param dtype, grad dtype): [numel per bucket]} per buffer]; more
    than one dtype in a buffer is refused (megatron-core itself supports one)."""
    if not isinstance(value, list) or not all(isinstance(b, dict) for b in value):
        raise MConvertError(f"{where}: dp_group_idx_{idx}'s bucket sizes are not megatron-core's "
                            "[{dtype: [numel, ...]}] list; the checkpoint is damaged — drop --with-optimizer")
    out = []
    for buf in value:
        if len(buf) != 1:
            raise MConvertError(f"{where}: dp_group_idx_{idx} has a buffer with {len(buf)} dtypes "
                                f"{list(buf)}; one (param, grad) dtype per buffer is carried — drop --with-optimizer")
        [numels] = buf.values()
        if not isinstance(numels, list) or not all(isinstance(n, int) and not isinstance(n, bool) for n in numels):
            raise MConvertError(f"{where}: dp_group_idx_{idx}'s bucket sizes are not integers; the checkpoint is "
                                "damaged — drop --with-optimizer")
        out.append(list(numels))
    return out


def bucket_key(idx: int, gbuf: int, dtype: tuple[Any, Any], bucket: int, state: str) -> str:
    """The DCP key of one bucket's state, as `sharded_param_state_dp_reshardable` names it."""
    return f"optimizer.distributed.dp_group_idx_{idx}.gbuf_idx_{gbuf}.dtype_{dtype}.bucket_idx_{bucket}.{state}"


def object_key(idx: int, name: str) -> str:
    """The DCP key of a domain's ShardedObject (`optimizer`, `per_bucket_numel`, ...): one shard of shape (1,)."""
    return f"optimizer.distributed.dp_group_idx_{idx}.{name}/shard_0_1"
