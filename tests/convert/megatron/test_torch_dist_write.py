"""torch_dist as an output format, proven against megatron-core 0.16.1 itself (CPU, gloo, local spec).

- our torch_dist output loads with megatron-core's own `dist_checkpointing.load` into its GPTModel at a TP/PP
  other than the one written, and reproduces transformers' logits (1e-4 relative);
- re-sharding megatron-core's own legacy checkpoint into torch_dist gives the `.metadata` megatron-core's
  `dist_checkpointing.save` writes for the same model (keys, global shapes, dtypes, chunk boxes) and the same
  values and `_extra_state` bytes;
- torch -> torch_dist -> torch is byte-identical; `--dry-run` sizes the data file; bad options are one line.
"""

from __future__ import annotations

import filecmp
import io
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hf_ref import hf_logits
from deploy_common import make_hf, rel
from mcore_ref import McoreContext, run_mcore
from test_external_mcore import ITERATION, SPECS, _saved

from mconvert.cli import main as cli_main
from mconvert.convert.verbs import hf_to_megatron, reshard
from mconvert.convert.inspect import inspect_checkpoint
from mconvert.io.safeload import safe_load_dcp_metadata
from mconvert.mappings.families import preset

TOKENS = torch.Generator().manual_seed(3)


def _dcp_read_all(d: Path) -> dict[str, object]:
    """Every entry of a DCP checkpoint read by torch's own reader (full tensors; bytes entries as bytes)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    from torch.distributed.checkpoint._traverse import set_element

    class _RawBytes(_EmptyStateDictLoadPlanner):
        def load_bytes(self, read_item, value: io.BytesIO) -> None:  # the saved bytes, not torch.load of them
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], value)

    sd: dict[str, object] = {}
    _load_state_dict(sd, storage_reader=FileSystemReader(str(d)), planner=_RawBytes(), no_dist=True)
    return {k: (v.getvalue() if isinstance(v, io.BytesIO) else v) for k, v in sd.items()}


def _summary(d: Path) -> dict[str, object]:
    """`.metadata` as data: key -> (global shape, dtype, chunk boxes) or 'bytes'."""
    md = safe_load_dcp_metadata(d / ".metadata")
    out: dict[str, object] = {}
    for k, v in md.state_dict_metadata.items():
        if hasattr(v, "chunks"):
            out[k] = (tuple(v.size), v.properties.dtype, sorted((tuple(c.offsets), tuple(c.sizes)) for c in v.chunks))
        else:
            out[k] = "bytes"
    return out


def _load_dist(ctx: McoreContext, ckpt_dir: str, tokens: torch.Tensor) -> torch.Tensor | None:
    """What Megatron-LM's `load_checkpoint` does for torch_dist: sharded_state_dict -> dist_checkpointing.load
    -> load_state_dict(strict); then the harness's forward."""
    from megatron.core import dist_checkpointing

    loaded = dist_checkpointing.load({"model": ctx.model.sharded_state_dict()}, ckpt_dir)
    assert loaded["iteration"] == 0 and loaded["checkpoint_version"] == 3.0  # common.pt, merged in
    ctx.model.load_state_dict(loaded["model"], strict=True)
    return ctx.logits(tokens)


CASES = {
    # GQA, SwiGLU (gate/up chunks), untied head; written at TP=1 PP=1, loaded at TP=2 PP=2
    "llama": (SPECS["llama"], (1, 1), (2, 2)),
    # LayerNorm + biases, learned positions, tied head; written at TP=2, loaded at TP=1 PP=2 (the last stage
    # finds its head under the embedding's key)
    "gpt2": (preset("tiny-gpt2"), (2, 1), (1, 2)),
}


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", sorted(CASES))
def test_torch_dist_output_loads_in_megatron_core_at_another_layout(case: str, tmp_path: Path) -> None:
    spec, (tp_w, pp_w), (tp_l, pp_l) = CASES[case]
    hf = make_hf(spec, tmp_path / "hf")
    out = tmp_path / "dist"
    cli_main(["hf-to-megatron", str(hf), str(out), "--tp", str(tp_w), "--pp", str(pp_w), "--format", "torch_dist"])
    assert sorted(p.name for p in (out / "release").iterdir()) == [".metadata", "__0_0.distcp", "common.pt",
                                                                  "integrity.json", "metadata.json"]
    tokens = torch.randint(0, spec.vocab_size, (2, 12), generator=TOKENS)
    res = run_mcore(spec, tp_l, _load_dist, (str(out / "release"), tokens), pp=pp_l)
    got = res[-1][..., : spec.vocab_size]
    want = hf_logits(hf, tokens)
    err = rel(got, want)
    print(f"{case}: written TP={tp_w} PP={pp_w}, loaded TP={tp_l} PP={pp_l}: rel err {err:.2e}")
    assert err <= 1e-4, f"{case}: megatron-core's logits differ from transformers' by {err:.2e} relative"
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_torch_dist_written_from_mcore_torch_matches_mcore_dist_save(tmp_path: Path,
                                                                     tmp_path_factory: pytest.TempPathFactory) -> None:
    """megatron-core wrote the same model twice (legacy torch and dist_checkpointing.save, TP=2): our
    torch -> torch_dist reshard at TP=2 has its `.metadata` structure, its tensors and its extra-state bytes."""
    spec, _, _, mcore_torch, dist_root = _saved("llama", 1, tmp_path_factory)
    torch_root = mcore_torch  # its args hold megatron enums (attention_backend): written back as they were read
    out = tmp_path / "ours"
    report = reshard(torch_root, out, tp=2, pp=1, format="torch_dist")
    assert report["format"] == "torch_dist"
    ours_dir, ref_dir = out / f"iter_{ITERATION:07d}", dist_root / f"iter_{ITERATION:07d}"
    assert (out / "latest_checkpointed_iteration.txt").read_text() == str(ITERATION)
    assert (ours_dir / "metadata.json").read_text() == (ref_dir / "metadata.json").read_text()
    assert _summary(ours_dir) == _summary(ref_dir)
    ours, ref = _dcp_read_all(ours_dir), _dcp_read_all(ref_dir)
    assert ours.keys() == ref.keys()
    for k in ref:
        if isinstance(ref[k], torch.Tensor):
            assert torch.equal(ours[k], ref[k]), k
        else:
            assert ours[k] == ref[k], k
    common = torch.load(ours_dir / "common.pt", weights_only=False)  # our own file, written a moment ago
    ref_common = torch.load(ref_dir / "common.pt", weights_only=False)  # megatron-core's, from this test session
    assert common["iteration"] == ref_common["iteration"] == ITERATION
    assert common["checkpoint_version"] == ref_common["checkpoint_version"]
    for field in ("num_layers", "hidden_size", "tensor_model_parallel_size", "padded_vocab_size", "swiglu"):
        assert getattr(common["args"], field) == getattr(ref_common["args"], field), field


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", [(1, 1, 2, 1), (2, 2, 1, 2)])
def test_torch_to_torch_dist_to_torch_is_byte_identical(layout: tuple[int, int, int, int], tmp_path: Path) -> None:
    tp, pp, dist_tp, dist_pp = layout
    spec = preset("tiny-llama").replace(num_layers=4)
    hf = make_hf(spec, tmp_path / "hf")
    first = tmp_path / "torch"
    hf_to_megatron(hf, first, tp=tp, pp=pp)
    reshard(first, tmp_path / "dist", tp=dist_tp, pp=dist_pp, format="torch_dist")
    back = tmp_path / "back"
    reshard(tmp_path / "dist", back, tp=tp, pp=pp, format="torch")
    cmp = filecmp.dircmp(first, back)
    assert not cmp.left_only and not cmp.right_only
    files = sorted(p.relative_to(first) for p in first.rglob("*") if p.is_file())
    assert any(f.name == "model_optim_rng.pt" for f in files)
    for f in files:
        assert (first / f).read_bytes() == (back / f).read_bytes(), f


@pytest.mark.timeout(300)
def test_dry_run_and_inspect_size_the_torch_dist_data_file(tmp_path: Path) -> None:
    spec = preset("tiny-llama")
    hf = make_hf(spec, tmp_path / "hf")
    plan = hf_to_megatron(hf, tmp_path / "dist", tp=2, format="torch_dist", dry_run=True)
    assert plan["format"] == "torch_dist" and not (tmp_path / "dist").exists()
    [entry] = plan["files"]
    hf_to_megatron(hf, tmp_path / "dist", tp=2, format="torch_dist")
    size = (tmp_path / "dist" / "release" / entry["path"]).stat().st_size
    md = safe_load_dcp_metadata(tmp_path / "dist" / "release" / ".metadata")
    tensor_items = [k for k in md.storage_data if k.offset is not None]
    assert entry["tensors"] == len(tensor_items)
    # tensor bytes exactly; each chunk adds torch.save's zip framing (< 4 KiB), each extra state its blob
    framing = size - entry["bytes"]
    assert 0 < framing < 4096 * len(md.storage_data), (size, entry["bytes"])
    info = inspect_checkpoint(tmp_path / "dist")
    assert info["format"] == "megatron-torch_dist" and info["tp"] == 2
    assert info["files"][0] == {"path": "__0_0.distcp", "bytes": size, "entries": len(md.storage_data)}
    assert {f["path"] for f in info["files"]} == {p.name for p in (tmp_path / "dist" / "release").iterdir()}


@pytest.mark.timeout(400)
def test_bad_format_and_optimizer_into_torch_dist_are_one_line_refusals(tmp_path: Path) -> None:
    spec = preset("tiny-llama")
    hf = make_hf(spec, tmp_path / "hf")
    ckpt = tmp_path / "ckpt"
    hf_to_megatron(hf, ckpt)
    runs = {
        "zarr": (["hf-to-megatron", str(hf), str(tmp_path / "o1"), "--format", "zarr"], "--format 'zarr'"),
        "optimizer": (["reshard", str(ckpt), str(tmp_path / "o2"), "--format", "torch_dist", "--with-optimizer"],
                      "--with-optimizer"),
    }
    for name, (argv, needle) in runs.items():
        p = subprocess.run([sys.executable, "-m", "mconvert.cli", *argv], capture_output=True, text=True, timeout=150)
        assert p.returncode != 0, name
        lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
        assert len(lines) == 1 and needle in lines[0] and "Traceback" not in p.stderr, (name, p.stderr)
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()


@pytest.mark.timeout(300)
def test_data_files_split_at_the_size_limit_as_planned_and_read_back(tmp_path: Path) -> None:
    """A new `__0_<i>.distcp` starts where the next chunk would pass the limit; `plan` names the same files
    with the same tensor bytes, and the reader gets every tensor back from them."""
    from mconvert.layouts.estimate import torch_dist_files
    from mconvert.convert.sources import open_source
    from mconvert.convert.megatron.torch_dist_writer import TorchDistWriter

    spec = preset("tiny-llama")
    hf = open_source(make_hf(spec, tmp_path / "hf"))
    limit = 300_000  # a few chunks per file
    out = tmp_path / "dist"
    writer = TorchDistWriter(out, hf.spec, 2, 1, max_file_bytes=limit)
    for unit in hf.units():
        writer.add(unit, hf.read_mcore(unit))
    writer.close()
    release = out / "release"
    names = sorted(p.name for p in release.glob("*.distcp"))
    planned = torch_dist_files(hf.spec, 2, 4, limit)
    assert len(names) > 2 and names == sorted(f["path"] for f in planned)
    md = safe_load_dcp_metadata(release / ".metadata")
    per_file: dict[str, int] = {}
    for index, info in md.storage_data.items():
        if index.offset is not None:  # tensor chunks (bytes entries carry no offset)
            chunk = next(c for c in md.state_dict_metadata[index.fqn].chunks if tuple(c.offsets) == tuple(index.offset))
            per_file[info.relative_path] = per_file.get(info.relative_path, 0) + 4 * int(chunk.sizes.numel())
    assert per_file == {f["path"]: f["bytes"] for f in planned}
    assert all(v <= limit for v in per_file.values())
    back = open_source(out, verify=False)
    for unit in hf.units():
        want, got = hf.read_mcore(unit), back.read_mcore(unit)
        for k, v in want.items():
            assert torch.equal(got[k][: v.shape[0]], v), k


# ---- megatron-core's distributed optimizer (fully_reshardable) through reshard ------------------------------
DIST_OPT = {"distrib_optim_sharding_type": "fully_reshardable"}


def _on_cpu(fn):
    def wrapped(*a, **k):
        if str(k.get("device", "")).startswith("cuda"):
            k["device"] = "cpu"
        return fn(*a, **k)
    return wrapped


def cpu_patches() -> None:
    """Test-only patches in a megatron-core child process: tensors asked for on 'cuda' are made on the CPU, and
    `Tensor.type()` answers with the CUDA type names the distributed optimizer checks its parameters against."""
    for name in ("tensor", "zeros", "empty", "ones", "full", "arange"):
        setattr(torch, name, _on_cpu(getattr(torch, name)))
    plain_type = torch.Tensor.type

    def cuda_type(self, *a, **k):
        r = plain_type(self, *a, **k)
        if not a and not k and isinstance(r, str) and r.startswith("torch.") and not r.startswith("torch.cuda."):
            return "torch.cuda." + r[len("torch."):]
        return r

    torch.Tensor.type = cuda_type


def _dist_optimizer(ctx: McoreContext):
    """megatron-core's DDP + DistributedOptimizer (Adam) around the rank's model, on CPU. Test-only patches in
    the child process: tensors asked for on 'cuda' are made on the CPU, and `Tensor.type()` answers with the
    CUDA type names the optimizer checks its parameters against."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    cpu_patches()
    ddp = DistributedDataParallel(ctx.model.config, DistributedDataParallelConfig(use_distributed_optimizer=True,
                                                                                  grad_reduce_in_fp32=True), ctx.model)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, use_distributed_optimizer=True), [ddp])
    ctx.model.train()
    return ddp, opt


def _loss(ctx: McoreContext, tokens: torch.Tensor) -> torch.Tensor:
    s = tokens.shape[1]
    pos = torch.arange(s).unsqueeze(0).expand(tokens.shape[0], -1)
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)[None, None]
    return ctx.model(tokens, pos, mask, labels=tokens).float().mean()


def _step(ctx: McoreContext, ddp, opt, tokens: torch.Tensor) -> None:
    ddp.zero_grad_buffer()
    opt.zero_grad()
    _loss(ctx, tokens).backward()
    ddp.finish_grad_sync()
    assert opt.step()[0]


def _train_save_go_on(ctx: McoreContext, root: str, batches: list[torch.Tensor]) -> float:
    """Two steps, a torch_dist save (model + distributed optimizer, as Megatron-LM saves them), one more step,
    then the loss of the next batch."""
    from megatron.core import dist_checkpointing

    ddp, opt = _dist_optimizer(ctx)
    _step(ctx, ddp, opt, batches[0])
    _step(ctx, ddp, opt, batches[1])
    d = Path(root) / "iter_0000002"
    d.mkdir(parents=True, exist_ok=True)
    torch.distributed.barrier()
    args = ctx.spec.to_megatron_args(ctx.tp, ctx.pp, ctx.vpp)
    args.params_dtype, args.iteration = torch.float32, 2
    msd = ctx.model.sharded_state_dict()
    dist_checkpointing.save({"model": msd, "optimizer": opt.sharded_state_dict(msd, metadata=DIST_OPT), "args": args,
                             "checkpoint_version": 3.0, "iteration": 2}, str(d))
    if ctx.rank == 0:
        (Path(root) / "latest_checkpointed_iteration.txt").write_text("2")
    _step(ctx, ddp, opt, batches[2])
    with torch.no_grad():
        return _loss(ctx, batches[3]).item()


def _load_go_on(ctx: McoreContext, ckpt_dir: str, batches: list[torch.Tensor]) -> float:
    """What Megatron-LM's resume does for torch_dist (model, then optimizer), then the same step and loss.

    Three test-only patches for megatron-core 0.16.1 on torch's Adam (no Apex / Transformer Engine): the fresh
    optimizer's states are made with megatron-core's own `_init_optimizer_states_with_dummy_values` (its
    `state_dict()` needs them); loading `fully_reshardable` states keeps the Adam `step` it already set
    from the saved param groups (its copy loop asks every state key of the `tensors` it was given); and that
    step, one tensor shared by every parameter after megatron-core's load, is given to each parameter as its
    own tensor (torch's Adam adds 1 to it per parameter)."""
    from megatron.core import dist_checkpointing

    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    set_states = DistributedOptimizer._set_main_param_and_optimizer_states

    def keep_step(self, model_param, tensors):  # megatron-core 0.16.1, torch Adam: 'step' is not in `tensors`
        g, o = self.model_param_group_index_map[model_param]
        step = self.optimizer.state[self.optimizer.param_groups[g]["params"][o]].get("step")
        return set_states(self, model_param, tensors if step is None else {**tensors, "step": step.clone()})

    DistributedOptimizer._set_main_param_and_optimizer_states = keep_step  # the step comes from param_groups
    ddp, opt = _dist_optimizer(ctx)
    for o in getattr(opt, "chained_optimizers", [opt]):  # torch's Adam (no Apex/TE): states exist after a step
        o._init_optimizer_states_with_dummy_values()  # megatron-core's own: replaced in place by the load
    msd = ctx.model.sharded_state_dict()
    osd = opt.sharded_state_dict(msd, is_loading=True, metadata=DIST_OPT)
    loaded = dist_checkpointing.load({"model": msd, "optimizer": osd}, ckpt_dir)
    ctx.model.load_state_dict(loaded["model"], strict=True)
    opt.load_state_dict(loaded["optimizer"])
    for o in getattr(opt, "chained_optimizers", [opt]):  # one `step` tensor per parameter, as a fresh Adam has
        for state in o.optimizer.state.values():
            state["step"] = state["step"].clone()
    _step(ctx, ddp, opt, batches[2])
    with torch.no_grad():
        return _loss(ctx, batches[3]).item()


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_megatron_core_distributed_optimizer_reshards_and_resumes(tmp_path: Path) -> None:
    """megatron-core trains at TP=2 with its distributed optimizer and saves torch_dist; `reshard
    --with-optimizer` to TP=1 keeps every state tensor and the param groups: megatron-core resumed from our
    TP=1 copy takes the same next step as the run that went straight on (loss within 1e-5), as does
    megatron-core resumed from its own TP=2 checkpoint."""
    spec = SPECS["llama"]
    g = torch.Generator().manual_seed(5)
    batches = [torch.randint(0, spec.vocab_size, (2, 16), generator=g) for _ in range(4)]
    root = tmp_path / "mcore"
    straight = run_mcore(spec, 2, _train_save_go_on, (str(root), batches))
    assert straight[0] == straight[1]
    own = run_mcore(spec, 2, _load_go_on, (str(root / "iter_0000002"), batches))
    out = tmp_path / "tp1"
    report = reshard(root, out, tp=1, pp=1, with_optimizer=True)
    assert report["format"] == "torch_dist"
    ours, ref = _dcp_read_all(out / "iter_0000002"), _dcp_read_all(root / "iter_0000002")
    states = [k for k in ref if k.startswith("optimizer.state.")]
    assert len(states) == 3 * len([k for k in ref if isinstance(ref[k], torch.Tensor)
                                   and not k.startswith("optimizer.")])  # param, exp_avg, exp_avg_sq each
    for k in states:
        assert torch.equal(ours[k], ref[k]), k
    common = torch.load(out / "iter_0000002" / "common.pt", weights_only=False)  # our own file
    ref_common = torch.load(root / "iter_0000002" / "common.pt", weights_only=False)  # megatron-core's, just written
    assert common["optimizer"] == ref_common["optimizer"] and common["iteration"] == 2
    [resumed] = run_mcore(spec, 1, _load_go_on, (str(out / "iter_0000002"), batches))
    print(f"next-step loss: straight on {straight[0]:.7f}; resumed from megatron-core's TP=2 save {own[0]:.7f}; "
          f"from our TP=1 reshard {resumed:.7f}")
    assert own[0] == own[1]
    assert abs(own[0] - straight[0]) <= 1e-5 * abs(straight[0])  # the harness resumes megatron-core exactly
    assert abs(resumed - straight[0]) <= 1e-5 * abs(straight[0])
    # without --with-optimizer the param groups stay behind with the states
    fresh = tmp_path / "no_opt"
    reshard(root, fresh, tp=1, pp=1)
    assert "optimizer" not in torch.load(fresh / "iter_0000002" / "common.pt", weights_only=False)  # our own file


@pytest.mark.timeout(300)
def test_damaged_layer_midway_leaves_no_torch_dist_output(tmp_path: Path) -> None:
    """A source chunk that cannot be read after earlier units were written: one line naming the input, no OUT,
    no temporary directory left beside it."""
    from mconvert.io.atomic import MANIFEST

    spec = preset("tiny-llama").replace(num_layers=4)
    hf = make_hf(spec, tmp_path / "hf")
    src = tmp_path / "src"
    hf_to_megatron(hf, src, format="torch_dist")
    # mconvert's and Megatron-LM's manifests would refuse the damage before any unit: reach the read instead
    (src / MANIFEST).unlink()
    (src / "release" / "integrity.json").unlink()
    md = safe_load_dcp_metadata(src / "release" / ".metadata")
    index = next(i for i in md.storage_data if i.fqn == "decoder.layers.mlp.linear_fc2.weight" and i.offset[0] == 2)
    info = md.storage_data[index]
    with open(src / "release" / info.relative_path, "r+b") as f:
        f.seek(info.offset)
        f.write(b"XXXX")  # layer 2's chunk is no longer a torch.save zip; layers 0 and 1 read fine
    before = sorted(p.name for p in tmp_path.iterdir())
    p = subprocess.run([sys.executable, "-m", "mconvert.cli", "reshard", str(src), str(tmp_path / "out"), "--tp", "2",
                        "--format", "torch_dist"], capture_output=True, text=True, timeout=200)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode != 0 and len(lines) == 1, p.stderr
    assert "linear_fc2.weight" in lines[0] and "Traceback" not in p.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no OUT, no leftover temporary directory


@pytest.mark.timeout(300)
def test_torch_dist_optimizer_refusals_name_the_layout(tmp_path: Path) -> None:
    """--with-optimizer on a torch_dist checkpoint without states, or with a layout not carried (megatron-core's
    deprecated fully_sharded_model_space), is one MConvertError naming common.pt; nothing is written."""
    from mconvert.io.atomic import MANIFEST
    from mconvert.io.safeload import safe_load
    from mconvert.errors import MConvertError

    hf = make_hf(preset("tiny-llama"), tmp_path / "hf")
    plain = tmp_path / "plain"
    hf_to_megatron(hf, plain, format="torch_dist")
    with pytest.raises(MConvertError, match=r"common\.pt: no optimizer state"):
        reshard(plain, tmp_path / "o1", tp=2, pp=1, with_optimizer=True)
    bucketed = tmp_path / "bucketed"
    hf_to_megatron(hf, bucketed, format="torch_dist")
    (bucketed / MANIFEST).unlink()  # both manifests: the edit stands for a save by another megatron-core
    (bucketed / "release" / "integrity.json").unlink()
    common = safe_load(bucketed / "release" / "common.pt")
    common["optimizer"] = {"param_state_sharding_type": "fully_sharded_model_space",
                           "optimizer": {"param_groups": []}}
    torch.save(common, bucketed / "release" / "common.tmp")
    (bucketed / "release" / "common.tmp").replace(bucketed / "release" / "common.pt")
    with pytest.raises(MConvertError, match=r"common\.pt: distributed optimizer states are saved as "
                                            r"'fully_sharded_model_space'; only 'fully_reshardable' and "
                                            r"'dp_reshardable' can be re-sharded"):
        reshard(bucketed, tmp_path / "o2", tp=2, pp=1, with_optimizer=True)
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()


PEAK_SCRIPT = """
import sys, tempfile, torch
from pathlib import Path
from mconvert.mappings.families import preset
from mconvert.convert.megatron.torch_dist_writer import TorchDistWriter

def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024

t = torch.randn(8192, 8192)  # 256 MiB; row-parallel at TP=2: each chunk a strided half of the columns
with tempfile.TemporaryDirectory(dir=sys.argv[1]) as d:
    w = TorchDistWriter(Path(d), preset("tiny-llama"), 2, 1)
    base = status("VmRSS:")
    w._add_tensor("decoder.layers.0.mlp.linear_fc2.weight", t)
    w._file.close()
    print(status("VmHWM:") - base)
"""


@pytest.mark.timeout(120)
def test_writer_peak_is_about_one_chunk_above_the_tensor(tmp_path: Path) -> None:
    """A strided TP chunk is copied once (torch.save of a view would save its whole storage) and streamed from
    that copy into the data file: the writer's peak stays well under two chunks above the full tensor, where a
    serialized copy per chunk would add a second and a third."""
    p = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, str(tmp_path)], capture_output=True, text=True,
                       timeout=100)
    assert p.returncode == 0, p.stderr
    chunk = 8192 * 8192 * 4 // 2
    above = int(p.stdout.split()[-1])
    print(f"writer peak above the tensor: {above / 2**20:.0f} MiB for {chunk / 2**20:.0f} MiB chunks")
    assert above < 1.75 * chunk
