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
from typing import Any

from mconvert import dtypes
from mconvert.errors import MConvertError

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

FAMILIES = {
    # family: (HF architecture, HF model_type)
    "gpt2": ("GPT2LMHeadModel", "gpt2"),
    "llama": ("LlamaForCausalLM", "llama"),
    "mistral": ("MistralForCausalLM", "mistral"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
}
ARCH_TO_FAMILY = {arch: fam for fam, (arch, _) in FAMILIES.items()}


@dataclass(frozen=True)
class ParamDecl:
    """One parameter of the full (unsharded) model: canonical name, split kind and full shape."""

    name: str
    kind: str
    shape: tuple[int, ...]
    layer: int | None = None  # global layer index; None for embedding / final params


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer, described once.

    Sizes use Megatron's names; `vocab_size` is the true (unpadded) vocabulary.
    """

    family: str  # gpt2 | llama | mistral | qwen2
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
    activation: str = "gelu"  # gelu (erf) | gelu_new (tanh, Megatron openai_gelu) | swiglu
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
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    # ---- derived -------------------------------------------------------------------------------
    def __post_init__(self) -> None:
        # canonical form: defaults are stored as None so equal models compare equal
        if self.kv_channels is not None and self.kv_channels * self.num_attention_heads == self.hidden_size:
            object.__setattr__(self, "kv_channels", None)
        if self.num_query_groups == self.num_attention_heads:
            object.__setattr__(self, "num_query_groups", None)
        if self.add_bias_linear and self.add_qkv_bias:  # the qkv bias is already there
            object.__setattr__(self, "add_qkv_bias", False)
        if self.position_embedding_type != "rope":  # rotary fields mean nothing without rope
            object.__setattr__(self, "rotary_base", 10000.0)
            object.__setattr__(self, "rotary_percent", 1.0)
            object.__setattr__(self, "rotary_interleaved", False)
        self.validate()

    def validate(self) -> None:
        """Refuse specs that no format can hold; one line naming the field."""
        if self.family not in FAMILIES:
            raise MConvertError(f"unsupported model family {self.family!r}; supported: {', '.join(FAMILIES)}")
        if self.normalization not in ("LayerNorm", "RMSNorm"):
            raise MConvertError(f"unsupported normalization {self.normalization!r} (LayerNorm or RMSNorm)")
        if self.activation not in ("gelu", "gelu_new", "swiglu"):
            raise MConvertError(f"unsupported activation {self.activation!r} (gelu, gelu_new or swiglu)")
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
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            raise MConvertError(
                f"hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                f"{self.num_attention_heads}; set kv_channels"
            )
        if self.num_attention_heads % self.num_groups:
            raise MConvertError(
                f"num_attention_heads {self.num_attention_heads} is not divisible by "
                f"num_query_groups {self.num_groups}"
            )

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def num_groups(self) -> int:
        """Query groups (KV heads); equals the head count for MHA."""
        return self.num_query_groups or self.num_attention_heads

    @property
    def gated(self) -> bool:
        return self.activation == "swiglu"

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
        """Parameter count (padded vocab at TP=1); every layer has layer 0's shapes, so no loop over layers."""
        per_layer = sum(math.prod(p.shape) for p in self.layer_params(0))
        rest = self.embedding_params(1) + self.final_params(1)
        return sum(math.prod(p.shape) for p in rest) + self.num_layers * per_layer

    def check_parallel(self, tp: int = 1, pp: int = 1, vpp: int | None = None) -> None:
        """Refuse a TP/PP that does not divide heads, groups, ffn or layers."""
        if tp < 1 or pp < 1:
            raise MConvertError(f"--tp and --pp must be >= 1 (got tp={tp}, pp={pp})")
        if self.num_attention_heads % tp:
            raise MConvertError(
                f"TP={tp} does not divide num_attention_heads={self.num_attention_heads}; pick a TP that does"
            )
        if self.num_groups % tp and tp % self.num_groups:
            raise MConvertError(
                f"TP={tp} and num_query_groups={self.num_groups}: one must divide the other; pick such a TP"
            )
        if self.qkv_rows % tp:  # groups < TP: a group straddles ranks, the fused rows must still split evenly
            raise MConvertError(
                f"TP={tp} does not divide the {self.qkv_rows} fused QKV rows (heads={self.num_attention_heads}, "
                f"groups={self.num_groups}, head_dim={self.head_dim}); pick a TP that divides num_query_groups"
            )
        if self.ffn_hidden_size % tp:
            raise MConvertError(
                f"TP={tp} does not divide ffn_hidden_size={self.ffn_hidden_size}; pick a TP that does"
            )
        chunks = pp * (vpp or 1)
        if self.num_layers % chunks:
            raise MConvertError(
                f"PP={pp}" + (f"×VPP={vpp}" if vpp else "") + f" does not divide num_layers={self.num_layers}; "
                "pick a PP that does"
            )

    # ---- the split declarations ----------------------------------------------------------------
    def layer_params(self, layer: int) -> list[ParamDecl]:
        """The parameters of one transformer layer (global index), full shapes."""
        H, F, hd, nh = self.hidden_size, self.ffn_hidden_size, self.head_dim, self.num_attention_heads
        p = f"decoder.layers.{layer}."
        out: list[ParamDecl] = []

        def add(name: str, kind: str, *shape: int) -> None:
            out.append(ParamDecl(p + name, kind, tuple(shape), layer))

        ln_bias = self.normalization == "LayerNorm"
        add("input_layernorm.weight", "replicated", H)
        if ln_bias:
            add("input_layernorm.bias", "replicated", H)
        add("self_attention.linear_qkv.weight", "qkv", self.qkv_rows, H)
        if self.has_qkv_bias:
            add("self_attention.linear_qkv.bias", "qkv", self.qkv_rows)
        add("self_attention.linear_proj.weight", "row", H, nh * hd)
        if self.add_bias_linear:
            add("self_attention.linear_proj.bias", "replicated", H)
        add("pre_mlp_layernorm.weight", "replicated", H)
        if ln_bias:
            add("pre_mlp_layernorm.bias", "replicated", H)
        fc1_kind = "gated" if self.gated else "column"
        fc1_rows = 2 * F if self.gated else F
        add("mlp.linear_fc1.weight", fc1_kind, fc1_rows, H)
        if self.add_bias_linear:
            add("mlp.linear_fc1.bias", fc1_kind, fc1_rows)
        add("mlp.linear_fc2.weight", "row", H, F)
        if self.add_bias_linear:
            add("mlp.linear_fc2.bias", "replicated", H)
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

    def final_params(self, tp: int = 1) -> list[ParamDecl]:
        H = self.hidden_size
        out = [ParamDecl("decoder.final_layernorm.weight", "replicated", (H,))]
        if self.normalization == "LayerNorm":
            out.append(ParamDecl("decoder.final_layernorm.bias", "replicated", (H,)))
        if not self.tie_embeddings:
            out.append(ParamDecl("output_layer.weight", "vocab", (self.padded_vocab_size(tp), H)))
        return out

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
            if _template(name) == decl[0]:
                return decl[1]
        raise MConvertError(f"no split declaration for parameter {name!r}")

    def _decls_by_template(self) -> list[tuple[str, str]]:
        decls = self.embedding_params() + self.layer_params(0) + self.final_params()
        if self.tie_embeddings:  # the last stage's copy of the embedding, when PP > 1
            decls.append(ParamDecl("output_layer.weight", "vocab", ()))
        return [(_template(d.name), d.kind) for d in decls]

    # ---- Megatron args -------------------------------------------------------------------------
    def to_megatron_args(
        self, tp: int = 1, pp: int = 1, vpp: int | None = None, **extra: Any
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
            swiglu=self.gated,
            openai_gelu=self.activation == "gelu_new",
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
        for k, v in extra.items():
            setattr(ns, k, v)
        return ns

    @classmethod
    def from_megatron_args(cls, args: Any, family: str | None = None, source: str = "args") -> "ModelSpec":
        """Parse a Megatron args Namespace (or SimpleNamespace / dict) — tolerant of older names.

        A field of the wrong type (None, text, NaN where a size belongs) is one MConvertError naming it."""
        try:
            a = vars(args) if not isinstance(args, dict) else dict(args)
        except TypeError:
            raise MConvertError(f"{source}: args is a {type(args).__name__}, not a Namespace or dict") from None
        _check_numbers(a, _ARGS_NUMBERS, ("hidden_size", "num_attention_heads", "num_layers"), source)
        from mconvert.mappings.fields import check_megatron_args  # mappings imports spec: import on use

        check_megatron_args(a, source)
        try:
            return cls._from_megatron_args(a, family, source)
        except (TypeError, ValueError, OverflowError, ZeroDivisionError, AttributeError) as e:
            raise MConvertError(f"{source}: malformed Megatron args ({type(e).__name__}: {e})") from None

    @classmethod
    def _from_megatron_args(cls, a: dict[str, Any], family: str | None, source: str) -> "ModelSpec":
        def get(name: str, default: Any = None) -> Any:
            v = a.get(name, default)
            return default if v is None else v

        try:
            H = int(a["hidden_size"])
            nh = int(a["num_attention_heads"])
            L = int(a["num_layers"])
        except KeyError as e:
            raise MConvertError(
                f"{source}: Megatron args lack {e.args[0]!r}; is this a Megatron checkpoint?"
            ) from None
        swiglu = bool(get("swiglu", False))
        norm = get("normalization", "LayerNorm")
        rope = get("position_embedding_type", "learned_absolute") == "rope"
        gqa = bool(get("group_query_attention", False))
        groups = int(get("num_query_groups", nh)) if gqa else None
        ffn = get("ffn_hidden_size", None) or 4 * H
        eps = get("norm_epsilon", None) or get("layernorm_epsilon", 1e-5)
        untie = bool(get("untie_embeddings_and_output_weights", False))
        bias = bool(get("add_bias_linear", True))
        qkv_bias = bool(get("add_qkv_bias", False))
        if family is None:
            family = get("model_family", None)
        if family is None:
            if not swiglu and norm == "LayerNorm" and not rope:
                family = "gpt2"
            elif qkv_bias and not bias:
                family = "qwen2"
            else:
                family = "llama"
        padded = get("padded_vocab_size", None)
        vocab = get("vocab_size", None) or get("true_vocab_size", None) or padded
        if vocab is None:
            raise MConvertError(f"{source}: Megatron args have neither vocab_size nor padded_vocab_size")
        dtype = "bfloat16" if get("bf16", False) else "float16" if get("fp16", False) else "float32"
        activation = "swiglu" if swiglu else ("gelu_new" if get("openai_gelu", False) else "gelu")
        return cls(
            family=family,
            num_layers=L,
            hidden_size=H,
            num_attention_heads=nh,
            ffn_hidden_size=int(ffn),
            vocab_size=int(vocab),
            max_position_embeddings=int(get("max_position_embeddings", get("seq_length", 2048))),
            num_query_groups=groups if groups and groups != nh else None,
            kv_channels=int(get("kv_channels", H // nh)),
            normalization=norm,
            norm_epsilon=float(eps),
            activation=activation,
            position_embedding_type="rope" if rope else "learned_absolute",
            rotary_base=float(get("rotary_base", 10000)),
            rotary_percent=float(get("rotary_percent", 1.0)),
            rotary_interleaved=bool(get("rotary_interleaved", False)),
            add_bias_linear=bias,
            add_qkv_bias=qkv_bias,
            tie_embeddings=not untie,
            make_vocab_size_divisible_by=int(get("make_vocab_size_divisible_by", 128)),
            params_dtype=dtype,
        )

    # ---- HF config -----------------------------------------------------------------------------
    def to_hf_config(self) -> dict[str, Any]:
        """config.json content for transformers / vLLM. Every eps and rope setting is written explicitly."""
        arch, model_type = FAMILIES[self.family]
        cfg: dict[str, Any] = {"architectures": [arch], "model_type": model_type}
        if self.family == "gpt2":
            if (
                self.normalization != "LayerNorm"
                or self.gated
                or self.position_embedding_type != "learned_absolute"
            ):
                raise MConvertError(
                    "a gpt2-family model needs LayerNorm, GeLU and learned absolute positions"
                )
            if not self.add_bias_linear:
                raise MConvertError("HF GPT-2 always has linear biases; this model has add_bias_linear=False")
            if (
                self.head_dim * self.num_attention_heads != self.hidden_size
                or self.num_groups != self.num_attention_heads
            ):
                raise MConvertError("HF GPT-2 needs MHA with head_dim = hidden/heads")
            cfg.update(
                n_embd=self.hidden_size,
                n_layer=self.num_layers,
                n_head=self.num_attention_heads,
                n_inner=self.ffn_hidden_size,
                n_positions=self.max_position_embeddings,
                n_ctx=self.max_position_embeddings,
                vocab_size=self.vocab_size,
                layer_norm_epsilon=self.norm_epsilon,
                activation_function=self.activation,
                tie_word_embeddings=self.tie_embeddings,
                scale_attn_weights=True,
                resid_pdrop=0.0,
                embd_pdrop=0.0,
                attn_pdrop=0.0,
            )
        else:
            if self.normalization != "RMSNorm" or not self.gated or self.position_embedding_type != "rope":
                raise MConvertError(f"a {self.family}-family model needs RMSNorm, SwiGLU and RoPE")
            if self.rotary_percent != 1.0:
                raise MConvertError(f"HF {arch} cannot express rotary_percent={self.rotary_percent}")
            if self.family == "qwen2" and (self.add_bias_linear or not self.add_qkv_bias):
                raise MConvertError("a qwen2-family model has a qkv bias and no other linear bias")
            if self.family in ("mistral",) and self.has_qkv_bias:
                raise MConvertError("a mistral-family model has no linear biases")
            cfg.update(
                hidden_size=self.hidden_size,
                intermediate_size=self.ffn_hidden_size,
                num_hidden_layers=self.num_layers,
                num_attention_heads=self.num_attention_heads,
                num_key_value_heads=self.num_groups,
                head_dim=self.head_dim,
                max_position_embeddings=self.max_position_embeddings,
                vocab_size=self.vocab_size,
                rms_norm_eps=self.norm_epsilon,
                rope_theta=self.rotary_base,
                hidden_act="silu",
                tie_word_embeddings=self.tie_embeddings,
                attention_dropout=0.0,
            )
            if self.family == "llama":
                cfg.update(attention_bias=self.add_bias_linear, mlp_bias=self.add_bias_linear)
            if self.family == "mistral":
                cfg.update(sliding_window=None)
            if self.family == "qwen2":
                cfg.update(use_sliding_window=False, sliding_window=None, max_window_layers=self.num_layers)
        cfg["torch_dtype"] = self.params_dtype
        if self.bos_token_id is not None:
            cfg["bos_token_id"] = self.bos_token_id
        if self.eos_token_id is not None:
            cfg["eos_token_id"] = self.eos_token_id
        return cfg

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], source: str = "config.json") -> "ModelSpec":
        """Parse an HF config.json dict. A field of the wrong type is one MConvertError naming it."""
        if not isinstance(cfg, dict):
            raise MConvertError(f"{source}: expected a JSON object, found {type(cfg).__name__}; fix or re-export it")
        _check_numbers(cfg, _HF_NUMBERS, (), source)
        try:
            return cls._from_hf_config(cfg, source)
        except (TypeError, ValueError, OverflowError, ZeroDivisionError, AttributeError) as e:
            raise MConvertError(f"{source}: malformed config ({type(e).__name__}: {e}); fix or re-export it") from None

    @classmethod
    def _from_hf_config(cls, cfg: dict[str, Any], source: str) -> "ModelSpec":
        archs = cfg.get("architectures") or []
        family = next((ARCH_TO_FAMILY[a] for a in archs if a in ARCH_TO_FAMILY), None)
        if family is None:
            family = {"gpt2": "gpt2", "llama": "llama", "mistral": "mistral", "qwen2": "qwen2"}.get(
                cfg.get("model_type", "")
            )
        if family is None:
            raise MConvertError(
                f"{source}: unsupported architecture {archs or cfg.get('model_type')!r}; "
                f"supported: {', '.join(a for a, _ in FAMILIES.values())}"
            )
        from mconvert.mappings.fields import check_hf_config  # mappings imports spec: import on use

        check_hf_config(cfg, FAMILIES[family][1], source)
        dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32").replace("torch.", "")
        common = dict(
            family=family,
            vocab_size=int(cfg["vocab_size"]),
            params_dtype=dtype if dtype in dtypes.PARAM_DTYPES else "float32",
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=cfg.get("eos_token_id")
            if not isinstance(cfg.get("eos_token_id"), list)
            else cfg["eos_token_id"][0],
        )
        try:
            if family == "gpt2":
                H = int(cfg["n_embd"])
                act = cfg.get("activation_function") or "gelu_new"  # its values are checked by the field table
                return cls(
                    num_layers=int(cfg["n_layer"]),
                    hidden_size=H,
                    num_attention_heads=int(cfg["n_head"]),
                    ffn_hidden_size=int(cfg.get("n_inner") or 4 * H),
                    max_position_embeddings=int(cfg["n_positions"]),
                    normalization="LayerNorm",
                    norm_epsilon=float(cfg.get("layer_norm_epsilon", 1e-5)),
                    activation=act,
                    position_embedding_type="learned_absolute",
                    add_bias_linear=True,
                    # transformers' GPT2Config default is tied; an untied one keeps its own lm_head
                    tie_embeddings=bool(cfg.get("tie_word_embeddings", True)),
                    **common,
                )
            nh = int(cfg["num_attention_heads"])
            H = int(cfg["hidden_size"])
            kvh = int(cfg.get("num_key_value_heads") or nh)
            attn_bias = bool(cfg.get("attention_bias", False))
            mlp_bias = bool(cfg.get("mlp_bias", False))
            if family == "llama" and attn_bias != mlp_bias:
                raise MConvertError(f"{source}: attention_bias != mlp_bias is not supported")
            return cls(
                num_layers=int(cfg["num_hidden_layers"]),
                hidden_size=H,
                num_attention_heads=nh,
                ffn_hidden_size=int(cfg["intermediate_size"]),
                max_position_embeddings=int(cfg["max_position_embeddings"]),
                num_query_groups=kvh if kvh != nh else None,
                kv_channels=int(cfg.get("head_dim") or H // nh),
                normalization="RMSNorm",
                norm_epsilon=float(cfg.get("rms_norm_eps", 1e-6)),
                activation="swiglu",
                position_embedding_type="rope",
                rotary_base=float(cfg.get("rope_theta", 10000.0)),
                add_bias_linear=attn_bias if family == "llama" else False,
                add_qkv_bias=family == "qwen2",
                tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                **common,
            )
        except KeyError as e:
            raise MConvertError(f"{source}: missing field {e.args[0]!r}") from None

    def replace(self, **changes: Any) -> "ModelSpec":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("extra")
        return d


def _template(name: str) -> str:
    """`decoder.layers.7.mlp...` -> `decoder.layers.*.mlp...`."""
    parts = name.split(".")
    return ".".join("*" if p.isdigit() else p for p in parts)


# Numeric fields: checked for type before parsing so a malformed file is refused by field name.
_ARGS_NUMBERS = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
    "max_position_embeddings", "seq_length", "vocab_size", "padded_vocab_size", "make_vocab_size_divisible_by",
    "norm_epsilon", "layernorm_epsilon", "rotary_base", "rotary_percent",
)
_HF_NUMBERS = (
    "vocab_size", "n_embd", "n_layer", "n_head", "n_inner", "n_positions", "layer_norm_epsilon",
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_theta",
)


def _check_numbers(d: dict[str, Any], keys: tuple[str, ...], required: tuple[str, ...], source: str) -> None:
    """Refuse a non-numeric, non-finite or (for sizes) non-positive value, naming the field."""
    for k in keys:
        if k not in d or (d[k] is None and k not in required):
            continue
        v = d[k]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise MConvertError(f"{source}: field {k!r} = {v!r} is not a finite number; fix it")
        if v <= 0 and not k.endswith(("epsilon", "eps", "percent", "theta", "base")):
            raise MConvertError(f"{source}: field {k!r} = {v!r} must be positive; fix it")
        if isinstance(v, float) and not k.endswith(("epsilon", "eps", "percent", "theta", "base")) and v != int(v):
            raise MConvertError(f"{source}: field {k!r} = {v!r} must be a whole number; fix it")


def torch_dtype(name: str):
    """`"bfloat16"` -> torch.bfloat16 (imported lazily so spec stays light)."""
    if name not in dtypes.PARAM_DTYPES:
        raise KeyError(name)
    return dtypes.lookup(name).torch


# ---- presets ---------------------------------------------------------------------------------------
# Every preset has head_dim 32, 64 or 128: vLLM's CPU attention rejects 16.
PRESETS: dict[str, ModelSpec] = {
    "tiny-gpt2": ModelSpec(
        family="gpt2",
        num_layers=2,
        hidden_size=64,
        num_attention_heads=2,
        ffn_hidden_size=256,
        vocab_size=1000,
        max_position_embeddings=128,
        activation="gelu_new",
    ),
    "tiny-llama": ModelSpec(
        family="llama",
        num_layers=2,
        hidden_size=128,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=256,
        vocab_size=1000,
        max_position_embeddings=128,
        normalization="RMSNorm",
        activation="swiglu",
        position_embedding_type="rope",
        add_bias_linear=False,
        tie_embeddings=False,
    ),
    "tiny-qwen2": ModelSpec(
        family="qwen2",
        num_layers=2,
        hidden_size=128,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=256,
        vocab_size=1000,
        max_position_embeddings=128,
        normalization="RMSNorm",
        norm_epsilon=1e-6,
        activation="swiglu",
        position_embedding_type="rope",
        rotary_base=1000000.0,
        add_bias_linear=False,
        add_qkv_bias=True,
        tie_embeddings=False,
    ),
    "tiny-mistral": ModelSpec(
        family="mistral",
        num_layers=2,
        hidden_size=128,
        num_attention_heads=4,
        num_query_groups=1,
        ffn_hidden_size=256,
        vocab_size=1000,
        max_position_embeddings=128,
        normalization="RMSNorm",
        activation="swiglu",
        position_embedding_type="rope",
        add_bias_linear=False,
        tie_embeddings=False,
    ),
    # ~100M parameters, for quick benchmarks
    "llama-100m": ModelSpec(
        family="llama",
        num_layers=12,
        hidden_size=768,
        num_attention_heads=12,
        num_query_groups=4,
        ffn_hidden_size=2048,
        vocab_size=32000,
        max_position_embeddings=1024,
        normalization="RMSNorm",
        activation="swiglu",
        position_embedding_type="rope",
        add_bias_linear=False,
        tie_embeddings=False,
    ),
    "gpt2-100m": ModelSpec(
        family="gpt2",
        num_layers=12,
        hidden_size=768,
        num_attention_heads=12,
        ffn_hidden_size=3072,
        vocab_size=50257,
        max_position_embeddings=1024,
        activation="gelu_new",
    ),
    # ~1B parameters (~4 GB fp32), the `make bench` model; same shapes as GPT-2 XL's width
    "gpt2-1b": ModelSpec(
        family="gpt2",
        num_layers=16,
        hidden_size=2048,
        num_attention_heads=16,
        ffn_hidden_size=8192,
        vocab_size=50257,
        max_position_embeddings=1024,
        activation="gelu_new",
    ),
    # Llama-3-405B shapes: only for `--dry-run` estimates from shapes alone (126 layers: PP=16 is uneven)
    "llama3-405b": ModelSpec(
        family="llama",
        num_layers=126,
        hidden_size=16384,
        num_attention_heads=128,
        num_query_groups=8,
        ffn_hidden_size=53248,
        vocab_size=128256,
        max_position_embeddings=131072,
        normalization="RMSNorm",
        activation="swiglu",
        position_embedding_type="rope",
        rotary_base=500000.0,
        add_bias_linear=False,
        tie_embeddings=False,
        params_dtype="bfloat16",
    ),
}


def preset(name: str) -> ModelSpec:
    try:
        return PRESETS[name]
    except KeyError:
        raise MConvertError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}") from None
