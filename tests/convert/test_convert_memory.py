"""Streaming: megatron-to-hf's peak memory does not grow with depth (one layer's shards + the output buffer).

Measured in a fresh process: peak RSS (VmHWM) minus the RSS after imports, for a 4-layer and a 12-layer
model with 12.6 MB layers (TP=2, PP=2). Holding the whole model would cost ~100 MB more at depth 12."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mconvert.convert.base import units_of
from mconvert.convert.megatron.writer import MegatronWriter
from mconvert.spec import ModelSpec

pytestmark = pytest.mark.slow
H = 512
LAYER_BYTES = 12 * H * H * 4

PROBE = r"""
import json, sys, psutil
from mconvert.convert.driver import peak_rss_bytes
from mconvert.convert.verbs import megatron_to_hf
from mconvert.io import tuning
tuning.apply()  # as the mconvert command does before a conversion (heap threshold, threads, gc)
base = psutil.Process().memory_info().rss
rep = megatron_to_hf(sys.argv[1], sys.argv[2], max_shard_size="8MB")
peak = peak_rss_bytes()  # VmHWM: ru_maxrss would carry the parent's peak across fork+exec
print(json.dumps({"base": base, "peak": peak, "delta": peak - base, "buffer": rep["hf_buffer_peak_bytes"]}))
"""


def _ckpt(root: Path, layers: int) -> None:
    spec = ModelSpec(family="gpt2", num_layers=layers, hidden_size=H, num_attention_heads=4, ffn_hidden_size=4 * H,
                     vocab_size=1000, max_position_embeddings=64, activation="gelu_new")
    w = MegatronWriter(root, spec, tp=2, pp=2)
    g = torch.Generator().manual_seed(0)
    for unit in units_of(spec):
        decls = {"embedding": spec.embedding_params(2), "final": spec.final_params(2)}.get(unit) or spec.layer_params(unit)
        w.add(unit, {d.name: torch.randn(d.shape, generator=g) for d in decls})
    w.close()


def _probe(ckpt: Path, out: Path) -> dict:
    r = subprocess.run([sys.executable, "-c", PROBE, str(ckpt), str(out)], capture_output=True, text=True, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_peak_memory_does_not_grow_with_depth(tmp_path):
    _ckpt(tmp_path / "l4", 4)
    _ckpt(tmp_path / "l12", 12)
    shallow = _probe(tmp_path / "l4", tmp_path / "h4")
    deep = _probe(tmp_path / "l12", tmp_path / "h12")
    print(f"\npeak RSS over baseline: 4 layers {shallow['delta'] / 1e6:.1f} MB, 12 layers {deep['delta'] / 1e6:.1f} MB "
          f"(layer {LAYER_BYTES / 1e6:.1f} MB, 12-layer model {12 * LAYER_BYTES / 1e6:.0f} MB)")
    assert deep["delta"] - shallow["delta"] < 2 * LAYER_BYTES
    assert deep["delta"] < 6 * LAYER_BYTES  # a few layers' worth, not the 12-layer model
