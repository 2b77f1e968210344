"""Per-rank entry point for torchrun (several nodes): `python -m mconvert.trainer.main --tp 2 --pp 2 ...`.

    torchrun --nnodes 2 --nproc-per-node 4 --node-rank 0 --master-addr HOST --master-port 29500 \\
        -m mconvert.trainer.main --preset tiny-llama --tp 2 --pp 2 --dp 2 --steps 50 --save /shared/ckpt

The flags are TrainConfig's fields (`--micro-batch-size`, `--seq-length`, ...), the same as `mconvert train`.
Every rank builds the (deterministic) tokenizer itself; global rank 0 saves it into --save. The save
directory must be shared by all nodes (each DP-rank-0 process writes its own mp_rank file).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import typing

from rich.console import Console

from mconvert.errors import MConvertError
from mconvert.trainer.comm import render_report
from mconvert.trainer.procs import set_parent_death_signal
from mconvert.trainer.train import TrainConfig, build_spec, prepare_save_dir, prepare_tokens, train_worker


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m mconvert.trainer.main", description=__doc__.splitlines()[0])
    hints = typing.get_type_hints(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        if f.name == "extra":
            continue
        flag = "--" + f.name.replace("_", "-")
        hint = hints[f.name]
        if hint is bool:
            ap.add_argument(flag, action="store_true", default=f.default)
            continue
        base = next((t for t in typing.get_args(hint) if t is not type(None)), hint)
        ap.add_argument(flag, type=base, default=f.default)
    return ap


def parse(argv: list[str] | None = None) -> TrainConfig:
    ns = _parser().parse_args(argv)
    return TrainConfig(**vars(ns))


def main(argv: list[str] | None = None) -> None:
    """One rank: rank 0 prepares the save dir and tokenizer files, everyone trains."""
    cfg = parse(argv)
    set_parent_death_signal()  # a rank never outlives the torchrun agent that started it
    try:
        cfg.validate()
        rank = int(os.environ.get("RANK", "0"))
        tokens, vocab = prepare_tokens(None, write=False)
        cfg.check_corpus(tokens)
        spec = build_spec(cfg, vocab)
        if rank == 0:
            prepare_save_dir(cfg)
            if cfg.save:
                prepare_tokens(cfg.save, write=True)
        result = train_worker(cfg, spec, tokens)
    except MConvertError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(1)
    if result.get("comm"):
        Console().print(render_report(result["comm"]))


if __name__ == "__main__":
    main()
