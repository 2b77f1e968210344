"""FasterTransformer's on-disk layout: writer (`megatron-to-ft`) and the loader-side layout check.

Facts read from FT's own code (NVIDIA/FasterTransformer):
- GPT (`[gpt]`): converters `examples/pytorch/gpt/utils/megatron_ckpt_convert.py` and
  `huggingface_gpt_convert.py`; loader `ParallelGptWeight.cc::loadModel` + `ParallelGptDecoderLayerWeight.cc`.
  Replicated tensors have no rank suffix; column/row-parallel ones end in `.R.bin`; every 2-D weight is
  `[in, out]`; the fused QKV is `[H, 3, H/t]` (q|k|v, each split by heads); the layer index is global.
  `model.lm_head.weight.bin` present -> untied head, absent -> the head is `model.wte.bin`.
  FT's GPT has one activation, `GeluActivation` = the tanh approximation (HF `gelu_new`), and
  `gptVariantParams::layernorm_eps` defaults to 1e-6, so `layernorm_eps` is always written.
  `vocab_size` is the row count of `model.wte.bin`; FT pads it per rank itself (`vocab_size_padded_`).
- LLaMA (`[llama]`): converter `examples/cpp/llama/huggingface_llama_convert.py`; loader
  `models/llama/LlamaWeight.cc` + `LlamaDecoderLayerWeight.cc`. `model.wte.weight.bin`,
  `model.final_layernorm.weight.bin` and `model.lm_head.weight.bin` (always read: a tied model gets a copy),
  QKV `[H, 3, H/t]` (so MHA only: the loader sizes it 3·H/t), `mlp.{gate,up}_proj.weight.R.bin` `[H, F/t]`,
  `mlp.down_proj.weight.R.bin` `[F/t, H]`; every bias is zero-filled by the loader (no bias can be held);
  RMSNorm; rotary in GPT-NeoX style (`neox_rotary_style_ = true`, = HF rotate_half) over `rotary_embedding`
  dims with the kernels' fixed base 10000.
The loader only warns on a missing or short file (and runs on garbage): `check_ft_dir` fails instead.
"""

from __future__ import annotations

import configparser
import os
import re
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mconvert import dtypes
from mconvert.convert.io.atomic import atomic_output_dir, check_output, record_digest
from mconvert.convert.io.hashing import HashingFile
from mconvert.convert.io.paths import contained, inside_file, read_small
from mconvert.convert.io.safeload import crc_in_background, wait_crc_checks
from mconvert.convert.progress import UnitProgress
from mconvert.convert.sources import open_source
from mconvert.errors import MConvertError
from mconvert.mappings import families
from mconvert.mappings.family import FTFile, FTLayout
from mconvert.spec import ModelSpec

# FT's weight_data_type names -> (numpy dtype of the raw files, torch dtype)
FT_DTYPES = {row.aliases[0]: (row.np, row.torch) for row in map(dtypes.lookup, ("float32", "float16"))}


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


@dataclass
class FTResult:
    """What `megatron_to_ft` wrote (for the CLI report)."""

    out: Path
    ft_dir: Path
    section: str
    infer_tp: int
    dtype: str
    files: int
    bytes: int
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "out": str(self.out), "ft_dir": str(self.ft_dir), "section": self.section, "infer_tp": self.infer_tp,
            "dtype": self.dtype, "files": self.files, "bytes": self.bytes, "notes": self.notes,
        }


# ---- what FT can hold --------------------------------------------------------------------------------
def ft_layout(spec: ModelSpec, infer_tp: int, allow_approx_gelu: bool = False) -> FTLayout:
    """The FT section of a model FT can represent exactly at `infer_tp`; one-line refusal otherwise."""
    spec.refuse_unmapped("FasterTransformer")
    nh, hd, H = spec.num_attention_heads, spec.head_dim, spec.hidden_size
    if infer_tp < 1:
        raise MConvertError(f"--infer-tp must be >= 1 (got {infer_tp})")
    if nh * hd != H:
        raise MConvertError(
            f"FasterTransformer needs head_num·size_per_head = hidden ({nh}·{hd} != {H}); it cannot hold this model"
        )
    if nh % infer_tp:
        raise MConvertError(f"--infer-tp {infer_tp} does not divide num_attention_heads={nh}; pick a divisor")
    if spec.ffn_hidden_size % infer_tp:
        raise MConvertError(f"--infer-tp {infer_tp} does not divide ffn_hidden_size={spec.ffn_hidden_size}")
    layout = families.of(spec).ft
    if layout is None or not layout.holds(spec):
        raise MConvertError(
            f"FasterTransformer has no layout for {spec.normalization} + {spec.activation} + "
            f"{spec.position_embedding_type} positions ({spec.family}); supported: GPT-2 style and LLaMA style"
        )
    layout.refuse(spec, infer_tp, allow_approx_gelu)
    return layout


def ft_section(spec: ModelSpec, infer_tp: int, allow_approx_gelu: bool = False) -> str:
    """The FT section name (`gpt`, `llama`, ...) for the model; one-line refusal otherwise."""
    return ft_layout(spec, infer_tp, allow_approx_gelu).section


# ---- the files FT's loader opens ---------------------------------------------------------------------
def ft_expected_files(section: str, cfg: dict[str, Any]) -> list[FTFile]:
    """Every file FT's C++ loader opens for a config (int8_mode 0, no prompt tables), with its shape."""
    return section_layout(section).expected_files(cfg)


# ---- reading an FT dir (shared by the check and the reference runner) ---------------------------------
def resolve_ft_dir(path: str | Path) -> Path:
    """`OUT` (holding one `<t>-gpu/`) or `OUT/<t>-gpu` itself -> the dir with config.ini."""
    path = Path(path)
    if os.path.lexists(path / "config.ini"):
        return path
    subs = sorted(p for p in path.glob("*-gpu") if os.path.lexists(p / "config.ini"))
    if len(subs) == 1:
        return contained(path, subs[0].name, f"{path}: FT directory")
    if not subs:
        raise MConvertError(f"{path}: no config.ini and no <N>-gpu/config.ini; not a FasterTransformer directory")
    raise MConvertError(f"{path}: several FT layouts ({', '.join(p.name for p in subs)}); pass one of them")


def read_ft_config(ft_dir: Path) -> tuple[str, dict[str, str]]:
    """(section, fields) of `config.ini`; the section is one a family declares (`gpt`, `llama`)."""
    cp = configparser.ConfigParser()
    ini = inside_file(ft_dir, "config.ini", f"{ft_dir}: FT config")
    try:
        cp.read_string(read_small(ini, "ini").decode("utf-8", errors="replace"), str(ini))
    except configparser.Error as e:
        raise MConvertError(f"{ft_dir / 'config.ini'}: unreadable ({str(e).splitlines()[0]})") from None
    known = list(ft_layouts())
    sections = [s for s in known if cp.has_section(s)]
    if len(sections) != 1:
        raise MConvertError(
            f"{ft_dir / 'config.ini'}: needs exactly one of the sections {' or '.join(f'[{s}]' for s in known)}"
        )
    fields = dict(cp[sections[0]])
    m = re.fullmatch(r"(\d+)-gpu", ft_dir.name)
    if "tensor_para_size" not in fields and m:
        fields["tensor_para_size"] = m.group(1)
    return sections[0], fields


def ft_number(fields: dict[str, str], key: str, ini: Path, kind: type = int) -> Any:
    """config.ini field `key` as an int (or `kind`); a missing field or text where a number belongs is one
    MConvertError naming the file and the key."""
    if key not in fields:
        raise MConvertError(f"{ini}: lacks {key}; re-export the FasterTransformer directory")
    try:
        return kind(fields[key])
    except ValueError:
        raise MConvertError(f"{ini}: {key} = {fields[key]!r} is not {'an integer' if kind is int else 'a number'}; "
                            "re-export the FasterTransformer directory") from None


def load_ft_tensor(ft_dir: Path, f: FTFile, dtype: str) -> torch.Tensor:
    """One raw little-endian file as a float32 tensor of the loader's shape (size checked)."""
    np_dtype = FT_DTYPES[dtype][0]
    path = ft_dir / f.name
    n = int(np.prod(f.shape))
    if not os.path.lexists(path):
        raise MConvertError(f"{path}: missing; FT would read garbage here")
    size = inside_file(ft_dir, f.name, f"{ft_dir}: FT weight file").stat().st_size
    if size != n * np_dtype.itemsize:
        raise MConvertError(
            f"{path}: {size} bytes, FT reads {n}×{np_dtype.itemsize} = {n * np_dtype.itemsize} for shape {f.shape}"
        )
    arr = np.fromfile(path, dtype=np_dtype)
    return torch.from_numpy(arr.astype(np.float32)).reshape(f.shape)


def check_ft_dir(path: str | Path) -> list[str]:
    """Problems FT's loader would meet (empty list: loadable as written). Each problem names its file."""
    try:
        ft_dir = resolve_ft_dir(path)
        section, cfg = read_ft_config(ft_dir)
    except MConvertError as e:
        return [str(e)]
    ini = ft_dir / "config.ini"
    layout = section_layout(section)
    problems = [f"{ini}: [{section}] lacks {k}" for k in layout.required_fields if k not in cfg]
    if problems:
        return problems
    try:
        ints = {k: ft_number(cfg, k, ini) for k in ("head_num", "size_per_head", "inter_size", "num_layer",
                                                    "vocab_size", "tensor_para_size")}
        ft_number(cfg, "layernorm_eps", ini, float)
        if layout.kernels.rotary_dim:
            ft_number(cfg, layout.kernels.rotary_dim, ini)
        if "max_pos_seq_len" in cfg:
            ft_number(cfg, "max_pos_seq_len", ini)
    except MConvertError as e:
        return [str(e)]
    not_positive = [k for k, v in ints.items() if v <= 0]
    if not_positive:
        return [f"{ini}: {not_positive[0]} = {ints[not_positive[0]]} must be positive; re-export the directory"]
    dtype = cfg["weight_data_type"]
    if dtype not in FT_DTYPES:
        return [f"{ini}: weight_data_type {dtype!r} (mconvert writes fp32 or fp16)"]
    t = ints["tensor_para_size"]
    if ft_dir.name.endswith("-gpu") and ft_dir.name != f"{t}-gpu":
        problems.append(f"{ini}: tensor_para_size={t} but the directory is {ft_dir.name}")
    if ints["head_num"] % t or ints["inter_size"] % t:
        problems.append(f"{ini}: tensor_para_size={t} does not divide head_num / inter_size")
        return problems
    problems += [f"{ini}: {p}" for p in layout.check_config(cfg, ints)]
    itemsize = FT_DTYPES[dtype][0].itemsize
    expected = ft_expected_files(section, cfg)
    for f in expected:
        p = ft_dir / f.name
        want = int(np.prod(f.shape)) * itemsize
        if os.path.lexists(p):
            try:
                inside_file(ft_dir, f.name, f"{ft_dir}: FT weight file")
            except MConvertError as e:
                problems.append(str(e))
                continue
        if not p.is_file():
            if not f.optional:
                problems.append(f"{p}: missing (FT's loader would only warn and run on uninitialised memory)")
        elif p.stat().st_size != want:
            problems.append(
                f"{p}: {p.stat().st_size} bytes, FT reads shape {list(f.shape)} × {itemsize} B = {want} bytes"
            )
    known = {f.name for f in expected}
    for p in sorted(ft_dir.glob("*.bin")):
        if p.name not in known:
            problems.append(f"{p}: not read by FT's {section} loader at tensor_para_size={t} (stray file)")
    return problems


# ---- writing -----------------------------------------------------------------------------------------
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


class _RawFiles:
    """FT weight files (raw little-endian values), each written through `io.hashing.HashingFile` — O_DIRECT
    from 1 MiB up, hashed on the way and handed to the manifest, so the manifest never reads them back. Up to
    `window` files are in flight, so converting the next tensor overlaps writing the previous ones; `finish()`
    waits for the rest."""

    def __init__(self, window: int = 1) -> None:
        self._open: Any = deque()
        self._window = window

    def write(self, path: Path, x: torch.Tensor, dtype: str) -> int:
        arr = x.detach().to(torch.float32).contiguous().numpy().astype(FT_DTYPES[dtype][0], copy=False)
        f = HashingFile(path, direct=arr.nbytes >= (1 << 20), chunk=4 << 20)  # one chunk size: a small pool
        self._open.append(f)
        f.write(memoryview(arr).cast("B"), keep=arr)
        while len(self._open) > self._window:
            self._close(self._open.popleft())
        return arr.nbytes

    def _close(self, f: Any) -> None:
        record_digest(f.path, f.close(), f.algorithm)

    def finish(self) -> None:
        while self._open:
            self._close(self._open.popleft())

    def abort(self) -> None:
        while self._open:
            self._open.popleft().abort()


def write_ft_dir(source: Any, ft_dir: Path, infer_tp: int, dtype: str = "fp32",
                 allow_approx_gelu: bool = False, progress: Any = None) -> tuple[str, int, int]:
    """Stream `source` unit by unit into `ft_dir` (already created). Returns (section, files, bytes)."""
    if dtype not in FT_DTYPES:
        raise MConvertError(f"--dtype {dtype!r}: FasterTransformer weights are fp32 or fp16")
    spec: ModelSpec = source.spec
    layout = ft_layout(spec, infer_tp, allow_approx_gelu)
    nfiles = nbytes = 0
    embed: torch.Tensor | None = None
    raw = _RawFiles()
    try:
        for unit in source.units():
            hf = source.read_hf(unit)
            if unit == "embedding":
                files = layout.embedding_files(hf)
                if spec.tie_embeddings and layout.always_reads_head:
                    embed = hf[families.of(spec).plugin.hf_embedding]
                wte = next(iter(files.values()))
                if wte.shape[0] != spec.vocab_size:
                    raise MConvertError(
                        f"{source.path}: embedding has {wte.shape[0]} rows, spec vocab_size={spec.vocab_size}"
                    )
            elif unit == "final":
                files = layout.final_files(hf, embed, spec)
            else:
                files = layout.layer_files(hf, int(unit), spec, infer_tp)
            for name, x in files.items():
                nbytes += raw.write(ft_dir / name, x, dtype)
                nfiles += 1
            if progress is not None:
                progress()
        raw.finish()
    except BaseException:
        raw.abort()
        raise
    with open(ft_dir / "config.ini", "w") as fh:
        ft_config(spec, layout.section, infer_tp, dtype, str(source.path)).write(fh)
    return layout.section, nfiles + 1, nbytes


@crc_in_background
def megatron_to_ft(src: str | Path, out: str | Path, infer_tp: int, dtype: str = "fp32", force: bool = False,
                   allow_approx_gelu: bool = False, iteration: str | None = None) -> FTResult:
    """`mconvert megatron-to-ft`: write `OUT/<infer_tp>-gpu/` atomically, then run the FT layout check on it."""
    if dtype not in FT_DTYPES:
        raise MConvertError(f"--dtype {dtype!r}: FasterTransformer weights are fp32 or fp16")
    check_output(out, force, (src,))
    source = open_source(src, iteration=iteration)
    layout = ft_layout(source.spec, infer_tp, allow_approx_gelu)  # refuse before any work
    units = source.units()
    with UnitProgress(f"FT {infer_tp}-gpu", len(units)) as step, atomic_output_dir(out, force, inputs=(src,)) as tmp:
        ft_dir = tmp / f"{infer_tp}-gpu"
        ft_dir.mkdir()
        section, nfiles, nbytes = write_ft_dir(source, ft_dir, infer_tp, dtype, allow_approx_gelu, step)
        problems = check_ft_dir(ft_dir)
        if problems:  # our own writer disagreeing with FT's loader is a bug: never leave the dir behind
            raise MConvertError(f"FT layout check failed on what was written: {problems[0]}")
        wait_crc_checks()  # the input's CRC-32, checked in the background, before the output is committed
    notes = []
    if source.spec.activation == "gelu":
        notes.append("exact-erf GeLU model written for FT's tanh GeLU (--allow-approx-gelu): logits will differ")
    if layout.tied_head_note and source.spec.tie_embeddings:
        notes.append(layout.tied_head_note)
    return FTResult(Path(out), Path(out) / f"{infer_tp}-gpu", section, infer_tp, dtype, nfiles, nbytes, notes)


def describe(result: FTResult) -> Iterator[tuple[str, str]]:
    """Rows for the CLI report."""
    d = result.to_dict()
    for k in ("ft_dir", "section", "infer_tp", "dtype", "files", "bytes"):
        yield k, str(d[k])
    for n in d["notes"]:
        yield "note", n

