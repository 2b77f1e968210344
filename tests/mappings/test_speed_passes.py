"""Fewer passes in the mappings: q/k/v rows placed straight from each rank's shard into HF's q_proj/k_proj/v_proj,
GPT-2's c_attn regrouped per head block — each against torch's reshape formulas or the merge-then-map path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mconvert.errors import MConvertError
from mconvert.mappings import transforms as T
from safety_common import load_rank, save_rank, sha_tree


def _qkv_truth(full: torch.Tensor, nq: int, ng: int, hd: int) -> list[torch.Tensor]:
    """Megatron's fused qkv rows `[ng, nq/ng + 2, hd]` cut into q, k, v by indexing (megatron-core's
    `get_query_key_value_tensors` split of each group)."""
    g = full.reshape(ng, nq // ng + 2, hd, *full.shape[1:])
    per = nq // ng
    return [g[:, :per].reshape(nq * hd, *full.shape[1:]), g[:, per].reshape(ng * hd, *full.shape[1:]),
            g[:, per + 1].reshape(ng * hd, *full.shape[1:])]


@pytest.mark.parametrize("nq,ng,hd,tp", [(4, 2, 8, 2), (8, 8, 4, 4), (8, 2, 4, 1), (6, 3, 2, 3), (16, 4, 2, 2)])
@pytest.mark.parametrize("cols", [5, None])
def test_place_rows_puts_every_rank_row_where_merge_then_qkv_split_does(nq: int, ng: int, hd: int, tp: int,
                                                                         cols: int | None) -> None:
    """Each rank's rows copied once where `place_rows` says give the q, k and v of merging the shards and
    cutting the fused tensor per group (weights and 1-D biases), every row written exactly once."""
    rows = (nq + 2 * ng) * hd // tp
    rest = () if cols is None else (cols,)
    shards = [torch.randn(rows, *rest) for _ in range(tp)]
    want = _qkv_truth(torch.cat(shards), nq, ng, hd)
    parts = [torch.full((n, *rest), float("nan")) for n in (nq * hd, ng * hd, ng * hd)]
    writes = torch.zeros(sum(p.shape[0] for p in parts), dtype=torch.int64)
    offs = [0, nq * hd, (nq + ng) * hd]
    per_rank = T.place_rows(T.merge_rows("qkv", tp, rows), T.qkv_separate_rows(nq, ng, hd))
    for shard, pieces in zip(shards, per_rank, strict=True):
        assert [s for _, _, s, _ in pieces] == sorted(s for _, _, s, _ in pieces)  # file order: CRC runs on
        for part, at, start, n in pieces:
            parts[part][at:at + n] = shard[start:start + n]
            writes[offs[part] + at:offs[part] + at + n] += 1
    assert torch.equal(writes, torch.ones_like(writes))
    for got, ref in zip(parts, want, strict=True):
        assert torch.equal(got, ref)
    assert [torch.equal(a, b) for a, b in zip(parts, T.qkv_to_separate(torch.cat(shards), nq, ng, hd))] == [True] * 3


def test_place_rows_refuses_a_plan_that_misses_or_repeats_rows() -> None:
    ranks = T.merge_rows("qkv", 2, 4)
    with pytest.raises(MConvertError, match="does not cover the 8 merged rows once"):
        T.place_rows(ranks, [(0, 0, 0, 4), (1, 0, 5, 3)], "w")  # row 4 nowhere
    with pytest.raises(MConvertError, match="does not cover the 8 merged rows once"):
        T.place_rows(ranks, [(0, 0, 0, 5), (1, 0, 4, 4)], "w")  # row 4 twice


# ---- megatron-to-hf of a GQA Llama: q/k/v placed from the rank files --------------------------------------
@pytest.fixture(scope="module")
def llama_tp2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mconvert.trainer.train import TrainConfig, train

    root = tmp_path_factory.mktemp("llama-tp2")
    train(TrainConfig(preset="tiny-llama", tp=2, pp=1, steps=1, save=str(root / "ck"), force=True, quiet=True,
                      device="cpu"))
    return root / "ck"


@pytest.mark.timeout(300)
def test_megatron_to_hf_places_qkv_rows_and_matches_merge_then_map(llama_tp2: Path, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """With TP=2 and 2 KV groups, q/k/v are read straight into their HF tensors (the fused-tensor split is never
    called) and the output is byte-identical to the merge-then-`qkv_to_separate` path."""
    from mconvert.convert.verbs import megatron_to_hf
    from mconvert.mappings import plugin

    real = T.qkv_to_separate
    calls: list[str] = []

    def watched(qkv: torch.Tensor, *a: object, **k: object) -> list[torch.Tensor]:
        if qkv.device.type != "meta":  # the writer's plan maps meta tensors; only data counts
            calls.append(str(a[-1] if a else k.get("name")))
        return real(qkv, *a, **k)

    with monkeypatch.context() as m:
        m.setattr(T, "qkv_to_separate", watched)
        megatron_to_hf(llama_tp2, tmp_path / "placed")
    assert calls == []
    with monkeypatch.context() as m:
        m.setattr(T, "qkv_to_separate", watched)
        m.setattr(plugin, "ROW_PLANS", {})  # the merge-then-map path
        megatron_to_hf(llama_tp2, tmp_path / "merged")
    assert calls and all(c.endswith("linear_qkv.weight") for c in calls)  # the watch sees that path
    placed, merged = sha_tree(tmp_path / "placed"), sha_tree(tmp_path / "merged")
    assert placed == merged and any(k.endswith(".safetensors") for k in placed)


@pytest.mark.timeout(300)
def test_nan_in_one_ranks_qkv_is_refused_by_file_and_key(llama_tp2: Path, tmp_path: Path) -> None:
    """A NaN in TP rank 1's linear_qkv rows is refused naming that rank file and key; no output is left."""
    import shutil

    from mconvert.convert.verbs import megatron_to_hf

    ck = tmp_path / "ck"
    shutil.copytree(llama_tp2, ck)
    f = next(ck.rglob("mp_rank_01*/model_optim_rng.pt"))
    st = load_rank(f)
    key = next(k for k in st["model"] if k.endswith("layers.1.self_attention.linear_qkv.weight"))
    st["model"][key][-1, -1] = float("nan")  # a value row of the last group: the last piece read
    save_rank(f.with_name("new.pt"), st)  # the old file stays mapped until the new one is whole
    f.with_name("new.pt").replace(f)
    with pytest.raises(MConvertError, match=rf"mp_rank_01.*'{key}' holds NaN or Inf"):
        megatron_to_hf(ck, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


# ---- the finite check: one aminmax pass, answer as torch.isfinite(t).all() -----------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_all_finite_agrees_with_isfinite_on_every_special_value(dtype: torch.dtype) -> None:
    """NaN, +Inf or -Inf anywhere (first, middle, last element) is caught; the largest finite values, signed
    zeros and denormals pass — the same answer as `torch.isfinite(t).all()`."""
    from mconvert.io.casts import all_finite

    fi = torch.finfo(dtype)
    base = torch.tensor([fi.max, -fi.max, 0.0, -0.0, fi.tiny / 4, -fi.tiny, 1.0] * 300, dtype=dtype)
    assert all_finite(base) and bool(torch.isfinite(base).all())
    for bad in (float("nan"), float("inf"), float("-inf")):
        for at in (0, base.numel() // 2, base.numel() - 1):
            t = base.clone()
            t[at] = bad
            assert all_finite(t) is False and not bool(torch.isfinite(t).all())
            assert all_finite(t.reshape(30, -1).t()) is False  # a strided view too


# ---- hf-to-megatron of a GQA Llama: q/k/v and gate/up rows placed into the merged tensors -----------------
@pytest.fixture(scope="module")
def llama_hf(llama_tp2: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mconvert.convert.verbs import megatron_to_hf

    out = tmp_path_factory.mktemp("llama-hf") / "hf"
    megatron_to_hf(llama_tp2, out)
    return out


@pytest.mark.timeout(300)
def test_hf_to_megatron_places_hf_rows_and_matches_cat_then_split(llama_hf: Path, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """q_proj/k_proj/v_proj and gate_proj/up_proj are read straight into the fused linear_qkv / linear_fc1
    (torch.cat of `separate_to_qkv` / `halves_to_gated` never runs on data) and the rank files are
    byte-identical to those of the cat-then-split path."""
    from mconvert.convert.verbs import hf_to_megatron
    from mconvert.mappings import plugin

    calls: list[str] = []

    def watch(fn):  # noqa: ANN001, ANN202
        def watched(*a: object, **k: object) -> torch.Tensor:
            if a and isinstance(a[0], torch.Tensor) and a[0].device.type != "meta":
                calls.append(fn.__name__)
            return fn(*a, **k)
        return watched

    for fn in (T.separate_to_qkv, T.halves_to_gated):
        monkeypatch.setattr(T, fn.__name__, watch(fn))
    hf_to_megatron(llama_hf, tmp_path / "placed", tp=2)
    assert calls == []
    monkeypatch.setattr(plugin, "ROW_PLANS", {})
    hf_to_megatron(llama_hf, tmp_path / "cat", tp=2)
    assert sorted(set(calls)) == ["halves_to_gated", "separate_to_qkv"]  # the watch sees that path
    placed, cat = sha_tree(tmp_path / "placed"), sha_tree(tmp_path / "cat")
    assert placed == cat and any(k.endswith("model_optim_rng.pt") for k in placed)


@pytest.mark.timeout(300)
def test_nan_in_an_hf_v_proj_is_refused_by_file_and_key(llama_hf: Path, tmp_path: Path) -> None:
    """An Inf in the last row of layer 1's v_proj (the last block placed) is refused naming the safetensors
    file and the key; no output is left."""
    import shutil

    from safetensors.torch import load_file, save_file

    from mconvert.convert.verbs import hf_to_megatron

    hf = tmp_path / "hf"
    shutil.copytree(llama_hf, hf)
    key = "model.layers.1.self_attn.v_proj.weight"
    f = next(p for p in hf.glob("*.safetensors") if key in load_file(p))
    tensors = load_file(f)
    tensors[key][-1, -1] = float("inf")
    save_file(tensors, f, metadata={"format": "pt"})
    (hf / "mconvert-manifest.json").unlink(missing_ok=True)  # the edit is the subject, not the manifest
    with pytest.raises(MConvertError, match=rf"{f.name}: tensor '{key}' holds NaN or Inf"):
        hf_to_megatron(hf, tmp_path / "mg", tp=2)
    assert not (tmp_path / "mg").exists()
