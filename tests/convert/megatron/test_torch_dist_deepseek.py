"""torch_dist checkpoints of the DeepSeek-V3 architecture (MLA, sigmoid router with expert bias, shared experts, a
dense first layer by a `moe_layer_freq` list), proven against megatron-core 0.16.1's own `dist_checkpointing.save`:
with a `moe_layer_freq` list megatron-core keys layers one by one (`decoder.layers.<N>.…`, the routed experts
stacked over experts only) and keeps MLA's norms under their own names.

- our torch -> torch_dist reshard of megatron-core's legacy save has the `.metadata` of megatron-core's
  `dist_checkpointing.save` of the same model (keys, shapes, chunk boxes, `_extra_state` entries) and its values;
- megatron-core's own torch_dist save converts to the HF bytes its legacy save converts to, and transformers'
  logits of them are megatron-core's;
- torch_dist -> torch gives back the legacy rank files' tensors (by name: the MLA linears come in ModelSpec's
  order, not megatron-core's registration order).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from mcore_ref import McoreContext, perturb, run_mcore, save_checkpoints
from safetensors.torch import load_file
from test_torch_dist_write import _dcp_read_all, _summary

from mconvert.convert.verbs import megatron_to_hf, reshard
from mconvert.io.safeload import safe_load
from mconvert.convert.megatron.layout import rank_file
from mconvert.mappings.families import preset

pytestmark = pytest.mark.slow
ITERATION = 5
TP = 2
SPEC = preset("tiny-deepseek-v3").replace(mtp_num_layers=None)  # layers: dense, MoE, MoE


def _save_both(ctx: McoreContext, root: str, tokens: torch.Tensor) -> torch.Tensor:
    """Per rank: weights off their init (and a non-zero expert bias), the legacy rank file and megatron-core's
    torch_dist save of the same model; the logits."""
    perturb(ctx)
    for name, buf in ctx.model.named_buffers():
        if name.endswith("expert_bias"):
            buf.copy_(0.3 * torch.arange(buf.numel(), dtype=buf.dtype).remainder(5))
    save_checkpoints(ctx, root, ITERATION, torch_dist=True)
    return ctx.logits(tokens)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, torch.Tensor, torch.Tensor]:
    root = tmp_path_factory.mktemp("mcore_ds") / "ckpt"
    tokens = torch.randint(0, SPEC.vocab_size, (2, 12), generator=torch.Generator().manual_seed(7))
    logits = run_mcore(SPEC, TP, _save_both, (str(root), tokens))[0][..., : SPEC.vocab_size]
    return root, tokens, logits


def test_torch_dist_of_a_moe_layer_freq_list_is_megatron_cores_save(saved, tmp_path):
    root, _, _ = saved
    out = tmp_path / "ours"
    reshard(root, out, tp=TP, pp=1, format="torch_dist")
    ours_dir, ref_dir = out / f"iter_{ITERATION:07d}", Path(str(root) + "_dist") / f"iter_{ITERATION:07d}"
    ours, ref = _summary(ours_dir), _summary(ref_dir)
    assert "decoder.layers.1.mlp.experts.experts.linear_fc1.weight" in ref  # per layer, experts stacked
    assert "decoder.layers.0.self_attention.linear_q_down_proj.weight" in ref
    assert sorted(set(ours) ^ set(ref)) == []
    assert ours == ref
    a, b = _dcp_read_all(ours_dir), _dcp_read_all(ref_dir)
    for k in b:
        assert (torch.equal(a[k], b[k]) if isinstance(b[k], torch.Tensor) else a[k] == b[k]), k


def test_megatron_cores_torch_dist_save_converts_to_the_same_hf(saved, tmp_path):
    from transformers import AutoModelForCausalLM

    root, tokens, ref = saved
    megatron_to_hf(root, tmp_path / "legacy")
    megatron_to_hf(Path(str(root) + "_dist"), tmp_path / "dist")
    a, b = (load_file(tmp_path / d / "model.safetensors") for d in ("legacy", "dist"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(k.endswith("e_score_correction_bias") and a[k].abs().max() > 0 for k in a)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "dist", torch_dtype=torch.float32).eval()
    with torch.no_grad():
        got = model(tokens).logits.float()
    assert (got - ref).abs().max() <= 1e-4 * ref.abs().max()


def test_torch_dist_back_to_rank_files_gives_the_legacy_tensors(saved, tmp_path):
    root, _, _ = saved
    reshard(Path(str(root) + "_dist"), tmp_path / "torch", tp=TP, pp=1, format="torch")
    for t in range(TP):
        want = safe_load(rank_file(root, ITERATION, t, 0, 1))["model"]
        got = safe_load(rank_file(tmp_path / "torch", ITERATION, t, 0, 1))["model"]
        tensors = {k for k, v in want.items() if isinstance(v, torch.Tensor)}
        assert tensors == {k for k, v in got.items() if isinstance(v, torch.Tensor)}
        assert all(torch.equal(want[k], got[k]) for k in tensors)


def test_hf_to_torch_dist_and_back_gives_the_hf_bytes(saved, tmp_path):
    """HF -> torch_dist at TP=2 EP=2 (per-layer keys) -> HF: the same safetensors, byte for byte; a model with
    MTP layers is refused by name, nothing written."""
    from mconvert.convert.verbs import hf_to_megatron
    from mconvert.errors import MConvertError

    root, _, _ = saved
    megatron_to_hf(root, tmp_path / "hf")
    hf_to_megatron(tmp_path / "hf", tmp_path / "d", tp=2, ep=2, format="torch_dist")
    megatron_to_hf(tmp_path / "d", tmp_path / "back")
    a, b = (load_file(tmp_path / d / "model.safetensors") for d in ("hf", "back"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    from mconvert.convert.megatron.torch_dist_writer import TorchDistWriter

    with pytest.raises(MConvertError, match=r"multi-token prediction layers \(mtp_num_layers=1\)"):
        TorchDistWriter(tmp_path / "mtp", preset("tiny-deepseek-v3"), 1, 1)
