"""An MoE MTP layer's experts move one parameter at a time: memory is bounded by one expert, not by the MTP layer.

The final unit holds the MTP layers (megatron-core's `mtp.layers.K`); its routed experts (DeepSeek-V3 671B: 256 of
44 MB in bf16) reach the writer parameter by parameter, with their optimizer states where they have some.
Measured as `test_moe_memory.py` measures a decoder layer (`memory_probe`), for a DeepSeek-V3-style model (one MoE
layer, one MoE MTP layer) of 8 and of 32 experts of the same width (6.3 MB each in fp32): megatron-to-hf from EP=2
rank files and from a torch_dist copy, hf-to-megatron to EP=2 rank files and to torch_dist, reshards to EP=4 rank
files, to torch_dist and from torch_dist (both ways), and `--with-optimizer` from rank files with Adam states and
from a torch_dist checkpoint with megatron-core's distributed-optimizer states. Holding the MTP layer's experts at
once would cost ~150 MB more at 32 experts than at 8 (three times that with their states).
"""

from __future__ import annotations

import inspect
import math
import shutil
from pathlib import Path

import pytest
import torch

from mconvert.convert.verbs import reshard
from mconvert.convert.megatron.torch_dist_writer import TorchDistWriter
from mconvert.convert.megatron.writer import megatron_writer
from mconvert.io.hashing import HashingFile
from mconvert.mappings.families import preset
from mconvert.spec import is_buffer
from memory_probe import peak_over_baseline
from safety_common import add_adam_states

pytestmark = pytest.mark.slow
H, F = 256, 2048
EXPERT_BYTES = 3 * H * F * 4  # gate, up [F, H] and down [H, F] in fp32: 6.3 MB
SLACK = 32 << 20  # interpreter, allocator and page-cache noise between two runs of one verb
TORCH_DIST_QUEUE = inspect.signature(HashingFile).parameters["max_pending"].default

VERBS = r"""
VERBS = {  # verb -> (its source, the call); megatron-to-hf first: it writes hf-to-megatron's source
    "megatron-to-hf": ("{mg}", lambda s, o, **kw: verbs.megatron_to_hf(s, o, max_shard_size="8MB", **kw)),
    "hf-to-megatron": ("{out}/megatron-to-hf", lambda s, o, **kw: verbs.hf_to_megatron(s, o, ep=2, **kw)),
    "hf-to-megatron -> torch_dist": ("{out}/megatron-to-hf", lambda s, o, **kw: verbs.hf_to_megatron(
        s, o, format="torch_dist", **kw)),
    "reshard": ("{mg}", lambda s, o, **kw: verbs.reshard(s, o, tp=1, pp=1, ep=4, **kw)),
    "reshard torch -> torch_dist": ("{mg}", lambda s, o, **kw: verbs.reshard(s, o, tp=1, pp=1, ep=1,
                                                                             format="torch_dist", **kw)),
    "reshard torch_dist -> torch": ("{mg}.dist", lambda s, o, **kw: verbs.reshard(s, o, tp=1, pp=1, ep=4,
                                                                                  format="torch", **kw)),
    "reshard torch_dist -> torch_dist": ("{mg}.dist", lambda s, o, **kw: verbs.reshard(s, o, tp=1, pp=1, ep=2,
                                                                                       **kw)),
    "megatron-to-hf from torch_dist": ("{mg}.dist", lambda s, o, **kw: verbs.megatron_to_hf(s, o, max_shard_size="8MB",
                                                                                           **kw)),
    "reshard --with-optimizer": ("{mg}.adam", lambda s, o, **kw: verbs.reshard(s, o, tp=1, pp=1, ep=4,
                                                                                with_optimizer=True, **kw)),
    "reshard --with-optimizer torch_dist -> torch_dist": ("{mg}.states", lambda s, o, **kw: verbs.reshard(
        s, o, tp=1, pp=1, ep=2, with_optimizer=True, **kw)),
}
"""


def _spec(experts: int):
    return preset("tiny-deepseek-v3").replace(num_layers=1, moe_layer_freq=(1,), hidden_size=H,
                                              moe_ffn_hidden_size=F, moe_shared_expert_intermediate_size=F,
                                              num_experts=experts, vocab_size=512)


def _ckpt(root: Path, experts: int) -> Path:
    """An EP=2 checkpoint of one MoE layer and one MoE MTP layer, written one expert at a time; beside it
    (`.dist`) its torch_dist copy, (`.adam`) a copy with Adam states in its rank files and (`.states`) a
    torch_dist checkpoint of the same weights with megatron-core's distributed-optimizer states."""
    spec = _spec(experts)
    w = megatron_writer(root, spec, tp=1, pp=1, ep=2)
    states = TorchDistWriter(root.with_name(root.name + ".states"), spec, tp=1, pp=1, with_states=True,
                             top_level={"optimizer": {"param_state_sharding_type": "fully_reshardable"}})
    g = torch.Generator().manual_seed(experts)
    for unit in spec.units(split_experts=True):
        tensors = {d.name: torch.randn(d.shape, generator=g) * 0.02 for d in spec.unit_params(unit)}
        w.add(unit, tensors)
        states.add(unit, tensors, {n: {"param": t, "exp_avg": t / 2, "exp_avg_sq": t ** 2}
                                   for n, t in tensors.items() if not is_buffer(n)})  # no state for a buffer
    w.close()
    states.close()
    reshard(root, root.with_name(root.name + ".dist"), tp=1, pp=1, ep=1, format="torch_dist")
    shutil.copytree(root, root.with_name(root.name + ".adam"))
    add_adam_states(root.with_name(root.name + ".adam"))
    return root


@pytest.mark.timeout(900)
def test_an_moe_mtp_layer_moves_one_expert_at_a_time(tmp_path: Path) -> None:
    spec32 = _spec(32)
    assert sum(math.prod(d.shape) for d in spec32.expert_params(0, 0)) * 4 == EXPERT_BYTES
    mtp32 = sum(math.prod(d.shape) for d in spec32.mtp_params(0)) * 4
    warm = _ckpt(tmp_path / "warm", 8)
    deltas: dict[str, dict[int, int]] = {}
    for experts in (8, 32):
        mg = _ckpt(tmp_path / f"mg{experts}", experts)
        got = peak_over_baseline(VERBS, mg, warm, tmp_path / f"out{experts}")
        for verb in ("megatron-to-hf", "megatron-to-hf from torch_dist"):  # the HF writer held one parameter
            assert got[verb]["buffer"] <= 2 * H * F * 4, (verb, got[verb])
        for verb, r in got.items():
            deltas.setdefault(verb, {})[experts] = r["delta"]
        for p in (mg, *(mg.with_name(mg.name + s) for s in (".dist", ".adam", ".states")), tmp_path / f"out{experts}"):
            shutil.rmtree(p)  # GBs at 32 experts
    print(f"\npeak RSS over baseline (MB), 8 vs 32 experts of 6.3 MB (32-expert MTP layer {mtp32 / 1e6:.0f} MB): "
          + ", ".join(f"{v} {d[8] / 1e6:.1f} vs {d[32] / 1e6:.1f}" for v, d in deltas.items()))
    for verb, d in deltas.items():  # the MTP layer held whole would add 24 experts (151 MB, 453 MB with states)
        # a torch_dist output is one file behind one HashingFile queue: how full it gets depends on how fast the
        # disk takes the bytes, and the 8-expert file is too small to fill it
        queue = TORCH_DIST_QUEUE if verb.endswith("-> torch_dist") else 0
        assert d[32] - d[8] < EXPERT_BYTES + SLACK + queue, (verb, d)
