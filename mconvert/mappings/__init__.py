"""Layout transforms (pure shard math), the family registry and one module per model family."""

from __future__ import annotations

from typing import Any

__all__ = ["from_hf", "hf_names", "hf_unit", "plugin_for", "to_hf"]


def __getattr__(name: str) -> Any:
    """The adapter functions load with `plugin` (and torch) on first use: `plan` reads the family tables and
    shapes only, without torch."""
    if name in __all__:
        from mconvert.mappings import plugin

        return getattr(plugin, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
