"""`plan` and `--dry-run` take the pipeline split as the verbs do (`PipelineSplit`, Megatron-LM's option names) and
size block-scaled FP8: checked against the files the conversions really write.

- hf-to-megatron at an uneven split (`--decoder-first-pipeline-num-layers 1`): the dry run lists the rank files,
  tensors and sizes it writes; a reshard dry run of that checkpoint reads the files at their real split;
- megatron-to-hf --fp8-blocks: the dry run's safetensors hold the tensors (weights, their `_scale_inv`) and bytes
  of the FP8 export;
- `plan --decoder-first-pipeline-num-layers` (and its former name `--first-stage-layers`) and
  `--pipeline-model-parallel-layout` give PipelineSplit's stages and the args to pass.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from safety_common import run_cli
from test_moe_plan import _check, _real

from mconvert.convert.verbs import hf_to_megatron, megatron_to_hf, reshard
from mconvert.layouts.megatron import PipelineSplit
from mconvert.mappings.families import preset

SPEC = preset("tiny-deepseek-v3")  # 3 layers: dense, MoE, MoE; an MTP layer (MoE) on the last stage


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An HF export with its MTP layer (transformers builds none): random rank files through megatron-to-hf."""
    import torch

    from mconvert.convert.megatron.writer import megatron_writer

    d = tmp_path_factory.mktemp("plan_splits")
    w = megatron_writer(d / "mg", SPEC, 1, 1, None, 1, iteration="release")
    g = torch.Generator().manual_seed(0)
    for unit in SPEC.units():
        w.add(unit, {n.name: torch.randn(n.shape, generator=g) * 0.02 for n in SPEC.unit_params(unit)})
    w.close()
    megatron_to_hf(d / "mg", d / "hf")
    return d / "hf"


@pytest.mark.timeout(300)
def test_dry_runs_at_an_uneven_split_list_the_files_written(hf_dir: Path, tmp_path: Path) -> None:
    mg = tmp_path / "mg"
    pipeline = {"decoder_first_pipeline_num_layers": 1}
    plan = hf_to_megatron(hf_dir, mg, pp=2, ep=2, pipeline=pipeline, dry_run=True)
    assert not mg.exists()
    hf_to_megatron(hf_dir, mg, pp=2, ep=2, pipeline=pipeline)
    real = _real(mg)
    _check(plan["files"], real)
    layers = {f["path"]: f.get("layers") for f in plan["files"]}
    assert layers == {f"mp_rank_00_00{p}_00{e}/model_optim_rng.pt": 1 + p for p in (0, 1) for e in (0, 1)}
    again = reshard(mg, tmp_path / "rs", tp=1, pp=1, dry_run=True)  # the source's own uneven split
    assert again["read_files"] == 4 and again["read_bytes"] == sum(f["bytes"] for f in plan["files"])


def _safetensors(path: Path) -> tuple[int, int]:
    """(tensor data bytes, tensors) of one safetensors file, from its header."""
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = {k: v for k, v in json.loads(raw[8:8 + n]).items() if k != "__metadata__"}
    return len(raw) - 8 - n, len(header)


@pytest.mark.timeout(300)
def test_an_fp8_dry_run_sizes_the_fp8_export(hf_dir: Path, tmp_path: Path) -> None:
    mg = tmp_path / "mg"
    hf_to_megatron(hf_dir, mg)
    plain = megatron_to_hf(mg, tmp_path / "plain", dry_run=True)
    plan = megatron_to_hf(mg, tmp_path / "fp8", fp8_blocks=True, dry_run=True)
    megatron_to_hf(mg, tmp_path / "fp8", fp8_blocks=True)
    [f] = plan["files"]
    assert (f["bytes"], f["tensors"]) == _safetensors(tmp_path / "fp8" / f["path"])
    assert f["bytes"] < plain["files"][0]["bytes"]
    back = hf_to_megatron(tmp_path / "fp8", tmp_path / "mg2", dry_run=True)  # an FP8 source reads FP8 bytes
    assert back["read_bytes"] == f["bytes"]


def _plan(capsys, *argv: str) -> dict:
    code, out, err = run_cli(["plan", "--preset", "deepseek-v3-671b", "--to", "hf", "--tp", "8", "--ep", "8",
                              "--json", *argv], capsys)
    assert code == 0, err
    return json.loads(out)


def test_plan_takes_megatron_lms_split_options_and_the_former_names(capsys) -> None:
    new = _plan(capsys, "--pp", "16", "--decoder-first-pipeline-num-layers", "1")
    old = _plan(capsys, "--pp", "16", "--first-stage-layers", "1")
    want = PipelineSplit.make(61, 16, first=1, mtp_num_layers=1)
    assert new["stage_layers"] == old["stage_layers"] == want.layer_counts() == [1] + [4] * 15
    assert new["megatron_args"] == old["megatron_args"] == {"decoder_first_pipeline_num_layers": 1}
    layout = "E" + "t|" + "tttt|" * 14 + "ttttmL"
    got = _plan(capsys, "--pp", "16", "--pipeline-model-parallel-layout", layout)
    assert got["stage_layers"] == [1] + [4] * 15
    assert got["megatron_args"] == {"pipeline_model_parallel_layout": layout}
    code, _, err = run_cli(["plan", "--preset", "deepseek-v3-671b", "--to", "hf", "--tp", "8", "--pp", "16",
                            "--decoder-first-pipeline-num-layers", "2"], capsys)
    assert code != 0 and "error:" in err and "do not divide evenly" in err, err
