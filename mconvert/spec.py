"""ModelSpec: the one description of a decoder LM and of how each of its parameters is split.

Every other part of mconvert reads this file: the trainer builds its layers from `ModelSpec.params()`,
the converter reads the same split declarations to merge and split shards, and the HF / Megatron / FT
configs are rendered from (and parsed into) a ModelSpec. Parameter names are megatron-core **local-spec**
names with a *global* layer index; adapters map other spellings (TE spec, legacy `language_model.*`,
stage-local indices) onto these.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass, field
from collections.abc import Mapping
from typing import Any, NamedTuple, Union

from mconvert import dtypes
from mconvert.errors import MConvertError
from mconvert.rope import megatron_attention_factor

# How a parameter is cut across tensor-parallel ranks.
#   replicated: every rank holds the full tensor
#   column:     split along dim 0 (output features) — ColumnParallelLinear
#   row:        split along dim 1 (input features) — RowParallelLinear
#   vocab:      split along dim 0 (vocab rows, after padding) — VocabParallelEmbedding / output layer
#   qkv:        column split of the fused [ng, nq/ng + 2, hd] row layout (a group may straddle ranks)
#   gated:      column split where each rank stores [gate_r; up_r] (SwiGLU fc1)
SPLIT_KINDS = ("replicated", "column", "row", "vocab", "qkv", "gated")
SPLIT_DIM: dict[str, int | None] = {
    "replicated": None,
    "column": 0,
    "row": 1,
    "vocab": 0,
    "qkv": 0,
    "gated": 0,
}
# The collective each split kind needs at run time (forward; backward is its conjugate).
SPLIT_COLLECTIVE: dict[str, str] = {
    "replicated": "none (grads all-reduced over TP where the input is TP-parallel)",
    "column": "identity fwd / all-reduce bwd on input",
    "qkv": "identity fwd / all-reduce bwd on input",
    "gated": "identity fwd / all-reduce bwd on input",
    "row": "all-reduce fwd on output / identity bwd",
    "vocab": "embedding: all-reduce fwd; head: vocab-parallel cross-entropy (all-reduce of max/sum)",
}

# The output formats that can state each optional feature (`ModelSpec.refuse_unmapped` refuses the others):
# FasterTransformer has neither; TensorRT-LLM states rope scaling (LLaMAConfig's `rotary_scaling`; its layout
# refuses the types it does not state) and has no confirmed field for qk-norm or MoE here.
FEATURE_TARGETS: dict[str, tuple[str, ...]] = {
    "rope_scaling": ("HF", "GGUF", "TensorRT-LLM"),
    "qk_layernorm": ("HF", "GGUF"),
    "moe": ("HF", "GGUF"),
    # a sliding window shorter than the context: FasterTransformer's and TensorRT-LLM's checkpoints have no window
    # field, and llama.cpp's llama / qwen2 / qwen3 / qwen3moe architectures read none (ONNX is exported from the HF
    # form, which has it; see docs/formats.md); `window_as_full` writes those targets' full attention on request
    "window": ("HF",),
    # Gemma's block (zero-centred norms, sandwich norms, embedding scale, attention scale, soft-capping, local
    # rope base): the HF Gemma classes (ONNX is exported from them) and llama.cpp's gemma2 / gemma3 architectures
    # (their GgufLayout states it); FasterTransformer's and TensorRT-LLM's checkpoints have no field for it
    "gemma": ("HF",),
}


@dataclass(frozen=True)
class ParamDecl:
    """One parameter of the full (unsharded) model: canonical name, split kind and full shape."""

    name: str
    kind: str
    shape: tuple[int, ...]
    layer: int | None = None  # global layer index; None for embedding / final params
    expert: int | None = None  # global expert index of a routed expert's weight; None for every other param


class LayerPart(NamedTuple):
    """A conversion unit smaller than a layer: a mixture-of-experts layer's dense part (attention, norms,
    router; `expert` None) or one routed expert (its global index), so memory is bounded by one expert."""

    layer: int
    expert: int | None

    def __str__(self) -> str:
        return f"layer {self.layer} " + ("dense part" if self.expert is None else f"expert {self.expert}")


# A conversion unit: "embedding", a layer's global index, a `LayerPart` of an MoE layer, or "final".
Unit = Union[str, int, LayerPart]


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer, described once.

    Sizes use Megatron's names; `vocab_size` is the true (unpadded) vocabulary.
    """

    family: str  # a family module of mconvert.mappings (its name)
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int
    vocab_size: int  # true vocab; the padded size depends on TP (padded_vocab_size)
    max_position_embeddings: int
    num_query_groups: int | None = None  # None (or == heads) means MHA
    kv_channels: int | None = None  # head_dim; None = hidden_size // num_attention_heads
    normalization: str = "LayerNorm"  # LayerNorm | RMSNorm
    norm_epsilon: float = 1e-5
    activation: str = "gelu"  # gelu (erf) | gelu_new (tanh, Megatron openai_gelu) | swiglu | geglu (tanh GeLU gate)
    position_embedding_type: str = "learned_absolute"  # learned_absolute | rope
    rotary_base: float = 10000.0
    rotary_percent: float = 1.0
    rotary_interleaved: bool = False
    add_bias_linear: bool = True  # biases on qkv, proj, fc1, fc2
    add_qkv_bias: bool = False  # qkv bias only (Qwen2)
    tie_embeddings: bool = True
    make_vocab_size_divisible_by: int = 128
    params_dtype: str = "float32"  # float32 | bfloat16 | float16
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    qk_layernorm: bool = False  # per-head norm (kind = normalization) of q and k before RoPE (Qwen3)
    rope_scaling: str | None = None  # None | "llama3" (Llama-3.1 frequency scaling) | "linear" (positions / factor)
    #                                  | "yarn" (megatron-core's position_embedding_type='yarn')
    rope_scaling_factor: float = 1.0
    rope_low_freq_factor: float = 1.0  # llama3 only
    rope_high_freq_factor: float = 4.0  # llama3 only
    rope_original_max_position_embeddings: int = 8192  # llama3 and yarn: the context the model was trained at
    # YaRN only, megatron-core's names and defaults; the attention factor is derived from them by megatron-core's
    # rule (`yarn_attention_factor`)
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_mscale: float = 1.0
    yarn_mscale_all_dim: float = 0.0
    yarn_correction_range_round_to_int: bool = True  # transformers' `truncate`
    # Mixture of experts (every layer's MLP is routed; None = a dense model). Megatron's router: top-k over the
    # logits, softmax over the k chosen (= HF Mixtral / Qwen3-MoE with norm_topk_prob). Expert parallelism is a
    # layout (like TP / PP), not a field: see `check_parallel`.
    num_experts: int | None = None
    moe_ffn_hidden_size: int | None = None  # each expert's width; None = ffn_hidden_size (Megatron's default)
    moe_router_topk: int = 2  # experts per token
    # DeepSeek-V3 architecture (megatron-core's MLA and DeepSeek MoE); the defaults are the other families'.
    # Multi-latent attention when kv_lora_rank is set: q (through a q_lora_rank latent, or directly when None)
    # and k/v from a shared kv_lora_rank latent; each head's q/k is qk_nope_head_dim + qk_rope_head_dim wide
    # (Megatron's qk_head_dim / qk_pos_emb_head_dim), its v v_head_dim.
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    # DeepSeek MoE: shared experts (their total width), sigmoid scores with an aux-loss-free expert bias,
    # a scale on the routed probabilities, group-limited top-k, and which layers are MoE (Megatron's
    # moe_layer_freq: every N-th layer, or a 0/1 per layer; HF first_k_dense_replace is [0]*k + [1]*(L-k)).
    moe_shared_expert_intermediate_size: int | None = None
    moe_router_score_function: str = "softmax"  # softmax | sigmoid
    moe_router_enable_expert_bias: bool = False  # `mlp.router.expert_bias` [E] fp32, added to scores for choice only
    moe_router_topk_scaling_factor: float | None = None  # HF routed_scaling_factor
    moe_router_num_groups: int | None = None  # HF n_group
    moe_router_group_topk: int | None = None  # HF topk_group
    moe_layer_freq: int | tuple[int, ...] = 1
    mtp_num_layers: int | None = None  # multi-token prediction layers (`mtp.layers.K.*`); HF num_nextn_predict_layers
    # Sliding-window attention, megatron-core's `window_size` left size: a query at position i attends to keys
    # i - window_size .. i (window_size + 1 keys; HF's `sliding_window` counts them, so it is window_size + 1).
    # None = full causal attention everywhere.
    window_size: int | None = None
    # Which layers the window applies to (megatron-core's list form of `window_attn_skip_freq`): one entry per
    # layer, 1 = windowed, 0 = full attention; None = every layer windowed.
    window_pattern: tuple[int, ...] | None = None
    # Gemma's block (Megatron-Bridge's Gemma providers): every norm scales by (1 + w) (megatron-core's
    # layernorm_zero_centered_gamma; the stored weight is HF's), a norm after attention and after the MLP
    # (`linear_proj.post_layernorm`, `linear_fc2.post_layernorm`), the embedding multiplied by sqrt(hidden), the
    # attention scores multiplied by softmax_scale (None: 1/sqrt(head_dim)), tanh soft-capping of the attention
    # scores and of the final logits (cap · tanh(x / cap); None: none), and the windowed layers roped with their
    # own base, unscaled (None: every layer ropes alike)
    norm_zero_centered: bool = False
    sandwich_norms: bool = False
    scale_embeddings: bool = False
    softmax_scale: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    rotary_base_local: float | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    # ---- derived -------------------------------------------------------------------------------
    def __post_init__(self) -> None:
        # canonical form: defaults are stored as None so equal models compare equal
        # (MLA computes with its own head widths; megatron-core's MLA never reads kv_channels)
        if self.kv_channels is not None and (self.kv_channels * self.num_attention_heads == self.hidden_size
                                             or self.kv_lora_rank is not None):
            object.__setattr__(self, "kv_channels", None)
        if self.num_query_groups == self.num_attention_heads:
            object.__setattr__(self, "num_query_groups", None)
        if self.add_bias_linear and self.add_qkv_bias:  # the qkv bias is already there
            object.__setattr__(self, "add_qkv_bias", False)
        if self.position_embedding_type != "rope":  # rotary fields mean nothing without rope
            object.__setattr__(self, "rotary_base", 10000.0)
            object.__setattr__(self, "rotary_percent", 1.0)
            object.__setattr__(self, "rotary_interleaved", False)
            object.__setattr__(self, "rope_scaling", None)
        if self.rope_scaling is None:
            object.__setattr__(self, "rope_scaling_factor", 1.0)
        if self.rope_scaling != "llama3":  # the llama3 band constants mean nothing to other scalings
            for name, default in _LLAMA3_BAND_DEFAULTS.items():
                if not (self.rope_scaling == "yarn" and name == "rope_original_max_position_embeddings"):
                    object.__setattr__(self, name, default)
        if self.rope_scaling != "yarn":
            for name, default in _YARN_DEFAULTS.items():
                object.__setattr__(self, name, default)
        if self.num_experts is None:  # the MoE fields mean nothing to a dense model
            object.__setattr__(self, "moe_ffn_hidden_size", None)
            object.__setattr__(self, "moe_router_topk", 2)
            for name, default in _DEEPSEEK_MOE_DEFAULTS.items():
                object.__setattr__(self, name, default)
        elif self.moe_ffn_hidden_size == self.ffn_hidden_size:
            object.__setattr__(self, "moe_ffn_hidden_size", None)
        if isinstance(self.moe_layer_freq, list):  # frozen and hashable
            object.__setattr__(self, "moe_layer_freq", tuple(self.moe_layer_freq))
        if self.kv_lora_rank is None:  # the MLA sizes mean nothing to standard attention
            for name, default in _MLA_DEFAULTS.items():
                object.__setattr__(self, name, default)
        self._canonical_window()
        self.validate()

    def _canonical_window(self) -> None:
        """A pattern as a tuple of 0/1; every layer windowed is no pattern; no layer windowed is no window."""
        pattern = self.window_pattern
        if pattern is not None and not isinstance(pattern, tuple):
            pattern = tuple(pattern) if isinstance(pattern, (list, tuple)) else pattern
            object.__setattr__(self, "window_pattern", pattern)
        if isinstance(pattern, tuple) and all(type(v) in (int, bool) and v in (0, 1) for v in pattern):
            pattern = tuple(int(v) for v in pattern)
            object.__setattr__(self, "window_pattern", None if all(pattern) else pattern)
            if not any(pattern):
                object.__setattr__(self, "window_size", None)
        if self.window_size is None:
            object.__setattr__(self, "window_pattern", None)

    def validate(self) -> None:
        """Refuse specs that no format can hold; one line naming the field."""
        if self.normalization not in ("LayerNorm", "RMSNorm"):
            raise MConvertError(f"unsupported normalization {self.normalization!r} (LayerNorm or RMSNorm)")
        if self.activation not in ("gelu", "gelu_new", "swiglu", "geglu"):
            raise MConvertError(f"unsupported activation {self.activation!r} (gelu, gelu_new, swiglu or geglu)")
        for name in ("softmax_scale", "attn_logit_softcapping", "final_logit_softcapping", "rotary_base_local"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                                  or v <= 0):
                raise MConvertError(f"{name} must be a finite positive number or None, got {v!r}")
        if self.position_embedding_type not in ("learned_absolute", "rope"):
            raise MConvertError(f"unsupported position_embedding_type {self.position_embedding_type!r}")
        for name in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "vocab_size",
                     "max_position_embeddings", "make_vocab_size_divisible_by"):
            if getattr(self, name) <= 0:
                raise MConvertError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("kv_channels", "num_query_groups"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise MConvertError(f"{name} must be positive, got {getattr(self, name)}")
        if not (math.isfinite(self.norm_epsilon) and self.norm_epsilon > 0):
            raise MConvertError(f"norm_epsilon must be a small positive number, got {self.norm_epsilon}")
        if not 0 < self.rotary_percent <= 1:
            raise MConvertError(f"rotary_percent must be in (0, 1], got {self.rotary_percent}")
        self._validate_rope_scaling()
        self._validate_moe()
        self._validate_deepseek()
        self._validate_window()
        if self.sandwich_norms and (self.is_moe or self.is_mla):
            raise MConvertError("sandwich_norms (Gemma's post-attention and post-MLP norms) with mixture of experts or "
                                "multi-latent attention is not mapped; drop one")
        # MLA's head widths are its own (qk_nope/qk_rope/v_head_dim): GLM-4.7-Flash has 2048 wide, 20 heads
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads and not self.is_mla:
            raise MConvertError(
                f"hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                f"{self.num_attention_heads}; set kv_channels"
            )
        if self.num_attention_heads % self.num_groups:
            raise MConvertError(
                f"num_attention_heads {self.num_attention_heads} is not divisible by "
                f"num_query_groups {self.num_groups}"
            )

    def _validate_moe(self) -> None:
        """Refuse an expert count, width or top-k that is not a positive whole number, or a top-k above the count."""
        if self.num_experts is None:
            return
        for name in ("num_experts", "moe_ffn_hidden_size", "moe_router_topk"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
                raise MConvertError(f"{name} must be a positive whole number, got {v!r}")
        if self.moe_router_topk > self.num_experts:
            raise MConvertError(f"moe_router_topk {self.moe_router_topk} exceeds num_experts {self.num_experts}")

    def _validate_deepseek(self) -> None:
        """Refuse MLA sizes, DeepSeek router settings, an MoE layer pattern or MTP depth that megatron-core cannot
        build; one line naming the field."""
        def whole(name: str, v: Any, minimum: int = 1) -> None:
            if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
                raise MConvertError(f"{name} must be a whole number >= {minimum}, got {v!r}")

        if self.is_mla:
            for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
                whole(name, getattr(self, name))
            if self.q_lora_rank is not None:
                whole("q_lora_rank", self.q_lora_rank)
            if self.qk_rope_head_dim % 2:
                raise MConvertError(f"qk_rope_head_dim must be even (rope rotates pairs), got {self.qk_rope_head_dim}")
            if (self.position_embedding_type != "rope" or self.rope_scaling not in (None, "yarn")
                    or self.rotary_percent != 1):
                raise MConvertError("multi-latent attention rotates qk_rope_head_dim with plain rope or YaRN "
                                    "(position_embedding_type='rope', rotary_percent 1, rope_scaling None or 'yarn'); "
                                    f"this model has {self.position_embedding_type!r}, rotary_percent "
                                    f"{self.rotary_percent}, rope_scaling {self.rope_scaling!r}")
            if self.rope_scaling == "yarn" and not self.yarn_correction_range_round_to_int:
                raise MConvertError("multi-latent attention with yarn_correction_range_round_to_int=False: "
                                    "megatron-core's MLA always rounds YaRN's correction range")
            if self.rotary_interleaved:
                raise MConvertError("multi-latent attention with rotary_interleaved=True is not megatron-core's MLA "
                                    "(it de-interleaves the rope dims itself); set rotary_interleaved False")
            if self.add_bias_linear or self.add_qkv_bias or self.qk_layernorm:
                raise MConvertError("multi-latent attention has no linear biases and no per-head q/k norm (its "
                                    "latent norms are part of it); set add_bias_linear, add_qkv_bias and "
                                    "qk_layernorm False")
        elif self.q_lora_rank is not None:
            raise MConvertError(f"q_lora_rank={self.q_lora_rank} without kv_lora_rank: multi-latent attention "
                                "needs kv_lora_rank")
        if self.mtp_num_layers is not None:
            whole("mtp_num_layers", self.mtp_num_layers)
        if self.window_size is not None and (self.is_mla or self.mtp_num_layers is not None):
            raise MConvertError(f"window_size={self.window_size} (sliding-window attention) with multi-latent "
                                "attention or MTP layers is not mapped; drop window_size or use standard attention")
        if not self.is_moe:
            return
        if self.moe_router_score_function not in ("softmax", "sigmoid"):
            raise MConvertError(f"unsupported moe_router_score_function {self.moe_router_score_function!r} "
                                "(softmax or sigmoid)")
        if self.moe_shared_expert_intermediate_size is not None:
            whole("moe_shared_expert_intermediate_size", self.moe_shared_expert_intermediate_size)
        f = self.moe_router_topk_scaling_factor
        if f is not None and (isinstance(f, bool) or not isinstance(f, (int, float)) or not math.isfinite(f)
                              or f <= 0):
            raise MConvertError(f"moe_router_topk_scaling_factor must be a finite positive number, got {f!r}")
        groups, group_topk = self.moe_router_num_groups, self.moe_router_group_topk
        if (groups is None) != (group_topk is None):
            raise MConvertError("moe_router_num_groups and moe_router_group_topk go together (group-limited "
                                f"routing); got {groups!r} and {group_topk!r}")
        if groups is not None:
            whole("moe_router_num_groups", groups)
            whole("moe_router_group_topk", group_topk)
            if self.num_experts % groups or group_topk > groups:  # type: ignore[operator]
                raise MConvertError(f"moe_router_num_groups={groups} must divide num_experts={self.num_experts} "
                                    f"and be at least moe_router_group_topk={group_topk}")
            if self.moe_router_topk % group_topk or self.moe_router_topk > group_topk * (self.num_experts // groups):  # type: ignore[operator]
                raise MConvertError(f"moe_router_topk={self.moe_router_topk} must be a multiple of "
                                    f"moe_router_group_topk={group_topk} and fit in the chosen groups")
        freq = self.moe_layer_freq
        if isinstance(freq, tuple):
            if len(freq) != self.num_layers or any(v not in (0, 1) or isinstance(v, bool) for v in freq):
                raise MConvertError(f"moe_layer_freq must be one 0/1 per layer ({self.num_layers}), got {list(freq)}")
            if not any(freq):
                raise MConvertError("moe_layer_freq marks no layer as MoE; drop num_experts for a dense model")
        else:
            whole("moe_layer_freq", freq)
    def _validate_window(self) -> None:
        """Refuse a window that is not a whole number >= 0, or a pattern that is not one 0/1 per layer."""
        w = self.window_size
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 0):
            raise MConvertError(f"window_size must be a whole number >= 0 (keys before the query), got {w!r}")
        p = self.window_pattern
        if p is not None and (not isinstance(p, tuple) or len(p) != self.num_layers
                              or any(v not in (0, 1) for v in p)):
            raise MConvertError(f"window_pattern must give 1 (windowed) or 0 (full attention) for each of the "
                                f"{self.num_layers} layers, got {p!r}")

    def _validate_rope_scaling(self) -> None:
        """Refuse an unknown scaling type or a factor that is not a finite number of the right range."""
        if self.rope_scaling not in ROPE_SCALINGS:
            raise MConvertError(
                f"unsupported rope_scaling {self.rope_scaling!r} (supported: {', '.join(map(str, ROPE_SCALINGS))})"
            )
        for name in ("rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor",
                     "rope_original_max_position_embeddings"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise MConvertError(f"{name} must be a finite positive number, got {v!r}")
        if self.rope_scaling is not None and self.rope_scaling_factor < 1:
            raise MConvertError(f"rope_scaling_factor must be >= 1 (it stretches positions), got "
                                f"{self.rope_scaling_factor}")
        if self.rope_scaling == "llama3":
            if self.rope_high_freq_factor <= self.rope_low_freq_factor:
                raise MConvertError(
                    f"rope_high_freq_factor {self.rope_high_freq_factor} must exceed rope_low_freq_factor "
                    f"{self.rope_low_freq_factor} (the llama3 band between them is interpolated)"
                )
        if self.rope_scaling in ("llama3", "yarn"):
            if self.rope_original_max_position_embeddings != int(self.rope_original_max_position_embeddings):
                raise MConvertError(f"rope_original_max_position_embeddings must be a whole number, got "
                                    f"{self.rope_original_max_position_embeddings}")
        if self.rope_scaling == "yarn":
            self._validate_yarn()

    def _validate_yarn(self) -> None:
        """Refuse YaRN settings megatron-core cannot compute: zero or negative betas (it divides by them), a
        partial or interleaved rotary (its YaRN rotates the whole head, rotate-half style)."""
        # a negative mscale is an attention factor below 1; mscale_all_dim >= 0 keeps the divisor >= 1
        for name in ("yarn_beta_fast", "yarn_beta_slow", "yarn_mscale", "yarn_mscale_all_dim"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or (
                    v < 0 and name != "yarn_mscale"):
                raise MConvertError(f"{name} must be a finite number{'' if name == 'yarn_mscale' else ' >= 0'}, "
                                    f"got {v!r}")
        for name in ("yarn_beta_fast", "yarn_beta_slow"):
            if getattr(self, name) == 0:
                raise MConvertError(f"{name} must be positive (YaRN divides by it), got 0")
        if not isinstance(self.yarn_correction_range_round_to_int, bool):
            raise MConvertError(f"yarn_correction_range_round_to_int must be true or false, got "
                                f"{self.yarn_correction_range_round_to_int!r}")
        if self.rotary_percent != 1.0:
            raise MConvertError(f"rope_scaling='yarn' with rotary_percent={self.rotary_percent}: megatron-core's YaRN "
                                "rotates the whole head (it ignores rotary_percent); conversion refused")
        if self.rotary_interleaved:
            raise MConvertError("rope_scaling='yarn' with rotary_interleaved=True: megatron-core's YaRN rotates "
                                "halves only; conversion refused")

    def refuse_unmapped(self, target: str, source: str = "", states: tuple[str, ...] = ()) -> None:
        """Refuse, naming the field (and `source`, the checkpoint), the features `target` cannot state.

        `FEATURE_TARGETS` says which targets state each feature, `states` the features this family's form of
        the target states besides (llama.cpp's gemma2 / gemma3 architectures: the window and the Gemma block);
        the target's family writer still refuses what its own class cannot compute (a llama with qk-norm for HF,
        say)."""
        where = f"{source}: " if source else ""
        present = {
            "rope_scaling": self.rope_scaling is not None and (
                f"rope_scaling={self.rope_scaling!r} (factor {self.rope_scaling_factor:g}; "
                f"{_megatron_scaling_args(self)})"),
            "qk_layernorm": self.qk_layernorm and "qk_layernorm=True (per-head q/k norm)",
            "moe": self.is_moe and f"num_experts={self.num_experts} (mixture of experts)",
            "window": self.window_masks and self.window_description(),
            "gemma": self.gemma_features() and f"the Gemma block ({', '.join(self.gemma_features())})",
        }
        for feature, what in present.items():
            if what and target not in FEATURE_TARGETS[feature] and feature not in states:
                fix = ("; pass --accept-window-as-full to write it with full attention, which agrees with the model "
                       f"only on sequences of up to {self.window_size + 1} tokens") if feature == "window" else ""
                raise MConvertError(f"{where}{what} is not mapped to {target}; conversion refused (reshard and "
                                    f"validate handle the Megatron checkpoint){fix}")

    # ---- sliding window --------------------------------------------------------------------------
    def window_as_full(self, target: str, accept: bool,
                       states: tuple[str, ...] = ()) -> tuple["ModelSpec", str | None]:
        """For a target that has no window: with `accept` (--accept-window-as-full) the model as the target runs
        it, full attention, and the note its report carries; else this spec (whose refusal names the window).
        `states`: as for `refuse_unmapped`."""
        if not (accept and self.window_masks and target not in FEATURE_TARGETS["window"] and "window" not in states):
            return self, None
        return self.replace(window_size=None), (
            f"{self.window_description()} written as full attention for {target} (--accept-window-as-full): it "
            f"agrees with the model only on sequences of up to {self.window_size + 1} tokens")

    def layer_window(self, layer: int) -> int | None:
        """The window (megatron-core's left size) of layer `layer` (global index), None for full attention."""
        if self.window_size is None or (self.window_pattern is not None and not self.window_pattern[layer]):
            return None
        return self.window_size

    @property
    def windowed_layers(self) -> list[int]:
        """The global indices of the layers that attend through the window."""
        return [i for i in range(self.num_layers) if self.layer_window(i) is not None]

    @property
    def window_masks(self) -> bool:
        """Whether the window masks any key within the context (a window covering the context is full
        attention for every sequence the model takes)."""
        return self.window_size is not None and self.window_size + 1 < self.max_position_embeddings

    def window_description(self) -> str:
        """The window in both spellings, for messages and reports."""
        layers = ("every layer" if self.window_pattern is None else
                  f"layers {', '.join(map(str, self.windowed_layers))} of {self.num_layers}")
        return (f"sliding-window attention (window_size=({self.window_size}, 0), HF sliding_window="
                f"{self.window_size + 1}, on {layers})" if self.window_size is not None else "full attention")

    @property
    def yarn_attention_factor(self) -> float:
        """The number YaRN multiplies cos and sin by (megatron-core's rule over factor, mscale, mscale_all_dim)."""
        return megatron_attention_factor(self.rope_scaling_factor, self.yarn_mscale, self.yarn_mscale_all_dim)

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def num_groups(self) -> int:
        """Query groups (KV heads); equals the head count for MHA."""
        return self.num_query_groups or self.num_attention_heads

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None

    def deepseek_features(self) -> dict[str, Any]:
        """The DeepSeek-V3 architecture features this model uses, under Megatron-LM's arg names (empty for the
        other families' architectures): what a family must state to hold the model."""
        values = {k: getattr(self, k) for k in _DEEPSEEK_ARGS if hasattr(self, k)}
        return deepseek_features({**values, "multi_latent_attention": self.is_mla})

    @property
    def is_mla(self) -> bool:
        """Multi-latent attention (DeepSeek-V2/V3) instead of fused QKV."""
        return self.kv_lora_rank is not None

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer `layer` (global index; `num_layers` and above: the MTP layers, built as the last
        decoder layer) routes its MLP over experts (megatron-core's moe_layer_freq rule)."""
        if not self.is_moe:
            return False
        freq = self.moe_layer_freq
        layer = min(layer, self.num_layers - 1)
        return bool(freq[layer]) if isinstance(freq, tuple) else layer % freq == 0

    @property
    def num_moe_layers(self) -> int:
        """How many decoder layers are MoE (megatron-core's moe_layer_freq rule, counted without a loop over
        the layers when it is an every-N-th)."""
        if not self.is_moe:
            return 0
        freq = self.moe_layer_freq
        return sum(freq) if isinstance(freq, tuple) else -(-self.num_layers // freq)

    @property
    def expert_ffn_hidden_size(self) -> int:
        """One expert's MLP width (Megatron's moe_ffn_hidden_size, defaulting to ffn_hidden_size)."""
        return self.moe_ffn_hidden_size or self.ffn_hidden_size

    @property
    def gated(self) -> bool:
        """fc1 holds [gate; up] (SwiGLU, GeGLU)."""
        return self.activation in ("swiglu", "geglu")

    def gemma_features(self) -> list[str]:
        """The Gemma block's fields this model sets, as Megatron args `name=value` (empty for the other families'
        blocks)."""
        out = [f"{_GEMMA_ARG_NAMES.get(k, k)}={getattr(self, k)!r}" for k, v in _GEMMA_DEFAULTS.items()
               if getattr(self, k) != v]
        return (["gated_linear_unit=True (GeGLU)"] if self.activation == "geglu" else []) + out

    @property
    def attention_scale(self) -> float:
        """What attention multiplies q·k by: softmax_scale, else 1/sqrt(head_dim)."""
        return self.softmax_scale if self.softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)

    def layer_rotary_base(self, layer: int) -> tuple[float, bool]:
        """Layer `layer`'s rope base and whether the rope scaling applies to it: the windowed layers of a model
        with rotary_base_local rope with that base, unscaled (Gemma 3's local layers)."""
        if self.rotary_base_local is not None and self.layer_window(layer) is not None:
            return self.rotary_base_local, False
        return self.rotary_base, True

    @property
    def has_qkv_bias(self) -> bool:
        return self.add_bias_linear or self.add_qkv_bias

    @property
    def qkv_rows(self) -> int:
        return (self.num_attention_heads + 2 * self.num_groups) * self.head_dim

    def padded_vocab_size(self, tp: int = 1) -> int:
        """Megatron's `_vocab_size_with_padding`: round up to a multiple of divisible_by · TP."""
        multiple = self.make_vocab_size_divisible_by * tp
        return int(math.ceil(self.vocab_size / multiple) * multiple)

    def num_parameters(self) -> int:
        """Parameter count (padded vocab at TP=1, buffers left out): every MoE layer has the shapes of any other,
        every dense layer too, and every expert expert 0's, so the count is arithmetic in layers and experts."""
        def count(decls: list[ParamDecl]) -> int:
            return sum(math.prod(p.shape) for p in decls if not is_buffer(p.name))

        experts = self.num_experts * count(self.expert_params(0, 0)) if self.is_moe else 0  # type: ignore[operator]
        moe_layer = count(self._block_params("", 0, True, False, None)) + experts if self.is_moe else 0
        dense_layer = count(self._block_params("", 0, False, False, None))
        n_moe = self.num_moe_layers
        total = n_moe * moe_layer + (self.num_layers - n_moe) * dense_layer
        if self.mtp_num_layers:  # each MTP layer's transformer layer is built as the last decoder layer
            last = self.num_layers
            total += self.mtp_num_layers * (count(self.mtp_params(0, experts=False))
                                            + (experts if self.is_moe_layer(last) else 0))
        return total + count(self.embedding_params(1) + self.final_params(1, mtp=False))

    def check_parallel(self, tp: int = 1, pp: int = 1, vpp: int | None = None, ep: int = 1,
                       layers: bool = True) -> None:
        """Refuse a TP/PP/EP that does not divide heads, groups, ffn, layers or experts (`layers=False`: an
        uneven pipeline split, checked where it is built)."""
        if tp < 1 or pp < 1 or ep < 1:
            raise MConvertError(f"--tp, --pp and --ep must be >= 1 (got tp={tp}, pp={pp}, ep={ep})")
        if ep > 1 and not self.is_moe:
            raise MConvertError(f"EP={ep} needs a mixture-of-experts model; this {self.family} model is dense: use --ep 1")
        if self.is_moe and self.num_experts % ep:  # type: ignore[operator]
            raise MConvertError(f"EP={ep} does not divide num_experts={self.num_experts}; pick an EP that does")
        if self.is_moe and self.expert_ffn_hidden_size % tp:
            raise MConvertError(f"TP={tp} does not divide moe_ffn_hidden_size={self.expert_ffn_hidden_size}; "
                                "pick a TP that does")
        if self.num_attention_heads % tp:
            raise MConvertError(
                f"TP={tp} does not divide num_attention_heads={self.num_attention_heads}; pick a TP that does"
            )
        if self.num_groups % tp and tp % self.num_groups:
            raise MConvertError(
                f"TP={tp} and num_query_groups={self.num_groups}: one must divide the other; pick such a TP"
            )
        for name, rows in self._mla_split_rows().items():
            if rows % tp:
                raise MConvertError(f"TP={tp} does not divide {name}={rows} (megatron-core's local spec splits "
                                    "multi-latent attention's down projection over TP); pick a TP that does")
        if self.moe_shared_expert_intermediate_size is not None and self.moe_shared_expert_intermediate_size % tp:
            raise MConvertError(f"TP={tp} does not divide moe_shared_expert_intermediate_size="
                                f"{self.moe_shared_expert_intermediate_size}; pick a TP that does")
        if not self.is_mla and self.qkv_rows % tp:  # groups < TP: a group straddles ranks, the fused rows must still split evenly
            raise MConvertError(
                f"TP={tp} does not divide the {self.qkv_rows} fused QKV rows (heads={self.num_attention_heads}, "
                f"groups={self.num_groups}, head_dim={self.head_dim}); pick a TP that divides num_query_groups"
            )
        if self.ffn_hidden_size % tp:
            raise MConvertError(
                f"TP={tp} does not divide ffn_hidden_size={self.ffn_hidden_size}; pick a TP that does"
            )
        chunks = pp * (vpp or 1)
        if layers and self.num_layers % chunks:
            raise MConvertError(
                f"PP={pp}" + (f"×VPP={vpp}" if vpp else "") + f" does not divide num_layers={self.num_layers}; "
                "pick a PP that does"
            )

    def _mla_split_rows(self) -> dict[str, int]:
        """The latent widths TP splits in megatron-core's local spec (empty without multi-latent attention)."""
        if not self.is_mla:
            return {}
        out = {"kv_lora_rank + qk_rope_head_dim": (self.kv_lora_rank or 0) + self.qk_rope_head_dim}
        if self.q_lora_rank is not None:
            out["q_lora_rank"] = self.q_lora_rank
        return out

    # ---- the split declarations ----------------------------------------------------------------
    def layer_params(self, layer: int, experts: bool = True) -> list[ParamDecl]:
        """The parameters of one transformer layer (global index), full shapes; without `experts`, an MoE
        layer's dense part only (attention, norms, router)."""
        return self._block_params(f"decoder.layers.{layer}.", layer, self.is_moe_layer(layer), experts, layer)

    def _block_params(self, p: str, layer: int, moe: bool, experts: bool, tag: int | None) -> list[ParamDecl]:
        """One transformer layer's declarations under prefix `p` (a decoder layer, or an MTP layer's
        `transformer_layer`); `tag` is the ParamDecl's layer."""
        H, F, hd, nh = self.hidden_size, self.ffn_hidden_size, self.head_dim, self.num_attention_heads
        out: list[ParamDecl] = []

        def add(name: str, kind: str, *shape: int) -> None:
            out.append(ParamDecl(p + name, kind, tuple(shape), tag))

        ln_bias = self.normalization == "LayerNorm"
        add("input_layernorm.weight", "replicated", H)
        if ln_bias:
            add("input_layernorm.bias", "replicated", H)
        if self.is_mla:
            out += [ParamDecl(p + d.name, d.kind, d.shape, tag) for d in self.mla_params()]
        else:
            add("self_attention.linear_qkv.weight", "qkv", self.qkv_rows, H)
            if self.has_qkv_bias:
                add("self_attention.linear_qkv.bias", "qkv", self.qkv_rows)
            if self.qk_layernorm:  # one [head_dim] norm shared by every head, so every TP rank holds all of it
                for qk in ("q_layernorm", "k_layernorm"):
                    add(f"self_attention.{qk}.weight", "replicated", hd)
                    if ln_bias:
                        add(f"self_attention.{qk}.bias", "replicated", hd)
            add("self_attention.linear_proj.weight", "row", H, nh * hd)
        if self.add_bias_linear:
            add("self_attention.linear_proj.bias", "replicated", H)
        if self.sandwich_norms:  # on the attention output, before the residual add
            add("self_attention.linear_proj.post_layernorm.weight", "replicated", H)
        add("pre_mlp_layernorm.weight", "replicated", H)
        if ln_bias:
            add("pre_mlp_layernorm.bias", "replicated", H)
        fc1_kind = "gated" if self.gated else "column"
        if moe:  # router (every rank holds it), then each expert's MLP split over TP like a dense one
            add("mlp.router.weight", "replicated", self.num_experts, H)  # type: ignore[arg-type]
            if self.moe_router_enable_expert_bias:  # an fp32 buffer, updated outside the optimizer
                add("mlp.router.expert_bias", "replicated", self.num_experts)  # type: ignore[arg-type]
            if self.moe_shared_expert_intermediate_size is not None:  # a dense MLP beside the experts
                S = self.moe_shared_expert_intermediate_size
                add("mlp.shared_experts.linear_fc1.weight", fc1_kind, 2 * S if self.gated else S, H)
                add("mlp.shared_experts.linear_fc2.weight", "row", H, S)
            for e in range(self.num_experts if experts else 0):  # type: ignore[arg-type]
                out += self.expert_params(layer, e, prefix=p, tag=tag)
            return out
        fc1_rows = 2 * F if self.gated else F
        add("mlp.linear_fc1.weight", fc1_kind, fc1_rows, H)
        if self.add_bias_linear:
            add("mlp.linear_fc1.bias", fc1_kind, fc1_rows)
        add("mlp.linear_fc2.weight", "row", H, F)
        if self.add_bias_linear:
            add("mlp.linear_fc2.bias", "replicated", H)
        if self.sandwich_norms:  # on the MLP output, before the residual add
            add("mlp.linear_fc2.post_layernorm.weight", "replicated", H)
        return out

    def mla_params(self) -> list[ParamDecl]:
        """Multi-latent attention's parameters (names under `self_attention.`, megatron-core's local spec): the
        down projections are column-split there (each rank computes a slice of the latent, then all-gathers it;
        the Transformer Engine spec keeps them whole on every rank), the up projections split by head. In the
        order megatron-core registers them (`MultiLatentAttention` makes linear_proj, then `MLASelfAttention` the
        projections and last the latent norms), which is its rank files' key order."""
        H, nh, r = self.hidden_size, self.num_attention_heads, self.qk_rope_head_dim
        q_head = self.qk_nope_head_dim + r
        a = "self_attention."
        kv = self.kv_lora_rank or 0
        out = [ParamDecl(a + "linear_proj.weight", "row", (H, nh * self.v_head_dim))]
        if self.q_lora_rank is None:
            out.append(ParamDecl(a + "linear_q_proj.weight", "column", (nh * q_head, H)))
        else:
            out += [ParamDecl(a + "linear_q_down_proj.weight", "column", (self.q_lora_rank, H)),
                    ParamDecl(a + "linear_q_up_proj.weight", "column", (nh * q_head, self.q_lora_rank))]
        out += [
            ParamDecl(a + "linear_kv_down_proj.weight", "column", (kv + r, H)),  # rows: the latent, then k's rope part
            ParamDecl(a + "linear_kv_up_proj.weight", "column", (nh * (self.qk_nope_head_dim + self.v_head_dim), kv)),
        ]
        if self.q_lora_rank is not None:
            out.append(ParamDecl(a + "q_layernorm.weight", "replicated", (self.q_lora_rank,)))
        return out + [ParamDecl(a + "kv_layernorm.weight", "replicated", (kv,))]

    def layer_template(self, layer: int | None = None) -> list[ParamDecl]:
        """A layer's parameters with expert 0 standing for every routed expert (each has its shapes): what a
        table of shapes by name template needs, built in a time that does not grow with num_experts, so a
        config claiming a million experts is refused on the router's shape before anything loops over them.
        Without `layer`, the first dense layer's and the first MoE layer's together (an MoE layer pattern mixes
        both, under the same layer-index template)."""
        if layer is not None:
            return self.layer_params(layer, experts=False) + (
                self.expert_params(layer, 0) if self.is_moe_layer(layer) else [])
        return [d for i in self._first_layers() for d in self.layer_template(i)]

    def _first_layers(self) -> list[int]:
        """The first dense layer and the first MoE layer, where there are (no loop over the layers)."""
        if not self.is_moe:
            return [0]
        freq = self.moe_layer_freq
        if isinstance(freq, tuple):
            return sorted({freq.index(v) for v in set(freq)})
        return [0] if freq == 1 or self.num_layers == 1 else [0, 1]

    def expert_params(self, layer: int, expert: int, prefix: str | None = None,
                      tag: int | None = -1) -> list[ParamDecl]:
        """The parameters of one routed expert (global index) of an MoE layer: its MLP, split over TP like a
        dense one (`prefix`: another layer's, e.g. an MTP layer's `transformer_layer.`)."""
        H, F = self.hidden_size, self.expert_ffn_hidden_size
        fc1_kind, fc1_rows = ("gated", 2 * F) if self.gated else ("column", F)
        x = (prefix or f"decoder.layers.{layer}.") + f"mlp.experts.local_experts.{expert}."
        at = layer if tag == -1 else tag
        out = [ParamDecl(x + "linear_fc1.weight", fc1_kind, (fc1_rows, H), at, expert)]
        if self.add_bias_linear:
            out.append(ParamDecl(x + "linear_fc1.bias", fc1_kind, (fc1_rows,), at, expert))
        out.append(ParamDecl(x + "linear_fc2.weight", "row", (H, F), at, expert))
        if self.add_bias_linear:
            out.append(ParamDecl(x + "linear_fc2.bias", "replicated", (H,), at, expert))
        return out

    def mtp_params(self, k: int, experts: bool = True) -> list[ParamDecl]:
        """Multi-token prediction layer `k` (megatron-core's `mtp.layers.K.*`): norms of the next token's
        embedding and of the hidden state, their projection eh_proj [H, 2H] (column), one transformer layer
        (built as the last decoder layer), and its final norm; the embedding and the head are the model's."""
        H, p = self.hidden_size, f"mtp.layers.{k}."
        out = [ParamDecl(p + "enorm.weight", "replicated", (H,)), ParamDecl(p + "hnorm.weight", "replicated", (H,)),
               ParamDecl(p + "eh_proj.weight", "column", (H, 2 * H))]
        if self.normalization == "LayerNorm":
            out.insert(1, ParamDecl(p + "enorm.bias", "replicated", (H,)))
            out.append(ParamDecl(p + "hnorm.bias", "replicated", (H,)))
        last = self.num_layers + k
        out += self._block_params(p + "transformer_layer.", last, self.is_moe_layer(last), experts, None)
        out.append(ParamDecl(p + "final_layernorm.weight", "replicated", (H,)))
        if self.normalization == "LayerNorm":
            out.append(ParamDecl(p + "final_layernorm.bias", "replicated", (H,)))
        return out

    def embedding_params(self, tp: int = 1) -> list[ParamDecl]:
        out = [
            ParamDecl(
                "embedding.word_embeddings.weight", "vocab", (self.padded_vocab_size(tp), self.hidden_size)
            )
        ]
        if self.position_embedding_type == "learned_absolute":
            out.append(
                ParamDecl(
                    "embedding.position_embeddings.weight",
                    "replicated",
                    (self.max_position_embeddings, self.hidden_size),
                )
            )
        return out

    def final_params(self, tp: int = 1, mtp: bool = True) -> list[ParamDecl]:
        """The final norm, (with `mtp`) the MTP layers, whole, and the untied head: megatron-core's GPTModel
        registers its MTP block before the output layer."""
        H = self.hidden_size
        out = [ParamDecl("decoder.final_layernorm.weight", "replicated", (H,))]
        if self.normalization == "LayerNorm":
            out.append(ParamDecl("decoder.final_layernorm.bias", "replicated", (H,)))
        for k in range((self.mtp_num_layers or 0) if mtp else 0):
            out += self.mtp_params(k)
        if not self.tie_embeddings:
            out.append(ParamDecl("output_layer.weight", "vocab", (self.padded_vocab_size(tp), H)))
        return out

    def units(self, split_experts: bool = False) -> list[Unit]:
        """The conversion units in order: embedding, each layer, final. With `split_experts` an MoE layer is
        its dense part, then one unit per global expert (no unit then holds more than one expert)."""
        out: list[Unit] = ["embedding"]
        for i in range(self.num_layers):
            out += self.layer_units(i) if split_experts else [i]
        return out + ["final"]

    def layer_units(self, layer: int) -> list[Unit]:
        """Layer `layer` as the units it splits into: itself when dense, else its dense part and its experts."""
        if not self.is_moe_layer(layer):
            return [layer]
        return [LayerPart(layer, None), *(LayerPart(layer, e) for e in range(self.num_experts))]  # type: ignore[arg-type]

    def unit_params(self, unit: Unit) -> list[ParamDecl]:
        """The parameters of one unit (full shapes), in declared order."""
        if unit == "embedding":
            return self.embedding_params()
        if unit == "final":
            return self.final_params()
        if isinstance(unit, LayerPart):
            if unit.expert is None:
                return self.layer_params(unit.layer, experts=False)
            return self.expert_params(unit.layer, unit.expert)
        return self.layer_params(int(unit))  # type: ignore[arg-type]

    def params(self, tp: int = 1) -> list[ParamDecl]:
        """Every parameter of the full model in order: embedding, layers, final norm (and untied head).

        Vocab-split shapes are padded for `tp`."""
        out = self.embedding_params(tp)
        for i in range(self.num_layers):
            out += self.layer_params(i)
        return out + self.final_params(tp)

    def split_kind(self, name: str) -> str:
        """Split kind of a canonical parameter name (any layer index)."""
        for decl in self._decls_by_template():
            if name_template(name) == decl[0]:
                return decl[1]
        raise MConvertError(f"no split declaration for parameter {name!r}")

    def _decls_by_template(self) -> list[tuple[str, str]]:
        # every expert has expert 0's template and kind; dense and MoE layers each their own (no loop over layers)
        decls = self.embedding_params() + self.layer_template() + self.final_params()
        if self.tie_embeddings:  # the last stage's copy of the embedding, when PP > 1
            decls.append(ParamDecl("output_layer.weight", "vocab", ()))
        return [(name_template(d.name), d.kind) for d in decls]

    # ---- Megatron args -------------------------------------------------------------------------
    def to_megatron_args(
        self, tp: int = 1, pp: int = 1, vpp: int | None = None, ep: int = 1, **extra: Any
    ) -> argparse.Namespace:
        """A Namespace with Megatron-LM's own argument names (as stored in `model_optim_rng.pt['args']`)."""
        gqa = self.num_groups != self.num_attention_heads
        dtype = self.params_dtype
        ns = argparse.Namespace(
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            ffn_hidden_size=self.ffn_hidden_size,
            num_attention_heads=self.num_attention_heads,
            group_query_attention=gqa,
            num_query_groups=self.num_groups if gqa else 1,
            kv_channels=self.head_dim,
            max_position_embeddings=self.max_position_embeddings,
            seq_length=extra.pop("seq_length", self.max_position_embeddings),
            vocab_size=self.vocab_size,
            padded_vocab_size=self.padded_vocab_size(tp),
            make_vocab_size_divisible_by=self.make_vocab_size_divisible_by,
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=vpp,
            normalization=self.normalization,
            norm_epsilon=self.norm_epsilon,
            swiglu=self.activation == "swiglu",
            openai_gelu=self.activation in ("gelu_new", "geglu"),
            bias_gelu_fusion=False,  # fused is tanh GeLU: `openai_gelu` alone says which GeLU the model computes
            position_embedding_type=self.position_embedding_type,
            rotary_base=self.rotary_base,
            rotary_percent=self.rotary_percent,
            rotary_interleaved=self.rotary_interleaved,
            untie_embeddings_and_output_weights=not self.tie_embeddings,
            add_bias_linear=self.add_bias_linear,
            add_qkv_bias=self.add_qkv_bias,
            bf16=dtype == "bfloat16",
            fp16=dtype == "float16",
            params_dtype=str(torch_dtype(dtype)),
            apply_query_key_layer_scaling=False,
            attention_softmax_in_fp32=True,
            transformer_impl="local",
            ckpt_format="torch",
            model_family=self.family,  # mconvert's own hint; Megatron ignores unknown args
        )
        # written only when used, so the args of a model without them stay as they are
        for k, v in self._rope_and_qk_megatron_args().items():
            setattr(ns, k, v)
        for k, v in self._deepseek_megatron_args().items():
            setattr(ns, k, v)
        for k, v in window_megatron_args(self).items():
            setattr(ns, k, v)
        for k, v in self._gemma_megatron_args().items():
            setattr(ns, k, v)
        if self.is_moe:
            ns.num_experts = self.num_experts
            ns.moe_ffn_hidden_size = self.expert_ffn_hidden_size
            ns.moe_router_topk = self.moe_router_topk
            ns.expert_model_parallel_size = ep
            ns.expert_tensor_parallel_size = tp
            ns.moe_token_dispatcher_type = "allgather"
            ns.moe_grouped_gemm = False
        for k, v in extra.items():
            setattr(ns, k, v)
        return ns

    def _gemma_megatron_args(self) -> dict[str, Any]:
        """The Gemma block's args (empty when unused): megatron-core's `gated_linear_unit`,
        `layernorm_zero_centered_gamma` and `softmax_scale`, Megatron-Bridge's soft-capping names, and
        mconvert's own `sandwich_norms`, `scale_embeddings`, `rotary_base_local` (the Bridge states them by its
        provider class and its (local, global) rotary_base pair)."""
        out: dict[str, Any] = {}
        if self.activation == "geglu":
            out["gated_linear_unit"] = True
        for name in _GEMMA_DEFAULTS:
            if getattr(self, name) != _GEMMA_DEFAULTS[name]:
                out[_GEMMA_ARG_NAMES.get(name, name)] = getattr(self, name)
        return out

    def _deepseek_megatron_args(self) -> dict[str, Any]:
        """Megatron-LM's args for MLA, the DeepSeek router, the MoE layer pattern and MTP (empty when unused).
        MLA's latent norms exist in megatron-core only with `qk_layernorm`; its rope is plain (`rope_type`)."""
        out: dict[str, Any] = {}
        if self.is_mla:
            out.update(multi_latent_attention=True, qk_layernorm=True, q_lora_rank=self.q_lora_rank,
                       kv_lora_rank=self.kv_lora_rank, qk_head_dim=self.qk_nope_head_dim,
                       qk_pos_emb_head_dim=self.qk_rope_head_dim, v_head_dim=self.v_head_dim, rope_type="rope",
                       rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=1.0)
            if self.rope_scaling == "yarn":  # MLATransformerConfig's names (Megatron-LM copies args by name)
                out["rope_type"] = "yarn"
                out.update({name: type(default)(getattr(self, f)) for f, (name, default) in MLA_YARN_ARG_NAMES.items()})
        if self.mtp_num_layers is not None:
            out["mtp_num_layers"] = self.mtp_num_layers
        if self.is_moe:
            out.update({k: getattr(self, k) for k, v in _DEEPSEEK_MOE_DEFAULTS.items() if getattr(self, k) != v})
            if isinstance(self.moe_layer_freq, tuple):  # Megatron-LM parses its string form into this list
                out["moe_layer_freq"] = list(self.moe_layer_freq)
        return out

    def _rope_and_qk_megatron_args(self) -> dict[str, Any]:
        """megatron-core's own args for qk-norm and rope scaling (empty when the model uses neither)."""
        out: dict[str, Any] = {}
        if self.qk_layernorm:
            out["qk_layernorm"] = True
        if self.rope_scaling == "llama3":
            bands = {name: getattr(self, name) for name in _LLAMA3_BAND_DEFAULTS}
            if bands != _LLAMA3_BAND_DEFAULTS:  # megatron-core hard-codes these three constants
                raise MConvertError(
                    "megatron-core's Llama-3 rope scaling fixes low_freq_factor 1, high_freq_factor 4 and "
                    f"original_max_position_embeddings 8192; this model has {bands}; Megatron cannot hold it"
                )
            out.update(use_rope_scaling=True, rope_scaling_factor=float(self.rope_scaling_factor))
        elif self.rope_scaling == "linear":
            out["rotary_seq_len_interpolation_factor"] = float(self.rope_scaling_factor)
        elif self.rope_scaling == "yarn" and not self.is_mla:  # Megatron-LM's names (arguments.py, argument_utils.py)
            out["position_embedding_type"] = "yarn"
            for field_name, (name, default) in YARN_ARG_NAMES.items():
                v = getattr(self, field_name)
                out[name] = v if isinstance(default, bool) else type(default)(v)
        return out

    def replace(self, **changes: Any) -> "ModelSpec":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """The fields as a dict; qk-norm and rope-scaling fields only when the model uses them."""
        d = dataclasses.asdict(self)
        d.pop("extra")
        unused = [] if self.qk_layernorm else ["qk_layernorm"]
        if self.rope_scaling is None:
            unused += ["rope_scaling", "rope_scaling_factor"]
        if self.rope_scaling != "llama3":
            unused += [n for n in _LLAMA3_BAND_DEFAULTS
                       if not (self.rope_scaling == "yarn" and n == "rope_original_max_position_embeddings")]
        if self.rope_scaling != "yarn":
            unused += list(_YARN_DEFAULTS)
        if not self.is_moe:
            unused += ["num_experts", "moe_ffn_hidden_size", "moe_router_topk"]
        unused += [k for k, v in _DEEPSEEK_MOE_DEFAULTS.items() if d[k] == v]
        unused += [] if self.is_mla else ["kv_lora_rank", *_MLA_DEFAULTS]
        unused += [] if self.mtp_num_layers is not None else ["mtp_num_layers"]
        if self.window_size is None:
            unused += ["window_size", "window_pattern"]
        unused += [k for k, v in _GEMMA_DEFAULTS.items() if d[k] == v]
        for name in unused:
            del d[name]
        return d


ROPE_SCALINGS = (None, "llama3", "linear", "yarn")
_GEMMA_DEFAULTS: dict[str, Any] = {
    "norm_zero_centered": False, "sandwich_norms": False, "scale_embeddings": False, "softmax_scale": None,
    "attn_logit_softcapping": None, "final_logit_softcapping": None, "rotary_base_local": None,
}
_GEMMA_ARG_NAMES = {"norm_zero_centered": "layernorm_zero_centered_gamma"}


def gemma_from_megatron_args(a: dict[str, Any]) -> dict[str, Any]:
    """ModelSpec kwargs for the Gemma block from the args `_gemma_megatron_args` writes (empty when unused)."""
    out: dict[str, Any] = {}
    for name in _GEMMA_DEFAULTS:
        v = a.get(_GEMMA_ARG_NAMES.get(name, name))
        if v is not None and v is not False:
            out[name] = v
    return out
_MLA_DEFAULTS: dict[str, Any] = {"q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                                 "v_head_dim": 128}
_DEEPSEEK_MOE_DEFAULTS: dict[str, Any] = {
    "moe_shared_expert_intermediate_size": None, "moe_router_score_function": "softmax",
    "moe_router_enable_expert_bias": False, "moe_router_topk_scaling_factor": None, "moe_router_num_groups": None,
    "moe_router_group_topk": None, "moe_layer_freq": 1,
}
_LLAMA3_BAND_DEFAULTS: dict[str, Any] = {
    "rope_low_freq_factor": 1.0, "rope_high_freq_factor": 4.0, "rope_original_max_position_embeddings": 8192,
}
_YARN_DEFAULTS: dict[str, Any] = {
    "yarn_beta_fast": 32.0, "yarn_beta_slow": 1.0, "yarn_mscale": 1.0, "yarn_mscale_all_dim": 0.0,
    "yarn_correction_range_round_to_int": True,
}


def _megatron_scaling_args(spec: ModelSpec) -> str:
    """How Megatron spells the spec's rope scaling, for messages."""
    if spec.rope_scaling == "llama3":
        return f"Megatron use_rope_scaling=True, rope_scaling_factor={spec.rope_scaling_factor:g}"
    if spec.rope_scaling == "yarn":
        return f"Megatron position_embedding_type='yarn', rotary_scaling_factor={spec.rope_scaling_factor:g}"
    return f"Megatron rotary_seq_len_interpolation_factor={spec.rope_scaling_factor:g}"


def rope_and_qk_from_megatron_args(a: dict[str, Any], source: str = "args") -> dict[str, Any]:
    """ModelSpec kwargs for qk-norm and rope scaling from megatron-core's args (`qk_layernorm`,
    `use_rope_scaling` + `rope_scaling_factor` with its hard-coded llama3 bands, and
    `rotary_seq_len_interpolation_factor`); both scalings at once is refused (HF states one)."""
    out: dict[str, Any] = {"qk_layernorm": bool(a.get("qk_layernorm") or False)}
    llama3 = bool(a.get("use_rope_scaling") or False)
    linear = a.get("rotary_seq_len_interpolation_factor")
    if a.get("position_embedding_type") == "yarn":
        return {**out, **_yarn_from_megatron_args(a, llama3, linear, source)}
    if llama3 and linear is not None:
        raise MConvertError(
            f"{source}: use_rope_scaling=True together with rotary_seq_len_interpolation_factor={linear!r} is "
            "not mapped (HF states one rope scaling); conversion refused"
        )
    if llama3:
        factor = a.get("rope_scaling_factor")
        out.update(rope_scaling="llama3", rope_scaling_factor=float(8.0 if factor is None else factor),
                   **_LLAMA3_BAND_DEFAULTS)
    elif linear is not None:
        out.update(rope_scaling="linear", rope_scaling_factor=float(linear))
    return out


# ModelSpec YaRN field -> (Megatron-LM arg, the default GPTModel gets when the arg is unset): Megatron-LM's
# `_apply_yarn_config_from_args` for position_embedding_type='yarn' (MLA reads other names: pass its own table)
YARN_ARG_NAMES: dict[str, tuple[str, Any]] = {
    "rope_scaling_factor": ("rotary_scaling_factor", 1.0),
    "rope_original_max_position_embeddings": ("yarn_original_max_position_embeddings", 4096),
    "yarn_beta_fast": ("yarn_beta_fast", 32.0),
    "yarn_beta_slow": ("yarn_beta_slow", 1.0),
    "yarn_mscale": ("mscale", 1.0),
    "yarn_mscale_all_dim": ("mscale_all_dim", 0.0),
    "yarn_correction_range_round_to_int": ("yarn_correction_range_round_to_int", True),
}


# ModelSpec YaRN field -> (megatron-core MLATransformerConfig field, its default): multi-latent attention's own
# YaRN (`rope_type='yarn'`, the default when Megatron-LM's --rope-type is unset). Megatron-LM copies an arg into
# the config when the names match; it has arguments for rotary_scaling_factor, mscale and mscale_all_dim only, so
# the config's defaults hold the rest unless the args carry them. MLA always rounds the correction range.
MLA_YARN_ARG_NAMES: dict[str, tuple[str, Any]] = {
    "rope_scaling_factor": ("rotary_scaling_factor", 40.0),
    "rope_original_max_position_embeddings": ("original_max_position_embeddings", 4096),
    "yarn_beta_fast": ("beta_fast", 32.0),
    "yarn_beta_slow": ("beta_slow", 1.0),
    "yarn_mscale": ("mscale", 1.0),
    "yarn_mscale_all_dim": ("mscale_all_dim", 0.0),
}


def yarn_from_megatron_args(a: dict[str, Any], source: str = "args",
                            names: dict[str, tuple[str, Any]] = YARN_ARG_NAMES) -> dict[str, Any]:
    """ModelSpec kwargs for megatron-core's YaRN read from args by `names` (field -> arg name and the default
    megatron-core uses when the arg is unset or absent); each value's type is checked, naming the arg."""
    out: dict[str, Any] = {"rope_scaling": "yarn"}
    for field_name, (name, default) in names.items():
        v = a.get(name)
        v = default if v is None else v
        if isinstance(default, bool):
            if not isinstance(v, bool):
                raise MConvertError(f"{source}: Megatron arg {name}={v!r} must be true or false; fix it")
        elif isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise MConvertError(f"{source}: Megatron arg {name}={v!r} must be a finite number; fix it")
        out[field_name] = v
    return out


def _yarn_from_megatron_args(a: dict[str, Any], llama3: bool, linear: Any, source: str) -> dict[str, Any]:
    """GPTModel's YaRN (`position_embedding_type='yarn'`). megatron-core's YaRN ignores the Llama-3.1 and linear
    scalings, so args that also state one are ambiguous and refused."""
    for name, given in (("use_rope_scaling", llama3), ("rotary_seq_len_interpolation_factor", linear)):
        if given not in (None, False):
            raise MConvertError(f"{source}: position_embedding_type='yarn' together with {name}={given!r}: "
                                "megatron-core's YaRN ignores the second scaling, so which one the model was meant "
                                "to compute is ambiguous; conversion refused")
    return yarn_from_megatron_args(a, source)


def window_megatron_args(spec: ModelSpec) -> dict[str, Any]:
    """megatron-core's `window_size` (left, 0) and `window_attn_skip_freq` (an int N when every N-th layer,
    1-based, is the full-attention one, else the per-layer list; absent when every layer is windowed)."""
    if spec.window_size is None:
        return {}
    out: dict[str, Any] = {"window_size": (spec.window_size, 0)}
    p = spec.window_pattern
    if p is not None:
        every = next((n for n in range(2, len(p) + 1)
                      if all(bool(v) == ((i + 1) % n != 0) for i, v in enumerate(p))), None)
        out["window_attn_skip_freq"] = every if every is not None else list(p)
    return out


def window_from_megatron_args(a: dict[str, Any], num_layers: int, source: str = "args") -> dict[str, Any]:
    """ModelSpec kwargs from megatron-core's `window_size` (left, right) and `window_attn_skip_freq`
    (transformer/utils.py `is_layer_window_attention`: layer n, 1-based, is windowed when n % N != 0, or when
    entry n-1 of the list is 1). A right size other than 0 (keys after the query) is refused; a left size of
    -1 is megatron-core's "infinite", i.e. no window."""
    ws, freq = a.get("window_size"), a.get("window_attn_skip_freq")
    if ws is None or ws is False:
        return {}
    where = f"{source}: Megatron arg window_size={ws!r}"
    if (not isinstance(ws, (tuple, list)) or len(ws) != 2
            or any(isinstance(v, bool) or not isinstance(v, int) for v in ws)):
        raise MConvertError(f"{where} must be a pair of whole numbers (left, right); fix it")
    left, right = ws
    if right != 0:
        raise MConvertError(f"{where} is not supported: a right size {right} lets a query see keys after it (or, "
                            "with -1, every later key); only causal windows (left, 0) are mapped; conversion refused")
    if left == -1:
        return {}
    if left < 0:
        raise MConvertError(f"{where}: the left size must be >= 0 or -1 (no limit); fix it")
    if freq is None:
        return {"window_size": left}
    if isinstance(freq, int) and not isinstance(freq, bool) and freq >= 1:
        pattern = tuple(int((n + 1) % freq != 0) for n in range(num_layers))
    elif isinstance(freq, (list, tuple)) and len(freq) == num_layers and all(v in (0, 1) for v in freq):
        pattern = tuple(int(v) for v in freq)
    else:
        raise MConvertError(f"{source}: Megatron arg window_attn_skip_freq={freq!r} must be a whole number >= 1 or "
                            f"a list of {num_layers} ones (windowed) and zeros (full attention); fix it")
    return {"window_size": left, "window_pattern": pattern}


def moe_from_megatron_args(a: dict[str, Any]) -> dict[str, Any]:
    """ModelSpec kwargs for MoE from Megatron-LM's `num_experts` (megatron-core: `num_moe_experts`),
    `moe_ffn_hidden_size` and `moe_router_topk` (empty for a dense model)."""
    n = a.get("num_experts") if a.get("num_experts") is not None else a.get("num_moe_experts")
    if n is None:
        return {}
    topk = a.get("moe_router_topk")
    return {"num_experts": int(n), "moe_ffn_hidden_size": a.get("moe_ffn_hidden_size"),
            "moe_router_topk": 2 if topk is None else int(topk)}


_DEEPSEEK_ARGS: dict[str, Any] = {"multi_latent_attention": False, "mtp_num_layers": None, **_DEEPSEEK_MOE_DEFAULTS}


def deepseek_features(values: Mapping[str, Any]) -> dict[str, Any]:
    """The DeepSeek-V3 architecture args among `values` (Megatron-LM's args, or ModelSpec fields) that are not at
    their default, in a fixed order (MLA first)."""
    out = {}
    for k, default in _DEEPSEEK_ARGS.items():
        v = values.get(k)
        if v is None or v == default or (k == "moe_layer_freq" and isinstance(v, (list, tuple)) and set(v) == {1}):
            continue
        out[k] = v
    return out


def deepseek_from_megatron_args(a: dict[str, Any], source: str = "args") -> dict[str, Any]:
    """ModelSpec kwargs for MLA, the DeepSeek router, the MoE layer pattern and MTP from Megatron-LM's args
    (empty when unused). Under MLA `qk_layernorm` means its latent norms, not a per-head q/k norm. MLA's rope is
    YaRN unless `rope_type` is 'rope' (`mla_yarn_from_megatron_args`); plain rope with a factor and
    mscale_all_dim that rescale the softmax is refused."""
    out: dict[str, Any] = {}
    if a.get("multi_latent_attention"):
        if not a.get("qk_layernorm"):
            raise MConvertError(f"{source}: Megatron arg multi_latent_attention=True without qk_layernorm (no latent norms) is not "
                                "mapped; conversion refused")
        if a.get("position_embedding_type") == "yarn":
            raise MConvertError(f"{source}: position_embedding_type='yarn' with multi_latent_attention: megatron-core's "
                                "MLA computes its own rope from rope_type and ignores GPTModel's YaRN, so which one "
                                "the model was meant to compute is ambiguous; conversion refused")
        factor = a.get("rotary_scaling_factor")
        if a.get("rope_type") != "rope":
            out.update(mla_yarn_from_megatron_args(a, source))
        elif factor not in (None, 1, 1.0) and a.get("mscale_all_dim"):
            raise MConvertError(f"{source}: rope_type='rope' with rotary_scaling_factor={factor!r} and "
                                f"mscale_all_dim={a.get('mscale_all_dim')!r} rescales MLA's softmax in "
                                "megatron-core; not mapped; conversion refused")
        out.update(qk_layernorm=False, q_lora_rank=a.get("q_lora_rank"), kv_lora_rank=int(a["kv_lora_rank"]),
                   qk_nope_head_dim=int(a.get("qk_head_dim") or 128),
                   qk_rope_head_dim=int(a.get("qk_pos_emb_head_dim") or 64), v_head_dim=int(a.get("v_head_dim") or 128))
    if a.get("mtp_num_layers") is not None:
        out["mtp_num_layers"] = int(a["mtp_num_layers"])
    if a.get("num_experts") is not None or a.get("num_moe_experts") is not None:
        for k in _DEEPSEEK_MOE_DEFAULTS:
            if a.get(k) is not None:
                out[k] = a[k]
        if a.get("moe_router_pre_softmax") and a.get("moe_router_score_function") != "sigmoid":  # sigmoid: unread
            raise MConvertError(f"{source}: moe_router_pre_softmax=True is not mapped; conversion refused")
    return out


# GPTModel's YaRN args, which megatron-core's MLA does not read -> the MLA field it reads instead
_GPT_YARN_UNDER_MLA = {"yarn_original_max_position_embeddings": "original_max_position_embeddings",
                       "yarn_beta_fast": "beta_fast", "yarn_beta_slow": "beta_slow",
                       "yarn_correction_range_round_to_int": None}


def mla_yarn_from_megatron_args(a: dict[str, Any], source: str = "args") -> dict[str, Any]:
    """ModelSpec kwargs for MLA's YaRN (`rope_type` 'yarn' or unset, megatron-core's default): each
    MLATransformerConfig field from the arg of its name, its default when the args lack it (`MLA_YARN_ARG_NAMES`).
    A factor of 1 is plain rope. Refused by name: a value megatron-core cannot build MLA with (None, not a
    number), and a GPTModel yarn_* arg that differs from what MLA reads (megatron-core's MLA ignores it, so the
    intended YaRN is ambiguous)."""
    out: dict[str, Any] = {"rope_scaling": "yarn"}
    for field_name, (name, default) in MLA_YARN_ARG_NAMES.items():
        v = a[name] if name in a else default  # None reaches MLATransformerConfig as None: refused below
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise MConvertError(f"{source}: Megatron arg {name}={v!r} must be a finite number (megatron-core's "
                                "multi-latent attention builds its YaRN from it); fix it")
        out[field_name] = v
    for name, reads in _GPT_YARN_UNDER_MLA.items():
        given, used = a.get(name), (out[_MLA_FIELD[reads]] if reads else True)
        if given is not None and given != used:
            raise MConvertError(f"{source}: Megatron arg {name}={given!r} with multi_latent_attention: megatron-core's "
                                f"MLA ignores it and uses {reads or 'a rounded correction range'}={used!r}, so the "
                                "intended YaRN is ambiguous; conversion refused")
    if out["rope_scaling_factor"] == 1:  # YaRN that stretches nothing: plain rope, cos/sin and softmax unscaled
        return {"rope_scaling": None}
    return out


_MLA_FIELD = {name: field_name for field_name, (name, _) in MLA_YARN_ARG_NAMES.items()}


def megatron_lm_unstated(spec: ModelSpec) -> list[str]:
    """Warnings for what the written args hold but Megatron-LM's command line cannot state: MLA YaRN's
    original_max_position_embeddings / beta_fast / beta_slow away from MLATransformerConfig's defaults."""
    if not (spec.is_mla and spec.rope_scaling == "yarn"):
        return []
    differ = [f"{name}={getattr(spec, f)!r}" for f, (name, default) in MLA_YARN_ARG_NAMES.items()
              if name in ("original_max_position_embeddings", "beta_fast", "beta_slow") and getattr(spec, f) != default]
    return [f"multi-latent attention's YaRN has {', '.join(differ)}: the args hold it under MLATransformerConfig's "
            "names, for which Megatron-LM has no command-line argument; Megatron-LM trains it with 4096 / 32 / 1 "
            "unless its config receives them"] if differ else []


def mtp_experts(spec: ModelSpec) -> bool:
    """Whether the final unit holds routed experts (MTP layers built as an MoE layer) that a reader gives one
    parameter at a time; a tied head's copy makes the final unit come whole."""
    return bool(spec.mtp_num_layers) and spec.is_moe_layer(spec.num_layers) and not spec.tie_embeddings


def comes_whole(spec: ModelSpec, unit: Unit) -> bool:
    """Whether `unit` reaches a Megatron-side writer as one part: the embedding and final units (a tied head's
    copy, dropped keys) and an MoE model's units (already one expert each) — except the final unit of an untied
    model whose MTP layers route over experts, which comes parameter by parameter (memory: one expert)."""
    if unit == "final" and mtp_experts(spec):
        return False
    return not isinstance(unit, int) or spec.is_moe


def is_buffer(name: str) -> bool:
    """Whether a declared tensor is a saved buffer, not a trained parameter (the router's expert bias, which
    moves outside the optimizer)."""
    return name.endswith(".expert_bias")


def expert_of(name: str) -> int | None:
    """The global expert index in a canonical routed-expert name (`...mlp.experts.local_experts.3...` -> 3)."""
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part == "local_experts" and parts[i + 1].isdigit():
            return int(parts[i + 1])
    return None


def with_expert(name: str, expert: int) -> str:
    """`...local_experts.3.linear_fc1.weight` -> the same name with expert index `expert`."""
    parts = name.split(".")
    i = parts.index("local_experts")
    parts[i + 1] = str(expert)
    return ".".join(parts)


def layer_of_unit(unit: Unit) -> int | None:
    """The global layer a unit belongs to (None for the embedding and the final unit)."""
    if isinstance(unit, LayerPart):
        return unit.layer
    return unit if isinstance(unit, int) else None


def name_template(name: str) -> str:
    """`decoder.layers.7.mlp...` -> `decoder.layers.*.mlp...`."""
    parts = name.split(".")
    return ".".join("*" if p.isdigit() else p for p in parts)


def torch_dtype(name: str):
    """`"bfloat16"` -> torch.bfloat16 (imported lazily so spec stays light)."""
    if name not in dtypes.PARAM_DTYPES:
        raise KeyError(name)
    return dtypes.lookup(name).torch
