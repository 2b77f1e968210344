"""`--dry-run` and `plan` at expert parallelism: one rank file per (TP, PP, EP) rank, each with its E/EP experts and
a copy of the dense weights and the router. Checked against the files hf-to-megatron and reshard really write
(names, tensor counts read back from the files, sizes within the pickle framing the other dry-run tests allow)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from deploy_common import make_hf
from safety_common import assert_one_line_error, run_cli

from mconvert.convert.verbs import hf_to_megatron, reshard
from mconvert.layouts.estimate import estimate
from mconvert.io.safeload import safe_load
from mconvert.mappings.families import preset

FRAMING = 4096  # torch.save framing per tensor, as the torch_dist dry-run test allows; args pickle included


@pytest.fixture(scope="module")
def hf_mixtral(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_hf(preset("tiny-mixtral"), tmp_path_factory.mktemp("moe_plan") / "hf")


def _real(root: Path) -> dict[str, tuple[int, int]]:
    """Each rank file of a written checkpoint: (bytes on disk, tensors in its model dict)."""
    out = {}
    for f in sorted((root / "release").rglob("model_optim_rng.pt")):
        model = safe_load(f)["model"]
        out[str(f.relative_to(root / "release"))] = (f.stat().st_size, sum(1 for v in model.values()
                                                                          if hasattr(v, "shape")))
    return out


def _check(planned: list[dict], real: dict[str, tuple[int, int]]) -> None:
    assert {f["path"] for f in planned} == set(real)
    for f in planned:
        size, tensors = real[f["path"]]
        assert f["tensors"] == tensors, f["path"]
        assert 0 < size - f["bytes"] < FRAMING * tensors, (f["path"], size, f["bytes"])


@pytest.mark.timeout(300)
def test_dry_runs_at_ep_list_the_rank_files_hf_to_megatron_and_reshard_write(hf_mixtral: Path,
                                                                              tmp_path: Path) -> None:
    mg = tmp_path / "mg"
    plan = hf_to_megatron(hf_mixtral, mg, tp=2, ep=2, dry_run=True)
    assert not mg.exists() and plan["ep"] == 2
    hf_to_megatron(hf_mixtral, mg, tp=2, ep=2)
    real = _real(mg)
    assert sorted(real) == [f"mp_rank_0{t}_00{e}/model_optim_rng.pt" for t in (0, 1) for e in (0, 1)]
    _check(plan["files"], real)
    # the shape-only estimate of `plan` names and sizes the same files
    est = estimate(preset("tiny-mixtral"), "megatron", tp=2, ep=2)
    assert est.target == "megatron TP=2 PP=1 EP=2"
    _check(est.files["write"], real)

    # reshard EP2 TP2 -> EP4 TP1: four files, each with one expert per layer; the read side is the EP2 files
    rs = tmp_path / "rs"
    plan = reshard(mg, rs, tp=1, pp=1, ep=4, dry_run=True)
    assert not rs.exists() and plan["ep"] == 4 and plan["read_files"] == 4
    assert plan["read_bytes"] == sum(f["bytes"] for f in est.files["write"])
    reshard(mg, rs, tp=1, pp=1, ep=4)
    real4 = _real(rs)
    _check(plan["files"], real4)
    est4 = estimate(preset("tiny-mixtral"), "megatron", tp=2, ep=2, target_tp=1, target_pp=1, target_ep=4)
    _check(est4.files["write"], real4)
    assert est4.read_files == 4


def test_expert_bytes_divide_by_ep_and_dense_bytes_repeat_in_every_ep_file() -> None:
    spec = preset("tiny-mixtral")
    layer = spec.layer_params(0)
    expert = sum(math.prod(d.shape) for d in layer if d.expert is not None) * 4 * spec.num_layers
    one = estimate(spec, "megatron", tp=1, ep=1, dtype="fp32")
    four = estimate(spec, "megatron", tp=1, ep=4, dtype="fp32")
    assert (one.write_files, four.write_files) == (1, 4)
    # four files: the experts once in all, everything else four times
    assert four.write_bytes == 4 * (one.write_bytes - expert) + expert
    sizes = {f["bytes"] for f in four.files["write"]}
    assert sizes == {one.write_bytes - expert + expert // 4}


def test_plan_cli_estimates_at_ep_and_refuses_an_ep_that_does_not_fit(capsys) -> None:
    code, out, _ = run_cli(["plan", "--preset", "moe-671b", "--tp", "8", "--ep", "8", "--to", "megatron",
                            "--target-ep", "16", "--json"], capsys)
    est = json.loads(out)
    assert code == 0 and (est["read_files"], est["write_files"]) == (64, 128)
    assert (est["source"], est["target"]) == ("megatron TP=8 PP=1 EP=8", "megatron TP=8 PP=1 EP=16")
    code, _, err = run_cli(["plan", "--preset", "tiny-mixtral", "--ep", "3", "--to", "hf"], capsys)
    assert_one_line_error(code, err, "EP=3 does not divide num_experts=4")
    code, _, err = run_cli(["plan", "--preset", "tiny-llama", "--ep", "2", "--to", "megatron"], capsys)
    assert_one_line_error(code, err, "EP=2 needs a mixture-of-experts model")


def test_plan_counts_one_expert_not_a_layer_of_experts() -> None:
    """The peak of an MoE conversion is one unit of the driver's: the embedding, a layer's dense part or one
    expert — so 32 experts of a width plan the same peak as 8."""
    small, big = (preset("tiny-mixtral").replace(num_experts=e, ffn_hidden_size=1024) for e in (8, 32))
    a, b = (estimate(s, "hf", tp=2, ep=2, dtype="fp32") for s in (small, big))
    assert (a.largest_unit, b.largest_unit) == ("expert", "expert")
    assert a.largest_unit_bytes == b.largest_unit_bytes == 2 * 3 * 128 * 1024 * 4  # in (TP shards) and out
    assert a.peak_memory_bytes == b.peak_memory_bytes


def test_an_hf_expert_beyond_num_experts_is_refused_by_name(hf_mixtral: Path, tmp_path: Path) -> None:
    """A tensor of expert 4 in a 4-expert model fits no unit of the layer: refused naming it, nothing written
    (a layer read whole would pass it by unread)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from mconvert.errors import MConvertError

    bad = tmp_path / "hf"
    shutil.copytree(hf_mixtral, bad)
    weights = sorted(bad.glob("*.safetensors"))
    assert len(weights) == 1
    tensors = load_file(weights[0])
    extra = "model.layers.0.block_sparse_moe.experts.4.w1.weight"
    tensors[extra] = tensors["model.layers.0.block_sparse_moe.experts.3.w1.weight"].clone()
    save_file(tensors, weights[0], metadata={"format": "pt"})
    with pytest.raises(MConvertError) as err:
        hf_to_megatron(bad, tmp_path / "mg", ep=2)
    assert str(err.value).startswith(f"{weights[0]}: tensor {extra!r} is not a parameter of this mixtral model "
                                     "(4 experts")
    assert not (tmp_path / "mg").exists()
