"""Published config.json files of the supported families (tests/data/configs/, each with its source noted)
convert: `hf-to-megatron --dry-run` and `hf-to-gguf --dry-run` accept every one whose features mconvert maps,
and refuse the others naming the feature.

Truth we did not write: the configs are the ones their authors published, and each model's tensors are the
ones transformers builds from it (names, shapes, dtypes of `AutoModelForCausalLM.from_config` on the meta
device), written as a safetensors file with a correct header and a sparse data region (no bytes are written,
so a 70B model costs what a tiny one does). The expected verdicts live beside the configs in
tests/data/config_expectations.json: a feature mconvert does not map yet is marked there, and flipping its
`supported` makes every config using it an expected acceptance.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from safety_common import run_cli

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "tests" / "data" / "configs"
EXPECTATIONS = ROOT / "tests" / "data" / "config_expectations.json"
MIN_CORPUS = 40

# safetensors' dtype names
_ST_DTYPE = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


def _rope_type(cfg: dict[str, Any]) -> str | None:
    rs = cfg.get("rope_scaling")
    return (rs.get("rope_type") or rs.get("type")) if isinstance(rs, dict) else None


def _sliding_window(cfg: dict[str, Any]) -> bool:
    """Whether transformers' class masks attention to a window shorter than the context."""
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


# feature -> (whether a config uses it, the config without it); what each one means and whether it is mapped is
# in the expectations file
FEATURES = {
    "sliding_window": (_sliding_window, _no_window),
    "yarn": (lambda cfg: _rope_type(cfg) == "yarn", lambda cfg: {**cfg, "rope_scaling": None}),
    "rope_dynamic_or_longrope": (lambda cfg: _rope_type(cfg) in ("dynamic", "longrope"),
                                 lambda cfg: {**cfg, "rope_scaling": None}),
}


def expected(name: str, cfg: dict[str, Any], book: dict[str, Any]) -> tuple[str | None, dict[str, Any] | None]:
    """(None, None) when the config must be accepted, else the text its refusal must hold and the config
    without the refused features (which must be accepted; None for a per-file exception)."""
    entry = book["files"].get(name)
    if entry is not None:
        return entry["refused_naming"], None
    named, without = None, cfg
    for feature, (uses, strip) in FEATURES.items():
        spec = book["features"][feature]
        if not spec["supported"] and uses(cfg):
            named = named or spec["refused_naming"]
            without = strip(without)
    return named, (without if named else None)


def write_sparse_hf(cfg: dict[str, Any], d: Path) -> int:
    """config.json plus a model.safetensors whose header lists the tensors transformers builds for it and whose
    data region is a hole of the right length; returns the bytes the tensors claim."""
    import transformers
    from transformers.modeling_utils import no_init_weights

    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(cfg))
    config = transformers.AutoConfig.from_pretrained(d)
    dtype = getattr(config, "dtype", None) or torch.float32
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    with torch.device("meta"), no_init_weights():  # shapes only: no storage, no initialiser run
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    state = model.state_dict()
    if getattr(config, "tie_word_embeddings", False):  # save_pretrained writes the tied copy once
        for k in getattr(model, "_tied_weights_keys", None) or ():
            state.pop(k, None)
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for k, t in state.items():
        n = t.numel() * t.element_size()
        header[k] = {"dtype": _ST_DTYPE[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(d / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)  # a hole: nothing is written, nothing is read in a dry run
    return offset


def _corpus() -> list[Path]:
    return sorted(CONFIGS.glob("*.json"))


@pytest.mark.timeout(900)
def test_every_published_config_of_a_supported_family_converts(tmp_path_factory, capsys) -> None:
    if not CONFIGS.is_dir():
        pytest.skip(f"{CONFIGS} is not in this checkout")
    files = _corpus()
    assert len(files) >= MIN_CORPUS, f"{CONFIGS} holds {len(files)} configs; the corpus needs {MIN_CORPUS}"
    book = json.loads(EXPECTATIONS.read_text())
    assert set(book["features"]) == set(FEATURES), "the expectations file and FEATURES name different features"
    unknown = set(book["files"]) - {p.name for p in files}
    assert not unknown, f"expectations for configs not in the corpus: {sorted(unknown)}"
    work = tmp_path_factory.mktemp("corpus")
    wrong: list[str] = []
    verdicts = {"accepted": 0, "refused": 0}
    for path in files:
        cfg = json.loads(path.read_text())
        want, without = expected(path.name, cfg, book)
        hf = work / path.stem
        write_sparse_hf(cfg, hf)
        problems = _verdicts(path.name, hf, work / path.stem, want, capsys)
        if without is not None:  # the refusal is for the feature alone: the same config without it converts
            write_sparse_hf(without, work / f"{path.stem}-without")
            problems += _verdicts(f"{path.name} without its refused features", work / f"{path.stem}-without",
                                  work / f"{path.stem}-without", None, capsys, ("hf-to-megatron",))
        wrong += problems
        if not problems:
            verdicts["refused" if want else "accepted"] += 1
    with capsys.disabled():
        print(f"\nHF config corpus: {verdicts['accepted']} of {len(files)} published configs accepted by "
              f"hf-to-megatron and hf-to-gguf --dry-run, {verdicts['refused']} refused naming the feature")
    assert not wrong, "\n".join(wrong)


def _verdicts(name: str, hf: Path, out: Path, want: str | None, capsys,
              verbs: tuple[str, ...] = ("hf-to-megatron", "hf-to-gguf")) -> list[str]:
    """What is wrong with each verb's dry-run verdict on `hf` (want: None to accept, else the text its refusal
    must hold)."""
    wrong = []
    for verb in verbs:
        dst = out.with_name(out.name + (".gguf" if verb == "hf-to-gguf" else "-mg"))
        code, _, err = run_cli([verb, hf, dst, "--dry-run"], capsys)
        if want is None and code != 0:
            wrong.append(f"{name}: {verb} refused a supported config: {err.strip()}")
        elif want is not None and code == 0:
            wrong.append(f"{name}: {verb} accepted it; expected a refusal naming {want!r}")
        elif want is not None and want not in err:
            wrong.append(f"{name}: {verb} refused it without naming {want!r}: {err.strip()}")
        assert not dst.exists(), f"{verb} --dry-run wrote {dst}"
    return wrong
