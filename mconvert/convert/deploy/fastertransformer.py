"""FasterTransformer's on-disk layout: `prepare` (what FT can hold, config.ini, every file and its bytes: the one
place the verb `megatron-to-ft` in `convert/verbs.py`, the writer, `--dry-run` and `plan --to ft` take them from),
the writer and the loader-side layout check.

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
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mconvert import dtypes
from mconvert.convert.base import units_of
from mconvert.io import buffers
from mconvert.io.atomic import record_digest
from mconvert.io.hashing import HashingFile
from mconvert.io.paths import contained, inside_file, read_small
from mconvert.io.casts import check_narrowed
from mconvert.convert.scaleout import world
from mconvert.convert.writer import Writer
from mconvert.errors import MConvertError
from mconvert.mappings import deploy
from mconvert.mappings.record import FTFile, FTLayout
from mconvert.mappings.fields import Field, check, neutral, refused
from mconvert.layouts.ft import (  # noqa: F401 - the module's own names, importable from here too
    FT_PARAM_DTYPES, FTPrepared, ft_config, ft_dtype, ft_expected_files, ft_layout, ft_layouts, prepare,
    section_layout)

# FT's weight_data_type names -> (numpy dtype of the raw files, torch dtype)
FT_DTYPES = {row.aliases[0]: (row.np, row.torch) for row in map(dtypes.lookup, FT_PARAM_DTYPES)}

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


# config.ini fields FT's model classes read that change what FT computes, each refused at another value than the one
# the checker and the reference runner assume (FT's own default: an absent field has it too); at another value the
# runner would judge another model than FT runs. Values as `_ft_value` reads them.
_FT_FIELDS: dict[str, Field] = {
    "layernorm_type": refused("only pre-layernorm blocks are computed by the reference runner", "pre_layernorm"),
    "has_positional_encoding": refused("the reference runner computes with FT's default (true)", True),
    "has_pre_decoder_layernorm": refused("a layernorm before the first block is not computed by the reference "
                                         "runner", False),
    "has_post_decoder_layernorm": refused("the reference runner computes the final layernorm", True),
    "use_attention_linear_bias": refused("ALiBi attention biases are not computed by the reference runner", False),
    "use_gptj_residual": refused("GPT-J's parallel residual is not computed by the reference runner", False),
    "int8_mode": refused("INT8 weights are not computed by the reference runner (only 0)", False),
    "has_adapters": refused("adapter layers are not computed by the reference runner", False),
    "prompt_learning_type": refused("prompt tables are not read by the reference runner (only 0)", False),
    **neutral("changes nothing while the refused fields hold their values",
              "model_name", "start_id", "end_id", "adapter_inter_size", "shared_contexts_ratio",
              "prompt_learning_start_id", "num_tasks", "max_pos_seq_len"),
}
_FT_TRUE, _FT_FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off", "", "none", "null")


def _ft_value(v: str) -> bool | str:
    """A config.ini value as the field table compares it: every spelling of a boolean (1 / 0 and empty too) as
    True / False, anything else in lower case."""
    v = v.strip().lower()
    return True if v in _FT_TRUE else False if v in _FT_FALSE else v


def _ft_fields(layout: FTLayout) -> dict[str, Field]:
    """The field table for one FT section: the common fields, the activation its MLP is checked with (FT's LLaMA
    MLP is SiLU-gated whatever activation_type says) and the fields the layout check reads."""
    act = "silu" if len(layout.kernels.mlp) == 3 else "gelu"
    read = (*layout.required_fields, "tensor_para_size", "layernorm_eps",
            *((layout.kernels.rotary_dim,) if layout.kernels.rotary_dim else ()))
    return {
        **_FT_FIELDS,
        "activation_type": refused(f"the reference runner computes the [{layout.section}] MLP with {act} only", act),
        **neutral("read and checked by the layout check", *read),
    }


def check_ft_fields(section: str, cfg: dict[str, str], ini: Path) -> list[str]:
    """Every field that decides what FT computes holds the value the runner computes with (the section's table,
    checked by `mappings.fields.check`; empty, 0 and false are unset); [] or the problem (its summary, then one
    line per field when several are refused)."""
    try:
        check(cfg, _ft_fields(section_layout(section)), f"{ini} [{section}]", "FasterTransformer field",
              "validation refused — re-export the directory", unknown_hint="", norm=_ft_value, show=str.strip)
    except MConvertError as e:
        return [e.summary, *e.details]
    return []


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
    problems = check_ft_fields(section, cfg, ini)
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
class _RawFiles:
    """FT weight files (raw little-endian values), each written through `io.hashing.HashingFile` — O_DIRECT
    from 1 MiB up, hashed on the way and handed to the manifest, so the manifest never reads them back. Up to
    `window` files are in flight, so converting the next tensor overlaps writing the previous ones; `finish()`
    waits for the rest."""

    def __init__(self, window: int = 1) -> None:
        self._open: Any = deque()
        self._window = window

    def write(self, path: Path, x: torch.Tensor, dtype: str) -> int:
        src = buffers.contiguous(x.detach().to(torch.float32))
        with np.errstate(over="ignore"):  # an overflow is refused below, by name
            arr = src.numpy().astype(FT_DTYPES[dtype][0], copy=False)
        check_narrowed(src, torch.from_numpy(arr), path.name, "keep float32 (--dtype fp32)")
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


class FTWriter(Writer):
    """FasterTransformer's `<infer_tp>-gpu/` directory as a `Writer` (`convert/writer.py`): each unit's full
    tensors cut by the family's FT table (`mappings.deploy`) into raw files; `close()` writes config.ini. The verb
    then runs `refuse_written` on the whole output (under torchrun: once every rank wrote its part).

    Under torchrun (`scaleout`) the units go round robin to the ranks in the order `units_of` gives (embedding,
    layers, final): a rank writes every file of the units it owns, reads the embedding too when it owns the final
    unit of a tied model whose head FT reads as a copy, and rank 0 writes config.ini."""

    reads = "mcore"
    takes_parts = True  # `add(unit, part, complete=False)` per part, then `add(unit, {}, complete=True)`
    shares_work = True  # the units go round robin to the torchrun processes

    def __init__(self, out: Path, prepared: "FTPrepared") -> None:
        self.prepared = prepared
        spec = self.spec = prepared.spec
        self.infer_tp, self.dtype, self.source = prepared.infer_tp, prepared.dtype, prepared.source
        self.layout = prepared.layout
        self.ft_dir = Path(out) / f"{self.infer_tp}-gpu"
        self.ft_dir.mkdir(exist_ok=True)  # every torchrun rank writes into the one directory
        self.nbytes = 0
        self._written: list[Path] = []
        self._embed: torch.Tensor | None = None
        self._raw = _RawFiles()
        self.world = world()
        self._plan = {unit: i for i, unit in enumerate(units_of(spec))}
        self._parts: dict[Any, set[str]] = {}  # the parameters each unit in progress has brought so far

    def _owns(self, unit: Any) -> bool:
        if unit not in self._plan:
            raise MConvertError(f"internal: unit {unit!r} is not one of the model's units")
        return self.world.owns(self._plan[unit])

    def _keeps_embedding(self, unit: Any) -> bool:
        """Whether `unit` is the embedding the head file of a tied model repeats (FT reads the head always)."""
        return unit == "embedding" and self.spec.tie_embeddings and self.layout.always_reads_head

    def needs(self, unit: Any) -> bool:
        """Whether this rank must read `unit`: it owns it, or it is the embedding a tied head here copies."""
        return self._owns(unit) or (self._keeps_embedding(unit) and self._owns("final"))

    def skip(self, unit: Any) -> None:
        """Pass `unit` by unread (`needs` is False): another rank writes its files."""

    def add(self, unit: Any, tensors: dict[str, torch.Tensor], complete: bool = True) -> None:
        """One unit's files (replicated tensors once, split ones per rank). `complete=False` (`takes_parts`):
        more of the unit's parameters follow; each part's files are written as it comes."""
        came = self._parts.setdefault(unit, set())
        in_parts = not complete or bool(came)
        came.update(tensors)
        if complete:
            del self._parts[unit]
            if in_parts and self._owns(unit):
                deploy.check_complete(self.spec, unit, came, "FasterTransformer", self.source)
        if self._keeps_embedding(unit) and deploy.EMBEDDING in tensors:
            self._embed = tensors[deploy.EMBEDDING]
        if not self._owns(unit) or not tensors:
            return
        per_rank = deploy.rank_tensors(self.spec, self.layout.files, unit, tensors, self.infer_tp,
                                       "FasterTransformer", self._embed, self.source, part=in_parts,
                                       empty=buffers.empty)
        for name, x in deploy.files(per_rank).items():
            self.nbytes += self._raw.write(self.ft_dir / name, x, self.dtype)
            self._written.append(self.ft_dir / name)

    def close(self) -> list[Path]:
        """Finish the files and (rank 0) write config.ini; the files this process wrote."""
        self._raw.finish()
        if self.world.primary:
            with open(self.ft_dir / "config.ini", "w") as fh:
                fh.write(self.prepared.config_text)
            self._written.append(self.ft_dir / "config.ini")
        return sorted(self._written)

    def abort(self) -> None:
        self._raw.abort()


def refuse_written(ft_dir: Path) -> None:
    """Refuse an FT directory mconvert wrote that FT's loader would not read as written (`check_ft_dir`)."""
    problems = check_ft_dir(ft_dir)
    if problems:  # our own writer disagreeing with FT's loader is a bug: never leave the dir behind
        raise MConvertError(f"FT layout check failed on what was written: {problems[0]}")
