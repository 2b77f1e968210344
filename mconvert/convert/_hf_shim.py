"""TEMPORARY stand-in for `mconvert.convert.sources.open_source` on HF dirs (deleted once sources.py lands).

Reads config.json + *.safetensors and yields one unit's tensors under HF names (GPT-2 and LLaMA-style).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from mconvert.convert.base import Unit, units_of
from mconvert.errors import MConvertError
from mconvert.spec import ModelSpec


class HFDirShim:
    """Minimal Source over an HF directory (HF names only)."""

    format = "hf"

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        cfg = self.path / "config.json"
        if not cfg.is_file():
            raise MConvertError(f"{self.path}: no config.json; not an HF model directory")
        self.config = json.loads(cfg.read_text())
        self.spec = ModelSpec.from_hf_config(self.config, source=str(cfg))
        self.tokenizer_dir = self.path if (self.path / "tokenizer_config.json").exists() else None
        self._where: dict[str, Path] = {}
        for f in sorted(self.path.glob("*.safetensors")):
            with safe_open(f, "pt") as h:
                for k in h.keys():
                    self._where[k] = f

    def units(self) -> list[Unit]:
        return units_of(self.spec)

    def _get(self, name: str) -> torch.Tensor:
        with safe_open(self._where[name], "pt") as h:
            return h.get_tensor(name)

    def read_hf(self, unit: Unit) -> dict[str, torch.Tensor]:
        gpt = self.spec.family == "gpt2"
        if unit == "embedding":
            pref = ("transformer.wte.", "transformer.wpe.") if gpt else ("model.embed_tokens.",)
        elif unit == "final":
            pref = ("transformer.ln_f.", "lm_head.") if gpt else ("model.norm.", "lm_head.")
        else:
            pref = (f"transformer.h.{unit}.",) if gpt else (f"model.layers.{unit}.",)
        out = {}
        for k in self._where:
            if k.startswith(pref) and not k.endswith((".attn.bias", ".attn.masked_bias")):
                out[k] = self._get(k)
        if unit == "final" and "lm_head.weight" not in out and not self.spec.tie_embeddings:
            raise MConvertError(f"{self.path}: untied model without lm_head.weight")
        return out

    def read_mcore(self, unit: Unit) -> dict[str, torch.Tensor]:
        raise NotImplementedError("shim: read_mcore")
