"""`open_source(path)`: detect the checkpoint format and return a Source (see `base.py`).

Megatron torch (`latest_checkpointed_iteration.txt`, `iter_*` / `release`, `mp_rank_*`), Megatron torch_dist
(`common.pt` / `metadata.json` / `.metadata` in the iteration dir) and HuggingFace dirs (`config.json` +
safetensors or pytorch_model*.bin).
"""

from __future__ import annotations

from pathlib import Path

from mconvert.io.atomic import verify_input
from mconvert.convert.base import SourceBase
from mconvert.convert import detect


def detect_format(path: str | Path, iteration: int | str | None = None) -> str:
    """'hf', 'megatron' or 'megatron-torch_dist' (`convert.detect`; one-line error when it is none of them)."""
    return detect.detect_format(path, iteration, detect.CHECKPOINTS)


def open_source(path: str | Path, iteration: int | str | None = None, tokenizer: str | Path | None = None,
                verify: bool = True, arrays: bool = False) -> SourceBase:
    """Open any supported checkpoint as a Source: units of full tensors, read one unit at a time. Each reader
    module loads only when its format is opened (torch with the torch readers).

    `verify`: an input mconvert wrote is first checked against its manifest (the digest of every file).
    `arrays`: for a writer that takes numpy arrays (GGUF), an HF directory of safetensors is read as arrays
    (`hf.arrays.HFArrays`), without torch."""
    if verify:  # before anything is read, the tracker file included
        verify_input(path)
    fmt = detect_format(path, iteration)
    if fmt == "hf":
        from mconvert.convert.hf.arrays import HFArrays, readable

        if arrays and readable(Path(path)):
            return HFArrays(Path(path), tokenizer=tokenizer)
        from mconvert.convert.hf.source import HFSource

        return HFSource(Path(path), tokenizer=tokenizer)
    if fmt == "megatron-torch_dist":
        # torch.distributed.checkpoint is a heavy import: paid only by a torch_dist source, not at every start-up
        from mconvert.convert.megatron.torch_dist import TorchDistSource

        return TorchDistSource(Path(path), iteration=iteration, tokenizer=tokenizer, verify=verify)
    from mconvert.convert.megatron.source import MegatronSource

    return MegatronSource(Path(path), iteration=iteration, tokenizer=tokenizer)
