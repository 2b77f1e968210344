"""Which on-disk format a path holds (Megatron checkpoint, HF dir, FT dir, ONNX dir), and small facts about it.

Detection looks only at file names and small text files, so it is instant and never unpickles anything.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mconvert import dtypes
from mconvert.layouts.megatron import RANK_FILE, parse_rank_dir
from mconvert.io.paths import inside_file, load_json_object
from mconvert.convert import detect
from mconvert.convert.megatron import bridge
from mconvert.convert.megatron.checkpoint import DIST_MARKERS, args_dict, checkpoint_dict, is_iteration_dir
from mconvert.convert.deploy.fastertransformer import ft_number, read_ft_config
from mconvert.layouts.megatron import iteration_dir_name, read_latest
from mconvert.io.safeload import safe_load
from mconvert.convert.deploy.trtllm import read_trtllm_config
from mconvert.errors import MConvertError


@dataclass
class ModelInfo:
    """What the validator needs to know about one model before running it."""

    path: Path
    format: str
    dtype: str = "float32"  # float32 | float16 | bfloat16 (the dtype it computes in)
    vocab_size: int | None = None  # true vocab (logit columns that count)
    max_positions: int | None = None
    layout: dict[str, Any] = field(default_factory=dict)  # tp / pp / infer_tp / iteration ...
    tokenizer_dir: Path | None = None
    window: int | None = None  # keys a query sees in a sliding-window layer (HF sliding_window); None: no window


def _window_keys(parse: Any, *args: Any) -> int | None:
    """The sliding window (keys per query) of the model a parser reads from `args`; None when it has none or
    the config is not one mconvert reads (the runner says so when it runs it)."""
    from mconvert.mappings import families  # the family registry, only when a model is described

    try:
        spec = getattr(families, parse)(*args)
    except MConvertError:
        return None
    return None if spec.window_size is None else spec.window_size + 1


def detect_format(path: str | Path) -> str:
    """Name the format held at `path` (`convert.detect`, every format); one-line error when it is none we run."""
    return detect.detect_format(path, accept=detect.FORMATS)


def _megatron_iter_dirs(p: Path) -> list[Path]:
    out = []
    for d in p.iterdir():
        if d.is_dir() and (d.name == "release" or d.name.startswith("iter_")):
            if any(parse_rank_dir(r.name) is not None and (r / RANK_FILE).is_file() for r in d.iterdir()):
                out.append(d)
    return sorted(out)


def _ft_config(p: Path) -> Path | None:
    """FT's `config.ini`: directly in `p` or in the single `<t>-gpu/` directory below it."""
    if (p / "config.ini").is_file():
        return p / "config.ini"
    found = sorted(p.glob("*-gpu/config.ini"))
    return found[0] if found else None


def describe(path: str | Path, fmt: str | None = None) -> ModelInfo:
    """Detect the format and read dtype, true vocab size, positions, layout and tokenizer location."""
    p = Path(path)
    fmt = fmt or detect_format(p)
    info = ModelInfo(path=p, format=fmt)
    if fmt == "hf":
        cfg = _read_json(p / "config.json")
        info.dtype = norm_dtype(cfg.get("torch_dtype") or cfg.get("dtype") or "float32")
        info.vocab_size = cfg.get("vocab_size")
        info.max_positions = cfg.get("max_position_embeddings") or cfg.get("n_positions")
        info.tokenizer_dir = p if has_tokenizer(p) else None
        info.window = _window_keys("spec_from_hf_config", cfg)
    elif fmt == "megatron" or (fmt == "megatron-torch_dist" and not is_iteration_dir(p)):
        _describe_megatron(info)  # a checkpoint root: its tracker names the iteration (torch or torch_dist)
    elif fmt == "megatron-torch_dist":
        info.tokenizer_dir = p if has_tokenizer(p) else None
    elif fmt == "ft":
        ini = _ft_config(p)
        _, sec = read_ft_config(ini.parent)
        wdt = sec.get("weight_data_type", "fp32")
        info.dtype = norm_dtype(wdt)
        info.vocab_size = ft_number(sec, "vocab_size", ini) if "vocab_size" in sec else None
        if "max_pos_seq_len" in sec:
            info.max_positions = ft_number(sec, "max_pos_seq_len", ini)
        info.layout = {"infer_tp": ft_number(sec, "tensor_para_size", ini) if "tensor_para_size" in sec else 1}
        for cand in (p, ini.parent, p.parent):
            if has_tokenizer(cand):
                info.tokenizer_dir = cand
                break
    elif fmt == "trtllm":
        cfg = read_trtllm_config(p / "config.json")
        info.dtype = norm_dtype(cfg["dtype"])
        info.vocab_size = cfg["vocab_size"]
        info.max_positions = cfg.get("max_position_embeddings")
        info.layout = {"tp": cfg["mapping"]["tp_size"]}
        for cand in (p, p.parent):
            if has_tokenizer(cand):
                info.tokenizer_dir = cand
                break
    elif fmt == "gguf":
        from mconvert.validators.gguf_runner import gguf_dtype, read_gguf_metadata

        meta = read_gguf_metadata(p)
        arch = meta.get("general.architecture")
        info.dtype = gguf_dtype(meta, p)
        info.vocab_size = meta.get("n_vocab")
        info.max_positions = meta.get(f"{arch}.context_length")
        info.layout = {"arch": arch, "file_type": meta.get("file_type_name")}
        info.tokenizer_dir = p.parent if has_tokenizer(p.parent) else None
    elif fmt == "onnx":
        d = p if p.is_dir() else p.parent
        if (d / "config.json").is_file():
            cfg = _read_json(d / "config.json")
            info.vocab_size = cfg.get("vocab_size")
            info.max_positions = cfg.get("max_position_embeddings") or cfg.get("n_positions")
            info.window = _window_keys("spec_from_hf_config", cfg)
        info.dtype = _onnx_dtype(p if p.is_file() else (d / "model.onnx"))
        info.tokenizer_dir = d if has_tokenizer(d) else None
    return info


def _describe_megatron(info: ModelInfo) -> None:
    p = info.path
    try:
        it = read_latest(p)
    except MConvertError:
        dirs = _megatron_iter_dirs(p)
        if not dirs:
            raise
        it = "release" if dirs[-1].name == "release" else int(dirs[-1].name[5:])
    d = p / iteration_dir_name(it)
    ranks = [parse_rank_dir(r.name) for r in d.iterdir() if r.is_dir()] if d.is_dir() else []
    ranks = [r for r in ranks if r is not None]
    if not ranks and any(os.path.lexists(d / m) for m in DIST_MARKERS):  # torch_dist: no TP/PP layout to run at
        info.format = "megatron-torch_dist"
        # Megatron-Bridge: no args in common.pt, its model provider instead
        rc = bridge.find_run_config(d, beside=not (d / "common.pt").is_file())
        if rc is not None:
            a = args_dict(bridge.megatron_args(bridge.read_run_config(rc), str(rc)), rc)
        else:
            common = checkpoint_dict(safe_load(d / "common.pt", "common.pt"), d / "common.pt")
            a = args_dict(common.get("args"), d / "common.pt")
        info.dtype = "bfloat16" if a.get("bf16") else "float16" if a.get("fp16") else "float32"
        info.vocab_size = a.get("vocab_size") or a.get("padded_vocab_size")
        info.max_positions = a.get("max_position_embeddings")
        info.window = _window_keys("spec_from_megatron_args", a)
        info.layout = {"iteration": it}
        info.tokenizer_dir = next((c for c in (p, p / "tokenizer", p.parent, d / bridge.TOKENIZER_DIR)
                                   if has_tokenizer(c)), None)
        return
    if not ranks:
        raise MConvertError(f"{d}: no mp_rank_* directories; is iteration {it} in this checkpoint?")
    tp = max(r[0] for r in ranks) + 1
    pp = max((r[1] or 0) for r in ranks) + 1
    first = d / ("mp_rank_00" if pp == 1 else "mp_rank_00_000") / RANK_FILE
    state = safe_load(first)
    a = args_dict(checkpoint_dict(state, first).get("args"), first)
    info.dtype = "bfloat16" if a.get("bf16") else "float16" if a.get("fp16") else "float32"
    info.vocab_size = a.get("vocab_size") or a.get("padded_vocab_size")
    info.max_positions = a.get("max_position_embeddings")
    info.window = _window_keys("spec_from_megatron_args", a)
    info.layout = {"tp": tp, "pp": pp, "iteration": it}
    for cand in (p, p / "tokenizer", p.parent):
        if has_tokenizer(cand):
            info.tokenizer_dir = cand
            break


def _onnx_dtype(path: Path) -> str:
    try:
        import onnx  # heavy optional import: onnx loads only when an ONNX file is inspected

        m = onnx.load(str(path), load_external_data=False)
        out = next((o for o in m.graph.output if o.name == "logits"), m.graph.output[0])
        row = dtypes.of_onnx(onnx.TensorProto.DataType.Name(out.type.tensor_type.elem_type))
        return row.name if row is not None and row.floating else "float32"
    except Exception:
        return "float32"


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def has_tokenizer(p: Path) -> bool:
    return p.is_dir() and any((p / f).is_file() for f in TOKENIZER_FILES)


def _read_json(path: Path) -> dict[str, Any]:
    return load_json_object(inside_file(path.parent, path.name, f"{path.parent}: model file"), "JSON",
                            "re-export the model")


def norm_dtype(d: Any) -> str:
    """A dtype as configs spell it (`bfloat16`, `bf16`, `torch.float16`, torch's `half` / `float`) -> its canonical
    name (`mconvert.dtypes`); float32 for what names no float type."""
    name = str(d).removeprefix("torch.")
    row = dtypes.lookup(name)
    if row is None and isinstance(getattr(torch, name, None), torch.dtype):  # torch's own spellings: half, float
        row = dtypes.of_torch(getattr(torch, name))
    return row.name if row is not None and row.floating else "float32"


def stand_in_model_type(model_type: str) -> str:
    """The model_type whose class the installed transformers builds for `model_type`'s function: itself, or, for a
    class newer than the installed transformers, its family's `transformers_stand_in`."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    from mconvert.mappings.families import by_model_type

    fam = by_model_type(model_type)
    if model_type in CONFIG_MAPPING_NAMES or fam is None or fam.transformers_stand_in is None:
        return model_type
    return fam.transformers_stand_in


def reference_config(path: Path) -> dict[str, Any]:
    """`from_pretrained`'s `config=` for HF dir `path` when the installed transformers builds it as a stand-in
    (`stand_in_model_type`); else nothing (transformers reads config.json itself)."""
    cfg = load_json_object(Path(path) / "config.json", "HF config")
    model_type = str(cfg.get("model_type", ""))
    stand_in = stand_in_model_type(model_type)
    if stand_in == model_type:
        return {}
    from transformers import AutoConfig

    rest = {k: v for k, v in cfg.items() if k not in ("model_type", "architectures", "transformers_version")}
    return {"config": AutoConfig.for_model(stand_in, **rest)}


def reference_attention(config: Path | dict) -> dict[str, str]:
    """The attention implementation transformers runs a reference in: its SDPA and flash paths drop
    attention-logit soft-capping (Gemma 2's `attn_logit_softcapping`) without a word, so a model that declares it
    runs in the eager path, the one that computes what the config describes."""
    cfg = config if isinstance(config, dict) else load_json_object(Path(config) / "config.json", "HF config")
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}
    capped = cfg.get("attn_logit_softcapping") or text.get("attn_logit_softcapping")
    return {"attn_implementation": "eager"} if capped else {}
