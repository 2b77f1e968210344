"""Mixture-of-experts models as torch_dist output, proven against megatron-core 0.16.1's MoE GPTModel (local
spec, SequentialMLP experts, allgather dispatcher; CPU, gloo):

- resharding megatron-core's own legacy MoE checkpoint into torch_dist gives the `.metadata` megatron-core's
  `dist_checkpointing.save` writes for the same model (keys, global `[layers, experts, ...]` shapes, chunk
  boxes, `_extra_state` entries per layer and expert) and the same values;
- our torch_dist output of an HF MoE model loads with megatron-core's `dist_checkpointing.load` into its MoE
  GPTModel at another TP and EP and reproduces transformers' logits (1e-4 relative).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hf_ref import hf_logits
from deploy_common import make_hf, rel
from mcore_ref import run_mcore
from test_moe import ITERATION, SPECS
from test_moe import _saved as _moe_saved
from test_torch_dist_write import _dcp_read_all, _load_dist, _summary

from mconvert.convert.verbs import hf_to_megatron, reshard
from mconvert.io.safeload import safe_load_dcp_metadata


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_moe_torch_dist_from_mcore_torch_matches_mcore_dist_save(tmp_path: Path,
                                                                 tmp_path_factory: pytest.TempPathFactory) -> None:
    """megatron-core saved the same Mixtral model twice at EP=2 (legacy rank files and dist_checkpointing.save):
    our torch -> torch_dist reshard has its `.metadata` structure and its values, whatever EP we write at."""
    _, _, _, root = _moe_saved("mixtral", 1, 2, tmp_path_factory)
    ref_dir = Path(str(root) + "_dist") / f"iter_{ITERATION:07d}"
    out = tmp_path / "ours"
    rep = reshard(root, out, tp=1, pp=1, ep=1, format="torch_dist")
    assert rep["format"] == "torch_dist" and rep["ep"] == 1
    ours_dir = out / f"iter_{ITERATION:07d}"
    ours, ref = _summary(ours_dir), _summary(ref_dir)
    assert sorted(set(ours) ^ set(ref)) == []
    assert ours == ref
    a, b = _dcp_read_all(ours_dir), _dcp_read_all(ref_dir)
    for k in b:
        assert (torch.equal(a[k], b[k]) if isinstance(b[k], torch.Tensor) else a[k] == b[k]), k


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_moe_torch_dist_output_loads_in_megatron_core_at_another_tp_and_ep(tmp_path: Path) -> None:
    """Qwen3-MoE (q/k norms, 4 experts) written at TP=2 EP=1, loaded by megatron-core at TP=1 EP=2."""
    spec = SPECS["qwen3_moe"]
    hf = make_hf(spec, tmp_path / "hf")
    out = tmp_path / "dist"
    plan = hf_to_megatron(hf, tmp_path / "plan", tp=2, pp=1, ep=1, format="torch_dist", dry_run=True)
    hf_to_megatron(hf, out, tp=2, pp=1, ep=1, format="torch_dist")
    [entry] = plan["files"]  # the plan names the data file, its chunks and their tensor bytes
    md = safe_load_dcp_metadata(out / "release" / ".metadata")
    assert entry["tensors"] == len([k for k in md.storage_data if k.offset is not None])
    framing = (out / "release" / entry["path"]).stat().st_size - entry["bytes"]
    assert 0 < framing < 4096 * len(md.storage_data)
    tokens = torch.randint(0, spec.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))
    res = run_mcore(spec, 1, _load_dist, (str(out / "release"), tokens), ep=2)
    got, want = res[0][..., : spec.vocab_size], hf_logits(hf, tokens)
    err = rel(got, want)
    print(f"qwen3_moe: written TP=2 EP=1, loaded TP=1 EP=2: rel err {err:.2e}")
    assert err <= 1e-4
    assert torch.equal(got.argmax(-1), want.argmax(-1))
