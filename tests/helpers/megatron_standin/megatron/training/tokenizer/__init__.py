"""Stand-in `megatron.training.tokenizer` (see `megatron/__init__.py`)."""
