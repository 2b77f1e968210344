"""What the engines do with an export's untrusted text, run inside a bounded child (`io.bounded`):
transformers renders the chat template. Each function takes and returns JSON values; each part announces
itself (`bounded.part`) so that a part running past a bound is named.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from mconvert.io.bounded import part, run_bounded
from mconvert.convert.hf.tokenizer import CHAT_TEMPLATE_DIR, has_chat_template, load_tokenizer
from mconvert.errors import MConvertError, escape_controls

# A chat template renders a conversation in milliseconds; one given seconds of CPU loops or grows without end.
RENDER_CPU_SECONDS = 5


def template_file(d: Path) -> Path:
    """The file the chat template of tokenizer dir `d` comes from, as transformers looks for it."""
    for name in ("chat_template.jinja", "chat_template.json"):
        if os.path.lexists(d / name):
            return d / name
    return d / "tokenizer_config.json"


def render_chat(tok_dir: str, messages: list[dict[str, str]]) -> list[list[int]]:
    """In the child: transformers' prompt ids of `messages` through every chat template of `tok_dir` (the
    default one first, then the named ones in name order)."""
    d = Path(tok_dir)
    part("loading the tokenizer")
    tok = load_tokenizer(d)
    templates = tok.chat_template if isinstance(tok.chat_template, dict) else {"default": tok.chat_template}
    out = []
    for name in sorted(templates, key=lambda n: (n != "default", n)):
        where = template_file(d) if name == "default" else d / CHAT_TEMPLATE_DIR / f"{name}.jinja"
        part("rendering the chat template" + (f" {name!r}" if name != "default" else ""), RENDER_CPU_SECONDS)
        try:
            ids = tok.apply_chat_template(messages, chat_template=templates[name], add_generation_prompt=True,
                                          tokenize=True)
        except Exception as e:  # noqa: BLE001 - jinja's TemplateError, a sandbox refusal, a type error in it
            text = escape_controls(str(e).split("\n", 1)[0])[:160]
            raise MConvertError(f"{where}: the chat template does not render ({type(e).__name__}: {text}); fix "
                                "the template or remove it") from None
        out.append(list(ids["input_ids"] if isinstance(ids, dict) else ids))
    return out


def chat_ids(d: Path, messages: list[dict[str, str]]) -> list[list[int]]:
    """transformers' prompt ids of `messages` through each chat template of `d` ([] without one), rendered in a
    bounded child: a template that loops or allocates without end is one line naming its file."""
    if not has_chat_template(d):
        return []
    return run_bounded("mconvert.validators.engine_probe:render_chat", {"tok_dir": str(d), "messages": messages},
                       f"{template_file(d)}", "fix the chat template or remove it")


def build_config(config: dict[str, Any]) -> dict[str, Any]:
    """In the child: config.json instantiated as transformers does (`AutoConfig.for_model`) and its model class
    built on the meta device; {"model": class name, "tie": tie_word_embeddings, "shapes": {name: shape}}, or
    {"error": why} when transformers refuses it."""
    # heavy optional import: transformers loads only in the child
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    import torch

    hf_logging.set_verbosity_error()
    c = dict(config)
    mt = c.pop("model_type", None)
    from mconvert.validators.formats import stand_in_model_type

    mt = stand_in_model_type(mt) if isinstance(mt, str) else mt
    for k in ("architectures", "transformers_version", "_name_or_path"):
        c.pop(k, None)
    part("instantiating config.json as transformers does")
    try:
        conf = AutoConfig.for_model(mt, **c)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(conf)
    except Exception as e:  # noqa: BLE001 - transformers rejects the config itself, with any type
        return {"error": escape_controls(str(e).split("\n", 1)[0])[:200]}
    return {"model": type(model).__name__, "tie": bool(getattr(conf, "tie_word_embeddings", False)),
            "shapes": {k: list(v.shape) for k, v in model.state_dict().items()}}


def check_generation_config(generation: dict[str, Any]) -> str | None:
    """In the child: why transformers' `GenerationConfig` refuses generation_config.json (its `validate`, run by
    its constructor: errors only, never its warnings), or None."""
    # heavy optional import: transformers loads only in the child
    from transformers import GenerationConfig
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    part("validating generation_config.json as transformers does")
    try:
        GenerationConfig.from_dict(dict(generation))
    except Exception as e:  # noqa: BLE001 - ValueError mostly; a wrong type raises TypeError
        return escape_controls(str(e).split("\n", 1)[0])[:200]
    return None


def probe(config: dict[str, Any], generation: dict[str, Any] | None) -> dict[str, Any]:
    """In the child: `build_config` and `check_generation_config` in one process (one import of transformers)."""
    return {"config": build_config(config),
            "generation": None if generation is None else check_generation_config(generation)}


def probe_export(config: dict[str, Any], generation: dict[str, Any] | None, where: Path) -> dict[str, Any]:
    """`probe` in a bounded child: a config that asks transformers for more modules or memory than a model
    has is one line naming config.json, never a hang or a MemoryError of mconvert's own process."""
    return run_bounded("mconvert.validators.engine_probe:probe", {"config": config, "generation": generation},
                       f"{where / 'config.json'}", "check its sizes (layers, experts, hidden) against the weights")
