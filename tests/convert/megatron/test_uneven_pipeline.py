"""Uneven pipeline stages (Megatron-LM's --decoder-first/last-pipeline-num-layers, --account-for-embedding/loss-in-
pipeline-split, --pipeline-model-parallel-layout): which global layer each stage holds is megatron-core 0.16.1's own
answer (`get_transformer_layer_offset`, `get_num_layers_to_build`, `PipelineParallelLayerLayout`); a trainer
checkpoint at an uneven split converts to the HF bytes its even-PP reshard converts to; inconsistent values are
one line."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

import mconvert.trainer.train as train_mod
from mconvert.convert.verbs import hf_to_megatron, megatron_to_hf, reshard
from mconvert.io.safeload import safe_load
from mconvert.layouts.megatron import PipelineSplit
from mconvert.errors import MConvertError
from safety_common import run_cli

# (num_layers, pp, vpp, first, last, embedding_in_split, loss_in_split)
SPLITS = [
    (61, 8, None, 5, 8, False, False),
    (61, 16, None, 1, None, False, False),
    (61, 4, None, None, 1, False, False),
    (62, 8, 2, 6, 8, False, False),
    (8, 2, 2, None, None, False, False),
    (14, 4, None, None, None, True, True),
    (15, 4, None, None, None, True, False),
    (30, 4, 2, None, None, True, True),
]
LAYOUTS = [  # (num_layers, pp, layout, mtp_num_layers)
    (61, 16, "Et*3|(tt|)*29,|mL", 1),
    (61, 8, "Et*5|(t*8|)*6,t*8L", None),
    (10, 2, "Et|ttt|tttt|ttL", None),
    (4, 2, "E|tt|tt|L", None),
]


def _mcore_config(num_layers, pp, vpp, first=None, last=None, emb=False, loss=False, layout=None, mtp=None):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=num_layers, hidden_size=8, num_attention_heads=2,
                             pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp,
                             num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last,
                             account_for_embedding_in_pipeline_split=emb, account_for_loss_in_pipeline_split=loss,
                             pipeline_model_parallel_layout=layout, mtp_num_layers=mtp,
                             pipeline_dtype=torch.float32)


def _mcore_layers(cfg, pp: int, vpp: int | None, monkeypatch) -> dict[tuple[int, int], list[int]]:
    """(pp_rank, chunk) -> the global layers megatron-core builds there."""
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    out = {}
    for p in range(pp):
        monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_rank", lambda p=p: p)
        monkeypatch.setattr(parallel_state, "get_virtual_pipeline_model_parallel_world_size", lambda: vpp)
        for c in range(vpp or 1):
            stage = c if vpp else None
            start = get_transformer_layer_offset(cfg, vp_stage=stage, pp_rank=p)
            out[(p, c)] = list(range(start, start + get_num_layers_to_build(cfg, vp_stage=stage, pp_rank=p)))
    return out


def _ours(split: PipelineSplit) -> dict[tuple[int, int], list[int]]:
    return {(p, c): list(r) for p in range(split.pp) for c, r in enumerate(split.stage_layers(p))}


@pytest.mark.parametrize("case", SPLITS, ids=lambda c: "-".join(map(str, c)))
def test_first_last_and_account_for_splits_place_layers_as_megatron_core(case, monkeypatch):
    layers, pp, vpp, first, last, emb, loss = case
    cfg = _mcore_config(layers, pp, vpp, first, last, emb, loss)
    split = PipelineSplit.make(layers, pp, vpp, first, last, None, emb, loss)
    assert _ours(split) == _mcore_layers(cfg, pp, vpp, monkeypatch)
    assert sum(map(len, _ours(split).values())) == layers
    for g in range(layers):  # layer_location inverts stage_layers
        p, c, i = split.layer_location(g)
        assert split.stage_layers(p)[c][i] == g


@pytest.mark.parametrize("case", LAYOUTS, ids=lambda c: c[2])
def test_layout_strings_place_layers_as_megatron_core(case, monkeypatch):
    layers, pp, layout, mtp = case
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    parsed = PipelineParallelLayerLayout(layout, pp)
    vpp = parsed.virtual_pipeline_model_parallel_size
    parsed.validate_layer_layout(layers, mtp)
    cfg = _mcore_config(layers, pp, vpp if vpp > 1 else None, layout=layout, mtp=mtp)
    split = PipelineSplit.make(layers, pp, vpp if vpp > 1 else None, layout=layout, mtp_num_layers=mtp)
    assert _ours(split) == _mcore_layers(cfg, pp, vpp if vpp > 1 else None, monkeypatch)


@pytest.mark.parametrize("pp, kw, words", [
    (8, dict(first=5, last=7), "do not divide evenly"),
    (2, dict(first=70), "add up to num_layers"),
    (2, dict(first=5, layout="Et*5|t*56L"), "one way of splitting"),
    (2, dict(first=4, embedding_in_split=True), "refuses the pair"),
    (2, dict(layout="Et*59|L"), "59 decoder layers"),
    (2, dict(layout="Etx|t*60L"), "unknown layer letter"),
    (2, dict(layout="t*61|EL"), "embedding (E) comes once, first"),
    (2, dict(layout="Et*30|t*31L", vpp=2), "VPP=2"),
    (4, dict(first=5, last=8, vpp=2), "do not divide into VPP=2 chunks"),
])
def test_inconsistent_split_is_one_line(pp, kw, words):
    vpp = kw.pop("vpp", None)
    with pytest.raises(MConvertError) as e:
        PipelineSplit.make(61, pp, vpp, **kw)
    assert words in str(e.value) and "\n" not in str(e.value)


# ---- trainer -> HF -----------------------------------------------------------------------------------------------
RUN = dict(micro_batch_size=2, global_batch_size=4, seq_length=32, quiet=True, seed=7, preset="tiny-llama",
           num_layers=5)


def _hf_bytes(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.glob("*.safetensors"))}


@pytest.fixture(scope="module")
def uneven(tmp_path_factory) -> Path:
    """tiny-llama with 5 layers at PP=3: 1 + 2 + 2 (megatron-core's first-stage rule), two steps."""
    root = tmp_path_factory.mktemp("uneven") / "ckpt"
    train_mod.train(train_mod.TrainConfig(tp=1, pp=3, steps=2, save=str(root), force=True,
                                          decoder_first_pipeline_num_layers=1, **RUN))
    return root


def test_trainer_uneven_split_converts_like_its_even_reshard(uneven, tmp_path):
    rank_layers = {}
    for p in range(3):
        st = safe_load(uneven / "iter_0000002" / f"mp_rank_00_{p:03d}" / "model_optim_rng.pt")
        assert st["args"].decoder_first_pipeline_num_layers == 1
        rank_layers[p] = sorted({int(k.split(".")[2]) for k in st["model"] if k.startswith("decoder.layers.")})
    assert rank_layers == {0: [0], 1: [0, 1], 2: [0, 1]}  # local indices: 1 + 2 + 2
    megatron_to_hf(uneven, tmp_path / "hf-uneven")
    reshard(uneven, tmp_path / "even", tp=1, pp=1, with_optimizer=True)
    megatron_to_hf(tmp_path / "even", tmp_path / "hf-even")
    assert _hf_bytes(tmp_path / "hf-uneven") == _hf_bytes(tmp_path / "hf-even")
    # and back: the even checkpoint resharded onto the first/last split is the trainer's, byte for byte
    reshard(tmp_path / "even", tmp_path / "back", tp=1, pp=3, with_optimizer=True,
            pipeline={"decoder_first_pipeline_num_layers": 1})
    for p in range(3):
        a = safe_load(uneven / "iter_0000002" / f"mp_rank_00_{p:03d}" / "model_optim_rng.pt")
        b = safe_load(tmp_path / "back" / "iter_0000002" / f"mp_rank_00_{p:03d}" / "model_optim_rng.pt")
        assert a["model"].keys() == b["model"].keys()
        assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"] if isinstance(a["model"][k],
                                                                                               torch.Tensor))


def test_trainer_init_at_uneven_split_is_the_even_model(tmp_path):
    """The trainer's layers are placed by the split: its init (keyed by global name) converts to the PP=1 bytes."""
    for name, pp, kw in (("pp1", 1, {}), ("layout", 2, {"pipeline_model_parallel_layout": "Etttt|tL"})):
        train_mod.train(train_mod.TrainConfig(tp=1, pp=pp, steps=0, save=str(tmp_path / name), force=True,
                                              **kw, **RUN))
        megatron_to_hf(tmp_path / name, tmp_path / f"hf-{name}")
    assert _hf_bytes(tmp_path / "hf-pp1") == _hf_bytes(tmp_path / "hf-layout")


def test_hf_to_megatron_writes_megatron_args_for_the_split(uneven, tmp_path, capsys):
    megatron_to_hf(uneven, tmp_path / "hf")
    code, out, err = run_cli(["hf-to-megatron", tmp_path / "hf", tmp_path / "m", "--pp", "2",
                              "--pipeline-model-parallel-layout", "Et|ttttL", "--json"], capsys)
    assert code == 0, err
    a = safe_load(tmp_path / "m" / "release" / "mp_rank_00_001" / "model_optim_rng.pt")
    assert a["args"].pipeline_model_parallel_layout == "Et|ttttL"
    assert sorted({k.split(".")[2] for k in a["model"] if k.startswith("decoder.layers.")}) == ["0", "1", "2", "3"]
    # torch_dist keeps the split in its args; back to HF, the same bytes
    hf_to_megatron(tmp_path / "hf", tmp_path / "dist", pp=2, format="torch_dist",
                   pipeline={"decoder_last_pipeline_num_layers": 4})
    common = safe_load(tmp_path / "dist" / "release" / "common.pt")
    assert common["args"].decoder_last_pipeline_num_layers == 4
    reshard(tmp_path / "dist", tmp_path / "dist-torch", tp=1, pp=2, format="torch")  # keeps the source's split
    st = safe_load(tmp_path / "dist-torch" / "release" / "mp_rank_00_000" / "model_optim_rng.pt")
    assert {k.split(".")[2] for k in st["model"] if k.startswith("decoder.layers.")} == {"0"}
    megatron_to_hf(tmp_path / "dist-torch", tmp_path / "hf2")
    assert _hf_bytes(tmp_path / "hf") == _hf_bytes(tmp_path / "hf2")
    code, _, err = run_cli(["hf-to-megatron", tmp_path / "hf", tmp_path / "bad", "--pp", "2",
                            "--decoder-first-pipeline-num-layers", "9"], capsys)
    assert code == 1 and err.count("\n") == 1 and "add up to num_layers" in err
