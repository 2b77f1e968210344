"""The wildcard name tables: plugin templates use `*` for the layer index (and a second `*` for a routed expert's
index); this module compiles them once.

No plugin ever writes a regex. `Registry.match(name)` returns the template's value and the layer index (the
(layer, expert) pair for a template with two wildcards).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Generic, TypeVar

V = TypeVar("V")


def compile_template(template: str) -> re.Pattern[str]:
    """`decoder.layers.*.mlp.linear_fc1.weight` -> `^decoder\\.layers\\.(\\d+)\\.mlp\\.linear_fc1\\.weight$`."""
    return re.compile("^" + r"(\d+)".join(re.escape(p) for p in template.split("*")) + "$")


Index = int | tuple[int, ...] | None


def fill(template: str, layer: Index) -> str:
    """Put a layer index (or the (layer, expert) pair) into a template's wildcards, in order (templates without
    `*` pass through)."""
    if layer is None:
        return template
    idx = layer if isinstance(layer, tuple) else (layer,) * template.count("*")
    parts = template.split("*")
    if len(idx) != len(parts) - 1:
        raise ValueError(f"template {template!r} has {len(parts) - 1} wildcards, given {len(idx)} indices")
    return parts[0] + "".join(str(i) + rest for i, rest in zip(idx, parts[1:]))


def layer_of(index: Index) -> int | None:
    """The layer index of a match (the first wildcard)."""
    return index[0] if isinstance(index, tuple) else index


class Registry(Generic[V]):
    """Templates -> values; exact names are looked up by dict, wildcard ones by their compiled pattern."""

    def __init__(self, table: dict[str, V]) -> None:
        self.table = dict(table)
        self._exact = {k: v for k, v in table.items() if "*" not in k}
        self._wild = [(compile_template(k), k, v) for k, v in table.items() if "*" in k]

    def match(self, name: str) -> tuple[str, V, Index] | None:
        """(template, value, layer index — or (layer, expert) for two wildcards — or None) for `name`, or None
        when no template matches."""
        if name in self._exact:
            return name, self._exact[name], None
        for pat, tpl, val in self._wild:
            m = pat.match(name)
            if m:
                groups = tuple(int(g) for g in m.groups())
                return tpl, val, groups[0] if len(groups) == 1 else groups
        return None

    def __iter__(self) -> Iterator[str]:
        return iter(self.table)

    def items(self) -> Iterator[tuple[str, V]]:
        return iter(self.table.items())
