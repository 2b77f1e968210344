"""Megatron-Bridge checkpoints: `run_config.yaml` read as data, its model provider mapped to Megatron args, and
the files Megatron-Bridge needs beside a torch_dist checkpoint written for it.

Megatron-Bridge (`training/checkpointing.py`, `training/model_load_save.py`) saves a megatron-core torch_dist
iteration dir `iter_NNNNNNN/` holding, besides the DCP files and `metadata.json`: `run_config.yaml` (its whole
`ConfigContainer`; under `model:` the provider dataclass, `_target_` naming its class and every field written),
`train_state.pt` (step and sample counters, tensors only) and `tokenizer/` (the HF tokenizer files). Beside the
iteration dirs: `latest_train_state.pt` and Megatron-LM's `latest_checkpointed_iteration.txt`. There is no `args`:
`common.pt` (or the `common_state` object newer megatron-core keeps in the DCP files) holds only the checkpoint
version and iteration. Its loader builds the model from `run_config.yaml` alone.

Nothing here imports or calls what the YAML names: callables, dtypes and enums are mappings with a `_target_`
string, compared as strings.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import torch
import yaml

from mconvert.io.paths import inside_file, read_small
from mconvert.errors import MConvertError, type_name
from mconvert.mappings import families
from mconvert.mappings.fields import (ARGS_NUMBERS, BRIDGE_MODEL, MAPPED, MEGATRON_ARGS, MEGATRON_MLA_ROPE_ARGS, check,
                                      check_numbers)
from mconvert.spec import ModelSpec

RUN_CONFIG = "run_config.yaml"
TRAIN_STATE = "train_state.pt"
LATEST_TRAIN_STATE = "latest_train_state.pt"
TOKENIZER_DIR = "tokenizer"

# Provider classes whose `provide()` is GPTModelProvider's: the model is the fields, nothing more. Megatron-Bridge
# 0.6 writes GPTModelProvider for Llama, Qwen2/3, Qwen3-MoE and GLM-4.5, MLAModelProvider (MLATransformerConfig's
# fields added, `provide()` unchanged) for DeepSeek-V2/V3, Moonlight and Kimi K2; releases before it wrote the
# named subclasses (`models/llama/llama_provider.py`, `models/qwen/qwen_provider.py`,
# `models/deepseek/deepseek_provider.py`, `models/kimi/kimi_provider.py`, `models/glm/glm45_provider.py`), which
# only change field defaults. Which layers the model has (MLA, dense or MoE per layer) is its
# `transformer_layer_spec`'s, judged by `fields.BRIDGE_MODEL`.
_GPT = "megatron.bridge.models.gpt_provider.GPTModelProvider"
_MLA = "megatron.bridge.models.mla_provider.MLAModelProvider"
_LLAMA = ("LlamaModelProvider Llama2ModelProvider7B Llama2ModelProvider13B Llama2ModelProvider70B Llama3ModelProvider "
          "Llama31ModelProvider Llama3ModelProvider8B Llama3ModelProvider70B Llama31ModelProvider8B "
          "Llama31ModelProvider70B Llama31ModelProvider405B Llama32ModelProvider1B Llama32ModelProvider3B "
          "CodeLlamaModelProvider7B CodeLlamaModelProvider13B CodeLlamaModelProvider34B CodeLlamaModelProvider70B")
_QWEN = ("Qwen2ModelProvider Qwen2ModelProvider500M Qwen2ModelProvider1P5B Qwen2ModelProvider7B Qwen2ModelProvider72B "
         "Qwen25ModelProvider500M Qwen25ModelProvider1P5B Qwen25ModelProvider3B Qwen25ModelProvider7B "
         "Qwen25ModelProvider14B Qwen25ModelProvider32B Qwen25ModelProvider72B Qwen3ModelProvider "
         "Qwen3ModelProvider600M Qwen3ModelProvider1P7B Qwen3ModelProvider4B Qwen3ModelProvider8B "
         "Qwen3ModelProvider14B Qwen3ModelProvider32B Qwen3MoEModelProvider Qwen3MoEModelProvider30B_A3B "
         "Qwen3MoEModelProvider235B_A22B")
_DEEPSEEK = ("DeepSeekModelProvider DeepSeekV2ModelProvider DeepSeekV2LiteModelProvider DeepSeekV3ModelProvider "
             "MoonlightModelProvider16B DeepSeekProvider DeepSeekV2Provider DeepSeekV2LiteProvider DeepSeekV3Provider "
             "MoonlightProvider")
_GLM = "GLMMoEModelProvider GLM45ModelProvider355B GLM45AirModelProvider106B"
PROVIDERS: frozenset[str] = frozenset(
    [_GPT, _MLA, "megatron.bridge.models.mistral.mistral_provider.MistralModelProvider",
     "megatron.bridge.models.kimi.kimi_provider.KimiK2Provider"]
    + [f"megatron.bridge.models.llama.llama_provider.{n}" for n in _LLAMA.split()]
    + [f"megatron.bridge.models.qwen.qwen_provider.{n}" for n in _QWEN.split()]
    + [f"megatron.bridge.models.deepseek.deepseek_provider.{n}" for n in _DEEPSEEK.split()]
    + [f"megatron.bridge.models.glm.glm45_provider.{n}" for n in _GLM.split()]
    # the providers a family declares (`Family.bridge`: Gemma 2 / 3), whose block beyond the fields it reads
    + [cls for fam in families.all_families() if fam.bridge is not None for cls in fam.bridge.classes]
)
# Providers known to build what mconvert does not map, refused by name with the reason.
REFUSED_PROVIDERS: dict[str, str] = {
    "megatron.bridge.models.deepseek.deepseek_provider.DeepSeekV32": "DeepSeek sparse attention (its indexer) is "
                                                                     "not mapped",
    "megatron.bridge.models.mamba.": "Mamba models are not mapped",
    "megatron.bridge.models.hybrid.": "hybrid Mamba models are not mapped",
    "megatron.bridge.models.t5_provider.": "encoder-decoder (T5) models are not mapped",
}
# The fields the mapping reads; a run_config.yaml without one of them is refused (Megatron-Bridge writes every
# field, and a subclass's defaults are not known without importing it).
REQUIRED = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "vocab_size", "normalization",
    "layernorm_epsilon", "activation_func", "gated_linear_unit", "position_embedding_type", "add_bias_linear",
    "add_qkv_bias", "share_embeddings_and_output_weights", "seq_length", "make_vocab_size_divisible_by",
)
# Fields whose names and meanings are megatron-core's TransformerConfig's, which Megatron-LM's args share.
SHARED = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
    "vocab_size", "make_vocab_size_divisible_by", "normalization", "position_embedding_type", "rotary_base",
    "rotary_percent", "rotary_interleaved", "add_bias_linear", "add_qkv_bias", "bf16", "fp16", "qk_layernorm",
    "num_moe_experts", "moe_ffn_hidden_size", "moe_router_topk", "rope_scaling_factor", "bias_activation_fusion",
    "use_te_activation_func", "tensor_model_parallel_size", "pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size", "expert_model_parallel_size",
)
SILU, GELU = "torch.nn.functional.silu", "torch.nn.functional.gelu"
TANH_GELU = "megatron.core.activations.fast_gelu"  # Gemma's: 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))
DTYPES = {"float32": "torch.float32", "bfloat16": "torch.bfloat16", "float16": "torch.float16"}


class _DataOnly(yaml.SafeLoader):
    """PyYAML's safe loader (plain data: no `!!python/...` tag builds an object) that also refuses anchors and
    aliases: a few aliases nest into billions of nodes, and Megatron-Bridge's OmegaConf dump writes none."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent) or getattr(self.peek_event(), "anchor", None) is not None:
            raise yaml.composer.ComposerError(None, None, "anchors and aliases are not read",
                                              self.peek_event().start_mark)
        return super().compose_node(parent, index)


def find_run_config(iter_dir: Path, beside: bool = False) -> Path | None:
    """The `run_config.yaml` of a torch_dist iteration dir (Megatron-Bridge writes it in each); with `beside`,
    else the one beside the iteration dirs (read only for a checkpoint without args of its own); or None."""
    for d in (iter_dir, iter_dir.parent) if beside else (iter_dir,):
        if os.path.lexists(d / RUN_CONFIG):
            return d / RUN_CONFIG
    return None


def read_run_config(path: Path) -> dict[str, Any]:
    """`run_config.yaml` as plain data (size-checked before reading; tags, anchors and aliases refused)."""
    path = inside_file(path.parent, path.name, f"{path.parent}: Megatron-Bridge run config")
    text = read_small(path, "yaml")
    try:
        cfg = yaml.load(text.decode("utf-8"), Loader=_DataOnly)  # noqa: S506 - a SafeLoader subclass
    except UnicodeDecodeError as e:
        raise MConvertError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start}); re-copy the checkpoint") from None
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        line = f" at line {where.line + 1}" if where is not None else ""
        problem = " ".join(str(getattr(e, "problem", None) or e).split())[:160]
        raise MConvertError(f"{path}: not plain YAML data ({problem}{line}); mconvert reads run_config.yaml as data "
                            "only — remove the tag or alias, or re-save it with Megatron-Bridge") from None
    except RecursionError:
        raise MConvertError(f"{path}: YAML nested too deeply; not a Megatron-Bridge run config") from None
    if not isinstance(cfg, dict) or not isinstance(cfg.get("model"), dict):
        found = type_name(cfg) if not isinstance(cfg, dict) else f"model: {type_name(cfg.get('model'))}"
        raise MConvertError(f"{path}: no `model:` mapping (found {found}); not a Megatron-Bridge run config")
    return cfg


def target(v: Any) -> str | None:
    """The class or function path a YAML mapping names (`_target_`), else None."""
    return v.get("_target_") if isinstance(v, dict) and isinstance(v.get("_target_"), str) else None


def provider_class(cfg: dict[str, Any], source: str) -> str:
    """The model provider's class path, refused unless its model is its fields alone."""
    cls = target(cfg["model"])
    if cls is None:
        raise MConvertError(f"{source}: model has no `_target_` class path (or a `_builder_` ModelConfig); "
                            "not a Megatron-Bridge model provider mconvert reads")
    for prefix, why in REFUSED_PROVIDERS.items():
        if cls.startswith(prefix):
            raise MConvertError(f"{source}: model provider {cls} is not supported: {why}; conversion refused")
    if cls not in PROVIDERS:
        raise MConvertError(f"{source}: model provider {cls} is not known to mconvert (its provide() may build "
                            "another model than its fields say); supported: GPTModelProvider, MLAModelProvider and "
                            "the Llama, Qwen, Mistral, DeepSeek, Kimi, GLM-4.5 and Gemma 2 / 3 providers; conversion "
                            "refused")
    return cls


def megatron_args(cfg: dict[str, Any], source: str) -> argparse.Namespace:
    """The Megatron-LM args a run_config.yaml's model provider stands for (every field mapped or refused, by the
    `fields.BRIDGE_MODEL` table), so that one ModelSpec path serves both writers' checkpoints."""
    cls = provider_class(cfg, source)
    own = next((f.bridge for f in families.all_families() if f.bridge is not None and cls in f.bridge.classes), None)
    # a family's own providers build more than their fields say: the family reads what they imply
    m, implied = own.args(cfg["model"], f"{source}: Megatron-Bridge model field") if own else (cfg["model"], {})
    # MLATransformerConfig's rope fields (rope_type, rotary_scaling_factor, mscale, ...) are Megatron-LM's MLA
    # args by name: read under multi_latent_attention, refused by the GPT table otherwise
    mla = MEGATRON_MLA_ROPE_ARGS if m.get("multi_latent_attention") else {}
    check(m, {**BRIDGE_MODEL, **mla}, source, "Megatron-Bridge model field",
          unknown_hint="remove it from run_config.yaml if it is training-only")
    missing = [k for k in REQUIRED if m.get(k) is None]
    if missing:
        raise MConvertError(f"{source}: model has no {missing[0]!r} (or it is null); mconvert reads every field from "
                            "run_config.yaml (Megatron-Bridge writes them all) — re-save it with Megatron-Bridge")
    check_numbers(m, ARGS_NUMBERS, ("hidden_size", "num_attention_heads", "num_layers"), source)
    act, glu = target(m["activation_func"]), m["gated_linear_unit"]
    geglu = act == TANH_GELU and bool(glu)
    if (act == SILU) != bool(glu) and not geglu:  # erf-GeLU GLU and a SiLU MLP without GLU are not mapped
        raise MConvertError(f"{source}: Megatron-Bridge model field activation_func={act} with gated_linear_unit="
                            f"{glu} is not supported: only SwiGLU (silu, gated), GeGLU (fast_gelu, gated) and GeLU "
                            "(ungated) MLPs are mapped; conversion refused")
    # every field the Megatron table maps is carried under its own name, so a feature mapped for Megatron-LM's
    # args (a sliding window, ...) is read from the provider too, never dropped
    a: dict[str, Any] = {k: v for k, v in m.items() if k in SHARED or k in mla
                         or (k in MEGATRON_ARGS and MEGATRON_ARGS[k].kind == MAPPED)}
    nh, groups = m["num_attention_heads"], m.get("num_query_groups")
    a.update(
        swiglu=act == SILU and bool(glu), openai_gelu=geglu, gated_linear_unit=geglu,
        untie_embeddings_and_output_weights=not m["share_embeddings_and_output_weights"],
        norm_epsilon=m["layernorm_epsilon"],
        max_position_embeddings=m["seq_length"],
        seq_length=m["seq_length"],
        group_query_attention=groups is not None and groups != nh,
        use_rope_scaling=bool(m.get("rope_scaling")),
    )
    try:
        a["padded_vocab_size"] = padded_vocab(m)
    except (TypeError, ValueError):
        raise MConvertError(f"{source}: model tensor_model_parallel_size={m.get('tensor_model_parallel_size')!r} "
                            "is not a whole number; fix it") from None
    if not a["group_query_attention"]:
        a["num_query_groups"] = 1  # Megatron-LM's MHA spelling
    if m.get("seq_len_interpolation_factor") is not None:
        a["rotary_seq_len_interpolation_factor"] = m["seq_len_interpolation_factor"]
    if not a["use_rope_scaling"]:
        a.pop("rope_scaling_factor", None)
    return argparse.Namespace(**{**a, **implied})


def padded_vocab(m: dict[str, Any]) -> int:
    """The embedding rows GPTModelProvider.provide() builds: `vocab_size`, padded to a multiple of
    `make_vocab_size_divisible_by` × TP only when `should_pad_vocab`."""
    v = int(m["vocab_size"])
    if not m.get("should_pad_vocab"):
        return v
    multiple = int(m["make_vocab_size_divisible_by"]) * int(m.get("tensor_model_parallel_size") or 1)
    return -(-v // multiple) * multiple


def writer_info(cfg: dict[str, Any]) -> dict[str, Any]:
    """What `inspect` says of the writer: Megatron-Bridge, its version when the config records one (0.6 records
    none), the provider class, and the model fields the ModelSpec was read from."""
    version = next((v for v in (cfg.get("megatron_bridge_version"), cfg.get("version")) if isinstance(v, str)), None)
    cls = (target(cfg.get("model")) or "?").rsplit(".", 1)[-1]
    table = {**BRIDGE_MODEL, **(MEGATRON_MLA_ROPE_ARGS if cfg["model"].get("multi_latent_attention") else {})}
    read = sorted(k for k, f in table.items() if f.kind == MAPPED and k in cfg["model"])
    text = f"written by Megatron-Bridge{' ' + version if version else ''}, provider {cls}"
    return {"writer": "Megatron-Bridge", "version": version, "provider": cls, "text": text, "fields_read": read}


# ---- writing --------------------------------------------------------------------------------------------
def bridge_divisor(n: int) -> int:
    """Megatron-Bridge's `make_vocab_size_divisible_by` for an HF vocab (model_bridge.py): the largest power of
    two up to 128 dividing it. Given the vocab / TP, the divisor × TP divides the vocab: no padding row is stored,
    as Megatron-Bridge's own import (`should_pad_vocab` off) stores none."""
    d = 128
    while n % d:
        d //= 2
    return d


# Megatron args of the same names as megatron-core's TransformerConfig / MLATransformerConfig fields: what a model
# states beyond GPTModelProvider's basic fields (MLA and its rope, the DeepSeek router, moe_layer_freq, MTP, the
# window), written under those names as Megatron-Bridge's DeepSeek and GLM imports write them
_CONFIG_ARGS = (
    "multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim",
    "rope_type", "rotary_scaling_factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
    "mscale_all_dim", "mtp_num_layers", "moe_shared_expert_intermediate_size", "moe_shared_expert_gate",
    "moe_router_score_function", "moe_router_pre_softmax",
    "moe_router_enable_expert_bias", "moe_router_topk_scaling_factor", "moe_router_num_groups",
    "moe_router_group_topk", "moe_layer_freq", "window_size", "window_attn_skip_freq",
)
_BLOCK_SPEC = {"_target_": "megatron.core.models.gpt.gpt_layer_specs.get_gpt_decoder_block_spec", "_partial_": True,
               "_args_": [], "use_transformer_engine": True}


def provider_fields(spec: ModelSpec, tp: int, pp: int, vpp: int | None, ep: int = 1) -> dict[str, Any]:
    """The provider fields (run_config.yaml `model:`) of `spec` at TP/PP/VPP/EP, as Megatron-Bridge's own import
    writes them: unpadded vocab (`should_pad_vocab` off); GPTModelProvider with the default (Transformer Engine)
    layer spec, or, for MLA or dense and MoE layers mixed, MLAModelProvider / GPTModelProvider with megatron-core's
    block spec (its DeepSeek and GLM bridges' choice)."""
    dtype = spec.params_dtype
    m: dict[str, Any] = {
        "_target_": _GPT,
        "num_layers": spec.num_layers, "hidden_size": spec.hidden_size, "ffn_hidden_size": spec.ffn_hidden_size,
        "num_attention_heads": spec.num_attention_heads, "num_query_groups": spec.num_groups,
        "kv_channels": spec.head_dim, "seq_length": spec.max_position_embeddings,
        "vocab_size": spec.vocab_size, "should_pad_vocab": False,
        "make_vocab_size_divisible_by": spec.make_vocab_size_divisible_by,
        "normalization": spec.normalization, "layernorm_epsilon": spec.norm_epsilon,
        "activation_func": {"_target_": SILU if spec.gated else GELU, "_call_": False},
        "gated_linear_unit": spec.gated,
        # unfused GeLU is torch's exact erf GeLU; the fused kernel is the tanh approximation
        "bias_activation_fusion": spec.gated or spec.activation == "gelu_new",
        "position_embedding_type": spec.position_embedding_type, "rotary_base": spec.rotary_base,
        "rotary_percent": spec.rotary_percent, "rotary_interleaved": spec.rotary_interleaved,
        "add_bias_linear": spec.add_bias_linear, "add_qkv_bias": spec.add_qkv_bias,
        "share_embeddings_and_output_weights": spec.tie_embeddings,
        "qk_layernorm": bool(spec.qk_layernorm),
        "rope_scaling": spec.rope_scaling == "llama3",
        "rope_scaling_factor": float(spec.rope_scaling_factor) if spec.rope_scaling == "llama3" else 1.0,
        "seq_len_interpolation_factor": float(spec.rope_scaling_factor) if spec.rope_scaling == "linear" else None,
        "bf16": dtype == "bfloat16", "fp16": dtype == "float16",
        "params_dtype": {"_target_": DTYPES[dtype], "_call_": False},
        "tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
        "virtual_pipeline_model_parallel_size": vpp,
        "transformer_layer_spec": {"_target_": "megatron.bridge.models.gpt_provider.default_layer_spec",
                                   "_call_": False},
        "hidden_dropout": 0.0, "attention_dropout": 0.0,
    }
    if spec.is_moe:
        m.update(num_moe_experts=spec.num_experts, moe_ffn_hidden_size=spec.expert_ffn_hidden_size,
                 moe_router_topk=spec.moe_router_topk, expert_model_parallel_size=ep,
                 expert_tensor_parallel_size=tp, moe_token_dispatcher_type="allgather", moe_grouped_gemm=False,
                 moe_router_score_function="softmax", moe_router_pre_softmax=False)
    args = vars(spec.to_megatron_args(tp, pp, vpp, ep=ep))
    m.update({k: list(v) if isinstance(v, tuple) else v for k, v in args.items() if k in _CONFIG_ARGS})
    if spec.is_mla:
        m.update(_target_=_MLA, qk_layernorm=True)  # MLA's latent norms
    if spec.is_mla or (spec.is_moe and spec.num_moe_layers != spec.num_layers):
        m["transformer_layer_spec"] = dict(_BLOCK_SPEC)
    return m


def check_writable(spec: ModelSpec, tp: int, carried: bool = False) -> None:
    """Megatron-Bridge stores the vocab unpadded and pads nothing when it loads: the vocab must split over TP. The
    Gemma block is built by Megatron-Bridge's Gemma providers, whose run_config.yaml mconvert reads and (`carried`,
    from a Megatron-Bridge source) carries, but does not write."""
    if not carried and (spec.sandwich_norms or spec.scale_embeddings or spec.rotary_base_local is not None):
        raise MConvertError(f"--bridge: the {spec.family} block (post-norms, embedding scale, two rope bases) is "
                            "built by Megatron-Bridge's Gemma providers, which mconvert does not write; drop --bridge "
                            "(the torch_dist checkpoint holds Megatron-Bridge's tensor names)")
    if spec.vocab_size % tp:
        raise MConvertError(f"--bridge: vocab size {spec.vocab_size} does not split over TP={tp}; Megatron-Bridge "
                            "keeps the vocab unpadded — choose a TP dividing it, or drop --bridge")


# The provider fields a re-shard rewrites in a carried run_config.yaml: the layout, and the vocab as now stored.
LAYOUT_FIELDS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
                 "expert_model_parallel_size", "expert_tensor_parallel_size", "vocab_size", "should_pad_vocab",
                 "make_vocab_size_divisible_by")


def write_bridge_files(iter_dir: Path, root: Path, spec: ModelSpec, tp: int, pp: int, vpp: int | None, ep: int,
                       iteration: int, source: dict[str, Any] | None = None,
                       train_state: dict[str, Any] | None = None) -> list[Path]:
    """`run_config.yaml` and `train_state.pt` in the iteration dir, `latest_train_state.pt` beside it. From a
    Megatron-Bridge source, its run config (every section, as read) with the layout and vocab fields of the model
    rewritten, and its train state; otherwise a GPTModelProvider and counters at zero."""
    fields = provider_fields(spec, tp, pp, vpp, ep)
    if source is None:
        cfg: dict[str, Any] = {"_target_": "megatron.bridge.training.config.ConfigContainer", "model": fields}
    else:
        model = dict(source["model"])
        model.update({k: fields[k] for k in LAYOUT_FIELDS if k in fields})  # expert sizes: MoE models only
        cfg = {**source, "model": model}
    text = yaml.safe_dump(cfg, sort_keys=False, default_flow_style=False)
    (iter_dir / RUN_CONFIG).write_text(text)
    state = train_state if train_state is not None else {
        "step": torch.tensor(iteration), "consumed_train_samples": torch.tensor(0),
        "skipped_train_samples": torch.tensor(0), "consumed_valid_samples": torch.tensor(0),
        "floating_point_operations_so_far": torch.tensor(0.0), "do_train": torch.tensor(False),
        "do_valid": torch.tensor(False), "do_test": torch.tensor(False)}
    torch.save(state, iter_dir / TRAIN_STATE)
    torch.save(state, root / LATEST_TRAIN_STATE)
    return [iter_dir / RUN_CONFIG, iter_dir / TRAIN_STATE, root / LATEST_TRAIN_STATE]
