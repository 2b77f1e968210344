"""What a model family is: one frozen `Family` record per family module, holding every fact of that family.

A family module (`gpt2.py`, `llama.py`, ...) declares `FAMILY = Family(...)`; `families.FAMILY_MODULES` lists them.
Everything outside `mappings/` reads a family's facts from its record and never branches on a family's name.
The records here are data plus small pure functions; no I/O.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mconvert.errors import MConvertError
from mconvert.mappings.fields import Field
from mconvert.spec import ModelSpec

if TYPE_CHECKING:  # the tables are plain data: `plan` reads them without loading torch
    import torch

Tensors = dict[str, "torch.Tensor"]
FT_BASE_ROTARY = 10000.0  # FasterTransformer's rotary kernels take no base: it is fixed


@dataclass(frozen=True)
class Rule:
    """How one canonical mcore parameter becomes one or more HF tensors."""

    hf: tuple[str, ...]
    op: str = "identity"  # identity | vocab | qkv | qkv_conv1d | gated | transpose


@dataclass(frozen=True)
class Plugin:
    """The HF⇄Megatron name table: canonical mcore template -> Rule, plus HF names dropped on import."""

    family: str
    table: dict[str, Rule]  # canonical mcore template -> Rule
    hf_drops: dict[str, None]  # HF names (templates) dropped on import
    # canonical name -> HF template (`*` = each multi-token prediction layer's HF index) of the copy that each MTP
    # layer carries of a tensor megatron-core shares with the main model (DeepSeek-V3's `embed_tokens`,
    # `shared_head.head`); written once per MTP layer, and checked equal to the main tensor on import
    mtp_copies: dict[str, str] = field(default_factory=dict)

    @property
    def hf_embedding(self) -> str:
        """The HF name of the word embedding (what a tied head copies)."""
        return self.table["embedding.word_embeddings.weight"].hf[0]


# ---- deployment formats ----------------------------------------------------------------------------
@dataclass(frozen=True)
class DeployRule:
    """Where one canonical mcore parameter goes in a deployment format: the target name(s) (`*` = layer index,
    `{r}` = TP rank) and the `form` the engine stores a rank's shard in (`mappings.deploy.FORMS`). The split
    itself follows the parameter's split kind in ModelSpec."""

    names: tuple[str, ...]
    form: str = "whole"


# ---- FasterTransformer ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class FTFile:
    """One file FT's loader opens: name relative to `<t>-gpu/`, and the shape it reads."""

    name: str
    shape: tuple[int, ...]
    optional: bool = False  # only model.lm_head.weight.bin for [gpt]


@dataclass(frozen=True)
class FTKernels:
    """What FT's kernels compute for a section, and the files they read (the reference runner follows it).

    Pre-norm decoder layers; `norm` LayerNorm reads `.weight` and `.bias`, RMSNorm only `.weight`; every
    linear has a bias when `biases`; positions are learned (`positions` file) or GPT-NeoX rotary over the
    `rotary_dim` config field's dims; the MLP is tanh-GeLU over `mlp = (in, out)` files or SiLU-gated over
    `mlp = (gate, up, down)`; the head is `head`, or `embedding` when `head` is optional and absent."""

    embedding: str
    positions: str | None
    norm: str  # LayerNorm | RMSNorm
    biases: bool
    mlp: tuple[str, ...]  # (in, out): GeLU; (gate, up, down): SiLU-gated
    rotary_dim: str | None = None  # config.ini field with the rotary dims (rotary models)
    head: str = "model.lm_head.weight.bin"
    head_optional: bool = False


@dataclass(frozen=True)
class FTLayout:
    """One FasterTransformer model section (`[gpt]`, `[llama]`): what it holds, its files and its config.

    `holds(spec)`: the section's architecture style matches the model; `refuse(spec, infer_tp,
    allow_approx_gelu)`: one MConvertError for what the section's loader cannot hold. The `*_files` functions
    turn one unit's HF tensors into FT files (every 2-D weight `[in, out]`, split over `t` ranks)."""

    section: str
    required_fields: tuple[str, ...]
    holds: Callable[[ModelSpec], bool]
    refuse: Callable[[ModelSpec, int, bool], None]
    expected_files: Callable[[dict[str, Any]], list[FTFile]]
    files: dict[str, DeployRule | None]
    config_fields: Callable[[ModelSpec], dict[str, Any]]  # section fields beyond the common ones
    kernels: FTKernels
    check_config: Callable[[dict[str, str], dict[str, int]], list[str]] = lambda cfg, ints: []
    model_name: str | None = None  # config.ini model_name; None: the family's name (FT's converters do so)
    always_reads_head: bool = False  # the loader reads lm_head even when tied: a tied model gets a copy
    tied_head_note: str | None = None  # report note when a tied head is written as that copy


# ---- TensorRT-LLM -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TrtllmLayout:
    """One TensorRT-LLM model class: its config fields, its refusals and where each canonical parameter goes in
    the rank files (`tensors`; the head is always written, a tied model's as a copy of the embedding)."""

    architecture: str
    hidden_act: Callable[[ModelSpec], str]
    position_embedding_type: str
    config_fields: Callable[[ModelSpec], dict[str, Any]]  # appended after the common PretrainedConfig fields
    refuse: Callable[[ModelSpec], None]
    tensors: dict[str, DeployRule | None]
    # what the checker and the reference runner read from config.json alone (no class names there):
    aliases: tuple[str, ...] = ()  # other `architecture` names TensorRT-LLM gives this class
    norm: str = "RMSNorm"  # LayerNorm: `.weight` and `.bias`
    gated: bool = True  # SiLU(mlp.fc) · mlp.gate; else tanh-GeLU(mlp.fc)
    # config.json `hidden_act` values under which TensorRT-LLM computes what the runner computes (`gated`)
    hidden_acts: tuple[str, ...] = ("silu",)
    # this class's own config.json fields that change what TensorRT-LLM computes, each with the one value the
    # runner computes with (absent: that value); the checker refuses another
    fixed: dict[str, Any] = field(default_factory=dict)
    bias_keys: tuple[str, str] = ("attn_bias", "mlp_bias")  # config fields of the attention / MLP linear biases
    bias_default: bool = False  # their value when config.json omits them
    # rope scaling types (ModelSpec.rope_scaling) the class states in config.json's `rotary_scaling`; another
    # is refused by name
    rope_scalings: tuple[str, ...] = ()


# ---- GGUF (llama.cpp) -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class GgufLayout:
    """How llama.cpp's `convert_hf_to_gguf.py` writes this family: its llama.cpp architecture (the
    `general.architecture` value and metadata key prefix), HF name template -> GGUF name template (layer `*`
    -> block `*`; a second `*` is the expert index: every expert's tensor goes into one tensor stacked
    [experts, ...] in expert order; an HF name missing here is refused), whether q/k rows are permuted for
    llama.cpp's rope (`LlamaModel.permute`: llama.cpp's LLAMA rope pairs dims (2i, 2i+1), HF's pairs
    (i, i + d/2)), and the refusals of what llama.cpp's architecture cannot compute."""

    arch: str
    tensors: dict[str, str]
    permute_qk: bool
    refuse: Callable[[ModelSpec], None] = lambda spec: None
    rope_freqs: bool = False  # the architecture reads a `rope_freqs.weight` factor tensor (llama3 rope scaling)
    # HF templates stored [in, out] (GPT-2's Conv1D) that llama.cpp reads [out, in]: written transposed
    transposed: frozenset[str] = frozenset()
    # the keys llama.cpp's architecture reads beyond the ones written for every family (key after `{arch}.` ->
    # value; an int is written as uint32, a float as float32): `gguf.GgufWriter` writes them after the expert counts
    metadata: Callable[[ModelSpec], dict[str, int | float | bool | str]] = lambda spec: {}
    # the coarsest precision llama.cpp's CPU graph of this architecture computes a step in, whatever the file
    # holds: `validate` judges the file by this row when it is coarser than the file type's
    compute_dtype: str = "float32"
    # features of `spec.FEATURE_TARGETS` this architecture states although GGUF in general does not
    states: tuple[str, ...] = ()
    # added to every `*norm.weight` (llama.cpp's converter stores Gemma's zero-centred weights as 1 + w)
    norm_shift: float = 0.0
    # HF template -> the GGUF tensors made from that one tensor, in order: (GGUF template, function of the spec
    # and the HF tensor, shape-only on meta tensors too); llama.cpp's deepseek2 reads MLA's kv_b_proj as two
    pieces: dict[str, tuple[tuple[str, Callable[[ModelSpec, Any], Any]], ...]] = field(default_factory=dict)
    # multi-token prediction layers: True writes MTP layer K as block num_layers + K (llama.cpp's `nextn`
    # blocks, counted in block_count through `metadata`); False leaves them out and the report says so
    mtp_blocks: bool = False
    # special-token type (gguf-py's SpecialVocab: bos, eot, eom, ...) -> the token text llama.cpp's converter
    # sets it to for this architecture, applied when the vocabulary holds that token
    special_tokens: dict[str, str] = field(default_factory=dict)
    # the architecture reads `rope.scaling.yarn_log_multiplier` and scales YaRN's attention as MLA does: the
    # softmax by its own factor, apart from cos and sin (llama.cpp's deepseek2; `gguf.yarn_keys`)
    yarn_log_mul: bool = False


EXPERT_FF_KEY = "expert_feed_forward_length"


def expert_width_key(spec: ModelSpec) -> dict[str, int]:
    """A `GgufLayout.metadata` for an architecture that reads its experts' width from `expert_feed_forward_length`
    (`feed_forward_length` then holds the dense width; without it, `feed_forward_length` is the experts')."""
    return {EXPERT_FF_KEY: spec.expert_ffn_hidden_size} if spec.is_moe else {}


# ---- vLLM ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TiedHeadMessages:
    """What `verify` says about a family whose head vLLM always ties to the embedding."""

    differs: str
    untied: str
    ok: str


@dataclass(frozen=True)
class VllmFacts:
    """What vLLM needs of this family's config.json and weights."""

    required: dict[str, str]  # config key -> what it is (missing = an error)
    eps_key: str
    head_dim: Callable[[dict[str, Any]], int]
    config_checks: Callable[[dict[str, Any]], tuple[list[str], list[str]]]  # (problems, notes)
    rope: bool
    always_ties_head: TiedHeadMessages | None = None  # vLLM ignores tie_word_embeddings=false for it
    untied_export_warning: str | None = None  # megatron-to-hf warning for an untied model
    # the head widths vLLM's CPU attention runs and what `head_dim` measures (None: its standard attention's widths)
    cpu_head_dims: tuple[int, ...] | None = None
    head_dim_label: str = "head_dim"


@dataclass(frozen=True)
class BridgeProviders:
    """Megatron-Bridge model providers whose `provide()` builds this family's block beyond what
    GPTModelProvider's fields say: their class paths (`_target_` in run_config.yaml), and `args(model fields,
    where)` -> (the fields left for the common Megatron-Bridge table, the Megatron-LM args the provider implies),
    refusing by name what the family does not map."""

    classes: tuple[str, ...]
    args: Callable[[dict[str, Any], str], tuple[dict[str, Any], dict[str, Any]]]


@dataclass(frozen=True)
class Family:
    """Every fact of one model family (see the module docstring)."""

    name: str
    architecture: str  # the HF causal-LM class (registered in vLLM)
    model_type: str
    base_architecture: str  # HF's model without LM head (vLLM refuses or misreads it)
    plugin: Plugin
    hf_fields: dict[str, Field]  # this family's own config.json fields (common ones live in fields.py)
    to_hf: Callable[[ModelSpec], dict[str, Any]]  # family fields of config.json; refuses what HF cannot hold
    from_hf: Callable[[dict[str, Any], dict[str, Any], str], ModelSpec]  # (cfg, common fields, source)
    vllm: VllmFacts
    presets: dict[str, ModelSpec] = field(default_factory=dict)
    # Megatron args without `model_family`: families are tried by `recognise_order` (ascending); `recognise`
    # gets the parsed ModelSpec fields; None: never inferred (only named).
    recognise: Callable[[dict[str, Any]], bool] | None = None
    recognise_order: int = 0
    ft: FTLayout | None = None
    trtllm: TrtllmLayout | None = None
    gguf: GgufLayout | None = None
    # the sliding window the HF class computes: None (none), "every" (one `sliding_window` on every layer) or
    # "per_layer" (`layer_types` / `max_window_layers` choose the windowed layers)
    hf_window: str | None = None
    moe: bool = False  # the HF class routes every layer's MLP over experts (a dense class refuses a MoE model)
    deepseek: bool = False  # the HF class computes MLA, the DeepSeek router and MTP (`ModelSpec.deepseek_features`)
    gemma: bool = False  # the HF class computes the Gemma block (`ModelSpec.gemma_features`)
    # model_types of published configs whose `architectures` name this class and whose remote code (auto_map) is
    # this class's own function under another name (Kimi K2's kimi_k2 is DeepSeek's modeling_deepseek.py): read as
    # this family, written back under `model_type`, which transformers and vLLM build without remote code
    remote_model_types: tuple[str, ...] = ()
    # the model_type whose class an older transformers (the pinned one) builds with this family's function from the
    # same config, where it lacks this family's own class (GLM-4.7-Flash's glm4_moe_lite: deepseek_v3); the
    # validators run that class as the reference
    transformers_stand_in: str | None = None
    # Megatron-Bridge providers of this family that build more than their fields say (`convert/megatron/bridge.py`
    # accepts their checkpoints through `args`)
    bridge: BridgeProviders | None = None


def check_qk_norm(spec: ModelSpec, architecture: str, has_qk_norm: bool) -> None:
    """Refuse a model whose per-head q/k norm the HF class `architecture` lacks (or needs and it lacks)."""
    if spec.qk_layernorm != has_qk_norm:
        raise MConvertError(f"HF {architecture} {'needs' if has_qk_norm else 'has no'} per-head q/k norm and this "
                            f"{spec.family}-family model has qk_layernorm={spec.qk_layernorm}; conversion refused")
