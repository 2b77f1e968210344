"""Runs Megatron-Bridge itself (in its own venv: mconvert/validators/bridge_env.sh) for tests/test_bridge.py.

    python bridge_helper.py import HF_DIR CKPT        Megatron-Bridge's HF -> Megatron import (AutoBridge), saved
                                                      as it saves every checkpoint (save_megatron_model)
    python bridge_helper.py export HF_DIR CKPT OUT    Megatron-Bridge's own loader and HF export (export_ckpt) of CKPT
    python bridge_helper.py dump CONFIG_JSON OUT      the run_config.yaml Megatron-Bridge writes for the model of an
                                                      HF config.json (its provider from AutoBridge, no weights)

Megatron-Bridge targets GPUs with Transformer Engine; on this CPU-only venv it needs these stand-ins, each for a
name its checkpoint and conversion paths touch but whose work does not happen on CPU:
- `typing.override`: megatron-core 0.19 imports it (Python 3.12); the 3.11 venv takes typing_extensions'.
- `transformer_engine`: two Megatron-Bridge modules import it unconditionally (its LoRA layers and the full-TE
  layer spec) though neither is used here. A stub is served to those two importers only, so megatron-core still
  finds Transformer Engine absent and builds its torch layers.
- `torch.cuda.current_device`, `get_rng_state`, `set_rng_state`, `synchronize`: called by megatron-core's model
  set-up and checkpoint save; on CPU there is no device, RNG or stream to address (the CPU generator stands in).
- the layer spec: Megatron-Bridge's default (and what mconvert's run_config.yaml names) is the Transformer Engine
  spec; here it is megatron-core's local spec, which saves and loads the same torch_dist keys (its
  `sharded_state_dict_keys_map` maps the norms to the TE names). A bridge that names megatron-core's block spec
  (DeepSeek, Kimi, GLM: `get_gpt_decoder_block_spec`) keeps it, with `use_transformer_engine=False`.
- multi-latent attention: megatron-core 0.19's MLA hands its core attention `k_channels` / `v_channels`, which only
  TE's attention takes; the local DotProductAttention takes them here (v_channels sizes its output), as the model
  is only built and saved, never run.
- MTP layers: GPTModelProvider asks megatron-core for their Transformer Engine spec whatever the layer spec; the
  local one stands in, as for the decoder layers, and for megatron-core's block spec a run_config.yaml names with
  `use_transformer_engine: true` (as Megatron-Bridge writes it on a machine with TE).
- GLM-4.5's bridge maps its routed experts only in the grouped-GEMM spelling (TE); without TE the experts are
  megatron-core's SequentialMLP, mapped here from the same HF tensors as Megatron-Bridge's DeepSeek and Qwen3-MoE
  bridges map theirs (`local_experts.*`).
- the fusions the providers turn on (rope, persistent layer norm, MoE permutation and router, grouped GEMM, the
  shared-expert overlap) are TE kernels or need the all-to-all dispatcher: turned off for the import, and MoE
  tokens go through the allgather dispatcher.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import sys
import types
import typing

import typing_extensions

typing.override = typing_extensions.override  # type: ignore[attr-defined]

_TE_IMPORTERS = ("megatron.bridge.peft.lora_layers", "megatron.bridge.models.gpt_full_te_layer_autocast_spec")


class _Absent:
    def __init__(self, *a: object, **k: object) -> None:
        raise RuntimeError("Transformer Engine is stubbed in the Megatron-Bridge test venv")


class _StubModule(types.ModuleType):
    def __getattr__(self, attr: str) -> object:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Absent if attr[:1].isupper() else _StubModule(f"{self.__name__}.{attr}")


class _TEFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves `transformer_engine` (a stub) only to the modules in _TE_IMPORTERS."""

    def find_spec(self, name, path=None, target=None):  # noqa: ANN001
        if name.split(".")[0] != "transformer_engine":
            return None
        frame = sys._getframe(1)
        while frame is not None:
            if frame.f_globals.get("__name__") in _TE_IMPORTERS:
                return importlib.util.spec_from_loader(name, self, is_package=True)
            frame = frame.f_back
        return None

    def create_module(self, spec):  # noqa: ANN001
        return _StubModule(spec.name)

    def exec_module(self, module) -> None:  # noqa: ANN001
        module.__path__ = []


def _cpu() -> None:
    sys.meta_path.insert(0, _TEFinder())
    import torch

    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    torch.cuda.set_rng_state = lambda *a, **k: None
    torch.cuda.synchronize = lambda *a, **k: None
    from megatron.bridge.models import gpt_provider

    gpt_provider.default_layer_spec = gpt_provider.local_layer_spec  # looked up by name when a config loads
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    init = DotProductAttention.__init__

    def mla_init(self, *a, k_channels=None, v_channels=None, **k):  # noqa: ANN001, ANN002, ANN003
        init(self, *a, **k)
        if v_channels is not None:
            self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition

    DotProductAttention.__init__ = mla_init
    from megatron.core.models.gpt import gpt_layer_specs

    mtp = gpt_layer_specs.get_gpt_mtp_block_spec  # GPTModelProvider asks for the TE spec of MTP layers

    def local_mtp(config, spec, use_transformer_engine, **k):  # noqa: ANN001, ANN003, ANN202
        return mtp(config, spec, False, **k)

    gpt_layer_specs.get_gpt_mtp_block_spec = local_mtp
    block = gpt_layer_specs.get_gpt_decoder_block_spec  # a run_config.yaml's partial names it with TE

    def local_block(config, use_transformer_engine, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
        return block(config, False, *a, **k)

    gpt_layer_specs.get_gpt_decoder_block_spec = local_block
    for name in [n for n in sys.modules if n.split(".")[0] == "transformer_engine"]:
        del sys.modules[name]


def _sequential_glm_experts() -> None:
    from megatron.bridge.models.conversion.mapping_registry import MegatronMappingRegistry
    from megatron.bridge.models.conversion.param_mapping import AutoMapping, GatedMLPMapping
    from megatron.bridge.models.glm.glm45_bridge import GLM45Bridge

    grouped = GLM45Bridge.mapping_registry

    def registry(self):  # noqa: ANN001, ANN202
        if self._uses_fused_experts():
            return grouped(self)
        x, hx = "decoder.layers.*.mlp.experts.local_experts.*.", "model.layers.*.mlp.experts.*."
        return MegatronMappingRegistry(
            *grouped(self).mappings,
            GatedMLPMapping(megatron_param=x + "linear_fc1.weight", gate=hx + "gate_proj.weight",
                            up=hx + "up_proj.weight"),
            AutoMapping(megatron_param=x + "linear_fc2.weight", hf_param=hx + "down_proj.weight"))

    GLM45Bridge.mapping_registry = registry


def _cpu_kernels(provider) -> None:  # noqa: ANN001
    provider.apply_rope_fusion = False
    provider.persist_layer_norm = False
    provider.gradient_accumulation_fusion = False
    provider.moe_permute_fusion = False  # TE kernels, as above; the MoE dispatcher is the allgather one on CPU
    provider.moe_router_fusion = False
    provider.moe_grouped_gemm = False
    provider.moe_token_dispatcher_type = "allgather"
    provider.moe_shared_expert_overlap = False


def import_hf(hf_dir: str, ckpt: str) -> None:
    from megatron.bridge import AutoBridge
    from megatron.bridge.models.gpt_provider import local_layer_spec
    from megatron.bridge.training.model_load_save import temporary_distributed_context

    bridge = AutoBridge.from_hf_pretrained(hf_dir)
    provider = bridge.to_megatron_provider(load_weights=True)
    spec = provider.transformer_layer_spec
    if isinstance(spec, functools.partial) and "use_transformer_engine" in spec.keywords:
        provider.transformer_layer_spec = functools.partial(spec.func, *spec.args,
                                                            **{**spec.keywords, "use_transformer_engine": False})
    else:
        provider.transformer_layer_spec = local_layer_spec
    _cpu_kernels(provider)
    provider.finalize()
    with temporary_distributed_context(backend="gloo"):
        model = provider.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True)
        bridge.save_megatron_model(model, ckpt, hf_tokenizer_path=hf_dir)


def export_hf(hf_dir: str, ckpt: str, out: str) -> None:
    from megatron.bridge import AutoBridge

    AutoBridge.from_hf_pretrained(hf_dir).export_ckpt(ckpt, out, show_progress=False)


def dump_run_config(config_json: str, out: str) -> None:
    import json

    from megatron.bridge import AutoBridge
    from megatron.bridge.training.config import CheckpointConfig, ConfigContainer, LoggerConfig
    from megatron.core.optimizer import OptimizerConfig
    from transformers import AutoConfig

    cfg = json.loads(open(config_json).read())
    cfg.pop("auto_map", None)  # the published remote code is not run: transformers' own class reads the config
    hf_config = AutoConfig.for_model(**cfg)
    provider = AutoBridge.from_hf_config(hf_config).to_megatron_provider(load_weights=False)
    _cpu_kernels(provider)  # finalize() refuses TE kernels where TE is absent; the layer spec is kept as named
    provider.finalize()
    # the container save_megatron_model (training/model_load_save.py) writes
    ConfigContainer(model=provider, train=None, optimizer=OptimizerConfig(use_distributed_optimizer=False), ddp=None,
                    scheduler=None, dataset=None, logger=LoggerConfig(), tokenizer=None,
                    checkpoint=CheckpointConfig(async_save=False, save="ckpt", save_optim=False, save_rng=False,
                                                ckpt_format="torch_dist"), dist=None).to_yaml(out)


if __name__ == "__main__":  # megatron-core's checkpoint writer spawns processes that re-import this file
    _cpu()
    _sequential_glm_experts()
    verb, *argv = sys.argv[1:]
    {"import": import_hf, "export": export_hf, "dump": dump_run_config}[verb](*argv)
