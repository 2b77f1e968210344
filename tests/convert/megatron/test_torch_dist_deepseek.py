"""torch_dist checkpoints of the DeepSeek-V3 architecture (MLA, sigmoid router with expert bias, shared experts, a
dense first layer by a `moe_layer_freq` list, one MTP layer) and of GLM-4.5 (qkv bias, qk-norm, the same router,
MTP), proven against megatron-core 0.16.1's own `dist_checkpointing.save`: with a `moe_layer_freq` list
megatron-core keys layers one by one (`decoder.layers.<N>.…`, the routed experts stacked over experts only), keeps
MLA's norms under their own names, and keys each MTP layer apart (`mtp.layers.<K>.{enorm,hnorm,eh_proj,
final_layernorm}`, its transformer layer as a per-layer decoder layer under `mtp.layers.<K>.transformer_layer.`).

- our torch -> torch_dist reshard of megatron-core's legacy save, and hf -> torch_dist of its HF export, have the
  `.metadata` of megatron-core's `dist_checkpointing.save` of the same model (keys, shapes, chunk boxes,
  `_extra_state` entries) and its values;
- megatron-core's own torch_dist save converts to the HF bytes its legacy save converts to (the MTP layer at
  DeepSeek's `model.layers.<num_layers>.*`), and transformers' logits of them are megatron-core's;
- torch_dist -> torch gives back the legacy rank files' tensors in megatron-core's key order (MLA); torch ⇄ torch_dist round
  trips give the bytes;
- a torch_dist save whose MTP keys are gone is refused by name.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from mcore_ref import McoreContext, perturb, run_mcore, save_checkpoints
from safetensors.torch import load_file
from test_torch_dist_write import _dcp_read_all, _summary

from mconvert.convert.verbs import megatron_to_hf, reshard
from mconvert.io.safeload import safe_load
from mconvert.layouts.megatron import rank_file
from mconvert.convert.megatron.torch_dist import TorchDistSource
from mconvert.mappings.families import preset

pytestmark = pytest.mark.slow
ITERATION = 5
TP = 2
FAMILIES = ("tiny-deepseek-v3", "tiny-glm45")  # layers: dense, MoE, MoE; one MTP layer (MoE)


def _save_both(ctx: McoreContext, root: str, tokens: torch.Tensor) -> torch.Tensor:
    """Per rank: weights off their init (and a non-zero expert bias), the legacy rank file and megatron-core's
    torch_dist save of the same model; the main head's logits."""
    perturb(ctx)
    for name, buf in ctx.model.named_buffers():
        if name.endswith("expert_bias"):
            buf.copy_(0.3 * torch.arange(buf.numel(), dtype=buf.dtype).remainder(5))
    save_checkpoints(ctx, root, ITERATION, torch_dist=True)
    seen: list[torch.Tensor] = []  # copies: megatron-core's cross-entropy works on the logits in place
    ctx.model.output_layer.register_forward_hook(lambda mod, args, out: seen.append(out[0].detach().clone()))
    b, s = tokens.shape
    pos = torch.arange(s).unsqueeze(0).expand(b, -1)
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)[None, None]
    with torch.no_grad():  # a forward with MTP layers needs labels; the main head runs last
        ctx.model(tokens, pos, mask, labels=tokens, runtime_gather_output=True)
    return seen[-1].transpose(0, 1).float()


@pytest.fixture(scope="module", params=FAMILIES)
def saved(request, tmp_path_factory) -> tuple[Path, torch.Tensor, torch.Tensor]:
    spec = preset(request.param)
    assert spec.mtp_num_layers == 1
    root = tmp_path_factory.mktemp(request.param) / "ckpt"
    tokens = torch.randint(0, spec.vocab_size, (2, 12), generator=torch.Generator().manual_seed(7))
    logits = run_mcore(spec, TP, _save_both, (str(root), tokens))[0][..., : spec.vocab_size]
    return root, tokens, logits


VOCAB_ROWS = ("embedding.word_embeddings.weight", "output_layer.weight")


def _same_dist(ours_dir: Path, ref_dir: Path, vocab: int | None = None) -> None:
    """`.metadata` as data and every entry's value equal to megatron-core's save (with `vocab`: the vocab rows up
    to it; an HF export carries no padding rows)."""
    ours, ref = _summary(ours_dir), _summary(ref_dir)
    assert sorted(set(ours) ^ set(ref)) == []
    assert ours == ref
    a, b = _dcp_read_all(ours_dir), _dcp_read_all(ref_dir)
    for k in b:
        if vocab is not None and k in VOCAB_ROWS:
            a[k], b[k] = a[k][:vocab], b[k][:vocab]
        assert (torch.equal(a[k], b[k]) if isinstance(b[k], torch.Tensor) else a[k] == b[k]), k


def _ref_dir(root: Path) -> Path:
    return Path(str(root) + "_dist") / f"iter_{ITERATION:07d}"


def test_torch_dist_of_a_moe_layer_freq_list_is_megatron_cores_save(saved, tmp_path):
    root, _, _ = saved
    out = tmp_path / "ours"
    reshard(root, out, tp=TP, pp=1, format="torch_dist")
    ref = _summary(_ref_dir(root))
    assert "decoder.layers.1.mlp.experts.experts.linear_fc1.weight" in ref  # per layer, experts stacked
    assert "mtp.layers.0.transformer_layer.mlp.experts.experts.linear_fc1.weight" in ref
    assert "mtp.layers.0.eh_proj._extra_state/shard_0_1" in ref
    _same_dist(out / f"iter_{ITERATION:07d}", _ref_dir(root))


def test_megatron_cores_torch_dist_save_converts_to_the_same_hf(saved, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    root, tokens, ref = saved
    megatron_to_hf(root, tmp_path / "legacy")
    megatron_to_hf(Path(str(root) + "_dist"), tmp_path / "dist")
    a, b = (load_file(tmp_path / d / "model.safetensors") for d in ("legacy", "dist"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(k.endswith("e_score_correction_bias") and a[k].abs().max() > 0 for k in a)
    n = AutoConfig.from_pretrained(tmp_path / "dist").num_hidden_layers
    mtp = {k for k in b if k.startswith(f"model.layers.{n}.")}  # the MTP layer, at DeepSeek's names
    assert {f"model.layers.{n}.{s}" for s in ("enorm.weight", "hnorm.weight", "eh_proj.weight",
                                                "shared_head.norm.weight", "mlp.experts.3.up_proj.weight")} <= mtp
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "dist", torch_dtype=torch.float32).eval()
    with torch.no_grad():
        got = model(tokens).logits.float()
    assert (got - ref).abs().max() <= 1e-4 * ref.abs().max()


def test_torch_dist_back_to_rank_files_gives_the_legacy_tensors_in_megatron_cores_order(saved, tmp_path):
    """megatron-core's torch_dist save -> torch: its legacy rank files' tensors, in its key order (MLA's linears
    before its latent norms, a layer's shared experts after its routed experts, the MTP layer before the head);
    the standard attention's linear_qkv comes before linear_proj, as ModelSpec and the trainer declare it."""
    root, _, _ = saved
    reshard(Path(str(root) + "_dist"), tmp_path / "torch", tp=TP, pp=1, format="torch")
    for t in range(TP):
        want = safe_load(rank_file(root, ITERATION, t, 0, 1))["model"]
        got = safe_load(rank_file(tmp_path / "torch", ITERATION, t, 0, 1))["model"]
        tensors = {k for k, v in want.items() if isinstance(v, torch.Tensor)}
        assert tensors == {k for k, v in got.items() if isinstance(v, torch.Tensor)}
        assert all(torch.equal(want[k], got[k]) for k in tensors)
        assert {k: v for k, v in want.items() if k not in tensors} == {k: v for k, v in got.items() if k not in tensors}
        if any(".linear_kv_down_proj." in k for k in want):
            assert list(got) == list(want)
        else:
            def order(keys):
                return [k for k in keys if ".self_attention." not in k]
            assert order(got) == order(want)


def test_hf_to_torch_dist_is_megatron_cores_save_and_back_gives_the_hf_bytes(saved, tmp_path):
    """HF -> torch_dist at TP=2: megatron-core's own save (MTP layer included); at TP=2 EP=2 back to HF: the
    same safetensors, byte for byte."""
    from mconvert.convert.verbs import hf_to_megatron

    root, _, _ = saved
    megatron_to_hf(root, tmp_path / "hf")
    hf_to_megatron(tmp_path / "hf", tmp_path / "tp2", tp=TP, format="torch_dist")
    _same_dist(tmp_path / "tp2" / "release", _ref_dir(root), TorchDistSource(tmp_path / "tp2").spec.vocab_size)
    hf_to_megatron(tmp_path / "hf", tmp_path / "d", tp=2, ep=2, format="torch_dist")
    megatron_to_hf(tmp_path / "d", tmp_path / "back")
    a, b = ((tmp_path / d / "model.safetensors").read_bytes() for d in ("hf", "back"))
    assert a == b


def _files(d: Path) -> dict[str, bytes]:
    return {str(f.relative_to(d)): f.read_bytes() for f in sorted(d.rglob("*")) if f.is_file()}


def test_torch_and_torch_dist_round_trips_give_the_bytes(saved, tmp_path):
    """torch -> torch_dist -> torch gives the rank files, torch_dist -> torch -> torch_dist the DCP files, byte
    for byte, with the MTP layer."""
    root, _, _ = saved
    reshard(Path(str(root) + "_dist"), tmp_path / "t", tp=TP, pp=1, format="torch")
    reshard(tmp_path / "t", tmp_path / "d", tp=TP, pp=1, format="torch_dist")
    reshard(tmp_path / "d", tmp_path / "t2", tp=TP, pp=1, format="torch")
    reshard(tmp_path / "t2", tmp_path / "d2", tp=TP, pp=1, format="torch_dist")
    t, t2 = _files(tmp_path / "t" / f"iter_{ITERATION:07d}"), _files(tmp_path / "t2" / f"iter_{ITERATION:07d}")
    assert t.keys() == t2.keys() and all(t[k] == t2[k] for k in t)
    d, d2 = _files(tmp_path / "d" / f"iter_{ITERATION:07d}"), _files(tmp_path / "d2" / f"iter_{ITERATION:07d}")
    assert d.keys() == d2.keys() and all(d[k] == d2[k] for k in d)
    assert any(k.startswith("mtp.layers.0.") for k in safe_load(rank_file(tmp_path / "t2", ITERATION, 0, 0, 1))["model"])


def test_a_torch_dist_save_without_its_mtp_keys_is_refused(saved, tmp_path):
    """Control: megatron-core's save with every `mtp.layers.*` entry dropped from `.metadata` (its args still
    say mtp_num_layers=1) is refused by name, nothing written."""
    import pickle
    import shutil

    from mconvert.errors import MConvertError
    from mconvert.io.safeload import safe_load_dcp_metadata

    root, _, _ = saved
    src = tmp_path / "cut"
    shutil.copytree(Path(str(root) + "_dist"), src)
    md_file = src / f"iter_{ITERATION:07d}" / ".metadata"
    md = safe_load_dcp_metadata(md_file)
    md.state_dict_metadata = {k: v for k, v in md.state_dict_metadata.items() if not k.startswith("mtp.")}
    md.storage_data = {k: v for k, v in md.storage_data.items() if not k.fqn.startswith("mtp.")}
    with open(md_file, "wb") as f:
        pickle.dump(md, f)
    with pytest.raises(MConvertError, match=r"no tensor for 'mtp\.layers\.0\..*mtp_num_layers=1"):
        megatron_to_hf(src, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
