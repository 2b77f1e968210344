"""mconvert: move Megatron-LM checkpoints between training and serving layouts, and prove the result."""

from mconvert.errors import MConvertError
from mconvert.spec import PRESETS, ModelSpec, preset

__all__ = ["MConvertError", "ModelSpec", "PRESETS", "preset"]
__version__ = "0.1.0"
