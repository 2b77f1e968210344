"""Run a Megatron checkpoint natively at its own TP/PP/EP (no merging) and return its logits.

`megatron_logits(ckpt, tokens)` starts TP·PP·EP processes (gloo on CPU, NCCL on CUDA; the EP ranks are the
data-parallel ranks, every one fed the same tokens), each loads its own `mp_rank_TT[_PPP][_EEE]` file into the
trainer's GPT stage, activations flow stage to stage, the last stage all-gathers its vocab shards and strips
the padded rows. This is what the validator compares formats against.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mconvert.convert.megatron.checkpoint import args_dict
from mconvert.layouts.megatron import PipelineSplit, rank_file, read_latest
from mconvert.io.paths import inside_file
from mconvert.io.safeload import safe_load
from mconvert.errors import MConvertError
from mconvert.mappings import families
from mconvert.mappings.keys import canonical_key, flatten
from mconvert.spec import ModelSpec
from mconvert.trainer.model import GPTModel
from mconvert.trainer.parallel import ParallelState, coords, init_distributed
from mconvert.trainer.schedule import P2P
from mconvert.trainer.train import launch, threads_per_rank


def pipeline_logits(model: GPTModel, st: ParallelState, tokens: torch.Tensor,
                    return_hidden: bool = False) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
    """Forward `tokens` [B, S] through every stage; full-vocab logits [B, S, V] (fp32) on the last stage.

    Also returns this stage's recorded hidden states when asked (inputs of its layers and final output)."""
    B, S = tokens.shape
    model.record_hidden = return_hidden
    dtype = next(model.parameters()).dtype
    p2p = P2P(st, (B, S // st.tp if st.sequence_parallel else S, model.spec.hidden_size), dtype)
    with torch.no_grad():
        x = p2p.recv_forward()
        out = model(tokens.to(st.device) if st.is_first_stage else x.detach())
        p2p.send_forward(out)
        hidden = [h.float().cpu() for h in (model.hidden_states or [])]
        if not st.is_last_stage:
            return None, hidden
        return model.full_logits(out).cpu(), hidden


def _contained(ckpt_dir: str | Path, path: Path) -> Path:
    """The rank file `path`, refused unless it is a regular file inside the checkpoint (no symlink out, no FIFO)."""
    return inside_file(ckpt_dir, path.relative_to(ckpt_dir), "rank file")


def read_checkpoint_args(ckpt_dir: str | Path, iteration: int | str | None = None) -> tuple[Any, int | str]:
    """The `args` Namespace of rank 0's file and the resolved iteration."""
    it = read_latest(ckpt_dir) if iteration is None else iteration
    if isinstance(it, str) and it != "release":
        it = int(it)
    # PP > 1 and EP > 1 name mp_rank_00_000_000; one of them mp_rank_00_000; neither mp_rank_00
    for pp_size, ep_size in ((2, 2), (2, 1), (1, 1)):
        path = rank_file(ckpt_dir, it, 0, 0, pp_size, 0, ep_size)
        if path.exists():
            return safe_load(_contained(ckpt_dir, path))["args"], it
    raise MConvertError(f"{ckpt_dir}: no {rank_file(ckpt_dir, it, 0, 0, 2).parent.name} or mp_rank_00 in "
                        f"iteration {it}; is this a Megatron legacy-torch checkpoint?")


def _local_spec_weights(state: dict[str, Any], path: Path) -> dict[str, torch.Tensor]:
    """This rank's tensors under megatron-core local-spec names, whatever spelling the file uses
    (TE spec, legacy `language_model.*` flat or nested); still this rank's shards, never merged."""
    if "model" not in state:
        raise MConvertError(f"{path}: no 'model' entry (virtual-pipeline files hold model0, model1, ...); "
                            "the native runner needs one model per rank — reshard without --vpp first")
    version = float(state.get("checkpoint_version", 3.0) or 0)
    if version < 2.0:
        raise MConvertError(f"{path}: checkpoint_version {version} uses the pre-2.0 QKV row order; "
                            "run `mconvert reshard` on it first to write the current layout")
    out: dict[str, torch.Tensor] = {}
    for key, value in flatten(state["model"]).items():
        name = canonical_key(key)
        if name is not None and isinstance(value, torch.Tensor):
            out[name] = value
    if not out:
        raise MConvertError(f"{path}: the model entry holds no tensors")
    return out


def _infer_worker(ckpt_dir: str, it: int | str, spec: ModelSpec, tp: int, pp: int, tokens: torch.Tensor,
                  device: str, return_hidden: bool, ep: int = 1, split: PipelineSplit | None = None) -> dict[str, Any]:
    """One rank: load and check its own file before joining the group (a bad file fails this rank before any
    collective), then run its stage. A failure leaves at once: no barrier on the way out."""
    torch.set_num_threads(threads_per_rank(tp * pp * ep))
    tp_rank, ep_rank, pp_rank = coords(int(os.environ.get("RANK", "0")), tp, ep, pp)  # DP = EP
    path = _contained(ckpt_dir, rank_file(ckpt_dir, it, tp_rank, pp_rank, pp, ep_rank, ep))
    weights = _local_spec_weights(safe_load(path), path)
    st = init_distributed(tp, pp, ep, device, ep=ep)
    dtype = next(iter(weights.values())).dtype
    model = GPTModel(spec, st, seed=None, dtype=dtype, split=split)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    unexpected = [k for k in unexpected if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise MConvertError(f"{path}: keys do not match the model (missing {missing[:3]}, unexpected "
                            f"{unexpected[:3]})")
    del weights
    logits, hidden = pipeline_logits(model, st, tokens, return_hidden)
    out: dict[str, Any] = {}
    if st.tp_rank == 0 and st.ep_rank == 0:  # the other EP ranks ran the same tokens
        out["hidden"] = (st.pp_rank, hidden)
        if logits is not None:
            out["logits"] = logits
    dist.barrier()
    dist.destroy_process_group()
    return out


def megatron_logits(ckpt_dir: str | Path, tokens: torch.LongTensor, iteration: int | str | None = None,
                    device: str = "cpu", return_hidden: bool = False) -> Any:
    """Logits [B, S, vocab_size] (fp32, padding stripped) of the checkpoint run at its own TP/PP/EP.

    With `return_hidden=True` returns (logits, hidden) where hidden is a list of num_layers + 1 tensors
    [B, S, H]: the embedding output, then each layer's output (before the final norm)."""
    args, it = read_checkpoint_args(ckpt_dir, iteration)
    spec = families.spec_from_megatron_args(args, source=str(ckpt_dir))
    tp = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
    pp = int(getattr(args, "pipeline_model_parallel_size", 1) or 1)
    ep = int(getattr(args, "expert_model_parallel_size", 1) or 1)
    etp = int(getattr(args, "expert_tensor_parallel_size", None) or tp)
    if etp != tp:
        raise MConvertError(f"{ckpt_dir}: expert_tensor_parallel_size={etp} differs from TP={tp}; the native runner "
                            "splits experts like the dense MLP: reshard it to expert TP = TP first")
    if getattr(args, "virtual_pipeline_model_parallel_size", None):
        raise MConvertError(f"{ckpt_dir}: virtual pipeline checkpoints are not supported by the native runner")
    tokens = torch.as_tensor(tokens, dtype=torch.long)
    if tokens.dim() != 2:
        raise MConvertError(f"tokens must be [batch, seq], got shape {tuple(tokens.shape)}")
    if int(tokens.max()) >= spec.vocab_size or int(tokens.min()) < 0:
        raise MConvertError(f"token ids must lie in [0, {spec.vocab_size}) for {ckpt_dir}")
    split = PipelineSplit.from_args(args_dict(args, str(ckpt_dir)), spec.num_layers, pp, None, str(ckpt_dir))
    results = launch(_infer_worker, (str(ckpt_dir), it, spec, tp, pp, tokens, device, return_hidden, ep, split),
                     tp * pp * ep, device)
    logits = next(r["logits"] for r in results.values() if r and "logits" in r)
    if not return_hidden:
        return logits
    stages = sorted((r["hidden"] for r in results.values() if r and "hidden" in r), key=lambda h: h[0])
    return logits, [h for _, hs in stages for h in hs]
