"""megatron-to-ft and megatron-to-trtllm on torchrun: two processes write exactly the bytes one process writes
(every file, the manifest included), each process writes only the files it owns and reads only the units
they need, and a failing process leaves no output at all."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

from mconvert.io import world as world_state
from mconvert.io.atomic import MANIFEST, check_manifest
from mconvert.convert.scaleout import World
from safety_common import base
from test_speed_torchrun import _torchrun, _tree, assert_a_failing_rank_leaves_no_output

pytestmark = pytest.mark.slow

LAYERS = 2  # units embedding, 0, 1, final: with two processes the tied head's owner is not the embedding's


@pytest.fixture(scope="module")
def mha_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tied MHA llama (FT's [llama] loader has no GQA and reads the head as a copy) saved by transformers,
    as a Megatron TP=2 PP=2 checkpoint."""
    import transformers

    from mconvert.convert.verbs import hf_to_megatron

    d = tmp_path_factory.mktemp("mha")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                                   num_attention_heads=4, num_key_value_heads=4, head_dim=16, vocab_size=100,
                                   max_position_embeddings=64, tie_word_embeddings=True)
    transformers.LlamaForCausalLM(cfg).save_pretrained(d / "hf")
    hf_to_megatron(d / "hf", d / "mg", tp=2, pp=2)
    return d / "mg"


JOBS = {  # output -> (verb, source, options), the same in one process and on torchrun
    "ft": ("ft", "mha", dict(infer_tp=2)),
    "trt": ("trt", "gqa", dict(tp=4)),
    "trt1": ("trt", "gqa", dict(tp=1)),  # one rank file: process 1 has nothing to write
}


def _run(verb: str, src: Path, out: Path, opts: dict) -> None:
    from mconvert.convert.verbs import megatron_to_ft
    from mconvert.convert.verbs import megatron_to_trtllm

    if verb == "ft":
        megatron_to_ft(src, out, **opts)
    else:
        megatron_to_trtllm(src, out, **opts)


def _src(which: str, mha: Path) -> Path:
    return mha if which == "mha" else base()["ckpt"]


@pytest.fixture(scope="module")
def one_process(mha_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("one")
    for name, (verb, which, opts) in JOBS.items():
        _run(verb, _src(which, mha_ckpt), d / name, opts)
    return {name: d / name for name in JOBS}


_SCRIPT = """
import sys
from mconvert.convert.verbs import megatron_to_ft
from mconvert.convert.verbs import megatron_to_trtllm
mha, gqa, out = sys.argv[1:]
megatron_to_ft(mha, out + "/ft", infer_tp=2)
megatron_to_trtllm(gqa, out + "/trt", tp=4)
megatron_to_trtllm(gqa, out + "/trt1", tp=1)
"""


@pytest.mark.timeout(600)
def test_two_processes_write_the_one_process_bytes(one_process: dict[str, Path], mha_ckpt: Path,
                                                   tmp_path: Path) -> None:
    """megatron-to-ft and megatron-to-trtllm (TP 4 and 1) in one torchrun job of two processes."""
    script = tmp_path / "job.py"
    script.write_text(_SCRIPT)
    (tmp_path / "out").mkdir()
    r = _torchrun([script, mha_ckpt, base()["ckpt"], tmp_path / "out"], module=False)
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(os.listdir(tmp_path / "out")) == sorted(JOBS)  # no temporary directory or status left
    for name in JOBS:
        got, want = _tree(tmp_path / "out" / name), _tree(one_process[name])
        assert sorted(got) == sorted(want), name
        assert [k for k in want if got[k] != want[k]] == [], name  # manifest included
        assert check_manifest(tmp_path / "out" / name) == []


class _Recording:
    """A source that records which units the driver reads."""

    def __init__(self, src) -> None:
        self.src, self.read = src, []

    def __getattr__(self, name: str):
        return getattr(self.src, name)

    def read_mcore(self, unit):
        self.read.append(unit)
        return self.src.read_mcore(unit)

    def read_mcore_parts(self, unit):  # a writer that takes a layer in parts reads it so
        self.read.append(unit)
        return self.src.read_mcore_parts(unit)

    def mcore_part_tasks(self, unit):  # or so, every unit on one pool (`base.parts_ahead`)
        self.read.append(unit)
        return self.src.mcore_part_tasks(unit)


def _ft_unit(name: str) -> int:
    """The unit index (embedding 0, layer N -> N + 1, final) of an FT file, from FT's own file names."""
    m = re.match(r"model\.layers\.(\d+)\.", name)
    if m:
        return int(m.group(1)) + 1
    return 0 if name.startswith("model.wte") else LAYERS + 1


@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_writes_only_its_own_files(one_process: dict[str, Path], mha_ckpt: Path, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch, rank: int) -> None:
    """One process's part alone (its writer driven as on torchrun): the files it owns, byte-identical to the
    one-process files, rank 0 alone writing config.ini / config.json; it reads only the units they need."""
    from mconvert.convert.driver import drive
    from mconvert.convert.deploy.fastertransformer import FTWriter
    from mconvert.convert.deploy.fastertransformer import prepare as ft_prepare
    from mconvert.convert.sources import open_source
    from mconvert.convert.deploy.trtllm import TrtllmWriter
    from mconvert.convert.deploy.trtllm import prepare as trtllm_prepare

    monkeypatch.setattr(world_state, "_WORLD", World(rank, 2))
    src = _Recording(open_source(mha_ckpt))
    (tmp_path / "ft").mkdir()
    drive(src, FTWriter(tmp_path / "ft", ft_prepare(src.spec, 2, source=str(src.path))))
    src.close()
    want = {k: v for k, v in _tree(one_process["ft"]).items() if k != MANIFEST}
    got = _tree(tmp_path / "ft")
    mine = [k for k in want if k.endswith(".bin") and _ft_unit(k.split("/")[1]) % 2 == rank]
    assert sorted(got) == sorted(mine + (["2-gpu/config.ini"] if rank == 0 else []))
    assert all(got[k] == want[k] for k in got)
    # rank 0: embedding and layer 1; rank 1: layer 0 and final, whose tied head copies the embedding
    assert src.read == (["embedding", 1] if rank == 0 else ["embedding", 0, "final"])

    for name, tp in (("trt", 4), ("trt1", 1)):
        src = _Recording(open_source(base()["ckpt"]))
        (tmp_path / name).mkdir()
        drive(src, TrtllmWriter(tmp_path / name, trtllm_prepare(src.spec, tp, source=str(src.path))))
        src.close()
        want = {k: v for k, v in _tree(one_process[name]).items() if k != MANIFEST}
        got = _tree(tmp_path / name)
        mine = [f"rank{i}.safetensors" for i in range(tp) if i % 2 == rank]
        assert sorted(got) == sorted(mine + (["config.json"] if rank == 0 else []))
        assert all(got[k] == want[k] for k in got)
        # every unit, in the order their tensors lie in the rank files (lm_head first, the vocab embedding last
        # in this untied model), so the files are written and hashed front to back
        assert not src.spec.tie_embeddings
        assert src.read == ([] if not mine else ["final", *range(src.spec.num_layers), "embedding"])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("verb,opts", [("megatron-to-trtllm", ["--tp", "2"]), ("megatron-to-ft", ["--infer-tp", "2"])])
def test_a_failing_rank_leaves_no_output(mha_ckpt: Path, tmp_path: Path, verb: str, opts: list[str]) -> None:
    """Process 1 alone checks the CRC-32 of some input files; one of them is corrupt: process 1 fails, and the
    whole job with it."""
    assert_a_failing_rank_leaves_no_output(mha_ckpt, tmp_path, [verb, "{src}", "{out}", *opts])


def test_plan_on_nodes_shares_out_ft_units() -> None:
    """The torchrun estimate of FT output: one file group per unit (embedding, each layer, final), holding all
    of the written bytes; more machines never take longer."""
    from mconvert.layouts.estimate import estimate, scaleout_estimate
    from mconvert.mappings.families import preset

    spec = preset("gpt2-1b")
    bw = {"copy_bytes_per_s": 1e9, "ratio_to_cp": {"megatron-to-ft": 2.0}, "base_rss_bytes": 0}
    one = estimate(spec, "ft", tp=2, target_tp=2, bandwidth=bw)
    est = scaleout_estimate(estimate(spec, "ft", tp=2, target_tp=2, bandwidth=bw), 1, 4, start_seconds=0)
    assert est.scaleout["file_groups"] == spec.num_layers + 2
    layer = sum(int(torch.Size(d.shape).numel()) for d in spec.layer_params(0)) * 4  # fp32 bytes of one layer
    assert est.scaleout["largest_rank_write_bytes"] < one.write_bytes / 2
    assert est.scaleout["largest_rank_write_bytes"] >= 4 * layer  # 18 units over 4 processes: 4 or 5 layers each
    times = [scaleout_estimate(estimate(spec, "ft", tp=2, target_tp=2, bandwidth=bw), n, 1, start_seconds=0)
             .scaleout["expected_seconds"] for n in (1, 2, 4, 8)]
    assert times == sorted(times, reverse=True) and times[-1] < times[0] / 2
