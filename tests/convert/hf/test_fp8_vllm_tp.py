"""`megatron-to-hf --fp8-blocks --fp8-tp N`: every block-scaled FP8 projection must load in vLLM at TP=N.

vLLM's own checks decide (`validate_fp8_block_shape` / `validate_fp8_block_shape_moe` of its fp8_utils, run in the
vLLM venv): each projection is given to them as vLLM's model files build it (QKVParallelLinear, the merged
gate/up, DeepSeek's fused q_a/kv_a projection that is never split, column-, row-parallel and fused-MoE layers),
and `fp8.vllm_tp_misfit` must refuse exactly the layers they refuse, at TP 1 to 32, for DeepSeek-V3 671B, the
tiny DeepSeek and GLM-4.5 models, Llama 3 405B and Mixtral. The verb refuses before writing anything and names
the tensor.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mconvert.convert.bounds import expected_hf_shapes
from mconvert.convert.hf import fp8
from mconvert.errors import MConvertError
from mconvert.mappings.families import preset

PRESETS = ("deepseek-v3-671b", "tiny-deepseek-v3", "tiny-glm45", "llama3-405b", "tiny-mixtral")
TPS = (1, 2, 4, 8, 16, 32)
BLOCK = fp8.DEFAULT_BLOCK

VLLM_CHECK = """
import json, sys, types
import vllm.distributed as dist
from vllm.model_executor.layers.quantization.utils.fp8_utils import (validate_fp8_block_shape,
                                                                      validate_fp8_block_shape_moe)
out = []
for c in json.load(sys.stdin):
    dist.get_tensor_model_parallel_world_size = lambda: c["tp"]  # no process group here: the case's TP
    try:
        if c["kind"] == "moe":
            validate_fp8_block_shape_moe(c["inter"], c["block"])
        else:
            validate_fp8_block_shape(types.SimpleNamespace(tp_size=c["tp"]), c["input_size"], c["output_size"],
                                     c["in_part"], c["out_parts"], c["block"])
        out.append(True)
    except ValueError:
        out.append(False)
print(json.dumps(out))
"""


def _layers(name: str, tp: int) -> list[tuple[dict, list[str]]]:
    """vLLM's quantized layers of preset `name` at TP=`tp` (the arguments its fp8 checks get), each with the HF
    projections it loads (layer 0 / expert 0 standing for all)."""
    spec = preset(name)
    shapes = {k.replace("*", "0"): v for k, v in expected_hf_shapes(spec).items() if fp8.quantized_name(k)}

    def linear(parts: list[str], split_out: bool, split_in: bool, layer_tp: int = tp) -> tuple[dict, list[str]]:
        rows = [shapes[p][0] for p in parts]
        cols = shapes[parts[0]][1]
        out_parts = [r // layer_tp if split_out else r for r in rows]
        if split_out and parts[-1].endswith(("k_proj.weight", "v_proj.weight")):  # fewer kv heads than ranks
            out_parts = [out_parts[0], *(max(p, spec.head_dim) for p in out_parts[1:])]
        return ({"kind": "linear", "tp": layer_tp, "input_size": cols, "output_size": sum(rows),
                 "in_part": cols // layer_tp if split_in else cols, "out_parts": out_parts, "block": list(BLOCK)},
                parts)

    out = []
    for layer in sorted({k.split(".")[2] for k in shapes if k.startswith("model.layers.")}):
        p = f"model.layers.{layer}."
        a = p + "self_attn."
        have = {k for k in shapes if k.startswith(p)}
        if a + "k_proj.weight" in have:
            out.append(linear([a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"], True, False))
        if a + "q_a_proj.weight" in have:  # DeepSeek's fused_qkv_a_proj: merged, never split over TP
            out.append(linear([a + "q_a_proj.weight", a + "kv_a_proj_with_mqa.weight"], True, False, 1))
        for col in ("q_b_proj", "kv_b_proj") + (("q_proj",) if a + "kv_b_proj.weight" in have else ()):
            if a + col + ".weight" in have:
                out.append(linear([a + col + ".weight"], True, False))
        out.append(linear([a + "o_proj.weight"], False, True))
        for mlp in (p + "mlp.", p + "mlp.shared_experts."):
            if mlp + "gate_proj.weight" in have:
                out.append(linear([mlp + "gate_proj.weight", mlp + "up_proj.weight"], True, False))
                out.append(linear([mlp + "down_proj.weight"], False, True))
        experts = sorted(k for k in have if ".experts.0." in k)
        if experts:
            gate = next(k for k in experts if k.endswith(("gate_proj.weight", "w1.weight")))
            out.append(({"kind": "moe", "tp": tp, "inter": shapes[gate][0] // tp, "block": list(BLOCK)}, experts))
    return [(c, parts) for c, parts in out]


def _ours(name: str, parts: list[str], tp: int) -> bool:
    spec = preset(name)
    shapes = {k.replace("*", "0"): v for k, v in expected_hf_shapes(spec).items()}
    return all(fp8.vllm_tp_misfit(p, shapes[p], tp, BLOCK, spec.head_dim, not spec.is_mla) is None for p in parts)


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_fp8_tp_refuses_exactly_what_vllms_block_checks_refuse() -> None:
    if os.environ.get("MCONVERT_SKIP_VLLM"):
        pytest.skip("MCONVERT_SKIP_VLLM set")
    from mconvert.validators.vllm_check import ensure_vllm_env

    cases = [(name, tp, c, parts) for name in PRESETS for tp in TPS for c, parts in _layers(name, tp)]
    run = subprocess.run([str(ensure_vllm_env()), "-c", VLLM_CHECK], input=json.dumps([c for _, _, c, _ in cases]),
                         capture_output=True, text=True, timeout=500)
    assert run.returncode == 0, run.stderr[-2000:]
    theirs = json.loads(run.stdout.strip().splitlines()[-1])
    ours = [_ours(name, parts, tp) for name, tp, _, parts in cases]
    wrong = [(name, tp, parts, t) for (name, tp, _, parts), o, t in zip(cases, ours, theirs) if o != t]
    assert not wrong, wrong[:5]
    assert False in theirs and True in theirs  # both verdicts occur: the table tells something
    refused = {(n, tp) for (n, tp, _, _), t in zip(cases, theirs) if not t}
    assert ("deepseek-v3-671b", 8) not in refused and ("deepseek-v3-671b", 32) in refused


def test_fp8_tp_refuses_before_writing_and_names_the_tensor(tmp_path: Path) -> None:
    """The 671B model's shapes at TP=32 (its dense MLP's 18432/32 rows): refused, naming the tensor; TP=8 passes;
    --fp8-tp without --fp8-blocks is refused."""
    fp8_vllm_tp = fp8.check_vllm_tp
    spec = preset("deepseek-v3-671b")
    fp8_vllm_tp(spec, 8, True, "ckpt")
    with pytest.raises(MConvertError, match=r"--fp8-tp 32: model\.layers\.0\.mlp\.gate_proj\.weight \[18432, 7168\]: "
                                            r"its output rows per vLLM TP rank are 576"):
        fp8_vllm_tp(spec, 32, True, "ckpt")
    with pytest.raises(MConvertError, match="add --fp8-blocks or drop --fp8-tp"):
        fp8_vllm_tp(spec, 8, False, "ckpt")


def test_fp8_tp_of_the_cli_writes_nothing_when_refused(tmp_path: Path) -> None:
    """`megatron-to-hf --fp8-blocks --fp8-tp 2` of a tiny DeepSeek checkpoint (q_lora_rank 64: the first part of
    vLLM's fused q_a/kv_a projection is not whole blocks): one error line naming it, no output."""
    from mconvert.convert.megatron.writer import megatron_writer

    spec = preset("tiny-deepseek-v3").replace(mtp_num_layers=None)
    import torch

    w = megatron_writer(tmp_path / "ckpt", spec, 1, 1, None, 1, iteration="release")
    g = torch.Generator().manual_seed(0)
    for unit in spec.units():
        w.add(unit, {d.name: torch.randn(d.shape, generator=g) * 0.02 for d in spec.unit_params(unit)})
    w.close()
    run = subprocess.run([sys.executable, "-c", "from mconvert.cli import run; run()", "megatron-to-hf",
                          str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--fp8-blocks", "--fp8-tp", "2"],
                         capture_output=True, text=True, timeout=300, env={**os.environ})
    assert run.returncode != 0 and "Traceback" not in run.stderr, run.stderr[-2000:]
    assert "error:" in run.stderr and "--fp8-tp 2:" in run.stderr and "q_a_proj" in run.stderr, run.stderr
    assert not (tmp_path / "hf").exists()
