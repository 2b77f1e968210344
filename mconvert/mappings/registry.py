"""Wildcard registry: plugin templates use `*` for the layer index; this module compiles them once.

No plugin ever writes a regex. `Registry.match(name)` returns the template's value and the layer index.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Generic, TypeVar

V = TypeVar("V")


def compile_template(template: str) -> re.Pattern[str]:
    """`decoder.layers.*.mlp.linear_fc1.weight` -> `^decoder\\.layers\\.(\\d+)\\.mlp\\.linear_fc1\\.weight$`."""
    return re.compile("^" + r"(\d+)".join(re.escape(p) for p in template.split("*")) + "$")


def fill(template: str, layer: int | None) -> str:
    """Put a layer index into a template (templates without `*` pass through)."""
    return template if layer is None else template.replace("*", str(layer))


class Registry(Generic[V]):
    """Templates -> values; exact names are looked up by dict, wildcard ones by their compiled pattern."""

    def __init__(self, table: dict[str, V]) -> None:
        self.table = dict(table)
        self._exact = {k: v for k, v in table.items() if "*" not in k}
        self._wild = [(compile_template(k), k, v) for k, v in table.items() if "*" in k]

    def match(self, name: str) -> tuple[str, V, int | None] | None:
        """(template, value, layer index or None) for `name`, or None when no template matches."""
        if name in self._exact:
            return name, self._exact[name], None
        for pat, tpl, val in self._wild:
            m = pat.match(name)
            if m:
                return tpl, val, int(m.group(1))
        return None

    def __iter__(self) -> Iterator[str]:
        return iter(self.table)

    def items(self) -> Iterator[tuple[str, V]]:
        return iter(self.table.items())
