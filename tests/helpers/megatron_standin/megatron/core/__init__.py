"""Stand-in `megatron.core`: only `package_info` (see `megatron/__init__.py`)."""
