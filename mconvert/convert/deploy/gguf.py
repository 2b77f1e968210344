"""GGUF for llama.cpp (`mconvert megatron-to-gguf`, `hf-to-gguf`, whose verbs are in `convert/verbs.py`): one
`.gguf` file, its key-values collected by gguf-py's `GGUFWriter` (llama.cpp's own writer) and its bytes written as
that writer lays them out (`io.gguf_file`). `prepare` is the one place its refusals and its tensor plan are worked
out; the verb, the writer, `--dry-run` and `verify` take them from it.

What is written follows llama.cpp's `convert_hf_to_gguf.py` (ggml-org/llama.cpp): tensor names from the family's
`GgufLayout` (gguf-py's `TensorNameMap` names; a MoE layer's experts stacked [experts, out, in] as
`LlamaModel` / `Qwen2MoeModel.modify_tensors` stack them; GPT-2's Conv1D weights transposed), q/k rows permuted
where the family's llama.cpp architecture ropes adjacent pairs (`LlamaModel.permute`), llama3 rope scaling as a
`rope_freqs.weight` factor tensor (`LlamaModel.generate_extra_tensors`), YaRN as the `rope.scaling.*` keys
(`TextModel.set_gguf_parameters`, with the attention factor in the key llama.cpp reads, see `yarn_keys`), 1-D tensors, norms, the router and
learned positions in F32 whatever the outtype, a q8_0 tensor whose rows are not whole 32-blocks in F16 (its
QuantError fallback); the metadata keys of `TextModel` / `LlamaModel.set_gguf_parameters`; the tokenizer as
`_set_vocab_gpt2` (byte-level BPE: tokens, token types, the pre-tokenizer name) or
`_create_vocab_sentencepiece` (a `tokenizer.model`: pieces, scores, types) writes it, then gguf-py's
`SpecialVocab` (merges for BPE, special ids, add-bos/eos, chat template).

Streaming: every tensor's name, shape and type follows from the ModelSpec alone (a meta-tensor pass through the
family's HF mapping), so the header is written first (every tensor info, so every offset, up front) and each
tensor's bytes as it is converted. An MoE layer comes as its dense part and one expert at a time, each expert's
tensors written as their slices of the stacked tensors at their offsets (`io.gguf_file.GgufFile`'s positional
mode), and a final unit with an MoE MTP layer a parameter at a time: memory is one unit, and one expert of an
MoE layer.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mconvert.convert.base import Unit, pmap_iter, units_of
from mconvert.io.paths import inside_file, load_json_object, read_small
from mconvert.io import buffers
from mconvert.io.gguf_file import BF16_BITS, GgufFile, KeyValue, TensorInfo, quantize_q8_0, to_float16, to_float32
from mconvert.convert.hf.tokenizer import check_tokenizer_dir, staged_tokenizer
from mconvert.convert.hf.tokenizer_files import read_tokenizer
from mconvert.convert.writer import Writer
from mconvert.errors import MConvertError, escape_controls, expect, renamed
from mconvert.mappings import families
from mconvert.mappings.plugin import unit_hf_shapes
from mconvert.mappings.record import EXPERT_FF_KEY, GgufLayout
from mconvert.mappings.gguf_vocab import (
    ADDED_SCORE,
    BPE_MODEL,
    BYTE_LEVEL_REGEX,
    PRE_TOKENIZERS,
    SPM_FILE,
    SPM_MODEL,
    SPM_PRE,
    SPM_SETTINGS,
    UNFILLED_SCORE,
)
from mconvert.rope import yarn_get_mscale
from mconvert.spec import ModelSpec

# --outtype -> (the type of 2-D weights, general.file_type), as convert_hf_to_gguf.py's --outtype
OUTTYPES = ("f32", "f16", "bf16", "q8_0")
ROPE_FREQS = "rope_freqs.weight"


def _gguf() -> Any:
    # heavy optional import: gguf-py (numpy, yaml) loads only when a GGUF is written or read
    import gguf

    return gguf


def outtype_types(outtype: str) -> tuple[Any, Any]:
    """(GGMLQuantizationType of the 2-D weights, LlamaFileType) of an --outtype; anything else is refused."""
    g = _gguf()
    table = {
        "f32": (g.GGMLQuantizationType.F32, g.LlamaFileType.ALL_F32),
        "f16": (g.GGMLQuantizationType.F16, g.LlamaFileType.MOSTLY_F16),
        "bf16": (g.GGMLQuantizationType.BF16, g.LlamaFileType.MOSTLY_BF16),
        "q8_0": (g.GGMLQuantizationType.Q8_0, g.LlamaFileType.MOSTLY_Q8_0),
    }
    if outtype not in table:
        raise MConvertError(f"--outtype {outtype!r}: choose {', '.join(OUTTYPES)}")
    return table[outtype]


# The tensor kinds (gguf-py's MODEL_TENSOR) convert_hf_to_gguf.py keeps in F32 whatever the outtype, as
# llama.cpp's quantizer skips them: MoE routers (the shared expert's gate too), learned positions and token types,
# convolutions and the recurrent families' mixing weights; a kind this gguf-py does not know names no tensor here
F32_KINDS = ("FFN_GATE_INP", "FFN_GATE_INP_SHEXP", "POS_EMBD", "TOKEN_TYPES", "SSM_CONV1D", "SHORTCONV_CONV",
             "TIME_MIX_FIRST", "TIME_MIX_W1", "TIME_MIX_W2", "TIME_MIX_DECAY_W1", "TIME_MIX_DECAY_W2",
             "TIME_MIX_LERP_FUSED", "POSNET_NORM1", "POSNET_NORM2", "V_ENC_EMBD_POS", "A_ENC_EMBD_POS",
             "ALTUP_CORRECT_COEF", "ALTUP_PREDICT_COEF", "SSM_CONV1D_Q", "SSM_CONV1D_K", "SSM_CONV1D_V",
             "INDEXER_PROJ")


@functools.lru_cache(maxsize=1)
def _f32_names() -> re.Pattern[str]:
    """The GGUF weight names of `F32_KINDS` (gguf-py's TENSOR_NAMES, any block number) as one pattern."""
    g = _gguf()
    kinds = [getattr(g.MODEL_TENSOR, k) for k in F32_KINDS if hasattr(g.MODEL_TENSOR, k)]
    names = sorted({g.TENSOR_NAMES[k] for k in kinds if k in g.TENSOR_NAMES})
    return re.compile("(?:" + "|".join(re.escape(n).replace(re.escape("{bid}"), r"\d+") for n in names) + r")\.weight")


@dataclass(frozen=True)
class GgufTensor:
    """One tensor of the file: GGUF name, the HF tensors it is made from (one; every expert's, stacked in
    expert order; none: generated), its shape in torch order ([out, in]), its GGML type, and the layout's
    function making it from its one HF tensor (`GgufLayout.pieces`) or None."""

    name: str
    hf: tuple[str, ...]
    unit: Unit | None
    shape: tuple[int, ...]
    qtype: Any
    make: Callable[[ModelSpec, Any], Any] | None = None

    @property
    def nbytes(self) -> int:
        block, size = _gguf().GGML_QUANT_SIZES[self.qtype]
        return math.prod(self.shape[:-1]) * (self.shape[-1] // block) * size


def gguf_layout(spec: ModelSpec) -> GgufLayout:
    """The family's GGUF layout, after every refusal: what HF cannot hold, then what llama.cpp cannot compute."""
    layout = families.of(spec).gguf
    names = ", ".join(f.name for f in families.all_families() if f.gguf is not None)
    if layout is None:
        raise MConvertError(f"the {spec.family} family has no GGUF form here (GGUF is written for {names}); "
                            "conversion refused")
    spec.refuse_unmapped("GGUF", states=layout.states)
    families.refuse_for_hf(spec, "GGUF")
    if spec.rope_scaling not in (None, "linear", "llama3", "yarn"):
        raise MConvertError(f"rope scaling {spec.rope_scaling!r} has no GGUF form here; conversion refused")
    if spec.rope_scaling == "yarn":
        refuse_yarn(spec, layout.arch)
        yarn_keys(spec, layout)  # refuses a YaRN whose attention scaling the architecture cannot state
    layout.refuse(spec)
    if spec.rope_scaling == "llama3" and not layout.rope_freqs:
        raise MConvertError(f"rope scaling llama3 has no GGUF form for llama.cpp's {layout.arch} architecture; "
                            "conversion refused")
    return layout


# What llama.cpp's YaRN computes for the architectures written here (llama-model.cpp's load_hparams reads no
# beta keys for them, ggml's `ggml_rope_yarn_corr_dims` always floors and ceils the correction range).
LLAMA_CPP_YARN_FIXED = {"yarn_beta_fast": 32.0, "yarn_beta_slow": 1.0, "yarn_correction_range_round_to_int": True}


def refuse_yarn(spec: ModelSpec, arch: str) -> None:
    """Refuse a YaRN that llama.cpp computes otherwise, naming each field that differs."""
    differs = [f"{k}={getattr(spec, k)!r}" for k, v in LLAMA_CPP_YARN_FIXED.items() if getattr(spec, k) != v]
    if differs:
        raise MConvertError(f"YaRN with {', '.join(differs)} has no GGUF form: llama.cpp's {arch} architecture fixes "
                            "beta_fast 32 and beta_slow 1 (it reads no beta keys) and always rounds the correction "
                            "range; conversion refused")


def yarn_keys(spec: ModelSpec, layout: GgufLayout) -> dict[str, float | int]:
    """The YaRN metadata (key suffix after `{arch}.rope.scaling.` -> value). llama.cpp multiplies cos and sin by
    0.1·ln(factor)+1 times `attn_factor` (llama-context.cpp overwrites the `yarn_attn_factor` key for YaRN), so
    the model's own factor is stated as its ratio to that default, and only when it differs.

    An architecture that reads `yarn_log_multiplier` (`GgufLayout.yarn_log_mul`: llama.cpp's deepseek2, whose
    MLA scales the softmax apart from cos and sin) computes otherwise when that key is non-zero: cos and sin
    times `attn_factor` A alone, and the softmax times (A·(1 + 0.1·L·ln factor))², L the key over 0.1 (its
    converter writes 0.1·mscale_all_dim and its loader divides the 0.1 back out). The model's cos/sin factor P
    and softmax factor R² (R = get_mscale(factor, mscale_all_dim), megatron-core's MLA and transformers'
    DeepseekV3 alike) are reached by A = P and L = (R/P - 1) / (0.1·ln factor), computed as mscale_all_dim +
    10·R·(1 - P) / (P·ln factor) so that P = 1 (mscale = mscale_all_dim, DeepSeek-V3's YaRN) gives
    mscale_all_dim itself, the converter's value. An L that is 0 in float32 (P = R) takes the first rule."""
    factor = float(spec.rope_scaling_factor)
    out: dict[str, float | int] = {"factor": factor,
                                   "original_context_length": int(spec.rope_original_max_position_embeddings),
                                   "yarn_beta_fast": float(spec.yarn_beta_fast),
                                   "yarn_beta_slow": float(spec.yarn_beta_slow)}
    p = spec.yarn_attention_factor
    if layout.yarn_log_mul and factor > 1:  # a factor <= 1 scales nothing: P = R = 1, the first rule
        r, ln = yarn_get_mscale(factor, spec.yarn_mscale_all_dim), math.log(factor)
        log_mul = 0.1 * (spec.yarn_mscale_all_dim + 10 * r * (1 - p) / (p * ln)) if p else math.inf
        if not (math.isfinite(_f32(log_mul)) and _f32(p)):
            raise MConvertError(
                f"YaRN with mscale={spec.yarn_mscale!r}, mscale_all_dim={spec.yarn_mscale_all_dim!r} and factor "
                f"{factor:g} has no GGUF form: it multiplies cos and sin by {p:.6g} and the softmax by {r * r:.6g}, "
                f"and llama.cpp's {layout.arch} multiplies the softmax by the square of its cos/sin factor times "
                "(1 + yarn_log_multiplier·ln factor), which no float32 key reaches here; conversion refused")
        if _f32(log_mul):
            out["yarn_log_multiplier"] = log_mul
            if p != 1.0:
                out["attn_factor"] = p
            return out
    ratio = p / yarn_get_mscale(factor)
    if ratio != 1.0:
        out["attn_factor"] = ratio
    return out


def _f32(x: float) -> float:
    """x as the float32 llama.cpp reads a key into (inf beyond its range, 0 below it)."""
    with np.errstate(over="ignore"):  # IEEE round to nearest, as a float32 key is stored
        return float(np.float32(x))


def hf_template(hf_name: str) -> tuple[str, list[int]]:
    """(the name with every index `*`, the indices in order: layer, then expert)."""
    parts = hf_name.split(".")
    return ".".join("*" if p.isdigit() else p for p in parts), [int(p) for p in parts if p.isdigit()]


def gguf_name(layout: GgufLayout, hf_name: str) -> tuple[str, int | None]:
    """(GGUF name, expert index or None) of one HF tensor name: the layer index becomes the block index; an
    expert's tensor names the stacked tensor it joins. Unmapped is refused."""
    template, idx = hf_template(hf_name)
    out = layout.tensors.get(template)
    if out is None or len(idx) > 2:
        raise MConvertError(f"tensor {hf_name} has no GGUF name in llama.cpp's {layout.arch} layout; conversion refused")
    return (out.replace("*", str(idx[0]), 1) if idx else out), (idx[1] if len(idx) == 2 else None)


def dropped_mtp(spec: ModelSpec, layout: GgufLayout, hf_name: str) -> bool:
    """An HF tensor of a multi-token prediction layer (`model.layers.{num_layers + K}`) that the layout leaves out."""
    idx = hf_template(hf_name)[1]
    return not layout.mtp_blocks and bool(idx) and idx[0] >= spec.num_layers


def mtp_note(spec: ModelSpec, layout: GgufLayout) -> str | None:
    """The report's line for MTP layers the layout leaves out (never silently)."""
    if not spec.mtp_num_layers or layout.mtp_blocks:
        return None
    return (f"the model's {spec.mtp_num_layers} multi-token prediction layer(s) are not written: llama.cpp's "
            f"{layout.arch} architecture reads none (convert_hf_to_gguf.py skips them too); the GGUF predicts the "
            "next token only")


def tensor_type(name: str, shape: tuple[int, ...], outtype: str) -> Any:
    """convert_hf_to_gguf.py's choice: 1-D tensors, norms, non-weights and the kinds of `F32_KINDS` (the
    routers, learned positions) stay F32; q8_0 needs rows of whole 32-value blocks, else F16."""
    g = _gguf()
    want = outtype_types(outtype)[0]
    if (len(shape) <= 1 or name.endswith("_norm.weight") or not name.endswith(".weight")
            or _f32_names().fullmatch(name)):
        return g.GGMLQuantizationType.F32
    if want == g.GGMLQuantizationType.Q8_0 and shape[-1] % g.GGML_QUANT_SIZES[want][0]:
        return g.GGMLQuantizationType.F16
    return want


def plan_tensors(spec: ModelSpec, layout: GgufLayout, outtype: str) -> list[GgufTensor]:
    """Every tensor of the file in write order, derived from the spec alone: each unit's parameters' shapes
    through the family's HF mapping (`unit_hf_shapes`), then renamed (experts stacked where their first one
    stands; a layout's `pieces` made from a zero-strided array of the HF shape, which holds no memory); the rope
    factor tensor first when llama3 scaling."""
    plan: list[GgufTensor] = []
    if spec.rope_scaling == "llama3":
        shape = (spec.head_dim // 2,)
        plan.append(GgufTensor(ROPE_FREQS, (), None, shape, tensor_type(ROPE_FREQS, shape, outtype)))
    for unit in units_of(spec):
        parts: dict[str, dict[int | None, tuple[str, tuple[int, ...]]]] = {}
        made: dict[str, Callable[[ModelSpec, Any], Any]] = {}
        for hf_name, hf_shape in unit_hf_shapes(spec, unit).items():
            if dropped_mtp(spec, layout, hf_name):
                continue
            template, idx = hf_template(hf_name)
            for piece, make in layout.pieces.get(template, ()):
                name = piece.replace("*", str(idx[0]), 1)
                shape = make(spec, np.broadcast_to(np.float32(0), hf_shape)).shape
                parts[name], made[name] = {None: (hf_name, tuple(int(s) for s in shape))}, make
            if template in layout.pieces:
                continue
            name, expert = gguf_name(layout, hf_name)
            shape = hf_shape
            if hf_template(hf_name)[0] in layout.transposed:
                shape = shape[::-1]
            parts.setdefault(name, {})[expert] = (hf_name, shape)
        for name, by in parts.items():
            if None in by:
                hf_name, shape = by[None]
                plan.append(GgufTensor(name, (hf_name,), unit, shape, tensor_type(name, shape, outtype), made.get(name)))
                continue
            experts = sorted(by)  # type: ignore[type-var]
            shapes = {by[e][1] for e in experts}
            if experts != list(range(spec.num_experts or 0)) or len(shapes) != 1:
                raise MConvertError(f"unit {unit}: the experts of {name} are {experts} with shapes {sorted(shapes)}, "
                                    f"not {spec.num_experts} of one shape; conversion refused")
            shape = (len(experts), *shapes.pop())
            plan.append(GgufTensor(name, tuple(by[e][0] for e in experts), unit, shape,
                                   tensor_type(name, shape, outtype)))
    return plan


@dataclass(frozen=True)
class GgufPrepared:
    """What one GGUF conversion writes, worked out before any tensor is read: the spec as the file states it (a
    sliding window accepted as full attention), the family's layout after every refusal, every tensor of the
    file in write order with its shape and type, and the notes the report carries."""

    spec: ModelSpec
    layout: GgufLayout
    outtype: str
    tensors: list[GgufTensor]
    notes: list[str]

    @property
    def tensor_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def prepare(spec: ModelSpec, outtype: str = "f16", accept_window_as_full: bool = False) -> GgufPrepared:
    """The one place a GGUF's refusals and plan are worked out (the verb, `GgufWriter`, `--dry-run` and `verify`
    call it): the --outtype, a sliding window (`accept_window_as_full`: written as full attention, with a
    note), what HF and llama.cpp cannot hold (`gguf_layout`), then every tensor from the spec alone."""
    outtype_types(outtype)
    own = families.of(spec).gguf
    spec, window_note = spec.window_as_full("GGUF", accept_window_as_full, own.states if own else ())
    layout = gguf_layout(spec)
    notes = [note for note in (window_note, mtp_note(spec, layout)) if note]
    return GgufPrepared(spec, layout, outtype, plan_tensors(spec, layout, outtype), notes)


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's `LlamaModel.permute`: per head, rows (i, i + d/2) become rows (2i, 2i + 1), the
    pairs llama.cpp's LLAMA rope rotates together (weights [rows, in] or biases [rows]); into reused memory."""
    half = w.shape[0] // n_head // 2
    out = buffers.array(w.shape, w.dtype)
    out.reshape(n_head, half, 2, *w.shape[1:])[...] = w.reshape(n_head, 2, half, *w.shape[1:]).swapaxes(1, 2)
    return out


def as_array(x: Any) -> np.ndarray:
    """A source's tensor as the array the GGUF rules work on (bfloat16 as its raw bits, `BF16_BITS`): an array
    as it is; a torch tensor (a Megatron source's) viewed, not copied."""
    if isinstance(x, np.ndarray):
        return x
    import torch

    x = x.detach()
    return x.view(torch.int16).numpy().view(BF16_BITS) if x.dtype == torch.bfloat16 else x.numpy()


def gguf_data(spec: ModelSpec, layout: GgufLayout, hf_name: str, x: np.ndarray, permute: bool = True) -> np.ndarray:
    """One HF tensor as the GGUF stores it (Conv1D weights transposed, q/k rows permuted where the layout says
    so)."""
    if hf_template(hf_name)[0] in layout.transposed:
        x = x.T
    if layout.norm_shift and hf_name.endswith("norm.weight"):
        x = to_float32(x) + np.float32(layout.norm_shift)
    if permute and layout.permute_qk:
        if ".self_attn.q_proj." in hf_name:
            return permute_qk(x, spec.num_attention_heads)
        if ".self_attn.k_proj." in hf_name:
            return permute_qk(x, spec.num_groups)
    return x


def rope_freqs(spec: ModelSpec) -> np.ndarray:
    """llama3 rope scaling as llama.cpp reads it: one divisor per rotary pair (`rope_freqs.weight`), from the
    base, head dim and the four scaling numbers, in the float32 steps `LlamaModel.generate_extra_tensors`
    takes on torch scalars: the frequencies 1 / base^(2i / dim); `number / tensor` as torch's reciprocal times
    the number; each bound cast to float32 before it is compared; the smoothed divisor in float32 throughout."""
    f32, one = np.float32, np.float32(1)
    dim = spec.head_dim
    freqs = one / powf(f32(spec.rotary_base), np.arange(0, dim, 2, dtype=f32) / f32(dim))
    factor = float(spec.rope_scaling_factor)
    low, high = float(spec.rope_low_freq_factor), float(spec.rope_high_freq_factor)
    old = spec.rope_original_max_position_embeddings
    out = np.empty(freqs.shape, dtype=f32)
    with np.errstate(divide="ignore", invalid="ignore"):  # low == high: what the converter computes, Inf or NaN
        for i, freq in enumerate(freqs):
            wavelen = (one / freq) * f32(2 * math.pi)
            if wavelen < f32(old / high):
                out[i] = 1
            elif wavelen > f32(old / low):
                out[i] = factor
            else:
                smooth = ((one / wavelen) * f32(old) - f32(low)) / f32(high - low)
                out[i] = one / ((one - smooth) / f32(factor) + smooth)
    return out


@functools.lru_cache(maxsize=1)
def _libm_powf() -> Any:
    """The C library's powf, or None where no C math library is found."""
    import ctypes
    import ctypes.util

    try:
        fn = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6").powf
    except (OSError, AttributeError):
        return None
    fn.restype, fn.argtypes = ctypes.c_float, [ctypes.c_float, ctypes.c_float]
    return fn


def powf(base: np.float32, x: np.ndarray) -> np.ndarray:
    """`base ** x` in float32 as torch's CPU kernel computes it element by element (std::pow on floats): the C
    library's powf, else (no C library found) the float64 power rounded once. torch computes whole vector-width
    chunks with SLEEF's powf instead, which can differ in the last bit (within 1 ulp, either way)."""
    fn = _libm_powf()
    if fn is None:
        return (np.float64(base) ** x.astype(np.float64)).astype(np.float32)
    return np.array([fn(float(base), float(v)) for v in x], dtype=np.float32)


# ---- tokenizer ------------------------------------------------------------------------------------------
def tokenizer_pre(tok_json: dict[str, Any], where: str) -> str:
    """The llama.cpp pre-tokenizer name of a byte-level BPE `tokenizer.json`; any other tokenizer is refused."""
    fix = "re-save the tokenizer"
    model = expect(tok_json.get("model") or {}, dict, f"{where}: model", fix).get("type")
    if model != "BPE":
        raise MConvertError(f"{where}: tokenizer model {model!r} has no GGUF form here (byte-level BPE is written; "
                            "SentencePiece/Unigram/WordPiece are not); conversion refused")
    pre = expect(tok_json.get("pre_tokenizer") or {}, dict, f"{where}: pre_tokenizer", fix)
    steps = expect(pre.get("pretokenizers", []), list, f"{where}: pre_tokenizer.pretokenizers", fix) \
        if pre.get("type") == "Sequence" else [pre]
    regex, byte_level = None, None
    for s in steps:
        kind = s.get("type") if isinstance(s, dict) else None
        if kind == "ByteLevel" and byte_level is None:
            byte_level = s
            if s.get("add_prefix_space"):
                raise MConvertError(f"{where}: ByteLevel add_prefix_space=true has no llama.cpp pre-tokenizer; "
                                    "conversion refused")
            if s.get("use_regex", True) and regex is None:
                regex = BYTE_LEVEL_REGEX
        elif kind == "Split" and regex is None and isinstance(s.get("pattern"), dict) and "Regex" in s["pattern"]:
            if s.get("behavior") != "Isolated" or s.get("invert"):
                raise MConvertError(f"{where}: Split pre-tokenizer behaviour {s.get('behavior')!r} has no llama.cpp "
                                    "form; conversion refused")
            regex = expect(s["pattern"]["Regex"], str, f"{where}: pre-tokenizer Split pattern.Regex", fix)
        else:
            raise MConvertError(f"{where}: pre-tokenizer step {kind!r} has no llama.cpp form here; conversion refused")
    if byte_level is None or regex is None:
        raise MConvertError(f"{where}: not a byte-level BPE pre-tokenizer; conversion refused")
    name = PRE_TOKENIZERS.get(regex)
    if name is None:
        shown = regex if len(regex) <= 60 else regex[:57] + "..."
        raise MConvertError(f"{where}: pre-tokenizer regex {shown!r} matches none llama.cpp names "
                            f"({', '.join(sorted(set(PRE_TOKENIZERS.values())))}); conversion refused")
    return name


@dataclass(frozen=True)
class GgufVocab:
    """The tokenizer as the GGUF states it: `tokenizer.ggml.model` / `.pre`, one token, type and (SentencePiece
    only) score per embedding row, whether gguf-py's SpecialVocab carries BPE merges, and add_space_prefix."""

    model: str
    pre: str
    tokens: list[str]
    types: list[int]
    scores: list[float] | None = None
    merges: bool = True
    add_space_prefix: bool | None = None


def gguf_vocab(tok_dir: Path, n_vocab: int) -> GgufVocab:
    """The vocabulary of `tok_dir` for the GGUF: a SentencePiece `tokenizer.model` where there is one (as
    convert_hf_to_gguf.py's LlamaModel prefers it) and it is the vocabulary transformers loads, else a
    byte-level BPE `tokenizer.json`. transformers reads tokenizer.json whenever there is one, so a
    `tokenizer.model` whose pieces disagree with it is a stray file and never wins."""
    check_tokenizer_dir(tok_dir)
    if (tok_dir / SPM_FILE).exists():
        proto = read_sentencepiece(inside_file(tok_dir, SPM_FILE, f"{tok_dir}: tokenizer file"))
        if not (tok_dir / "tokenizer.json").exists() or pieces_agree(proto, read_tokenizer(tok_dir).get_vocab()):
            return sentencepiece_vocab(tok_dir, n_vocab)
    tokens, types, pre = tokenizer_vocab(tok_dir, n_vocab)
    return GgufVocab(BPE_MODEL, pre, tokens, types)


def tokenizer_vocab(tok_dir: Path, n_vocab: int) -> tuple[list[str], list[int], str]:
    """(tokens, token types, pre-tokenizer name) for a byte-level BPE tokenizer, as convert_hf_to_gguf.py's
    `get_vocab_base`: rows past the tokenizer are `[PADi]` UNUSED, added special tokens CONTROL, other added
    tokens USER_DEFINED."""
    g = _gguf()
    check_tokenizer_dir(tok_dir)
    path = tok_dir / "tokenizer.json"
    if not path.is_file():
        raise MConvertError(f"{tok_dir}: no tokenizer.json and no {SPM_FILE} (GGUF embeds a byte-level BPE "
                            "tokenizer.json or a SentencePiece model); pass --tokenizer DIR")
    # JSON nested too deeply, invalid JSON or not an object: one line (load_json_object), never a RecursionError
    tok_json = load_json_object(inside_file(tok_dir, "tokenizer.json", f"{tok_dir}: tokenizer file"), "tokenizer",
                                "re-save the tokenizer", kind="tokenizer")
    pre = tokenizer_pre(tok_json, str(path))
    tok = read_tokenizer(tok_dir)
    vocab = tok.get_vocab()
    if vocab and max(vocab.values()) >= n_vocab:
        raise MConvertError(f"{tok_dir}: the tokenizer has id {max(vocab.values())}, the model {n_vocab} rows; "
                            "the tokenizer does not belong to this model")
    reverse = {i: t for t, i in vocab.items()}
    added = tok.get_added_vocab()
    decoder = tok.added_tokens_decoder
    tokens, types = [], []
    for i in range(n_vocab):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(int(g.TokenType.UNUSED))
            continue
        t = reverse[i]
        if t in added:
            types.append(int(g.TokenType.CONTROL if decoder[i].special else g.TokenType.USER_DEFINED))
        else:
            types.append(int(g.TokenType.NORMAL))
        tokens.append(t)
    return tokens, types, pre


def read_sentencepiece(path: Path) -> Any:
    """The model proto of a SentencePiece `tokenizer.model`, after the refusals of what llama.cpp's SPM
    tokenizer cannot reproduce: a malformed file, a model that is not BPE, no byte fallback, a normalizer."""
    try:
        import sentencepiece
        from sentencepiece import sentencepiece_model_pb2 as pb
    except ImportError:
        raise MConvertError(f"{path}: reading a SentencePiece model needs the sentencepiece package; "
                            "pip install sentencepiece") from None
    data = read_small(path, "tokenizer")
    proto = pb.ModelProto()
    try:
        proto.ParseFromString(data)
        # sentencepiece's own loader checks what the proto cannot (piece table, ids, the trainer spec)
        sentencepiece.SentencePieceProcessor(model_proto=data)
    except Exception as e:  # noqa: BLE001 - protobuf's DecodeError, sentencepiece's RuntimeError
        text = str(e).split("\n", 1)[0][:120]
        raise MConvertError(f"{path}: not a SentencePiece model ({type(e).__name__}: {text}); re-save the "
                            "tokenizer") from None
    if not proto.pieces:
        raise MConvertError(f"{path}: a SentencePiece model without pieces; re-save the tokenizer")
    kind = pb.TrainerSpec.ModelType.Name(proto.trainer_spec.model_type)
    if kind != "BPE":
        raise MConvertError(f"{path}: SentencePiece model type {kind} has no GGUF form (llama.cpp merges pieces by "
                            "score, which is SentencePiece BPE only); conversion refused")
    if not proto.trainer_spec.byte_fallback:
        raise MConvertError(f"{path}: SentencePiece model without byte_fallback has no GGUF form (llama.cpp spells "
                            "characters outside the pieces as <0xXX> byte tokens); conversion refused")
    norm = proto.normalizer_spec
    if norm.precompiled_charsmap:
        raise MConvertError(f"{path}: SentencePiece normalizer {norm.name or 'custom'!r} has no GGUF form "
                            "(llama.cpp normalizes nothing; an identity normalizer is needed); conversion refused")
    marked = next((p.piece for p in proto.pieces if p.type == pb.ModelProto.SentencePiece.USER_DEFINED
                   and "\u2581" in p.piece), None)
    if marked is not None:
        raise MConvertError(f"{path}: user-defined SentencePiece piece {escape_controls(marked)[:40]!r} holds the "
                            "word-boundary mark \u2581, which llama.cpp and transformers' tokenizers each read "
                            "differently; conversion refused")
    for key, (want, why) in SPM_SETTINGS.items():
        part, field = key.split(".")
        have = getattr(getattr(proto, part), field)
        if have != want:
            raise MConvertError(f"{path}: SentencePiece {field}={str(have).lower()} has no GGUF form ({why}); "
                                "conversion refused")
    return proto


def pieces_agree(proto: Any, vocab: dict[str, int]) -> bool:
    """Whether every piece of a SentencePiece model has its own id in `vocab` (transformers' tokenizer's), as
    in a tokenizer.json converted from that model."""
    return all(vocab.get(p.piece) == i for i, p in enumerate(proto.pieces))


def sentencepiece_vocab(tok_dir: Path, n_vocab: int) -> GgufVocab:
    """A SentencePiece tokenizer as convert_hf_to_gguf.py's `_create_vocab_sentencepiece` writes it: every piece
    with its score and its type from the model proto (normal, unknown, control, user-defined, byte, unused);
    transformers' added tokens (added_tokens.json, tokenizer.json / tokenizer_config.json's added tokens) over
    them, CONTROL when special, else USER_DEFINED with \u2581 read as a space; rows past both `[PADi]` UNUSED."""
    g = _gguf()
    path = inside_file(tok_dir, SPM_FILE, f"{tok_dir}: tokenizer file")
    proto = read_sentencepiece(path)
    if len(proto.pieces) > n_vocab:
        raise MConvertError(f"{path}: {len(proto.pieces)} pieces, the model {n_vocab} rows; the tokenizer does not "
                            "belong to this model")
    tokens = [f"[PAD{i}]" for i in range(n_vocab)]
    scores = [UNFILLED_SCORE] * n_vocab
    types = [int(g.TokenType.UNUSED)] * n_vocab
    for i, piece in enumerate(proto.pieces):
        tokens[i], scores[i], types[i] = piece.piece, float(piece.score), int(piece.type)
    tok = read_tokenizer(tok_dir)
    for i, added in sorted(tok.added_tokens_decoder.items()):
        if i >= n_vocab:
            raise MConvertError(f"{tok_dir}: added token {escape_controls(added.content)[:40]!r} has id {i}, the "
                                f"model {n_vocab} rows; the tokenizer does not belong to this model")
        if added.special:
            tokens[i], types[i] = added.content, int(g.TokenType.CONTROL)
        else:
            tokens[i], types[i] = added.content.replace("\u2581", " "), int(g.TokenType.USER_DEFINED)
        scores[i] = ADDED_SCORE
    prefix = tok.init_kwargs.get("add_prefix_space")
    add_space_prefix = bool(proto.normalizer_spec.add_dummy_prefix) if prefix is None else bool(prefix)
    return GgufVocab(SPM_MODEL, SPM_PRE, tokens, types, scores, merges=False, add_space_prefix=add_space_prefix)


# gguf-py's SpecialVocab: the special-token types it reads (its default `special_token_types`), and the file
# each of its readers opens (an exception raised inside one names that file)
SPECIAL_TYPES = ("bos", "eos", "unk", "sep", "pad", "cls", "mask")
_SPECIAL_VOCAB_READERS = {"_try_load_from_config_json": "config.json", "_try_load_merges_txt": "merges.txt",
                          "_try_load_from_tokenizer_json": "tokenizer.json"}


def special_vocab_file(e: BaseException) -> str:
    """The file gguf-py's SpecialVocab was reading when it raised `e` (by the reader method on its stack)."""
    name, tb = "tokenizer.json", e.__traceback__
    while tb is not None:
        name = _SPECIAL_VOCAB_READERS.get(tb.tb_frame.f_code.co_name, name)
        tb = tb.tb_next
    return name


def check_special_ids(tok_dir: Path) -> None:
    """config.json's special-token ids as gguf-py's SpecialVocab reads them (`<type>_token_id`, at the top or
    under `text_config`): a negative id makes llama.cpp's converter raise, so it is refused here by file and
    key. A config that is not a JSON object is refused too."""
    if not os.path.lexists(tok_dir / "config.json"):
        return
    path = inside_file(tok_dir, "config.json", f"{tok_dir}: file config.json")
    fix = "fix it (llama.cpp's converter reads its special-token ids)"
    cfg = load_json_object(path, "config", fix)
    tables = [("", cfg)]
    if cfg.get("text_config") is not None:
        tables.append(("text_config.", expect(cfg["text_config"], dict, f"{path}: text_config", fix)))
    for prefix, table in tables:
        for typ in SPECIAL_TYPES:
            v = table.get(f"{typ}_token_id")
            if isinstance(v, int) and v < 0:
                raise MConvertError(f"{path}: {prefix}{typ}_token_id {v} is not a token id; llama.cpp's converter "
                                    f"(gguf-py's SpecialVocab) refuses a negative id — set it to null (no {typ} "
                                    "token) or to an id of the vocabulary")


@contextmanager
def gguf_log(name: str, private: Path | None = None, shown: Path | None = None) -> Iterator[list[str]]:
    """gguf-py's log records of logger `name` and below, caught instead of printed (logging's last-resort
    handler would put them on stderr beside mconvert's one line): the messages, with a private staged path
    named as the user's, for the report's warnings."""
    logger = logging.getLogger(name)
    said: list[str] = []

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            text = record.getMessage()
            said.append(escape_controls(renamed(text, private, shown) if private is not None else text)[:300])

    handler, propagate = Catch(logging.WARNING), logger.propagate
    logger.addHandler(handler)
    logger.propagate = False
    try:
        yield said
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate


# ---- the writer -----------------------------------------------------------------------------------------
class GgufWriter(Writer):
    """Writer of one `.gguf` (reads HF-named units): header, metadata and tensor infos at open, then each unit's
    tensors written by `add` at their places (in plan order where they come so; an expert's tensors as slices of
    the stacked ones); `close` checks every planned tensor was written. It writes what `prepare` worked out."""

    reads = "hf"
    # an MoE layer comes as its dense part and one unit per expert; a unit may come in parts (the final unit's
    # MTP layer one parameter at a time, without the tensors the plan leaves out: `wants`): memory is one expert
    splits_experts = True
    takes_parts = True

    def __init__(self, path: Path, prepared: GgufPrepared, tokenizer_dir: Path | None,
                 name: str | None = None, permute: bool = True) -> None:
        g = _gguf()
        self.path, self.spec, self.outtype = Path(path), prepared.spec, prepared.outtype
        spec = self.spec
        self.layout = prepared.layout
        self.permute = permute  # False only to prove that a file without the permutation fails validation
        self.warnings: list[str] = []  # what gguf-py logged while reading the tokenizer
        self.plan = prepared.tensors
        if tokenizer_dir is None:
            raise MConvertError("no tokenizer found beside the checkpoint; GGUF embeds one — pass --tokenizer DIR")
        vocab = gguf_vocab(tokenizer_dir, spec.vocab_size)
        # gguf-py's writer collects the key-values (its `add_*` names and types, SpecialVocab's keys); the bytes
        # are mconvert's own (`io.gguf_file`: O_DIRECT, hashed on the way)
        self._w = g.GGUFWriter(None, self.layout.arch)
        self._metadata(name or self.path.stem, vocab, tokenizer_dir)
        kvs = [KeyValue(k, v.value, int(v.type), None if v.sub_type is None else int(v.sub_type))
               for k, v in self._w.kv_data[0].items()]
        self._file = GgufFile(self.path, kvs, [TensorInfo(t.name, t.shape, int(t.qtype)) for t in self.plan],
                              positional=any(len(t.hf) > 1 for t in self.plan))  # experts a slice at a time
        # HF name -> the (plan index, expert slice or None) it is written to: one tensor may make several
        self._uses: dict[str, list[tuple[int, int | None]]] = {}
        for i, t in enumerate(self.plan):
            for e, h in enumerate(t.hf):
                self._uses.setdefault(h, []).append((i, e if len(t.hf) > 1 else None))
        self._written: set[tuple[int, int | None]] = set()
        if self.plan and self.plan[0].name == ROPE_FREQS:
            self._write_piece(0, None, self._converted(self.plan[0], rope_freqs(spec)))

    def _metadata(self, name: str, vocab: GgufVocab, tok_dir: Path) -> None:
        g, w, s = _gguf(), self._w, self.spec
        w.add_type(g.GGUFType.MODEL)
        w.add_name(name)
        # the family's architecture keys (`GgufLayout.metadata`); one of them replaces the common key it names
        own = self.layout.metadata(s)

        def common(key: str, add: Callable[[Any], None], value: Any) -> None:
            if key not in own:
                add(value)

        w.add_context_length(s.max_position_embeddings)
        w.add_embedding_length(s.hidden_size)
        common("block_count", w.add_block_count, s.num_layers)
        moe_width = s.is_moe and EXPERT_FF_KEY not in own
        w.add_feed_forward_length(s.expert_ffn_hidden_size if moe_width else s.ffn_hidden_size)
        w.add_head_count(s.num_attention_heads)
        common("attention.head_count_kv", w.add_head_count_kv, s.num_groups)
        common("attention.key_length", w.add_key_length, s.head_dim)
        common("attention.value_length", w.add_value_length, s.head_dim)
        if s.is_moe:
            w.add_expert_count(int(s.num_experts))
            w.add_expert_used_count(int(s.moe_router_topk))
        for key, value in own.items():
            add = (w.add_bool if isinstance(value, bool) else w.add_uint32 if isinstance(value, int)
                   else w.add_float32 if isinstance(value, float) else w.add_string)
            add(f"{self.layout.arch}.{key}", value)
        if s.position_embedding_type == "rope":
            w.add_rope_freq_base(float(s.rotary_base))
            common("rope.dimension_count", w.add_rope_dimension_count, s.head_dim)
        if s.normalization == "LayerNorm":
            w.add_layer_norm_eps(float(s.norm_epsilon))
        else:
            w.add_layer_norm_rms_eps(float(s.norm_epsilon))
        w.add_vocab_size(s.vocab_size)
        if s.rope_scaling == "linear":
            w.add_rope_scaling_type(g.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(float(s.rope_scaling_factor))
        if s.rope_scaling == "yarn":
            w.add_rope_scaling_type(g.RopeScalingType.YARN)
            keys = yarn_keys(s, self.layout)
            w.add_rope_scaling_factor(keys["factor"])
            w.add_rope_scaling_orig_ctx_len(int(keys["original_context_length"]))
            w.add_rope_scaling_yarn_beta_fast(keys["yarn_beta_fast"])
            w.add_rope_scaling_yarn_beta_slow(keys["yarn_beta_slow"])
            if "attn_factor" in keys:
                w.add_rope_scaling_attn_factors(keys["attn_factor"])
            if "yarn_log_multiplier" in keys:
                w.add_rope_scaling_yarn_log_mul(keys["yarn_log_multiplier"])
        w.add_file_type(outtype_types(self.outtype)[1])
        w.add_quantization_version(g.GGML_QUANT_VERSION)
        w.add_tokenizer_model(vocab.model)
        w.add_tokenizer_pre(vocab.pre)
        w.add_token_list(vocab.tokens)
        if vocab.scores is not None:
            w.add_token_scores(vocab.scores)
        w.add_token_types(vocab.types)
        if vocab.add_space_prefix is not None:
            w.add_add_space_prefix(vocab.add_space_prefix)
        # gguf-py reads tokenizer.json, tokenizer_config.json, the chat templates, merges.txt and config.json by
        # name: it is given a staged copy of the checked files, never the user's directory
        # merges.txt is read by gguf-py only when tokenizer.json holds none; transformers' fast tokenizer never
        # reads it beside a tokenizer.json, so neither does the GGUF
        skip = ("merges.txt",) if (tok_dir / "tokenizer.json").exists() else ()
        check_special_ids(tok_dir)
        with staged_tokenizer(tok_dir, "config.json", skip=skip) as staged, gguf_log("gguf.vocab", staged,
                                                                                    tok_dir) as said:
            try:
                special = g.SpecialVocab(staged, load_merges=vocab.merges, n_vocab=len(vocab.tokens))
            except Exception as e:  # noqa: BLE001 - gguf-py raises what its json reads raise, on any file
                text = escape_controls(renamed(str(e).split("\n", 1)[0], staged, tok_dir))[:160]
                raise MConvertError(f"{tok_dir / special_vocab_file(e)}: llama.cpp's converter (gguf-py's "
                                    f"SpecialVocab) cannot read it ({type(e).__name__}: {text}); re-save the "
                                    "tokenizer") from None
        self.warnings += [f"gguf-py: {w}" for w in said]
        if vocab.merges and not special.merges:
            raise MConvertError(f"{tok_dir}: tokenizer.json holds no BPE merges; re-save the tokenizer")
        ids = {t: i for i, t in enumerate(vocab.tokens)}
        for typ, text in self.layout.special_tokens.items():
            if text in ids:
                special._set_special_token(typ, ids[text])
        special.add_to_gguf(w, quiet=True)

    def _converted(self, t: GgufTensor, x: np.ndarray, stacked: bool = False) -> np.ndarray:
        """Tensor `t`'s bytes in its GGML type, from `x` as the GGUF stores it (`gguf_data`); `stacked`: `x`
        is one expert's slice of `t`."""
        if tuple(x.shape) != (t.shape[1:] if stacked else t.shape):
            raise MConvertError(f"tensor {t.hf[0] if t.hf else t.name}: shape {list(x.shape)}, the plan has "
                                f"{list(t.shape)}")
        name = t.hf[0] if t.hf else t.name
        fix = "write --outtype bf16 or f32"
        q = _gguf().GGMLQuantizationType
        if t.qtype == q.F16:
            return to_float16(x, name, fix)
        if t.qtype == q.F32:
            return to_float32(x, name, fix)
        if t.qtype == q.Q8_0:
            return quantize_q8_0(x, name=name, fix=fix)  # cast to float32 a slice at a time
        if t.qtype == q.BF16 and x.dtype == BF16_BITS:
            return x  # bfloat16 written as it is
        return _gguf().quants.quantize(to_float32(x, name, fix), t.qtype)

    def add(self, unit: Unit, tensors: dict[str, Any], states: dict[str, dict] | None = None,
            complete: bool = True) -> None:
        """Write HF-named tensors (arrays, or torch tensors taken as arrays at this edge) of `unit`: a unit whole
        or in parts, an MoE layer as its dense part and one expert at a time (`splits_experts`), each expert's
        tensor written as its slice of the stacked tensor at its offset (a q8_0 row is quantized alone, so a
        slice is the stacked tensor's bytes for that expert); a tensor the plan has no place for is refused by
        name. The tensors are converted several at once on the readers' pool (numpy releases the GIL), each
        written as soon as it is ready."""
        todo = {k: as_array(v) for k, v in tensors.items() if not dropped_mtp(self.spec, self.layout, k)}
        left = sorted(k for k in todo if k not in self._uses)
        if left:
            raise MConvertError(f"unit {unit}: tensor {left[0]} has no place in the GGUF plan; conversion refused")
        jobs = sorted((i, e, k) for k in todo for i, e in self._uses[k])  # file order where a unit comes whole

        def one(job: tuple[int, int | None, str]) -> np.ndarray:
            i, _, k = job
            t = self.plan[i]
            data = gguf_data(self.spec, self.layout, k, todo[k], self.permute)
            return self._converted(t, t.make(self.spec, data) if t.make is not None else data, stacked=len(t.hf) > 1)

        def elements(job: tuple[int, int | None, str]) -> int:  # of the result: a stacked tensor's one slice
            shape = self.plan[job[0]].shape
            return math.prod(shape[1:] if job[1] is not None else shape)

        for (i, e, k), out in zip(jobs, pmap_iter(one, jobs, elements)):
            if (i, e) in self._written:
                raise MConvertError(f"unit {unit}: tensor {k} came twice; cannot write {self.plan[i].name}")
            self._write_piece(i, e, out)

    def wants(self, unit: Unit) -> set[str] | None:
        """The HF names of `unit` the plan writes: the tensors of multi-token prediction layers the layout leaves
        out (in the final unit, and their copy of the embedding in the embedding unit) are not read."""
        if unit not in ("embedding", "final") or not self.spec.mtp_num_layers or self.layout.mtp_blocks:
            return None
        return {h for t in self.plan if t.unit == unit for h in t.hf}

    def _write_piece(self, i: int, expert: int | None, out: np.ndarray) -> None:
        """Tensor i's bytes, or expert `expert`'s slice of them (tensor i stacks its experts), marked written."""
        self._written.add((i, expert))
        if expert is None:
            self._file.write_at(i, out)
            return
        t = self.plan[i]
        self._file.write_at(i, out, expert * (t.nbytes // t.shape[0]))

    def close(self) -> list[Path]:
        """Finish the file; refuse one that misses a planned tensor."""
        for i, t in enumerate(self.plan):
            lost = [h for e, h in enumerate(t.hf) if (i, e if len(t.hf) > 1 else None) not in self._written]
            if lost or (not t.hf and (i, None) not in self._written):
                raise MConvertError(f"GGUF incomplete: {t.name} (from {', '.join(lost) or 'the spec'}) was never "
                                    "written")
        self._file.close()
        return [self.path]

    def abort(self) -> None:
        """Close the file; the atomic output removes it."""
        self._file.abort()
