"""Every Megatron arg and HF config field, classified: function-neutral, mapped, or refused.

mconvert's promise is that a converted model computes the same function or the conversion is refused. A
checkpoint's args / config.json carry hundreds of names; each one that could change the function is either
mapped onto a ModelSpec field (with its expected type, so a wrong type is refused by name) or refused unless it
holds its default. A name in no table passes only when it is None or False (what argparse stores for an
option never given), or, in an HF config.json, when no reference implementation of the model reads it
(`families.hf_reads`: what transformers' and vLLM's code for that model_type reads, derived from their sources);
anything else is refused by name, so a new upstream option cannot slip through unread. Every refusal of one
`check` is raised at once, so a user fixes a file in one pass.
A table may hold `section.*`: it stands for every `section.<key>` the table does not list itself.

The deployment checkers read their formats' configs through the same `check` (TensorRT-LLM `config.json` in
`convert/deploy/trtllm.py`, FasterTransformer `config.ini` in `convert/deploy/fastertransformer.py`), each with its own table
and verdict.

The HF table here holds the common `PretrainedConfig` attributes; each family module holds its own fields
(`Family.hf_fields`) and `families.hf_table(model_type)` joins the two.
"""

from __future__ import annotations

from dataclasses import dataclass
import math
from typing import Any, Callable, Collection, Mapping

from mconvert.errors import MConvertError, escape_controls

NEUTRAL, MAPPED, REFUSED = "neutral", "mapped", "refused"

INT = (int,)
NUM = (int, float)
BOOL = (bool,)
STR = (str,)


@dataclass(frozen=True)
class Field:
    """How one arg / config field is treated.

    neutral: never changes the function (training, data, logging, checkpointing, parallel sizes read from the
    layout, kernel choices). mapped: read into ModelSpec field `to`; a value that is not None must be one of
    `types` (and one of `choices` when given). refused: passes only at its `default` (or None, or when `ok`
    accepts it given the whole dict); otherwise the conversion is refused with `why`."""

    kind: str
    why: str = ""
    default: Any = None
    types: tuple[type, ...] = ()
    to: str = ""
    choices: tuple[Any, ...] = ()
    ok: Callable[[Any, Mapping[str, Any]], bool] | None = None


def neutral(why: str, *names: str) -> dict[str, Field]:
    """Entries for names that never change the function, with the one reason they share."""
    return {n: Field(NEUTRAL, why) for n in names}


def mapped(to: str, types: tuple[type, ...], default: Any = None, choices: tuple[Any, ...] = ()) -> Field:
    """An entry read into ModelSpec field `to` (`types`: what a value other than None must be)."""
    return Field(MAPPED, f"read into ModelSpec.{to}", default, types, to, choices)


def refused(why: str, default: Any = None, ok: Callable[[Any, Mapping[str, Any]], bool] | None = None) -> Field:
    """An entry the converter cannot honour: refused with `why` unless it holds `default` (or None)."""
    return Field(REFUSED, why, default, ok=ok)


def _short(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


def _type_ok(v: Any, types: tuple[type, ...]) -> bool:
    if isinstance(v, bool) and bool not in types:  # JSON true is not a size
        return False
    return isinstance(v, types)


def _at_default(v: Any, f: Field) -> bool:
    if v is None or v is f.default or (v is False and f.default is None):  # argparse's two spellings of "unset"
        return True
    try:
        if type(v) is not bool and type(f.default) is not bool and v == f.default:
            return True
        if type(v) is bool and type(f.default) is bool and v == f.default:
            return True
    except Exception:  # a stand-in object from the unpickler compares as it likes; treat it as not default
        return False
    return False


def _entry(table: Mapping[str, Field], k: str) -> Field | None:
    f = table.get(k)
    if f is None and "." in k:
        f = table.get(k.partition(".")[0] + ".*")
    return f


def check(values: Mapping[str, Any], table: Mapping[str, Field], source: str, what: str,
          refused_as: str = "conversion refused", unknown_hint: str = "remove it if it is training-only",
          norm: Callable[[Any], Any] | None = None, show: Callable[[Any], str] | None = None,
          reads: Collection[str] | None = None) -> None:
    """Refuse every value the table does not allow (see the module docstring), all in one MConvertError: one
    line naming the key when one is refused, else a summary line counting and naming them, then one line each.

    `refused_as` ends every refusal (what is refused, and the fix where there is one); `unknown_hint` follows it,
    in parentheses, for a name in no table ("": nothing follows). `norm`: how a format's value compares (an INI
    "1" as True, an empty JSON object as unset); the message shows the value as written, by `show` (default:
    Python's repr, shortened). `reads`: every name a reference implementation of the model reads; a name in no
    table and not in `reads` cannot change the function and passes whatever its value (None: every name counts
    as read)."""
    display = show or _short
    problems: list[tuple[str, str]] = []  # (key, "key=value <why it is refused>")
    for k, raw in values.items():
        v = raw if norm is None else norm(raw)
        f = _entry(table, k)
        said = f"{escape_controls(k)}={display(raw)}"
        if f is None:
            if v is None or v is False or (reads is not None and k not in reads):
                continue
            problems.append((k, f"{said} is not known to mconvert and may change the model's function"))
        elif f.kind == NEUTRAL or v is None:
            continue
        elif f.kind == MAPPED:
            if f.types and not _type_ok(v, f.types):
                problems.append((k, f"{said} must be {' or '.join(t.__name__ for t in f.types)}; fix it"))
            elif f.choices and v not in f.choices:
                problems.append((k, f"{said} is not supported (supported: {', '.join(map(str, f.choices))})"))
        elif not (_at_default(v, f) or (f.ok is not None and f.ok(v, values))):
            problems.append((k, f"{said} is not supported: {f.why}"))
    if not problems:
        return
    hint = f" ({unknown_hint})" if unknown_hint and any(p.endswith("model's function") for _, p in problems) else ""
    if len(problems) == 1:
        line = problems[0][1]
        raise MConvertError(f"{source}: {what} {line}" + ("" if line.endswith("; fix it") else f"; {refused_as}{hint}"))
    names = ", ".join(escape_controls(k) for k, _ in problems)
    raise MConvertError(f"{source}: {len(problems)} {what}s are refused ({names}); {refused_as}{hint}",
                        [f"{what} {p}" for _, p in problems])


def check_megatron_args(args: Mapping[str, Any], source: str) -> None:
    """Refuse Megatron args that change the function and are not mapped (one line naming each arg); with
    `position_embedding_type='yarn'` the YaRN args are mapped (`MEGATRON_YARN_ARGS`), with multi-latent
    attention its rope args (`MEGATRON_MLA_ROPE_ARGS`).

    A name in no table is judged by `unlisted_passes` first: at a known release's default, or of a class of
    options that cannot reach the model's function, it passes; otherwise `check` refuses it by name."""
    table = megatron_table(args)
    check({k: v for k, v in args.items() if not unlisted_passes(k, v, table)}, table, source, "Megatron arg")


def megatron_table(args: Mapping[str, Any]) -> dict[str, Field]:
    """The table that judges these args: `MEGATRON_ARGS`, with the YaRN args mapped under
    `position_embedding_type='yarn'` and MLA's rope args under `multi_latent_attention`."""
    table = {**MEGATRON_ARGS, **MEGATRON_YARN_ARGS} if args.get("position_embedding_type") == "yarn" else MEGATRON_ARGS
    return {**table, **MEGATRON_MLA_ROPE_ARGS} if args.get("multi_latent_attention") else table


# Option families of Megatron-LM that configure the run around the model, never the network: optimizers,
# schedules, RL and inference serving, data, tokenizer files, logging, profiling, checkpoint I/O, fault
# tolerance, communication overlap. A new release's new option of one of these families passes at any value;
# one of any other family (a model, attention, norm, MoE or precision option) passes only unset or at a
# known release's default. A family that holds a function-changing option is not listed here.
INERT_PREFIXES = (
    "adam_", "sgd_", "muon_", "lion_", "optimizer_", "lr_", "rl_", "grpo_", "inference_", "logits_save_",
    "logits_load_", "data_", "dataloader_", "tokenizer_", "log_", "logging_", "tensorboard_", "wandb_",
    "one_logger_", "profile_", "flight_recorder_", "straggler_", "inprocess_", "rerun_", "ckpt_",
    "async_ckpt_", "dist_ckpt_", "non_persistent_", "save_", "load_", "eval_", "exit_", "nccl_", "tp_comm_",
    "ddp_", "cuda_graph_", "megatron_fsdp_",
)


def unlisted_passes(name: str, value: Any, table: Mapping[str, Field] | None = None) -> bool:
    """True for an arg no table lists that cannot change the model: of an `INERT_PREFIXES` family, or holding
    the default of a known Megatron-LM release (mappings/megatron_releases.py). `table`: the table that judges
    the args (default `MEGATRON_ARGS`)."""
    if _entry(MEGATRON_ARGS if table is None else table, name) is not None:
        return False
    if name.startswith(INERT_PREFIXES):
        return True
    from mconvert.mappings.megatron_releases import is_release_default

    return is_release_default(name, value)


def megatron_rule(name: str, value: Any, args: Mapping[str, Any] | None = None) -> str:
    """Which rule judges Megatron arg `name` holding `value` (what `inspect` reports): "read", "checked"
    (refused unless allowed), "neutral", "inert family", "release default", "unset" or "refused"; `args`: the
    whole dict, whose YaRN or MLA makes their rope args read (`megatron_table`)."""
    table = MEGATRON_ARGS if args is None else megatron_table(args)
    f = _entry(table, name)
    if f is not None:
        if f.kind == MAPPED:
            return "read" if value is not None else "unset"
        return "checked" if f.kind == REFUSED else "neutral"
    if name.startswith(INERT_PREFIXES):
        return "inert family"
    if value is None or value is False:
        return "unset"
    return "release default" if unlisted_passes(name, value, table) else "refused"


def key_names(table: Mapping[str, Field]) -> dict[str, str]:
    """ModelSpec field -> the key a source spells it with (the first mapped entry of the table)."""
    out: dict[str, str] = {}
    for k, f in table.items():
        if f.kind == MAPPED:
            out.setdefault(f.to, k)
    return out


# ---- Megatron args -----------------------------------------------------------------------------------
# megatron-core 0.16.1 TransformerConfig / ModelParallelConfig fields and Megatron-LM's argparse names
# (megatron/training/arguments.py, core_v0.9 .. core_v0.16), plus what mconvert's own trainer and
# transformers' checkpoint_reshaping_and_interoperability.py store.


def _rope_requested(_: Any, a: Mapping[str, Any]) -> bool:
    return a.get("position_embedding_type") == "rope"


def _learned_positions_off_ok(v: Any, a: Mapping[str, Any]) -> bool:
    # add_position_embedding=False with rope is how older args say "no learned positions"
    return a.get("position_embedding_type") == "rope"


_MEGATRON_MAPPED: dict[str, Field] = {
    "num_layers": mapped("num_layers", INT),
    "hidden_size": mapped("hidden_size", INT),
    "ffn_hidden_size": mapped("ffn_hidden_size", INT),
    "num_attention_heads": mapped("num_attention_heads", INT),
    "num_query_groups": mapped("num_query_groups", INT),
    "group_query_attention": mapped("num_query_groups", BOOL, False),
    "kv_channels": mapped("kv_channels", INT),
    "max_position_embeddings": mapped("max_position_embeddings", INT),
    "seq_length": mapped("max_position_embeddings", INT),
    "vocab_size": mapped("vocab_size", INT),
    "true_vocab_size": mapped("vocab_size", INT),
    "orig_vocab_size": mapped("vocab_size", INT),
    "padded_vocab_size": mapped("vocab_size", INT),
    "make_vocab_size_divisible_by": mapped("make_vocab_size_divisible_by", INT, 128),
    "normalization": mapped("normalization", STR, "LayerNorm", ("LayerNorm", "RMSNorm")),
    "norm_epsilon": mapped("norm_epsilon", NUM, 1e-5),
    "layernorm_epsilon": mapped("norm_epsilon", NUM, 1e-5),
    "swiglu": mapped("activation", BOOL, False),
    # gated with Megatron's GeLU: GeGLU with openai_gelu (tanh GeLU, Gemma's gelu_pytorch_tanh)
    "gated_linear_unit": Field(REFUSED, "a gated MLP other than SwiGLU or tanh-GeLU GeGLU (set swiglu for SwiGLU, "
                               "openai_gelu for GeGLU)", False,
                               ok=lambda v, a: bool(a.get("swiglu") or a.get("openai_gelu"))),
    "openai_gelu": mapped("activation", BOOL, False),
    # a fused or Transformer Engine GeLU is the tanh approximation (megatron-core fusions/fused_bias_gelu.py,
    # TransformerEngine common/util/math.h), the unfused one torch's exact erf GeLU
    "bias_gelu_fusion": mapped("activation", BOOL, False),
    "bias_activation_fusion": mapped("activation", BOOL, False),
    "use_te_activation_func": mapped("activation", BOOL, False),
    "position_embedding_type": mapped("position_embedding_type", STR, "learned_absolute",
                                      ("learned_absolute", "rope")),
    "rotary_base": mapped("rotary_base", NUM, 10000),
    "rotary_percent": mapped("rotary_percent", NUM, 1.0),
    "rotary_interleaved": mapped("rotary_interleaved", BOOL, False),
    "untie_embeddings_and_output_weights": mapped("tie_embeddings", BOOL, False),
    "add_bias_linear": mapped("add_bias_linear", BOOL, True),
    "add_qkv_bias": mapped("add_qkv_bias", BOOL, False),
    "bf16": mapped("params_dtype", BOOL, False),
    "fp16": mapped("params_dtype", BOOL, False),
    "model_family": mapped("family", STR),
    "bos_token_id": mapped("bos_token_id", INT),
    "eos_token_id": mapped("eos_token_id", INT),
    # megatron-core's Llama-3.1 scaling (bands fixed in its code) and linear position interpolation
    "use_rope_scaling": mapped("rope_scaling", BOOL, False),
    "rope_scaling_factor": mapped("rope_scaling_factor", NUM, 8.0),
    "rotary_seq_len_interpolation_factor": mapped("rope_scaling_factor", NUM),
    "qk_layernorm": mapped("qk_layernorm", BOOL, False),
    # mixture of experts: Megatron-LM's argparse name and megatron-core's config name for the count
    "num_experts": mapped("num_experts", INT),
    "num_moe_experts": mapped("num_experts", INT),
    "moe_ffn_hidden_size": mapped("moe_ffn_hidden_size", INT),
    "moe_router_topk": mapped("moe_router_topk", INT, 2),
    # sliding-window attention: (left, right) and which layers are windowed (spec.window_from_megatron_args)
    "window_size": mapped("window_size", (tuple, list)),
    "window_attn_skip_freq": mapped("window_pattern", (int, list, tuple)),
}


def _yarn_unused(_: Any, a: Mapping[str, Any]) -> bool:
    """YaRN's factors are read by YaRN rope, multi-latent attention and DSA (megatron-core's
    YarnRotaryEmbedding users), and by nothing else."""
    return (a.get("position_embedding_type") != "yarn" and not a.get("multi_latent_attention")
            and not a.get("experimental_attention_variant"))


def _decoder_only(v: Any, args: Mapping[str, Any]) -> bool:
    """Megatron-LM's training loop stores `args.model_type = ModelType.encoder_or_decoder` (value 1) for GPT: read
    as a stand-in enum member (`.value`), a plain int or its name; encoder-decoder and retro models differ."""
    value = getattr(v, "value", v)
    return value == 1 or value == "encoder_or_decoder" or getattr(v, "name", None) == "encoder_or_decoder"


_MEGATRON_REFUSED: dict[str, Field] = {
    # the model class Megatron-LM's training loop built (not an argparse option)
    "model_type": refused("only a decoder-only model (ModelType.encoder_or_decoder) is mapped", None,
                          _decoder_only),
    # rope variants (YaRN's factors are dead values unless `_yarn_unused` says otherwise)
    "rotary_scaling_factor": refused("YaRN rotary scaling is not mapped", 1.0, _yarn_unused),
    # read only by multi-latent attention (mapped there) and the experimental variants (refused)
    "rope_type": refused("only plain rope is mapped", None, lambda v, a: v == "rope" or not (
        a.get("multi_latent_attention") or a.get("experimental_attention_variant"))),
    "mscale": refused("YaRN mscale is not mapped", 1.0, _yarn_unused),
    "mscale_all_dim": refused("YaRN mscale is not mapped", 1.0, _yarn_unused),
    "beta_fast": refused("YaRN rotary scaling is not mapped", None, _yarn_unused),
    "beta_slow": refused("YaRN rotary scaling is not mapped", None, _yarn_unused),
    "yarn_beta_fast": refused("YaRN rotary scaling is not mapped", None, _yarn_unused),
    "yarn_beta_slow": refused("YaRN rotary scaling is not mapped", None, _yarn_unused),
    "original_max_position_embeddings": refused("YaRN rotary scaling is not mapped", None, _yarn_unused),
    "yarn_original_max_position_embeddings": refused("YaRN rotary scaling is not mapped", None, _yarn_unused),
    # weight shards beyond tensor parallelism (GTP weight rematerialisation): validate_args derives them
    # from the layout; only the plain layout (one shard per TP rank) is read
    "tensor_parallel_num_weight_shards": refused(
        "weights sharded beyond tensor parallelism (GTP) are not read", None,
        lambda v, a: v == (a.get("tensor_model_parallel_size") or 1)),
    "expert_tensor_parallel_num_weight_shards": refused(
        "expert weights sharded beyond expert tensor parallelism (GTP) are not read", None,
        lambda v, a: v == (a.get("expert_tensor_parallel_size") or a.get("tensor_model_parallel_size") or 1)),
    "gtp_weight_remat_size": refused("weights sharded beyond tensor parallelism (GTP) are not read", 1),
    "expert_gtp_weight_remat_size": refused("expert weights sharded beyond tensor parallelism (GTP) are not read",
                                            1),
    "no_rope_freq": refused("layers without rope are not mapped", None),
    "mrope_section": refused("multimodal rope is not mapped", None),
    "use_rotary_position_embeddings": refused("older rope flag without position_embedding_type='rope'", False,
                                              _rope_requested),
    "add_position_embedding": refused("a model without learned positions needs position_embedding_type='rope'",
                                      True, _learned_positions_off_ok),
    # attention variants
    "qk_l2_norm": refused("QK L2 norm is not mapped", False),
    "multi_latent_attention": mapped("kv_lora_rank", BOOL, False),
    "softmax_scale": mapped("softmax_scale", NUM),
    "softmax_type": refused("only the vanilla attention softmax is mapped", "vanilla"),
    "attention_output_gate": refused("a gated attention output is not mapped", False),
    "experimental_attention_variant": refused("experimental attention variants are not mapped", None),
    "linear_attention_freq": refused("linear attention layers are not mapped", None),
    # norm / residual / activation variants
    "apply_residual_connection_post_layernorm": refused("post-layernorm residuals are not mapped", False),
    "layernorm_zero_centered_gamma": mapped("norm_zero_centered", BOOL, False),
    # Megatron-Bridge's Gemma provider fields, and mconvert's own for what the Bridge states by its provider class
    "attn_logit_softcapping": mapped("attn_logit_softcapping", NUM),
    "final_logit_softcapping": mapped("final_logit_softcapping", NUM),
    "rotary_base_local": mapped("rotary_base_local", NUM),
    "sandwich_norms": mapped("sandwich_norms", BOOL, False),
    "scale_embeddings": mapped("scale_embeddings", BOOL, False),
    "apply_layernorm_1p": refused("zero-centred norm weights (1 + w) are not mapped", False),
    "squared_relu": refused("the squared-ReLU MLP is not mapped", False),
    "quick_geglu": refused("the quick-GeGLU MLP is not mapped", False),
    "glu_linear_offset": refused("a GLU linear offset is not mapped", 0.0),
    "activation_func_clamp_value": refused("a clamped activation is not mapped", None),
    "activation_func": refused("a stored activation callable is not read (Megatron-LM selects it by swiglu / "
                               "openai_gelu)", None),
    # other architectures and layer layouts
    # MoE variants that change the routed function (the mapped router: top-k of the logits, softmax over the k)
    "moe_router_score_function": mapped("moe_router_score_function", STR, "softmax", ("softmax", "sigmoid")),
    # megatron-core's sigmoid router never reads it (moe_utils.topk_routing_with_score_function)
    "moe_router_pre_softmax": refused("a softmax over all experts before top-k (no renormalisation) is not mapped",
                                      False, lambda v, a: a.get("moe_router_score_function") == "sigmoid"),
    "moe_router_enable_expert_bias": mapped("moe_router_enable_expert_bias", BOOL, False),
    "moe_router_num_groups": mapped("moe_router_num_groups", INT),
    "moe_router_group_topk": mapped("moe_router_group_topk", INT),
    "moe_router_topk_limited_devices": refused("device-limited routing is not mapped", None),
    "moe_router_topk_scaling_factor": mapped("moe_router_topk_scaling_factor", NUM),
    "moe_router_load_balancing_type": refused("sinkhorn routing changes the inference router (sigmoid / softmax "
                                              "before top-k); only the softmax top-k router is mapped", "aux_loss",
                                              lambda v, a: v in ("aux_loss", "seq_aux_loss", "global_aux_loss",
                                                                 "none")
                                              or (isinstance(v, list) and "sinkhorn" not in v)),
    "moe_router_force_load_balancing": refused("forced (random) routing is not mapped", False),
    "moe_shared_expert_intermediate_size": mapped("moe_shared_expert_intermediate_size", INT),
    "moe_shared_expert_gate": refused("shared experts are not mapped", False),
    "moe_layer_freq": mapped("moe_layer_freq", (int, list, tuple), 1),
    "moe_expert_capacity_factor": refused("expert capacity (token dropping) changes the function; not mapped", None),
    "moe_pad_expert_input_to_capacity": refused("expert capacity padding is not mapped", False),
    "moe_token_dropping": refused("token dropping changes the function; not mapped", False),
    "moe_apply_probs_on_input": refused("routing probabilities applied to the expert input are not mapped", False),
    "moe_latent_size": refused("latent MoE projections are not mapped", None),
    "mtp_num_layers": mapped("mtp_num_layers", INT),
    "is_hybrid_model": refused("hybrid Mamba models are not mapped", False),
    "hybrid_attention_ratio": refused("hybrid Mamba models are not mapped", 0.0),
    "hybrid_mlp_ratio": refused("hybrid Mamba models are not mapped", 0.0),
    "hybrid_override_pattern": refused("hybrid Mamba models are not mapped", None),
    "heterogeneous_block_specs": refused("heterogeneous layers are not mapped", False),
    "hetereogenous_dist_checkpoint": refused("heterogeneous layers are not mapped", False),
    "heterogeneous_layers_config_path": refused("heterogeneous layers are not mapped", None),
    "heterogeneous_layers_config_encoded_json": refused("heterogeneous layers are not mapped", None),
    "spec": refused("a custom layer spec is not mapped", None),
    "retro_add_retriever": refused("RETRO is not mapped", False),
    "fp8_param": refused("weights stored in fp8 are not read", False),
    "fp4_param": refused("weights stored in fp4 are not read", False),
    "use_kitchen": refused("kitchen quantization is not mapped", False),
    "quant_recipe": refused("quantization recipes are not mapped", None),
    "standalone_embedding_stage": refused("an embedding-only pipeline stage is not read", False),
    "pipeline_model_parallel_split_rank": refused("encoder-decoder pipeline splits are not read", None),
    "encoder_num_layers": refused("encoder-decoder models are not mapped", None,
                                  lambda v, a: v == a.get("num_layers")),
    "decoder_num_layers": refused("encoder-decoder models are not mapped", None),
}

_MEGATRON_NEUTRAL: dict[str, Field] = {
    **neutral(
        "parallel layout: read from the rank directories and their own args",
        "tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
        "num_layers_per_virtual_pipeline_stage", "num_virtual_stages_per_pipeline_rank",
        "expert_model_parallel_size", "expert_tensor_parallel_size", "context_parallel_size",
        # the pipeline split: which stage holds which layers (layouts/megatron.py `PipelineSplit` reads them)
        "num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage",
        "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers", "pipeline_model_parallel_layout",
        "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split",
        "hierarchical_context_parallel_sizes", "data_parallel_size", "world_size", "rank", "local_rank",
        "model_parallel_size", "transformer_pipeline_model_parallel_size", "encoder_tensor_model_parallel_size",
        "encoder_pipeline_model_parallel_size", "sequence_parallel", "moe_extended_tp", "max_seqlen_per_dp_cp_rank",
        "hybrid_context_parallel", "pipeline_model_parallel_comm_backend", "use_tp_pp_dp_mapping",
    ),
    **neutral(
        "compute precision or kernel choice: the same function (the stored dtype is read from bf16 / fp16)",
        "params_dtype", "pipeline_dtype", "autocast_dtype", "enable_autocast", "attention_softmax_in_fp32",
        "apply_query_key_layer_scaling", "fp32_residual_connection", "disable_bf16_reduced_precision_matmul",
        "fp8", "fp8_recipe", "fp8_margin", "fp8_interval", "fp8_amax_history_len", "fp8_amax_compute_algo",
        "fp8_wgrad", "fp8_dot_product_attention", "fp8_multi_head_attention", "fp8_quantizer_factory",
        "fp8_param_gather", "tp_only_amax_red", "first_last_layers_bf16", "num_layers_at_start_in_bf16",
        "num_layers_at_end_in_bf16", "fp4", "fp4_recipe", "fp4_quantizer_factory", "fp4_param_gather",
        "use_kitchen_attention", "kitchen_attention_backend", "kitchen_config_file", "kitchen_recipe_number",
        "te_precision_config_file", "attention_backend", "transformer_impl", "use_flash_attn",
        "bias_swiglu_fusion", "masked_softmax_fusion",
        "persist_layer_norm", "no_persist_layer_norm", "memory_efficient_layer_norm", "bias_dropout_fusion",
        "apply_rope_fusion", "use_fused_weighted_squared_relu", "fused_single_qkv_rope", "gradient_accumulation_fusion",
        "cross_entropy_loss_fusion", "cross_entropy_fusion_impl", "activation_func_fp8_input_store",
        "batch_invariant_mode", "deterministic_mode", "disable_jit_fuser",
        "use_legacy_models", "deprecated_use_mcore_models", "use_mcore_models", "onnx_safe", "mlp_chunks_for_prefill",
        "chunk_size_feed_forward", "flash_decode", "use_inference_optimized_layers", "inference_fuse_tp_communication",
        "symmetric_ar_type", "clone_scatter_output_in_embedding", "disable_parameter_transpose_cache",
        "keep_fp8_transpose_cache", "keep_fp8_transpose_cache_when_using_custom_fsdp", "fp16_lm_cross_entropy",
        "scaled_upper_triang_masked_softmax_fusion", "scaled_masked_softmax_fusion", "test_mode",
    ),
    **neutral(
        "training only (dropout, initialisation, loss, regularisation)",
        "hidden_dropout", "attention_dropout", "init_method", "output_layer_init_method", "init_method_std",
        "embedding_init_method", "embedding_init_method_std", "init_model_with_meta_device", "init_method_xavier_uniform",
        "perform_initialization", "use_cpu_initialization", "calculate_per_token_loss", "qk_clip", "qk_clip_alpha",
        "qk_clip_threshold", "log_max_attention_logit", "mtp_loss_scaling_factor", "apply_wd_to_qk_layernorm",
        "head_lr_mult", "data_parallel_random_init",
    ),
    "q_lora_rank": mapped("q_lora_rank", INT),
    "kv_lora_rank": mapped("kv_lora_rank", INT),
    "qk_head_dim": mapped("qk_nope_head_dim", INT),
    "qk_pos_emb_head_dim": mapped("qk_rope_head_dim", INT),
    "v_head_dim": mapped("v_head_dim", INT),
    **neutral("an inference cache layout", "cache_mla_latents"),
    **neutral(
        "only with experimental_attention_variant / linear_attention_freq, which are refused",
        "dsa_indexer_n_heads", "dsa_indexer_head_dim", "dsa_indexer_topk", "dsa_indexer_loss_coeff",
        "dsa_indexer_use_sparse_loss", "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
        "linear_num_key_heads", "linear_num_value_heads",
    ),
    **neutral(
        "only in Mamba / hybrid models, which are refused",
        "mamba_state_dim", "mamba_head_dim", "mamba_num_groups", "mamba_num_heads", "use_mamba_mem_eff_path",
        "disable_mamba_mem_eff_path", "mamba_inference_conv_states_dtype", "mamba_inference_ssm_states_dtype",
        "mamba_training_ssm_states_dtype", "mtp_hybrid_override_pattern", "mtp_hsm", "mtp_standalone",
    ),
    **neutral(
        "not a GPT model option (BERT, T5, vision, retrieval); those checkpoints' weights are refused by the key table",
        "bert_binary_head", "bert_embedder_type", "bert_load", "biencoder_projection_dim",
        "biencoder_shared_query_context_model", "output_bert_embeddings", "relative_attention_max_distance",
        "relative_attention_num_buckets", "encoder_seq_length", "decoder_seq_length", "vocab_extra_ids",
        "img_h", "img_w", "patch_dim", "num_channels", "num_classes", "vision_backbone_type", "vision_pretraining",
        "vision_pretraining_type", "swin_backbone_type", "dino_bottleneck_size", "dino_freeze_last_layer",
        "dino_head_hidden_size", "dino_local_crops_number", "dino_local_img_size", "dino_norm_last_layer",
        "dino_teacher_temp", "dino_warmup_teacher_temp", "dino_warmup_teacher_temp_epochs", "classes_fraction",
        "data_per_class_fraction", "mask_factor", "mask_prob", "mask_type", "ict_head_size", "ict_load",
        "retriever_report_topk_accuracies", "retriever_score_scaling", "retriever_seq_length", "retro_attention_gate",
        "retro_cyclic_train_iters", "retro_encoder_attention_dropout", "retro_encoder_hidden_dropout",
        "retro_encoder_layers", "retro_num_neighbors", "retro_num_retrieved_chunks", "retro_project_dir",
        "retro_verify_neighbor_count", "query_in_block_prob", "short_seq_prob", "use_one_sent_docs",
        "block_data_path", "evidence_data_path", "embedding_path", "indexer_batch_size", "indexer_log_interval",
        "titles_data_path", "retro_bert_tokenizer_type", "retro_bert_vocab_file", "retro_block_size",
        "retro_chunk_length", "retro_neighbor_dirs", "retro_split_preprocessing",
    ),
}


def _training_only(names: str) -> dict[str, Field]:
    return neutral("training run only (optimizer, schedule, data, logging, checkpointing, runtime)", *names.split())


# Everything else Megatron-LM / megatron-core store: optimizer, schedule, data, tokenizer files, logging,
# checkpointing, fault tolerance, communication overlap, recomputation, inference serving and RL settings.
_MEGATRON_TRAINING = _training_only(
    """
    accumulate_allreduce_grads_in_fp32 adam_beta1 adam_beta2 adam_eps adlr_autoresume adlr_autoresume_interval
    align_grad_reduce align_param_gather allow_ambiguous_pad_tokens app_tag_run_name app_tag_run_version
    async_save async_strategy async_tensor_model_parallel_allreduce auto_detect_ckpt_format barrier_with_L1_time
    batch_p2p_comm batch_p2p_sync batch_size calc_ft_timeouts check_for_large_grads check_for_nan_in_loss
    check_for_nan_in_loss_and_grad check_for_spiky_loss check_weight_hash_across_dp_replicas_interval
    checkpoint_activations ckpt_assume_constant_structure ckpt_convert_format ckpt_convert_save
    ckpt_convert_update_legacy_dist_opt_format ckpt_format ckpt_fully_parallel_load ckpt_fully_parallel_save
    ckpt_fully_parallel_save_deprecated ckpt_step clip_grad config_logger_dir consumed_train_bins
    consumed_train_samples consumed_valid_samples cp_comm_type cpu_offloading cpu_offloading_activations
    cpu_offloading_double_buffering cpu_offloading_num_layers cpu_offloading_weights _cpu_offloading_context
    create_all_gather_group create_attention_mask_in_dataloader cuda_graph_impl cuda_graph_modules
    cuda_graph_retain_backward_graph cuda_graph_scope cuda_graph_use_single_mempool cuda_graph_warmup_steps
    data_args_path data_cache_path data_parallel_sharding_strategy data_path data_sharding
    dataloader_defer_npy_index_mmap dataloader_fast_cache_load dataloader_type ddp_average_in_collective
    ddp_bucket_size ddp_num_buckets ddp_pad_buckets_for_high_nccl_busbw ddp_reduce_scatter_with_fp32_accumulation
    deallocate_pipeline_outputs decode_only_cuda_graphs decoupled_lr decoupled_min_lr decrease_batch_size_if_needed
    defer_embedding_wgrad_compute delay_wgrad_compute disable_chunked_prefill disable_straggler_on_startup
    disable_symmetric_registration dist_ckpt_format_deprecated dist_ckpt_optim_fully_reshardable
    dist_ckpt_save_pre_mcore_014 dist_ckpt_strictness distrib_optim_fully_reshardable_mem_efficient
    distribute_saved_activations distributed_backend distributed_timeout_minutes
    distributed_timeout_seconds_after_init dump_param_to_param_group_map empty_unused_memory_level
    enable_cuda_graph enable_experimental enable_ft_package enable_full_sharding_in_hsdp enable_gloo_process_groups
    enable_msc enable_one_logger end_weight_decay eod_mask_loss ep_overlap_early_attn_memory_release
    error_injection_rate error_injection_type eval_global_batch_size eval_interval eval_iters eval_micro_batch_size
    exit_duration_in_mins exit_interval exit_on_missing_checkpoint exit_signal exit_signal_handler
    exit_signal_handler_for_dataloader exp_avg_dtype exp_avg_sq_dtype external_cuda_graph fake_process_group
    filter_warnings fim_data fim_eod_token fim_fragment_rate fim_middle_token fim_no_prefix fim_pad_token
    fim_prefix_token fim_rate fim_split_sample fim_spm_rate fim_suffix_token finalize_model_grads_func finetune
    fine_grained_activation_offloading fsdp_double_buffer fsdp_manual_registration ft_num_warmup_iters full_validation
    global_batch_size grad_reduce_in_bf16 grad_scale_func grad_sync_func gradient_reduce_div_fusion
    grpo_clamp_eps_lower grpo_clamp_eps_upper grpo_default_temperature grpo_default_top_p grpo_entropy_term_weight
    grpo_filter_groups_with_same_reward grpo_group_size grpo_iterations grpo_kl_beta grpo_prompts_per_step
    grpo_samples_per_iteration high_priority_stream_groups hysteresis inference_batch_times_seqlen_threshold
    inference_coordinator_port inference_cuda_graph_scope inference_dynamic_batching
    inference_dynamic_batching_block_size inference_dynamic_batching_buffer_guaranteed_fraction
    inference_dynamic_batching_buffer_overflow_factor inference_dynamic_batching_buffer_size_gb
    inference_dynamic_batching_cuda_graph_max_tokens inference_dynamic_batching_cuda_graph_mixed_prefill_count
    inference_dynamic_batching_max_requests inference_dynamic_batching_max_requests_override
    inference_dynamic_batching_max_tokens inference_dynamic_batching_max_tokens_override
    inference_dynamic_batching_num_cuda_graphs inference_dynamic_batching_paused_buffer_size_gb
    inference_dynamic_batching_track_paused_request_events inference_dynamic_batching_unified_memory_level
    inference_logging_step_interval inference_max_batch_size inference_max_seq_length inference_rng_tracker
    inference_sampling_seed inference_wandb_logging initial_loss_scale inprocess_active_world_size
    inprocess_barrier_timeout inprocess_completion_timeout inprocess_empty_cuda_cache inprocess_granularity
    inprocess_hard_timeout inprocess_heartbeat_interval inprocess_heartbeat_timeout inprocess_last_call_wait
    inprocess_max_iterations inprocess_monitor_process_interval inprocess_monitor_thread_interval
    inprocess_progress_watchdog_interval inprocess_restart inprocess_soft_timeout inprocess_termination_grace_time
    iter_per_epoch iteration iterations_to_skip langrl_env_config langrl_external_server
    langrl_inference_server_conversation_template langrl_inference_server_type lazy_mpu_init legacy_tokenizer load
    load_main_params_from_ckpt load_optim load_rng log_device_memory_used log_energy log_interval
    log_l2_norm_grad_to_tensorboard log_loss_scale_to_tensorboard log_memory_interval log_memory_to_tensorboard
    log_num_zeros_in_grad log_params_norm log_progress log_runtime_to_tensorboard log_straggler log_throughput
    log_throughput_to_tensorboard log_timers_to_tensorboard log_validation_ppl_to_tensorboard
    log_world_size_to_tensorboard logging_level logit_dtype loss_scale loss_scale_window lr lr_decay_iters
    lr_decay_samples lr_decay_steps lr_decay_style lr_warmup_fraction lr_warmup_init lr_warmup_iters
    lr_warmup_samples lr_warmup_steps lr_wsd_decay_iters lr_wsd_decay_samples lr_wsd_decay_style main_grads_dtype
    main_params_dtype manual_gc manual_gc_eval manual_gc_interval max_tokens_to_oom megatron_fsdp_grad_comm_dtype
    megatron_fsdp_main_grads_dtype megatron_fsdp_main_params_dtype memory_keys memory_snapshot_path merge_file
    micro_batch_size microbatch_group_size_per_vp_stage mid_level_dataset_surplus min_loss_scale min_lr
    min_offloaded_tensor_size mmap_bin_files mock_data modules_to_filter most_recent_k
    moe_pad_experts_for_cuda_graph_inference moe_upcycling_granularity moe_use_upcycling multiple_validation_sets
    muon_extra_scale_factor muon_fp32_matmul_prec muon_momentum muon_num_ns_steps muon_scale_mode muon_split_qkv
    muon_tp_mode muon_use_nesterov nccl_all_reduce_for_prefill nccl_communicator_config_path nccl_ub no_load_optim
    no_load_rng no_save_optim no_save_rng no_sync_func no_weight_decay_cond_type non_persistent_ckpt_type
    non_persistent_global_ckpt_dir non_persistent_local_ckpt_algo non_persistent_local_ckpt_dir
    non_persistent_save_interval num_dataset_builder_threads num_distributed_optimizer_instances
    num_microbatches_with_partial_activation_checkpoints num_workers nvtx_ranges object_storage_cache_path
    offload_modules one_logger_async one_logger_project one_logger_run_name optimizer optimizer_cpu_offload
    optimizer_offload_fraction outer_dp_sharding_strategy overlap_cpu_optimizer_d2h_h2d overlap_grad_reduce
    overlap_moe_expert_parallel_comm overlap_p2p_comm overlap_p2p_comm_warmup_flush overlap_param_gather
    overlap_param_gather_with_optimizer_step override_opt_param_scheduler param_sync_func per_dataset_sequences_path
    per_split_data_args_path perform_rl_step phase_transition_iterations pin_cpu_grads pin_cpu_params
    pretrained_checkpoint profile profile_ranks profile_step_end profile_step_start rampup_batch_size
    recompute_activations recompute_granularity recompute_method recompute_modules recompute_num_layers
    record_memory_history record_shapes refit_method renormalize_blend_weights replication replication_factor
    replication_jump rerun_mode reset_attention_mask reset_position_ids result_rejected_tracker_filename
    reuse_grad_buf_for_mxfp8_param_ag rl_calculate_intra_group_similarity rl_default_temperature rl_default_top_k
    rl_default_top_p rl_importance_sampling_truncation_coef rl_inference_expert_model_parallel_size
    rl_inference_expert_tensor_model_parallel_size rl_inference_logprobs_is_correction
    rl_inference_model_unified_memory_level rl_inference_pipeline_model_parallel_size
    rl_inference_tensor_model_parallel_size rl_offload_inference_model_weights_when_idle
    rl_offload_kv_cache_during_training rl_offload_optimizer_during_inference rl_parallel_generation_tasks
    rl_partial_rollouts rl_prompts_per_eval rl_remove_kv_cache_during_training rl_reset_cuda_graphs
    rl_sequence_packing_algo rl_sequence_packing_bin_size rl_sequence_packing_max_sequences_per_bin
    rl_skip_bos_token rl_training_cuda_graphs rl_use_sequence_packing rl_verify_model_weights_swap rl_generation_lag
    run_workload_inspector_server runtime_time_unit s3_cache_path sample_rate save save_config_filepath
    save_dgrads_interval save_interval save_optim save_retain_interval save_rng save_tokenizer_assets
    save_wgrads_interval scatter_gather_tensors_in_pipeline seed set_level_for_all_loggers sft
    sft_tokenizer_prompt_format sgd_momentum sharp_enabled_group skip_train skipped_train_samples split
    start_weight_decay straggler_ctrlr_port straggler_minmax_count strict_fsdp_dtensor_load
    suggested_communication_unit_size te_rng_tracker tensorboard_dir tensorboard_log_interval tensorboard_queue_size
    test_data_path throughput_window_size tiktoken_num_special_tokens tiktoken_pattern tiktoken_special_tokens
    timers timing_log_level timing_log_option tokenizer_hf_include_special_tokens tokenizer_hf_use_fast
    tokenizer_metadata tokenizer_model tokenizer_sentencepiece_legacy tokenizer_special_tokens tokenizer_type
    torch_fsdp2_reshard_after_forward tp_comm_atomic_ag tp_comm_atomic_rs tp_comm_bootstrap_backend
    tp_comm_bulk_dgrad tp_comm_bulk_wgrad tp_comm_overlap tp_comm_overlap_ag tp_comm_overlap_cfg
    tp_comm_overlap_disable_fc1 tp_comm_overlap_disable_qkv tp_comm_overlap_rs tp_comm_overlap_rs_dgrad
    tp_comm_split_ag tp_comm_split_rs train_data_path train_iters train_samples train_sync_interval
    trust_remote_code use_checkpoint_args use_checkpoint_opt_param_scheduler use_custom_fsdp use_dist_ckpt
    use_dist_ckpt_deprecated use_distributed_optimizer use_gloo_process_groups use_layer_wise_distributed_optimizer
    use_megatron_fsdp use_mp_args_from_checkpoint_args use_nsys_profiler use_persistent_ckpt_worker
    use_precision_aware_optimizer use_pytorch_profiler use_ring_exchange_p2p use_sharp use_te_rng_tracker
    use_tokenizer_model_from_checkpoint_args use_torch_fsdp2 use_torch_optimizer_for_cpu_offload valid_data_path
    variable_seq_lengths vocab_file wandb_entity wandb_exp_name wandb_project wandb_save_dir warmup wd_incr_steps
    weight_decay weight_decay_incr_style wgrad_deferral_limit wsd_decay_steps yaml_cfg use_legacy_static_engine
    _is_global_batch_size_explicitly_specified num_floating_point_operations_so_far
    """
)


def _moe_only(names: list[str]) -> dict[str, Field]:
    return neutral("MoE training, kernel or dispatch choice: the same routed function at inference", *names)


# The MoE args that cannot change the function at inference (the ones that can are mapped or refused above).
_MOE_FIELDS = """
    moe_shared_expert_overlap moe_enable_routing_replay moe_router_padding_for_quantization
    moe_router_padding_for_fp8 moe_router_dtype moe_router_bias_update_rate moe_grouped_gemm
    moe_use_legacy_grouped_gemm moe_aux_loss_coeff moe_z_loss_coeff moe_input_jitter_eps moe_token_dispatcher_type
    moe_enable_deepep moe_flex_dispatcher_backend moe_per_layer_logging moe_token_drop_policy moe_layer_recompute
    moe_permute_fusion moe_router_fusion moe_deepep_num_sms moe_hybridep_num_sms
""".split()

MEGATRON_ARGS: dict[str, Field] = {
    **_MEGATRON_TRAINING,
    **_MEGATRON_NEUTRAL,
    **_moe_only(_MOE_FIELDS),
    **_MEGATRON_REFUSED,
    **_MEGATRON_MAPPED,
}


# megatron-core's YaRN (GPTModel position_embedding_type='yarn'): Megatron-LM's names for the `config.yarn_*`
# attributes its `_apply_yarn_config_from_args` sets (training/argument_utils.py); read by
# `spec.rope_and_qk_from_megatron_args` only when YaRN is in use.
MEGATRON_YARN_ARGS: dict[str, Field] = {
    "position_embedding_type": mapped("position_embedding_type", STR, "learned_absolute",
                                      ("learned_absolute", "rope", "yarn")),
    "rotary_scaling_factor": mapped("rope_scaling_factor", NUM, 1.0),
    "yarn_original_max_position_embeddings": mapped("rope_original_max_position_embeddings", INT, 4096),
    "yarn_beta_fast": mapped("yarn_beta_fast", NUM, 32.0),
    "yarn_beta_slow": mapped("yarn_beta_slow", NUM, 1.0),
    "mscale": mapped("yarn_mscale", NUM, 1.0),
    "mscale_all_dim": mapped("yarn_mscale_all_dim", NUM, 0.0),
    "yarn_correction_range_round_to_int": mapped("yarn_correction_range_round_to_int", BOOL, True),
}


# Multi-latent attention's rope: MLATransformerConfig's fields, which Megatron-LM copies from args of the same
# name (--rope-type, --rotary-scaling-factor, --mscale, --mscale-all-dim; original_max_position_embeddings,
# beta_fast and beta_slow only when a build of it has such args); read by `spec.deepseek_from_megatron_args`,
# which refuses what is ambiguous by name.
MEGATRON_MLA_ROPE_ARGS: dict[str, Field] = {
    "rope_type": mapped("rope_scaling", STR, None, ("rope", "yarn")),
    "rotary_scaling_factor": mapped("rope_scaling_factor", NUM),
    "original_max_position_embeddings": mapped("rope_original_max_position_embeddings", INT),
    "beta_fast": mapped("yarn_beta_fast", NUM),
    "beta_slow": mapped("yarn_beta_slow", NUM),
    "mscale": mapped("yarn_mscale", NUM),
    "mscale_all_dim": mapped("yarn_mscale_all_dim", NUM),
    **neutral("GPTModel's YaRN args, which megatron-core's MLA does not read (spec.mla_yarn_from_megatron_args "
              "refuses one that differs from what MLA reads)", "yarn_original_max_position_embeddings",
              "yarn_beta_fast", "yarn_beta_slow", "yarn_correction_range_round_to_int"),
}


# ---- HF config.json, transformers 4.57 -----------------------------------------------------------------


def _int_or_ints(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v)


def _rope_parameters_plain(v: Any, cfg: Mapping[str, Any]) -> bool:
    """transformers 5's `rope_parameters` without scaling, its rope_theta the config's own (families folds a
    rope_theta stated only here into the config)."""
    return (isinstance(v, dict) and set(v) <= {"rope_type", "rope_theta", "partial_rotary_factor"}
            and v.get("rope_type", "default") == "default" and full_rotary(v, cfg)
            and v.get("rope_theta", cfg.get("rope_theta")) == cfg.get("rope_theta"))


def full_rotary(rope_parameters: Mapping[str, Any], cfg: Mapping[str, Any]) -> bool:
    """transformers 5 copies `partial_rotary_factor` into `rope_parameters` beside the top-level key (GLM-4.7-Flash's
    1.0): plain rope when it is absent there, or 1.0 there and at the top level (a class default may differ)."""
    return "partial_rotary_factor" not in rope_parameters or (
        rope_parameters["partial_rotary_factor"] == 1.0 and cfg.get("partial_rotary_factor") == 1.0)


HF_COMMON: dict[str, Field] = {
    "architectures": mapped("family", (list,)),
    "model_type": mapped("family", STR),
    "torch_dtype": mapped("params_dtype", STR),
    "dtype": mapped("params_dtype", STR),
    "vocab_size": mapped("vocab_size", INT),
    "tie_word_embeddings": mapped("tie_embeddings", BOOL),
    "bos_token_id": mapped("bos_token_id", INT),
    "eos_token_id": Field(MAPPED, "read into ModelSpec.eos_token_id (the first of a list)", None, (int, list),
                          "eos_token_id"),
    **neutral(
        "generation defaults, labels, bookkeeping: not the network's function",
        "_name_or_path", "transformers_version", "bad_words_ids", "begin_suppress_tokens", "decoder_start_token_id",
        "diversity_penalty", "do_sample", "early_stopping", "encoder_no_repeat_ngram_size",
        "exponential_decay_length_penalty", "finetuning_task", "forced_bos_token_id", "forced_eos_token_id",
        "id2label", "label2id", "length_penalty", "max_length", "min_length", "no_repeat_ngram_size",
        "num_beam_groups", "num_beams", "num_return_sequences", "output_attentions", "output_hidden_states",
        "output_scores", "pad_token_id", "sep_token_id", "prefix", "problem_type", "remove_invalid_values",
        "repetition_penalty", "return_dict", "return_dict_in_generate", "suppress_tokens", "task_specific_params",
        "temperature", "tf_legacy_loss", "tokenizer_class", "top_k", "top_p", "torchscript", "typical_p",
        "use_bfloat16", "use_cache", "is_decoder", "tie_encoder_decoder", "chunk_size_feed_forward",
        "initializer_range", "attention_dropout", "_attn_implementation", "attn_implementation",
        "_attn_implementation_autoset", "auto_map", "num_labels", "gradient_checkpointing",
    ),
    # vLLM lets `--max-model-len` exceed the derived context up to this cap: it bounds the positions served,
    # not the function over them
    "model_max_length": Field(NEUTRAL, "a cap on the context vLLM serves: the same function over it"),
    "add_cross_attention": refused("cross-attention layers are not mapped", False),
    "is_encoder_decoder": refused("encoder-decoder models are not mapped", False),
    "cross_attention_hidden_size": refused("cross-attention layers are not mapped", None),
    "pruned_heads": refused("pruned attention heads are not mapped", None, lambda v, _: v == {}),
    # block-scaled FP8 (DeepSeek-V3's release) is read dequantized; convert/hf/fp8.py checks its fields
    "quantization_config": refused("quantized weights other than block-scaled FP8 (quant_method fp8 with "
                                   "weight_block_size) are not read", None,
                                   lambda v, a: isinstance(v, dict) and v.get("quant_method") == "fp8"
                                   and v.get("weight_block_size") is not None),
    # MLX writes this key (group_size, bits) for weights packed into integers with per-group scales and biases;
    # beside a quantization_config (newer mlx-lm writes both) that refusal alone names the model's state
    "quantization": refused("MLX-quantized weights are not read: convert the unquantized model", None,
                            lambda _, cfg: "quantization_config" in cfg),
    "rope_scaling": refused("rope scaling (llama3, linear, dynamic, yarn ...) is not mapped yet", None),
    "rope_parameters": refused("only its plain rope (rope_type 'default') is read, with the config's rope_theta; "
                               "give rope scaling as rope_scaling", None, _rope_parameters_plain),
}


# ---- numeric fields ------------------------------------------------------------------------------------
# Checked for type before parsing so a malformed file is refused by field name.
ARGS_NUMBERS = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
    "max_position_embeddings", "seq_length", "vocab_size", "padded_vocab_size", "make_vocab_size_divisible_by",
    "norm_epsilon", "layernorm_epsilon", "rotary_base", "rotary_percent", "rope_scaling_factor",
    "rotary_seq_len_interpolation_factor", "num_experts", "num_moe_experts", "moe_ffn_hidden_size", "moe_router_topk",
)
HF_NUMBERS = (
    "vocab_size", "n_embd", "n_layer", "n_head", "n_inner", "n_positions", "layer_norm_epsilon",
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_theta",
)


def check_numbers(d: Mapping[str, Any], keys: tuple[str, ...], required: tuple[str, ...], source: str) -> None:
    """Refuse a non-numeric, non-finite or (for sizes) non-positive value, naming the field."""
    for k in keys:
        if k not in d or (d[k] is None and k not in required):
            continue
        v = d[k]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise MConvertError(f"{source}: field {k!r} = {v!r} is not a finite number; fix it")
        if v <= 0:  # sizes, epsilons, rope bases and factors alike: zero or less is no model
            raise MConvertError(f"{source}: field {k!r} = {v!r} must be positive; fix it")
        if isinstance(v, float) and not k.endswith(("epsilon", "eps", "percent", "theta", "base", "factor")) and v != int(v):
            raise MConvertError(f"{source}: field {k!r} = {v!r} must be a whole number; fix it")


# ---- Megatron-Bridge model providers (run_config.yaml `model:`) ----------------------------------------------
# Megatron-Bridge 0.6 GPTModelProvider (models/gpt_provider.py) extends megatron-core's TransformerConfig, whose
# fields the Megatron table judges under the same names; below are the provider's own names and the ones whose
# YAML form differs (callables, dtypes and enums are mappings naming a `_target_`, never imported). The
# translation to Megatron args is `convert/megatron/bridge.py`.


def _named(v: Any) -> Any:
    return v.get("_target_") if isinstance(v, dict) else v


_BRIDGE_ACTIVATIONS = ("torch.nn.functional.silu", "torch.nn.functional.gelu", "megatron.core.activations.fast_gelu")
_BRIDGE_LAYER_SPECS = tuple(f"megatron.bridge.models.gpt_provider.{n}" for n in
                            ("default_layer_spec", "transformer_engine_layer_spec", "local_layer_spec"))
# megatron-core's block spec, which the DeepSeek, Kimi and GLM bridges name (a partial): it builds each layer from
# the config (MLA, `moe_layer_freq`'s dense and MoE layers, qk-norm)
_DECODER_BLOCK_SPEC = "megatron.core.models.gpt.gpt_layer_specs.get_gpt_decoder_block_spec"
_BLOCK_SPEC_KEYWORDS = {"use_transformer_engine", "normalization", "qk_l2_norm", "vp_stage", "pp_rank"}


def _per_layer_moe(freq: Any) -> bool:
    return freq not in (None, 1) and not (isinstance(freq, list) and freq and set(freq) == {1})


def _bridge_layer_spec_ok(v: Any, m: Mapping[str, Any]) -> bool:
    """GPTModelProvider's own specs build every layer alike (standard attention; MoE in each layer with
    num_moe_experts): the model the fields say unless they ask for MLA or a per-layer `moe_layer_freq`. The block
    spec's keywords: use_transformer_engine (kernels: the same torch_dist keys), normalization (None: the
    model's), qk_l2_norm off, the pipeline stage."""
    if _named(v) in _BRIDGE_LAYER_SPECS:
        return not m.get("multi_latent_attention") and not (m.get("num_moe_experts") and
                                                            _per_layer_moe(m.get("moe_layer_freq")))
    if _named(v) != _DECODER_BLOCK_SPEC or not isinstance(v, dict) or v.get("_args_"):
        return False
    kw = {k: x for k, x in v.items() if k not in ("_target_", "_partial_", "_args_", "_call_")}
    return (set(kw) <= _BLOCK_SPEC_KEYWORDS and kw.get("normalization") in (None, m.get("normalization"))
            and not kw.get("qk_l2_norm"))


BRIDGE_MODEL: dict[str, Field] = {
    **MEGATRON_ARGS,
    "_target_": Field(NEUTRAL, "the provider class, checked against convert/megatron/bridge.py's provider table"),
    "share_embeddings_and_output_weights": mapped("tie_embeddings", BOOL, True),
    "gated_linear_unit": mapped("activation", BOOL, False),
    "activation_func": refused("only SiLU (gated: SwiGLU), GeLU and tanh GeLU (gated: GeGLU) MLPs are mapped", None,
                               lambda v, a: _named(v) in _BRIDGE_ACTIVATIONS),
    "rope_scaling": mapped("rope_scaling", BOOL, False),
    "seq_len_interpolation_factor": mapped("rope_scaling_factor", NUM),
    "should_pad_vocab": mapped("vocab_size", BOOL, False),
    "transformer_layer_spec": refused("only megatron-core's get_gpt_decoder_block_spec (plain keywords) and "
                                      "GPTModelProvider's own specs are mapped, the latter without MLA or a per-layer "
                                      "moe_layer_freq (they build every layer alike)", None, _bridge_layer_spec_ok),
    "yarn_rotary_scaling_factor": refused("YaRN rotary scaling is not mapped", None),
    "yarn_original_max_position_embeddings": refused("YaRN rotary scaling is not mapped", None),
    "yarn_beta_fast": refused("YaRN rotary scaling is not mapped", None),
    "yarn_beta_slow": refused("YaRN rotary scaling is not mapped", None),
    "yarn_mscale": refused("YaRN rotary scaling is not mapped", None),
    "yarn_mscale_all_dim": refused("YaRN rotary scaling is not mapped", None),
    "yarn_correction_range_round_to_int": refused("YaRN rotary scaling is not mapped", None),
    **neutral("Megatron-Bridge bookkeeping: where the weights came from, what its loader does",
              "hf_model_id", "hf_model_revision", "generation_config", "parallel_output", "restore_modelopt_state",
              "use_transformer_engine_full_layer_spec", "use_transformer_engine_op_fuser", "dense_grouped_gemm",
              "use_arbitrary_attention_mask", "scatter_embedding_sequence_parallel", "deallocate_pipeline_outputs",
              "tp_comm_overlap_cfg", "mtp_enabled"),
    # megatron-core 0.19 TransformerConfig fields (Megatron-Bridge 0.6 pins it)
    **neutral("memory, offloading or kernel choice: the same function",
              "activation_offload_fraction", "delta_offload_bytes_across_pp_ranks", "gtp_weight_remat_size",
              "expert_gtp_weight_remat_size", "mlp_chunks_for_training", "inference_grouped_gemm_backend",
              "inference_moe_token_dispatcher_type", "moe_hybridep_num_sms_preprocessing",
              "moe_paged_stash_buffer_size_factor_cpu", "moe_paged_stash_buffer_size_factor_cuda",
              "moe_paged_stash_page_size", "moe_router_quantile_balancing_ema"),
    **neutral("only with experimental_attention_variant, which is refused",
              "dsa_indexer_rotate_activation", "dsa_indexer_scoring_relu", "dsa_indexer_skip_topk_offset",
              "dsa_indexer_topk_freq", "dsa_kernel_backend"),
    "use_mup": refused("muP scaling (embedding, attention and output multipliers) is not mapped", False),
    **{k: refused("muP scaling is not mapped", 1.0) for k in
       ("mup_width_mult", "mup_embedding_mult", "mup_output_mult", "mup_attn_scale_power")},
}
