"""TensorRT-LLM checkpoint (`mconvert megatron-to-trtllm`, whose verb is in `convert/verbs.py`): `config.json` +
`rank{i}.safetensors`. `prepare` is the one place its refusals, config and tensor shapes are worked out; the verb,
the writer, `--dry-run` and `plan --to trtllm` take them from it.

Names, shapes and splits as TensorRT-LLM's own converters write them (NVIDIA/TensorRT-LLM
`tensorrt_llm/models/gpt/convert.py`, `models/llama/convert.py`; config = `models/modeling_utils.py`
`PretrainedConfig.to_dict` + `GPTConfig` / `LLaMAConfig` fields):
- `transformer.vocab_embedding.weight` [V, H] (whole on every rank: use_parallel_embedding=False),
  `transformer.position_embedding.weight` [P, H] (GPT), `transformer.ln_f.weight` (+ `.bias` for GPT),
  `lm_head.weight` [ceil(V/t)·t / t, H] (vocab padded with zero rows to a multiple of t, split on rows; written
  for tied models too, as the converters do; the loader also accepts it absent when the embedding is present).
- per layer `transformer.layers.N.`: `input_layernorm.*`, `post_layernorm.*`,
  `attention.qkv.weight` [(nq + 2·nkv)·hd / t, H] = cat(q_r, k_r, v_r) of the rank's heads (KV heads duplicated
  when nkv < t, as `dup_kv_weight` / `split_qkv` do), `attention.qkv.bias`, `attention.dense.weight` [H, nq·hd/t]
  (+ replicated `.bias`), GPT `mlp.fc` [F/t, H] / `mlp.proj` [H, F/t]; LLaMA `mlp.fc` = gate_proj,
  `mlp.gate` = up_proj (TensorRT-LLM's naming), `mlp.proj` = down_proj. Weights are Linear [out, in].
`check_trtllm_dir` derives every expected name and shape from config.json alone (independently of the writer),
and `mconvert.validators.trtllm_runner.trtllm_logits` runs the rank files as TensorRT-LLM's TP layers combine them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from mconvert import dtypes
from mconvert.io import buffers
from mconvert.io.atomic import record_digest
from mconvert.io.paths import inside_file, load_json_object
from mconvert.io.safetensors import SafetensorsRandomWriter
from mconvert.convert.scaleout import world
from mconvert.layouts.trtllm import (
    TRT_DTYPES,
    expected_trtllm_shapes,
    layout_for,
)
from mconvert.layouts.trtllm import trtllm_layout_of as trtllm_layout_of  # the checker's users import it here
from mconvert.layouts.trtllm import (  # noqa: F401 - worked out there (no torch), importable here
    TrtllmPrepared, prepare, trtllm_dtype)
from mconvert.convert.writer import Writer
from mconvert.errors import MConvertError, expect
from mconvert.mappings import deploy
from mconvert.mappings.record import TrtllmLayout
from mconvert.mappings.fields import Field, check, neutral, refused
from mconvert.spec import ModelSpec

def rank_tensors(unit: Any, mcore: dict[str, torch.Tensor], spec: ModelSpec, tp: int,
                 embed: torch.Tensor | None, source: str = "checkpoint",
                 ranks: Collection[int] | None = None) -> list[dict[str, torch.Tensor]]:
    """One unit's full tensors -> per-rank TensorRT-LLM tensors (the family's TensorRT-LLM table); `ranks`:
    only these ranks' (the rank files this process writes), None: every rank."""
    return deploy.rank_tensors(spec, layout_for(spec).tensors, unit, mcore, tp, "TensorRT-LLM", embed, source, ranks,
                               empty=buffers.empty)


class TrtllmWriter(Writer):
    """A TensorRT-LLM checkpoint as a `Writer` (`convert/writer.py`): `rank{r}.safetensors` laid out up front from
    the config (names and shapes known before any tensor), each unit's full tensors cut by the family's
    TensorRT-LLM table (`mappings.deploy`); `close()` writes config.json. The verb then runs `refuse_written` on
    the whole output (under torchrun: once every rank wrote its part).

    Under torchrun (`scaleout`) process `i mod N` writes `rank{i}.safetensors` (every unit feeds every rank file,
    so a process with a rank file reads every unit, one without reads none) and cuts only its own rank files'
    tensors; rank 0 writes config.json."""

    reads = "mcore"
    shares_work = True  # process `i mod N` writes rank{i}.safetensors

    def __init__(self, out: Path, prepared: "TrtllmPrepared") -> None:
        self.prepared = prepared
        self.out, self.spec, self.tp, self.source = Path(out), prepared.spec, prepared.tp, prepared.source
        tp = self.tp
        self.config, self.shapes = prepared.config, prepared.shapes
        self.world = world()
        tdt = dtypes.lookup(prepared.dtype).torch  # type: ignore[union-attr]
        self._embed: torch.Tensor | None = None
        self._writers: dict[int, SafetensorsRandomWriter] = {}
        try:
            for r in range(tp):
                if self.world.owns(r):
                    self._writers[r] = SafetensorsRandomWriter(
                        self.out / f"rank{r}.safetensors", [(n, tdt, self.shapes[n]) for n in sorted(self.shapes)],
                        {"format": "pt"}, layout="TensorRT-LLM layout")
        except BaseException:
            self.abort()
            raise

    def unit_order(self, units: list[Any]) -> list[Any]:
        """The units in the order their tensors lie in the rank files (by each unit's first byte), so the
        rank files are written, and their digests taken, mostly front to back (`io.hashing.RandomDirectFile`);
        a tied model's embedding comes before the final unit, whose head is cut from it."""
        if not self._writers:
            return units
        r, w = next(iter(self._writers.items()))
        tied = self.spec.tie_embeddings
        table = layout_for(self.spec).tensors

        def first(unit: Any) -> int:
            offsets = [w.offset(n) for n in deploy.unit_names(self.spec, table, unit, tied, r)]
            return min(offsets, default=0)

        order = sorted(units, key=first)
        if tied and "embedding" in order and "final" in order:
            order.remove("embedding")
            order.insert(order.index("final"), "embedding")
        return order

    def needs(self, unit: Any) -> bool:
        """Whether this process reads `unit`: every unit feeds every rank file, so whenever it writes one."""
        return bool(self._writers)

    def skip(self, unit: Any) -> None:
        """Pass `unit` by unread (`needs` is False): this process writes no rank file."""

    def add(self, unit: Any, tensors: dict[str, torch.Tensor]) -> None:
        """One unit's tensors into every rank file this process writes."""
        if unit == "embedding" and self.spec.tie_embeddings:
            self._embed = tensors[deploy.EMBEDDING]
        parts = rank_tensors(unit, tensors, self.spec, self.tp, self._embed, self.source, ranks=self._writers.keys())
        for r, w in self._writers.items():
            for k in sorted(parts[r], key=w.offset):  # in file order: the digest follows the writes
                w.write(k, parts[r][k])

    def close(self) -> list[Path]:
        """Finish the rank files and (rank 0) write config.json; the files this process wrote."""
        for r, w in self._writers.items():
            record_digest(self.out / f"rank{r}.safetensors", w.close())
        files = [self.out / f"rank{r}.safetensors" for r in self._writers]
        if self.world.primary:
            (self.out / "config.json").write_text(self.prepared.config_text)
            files.append(self.out / "config.json")
        return files

    def abort(self) -> None:
        for w in self._writers.values():
            w.abort()


def refuse_written(out: Path) -> None:
    """Refuse a TensorRT-LLM checkpoint mconvert wrote that the checker finds wrong (`check_trtllm_dir`)."""
    problems = check_trtllm_dir(out)
    if problems:
        raise MConvertError(f"TensorRT-LLM layout check failed on what was written: {problems[0]}")


_TRT_INTS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "intermediate_size")
_TRT_OPTIONAL_INTS = ("num_key_value_heads", "head_size", "max_position_embeddings", "rotary_embedding_dim")


# config.json as the checker reads it: `mapping`, `quantization` and `moe` field by field (`section.key`). A field
# that changes what TensorRT-LLM computes must hold the one value the checker and the reference runner assume (an
# absent or null field has it too); at another value the runner would judge another model than the engine builds.
_TRT_SECTIONS = ("mapping", "quantization", "moe")
_TRT_FIELDS: dict[str, Field] = {
    **neutral("read and checked by the checker and the reference runner",
              "architecture", "dtype", *_TRT_INTS, *_TRT_OPTIONAL_INTS, "norm_epsilon", "rotary_base",
              "rotary_scaling", "tie_word_embeddings", "bias", "attn_bias", "mlp_bias", "mapping.world_size",
              "mapping.tp_size"),
    **neutral("a section: each of its fields is checked as section.field", *_TRT_SECTIONS),
    **neutral("changes nothing the runner computes while the refused fields hold their values (output precision, "
              "options of quantization, MoE routing and a vocab-parallel embedding)",
              "logits_dtype", "embedding_sharding_dim", "disable_weight_only_quant_plugin", "mapping.gpus_per_node",
              "mapping.moe_tp_size", "quantization.*", "moe.*"),
    "use_parallel_embedding": refused("a vocab-parallel embedding is not read by the checker and the runner", False),
    "qk_layernorm": refused("QK layernorm is not computed by the reference runner", False),
    "residual_mlp": refused("a residual MLP is not computed by the reference runner", False),
    # another parallel size at its default of one process (or a flag left off) changes nothing
    "mapping.*": refused("the checker and the runner read other parallel settings only at 1 (a size) or false "
                         "(a flag)", 1, lambda v, _: v is False),
    "mapping.pp_size": refused("pipeline-parallel ranks are not read by the checker and the runner", 1),
    "mapping.cp_size": refused("context-parallel ranks are not read by the checker and the runner", 1),
    "mapping.moe_ep_size": refused("expert-parallel ranks are not read by the checker and the runner", 1),
    "quantization.quant_algo": refused("quantized weights are not computed by the reference runner", None),
    "quantization.kv_cache_quant_algo": refused("a quantized KV cache is not computed by the reference runner", None),
    "moe.num_experts": refused("mixture-of-experts layers are not computed by the reference runner", 0),
}


def _trt_fields(layout: TrtllmLayout) -> dict[str, Field]:
    """The field table for one TensorRT-LLM class: the common fields, the activations and position embedding it
    is checked with, and its own fields that change what it computes (`layout.fixed`)."""
    acts = layout.hidden_acts
    return {
        **_TRT_FIELDS,
        "hidden_act": refused(f"{layout.architecture} is checked with {', '.join(acts)}", acts[0],
                              lambda v, _: v in acts),
        "position_embedding_type": refused(f"{layout.architecture} is checked with {layout.position_embedding_type}",
                                           layout.position_embedding_type),
        **{k: refused(f"the reference runner computes {layout.architecture} with {json.dumps(want)} only", want)
           for k, want in layout.fixed.items()},
    }


def _empty_as_unset(v: Any) -> Any:
    return None if isinstance(v, (dict, list)) and not v else v


def _json_value(v: Any) -> str:
    """A config.json value as the file spells it (true, null, "text"), shortened."""
    text = json.dumps(v, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


def _check_computed_fields(cfg: dict[str, Any], cfg_path: Path, fix: str) -> None:
    """Every field that decides what TensorRT-LLM computes holds the value the runner computes with (the class's
    table, checked by `mappings.fields.check`; an empty object or list is unset, as null is)."""
    flat: dict[str, Any] = {}
    for k, v in cfg.items():
        flat[k] = v
        if k in _TRT_SECTIONS and v is not None:
            for sub, sv in expect(v, dict, f"{cfg_path}: {k}", fix).items():
                flat[f"{k}.{sub}"] = sv
    check(flat, _trt_fields(trtllm_layout_of(cfg["architecture"])), str(cfg_path), "TensorRT-LLM field",
          f"validation refused — {fix}", unknown_hint="", norm=_empty_as_unset, show=_json_value)


def read_trtllm_config(cfg_path: Path) -> dict[str, Any]:
    """A TensorRT-LLM `config.json` with every field the checker and runner use checked for presence and type;
    anything else is one MConvertError naming the file and the key."""
    fix = "re-export it with `mconvert megatron-to-trtllm`"
    cfg = load_json_object(inside_file(cfg_path.parent, cfg_path.name, f"{cfg_path.parent}: TensorRT-LLM config"),
                           "TensorRT-LLM config", fix)
    need = ("architecture", "dtype", *_TRT_INTS, "norm_epsilon", "position_embedding_type", "mapping")
    missing = [k for k in need if k not in cfg]
    if missing:
        raise MConvertError(f"{cfg_path}: lacks {', '.join(missing)}; {fix}")
    expect(cfg["architecture"], str, f"{cfg_path}: architecture", fix)
    expect(cfg["dtype"], str, f"{cfg_path}: dtype", fix)
    expect(cfg["norm_epsilon"], (int, float), f"{cfg_path}: norm_epsilon", fix)
    for k in ("hidden_act", "position_embedding_type"):  # null leaves TensorRT-LLM its own default, not the runner's
        if k in cfg:
            expect(cfg[k], str, f"{cfg_path}: {k}", fix)
    for k in _TRT_INTS + tuple(k for k in _TRT_OPTIONAL_INTS if cfg.get(k) is not None):
        if expect(cfg[k], int, f"{cfg_path}: {k}", fix) <= 0:
            raise MConvertError(f"{cfg_path}: {k} = {cfg[k]} must be positive; {fix}")
    mapping = expect(cfg["mapping"], dict, f"{cfg_path}: mapping", fix)
    for k in ("tp_size", "pp_size", "world_size"):
        if k in mapping and expect(mapping[k], int, f"{cfg_path}: mapping.{k}", fix) <= 0:
            raise MConvertError(f"{cfg_path}: mapping.{k} = {mapping[k]} must be positive; {fix}")
    if "tp_size" not in mapping:
        raise MConvertError(f"{cfg_path}: lacks mapping.tp_size; {fix}")
    if cfg.get("rotary_base") is not None:
        expect(cfg["rotary_base"], (int, float), f"{cfg_path}: rotary_base", fix)
    if cfg.get("rotary_scaling") is not None:
        scaling = expect(cfg["rotary_scaling"], dict, f"{cfg_path}: rotary_scaling", fix)
        for k in ("type", "rope_type"):
            if scaling.get(k) is not None:
                expect(scaling[k], str, f"{cfg_path}: rotary_scaling.{k}", fix)
    _check_computed_fields(cfg, cfg_path, fix)
    return cfg


def check_trtllm_dir(path: str | Path) -> list[str]:
    """Problems with a TensorRT-LLM checkpoint dir (empty list: every rank holds exactly the expected tensors)."""
    d = Path(path)
    cfg_path = d / "config.json"
    try:
        cfg = read_trtllm_config(cfg_path)
    except MConvertError as e:
        return [str(e)]
    try:
        shapes = expected_trtllm_shapes(cfg)
    except (MConvertError, KeyError, ValueError, TypeError) as e:
        return [f"{cfg_path}: {e}"]
    t = int(cfg["mapping"]["tp_size"])
    if int(cfg["mapping"].get("world_size", t)) != t * int(cfg["mapping"].get("pp_size", 1)):
        return [f"{cfg_path}: mapping world_size != tp_size·pp_size"]
    want_dtype = dtypes.lookup(cfg["dtype"]) if cfg["dtype"] in TRT_DTYPES else None
    if want_dtype is None:
        return [f"{cfg_path}: dtype {cfg['dtype']!r} unknown"]
    problems: list[str] = []
    for r in range(t):
        f = d / f"rank{r}.safetensors"
        if not os.path.lexists(f):
            problems.append(f"{f}: missing (mapping.tp_size={t})")
            continue
        try:
            inside_file(d, f.name, f"{d}: TensorRT-LLM rank file")
        except MConvertError as e:
            problems.append(str(e))
            continue
        with safe_open(f, "pt") as h:
            have = set(h.keys())
            for name in sorted(set(shapes) - have):
                if name == "lm_head.weight" and "transformer.vocab_embedding.weight" in have:
                    continue  # TensorRT-LLM's load(): embedding sharing exemption
                problems.append(f"{f}: missing tensor {name}")
            for name in sorted(have - set(shapes)):
                problems.append(f"{f}: unexpected tensor {name}")
            for name in sorted(have & set(shapes)):
                sl = h.get_slice(name)
                shape = tuple(sl.get_shape())
                if shape != shapes[name]:
                    problems.append(f"{f}: {name} has shape {list(shape)}, expected {list(shapes[name])}")
                dt = h.get_slice(name).get_dtype()
                if dt != want_dtype.safetensors:
                    problems.append(f"{f}: {name} is {dt}, config dtype is {cfg['dtype']}")
    stray = sorted(p.name for p in d.glob("rank*.safetensors") if p.name not in {f"rank{r}.safetensors" for r in range(t)})
    problems += [f"{d / n}: rank file beyond mapping.tp_size={t}" for n in stray]
    return problems
