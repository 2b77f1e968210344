"""What FasterTransformer can hold and what one conversion to it writes, from shapes alone: the family's FT
section after every refusal (`ft_layout`), config.ini (`ft_config`), every file FT's loader opens with its bytes,
and `prepare`, the one place the verb `megatron-to-ft`, `FTWriter`, `--dry-run` and `plan --to ft` take them
from. No tensor is touched here (`plan` runs without torch); the writer and the loader-side check are in
`fastertransformer.py`."""

from __future__ import annotations

import configparser
import io
import math
from dataclasses import dataclass
from typing import Any

from mconvert import dtypes
from mconvert.errors import MConvertError
from mconvert.mappings import families
from mconvert.mappings.deploy_names import unit_names
from mconvert.mappings.record import FTFile, FTLayout
from mconvert.spec import ModelSpec, Unit

FT_PARAM_DTYPES = ("float32", "float16")  # what FT's weight_data_type (fp32 / fp16) names


def ft_layouts() -> dict[str, FTLayout]:
    """Every FT section a family declares, by section name (families may share one)."""
    out: dict[str, FTLayout] = {}
    for fam in families.all_families():
        if fam.ft is not None:
            out.setdefault(fam.ft.section, fam.ft)
    return out


def section_layout(section: str) -> FTLayout:
    """The layout of a config.ini section; one MConvertError for a section no family declares."""
    layout = ft_layouts().get(section)
    if layout is None:
        raise MConvertError(f"unknown FasterTransformer section [{section}]")
    return layout


# ---- what FT can hold --------------------------------------------------------------------------------
def ft_layout(spec: ModelSpec, infer_tp: int, allow_approx_gelu: bool = False,
              option: str = "--infer-tp") -> FTLayout:
    """The FT section of a model FT can represent exactly at `infer_tp`; one-line refusal otherwise, naming
    `option`, the caller's flag for the inference TP (`plan` calls it --target-tp)."""
    spec.refuse_unmapped("FasterTransformer")
    nh, hd, H = spec.num_attention_heads, spec.head_dim, spec.hidden_size
    if infer_tp < 1:
        raise MConvertError(f"{option} must be >= 1 (got {infer_tp})")
    if nh * hd != H:
        raise MConvertError(
            f"FasterTransformer needs head_num·size_per_head = hidden ({nh}·{hd} != {H}); it cannot hold this model"
        )
    if nh % infer_tp:
        raise MConvertError(f"{option} {infer_tp} does not divide num_attention_heads={nh}; pick a divisor")
    if spec.ffn_hidden_size % infer_tp:
        raise MConvertError(f"{option} {infer_tp} does not divide ffn_hidden_size={spec.ffn_hidden_size}")
    layout = families.of(spec).ft
    if layout is None or not layout.holds(spec):
        raise MConvertError(
            f"FasterTransformer has no layout for {spec.normalization} + {spec.activation} + "
            f"{spec.position_embedding_type} positions ({spec.family}); supported: GPT-2 style and LLaMA style"
        )
    layout.refuse(spec, infer_tp, allow_approx_gelu)
    return layout


# ---- the files FT's loader opens ---------------------------------------------------------------------
def ft_expected_files(section: str, cfg: dict[str, Any]) -> list[FTFile]:
    """Every file FT's C++ loader opens for a config (int8_mode 0, no prompt tables), with its shape."""
    return section_layout(section).expected_files(cfg)


def ft_config(spec: ModelSpec, section: str, infer_tp: int, dtype: str, source: str) -> configparser.ConfigParser:
    """config.ini: FT's fields for the section (layernorm_eps always) plus an informational [mconvert] section."""
    layout = section_layout(section)
    def token(tid: int | None) -> int:  # unknown or outside the vocab (GPT-2 config defaults): last id
        return tid if tid is not None and 0 <= tid < spec.vocab_size else spec.vocab_size - 1

    start, end = token(spec.bos_token_id), token(spec.eos_token_id)
    common = {
        "model_name": layout.model_name or spec.family,  # FT's converters: "gpt" / the model's name
        "head_num": spec.num_attention_heads,
        "size_per_head": spec.head_dim,
        "inter_size": spec.ffn_hidden_size,
        "num_layer": spec.num_layers,
        "vocab_size": spec.vocab_size,
        "layernorm_eps": repr(float(spec.norm_epsilon)),
        "start_id": start,
        "end_id": end,
        "weight_data_type": dtype,
        "tensor_para_size": infer_tp,
    }
    fields = dict(common, **layout.config_fields(spec))
    cp = configparser.ConfigParser()
    cp[section] = {k: str(v) for k, v in fields.items()}
    cp["mconvert"] = {  # FT ignores unknown sections; kept for provenance
        "source": source,
        "source_activation": spec.activation,
        "tie_word_embeddings": str(spec.tie_embeddings),
        "true_vocab_size": str(spec.vocab_size),
    }
    return cp


def ft_dtype(name: str) -> str:
    """FT's `weight_data_type` word (`fp32` / `fp16`) for `--dtype NAME`; other dtypes refused by name."""
    return dtypes.short_name(dtypes.choose(name, FT_PARAM_DTYPES, auto=False,
                                           why="FasterTransformer weights are fp32 or fp16"))


@dataclass(frozen=True)
class FTPrepared:
    """What one FasterTransformer conversion writes, worked out before any tensor is read: the spec as FT runs
    it (a sliding window accepted as full attention), its section after every refusal, FT's weight_data_type,
    config.ini, every file of `<infer_tp>-gpu/` with its bytes (FT's own file list) and the report's notes."""

    spec: ModelSpec
    layout: FTLayout
    infer_tp: int
    dtype: str  # FT's weight_data_type word: fp32 / fp16
    source: str  # named in config.ini's [mconvert] section and in errors
    config_text: str  # config.ini as written
    files: list[dict[str, Any]]  # {"path": "<t>-gpu/NAME", "bytes"}, sorted by path
    units: dict[str, Unit]  # each weight file's path -> the unit whose tensors it holds (config.ini: none)
    notes: list[str]

    @property
    def where(self) -> str:
        """The report's layout: `[gpt] TP=2`."""
        return f"[{self.layout.section}] TP={self.infer_tp}"


def prepare(spec: ModelSpec, infer_tp: int, dtype: str = "fp32", allow_approx_gelu: bool = False,
            accept_window_as_full: bool = False, source: str = "checkpoint", option: str = "--infer-tp") -> FTPrepared:
    """The one place FT's refusals, config and file sizes are worked out (the verb, `FTWriter`, `--dry-run` and
    `plan --to ft` call it): the dtype FT stores, a sliding window (`accept_window_as_full`: written for FT's
    full attention, with a note), what FT's loader cannot hold at `infer_tp` (`ft_layout`; `option` names the
    caller's flag), then config.ini and every file FT's loader opens, from shapes alone."""
    dtype = ft_dtype(dtype)
    spec, window_note = spec.window_as_full("FasterTransformer", accept_window_as_full)
    layout = ft_layout(spec, infer_tp, allow_approx_gelu, option)
    notes = [window_note] if window_note else []
    if spec.activation == "gelu":
        notes.append("exact-erf GeLU model written for FT's tanh GeLU (--allow-approx-gelu): logits will differ")
    if layout.tied_head_note and spec.tie_embeddings:
        notes.append(layout.tied_head_note)
    cfg = ft_config(spec, layout.section, infer_tp, dtype, source)
    text = io.StringIO()
    cfg.write(text)
    itemsize = dtypes.lookup(dtype).itemsize  # type: ignore[union-attr]
    head = not spec.tie_embeddings
    files = [{"path": f"{infer_tp}-gpu/{f.name}", "bytes": math.prod(f.shape) * itemsize}
             for f in ft_expected_files(layout.section, dict(cfg[layout.section])) if head or not f.optional]
    files.append({"path": f"{infer_tp}-gpu/config.ini", "bytes": len(text.getvalue().encode())})
    tied = spec.tie_embeddings and layout.always_reads_head
    units = {f"{infer_tp}-gpu/{name}": unit for unit in spec.units() for r in range(infer_tp)
             for name in unit_names(spec, layout.files, unit, tied, r)}
    return FTPrepared(spec, layout, infer_tp, dtype, source, text.getvalue(),
                      sorted(files, key=lambda f: f["path"]), units, notes)
