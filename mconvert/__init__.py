"""mconvert: move Megatron-LM checkpoints between training and serving layouts, and prove the result."""

from typing import Any

from mconvert.errors import MConvertError
from mconvert.spec import ModelSpec

__all__ = ["MConvertError", "ModelSpec", "PRESETS", "preset"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """`PRESETS` and `preset` come from the family registry, loaded on first use (it imports torch)."""
    if name in ("PRESETS", "preset"):
        from mconvert.mappings import families  # the registry imports torch: `import mconvert` stays light

        return getattr(families, name)
    raise AttributeError(name)
