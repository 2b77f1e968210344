"""An MoE MTP layer's experts move one parameter at a time: memory is bounded by one expert, not by the MTP layer.

The final unit holds the MTP layers (megatron-core's `mtp.layers.K`); its routed experts (DeepSeek-V3 671B: 256 of
44 MB in bf16) reach the writer parameter by parameter. Measured as `test_moe_memory.py` measures a decoder layer:
in a fresh process per model, each verb after a warm-up run and a reset of the peak, peak RSS (VmHWM) minus the
RSS before the verb, for a DeepSeek-V3-style model (one MoE layer, one MoE MTP layer) of 8 and of 32 experts of the
same width (6.3 MB each in fp32): megatron-to-hf from EP=2 rank files and from a torch_dist copy, hf-to-megatron to
EP=2 and a reshard to EP=4. Holding the MTP layer's experts at once would cost ~150 MB more at 32 experts than at
8. Still whole: a torch_dist output and `--with-optimizer` (whole units with their states).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mconvert.convert.verbs import reshard
from mconvert.convert.megatron.writer import megatron_writer
from mconvert.mappings.families import preset

pytestmark = pytest.mark.slow
H, F = 256, 2048
EXPERT_BYTES = 3 * H * F * 4  # gate, up [F, H] and down [H, F] in fp32: 6.3 MB
SLACK = 32 << 20  # interpreter, allocator and page-cache noise between two runs of one verb

PROBE = r"""
import json, sys, psutil
from pathlib import Path
from mconvert.convert import driver, verbs
from mconvert.io import tuning
tuning.apply()
mg, warm, out = sys.argv[1:4]
VERBS = {
    "megatron-to-hf": ("{mg}", lambda s, o: verbs.megatron_to_hf(s, o, max_shard_size="8MB")),
    "hf-to-megatron": ("{out}/megatron-to-hf", lambda s, o: verbs.hf_to_megatron(s, o, ep=2)),
    "reshard": ("{mg}", lambda s, o: verbs.reshard(s, o, tp=1, pp=1, ep=4)),
    "megatron-to-hf from torch_dist": ("{mg}.dist", lambda s, o: verbs.megatron_to_hf(s, o, max_shard_size="8MB")),
}
Path(out, "warm").mkdir()
for verb, (src, call) in VERBS.items():
    call(src.format(mg=warm, out=out + "/warm"), f"{out}/warm/{verb}")
got = {}
for verb, (src, call) in VERBS.items():
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS now
    base = psutil.Process().memory_info().rss
    rep = call(src.format(mg=mg, out=out), f"{out}/{verb}")
    got[verb] = {"delta": driver.peak_rss_bytes() - base, "buffer": rep.get("hf_buffer_peak_bytes")}
print(json.dumps(got))
"""


def _spec(experts: int):
    return preset("tiny-deepseek-v3").replace(num_layers=1, moe_layer_freq=(1,), hidden_size=H,
                                              moe_ffn_hidden_size=F, moe_shared_expert_intermediate_size=F,
                                              num_experts=experts, vocab_size=512)


def _ckpt(root: Path, experts: int) -> Path:
    """An EP=2 checkpoint of one MoE layer and one MoE MTP layer, written one expert at a time, and its torch_dist
    copy beside it (`.dist`)."""
    spec = _spec(experts)
    w = megatron_writer(root, spec, tp=1, pp=1, ep=2)
    g = torch.Generator().manual_seed(experts)
    for unit in spec.units(split_experts=True):
        w.add(unit, {d.name: torch.randn(d.shape, generator=g) * 0.02 for d in spec.unit_params(unit)})
    w.close()
    reshard(root, root.with_name(root.name + ".dist"), tp=1, pp=1, ep=1, format="torch_dist")
    return root


def _probe(mg: Path, warm: Path, out: Path) -> dict:
    out.mkdir()
    r = subprocess.run([sys.executable, "-c", PROBE, str(mg), str(warm), str(out)], capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(900)
def test_an_moe_mtp_layer_moves_one_expert_at_a_time(tmp_path: Path) -> None:
    spec32 = _spec(32)
    assert sum(math.prod(d.shape) for d in spec32.expert_params(0, 0)) * 4 == EXPERT_BYTES
    mtp32 = sum(math.prod(d.shape) for d in spec32.mtp_params(0)) * 4
    warm = _ckpt(tmp_path / "warm", 8)
    deltas: dict[str, dict[int, int]] = {}
    for experts in (8, 32):
        got = _probe(_ckpt(tmp_path / f"mg{experts}", experts), warm, tmp_path / f"out{experts}")
        for verb in ("megatron-to-hf", "megatron-to-hf from torch_dist"):  # the HF writer held one parameter
            assert got[verb]["buffer"] <= 2 * H * F * 4, (verb, got[verb])
        for verb, r in got.items():
            deltas.setdefault(verb, {})[experts] = r["delta"]
    print(f"\npeak RSS over baseline (MB), 8 vs 32 experts of 6.3 MB (32-expert MTP layer {mtp32 / 1e6:.0f} MB): "
          + ", ".join(f"{v} {d[8] / 1e6:.1f} vs {d[32] / 1e6:.1f}" for v, d in deltas.items()))
    for verb, d in deltas.items():  # the MTP layer held whole would add 24 experts (151 MB) here
        assert d[32] - d[8] < EXPERT_BYTES + SLACK, (verb, d)
