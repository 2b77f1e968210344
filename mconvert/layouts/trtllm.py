"""The TensorRT-LLM layout as data: `config.json` for a model, what TensorRT-LLM's classes cannot hold, every
tensor name and per-rank shape a `config.json` implies, and `prepare`, the one place the verb, the writer,
`--dry-run` and `plan --to trtllm` take what one conversion writes from. No torch: `plan` runs without it; the
writer and the checker (`convert/deploy/trtllm.py`) build on it."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from mconvert import dtypes
from mconvert.errors import MConvertError
from mconvert.mappings import families
from mconvert.mappings.record import TrtllmLayout
from mconvert.spec import ModelSpec

TRT_DTYPES = dtypes.PARAM_DTYPES  # what TensorRT-LLM's `dtype` config field takes


def trtllm_config(spec: ModelSpec, tp: int, dtype: str) -> dict[str, Any]:
    """config.json as PretrainedConfig.to_dict writes it, with the model class's own fields."""
    layout = layout_for(spec)
    cfg: dict[str, Any] = {
        "architecture": layout.architecture,
        "dtype": dtype,
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_groups,
        "head_size": spec.head_dim,
        "intermediate_size": spec.ffn_hidden_size,
        "hidden_act": layout.hidden_act(spec),
        "logits_dtype": "float32",
        "norm_epsilon": spec.norm_epsilon,
        "position_embedding_type": layout.position_embedding_type,
        "max_position_embeddings": spec.max_position_embeddings,
        "rotary_embedding_dim": int(spec.head_dim * spec.rotary_percent),
        "use_parallel_embedding": False,
        "embedding_sharding_dim": 0,
        "qk_layernorm": False,
        "tie_word_embeddings": spec.tie_embeddings,
        "mapping": {"world_size": tp, "gpus_per_node": 8, "cp_size": 1, "tp_size": tp, "pp_size": 1,
                    "moe_tp_size": tp, "moe_ep_size": 1},
        "quantization": {"quant_algo": None, "kv_cache_quant_algo": None, "group_size": 128,
                         "smoothquant_val": 0.5, "clamp_val": None, "has_zero_point": False,
                         "pre_quant_scale": False, "exclude_modules": None},
    }
    cfg.update(layout.config_fields(spec))
    return cfg


def trtllm_refusal(spec: ModelSpec, tp: int) -> None:
    """One-line refusal for what this writer / TensorRT-LLM's GPT and LLaMA classes cannot hold."""
    spec.refuse_unmapped("TensorRT-LLM")
    if tp < 1 or spec.num_attention_heads % tp:
        raise MConvertError(f"--tp {tp} does not divide num_attention_heads={spec.num_attention_heads}")
    if spec.num_groups % tp and tp % spec.num_groups:
        raise MConvertError(f"--tp {tp} and num_query_groups={spec.num_groups}: one must divide the other")
    if spec.ffn_hidden_size % tp:
        raise MConvertError(f"--tp {tp} does not divide ffn_hidden_size={spec.ffn_hidden_size}")
    layout = layout_for(spec)
    if spec.rope_scaling is not None and spec.rope_scaling not in layout.rope_scalings:
        raise MConvertError(f"rope_scaling={spec.rope_scaling!r} has no rotary_scaling form in TensorRT-LLM's "
                            f"{layout.architecture} layout (states: {', '.join(layout.rope_scalings) or 'none'}); "
                            "conversion refused")
    layout.refuse(spec)


def trtllm_layout_of(architecture: str) -> TrtllmLayout:
    """The TensorRT-LLM layout a family declares for config.json's `architecture` (or one of its aliases)."""
    for fam in families.all_families():
        layout = fam.trtllm
        if layout is not None and architecture in (layout.architecture, *layout.aliases):
            return layout
    raise MConvertError(f"config.json: architecture {architecture!r} is not one mconvert checks")


def layout_for(spec: ModelSpec) -> TrtllmLayout:
    """The TensorRT-LLM layout of the spec's family; one refusal for a family that has none."""
    layout = families.of(spec).trtllm
    if layout is None:
        raise MConvertError(f"megatron-to-trtllm supports GPT-2 and LLaMA/Mistral style models, not {spec.family}")
    return layout


def expected_trtllm_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor (name -> per-rank shape) a rank file must hold for this config.json."""
    layout = trtllm_layout_of(cfg["architecture"])
    t = int(cfg["mapping"]["tp_size"])
    H, L, V = int(cfg["hidden_size"]), int(cfg["num_hidden_layers"]), int(cfg["vocab_size"])
    nh = int(cfg["num_attention_heads"])
    nkv = int(cfg.get("num_key_value_heads") or nh)
    hd = int(cfg.get("head_size") or H // nh)
    F = int(cfg["intermediate_size"])
    kv_local = max(nkv, t) // t  # KV heads per rank after duplication
    norm_bias = layout.norm == "LayerNorm"
    shapes: dict[str, tuple[int, ...]] = {"transformer.vocab_embedding.weight": (V, H),
                                          "transformer.ln_f.weight": (H,),
                                          "lm_head.weight": (-(-V // t), H)}
    if layout.position_embedding_type == "learned_absolute":
        shapes["transformer.position_embedding.weight"] = (int(cfg["max_position_embeddings"]), H)
    if norm_bias:
        shapes["transformer.ln_f.bias"] = (H,)
    bias, mlp_bias = (bool(cfg.get(k, layout.bias_default)) for k in layout.bias_keys)
    qkv_rows = (nh // t + 2 * kv_local) * hd
    for i in range(L):
        p = f"transformer.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (H,)
        shapes[p + "post_layernorm.weight"] = (H,)
        shapes[p + "attention.qkv.weight"] = (qkv_rows, H)
        shapes[p + "attention.dense.weight"] = (H, nh * hd // t)
        shapes[p + "mlp.fc.weight"] = (F // t, H)
        shapes[p + "mlp.proj.weight"] = (H, F // t)
        if layout.gated:
            shapes[p + "mlp.gate.weight"] = (F // t, H)
        if norm_bias:
            shapes[p + "input_layernorm.bias"] = (H,)
            shapes[p + "post_layernorm.bias"] = (H,)
        if bias:
            shapes[p + "attention.qkv.bias"] = (qkv_rows,)
            shapes[p + "attention.dense.bias"] = (H,)
        if mlp_bias:
            shapes[p + "mlp.fc.bias"] = (F // t,)
            shapes[p + "mlp.proj.bias"] = (H,)
            if layout.gated:
                shapes[p + "mlp.gate.bias"] = (F // t,)
    return shapes


def trtllm_dtype(name: str, spec: ModelSpec) -> str:
    """The canonical dtype of `--dtype NAME` (`auto`: the model's own)."""
    dtype = dtypes.choose(name, TRT_DTYPES)
    return spec.params_dtype if dtype == "auto" else dtype


@dataclass(frozen=True)
class TrtllmPrepared:
    """What one TensorRT-LLM conversion writes, worked out before any tensor is read: the spec as the engine runs
    it (a sliding window accepted as full attention), the rank count, the dtype, config.json, every tensor's
    per-rank shape (the checker's derivation from that config) and the report's notes."""

    spec: ModelSpec
    tp: int
    dtype: str
    source: str  # named in errors
    config: dict[str, Any]
    shapes: dict[str, tuple[int, ...]]
    notes: list[str]

    @property
    def where(self) -> str:
        """The report's layout: `LlamaForCausalLM TP=2`."""
        return f"{self.config['architecture']} TP={self.tp}"

    @property
    def config_text(self) -> str:
        return json.dumps(self.config, indent=4) + "\n"

    @property
    def rank_bytes(self) -> int:
        """Tensor bytes of one rank file (its safetensors header not counted)."""
        return sum(math.prod(s) for s in self.shapes.values()) * dtypes.lookup(self.dtype).itemsize  # type: ignore[union-attr]

    @property
    def files(self) -> list[dict[str, Any]]:
        """Every file with its bytes, sorted by path (the rank files' tensor bytes)."""
        files = [{"path": f"rank{r}.safetensors", "bytes": self.rank_bytes} for r in range(self.tp)]
        files.append({"path": "config.json", "bytes": len(self.config_text.encode())})
        return sorted(files, key=lambda f: f["path"])


def prepare(spec: ModelSpec, tp: int, dtype: str = "auto", accept_window_as_full: bool = False,
            source: str = "checkpoint") -> TrtllmPrepared:
    """The one place TensorRT-LLM's refusals, config and shapes are worked out (the verb, `TrtllmWriter`,
    `--dry-run` and `plan --to trtllm` call it): a sliding window (`accept_window_as_full`: written as full
    attention, with a note), what TensorRT-LLM's classes cannot hold at `tp`, the dtype (`auto`: the model's),
    then config.json and every tensor's per-rank shape."""
    spec, window_note = spec.window_as_full("TensorRT-LLM", accept_window_as_full)
    trtllm_refusal(spec, tp)
    dtype = trtllm_dtype(dtype, spec)
    if dtype not in TRT_DTYPES:
        raise MConvertError(f"{source}: stored dtype {dtype} is not one TensorRT-LLM takes; pass --dtype")
    cfg = trtllm_config(spec, tp, dtype)
    notes = ["rank files hold the whole model (no pipeline split: mapping.pp_size=1)"] + ([window_note] if window_note
                                                                                         else [])
    if spec.num_groups < tp:
        notes.append(f"{spec.num_groups} KV heads duplicated to {tp} ranks (TensorRT-LLM's dup_kv_weight)")
    return TrtllmPrepared(spec, tp, dtype, source, cfg, expected_trtllm_shapes(cfg), notes)


# ---- the checker: names and shapes derived from config.json alone --------------------------------------
