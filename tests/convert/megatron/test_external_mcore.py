"""Checkpoints written by megatron-core itself convert to HF whose transformers logits match megatron-core's.

Truth we did not write on both ends: megatron-core 0.16.1's GPTModel (local spec, TP=2 over gloo, CPU) writes
(a) the legacy torch layout exactly as Megatron-LM's `save_checkpoint` does (`iter_0000010/mp_rank_0T/
model_optim_rng.pt` with `args`, `checkpoint_version` 3.0, `iteration`, `model` =
`state_dict_for_save_checkpoint()`, rng state, scheduler) and (b) a `dist_checkpointing.save` torch_dist
checkpoint with `common.pt`; `mconvert megatron-to-hf` converts each, and transformers' model class runs the
export. Issue 3: max abs ≤ 1e-4 · max|logit| and the same top-1 everywhere.
"""

from __future__ import annotations

import random
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from hf_ref import hf_logits
from mcore_ref import McoreContext, run_mcore
from safetensors.torch import load_file

from mconvert.cli import main as cli_main
from mconvert.layouts.megatron import rank_file, save_rank_file, write_latest
from mconvert.mappings.families import preset
from mconvert.spec import ModelSpec

ITERATION = 10
TOKENS = torch.Generator().manual_seed(7)

SPECS = {
    # GQA (4 heads, 2 groups at TP=2), SwiGLU, RoPE with a non-default base, untied head, eps 1e-6
    "llama": preset("tiny-llama").replace(rotary_base=500000.0, norm_epsilon=1e-6),
    # LayerNorm with biases, tanh GeLU, learned positions, tied head
    "gpt2": preset("tiny-gpt2"),
    # 4 layers for PP=2 x VPP=2: rank 0 holds global layers 0 and 2, rank 1 holds 1 and 3
    "llama4": preset("tiny-llama").replace(num_layers=4, rotary_base=500000.0, norm_epsilon=1e-6),
    # sliding window (5 keys before the query, 6 in all) on every layer, shorter than the 16-token test sequence;
    # written without model_family, as Megatron-LM writes it: read as HF Mistral
    "mistral-swa": preset("tiny-mistral-swa").replace(window_size=5),
    # window_attn_skip_freq=2: layer 1 (1-based) windowed, layer 2 full attention -> HF Qwen2 layer_types
    "qwen2-swa": preset("tiny-qwen2-swa").replace(window_size=5, window_pattern=(1, 0)),
}


def _perturb(ctx: McoreContext) -> None:
    """Move every parameter off its init (norms off 1, biases off 0) so that a wrong layout cannot hide.

    Replicated parameters get the same values on every TP rank, split ones differ per rank (and per virtual
    chunk, whose layer names repeat)."""
    for chunk, model in enumerate(ctx.models):
        for name, p in model.named_parameters():
            _perturb_one(ctx, chunk, name, p)


def _perturb_one(ctx: McoreContext, chunk: int, name: str, p: torch.Tensor) -> None:
    split = bool(getattr(p, "tensor_model_parallel", False))
    where = f"{ctx.pp_rank}:{chunk}"  # stage-local layer names repeat across stages and chunks
    if name == "output_layer.weight" and ctx.spec.tie_embeddings:
        name = "embedding.word_embeddings.weight"  # the last stage's copy of the tied embedding (PP > 1)
    if name.startswith("embedding."):
        where = "0:0"
    g = torch.Generator().manual_seed(zlib.crc32(f"{where}:{name}".encode()) + (1000 * ctx.tp_rank if split else 0))
    noise = torch.randn(p.shape, generator=g)
    with torch.no_grad():
        if name.endswith("layernorm.weight"):
            p.copy_(1.0 + 0.2 * noise)
        else:
            p.copy_(0.1 * noise)


def _megatron_args(ctx: McoreContext):
    from megatron.core.transformer.enums import AttnBackend

    args = ctx.spec.to_megatron_args(ctx.tp, ctx.pp, ctx.vpp)
    if ctx.spec.window_size is not None:
        del args.model_family  # Megatron-LM writes no model_family: the family is recognised from the args
    args.params_dtype = torch.float32  # Megatron-LM stores a torch.dtype and enums in its args
    args.attention_backend = AttnBackend.auto
    args.iteration = ITERATION
    args.ckpt_format = "torch"
    return args


def _per_chunk(ctx: McoreContext, fn) -> dict:
    """Megatron-LM's `model` entry, or `model0`, `model1`, ... with virtual pipeline chunks."""
    if ctx.vpp is None:
        return {"model": fn(ctx.model)}
    return {f"model{c}": fn(m) for c, m in enumerate(ctx.models)}


def _save_both(ctx: McoreContext, torch_root: str, dist_root: str, tokens: torch.Tensor) -> torch.Tensor | None:
    """Per rank: perturb, save legacy torch + torch_dist checkpoints as Megatron-LM would, return logits."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    _perturb(ctx)
    args = _megatron_args(ctx)
    state = {
        "args": args,
        "checkpoint_version": 3.0,
        "iteration": ITERATION,
        **_per_chunk(ctx, lambda m: m.state_dict_for_save_checkpoint()),
        "opt_param_scheduler": {"max_lr": 1e-3, "num_steps": ITERATION * 8},
        "rng_state": [{
            "random_rng_state": random.getstate(),
            "np_rng_state": np.random.get_state(),
            "torch_rng_state": torch.get_rng_state(),
            "rng_tracker_states": {},
        }],
        "num_floating_point_operations_so_far": 0,
    }
    save_rank_file(rank_file(torch_root, ITERATION, ctx.tp_rank, ctx.pp_rank, ctx.pp), state)
    dist_dir = Path(dist_root) / f"iter_{ITERATION:07d}"
    dist_dir.mkdir(parents=True, exist_ok=True)
    torch.distributed.barrier()
    dargs = _megatron_args(ctx)
    dargs.ckpt_format = "torch_dist"
    # the same rng states, as Megatron-LM's get_rng_state hands them to a torch_dist save
    rng = ShardedObject("rng_state", state["rng_state"], (ctx.pp, ctx.tp), (ctx.pp_rank, ctx.tp_rank), replica_id=0)
    dist_checkpointing.save(
        {**_per_chunk(ctx, lambda m: m.sharded_state_dict()), "args": dargs, "checkpoint_version": 3.0,
         "iteration": ITERATION, "rng_state": rng},
        str(dist_dir),
    )
    if ctx.rank == 0:
        write_latest(torch_root, ITERATION)
        write_latest(dist_root, ITERATION)
    return ctx.logits(tokens)


def _hf_tensors(hf_dir: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        out.update(load_file(f))
    return out


_SAVED: dict[tuple[str, int, int | None], tuple] = {}


def _saved(family: str, pp: int, tmp_path_factory: pytest.TempPathFactory, vpp: int | None = None) -> tuple:
    """One megatron-core run per (family, PP, VPP), shared by the tests of this module."""
    if (family, pp, vpp) not in _SAVED:
        spec: ModelSpec = SPECS[family]
        tmp = tmp_path_factory.mktemp(f"mcore_{family}_pp{pp}_vpp{vpp}")
        tokens = torch.randint(0, spec.vocab_size, (2, 16), generator=TOKENS)
        torch_root, dist_root = tmp / "mcore_torch", tmp / "mcore_dist"
        results = run_mcore(spec, 2, _save_both, (str(torch_root), str(dist_root), tokens), pp=pp, vpp=vpp)
        assert torch.equal(results[-1], results[-2])  # both TP ranks of the last stage gathered the same logits
        _SAVED[(family, pp, vpp)] = (spec, tokens, results[-1], torch_root, dist_root)
    return _SAVED[(family, pp, vpp)]


@pytest.mark.slow
@pytest.mark.parametrize("family,pp,vpp", [("llama", 1, None), ("gpt2", 1, None), ("gpt2", 2, None),
                                          ("llama4", 2, 2)])
def test_megatron_core_checkpoints_convert_to_matching_hf(family: str, pp: int, vpp: int | None, tmp_path: Path,
                                                          tmp_path_factory: pytest.TempPathFactory) -> None:
    spec, tokens, logits_mcore, torch_root, dist_root = _saved(family, pp, tmp_path_factory, vpp)
    ref = logits_mcore[..., : spec.vocab_size]  # megatron-core's logits (last stage), padded vocab rows dropped
    exports = {}
    for kind, root in (("torch", torch_root), ("torch_dist", dist_root)):
        out = tmp_path / f"hf_{kind}"
        cli_main(["megatron-to-hf", str(root), str(out)])
        logits = hf_logits(out, tokens)
        diff = (logits - ref).abs().max().item()
        scale = ref.abs().max().item()
        print(f"{family} TP=2 PP={pp} VPP={vpp} {kind}: max|hf - mcore| = {diff:.3e}, max|logit| = {scale:.3f}")
        assert diff <= 1e-4 * scale, f"{family} {kind}: max abs diff {diff} > 1e-4 * {scale}"
        assert torch.equal(logits.argmax(-1), ref.argmax(-1)), f"{family} {kind}: top-1 differs"
        exports[kind] = _hf_tensors(out)
    # two independent readers (legacy torch, torch_dist) of the same weights agree bit for bit
    a, b = exports["torch"], exports["torch_dist"]
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.slow
def test_torch_dist_reader_reads_one_layer_slice_and_matches_the_legacy_reader(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """Each unit reads only the DCP chunks of its own layer; full tensors equal the legacy rank files' merge."""
    from mconvert.convert.megatron.source import MegatronSource
    from mconvert.convert.sources import open_source
    from mconvert.convert.megatron.torch_dist import TorchDistSource

    spec, _, _, torch_root, dist_root = _saved("llama", 1, tmp_path_factory)
    dist, legacy = open_source(dist_root), open_source(torch_root)
    assert isinstance(dist, TorchDistSource) and isinstance(legacy, MegatronSource)
    assert dist.iteration == ITERATION and dist.spec == legacy.spec
    seen: list[tuple[str, tuple[int, ...]]] = []
    real_read = dist.reader.read_data

    def spy(plan, planner):
        seen.extend((it.storage_index.fqn, tuple(it.storage_index.offset)) for it in plan.items)
        return real_read(plan, planner)

    dist.reader.read_data = spy
    for unit in dist.units():
        seen.clear()
        got, want = dist.read_mcore(unit), legacy.read_mcore(unit)
        assert got.keys() == want.keys()
        for k in want:
            assert torch.equal(got[k], want[k]), (unit, k)
        if isinstance(unit, int):  # stacked [num_layers, ...] tensors: only this layer's chunks were opened
            assert seen and all(off[0] == unit for fqn, off in seen if fqn.startswith("decoder.layers."))


def _wrong_ffn_args(d: Path) -> None:
    from mconvert.io import repickle
    from mconvert.io.safeload import safe_load

    common = safe_load(d / "common.pt")
    common["args"].ffn_hidden_size *= 2
    repickle.save(common, d / "common.pt")  # the args' enums (safe_load's stand-ins) written back as they were


@pytest.mark.slow
def test_torch_dist_damage_is_one_line_errors(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    import shutil

    from mconvert.convert.megatron.torch_dist import TorchDistSource
    from mconvert.errors import MConvertError

    _, _, _, _, dist_root = _saved("llama", 1, tmp_path_factory)

    def damaged(name: str, fn) -> Path:
        root = tmp_path / name
        shutil.copytree(dist_root, root)
        fn(root / f"iter_{ITERATION:07d}")
        return root

    cases = {
        "no common.pt": (lambda d: (d / "common.pt").unlink(), "common.pt"),
        "zarr backend": (lambda d: (d / "metadata.json").write_text('{"sharded_backend": "zarr"}'), "zarr"),
        "no .metadata": (lambda d: (d / ".metadata").unlink(), ".metadata"),
        "truncated distcp": (lambda d: (d / "__1_0.distcp").write_bytes(b"x" * 10), "distcp"),
        "args disagree": (_wrong_ffn_args, "disagree"),
    }
    for name, (fn, needle) in cases.items():
        root = damaged(name.replace(" ", "_"), fn)
        with pytest.raises(MConvertError) as e:
            src = TorchDistSource(root)
            for unit in src.units():
                src.read_mcore(unit)
        msg = str(e.value)
        assert needle in msg and "\n" not in msg, (name, msg)


def _state_and_logits(ctx: McoreContext, tokens: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    _perturb(ctx)
    return dict(ctx.model.state_dict()), ctx.logits(tokens)


@pytest.mark.slow
def test_mcore_ref_pipeline_forward_equals_one_stage() -> None:
    """The harness's PP=2 forward (activations passed stage to stage) gives megatron-core's PP=1 logits."""
    import re

    spec = SPECS["llama"]
    tokens = torch.randint(0, spec.vocab_size, (2, 8), generator=torch.Generator().manual_seed(11))
    staged = run_mcore(spec, 2, _state_and_logits, (tokens,), pp=2)  # ranks: pp0 tp0, pp0 tp1, pp1 tp0, pp1 tp1
    per_stage = spec.num_layers // 2
    merged = []
    for t in range(2):
        sd = dict(staged[t][0])
        for k, v in staged[2 + t][0].items():
            m = re.match(r"decoder\.layers\.(\d+)\.(.*)", k)
            sd[f"decoder.layers.{int(m.group(1)) + per_stage}.{m.group(2)}" if m else k] = v
        merged.append(sd)
    from mcore_ref import mcore_forward_logits

    one_stage = mcore_forward_logits(spec, 2, tokens, merged, pp=1)
    assert staged[0][1] is None and torch.equal(one_stage, staged[-1][1])


@pytest.mark.slow
@pytest.mark.parametrize("family", ["mistral-swa", "qwen2-swa"])
def test_megatron_core_sliding_window_converts_to_matching_hf(family: str, tmp_path: Path,
                                                              tmp_path_factory: pytest.TempPathFactory) -> None:
    """megatron-core's `window_size` (and `window_attn_skip_freq`) on a sequence longer than the window: the HF
    export matches over the whole sequence; the same export with its window switched off (the control) matches
    up to the window's length and differs beyond it."""
    import json

    spec, tokens, logits_mcore, torch_root, dist_root = _saved(family, 1, tmp_path_factory)
    keys = spec.window_size + 1
    assert tokens.shape[1] > keys
    ref = logits_mcore[..., : spec.vocab_size]
    scale = ref.abs().max().item()
    for kind, root in (("torch", torch_root), ("torch_dist", dist_root)):
        out = tmp_path / f"hf_{kind}"
        cli_main(["megatron-to-hf", str(root), str(out)])
        cfg = json.loads((out / "config.json").read_text())
        assert cfg["sliding_window"] == keys
        logits = hf_logits(out, tokens)
        diff = (logits - ref).abs().max().item()
        print(f"{family} {kind} ({cfg['architectures'][0]}): max|hf - mcore| = {diff:.3e}, max|logit| = {scale:.3f}")
        assert diff <= 1e-4 * scale, f"{family} {kind}: max abs diff {diff} > 1e-4 * {scale}"
        assert torch.equal(logits.argmax(-1), ref.argmax(-1))
    cfg.update(sliding_window=None, use_sliding_window=False)
    cfg.pop("layer_types", None)
    (out / "config.json").write_text(json.dumps(cfg))
    full = hf_logits(out, tokens)
    inside = (full[:, :keys] - ref[:, :keys]).abs().max().item()
    beyond = (full[:, keys:] - ref[:, keys:]).abs().max().item()
    print(f"{family} control without the window: within the window {inside:.3e}, beyond it {beyond:.3e}")
    assert inside <= 1e-4 * scale
    assert beyond > 1e-2 * scale, "the window changed nothing: the test sequence does not prove it"
