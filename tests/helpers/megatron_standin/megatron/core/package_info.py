"""The version the script checks to pick `megatron.training.tokenizer` (>= 0.6.0)."""

__version__ = "0.16.1"
