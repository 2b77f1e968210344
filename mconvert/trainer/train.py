"""The training loop (one process per rank) and the launcher that starts TP·PP·DP processes on this node.

`train(cfg)` builds the tokenizer, then starts the ranks through torch's elastic launcher (what torchrun
uses); every rank runs `train_worker`: process groups, the GPT stage, Adam, the 1F1B schedule, DP,
expert-data-parallel and embedding-group gradient all-reduces, and Megatron legacy-torch checkpoints
(one file per TP × PP × EP rank, written by its expert-data-parallel rank 0).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import logging
import math
import multiprocessing
import os
import random
import shutil
import signal
import socket
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from mconvert.convert.megatron import optimizer as optim
from mconvert.convert.megatron.checkpoint import args_dict
from mconvert.io.atomic import atomic_output_dir, terminating
from mconvert.layouts.megatron import TRACKER, PipelineSplit, rank_file, read_latest, save_rank_file, write_latest
from mconvert.io.safeload import safe_load
from mconvert.io.casts import all_finite, value_range
from mconvert.data import build_tokenizer, save_hf_tokenizer, tokenize_corpus
from mconvert.errors import MConvertError, at_least_one, expect
from mconvert.mappings import families
from mconvert.mappings.families import preset
from mconvert.spec import ModelSpec
from mconvert.trainer import comm, procs
from mconvert.trainer.deepseek_moe import BIAS_UPDATE_RATE, update_expert_bias
from mconvert.trainer.model import GPTModel, check_trainable
from mconvert.trainer.parallel import ParallelState, check_expert_layout, global_rank, init_distributed
from mconvert.trainer.schedule import forward_backward_1f1b

# Model-size fields a flag may override on top of the preset.
SPEC_OVERRIDES = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
                  "max_position_embeddings", "kv_channels", "rotary_base", "norm_epsilon", "num_experts",
                  "moe_ffn_hidden_size")
# Megatron-LM's Adam is AdamW: weight decay decoupled from the gradient, scaled per group by `wd_mult`
ADAM = dict(betas=(0.9, 0.999), eps=1e-8, decoupled_weight_decay=True)
# Size flags (TrainConfig fields) that override the preset: whole numbers >= 1 when given
SIZE_FLAGS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
              "max_position_embeddings", "kv_channels", "num_experts", "moe_topk", "moe_ffn_hidden_size")
# numpy seeds (data order, per epoch: seed + epoch) take 0 .. 2**32 - 1; the upper half is left to the epochs
MAX_SEED = 2**31 - 1


@dataclass
class TrainConfig:
    """Everything `mconvert train` takes; field names become the `--flags` of `python -m mconvert.trainer.main`."""

    preset: str = "tiny-llama"
    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1  # expert-parallel size: experts split over groups of EP data-parallel ranks (divides dp)
    steps: int = 50  # Megatron's train_iters: the iteration to stop at (also with --resume)
    save: str | None = None
    save_interval: int | None = None  # default: only at the end
    resume: bool = False
    force: bool = False  # replace an existing checkpoint in `save` (only once the new run has saved)
    save_as: str | None = None  # the path `save` is renamed to at the end (args record it); internal
    seed: int = 1234
    lr: float = 1e-3
    weight_decay: float = 0.0  # Megatron's --weight-decay: weights only (biases and norms: wd_mult 0)
    micro_batch_size: int = 4
    global_batch_size: int = 16
    seq_length: int = 64
    dtype: str = "fp32"  # fp32 | bf16
    sequence_parallel: bool = False  # Megatron's --sequence-parallel (needs TP > 1)
    comm_report: bool = False
    device: str | None = None  # cpu | cuda (default: cuda when available)
    quiet: bool = False
    log_stderr: bool = False  # loss lines to stderr (keeps stdout clean for --json)
    num_layers: int | None = None
    hidden_size: int | None = None
    num_attention_heads: int | None = None
    num_query_groups: int | None = None
    ffn_hidden_size: int | None = None
    max_position_embeddings: int | None = None
    kv_channels: int | None = None
    rotary_base: float | None = None
    norm_epsilon: float | None = None
    num_experts: int | None = None  # MoE: experts per layer (Megatron --num-experts)
    moe_ffn_hidden_size: int | None = None  # MoE: each expert's ffn width
    moe_topk: int | None = None  # MoE: experts per token (Megatron --moe-router-topk)
    moe_aux_loss_coeff: float = 1e-2  # MoE: load-balancing loss coefficient (Megatron --moe-aux-loss-coeff)
    window_size: int | None = None  # sliding window: keys before each query, every layer (Megatron --window-size W,0)
    # an uneven pipeline split, Megatron-LM's args (one chunk per rank: a layout string of PP stages)
    decoder_first_pipeline_num_layers: int | None = None
    decoder_last_pipeline_num_layers: int | None = None
    pipeline_model_parallel_layout: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    def split(self, spec: ModelSpec) -> PipelineSplit | None:
        """The uneven pipeline split these options ask for (None: the even one)."""
        if (self.decoder_first_pipeline_num_layers, self.decoder_last_pipeline_num_layers,
                self.pipeline_model_parallel_layout) == (None, None, None):
            return None
        return PipelineSplit.make(spec.num_layers, self.pp, None, self.decoder_first_pipeline_num_layers,
                                  self.decoder_last_pipeline_num_layers, self.pipeline_model_parallel_layout,
                                  mtp_num_layers=spec.mtp_num_layers)

    @property
    def num_micro_batches(self) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.dp)

    def validate(self) -> None:
        """Refuse a bad option before anything runs or is written: one line naming the option."""
        if self.dtype not in ("fp32", "bf16"):
            raise MConvertError(f"--dtype {self.dtype!r}: choose fp32 or bf16")
        if self.device not in (None, "cpu", "cuda"):
            raise MConvertError(f"--device {self.device!r}: choose cpu or cuda (or omit it)")
        for flag, value, advice in (
            ("--tp", self.tp, "1 means no tensor parallelism"),
            ("--pp", self.pp, "1 means no pipeline parallelism"),
            ("--dp", self.dp, "1 means no data parallelism"),
            ("--ep", self.ep, "1 means no expert parallelism"),
            ("--micro-batch-size", self.micro_batch_size, "it counts the samples of a micro-batch"),
            ("--global-batch-size", self.global_batch_size, "it counts the samples of a step"),
            ("--seq-length", self.seq_length, "it counts the tokens of a sample"),
        ):
            at_least_one(flag, value, advice)
        for name in SIZE_FLAGS:
            at_least_one("--" + name.replace("_", "-"), getattr(self, name), "omit it to keep the preset's")
        if self.steps < 0:
            raise MConvertError(f"--steps must be >= 0, got {self.steps}; 0 saves the initialised model")
        if self.window_size is not None and self.window_size < 0:
            raise MConvertError(f"--window-size must be >= 0 (the keys before each query), got {self.window_size}")
        at_least_one("--save-interval", self.save_interval, "omit it to save only at the end")
        if not 0 <= self.seed <= MAX_SEED:
            raise MConvertError(f"--seed must be between 0 and {MAX_SEED}, got {self.seed}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise MConvertError(f"--lr must be > 0 and finite, got {self.lr}; e.g. --lr 1e-3")
        for flag, value in (("--weight-decay", self.weight_decay), ("--moe-aux-loss-coeff", self.moe_aux_loss_coeff)):
            if not (math.isfinite(value) and value >= 0):
                raise MConvertError(f"{flag} must be >= 0 and finite, got {value}; 0 turns it off")
        for flag, value in (("--rotary-base", self.rotary_base), ("--norm-epsilon", self.norm_epsilon)):
            if value is not None and not (math.isfinite(value) and value > 0):
                raise MConvertError(f"{flag} must be > 0 and finite, got {value}; omit it to keep the preset's")
        check_expert_layout(self.dp, self.ep)
        if self.global_batch_size % (self.micro_batch_size * self.dp):
            raise MConvertError(
                f"--global-batch-size {self.global_batch_size} is not a multiple of micro_batch_size × DP = "
                f"{self.micro_batch_size} × {self.dp}; pick a multiple"
            )
        if self.resume and not self.save:
            raise MConvertError("--resume needs --save DIR (the checkpoint to continue)")
        if self.resume and self.steps == 0:  # --steps 0 saves the model as iteration 0: the resumed one, mislabelled
            raise MConvertError("--resume with --steps 0: --steps is the iteration to train to, and 0 writes the "
                                "loaded model as iteration 0; pass an iteration above the checkpoint's")
        if self.sequence_parallel and self.seq_length % self.tp:
            raise MConvertError(f"--sequence-parallel needs --seq-length {self.seq_length} divisible by TP={self.tp}")

    def check_corpus(self, tokens: torch.Tensor) -> None:
        """Every sample is --seq-length + 1 consecutive tokens of the corpus: refuse a longer one."""
        if self.seq_length >= tokens.numel():
            raise MConvertError(f"--seq-length {self.seq_length}: the corpus holds {tokens.numel()} tokens, a sample "
                                f"needs --seq-length + 1; pick at most {tokens.numel() - 1}")


def build_spec(cfg: TrainConfig, vocab_size: int) -> ModelSpec:
    """The preset, overridden by any model-size flag; vocab follows the tokenizer; dtype follows --dtype."""
    changes: dict[str, Any] = {k: getattr(cfg, k) for k in SPEC_OVERRIDES if getattr(cfg, k) is not None}
    if cfg.moe_topk is not None:
        changes["moe_router_topk"] = cfg.moe_topk
    base = preset(cfg.preset)
    if "hidden_size" in changes or "num_attention_heads" in changes:
        changes.setdefault("kv_channels", None)
    if cfg.window_size is not None:  # one window on every layer, as Megatron-LM's --window-size alone
        changes.update(window_size=cfg.window_size, window_pattern=None)
    spec = base.replace(vocab_size=vocab_size, params_dtype="bfloat16" if cfg.dtype == "bf16" else "float32",
                        **changes)
    if cfg.seq_length > spec.max_position_embeddings:
        raise MConvertError(
            f"--seq-length {cfg.seq_length} > max_position_embeddings {spec.max_position_embeddings} of the model; "
            "lower --seq-length or raise --max-position-embeddings"
        )
    if spec.is_moe and not families.of(spec).moe:  # its HF class has no experts: no converter could export it
        moe_presets = [name for f in families.all_families() if f.moe for name in f.presets]
        raise MConvertError(f"--num-experts: preset {cfg.preset} is of the dense family {spec.family!r}; "
                            f"train experts from an MoE preset ({', '.join(moe_presets)})")
    if cfg.window_size is not None and families.of(spec).hf_window is None:  # no HF class could export it
        windowed = [f.name for f in families.all_families() if f.hf_window is not None]
        raise MConvertError(f"--window-size: preset {cfg.preset} is of the family {spec.family!r}, whose HF class has "
                            f"no sliding window; train it from a preset of {', '.join(windowed)}")
    check_trainable(spec, cfg.tp, cfg.pp, cfg.ep, cfg.split(spec))
    return spec


# ---- data ----------------------------------------------------------------------------------------
def sample_batch(tokens: torch.Tensor, seq: int, start: int, count: int, seed: int) -> torch.Tensor:
    """Samples [start, start+count) of the endless shuffled stream of (seq+1)-token windows -> [count, seq+1].

    Epoch e is a permutation drawn from seed+e, so the data position is a pure function of consumed samples
    (resume needs no data state)."""
    n = (tokens.numel() - 1) // seq
    out = []
    for k in range(start, start + count):
        epoch, i = divmod(k, n)
        j = int(_epoch_order(n, seed + epoch)[i]) * seq
        out.append(tokens[j: j + seq + 1])
    return torch.stack(out)


@functools.lru_cache(maxsize=4)
def _epoch_order(n: int, seed: int) -> np.ndarray:
    return np.random.RandomState(seed).permutation(n)


def get_micro_batches(cfg: TrainConfig, st: ParallelState, tokens: torch.Tensor, consumed: int,
                      spec: ModelSpec) -> list[dict[str, torch.Tensor]]:
    """This DP rank's micro-batches of the iteration; TP rank 0 reads them, the TP group gets a broadcast."""
    M, b, S = cfg.num_micro_batches, cfg.micro_batch_size, cfg.seq_length
    if st.tp_rank == 0:
        data = sample_batch(tokens, S, consumed + st.dp_rank * M * b, M * b, cfg.seed).to(st.device)
    else:
        data = torch.empty(M * b, S + 1, dtype=torch.int64, device=st.device)
    comm.broadcast(data, st.tp_ranks[0], st.tp_group, "TP")
    data = data.view(M, b, S + 1)
    return [{"tokens": data[m, :, :-1], "labels": data[m, :, 1:]} for m in range(M)]


# ---- gradient synchronisation -------------------------------------------------------------------
def _flat_all_reduce(tensors: list[torch.Tensor], group: Any, name: str, scale: float = 1.0) -> None:
    if group is None or not tensors:
        return
    flat = torch.cat([t.reshape(-1).float() for t in tensors])
    comm.all_reduce(flat, group, name)
    if scale != 1.0:
        flat.mul_(scale)
    off = 0
    for t in tensors:
        t.copy_(flat[off: off + t.numel()].view_as(t))
        off += t.numel()


def sync_gradients(model: GPTModel, st: ParallelState) -> None:
    """TP sum of the replicated grads that are partial per rank (sequence parallel, q/k norms, MoE routers);
    DP mean of every dense gradient; expert gradients summed over their expert-data-parallel replicas and
    divided by DP (each already holds the tokens of its whole EP group, as megatron-core scales them);
    then the tied-embedding sum over the embedding group. One flat all-reduce each."""
    _flat_all_reduce([p.grad for p in model.tp_summed_params() if p.grad is not None], st.tp_group, "TP")
    experts = {id(p) for p in model.expert_params()}
    grads = [p.grad for p in model.parameters() if p.grad is not None and id(p) not in experts]
    _flat_all_reduce(grads, st.dp_group, "DP", 1.0 / st.dp)
    for p in model.expert_params():  # an expert no token reached on this rank: zeros, as Megatron's grad buffers
        if p.grad is None:             # hold, so that every replica reduces the same tensors
            p.grad = torch.zeros_like(p)
    expert_grads = [p.grad for p in model.expert_params()]
    if st.edp_group is None:
        for g in expert_grads:
            g.mul_(1.0 / st.dp)
    else:
        _flat_all_reduce(expert_grads, st.edp_group, "EDP", 1.0 / st.dp)
    shared = model.shared_embedding_weight()
    if shared is not None and shared.grad is not None:
        _flat_all_reduce([shared.grad], st.embedding_group, "embedding")


# ---- checkpoints --------------------------------------------------------------------------------
def rng_state(seed: int, st: ParallelState) -> list[dict[str, Any]]:
    """Megatron's rng_state: a list (one entry per DP rank it gathered; here this rank's) of RNG dicts."""
    tracker = torch.Generator().manual_seed(seed + 2718 + st.tp_rank)  # Megatron's model-parallel seed offset
    state: dict[str, Any] = {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        "rng_tracker_states": {"model-parallel-rng": tracker.get_state()},
    }
    if torch.cuda.is_available() and st.device.type == "cuda":
        state["cuda_rng_state"] = torch.cuda.get_rng_state()
    return [state]


def megatron_args(cfg: TrainConfig, spec: ModelSpec, iteration: int, consumed: int) -> Any:
    """Megatron's args Namespace: the model's (spec.to_megatron_args) plus the training run's own names."""
    moe: dict[str, Any] = {}
    if spec.is_moe:  # megatron-core's names for this trainer's router and its load-balancing loss
        moe = dict(moe_aux_loss_coeff=cfg.moe_aux_loss_coeff, moe_router_load_balancing_type="aux_loss",
                   moe_router_pre_softmax=False, moe_router_score_function=spec.moe_router_score_function,
                   moe_expert_capacity_factor=None)
        if spec.moe_router_enable_expert_bias:
            moe["moe_router_bias_update_rate"] = BIAS_UPDATE_RATE
    split = cfg.split(spec)
    return spec.to_megatron_args(
        cfg.tp, cfg.pp, ep=cfg.ep, **(split.megatron_args() if split is not None else {}),
        seq_length=cfg.seq_length, seed=cfg.seed, lr=cfg.lr, min_lr=cfg.lr, lr_decay_style="constant",
        lr_warmup_iters=0, micro_batch_size=cfg.micro_batch_size, global_batch_size=cfg.global_batch_size,
        train_iters=cfg.steps, iteration=iteration, consumed_train_samples=consumed,
        data_parallel_size=cfg.dp, world_size=cfg.world, optimizer="adam", adam_beta1=ADAM["betas"][0],
        adam_beta2=ADAM["betas"][1], adam_eps=ADAM["eps"], weight_decay=cfg.weight_decay, clip_grad=0.0,
        init_method_std=0.02, hidden_dropout=0.0, attention_dropout=0.0, save=cfg.save_as or cfg.save, load=cfg.save_as or cfg.save,
        save_interval=cfg.save_interval, use_distributed_optimizer=False, data_parallel_random_init=False,
        tokenizer_type="HuggingFaceTokenizer", tokenizer_model=cfg.save_as or cfg.save, use_checkpoint_args=False,
        sequence_parallel=cfg.sequence_parallel and cfg.tp > 1, **moe,
    )


def active_parameters(spec: ModelSpec) -> int:
    """Parameters one token meets: all of a dense model; an MoE model's router and k of its E experts."""
    if not spec.is_moe:
        return spec.num_parameters()
    per_expert = sum(math.prod(d.shape) for d in spec.expert_params(0, 0))
    moe_layers = spec.num_moe_layers + (spec.mtp_num_layers or 0) * spec.is_moe_layer(spec.num_layers)  # MTP's too
    return spec.num_parameters() - moe_layers * (spec.num_experts - spec.moe_router_topk) * per_expert


def flops_per_iteration(spec: ModelSpec, cfg: TrainConfig) -> float:
    """6·N·tokens for the matmuls (N: the parameters a token meets) plus the attention score/context
    products (fwd+bwd)."""
    tokens = cfg.global_batch_size * cfg.seq_length
    attn = 12 * spec.num_layers * spec.hidden_size * cfg.seq_length * tokens
    return 6.0 * active_parameters(spec) * tokens + attn


def save_checkpoint(cfg: TrainConfig, spec: ModelSpec, st: ParallelState, model: GPTModel,
                    opt: torch.optim.Optimizer, iteration: int, consumed: int) -> None:
    """Every expert-data-parallel-rank-0 process (DP rank 0 without experts) writes its mp_rank file, one per
    (TP, PP, EP) rank; after a barrier global rank 0 writes the tracker."""
    if st.edp_rank == 0:
        state = {
            "args": megatron_args(cfg, spec, iteration, consumed),
            "checkpoint_version": 3.0,
            "iteration": iteration,
            "model": {k: (v.detach().cpu() if isinstance(v, torch.Tensor) else v)
                      for k, v in model.state_dict().items()},
            "optimizer": _to_cpu(opt.state_dict()),
            "opt_param_scheduler": {
                "max_lr": cfg.lr, "lr_warmup_steps": 0, "num_steps": consumed, "lr_decay_style": "constant",
                "lr_decay_steps": cfg.steps * cfg.global_batch_size, "min_lr": cfg.lr, "start_wd": cfg.weight_decay,
                "end_wd": cfg.weight_decay, "wd_incr_style": "constant",
            },
            "rng_state": rng_state(cfg.seed, st),
            "num_floating_point_operations_so_far": flops_per_iteration(spec, cfg) * iteration,
        }
        save_rank_file(rank_file(cfg.save, iteration, st.tp_rank, st.pp_rank, st.pp, st.ep_rank, st.ep), state)
    if dist.is_initialized():
        dist.barrier()
    if st.rank == 0:
        write_latest(cfg.save, iteration)
    if dist.is_initialized():
        dist.barrier()


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_cpu(v) for v in obj]
    return obj


def _clone(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().to(device).clone()
    if isinstance(obj, dict):
        return {k: _clone(v, device) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clone(v, device) for v in obj]
    return obj


def load_rank_checkpoint(root: str | Path, iteration: int | str, st: ParallelState) -> dict[str, Any]:
    """This rank's model_optim_rng.pt (safe_load only)."""
    path = rank_file(root, iteration, st.tp_rank, st.pp_rank, st.pp, st.ep_rank, st.ep)
    if not path.parents[1].is_dir():  # the iteration directory itself: the tracker names one that is gone
        raise MConvertError(f"{Path(root) / TRACKER} names iteration {iteration}, but {path.parents[1]} does not "
                            "exist; write the iteration of a saved iter_* directory into it")
    if not path.is_file():
        raise MConvertError(f"{path}: missing; the checkpoint does not have TP={st.tp} PP={st.pp} EP={st.ep} shards")
    return safe_load(path)


def check_resume_args(args: Any, spec: ModelSpec, cfg: TrainConfig, path: str) -> None:
    """Refuse to resume into a different model or layout, naming the first differing field."""
    theirs = families.spec_from_megatron_args(args, family=spec.family, source=path)
    # every field that defines the function (rotary base, norm epsilon, biases, rope scaling, ...), not only
    # the ones that change a shape: a field that differs alone would load and train a different model
    for f in [x.name for x in dataclasses.fields(ModelSpec) if x.compare and x.name != "family"]:
        if getattr(theirs, f) != getattr(spec, f):
            raise MConvertError(
                f"{path}: checkpoint has {f}={getattr(theirs, f)!r} but this run asks for {getattr(spec, f)!r}; "
                "repeat the original flags to resume"
            )
    for f, mine in (("tensor_model_parallel_size", cfg.tp), ("pipeline_model_parallel_size", cfg.pp),
                    ("expert_model_parallel_size", cfg.ep)):
        if getattr(args, f, 1 if f == "expert_model_parallel_size" else None) != mine:
            raise MConvertError(
                f"{path}: checkpoint has {f}={getattr(args, f, None)} but this run uses {mine}; "
                "reshard it first (mconvert reshard) or resume at its layout"
            )
    split = cfg.split(spec) or PipelineSplit.make(spec.num_layers, cfg.pp)
    theirs_split = PipelineSplit.from_args(args_dict(args, path), spec.num_layers, cfg.pp, None, path)
    if theirs_split != split:
        raise MConvertError(f"{path}: checkpoint has the pipeline split {theirs_split.describe()} but this run uses "
                            f"{split.describe()}; repeat its --decoder-first/last-pipeline-num-layers or "
                            "--pipeline-model-parallel-layout")


# ---- the worker -----------------------------------------------------------------------------------
def _dtype(cfg: TrainConfig) -> torch.dtype:
    return torch.bfloat16 if cfg.dtype == "bf16" else torch.float32


def train_worker(cfg: TrainConfig, spec: ModelSpec, tokens: torch.Tensor) -> dict[str, Any]:
    """One rank's whole run. Returns {'losses': [...]} on the logging rank, comm rows on rank 0, else {}."""
    torch.set_num_threads(threads_per_rank(cfg.world))

    # this rank's checkpoint is read and checked before the first collective: a bad file fails the rank alone
    ckpt = load_resume(cfg, spec, int(os.environ.get("RANK", "0"))) if cfg.resume else None
    st = init_distributed(cfg.tp, cfg.pp, cfg.dp, cfg.device, sequence_parallel=cfg.sequence_parallel, ep=cfg.ep)
    out = _train(cfg, spec, tokens, st, ckpt)  # a failure leaves at once; its peers are ended by the launcher
    if dist.is_initialized():
        dist.destroy_process_group()
    return out


def _load_balancing_loss(model: GPTModel, st: ParallelState, spec: ModelSpec, micro_batches: int) -> float:
    """One step's load-balancing loss as megatron-core logs it (`track_moe_metrics`): each MoE layer's aux loss
    ÷ its coefficient, averaged over the micro-batches, summed over the stages, averaged over the layers and
    the data-parallel replicas. Every rank takes part (collectives over PP and DP)."""
    aux = model.pop_aux_loss().float().reshape(1) / micro_batches
    comm.all_reduce(aux, st.pp_group, "PP")  # each stage holds its own layers
    comm.all_reduce(aux, st.dp_group, "DP")
    return float(aux.item()) / (st.dp * spec.num_layers)


def _log_rank(cfg: TrainConfig) -> int:
    return global_rank(0, 0, cfg.pp - 1, cfg.tp, cfg.dp)


def load_resume(cfg: TrainConfig, spec: ModelSpec, rank: int) -> dict[str, Any]:
    """Global rank `rank`'s file of the checkpoint in --save, checked against this run's model and layout."""
    latest = read_latest(cfg.save, other=None)  # a resume continues the tracker's iteration: no flag names another
    if latest == "release":
        raise MConvertError(f"{cfg.save}/{TRACKER}: 'release' has no iteration to resume from")
    st = ParallelState(tp=cfg.tp, pp=cfg.pp, dp=cfg.dp, rank=rank, ep=cfg.ep)
    ckpt = load_rank_checkpoint(cfg.save, latest, st)
    path = rank_file(cfg.save, latest, st.tp_rank, st.pp_rank, st.pp, st.ep_rank, st.ep)
    check_resume_entries(ckpt, latest, str(path))
    # args as Megatron-LM saves them (a Namespace) or as a dict, as every reader of rank files takes them
    ckpt["args"] = argparse.Namespace(**args_dict(ckpt["args"], path))
    check_resume_args(ckpt["args"], spec, cfg, str(path))
    consumed = getattr(ckpt["args"], "consumed_train_samples", latest * cfg.global_batch_size)
    batch = getattr(ckpt["args"], "global_batch_size", None)
    batch = batch if isinstance(batch, int) and not isinstance(batch, bool) and batch > 0 else cfg.global_batch_size
    # samples are drawn by position in the data order: a count the iterations cannot have consumed is damage
    if isinstance(consumed, bool) or not isinstance(consumed, int) or not 0 <= consumed <= latest * batch:
        raise MConvertError(f"{path}: args.consumed_train_samples is {consumed!r}, not a whole number from 0 to "
                            f"{latest * batch} (iteration {latest} × global batch {batch}); the file is damaged — "
                            "resume from an earlier iteration")
    return {**ckpt, "source": str(path)}


_RESUME_ENTRIES = {"args": "the run's arguments", "iteration": "the iteration", "model": "the weights",
                   "optimizer": "the Adam state", "rng_state": "the random generators' states"}


def check_resume_entries(ckpt: Any, latest: int, path: str) -> None:
    """The entries a resume reads, present and of their types, and the file's iteration the tracker's: a rank
    file that lacks one is not a training checkpoint (a conversion's output holds the weights alone)."""
    expect(ckpt, dict, path, "the file is not a Megatron checkpoint")
    for key, what in _RESUME_ENTRIES.items():
        if key not in ckpt:
            raise MConvertError(f"{path}: no {key!r} entry ({what}); only a checkpoint `mconvert train` saved can "
                                "be resumed — start a new run from it with `mconvert train` without --resume")
    fix = "the file is damaged — resume from an earlier iteration"
    expect(ckpt["model"], dict, f"{path}: model", fix)
    expect(ckpt["optimizer"], dict, f"{path}: optimizer", fix)
    rng = expect(ckpt["rng_state"], list, f"{path}: rng_state", fix)
    if not rng:
        raise MConvertError(f"{path}: rng_state is an empty list; {fix}")
    for i, r in enumerate(rng):
        expect(r, dict, f"{path}: rng_state[{i}]", fix)
    it = expect(ckpt["iteration"], int, f"{path}: iteration", fix)
    if it != latest:
        raise MConvertError(f"{path}: the file is of iteration {it} but {TRACKER} names {latest}; "
                            "the checkpoint is mixed up — point the tracker at the iteration the files hold")


def check_resume_model(saved: dict[str, Any], model: GPTModel, path: str) -> None:
    """The saved weights against the model this run builds, key by key: the names, shapes and dtypes, and
    finite values. `load_state_dict` would copy an int view of float bits as numbers and cast any float."""
    own = model.state_dict()
    fix = "the checkpoint is of another model or damaged — repeat the original flags or resume an earlier iteration"
    for key in sorted(set(own) | set(saved)):
        if key not in saved:
            raise MConvertError(f"{path}: model has no {key!r}; {fix}")
        if key not in own:
            raise MConvertError(f"{path}: model holds {key!r}, which this run's model does not have; {fix}")
        want, got = own[key], saved[key]
        if not isinstance(want, torch.Tensor):
            continue
        if not isinstance(got, torch.Tensor):
            raise MConvertError(f"{path}: model {key!r} is {type(got).__name__}, not a tensor; {fix}")
        if tuple(got.shape) != tuple(want.shape) or got.dtype != want.dtype:
            raise MConvertError(f"{path}: model {key!r} is {got.dtype} {tuple(got.shape)}, this run's is "
                                f"{want.dtype} {tuple(want.shape)}; {fix}")
        if got.is_floating_point() and not all_finite(got):
            raise MConvertError(f"{path}: model {key!r} holds NaN or Inf values; the run diverged or the file is "
                                "corrupt — resume from an earlier iteration")


def check_resume_optimizer(saved: dict[str, Any], named: list[tuple[str, torch.Tensor]], path: str) -> None:
    """The Adam state_dict (in this run's groups) against the parameters: every parameter has its step and
    moments, of its shape, finite (exp_avg_sq ≥ 0), and every group usable hyperparameters. torch's
    `load_state_dict` takes a missing state as a fresh start and a wrong shape fails only at the first step."""
    fix = "the file is damaged — resume from an earlier iteration"
    shapes = dict((n, tuple(p.shape)) for n, p in named)
    states = expect(saved.get("state"), dict, f"{path}: optimizer state", fix)
    groups = expect(saved.get("param_groups"), list, f"{path}: optimizer param_groups", fix)
    for g, group in enumerate(groups):
        group = expect(group, dict, f"{path}: optimizer param_groups[{g}]", fix)
        betas, eps = group.get("betas"), group.get("eps")
        if not (isinstance(betas, (tuple, list)) and len(betas) == 2
                and all(_number(b) and 0 <= b < 1 for b in betas)) or not (_number(eps) and eps > 0):
            raise MConvertError(f"{path}: optimizer param_groups[{g}] has betas={betas!r} eps={eps!r}, and Adam needs "
                                f"two betas in [0, 1) and eps > 0; {fix}")
        ids, names = group.get("params"), group.get("param_names")
        if not (isinstance(ids, list) and isinstance(names, list) and len(ids) == len(names)):
            raise MConvertError(f"{path}: optimizer param_groups[{g}] has params and param_names of different "
                                f"lengths or types; {fix}")
        for pid, name in zip(ids, names):
            st = states.get(pid)
            if not isinstance(st, dict) or not {"step", "exp_avg", "exp_avg_sq"} <= set(st):
                raise MConvertError(f"{path}: the optimizer has no step / exp_avg / exp_avg_sq for parameter "
                                    f"{name!r}, and resuming would restart its Adam moments; {fix}")
            for key in ("exp_avg", "exp_avg_sq"):
                t = st[key]
                if not isinstance(t, torch.Tensor) or not t.is_floating_point() or tuple(t.shape) != shapes.get(name):
                    what = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
                    raise MConvertError(f"{path}: optimizer {key!r} of parameter {name!r} is {what}, the parameter "
                                        f"is {shapes.get(name)}; {fix}")
            step = st["step"]
            step = float(step) if isinstance(step, torch.Tensor) and step.numel() == 1 else step
            if not (_number(step) and step >= 0):
                raise MConvertError(f"{path}: optimizer step of parameter {name!r} is {step!r}, not a number ≥ 0; "
                                    f"{fix}")
            ranges = {key: value_range(st[key]) for key in ("exp_avg", "exp_avg_sq")}  # one pass: finite, sign
            for key, (lo, hi) in ranges.items():
                if not (math.isfinite(lo) and math.isfinite(hi)):
                    raise MConvertError(f"{path}: optimizer {key!r} of parameter {name!r} holds NaN or Inf values; "
                                        "the run diverged or the file is corrupt — resume from an earlier iteration")
            if ranges["exp_avg_sq"][0] < 0:
                raise MConvertError(f"{path}: optimizer 'exp_avg_sq' of parameter {name!r} holds negative values "
                                    f"(a mean of squares); {fix}")


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _train(cfg: TrainConfig, spec: ModelSpec, tokens: torch.Tensor, st: ParallelState,
           ckpt: dict[str, Any] | None = None) -> dict[str, Any]:
    comm.STATS.reset()
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    dtype = _dtype(cfg)
    start, consumed = 0, 0
    if ckpt is not None:
        start = int(ckpt["iteration"])
        consumed = int(getattr(ckpt["args"], "consumed_train_samples", start * cfg.global_batch_size))
    model = GPTModel(spec, st, seed=None if ckpt else cfg.seed, dtype=dtype, split=cfg.split(spec))
    source = str(ckpt.get("source", cfg.save)) if ckpt is not None else ""
    if ckpt is not None:
        check_resume_model(ckpt["model"], model, source)
        model.load_state_dict(ckpt["model"], strict=True)
    model.set_aux_loss(cfg.moe_aux_loss_coeff, 1.0 / cfg.num_micro_batches)
    # fp32 master copies for bf16 (Megatron's mixed precision); Adam names each parameter by its state_dict key
    if dtype == torch.float32:
        named = list(model.named_parameters())
    else:
        named = [(n, torch.nn.Parameter(p.detach().float().clone())) for n, p in model.named_parameters()]
    groups = optim.trainer_param_groups(named, cfg.weight_decay)
    opt = torch.optim.Adam(groups, lr=cfg.lr, **ADAM)
    if ckpt is not None:
        saved = optim.regroup(ckpt["optimizer"], groups, source)
        check_resume_optimizer(saved, named, source)
        opt.load_state_dict(_clone(saved, st.device))
        for group in opt.param_groups:  # as Megatron-LM's scheduler sets them each step, whatever was saved
            group["lr"] = cfg.lr * group.get("lr_mult", 1.0)
            group["weight_decay"] = cfg.weight_decay * group.get("wd_mult", 0.0)
            group["decoupled_weight_decay"] = True
        rs = ckpt["rng_state"][min(st.dp_rank, len(ckpt["rng_state"]) - 1)]
        try:
            random.setstate(rs["random_rng_state"])
            np.random.set_state(rs["np_rng_state"])
            torch.set_rng_state(rs["torch_rng_state"])
        except (KeyError, TypeError, ValueError, RuntimeError, IndexError) as e:
            raise MConvertError(f"{source}: rng_state cannot be restored ({type(e).__name__}: {e}); the file is "
                                "damaged — resume from an earlier iteration") from None
        del ckpt
    losses: list[float] = []
    aux_losses: list[float] = []  # megatron-core's `load_balancing_loss` per step (MoE)
    log = st.rank == _log_rank(cfg) and not cfg.quiet
    if cfg.steps == 0 or start >= cfg.steps:
        if log and start >= cfg.steps and cfg.steps:
            print(f"checkpoint is at iteration {start} >= --steps {cfg.steps}: nothing to train", flush=True)
        if cfg.save and cfg.steps == 0:
            save_checkpoint(cfg, spec, st, model, opt, 0, 0)
    for it in range(start + 1, cfg.steps + 1):
        t0 = time.perf_counter()
        for p in model.parameters():
            p.grad = None
        mbs = get_micro_batches(cfg, st, tokens, consumed, spec)
        mb_losses = forward_backward_1f1b(model, mbs, st, dtype)
        sync_gradients(model, st)
        if dtype != torch.float32:
            for (_, master), p in zip(named, model.parameters()):
                master.grad = p.grad.float()
        opt.step()
        update_expert_bias(model.routers(), st)  # aux-loss-free balancing: the bias moves outside the optimizer
        if dtype != torch.float32:
            with torch.no_grad():
                for (_, master), p in zip(named, model.parameters()):
                    p.copy_(master)
        consumed += cfg.global_batch_size
        loss = torch.tensor([sum(mb_losses) / max(1, len(mb_losses))], device=st.device)
        if st.is_last_stage:
            comm.all_reduce(loss, st.dp_group, "DP")
            loss /= st.dp
        loss_v = float(loss.item())
        losses.append(loss_v)
        aux_text = ""
        if spec.is_moe and cfg.moe_aux_loss_coeff > 0:
            aux_losses.append(_load_balancing_loss(model, st, spec, cfg.num_micro_batches))
            aux_text = f" | load_balancing_loss {aux_losses[-1]:.6f}"
        if log:
            print(f"iteration {it:>6}/{cfg.steps} | loss {loss_v:.6f}{aux_text} | lr {cfg.lr:.2e} | "
                  f"{time.perf_counter() - t0:.3f} s", flush=True, file=sys.stderr if cfg.log_stderr else sys.stdout)
        if cfg.save and (it == cfg.steps or (cfg.save_interval and it % cfg.save_interval == 0)):
            save_checkpoint(cfg, spec, st, model, opt, it, consumed)
            if log:
                print(f"saved checkpoint iteration {it} to {cfg.save_as or cfg.save}", flush=True,
                      file=sys.stderr if cfg.log_stderr else sys.stdout)
    out: dict[str, Any] = {}
    if st.rank == _log_rank(cfg):
        out["losses"] = losses
        if aux_losses:
            out["load_balancing_losses"] = aux_losses
    rows = comm.gather_report() if cfg.comm_report else None
    if st.rank == 0 and rows is not None:
        out["comm"] = rows
    if dist.is_initialized():
        dist.barrier()
    return out


# ---- launcher ---------------------------------------------------------------------------------------
def prepare_tokens(save: str | None, write: bool) -> tuple[torch.Tensor, int]:
    """Build the tokenizer (deterministic), save it as HF files into `save` when asked, tokenize the corpus."""
    tok = build_tokenizer()
    if save and write:
        Path(save).mkdir(parents=True, exist_ok=True)
        save_hf_tokenizer(tok, save)
    return tokenize_corpus(tok), tok.get_vocab_size()


def prepare_save_dir(cfg: TrainConfig) -> None:
    """Refuse to mix a new run into an existing checkpoint unless --resume or --force (which clears it)."""
    if not cfg.save:
        return
    root = Path(cfg.save)
    if root.exists() and not root.is_dir():
        raise MConvertError(f"--save {root}: exists and is not a directory")
    has_ckpt = (root / TRACKER).exists() or any(root.glob("iter_*"))
    if cfg.resume:
        if not (root / TRACKER).exists():
            raise MConvertError(f"--resume: {root / TRACKER} not found; nothing to resume (drop --resume)")
        return
    if has_ckpt and not cfg.force:
        raise MConvertError(f"--save {root}: already holds a checkpoint; pass --resume to continue or --force")


def _replaces_checkpoint(cfg: TrainConfig) -> bool:
    """--force over an existing checkpoint: train into a temporary sibling, swap it in only at the end."""
    if not (cfg.save and cfg.force and not cfg.resume):
        return False
    root = Path(cfg.save)
    return root.is_dir() and ((root / TRACKER).exists() or any(root.glob("iter_*")) or (root / "release").exists())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(fn: Any, args: tuple, nprocs: int, device: str | None = None) -> dict[int, Any]:
    """Start `nprocs` ranks of `fn(*args)` on this node with torch's elastic launcher (torchrun's engine).

    CPU runs fork from a forkserver with one thread per rank (see _start_method); CUDA runs spawn. Every rank
    runs inside procs.run_rank: the first failing rank ends the launch at once, and no rank outlives it.
    Returns {global rank: return value}. A failing rank raises MConvertError naming it and its error."""
    method = _start_method(device)

    def config(group: procs.RankGroup) -> LaunchConfig:
        # the agent's per-rank log and error files go into the group's directory, which the launch removes
        # (without a log_dir the agent makes a directory of its own in the temporary directory and leaves it)
        return LaunchConfig(
            min_nodes=1, max_nodes=1, nproc_per_node=nprocs, run_id=str(uuid.uuid4()),
            rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{_free_port()}", max_restarts=0, monitor_interval=0.1,
            start_method=method, logs_specs=DefaultLogsSpecs(log_dir=str(group.directory / "logs")),
            local_addr="127.0.0.1",
        )
    # A rank forked from the caller must stay single-threaded: the parent's OpenMP pool does not survive fork.
    threads = 1 if method == "fork" else max(1, (os.cpu_count() or 1) // nprocs)
    if not os.environ.get("MCONVERT_DEBUG"):  # a failing rank is reported once, as one line, below
        for name in list(logging.root.manager.loggerDict):  # elastic's loggers set their own level each
            if name.startswith(("torch.distributed.elastic", "torch.multiprocessing")):
                logging.getLogger(name).setLevel(logging.CRITICAL)
    saved = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "MCONVERT_RANK_THREADS")}
    os.environ.update(OMP_NUM_THREADS=str(threads), MCONVERT_RANK_THREADS=str(threads))
    signalled: int | None = None
    try:
        with procs.kept_signal_handlers(), procs.RankGroup() as group:
            try:
                return elastic_launch(config(group), procs.run_rank)(group.control, fn, args)
            except ChildFailedError as e:
                group.kill()
                failure = group.first_failure()
                if failure is None:  # killed from outside (OOM killer, a signal): what the agent saw
                    rank, first = next(iter(sorted(e.failures.items())))  # {global rank: ProcessFailure}
                    text = first.message
                    if isinstance(text, dict):  # the error file's JSON: {"message": ..., "extraInfo": ...}
                        text = text.get("message", "")
                    lines = str(text or "").strip().splitlines()
                    failure = (rank, lines[-1] if lines else _exit_reason(first.exitcode))
                raise MConvertError(f"rank {failure[0]} failed: {failure[1]}") from None
            except SignalException as e:
                signalled = int(e.sigval)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    assert signalled is not None  # every other path returned or raised above
    procs.redeliver(signalled)  # the ranks are gone and the caller's handlers are back


def _exit_reason(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


def threads_per_rank(nprocs: int) -> int:
    """Intra-op threads for each rank: what `launch` chose (1 for forked ranks), else the cores shared out."""
    env = os.environ.get("MCONVERT_RANK_THREADS")
    local = int(os.environ.get("LOCAL_WORLD_SIZE", nprocs))  # torchrun: ranks on this node
    return int(env) if env else max(1, (os.cpu_count() or 1) // local)


def _start_method(device: str | None) -> str:
    """CPU: forkserver — ranks fork from a clean single-threaded server that imported torch once, so a
    rank neither re-imports torch (~10 s each on a small machine) nor inherits the caller's threads and
    locks (forking a busy process, a test runner say, can deadlock a rank in its store connect); the
    preloaded forkserver_init ties the server's life to the launcher's. CUDA: spawn.
    MCONVERT_START_METHOD=fork|spawn overrides."""
    cuda = device.startswith("cuda") if device else torch.cuda.is_available()
    default = "spawn" if cuda or sys.platform != "linux" else "forkserver"
    method = os.environ.get("MCONVERT_START_METHOD", default)
    if method == "forkserver":
        multiprocessing.set_forkserver_preload(["torch", "mconvert.trainer.train", "mconvert.trainer.forkserver_init"])
    return method


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Run a whole training job on this node: TP·PP·DP processes; returns losses (and comm rows)."""
    cfg.validate()
    _check_gpus(cfg)
    tokens, vocab = prepare_tokens(None, write=False)
    cfg.check_corpus(tokens)
    spec = build_spec(cfg, vocab)  # refuse a bad layout before anything is written
    prepare_save_dir(cfg)
    if _replaces_checkpoint(cfg):  # a run that dies leaves the old checkpoint whole
        with atomic_output_dir(cfg.save, force=True, manifest=False) as tmp:
            return _run_training(dataclasses.replace(cfg, save=str(tmp), save_as=cfg.save), spec, tokens)
    with _undone_on_failure(cfg.save):
        return _run_training(cfg, spec, tokens)


def _check_gpus(cfg: TrainConfig) -> None:
    """A CUDA run on this node takes one GPU per rank."""
    if cfg.device == "cpu" or (cfg.device is None and not torch.cuda.is_available()):
        return
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have < cfg.world:
        raise MConvertError(f"--device cuda: this machine has {have} GPU(s) and the run needs TP·PP·DP = {cfg.world}, "
                            "one per rank; pass --device cpu or a smaller layout")


def _iteration_of(name: str) -> int | None:
    return int(name[5:]) if name.startswith("iter_") and name[5:].isdigit() else None


@contextlib.contextmanager
def _undone_on_failure(save: str | None) -> Iterator[None]:
    """A run into a new or existing --save that fails (a rank error, Ctrl-C, SIGTERM, SIGHUP) removes what it
    added and no checkpoint holds: the directory itself (and the parents it made) when no checkpoint was
    committed, else the files and directories it created; a checkpoint it committed (the tracker names it)
    stays with the tokenizer files, an iteration after it that did not finish goes."""
    if not save:
        yield
        return
    root = Path(save).absolute()
    made = root  # the top directory this run creates (root or one of its parents), None when root exists
    while not made.parent.exists():
        made = made.parent
    made_top = None if root.exists() else made
    before = set(os.listdir(root)) if root.is_dir() else set()
    tracker = root / TRACKER
    tracked = tracker.read_bytes() if tracker.is_file() else None
    with terminating():
        try:
            yield
        except BaseException:
            _undo_run(root, made_top, before, tracked)
            raise


def _undo_run(root: Path, made_top: Path | None, before: set[str], tracked: bytes | None) -> None:
    """`_undone_on_failure`'s removal; `tracked`: the tracker's bytes before the run (None: no tracker)."""
    tracker = root / TRACKER
    latest: int | str | None = None
    if tracker.is_file() and tracker.read_bytes() != tracked:  # this run committed a checkpoint
        with contextlib.suppress(MConvertError, OSError):
            latest = read_latest(root)
    if not isinstance(latest, int):
        if made_top is not None:
            shutil.rmtree(made_top, ignore_errors=True)
            return
        latest = None
    if not root.is_dir():
        return
    for name in set(os.listdir(root)) - before:
        it = _iteration_of(name)
        if latest is not None and (it is None or it <= latest):  # the checkpoint, its tokenizer, its tracker
            continue
        path = root / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def _run_training(cfg: TrainConfig, spec: ModelSpec, tokens: torch.Tensor) -> dict[str, Any]:
    if cfg.save:
        prepare_tokens(cfg.save, write=True)
    results = launch(train_worker, (cfg, spec, tokens), cfg.world, cfg.device)
    out: dict[str, Any] = {"spec": spec}
    for r in sorted(results):
        out.update(results[r] or {})
    return out

