"""Run one model, in its own format, on a token batch: logits [B, S, V] (float32, CPU) and, where the
engine exposes them, per-layer hidden states.

Megatron checkpoints run natively at their own TP/PP (the trainer's model across processes), HF dirs
through transformers, FT dirs through the FT reference runner, ONNX through onnxruntime.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from mconvert.io.paths import check_tree_contained
from mconvert.convert.sources import open_source
from mconvert.errors import MConvertError
from mconvert.mappings.families import hf_config
from mconvert.spec import torch_dtype
from mconvert.trainer.infer import megatron_logits
from mconvert.validators.formats import ModelInfo, reference_attention, reference_config, stand_in_model_type
from mconvert.validators.ft_runner import ft_logits
from mconvert.validators.gguf_runner import gguf_logits
from mconvert.validators.onnx_runner import onnx_logits
from mconvert.validators.trtllm_runner import trtllm_logits


@dataclass
class RunOutput:
    logits: torch.Tensor  # [B, S, V] float32 on CPU (V: the model's own vocab, padding stripped for Megatron)
    hidden: list[torch.Tensor] | None  # per-layer hidden states [B, S, H] (embeddings first) or None
    seconds: float
    dtype: str | None = None  # the dtype the engine computed in, where it says (else the one `describe` read)


def resolve_device(device: str) -> str:
    """`auto` takes the GPU when one is visible; `cuda` without one is a one-line error."""
    if device not in ("auto", "cpu", "cuda"):
        raise MConvertError(f"--device {device!r}: choose auto, cpu or cuda")
    has_cuda = torch.cuda.is_available()
    if device == "cuda" and not has_cuda:
        raise MConvertError("--device cuda: no CUDA GPU is visible to torch on this machine; use --device cpu or auto")
    if device == "auto":
        return "cuda" if has_cuda else "cpu"
    return device


def run_model(info: ModelInfo, tokens: torch.Tensor, device: str) -> RunOutput:
    """Logits of `info`'s model on `tokens`, computed by that format's own engine."""
    t0 = time.perf_counter()
    hidden = None
    dtype = None
    if info.format == "hf":
        logits, hidden, dtype = hf_logits(info.path, tokens, device)
    elif info.format == "megatron":
        it = info.layout.get("iteration")
        logits, hidden = megatron_logits(info.path, tokens, iteration=it, device=device, return_hidden=True)
    elif info.format == "megatron-torch_dist":
        logits = source_logits(info.path, tokens, device)
    elif info.format == "ft":
        logits = ft_logits(info.path, tokens, device)
    elif info.format == "onnx":
        logits = onnx_logits(info.path, tokens, device)
    elif info.format == "gguf":
        logits = gguf_logits(info.path, tokens)  # llama.cpp itself, in its own venv (make gguf-env)
    elif info.format == "trtllm":
        # the rank files combined as TensorRT-LLM's ColumnLinear / RowLinear do (the engine itself needs a GPU build)
        logits = trtllm_logits(info.path, tokens, device)
    else:
        raise MConvertError(f"{info.path}: format {info.format!r} cannot be run")
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3:
        raise MConvertError(f"{info.path}: the {info.format} runner returned no [B, S, V] logits")
    logits = logits.detach().float().cpu()
    if info.format.startswith("megatron") and info.vocab_size and logits.shape[-1] > info.vocab_size:
        logits = logits[..., : info.vocab_size]  # Megatron pads the vocab; the padding rows are not the model's
    if logits.shape[:2] != tokens.shape:
        raise MConvertError(
            f"{info.path}: logits shape {tuple(logits.shape)} does not match tokens {tuple(tokens.shape)}"
        )
    return RunOutput(logits=logits, hidden=hidden, seconds=time.perf_counter() - t0, dtype=dtype)


def hf_logits(path: Path, tokens: torch.Tensor, device: str) -> tuple[torch.Tensor, list[torch.Tensor] | None, str]:
    """Logits, hidden states and the dtype transformers computed in (the one its config resolves to: `dtype`
    wins over `torch_dtype`, so `describe`'s reading of the config can differ).

    Hidden states are captured by hooks as the Megatron runner records them: the first layer's input
    (the embedding output), then every layer's output before the final norm."""
    # heavy optional import: transformers loads only when a model is run
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    check_tree_contained(path, f"{path}: model file")  # transformers opens the files by name
    verbosity = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype="auto", local_files_only=True,
                                                     trust_remote_code=False, **reference_attention(path),
                                                     **reference_config(path))
    except Exception as e:  # a broken dir: missing shard, bad config ... -> one line
        raise MConvertError(f"{path}: transformers cannot load this dir ({_first_line(e)})") from None
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
    model.eval().to(device)
    hidden: list[torch.Tensor] = []
    layers = _decoder_layers(model)
    hooks = []
    if layers is not None:
        def pre(_m, args, kwargs):
            x = args[0] if args else kwargs.get("hidden_states")
            hidden.append(x.detach().float().cpu())

        def post(_m, _args, out):
            x = out[0] if isinstance(out, tuple) else out
            hidden.append(x.detach().float().cpu())

        hooks.append(layers[0].register_forward_pre_hook(pre, with_kwargs=True))
        hooks += [layer.register_forward_hook(post) for layer in layers]
    try:
        with torch.inference_mode():
            out = model(input_ids=tokens.to(device), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return out.logits.float().cpu(), (hidden or None), str(model.dtype).removeprefix("torch.")


def _decoder_layers(model) -> list | None:
    for path in ("model.layers", "transformer.h"):
        obj = model
        for part in path.split("."):
            obj = getattr(obj, part, None)
        if obj is not None:
            return list(obj)
    return None


def source_logits(path: Path, tokens: torch.Tensor, device: str) -> torch.Tensor:
    """Logits of any Source (e.g. torch_dist) via its HF-named tensors loaded into the transformers class."""
    model = source_model(path, device)
    with torch.inference_mode():
        return model(input_ids=tokens.to(device), use_cache=False).logits.float().cpu()


def source_model(path: Path, device: str = "cpu"):
    """The transformers model of any Source (Megatron torch or torch_dist, HF), its weights read through the
    family's HF mapping."""
    # heavy optional import: transformers loads only when a model is run
    from transformers import AutoConfig, AutoModelForCausalLM

    # heavy optional import: transformers loads only when a model is run
    from transformers.modeling_utils import no_init_weights

    state = {}
    with open_source(path) as src:  # its rank / safetensors files close once the weights are read, or on an error
        cfg_dict = hf_config(src.spec)
        model_type = stand_in_model_type(cfg_dict.pop("model_type"))
        cfg_dict.pop("architectures", None)
        cfg = AutoConfig.for_model(model_type, **cfg_dict)
        with no_init_weights():  # buffers (rotary inv_freq, causal masks) built for real; weights come from source
            model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch_dtype(src.spec.params_dtype),
                                                     **reference_attention(cfg_dict))
        for unit in src.units():
            state.update(src.read_hf(unit))
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and src.spec.tie_embeddings)]
    # transformers builds no multi-token prediction layer (HF's `model.layers.{num_layers + K}`): none is loaded
    mtp = tuple(f"model.layers.{src.spec.num_layers + k}." for k in range(src.spec.mtp_num_layers or 0))
    unexpected = [k for k in unexpected if not k.startswith(mtp)] if mtp else unexpected
    if missing or unexpected:
        raise MConvertError(f"{path}: tensors do not match the transformers class (missing {missing[:3]}, "
                            f"unexpected {unexpected[:3]})")
    model.tie_weights()
    return model.eval().to(device)


def _first_line(e: BaseException) -> str:
    s = str(e).strip().splitlines()
    return (s[0] if s else type(e).__name__)[:300]
