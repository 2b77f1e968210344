"""Stand-in `megatron.training` (see `megatron/__init__.py`)."""
