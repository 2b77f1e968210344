"""The memory pre-check counts what a conversion holds at once, on the published GLM-4.5 and DeepSeek-V3 configs.

Each model is its published config.json and a safetensors header listing the tensors transformers builds for it,
its MTP layer's included (`sparse_hf`: nothing written, nothing read). What the conversion holds at once comes
from the header alone: the embedding (with the MTP layer's copy of it, checked equal), a layer's tensors outside
its routed experts, one routed expert, and the head (with the MTP layer's copy): the final unit, MTP layer and
its experts included, moves one parameter at a time. The pre-check needs 3 × the largest of these (shards,
merged tensors, output buffer); a machine with exactly that much free is accepted by `hf-to-megatron --dry-run`,
one with a byte less refused with the one line naming the need, well below 3 × the final unit held whole.
"""

from __future__ import annotations

import json
import math
import re
import struct
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safety_common import assert_one_line_error, run_cli
from sparse_hf import write_sparse_hf

import mconvert.convert.bounds as bounds
from mconvert.convert.megatron.writer import megatron_writer
from mconvert.mappings.families import preset

CONFIGS = Path(__file__).resolve().parents[1] / "data" / "configs"
MODELS = ("zai-org__GLM-4.5", "deepseek-ai__DeepSeek-V3")
BYTES = {"BF16": 2, "F16": 2, "F32": 4}


@pytest.fixture(scope="session")
def published(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    if not CONFIGS.is_dir():
        pytest.skip(f"{CONFIGS} is not in this checkout")
    root = tmp_path_factory.mktemp("published")
    out = {}
    for name in MODELS:
        write_sparse_hf(json.loads((CONFIGS / f"{name}.json").read_text()), root / name)
        out[name] = root / name
    return out


def _header(d: Path) -> dict[str, int]:
    """Tensor name -> bytes, from the safetensors header."""
    with open(d / "model.safetensors", "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return {k: BYTES[v["dtype"]] * math.prod(v["shape"]) for k, v in header.items() if k != "__metadata__"}


def _layer(name: str) -> int | None:
    m = re.match(r"model\.layers\.(\d+)\.", name)
    return int(m.group(1)) if m else None


def _held_at_once(d: Path) -> dict[str, int]:
    """The pieces the conversion holds at once and their bytes, grouped from the header's tensor names."""
    cfg = json.loads((d / "config.json").read_text())
    L = cfg["num_hidden_layers"]
    sizes = _header(d)
    mtp = {k: v for k, v in sizes.items() if (_layer(k) or 0) >= L}  # the MTP layers: after the decoder's
    held = {"embedding": sizes["model.embed_tokens.weight"] + sum(v for k, v in mtp.items()
                                                                   if k.endswith(".embed_tokens.weight")),
            "head": sizes["lm_head.weight"] + sum(v for k, v in mtp.items() if k.endswith(".shared_head.head.weight"))}
    for k, v in sizes.items():
        m = re.match(r"model\.layers\.(\d+)\.(mlp\.experts\.(\d+)\.)?", k)
        if m and int(m.group(1)) < L:
            part = f"layer {m.group(1)}" + (f" expert {m.group(3)}" if m.group(2) else "")
            held[part] = held.get(part, 0) + v
    held["final unit whole"] = (sum(v for k, v in mtp.items() if not k.endswith(".embed_tokens.weight"))
                                + sizes["lm_head.weight"] + sizes["model.norm.weight"])
    return held


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", MODELS)
def test_the_precheck_needs_what_is_held_at_once_not_the_mtp_layer_whole(name, published, monkeypatch, capsys,
                                                                          tmp_path: Path) -> None:
    hf = published[name]
    held = _held_at_once(hf)
    whole = held.pop("final unit whole")
    need = 3 * max(held.values())
    assert need < 3 * whole / 3, (need, whole)  # the final unit held whole would need more than three times as much

    def free(available: int) -> tuple[int, str]:
        monkeypatch.setattr(bounds.psutil, "virtual_memory", lambda: SimpleNamespace(available=available))
        code, _, err = run_cli(["hf-to-megatron", hf, tmp_path / "out", "--tp", "8", "--ep", "8", "--dry-run"],
                               capsys)
        return code, err

    code, err = free(need)
    assert code == 0, err
    code, err = free(need - 1)
    assert_one_line_error(code, err, f"{hf / 'config.json'}: converting ", f"needs about {need / 2**30:.1f} GiB",
                          f"but {(need - 1) / 2**30:.1f} GiB is available")
    assert not (tmp_path / "out").exists()
    print(f"\n{name}: the pre-check needs {need / 2**30:.1f} GiB (3 × the largest of what is held at once); "
          f"the final unit with its MTP layer held whole would need {3 * whole / 2**30:.1f} GiB")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", MODELS)
def test_gguf_is_checked_for_one_expert_not_a_layer_of_them(name, published, monkeypatch, capsys,
                                                            tmp_path: Path) -> None:
    """hf-to-gguf writes each expert as its slice of llama.cpp's stacked tensors and the final unit a parameter
    at a time: it holds what hf-to-megatron holds, so a machine with exactly the need above is accepted for the
    GGUF too and one with a byte less refused, far below 3 × a whole MoE layer (or the final unit with its MTP
    layer, GLM-4.5's nextn block), what a writer fed whole layers would need."""
    hf = published[name]
    held = _held_at_once(hf)
    final = held.pop("final unit whole")
    need = 3 * max(held.values())
    layer = max(sum(v for k, v in held.items() if k == f"layer {i}" or k.startswith(f"layer {i} "))
                for i in range(json.loads((hf / "config.json").read_text())["num_hidden_layers"]))
    whole = 3 * max(layer, final)
    assert need < whole / 3, (need, whole)

    def free(available: int) -> tuple[int, str]:
        monkeypatch.setattr(bounds.psutil, "virtual_memory", lambda: SimpleNamespace(available=available))
        code, _, err = run_cli(["hf-to-gguf", hf, tmp_path / "out.gguf", "--outtype", "bf16", "--dry-run"], capsys)
        return code, err

    code, err = free(need)
    assert code == 0, err
    code, err = free(need - 1)
    assert_one_line_error(code, err, f"{hf / 'config.json'}: converting ", f"needs about {need / 2**30:.1f} GiB")
    assert not (tmp_path / "out.gguf").exists()
    print(f"\n{name} to GGUF: the pre-check needs {need / 2**30:.1f} GiB; whole layers would need "
          f"{whole / 2**30:.1f} GiB (3 × {max(layer, final) / 2**30:.1f} GiB)")


@pytest.mark.timeout(300)
def test_megatron_rank_files_are_checked_per_expert_and_per_mtp_parameter(monkeypatch, capsys, tmp_path: Path) -> None:
    """EP=2 rank files of a DeepSeek-V3-style model of 32 experts of 6.3 MB in fp32 (a 201 MB layer of experts, one
    MoE MTP layer): with 100 MB free, megatron-to-hf and megatron-to-gguf (one expert, one MTP parameter at a time;
    the GGUF reads no MTP tensor, llama.cpp's deepseek2 has none) are accepted, where the final unit held whole
    would need more than 600 MB; with 10 MB free the GGUF is refused, naming what it holds at once."""
    H, F, E = 256, 2048, 32
    spec = preset("tiny-deepseek-v3").replace(num_layers=1, moe_layer_freq=(1,), hidden_size=H, moe_ffn_hidden_size=F,
                                              moe_shared_expert_intermediate_size=F, num_experts=E, vocab_size=512)
    w = megatron_writer(tmp_path / "mg", spec, tp=1, pp=1, ep=2)
    for unit in spec.units(split_experts=True):
        w.add(unit, {d.name: torch.zeros(d.shape) for d in spec.unit_params(unit)})
    w.close()
    final = sum(math.prod(d.shape) for d in spec.final_params()) * 4
    assert 3 * final > 600e6  # 32 experts of the MTP layer and the rest of the final unit, held whole
    monkeypatch.setattr(bounds.psutil, "virtual_memory", lambda: SimpleNamespace(available=100 << 20))
    code, _, err = run_cli(["megatron-to-hf", tmp_path / "mg", tmp_path / "hf", "--dry-run"], capsys)
    assert code == 0, err
    code, _, err = run_cli(["megatron-to-gguf", tmp_path / "mg", tmp_path / "out.gguf", "--dry-run"], capsys)
    assert code == 0, err
    monkeypatch.setattr(bounds.psutil, "virtual_memory", lambda: SimpleNamespace(available=10 << 20))
    code, _, err = run_cli(["megatron-to-gguf", tmp_path / "mg", tmp_path / "out.gguf", "--dry-run"], capsys)
    assert_one_line_error(code, err, "converting layer 0's dense part needs about", "but 0.0 GiB is available")
    assert not (tmp_path / "out.gguf").exists()
