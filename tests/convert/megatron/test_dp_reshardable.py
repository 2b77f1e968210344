"""megatron-core's `dp_reshardable` distributed-optimizer layout (Megatron-LM's default), read and written.

- the bucket layout `dp_buckets` rebuilds from the spec is megatron-core's own: its DDP buffers (parameter order,
  offsets, bucket sizes padded and unpadded) and its optimizer's `data_parallel_group_idx`, at TP, PP, VPP, tied
  embeddings at PP > 1, qk-layernorm, a bucket size and the NCCL bus-bandwidth padding;
- megatron-core trains at TP=2 and saves `dp_reshardable`; `reshard --with-optimizer` to TP=1 (dp_reshardable,
  fully_reshardable) and through the trainer's Adam states back to TP=2 dp_reshardable: megatron-core resumed
  from each takes the step the straight run took (loss within 1e-5), as it does from its own save; the same
  output with the buckets laid out in the wrong order does not (negative control);
- what the layout cannot carry is refused by name, with nothing written.
"""

from __future__ import annotations

import io
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from mcore_ref import McoreContext, run_mcore
from test_external_mcore import SPECS
from test_torch_dist_write import _load_go_on, _train_save_go_on, cpu_patches

from mconvert.convert.megatron import dp_buckets
from mconvert.convert.verbs import reshard
from mconvert.io.safeload import safe_load, safe_load_dcp_metadata
from mconvert.errors import MConvertError
from mconvert.mappings.families import preset

ITER = "iter_0000002"
DP = {"distrib_optim_sharding_type": "dp_reshardable"}


def _mcore_buckets(ctx: McoreContext, ddp_kw: dict) -> tuple:
    """megatron-core's own buffers and distributed optimizer for this rank's chunks (DDP per chunk, bucketing
    off after the first, as Megatron-LM builds them): (dp_group_idx, per_bucket_numel_unpadded, per_bucket_numel,
    [[[(global name, start, end) in the bucket] per bucket] per buffer])."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    cpu_patches()
    if "num_buckets" in ddp_kw:  # Megatron-LM's --ddp-num-buckets: this rank's parameter count over it
        n = sum(p.numel() for m in ctx.models for p in m.parameters())
        ddp_kw = {**{k: v for k, v in ddp_kw.items() if k != "num_buckets"}, "bucket_size": n // ddp_kw["num_buckets"]}
    cfg = DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True, **ddp_kw)
    ddps = [DistributedDataParallel(m.config, cfg, m, disable_bucketing=c > 0) for c, m in enumerate(ctx.models)]
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, use_distributed_optimizer=True), ddps)
    [dist] = getattr(opt, "chained_optimizers", [opt])
    per = ctx.spec.num_layers // (ctx.pp * (ctx.vpp or 1))
    buffers = []
    for c, (m, ddp) in enumerate(zip(ctx.models, ddps)):
        first = (c * ctx.pp + ctx.pp_rank) * per
        names = {}
        for n, p in m.named_parameters():
            parts = n.split(".")
            if n.startswith("decoder.layers."):
                parts[2] = str(int(parts[2]) + first)  # megatron-core numbers a chunk's layers from 0
            names[p] = ".".join(parts)
        for buf in ddp.buffers:
            buckets = []
            for b, bucket in enumerate(buf.buckets):
                slots = [(names[p], s - bucket.offset, e - bucket.offset)
                         for p, (s, e, bid) in buf.param_index_map.items() if bid == b]
                buckets.append(slots)
            buffers.append(buckets)
    return dist.data_parallel_group_idx, dist.per_bucket_numel_unpadded, dist.per_bucket_numel, buffers


LAYOUTS = {
    "llama-tp2": (SPECS["llama"], 2, 1, None, {}),
    "gpt2-tied-pp2": (SPECS["gpt2"], 1, 2, None, {}),
    "llama4-pp2-vpp2": (SPECS["llama4"], 1, 2, 2, {}),
    "llama-tp2-pp2-buckets": (SPECS["llama"], 2, 2, None, {"overlap_grad_reduce": True, "bucket_size": 30000}),
    "qwen3-busbw": (preset("tiny-qwen3"), 1, 1, None, {"overlap_grad_reduce": True, "bucket_size": 50000,
                                                       "pad_buckets_for_high_nccl_busbw": True}),
    "llama4-tp2-pp2-vpp2-num-buckets": (SPECS["llama4"], 2, 2, 2, {"overlap_grad_reduce": True, "num_buckets": 3}),
}


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", sorted(LAYOUTS))
def test_rebuilt_buckets_are_megatron_cores(case: str) -> None:
    """Every domain's buffers rebuilt from the spec equal megatron-core's: parameter order and [start, end) in
    each bucket, bucket sizes unpadded and padded, and the domain index its optimizer saves under."""
    spec, tp, pp, vpp, kw = LAYOUTS[case]
    got = run_mcore(spec, tp, _mcore_buckets, (kw,), pp=pp, vpp=vpp)
    args = {"overlap_grad_reduce": kw.get("overlap_grad_reduce"), "ddp_bucket_size": kw.get("bucket_size"),
            "ddp_num_buckets": kw.get("num_buckets"),
            "ddp_pad_buckets_for_high_nccl_busbw": kw.get("pad_buckets_for_high_nccl_busbw")}
    ddp = dp_buckets.ddp_settings(args)  # from Megatron-LM's args, as a checkpoint's common.pt holds them
    layout = dp_buckets.domain_layout(spec, tp, pp, vpp, ddp)
    dtype = (torch.float32, torch.float32)
    assert sorted(r[0] for r in got) == sorted(layout)
    for idx, unpadded, padded, buffers in got:
        mine = layout[idx]
        assert unpadded == [{dtype: [b.numel_unpadded for b in buf]} for buf in mine], idx
        assert padded == [{dtype: [b.numel for b in buf]} for buf in mine], idx
        assert buffers == [[[(s.name, s.start, s.end) for s in b.slots] for b in buf] for buf in mine], idx
    if kw.get("bucket_size") or kw.get("num_buckets"):
        assert len(layout[0][0]) > 1  # the case exercises several buckets


def test_moe_and_unknown_layouts_are_refused_by_name() -> None:
    """Expert-parallel buffers are not carried; an unknown layout name is one line naming the choices."""
    with pytest.raises(MConvertError, match="expert-parallel buffers"):
        dp_buckets.domain_layout(preset("tiny-mixtral"), 1, 1, None, dp_buckets.DdpSettings())
    with pytest.raises(MConvertError, match="--optimizer-layout 'zero': choose fully_reshardable or dp_reshardable"):
        dp_buckets.check_optimizer_layout("zero")


# ---- megatron-core saves dp_reshardable; reshard; megatron-core resumes -----------------------------------------
def _load_go_on_dp(ctx: McoreContext, ckpt_dir: str, batches: list[torch.Tensor]) -> float:
    """`_load_go_on` with megatron-core's dp_reshardable load. Test-only patch: megatron-core 0.16.1 copies the
    loaded states into the fp32 main params (views of parameters that require grad) outside `no_grad`, which
    torch refuses for fp32 models; the copy runs under `no_grad` as the other layouts' loads do."""
    import test_torch_dist_write as tdw
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    load = DistributedOptimizer.load_parameter_state_from_dp_reshardable
    DistributedOptimizer.load_parameter_state_from_dp_reshardable = torch.no_grad()(load)
    tdw.DIST_OPT = DP
    return _load_go_on(ctx, ckpt_dir, batches)


def _train_save_dp(ctx: McoreContext, root: str, batches: list[torch.Tensor]) -> float:
    """`_train_save_go_on` saving Megatron-LM's default layout, dp_reshardable."""
    import test_torch_dist_write as tdw

    tdw.DIST_OPT = DP
    return _train_save_go_on(ctx, root, batches)


@pytest.fixture(scope="module")
def mcore_dp(tmp_path_factory: pytest.TempPathFactory) -> tuple:
    """megatron-core at TP=2: two steps, a dp_reshardable save, the straight run's next loss."""
    spec = SPECS["llama"]
    g = torch.Generator().manual_seed(5)
    batches = [torch.randint(0, spec.vocab_size, (2, 16), generator=g) for _ in range(4)]
    root = tmp_path_factory.mktemp("mcore_dp") / "ckpt"
    straight = run_mcore(spec, 2, _train_save_dp, (str(root), batches))
    assert straight[0] == straight[1]
    return spec, root, batches, straight[0]


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-5 * abs(b)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_megatron_core_dp_reshardable_reshards_and_resumes(mcore_dp: tuple, tmp_path: Path) -> None:
    """megatron-core's own TP=2 dp_reshardable save resumes (the harness is exact); our TP=1 reshard keeps
    dp_reshardable by default (megatron-core's bucket sizes) and, with --optimizer-layout fully_reshardable,
    writes the per-parameter layout: megatron-core resumed from either takes the straight run's step."""
    spec, root, batches, straight = mcore_dp
    common = safe_load(root / ITER / "common.pt")
    assert common["optimizer"] == {"param_state_sharding_type": "dp_reshardable"}  # Megatron-LM's default layout
    own = run_mcore(spec, 2, _load_go_on_dp, (str(root / ITER), batches))
    assert _close(own[0], straight)

    reshard(root, tmp_path / "dp1", tp=1, pp=1, with_optimizer=True)
    assert safe_load(tmp_path / "dp1" / ITER / "common.pt")["optimizer"] == {"param_state_sharding_type":
                                                                             "dp_reshardable"}
    [dp1] = run_mcore(spec, 1, _load_go_on_dp, (str(tmp_path / "dp1" / ITER), batches))

    reshard(root, tmp_path / "full1", tp=1, pp=1, with_optimizer=True, optimizer_layout="fully_reshardable")
    [full1] = run_mcore(spec, 1, _load_go_on, (str(tmp_path / "full1" / ITER), batches))
    print(f"next-step loss: straight {straight:.7f}; own dp save {own[0]:.7f}; our TP1 dp_reshardable {dp1:.7f}; "
          f"our TP1 fully_reshardable {full1:.7f}")
    assert _close(dp1, straight) and _close(full1, straight)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_dp_reshardable_through_trainer_states_and_a_wrong_layout(mcore_dp: tuple, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """dp_reshardable TP=2 -> torch TP=1 (the trainer's Adam states) -> torch_dist TP=2 dp_reshardable: the bucket
    sizes are megatron-core's own and megatron-core resumes with the straight run's step. The same reshard with
    each bucket's parameters in registration order instead of megatron-core's reverse order writes states that
    load but put states on the wrong parameters: the loss differs (negative control)."""
    spec, root, batches, straight = mcore_dp
    reshard(root, tmp_path / "torch", tp=1, pp=1, format="torch", with_optimizer=True)
    st = safe_load(tmp_path / "torch" / ITER / "mp_rank_00" / "model_optim_rng.pt")
    assert {float(s["step"]) for s in st["optimizer"]["state"].values()} == {2.0}
    reshard(tmp_path / "torch", tmp_path / "dp2", tp=2, pp=1, format="torch_dist", with_optimizer=True,
            optimizer_layout="dp_reshardable")
    assert _objects(tmp_path / "dp2" / ITER, "per_bucket_numel_unpadded") == \
        _objects(root / ITER, "per_bucket_numel_unpadded")
    back = run_mcore(spec, 2, _load_go_on_dp, (str(tmp_path / "dp2" / ITER), batches))
    assert _close(back[0], straight), (back, straight)

    plain = dp_buckets.buffer_buckets
    monkeypatch.setattr(dp_buckets, "buffer_buckets", lambda params, *a: plain(params[::-1], *a))
    reshard(root, tmp_path / "wrong", tp=2, pp=1, with_optimizer=True, optimizer_layout="dp_reshardable")
    wrong = run_mcore(spec, 2, _load_go_on_dp, (str(tmp_path / "wrong" / ITER), batches))
    print(f"next-step loss: straight {straight:.7f}; through trainer states {back[0]:.7f}; wrong order {wrong[0]:.7f}")
    assert not _close(wrong[0], straight)


def _objects(d: Path, name: str) -> dict[str, object]:
    """Each domain's ShardedObject `name`, read from the data files (`torch.save([value])` bytes)."""
    md = safe_load_dcp_metadata(d / ".metadata")
    out = {}
    for index, info in md.storage_data.items():
        if index.fqn.endswith(f".{name}/shard_0_1"):
            with open(d / info.relative_path, "rb") as f:
                f.seek(info.offset)
                out[index.fqn] = torch.load(io.BytesIO(f.read(info.length)), weights_only=True)[0]
    return out


# ---- refusals ---------------------------------------------------------------------------------------------------
def _set_object(d: Path, key: str, value: object) -> None:
    """Replace one ShardedObject's bytes: appended to its data file, the metadata pointed at them."""
    md_file = d / ".metadata"
    md = safe_load_dcp_metadata(md_file)
    index = next(i for i in md.storage_data if i.fqn == key)
    info = md.storage_data[index]
    buf = io.BytesIO()
    torch.save([value], buf)
    path = d / info.relative_path
    info.offset, info.length = path.stat().st_size, len(buf.getvalue())
    with open(path, "ab") as f:
        f.write(buf.getvalue())
    with open(md_file, "wb") as f:
        pickle.dump(md, f)  # our own metadata, one entry moved


def _edit_args(d: Path, **kw: object) -> None:
    path = d / ITER / "common.pt"
    common = torch.load(path, weights_only=False)  # megatron-core's file, written by this test's fixture
    for k, v in kw.items():
        setattr(common["args"], k, v)
    torch.save(common, path)


def _refused(src: Path, out: Path, match: str, **kw: object) -> None:
    """reshard(src, out, ...) is one MConvertError matching `match`; no OUT, the source's files unchanged."""
    before = {p.name: p.read_bytes() for p in (src / ITER).iterdir()}
    with pytest.raises(MConvertError, match=match):
        reshard(src, out, tp=1, pp=1, with_optimizer=True, **kw)
    assert not out.exists()
    assert {p.name: p.read_bytes() for p in (src / ITER).iterdir()} == before


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_layouts_that_cannot_be_rebuilt_are_refused_by_name(mcore_dp: tuple, tmp_path: Path) -> None:
    """Args naming another bucket size, a DP size whose padding differs from the saved sizes, a buffer with two
    dtypes, and --optimizer-layout without torch_dist output: each one MConvertError naming the key; no OUT and
    the source's files unchanged."""
    _, root, _, _ = mcore_dp
    src = tmp_path / "src"
    shutil.copytree(root, src)
    _edit_args(src, overlap_grad_reduce=True, ddp_bucket_size=100000)
    _refused(src, tmp_path / "o1", r"\.metadata: dp_group_idx_0\.per_bucket_numel_unpadded is \[\[279168\]\], the "
             r"model's buckets rebuilt from the args are \[\[1\d+, 1\d+\]\]")
    _edit_args(src, overlap_grad_reduce=False, data_parallel_size=5)
    _refused(src, tmp_path / "o2", r"dp_group_idx_0\.per_bucket_numel is \[\[279168\]\], the buckets padded for the "
             r"args' data-parallel size are \[\[279680\]\]")
    _edit_args(src, data_parallel_size=1)
    key = "optimizer.distributed.dp_group_idx_1.per_bucket_numel_unpadded/shard_0_1"
    _set_object(src / ITER, key, [{(torch.bfloat16, torch.float32): [10], (torch.float32, torch.float32): [279168]}])
    _refused(src, tmp_path / "o3", r"dp_group_idx_1 has a buffer with 2 dtypes")
    _refused(root, tmp_path / "o4", r"--optimizer-layout dp_reshardable: applies to the optimizer states of "
             r"torch_dist output", format="torch", optimizer_layout="dp_reshardable")


# ---- CPU round trip at PP / VPP / tied embeddings (no megatron-core) --------------------------------------------
@pytest.mark.timeout(300)
def test_trainer_states_through_dp_reshardable_at_pp_vpp_come_back(tmp_path: Path) -> None:
    """GPT-2 (tied head) trainer states exp_avg = 2·p, exp_avg_sq = |p| at TP2 PP2 VPP2 -> torch_dist
    dp_reshardable TP2 PP2 VPP2 -> torch TP2 PP2 VPP2: every rank file's model and states come back byte for
    byte. In the buckets each parameter's slice keeps the relation to its fp32 copy (`param`), the tied head's
    copy on the last stage holds the embedding's states, and the gaps are zeros; common.pt names the layout."""
    from test_convert_optimizer import _add_optimizer
    from test_torch_dist_optimizer import _gpt2
    from test_torch_dist_write import _dcp_read_all

    from mconvert.convert.verbs import hf_to_megatron

    hf_to_megatron(_gpt2(tmp_path), tmp_path / "a", tp=2, pp=2, vpp=2)
    _add_optimizer(tmp_path / "a")
    reshard(tmp_path / "a", tmp_path / "d", tp=2, pp=2, vpp=2, format="torch_dist", with_optimizer=True,
            optimizer_layout="dp_reshardable")
    d = tmp_path / "d" / "release"
    assert safe_load(d / "common.pt")["optimizer"] == {"param_state_sharding_type": "dp_reshardable"}
    groups = {k: v["param_groups"] for k, v in _objects(d, "optimizer").items()}
    assert len(groups) == 4 and all(g[0]["step"] == 3.0 and g[0]["lr"] == 1e-3 for g in groups.values())
    dist = _dcp_read_all(d)
    assert not any(k.startswith("optimizer.state.") for k in dist)
    spec = preset("tiny-gpt2").replace(num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=100,
                                       ffn_hidden_size=128, max_position_embeddings=16)
    for idx, buffers in dp_buckets.domain_layout(spec, 2, 2, 2, dp_buckets.DdpSettings()).items():
        for g, buckets in enumerate(buffers):
            for b, bucket in enumerate(buckets):
                key = dp_buckets.bucket_key(idx, g, (torch.float32, torch.float32), b, "{}")
                param, avg, sq = (dist[key.format(s)] for s in ("param", "exp_avg", "exp_avg_sq"))
                assert param.numel() == bucket.numel_unpadded
                used = torch.zeros(bucket.numel_unpadded, dtype=torch.bool)
                for s in bucket.slots:
                    assert torch.equal(avg[s.start:s.end], 2 * param[s.start:s.end]), (key, s.name)
                    assert torch.equal(sq[s.start:s.end], param[s.start:s.end].abs()), (key, s.name)
                    used[s.start:s.end] = True
                assert not avg[~used].any() and not param[~used].any()
    def slices(name: str) -> dict[int, torch.Tensor]:  # tp rank -> that rank's exp_avg slice of `name`
        out = {}
        for i, bufs in dp_buckets.domain_layout(spec, 2, 2, 2, dp_buckets.DdpSettings()).items():
            for g, bks in enumerate(bufs):
                for b, bk in enumerate(bks):
                    for s in bk.slots:
                        if s.name == name:
                            key = dp_buckets.bucket_key(i, g, (torch.float32, torch.float32), b, "exp_avg")
                            out[dp_buckets.stage_of(i, 2)[1]] = dist[key][s.start:s.end]
        return out

    head, emb = slices("output_layer.weight"), slices("embedding.word_embeddings.weight")
    assert sorted(head) == sorted(emb) == [0, 1]  # the tied head's copy on the last stage, per TP rank
    # (rank 1 holds only padding rows: 100 tokens padded to 256)
    assert all(torch.equal(head[t], emb[t]) for t in emb) and emb[0].any()
    reshard(tmp_path / "d", tmp_path / "b", tp=2, pp=2, vpp=2, format="torch", with_optimizer=True)
    for f in sorted((tmp_path / "a").rglob("model_optim_rng.pt")):
        a, c = safe_load(f), safe_load(tmp_path / "b" / f.relative_to(tmp_path / "a"))
        ga, gc = a["optimizer"]["param_groups"][0], c["optimizer"]["param_groups"][0]
        assert ga["param_names"] == gc["param_names"]
        for k in ("model0", "model1"):
            assert all(torch.equal(a[k][n], c[k][n]) for n in a[k] if isinstance(a[k][n], torch.Tensor))
        for pa, pc in zip(ga["params"], gc["params"]):
            sa, sc = a["optimizer"]["state"][pa], c["optimizer"]["state"][pc]
            assert sa.keys() == sc.keys() and all(torch.equal(sa[s], sc[s]) for s in sa)


@pytest.mark.timeout(300)
def test_cli_optimizer_layout_refusals_are_one_line(tmp_path: Path, capsys) -> None:
    """`--optimizer-layout` with an unknown name, or into torch output, is one `error:` line naming the option;
    no OUT."""
    from safety_common import assert_one_line_error, run_cli
    from test_torch_dist_optimizer import _gpt2

    from mconvert.convert.verbs import hf_to_megatron

    hf_to_megatron(_gpt2(tmp_path), tmp_path / "a", tp=1)
    base = ["reshard", tmp_path / "a", tmp_path / "o", "--tp", "1", "--with-optimizer"]
    code, _, err = run_cli([*base, "--format", "torch_dist", "--optimizer-layout", "zero"], capsys)
    assert_one_line_error(code, err, "--optimizer-layout 'zero'", "fully_reshardable or dp_reshardable")
    code, _, err = run_cli([*base, "--format", "torch", "--optimizer-layout", "dp_reshardable"], capsys)
    assert_one_line_error(code, err, "--optimizer-layout dp_reshardable", "torch_dist output")
    assert not (tmp_path / "o").exists()


# ---- data parallel: megatron-core at DP=2 ------------------------------------------------------------------------
def _run_dp(spec, dp: int, fn, args: tuple) -> list:
    """`run_mcore` at TP=PP=1 with `dp` data-parallel ranks (each runs the same tokens): the harness's worker with
    a world of `dp` processes (its `ep` argument sizes the world; a dense model has no expert groups to use it)."""
    import tempfile

    import mcore_ref
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="mcore_dp_") as tmp:
        mcore_ref._preload()
        mp.start_processes(mcore_ref._worker, args=(dp, mcore_ref._free_port(), spec, 1, 1, None, 1234, fn, args,
                                                     tmp, dp), nprocs=dp, start_method="fork")
        return [pickle.loads(Path(tmp, f"rank{r}.pkl").read_bytes()) for r in range(dp)]  # the children's own


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_megatron_core_dp2_save_reshards_and_resumes_at_other_dp(tmp_path: Path) -> None:
    """megatron-core at DP=2 saves dp_reshardable (each DP rank its half of every bucket, parameters cut at the
    half); reshard to TP=2 dp_reshardable: megatron-core resumes from it at TP=2 (DP=1) with the straight run's
    step; back to TP=1 it resumes at DP=2 (our one chunk per parameter read as each DP rank's half)."""
    spec = SPECS["llama"]
    g = torch.Generator().manual_seed(5)
    batches = [torch.randint(0, spec.vocab_size, (2, 16), generator=g) for _ in range(4)]
    root = tmp_path / "mcore"
    straight = _run_dp(spec, 2, _train_save_dp, (str(root), batches))
    assert straight[0] == straight[1]
    md = safe_load_dcp_metadata(root / ITER / ".metadata")
    bucket = next(k for k in md.state_dict_metadata if k.endswith("bucket_idx_0.exp_avg"))
    half = md.state_dict_metadata[bucket].size[0] // 2  # each DP rank saves its half of the bucket
    chunks = [(c.offsets[0], c.offsets[0] + c.sizes[0]) for c in md.state_dict_metadata[bucket].chunks]
    assert half in [s for s, _ in chunks] and not any(s < half < e for s, e in chunks)
    reshard(root, tmp_path / "tp2", tp=2, pp=1, with_optimizer=True)
    tp2 = run_mcore(spec, 2, _load_go_on_dp, (str(tmp_path / "tp2" / ITER), batches))
    reshard(tmp_path / "tp2", tmp_path / "tp1", tp=1, pp=1, with_optimizer=True)
    dp2 = _run_dp(spec, 2, _load_go_on_dp, (str(tmp_path / "tp1" / ITER), batches))
    print(f"next-step loss: straight (DP2) {straight[0]:.7f}; ours at TP2 {tp2[0]:.7f}; ours at TP1 DP2 {dp2[0]:.7f}")
    assert _close(tp2[0], straight[0]) and _close(dp2[0], straight[0]) and dp2[0] == dp2[1]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_gpt2_with_padded_buckets_reshards_and_resumes(tmp_path: Path) -> None:
    """GPT-2 (LayerNorm biases, learned positions, tied head; parameters whose sizes leave 64-element alignment
    gaps in the buckets) saved dp_reshardable by megatron-core at TP=1 and resharded to TP=2 dp_reshardable:
    megatron-core resumes with the straight run's step."""
    spec = SPECS["gpt2"]
    sizes = [s.end - s.start for b in dp_buckets.domain_layout(spec, 2, 1, None, dp_buckets.DdpSettings())[0][0]
             for s in b.slots]
    assert any(n % dp_buckets.PARAM_ALIGN for n in sizes)  # the buckets have alignment gaps
    g = torch.Generator().manual_seed(5)
    batches = [torch.randint(0, spec.vocab_size, (2, 16), generator=g) for _ in range(4)]
    root = tmp_path / "mcore"
    [straight] = run_mcore(spec, 1, _train_save_dp, (str(root), batches))
    reshard(root, tmp_path / "tp2", tp=2, pp=1, with_optimizer=True)
    got = run_mcore(spec, 2, _load_go_on_dp, (str(tmp_path / "tp2" / ITER), batches))
    print(f"next-step loss: straight {straight:.7f}; ours at TP2 {got[0]:.7f}")
    assert _close(got[0], straight) and got[0] == got[1]


@pytest.mark.timeout(300)
def test_dp_reshardable_without_buckets_is_refused_by_name(tmp_path: Path) -> None:
    """common.pt naming dp_reshardable with no bucket states in the files (an incomplete copy): one MConvertError
    naming the domains the args expect; no OUT."""
    from test_torch_dist_optimizer import _gpt2

    from mconvert.convert.verbs import hf_to_megatron
    from mconvert.io.atomic import MANIFEST

    hf_to_megatron(_gpt2(tmp_path), tmp_path / "d", tp=2, format="torch_dist")
    (tmp_path / "d" / MANIFEST).unlink()  # both manifests: the edit stands for an incomplete copy, not damage
    (tmp_path / "d" / "release" / "integrity.json").unlink()
    path = tmp_path / "d" / "release" / "common.pt"
    common = safe_load(path)
    common["optimizer"] = {"param_state_sharding_type": "dp_reshardable"}
    torch.save(common, path)
    with pytest.raises(MConvertError, match=r"\.metadata: the dp_reshardable states are saved for dp_group_idx \[\], "
                                            r"the args' TP×PP layout has \[0, 1\]"):
        reshard(tmp_path / "d", tmp_path / "o", tp=1, pp=1, with_optimizer=True)
    assert not (tmp_path / "o").exists()
