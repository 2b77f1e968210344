"""Layout transforms (pure shard math), the family registry and one module per model family."""

from mconvert.mappings.plugin import from_hf, hf_names, hf_unit, plugin_for, to_hf

__all__ = ["from_hf", "hf_names", "hf_unit", "plugin_for", "to_hf"]
