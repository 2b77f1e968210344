"""`_vocab_size_with_padding` with Megatron-LM's semantics, written from its documented behaviour."""

from __future__ import annotations

import math
from typing import Any


def _vocab_size_with_padding(orig_vocab_size: int, args: Any, logging_enabled: bool = True) -> int:
    """Round the vocab up to a multiple of make_vocab_size_divisible_by * tensor_model_parallel_size."""
    multiple = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size
    after = int(math.ceil(orig_vocab_size / multiple) * multiple)
    if logging_enabled and getattr(args, "rank", 0) == 0:
        print(f" > padded vocab (size: {orig_vocab_size}) with {after - orig_vocab_size} dummy tokens "
              f"(new size: {after})", flush=True)
    return after
