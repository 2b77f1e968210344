"""Published config.json files (tests/data/configs/, each with its source noted in SOURCES.md) convert or are
refused by name: `hf-to-megatron --dry-run` and `hf-to-gguf --dry-run` accept every config of a family mconvert
supports whose features it maps, and refuse every other one with one `error:` line naming the feature, the
architecture or the field.

Truth we did not write: the configs are the ones their authors published, and each model's tensors are the
ones transformers builds from it (names, shapes, dtypes of the class its `architectures` names, else of
`AutoModelForCausalLM`, on the meta device), written as a safetensors file with a correct header and a sparse
data region (no bytes are written, so a 70B model costs what a tiny one does). The expected verdicts live beside
the configs in tests/data/config_expectations.json: a feature a verb does not map yet, a family mconvert does
not convert yet and a refused config of a supported family are each recorded there with the reason, so a
family or feature that lands flips its configs to expected acceptances. A refusal for a feature or a field is
proven to be for that alone: the same config without it converts.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from safety_common import run_cli
from sparse_hf import write_config_only, write_sparse_hf

ROOT = Path(__file__).resolve().parents[3]
CONFIGS = ROOT / "tests" / "data" / "configs"
EXPECTATIONS = ROOT / "tests" / "data" / "config_expectations.json"
MIN_CORPUS = 40
VERBS = ("hf-to-megatron", "hf-to-gguf")


def _rope_type(cfg: dict[str, Any]) -> str | None:
    rs = cfg.get("rope_scaling")
    return (rs.get("rope_type") or rs.get("type")) if isinstance(rs, dict) else None


def _sliding_window(cfg: dict[str, Any]) -> bool:
    """Whether transformers' class masks attention to a window shorter than the context (Gemma's windows are
    part of llama.cpp's gemma2 / gemma3 architectures, which every verb writes)."""
    if cfg.get("model_type") in ("gemma2", "gemma3_text"):
        return False
    if any(t != "full_attention" for t in cfg.get("layer_types") or ()):
        return True
    if cfg.get("model_type") in ("qwen2", "qwen3", "qwen3_moe"):
        return bool(cfg.get("use_sliding_window")) and cfg.get("sliding_window") is not None
    window, context = cfg.get("sliding_window"), cfg.get("max_position_embeddings")
    return isinstance(window, int) and isinstance(context, int) and window < context


def _no_window(cfg: dict[str, Any]) -> dict[str, Any]:
    out = {**cfg, "sliding_window": None, "use_sliding_window": False}
    out.pop("layer_types", None)
    return out


# feature -> (whether a config uses it, the config without it); what each one means and which verbs map it is
# in the expectations file
def _gemma_scale_off_llama_cpp(cfg: dict[str, Any]) -> bool:
    """A Gemma attention scale llama.cpp does not compute (it fixes 1/sqrt(head_dim) below its 27B sizes)."""
    big = {"gemma2": 46, "gemma3_text": 62}.get(str(cfg.get("model_type")))
    return big is not None and cfg.get("num_hidden_layers") != big and cfg.get("query_pre_attn_scalar", 256) != cfg.get(
        "head_dim", 256)


FEATURES = {
    "gemma_attention_scale": (_gemma_scale_off_llama_cpp,
                              lambda cfg: {**cfg, "query_pre_attn_scalar": cfg.get("head_dim", 256)}),
    "sliding_window": (_sliding_window, _no_window),
    "yarn": (lambda cfg: _rope_type(cfg) == "yarn", lambda cfg: {**cfg, "rope_scaling": None}),
    "rope_dynamic_or_longrope": (lambda cfg: _rope_type(cfg) in ("dynamic", "longrope"),
                                 lambda cfg: {**cfg, "rope_scaling": None}),
}


def expected(name: str, cfg: dict[str, Any], book: dict[str, Any]) -> tuple[dict[str, str | None],
                                                                         dict[str, Any] | None]:
    """verb -> None when the verb must accept the config, else the text its refusal must hold; and the config
    without what is refused (every verb must accept it; None when nothing can be taken away, as for a family
    mconvert does not convert)."""
    entry = book["files"].get(name)
    if entry is not None:
        keys = entry.get("without")
        accepting = entry.get("accepted_by", [])
        return {v: None if v in accepting else entry["refused_naming"] for v in VERBS}, (
            {k: v for k, v in cfg.items() if k not in keys} if keys else None)
    want: dict[str, str | None] = dict.fromkeys(VERBS)
    without = cfg
    for feature, (uses, strip) in FEATURES.items():
        spec = book["features"][feature]
        refusing = [v for v in VERBS if v not in spec["accepted_by"]]
        if refusing and uses(cfg):
            without = strip(without)
            for verb in refusing:
                want[verb] = want[verb] or spec["refused_naming"]
    return want, (without if any(want.values()) else None)


def _corpus() -> list[Path]:
    return sorted(CONFIGS.glob("*.json"))


@pytest.mark.timeout(900)
def test_every_published_config_of_a_supported_family_converts(tmp_path_factory, capsys, monkeypatch) -> None:
    if not CONFIGS.is_dir():
        pytest.skip(f"{CONFIGS} is not in this checkout")
    # the verdicts are the configs', not this machine's free memory (the memory refusal: test_safety_bounds)
    import mconvert.convert.bounds as bounds

    real = bounds.check_memory
    monkeypatch.setattr(bounds, "check_memory", lambda sizes, source, available=None: real(sizes, source, 1 << 40))
    files = _corpus()
    assert len(files) >= MIN_CORPUS, f"{CONFIGS} holds {len(files)} configs; the corpus needs {MIN_CORPUS}"
    book = json.loads(EXPECTATIONS.read_text())
    assert set(book["features"]) == set(FEATURES), "the expectations file and FEATURES name different features"
    unknown = set(book["files"]) - {p.name for p in files}
    assert not unknown, f"expectations for configs not in the corpus: {sorted(unknown)}"
    work = tmp_path_factory.mktemp("corpus")
    wrong: list[str] = []
    tally: dict[str, Counter] = {}
    for path in files:
        cfg = json.loads(path.read_text())
        want, without = expected(path.name, cfg, book)
        hf = work / path.stem
        if book["files"].get(path.name, {}).get("kind") == "family":
            write_config_only(cfg, hf)
        else:
            write_sparse_hf(cfg, hf, book["files"].get(path.name, {}).get("tensors_as"))
        problems = _verdicts(path.name, hf, want, capsys)
        if without is not None:  # the refusal is for what `without` lacks alone: without it, it converts
            write_sparse_hf(without, work / f"{path.stem}-without")
            verbs = tuple(v for v in VERBS if want[v] is not None)
            problems += _verdicts(f"{path.name} without what is refused", work / f"{path.stem}-without",
                                  dict.fromkeys(verbs), capsys)
        wrong += problems
        if not problems:
            counts = tally.setdefault(str(cfg.get("model_type")), Counter())
            counts["configs"] += 1
            for verb in VERBS:
                counts[(verb, "refused" if want[verb] else "accepted")] += 1
    _print_tally(tally, len(files), capsys)
    assert not wrong, "\n".join(wrong)


def _print_tally(tally: dict[str, Counter], total: int, capsys) -> None:
    rows = sorted(tally.items(), key=lambda kv: (-kv[1]["configs"], kv[0]))
    lines = [f"\nHF config corpus: {total} published configs, --dry-run verdicts per model_type "
             f"(accepted / refused naming the feature):",
             f"  {'model_type':<18}{'configs':>8}" + "".join(f"{v:>18}" for v in VERBS)]
    for mt, c in rows + [("all", sum(tally.values(), Counter()))]:
        lines.append(f"  {mt:<18}{c['configs']:>8}"
                     + "".join(f"{c[(v, 'accepted')]:>11} / {c[(v, 'refused')]:<4}" for v in VERBS))
    with capsys.disabled():
        print("\n".join(lines))


def _verdicts(name: str, hf: Path, want: dict[str, str | None], capsys) -> list[str]:
    """What is wrong with each verb's dry-run verdict on `hf` (want: verb -> None to accept, else the text its
    one-line refusal must hold)."""
    wrong = []
    for verb, named in want.items():
        dst = hf.with_name(hf.name + (".gguf" if verb == "hf-to-gguf" else "-mg"))
        code, _, err = run_cli([verb, hf, dst, "--dry-run"], capsys)
        lines = [ln for ln in err.splitlines() if ln.strip()]
        if named is None and code != 0:
            wrong.append(f"{name}: {verb} refused a supported config: {err.strip()}")
        elif named is not None and code == 0:
            wrong.append(f"{name}: {verb} accepted it; expected a refusal naming {named!r}")
        elif named is not None and (len(lines) != 1 or not lines[0].startswith("error: ") or named not in lines[0]
                                    or "MCONVERT_DEBUG" in lines[0]):
            wrong.append(f"{name}: {verb} did not refuse it in one error line naming {named!r}: {err.strip()}")
        assert not dst.exists(), f"{verb} --dry-run wrote {dst}"
    return wrong


# (a config as published, another published config of the same model): a transformers 5 re-save that states
# rope_theta only in `rope_parameters`, and a Qwen3 config that leaves head_dim to the class default
SAME_MODEL = [
    ("Qwen__Qwen2.5-0.5B.json", "galiihajiip__Qwen2.5-0.5B-merged-v5.json"),
    ("Qwen__Qwen2.5-0.5B-Instruct__resaved-4.49.json", "blackcoderh4k__Qwen2.5-0.5B-Instruct-merged-v5.json"),
    ("DeadByDawn101__Qwen3-8B-mlx-4bit.json", "Qwen__Qwen3-8B.json"),
]


@pytest.mark.parametrize("first,other", SAME_MODEL)
def test_two_published_configs_of_one_model_read_as_that_model(first: str, other: str) -> None:
    """The same model however its config was written (the dtype aside; a quantization_config describes the
    weights, not the network; so does MLX's `quantization`), with the head_dim transformers' Qwen3 config computes."""
    import dataclasses

    import transformers

    from mconvert.mappings.families import spec_from_hf_config

    specs = []
    for name in (first, other):
        cfg = {k: v for k, v in json.loads((CONFIGS / name).read_text()).items()
               if k not in ("quantization", "quantization_config")}
        spec = spec_from_hf_config(cfg)
        config = transformers.AutoConfig.for_model(**cfg)
        assert spec.head_dim == (getattr(config, "head_dim", None) or config.hidden_size
                                    // config.num_attention_heads), name
        specs.append(dataclasses.replace(spec, params_dtype="float32"))
    assert specs[0] == specs[1]
