"""`mconvert verify HF_DIR`: is this HF export ready to be served by vLLM, and does it compute what we trained?

Static checks follow vLLM's loading rules (DESIGN.md, vLLM section): vLLM loads models it would then serve
wrongly (an untied head that is missing becomes all zeros, a present `lm_head` wins over
`tie_word_embeddings`, GPT-2's head is always tied), so each of those is checked here by name. `--against`
adds the logits comparison of `validate`; `--vllm-python` serves the dir in a real vLLM engine.
"""

from __future__ import annotations

import math
import os
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.table import Table
from safetensors import safe_open

from mconvert import dtypes
from mconvert.convert.hf.directory import read_weight_map
from mconvert.io.paths import contained, inside_file, load_json_object
from mconvert.io.atomic import MANIFEST, check_manifest
from mconvert.layouts.megatron import RANK_FILE, iteration_dir_name
from mconvert.io.safeload import safe_load
from mconvert.io.casts import all_finite
from mconvert.convert.sources import open_source
from mconvert.convert.hf.tokenizer import has_chat_template
from mconvert.errors import MConvertError
from mconvert.errors import rich_safe as _plain
from mconvert.mappings import families
from mconvert.mappings.record import Family
from mconvert.validators.formats import describe, has_tokenizer
from mconvert.validators.tokens import load_tokenizer
from mconvert.validators.validate import validate
from mconvert.mappings.families import hf_table
from mconvert.mappings.fields import key_names
from mconvert.validators.engine_probe import chat_ids, probe_export
from mconvert.validators.vllm_check import CHAT, vllm_compare

SCHEMA = "mconvert.verify/1"
VLLM_CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
# Buffers that transformers and vLLM skip when present in a checkpoint (never weights).
_IGNORABLE = (r"\.attn\.bias$", r"\.attn\.masked_bias$", r"rotary_emb\.inv_freq$")


def _family(cfg: dict[str, Any]) -> Family:
    """The family whose vLLM facts apply to a config.json: by model_type, else the default family."""
    return families.by_model_type(cfg.get("model_type")) or families.default_family()


@dataclass
class Check:
    name: str
    status: str  # ok | warn | error
    message: str


@dataclass
class VerifyReport:
    path: str
    checks: list[Check] = field(default_factory=list)
    logits: dict[str, Any] | None = None  # validate's JSON report when --against was given
    vllm: dict[str, Any] | None = None  # the real-engine comparison when --vllm-python was given
    seconds: float = 0.0
    engine: str = "vLLM"  # what the verdict is about: the engine whose loading rules were checked

    @property
    def passed(self) -> bool:
        return all(c.status != "error" for c in self.checks)

    def add(self, name: str, status: str, message: str) -> None:
        self.checks.append(Check(name, status, message))

    def errors(self) -> list[Check]:
        return [c for c in self.checks if c.status == "error"]

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "path": self.path,
            "passed": self.passed,
            "seconds": round(self.seconds, 3),
            "errors": [c.name for c in self.errors()],
            "checks": [asdict(c) for c in self.checks],
            "logits": self.logits,
            "vllm": self.vllm,
        }


def verify(
    hf_dir: str | Path,
    against: str | Path | None = None,
    vllm_python: str | Path | None = None,
    device: str = "auto",
    n_tokens: int = 32,
) -> VerifyReport:
    """Run every readiness check on `hf_dir`; errors are collected, never raised, so all show at once."""
    t0 = time.perf_counter()
    d = Path(hf_dir)
    if not d.is_dir():
        raise MConvertError(f"{d}: not a directory; pass the HF export directory")
    rep = VerifyReport(path=str(d))
    cfg = _config(d, rep)
    if cfg is None:
        rep.seconds = time.perf_counter() - t0
        return rep
    _architecture(cfg, rep)
    _config_fields(cfg, rep)
    _engine_limits(cfg, rep)
    probed = _probe(d, cfg)
    files, wmap = _weight_files(d, rep)
    header = _headers(d, files, wmap, rep)  # name -> (shape, dtype, file)
    if header:
        _strict(cfg, header, probed, rep)
        _dtypes(cfg, header, rep)
        _finite_and_tied(cfg, header, rep)
    _tokenizer(d, cfg, rep)
    _chat_renders(d, rep)
    _config_ids(cfg, rep)
    _generation_config(d, cfg, probed, rep)
    _manifest(d, rep)
    if against is not None:
        _against(d, cfg, Path(against), rep, device, n_tokens)
    if vllm_python is not None:
        if rep.errors():
            rep.add("vllm", "error", f"not served: fix {', '.join(c.name for c in rep.errors())} first")
        else:
            try:
                rep.vllm = vllm_compare(d, Path(vllm_python))
            except MConvertError as e:
                rep.add("vllm", "error", str(e))
            else:
                v = rep.vllm
                rep.add("vllm", "ok" if v["passed"] else "error", v["summary"])
    rep.seconds = time.perf_counter() - t0
    return rep


# ---- config ---------------------------------------------------------------------------------------
def _config(d: Path, rep: VerifyReport) -> dict[str, Any] | None:
    p = d / "config.json"
    if not os.path.lexists(p):
        rep.add("config", "error", f"{p}: missing; an HF dir needs config.json")
        return None
    try:
        cfg = load_json_object(inside_file(d, "config.json", f"{d}: config"), "config", "re-export the model")
    except MConvertError as e:
        rep.add("config", "error", str(e))
        return None
    rep.add("config", "ok", f"{p.name}: model_type={cfg.get('model_type')}")
    return cfg


def _architecture(cfg: dict[str, Any], rep: VerifyReport) -> None:
    archs = cfg.get("architectures") or []
    mt = cfg.get("model_type")
    fam = families.by_model_type(mt)
    want = fam.architecture if fam else None
    vllm_archs = [f.architecture for f in families.all_families()]
    if not archs:
        rep.add("architecture", "error",
                f"config.json has no 'architectures'; set it to [{want or families.default_family().architecture!r}]")
    elif len(archs) != 1:
        rep.add("architecture", "error", f"config.json lists {len(archs)} architectures {archs}; give exactly one")
    elif archs[0] in {f.base_architecture for f in families.all_families()}:
        rep.add("architecture", "error",
                f"architectures={archs}: a base model without LM head; vLLM needs {want or 'a *ForCausalLM'} "
                "(some vLLM versions treat it as an embedding model) — re-export with the causal-LM class")
    elif archs[0] not in vllm_archs:
        rep.add("architecture", "error", f"architectures={archs}: not one mconvert checks for vLLM ({', '.join(vllm_archs)})")
    elif want and archs[0] != want:
        rep.add("architecture", "error", f"architectures={archs} does not match model_type={mt!r} ({want})")
    else:
        rep.add("architecture", "ok", f"{archs[0]} is in vLLM's registry")


def _config_fields(cfg: dict[str, Any], rep: VerifyReport) -> None:
    facts = _family(cfg).vllm
    problems, notes = facts.config_checks(cfg)
    hd = facts.head_dim(cfg)
    for k, what in facts.required.items():
        if cfg.get(k) is None:
            problems.append(f"{k} ({what}) missing")
    if not (cfg.get("torch_dtype") or cfg.get("dtype")):
        notes.append("no torch_dtype: vLLM falls back to float32/float16 by its own rule")
    if problems:
        rep.add("config-fields", "error", "config.json: " + "; ".join(problems))
    else:
        rep.add("config-fields", "ok", "positions, eps" + (", rope" if facts.rope else "") + " present"
                + (f" ({'; '.join(notes)})" if notes else ""))
    dims = facts.cpu_head_dims or VLLM_CPU_HEAD_DIMS
    if hd and hd not in dims:
        rep.add("head-dim", "warn", f"{facts.head_dim_label}={hd}: vLLM's CPU attention supports {dims} only "
                "(GPU backends accept more)")
    else:
        rep.add("head-dim", "ok", f"{facts.head_dim_label}={hd}")


# ---- weight files ---------------------------------------------------------------------------------
def _weight_files(d: Path, rep: VerifyReport) -> tuple[list[Path], dict[str, str] | None]:
    """The weight files vLLM would load (the index's, when there is one) and the index's weight_map."""
    index = d / "model.safetensors.index.json"
    st = sorted(d.glob("*.safetensors"))
    if index.is_file():
        try:
            wmap = read_weight_map(inside_file(d, index.name, f"{d}: index"))
            for f in set(wmap.values()):  # a name leading outside the directory is never opened
                contained(d, f, f"{index}: weight_map file")
                if os.path.lexists(d / f):
                    inside_file(d, f, f"{index}: weight_map file")
        except MConvertError as e:
            rep.add("weight-files", "error", str(e))
            return [], None
        named = sorted(set(wmap.values()))
        missing = [f for f in named if not (d / f).is_file()]
        stray = [p.name for p in st if p.name not in named]
        problems = []
        if missing:
            problems.append(f"missing shard(s) {missing} named in {index.name}")
        if stray:
            problems.append(f"stray {stray} not in {index.name} (vLLM would skip them; transformers too — "
                            "remove them or fix the index)")
        if problems:
            rep.add("weight-files", "error", "; ".join(problems))
        else:
            rep.add("weight-files", "ok", f"{len(named)} shard(s), all in {index.name}, none stray")
        return [d / f for f in named if (d / f).is_file()], wmap
    try:
        for f in st:
            inside_file(d, f.name, f"{d}: weight file")
    except MConvertError as e:
        rep.add("weight-files", "error", str(e))
        return [], None
    if not st:
        if list(d.glob("*.bin")):
            rep.add("weight-files", "error", "only pytorch *.bin weights; export safetensors (pickle-free) for serving")
        else:
            rep.add("weight-files", "error", f"{d}: no *.safetensors weights")
        return [], None
    if len(st) > 1 or st[0].name != "model.safetensors":
        rep.add("weight-files", "error",
                f"{[p.name for p in st]} without model.safetensors.index.json: missing index or stray shard(s)")
        return st, None
    rep.add("weight-files", "ok", "model.safetensors (single file)")
    return st, None


def _headers(d: Path, files: list[Path], wmap: dict[str, str] | None, rep: VerifyReport
             ) -> dict[str, tuple[tuple[int, ...], str, Path]]:
    """Name -> (shape, dtype, file) from the safetensors headers (no tensor read); index entries checked."""
    out: dict[str, tuple[tuple[int, ...], str, Path]] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as h:
                for k in h.keys():
                    sl = h.get_slice(k)
                    out[k] = (tuple(sl.get_shape()), str(sl.get_dtype()), f)
        except Exception as e:  # truncated / corrupt header
            rep.add("weight-files", "error", f"{f}: unreadable safetensors ({str(e)[:200]}); re-copy or re-export")
    if wmap:
        wrong = [k for k, fn in wmap.items() if k not in out and (d / fn).is_file()]
        wrong += [k for k, v in out.items() if k in wmap and wmap[k] != v[2].name]
        if wrong:
            rep.add("weight-index", "error", f"index entries do not match shard contents (e.g. {wrong[0]!r})")
    return out


def _engine_limits(cfg: dict[str, Any], rep: VerifyReport) -> None:
    """The values transformers and vLLM cannot run, named by config.json key: an epsilon that is not a positive
    number (RMSNorm/LayerNorm divide by sqrt(mean + eps), infinite on a zero row), a top-k outside [1, experts]
    (torch.topk in transformers' router and vLLM's fused_topk refuses k > experts; k = 0 routes a token
    nowhere), query heads that KV heads do not divide (both repeat each KV head over a whole group)."""
    mt = cfg.get("model_type")
    keys = key_names(hf_table(mt)) if families.by_model_type(mt) is not None else {}
    problems = []

    def num(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

    eps = keys.get("norm_epsilon")
    if eps and eps in cfg and not (num(cfg[eps]) and cfg[eps] > 0):
        problems.append(f"{eps}={cfg[eps]!r} must be a positive number (the norms divide by sqrt(mean(x²) + "
                        f"{eps}), infinite on a zero row)")
    topk, n = keys.get("moe_router_topk"), keys.get("num_experts")
    if topk and n and cfg.get(n) is not None and topk in cfg:
        k, e = cfg[topk], cfg[n]
        if not (isinstance(k, int) and isinstance(e, int) and 1 <= k <= e):
            problems.append(f"{topk}={k!r} must lie in [1, {n}={e!r}] (torch.topk in transformers' router and "
                            "vLLM's fused_topk refuses more experts than there are; 0 routes a token to none)")
    heads, groups = keys.get("num_attention_heads"), keys.get("num_query_groups")
    h, g = cfg.get(heads) if heads else None, cfg.get(groups) if groups else None
    if isinstance(h, int) and isinstance(g, int) and (g <= 0 or h % g):
        problems.append(f"{groups}={g} must divide {heads}={h} (transformers and vLLM repeat each KV head over a "
                        "whole group of query heads)")
    if problems:
        rep.add("config-engines", "error", "config.json: " + "; ".join(problems) + " — fix config.json")
    else:
        rep.add("config-engines", "ok", "epsilon, experts and head groups within what transformers and vLLM run")


def _generation_dict(d: Path) -> dict[str, Any] | None:
    """generation_config.json as an object, or None (missing or unreadable: `_generation_config` says so)."""
    try:
        return load_json_object(inside_file(d, "generation_config.json", f"{d}: generation config"),
                                "generation config")
    except MConvertError:
        return None


def _probe(d: Path, cfg: dict[str, Any]) -> dict[str, Any]:
    """transformers' own reading of config.json (its model class built on meta) and of generation_config.json,
    in a bounded child (`engine_probe.probe_export`); the config part is {"refused": line} when mconvert
    refuses before transformers runs or the child ran past a bound."""
    mt = cfg.get("model_type")
    if families.by_model_type(mt) is None:
        known = ", ".join(f.model_type for f in families.all_families())
        return {"config": {"refused": f"config.json: model_type {mt!r} is not one mconvert verifies ({known})"},
                "generation": None}
    try:
        return probe_export(cfg, _generation_dict(d), d)
    except MConvertError as e:
        return {"config": {"refused": str(e)}, "generation": None}


def _beyond_transformers(cfg: dict[str, Any], built: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """The HF tensors config.json implies that the transformers class does not build: the multi-token prediction
    layers (`num_nextn_predict_layers`), which transformers skips and vLLM's MTP loader reads, with their copies
    of the embedding and head; names and shapes from mconvert's own mapping on the meta device."""
    if not cfg.get("num_nextn_predict_layers"):
        return {}
    from mconvert.mappings.plugin import to_hf

    try:
        spec = families.spec_from_hf_config(cfg)
    except MConvertError:
        return {}  # the config check reports it
    out: dict[str, tuple[int, ...]] = {}
    for unit in ("embedding", "final"):  # where the MTP layers' tensors and copies go
        meta = {d.name: torch.empty(d.shape, device="meta") for d in spec.unit_params(unit)}
        out.update({k: tuple(t.shape) for k, t in to_hf(spec, unit, meta).items() if k not in built})
    return out


def _strict(cfg: dict[str, Any], header: dict, probed: dict[str, Any], rep: VerifyReport) -> None:
    built = probed["config"]
    if "refused" in built:  # mconvert's own line (a family it does not verify, a bound hit)
        rep.add("weights-strict", "error", built["refused"])
        return
    if "error" in built:
        rep.add("weights-strict", "error", f"config.json: transformers cannot build the model ({built['error']})")
        return
    expected = {k: tuple(v) for k, v in built["shapes"].items()}
    expected.update(_beyond_transformers(cfg, expected))
    always_tied = _family(cfg).vllm.always_ties_head is not None
    tied = built["tie"] or always_tied
    missing = [k for k in expected if k not in header and not (tied and k == "lm_head.weight")]
    unexpected = [k for k in header if k not in expected and not any(re.search(p, k) for p in _IGNORABLE)]
    bad_shape = [(k, header[k][0], expected[k]) for k in expected if k in header and header[k][0] != expected[k]]
    problems = []
    if missing:
        hint = " (untied lm_head missing: vLLM would serve an all-zero head)" if "lm_head.weight" in missing else ""
        problems.append(f"missing {len(missing)} key(s) {missing[:4]}{hint}")
    if unexpected:
        problems.append(f"unexpected {len(unexpected)} key(s) {unexpected[:4]}")
    if bad_shape:
        k, got, want = bad_shape[0]
        problems.append(f"{len(bad_shape)} shape mismatch(es), e.g. {k} is {list(got)}, config says {list(want)}")
    if problems:
        rep.add("weights-strict", "error", f"not strict-loadable by {built['model']}: " + "; ".join(problems))
    else:
        rep.add("weights-strict", "ok", f"{len(header)} tensors match {built['model']} by name and shape")


def _dtypes(cfg: dict[str, Any], header: dict, rep: VerifyReport) -> None:
    want = str(cfg.get("torch_dtype") or cfg.get("dtype") or "").replace("torch.", "")
    found: dict[str, int] = {}
    for _, (_, dt, _) in header.items():
        row = dtypes.of_safetensors(dt)
        name = row.name if row else dt
        found[name] = found.get(name, 0) + 1
    floats = {k: v for k, v in found.items() if k in ("float32", "float16", "bfloat16", "float64")}
    if want and set(floats) - {want}:
        rep.add("dtypes", "error", f"tensors are {floats} but config.json says {want}; re-export with one dtype")
    elif len(floats) > 1:
        rep.add("dtypes", "error", f"mixed tensor dtypes {floats}")
    else:
        rep.add("dtypes", "ok", f"all {sum(floats.values())} tensors {next(iter(floats), '?')}")


def _finite_and_tied(cfg: dict[str, Any], header: dict, rep: VerifyReport) -> None:
    """Stream every tensor once: NaN/Inf scan, and the embedding vs lm_head comparison."""
    fam = _family(cfg)
    emb_key = fam.plugin.hf_embedding
    bad: list[str] = []
    emb = head = None
    by_file: dict[Path, list[str]] = {}
    for k, (_, _, f) in header.items():
        by_file.setdefault(f, []).append(k)
    for f, keys in by_file.items():
        with safe_open(str(f), framework="pt") as h:
            for k in keys:
                t = h.get_tensor(k)
                if t.is_floating_point() and not all_finite(t):
                    n = int((~torch.isfinite(t)).sum())
                    bad.append(f"{k} ({n} non-finite)")
                if k == emb_key:
                    emb = t
                elif k == "lm_head.weight":
                    head = t
                del t
    if bad:
        rep.add("finite", "error", f"NaN/Inf in {len(bad)} tensor(s): {', '.join(bad[:3])}")
    else:
        rep.add("finite", "ok", f"no NaN/Inf in {len(header)} tensors")

    tie = cfg.get("tie_word_embeddings")
    always = fam.vllm.always_ties_head
    tie = True if (tie is None and always) else bool(tie)
    same = head is not None and emb is not None and head.shape == emb.shape and torch.equal(head, emb)
    if always:
        if head is not None and not same:
            rep.add("tied-head", "error", always.differs)
        elif not tie:
            rep.add("tied-head", "error", always.untied)
        else:
            rep.add("tied-head", "ok", always.ok)
    elif tie:
        if head is not None and not same:
            rep.add("tied-head", "error", "tie_word_embeddings=true beside a different lm_head.weight: vLLM loads the "
                    "present lm_head, transformers ties it — they disagree; drop lm_head or set tie=false")
        else:
            rep.add("tied-head", "ok", "tied (lm_head absent or equal to the embedding)")
    else:
        if head is None:
            rep.add("tied-head", "error", "untied lm_head missing: tie_word_embeddings=false and no lm_head.weight; "
                    "vLLM would load an all-zero head without a warning")
        else:
            rep.add("tied-head", "ok", "untied lm_head present")


# ---- tokenizer, generation config, manifest -------------------------------------------------------
def _tokenizer(d: Path, cfg: dict[str, Any], rep: VerifyReport) -> None:
    vocab = int(cfg.get("vocab_size") or 0)
    if not has_tokenizer(d):
        rep.add("tokenizer", "error", f"{d}: no tokenizer files (tokenizer.json / tokenizer_config.json); vLLM "
                "needs one to serve text — export with --tokenizer DIR")
        return
    try:
        tok = load_tokenizer(d)
    except MConvertError as e:
        rep.add("tokenizer", "error", str(e))
        return
    n = len(tok)
    top = max(tok.get_vocab().values(), default=-1)
    if n > vocab or top >= vocab:
        rep.add("tokenizer", "error", f"tokenizer has {n} tokens (max id {top}) but vocab_size is {vocab}: ids "
                "beyond the embedding would crash or read garbage")
    else:
        pad = f"; {vocab - n} embedding rows beyond the tokenizer" if vocab > n else ""
        rep.add("tokenizer", "ok", f"{n} tokens within vocab_size {vocab}{pad}")


def _chat_renders(d: Path, rep: VerifyReport) -> None:
    """Every chat template of the export renders a conversation, as vLLM's chat endpoint renders it (in a
    bounded child: a template that loops or grows without end is an error, never a hang)."""
    try:
        if not has_tokenizer(d) or not has_chat_template(d):
            return
        n = len(chat_ids(d, CHAT))
    except MConvertError as e:
        rep.add("chat-template", "error", str(e))
        return
    rep.add("chat-template", "ok", f"{n} template(s) render a conversation")


def _generation_config(d: Path, cfg: dict[str, Any], probed: dict[str, Any], rep: VerifyReport) -> None:
    p = d / "generation_config.json"
    vocab = int(cfg.get("vocab_size") or 0)
    if not os.path.lexists(p):
        rep.add("generation-config", "error", f"{p}: missing; vLLM reads eos/bos ids from it")
        return
    try:
        g = load_json_object(inside_file(d, p.name, f"{d}: generation config"), "generation config",
                             "re-export the model")
    except MConvertError as e:
        rep.add("generation-config", "error", str(e))
        return
    eos = g.get("eos_token_id", cfg.get("eos_token_id"))
    eos_ids = eos if isinstance(eos, list) else ([] if eos is None else [eos])
    outside = _ids_outside(g, vocab)
    refused = probed.get("generation")
    if refused:
        key = re.search(r"`(\w+)`", refused)
        fix = f"fix {key.group(1)}" if key else "fix it"
        rep.add("generation-config", "error", f"{p}: transformers' GenerationConfig refuses it ({refused}); {fix}")
    elif not eos_ids:
        rep.add("generation-config", "error", f"{p.name}: no eos_token_id; generation would never stop on EOS")
    elif outside:
        rep.add("generation-config", "error", f"{p.name}: {'; '.join(outside)} outside vocab_size {vocab}")
    elif any(not isinstance(i, int) or not 0 <= i < vocab for i in eos_ids):
        rep.add("generation-config", "error", f"{p.name}: eos_token_id {eos} outside vocab_size {vocab}")
    else:
        rep.add("generation-config", "ok", f"eos_token_id {eos}")


# The special-token id fields of config.json and generation_config.json: an int, a list of ints (eos) or null.
_ID_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")


def _ids_outside(obj: dict[str, Any], vocab: int) -> list[str]:
    """'field value' for each special-token id field of `obj` naming an id outside [0, vocab) (or not an id)."""
    bad = []
    for k in _ID_FIELDS:
        v = obj.get(k)
        ids = v if isinstance(v, list) else [] if v is None else [v]
        if any(not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < vocab for i in ids) or v == []:
            bad.append(f"{k} {v}")
    return bad


def _config_ids(cfg: dict[str, Any], rep: VerifyReport) -> None:
    """config.json's bos/eos/pad ids (lists included) against its vocab_size: transformers and vLLM index the
    embedding with them."""
    vocab = int(cfg.get("vocab_size") or 0)
    outside = _ids_outside(cfg, vocab)
    if outside:
        rep.add("token-ids", "error", f"config.json: {'; '.join(outside)} outside vocab_size {vocab}")
    else:
        held = {k: cfg[k] for k in _ID_FIELDS if cfg.get(k) is not None}
        rep.add("token-ids", "ok", ", ".join(f"{k} {v}" for k, v in held.items()) or "no special-token ids")


def _chat_template(d: Path, ckpt: Path, info: Any, rep: VerifyReport) -> None:
    """An instruct-style source (its tokenizer has a chat template) whose export has none: chat endpoints then
    refuse the model or fall back to a template nobody trained with."""
    src = getattr(info, "tokenizer_dir", None)
    try:
        if src is None or not has_chat_template(Path(src)):
            return
        if has_tokenizer(d) and has_chat_template(d):
            rep.add("chat-template", "ok", f"present, as in {ckpt.name}'s tokenizer")
            return
    except MConvertError as e:
        rep.add("chat-template", "error", str(e))
        return
    rep.add("chat-template", "error", f"{d}: no chat template, but the source's tokenizer ({src}) has one: chat "
            "requests would be refused (vLLM) or formatted differently — re-export with mconvert, or copy "
            "chat_template.jinja (and additional_chat_templates/) from the source")


def _manifest(d: Path, rep: VerifyReport) -> None:
    if not (d / MANIFEST).is_file():
        rep.add("manifest", "warn", f"no {MANIFEST} (not written by mconvert, or copied without it)")
        return
    problems = check_manifest(d)
    if problems:
        rep.add("manifest", "error", f"{len(problems)} file(s) differ from the manifest: {problems[0]}")
    else:
        rep.add("manifest", "ok", "every file matches its digest in the manifest")


# ---- against a checkpoint ------------------------------------------------------------------------
def _against(d: Path, cfg: dict[str, Any], ckpt: Path, rep: VerifyReport, device: str, n_tokens: int) -> None:
    """Config vs the checkpoint's spec (named differences), then the logits check of `validate`."""
    info = describe(ckpt)
    _chat_template(d, ckpt, info, rep)
    ref_spec = reference_spec(info)
    if ref_spec is not None:
        _config_vs_spec(cfg, ref_spec, rep)
    try:
        vr = validate(ckpt, [d], device=device, n_tokens=n_tokens)
    except MConvertError as e:
        rep.add("logits", "error", f"logits check could not run: {e}")
        return
    rep.logits = vr.to_json()
    r = vr.results[0]
    if r.passed:
        m = r.metrics
        rep.add("logits", "ok", f"vs {ckpt.name} ({info.format}): max abs {m['max_abs']:.2e}, KL {m['kl']:.1e}, "
                f"top-1 {m['top1']:.3f}")
    else:
        rep.add("logits", "error", f"vs {ckpt.name} ({info.format}): " + "; ".join(r.failures))
        culprit = diagnose_weights(d, ckpt)
        if culprit:
            rep.add("weights-vs-checkpoint", "error", culprit)


def reference_spec(info) -> Any:
    """The ModelSpec of a reference model (Megatron args or HF config), or None when unknown."""
    try:
        if info.format == "hf":
            return families.spec_from_hf_config(load_json_object(inside_file(info.path, "config.json",
                                                                         f"{info.path}: config"), "config"))
        if info.format == "megatron":
            lay = info.layout
            rank = "mp_rank_00" if lay["pp"] == 1 else "mp_rank_00_000"
            st = safe_load(info.path / iteration_dir_name(lay["iteration"]) / rank / RANK_FILE)
            return families.spec_from_megatron_args(st["args"])
    except (MConvertError, OSError, ValueError, KeyError):
        return None
    return None


def _config_vs_spec(cfg: dict[str, Any], ref, rep: VerifyReport) -> None:
    try:
        mine = families.spec_from_hf_config(cfg)
    except MConvertError as e:
        rep.add("config-vs-checkpoint", "error", str(e))
        return
    diffs = []
    if mine.vocab_size != ref.vocab_size:
        pad = any(mine.vocab_size == ref.padded_vocab_size(tp) for tp in (1, 2, 4, 8, 16))
        diffs.append(f"vocab_size {mine.vocab_size} != checkpoint's true vocab {ref.vocab_size}"
                     + (" (vocab padding left in)" if pad or mine.vocab_size > ref.vocab_size else ""))
    eps_key = families.of(mine).vllm.eps_key
    if not _close(mine.norm_epsilon, ref.norm_epsilon):
        diffs.append(f"{eps_key} {mine.norm_epsilon:g} != checkpoint's {ref.norm_epsilon:g}")
    if mine.position_embedding_type == "rope" and not _close(mine.rotary_base, ref.rotary_base):
        diffs.append(f"rope_theta {mine.rotary_base:g} != checkpoint's rotary_base {ref.rotary_base:g}")
    for f in ("num_layers", "hidden_size", "num_attention_heads", "num_groups", "ffn_hidden_size", "head_dim",
              "max_position_embeddings", "activation", "tie_embeddings"):
        a, b = getattr(mine, f), getattr(ref, f)
        if a != b:
            diffs.append(f"{f} {a} != checkpoint's {b}")
    if diffs:
        rep.add("config-vs-checkpoint", "error", "; ".join(diffs))
    else:
        rep.add("config-vs-checkpoint", "ok", "sizes, eps, rope and tying equal the checkpoint's")


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-9 * max(abs(a), abs(b), 1e-30)


def diagnose_weights(d: Path, ckpt: Path) -> str | None:
    """Name the first HF tensor that differs from the checkpoint's, and how (permuted rows, mixed halves)."""
    try:
        with open_source(ckpt) as src:  # its files close whichever way this returns
            keys: dict[str, Path] = {}
            for f in sorted(d.glob("*.safetensors")):
                with safe_open(str(f), framework="pt") as h:
                    keys.update({k: f for k in h.keys()})
            # one expert, one parameter of a streamed unit at a time (an MoE MTP layer's experts): never a layer
            # of experts; a parameter's siblings (gate/up, q/k/v) come in its part
            for unit in src.units(split_experts=True):
                for want in src.read_hf_parts(unit):
                    for name, w in want.items():
                        if name not in keys:
                            continue
                        with safe_open(str(keys[name]), framework="pt") as h:
                            got = h.get_tensor(name)
                        verdict = classify_difference(name, got, w, want)
                        if verdict:
                            return verdict
    except Exception as e:  # diagnosis is best effort; the logits verdict stands either way
        return f"(weight diagnosis unavailable: {str(e)[:120]})"
    return None


def _rows(t: torch.Tensor) -> torch.Tensor:
    return torch.unique(t.float().reshape(t.shape[0], -1), dim=0)


def classify_difference(name: str, got: torch.Tensor, want: torch.Tensor, unit: dict[str, torch.Tensor]) -> str | None:
    """How `got` differs from `want` (None when equal); `unit` holds the expected siblings (gate/up, q/k/v)."""
    if got.shape != want.shape:
        return f"{name}: shape {list(got.shape)} != checkpoint's {list(want.shape)}"
    if torch.equal(got, want.to(got.dtype)):
        return None
    where = f"{name}: "
    if got.dim() == 2:
        g = got.float()
        if torch.equal(_rows(g), _rows(want)):
            kind = "GQA/head groups permuted" if any(x in name for x in ("k_proj", "v_proj", "q_proj", "c_attn")) \
                else "rows permuted"
            return where + f"same rows as the checkpoint in another order ({kind})"
        for a, b in (("gate_proj", "up_proj"), ("up_proj", "gate_proj")):
            sib = name.replace(a, b)
            if a in name and sib in unit:
                pool = _rows(torch.cat([want.float(), unit[sib].float()]))
                mine = _rows(g)
                if all(bool((pool == r).all(-1).any()) for r in mine):
                    return where + "rows mixed between gate_proj and up_proj (SwiGLU halves swapped across TP ranks)"
    diff = float((got.float() - want.float()).abs().max())
    return where + f"values differ from the checkpoint (max abs {diff:.3g})"


def render_verify(rep: VerifyReport, console) -> None:
    """The rich table of checks, then the verdict line."""
    t = Table(title=f"verify {rep.path} ({rep.engine} readiness)", title_justify="left")
    t.add_column("check")
    t.add_column("status")
    t.add_column("detail", overflow="fold")
    style = {"ok": "[green]ok[/]", "warn": "[yellow]warn[/]", "error": "[bold red]ERROR[/]"}
    for c in rep.checks:
        t.add_row(c.name, style.get(c.status, c.status), _plain(c.message))
    console.print(t)
    errs = rep.errors()
    for c in errs:
        console.print(f"  [red]✗[/] {c.name}: {_plain(c.message)}", highlight=False, soft_wrap=True)
    if errs:
        console.print(f"[bold red]NOT READY[/]: {len(errs)} error(s): {', '.join(c.name for c in errs)}")
    else:
        console.print(f"[bold green]READY[/] for {rep.engine} ({rep.seconds:.1f} s)")
