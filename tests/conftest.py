"""Fixtures shared by every test folder. The truth helpers they build on live in tests/helpers/ (on pytest's
`pythonpath`): transformers' logits and randomized models in hf_ref.py, megatron-core's in mcore_ref.py,
checkpoint trees' hashes in safety_common.py."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="session")
def trained_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """`trained_checkpoint(preset=..., tp=..., pp=..., steps=..., **TrainConfig fields)` -> a checkpoint the
    built-in trainer wrote on the CPU, trained once per session for each distinct configuration; the losses of
    its run are `trained_checkpoint.losses[ckpt]`. Callers read it and never write into it (a resume or a
    damaged copy goes to a directory of their own)."""
    from mconvert.trainer.train import TrainConfig, train

    done: dict[str, Path] = {}
    losses: dict[Path, list[float]] = {}

    def make(**cfg: Any) -> Path:
        cfg.setdefault("quiet", True)
        cfg.setdefault("device", "cpu")
        key = repr(sorted(cfg.items()))
        if key not in done:
            ckpt = tmp_path_factory.mktemp(f"trained-{cfg['preset']}") / "ckpt"
            losses[ckpt] = train(TrainConfig(save=str(ckpt), **cfg)).get("losses", [])
            done[key] = ckpt
        return done[key]

    make.losses = losses  # type: ignore[attr-defined]
    return make


@pytest.fixture(scope="session")
def llama_cpp() -> None:
    """The llama.cpp venv (`make gguf-env`), built when absent (a source build: ~10+ min on a loaded 2-core
    machine); its python is what the GGUF runner starts."""
    from mconvert.validators.gguf_runner import ENV_SCRIPT

    r = subprocess.run(["bash", str(ENV_SCRIPT)], capture_output=True, text=True, timeout=3600)
    assert r.returncode == 0, f"make gguf-env failed: {r.stderr[-2000:]}"
    os.environ.setdefault("MCONVERT_GGUF_PYTHON", r.stdout.strip().splitlines()[-1])
