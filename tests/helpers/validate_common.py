"""Shared builders of the validate / verify / vLLM tests: trained tiny checkpoints (the built-in trainer), their
correct exports in every format (the conversion engine), and broken copies of a correct HF export, each
made the way a buggy converter would write it (with a consistent manifest, so only the targeted check can
catch it). Everything is built once per test process and cached.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from functools import lru_cache
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from scratch import scratch_dir

WORK = scratch_dir("mconvert-validate-", __name__)

# family -> (preset, training TP, training PP)
TRAINED = {"llama": ("tiny-llama", 2, 2), "gpt2": ("tiny-gpt2", 2, 1), "llama3": ("tiny-llama3", 2, 2),
           "qwen3": ("tiny-qwen3", 2, 2), "mistral-swa": ("tiny-mistral-swa", 2, 1)}


@lru_cache(maxsize=None)
def trained_ckpt(family: str) -> Path:
    """A tiny model trained a few steps by the built-in trainer at TP/PP > 1 (Megatron legacy layout)."""
    from mconvert.trainer.train import TrainConfig, train

    preset, tp, pp = TRAINED[family]
    out = WORK / f"ckpt-{family}"
    train(TrainConfig(preset=preset, tp=tp, pp=pp, steps=4, save=str(out), quiet=True, device="cpu",
                      global_batch_size=8, seq_length=32))
    return out


@lru_cache(maxsize=None)
def hf_export(family: str, shard: str = "5GB") -> Path:
    """The checkpoint converted to HF by `megatron-to-hf` (tokenizer carried, manifest written)."""
    from mconvert.convert.verbs import megatron_to_hf

    out = WORK / f"hf-{family}-{shard}"
    megatron_to_hf(trained_ckpt(family), out, max_shard_size=shard)
    return out


@lru_cache(maxsize=None)
def resharded(family: str, tp: int, pp: int) -> Path:
    from mconvert.convert.verbs import reshard

    out = WORK / f"ckpt-{family}-tp{tp}pp{pp}"
    reshard(trained_ckpt(family), out, tp=tp, pp=pp)
    return out


@lru_cache(maxsize=None)
def onnx_export(family: str) -> Path:
    from mconvert.convert.verbs import to_onnx
    from mconvert.validators.onnx_runner import check_onnx_against_hf

    out = WORK / f"onnx-{family}"
    to_onnx(hf_export(family), out, with_past=False, check=check_onnx_against_hf)
    return out


@lru_cache(maxsize=None)
def ft_export(family: str, infer_tp: int, dtype: str = "fp32") -> Path:
    from mconvert.convert.verbs import megatron_to_ft

    out = WORK / f"ft-{family}-{infer_tp}-{dtype}"
    megatron_to_ft(trained_ckpt(family), out, infer_tp, dtype)
    return out


@lru_cache(maxsize=None)
def trtllm_export(family: str, tp: int) -> Path:
    from mconvert.convert.verbs import megatron_to_trtllm

    out = WORK / f"trtllm-{family}-{tp}"
    megatron_to_trtllm(trained_ckpt(family), out, tp)
    return out


# ---- mixture of experts, written by megatron-core itself ----------------------------------------------
# family -> (preset, TP, EP) of megatron-core's MoE GPTModel run (SequentialMLP experts, allgather dispatcher)
MCORE_MOE = {"mixtral": ("tiny-mixtral", 1, 2), "qwen3_moe": ("tiny-qwen3-moe", 2, 2)}
MOE_ITERATION = 1


def _mcore_save(ctx, root: str) -> None:
    """Per rank: perturb megatron-core's model, save its own state dict as Megatron-LM names the rank file."""
    from mcore_ref import perturb, save_checkpoints

    perturb(ctx)
    save_checkpoints(ctx, root, MOE_ITERATION, params_dtype=torch.float32)


def _mcore_greedy(ctx, root: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Per rank: strict-load this rank's file of the checkpoint, then megatron-core's greedy tokens."""
    from mcore_ref import greedy

    from mconvert.io.safeload import safe_load
    from mconvert.layouts.megatron import rank_file

    ctx.model.load_state_dict(safe_load(rank_file(root, MOE_ITERATION, ctx.tp_rank, 0, 1, ctx.ep_rank,
                                                  ctx.ep))["model"], strict=True)
    return greedy(ctx, prompts, max_tokens)


@lru_cache(maxsize=None)
def mcore_moe_ckpt(family: str) -> Path:
    """A MoE checkpoint written by megatron-core's own GPTModel at TP × EP (legacy rank files `mp_rank_TT_EEE`)."""
    from mcore_ref import run_mcore

    from mconvert.mappings.families import preset

    name, tp, ep = MCORE_MOE[family]
    out = WORK / f"mcore-{family}"
    run_mcore(preset(name), tp, _mcore_save, (str(out),), ep=ep)
    return out


def mcore_moe_greedy(family: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """megatron-core's greedy tokens for `prompts`, from the rank files of `mcore_moe_ckpt(family)`."""
    from mcore_ref import run_mcore

    from mconvert.mappings.families import preset

    name, tp, ep = MCORE_MOE[family]
    return run_mcore(preset(name), tp, _mcore_greedy, (str(mcore_moe_ckpt(family)), prompts, max_tokens), ep=ep)[0]


@lru_cache(maxsize=None)
def mcore_moe_export(family: str) -> Path:
    """megatron-core's MoE checkpoint converted by `megatron-to-hf`."""
    from mconvert.convert.verbs import megatron_to_hf

    out = WORK / f"hf-mcore-{family}"
    megatron_to_hf(mcore_moe_ckpt(family), out)
    return out


@lru_cache(maxsize=None)
def moved_ckpt(name: str) -> Path:
    """`moved_off_init_ckpt(name)` (MTP layer included) with the trainer's tokenizer beside it."""
    from mconvert.data import build_tokenizer, save_hf_tokenizer

    out = WORK / f"moved-{name}"
    shutil.copytree(moved_off_init_ckpt(name), out, dirs_exist_ok=True)
    save_hf_tokenizer(build_tokenizer(), out)
    return out


@lru_cache(maxsize=None)
def moved_export(name: str) -> Path:
    """`moved_ckpt(name)` converted by `megatron-to-hf`."""
    from mconvert.convert.verbs import megatron_to_hf

    out = WORK / f"hf-moved-{name}"
    megatron_to_hf(moved_ckpt(name), out)
    return out


# ---- broken exports ------------------------------------------------------------------------------
GLM_SPECIAL = ("[gMASK]", "<|user|>", "<|observation|>")  # the added tokens llama.cpp's GLM converter looks up


@lru_cache(maxsize=None)
def glm_tokenizer() -> Path:
    """The trainer's byte-level BPE (990 pieces) with GLM's added special tokens, as transformers saves it."""
    from transformers import PreTrainedTokenizerFast

    from mconvert.data import EOS, build_tokenizer

    out = WORK / "tok-glm"
    fast = PreTrainedTokenizerFast(tokenizer_object=build_tokenizer(990)._tokenizer, bos_token=EOS, eos_token=EOS,
                                   unk_token=EOS)
    fast.add_special_tokens({"additional_special_tokens": list(GLM_SPECIAL)})
    fast.save_pretrained(str(out))
    return out


@lru_cache(maxsize=None)
def moved_off_init_ckpt(preset_name: str, **changes) -> Path:
    """A one-rank Megatron checkpoint of the trainer's model of `preset_name` (with `changes` to its spec) with
    every weight moved off its init (norms around 1, a non-negative expert bias, so routing depends on it), MTP
    layers included."""
    from mconvert.layouts.megatron import rank_file, save_rank_file, write_latest
    from mconvert.mappings.families import preset
    from mconvert.trainer.model import GPTModel
    from mconvert.trainer.parallel import ParallelState

    spec = preset(preset_name).replace(**changes)
    g = torch.Generator().manual_seed(7)
    state = {}
    for k, v in GPTModel(spec, ParallelState(), seed=3).state_dict().items():
        if not torch.is_tensor(v):
            continue
        noise = torch.randn(v.shape, generator=g)
        state[k] = (0.3 * noise.abs() if k.endswith("expert_bias") else
                    1 + 0.2 * noise if k.endswith("norm.weight") else v + 0.05 * noise)
    tag = hashlib.sha256(repr(sorted(changes.items())).encode()).hexdigest()[:8] if changes else "preset"
    out = WORK / f"ckpt-{preset_name}-moved-{tag}"
    save_rank_file(rank_file(out, 1, 0, 0, 1), {"args": spec.to_megatron_args(), "checkpoint_version": 3.0,
                                                "iteration": 1, "model": state})
    write_latest(out, 1)
    return out


def _copy(src: Path, name: str) -> Path:
    dst = WORK / "broken" / name
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    return dst


def _edit_tensors(d: Path, fn) -> None:
    """Apply `fn(dict) -> dict` to the tensors of every shard of `d`, rewriting index and manifest."""
    index = d / "model.safetensors.index.json"
    files = sorted(d.glob("*.safetensors"))
    all_t: dict[str, torch.Tensor] = {}
    for f in files:
        all_t.update(load_file(str(f)))
    new = fn(dict(all_t))
    if index.is_file():
        idx = json.loads(index.read_text())
        wmap = idx["weight_map"]
        first = sorted(set(wmap.values()))[0]
        by_file: dict[str, dict] = {}
        for k, v in new.items():
            by_file.setdefault(wmap.get(k, first), {})[k] = v.contiguous()
        for f in files:
            f.unlink()
        for fname, tensors in by_file.items():
            save_file(tensors, str(d / fname), metadata={"format": "pt"})
        idx["weight_map"] = {k: wmap.get(k, first) for k in new}
        index.write_text(json.dumps(idx, indent=2))
    else:
        save_file({k: v.contiguous() for k, v in new.items()}, str(files[0]), metadata={"format": "pt"})


def _edit_config(d: Path, **changes) -> None:
    p = d / "config.json"
    cfg = json.loads(p.read_text())
    cfg.update(changes)
    p.write_text(json.dumps(cfg, indent=2))


def _remanifest(d: Path) -> Path:
    from mconvert.io.atomic import write_manifest

    write_manifest(d)
    return d


def broken_mla(kind: str) -> Path:
    """A copy of the `tiny-deepseek-v3` export with one multi-latent-attention bug (manifest consistent):
    "kv-b-nope-v-swapped" (each head's k_nope and v rows of kv_b_proj swapped), "rope-rows-deinterleaved" (the
    rope rows of q_b_proj and kv_a_proj_with_mqa written even dims first, as megatron-core rotates them, under
    `rope_interleave: true`) or "rope-interleave-false" (the config says so; the weights are right)."""
    d = _copy(moved_export("tiny-deepseek-v3"), kind)
    cfg = json.loads((d / "config.json").read_text())
    heads, nope, rope, v = (cfg[k] for k in ("num_attention_heads", "qk_nope_head_dim", "qk_rope_head_dim",
                                              "v_head_dim"))
    assert nope == v  # a swap that keeps the shapes: only the outputs can show it
    layers = range(cfg["num_hidden_layers"] + cfg.get("num_nextn_predict_layers", 0))
    deinterleave = torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)])

    def fn(t):
        for i in layers:
            a = f"model.layers.{i}.self_attn."
            if kind == "kv-b-nope-v-swapped":
                w = t[a + "kv_b_proj.weight"].view(heads, nope + v, -1)
                t[a + "kv_b_proj.weight"] = torch.cat([w[:, nope:], w[:, :nope]], 1).reshape(heads * (nope + v), -1)
            else:
                q = t[a + "q_b_proj.weight"].view(heads, nope + rope, -1)
                t[a + "q_b_proj.weight"] = torch.cat([q[:, :nope], q[:, nope:][:, deinterleave]], 1).flatten(0, 1)
                kv = t[a + "kv_a_proj_with_mqa.weight"]
                lat = kv.shape[0] - rope
                t[a + "kv_a_proj_with_mqa.weight"] = torch.cat([kv[:lat], kv[lat:][deinterleave]])
        return t
    if kind == "rope-interleave-false":
        _edit_config(d, rope_interleave=False)
    elif kind in ("kv-b-nope-v-swapped", "rope-rows-deinterleaved"):
        _edit_tensors(d, fn)
    else:
        raise KeyError(kind)
    return _remanifest(d)


def broken(kind: str) -> Path:
    """A copy of a correct export with one bug, as a buggy converter would write it (manifest consistent)."""
    fam = "gpt2" if kind == "untied-gpt2-head" else "llama"
    sharded = kind in ("missing-shard", "stray-shard")
    d = _copy(hf_export(fam, "200KB") if sharded else hf_export(fam), kind)
    cfg = json.loads((d / "config.json").read_text())
    hd = cfg.get("head_dim") or 0
    if kind == "gqa-groups-permuted":
        def fn(t):  # swap KV groups 0 and 1 in layer 0 (queries keep their order)
            for n in ("k_proj", "v_proj"):
                w = t[f"model.layers.0.self_attn.{n}.weight"]
                t[f"model.layers.0.self_attn.{n}.weight"] = torch.cat([w[hd:2 * hd], w[:hd], w[2 * hd:]])
            return t
        _edit_tensors(d, fn)
    elif kind == "swiglu-halves-swapped":
        def fn(t):  # TP=2 fc1 ranks [g0; u0], [g1; u1] concatenated then chunked: gate=[g0; u0], up=[g1; u1]
            for i in range(cfg["num_hidden_layers"]):
                g, u = t[f"model.layers.{i}.mlp.gate_proj.weight"], t[f"model.layers.{i}.mlp.up_proj.weight"]
                h = g.shape[0] // 2
                t[f"model.layers.{i}.mlp.gate_proj.weight"] = torch.cat([g[:h], u[:h]])
                t[f"model.layers.{i}.mlp.up_proj.weight"] = torch.cat([g[h:], u[h:]])
            return t
        _edit_tensors(d, fn)
    elif kind == "vocab-padding-left-in":
        pad = 1024 - cfg["vocab_size"]

        def fn(t):  # Megatron's zero padding rows kept
            for k in ("model.embed_tokens.weight", "lm_head.weight"):
                t[k] = torch.cat([t[k], torch.zeros(pad, t[k].shape[1], dtype=t[k].dtype)])
            return t
        _edit_tensors(d, fn)
        _edit_config(d, vocab_size=1024)
    elif kind == "wrong-rms-norm-eps":
        _edit_config(d, rms_norm_eps=1e-6)  # HF's default instead of Megatron's 1e-5
    elif kind == "untied-gpt2-head":
        def fn(t):
            t["lm_head.weight"] = t["transformer.wte.weight"] + 0.01 * torch.randn_like(t["transformer.wte.weight"])
            return t
        _edit_tensors(d, fn)
        _edit_config(d, tie_word_embeddings=False)
    elif kind == "missing-shard":
        shards = sorted(d.glob("model-*.safetensors"))
        assert len(shards) >= 2, shards
        shards[-1].unlink()
    elif kind == "stray-shard":
        shards = sorted(d.glob("model-*.safetensors"))
        shutil.copy(shards[0], d / "model-extra-00001.safetensors")
    elif kind == "llama-model-architecture":
        _edit_config(d, architectures=["LlamaModel"])
    elif kind == "untied-lm-head-missing":
        def fn(t):
            t.pop("lm_head.weight")
            return t
        _edit_tensors(d, fn)
    elif kind == "tied-config-different-head":
        _edit_config(d, tie_word_embeddings=True)
    elif kind == "weight-perturbed-1e-3":
        def fn(t):
            k = "model.layers.1.mlp.down_proj.weight"
            t[k] = t[k] + 1e-3
            return t
        _edit_tensors(d, fn)
    else:
        raise KeyError(kind)
    return _remanifest(d)


# kind -> the check that must name it
BROKEN = {
    "gqa-groups-permuted": "logits",
    "swiglu-halves-swapped": "logits",
    "vocab-padding-left-in": "config-vs-checkpoint",
    "wrong-rms-norm-eps": "config-vs-checkpoint",
    "untied-gpt2-head": "tied-head",
    "missing-shard": "weight-files",
    "stray-shard": "weight-files",
    "llama-model-architecture": "architecture",
    "untied-lm-head-missing": "tied-head",
    "tied-config-different-head": "tied-head",
    "weight-perturbed-1e-3": "logits",
}
