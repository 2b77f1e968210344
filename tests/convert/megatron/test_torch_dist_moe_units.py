"""A torch_dist MoE checkpoint moves one expert at a time, on both sides (TorchDistSource, TorchDistWriter):

- the source reads an expert unit as that expert's box of the stacked `mlp.experts.experts.*` tensors only;
- torch -> torch_dist -> torch gives back the source's rank files byte for byte, and megatron-core's own
  `dist_checkpointing.save` read back to rank files gives megatron-core's own legacy state dicts (key order
  and values): the order megatron-core strict-loads;
- torch_dist -> torch_dist, torch -> torch_dist and hf -> torch_dist write the same bytes at one TP, and the
  writer given whole layers or one expert at a time writes the same bytes.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from mconvert.convert.verbs import hf_to_megatron, megatron_to_hf, reshard
from mconvert.io.atomic import MANIFEST
from mconvert.io.safeload import safe_load
from mconvert.convert.megatron.writer import megatron_writer
from mconvert.convert.megatron.torch_dist import STACKED_EXPERTS, TorchDistSource
from mconvert.convert.megatron.torch_dist_writer import TorchDistWriter
from mconvert.errors import MConvertError
from mconvert.mappings.families import preset
from mconvert.spec import LayerPart, is_buffer

E = 4


def _spec(family: str = "tiny-mixtral"):
    return preset(family).replace(num_layers=2, hidden_size=64, ffn_hidden_size=96, num_experts=E,
                                  num_attention_heads=4, num_query_groups=2, vocab_size=128)


def _weights(spec) -> dict:
    g = torch.Generator().manual_seed(3)
    return {u: {d.name: torch.randn(d.shape, generator=g) * 0.02 for d in spec.unit_params(u)}
            for u in spec.units(split_experts=True)}


@pytest.fixture(scope="module", params=["tiny-mixtral", "tiny-qwen3-moe"])
def saved(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    """A TP=2 EP=2 torch checkpoint and its TP=1 torch_dist copy."""
    spec = _spec(request.param)
    root = tmp_path_factory.mktemp(request.param)
    w = megatron_writer(root / "mg", spec, tp=2, pp=1, ep=2)
    for unit, tensors in _weights(spec).items():
        w.add(unit, tensors)
    w.close()
    reshard(root / "mg", root / "td", tp=1, pp=1, ep=1, format="torch_dist")
    return spec, root


def _files(d: Path, pattern: str) -> dict[str, str]:
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.rglob(pattern)) if p.is_file()}


@pytest.mark.timeout(120)
def test_torch_dist_source_reads_one_expert_box_per_expert_unit(saved: tuple) -> None:
    spec, root = saved
    src = TorchDistSource(root / "td")
    assert src.units(True) == spec.units(split_experts=True)  # dense part, then one unit per expert
    boxes: list[tuple[str, tuple, tuple]] = []
    read_slice = src.read_slice
    src.read_slice = lambda key, off, size: (boxes.append((key, off, size)), read_slice(key, off, size))[1]
    whole = src.read_mcore(1)
    for unit in spec.layer_units(1):
        boxes.clear()
        got = src.read_mcore(unit)
        assert list(got) == [d.name for d in spec.unit_params(unit)]  # the unit's parameters, none more
        for name, t in got.items():
            assert torch.equal(t, whole[name]), name
        expert_boxes = [(off, size) for key, off, size in boxes if STACKED_EXPERTS.strip(".") in key]
        if unit.expert is None:
            assert expert_boxes == []  # the dense part touches no expert
        else:  # [layer, expert, ...] boxes of one layer and one expert each
            assert expert_boxes and all(off[:2] == (1, unit.expert) and size[:2] == (1, 1)
                                        for off, size in expert_boxes), expert_boxes
    with pytest.raises(MConvertError, match="expert 4 out of range"):
        src.read_mcore(LayerPart(0, E))


@pytest.mark.timeout(120)
def test_torch_to_torch_dist_and_back_gives_the_source_rank_files(saved: tuple, tmp_path: Path) -> None:
    _, root = saved
    reshard(root / "td", tmp_path / "back", tp=2, pp=1, ep=2, format="torch")
    want = _files(root / "mg", "*.pt")
    assert len(want) == 4 and _files(tmp_path / "back", "*.pt") == want


@pytest.mark.timeout(120)
def test_every_route_to_torch_dist_writes_the_same_bytes(saved: tuple, tmp_path: Path) -> None:
    _, root = saved
    reshard(root / "mg", tmp_path / "from_torch", tp=2, pp=1, ep=1, format="torch_dist")
    reshard(root / "td", tmp_path / "from_dist", tp=2, pp=1, ep=1, format="torch_dist")
    megatron_to_hf(root / "td", tmp_path / "hf")
    hf_to_megatron(tmp_path / "hf", tmp_path / "from_hf", tp=2, pp=1, ep=1, format="torch_dist")
    def data(d: Path) -> dict[str, str]:  # the tensors and their index (common.pt: each source's own args)
        return {**_files(d, "*.distcp"), **_files(d, ".metadata")}

    want = data(tmp_path / "from_torch")
    assert any(k.endswith(".distcp") for k in want) and any(k.endswith(".metadata") for k in want)
    for other in ("from_dist", "from_hf"):
        assert data(tmp_path / other) == want, other


@pytest.mark.timeout(120)
def test_torch_dist_writer_writes_whole_layers_and_expert_units_alike(tmp_path: Path) -> None:
    spec = _spec()
    weights = _weights(spec)
    for split in (False, True):
        w = TorchDistWriter(tmp_path / str(split), spec, tp=2, pp=1)
        for unit in spec.units(split_experts=split):
            parts = spec.layer_units(unit) if isinstance(unit, int) else [unit]
            w.add(unit, {n: t for p in parts for n, t in weights[p].items()})
        w.close()
    assert _files(tmp_path / "False", "*") == _files(tmp_path / "True", "*")


@pytest.mark.timeout(60)
def test_torch_dist_writer_refuses_a_part_twice_or_a_part_of_a_layer_given_whole(tmp_path: Path) -> None:
    spec = _spec()
    weights = _weights(spec)
    w = TorchDistWriter(tmp_path / "a", spec, tp=1, pp=1)
    w.add(LayerPart(0, 1), weights[LayerPart(0, 1)])
    with pytest.raises(MConvertError, match="arrived twice"):
        w.add(LayerPart(0, 1), weights[LayerPart(0, 1)])
    with pytest.raises(MConvertError, match="arrived twice"):
        w.add(0, {})  # layer 0 is arriving in parts
    w.add(1, {n: t for p in spec.layer_units(1) for n, t in weights[p].items()})
    with pytest.raises(MConvertError, match="arrived twice"):
        w.add(LayerPart(1, 0), weights[LayerPart(1, 0)])
    with pytest.raises(MConvertError, match="never arrived"):
        w.close()  # layer 0's other parts are missing
    w.abort()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_megatron_core_dist_save_to_rank_files_strict_loads_into_megatron_core(
        tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """megatron-core saved one Mixtral model as legacy rank files and with `dist_checkpointing.save` (EP=2):
    its torch_dist save, read one expert at a time, gives rank files with its legacy files' keys and values,
    each expert's fc1 and fc2 together in its SequentialMLP order, which megatron-core strict-loads and which
    reproduce its logits."""
    from mcore_ref import run_mcore
    from test_moe import ITERATION, _close, _load_rank_files
    from test_moe import _saved as _moe_saved

    spec, tokens, ref_logits, root = _moe_saved("mixtral", 1, 2, tmp_path_factory)
    back = tmp_path / "back"
    reshard(Path(str(root) + "_dist"), back, tp=1, pp=1, ep=2, format="torch")
    for ref in sorted((root / f"iter_{ITERATION:07d}").glob("mp_rank_*/model_optim_rng.pt")):
        want = safe_load(ref)["model"]
        got = safe_load(back / ref.relative_to(root))["model"]
        assert set(got) == set(want), ref
        assert all(v is None and got[k] is None or torch.equal(v, got[k]) for k, v in want.items()
                   if not k.endswith("_extra_state")), ref
        experts = [k for k in want if ".local_experts." in k]
        assert [k for k in got if ".local_experts." in k] == experts, ref  # expert by expert
    (back / MANIFEST).unlink()  # _load_rank_files reads `release`
    (back / f"iter_{ITERATION:07d}").rename(back / "release")
    (back / "latest_checkpointed_iteration.txt").write_text("release")
    results = run_mcore(spec, 1, _load_rank_files, (str(back), tokens), ep=2)
    assert _close(results[0][..., : spec.vocab_size], ref_logits)


@pytest.mark.timeout(120)
def test_expert_optimizer_states_move_with_their_expert_through_torch_dist(tmp_path: Path) -> None:
    """megatron-core's `fully_reshardable` states of every parameter, routed experts included: resharded
    torch_dist -> torch_dist with `--with-optimizer`, each expert's states come back at its own box."""
    spec = _spec()
    weights = _weights(spec)

    def states(t: torch.Tensor) -> dict:
        return {"param": t.double().float(), "exp_avg": t / 2, "exp_avg_sq": t ** 2}

    w = TorchDistWriter(tmp_path / "src", spec, tp=1, pp=1, with_states=True,
                        top_level={"optimizer": {"param_state_sharding_type": "fully_reshardable"}})
    for unit, tensors in weights.items():
        w.add(unit, tensors, {n: states(t) for n, t in tensors.items()})
    w.close()
    reshard(tmp_path / "src", tmp_path / "out", tp=2, pp=1, with_optimizer=True)
    out = TorchDistSource(tmp_path / "out")
    out.check_optimizer()
    for unit in (LayerPart(1, None), LayerPart(1, 2), LayerPart(0, E - 1)):
        got, st = out.read_unit(unit, with_optimizer=True)
        assert list(got) == list(weights[unit])
        for name, t in weights[unit].items():
            assert set(st[name]) == {"param", "exp_avg", "exp_avg_sq"}, name
            for k, v in states(t).items():
                assert torch.equal(st[name][k], v), (name, k)


@pytest.mark.timeout(120)
def test_an_moe_mtp_final_unit_streams_through_torch_dist_with_its_states(tmp_path: Path) -> None:
    """tiny-deepseek-v3 (MoE layers with an expert bias, an MoE MTP layer in the final unit): the writer given the
    final unit whole or one parameter at a time writes the same bytes; resharded torch_dist -> torch_dist with
    `--with-optimizer`, every parameter's states (an MTP expert's included) come back at its place, and the router's
    expert bias, a buffer megatron-core keeps no optimizer state for, is carried without one."""
    spec = preset("tiny-deepseek-v3")

    def states(t: torch.Tensor) -> dict:
        return {"param": t.double().float(), "exp_avg": t / 2, "exp_avg_sq": t ** 2}

    weights = _weights(spec)
    state_of = {u: {n: states(t) for n, t in ts.items() if not is_buffer(n)} for u, ts in weights.items()}
    for parts in (False, True):
        w = TorchDistWriter(tmp_path / f"src-{parts}", spec, tp=1, pp=1, with_states=True,
                            top_level={"optimizer": {"param_state_sharding_type": "fully_reshardable"}})
        for unit, tensors in weights.items():
            if parts and unit == "final":
                for name, t in tensors.items():
                    w.add(unit, {name: t}, {n: s for n, s in state_of[unit].items() if n == name}, complete=False)
                w.add(unit, {}, {}, complete=True)
            else:
                w.add(unit, tensors, state_of[unit])
        w.close()
    assert _files(tmp_path / "src-False", "*") == _files(tmp_path / "src-True", "*")
    reshard(tmp_path / "src-True", tmp_path / "out", tp=2, pp=1, ep=2, with_optimizer=True)
    out = TorchDistSource(tmp_path / "out")
    out.check_optimizer()
    experts = 0
    for unit, tensors in weights.items():
        for got, st in out.read_unit_parts(unit, with_optimizer=True):
            for name, t in got.items():
                assert torch.equal(t, tensors[name]), name
                if is_buffer(name):
                    assert st.get(name, {}) == {}, name
                    continue
                assert set(st[name]) == {"param", "exp_avg", "exp_avg_sq"}, name
                for k, v in state_of[unit][name].items():
                    assert torch.equal(st[name][k], v), (name, k)
                experts += unit == "final" and ".local_experts." in name
    assert experts == 2 * spec.num_experts  # the MTP layer's experts' fc1 and fc2, one part each
