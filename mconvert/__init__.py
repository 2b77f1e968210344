"""mconvert: move Megatron-LM checkpoints between training and serving layouts, and prove the result."""

import os as _os
from typing import Any

# Tensors of 2 MB and more on transparent huge pages: a conversion allocates and frees buffers of the size of
# a layer's shards, and with 4 KiB pages every fresh buffer costs one page fault per 4 KiB (on a VM also a
# host-side fault). Measured on the 1B bench model (issue 7): minor faults 1.12 M -> 0.14 M, system CPU -1 s.
# torch reads this once, at its first allocation, so it is set before torch is imported; a user's setting wins.
_os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

from mconvert.errors import MConvertError  # noqa: E402
from mconvert.spec import ModelSpec  # noqa: E402

__all__ = ["MConvertError", "ModelSpec", "PRESETS", "preset"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """`PRESETS` and `preset` come from the family registry, loaded on first use (it imports torch)."""
    if name in ("PRESETS", "preset"):
        from mconvert.mappings import families  # the registry imports torch: `import mconvert` stays light

        return getattr(families, name)
    raise AttributeError(name)
