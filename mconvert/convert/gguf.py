"""GGUF for llama.cpp (`mconvert megatron-to-gguf`, `hf-to-gguf`): one `.gguf` file written through gguf-py's
`GGUFWriter`, llama.cpp's own writer.

What is written follows llama.cpp's `convert_hf_to_gguf.py` (ggml-org/llama.cpp): tensor names from the family's
`GgufLayout` (gguf-py's `TensorNameMap` names), q/k rows permuted where the family's llama.cpp architecture ropes
adjacent pairs (`LlamaModel.permute`), llama3 rope scaling as a `rope_freqs.weight` factor tensor
(`LlamaModel.generate_extra_tensors`), 1-D tensors and norms in F32 whatever the outtype, a q8_0 tensor whose
rows are not whole 32-blocks in F16 (its QuantError fallback); the metadata keys of `TextModel` /
`LlamaModel.set_gguf_parameters`; the tokenizer as `_set_vocab_gpt2` writes it (tokens, token types, the
pre-tokenizer name, then gguf-py's `SpecialVocab`: merges, special ids, add-bos/eos, chat template).

Streaming: every tensor's name, shape and type follows from the ModelSpec alone (a meta-tensor pass through the
family's HF mapping), so the header is written first and each unit's tensors are appended as they arrive
(`GGUFWriter.add_tensor_info` up front, `write_tensor_data` per tensor): memory is one unit.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mconvert.convert.base import Unit, units_of
from mconvert.convert.io.atomic import atomic_output_file, check_output, file_manifest_path
from mconvert.convert.io.paths import inside_file, read_small
from mconvert.convert.driver import drive, peak_rss_bytes
from mconvert.convert.io.safeload import crc_in_background, skip_crc_checks, wait_crc_checks
from mconvert.convert.sources import open_source
from mconvert.convert.tokenizer import check_tokenizer_dir, load_tokenizer
from mconvert.convert.writer import Report, make_report
from mconvert.errors import MConvertError
from mconvert.mappings import families, to_hf
from mconvert.mappings.family import GgufLayout
from mconvert.mappings.gguf_vocab import BPE_MODEL, BYTE_LEVEL_REGEX, PRE_TOKENIZERS
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


@dataclass(frozen=True)
class GgufTensor:
    """One tensor of the file: GGUF name, the HF tensor it is made from (None: generated), its shape in torch
    order ([out, in]) and its GGML type."""

    name: str
    hf: str | None
    unit: Unit | None
    shape: tuple[int, ...]
    qtype: Any

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
    spec.refuse_unmapped("GGUF")
    families.refuse_for_hf(spec, "GGUF")
    if spec.rope_scaling not in (None, "linear", "llama3"):
        raise MConvertError(f"rope scaling {spec.rope_scaling!r} has no GGUF form here; conversion refused")
    layout.refuse(spec)
    if spec.rope_scaling == "llama3" and not layout.rope_freqs:
        raise MConvertError(f"rope scaling llama3 has no GGUF form for llama.cpp's {layout.arch} architecture; "
                            "conversion refused")
    return layout


def gguf_name(layout: GgufLayout, hf_name: str) -> str:
    """The GGUF name of one HF tensor name (layer index carried to the block index); unmapped is refused."""
    parts = hf_name.split(".")
    idx = next((i for i, p in enumerate(parts) if p.isdigit()), None)
    template = hf_name if idx is None else ".".join(parts[:idx] + ["*"] + parts[idx + 1:])
    out = layout.tensors.get(template)
    if out is None:
        raise MConvertError(f"tensor {hf_name} has no GGUF name in llama.cpp's {layout.arch} layout; conversion refused")
    return out if idx is None else out.replace("*", parts[idx], 1)


def tensor_type(name: str, shape: tuple[int, ...], outtype: str) -> Any:
    """convert_hf_to_gguf.py's choice: 1-D tensors, norms and non-weights stay F32; q8_0 needs rows of whole
    32-value blocks, else F16."""
    g = _gguf()
    want = outtype_types(outtype)[0]
    if len(shape) <= 1 or name.endswith("_norm.weight") or not name.endswith(".weight"):
        return g.GGMLQuantizationType.F32
    if want == g.GGMLQuantizationType.Q8_0 and shape[-1] % g.GGML_QUANT_SIZES[want][0]:
        return g.GGMLQuantizationType.F16
    return want


def _unit_decls(spec: ModelSpec, unit: Unit) -> list[Any]:
    if unit == "embedding":
        return spec.embedding_params(1)
    if unit == "final":
        return spec.final_params(1)
    return spec.layer_params(int(unit))


def plan_tensors(spec: ModelSpec, layout: GgufLayout, outtype: str) -> list[GgufTensor]:
    """Every tensor of the file in write order, derived from the spec alone: each unit's parameters as meta
    tensors through the family's HF mapping, then renamed; the rope factor tensor first when llama3 scaling."""
    plan: list[GgufTensor] = []
    if spec.rope_scaling == "llama3":
        shape = (spec.head_dim // 2,)
        plan.append(GgufTensor(ROPE_FREQS, None, None, shape, tensor_type(ROPE_FREQS, shape, outtype)))
    for unit in units_of(spec):
        meta = {d.name: torch.empty(d.shape, device="meta") for d in _unit_decls(spec, unit)}
        for hf_name, x in to_hf(spec, unit, meta, source="GGUF plan").items():
            name = gguf_name(layout, hf_name)
            shape = tuple(int(s) for s in x.shape)
            plan.append(GgufTensor(name, hf_name, unit, shape, tensor_type(name, shape, outtype)))
    return plan


def permute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """convert_hf_to_gguf.py's `LlamaModel.permute`: per head, rows (i, i + d/2) become rows (2i, 2i + 1), the
    pairs llama.cpp's LLAMA rope rotates together (weights [rows, in] or biases [rows])."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_data(spec: ModelSpec, layout: GgufLayout, hf_name: str, x: torch.Tensor, permute: bool = True) -> torch.Tensor:
    """One HF tensor as the GGUF stores it (q/k rows permuted where the layout says so)."""
    if permute and layout.permute_qk:
        if ".self_attn.q_proj." in hf_name:
            return permute_qk(x, spec.num_attention_heads)
        if ".self_attn.k_proj." in hf_name:
            return permute_qk(x, spec.num_groups)
    return x


def rope_freqs(spec: ModelSpec) -> torch.Tensor:
    """llama3 rope scaling as llama.cpp reads it: one divisor per rotary pair (`rope_freqs.weight`), computed as
    `LlamaModel.generate_extra_tensors` does from the base, head dim and the four scaling numbers."""
    dim = spec.head_dim
    freqs = 1.0 / (spec.rotary_base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor = float(spec.rope_scaling_factor)
    low, high = float(spec.rope_low_freq_factor), float(spec.rope_high_freq_factor)
    old = float(spec.rope_original_max_position_embeddings)
    low_wavelen, high_wavelen = old / low, old / high
    out = []
    for f in freqs.tolist():
        wavelen = 2 * math.pi / f
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32)


# ---- tokenizer ------------------------------------------------------------------------------------------
def tokenizer_pre(tok_json: dict[str, Any], where: str) -> str:
    """The llama.cpp pre-tokenizer name of a byte-level BPE `tokenizer.json`; any other tokenizer is refused."""
    model = (tok_json.get("model") or {}).get("type")
    if model != "BPE":
        raise MConvertError(f"{where}: tokenizer model {model!r} has no GGUF form here (byte-level BPE is written; "
                            "SentencePiece/Unigram/WordPiece are not); conversion refused")
    pre = tok_json.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
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
            regex = s["pattern"]["Regex"]
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


def tokenizer_vocab(tok_dir: Path, n_vocab: int) -> tuple[list[str], list[int], str]:
    """(tokens, token types, pre-tokenizer name) for a byte-level BPE tokenizer, as convert_hf_to_gguf.py's
    `get_vocab_base`: rows past the tokenizer are `[PADi]` UNUSED, added special tokens CONTROL, other added
    tokens USER_DEFINED."""
    g = _gguf()
    check_tokenizer_dir(tok_dir)
    path = tok_dir / "tokenizer.json"
    if not path.is_file():
        raise MConvertError(f"{tok_dir}: no tokenizer.json (GGUF embeds a byte-level BPE tokenizer.json); "
                            "pass --tokenizer DIR")
    try:
        tok_json = json.loads(read_small(inside_file(tok_dir, "tokenizer.json", f"{tok_dir}: tokenizer file"),
                                         "tokenizer"))
    except (ValueError, UnicodeDecodeError) as e:
        raise MConvertError(f"{path}: not JSON ({type(e).__name__}); re-save the tokenizer") from None
    if not isinstance(tok_json, dict):
        raise MConvertError(f"{path}: not a JSON object; re-save the tokenizer")
    pre = tokenizer_pre(tok_json, str(path))
    tok = load_tokenizer(tok_dir)
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


# ---- the writer -----------------------------------------------------------------------------------------
class GgufWriter:
    """Writer of one `.gguf` (reads HF-named units): header, metadata and tensor infos at open, then each unit's
    tensors appended in plan order by `add`; `close` checks every planned tensor was written."""

    reads = "hf"

    def __init__(self, path: Path, spec: ModelSpec, outtype: str, tokenizer_dir: Path | None,
                 name: str | None = None, permute: bool = True) -> None:
        g = _gguf()
        self.path, self.spec, self.outtype = Path(path), spec, outtype
        self.layout = gguf_layout(spec)
        self.permute = permute  # False only to prove that a file without the permutation fails validation
        self.plan = plan_tensors(spec, self.layout, outtype)
        if tokenizer_dir is None:
            raise MConvertError("no tokenizer found beside the checkpoint; GGUF embeds one — pass --tokenizer DIR")
        tokens, types, pre = tokenizer_vocab(tokenizer_dir, spec.vocab_size)
        self._w = g.GGUFWriter(self.path, self.layout.arch)
        self._metadata(name or self.path.stem, tokens, types, pre, tokenizer_dir)
        for t in self.plan:
            self._w.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.nbytes, raw_dtype=t.qtype)
        self._w.write_header_to_file(self.path)
        self._w.write_kv_data_to_file()
        self._w.write_ti_data_to_file()
        self._next = 0
        if self.plan and self.plan[0].name == ROPE_FREQS:
            self._write(self.plan[0], rope_freqs(spec))

    def _metadata(self, name: str, tokens: list[str], types: list[int], pre: str, tok_dir: Path) -> None:
        g, w, s = _gguf(), self._w, self.spec
        w.add_type(g.GGUFType.MODEL)
        w.add_name(name)
        w.add_context_length(s.max_position_embeddings)
        w.add_embedding_length(s.hidden_size)
        w.add_block_count(s.num_layers)
        w.add_feed_forward_length(s.ffn_hidden_size)
        w.add_head_count(s.num_attention_heads)
        w.add_head_count_kv(s.num_groups)
        w.add_key_length(s.head_dim)
        w.add_value_length(s.head_dim)
        w.add_rope_freq_base(float(s.rotary_base))
        w.add_rope_dimension_count(s.head_dim)
        w.add_layer_norm_rms_eps(float(s.norm_epsilon))
        w.add_vocab_size(s.vocab_size)
        if s.rope_scaling == "linear":
            w.add_rope_scaling_type(g.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(float(s.rope_scaling_factor))
        w.add_file_type(outtype_types(self.outtype)[1])
        w.add_quantization_version(g.GGML_QUANT_VERSION)
        w.add_tokenizer_model(BPE_MODEL)
        w.add_tokenizer_pre(pre)
        w.add_token_list(tokens)
        w.add_token_types(types)
        special = g.SpecialVocab(tok_dir, load_merges=True, n_vocab=len(tokens))
        if not special.merges:
            raise MConvertError(f"{tok_dir}: tokenizer.json holds no BPE merges; re-save the tokenizer")
        special.add_to_gguf(w, quiet=True)

    def _write(self, t: GgufTensor, x: torch.Tensor) -> None:
        if tuple(x.shape) != t.shape:
            raise MConvertError(f"tensor {t.hf or t.name}: shape {list(x.shape)}, the plan has {list(t.shape)}")
        data = _gguf().quants.quantize(x.detach().to(torch.float32).contiguous().numpy(), t.qtype)
        self._w.write_tensor_data(data)
        self._next += 1

    def add(self, unit: Unit, tensors: dict[str, torch.Tensor]) -> None:
        """Append one unit's HF-named tensors; a tensor the plan has no place for is refused by name."""
        todo = dict(tensors)
        while self._next < len(self.plan) and self.plan[self._next].unit == unit:
            t = self.plan[self._next]
            if t.hf not in todo:
                raise MConvertError(f"unit {unit}: the source yields no {t.hf}; cannot write {t.name}")
            self._write(t, gguf_data(self.spec, self.layout, t.hf, todo.pop(t.hf), self.permute))
        if todo:
            raise MConvertError(f"unit {unit}: tensor {sorted(todo)[0]} has no place in the GGUF plan; conversion refused")

    def close(self) -> list[Path]:
        """Finish the file; refuse one that misses a planned tensor."""
        if self._next != len(self.plan):
            missing = self.plan[self._next]
            raise MConvertError(f"GGUF incomplete: {missing.name} (from {missing.hf}) was never written")
        self._w.close()
        return [self.path]

    def abort(self) -> None:
        """Close the file; the atomic output removes it."""
        self._w.close()


# ---- the verbs ------------------------------------------------------------------------------------------
@crc_in_background
def to_gguf(src_path: str | Path, out: str | Path, outtype: str = "f16", tokenizer: str | Path | None = None,
            iteration: int | str | None = None, force: bool = False, verb: str = "megatron-to-gguf",
            permute: bool = True, progress: bool = False, dry_run: bool = False) -> Report:
    """Megatron checkpoint (torch or torch_dist, any TP/PP) or HF dir -> one GGUF file, streamed unit by unit
    through the driver's loop, written atomically with its manifest beside it. Returns the common report."""
    t0 = time.perf_counter()
    outtype_types(outtype)
    check_output(out, force, (src_path, tokenizer))
    src = open_source(src_path, iteration=iteration, tokenizer=tokenizer)
    if verb == "megatron-to-gguf" and src.format == "hf":
        raise MConvertError(f"{src_path}: this is a HuggingFace directory; use hf-to-gguf")
    if verb == "hf-to-gguf" and src.format != "hf":
        raise MConvertError(f"{src_path}: not a HuggingFace directory (detected {src.format}); use megatron-to-gguf")
    if not getattr(src, "vocab_known", True):
        raise MConvertError(f"{src_path}: vocab size unknown (args have no vocab_size and no tokenizer was found); "
                            "pass --tokenizer DIR")
    tok_dir = Path(tokenizer) if tokenizer is not None else src.tokenizer_dir
    spec = src.spec
    layout = gguf_layout(spec)  # every refusal before any tensor is read
    extras = dict(arch=layout.arch, outtype=outtype, tokenizer=str(tok_dir),
                  permuted_qk=layout.permute_qk and permute)
    if dry_run:
        plan = plan_tensors(spec, layout, outtype)
        skip_crc_checks()  # nothing is written: the dry run reads no tensor data
        src.close()
        files = [{"path": Path(out).name, "bytes": None}, {"path": file_manifest_path(out).name, "bytes": None}]
        return make_report(verb, src.describe(), out, spec.family, "gguf", outtype, files, [], None,
                           time.perf_counter() - t0, dry_run=True, tensors=len(plan),
                           tensor_bytes=sum(t.nbytes for t in plan), **extras)
    try:
        with atomic_output_file(out, force, inputs=(src_path, tokenizer, src.tokenizer_dir)) as tmp:
            writer = GgufWriter(tmp, spec, outtype, tok_dir, name=Path(src_path).name, permute=permute)
            drive(src, writer, verb, progress)
            wait_crc_checks()  # the input's checks, run in the background, before the output is committed
            n = len(writer.plan)
    finally:
        src.close()
    files = [{"path": Path(out).name, "bytes": Path(out).stat().st_size},
             {"path": file_manifest_path(out).name, "bytes": file_manifest_path(out).stat().st_size}]
    return make_report(verb, src.describe(), out, spec.family, "gguf", outtype, files, [], peak_rss_bytes(),
                       time.perf_counter() - t0, tensors=n, **extras)
