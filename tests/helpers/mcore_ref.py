"""megatron-core as an independent reference: run its GPTModel (local spec) on CPU over gloo, N processes.

Truth we did not write (DESIGN.md): a checkpoint is right when megatron-core's own `GPTModel` loads it with
`strict=True` and its logits match. This harness forks `tp * pp` (≤ 4) processes, initialises
`megatron.core.parallel_state` with the two CPU patches of DESIGN.md (inference RNG tracker before
`model_parallel_cuda_manual_seed`; `torch.cuda.current_device` -> cpu; plus, in the children only,
`torch.cuda.synchronize` -> no-op for `dist_checkpointing.save` and `Tensor.cuda` -> identity for the tied
embedding all-reduce at PP > 1), builds a `GPTModel` from a
`mconvert.spec.ModelSpec`, runs a user function on every rank and returns the per-rank results.

Import it as `mcore_ref` (pytest puts `tests/` on sys.path) or `tests.mcore_ref`:

    from mcore_ref import run_mcore, mcore_forward_logits, McoreContext

    def my_fn(ctx: McoreContext, path):          # module-level (it is pickled into the children)
        ctx.model.load_state_dict(torch.load(path, weights_only=True)["model"], strict=True)
        return ctx.logits(tokens)                 # full-vocab logits [b, s, V_pad] (last stage), else None

    results = run_mcore(spec, tp=2, fn=my_fn, args=(path,), pp=1)   # list, index = global rank

    logits = mcore_forward_logits(spec, tp=2, tokens=ids, state_dicts=per_rank_sds)   # loads + forward

With `vpp=V` every rank builds V virtual chunks (`ctx.models`; chunk c holds model chunk c·pp + pp_rank, the
layer index inside a chunk is local, as in Megatron-LM's `model0`, `model1`, ... entries); `ctx.model` is
chunk 0. Missing `_extra_state` keys are accepted by megatron-core's strict load.

Rank layout is megatron-core's default order (tp fastest): global rank = pp_rank * tp + tp_rank.
`ctx.logits(tokens)` runs a full forward (with PP > 1 it passes activations stage to stage over gloo
point-to-point) and returns the vocab logits gathered across TP on the last stage, padded rows included
(`[b, s, spec.padded_vocab_size(tp)]`). Results travel back as pickles through a temporary directory.
The model is fp32, dropout-free, `vocab_size = spec.padded_vocab_size(tp)`; `spec.qk_layernorm` and
`spec.rope_scaling` ("llama3": `rope_scaling=True`; "linear": `seq_len_interpolation_factor`; "yarn":
`position_embedding_type='yarn'` and the `config.yarn_*` attributes) are passed on, and so
is a sliding window (`window_size`, `window_attn_skip_freq`, as `spec.to_megatron_args` writes them): megatron-core's
local attention applies it itself (FusedScaleMaskSoftmax builds `get_sliding_window_causal_mask` in place of the
causal mask); that helper allocates on device "cuda", which `_CudaOnCpu` redirects to the CPU during the forward
— megatron-core's own mask code runs unchanged. Children fork from a parent that
has imported megatron-core once (~10 s); each run after that costs ~1-3 s.
"""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from mconvert.spec import ModelSpec, window_megatron_args

MAX_PROCS = 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def moe_config(spec: ModelSpec, ep: int = 1) -> dict[str, Any]:
    """megatron-core's MoE `TransformerConfig` fields for `spec` (empty when dense): SequentialMLP experts, the
    allgather dispatcher (the alltoall one needs CUDA streams), the default softmax top-k router, no aux loss."""
    if not spec.is_moe:
        return {}
    return dict(num_moe_experts=spec.num_experts, moe_ffn_hidden_size=spec.expert_ffn_hidden_size,
                moe_router_topk=spec.moe_router_topk, moe_token_dispatcher_type="allgather", moe_grouped_gemm=False,
                moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, expert_model_parallel_size=ep)


def deepseek_config(spec: ModelSpec) -> dict[str, Any]:
    """megatron-core's config fields for MLA (`rope_type` 'rope', or 'yarn' with the spec's YaRN; its latent norms
    exist only with `qk_layernorm`), the DeepSeek router, the MoE layer pattern and MTP (empty when the model has none)."""
    out: dict[str, Any] = {}
    if spec.is_mla:
        out.update(multi_latent_attention=True, qk_layernorm=True, q_lora_rank=spec.q_lora_rank,
                   kv_lora_rank=spec.kv_lora_rank, qk_head_dim=spec.qk_nope_head_dim,
                   qk_pos_emb_head_dim=spec.qk_rope_head_dim, v_head_dim=spec.v_head_dim, rope_type="rope",
                   rotary_base=spec.rotary_base, rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0,
                   apply_rope_fusion=False)
        if spec.rope_scaling == "yarn":  # MLA's own YaRN (MLATransformerConfig's fields)
            out.update(rope_type="yarn", rotary_scaling_factor=spec.rope_scaling_factor,
                       original_max_position_embeddings=spec.rope_original_max_position_embeddings,
                       beta_fast=spec.yarn_beta_fast, beta_slow=spec.yarn_beta_slow, mscale=spec.yarn_mscale,
                       mscale_all_dim=spec.yarn_mscale_all_dim)
    if spec.mtp_num_layers:
        out.update(mtp_num_layers=spec.mtp_num_layers)
    if spec.is_moe:
        freq = spec.moe_layer_freq
        out.update(moe_router_score_function=spec.moe_router_score_function,
                   moe_router_enable_expert_bias=spec.moe_router_enable_expert_bias,
                   moe_router_topk_scaling_factor=spec.moe_router_topk_scaling_factor,
                   moe_router_num_groups=spec.moe_router_num_groups, moe_router_group_topk=spec.moe_router_group_topk,
                   moe_shared_expert_intermediate_size=spec.moe_shared_expert_intermediate_size,
                   moe_layer_freq=list(freq) if isinstance(freq, tuple) else freq)
    return out


def transformer_config(spec: ModelSpec, tp: int, pp: int = 1, vpp: int | None = None, ep: int = 1):
    """megatron-core `TransformerConfig` (`MLATransformerConfig` for MLA) equivalent to `spec` (fp32, no
    dropout, CPU init)."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig
    from megatron.core.transformer.utils import openai_gelu

    if spec.gated:
        act, glu = F.silu, True
    elif spec.activation == "gelu_new":
        act, glu = openai_gelu, False
    else:
        act, glu = F.gelu, False
    deepseek = {"qk_layernorm": spec.qk_layernorm, **deepseek_config(spec)}
    return (MLATransformerConfig if spec.is_mla else TransformerConfig)(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        ffn_hidden_size=spec.ffn_hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_groups,
        kv_channels=spec.head_dim,
        normalization=spec.normalization,
        layernorm_epsilon=spec.norm_epsilon,
        gated_linear_unit=glu,
        activation_func=act,
        add_bias_linear=spec.add_bias_linear,
        add_qkv_bias=spec.add_qkv_bias,
        rotary_interleaved=spec.rotary_interleaved,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        pipeline_dtype=torch.float32,
        params_dtype=torch.float32,
        use_cpu_initialization=True,
        apply_query_key_layer_scaling=False,
        attention_softmax_in_fp32=True,
        **{**moe_config(spec, ep), **deepseek, **window_megatron_args(spec)},
    )


class MLACoreAttention(torch.nn.Module):
    """Causal softmax attention for MLA (q/k `k_channels` wide, v `v_channels`) at megatron-core's softmax scale:
    the local spec's DotProductAttention assumes one head width, and Transformer Engine's fused attention is not
    on CPU. [s, b, heads, d] in, [s, b, heads·v_channels] out."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, softmax_scale=None, k_channels=None,
                 v_channels=None, **_: Any) -> None:
        super().__init__()
        self.softmax_scale = softmax_scale

    def forward(self, query, key, value, attention_mask, **_: Any):
        q, k, v = (t.permute(1, 2, 0, 3).float() for t in (query, key, value))  # [b, heads, s, d]
        s = q.shape[2]
        scores = (q @ k.transpose(-1, -2)) * self.softmax_scale
        mask = torch.ones(s, s, dtype=torch.bool).triu(1)
        ctx = scores.masked_fill(mask, float("-inf")).softmax(-1) @ v
        return ctx.permute(2, 0, 1, 3).reshape(s, q.shape[0], -1).to(query.dtype)


def _layer_spec(spec: ModelSpec, config):
    """The local layer spec; for the DeepSeek-V3 architecture megatron-core's per-layer block spec (dense and MoE
    layers by moe_layer_freq) with MLA's core attention swapped for `MLACoreAttention`."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec

    if not (spec.is_mla or spec.mtp_num_layers or spec.moe_layer_freq != 1):
        return get_gpt_layer_local_spec(num_experts=spec.num_experts, normalization=spec.normalization,
                                        qk_layernorm=spec.qk_layernorm)
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=spec.normalization)
    if spec.is_mla:
        for layer in block.layer_specs:
            layer.submodules.self_attention.submodules.core_attention = MLACoreAttention
    return block


def set_yarn_config(config: Any, spec: ModelSpec) -> None:
    """The `config.yarn_*` attributes GPTModel's yarn branch reads, set from the spec's Megatron-LM args as
    Megatron-LM's `_apply_yarn_config_from_args` sets them (nothing when the spec has no YaRN)."""
    if spec.rope_scaling != "yarn" or spec.is_mla:  # MLA builds its own YaRN from MLATransformerConfig
        return
    a = spec.to_megatron_args()
    for attr, arg in (("yarn_rotary_scaling_factor", "rotary_scaling_factor"),
                      ("yarn_original_max_position_embeddings", "yarn_original_max_position_embeddings"),
                      ("yarn_beta_fast", "yarn_beta_fast"), ("yarn_beta_slow", "yarn_beta_slow"),
                      ("yarn_mscale", "mscale"), ("yarn_mscale_all_dim", "mscale_all_dim"),
                      ("yarn_correction_range_round_to_int", "yarn_correction_range_round_to_int")):
        setattr(config, attr, getattr(a, arg))


def build_gpt_model(spec: ModelSpec, tp: int, pp: int = 1, vpp: int | None = None,
                    vp_stage: int | None = None, ep: int = 1):
    """A megatron-core GPTModel (local layer spec) for this rank's stage (virtual chunk `vp_stage` when VPP);
    parallel_state must be initialised."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    config = transformer_config(spec, tp, pp, vpp, ep)
    layer_spec = _layer_spec(spec, config)
    mtp = get_gpt_mtp_block_spec(config, layer_spec, use_transformer_engine=False) if spec.mtp_num_layers else None
    if spec.rope_scaling == "llama3" and (spec.rope_low_freq_factor, spec.rope_high_freq_factor,
                                          spec.rope_original_max_position_embeddings) != (1.0, 4.0, 8192):
        raise ValueError("megatron-core's llama3 rope scaling fixes low 1, high 4, original 8192")
    set_yarn_config(config, spec)
    return GPTModel(
        config,
        layer_spec,
        vocab_size=spec.padded_vocab_size(tp),
        max_sequence_length=spec.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=vpp is None, vp_stage=vp_stage),
        post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=vpp is None, vp_stage=vp_stage),
        share_embeddings_and_output_weights=spec.tie_embeddings,
        position_embedding_type="yarn" if spec.rope_scaling == "yarn" and not spec.is_mla else spec.position_embedding_type,
        rotary_percent=spec.rotary_percent,
        rotary_base=int(spec.rotary_base),
        rope_scaling=spec.rope_scaling == "llama3",
        rope_scaling_factor=spec.rope_scaling_factor if spec.rope_scaling == "llama3" else 8.0,
        seq_len_interpolation_factor=spec.rope_scaling_factor if spec.rope_scaling == "linear" else None,
        vp_stage=vp_stage,
        mtp_block_spec=mtp,
    ).eval()


@dataclass
class McoreContext:
    """What a user function receives on each rank."""

    spec: ModelSpec
    model: Any  # megatron.core.models.gpt.GPTModel (this stage; with VPP the first virtual chunk)
    tp: int
    pp: int
    rank: int
    tp_rank: int
    pp_rank: int
    vpp: int | None = None
    models: list[Any] | None = None  # every virtual chunk of this rank (chunk c = model chunk c·pp + pp_rank)
    ep: int = 1
    ep_rank: int = 0  # expert-parallel rank (with EP > 1 the data-parallel ranks hold the expert shards)

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    def logits(self, tokens: torch.Tensor) -> torch.Tensor | None:
        """Full forward of `tokens` [b, s]; TP-gathered logits [b, s, V_pad] on the last stage, else None."""
        return _pipeline_forward(self, tokens)


class _CudaOnCpu(TorchFunctionMode):
    """Tensors megatron-core creates on device "cuda" (its mask helpers in transformer/utils.py) are created on
    the CPU instead: the same values, on the only device here."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


def _pipeline_forward(ctx: McoreContext, tokens: torch.Tensor) -> torch.Tensor | None:
    """Run the model chunks in pipeline order (chunk 0 of ranks 0..pp-1, then chunk 1, ...) over gloo p2p."""
    from megatron.core import parallel_state

    tokens = tokens.long()
    b, s = tokens.shape
    pos = torch.arange(s).unsqueeze(0).expand(b, -1)
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)[None, None]  # True = masked
    out = None
    with torch.no_grad(), _CudaOnCpu():
        for model in ctx.models or [ctx.model]:
            if not model.pre_process:
                h = torch.empty(s, b, ctx.spec.hidden_size)
                torch.distributed.recv(h, src=parallel_state.get_pipeline_model_parallel_prev_rank())
                model.set_input_tensor(h)
            out = model(tokens, pos, mask, runtime_gather_output=True)
            if not model.post_process:
                nxt = parallel_state.get_pipeline_model_parallel_next_rank()
                torch.distributed.send(out.contiguous(), dst=nxt)
                out = None
    return None if out is None else out.float()


def _worker(rank: int, world: int, port: int, spec: ModelSpec, tp: int, pp: int, vpp: int | None, seed: int,
            fn: Callable[..., Any], args: tuple, out_dir: str, ep: int = 1) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), CUDA_DEVICE_MAX_CONNECTIONS="1")
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    torch.cuda.current_device = lambda: torch.device("cpu")  # DESIGN.md test-only patch
    torch.cuda.synchronize = lambda *a, **k: None  # dist_checkpointing.save calls it; nothing to wait for
    torch.Tensor.cuda = lambda self, *a, **k: self  # tied embeddings at PP > 1: `weight.data.cuda()`, all-reduce
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import random as mrandom

        parallel_state.initialize_model_parallel(tp, pp, virtual_pipeline_model_parallel_size=vpp,
                                                 expert_model_parallel_size=ep)
        if spec.is_moe:  # megatron-core's MoE names TE's GEMM even without TE (DESIGN.md)
            import megatron.core.transformer.moe.moe_utils as moe_utils
            moe_utils.te_general_gemm = None
        if spec.is_mla:  # MLA takes its linears from TE whenever TE imports; the local spec's are these
            import megatron.core.transformer.multi_latent_attention as mla
            mla.HAVE_TE = False
        mrandom.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
        mrandom.model_parallel_cuda_manual_seed(seed)
        torch.manual_seed(seed)
        models = [build_gpt_model(spec, tp, pp, vpp, c if vpp else None, ep) for c in range(vpp or 1)]
        ctx = McoreContext(
            spec=spec, model=models[0], tp=tp, pp=pp, rank=rank,
            tp_rank=parallel_state.get_tensor_model_parallel_rank(),
            pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
            vpp=vpp, models=models, ep=ep,
            ep_rank=parallel_state.get_expert_model_parallel_rank() if spec.is_moe else 0,
        )
        result = fn(ctx, *args)
        Path(out_dir, f"rank{rank}.pkl").write_bytes(pickle.dumps(result))
        torch.distributed.barrier()
        parallel_state.destroy_model_parallel()
    finally:
        torch.distributed.destroy_process_group()


def _preload() -> None:
    import megatron.core.models.gpt  # noqa: F401
    import megatron.core.models.gpt.gpt_layer_specs  # noqa: F401
    import megatron.core.parallel_state  # noqa: F401
    import megatron.core.tensor_parallel  # noqa: F401


def run_mcore(spec: ModelSpec, tp: int, fn: Callable[..., Any], args: tuple = (), pp: int = 1,
              seed: int = 1234, vpp: int | None = None, ep: int = 1) -> list[Any]:
    """Run `fn(ctx, *args)` on every rank of a TP×PP(×EP) megatron-core GPTModel; return results by global rank.

    With `ep` > 1 the world is tp·pp·ep: the EP ranks are megatron-core's data-parallel ranks (expert TP = TP),
    each of which runs the same tokens. `fn` must be picklable (a module-level function); its result must be
    picklable (tensors are fine)."""
    world = tp * pp * ep
    if world > MAX_PROCS:
        raise ValueError(f"tp*pp*ep={world} > {MAX_PROCS}: keep the reference runs small")
    spec.check_parallel(tp, pp, vpp, ep)
    with tempfile.TemporaryDirectory(prefix="mcore_ref_") as tmp:
        _preload()  # children fork with megatron already imported: ~10 s less per run than spawn
        mp.start_processes(_worker, args=(world, _free_port(), spec, tp, pp, vpp, seed, fn, tuple(args), tmp, ep),
                           nprocs=world, start_method="fork")
        # our own pickles, written a moment ago by the children above
        return [pickle.loads(Path(tmp, f"rank{r}.pkl").read_bytes()) for r in range(world)]


def perturb(ctx: McoreContext) -> None:
    """Every parameter off its init (norms off 1), replicated ones equal on every rank, split ones per TP rank,
    experts per EP rank: a wrong layout or a wrong expert index cannot hide."""
    for name, p in ctx.model.named_parameters():
        split = bool(getattr(p, "tensor_model_parallel", False))
        expert = ".experts." in name
        key = f"{name}:{ctx.ep_rank if expert else ''}:{ctx.tp_rank if split else ''}"
        g = torch.Generator().manual_seed(zlib.crc32(key.encode()))
        noise = torch.randn(p.shape, generator=g)
        with torch.no_grad():
            p.copy_(1.0 + 0.2 * noise if name.endswith("layernorm.weight") else 0.1 * noise)


def perturb_dense(ctx: McoreContext) -> None:
    """Every parameter off its init (norms off 1, q/k norms included), seeded by its name: equal on every TP
    rank where it is replicated, its own per TP rank where it is split, so that a wrong layout or a dropped
    norm cannot hide. Dense models (no expert index in the seed, unlike `perturb`)."""
    for name, p in ctx.model.named_parameters():
        split = bool(getattr(p, "tensor_model_parallel", False))
        g = torch.Generator().manual_seed(zlib.crc32(name.encode()) + (1000 * ctx.tp_rank if split else 0))
        noise = torch.randn(p.shape, generator=g)
        with torch.no_grad():
            p.copy_(1.0 + 0.2 * noise if name.endswith("layernorm.weight") else 0.1 * noise)


def save_checkpoints(ctx: McoreContext, root: str, iteration: int, torch_dist: bool = False,
                     params_dtype: torch.dtype | None = None) -> None:
    """Per rank: megatron-core's own state dict as the legacy rank file Megatron-LM names under `root`, with args
    that carry no `model_family` (recognised from the args, as a Megatron-LM checkpoint is); `torch_dist`: also
    megatron-core's `dist_checkpointing.save` of `sharded_state_dict()` under `root + "_dist"`. Collective."""
    from mconvert.layouts.megatron import rank_file, save_rank_file, write_latest

    args = ctx.spec.to_megatron_args(ctx.tp, ctx.pp, ep=ctx.ep)
    if params_dtype is not None:
        args.params_dtype = params_dtype
    args.iteration = iteration
    del args.model_family
    state = {"args": args, "checkpoint_version": 3.0, "iteration": iteration,
             "model": ctx.model.state_dict_for_save_checkpoint()}
    save_rank_file(rank_file(root, iteration, ctx.tp_rank, 0, 1, ctx.ep_rank, ctx.ep), state)
    if torch_dist:
        from megatron.core import dist_checkpointing

        dist = Path(root + "_dist") / f"iter_{iteration:07d}"
        dist.mkdir(parents=True, exist_ok=True)
        torch.distributed.barrier()
        dargs = ctx.spec.to_megatron_args(ctx.tp, ctx.pp, ep=ctx.ep, ckpt_format="torch_dist")
        del dargs.model_family
        dist_checkpointing.save({"model": ctx.model.sharded_state_dict(), "args": dargs, "checkpoint_version": 3.0,
                                 "iteration": iteration}, str(dist))
    if ctx.rank == 0:
        write_latest(root, iteration)
        if torch_dist:
            write_latest(root + "_dist", iteration)


def greedy(ctx: McoreContext, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """megatron-core's greedy tokens (argmax over the true vocab, full forward per step) for each prompt; rank 0's
    choice is broadcast so that every rank extends the same sequence (PP = 1)."""
    out = []
    for prompt in prompts:
        cur = torch.tensor([prompt])
        toks: list[int] = []
        for _ in range(max_tokens):
            nxt = ctx.logits(cur)[0, -1, : ctx.spec.vocab_size].argmax().reshape(1)
            torch.distributed.broadcast(nxt, src=0)
            toks.append(int(nxt))
            cur = torch.cat([cur, nxt[None]], dim=1)
        out.append(toks)
    return out


def _load_and_forward(ctx: McoreContext, state_dicts: list[Any] | None,
                      tokens: torch.Tensor) -> torch.Tensor | None:
    if state_dicts is not None:
        mine = state_dicts[ctx.rank]
        chunks = mine if isinstance(mine, (list, tuple)) else [mine]
        for model, sd in zip(ctx.models, chunks, strict=True):
            model.load_state_dict(sd, strict=True)
    return ctx.logits(tokens)


def mcore_forward_logits(spec: ModelSpec, tp: int, tokens: torch.Tensor, state_dicts: list[Any] | None = None,
                         pp: int = 1, seed: int = 1234, vpp: int | None = None, ep: int = 1) -> torch.Tensor:
    """Load `state_dicts[global_rank]` (strict; a list of chunk dicts with VPP; None = the seeded random init)
    and return the last stage's TP-gathered logits `[b, s, V_pad]`."""
    res = run_mcore(spec, tp, _load_and_forward, (state_dicts, tokens), pp=pp, seed=seed, vpp=vpp, ep=ep)
    return next(r for r in reversed(res) if r is not None)
